/* Weight-only quantized linear kernels for tokenmill (plain C, loaded with ctypes).
 *
 * Why plain C: it compiles in about a second with the system gcc at first use, needs
 * no torch headers, and -march=native picks the host's best instructions. Hosts
 * without AVX-512 VNNI/BF16 get the portable scalar code below (same results up to
 * float rounding order, much slower).
 *
 * Packed weight format (built by tokenmill/layers/quant_linear.py)
 * ----------------------------------------------------------------
 * A weight W [N, K] (K a multiple of 32) is cut, per row, into blocks of 32 values
 * with one scale d and optionally one min m per block:
 *
 *     w = d * (c - Z) + m          c: the unsigned code (4 or 8 bits)
 *     Z = 0 when the format has mins, else 8 (4-bit) or 128 (8-bit)
 *
 * This holds GGUF Q4_0 (Z=8), Q4_1 / Q4_K (mins), Q8_0 / Q5_0 (Z=128, codes biased
 * by +128) and Q5_1 / Q5_K (8-bit codes 0..31 with mins) exactly.
 *
 *   codes   uint8 [N, K/2] (bits=4) or [N, K] (bits=8), rows dense, no padding
 *   scales  float16 or float32 [N, K/32]
 *   mins    same dtype as scales [N, K/32], or absent
 *
 * Column order of the codes in a row ("lane order"):
 *  - full groups of 16 blocks (512 values) first. Value j = 4*i + t (i < 8, t < 4) of
 *    block k of a group sits at position p = i*64 + k*4 + t, so 64-byte vector i
 *    holds in 32-bit lane k four consecutive values of block k: a VNNI dot product
 *    (vpdpbusd) over the 8 vectors leaves block k's whole int32 dot in lane k, with
 *    no horizontal reduction per block.
 *  - then the tail (nb % 16 blocks) in natural order, in chunks of 64 values (two
 *    blocks; the last chunk may hold one block, 32 values).
 * 8-bit codes sit at byte p. 4-bit codes: in a full group, byte c*64 + r holds
 * position 2c*64 + r in its low nibble and (2c+1)*64 + r in its high nibble; in a
 * tail chunk of n values, byte r holds value r (low) and value n/2 + r (high).
 *
 * Activations are quantized per 32-block, written in the same lane order: to 8 bits
 * like llama.cpp's q8 (xq = round(x / dx), dx = max|x| / 127), or to 16 bits split
 * into two VNNI operands (see quantize_x). The dot of a block is then
 *     d * dx * (sum c*xq - Z * sum xq) + m * sum x
 * in exact int32 arithmetic up to the final float scaling (sum x is the exact float
 * sum: the min term adds no activation-quantization error).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define TM_AVX512 1
#include <immintrin.h>
#else
#define TM_AVX512 0
#endif

#define QK 32       /* values per block */
#define GB 16       /* blocks per full group */
#define GW 512      /* values per full group */
#define TCHUNK 8    /* activation rows computed together per weight row */
#define ROWBLOCK 16 /* weight rows a thread keeps hot while looping over T chunks */
/* Software prefetch distance in code bytes. Decode streams ~100 MB of codes per token;
 * in A/B runs (noisy, shared 2-core machine) prefetching 1-16 KB ahead cut the streaming
 * GEMV time by roughly 20-25% against none. Re-measured on the whole fused decode step
 * plus the un-embedding (a 96 MB working set, beyond what the VM's cache holds),
 * interleaved, 6 rounds, medians: 1 KB 4.94 ms, 2 KB 4.59-4.72, 4 KB 4.30, 8 KB
 * 4.11-4.38, 16 KB 4.51, 32 KB 4.70. -DPREFETCH=n overrides it. */
#ifndef PREFETCH
#define PREFETCH 8192
#endif

/* One packed weight, filled once per layer from Python (ctypes.Structure mirror). */
typedef struct {
    const uint8_t *codes;
    const void *scales;
    const void *mins;  /* NULL: no mins, zero point Z applies */
    int32_t bits;      /* 4 or 8 */
    int32_t scale_f16; /* 1: scales/mins are float16, 0: float32 */
    int32_t n;         /* rows (out features) */
    int32_t k;         /* columns (in features), a multiple of 32 */
} tm_weight;

static inline int zero_point(const tm_weight *w) {
    return w->mins ? 0 : (w->bits == 4 ? 8 : 128);
}

static inline size_t row_bytes(const tm_weight *w) {
    return (size_t)w->k * (size_t)w->bits / 8;
}

