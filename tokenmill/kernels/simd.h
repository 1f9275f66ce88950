/* The per-instruction-set layer: the few vector primitives that differ between CPUs,
 * so that the kernels (linear.c, attention.c, stack.c) write their block loops once.
 *
 * Exactly one layer is compiled in, chosen from the compiler's target (-march):
 *
 *   simd_avx512.h  x86-64 AVX-512 F/BW/DQ/VL (x86-64-v4),      TM_W = 16
 *                  with AVX-512 VNNI where the CPU has it
 *   simd_avx2.h    x86-64 AVX2 + FMA + F16C (x86-64-v3),       TM_W = 8
 *                  with AVX-VNNI where the CPU has it
 *   simd_neon.h    AArch64 Advanced SIMD                       TM_W = 4
 *                  with the dot-product extension where it has it
 *   simd_scalar.h  anything else: plain C loops, the reference TM_W = 4
 *
 * Every kernel is written once over these primitives: no instruction set has code of its
 * own outside its layer, so every layer runs the same kernels, and the tests run every
 * layer on any x86-64 host (AVX-512 and AVX-VNNI through emulations: kernel_builds.py).
 *
 * The contract. TM_W is the number of 32-bit lanes of a vector; it is also the number of
 * 32-value blocks in one lane-order group of the packed weights (linear.c).
 *   vf   TM_W floats      vf_zero vf_set1 vf_load vf_store vf_add vf_sub vf_mul vf_div
 *                         vf_fma(a, b, c) = a*b + c, vf_max vf_min vf_abs vf_copysign
 *                         vf_select_neg(x, a, b) = x < 0 ? a : b (by sign bit), vf_round
 *                         (to nearest, ties to even), vf_sum / vf_hmax (horizontal),
 *                         vf_hsums(v[TM_W]) (lane u = the sum of v[u]),
 *                         vf_load_f16 / vf_load_bf16 (TM_W 16-bit floats -> float32),
 *                         vf_load_u8 / vf_load_i8 (TM_W unsigned / signed bytes -> float32)
 *   vi   TM_W int32       vi_zero vi_set1 vi_load vi_store vi_add vi_sub vi_sum, vf_from_vi, vi_round
 *                         (float -> int32, ties to even), vf_pow2i (2^n), vi_store_i16,
 *                         vi_madd16(acc, w, x2): acc + per lane the lane's two int16 times
 *                         x2's two int16 (low half times low half, high times high), summed;
 *                         vi_transpose(v[TM_W]): v[k] lane l <- v[l] lane k
 *   vb   4*TM_W bytes     vb_zero, vb_load, vb_load_n(p, n) (n < 4*TM_W bytes, the rest zero),
 *                         vb_nibbles (low and high 4 bits of every byte),
 *                         vb_add_crumbs(c[4], v, at) (c[s] |= bits 2s..2s+1 of v at bits
 *                         at..at+1: 4, the top bits of 6-bit codes; 0, 2-bit codes),
 *                         vb_add_bits(c[8], v, at) (c[i] |= bit i of v at bit `at`: 4, the
 *                         top bits of 5-bit codes), vb_table(t) (a
 *                         16-byte table in every 16-byte lane), vb_lookup(table, c) (codes
 *                         0..15 looked up in it: the table-coded types),
 *                         vb_codes3(p0, p1, p2, c[8]) (a 3-bit group's 8 code vectors from
 *                         its three planes: tm_code3),
 *                         vf_scales6(lo, hi, &d0, &d1) (3-bit codes' 6-bit scale codes of a
 *                         group's TM_W blocks, less 32, as floats: tm_scales6_lanes),
 *                         vb_grid(grid, lo, hi, i, s) (the grid i-quants' codes: lane k
 *                         the grid entry lo[k] | (bit i of hi[k]) << 8, its bytes negated
 *                         where bit j of s is set: tm_grid_lanes), vb_widen_pairs(c, z, &even, &odd)
 *                         (codes minus z as int16 pairs: lane k of even = codes 4k, 4k+1,
 *                         of odd = 4k+2, 4k+3; the first of a pair in the low half)
 *   group_dot(c, n, xh, xl, bits) -> vi: the integer core of the packed GEMV. c: n (<= 8)
 *                         code vectors (vb, unsigned codes of `bits` 3, 4, 6 or 8; 2-bit ones go as 3, 5-bit ones as 6); xh / xl: the 16-bit
 *                         activations q = 256 hi + lo at the same positions, as signed high
 *                         bytes and unsigned low bytes. Lane k of the result: the exact sum
 *                         of c * q over bytes 4k..4k+3 of every vector (for 8-bit codes,
 *                         plus TM_A16_LEFT_OUT8(high bytes' sum, low bytes' sum) where the
 *                         layer defines it: quantize_x takes it back). A full lane-order group
 *                         (n = 8) gives block k's dot in lane k; one natural-order tail
 *                         block (n = 32 / (4 TM_W)) its dot as the sum of the lanes.
 *   group_dot8(c, n, x, bits) -> vi: group_dot for 8-bit activations q (|q| <= 127)
 *                         read as int8 x: the exact sum of c * q (for 8-bit codes plus
 *                         TM_A8_LEFT_OUT8(sum of q) where the layer defines it); layers
 *                         with TM_DOT8 1, where it takes about half group_dot's work.
 *   vi_dot8(acc, w, x4) -> vi: acc + per lane the lane's four unsigned bytes (codes of at
 *                         most TM_DOT8_BITS bits: 8 with VNNI, 6 on plain AVX2) times x4's
 *                         four signed bytes, summed (vpdpbusd, or its AVX2 pair; TM_DOT8
 *                         layers only).
 * Wide layers only (4 TM_W > 32: a vector holds two blocks, AVX-512):
 *   vb_tail_pair(p, bits) two natural-order tail blocks as one code vector (linear.c),
 *   vi_sum_halves(v, &lo, &hi) the sums of the lower and the upper half of the lanes,
 *   vf_set_halves(lo, hi) lo in the lower half of the lanes, hi in the upper.
 */
