"""Mixture-of-experts GGUF files, as llama.cpp's converter writes them: qwen2moe, qwen3moe,
olmoe, granitemoe, and llama with experts (Mixtral), written with the `gguf` package from the same
random weights as a Hugging Face folder (tests/test_moe.py's) and read back.

Each sparse layer holds its router blk.N.ffn_gate_inp [E, d] and its experts as 3-D
tensors blk.N.ffn_{gate,up,down}_exps ([E, fe, d], [E, d, fe] in numpy order); Qwen2-MoE
adds its shared expert ffn_{gate,up,down}_shexp and that expert's gate ffn_gate_inp_shexp
[d]. Whether the top k are renormalized is llama.cpp's rule per architecture (Mixtral
and Qwen3-MoE yes, Qwen2-MoE and OLMoE no), so the HF configs below follow it.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import Single, finish_gguf, hf_greedy, hf_logits, llama_cpp_greedy, write_gguf
from test_moe import GREEDY, build_moe_model

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
    # Granite's multipliers as granite.*_scale keys, Q/K rows permuted as for llama
    "granitemoe": ("granitemoe", "granitemoe", dict(num_experts_per_tok=2)),
    # and an ungated shared expert (expert_shared_feed_forward_length, ffn_*_shexp)
    "granitemoeshared": ("granitemoe", "granitemoeshared", dict(num_experts_per_tok=3)),
}


class _GraniteAsMixtral:
    """A Granite-MoE model's tensors under the names helpers.write_gguf knows, as
    llama.cpp's converter splits them: the experts' [E, 2fe, d] gate_up (gate rows
    first), the router, the shared expert's input_linear [2fs, d] into gate and up; Q/K
    rows permuted (the converter permutes Granite's, as Llama's)."""

    def __init__(self, hf):
        self.hf, self.config = hf, hf.config

    def parameters(self):
        return self.hf.parameters()

    def state_dict(self) -> dict:
        from helpers import _permute_qk

        out = {}
        cfg = self.config
        for name, t in self.hf.state_dict().items():
            name = name.replace("block_sparse_moe.experts.", "mlp.experts.")
            name = name.replace("block_sparse_moe.router.", "mlp.gate.")
            if name.endswith("shared_mlp.input_linear.weight"):
                gate, up = t.chunk(2, dim=0)
                stem = name.removesuffix("shared_mlp.input_linear.weight")
                out[f"{stem}mlp.shared_expert.gate_proj.weight"] = gate
                out[f"{stem}mlp.shared_expert.up_proj.weight"] = up
                continue
            name = name.replace("shared_mlp.output_linear.", "mlp.shared_expert.down_proj.")
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
                t = torch.from_numpy(_permute_qk(t.numpy(), heads).copy())
            out[name] = t
        return out


def _write(hf, path, arch: str, qtype=None) -> None:
    """hf as llama.cpp's converter writes a GGUF of `arch` (helpers.write_gguf)."""
    if arch != "granitemoe":
        return write_gguf(hf, path, arch, qtype)
    cfg = hf.config
    metadata = dict(
        embedding_scale=cfg.embedding_multiplier,
        attention_scale=cfg.attention_multiplier,
        residual_scale=cfg.residual_multiplier,
        logit_scale=cfg.logits_scaling,
    )
    if getattr(cfg, "shared_intermediate_size", 0):
        metadata["expert_shared_feed_forward_length"] = cfg.shared_intermediate_size
    write_gguf(_GraniteAsMixtral(hf), path, arch, qtype, metadata=metadata)


def _build(tmp_path, name: str, qtype=None, **more):
    arch, model_type, overrides = CASES[name]
    hf = build_moe_model(model_type, tmp_path / "hf", **{**overrides, **more})
    path = tmp_path / f"{name}.gguf"
    _write(hf, path, arch, qtype)
    return hf, path


_MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "router",
    "norm_topk_prob",
    "shared_expert_intermediate_size",
    "shared_expert_gate",
    "moe_layers",
    "qk_norm",
    "qkv_bias",
)


@pytest.mark.parametrize(
    "name, qtype",
    [(name, None) for name in CASES]
    + [("qwen2moe", Q.F16), ("mixtral", Q.F16), ("granitemoeshared", Q.F16)],
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
    # hf holds the file's weights (rounded to float16 for F16)
    assert (got - hf_logits(hf, prompt)).abs().max().item() < 1e-4
    llm = LLM(path, kv_cache_memory="1024tok")  # as loaded by default: packed as stored
    assert llm.generate([prompt], GREEDY)[0].token_ids == hf_greedy(hf, prompt, 12)


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
    finish_gguf(w)


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
    # Q8_1 (llama.cpp's activation format, never a weight's) is not read
    _rewrite(path, bad, experts_type=Q.Q8_1)
    with pytest.raises(LoadError, match="ffn_.*_exps.weight: unsupported quantization type Q8_1"):
        open_checkpoint(bad)


HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")
@pytest.mark.parametrize(
    "name, qtype",
    [(name, None) for name in ("qwen3moe", "qwen2moe", "mixtral", "olmoe", "granitemoe")]
    + [("granitemoeshared", None), ("qwen3moe", Q.Q8_0), ("mixtral", Q.Q8_0)],
)
def test_llama_cpp_reads_the_same_file_to_the_same_tokens(tmp_path, name, qtype):
    """llama.cpp (llama-cpp-python) on the same GGUF gives tokenmill's greedy tokens (as
    loaded by default: the fused stack, Q8_0 experts packed as stored), and transformers'
    where the file holds float weights. (llama.cpp reads no dense layer among experts,
    and OLMoE only without grouped K/V heads: its K norm is [d].)"""
    more = {"num_key_value_heads": 4} if name == "olmoe" else {}
    if qtype is not None:  # Q8_0 blocks are 32 wide along the input
        more.update(hidden_size=64, intermediate_size=64, moe_intermediate_size=32)
        more.update(initializer_range=0.1)
    hf, path = _build(tmp_path, name, qtype, **more)
    prompt = torch.randint(2, 300, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = LLM(path, kv_cache_memory="1024tok").generate([prompt], GREEDY)[0].token_ids
    assert ours == llama_cpp_greedy(path, prompt, 12)
    if qtype is None:
        assert ours == hf_greedy(hf, prompt, 12)
