"""Hugging Face `config.json` -> ModelConfig (transformers 4.x and 5.x spellings), beside
its loader (loader/hf_folder.py); GGUF metadata is read in loader/gguf_file.py. Every
value is checked (type, range) and named by its own key when wrong."""

from __future__ import annotations

import math
from typing import Any

from tokenmill.checks import short_repr
from tokenmill.config import (
    MAX_EXPERTS,
    MAX_SIZES,
    ConfigError,
    ModelConfig,
    RopeConfig,
    check_float,
    check_int,
)

# Mixture-of-experts families (layers/moe.py), read by _moe_config.
MOE_FAMILIES = (
    *("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss"),
    *("granitemoe", "granitemoeshared"),
)
# the newer dense families, each read by _dense_family below
DENSE_FAMILIES = ("phi3", "gemma2", "olmo2", "smollm3", "granite")
HF_FAMILIES = (
    *("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3", "gpt2"),
    *MOE_FAMILIES,
    *DENSE_FAMILIES,
)

REQUIRED = object()  # a read's default: the key must be there


class ConfigFields:
    """Checked reads of a parsed config.json: each names the JSON key when its value is
    missing or of the wrong type, so a hostile file gets a ConfigError, never a TypeError."""

    def __init__(
        self, cfg: Any, where: str = "config.json", missing: str = "missing field {key!r}"
    ):
        if not isinstance(cfg, dict):
            raise ConfigError(f"{where} must hold a JSON object, not {type(cfg).__name__}")
        self.cfg = cfg
        self.missing = missing  # the message for a required key that is absent

    def raw(self, key: str, default: Any = REQUIRED) -> Any:
        """The key's value; its default when absent or null (configs write null for
        "unset"); ConfigError when a key without a default is either."""
        value = self.cfg.get(key)
        if value is None:
            if default is REQUIRED:
                raise ConfigError(self.missing.format(key=key))
            return default
        return value

    def int(self, key: str, default: Any = REQUIRED, *, lo: int = 1, hi: int | None = None):
        value = self.raw(key, default)
        return None if value is None else check_int(key, value, lo, hi)

    def float(self, key: str, default: Any = REQUIRED, *, lo: float = 0.0, lo_open=False):
        value = self.raw(key, default)
        return None if value is None else check_float(key, value, lo, lo_open=lo_open)

    def bool(self, key: str, default: bool) -> bool:
        value = self.raw(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {short_repr(value)}")
        return value

    def str(self, key: str, default: Any = REQUIRED) -> str | None:
        value = self.raw(key, default)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {short_repr(value)}")
        return value

    def dict(self, key: str) -> dict | None:
        value = self.raw(key, None)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{key} must be a JSON object, got {short_repr(value)}")
        return value

    def ids(self, key: str) -> list[int]:
        """A token id or a list of them (eos_token_id's two spellings)."""
        value = self.raw(key, None)
        if value is None:
            return []
        values = value if isinstance(value, list) else [value]
        return [check_int(key, v, 0) for v in values]

    def names(self, key: str, count: int) -> list[str] | None:
        """A list of `count` strings (layer_types), or None when absent."""
        value = self.raw(key, None)
        if value is None or value == []:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key} must be a list of strings, got {short_repr(value)}")
        if len(value) != count:
            raise ConfigError(f"{key} has {len(value)} entries for {count} layers")
        return value


def _rope_from_params(p: dict[str, Any], default_theta: float, max_pos: int) -> RopeConfig:
    f = ConfigFields(p, "rope parameters")
    kind = f.str("rope_type", None) or f.str("type", None) or "default"
    rope = RopeConfig(theta=f.float("rope_theta", default_theta, lo_open=True))
    if kind == "default":
        return rope
    if kind == "linear":
        rope.scaling, rope.factor = "linear", f.float("factor", lo_open=True)
        return rope
    if kind == "llama3":
        rope.scaling = "llama3"
        rope.factor = f.float("factor", lo_open=True)
        rope.low_freq_factor = f.float("low_freq_factor", 1.0, lo_open=True)
        rope.high_freq_factor = f.float("high_freq_factor", 4.0, lo_open=True)
        rope.original_max_position = f.int(
            "original_max_position_embeddings", max_pos, hi=MAX_SIZES["max_position"]
        )
        return rope
    if kind in ("longrope", "su"):  # Phi-3 / Phi-4 ("su" is its first name)
        return _longrope(f, rope, max_pos)
    if kind == "yarn":
        return _yarn(f, rope, max_pos)
    raise ConfigError(
        f"unsupported rope scaling type {short_repr(kind)} "
        "(supported: default, linear, llama3, longrope, yarn)"
    )


