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
        if cfg.qk_norm:
            shapes.update(
                {f"{layer}attn.q_norm.weight": (hd,), f"{layer}attn.k_norm.weight": (hd,)}
            )
        if cfg.mlp == "gated":
            shapes.update(linear(f"{layer}mlp.gate", f, d, cfg.mlp_bias))
        shapes.update(linear(f"{layer}mlp.up", f, d, cfg.mlp_bias))
        shapes.update(linear(f"{layer}mlp.down", d, f, cfg.mlp_bias))
    shapes.update({f"final_norm.{kind}": (d,) for kind in norm})
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes
