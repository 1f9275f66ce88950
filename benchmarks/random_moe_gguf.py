"""Write a mixture-of-experts GGUF of a real model's layer shape with random weights.

    python benchmarks/random_moe_gguf.py qwen3-30b-a3b q4_k_m /tmp/qwen3moe.gguf --layers 8
    tokenmill bench --model /tmp/qwen3moe.gguf --peers llamacpp --skip throughput

As benchmarks/random_gguf.py does for dense models (its tensor types per file type, its
random blocks): every tensor has the real model's shape, with fewer layers (--layers) so
that two engines fit in memory at once. Decode reads the attention, the router and the
k chosen experts of each layer, so its speed depends on the layer shape and k, not on
the layer count beyond the per-layer cost. The experts are 3-D tensors
blk.N.ffn_{gate,up,down}_exps [E, rows, cols] (numpy order), the router blk.N.ffn_gate_inp
[E, d] stays F32, and the un-embedding is untied (output Q6_K).

Shapes:
  qwen3-30b-a3b  d 2048, 32 query / 4 K/V heads of 128, per-head Q/K norm, 128 experts
                 of 768, top 8 (48 layers in the real model)
  olmoe-1b-7b    d 2048, 16 heads of 128, Q/K norm over the whole projection, 64 experts
                 of 1024, top 8 (16 layers)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from random_gguf import FILE_TYPES, finish, pick_type, random_blocks  # noqa: E402

SHAPES = {
    "qwen3-30b-a3b": dict(arch="qwen3moe", d=2048, heads=32, kv=4, hd=128, experts=128, fe=768,
                          top=8, vocab=151936, theta=1000000.0, qk_norm="head", layers=48),
    "olmoe-1b-7b": dict(arch="olmoe", d=2048, heads=16, kv=16, hd=128, experts=64, fe=1024,
                        top=8, vocab=50304, theta=10000.0, qk_norm="full", layers=16),
}  # fmt: skip


def write(shape: str, ftype: str, path: Path, layers: int, seed: int = 0) -> None:
    s = SHAPES[shape]
    d, hd, E, fe = s["d"], s["hd"], s["experts"], s["fe"]
    q_rows, kv_rows = s["heads"] * hd, s["kv"] * hd
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), s["arch"])
    w.add_name(f"random {shape} {ftype}, {layers} of {s['layers']} layers")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_feed_forward_length(fe)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(s["top"])
    w.add_expert_feed_forward_length(fe)
    vocab = s["vocab"]
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"▁t{i}" for i in range(3, vocab)])
    w.add_token_scores([0.0] * 3 + [-float(i) for i in range(3, vocab)])
    w.add_token_types([2, 3, 3] + [1] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def matrix(name: str, rows: int, cols: int, role: str, layer: int = 0, n: int = 0) -> None:
        """A [rows, cols] matrix, or n experts' [n, rows, cols], of the file type's type."""
        qtype = pick_type(ftype, role, cols, layer, layers)
        blocks = random_blocks(rng, qtype, rows * max(n, 1), cols)
        w.add_tensor(name, blocks.reshape(n, rows, -1) if n else blocks, raw_dtype=qtype)

    def vector(name: str, shape: tuple[int, ...], scale: float | None = None) -> None:
        data = np.ones(shape, np.float32) if scale is None else rng.standard_normal(shape) * scale
        w.add_tensor(name, data.astype(np.float32))

    matrix("token_embd.weight", vocab, d, "token_embd")
    norm = hd if s["qk_norm"] == "head" else None
    for i in range(layers):
        blk = f"blk.{i}"
        vector(f"{blk}.attn_norm.weight", (d,))
        matrix(f"{blk}.attn_q.weight", q_rows, d, "attn_q", i)
        matrix(f"{blk}.attn_k.weight", kv_rows, d, "attn_k", i)
        matrix(f"{blk}.attn_v.weight", kv_rows, d, "attn_v", i)
        vector(f"{blk}.attn_q_norm.weight", (norm or q_rows,))
        vector(f"{blk}.attn_k_norm.weight", (norm or kv_rows,))
        matrix(f"{blk}.attn_output.weight", d, q_rows, "attn_output", i)
        vector(f"{blk}.ffn_norm.weight", (d,))
        vector(f"{blk}.ffn_gate_inp.weight", (E, d), scale=0.05)  # the router, F32
        matrix(f"{blk}.ffn_gate_exps.weight", fe, d, "ffn_gate", i, n=E)
        matrix(f"{blk}.ffn_up_exps.weight", fe, d, "ffn_up", i, n=E)
        matrix(f"{blk}.ffn_down_exps.weight", d, fe, "ffn_down", i, n=E)
    vector("output_norm.weight", (d,))
    matrix("output.weight", vocab, d, "output")
    finish(w)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("ftype", choices=FILE_TYPES)
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=None, help="default: the real model's")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    layers = args.layers or SHAPES[args.shape]["layers"]
    write(args.shape, args.ftype, args.out, layers, args.seed)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