static inline float half_to_float(uint16_t h) {
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

static inline float scale_at(const void *p, int f16, size_t idx) {
    return f16 ? half_to_float(((const uint16_t *)p)[idx]) : ((const float *)p)[idx];
}

/* Lane-order position of value j of block b in a row of nb blocks (= 8-bit code byte). */
static inline size_t lane_pos(int nb, int b, int j) {
    int full = nb / GB * GB;
    if (b >= full) return (size_t)b * QK + j; /* tail: natural order */
    return (size_t)(b / GB) * GW + (size_t)(j >> 2) * 64 + (b % GB) * 4 + (j & 3);
}

/* Code of value j of block b of a row (scalar reference for every layout rule). */
static inline int code_at(const tm_weight *w, const uint8_t *row, int b, int j) {
    const int nb = w->k / QK, full = nb / GB * GB;
    if (w->bits == 8) return row[lane_pos(nb, b, j)];
    if (b < full) {
        size_t p = lane_pos(nb, b, j), g = p / GW, r = p % GW, i = r / 64;
        uint8_t byte = row[g * (GW / 2) + (i >> 1) * 64 + r % 64];
        return (i & 1) ? byte >> 4 : byte & 15;
    }
    size_t v = (size_t)(b - full) * QK + j, tail_vals = (size_t)(nb - full) * QK;
    size_t c0 = v / 64 * 64, n = tail_vals - c0 < 64 ? tail_vals - c0 : 64, o = v - c0;
    uint8_t byte = row[(size_t)full * QK / 2 + c0 / 2 + o % (n / 2)];
    return o >= n / 2 ? byte >> 4 : byte & 15;
}

static int n_threads(int requested) {
#ifdef _OPENMP
    return requested > 0 ? requested : omp_get_max_threads();
#else
    (void)requested;
    return 1;
#endif
}

/* ------------------------------------------------------------------------------ */
/* Activation quantization (per call, on the calling thread: T*K is small).        */
/* ------------------------------------------------------------------------------ */

typedef struct {
    int8_t *q;   /* [T][kpad] int8 in lane order, zero padded (16-bit: high bytes) */
    uint8_t *ql; /* [T][kpad] 16-bit mode: low bytes (unsigned), else unused */
    float *dx;   /* [T][gpad] block scales (0 in padding) */
    float *sx;   /* [T][gpad] exact float sums of x per block */
    int32_t *zc; /* [T][gpad] Z * sum(q) per block */
    int32_t *zl; /* [T][gpad] 16-bit mode, 4-bit weights: Z * sum(ql) per block */
    int kpad, gpad;
} xq_t;

/* Grow-only scratch per calling thread: no malloc/mmap per call on the decode path. */
static __thread void *scratch_buf = NULL;
static __thread size_t scratch_cap = 0;

static void *scratch(size_t bytes) {
    if (bytes > scratch_cap) {
        free(scratch_buf);
        scratch_cap = (bytes + bytes / 2 + 63) & ~(size_t)63;
        scratch_buf = aligned_alloc(64, scratch_cap);
        if (!scratch_buf) scratch_cap = 0;
    }
    return scratch_buf;
}

/* Quantizes x [T, K] float32 per 32-block for a weight with zero point z and `bits`.
 * 8-bit mode: q = round(x / dx), dx = max|x| / 127.
 * 16-bit mode (act16): q16 = round(x / dx), dx = max|x| / 32767, stored as its signed
 * high byte (q) and unsigned low byte (ql): q16 = 256 * q + ql, so each half is a
 * VNNI operand. Returns 0 on OOM. */
static int quantize_x(const float *x, int T, int K, int z, int bits, int act16, xq_t *xq) {
    const int nb = K / QK;
    xq->gpad = (nb + GB - 1) / GB * GB;
    xq->kpad = xq->gpad * QK + 64; /* +64: full-width loads at the tail stay in bounds */
    const size_t qbytes = ((size_t)T * xq->kpad + 63) & ~(size_t)63;
    const size_t fbytes = (size_t)T * xq->gpad * 4;
    const size_t total = (act16 ? 2 : 1) * qbytes + 4 * fbytes;
    char *buf = scratch(total);
    if (!buf) return 0;
    memset(buf, 0, total);
    xq->dx = (float *)buf;
    xq->sx = (float *)(buf + fbytes);
    xq->zc = (int32_t *)(buf + 2 * fbytes);
    xq->zl = (int32_t *)(buf + 3 * fbytes);
    xq->q = (int8_t *)(buf + 4 * fbytes);
    xq->ql = act16 ? (uint8_t *)(buf + 4 * fbytes + qbytes) : NULL;
    const float qmax = act16 ? 32767.f : 127.f;
    const int zl = bits == 4 ? z : 0; /* 8-bit codes enter the low pass already signed */
    for (int r = 0; r < T; r++) {
        const float *xr = x + (size_t)r * K;
        int8_t *qr = xq->q + (size_t)r * xq->kpad;
        uint8_t *lr = act16 ? xq->ql + (size_t)r * xq->kpad : NULL;
        for (int b = 0; b < nb; b++) {
            const float *v = xr + b * QK;
            int8_t qv[QK];
            uint8_t lv[QK];
            float amax = 0.f, sum = 0.f;
            int qsum = 0, lsum = 0;
#if TM_AVX512
            __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
            amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            sum = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
            __m512 inv = _mm512_set1_ps(amax > 0.f ? qmax / amax : 0.f);
            __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)); /* round half to even */
            __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
            if (act16) {
                const __m512i ff = _mm512_set1_epi32(0xff);
                __m512i l0 = _mm512_and_si512(q0, ff), l1 = _mm512_and_si512(q1, ff);
                q0 = _mm512_srai_epi32(q0, 8);
                q1 = _mm512_srai_epi32(q1, 8);
                lsum = _mm512_reduce_add_epi32(_mm512_add_epi32(l0, l1));
                _mm_storeu_si128((__m128i *)lv, _mm512_cvtepi32_epi8(l0));
                _mm_storeu_si128((__m128i *)(lv + 16), _mm512_cvtepi32_epi8(l1));
            }
            qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            _mm_storeu_si128((__m128i *)qv, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(qv + 16), _mm512_cvtepi32_epi8(q1));
#else
            for (int j = 0; j < QK; j++) {
                amax = fmaxf(amax, fabsf(v[j]));
                sum += v[j];
            }
            float inv = amax > 0.f ? qmax / amax : 0.f;
            for (int j = 0; j < QK; j++) {
                int32_t q = (int32_t)lrintf(v[j] * inv); /* round half to even, like cvtps */
                if (act16) {
                    lv[j] = (uint8_t)(q & 0xff);
                    lsum += lv[j];
                    q >>= 8; /* arithmetic: q = 256 * (q >> 8) + (q & 0xff) */
                }
                qv[j] = (int8_t)q;
                qsum += qv[j];
            }
#endif
            const size_t pos = lane_pos(nb, b, 0);
            if (b >= nb / GB * GB) {
                memcpy(qr + pos, qv, QK);
                if (act16) memcpy(lr + pos, lv, QK);
            } else {
                for (int i = 0; i < 8; i++) memcpy(qr + pos + i * 64, qv + 4 * i, 4);
                if (act16)
                    for (int i = 0; i < 8; i++) memcpy(lr + pos + i * 64, lv + 4 * i, 4);
            }
            const size_t xi = (size_t)r * xq->gpad + b;
            xq->dx[xi] = amax / qmax;
            xq->sx[xi] = sum;
            xq->zc[xi] = z * qsum;
            xq->zl[xi] = zl * lsum;
        }
    }
    return 1;
}

/* ------------------------------------------------------------------------------ */
/* GEMV / small-T GEMM: y[t, r] = sum_k x[t, k] * W[r, k] (+ bias[r])              */
/* ------------------------------------------------------------------------------ */

#if TM_AVX512
static inline __m512 load_scales(const void *base, int f16, size_t idx, __mmask16 m) {
    if (f16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)base + idx));
    return _mm512_maskz_loadu_ps(m, (const float *)base + idx);
}

/* Tail chunk q of a row: up to 64 codes in natural order (upper half zero for a
 * single-block chunk). `tail` points at the row's tail codes. */
