"""The packed-weight path (QuantLinear) wired into the model, against the float path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import Single, build_hf_model, mapped_rss_kib, write_llama_gguf

from tokenmill import LLM, SamplingParams
from tokenmill.layers.quant_linear import QuantLinear
from tokenmill.loader import open_checkpoint
from tokenmill.models.transformer import Transformer

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _count_packed(llm: LLM) -> int:
    return sum(isinstance(m, QuantLinear) for m in llm.engine.model.modules())


def _packable(llm: LLM) -> int:
    """Layers a fully packed model has: per block q/k/v fused, o, gate+up fused and down,
    plus the embedding table, plus the un-embedding when it is not tied."""
    cfg = llm.engine.config
    return 4 * cfg.num_layers + 1 + (0 if cfg.tie_embeddings else 1)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q4_0])
def test_gguf_packed_weights_match_float(tmp_path, qtype):
    hf = build_hf_model("llama", tmp_path / "hf", initializer_range=0.05)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(hf, path, qtype)
    prompts = [[5, 6, 7, 8, 9, 10], list(range(20, 80))]  # decode kernel and GEMM paths
    packed = LLM(path, quantization="gguf", kv_cache_memory="2048tok")
    exact = LLM(path, quantization="none", kv_cache_memory="2048tok")
    # per layer: q/k/v fused, o, gate+up fused, down; plus the embedding table and the
    # (untied) un-embedding
    assert _count_packed(packed) == 3 * 4 + 2
    assert _count_packed(exact) == 0
    for prompt in prompts:
        a = packed.generate([prompt], GREEDY)[0].token_ids
        b = exact.generate([prompt], GREEDY)[0].token_ids
        assert a == b


@pytest.mark.parametrize("qtype", [Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4], ids=lambda q: q.name)
def test_table_coded_gguf_types_load_as_the_file_holds_them(tmp_path, qtype):
    """IQ4_NL, IQ4_XS (MoE GGUFs' usual types) and MXFP4 (gpt-oss's): the float path reads
    exactly what the file holds (transformers on the round-tripped weights), and the packed
    path holds the file's 4-bit codes, looked up in the type's table in registers: the
    same values, so only the activations' 16-bit rounding moves its logits (8-bit codes
    requantized at load moved them by 0.05-0.09 of a spread of 0.8 here). Hidden 256:
    IQ4_XS blocks are 256 wide."""
    hf = build_hf_model(
        "llama", tmp_path / "hf", initializer_range=0.05, hidden_size=256, intermediate_size=512
    )
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(hf, path, qtype)
    prompt = list(range(20, 60))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]  # [40, vocab]
    exact = Single(path).feed(prompt)
    assert (exact - ref).abs().max().item() < 1e-4
    packed_model = Single(path, quantize="gguf")
    packed = [m for m in packed_model.model.modules() if isinstance(m, QuantLinear)]
    assert len(packed) == 3 * 4 + 2 and all(m.bits == 4 and m.lut is not None for m in packed)
    assert (packed_model.feed(prompt) - exact).abs().max().item() < 0.01


def test_hf_checkpoint_quantized_q8(tmp_path):
    build_hf_model("llama", tmp_path, initializer_range=0.05)
    q8 = LLM(tmp_path, quantization="q8", kv_cache_memory="2048tok")
    exact = LLM(tmp_path, kv_cache_memory="2048tok")
    assert _count_packed(q8) == _packable(q8) == 3 * 4 + 2
    prompt = list(range(30, 50))
    assert (
        q8.generate([prompt], GREEDY)[0].token_ids == exact.generate([prompt], GREEDY)[0].token_ids
    )


def test_bad_quantization_name(tmp_path):
    build_hf_model("llama", tmp_path)
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(tmp_path, quantization="int3")


@pytest.mark.slow
def test_real_model_packed_greedy_matches_float(smollm_path):
    prompt = "The capital of France is"
    packed = LLM(smollm_path, kv_cache_memory="64MiB")
    assert packed.engine.quantization == "gguf" and _count_packed(packed) == _packable(packed)
    exact = LLM(smollm_path, quantization="none", kv_cache_memory="64MiB")
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    assert (
        packed.generate(prompt, params)[0].token_ids == exact.generate(prompt, params)[0].token_ids
    )
    # the packed model really is smaller: weights stay ~4.5 bits
    size = sum(b.numel() * b.element_size() for b in packed.engine.model.buffers())
    assert size < 0.3 * sum(p.numel() * p.element_size() for p in exact.engine.model.parameters())


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_packing_releases_the_files_pages(smollm_path):
    """Each packed tensor's file pages leave the resident set once packed: loading never
    holds the GGUF file and its packed copy at once."""
    ckpt = open_checkpoint(smollm_path)
    Transformer(ckpt.config).load_weights(ckpt, torch.float32, quantize="gguf")
    size_kib = Path(smollm_path).stat().st_size // 1024
    # what stays: the header (the tokenizer vocabulary) and the float norm weights
    assert mapped_rss_kib(Path(smollm_path).resolve()) < 0.2 * size_kib
    # without the releases (whole tensors, and row chunks of big ones), the whole file
    # stays mapped
    ckpt.release, ckpt.release_view = (lambda name: None), (lambda view: None)
    Transformer(ckpt.config).load_weights(ckpt, torch.float32, quantize="gguf")
    assert mapped_rss_kib(Path(smollm_path).resolve()) > 0.9 * size_kib
