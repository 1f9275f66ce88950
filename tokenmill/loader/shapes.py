"""The checkpoint tensors a config implies: the names the loaders produce (see
models/transformer.py's docstring) with the shape each must have.

Computed from the config alone, so loader/checks.py checks a file against it before any
model is built, without importing the model; tests/test_loader.py checks it against a
model built on the meta device, so the two cannot drift apart.
"""

from __future__ import annotations

from tokenmill.config import ModelConfig


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors Transformer(cfg) loads, by name, with the shape each must have
    (before fusing: q, k and v apart, gate and up apart)."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    norm = ("weight", "bias") if cfg.norm == "layer" else ("weight",)

    def linear(name: str, rows: int, cols: int, bias: bool) -> dict[str, tuple[int, ...]]:
        return {f"{name}.weight": (rows, cols), **({f"{name}.bias": (rows,)} if bias else {})}

    shapes = {"embed.weight": (cfg.vocab_size, d)}
    if cfg.position == "learned":
        shapes["pos_embed.weight"] = (cfg.max_position, d)
    for i in range(cfg.num_layers):
        layer = f"layers.{i}."
        norms = ["attn_norm", "mlp_norm"] if cfg.pre_norm else []  # OLMo 2: post-norms only
        if cfg.sandwich_norm:
            norms += ["post_attn_norm", "post_mlp_norm"]
        shapes.update({f"{layer}{n}.{kind}": (d,) for n in norms for kind in norm})
        shapes.update(linear(f"{layer}attn.q", cfg.q_size, d, cfg.qkv_bias))
        shapes.update(linear(f"{layer}attn.k", cfg.kv_size, d, cfg.qkv_bias))
        shapes.update(linear(f"{layer}attn.v", cfg.kv_size, d, cfg.qkv_bias))
        shapes.update(linear(f"{layer}attn.o", d, cfg.q_size, cfg.o_bias))
        if cfg.attn_sinks:
            shapes[f"{layer}attn.sinks"] = (cfg.num_heads,)
        if cfg.qk_norm:
            q_dim, k_dim = (cfg.q_size, cfg.kv_size) if cfg.qk_norm == "full" else (hd, hd)
            shapes.update(
                {f"{layer}attn.q_norm.weight": (q_dim,), f"{layer}attn.k_norm.weight": (k_dim,)}
            )
        if cfg.moe_layers[i]:
            shapes.update(moe_shapes(cfg, f"{layer}mlp."))
            continue
        if cfg.mlp == "gated":
            shapes.update(linear(f"{layer}mlp.gate", f, d, cfg.mlp_bias))
        shapes.update(linear(f"{layer}mlp.up", f, d, cfg.mlp_bias))
        shapes.update(linear(f"{layer}mlp.down", d, f, cfg.mlp_bias))
    shapes.update({f"final_norm.{kind}": (d,) for kind in norm})
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


def moe_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """One sparse layer's tensors (layers/moe.py): the router [E, d], each expert's gated
    MLP (gate, up [fe, d], down [d, fe], with biases for gpt-oss), and Qwen2-MoE's shared
    expert with its gate [1, d]."""
    d, fe, fs = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    shapes = {f"{prefix}router.weight": (cfg.num_experts, d)}
    if cfg.router_bias:
        shapes[f"{prefix}router.bias"] = (cfg.num_experts,)
    mlps = [(f"experts.{j}", fe) for j in range(cfg.num_experts)]
    if fs:
        mlps.append(("shared", fs))
        if cfg.shared_expert_gate:  # Granite's shared expert has none
            shapes[f"{prefix}shared_gate.weight"] = (1, d)
    for name, f in mlps:
        shapes[f"{prefix}{name}.gate.weight"] = (f, d)
        shapes[f"{prefix}{name}.up.weight"] = (f, d)
        shapes[f"{prefix}{name}.down.weight"] = (d, f)
        if cfg.mlp_bias:  # gpt-oss's experts
            shapes.update({f"{prefix}{name}.{p}.bias": (f,) for p in ("gate", "up")})
            shapes[f"{prefix}{name}.down.bias"] = (d,)
    return shapes
