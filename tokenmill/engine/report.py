"""What an engine runs, in words: for /metrics' build info, the inspector, the CLI's line.

    info(...)          {"version", "model", "device", "dtype", "weights", "kernels",
                        "prefill"}: LLMEngine.info(), the labels of tokenmill_build_info
    describe(...)      one line: the model's shape, weights, kernels, ranks, KV pool
    weight_forms(model) how each GGUF type is held: bits per weight, against the file's
    prefill_path(dev)  how prompt-sized products of packed weights run: the kernels'
                       answer (tm_linear_path in kernels/linear.c decides, for every
                       linear layer too), with its reason

The loop (engine/llm_engine.py) calls these with its parts; nothing here decides how
anything runs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill import kernels
from tokenmill.config import ModelConfig
from tokenmill.engine.kv_cache import KVCache
from tokenmill.version import __version__

# Rows of x standing for a prompt: a prefill chunk of the scheduler's default size (512
# tokens a step), past every row threshold of tm_linear_path.
PROMPT_ROWS = 512


def prefill_path(device: torch.device) -> kernels.LinearPath:
    """How prompt-sized products of packed weights run on `device` (layers/native_linear.py)."""
    if device.type != "cpu":
        return kernels.LinearPath(kernels.TORCH, f"the model runs on {device.type}")
    return kernels.linear_path(True, PROMPT_ROWS)


def info(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None,
    activation_bits: int = 16,
) -> dict[str, str]:
    """What runs, one word each."""
    return {
        "version": __version__,
        "model": path.name,
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "weights": quantization or "torch",
        "kernels": kernels.isa() if device.type == "cpu" else "torch",
        "prefill": prefill_path(device).name,
        # what packed weights' kernels quantize activations to (engine/build.py)
        "activation_bits": str(activation_bits),
    }


def weight_forms(model: torch.nn.Module | None) -> str:
    """How the packed layers hold each GGUF type, largest first: "Q4_K 4.6 bits per weight
    (file 4.5), Q6_K 6.6 (6.6)"; a type held wider than its file says so (never silently):
    "IQ2_XS 8.5 (2.3: 8-bit codes)". Empty for a model with no GGUF layers."""
    from gguf import GGMLQuantizationType as GT
    from gguf.constants import GGML_QUANT_SIZES

    from tokenmill.layers.quant_linear import QuantLinear

    held: dict[str, list[float]] = {}  # type -> [bytes, weights, widest code bits]
    for m in model.modules() if isinstance(model, torch.nn.Module) else ():
        if not isinstance(m, QuantLinear) or not m.sources:
            continue
        total = sum(m.sources.values())
        for name, n in m.sources.items():
            h = held.setdefault(name, [0.0, 0, 0])
            table = 0 if m.lut is None else m.lut.numel()  # a type's table or grid, not weights
            h[0] += (m.nbytes - table) * n / total
            h[1] += n
            h[2] = max(h[2], m.bits)
    parts = []
    for name, (nbytes, n, bits) in sorted(held.items(), key=lambda kv: -kv[1][0]):
        block, size = GGML_QUANT_SIZES[GT[name]]
        ours, file = 8 * nbytes / n, 8 * size / block
        wide = f": {bits}-bit codes" if ours > 1.05 * file else ""
        unit, of = (" bits per weight", "file ") if not parts else ("", "")  # said once
        parts.append(f"{name} {ours:.1f}{unit} ({of}{file:.1f}{wide})")
    return ", ".join(parts)


def num_weights(model: torch.nn.Module) -> int:
    """How many weights the model has: its float parameters and each packed layer's
    in x out (what a model's "135M" or "8B" counts)."""
    from tokenmill.layers.quant_linear import QuantLinear

    packed = sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantLinear)
    )
    return packed + sum(p.numel() for p in model.parameters())


def describe(
    path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    quantization: str | None,
    cache: KVCache,
    world: int | None = None,
    plan: list[str] | None = None,
    forms: str = "",
) -> str:
    """One line: the model, its weights (forms: weight_forms') and kernels, the ranks (world
    of them, what each holds: plan) of a parallel run, the KV pool."""
    c = config
    ranks = f"{world} ranks ({'; '.join(plan or [])}); " if world is not None else ""
    forms = f" ({forms})" if forms else ""
    return (
        f"{path.name}: {c.arch}, {c.num_layers} layers, d={c.hidden_size}, "
        f"heads {c.num_heads}/{c.num_kv_heads}, vocab {c.vocab_size}, {dtype}, "
        f"weights {quantization or 'torch'}{forms}, kernels {kernels.isa()}; {ranks}"
        f"KV cache {cache.capacity_tokens} tokens in {cache.num_blocks} blocks "
        f"({cache.nbytes / 2**20:.0f} MiB, {str(cache.dtype).removeprefix('torch.')}, "
        f"{cache.bytes_per_token} bytes per token)"
    )