static inline __m512i tail_codes(const uint8_t *tail, int bits, int q, int nbt) {
    const int two = 2 * q + 1 < nbt;
    if (bits == 8) return _mm512_maskz_loadu_epi8(two ? ~(__mmask64)0 : 0xffffffffull, tail + 64 * q);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    if (two) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(tail + 32 * q));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    __m128i v = _mm_loadu_si128((const __m128i *)(tail + 32 * q));
    __m128i lo = _mm_and_si128(v, _mm256_castsi256_si128(m4));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm256_castsi256_si128(m4));
    return _mm512_zextsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

/* Lanes [2q x8, 2q+1 x8]: spreads per-block values over a tail chunk's 16 lanes. */
static inline __m512i pair_index(int q) {
    return _mm512_add_epi32(_mm512_set1_epi32(2 * q),
                            _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
}

/* Rows [r0, r1) of W against T (<= TCHUNK) activation rows starting at t0; T, bits
 * and A16 (16-bit activations) are constants after inlining.
 *
 * Per full group and activation row: 8 vpdpbusd (codes x q) into four independent
 * int32 accumulators (hides vpdpbusd's latency). 4-bit high nibbles are used in place
 * (c*16: masked, not shifted) and their sums shifted back once (exact: every product
 * is a multiple of 16). In 16-bit mode a second pass multiplies the unsigned low
 * bytes ql by signed codes (c - Z for 8-bit, c for 4-bit, corrected by Z * sum(ql)),
 * and the block's dot is 256 * high + low. */
static inline __attribute__((always_inline)) void rows_dot(const tm_weight *w, const xq_t *xq,
                                                           int r0, int r1, int t0, int T, int bits,
                                                           int A16, float *y, const float *bias) {
    const int nb = w->k / QK, nfull = nb / GB, nbt = nb % GB, f16 = w->scale_f16;
    const size_t rb = row_bytes(w);
    const __mmask16 tmask = (__mmask16)((1u << nbt) - 1);
    /* 8-bit codes as signed values for the low pass: c - 128 (Z = 128) or c (mins) */
    const __m512i sflip = _mm512_set1_epi8(w->mins ? 0 : (char)0x80);
    for (int r = r0; r < r1; r++) {
        const uint8_t *row = w->codes + (size_t)r * rb;
        const size_t srow = (size_t)r * nb;
        { /* software prefetch PREFETCH bytes of codes ahead (and the matching scales) */
            const char *pf = (const char *)row + PREFETCH;
            for (size_t off = 0; off < rb; off += 64) _mm_prefetch(pf + off, _MM_HINT_T0);
            const size_t es = f16 ? 2 : 4, ahead = srow * es + PREFETCH * es / (4 * (size_t)bits);
            _mm_prefetch((const char *)w->scales + ahead, _MM_HINT_T0);
            if (w->mins) _mm_prefetch((const char *)w->mins + ahead, _MM_HINT_T0);
        }
        __m512 acc[TCHUNK];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int g = 0; g < nfull; g++) {
            __m512i wv[8], sv[8]; /* codes for the high pass; signed codes for the low pass */
            if (bits == 4) {
                const uint8_t *p = row + (size_t)g * (GW / 2);
                for (int c = 0; c < 4; c++) {
                    __m512i v = _mm512_loadu_si512(p + 64 * c);
                    wv[2 * c] = _mm512_and_si512(v, _mm512_set1_epi8(0x0f));
                    wv[2 * c + 1] = _mm512_and_si512(v, _mm512_set1_epi8((char)0xf0));
                    if (A16) {
                        sv[2 * c] = wv[2 * c];
                        sv[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
                    }
                }
            } else {
                for (int i = 0; i < 8; i++) {
                    wv[i] = _mm512_loadu_si512(row + (size_t)g * GW + 64 * i);
                    if (A16) sv[i] = _mm512_xor_si512(wv[i], sflip);
                }
            }
            __m512 d = load_scales(w->scales, f16, srow + (size_t)g * GB, 0xffff);
            __m512 m = w->mins ? load_scales(w->mins, f16, srow + (size_t)g * GB, 0xffff)
                               : _mm512_setzero_ps();
            for (int t = 0; t < T; t++) {
                const size_t tt = (size_t)(t0 + t), xi = tt * xq->gpad + (size_t)g * GB;
                const size_t xo = tt * xq->kpad + (size_t)g * GW;
                const int8_t *xg = xq->q + xo;
                __m512i a[4];
                for (int i = 0; i < 4; i++)
                    a[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[i], _mm512_loadu_si512(xg + 64 * i));
                for (int i = 4; i < 8; i++)
                    a[i & 3] = _mm512_dpbusd_epi32(a[i & 3], wv[i], _mm512_loadu_si512(xg + 64 * i));
                __m512i s32;
                if (bits == 4) /* a[0], a[2]: low nibbles; a[1], a[3]: high nibbles x16 */
                    s32 = _mm512_add_epi32(_mm512_add_epi32(a[0], a[2]),
                                           _mm512_srai_epi32(_mm512_add_epi32(a[1], a[3]), 4));
                else
                    s32 = _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(a[2], a[3]));
                s32 = _mm512_sub_epi32(s32, _mm512_loadu_si512(xq->zc + xi));
                if (A16) {
                    const uint8_t *lg = xq->ql + xo;
                    __m512i l[2];
                    for (int i = 0; i < 2; i++)
                        l[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(lg + 64 * i), sv[i]);
                    for (int i = 2; i < 8; i++)
                        l[i & 1] = _mm512_dpbusd_epi32(l[i & 1], _mm512_loadu_si512(lg + 64 * i), sv[i]);
                    __m512i lo = _mm512_sub_epi32(_mm512_add_epi32(l[0], l[1]), _mm512_loadu_si512(xq->zl + xi));
                    s32 = _mm512_add_epi32(_mm512_slli_epi32(s32, 8), lo);
                }
                __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s32), _mm512_loadu_ps(xq->dx + xi));
                acc[t] = _mm512_fmadd_ps(f, d, acc[t]);
                if (w->mins) acc[t] = _mm512_fmadd_ps(m, _mm512_loadu_ps(xq->sx + xi), acc[t]);
            }
        }
        if (nbt) {
            const uint8_t *tail = row + (size_t)nfull * GW * bits / 8;
            const int nchunks = (nbt + 1) / 2;
            __m512i wt[GB / 2];
            for (int q = 0; q < nchunks; q++) wt[q] = tail_codes(tail, bits, q, nbt);
            const size_t s0 = srow + (size_t)nfull * GB;
            __m512 d = load_scales(w->scales, f16, s0, tmask);
            __m512 m = w->mins ? load_scales(w->mins, f16, s0, tmask) : _mm512_setzero_ps();
            for (int t = 0; t < T; t++) {
                const size_t tt = (size_t)(t0 + t), xi = tt * xq->gpad + (size_t)nfull * GB;
                const size_t xo = tt * xq->kpad + (size_t)nfull * GW;
                __m512 dd = _mm512_mul_ps(d, _mm512_loadu_ps(xq->dx + xi)); /* lane k: block k */
                __m512i zc = _mm512_loadu_si512(xq->zc + xi);
                __m512i zl = A16 ? _mm512_loadu_si512(xq->zl + xi) : _mm512_setzero_si512();
                for (int q = 0; q < nchunks; q++) {
                    __m512i idx = pair_index(q);
                    __m512i s32 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wt[q],
                                                      _mm512_loadu_si512(xq->q + xo + 64 * q));
                    __m512i corr = _mm512_permutexvar_epi32(idx, zc);
                    if (A16) {
                        __m512i sc = bits == 4 ? wt[q] : _mm512_xor_si512(wt[q], sflip);
                        __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                         _mm512_loadu_si512(xq->ql + xo + 64 * q), sc);
                        s32 = _mm512_add_epi32(_mm512_slli_epi32(s32, 8), lo);
                        corr = _mm512_add_epi32(_mm512_slli_epi32(corr, 8), _mm512_permutexvar_epi32(idx, zl));
                    }
                    /* Sum each block's 8 lanes in int32 before going to float: the lanes
                     * of biased codes are large and cancel, float sums would lose bits. */
                    s32 = _mm512_add_epi32(s32, _mm512_shuffle_epi32(s32, _MM_PERM_BADC));
                    s32 = _mm512_add_epi32(s32, _mm512_shuffle_epi32(s32, _MM_PERM_CDAB));
                    s32 = _mm512_add_epi32(s32, _mm512_shuffle_i32x4(s32, s32, _MM_PERM_CDAB));
                    s32 = _mm512_sub_epi32(s32, corr); /* every lane: its block's exact dot */
                    acc[t] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(s32), _mm512_permutexvar_ps(idx, dd),
                                                   acc[t], 0x0101);
                }
                if (w->mins) acc[t] = _mm512_fmadd_ps(m, _mm512_loadu_ps(xq->sx + xi), acc[t]);
            }
        }
        const float b = bias ? bias[r] : 0.f;
        for (int t = 0; t < T; t++) y[(size_t)(t0 + t) * w->n + r] = _mm512_reduce_add_ps(acc[t]) + b;
    }
}