#ifndef TM_SIMD_H
#define TM_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* IEEE half -> float, bit exact (subnormals, inf and NaN included): one instruction where
 * the CPU converts halves (F16C, AArch64), else the bit manipulation. It sits in the K-quant
 * GEMV's group loop, where the branchy C version cost ~15% of a Q4_K GEMV on Zen 3. */
#if defined(__F16C__)
#include <immintrin.h>
static inline float tm_half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#elif defined(__aarch64__)
static inline float tm_half_to_float(uint16_t h) {
    __fp16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}
#else
static inline float tm_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

/* bfloat16 -> float: the high half of a float32. */
static inline float tm_bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Two codes minus the zero point z as one int32 of two int16 (low half: the first): the
 * integer GEMM's operand (gemm.c), built with vb_widen_pairs a vector at a time. */
static inline int32_t tm_code_pair(const uint8_t *c, int z) {
    return (int32_t)((uint32_t)(uint16_t)(c[0] - z) | (uint32_t)(uint16_t)(c[1] - z) << 16);
}

/* The grid i-quants' codes (tm.h tm_grid_codes), lane by lane in C: `lanes` lanes, lane k
 * the 4 bytes of grid entry lo[k] | (bit i of hi[k]) << 8 (hi NULL: 8-bit indices), byte j
 * of out then negated mod 256 where bit j of the sign bits at s is set (entries hold
 * their values + 128, so 256 - c is the negated value + 128). vb_grid's reference. */
static inline void tm_grid_lanes(const uint8_t *grid, const uint8_t *lo, const uint8_t *hi, int i,
                                 const uint8_t *s, uint8_t *out, int lanes) {
    for (int k = 0; k < lanes; k++) {
        const int e = lo[k] | (hi ? ((hi[k] >> i) & 1) << 8 : 0);
        for (int t = 0; t < 4; t++) {
            const int j = 4 * k + t;
            const uint8_t v = grid[4 * e + t];
            out[j] = (s[j >> 3] >> (j & 7)) & 1 ? (uint8_t)(0u - v) : v;
        }
    }
}

/* 3-bit codes (0..7) in three planes, one byte of each per position of a group's 8 vectors
 * (linear.c): plane 0 holds vectors 0 and 1 (bits 0-2, 3-5) and vector 2's low two bits
 * (6-7), plane 1 the same of vectors 3, 4 and 5, plane 2 vectors 6 and 7 (bits 0-2, 3-5)
 * and the top bits of 2 and 5 (6, 7). Two instructions per code where a code is whole in
 * its byte (against three per bit plane): vb_codes3 unpacks them, tm_code3 is its
 * reference and tm_plane3 the packing. */
static inline uint8_t tm_code3(uint8_t p0, uint8_t p1, uint8_t p2, int i) {
    switch (i) {
    case 0: return p0 & 7;
    case 1: return (p0 >> 3) & 7;
    case 2: return (uint8_t)(p0 >> 6 | ((p2 >> 4) & 4));
    case 3: return p1 & 7;
    case 4: return (p1 >> 3) & 7;
    case 5: return (uint8_t)(p1 >> 6 | ((p2 >> 5) & 4));
    case 6: return p2 & 7;
    default: return (p2 >> 3) & 7;
    }
}
/* Plane j's byte (0..2) of the 8 codes q[0..7] of one position */
static inline uint8_t tm_plane3(const uint8_t q[8], int j) {
    if (j < 2) return (uint8_t)(q[3 * j] | q[3 * j + 1] << 3 | (q[3 * j + 2] & 3) << 6);
    return (uint8_t)(q[6] | q[7] << 3 | (q[2] >> 2) << 6 | (q[5] >> 2) << 7);
}

