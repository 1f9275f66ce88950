"""ModelConfig: one description that configures the single transformer for every family.

The families tokenmill runs differ in a handful of switches (norm type, MLP type,
position encoding, biases, Q/K norms, sandwich norms, sliding windows), not in
structure. Loaders fill this dataclass (HF `config.json`: loader/hf_config.py; GGUF
metadata: loader/gguf_file.py); the model reads only this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill import checks
from tokenmill.checks import short_repr


class ConfigError(ValueError):
    """A checkpoint's configuration names something tokenmill cannot run, or holds a number
    no real model has. The message is one line naming the field."""


# The largest value each size may take. Generous (the largest released models sit far
# inside them: hidden 16384, 126 layers, 262k vocabulary, 10M positions); their job is to
# turn a corrupt or hostile number into a clear error before anything is sized from it.
MAX_SIZES = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 20,
    "num_layers": 1 << 10,
    "num_heads": 1 << 10,
    "num_kv_heads": 1 << 10,
    "head_dim": 1 << 12,
    "max_position": 1 << 24,
    "sliding_window": 1 << 24,
}
_CHOICES = {
    "norm": ("rms", "layer"),
    "mlp": ("gated", "plain"),
    "activation": ("silu", "gelu_tanh", "gelu"),
    "position": ("rope", "learned"),
}
_ROPE_SCALINGS = ("default", "linear", "llama3", "longrope", "yarn")


def check_int(name: str, value: Any, lo: int = 1, hi: int | None = None) -> int:
    """checks.check_int raising ConfigError (numpy integers come back as int)."""
    return checks.check_int(name, value, lo, hi, error=ConfigError)


def check_float(
    name: str, value: Any, lo: float, hi: float | None = None, *, lo_open: bool = False
) -> float:
    """checks.check_float raising ConfigError."""
    return checks.check_float(name, value, lo, hi, lo_open=lo_open, error=ConfigError)


@dataclass
class RopeConfig:
    theta: float = 10000.0
    # "default" | "linear" | "llama3"
    scaling: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # Rotary dimensions per head (partial rotary uses fewer than head_dim).
    dim: int | None = None
    # "longrope" (Phi-3, Phi-4; HF's "su"): per-frequency divisors [dim/2], the short ones
    # for positions below original_max_position and the long ones from there on, and
    # cos/sin times attention_factor at every position.
    short_factor: list[float] = field(default_factory=list)
    long_factor: list[float] = field(default_factory=list)
    attention_factor: float = 1.0
    # "yarn" (gpt-oss; YaRN): frequencies blended between interpolated (divided by
    # `factor`) and the plain ones along a ramp between the dimensions that turn
    # beta_fast and beta_slow times over original_max_position; `truncate` rounds the
    # ramp's ends to whole dimensions. cos/sin times attention_factor, as for LongRoPE.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass
class ModelConfig:
    arch: str  # family, e.g. "llama", "qwen3", "gemma3", "gpt2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int = 4096

    norm: str = "rms"  # "rms" | "layer"
    norm_eps: float = 1e-5
    mlp: str = "gated"  # "gated" (SwiGLU / GeGLU) | "plain" (GPT-2: up, act, down)
    activation: str = "silu"  # "silu" | "gelu_tanh" | "gelu"
    position: str = "rope"  # "rope" | "learned"
    rope: RopeConfig = field(default_factory=RopeConfig)
    # Gemma 3: local (sliding-window) layers use their own RoPE base.
    rope_local: RopeConfig | None = None

    qkv_bias: bool = False  # Qwen2, GPT-2
    o_bias: bool = False  # GPT-2
    mlp_bias: bool = False  # GPT-2
    # Q/K RMSNorm before RoPE: None (off), "head" (Qwen3, Gemma 3: over each head's q and k,
    # weights [hd]) or "full" (OLMoE, OLMo 2: over the whole q and k projections, weights
    # [H hd] and [Hkv hd]). True is read as "head", False as None.
    qk_norm: str | None = None
    # ---- Mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) ----
    # num_experts 0: every layer is the dense MLP above. A sparse layer's router picks
    # num_experts_per_tok of num_experts gated MLPs (width moe_intermediate_size) per token
    # and sums their outputs weighted by the router's probabilities.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None  # None: intermediate_size
    # "softmax_topk": softmax over all experts, then the top k (Qwen, Mixtral, OLMoE);
    # "topk_softmax": the top k logits, then softmax over those k.
    router: str = "softmax_topk"
    norm_topk_prob: bool = False  # softmax_topk: rescale the k probabilities to sum to 1
    router_bias: bool = False
    # Qwen2-MoE: one shared expert every token passes through, scaled by a sigmoid gate
    # (a [1, d] linear); 0 means none.
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = True  # False: the shared expert is added ungated (Granite)
    # Per layer: True where the layer is sparse. Empty means every layer when num_experts
    # > 0 (dense layers mixed in: Qwen's mlp_only_layers / decoder_sparse_step).
    moe_layers: list[bool] = field(default_factory=list)
    sandwich_norm: bool = False  # Gemma 3: norms after attention and after the MLP too
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # softmax scale; None means 1/sqrt(head_dim)
    final_logit_softcap: float | None = None
    # ---- the dense families' switches (Gemma 2, OLMo 2, SmolLM3, Granite) ----
    # Gemma 2: attention scores s become cap * tanh(s / cap) before the softmax.
    attn_logit_softcap: float | None = None
    # False (OLMo 2): no norm before each sublayer, only the sandwich norms after it.
    pre_norm: bool = True
    # Per layer: False where the layer has no RoPE (SmolLM3's NoPE layers). Empty: all True.
    rope_layers: list[bool] = field(default_factory=list)
    # Granite: each sublayer's output times residual_scale before its residual add (the
    # model's Block._residual and the fused stack's add_residual; a GGUF's packed o and
    # down weights could not take it folded in).
    residual_scale: float = 1.0
    logit_scale: float = 1.0  # Granite: logits times this (1 / logits_scaling)
    # gpt-oss: a learned logit per query head that joins every softmax of attention as one
    # more "key" with no value (an attention sink: a head can attend to nothing).
    attn_sinks: bool = False
    # gpt-oss's clamped SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit),
    # act = (u + 1) * g * sigmoid(alpha * g). None: the plain gated activation.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    tie_embeddings: bool = True

    sliding_window: int | None = None
    # Per layer: "full" or "sliding". Empty means all full.
    layer_types: list[str] = field(default_factory=list)

    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every number before anything is sized from it: ConfigError naming the first
        bad field. Loaders check the raw values first, under the file's own key names; this
        is the backstop every config passes through."""
        for name, hi in MAX_SIZES.items():
            value = getattr(self, name)
            if value is not None or name != "sliding_window":
                setattr(self, name, check_int(name, value, 1, hi))
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(
                    f"{name} must be one of {', '.join(choices)}, got {short_repr(getattr(self, name))}"
                )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        self.norm_eps = check_float("norm_eps", self.norm_eps, 0.0, 1.0)
        _check_qk_norm(self)
        for name, rope in (("rope", self.rope), ("rope_local", self.rope_local)):
            if rope is not None:
                _check_rope(name, rope, self.head_dim, self.position == "rope")
        self.embed_scale = check_float("embed_scale", self.embed_scale, 0.0, lo_open=True)
        if self.attn_scale is None:
            self.attn_scale = 1.0 / math.sqrt(self.head_dim)
        self.attn_scale = check_float("attn_scale", self.attn_scale, 0.0, lo_open=True)
        if self.final_logit_softcap is not None:
            self.final_logit_softcap = check_float(
                "final_logit_softcap", self.final_logit_softcap, 0.0, lo_open=True
            )
        if not self.layer_types:
            self.layer_types = ["full"] * self.num_layers
        if not isinstance(self.layer_types, list) or len(self.layer_types) != self.num_layers:
            count = len(self.layer_types) if isinstance(self.layer_types, list) else "no"
            raise ConfigError(f"layer_types has {count} entries for {self.num_layers} layers")
        bad = next((t for t in self.layer_types if t not in ("full", "sliding")), None)
        if bad is not None:
            raise ConfigError(
                f"layer_types entries must be 'full' or 'sliding', got {short_repr(bad)}"
            )
        if "sliding" in self.layer_types and self.sliding_window is None:
            raise ConfigError("sliding-window layers need a sliding_window size")
        _check_dense_switches(self)
        _check_moe(self)
        if self.bos_token_id is not None:
            self.bos_token_id = check_int("bos_token_id", self.bos_token_id, 0)
        if not isinstance(self.eos_token_ids, list):
            raise ConfigError(f"eos_token_ids must be a list, got {short_repr(self.eos_token_ids)}")
        self.eos_token_ids = [check_int("eos_token_id", i, 0) for i in self.eos_token_ids]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes the KV cache holds per token, over all layers (K and V)."""
        return 2 * self.num_layers * self.kv_size * element_size

    # The fields that hold one entry per layer: a run of layers (a pipeline stage) keeps
    # its own entries of each.
    PER_LAYER = ("layer_types", "moe_layers", "rope_layers")

    def layers_slice(self, start: int, end: int) -> ModelConfig:
        """The config of layers [start, end) alone (a pipeline stage's model)."""
        lists = {name: list(getattr(self, name)[start:end]) for name in self.PER_LAYER}
        return replace(self, num_layers=end - start, **lists)


def _check_rope(name: str, rope: RopeConfig, head_dim: int, used: bool) -> None:
    rope.theta = check_float(f"{name}.theta", rope.theta, 0.0, lo_open=True)
    if rope.scaling not in _ROPE_SCALINGS:
        raise ConfigError(
            f"{name}.scaling must be one of {', '.join(_ROPE_SCALINGS)}, got {short_repr(rope.scaling)}"
        )
    rope.factor = check_float(f"{name}.factor", rope.factor, 0.0, lo_open=True)
    rope.low_freq_factor = check_float(f"{name}.low_freq_factor", rope.low_freq_factor, 0.0)
    rope.high_freq_factor = check_float(f"{name}.high_freq_factor", rope.high_freq_factor, 0.0)
    if rope.scaling == "llama3" and rope.high_freq_factor <= rope.low_freq_factor:
        raise ConfigError(f"{name}.high_freq_factor must be above low_freq_factor")
    if rope.scaling == "llama3" and rope.low_freq_factor == 0.0:
        raise ConfigError(f"{name}.low_freq_factor must be > 0")
    rope.original_max_position = check_int(
        f"{name}.original_max_position", rope.original_max_position, 1, MAX_SIZES["max_position"]
    )
    if rope.dim is not None:
        rope.dim = check_int(f"{name}.dim", rope.dim, 2, head_dim)
    if used and (head_dim % 2 or (rope.dim or head_dim) % 2):
        raise ConfigError(f"head_dim and rotary dimensions must be even, got {head_dim}")
    rope.attention_factor = check_float(
        f"{name}.attention_factor", rope.attention_factor, 0.0, lo_open=True
    )
    rope.beta_fast = check_float(f"{name}.beta_fast", rope.beta_fast, 0.0, lo_open=True)
    rope.beta_slow = check_float(f"{name}.beta_slow", rope.beta_slow, 0.0, lo_open=True)
    if not isinstance(rope.truncate, bool):
        raise ConfigError(f"{name}.truncate must be true or false, got {short_repr(rope.truncate)}")
    if rope.scaling == "longrope":
        half = (rope.dim or head_dim) // 2
        for kind in ("short_factor", "long_factor"):
            factors = getattr(rope, kind)
            if not isinstance(factors, list) or len(factors) != half:
                count = len(factors) if isinstance(factors, list) else "no"
                raise ConfigError(f"{name}.{kind} has {count} entries for {half} frequencies")
            setattr(
                rope, kind, [check_float(f"{name}.{kind}", v, 0.0, lo_open=True) for v in factors]
            )


def _check_dense_switches(cfg: ModelConfig) -> None:
    """Gemma 2's attention soft-cap, OLMo 2's norm placement, SmolLM3's NoPE layers and
    Granite's multipliers."""
    if cfg.attn_logit_softcap is not None:
        cfg.attn_logit_softcap = check_float(
            "attn_logit_softcap", cfg.attn_logit_softcap, 0.0, lo_open=True
        )
    if not isinstance(cfg.pre_norm, bool):
        raise ConfigError(f"pre_norm must be true or false, got {short_repr(cfg.pre_norm)}")
    if not cfg.pre_norm and not cfg.sandwich_norm:
        raise ConfigError("pre_norm false needs sandwich_norm (a block with no norm at all)")
    if not cfg.rope_layers:
        cfg.rope_layers = [True] * cfg.num_layers
    if (
        not isinstance(cfg.rope_layers, list)
        or len(cfg.rope_layers) != cfg.num_layers
        or not all(isinstance(b, bool) for b in cfg.rope_layers)
    ):
        raise ConfigError(
            f"rope_layers must be {cfg.num_layers} true/false entries, got {short_repr(cfg.rope_layers)}"
        )
    cfg.residual_scale = check_float("residual_scale", cfg.residual_scale, 0.0, lo_open=True)
    if not isinstance(cfg.attn_sinks, bool):
        raise ConfigError(f"attn_sinks must be true or false, got {short_repr(cfg.attn_sinks)}")
    if cfg.swiglu_limit is not None:
        cfg.swiglu_limit = check_float("swiglu_limit", cfg.swiglu_limit, 0.0, lo_open=True)
        if cfg.mlp != "gated":
            raise ConfigError("swiglu_limit needs a gated MLP")
    cfg.swiglu_alpha = check_float("swiglu_alpha", cfg.swiglu_alpha, 0.0, lo_open=True)
    cfg.logit_scale = check_float("logit_scale", cfg.logit_scale, 0.0, lo_open=True)


_ROUTERS = ("softmax_topk", "topk_softmax")
MAX_EXPERTS = 1 << 12  # the largest released MoE models have 256-512 experts


def _check_qk_norm(cfg: ModelConfig) -> None:
    # loaders written before "full" existed pass a bool
    if cfg.qk_norm is True:
        cfg.qk_norm = "head"
    elif cfg.qk_norm is False:
        cfg.qk_norm = None
    if cfg.qk_norm not in (None, "head", "full"):
        raise ConfigError(f"qk_norm must be None, 'head' or 'full', got {short_repr(cfg.qk_norm)}")


def _check_moe(cfg: ModelConfig) -> None:
    """The MoE fields: all zero/empty for a dense model, consistent for a sparse one."""
    cfg.num_experts = check_int("num_experts", cfg.num_experts, 0, MAX_EXPERTS)
    cfg.shared_expert_intermediate_size = check_int(
        "shared_expert_intermediate_size",
        cfg.shared_expert_intermediate_size,
        0,
        MAX_SIZES["intermediate_size"],
    )
    if cfg.router not in _ROUTERS:
        raise ConfigError(
            f"router must be one of {', '.join(_ROUTERS)}, got {short_repr(cfg.router)}"
        )
    for name in ("norm_topk_prob", "router_bias", "shared_expert_gate"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"{name} must be true or false, got {short_repr(getattr(cfg, name))}")
    if not isinstance(cfg.moe_layers, list):
        raise ConfigError(f"moe_layers must be a list, got {short_repr(cfg.moe_layers)}")
    if cfg.num_experts == 0:
        if cfg.moe_layers and any(cfg.moe_layers):
            raise ConfigError("moe_layers marks sparse layers, but num_experts is 0")
        cfg.moe_layers = [False] * cfg.num_layers
        return
    cfg.num_experts_per_tok = check_int(
        "num_experts_per_tok", cfg.num_experts_per_tok, 1, cfg.num_experts
    )
    size = cfg.intermediate_size if cfg.moe_intermediate_size is None else cfg.moe_intermediate_size
    cfg.moe_intermediate_size = check_int(
        "moe_intermediate_size", size, 1, MAX_SIZES["intermediate_size"]
    )
    if cfg.mlp != "gated":
        raise ConfigError("experts must be gated MLPs (mlp='gated')")
    if not cfg.moe_layers:
        cfg.moe_layers = [True] * cfg.num_layers
    if len(cfg.moe_layers) != cfg.num_layers or not all(
        isinstance(b, bool) for b in cfg.moe_layers
    ):
        raise ConfigError(
            f"moe_layers must be {cfg.num_layers} true/false entries, got {short_repr(cfg.moe_layers)}"
        )
