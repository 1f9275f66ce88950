"""The machine's integer multiply-add peak, for the "share of peak" beside prefill figures.

    .venv/bin/python benchmarks/mac_peak.py [--threads N] [--seconds S]

Compiles a small C loop against the kernels' own simd.h layer (tokenmill/kernels/, the
host's -march=native or TOKENMILL_MARCH target) and times, on N threads (default: all
cores), independent chains of:

  int16  vi_madd16: the integer GEMM's core (gemm.c): vpdpwssd on AVX-512 VNNI / AVX-VNNI,
         vpmaddwd + vpaddd without: 2 x lanes multiply-adds per call
  int8   vpdpbusd (only where the build has VNNI): 4 x lanes multiply-adds per instruction,
         what 8-bit activations would run on

Operands stay in registers, so this is the arithmetic ceiling, not a memory one: the
integer GEMM's share of it is (weight rows x columns x tokens) / prefill time / peak.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
from pathlib import Path

from tokenmill.kernels import build

SOURCE = r"""
#include "simd.h"
#include <omp.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define CHAINS 12 /* independent accumulators: enough to cover the instruction's latency */
/* multiply-adds per second over `threads` threads for `seconds`; kind 0 int16, 1 int8 */
double peak(int kind, int threads, double seconds) {
    double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        vi acc[CHAINS];
        int32_t seed[TM_W];
        for (int i = 0; i < TM_W; i++) seed[i] = 0x00010001 * (i + omp_get_thread_num());
        const vi w = vi_load(seed);
        for (int c = 0; c < CHAINS; c++) acc[c] = vi_zero();
        long iters = 0;
        const double t0 = now();
        double t = t0;
        while (t - t0 < seconds) {
            for (int r = 0; r < 4096; r++)
                for (int c = 0; c < CHAINS; c++) {
                    if (kind == 0) acc[c] = vi_madd16(acc[c], w, 0x00020003);
#if TM_VNNI && TM_W == 16
                    else acc[c] = _mm512_dpbusd_epi32(acc[c], w, w);
#elif TM_VNNI && TM_W == 8
                    else acc[c] = vnni_dpbusd(acc[c], w, w);
#endif
                }
            iters += 4096;
            t = now();
        }
        int32_t out[TM_W];
        vi s = vi_zero();
        for (int c = 0; c < CHAINS; c++) s = vi_add(s, acc[c]);
        vi_store(out, s);
        volatile int32_t sink = out[0];
        (void)sink;
        total = (double)iters * CHAINS * TM_W * (kind == 0 ? 2 : 4) / (t - t0);
    }
    return total;
}
int has_int8(void) { return TM_VNNI; }
const char *isa(void) { return TM_SIMD_NAME; }
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "peak.c", Path(tmp) / "peak.so"
        src.write_text(SOURCE)
        cc = build._compiler()
        flags = [*build.BASE_FLAGS, *build.default_arch_flags(), f"-I{build.HERE}"]
        subprocess.run([cc, *flags, "-o", str(lib), str(src)], check=True)
        so = ctypes.CDLL(str(lib))
        so.peak.restype = ctypes.c_double
        so.peak.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_double]
        so.isa.restype = ctypes.c_char_p
        print(f"layer {so.isa().decode()}, {args.threads} threads")
        for kind, name in ((0, "int16 (vi_madd16)"), (1, "int8 (vpdpbusd)")):
            if kind == 1 and not so.has_int8():
                print(f"{name}: not in this build (no VNNI)")
                continue
            best = max(so.peak(kind, args.threads, args.seconds) for _ in range(3))
            print(f"{name}: {best / 1e9:.0f} G multiply-adds/s (best of 3)")


if __name__ == "__main__":
    main()