#define DEF_ROWS(B, A, T)                                                                        \
    static void rows_b##B##_a##A##_t##T(const tm_weight *w, const xq_t *xq, int r0, int r1,      \
                                        int t0, float *y, const float *bias) {                   \
        rows_dot(w, xq, r0, r1, t0, T, B, A, y, bias);                                           \
    }
/* Instantiated for T = 1, 2, 4, 8 only (compile time); other counts are split. */
#define DEF_ROWS_ALL(B, A)                                                     \
    DEF_ROWS(B, A, 1) DEF_ROWS(B, A, 2) DEF_ROWS(B, A, 4) DEF_ROWS(B, A, 8)    \
    static const rows_fn ROWS_B##B##_A##A[4] = {rows_b##B##_a##A##_t1, rows_b##B##_a##A##_t2, \
                                                rows_b##B##_a##A##_t4, rows_b##B##_a##A##_t8};

typedef void (*rows_fn)(const tm_weight *, const xq_t *, int, int, int, float *, const float *);
DEF_ROWS_ALL(4, 0)
DEF_ROWS_ALL(8, 0)
DEF_ROWS_ALL(4, 1)
DEF_ROWS_ALL(8, 1)

/* T (<= TCHUNK) rows as power-of-two pieces, e.g. 7 = 4 + 2 + 1: the rows [r0, r1)
 * (ROWBLOCK of them) stay in L1 between the pieces. */
static void rows_any(const tm_weight *w, const xq_t *xq, int r0, int r1, int t0, int T,
                     float *y, const float *bias) {
    const rows_fn *table = xq->ql ? (w->bits == 4 ? ROWS_B4_A1 : ROWS_B8_A1)
                                  : (w->bits == 4 ? ROWS_B4_A0 : ROWS_B8_A0);
    for (int p = 3; p >= 0; p--)
        if (T & (1 << p)) {
            table[p](w, xq, r0, r1, t0, y, bias);
            t0 += 1 << p;
        }
}
#else
/* Portable reference: the same integer block dots, scalar loops. */
static void rows_any(const tm_weight *w, const xq_t *xq, int r0, int r1, int t0, int T,
                     float *y, const float *bias) {
    const int nb = w->k / QK, z = zero_point(w);
    const size_t rb = row_bytes(w);
    for (int r = r0; r < r1; r++) {
        const uint8_t *row = w->codes + (size_t)r * rb;
        for (int t = t0; t < t0 + T; t++) {
            const int8_t *xr = xq->q + (size_t)t * xq->kpad;
            const uint8_t *lr = xq->ql ? xq->ql + (size_t)t * xq->kpad : NULL;
            float acc = 0.f;
            for (int b = 0; b < nb; b++) {
                const size_t xi = (size_t)t * xq->gpad + b, si = (size_t)r * nb + b;
                int32_t hi = 0, lo = 0;
                for (int j = 0; j < QK; j++) {
                    const size_t p = lane_pos(nb, b, j);
                    const int c = code_at(w, row, b, j);
                    hi += c * xr[p];
                    if (lr) lo += (w->bits == 4 ? c : c - z) * lr[p];
                }
                int32_t dot = hi - xq->zc[xi];
                if (lr) dot = dot * 256 + lo - xq->zl[xi];
                acc += scale_at(w->scales, w->scale_f16, si) * (xq->dx[xi] * (float)dot);
                if (w->mins) acc += scale_at(w->mins, w->scale_f16, si) * xq->sx[xi];
            }
            y[(size_t)t * w->n + r] = acc + (bias ? bias[r] : 0.f);
        }
    }
}
#endif

/* y [T, N] = x [T, K] @ W^T (+ bias), activations quantized per block to 8 bits, or
 * to 16 bits if act16 (about 1.5x the arithmetic, ~250x smaller activation error).
 * Returns 0 if scratch memory ran out. */
