"""Linear-layer timings: torch float32 / bfloat16 / int8pack vs tokenmill's quantized kernels.

    .venv/bin/python benchmarks/gemv.py [--threads N] [--cpu-time] [--rounds R] [--t 1 512]

For each weight shape (SmolLM2-135M's projections, its un-embedding, and 2048x2048)
and each row count T, every method runs once per round, in a shuffled order, so all
of them see the same machine load; the table shows the median over rounds (and the
minimum). GB/s is weight bytes read per call / time: meaningful at T=1, where a GEMV
is bound by memory bandwidth. The machine's bandwidth (a large copy and a large sum)
is measured first for reference.

Methods:
  fp32        F.linear on float32 weights (tokenmill's path before quantization)
  bf16        F.linear on bfloat16 weights and activations (oneDNN)
  int8pack    torch._weight_int8pack_mm (int8 weights, per-row scales)
  q4 / q8     QuantLinear from GGUF Q4_1 / Q8_0 blocks, as the layer routes them: the
              native GEMV, from kernels.gemm_min_rows() rows the integer GEMM (builds
              where kernels.gemm_prefill(): AVX2), elsewhere beyond what tm_linear_path sends to the GEMV
              rows dequantize-to-float32 + GEMM
  q4-gemm     the integer GEMM (kernels.gemm) at any T, any build
  q4-tiles    the float32-tile path (dequantize + torch GEMM) at any T

--cpu-time times with the calling thread's CPU clock: robust against other processes
on a shared machine, but only meaningful with --threads 1.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as GT
from gguf.quants import quantize

from tokenmill import kernels
from tokenmill.layers.quant_linear import PREFILL_MIN_T, QuantLinear

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576), (2048, 2048)]


def sample(fn, clock, min_seconds: float = 2e-3) -> float:
    """Seconds per call, averaged over enough calls to span min_seconds."""
    fn()
    n, t0 = 0, clock()
    while True:
        fn()
        n += 1
        elapsed = clock() - t0
        if elapsed >= min_seconds:
            return elapsed / n


def bandwidth(clock, rounds: int) -> tuple[float, float]:
    """(copy GB/s counting read + write, sum GB/s) over 256 MB float32."""
    a = torch.ones(64 << 20)
    b = torch.empty_like(a)
    nbytes = a.numel() * 4
    copy = statistics.median(sample(lambda: b.copy_(a), clock, 0.05) for _ in range(rounds))
    total = statistics.median(sample(lambda: a.sum(), clock, 0.05) for _ in range(rounds))
    return 2 * nbytes / copy / 1e9, nbytes / total / 1e9


def methods(n: int, k: int, t: int) -> dict[str, tuple[callable, int]]:
    """name -> (call, weight bytes) for one shape and row count."""
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    x = torch.randn(t, k)
    wb, xb = w.bfloat16(), x.bfloat16()
    scale = w.abs().amax(1) / 127
    w8 = torch.round(w / scale[:, None]).to(torch.int8)
    q4 = QuantLinear.from_gguf(quantize(w.numpy(), GT.Q4_1), GT.Q4_1, n, k)
    q8 = QuantLinear.from_gguf(quantize(w.numpy(), GT.Q8_0), GT.Q8_0, n, k)
    native = {}
    if kernels.library() is not None:
        native = {
            "q4-gemm": (lambda: kernels.gemm(q4.native(), x, None, q4.act_bits), q4.nbytes),
            "q4-tiles": (lambda: q4._prefill(q4.native(), x), q4.nbytes),
        }
    return {
        "fp32": (lambda: F.linear(x, w), w.numel() * 4),
        "bf16": (lambda: F.linear(xb, wb), wb.numel() * 2),
        "int8pack": (lambda: torch._weight_int8pack_mm(x, w8, scale), w8.numel() + n * 4),
        "q4": (lambda: q4(x), q4.nbytes),
        "q8": (lambda: q8(x), q8.nbytes),
        **native,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-time", action="store_true")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--t", type=int, nargs="+", default=[1, 512])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    native = kernels.library() is not None
    print(
        f"threads {torch.get_num_threads()}, clock {clock.__name__}, native kernels {native}"
        f" (kernels {kernels.isa()}, integer GEMM for prefill: {kernels.gemm_prefill()}),"
        f" PREFILL_MIN_T {PREFILL_MIN_T}, gemm_min_rows {kernels.gemm_min_rows()}"
    )
    copy, total = bandwidth(clock, 3)
    print(f"memory bandwidth (256 MB): copy {copy:.1f} GB/s (read+write), sum {total:.1f} GB/s\n")
    header = f"{'shape':>11} {'T':>4} {'method':<9}{'median us':>11}{'min us':>10}{'GB/s':>7}{'vs fp32':>9}"
    print(header)
    print("-" * len(header))
    with torch.inference_mode():
        for n, k in SHAPES:
            for t in args.t:
                ms = methods(n, k, t)
                times: dict[str, list[float]] = {name: [] for name in ms}
                for _ in range(args.rounds):
                    order = list(ms)
                    random.shuffle(order)
                    for name in order:
                        times[name].append(sample(ms[name][0], clock))
                base = statistics.median(times["fp32"])
                for name, (_, nbytes) in ms.items():
                    med = statistics.median(times[name])
                    gbs = f"{nbytes / med / 1e9:7.1f}" if t == 1 else f"{'':>7}"
                    print(
                        f"{f'{n}x{k}':>11} {t:>4} {name:<9}{med * 1e6:>11.1f}"
                        f"{min(times[name]) * 1e6:>10.1f}{gbs}{base / med:>8.2f}x"
                    )
                print()


if __name__ == "__main__":
    main()
