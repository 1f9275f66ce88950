"""Building what the engine loop runs: a model name in, its parts out.

    build(model, ...)   resolve the name (hub), open the checkpoint, load the tokenizer,
                        pick the weight scheme (models/quantize.py), then either
      one process:      Transformer + KVCache + ModelRunner, here;
      several ranks:    the registered parallel builder (tokenmill/distributed/build.py),
                        which starts the other ranks and returns our part of the model,
                        a pool of our heads (or layers) and a runner that drives them.
    -> EngineParts      what LLMEngine (engine/llm_engine.py) holds; the loop never
                        builds anything itself.

Why a registration: the parallel runtime sits in a layer above the engine (it subclasses
the engine's ModelRunner), so the engine may not import it, lazily or not (import-linter's
layers contract in pyproject.toml). tokenmill/distributed/build.py registers its builder
with `register_parallel` when it is imported; tokenmill.LLM imports it, so a parallel run
through the offline API, the CLI or the server needs nothing more, and a caller of
LLMEngine with tensor_parallel_size > 1 imports tokenmill.distributed.build first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.checks import ParamError
from tokenmill.config import ModelConfig
from tokenmill.dtypes import DTYPES, Q8_0
from tokenmill.engine.kv_cache import KVCache
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.hub import resolve_model
from tokenmill.layers.quant_linear import QuantLinear
from tokenmill.loader import Checkpoint, LoadError, open_checkpoint
from tokenmill.models.quantize import pick_scheme
from tokenmill.models.transformer import Transformer
from tokenmill.tokenizer import Tokenizer


def model_eos_ids(tokenizer: Tokenizer, config) -> list[int]:
    """The tokens that end a sequence: the tokenizer's and the config's, together."""
    return sorted(set(tokenizer.eos_token_ids) | set(config.eos_token_ids))


def load_tokenizer(path: Path) -> Tokenizer:
    """The model's tokenizer; LoadError (one line) for a vocabulary that cannot be built."""
    try:
        return Tokenizer.from_pretrained(path) if path.is_dir() else Tokenizer.from_gguf(path)
    except LoadError:
        raise
    except Exception as e:  # the vocabulary checks' ValueError, or the tokenizers library's
        message = str(e).removeprefix(f"{path}: ").splitlines()[0] if str(e) else ""
        raise LoadError(path, f"tokenizer: {message or type(e).__name__}") from None


@dataclass
class ParallelRequest:
    """What a parallel builder gets: the opened checkpoint and the engine's settings."""

    ckpt: Checkpoint
    path: Path
    device: torch.device
    dtype: torch.dtype
    quantization: str | None  # models/quantize.py's scheme, None: torch Linears
    tensor_parallel_size: int
    pipeline_parallel_size: int
    block_size: int
    kv_cache_memory: int | str | None
    threads: int | None
    progress: Callable[[int, int], None] | None


@dataclass
class ModelParts:
    """The model side of a run: what a builder returns for this process (rank 0)."""

    model: Transformer  # this process's part of it
    cache: KVCache  # the pool of this process's heads or layers
    runner: ModelRunner  # one forward pass per step (sends each step to the other ranks)
    parallel: Any = None  # the distributed Runtime (stop(), world, workers), None: one process
    parallel_plan: list[str] | None = None  # one line per rank: what it holds


@dataclass
class EngineParts:
    """Everything LLMEngine runs: what it was built from, and the model side."""

    path: Path  # the resolved checkpoint (a folder or a GGUF file)
    device: torch.device
    dtype: torch.dtype  # of the activations (and of torch Linears' weights)
    config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: list[int]  # model_eos_ids
    quantization: str | None  # models/quantize.py's scheme, None: torch Linears
    model: ModelParts


ParallelBuilder = Callable[[ParallelRequest], ModelParts]
_parallel_builder: ParallelBuilder | None = None