int tm_linear(const tm_weight *w, const float *x, int T, float *y, const float *bias,
              int nthreads, int act16) {
    xq_t xq;
    if (!quantize_x(x, T, w->k, zero_point(w), w->bits, act16, &xq)) return 0;
    const int n = w->n, nblk = (n + ROWBLOCK - 1) / ROWBLOCK;
    int nt = n_threads(nthreads);
    nt = nt < nblk ? nt : nblk;
    (void)nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int rb = 0; rb < nblk; rb++) {
        int r0 = rb * ROWBLOCK, r1 = r0 + ROWBLOCK < n ? r0 + ROWBLOCK : n;
        for (int t0 = 0; t0 < T; t0 += TCHUNK)
            rows_any(w, &xq, r0, r1, t0, T - t0 < TCHUNK ? T - t0 : TCHUNK, y, bias);
    }
    return 1;
}

/* ------------------------------------------------------------------------------ */
/* Dequantization                                                                 */
/* ------------------------------------------------------------------------------ */

/* Row r of W to out [K] float32 in lane order (the order of the packed codes). */
static void dequant_row_lanes(const tm_weight *w, int r, float *out) {
    const int nb = w->k / QK, z = zero_point(w), f16 = w->scale_f16;
    const uint8_t *row = w->codes + (size_t)r * row_bytes(w);
    const size_t srow = (size_t)r * nb;
#if TM_AVX512
    const int nfull = nb / GB, nbt = nb % GB;
    const __m512i zv = _mm512_set1_epi32(z);
    for (int g = 0; g < nfull; g++) {
        __m512i wv[8];
        for (int c = 0; c < 8; c++) {
            if (w->bits == 8) {
                wv[c] = _mm512_loadu_si512(row + (size_t)g * GW + 64 * c);
            } else {
                __m512i v = _mm512_loadu_si512(row + (size_t)g * (GW / 2) + 64 * (c >> 1));
                wv[c] = _mm512_and_si512(c & 1 ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0f));
            }
        }
        __m512 d = load_scales(w->scales, f16, srow + (size_t)g * GB, 0xffff);
        __m512 m = w->mins ? load_scales(w->mins, f16, srow + (size_t)g * GB, 0xffff)
                           : _mm512_setzero_ps();
        /* 16 values from lanes 4q..4q+3 need the block scales [4q x4, 4q+1 x4, ...] */
        __m512 dq[4], mq[4];
        for (int q = 0; q < 4; q++) {
            __m512i idx = _mm512_srli_epi32(
                _mm512_add_epi32(_mm512_set1_epi32(16 * q),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
                2);
            dq[q] = _mm512_permutexvar_ps(idx, d);
            mq[q] = _mm512_permutexvar_ps(idx, m);
        }
        const size_t o = (size_t)g * GW;
        for (int i = 0; i < 8; i++) {
            const __m512i c[4] = {_mm512_cvtepu8_epi32(_mm512_castsi512_si128(wv[i])),
                                  _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(wv[i], 1)),
                                  _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(wv[i], 2)),
                                  _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(wv[i], 3))};
            for (int q = 0; q < 4; q++)
                _mm512_storeu_ps(out + o + 64 * i + 16 * q,
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(c[q], zv)), dq[q], mq[q]));
        }
    }
    const uint8_t *tail = row + (size_t)nfull * GW * w->bits / 8;
    for (int q = 0; q < (nbt + 1) / 2; q++) {
        __m512i wt = tail_codes(tail, w->bits, q, nbt);
        const __m128i parts[4] = {_mm512_castsi512_si128(wt), _mm512_extracti32x4_epi32(wt, 1),
                                  _mm512_extracti32x4_epi32(wt, 2), _mm512_extracti32x4_epi32(wt, 3)};
        for (int h = 0; h < 4 && 2 * q + h / 2 < nbt; h++) {
            size_t b = srow + (size_t)nfull * GB + 2 * q + h / 2;
            __m512 d = _mm512_set1_ps(scale_at(w->scales, f16, b));
            __m512 m = _mm512_set1_ps(w->mins ? scale_at(w->mins, f16, b) : 0.f);
            __m512 c = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(parts[h]), zv));
            _mm512_storeu_ps(out + (size_t)nfull * GW + 64 * q + 16 * h, _mm512_fmadd_ps(c, d, m));
        }
    }
#else
    for (int b = 0; b < nb; b++) {
        float d = scale_at(w->scales, f16, srow + b);
        float m = w->mins ? scale_at(w->mins, f16, srow + b) : 0.f;
        for (int j = 0; j < QK; j++) {
            out[lane_pos(nb, b, j)] = d * (float)(code_at(w, row, b, j) - z) + m;
        }
    }
#endif
}

/* Rows [r0, r1) of W to out [r1 - r0, K] float32 in lane order (the caller permutes
 * x's columns the same way before its GEMM: tm_lanes_f32). */
void tm_dequant_lanes(const tm_weight *w, int r0, int r1, float *out, int nthreads) {
    const int nt = n_threads(nthreads);
    (void)nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int r = r0; r < r1; r++) dequant_row_lanes(w, r, out + (size_t)(r - r0) * w->k);
}

/* Rows ids[0..n) of W to out [n, K] float32 in natural column order: the embedding
 * lookup of a quantized (tied) embedding table. Returns 1, -1 if an id is outside
 * [0, N) (nothing written), 0 on OOM. */
/* x [T, K] float32 -> out [T, K] with columns in lane order: the activation side of the
 * prefill GEMM against tm_dequant_lanes' weights (16-byte moves, one pass). */
void tm_lanes_f32(const float *x, int T, int K, float *out, int nthreads) {
    const int nfull = K / QK / GB, nt = n_threads(nthreads);
    (void)nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && (size_t)T * K > 65536)
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * K;
        float *o = out + (size_t)t * K;
        for (int g = 0; g < nfull; g++) /* value j = 4i + u of block k -> i * 64 + k * 4 + u */
            for (int k = 0; k < GB; k++)
                for (int i = 0; i < 8; i++)
                    memcpy(o + (size_t)g * GW + i * 64 + k * 4, xr + (size_t)g * GW + k * QK + 4 * i, 16);
        memcpy(o + (size_t)nfull * GW, xr + (size_t)nfull * GW, (size_t)(K - nfull * GW) * sizeof(float));
    }
}

