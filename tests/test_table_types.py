"""GGUF types whose 4-bit codes index a table of 16 values (IQ4_NL, IQ4_XS, MXFP4) are
held at 4 bits and looked up in registers (kernels: tm_weight.lut): a real model
re-quantized by llama.cpp's own quantizer reads to llama.cpp's greedy tokens, and every
layer of the file's types keeps its table and its 4-bit codes. (Exactness against
gguf-py and every kernel build: tests/test_kernels.py.)"""

from __future__ import annotations

import ctypes
import importlib.util

import pytest
from gguf import GGMLQuantizationType as GT
from gguf import GGUFReader
from helpers import assert_same_greedy_but_ties, llama_cpp_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.layers.quant_linear import QuantLinear

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
    ),
]


def llama_cpp_quantize(source, dest, ftype: int) -> None:
    """llama.cpp's quantizer (llama_model_quantize), re-quantizing `source`."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, 2
    status = llama_cpp.llama_model_quantize(
        str(source).encode(), str(dest).encode(), ctypes.byref(params)
    )
    assert status == 0, f"llama_model_quantize returned {status}"


@pytest.mark.parametrize("ftype_name", ["IQ4_XS", "IQ4_NL"])
def test_a_model_requantized_by_llama_cpp_reads_alike(tmp_path, smollm_path, ftype_name):
    import llama_cpp

    path = tmp_path / f"smollm-{ftype_name}.gguf"
    llama_cpp_quantize(smollm_path, path, getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}"))
    types = {t.tensor_type for t in GGUFReader(path).tensors}
    # SmolLM2's 576-wide rows are not whole IQ4_XS super-blocks: llama.cpp writes those as
    # IQ4_NL, the 1536-wide ones as IQ4_XS
    assert GT.IQ4_NL in types and (ftype_name == "IQ4_NL" or GT.IQ4_XS in types), types
    llm = LLM(path, kv_cache_memory="64MiB")
    tables = [
        m for m in llm.engine.model.modules() if isinstance(m, QuantLinear) and m.lut is not None
    ]
    assert tables and all(m.bits == 4 for m in tables)
    prompt = llm.tokenizer.encode("The capital of France is")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
    ours = llm.generate([prompt], greedy)[0]
    # the oracle: the same file dequantized by gguf-py into float weights (exact values)
    exact = LLM(path, kv_cache_memory="64MiB", quantization="none").generate([prompt], greedy)[0]
    assert ours.token_ids == exact.token_ids
    for mine, reference in zip(ours.logprobs, exact.logprobs, strict=True):
        assert abs(mine.logprob - reference.logprob) < 0.01  # 16-bit activations' error
    # llama.cpp on the same file: its logprobs sit up to ~0.1 from the exact model's here
    # (an f16 KV cache, 8-bit activations; on the Q4_1 original up to 0.07), so a tie
    # within 0.15 may part the two
    assert_same_greedy_but_ties(ours, llama_cpp_greedy(path, prompt, 12), tol=0.15)
