"""Write a mixture-of-experts GGUF of a real model's layer shape with random weights.

    python benchmarks/random_moe_gguf.py qwen3-30b-a3b q4_k_m /tmp/qwen3moe.gguf --layers 8
    tokenmill bench --model /tmp/qwen3moe.gguf --peers llamacpp --skip throughput

`tokenmill bench --shape qwen3-30b-a3b` writes the same file (4 layers unless
--shape-layers says otherwise) into the cache and runs on it. The shapes
(tokenmill/bench/shapes.py MOE): every tensor has the real model's shape, with fewer
layers (--layers) so that two engines fit in memory at once. The experts are 3-D tensors
blk.N.ffn_{gate,up,down}_exps [E, rows, cols] (numpy order), the router
blk.N.ffn_gate_inp [E, d] stays F32, and the un-embedding is untied (output Q6_K).
  qwen3-30b-a3b  d 2048, 32 query / 4 K/V heads of 128, per-head Q/K norm, 128 experts
                 of 768, top 8 (48 layers in the real model)
  olmoe-1b-7b    d 2048, 16 heads of 128, Q/K norm over the whole projection, 64 experts
                 of 1024, top 8 (16 layers)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.bench import shapes
from tokenmill.bench.shapes import FILE_TYPES, MOE

SHAPES = MOE


def write(shape: str, ftype: str, path: Path, layers: int, seed: int = 0) -> None:
    shapes.write(shape, ftype, path, layers, seed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("ftype", choices=FILE_TYPES)
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=None, help="default: the real model's")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    write(args.shape, args.ftype, args.out, args.layers or SHAPES[args.shape]["layers"], args.seed)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
