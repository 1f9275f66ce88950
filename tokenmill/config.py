"""ModelConfig: one description that configures the single transformer for every family.

The families tokenmill runs differ in a handful of switches (norm type, MLP type,
position encoding, biases, Q/K norms, sandwich norms, sliding windows), not in
structure. Loaders (HF `config.json`, GGUF metadata) fill this dataclass; the model
reads only this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A checkpoint's configuration names something tokenmill cannot run."""


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
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k
    sandwich_norm: bool = False  # Gemma 3: norms after attention and after the MLP too
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # softmax scale; None means 1/sqrt(head_dim)
    final_logit_softcap: float | None = None
    tie_embeddings: bool = True

    sliding_window: int | None = None
    # Per layer: "full" or "sliding". Empty means all full.
    layer_types: list[str] = field(default_factory=list)

    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full"] * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.attn_scale is None:
            self.attn_scale = 1.0 / math.sqrt(self.head_dim)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes the KV cache holds per token, over all layers (K and V)."""
        return 2 * self.num_layers * self.kv_size * element_size


# ---------------------------------------------------------------------------
# Hugging Face config.json (transformers 4.x and 5.x spellings)
# ---------------------------------------------------------------------------

HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3", "gpt2")


def _rope_from_params(p: dict[str, Any], default_theta: float, max_pos: int) -> RopeConfig:
    kind = p.get("rope_type") or p.get("type") or "default"
    rope = RopeConfig(theta=float(p.get("rope_theta", default_theta)))
    if kind == "default":
        return rope
    if kind == "linear":
        rope.scaling, rope.factor = "linear", float(p["factor"])
        return rope
    if kind == "llama3":
        rope.scaling = "llama3"
        rope.factor = float(p["factor"])
        rope.low_freq_factor = float(p.get("low_freq_factor", 1.0))
        rope.high_freq_factor = float(p.get("high_freq_factor", 4.0))
        rope.original_max_position = int(p.get("original_max_position_embeddings", max_pos))
        return rope
    raise ConfigError(
        f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)"
    )


def from_hf_config(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a parsed HF `config.json`."""
    model_type = cfg.get("model_type", "")
    if model_type == "gemma3" and "text_config" in cfg:  # multimodal wrapper: take the text part
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    if model_type not in HF_FAMILIES:
        raise ConfigError(
            f"unsupported architecture {model_type!r} (supported: {', '.join(HF_FAMILIES)})"
        )
    if model_type == "gpt2":
        return _gpt2_config(cfg)

    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    max_pos = cfg.get("max_position_embeddings", 4096)
    # 5.x: rope_parameters (per layer type for Gemma 3); 4.x: rope_theta + rope_scaling.
    params = cfg.get("rope_parameters")
    local_params = None
    if isinstance(params, dict) and "full_attention" in params:
        local_params = params.get("sliding_attention")
        params = params["full_attention"]
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope = _rope_from_params(params, 10000.0, max_pos)
    eos = cfg.get("eos_token_id")
    common = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_position=max_pos,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope=rope,
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos if isinstance(eos, list) else ([eos] if eos is not None else []),
    )
    if model_type in ("llama", "mistral"):
        window = cfg.get("sliding_window") if model_type == "mistral" else None
        return ModelConfig(
            arch=model_type,
            qkv_bias=cfg.get("attention_bias", False),
            o_bias=cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            sliding_window=window,
            layer_types=["sliding" if window else "full"] * cfg["num_hidden_layers"],
            **common,
        )
    if model_type in ("qwen2", "qwen3"):
        layer_types = [
            "sliding" if t == "sliding_attention" else "full"
            for t in cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
        ]
        window = cfg.get("sliding_window") if "sliding" in layer_types else None
        return ModelConfig(
            arch=model_type,
            qkv_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            layer_types=layer_types,
            **common,
        )
    # Gemma 3 (text).
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if not types:
        pattern = cfg.get("sliding_window_pattern", 6)
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
        ]
    if local_params is None:
        local_params = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "gelu_pytorch_tanh")
    return ModelConfig(
        arch="gemma3",
        mlp="gated",
        activation="gelu_tanh" if "tanh" in act else "gelu",
        qk_norm=True,
        sandwich_norm=True,
        embed_scale=math.sqrt(hidden),
        attn_scale=cfg.get("query_pre_attn_scalar", head_dim) ** -0.5,
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        sliding_window=cfg.get("sliding_window"),
        layer_types=["sliding" if t == "sliding_attention" else "full" for t in types],
        rope_local=_rope_from_params(local_params, 10000.0, common["max_position"]),
        **{**common, "tie_embeddings": cfg.get("tie_word_embeddings", True)},
    )


def _gpt2_config(cfg: dict[str, Any]) -> ModelConfig:
    hidden = cfg["n_embd"]
    heads = cfg["n_head"]
    act = cfg.get("activation_function", "gelu_new")
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        arch="gpt2",
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg.get("n_inner") or 4 * hidden,
        num_layers=cfg["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_position=cfg.get("n_positions", 1024),
        norm="layer",
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        mlp="plain",
        activation="gelu_tanh" if act in ("gelu_new", "gelu_pytorch_tanh") else "gelu",
        position="learned",
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        tie_embeddings=cfg.get("tie_word_embeddings", True),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=[eos] if eos is not None else [],
    )