def _yarn(f: ConfigFields, rope: RopeConfig, max_pos: int) -> RopeConfig:
    """YaRN's fields, with transformers' defaults: the factor max_position /
    original_max_position, beta_fast 32 and beta_slow 1, truncate true, and the attention
    factor 0.1 ln(factor) + 1 (DeepSeek's mscale / mscale_all_dim ratio when both are set;
    1 when the factor is at most 1)."""
    rope.scaling = "yarn"
    orig = f.int("original_max_position_embeddings", max_pos, hi=MAX_SIZES["max_position"])
    rope.original_max_position = orig
    rope.factor = f.float("factor", None, lo_open=True) or max_pos / orig
    rope.beta_fast = f.float("beta_fast", None, lo_open=True) or 32.0
    rope.beta_slow = f.float("beta_slow", None, lo_open=True) or 1.0
    rope.truncate = f.bool("truncate", True)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = f.float("mscale", None), f.float("mscale_all_dim", None)
    default = mscale(rope.factor, m) / mscale(rope.factor, m_all) if m and m_all else None
    rope.attention_factor = f.float(
        "attention_factor", default or mscale(rope.factor), lo_open=True
    )
    return rope


def _longrope(f: ConfigFields, rope: RopeConfig, max_pos: int) -> RopeConfig:
    """LongRoPE's factors and its attention factor, as transformers computes them: the
    factor defaults to max_position / original_max_position, and the attention factor to
    sqrt(1 + ln(factor) / ln(original_max_position)) (1 when the factor is at most 1)."""
    rope.scaling = "longrope"
    orig = f.int("original_max_position_embeddings", hi=MAX_SIZES["max_position"])
    rope.original_max_position = orig
    for kind in ("short_factor", "long_factor"):
        factors = f.raw(kind)
        if not isinstance(factors, list):
            raise ConfigError(f"{kind} must be a list of numbers, got {short_repr(factors)}")
        setattr(rope, kind, [check_float(kind, v, 0.0, lo_open=True) for v in factors])
    factor = f.float("factor", max_pos / orig, lo_open=True)
    default = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    rope.attention_factor = f.float("attention_factor", default, lo_open=True)
    return rope


