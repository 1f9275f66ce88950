"""GGUF files (llama.cpp's format), read with the `gguf` package.

Metadata keys `{arch}.*` become the ModelConfig; tensors are dequantized from their
ggml block formats by `gguf.quants`. llama.cpp's converter permutes the rows of the
Q and K projections of llama-family models (its rotary kernel pairs adjacent
dimensions, HF's pairs the two halves); we undo that so one rotary implementation
serves both formats.

Mixture-of-experts files (qwen2moe, qwen3moe, olmoe, gpt-oss, granitemoe, and llama with experts:
Mixtral) keep each sparse layer's experts as 3-D tensors blk.N.ffn_{gate,up,down}_exps,
[n_expert, rows, cols] in numpy order (gpt-oss: or gate and up fused, ffn_gate_up_exps
[n_expert, 2 fe, d], and a bias [n_expert, rows] beside each); each expert's slice becomes
its own tensor (layers.N.mlp.experts.j.*), so it loads, and packs as stored, like any
projection.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tokenmill.checks import short_repr
from tokenmill.config import (
    MAX_EXPERTS,
    MAX_SIZES,
    ConfigError,
    ModelConfig,
    RopeConfig,
    check_int,
)
from tokenmill.loader.checkpoint import Checkpoint, LoadError
from tokenmill.loader.checks import check_checkpoint, part_shape
from tokenmill.loader.gguf_blocks import QUANT_GGUF_TYPES
from tokenmill.loader.gguf_reader import (
    GGUFFile,
    GGUFFormatError,
    GGUFShards,
    GGUFTensor,
    open_gguf_file,
)
from tokenmill.loader.hf_config import REQUIRED, ConfigFields
from tokenmill.loader.hf_folder import phi3_rows

SUPPORTED_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    *QUANT_GGUF_TYPES,
}
SUPPORTED_ARCHS = (
    *("llama", "mistral", "qwen2", "qwen3", "gemma3", "gpt2"),
    *("smollm3", "gemma2", "olmo2", "phi3", "granite"),
    *("qwen2moe", "qwen3moe", "olmoe", "gpt-oss", "granitemoe"),
)
# Mixture-of-experts families (layers/moe.py); llama is one too when it has experts.
_MOE_ARCHS = ("qwen2moe", "qwen3moe", "olmoe", "gpt-oss", "granitemoe")
# llama.cpp's rule per family (build_moe_ffn's norm_w): softmax over all experts, the top
# k, then rescale those k to sum to 1 or not. It is fixed per architecture, not read from
# the file: Mixtral and Qwen3-MoE renormalize, Qwen2-MoE and OLMoE do not.
_NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}
# llama.cpp MoE tensor (after blk.N.) -> tokenmill suffix after layers.N.mlp.
_MOE_NAMES = {
    "ffn_gate_inp": "router",
    "ffn_gate_inp_shexp": "shared_gate",
    "ffn_gate_shexp": "shared.gate",
    "ffn_up_shexp": "shared.up",
    "ffn_down_shexp": "shared.down",
}
# llama.cpp expert tensor -> the expert projections it holds, stacked along its rows
# (gpt-oss's fused ffn_gate_up_exps: [E, 2fe, d], each expert's gate rows then its up rows)
_EXPERT_NAMES = {
    "ffn_gate_exps": ("gate",),
    "ffn_up_exps": ("up",),
    "ffn_down_exps": ("down",),
    "ffn_gate_up_exps": ("gate", "up"),
}
# gpt-oss: llama.cpp's swiglu_oai has its alpha and limit built in (no header keys)
_GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
# Families whose Q/K rows llama.cpp's converter permuted.
_PERMUTED_QK = ("llama", "mistral", "smollm3", "granite", "granitemoe")
# SmolLM3: llama.cpp has no key for its NoPE layers; it hard-codes every 4th layer.
_SMOLLM3_NOPE_STEP = 4

_LAYER_NAMES = {
    "attn_norm": "attn_norm",
    "attn_q": "attn.q",
    "attn_k": "attn.k",
    "attn_v": "attn.v",
    "attn_output": "attn.o",
    "attn_q_norm": "attn.q_norm",
    "attn_k_norm": "attn.k_norm",
    "post_attention_norm": "post_attn_norm",
    "ffn_norm": "mlp_norm",
    "post_ffw_norm": "post_mlp_norm",
    "ffn_gate": "mlp.gate",
    "ffn_up": "mlp.up",
    "ffn_down": "mlp.down",
}
_TOP_NAMES = {
    "token_embd": "embed",
    "position_embd": "pos_embed",
    "output_norm": "final_norm",
    "output": "lm_head",
}


def _config(reader: GGUFFile | GGUFShards, path: Path) -> ModelConfig:
    """The ModelConfig a GGUF header describes. Every number is checked (type, range) under
    its own key name before it is used: ConfigError, which open_gguf turns into LoadError."""
    arch = reader.metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHS:
        raise LoadError(
            path,
            f"unsupported architecture {short_repr(arch)} (supported: {', '.join(SUPPORTED_ARCHS)})",
        )

    # GGUF metadata is read as config.json is (loader/hf_config.py), under {arch}.key names
    fields = ConfigFields(reader.metadata, str(path), missing="missing metadata key {key}")
    raw = fields.raw

    def meta_int(key: str, default=REQUIRED, *, lo: int = 1, size: str | None = None):
        return fields.int(f"{arch}.{key}", default, lo=lo, hi=MAX_SIZES[size] if size else None)

    def meta_float(key: str, default=REQUIRED, *, lo_open: bool = False):
        return fields.float(f"{arch}.{key}", default, lo_open=lo_open)

    hidden = meta_int("embedding_length", size="hidden_size")
    heads = meta_int("attention.head_count", size="num_heads")
    kv_heads = meta_int("attention.head_count_kv", None, size="num_kv_heads") or heads
    head_dim = meta_int("attention.key_length", None, size="head_dim") or hidden // heads
    layers = meta_int("block_count", size="num_layers")
    tokens = reader.metadata.get("tokenizer.ggml.tokens")
    vocab = meta_int("vocab_size", None, size="vocab_size")
    if vocab is None and isinstance(tokens, list) and tokens:
        vocab = len(tokens)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is not None:
        vocab = int(embd.shape[0])
    rope = RopeConfig(
        theta=meta_float("rope.freq_base", 10000.0, lo_open=True),
        dim=meta_int("rope.dimension_count", None, lo=2, size="head_dim"),
    )
    scaling = raw(f"{arch}.rope.scaling.type", None)
    if scaling == "linear":
        rope.scaling, rope.factor = "linear", meta_float("rope.scaling.factor", lo_open=True)
    if scaling == "yarn":
        _yarn(rope, arch, meta_int, meta_float)
    eos = raw("tokenizer.ggml.eos_token_id", None)
    bos = raw("tokenizer.ggml.bos_token_id", None)
    names = {t.name for t in reader.tensors}
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta_int("feed_forward_length", size="intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position=meta_int("context_length", 4096, size="max_position"),
        rope=rope,
        tie_embeddings="output.weight" not in names,
        bos_token_id=None if bos is None else check_int("tokenizer.ggml.bos_token_id", bos, 0),
        eos_token_ids=[] if eos is None else [check_int("tokenizer.ggml.eos_token_id", eos, 0)],
    )
    rms_eps = meta_float("attention.layer_norm_rms_epsilon", 1e-6)
    if arch == "gpt2":
        return ModelConfig(
            arch="gpt2",
            norm="layer",
            norm_eps=meta_float("attention.layer_norm_epsilon", 1e-5),
            mlp="plain",
            activation="gelu_tanh",
            position="learned",
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            **common,
        )
    if arch == "gemma3":
        window = meta_int("attention.sliding_window", size="sliding_window")
        # llama.cpp: every 6th Gemma 3 layer is global, local layers use RoPE base 10k.
        types = ["full" if (i + 1) % 6 == 0 else "sliding" for i in range(layers)]
        return ModelConfig(
            arch="gemma3",
            norm_eps=rms_eps,
            activation="gelu_tanh",
            qk_norm=True,
            sandwich_norm=True,
            embed_scale=math.sqrt(hidden),
            attn_scale=head_dim**-0.5,
            sliding_window=window,
            layer_types=types,
            rope_local=RopeConfig(theta=10000.0),
            **common,
        )
    if arch == "gemma2":
        # llama.cpp: the even layers slide; the caps default to Gemma 2's 50 and 30; queries
        # scale by 1/sqrt(head_dim), or 1/sqrt(d / H) for the 27B (its 46 layers)
        scale = (hidden // heads) ** -0.5 if layers == 46 else head_dim**-0.5
        return ModelConfig(
            arch="gemma2",
            norm_eps=rms_eps,
            activation="gelu_tanh",
            sandwich_norm=True,
            embed_scale=math.sqrt(hidden),
            attn_scale=scale,
            attn_logit_softcap=meta_float("attn_logit_softcapping", 50.0, lo_open=True),
            final_logit_softcap=meta_float("final_logit_softcapping", 30.0, lo_open=True),
            sliding_window=meta_int("attention.sliding_window", size="sliding_window"),
            layer_types=["sliding" if i % 2 == 0 else "full" for i in range(layers)],
            **common,
        )
    window = meta_int("attention.sliding_window", None, size="sliding_window")
    if arch == "phi3":
        _phi3_rope(reader, path, rope, meta_int, meta_float)
        return ModelConfig(
            arch="phi3",
            norm_eps=rms_eps,
            sliding_window=window,
            layer_types=["sliding" if window else "full"] * layers,
            **common,
        )
    if arch == "olmo2":
        # norms after each sublayer only; Q/K norm over the whole projection; with a window
        # (OLMo 3), llama.cpp makes 3 layers in every 4 slide
        return ModelConfig(
            arch="olmo2",
            norm_eps=rms_eps,
            qk_norm="full",
            pre_norm=False,
            sandwich_norm=True,
            sliding_window=window,
            layer_types=["sliding" if window and i % 4 < 3 else "full" for i in range(layers)],
            **common,
        )
    if arch in ("granite", "granitemoe"):
        # llama.cpp's converter writes each multiplier as a *_scale key, and only when it is
        # set (not 0); absent, llama.cpp takes none (1), and 1/sqrt(head_dim) for attention.
        # logit_scale is transformers' logits_scaling: the logits are divided by it.
        def scale(key: str, default: float) -> float:
            return meta_float(key, 0.0) or default

        moe = _moe_fields(arch, raw, meta_int, names, layers, common["intermediate_size"])
        return ModelConfig(
            arch=arch,
            norm_eps=rms_eps,
            embed_scale=scale("embedding_scale", 1.0),
            attn_scale=scale("attention.scale", head_dim**-0.5),
            residual_scale=scale("residual_scale", 1.0),
            logit_scale=1.0 / scale("logit_scale", 1.0),
            qkv_bias="blk.0.attn_q.bias" in names,
            o_bias="blk.0.attn_output.bias" in names,
            mlp_bias="blk.0.ffn_up.bias" in names,
            sliding_window=window,
            layer_types=["sliding" if window else "full"] * layers,
            **moe,
            **common,
        )
    nope = arch == "smollm3"
    moe = _moe_fields(arch, raw, meta_int, names, layers, common["intermediate_size"])
    if arch == "gpt-oss":
        # llama.cpp: the even layers slide (layer 0 first), every odd one is full; a sink
        # logit per head (blk.N.attn_sinks); the router's bias and the experts' biases
        return ModelConfig(
            arch=arch,
            norm_eps=rms_eps,
            qkv_bias="blk.0.attn_q.bias" in names,
            o_bias="blk.0.attn_output.bias" in names,
            mlp_bias=True,
            attn_sinks=True,
            sliding_window=window,
            layer_types=["sliding" if window and i % 2 == 0 else "full" for i in range(layers)],
            **_GPT_OSS_SWIGLU,
            **moe,
            **common,
        )
    qk_norm = "blk.0.attn_q_norm.weight" in names
    return ModelConfig(
        arch=arch,
        rope_layers=[not nope or (i + 1) % _SMOLLM3_NOPE_STEP != 0 for i in range(layers)],
        norm_eps=rms_eps,
        qkv_bias="blk.0.attn_q.bias" in names,
        # the MoE families with attention biases (Qwen2/3-MoE) carry one on the output too
        o_bias=arch in _MOE_ARCHS and "blk.0.attn_output.bias" in names,
        # OLMoE: RMSNorm over the whole q and k projections ([H hd], [Hkv hd])
        qk_norm="full" if arch == "olmoe" else qk_norm,
        sliding_window=window,
        layer_types=["sliding" if window else "full"] * layers,
        **moe,
        **common,
    )


def _moe_fields(arch: str, raw, meta_int, names: set[str], layers: int, n_ff: int) -> dict:
    """The MoE fields of ModelConfig from a GGUF header, as llama.cpp reads them: none for
    a dense file (llama without {arch}.expert_count, or with 0). A layer is sparse where
    the file has its router, blk.N.ffn_gate_inp (llama.cpp's files have one in every
    layer; a dense layer mixed in reads as the dense MLP)."""
    if arch not in (*_MOE_ARCHS, "llama"):
        return {}
    # gpt-oss and Granite-MoE: the top k logits, then a softmax over them (llama.cpp's
    # SOFTMAX_WEIGHT; Granite's softmax over all, top k, renormalized, is the same)
    topk_first = arch in ("gpt-oss", "granitemoe")
    key = f"{arch}.expert_count"
    experts = raw(key, REQUIRED if arch in _MOE_ARCHS else None)
    if arch == "llama" and not experts:
        return {}
    experts = check_int(key, experts, 1, MAX_EXPERTS)
    used_key = f"{arch}.expert_used_count"
    used = check_int(used_key, raw(used_key), 1, experts)
    # the experts' width: the key, else llama.cpp's fallback (the Qwen families:
    # feed_forward_length / expert_used_count; Mixtral and OLMoE: feed_forward_length)
    fallback = n_ff // used if arch in ("qwen2moe", "qwen3moe") else n_ff
    width = meta_int("expert_feed_forward_length", None, size="intermediate_size")
    fields = dict(
        num_experts=experts,
        num_experts_per_tok=used,
        moe_intermediate_size=width or fallback,
        router="topk_softmax" if topk_first else "softmax_topk",
        norm_topk_prob=_NORM_TOPK.get(arch, False),
        router_bias="blk.0.ffn_gate_inp.bias" in names,
        moe_layers=[f"blk.{i}.ffn_gate_inp.weight" in names for i in range(layers)],
    )
    if arch == "qwen2moe":  # its shared expert (sigmoid-gated) is in every sparse layer
        shared = meta_int("expert_shared_feed_forward_length", None, size="intermediate_size")
        fields["shared_expert_intermediate_size"] = shared or n_ff
    if arch == "granitemoe":  # Granite-MoE-shared: an ungated shared expert, if the key is set
        shared = meta_int("expert_shared_feed_forward_length", 0, lo=0, size="intermediate_size")
        fields.update(shared_expert_intermediate_size=shared, shared_expert_gate=False)
    return fields


def _yarn(rope: RopeConfig, arch: str, meta_int, meta_float) -> None:
    """YaRN from llama.cpp's rope.scaling.* keys: the factor, the original context, the
    ramp's beta_fast / beta_slow (32 and 1 when absent) and the attention factor, which the
    converter writes only when the HF config sets one (yarn_attn_factor); otherwise
    0.1 ln(factor) + 1 (1 for a factor at most 1), as transformers computes it. llama.cpp
    always rounds the ramp's ends to whole dimensions; gpt-oss was trained without that
    rounding (its config's "truncate": false), and its file has no key to say so."""
    rope.scaling = "yarn"
    rope.factor = meta_float("rope.scaling.factor", lo_open=True)
    rope.original_max_position = meta_int(
        "rope.scaling.original_context_length", size="max_position"
    )
    rope.beta_fast = meta_float("rope.scaling.yarn_beta_fast", 32.0, lo_open=True)
    rope.beta_slow = meta_float("rope.scaling.yarn_beta_slow", 1.0, lo_open=True)
    default = 1.0 if rope.factor <= 1 else 0.1 * math.log(rope.factor) + 1.0
    rope.attention_factor = meta_float("rope.scaling.yarn_attn_factor", default, lo_open=True)
    rope.truncate = arch != "gpt-oss"


def _phi3_rope(
    reader: GGUFFile | GGUFShards, path: Path, rope: RopeConfig, meta_int, meta_float
) -> None:
    """Phi-3's LongRoPE, which llama.cpp's converter stores as two tensors of per-frequency
    factors (rope_factors_short, rope_factors_long) beside the original context length and
    the attention factor in the header. Without the tensors: plain RoPE."""
    found = {
        t.name: t
        for t in reader.tensors
        if t.name in ("rope_factors_short.weight", "rope_factors_long.weight")
    }
    if not found:
        return
    if len(found) != 2:
        raise ConfigError("phi3 needs both rope_factors_short and rope_factors_long")
    for name, t in found.items():
        if math.prod(t.shape) > MAX_SIZES["head_dim"]:  # [rotary dims / 2]; checked again later
            raise ConfigError(f"tensor {name} has {math.prod(t.shape)} factors")
    rope.scaling = "longrope"
    rope.short_factor = read_tensor(found["rope_factors_short.weight"], path).reshape(-1).tolist()
    rope.long_factor = read_tensor(found["rope_factors_long.weight"], path).reshape(-1).tolist()
    rope.original_max_position = meta_int(
        "rope.scaling.original_context_length", size="max_position"
    )
    rope.attention_factor = meta_float("rope.scaling.attn_factor", 1.0, lo_open=True)


def _target_name(name: str, arch: str = "") -> list[tuple[str, str | None]]:
    stem, _, kind = name.rpartition(".")
    if stem in _TOP_NAMES:
        return [(f"{_TOP_NAMES[stem]}.{kind}", None)]
    if stem == "rope_freqs":
        return [("rope_freqs", None)]
    if not stem.startswith("blk.") or stem.count(".") < 2:
        return []
    _, idx, part = stem.split(".", 2)
    if part == "attn_sinks":  # gpt-oss: one logit per query head [H]
        return [(f"layers.{idx}.attn.sinks", None)]
    if part == "post_attention_norm" and arch == "gpt-oss":  # the norm before the MoE
        return [(f"layers.{idx}.mlp_norm.{kind}", None)]
    if part == "attn_qkv" and arch == "phi3":  # fused [q; k; v] of unequal sizes (GQA)
        return [(f"layers.{idx}.attn.{p}.{kind}", f"attn.{p}") for p in ("q", "k", "v")]
    if part == "ffn_up" and arch == "phi3":  # fused [gate; up]
        return [(f"layers.{idx}.mlp.{p}.{kind}", f"mlp.{p}") for p in ("gate", "up")]
    if part == "attn_qkv":  # fused (GPT-2): split into q, k, v by the loader
        return [(f"layers.{idx}.attn.{p}.{kind}", p) for p in ("q", "k", "v")]
    mapped = _LAYER_NAMES.get(part)
    return [(f"layers.{idx}.{mapped}.{kind}", None)] if mapped else []


def _moe_targets(t: GGUFTensor, config: ModelConfig, path: Path):
    """A sparse layer's tensor -> [(tokenmill name, the GGUFTensor it reads)], or None
    when `t` is not one. A 3-D expert tensor [E, rows, cols] gives one 2-D slice per
    expert (its bytes are contiguous in the file: quantized rows stay as stored); the
    shared expert's gate, [d] in llama.cpp's files, reads as the [1, d] linear it is."""
    stem, _, kind = t.name.rpartition(".")
    if not stem.startswith("blk.") or stem.count(".") != 2:
        return None
    _, idx, part = stem.split(".")
    if part in _MOE_NAMES:
        if part == "ffn_gate_inp_shexp" and len(t.shape) == 1:
            t = GGUFTensor(
                t.name, (1, *t.shape), t.tensor_type, t.data_offset, t.n_bytes, t.data[None]
            )
        return [(f"layers.{idx}.mlp.{_MOE_NAMES[part]}.{kind}", t)]
    if part not in _EXPERT_NAMES:
        return None
    experts, projections = config.num_experts, _EXPERT_NAMES[part]
    # a weight [E, rows, cols]; a bias (gpt-oss) [E, rows]; rows: the projections stacked
    dims = "rows" if kind == "bias" else "rows, cols"
    if (
        len(t.shape) != (2 if kind == "bias" else 3)
        or t.shape[0] != experts
        or t.shape[1] % len(projections)
    ):
        raise LoadError(
            path,
            f"tensor {t.name}: shape {t.shape} is not [{experts} experts, {dims}] "
            f"({config.arch}.expert_count is {experts})",
        )
    rows = t.shape[1] // len(projections)
    n_bytes = t.n_bytes // experts // len(projections)  # one projection of one expert
    return [
        (
            f"layers.{idx}.mlp.experts.{j}.{p}.{kind}",
            GGUFTensor(
                f"{t.name}[expert {j}]" + (f"[{p}]" if len(projections) > 1 else ""),
                (rows, *t.shape[2:]),
                t.tensor_type,
                t.data_offset + (j * len(projections) + h) * n_bytes,
                n_bytes,
                # [rows, cols] floats, [rows, bytes per row] blocks, or [rows] (a bias)
                t.data[j][h * rows : (h + 1) * rows],
            ),
        )
        for j in range(experts)
        for h, p in enumerate(projections)
    ]


def _targets(t: GGUFTensor, config: ModelConfig, path: Path):
    """[(tokenmill name, part, the GGUFTensor it reads)] for one tensor of the file."""
    if config.num_experts and (moe := _moe_targets(t, config, path)) is not None:
        return [(target, None, view) for target, view in moe]
    return [(target, part, t) for target, part in _target_name(t.name, config.arch)]


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: rows [h, d/2, 2] -> [h, 2, d/2]."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_tensor(t, path: Path) -> np.ndarray:
    """Dequantize one GGUF tensor to float32 numpy, shaped [rows, cols] (numpy order)."""
    if t.tensor_type not in SUPPORTED_TYPES:
        raise LoadError(
            path, f"tensor {t.name}: unsupported quantization type {t.tensor_type.name}"
        )
    shape = t.shape
    try:
        if t.tensor_type == GGMLQuantizationType.F32:
            data = np.asarray(t.data, dtype=np.float32)
        elif t.tensor_type == GGMLQuantizationType.F16:
            data = np.asarray(t.data).astype(np.float32)
        else:
            data = dequantize(np.asarray(t.data), t.tensor_type)
        return data.reshape(shape)
    except ValueError as e:
        raise LoadError(path, f"tensor {t.name}: data does not fit shape {shape} ({e})") from None


def open_gguf(path: Path) -> Checkpoint:
    try:
        reader = open_gguf_file(path)
    except GGUFFormatError as e:
        raise LoadError(path, str(e).removeprefix(f"{path}: ")) from None
    try:
        config = _config(reader, path)
    except ConfigError as e:
        raise LoadError(path, str(e)) from None
    tensors, raw, shapes, by_target = {}, {}, {}, {}
    for t in reader.tensors:  # the reader checked each lies inside the file
        targets = _targets(t, config, path)
        if targets and t.tensor_type not in SUPPORTED_TYPES:
            raise LoadError(
                path, f"tensor {t.name}: unsupported quantization type {t.tensor_type.name}"
            )
        for target, part, view in targets:  # view: t, or the part of t the target reads
            tensors[target] = _gguf_loader(view, path, config, target, part)
            raw[target] = _raw_loader(view, path, config, target, part)
            if config.arch == "phi3" and part is not None:
                start, stop = phi3_rows(path, t.name, tuple(t.shape), config, part)
                shapes[target] = (stop - start, *t.shape[1:])
            else:
                shapes[target] = part_shape(path, t.name, view.shape, part)
            by_target[target] = view  # release: an expert's own bytes
    ckpt = Checkpoint(
        path,
        "gguf",
        config,
        tensors,
        raw=raw,
        shapes=shapes,
        release=lambda n: reader.release(by_target[n]),
        release_view=reader.release_view,
    )
    check_checkpoint(ckpt, layer_key=f"{config.arch}.block_count")
    return ckpt


def _rows_in_our_order(
    w: np.ndarray, config: ModelConfig, target: str, part: str | None, path: Path
) -> np.ndarray:
    """Split fused QKV rows and undo llama.cpp's Q/K row permutation. Works on dequantized
    floats and on raw block bytes alike: both only move whole rows."""
    if part is not None and config.arch == "phi3":  # attn_qkv [q; k; v], ffn_up [gate; up]
        start, stop = phi3_rows(path, target, w.shape, config, part)
        w = w[start:stop]
    elif part is not None:
        w = np.split(w, 3, axis=0)[("q", "k", "v").index(part)]
    if config.arch in _PERMUTED_QK:
        if target.endswith("attn.q.weight"):
            w = _unpermute(w, config.num_heads)
        elif target.endswith("attn.k.weight"):
            w = _unpermute(w, config.num_kv_heads)
    return w


def _gguf_loader(t, path: Path, config: ModelConfig, target: str, part: str | None):
    def load() -> torch.Tensor:
        w = _rows_in_our_order(read_tensor(t, path), config, target, part, path)
        w = np.ascontiguousarray(w)
        return torch.from_numpy(w if w.flags.writeable else w.copy())

    return load


def _raw_loader(t, path: Path, config: ModelConfig, target: str, part: str | None):
    def load() -> tuple:
        if t.tensor_type not in SUPPORTED_TYPES:
            raise LoadError(
                path, f"tensor {t.name}: unsupported quantization type {t.tensor_type.name}"
            )
        data = np.asarray(t.data)
        if data.ndim == 1:
            data = data.reshape(1, -1)
        return t.tensor_type, _rows_in_our_order(data, config, target, part, path)

    return load