def register_parallel(builder: ParallelBuilder) -> None:
    """Set the builder of runs over several processes (tokenmill/distributed/build.py)."""
    global _parallel_builder
    _parallel_builder = builder


KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", Q8_0)


def kv_cache_torch_dtype(name: str, dtype: torch.dtype) -> torch.dtype | str:
    """The KV cache's torch dtype for kv_cache_dtype `name` ("auto": the activations'), or
    Q8_0 for the 8-bit blocks (KVCache stores those as bytes)."""
    if name not in KV_CACHE_DTYPES:
        raise ParamError.named(
            "kv_cache_dtype", f" must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}"
        )
    if name == Q8_0:
        return Q8_0
    return dtype if name == "auto" else DTYPES[name]


ACTIVATION_BITS = (8, 16)


def check_activation_bits(bits: int) -> None:
    if bits not in ACTIVATION_BITS:
        raise ParamError.named("activation_bits", f" must be 8 or 16, got {bits!r}")


def set_activation_bits(net: torch.nn.Module, bits: int) -> None:
    """What the packed layers quantize activations to, per 32-block, before the integer
    dot: 16 bits (near float32: greedy tokens match the float model's) or 8 (llama.cpp's
    q8 scheme: about half the integer work on VNNI and AVX2 CPUs, greedy tokens like llama.cpp's on the
    same file). Every layer alike: the fused decode stack takes one precision."""
    check_activation_bits(bits)
    packed = [m for m in net.modules() if isinstance(m, QuantLinear)]
    if bits != 16 and not packed:
        raise ParamError.named(
            "activation_bits",
            " 8 applies to weights packed for the CPU kernels (a GGUF file, or quantization "
            "q8 / q4); this model's weights are floats, which multiply float32 activations",
        )
    for module in net.modules():
        if hasattr(module, "act_bits"):
            module.act_bits = bits


def build(
    model: str | Path | None,
    *,
    dtype: str | torch.dtype,
    device: str,
    kv_cache_memory: int | str | None,
    block_size: int,
    kv_cache_dtype: str = "auto",
    threads: int | None,
    quantization: str,
    progress: Callable[[int, int], None] | None,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    activation_bits: int = 16,
) -> EngineParts:
    """LLMEngine's parts for its constructor's arguments (documented there)."""
    check_activation_bits(activation_bits)  # before loading
    if device == "cpu":
        torch.set_num_threads(threads or os.cpu_count() or 1)
    torch_device = torch.device(device)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
    path = resolve_model(model)
    ckpt = open_checkpoint(path)
    config = ckpt.config
    tokenizer = load_tokenizer(path)
    scheme = pick_scheme(quantization, ckpt.format, dtype, torch_device)
    if tensor_parallel_size * pipeline_parallel_size > 1:
        if kv_dtype != dtype:
            raise ParamError.named(
                "kv_cache_dtype", " other than the activations' is not supported in parallel runs"
            )
        if activation_bits != 16:
            raise ParamError.named("activation_bits", " 8 is not supported in parallel runs")
        if _parallel_builder is None:
            raise RuntimeError(
                "tensor_parallel_size/pipeline_parallel_size need the parallel runtime: "
                "import tokenmill.distributed.build first (tokenmill.LLM does)"
            )
        request = ParallelRequest(
            ckpt, path, torch_device, dtype, scheme, tensor_parallel_size,
            pipeline_parallel_size, block_size, kv_cache_memory, threads, progress,
        )  # fmt: skip
        parts = _parallel_builder(request)
    else:
        net = Transformer(config)
        net.load_weights(ckpt, dtype, progress, scheme)
        set_activation_bits(net, activation_bits)
        net.to(torch_device).eval()
        cache = KVCache(config, block_size, kv_dtype, torch_device, kv_cache_memory)
        parts = ModelParts(net, cache, ModelRunner(net, cache, torch_device))
    return EngineParts(
        path, torch_device, dtype, config, tokenizer, model_eos_ids(tokenizer, config), scheme,
        parts,
    )  # fmt: skip