def from_hf_config(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a parsed HF `config.json`; ConfigError for anything a real
    checkpoint would not hold (wrong types, zero or absurd sizes), naming the key."""
    f = ConfigFields(cfg)
    model_type = f.str("model_type", "")
    if model_type == "gemma3" and "text_config" in cfg:  # multimodal wrapper: take the text part
        f = ConfigFields({**ConfigFields(f.raw("text_config"), "text_config").cfg}, "text_config")
        f.cfg["model_type"] = model_type = "gemma3_text"
    if model_type not in HF_FAMILIES:
        raise ConfigError(
            f"unsupported architecture {short_repr(model_type)} (supported: {', '.join(HF_FAMILIES)})"
        )
    if model_type == "gpt2":
        return _gpt2_config(f)

    hidden = f.int("hidden_size", hi=MAX_SIZES["hidden_size"])
    heads = f.int("num_attention_heads", hi=MAX_SIZES["num_heads"])
    layers = f.int("num_hidden_layers", hi=MAX_SIZES["num_layers"])
    head_dim = f.int("head_dim", None, hi=MAX_SIZES["head_dim"]) or hidden // heads
    max_pos = f.int("max_position_embeddings", 4096, hi=MAX_SIZES["max_position"])
    # 5.x: rope_parameters (per layer type for Gemma 3); 4.x: rope_theta + rope_scaling.
    params = f.dict("rope_parameters")
    local_params = None
    if params is not None and "full_attention" in params:
        local_params = ConfigFields(params, "rope_parameters").dict("sliding_attention")
        params = ConfigFields(params, "rope_parameters").dict("full_attention") or {}
    if params is None:
        params = dict(f.dict("rope_scaling") or {})
        params.setdefault("rope_theta", f.raw("rope_theta", 10000.0))
    if model_type == "phi3":  # 4.x keeps these beside rope_scaling, not inside it
        params = dict(params)
        for key in ("original_max_position_embeddings", "partial_rotary_factor"):
            if f.raw(key, None) is not None:
                params.setdefault(key, f.raw(key))
    rope = _rope_from_params(params, 10000.0, max_pos)
    common = dict(
        vocab_size=f.int("vocab_size", hi=MAX_SIZES["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size", hi=MAX_SIZES["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=f.int("num_key_value_heads", None, hi=MAX_SIZES["num_kv_heads"]) or heads,
        head_dim=head_dim,
        max_position=max_pos,
        norm_eps=f.float("rms_norm_eps", 1e-6),
        rope=rope,
        tie_embeddings=f.bool("tie_word_embeddings", False),
        bos_token_id=f.int("bos_token_id", None, lo=0),
        eos_token_ids=f.ids("eos_token_id"),
    )
    if model_type in MOE_FAMILIES:
        return _moe_config(f, model_type, common)
    if model_type in DENSE_FAMILIES:
        return _dense_family(f, model_type, params, common)
    if model_type in ("llama", "mistral"):
        window = f.int("sliding_window", None) if model_type == "mistral" else None
        return ModelConfig(
            arch=model_type,
            qkv_bias=f.bool("attention_bias", False),
            o_bias=f.bool("attention_bias", False),
            mlp_bias=f.bool("mlp_bias", False),
            sliding_window=window,
            layer_types=["sliding" if window else "full"] * layers,
            **common,
        )
    if model_type in ("qwen2", "qwen3"):
        layer_types = [
            "sliding" if t == "sliding_attention" else "full"
            for t in f.names("layer_types", layers) or ["full_attention"] * layers
        ]
        window = f.int("sliding_window", None) if "sliding" in layer_types else None
        return ModelConfig(
            arch=model_type,
            qkv_bias=model_type == "qwen2" or f.bool("attention_bias", False),
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            layer_types=layer_types,
            **common,
        )
    # Gemma 3 (text).
    types = f.names("layer_types", layers)
    if not types:
        pattern = f.int("sliding_window_pattern", 6)
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ]
    if local_params is None:
        local_params = {"rope_theta": f.raw("rope_local_base_freq", 10000.0)}
    act = f.str("hidden_activation", None) or f.str("hidden_act", "gelu_pytorch_tanh")
    return ModelConfig(
        arch="gemma3",
        mlp="gated",
        activation="gelu_tanh" if "tanh" in act else "gelu",
        qk_norm=True,
        sandwich_norm=True,
        embed_scale=math.sqrt(hidden),
        attn_scale=f.float("query_pre_attn_scalar", head_dim, lo_open=True) ** -0.5,
        final_logit_softcap=f.float("final_logit_softcapping", None, lo_open=True),
        sliding_window=f.int("sliding_window", None),
        layer_types=["sliding" if t == "sliding_attention" else "full" for t in types],
        rope_local=_rope_from_params(local_params, 10000.0, max_pos),
        **{**common, "tie_embeddings": f.bool("tie_word_embeddings", True)},
    )


def _layer_types(f: ConfigFields, layers: int, default: list[str]) -> list[str]:
    """layer_types as ModelConfig spells them ("sliding" / "full")."""
    names = f.names("layer_types", layers) or default
    return ["sliding" if t == "sliding_attention" else "full" for t in names]


def _dense_family(f: ConfigFields, model_type: str, params: dict, common: dict) -> ModelConfig:
    """Phi-3/Phi-4, Gemma 2, OLMo 2, SmolLM3 and Granite 3: the Llama block with the
    switches each family adds (see ModelConfig)."""
    layers, hidden, head_dim = common["num_layers"], common["hidden_size"], common["head_dim"]
    bias = f.bool("attention_bias", False)
    if model_type == "phi3":
        # fused qkv_proj / gate_up_proj are split at load (loader/hf_folder.py)
        partial = ConfigFields(params, "rope parameters").float(
            "partial_rotary_factor", 1.0, lo_open=True
        )
        if partial < 1.0:
            common["rope"].dim = int(head_dim * partial)
        window = f.int("sliding_window", None)
        return ModelConfig(
            arch="phi3",
            sliding_window=window,
            layer_types=["sliding" if window else "full"] * layers,
            **common,
        )
    if model_type == "gemma2":
        act = f.str("hidden_activation", None) or f.str("hidden_act", "gelu_pytorch_tanh")
        alternating = ["sliding_attention", "full_attention"] * layers
        types = _layer_types(f, layers, alternating[:layers])
        return ModelConfig(
            arch="gemma2",
            activation="gelu_tanh" if "tanh" in act else "gelu",
            sandwich_norm=True,
            embed_scale=math.sqrt(hidden),
            attn_scale=f.float("query_pre_attn_scalar", head_dim, lo_open=True) ** -0.5,
            attn_logit_softcap=f.float("attn_logit_softcapping", None, lo_open=True),
            final_logit_softcap=f.float("final_logit_softcapping", None, lo_open=True),
            sliding_window=f.int("sliding_window", None) if "sliding" in types else None,
            layer_types=types,
            qkv_bias=bias,
            o_bias=bias,
            **{**common, "tie_embeddings": f.bool("tie_word_embeddings", True)},
        )
    if model_type == "olmo2":
        return ModelConfig(
            arch="olmo2",
            qk_norm="full",
            pre_norm=False,
            sandwich_norm=True,
            qkv_bias=bias,
            o_bias=bias,
            **common,
        )
    if model_type == "smollm3":
        # no_rope_layers[i]: 1 where layer i uses RoPE, 0 for a NoPE layer
        interval = f.int("no_rope_layer_interval", 4)
        flags = f.raw("no_rope_layers", [int((i + 1) % interval != 0) for i in range(layers)])
        if (
            not isinstance(flags, list)
            or len(flags) != layers
            or any(v not in (0, 1) for v in flags)
        ):
            raise ConfigError(
                f"no_rope_layers must be {layers} entries of 0 or 1, got {short_repr(flags)}"
            )
        types = _layer_types(f, layers, ["full_attention"] * layers)
        return ModelConfig(
            arch="smollm3",
            rope_layers=[bool(v) for v in flags],
            sliding_window=f.int("sliding_window", None) if "sliding" in types else None,
            layer_types=types,
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=f.bool("mlp_bias", False),
            **common,
        )
    # Granite 3
    return ModelConfig(
        arch="granite",
        **_granite_scales(f),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=f.bool("mlp_bias", False),
        **common,
    )


def _granite_scales(f: ConfigFields) -> dict[str, float]:
    """Granite's four multipliers (Granite 3 and Granite-MoE) as ModelConfig's scales."""
    return dict(
        embed_scale=f.float("embedding_multiplier", 1.0, lo_open=True),
        # transformers' GraniteConfig defaults the multiplier to 1.0, not 1/sqrt(head_dim)
        attn_scale=f.float("attention_multiplier", 1.0, lo_open=True),
        residual_scale=f.float("residual_multiplier", 1.0, lo_open=True),
        logit_scale=1.0 / f.float("logits_scaling", 1.0, lo_open=True),
    )


def _gpt2_config(f: ConfigFields) -> ModelConfig:
    hidden = f.int("n_embd", hi=MAX_SIZES["hidden_size"])
    heads = f.int("n_head", hi=MAX_SIZES["num_heads"])
    act = f.str("activation_function", "gelu_new")
    eos = f.ids("eos_token_id")
    return ModelConfig(
        arch="gpt2",
        vocab_size=f.int("vocab_size", hi=MAX_SIZES["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=f.int("n_inner", None, hi=MAX_SIZES["intermediate_size"]) or 4 * hidden,
        num_layers=f.int("n_layer", hi=MAX_SIZES["num_layers"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_position=f.int("n_positions", 1024, hi=MAX_SIZES["max_position"]),
        norm="layer",
        norm_eps=f.float("layer_norm_epsilon", 1e-5),
        mlp="plain",
        activation="gelu_tanh" if act in ("gelu_new", "gelu_pytorch_tanh") else "gelu",
        position="learned",
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        tie_embeddings=f.bool("tie_word_embeddings", True),
        bos_token_id=f.int("bos_token_id", None, lo=0),
        eos_token_ids=eos[:1],
    )


def _gpt_oss(f: ConfigFields) -> dict[str, Any]:
    """gpt-oss's switches: the router's top k logits then a softmax over them (with a
    bias), experts with biases and the clamped SwiGLU, and a sink logit per head."""
    return dict(
        router="topk_softmax",
        router_bias=True,
        mlp_bias=True,
        swiglu_limit=f.float("swiglu_limit", 7.0, lo_open=True),
        swiglu_alpha=f.float("swiglu_alpha", 1.702, lo_open=True),
        attn_sinks=True,
    )


def _moe_config(f: ConfigFields, model_type: str, common: dict[str, Any]) -> ModelConfig:
    """Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, gpt-oss and Granite-MoE: a Llama-style block
    whose MLP is the MoE of layers/moe.py in the sparse layers."""
    layers = common["num_layers"]
    # transformers writes either spelling (its attribute_map aliases them), per version
    key = "num_experts" if f.raw("num_experts", None) is not None else "num_local_experts"
    experts = f.int(key, hi=MAX_EXPERTS)
    if model_type in ("mixtral", "olmoe", "gpt_oss", "granitemoe", "granitemoeshared"):
        # every layer sparse; the experts' width is intermediate_size
        moe_layers = [True] * layers
        moe_size = common["intermediate_size"]
    else:
        step = f.int("decoder_sparse_step", 1)
        only = f.raw("mlp_only_layers", [])
        if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
            raise ConfigError(
                f"mlp_only_layers must be a list of layer numbers, got {short_repr(only)}"
            )
        moe_layers = [i not in only and (i + 1) % step == 0 for i in range(layers)]
        moe_size = f.int("moe_intermediate_size", hi=MAX_SIZES["intermediate_size"])
    moe = dict(
        num_experts=experts,
        num_experts_per_tok=f.int("num_experts_per_tok"),
        moe_intermediate_size=moe_size,
        # Mixtral always renormalizes the top k; the others say so in the config
        norm_topk_prob=model_type == "mixtral" or f.bool("norm_topk_prob", False),
        moe_layers=moe_layers,
    )
    if model_type == "qwen2_moe":
        moe["shared_expert_intermediate_size"] = f.int(
            "shared_expert_intermediate_size", 0, lo=0, hi=MAX_SIZES["intermediate_size"]
        )
    granite = model_type.startswith("granitemoe")
    if granite:  # Granite's multipliers; the top k logits then a softmax over them
        moe.update(_granite_scales(f), router="topk_softmax", shared_expert_gate=False)
    if model_type == "granitemoeshared":  # a shared expert added without a gate
        moe["shared_expert_intermediate_size"] = f.int(
            "shared_intermediate_size", 0, lo=0, hi=MAX_SIZES["intermediate_size"]
        )
    if model_type == "olmoe" and f.raw("clip_qkv", None) is not None:
        raise ConfigError("clip_qkv is not supported (OLMoE checkpoints released without it)")
    if model_type == "qwen2_moe":
        types = f.names("layer_types", layers) or ["full_attention"] * layers
        layer_types = ["sliding" if t == "sliding_attention" else "full" for t in types]
    elif model_type == "qwen3_moe":
        sliding = f.bool("use_sliding_window", False) and f.raw("sliding_window", None) is not None
        layer_types = ["sliding" if sliding else "full"] * layers
    elif model_type == "mixtral":
        layer_types = ["sliding" if f.raw("sliding_window", None) else "full"] * layers
    elif model_type == "gpt_oss":  # alternating, sliding first, unless the config lists them
        layer_types = _layer_types(
            f,
            layers,
            ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        )
        moe.update(_gpt_oss(f))
    else:
        layer_types = ["full"] * layers
    window = f.int("sliding_window", None) if "sliding" in layer_types else None
    # attention_bias: q, k, v and o (Qwen3-MoE, OLMoE, gpt-oss); Qwen2-MoE: qkv_bias, no o bias
    bias = model_type != "mixtral" and f.bool("attention_bias", model_type == "gpt_oss")
    return ModelConfig(
        arch=model_type,
        qkv_bias=f.bool("qkv_bias", True) if model_type == "qwen2_moe" else bias,
        o_bias=bias and model_type != "qwen2_moe",
        # Qwen3-MoE: RMSNorm over each head; OLMoE: over the whole q and k projections
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(model_type),
        sliding_window=window,
        layer_types=layer_types,
        **moe,
        **common,
    )