int tm_dequant_rows(const tm_weight *w, const int64_t *ids, int n, float *out) {
    const int nb = w->k / QK, nfull = nb / GB, K = w->k;
    for (int e = 0; e < n; e++)
        if (ids[e] < 0 || ids[e] >= w->n) return -1;
    float *tmp = scratch((size_t)K * sizeof(float));
    if (!tmp) return 0;
    for (int e = 0; e < n; e++) {
        float *o = out + (size_t)e * K;
        dequant_row_lanes(w, (int)ids[e], tmp);
        for (int g = 0; g < nfull; g++) /* un-transpose full groups, 4 values at a time */
            for (int k = 0; k < GB; k++)
                for (int i = 0; i < 8; i++)
                    memcpy(o + (size_t)g * GW + k * QK + 4 * i, tmp + (size_t)g * GW + i * 64 + 4 * k, 16);
        memcpy(o + (size_t)nfull * GW, tmp + (size_t)nfull * GW, (size_t)(K - nfull * GW) * sizeof(float));
    }
    return 1;
}

/* Lets Python check it loaded a library of this ABI and which code path it has. */
int tm_info(void) { return 2000 + TM_AVX512; }

/* ------------------------------------------------------------------------------ */
/* Fused decode attention (float32)                                               */
/* ------------------------------------------------------------------------------ */

/* RMSNorm of x [hd] in place: x * w / sqrt(mean(x^2) + eps); w NULL = no norm. */
static inline void rms_norm_inplace(float *x, int hd, const float *w, float eps) {
    if (!w) return;
    float ss = 0.f;
    for (int i = 0; i < hd; i++) ss += x[i] * x[i];
    const float inv = 1.f / sqrtf(ss / hd + eps);
    for (int i = 0; i < hd; i++) x[i] = x[i] * inv * w[i];
}

/* RoPE ("rotate half") of the first `dim` features of x [hd] in place, with the cos/sin
 * row of the token's position (sin's first half carries the minus sign, rotary.py). */
static inline void rope_inplace(float *x, int dim, const float *c, const float *s) {
    const int half = dim / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] + b * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
    }
}

static inline float dot_f32(const float *a, const float *b, int n) {
    int i = 0;
    float acc = 0.f;
#if TM_AVX512
    __m512 v = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) v = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), v);
    acc = _mm512_reduce_add_ps(v);
