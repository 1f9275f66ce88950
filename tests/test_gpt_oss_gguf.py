"""gpt-oss as GGUF, written with the `gguf` package under llama.cpp's names and keys
(arch "gpt-oss", as its convert_hf_to_gguf.py writes a checkpoint whose experts are not
MXFP4), from a random transformers GptOssForCausalLM, and read back.

What the file holds, per layer N (numpy order):
    blk.N.attn_{q,k,v,output}.{weight,bias}, blk.N.attn_sinks.weight [H]
    blk.N.attn_norm, blk.N.post_attention_norm (the norm before the MoE)
    blk.N.ffn_gate_inp.{weight [E, d], bias [E]}               the router
    blk.N.ffn_{gate,up}_exps.{weight [E, fe, d], bias [E, fe]}  HF's interleaved gate_up
        deinterleaved (gate = even columns, up = odd ones); or fused into
        blk.N.ffn_gate_up_exps.{weight [E, 2fe, d], bias [E, 2fe]} (gate rows, then up)
    blk.N.ffn_down_exps.{weight [E, d, fe], bias [E, d]}
and the header's expert_count, expert_used_count, expert_feed_forward_length,
attention.sliding_window (the even layers slide) and YaRN's rope.scaling.* keys.
llama.cpp's SwiGLU limit is 7 (no key), so the model here uses 7, with expert weights
large enough that the clamps bite.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import RopeScalingType
from gguf.quants import dequantize, quantize
from helpers import Single, _gguf_writer, finish_gguf, hf_greedy, hf_logits, llama_cpp_greedy
from test_moe import GREEDY, build_moe_model

from tokenmill.llm import LLM
from tokenmill.loader import LoadError, open_checkpoint
from tokenmill.loader.hf_config import from_hf_config
from tokenmill.models import paths

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.router": "ffn_gate_inp",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def build_gpt_oss(folder, **overrides):
    """A random gpt-oss (helpers.FAMILIES: sinks, sliding and full layers, YaRN) with
    llama.cpp's SwiGLU limit 7, its experts' gate_up weights scaled so that the clamps
    are reached; saved to `folder` as it is."""
    hf = build_moe_model("gpt_oss", folder, num_experts_per_tok=2, swiglu_limit=7.0, **overrides)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(3.0)
    hf.save_pretrained(folder)
    return hf


def write_gpt_oss_gguf(hf, path, *, fused: bool = False, qtype=None) -> None:
    """hf as a gpt-oss GGUF (module docstring). qtype: a block type for the experts'
    weights (the rest stays F32); hf's experts are replaced by the round trip, so it
    computes what the file holds."""
    cfg = hf.config
    rope = cfg.rope_parameters
    w = _gguf_writer(cfg, path, "gpt-oss")
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_sliding_window(cfg.sliding_window)
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, cfg.vocab_size)])

    def add(name: str, t: torch.Tensor) -> torch.Tensor:
        """Add tensor `name`; returns what the file holds, as float32."""
        data = np.ascontiguousarray(t.float().numpy())
        if qtype is None or "_exps.weight" not in name:
            w.add_tensor(name, data)
            return t.float()
        q = quantize(data, qtype)
        w.add_tensor(name, q, raw_dtype=qtype)
        return torch.from_numpy(dequantize(q, qtype).reshape(data.shape).copy())

    with torch.no_grad():
        for name, t in hf.state_dict().items():
            stem, _, kind = name.rpartition(".")
            if stem in _TOP:
                add(f"{_TOP[stem]}.{kind}", t)
                continue
            _, _, idx, rest = name.split(".", 3)
            blk = f"blk.{idx}"
            experts = hf.model.layers[int(idx)].mlp.experts
            if rest == "self_attn.sinks":
                add(f"{blk}.attn_sinks.weight", t)
            elif rest == "mlp.experts.gate_up_proj":  # [E, d, 2fe] -> [E, 2fe, d]
                rows = t.transpose(1, 2)
                gate, up = rows[:, ::2], rows[:, 1::2]  # [E, fe, d] each
                if fused:
                    back = add(f"{blk}.ffn_gate_up_exps.weight", torch.cat([gate, up], 1))
                    gate, up = back.chunk(2, dim=1)
                else:
                    gate = add(f"{blk}.ffn_gate_exps.weight", gate)
                    up = add(f"{blk}.ffn_up_exps.weight", up)
                both = torch.stack([gate, up], dim=2).flatten(1, 2)  # interleaved again
                experts.gate_up_proj.copy_(both.transpose(1, 2))
            elif rest == "mlp.experts.gate_up_proj_bias":  # [E, 2fe] interleaved
                gate, up = t[:, ::2], t[:, 1::2]
                if fused:
                    add(f"{blk}.ffn_gate_up_exps.bias", torch.cat([gate, up], 1))
                else:
                    add(f"{blk}.ffn_gate_exps.bias", gate)
                    add(f"{blk}.ffn_up_exps.bias", up)
            elif rest == "mlp.experts.down_proj":  # [E, fe, d] -> [E, d, fe]
                back = add(f"{blk}.ffn_down_exps.weight", t.transpose(1, 2))
                experts.down_proj.copy_(back.transpose(1, 2))
            elif rest == "mlp.experts.down_proj_bias":  # [E, d]
                add(f"{blk}.ffn_down_exps.bias", t)
            else:
                stem, _, kind = rest.rpartition(".")
                add(f"{blk}.{_LAYER[stem]}.{kind}", t)
    finish_gguf(w)


def _prompt() -> list[int]:
    return torch.randint(2, 300, (24,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("fused", [False, True], ids=["split-gate-up", "fused-gate-up"])
def test_gguf_reads_back_as_the_folder(tmp_path, fused):
    """The file reads to the folder's config (sinks, layer types, YaRN, the router and
    experts), the folder's logits at every position, and transformers' greedy tokens on
    the fused stack and on the per-layer path."""
    hf = build_gpt_oss(tmp_path / "hf")
    path = tmp_path / "oss.gguf"
    write_gpt_oss_gguf(hf, path, fused=fused)
    config = open_checkpoint(path).config
    ref = from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    for field in (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "router", "router_bias",
        "mlp_bias", "attn_sinks", "swiglu_limit", "swiglu_alpha", "layer_types",
        "sliding_window", "rope", "qkv_bias", "o_bias", "moe_layers", "head_dim",
    ):  # fmt: skip
        assert getattr(config, field) == getattr(ref, field), field
    prompt = _prompt()
    got = Single(path).feed(prompt)
    assert (got - Single(tmp_path / "hf").feed(prompt)).abs().max().item() < 1e-4
    assert (got - hf_logits(hf, prompt)).abs().max().item() < 1e-4
    # the clamps matter on this prompt: without them transformers' logits move
    limits = [layer.mlp.experts.limit for layer in hf.model.layers]
    for layer in hf.model.layers:
        layer.mlp.experts.limit = 1e9
    assert (hf_logits(hf, prompt) - got).abs().max().item() > 1e-2
    for layer, limit in zip(hf.model.layers, limits, strict=True):
        layer.mlp.experts.limit = limit

    want = hf_greedy(hf, prompt, 12)
    llm = LLM(path, kv_cache_memory="1024tok")
    assert llm.engine.model.decode_path().name == paths.STACK
    assert llm.generate([prompt], GREEDY)[0].token_ids == want
    llm.engine.model.native_model().stack_blocker = "test: the per-layer path"
    assert llm.generate([prompt], GREEDY)[0].token_ids == want


@pytest.mark.parametrize("qtype", [Q.MXFP4, Q.Q8_0], ids=lambda q: q.name)
def test_quantized_experts(tmp_path, qtype):
    """Experts stored MXFP4 (gpt-oss's published GGUFs) or Q8_0: the float path reads
    exactly what the file holds (transformers on the round-tripped experts, greedy
    tokens equal); packed as loaded by default (MXFP4's 4-bit codes looked up in its
    table, Q8_0 as stored) the logits of most positions stay within the activations'
    rounding of it. Sizes multiple of 32: the blocks'
    width."""
    hf = build_gpt_oss(tmp_path / "hf", hidden_size=64, intermediate_size=32)
    path = tmp_path / "oss.gguf"
    write_gpt_oss_gguf(hf, path, fused=True, qtype=qtype)
    prompt = _prompt()
    exact = Single(path).feed(prompt)
    assert (exact - hf_logits(hf, prompt)).abs().max().item() < 1e-4
    llm = LLM(path, quantization="none", kv_cache_memory="1024tok")
    assert llm.generate([prompt], GREEDY)[0].token_ids == hf_greedy(hf, prompt, 12)
    packed = Single(path, quantize="gguf")
    spread = (exact.max() - exact.min()).item()
    # per position: a router choice flipped by the rounding moves a whole row, so most
    # rows, not all (a wrong decoding moves every row by the logits' size)
    off = (packed.feed(prompt) - exact).abs().amax(dim=-1) / spread  # [T]
    assert (off < 0.05).float().mean().item() >= 0.75, off


def test_bad_gpt_oss_files_are_one_clear_error(tmp_path):
    hf = build_gpt_oss(tmp_path / "hf")
    path = tmp_path / "oss.gguf"
    write_gpt_oss_gguf(hf, path, fused=True)
    from test_moe_gguf import _rewrite

    bad = tmp_path / "bad.gguf"
    _rewrite(path, bad, drop_key="gpt-oss.rope.scaling.original_context_length")
    with pytest.raises(
        LoadError, match="missing metadata key gpt-oss.rope.scaling.original_context_length"
    ):
        open_checkpoint(bad)
    _rewrite(path, bad, drop_key="gpt-oss.expert_count")
    with pytest.raises(LoadError, match="missing metadata key gpt-oss.expert_count"):
        open_checkpoint(bad)


@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)
def test_llama_cpp_reads_the_same_file_to_the_same_tokens(tmp_path):
    """llama.cpp (llama-cpp-python) on the same gpt-oss GGUF gives tokenmill's and
    transformers' greedy tokens. Gate and up split: llama-cpp-python 0.3.16's llama.cpp
    does not read the fused ffn_gate_up_exps."""
    hf = build_gpt_oss(tmp_path / "hf")
    path = tmp_path / "oss.gguf"
    write_gpt_oss_gguf(hf, path, fused=False)
    prompt = _prompt()
    ours = LLM(path, kv_cache_memory="1024tok").generate([prompt], GREEDY)[0].token_ids
    assert ours == hf_greedy(hf, prompt, 12)
    assert ours == llama_cpp_greedy(path, prompt, 12)
