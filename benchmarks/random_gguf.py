"""Write a GGUF of a real model's shape with random weights (tokenmill/bench/shapes.py).

    python benchmarks/random_gguf.py llama-3.2-1b q4_0 /tmp/llama-1b-q4_0.gguf
    tokenmill bench --model /tmp/llama-1b-q4_0.gguf --peers llamacpp --skip throughput
    python benchmarks/random_gguf.py llama-3.2-1b q4_0 /tmp/gemma2-1b.gguf --family gemma2

`tokenmill bench --shape llama-3.2-1b:q4_0` writes the same file into the cache and runs
on it; this script writes one where you say, in any dense family's layout (--family: the
layouts of benchmarks/dense_families.py) or with fewer layers. The shapes, the tensor
types per file type and the random blocks are those of tokenmill/bench/shapes.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.bench.shapes import DENSE, FAMILIES, FILE_TYPES, MOE, write

SHAPES = {**DENSE, **MOE}
__all__ = ["FAMILIES", "FILE_TYPES", "SHAPES", "write"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("ftype", choices=FILE_TYPES)
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=None, help="default: the real model's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", choices=FAMILIES, default="llama",
                   help="write a dense shape's layers in this family's layout")  # fmt: skip
    args = p.parse_args()
    write(args.shape, args.ftype, args.out, args.layers, args.seed, args.family)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
