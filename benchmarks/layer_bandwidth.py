"""Where a decode step's time goes, per layer kind: each distinct weight of a GGUF file's
decode (type x shape), timed alone as a T = 1 GEMV, against the machine's read bandwidth.

    .venv/bin/python benchmarks/layer_bandwidth.py FILE.gguf [--rounds 7] [--threads 2]
    .venv/bin/python benchmarks/layer_bandwidth.py --shape llama-3.2-1b:q4_k_m

For every distinct (GGUF type, rows, columns) among the file's 2-D weights (the first
layer's, the un-embedding; each as tokenmill packs it), a layer is packed and repeated past
64 MB (so each call reads from DRAM, as in a decode step), then every kind and a large
torch sum take turns in shuffled rounds. The table: GB/s of the packed bytes (median over
rounds), that as a share of the sum's read rate, and the milliseconds per token the kind
takes over all the layers that have it (count x time per call). The sum of that column
against a real decode step (`tokenmill bench`) says how much of the step is GEMVs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader

from tokenmill.layers.quant_linear import QUANT_GGUF_TYPES, QuantLinear

REPEAT_BYTES = 64 << 20  # each kind repeated past the last-level cache


def kinds(path: Path) -> tuple[dict, Counter]:
    """{(type, rows, cols): raw tensor of the first one seen} and how many of each a
    decode step reads (the token embedding only where it is also the un-embedding)."""
    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    first, count = {}, Counter()
    for t in reader.tensors:
        if len(t.shape) != 2 or t.tensor_type not in QUANT_GGUF_TYPES:
            continue
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue  # a lookup: one row per token
        cols, rows = int(t.shape[0]), int(t.shape[1])
        key = (
            t.tensor_type.name,
            rows,
            cols,
            t.name.split(".")[-2] if "blk." in t.name else t.name,
        )
        count[key] += 1
        first.setdefault(key, t)
    return first, count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="a GGUF file")
    p.add_argument("--shape", help="instead: tokenmill bench's random-weight file NAME[:TYPE]")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.shape:
        from tokenmill.bench import shapes

        path = shapes.cached(args.shape)
    elif args.model:
        path = Path(args.model)
    else:
        p.error("name a GGUF file or --shape")
    torch.set_num_threads(args.threads)
    first, count = kinds(path)
    runs = {}
    for key, t in first.items():
        qtype, rows, cols, _ = key
        raw = np.asarray(t.data).reshape(rows, -1)
        layer = QuantLinear.from_gguf(raw, t.tensor_type, rows, cols)
        copies = [layer] + [QuantLinear.cat([layer]) for _ in range(REPEAT_BYTES // layer.nbytes)]
        runs[key] = (copies, torch.randn(1, cols))
    big = torch.ones(512 << 20 >> 2)  # 512 MiB of float32 for the read rate
    times: dict = {k: [] for k in runs}
    reads = []
    for _ in range(args.rounds):
        order = [*runs, "sum"]
        random.shuffle(order)
        for key in order:
            t0 = time.perf_counter()
            if key == "sum":
                big.sum()
                reads.append(big.numel() * 4 / (time.perf_counter() - t0) / 1e9)
                continue
            copies, x = runs[key]
            for layer in copies:
                layer(x)
            times[key].append((time.perf_counter() - t0) / len(copies))
    read = statistics.median(reads)
    print(f"{path.name}: {args.threads} threads, memory read (torch sum) {read:.1f} GB/s\n")
    print(
        f"{'tensor':<22}{'type':<8}{'rows x cols':>14}{'MiB':>8}{'GB/s':>7}{'of read':>9}{'n':>4}{'ms/token':>10}"
    )
    total = 0.0
    for key, (copies, _) in sorted(runs.items(), key=lambda kv: -kv[1][0][0].nbytes * count[kv[0]]):
        qtype, rows, cols, name = key
        t = statistics.median(times[key])
        nbytes = copies[0].nbytes
        ms = t * count[key] * 1e3
        total += ms
        print(
            f"{name:<22}{qtype:<8}{f'{rows}x{cols}':>14}{nbytes / 2**20:>8.1f}"
            f"{nbytes / t / 1e9:>7.1f}{nbytes / t / 1e9 / read:>9.0%}{count[key]:>4}{ms:>10.2f}"
        )
    print(
        f"\nthe GEMVs of one decode step: {total:.1f} ms ({1e3 / total:.1f} tok/s if nothing else ran)"
    )


if __name__ == "__main__":
    main()