#endif
    for (; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* y [n] += a * x [n] */
static inline void axpy_f32(float *y, float a, const float *x, int n) {
    int i = 0;
#if TM_AVX512
    const __m512 va = _mm512_set1_ps(a);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * x[i];
}

#if TM_AVX512
/* exp(x) for x <= 0 (max-subtracted scores), ~1 ulp: x = n ln2 + r, |r| <= ln2/2,
 * exp(r) by a degree-6 polynomial (Cephes expf), times 2^n; x < -87 gives 0. */
static inline __m512 exp_ps(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_maskz_scalef_ps(~under, p, n); /* p * 2^n */
}
#endif

#if TM_AVX512
/* The 16 horizontal sums of v[0..15] as one vector (element u = sum of v[u]): a
 * transpose-and-add tree, ~3 instructions per sum instead of a full reduction each. */
static inline __m512 hsum16(const __m512 v[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [v2i 0+2, v2i+1 0+2, v2i 1+3, v2i+1 1+3] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: the lane sums of v4i .. v4i+3 */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* add the four 128-bit lanes: 0x88 picks lanes (0, 2), 0xDD lanes (1, 3) */
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}
#endif

/* sc [m] = scale * (q . K_j), K_j = base + sl[j] * stride: float32 [hd] each. */
static void attn_scores(const float *q, const float *base, const int64_t *sl, size_t stride, int m,
                        int hd, float scale, float *sc) {
    int j = 0;
#if TM_AVX512
    if (hd % 16 == 0)
        for (; j + 16 <= m; j += 16) { /* 16 keys at a time: one horizontal-sum tree */
            __m512 v[16];
            for (int u = 0; u < 16; u++) {
                const float *k = base + (size_t)sl[j + u] * stride;
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
                for (int i = 16; i < hd; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), a);
                v[u] = a;
            }
            _mm512_storeu_ps(sc + j, _mm512_mul_ps(hsum16(v), _mm512_set1_ps(scale)));
        }
#endif
    for (; j < m; j++) sc[j] = dot_f32(q, base + (size_t)sl[j] * stride, hd) * scale;
}

/* acc [rep, hd] = sum_j p[r * m + j] * V_j for each of the rep rows of p, V_j as in
 * attn_scores. The accumulators of up to 4 rows x 64 features stay in registers while
 * the keys stream by (instead of a load and a store of acc per key and row). */
static void attn_values(const float *p, int m, int rep, const float *base, const int64_t *sl,
                        size_t stride, int hd, float *acc) {
#if TM_AVX512
    if (hd % 16 == 0) {
        for (int r0 = 0; r0 < rep; r0 += 4) {
            const int nr = rep - r0 < 4 ? rep - r0 : 4;
            for (int d0 = 0; d0 < hd; d0 += 64) {
                const int nv = (hd - d0 < 64 ? hd - d0 : 64) / 16;
                __m512 a[4][4], vv[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                for (int r = 0; r < 4; r++)
                    for (int i = 0; i < 4; i++) a[r][i] = _mm512_setzero_ps();
                for (int j = 0; j < m; j++) {
                    const float *v = base + (size_t)sl[j] * stride + d0;
                    for (int i = 0; i < 4; i++)
                        if (i < nv) vv[i] = _mm512_loadu_ps(v + 16 * i);
                    for (int r = 0; r < 4; r++)
                        if (r < nr) {
                            const __m512 pr = _mm512_set1_ps(p[(size_t)(r0 + r) * m + j]);
                            for (int i = 0; i < 4; i++)
                                if (i < nv) a[r][i] = _mm512_fmadd_ps(pr, vv[i], a[r][i]);
                        }
                }
                for (int r = 0; r < 4; r++)
                    for (int i = 0; i < 4; i++)
                        if (r < nr && i < nv) _mm512_storeu_ps(acc + (size_t)(r0 + r) * hd + d0 + 16 * i, a[r][i]);
            }
        }
        return;
    }
#endif
    memset(acc, 0, (size_t)rep * hd * sizeof(float));
    for (int j = 0; j < m; j++) {
        const float *vj = base + (size_t)sl[j] * stride;
        for (int r = 0; r < rep; r++) axpy_f32(acc + (size_t)r * hd, p[(size_t)r * m + j], vj, hd);
    }
}

/* s [n] = exp(s - max(s)); returns the sum. */
static inline float softmax_exp(float *s, int n) {
    float mx = -INFINITY;
    for (int j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    int j = 0;
    float sum = 0.f;
#if TM_AVX512
    const __m512 vm = _mm512_set1_ps(mx);
    __m512 acc = _mm512_setzero_ps();
    for (; j < n; j += 16) {
        const __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vm));
        _mm512_mask_storeu_ps(s + j, m, e);
        acc = _mm512_mask_add_ps(acc, m, acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; j < n; j++) {
        s[j] = expf(s[j] - mx);
        sum += s[j];
    }
    return sum;
}

/* Attention of Bd decode rows (one new token each) over a paged KV cache, whole layer
 * in one call: per row and K/V head, q/k RMSNorm (optional), RoPE, the cache write of
 * the new k/v, then softmax(q K^T * scale) V for the `rep` = H/Hkv query heads sharing
 * that K/V head.
 *
 *   qkv        [Bd, (H + 2 Hkv) hd]  fused projection output (q heads, k heads, v heads)
 *   q_norm/k_norm [hd] or NULL; eps their epsilon
 *   rcos/rsin  [P, rot_dim] rotary tables (NULL: no rotary); positions [Bd]
 *   k/v_cache  [num_slots, Hkv, hd]; new_slots [Bd]: where each row's k/v is written
 *   slots      [Bd, cmax] context slots (padded); ctx_lens [Bd]
 *   window     > 0: only the last `window` keys are seen (sliding window), else all
 *   out        [Bd, H hd]
 * Returns 1, or 0 if per-thread scratch could not be allocated. */
int tm_decode_attention(const float *qkv, int Bd, int H, int Hkv, int hd, const float *q_norm,
                        const float *k_norm, float eps, const float *rcos, const float *rsin,
                        const int64_t *positions, int rot_dim, float *k_cache, float *v_cache,
                        const int64_t *new_slots, const int64_t *slots, int cmax,
                        const int64_t *ctx_lens, int window, float scale, float *out,
                        int nthreads) {
    const int rep = H / Hkv, stride = (H + 2 * Hkv) * hd, ntask = Bd * Hkv;
    int nt = n_threads(nthreads);
    nt = nt < ntask ? nt : ntask;
    int ok = 1;
    (void)nt;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(& : ok)
    {
        /* per thread: q [rep, hd], accumulators [rep, hd], scores [rep, cmax] */
        float *q = scratch(((size_t)2 * rep * hd + (size_t)rep * cmax) * sizeof(float));
        if (!q) ok = 0;
#pragma omp for schedule(static)
        for (int task = 0; task < ntask; task++) {
            if (!q) continue;
            const int b = task / Hkv, g = task % Hkv;
            float *acc = q + (size_t)rep * hd, *sc = acc + (size_t)rep * hd;
            const float *row = qkv + (size_t)b * stride;
            const float *c = rcos ? rcos + positions[b] * rot_dim : NULL;
            const float *s = rsin ? rsin + positions[b] * rot_dim : NULL;
            /* ---- new k, v: norm, rotate, write to the cache ---- */
            float *kd = k_cache + ((size_t)new_slots[b] * Hkv + g) * hd;
            memcpy(kd, row + (size_t)(H + g) * hd, hd * sizeof(float));
            rms_norm_inplace(kd, hd, k_norm, eps);
            if (c) rope_inplace(kd, rot_dim, c, s);
            memcpy(v_cache + ((size_t)new_slots[b] * Hkv + g) * hd, row + (size_t)(H + Hkv + g) * hd,
                   hd * sizeof(float));
            /* ---- the rep query heads of this group ---- */
            for (int r = 0; r < rep; r++) {
                float *qr = q + (size_t)r * hd;
                memcpy(qr, row + (size_t)(g * rep + r) * hd, hd * sizeof(float));
                rms_norm_inplace(qr, hd, q_norm, eps);
                if (c) rope_inplace(qr, rot_dim, c, s);
            }
            /* ---- scores over the visible context [j0, n) ---- */
            const int n = (int)ctx_lens[b], j0 = window > 0 && n > window ? n - window : 0, m = n - j0;
            const int64_t *sl = slots + (size_t)b * cmax + j0;
            const size_t stride = (size_t)Hkv * hd; /* floats from one slot to the next */
            for (int r = 0; r < rep; r++)
                attn_scores(q + (size_t)r * hd, k_cache + (size_t)g * hd, sl, stride, m, hd, scale,
                            sc + (size_t)r * m);
            /* ---- softmax, then the weighted sum of values ---- */
            float inv[rep];
            for (int r = 0; r < rep; r++) inv[r] = 1.f / softmax_exp(sc + (size_t)r * m, m);
            attn_values(sc, m, rep, v_cache + (size_t)g * hd, sl, stride, hd, acc);
            for (int r = 0; r < rep; r++) {
                float *o = out + (size_t)b * H * hd + (size_t)(g * rep + r) * hd;
                for (int i = 0; i < hd; i++) o[i] = acc[(size_t)r * hd + i] * inv[r];
            }
        }
    }
    return ok;
}

/* ------------------------------------------------------------------------------ */
/* The whole decode step of every layer in one call                               */
/* ------------------------------------------------------------------------------ */

/* One transformer block's weights for tm_decode_stack (ctypes mirror: fused_stack.py).
 * Linear layers are packed weights; every float pointer may be NULL where the family
 * has no such tensor (biases, sandwich norms, q/k norms, rotary). */
typedef struct {
    const tm_weight *qkv, *o, *up, *down; /* up: [gate; up] stacked, [2f, d] */
    const float *qkv_bias, *o_bias, *up_bias, *down_bias;
    const float *attn_norm, *mlp_norm;            /* RMSNorm weights [d] */
    const float *post_attn_norm, *post_mlp_norm;  /* Gemma's sandwich norms [d] or NULL */
    const float *q_norm, *k_norm;                 /* [hd] or NULL */
    const float *rcos, *rsin;                     /* [P, rot_dim] or NULL */
    float *k_cache, *v_cache;                     /* [num_slots, Hkv, hd] */
    int32_t rot_dim, window, act16;               /* act16: activation bits of the linears */
    float scale;                                  /* attention score scale */
} tm_layer;

typedef struct {
    const tm_layer *layers;
    const float *final_norm; /* [d]: applied to x after the last layer */
    int32_t n_layers, d, H, Hkv, hd, f;
    int32_t act; /* MLP activation of the gate: 0 SiLU, 1 GELU (tanh approximation) */
    float eps;   /* RMSNorm epsilon (also the q/k norms') */
} tm_stack;

/* out [d] = x * w / sqrt(mean(x^2) + eps), accumulated in float like F.rms_norm. */
static void rms_norm_row(const float *x, int d, const float *w, float eps, float *out) {
    float ss = dot_f32(x, x, d);
    const float inv = 1.f / sqrtf(ss / d + eps);
    for (int i = 0; i < d; i++) out[i] = x[i] * inv * w[i];
}

/* out [f] = act(g [f]) * u [f]; act(x) = x * sigmoid(x) (SiLU) or the tanh-GELU
 * 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), both through exp(-|.|) <= 1. */
static void gated_act(const float *g, const float *u, int f, int act, float *out) {
    int i = 0;
#if TM_AVX512
    const __m512 one = _mm512_set1_ps(1.f), half = _mm512_set1_ps(0.5f);
    const __m512 sign = _mm512_set1_ps(-0.f);
    for (; i + 16 <= f; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        __m512 a;
        if (act == 0) {
            const __m512 e = exp_ps(_mm512_or_ps(_mm512_abs_ps(x), sign)); /* exp(-|x|) */
            const __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
            const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
            a = _mm512_mul_ps(x, _mm512_mask_mul_ps(r, neg, r, e)); /* x<0: e/(1+e) */
        } else {
            const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
            const __m512 z = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                           _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
            const __m512 e = exp_ps(_mm512_mul_ps(_mm512_set1_ps(-2.f), _mm512_abs_ps(z)));
            __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e)); /* tanh|z| */
            t = _mm512_or_ps(t, _mm512_and_ps(z, sign));                           /* sign of z */
            a = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, t));
        }
        _mm512_storeu_ps(out + i, _mm512_mul_ps(a, _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < f; i++) {
        const float x = g[i];
        float a;
        if (act == 0) {
            a = x / (1.f + expf(-x));
        } else {
            a = 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
        }
        out[i] = a * u[i];
    }
}

