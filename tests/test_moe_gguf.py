"""Mixture-of-experts GGUF files, as llama.cpp's converter writes them: qwen2moe, qwen3moe,
olmoe, and llama with experts (Mixtral), written with the `gguf` package from the same
random weights as a Hugging Face folder (tests/test_moe.py's) and read back.

Each sparse layer holds its router blk.N.ffn_gate_inp [E, d] and its experts as 3-D
tensors blk.N.ffn_{gate,up,down}_exps ([E, fe, d], [E, d, fe] in numpy order); Qwen2-MoE
adds its shared expert ffn_{gate,up,down}_shexp and that expert's gate ffn_gate_inp_shexp
[d]. Whether the top k are renormalized is llama.cpp's rule per architecture (Mixtral
and Qwen3-MoE yes, Qwen2-MoE and OLMoE no), so the HF configs below follow it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import _permute_qk
from test_models_hf import Single
from test_moe import GREEDY, VOCAB, _greedy_hf, build_moe_model

from tokenmill.layers.moe import MoE
from tokenmill.layers.native_linear import NativeLinear
from tokenmill.llm import LLM
from tokenmill.loader import LoadError, open_checkpoint
from tokenmill.loader.hf_config import from_hf_config

# name: (GGUF architecture, HF model type, config overrides)
CASES = {
    "qwen3moe": ("qwen3moe", "qwen3_moe", dict(num_experts_per_tok=3, norm_topk_prob=True)),
    # a dense layer mixed in: llama.cpp's own files have none, tokenmill reads the layer
    # without a router as the dense MLP
    "qwen3moe-dense-layer": (
        "qwen3moe",
        "qwen3_moe",
        dict(num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]),
    ),
    "qwen2moe": (
        "qwen2moe",
        "qwen2_moe",
        dict(num_experts_per_tok=2, norm_topk_prob=False, shared_expert_intermediate_size=48),
    ),
    "mixtral": ("llama", "mixtral", dict(num_experts_per_tok=2)),
    "olmoe": ("olmoe", "olmoe", dict(num_experts_per_tok=3, norm_topk_prob=False)),
}

_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# HF name inside a layer (without .weight/.bias) -> llama.cpp's
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",  # a dense layer's MLP
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # the router
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def write_moe_gguf(hf, path, arch: str, qtype=None) -> None:
    """hf's weights as a GGUF of `arch`. qtype: None (F32), F16 (every matrix; hf's own
    weights are first rounded to float16 in place, so it computes what the file holds)
    or a block type for the experts and attention (the router and norms stay F32)."""
    import gguf
    from gguf.quants import quantize

    cfg = hf.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):  # Mixtral and OLMoE: feed_forward_length
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, VOCAB)])

    def add(name: str, t: torch.Tensor) -> None:
        data = t.float().numpy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            data = _permute_qk(data, heads if "attn_q" in name else kv_heads)
        matrix = data.ndim >= 2 and "ffn_gate_inp" not in name
        if qtype == Q.F16 and data.ndim >= 2:
            w.add_tensor(name, np.ascontiguousarray(data.astype(np.float16)))
        elif qtype not in (None, Q.F16) and matrix:
            w.add_tensor(name, quantize(np.ascontiguousarray(data), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(data))

    with torch.no_grad():
        if qtype == Q.F16:
            for p in hf.parameters():
                if p.dim() >= 2:
                    p.copy_(p.half().float())
        for name, t in hf.state_dict().items():
            stem, _, kind = name.rpartition(".")
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                stem, kind = name, "weight"  # transformers 5's 3-D experts, no suffix
            if stem in _TOP:
                if stem == "lm_head" and cfg.tie_word_embeddings:
                    continue
                add(f"{_TOP[stem]}.{kind}", t)
                continue
            _, _, idx, rest = stem.split(".", 3)
            if rest == "mlp.experts.gate_up_proj":  # [E, 2fe, d], each expert's rows [gate; up]
                gate, up = t.chunk(2, dim=1)
                add(f"blk.{idx}.ffn_gate_exps.weight", gate)
                add(f"blk.{idx}.ffn_up_exps.weight", up)
            elif rest == "mlp.experts.down_proj":  # [E, d, fe]
                add(f"blk.{idx}.ffn_down_exps.weight", t)
            elif rest == "mlp.shared_expert_gate":  # [1, d], stored as llama.cpp's [d]
                add(f"blk.{idx}.ffn_gate_inp_shexp.weight", t.reshape(-1))
            else:
                add(f"blk.{idx}.{_LAYER[rest]}.{kind}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _build(tmp_path, name: str, qtype=None, **more):
    arch, model_type, overrides = CASES[name]
    hf = build_moe_model(model_type, tmp_path / "hf", **{**overrides, **more})
    path = tmp_path / f"{name}.gguf"
    write_moe_gguf(hf, path, arch, qtype)
    return hf, path


_MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "router",
    "norm_topk_prob",
    "shared_expert_intermediate_size",
    "moe_layers",
    "qk_norm",
    "qkv_bias",
)


@pytest.mark.parametrize(
    "name, qtype",
    [(name, None) for name in CASES] + [("qwen2moe", Q.F16), ("mixtral", Q.F16)],
)
def test_gguf_reads_back_as_the_folder(tmp_path, name, qtype):
    """The file reads to the folder's MoE config, the folder's prefill logits (every
    position, within 1e-4) and transformers' greedy tokens."""
    hf, path = _build(tmp_path, name, qtype)
    config = open_checkpoint(path).config
    ref = from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    for field in _MOE_FIELDS:
        assert getattr(config, field) == getattr(ref, field), field
    prompt = torch.randint(2, 300, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    got = Single(path).feed(prompt)
    if qtype is None:  # the same weights: the folder's logits
        assert (got - Single(tmp_path / "hf").feed(prompt)).abs().max().item() < 1e-4
    with torch.no_grad():  # hf holds the file's weights (rounded to float16 for F16)
        want = hf(torch.tensor([prompt])).logits[0]
    assert (got - want).abs().max().item() < 1e-4
    llm = LLM(path, kv_cache_memory="1024tok")  # as loaded by default: packed as stored
    assert llm.generate([prompt], GREEDY)[0].token_ids == _greedy_hf(hf, prompt, 12)


def test_q8_0_experts_pack_per_expert(tmp_path):
    """Q8_0 experts (and attention) pack as stored, one QuantLinear per expert's slice of
    the 3-D tensors; the router stays a float Gate; greedy tokens equal the dequantized
    file's on the torch path."""
    # Q8_0 blocks are 32 wide along the input: sizes multiple of 32
    _, path = _build(
        tmp_path, "qwen2moe", Q.Q8_0, initializer_range=0.05, hidden_size=64,
        intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
    )  # fmt: skip
    packed = LLM(path, quantization="gguf", kv_cache_memory="1024tok")
    moe = packed.engine.model.layers[0].mlp
    assert isinstance(moe, MoE)
    assert all(
        isinstance(e.up, NativeLinear) and isinstance(e.down, NativeLinear) for e in moe.experts
    )
    assert isinstance(moe.shared.up, NativeLinear)
    assert type(moe.router.weight) is torch.nn.Parameter
    exact = LLM(path, quantization="none", kv_cache_memory="1024tok")
    for prompt in ([5, 6, 7, 8, 9, 10], list(range(20, 80))):
        a = packed.generate([prompt], GREEDY)[0].token_ids
        assert a == exact.generate([prompt], GREEDY)[0].token_ids


def _rewrite(path, out, *, drop_key: str | None = None, experts_type=None, trim: bool = False):
    """A copy of GGUF `path` with one header key left out, or the experts' tensors stored
    as `experts_type` (random bytes), or layer 0's up experts cut to one expert fewer."""
    import gguf

    from tokenmill.loader.gguf_reader import GGUFFile

    src = GGUFFile(path)
    arch = src.metadata["general.architecture"]
    w = gguf.GGUFWriter(str(out), arch)
    for key, value in src.metadata.items():
        if key in (drop_key, "general.architecture") or key.startswith("GGUF."):
            continue
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    for t in src.tensors:
        data = np.array(t.data)
        if trim and t.name == "blk.0.ffn_up_exps.weight":
            data = data[:-1]
        if experts_type is not None and "_exps" in t.name:
            block, size = gguf.GGML_QUANT_SIZES[experts_type]
            rows = data.shape[:-1]
            raw = np.random.default_rng(0).integers(0, 255, (*rows, data.shape[-1] // block * size))
            w.add_tensor(t.name, raw.astype(np.uint8), raw_dtype=experts_type)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_bad_moe_files_are_one_clear_error(tmp_path):
    _, path = _build(tmp_path, "olmoe", hidden_size=64, intermediate_size=32)
    bad = tmp_path / "bad.gguf"
    _rewrite(path, bad, drop_key="olmoe.expert_used_count")
    with pytest.raises(LoadError, match="missing metadata key olmoe.expert_used_count"):
        open_checkpoint(bad)
    _rewrite(path, bad, trim=True)
    with pytest.raises(
        LoadError, match=r"blk\.0\.ffn_up_exps\.weight: shape \(4, 32, 64\) is not \[5 experts"
    ):
        open_checkpoint(bad)
    # IQ4_NL experts (common in MoE GGUFs) have no dequantizer or kernel here yet
    _rewrite(path, bad, experts_type=Q.IQ4_NL)
    with pytest.raises(LoadError, match="ffn_.*_exps.weight: unsupported quantization type IQ4_NL"):
        open_checkpoint(bad)