/* 3-bit codes' 6-bit scale codes (tm.h scale6_at's layout) of n blocks, lane by lane: block
 * k's halves' codes less 32, s0[k] and s1[k]: lo[k] holds their low nibbles (half 0 low),
 * hi[k / 2] their top pairs (block k at bits 4 (k & 1), half h 2 h further). vf_scales6's
 * reference. */
static inline void tm_scales6_lanes(const uint8_t *lo, const uint8_t *hi, int n, int8_t *s0, int8_t *s1) {
    for (int k = 0; k < n; k++) {
        const int t = hi[k / 2] >> (4 * (k & 1));
        s0[k] = (int8_t)(((lo[k] & 15) | (t & 3) << 4) - 32);
        s1[k] = (int8_t)(((lo[k] >> 4) | ((t >> 2) & 3) << 4) - 32);
    }
}

#if defined(TM_SIMDE_AVX512) || (defined(__AVX512F__) && defined(__AVX512BW__) && \
                                 defined(__AVX512DQ__) && defined(__AVX512VL__))
#include "simd_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd_avx2.h"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include "simd_neon.h"
#else
#include "simd_scalar.h"
#endif
#ifndef TM_A16_LEFT_OUT8 /* what group_dot adds to 8-bit codes' dots, if anything */
#define TM_A16_LEFT_OUT8(hsum, lsum) 0
#endif
#ifndef TM_DOT8 /* 1: the layer has group_dot8 and vi_dot8 */
#define TM_DOT8 0
#endif
#ifndef TM_DOT8_BITS /* the widest codes vi_dot8 multiplies exactly */
#define TM_DOT8_BITS 8
#endif
#ifndef TM_A8_LEFT_OUT8 /* what group_dot8 adds to 8-bit codes' dots, if anything */
#define TM_A8_LEFT_OUT8(qsum) 0
#endif

/* ---- derived operations, written once over the primitives ---- */

/* TM_W block scales (or mins) from index idx of a float32 (kind 0), float16 (1) or E8M0
 * (2: exponent bytes e, 2^(e - 128), e in [2, 254]: MXFP4's halved scales) array. */
static inline vf vf_scales(const void *p, int kind, size_t idx) {
    if (kind == 2) return vf_pow2i(vi_round(vf_sub(vf_load_u8((const uint8_t *)p + idx), vf_set1(128.f))));
    return kind ? vf_load_f16((const uint16_t *)p + idx) : vf_load((const float *)p + idx);
}

/* exp(x) for x in [-87, 88], ~1 ulp (Cephes expf): x = n ln2 + r, |r| <= ln2/2, exp(r) by
 * a degree-6 polynomial, times 2^n. Below -87 it returns exp(-87) ~ 1.6e-38: the callers
 * (softmax weights, sigmoid) add it to numbers >= 1, where it is 0. */
static inline vf vf_exp(vf x) {
    x = vf_min(vf_max(x, vf_set1(-87.f)), vf_set1(88.f));
    const vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fma(n, vf_set1(-0.693359375f), x);
    r = vf_fma(n, vf_set1(2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fma(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fma(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fma(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fma(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fma(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fma(p, vf_mul(r, r), vf_add(r, vf_set1(1.f)));
    return vf_mul(p, vf_pow2i(vi_round(n)));
}

/* sum a[i] * b[i], two accumulators (FMA latency), then the scalar remainder. */
static inline float vf_dot(const float *a, const float *b, int n) {
    vf s0 = vf_zero(), s1 = vf_zero();
    int i = 0;
    for (; i + 2 * TM_W <= n; i += 2 * TM_W) {
        s0 = vf_fma(vf_load(a + i), vf_load(b + i), s0);
        s1 = vf_fma(vf_load(a + i + TM_W), vf_load(b + i + TM_W), s1);
    }
    for (; i + TM_W <= n; i += TM_W) s0 = vf_fma(vf_load(a + i), vf_load(b + i), s0);
    float acc = vf_sum(vf_add(s0, s1));
    for (; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* y [n] += a * x [n] */
static inline void vf_axpy(float *y, float a, const float *x, int n) {
    const vf va = vf_set1(a);
    int i = 0;
    for (; i + TM_W <= n; i += TM_W) vf_store(y + i, vf_fma(va, vf_load(x + i), vf_load(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

#endif