/* dst [Bd, d] = rmsnorm of each row of src (in place when dst == src). */
static void norm_rows(const float *src, int Bd, int d, const float *w, float eps, float *dst) {
    for (int b = 0; b < Bd; b++) rms_norm_row(src + (size_t)b * d, d, w, eps, dst + (size_t)b * d);
}

/* The residual add of a sublayer's output h [Bd, d]: x += post_norm ? rmsnorm(h) : h. */
static void add_residual(float *x, float *h, int Bd, int d, const float *post_norm, float eps) {
    if (post_norm) norm_rows(h, Bd, d, post_norm, eps, h);
    for (size_t i = 0; i < (size_t)Bd * d; i++) x[i] += h[i];
}

/* Grow-only buffers of tm_decode_stack, separate from scratch(): the kernels it calls
 * use scratch() on this same thread. */
static __thread float *stack_buf = NULL;
static __thread size_t stack_cap = 0;

/* x [Bd, d]: the embedded decode rows in, the final norm of the residual stream out.
 * Per layer, for the Bd rows together:
 *     h = rmsnorm(x); qkv = h Wqkv^T; attention over the paged cache (writes k/v);
 *     x += [post_norm](attn Wo^T); h = rmsnorm(x); x += [post_norm](down(act(gate) * up))
 * The rest of the arguments are tm_decode_attention's. Returns 1, or 0 on OOM. */
int tm_decode_stack(const tm_stack *s, float *x, int Bd, const int64_t *positions,
                    const int64_t *new_slots, const int64_t *slots, int cmax,
                    const int64_t *ctx_lens, int nthreads) {
    const int d = s->d, f = s->f, qdim = s->H * s->hd, qkvdim = (s->H + 2 * s->Hkv) * s->hd;
    const size_t need = (size_t)Bd * (d + qkvdim + qdim + d + 2 * f + f);
    if (need > stack_cap) {
        free(stack_buf);
        stack_cap = need + need / 2;
        stack_buf = aligned_alloc(64, ((stack_cap * sizeof(float)) + 63) & ~(size_t)63);
        if (!stack_buf) {
            stack_cap = 0;
            return 0;
        }
    }
    float *h = stack_buf, *qkv = h + (size_t)Bd * d, *att = qkv + (size_t)Bd * qkvdim;
    float *proj = att + (size_t)Bd * qdim, *up = proj + (size_t)Bd * d, *mid = up + (size_t)Bd * 2 * f;
    for (int l = 0; l < s->n_layers; l++) {
        const tm_layer *L = s->layers + l;
        /* ---- attention sublayer ---- */
        norm_rows(x, Bd, d, L->attn_norm, s->eps, h);
        if (!tm_linear(L->qkv, h, Bd, qkv, L->qkv_bias, nthreads, L->act16)) return 0;
        if (!tm_decode_attention(qkv, Bd, s->H, s->Hkv, s->hd, L->q_norm, L->k_norm, s->eps, L->rcos,
                                 L->rsin, positions, L->rot_dim, L->k_cache, L->v_cache, new_slots,
                                 slots, cmax, ctx_lens, L->window, L->scale, att, nthreads))
            return 0;
        if (!tm_linear(L->o, att, Bd, proj, L->o_bias, nthreads, L->act16)) return 0;
        add_residual(x, proj, Bd, d, L->post_attn_norm, s->eps);
        /* ---- MLP sublayer ---- */
        norm_rows(x, Bd, d, L->mlp_norm, s->eps, h);
        if (!tm_linear(L->up, h, Bd, up, L->up_bias, nthreads, L->act16)) return 0;
        for (int b = 0; b < Bd; b++) {
            const float *ub = up + (size_t)b * 2 * f;
            gated_act(ub, ub + f, f, s->act, mid + (size_t)b * f);
        }
        if (!tm_linear(L->down, mid, Bd, proj, L->down_bias, nthreads, L->act16)) return 0;
        add_residual(x, proj, Bd, d, L->post_mlp_norm, s->eps);
    }
    norm_rows(x, Bd, d, s->final_norm, s->eps, x);
    return 1;
}
