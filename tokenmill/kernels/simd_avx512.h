/* x86-64 AVX-512 primitives: 512-bit vectors, 16 lanes. See simd.h for the contract every
 * simd_*.h fulfils.
 *
 * Needs AVX-512 F, BW, DQ and VL (x86-64-v4: Skylake-SP and later Xeons, Zen 4, Zen 5).
 * With AVX-512 VNNI (Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4, Zen 5; gcc defines
 * __AVX512VNNI__ under -march=native there) vpdpbusd multiplies 64 unsigned by signed
 * bytes and adds four products into each int32 lane, vpdpwssd 32 pairs of int16: the
 * integer cores of the GEMV (group_dot) and of the GEMM (vi_madd16). Without VNNI the
 * same sums come from vpmaddubsw / vpmaddwd chains, as on AVX2.
 *
 * TM_SIMDE_AVX512 builds this same file over SIMDe (Debian's libsimde-dev: the AVX-512
 * intrinsics written in AVX2 or plain C) on any x86-64-v3 host, TM_SIMDE_AVX512VNNI with
 * the VNNI instructions too: how the tests run this layer where the CPU lacks it. SIMDe
 * 0.7.4 has no _mm512_reduce_* and no _mm512_cvtsi512_si32, so the horizontal sums here
 * are written out of extracts. */
#if defined(TM_SIMDE_AVX512)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#endif
#include <immintrin.h>
#include "simd_x86.h"

#if defined(TM_SIMDE_AVX512)
/* What SIMDe 0.7.4 lacks or aliases wrongly, written from Intel's definitions, lane by
 * lane through memory (exact, and only ever run by the tests): the 128-bit block
 * shuffles (only their 256-bit forms exist), the widening and narrowing conversions, and
 * _mm512_madd_epi16, whose alias takes the masked form's four arguments. */
#define TM_SIMDE_CVT(name, out_t, out_load, in_t, in_store, n, lane_in, lane_out, expr) \
    static inline out_t tm_simde_##name(in_t a) {                                       \
        lane_in x[n];                                                                    \
        lane_out r[n];                                                                   \
        in_store((void *)x, a);                                                          \
        for (int i = 0; i < n; i++) r[i] = (expr);                                       \
        return out_load((const void *)r);                                                \
    }
static inline __m512 tm_simde_load_ps(const void *p) { return _mm512_loadu_ps((const float *)p); }
static inline void tm_simde_store_ps(void *p, __m512 a) { _mm512_storeu_ps((float *)p, a); }
static inline __m512i tm_simde_load_si512(const void *p) { return _mm512_loadu_si512(p); }
static inline void tm_simde_store_si512(void *p, __m512i a) { _mm512_storeu_si512(p, a); }
static inline __m256i tm_simde_load_si256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void tm_simde_store_si256(void *p, __m256i a) { _mm256_storeu_si256((__m256i *)p, a); }
static inline void tm_simde_store_si128(void *p, __m128i a) { _mm_storeu_si128((__m128i *)p, a); }
TM_SIMDE_CVT(cvtepi32_ps, __m512, tm_simde_load_ps, __m512i, tm_simde_store_si512, 16, int32_t, float, (float)x[i])
TM_SIMDE_CVT(cvtps_epi32, __m512i, tm_simde_load_si512, __m512, tm_simde_store_ps, 16, float, int32_t,
             (int32_t)lrintf(x[i]))
TM_SIMDE_CVT(cvtph_ps, __m512, tm_simde_load_ps, __m256i, tm_simde_store_si256, 16, uint16_t, float,
             tm_half_to_float(x[i]))
TM_SIMDE_CVT(cvtepu8_epi32, __m512i, tm_simde_load_si512, __m128i, tm_simde_store_si128, 16, uint8_t, int32_t, x[i])
TM_SIMDE_CVT(cvtepi8_epi32, __m512i, tm_simde_load_si512, __m128i, tm_simde_store_si128, 16, int8_t, int32_t, x[i])
TM_SIMDE_CVT(cvtepu16_epi32, __m512i, tm_simde_load_si512, __m256i, tm_simde_store_si256, 16, uint16_t, int32_t, x[i])
TM_SIMDE_CVT(cvtepi32_epi16, __m256i, tm_simde_load_si256, __m512i, tm_simde_store_si512, 16, int32_t, int16_t,
             (int16_t)x[i])
TM_SIMDE_CVT(cvtepu8_epi16, __m512i, tm_simde_load_si512, __m256i, tm_simde_store_si256, 32, uint8_t, int16_t, x[i])
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps(a) tm_simde_cvtepi32_ps(a)
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32(a) tm_simde_cvtps_epi32(a)
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps(a) tm_simde_cvtph_ps(a)
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32(a) tm_simde_cvtepu8_epi32(a)
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32(a) tm_simde_cvtepi8_epi32(a)
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32(a) tm_simde_cvtepu16_epi32(a)
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16(a) tm_simde_cvtepi32_epi16(a)
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16(a) tm_simde_cvtepu8_epi16(a)
static inline __m512i tm_simde_shuffle_i32x4(__m512i a, __m512i b, int imm) {
    int32_t x[16], y[16], r[16];
    _mm512_storeu_si512(x, a);
    _mm512_storeu_si512(y, b);
    memcpy(r, x + 4 * (imm & 3), 16);
    memcpy(r + 4, x + 4 * ((imm >> 2) & 3), 16);
    memcpy(r + 8, y + 4 * ((imm >> 4) & 3), 16);
    memcpy(r + 12, y + 4 * ((imm >> 6) & 3), 16);
    return _mm512_loadu_si512(r);
}
#undef _mm512_shuffle_i32x4
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_i32x4(a, b, imm) tm_simde_shuffle_i32x4(a, b, imm)
#define _mm512_shuffle_f32x4(a, b, imm) \
    _mm512_castsi512_ps(tm_simde_shuffle_i32x4(_mm512_castps_si512(a), _mm512_castps_si512(b), imm))
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)
#endif

#define TM_W 16
#if defined(__AVX512VNNI__) || defined(TM_SIMDE_AVX512VNNI)
#define TM_VNNI 1
#else
#define TM_VNNI 0
#endif
#if defined(TM_SIMDE_AVX512)
#define TM_SIMD_NAME (TM_VNNI ? "avx512+vnni(simde)" : "avx512(simde)")
#else
#define TM_SIMD_NAME (TM_VNNI ? "avx512+vnni" : "avx512")
#endif
#if TM_VNNI
/* vpdpbusd's low-byte pass runs on 8-bit codes as c - 128 (it needs one signed operand):
 * quantize_x folds the missing 128 * sum(low bytes) into its zero-point term. */
#define TM_A16_LEFT_OUT8(hsum, lsum) (-128 * (lsum))
#endif

typedef __m512 vf;  /* 16 floats */
typedef __m512i vi; /* 16 int32 */
typedef __m512i vb; /* 64 bytes: lane k holds bytes 4k..4k+3 */

/* the two 256-bit halves, for horizontal sums (AVX-512 F casts and extracts only) */
static inline __m256 tm512_lo_ps(__m512 a) { return _mm512_castps512_ps256(a); }
static inline __m256 tm512_hi_ps(__m512 a) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
}

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_abs(vf a) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)));
}
/* sign bit of s on the magnitude of a */
static inline vf vf_copysign(vf a, vf s) {
    const __m512i m = _mm512_set1_epi32(0x7fffffff);
    const __m512i mag = _mm512_and_si512(_mm512_castps_si512(a), m);
    return _mm512_castsi512_ps(_mm512_or_si512(mag, _mm512_andnot_si512(m, _mm512_castps_si512(s))));
}
/* a where x < 0 (sign bit set), else b */
static inline vf vf_select_neg(vf x, vf a, vf b) {
    const __mmask16 neg = _mm512_movepi32_mask(_mm512_castps_si512(x));
    return _mm512_mask_blend_ps(neg, b, a);
}
static inline vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline float vf_sum(vf a) {
    __m256 h = _mm256_add_ps(tm512_lo_ps(a), tm512_hi_ps(a));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vf_hmax(vf a) {
    __m256 h = _mm256_max_ps(tm512_lo_ps(a), tm512_hi_ps(a));
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
/* lane u = the sum of v[u]'s lanes: a transpose-and-add tree, ~3 instructions a sum */
static inline vf vf_hsums(const vf v[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [v2i 0+2, v2i+1 0+2, v2i 1+3, v2i+1 1+3] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: the lane sums of v4i .. v4i+3 */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* add the four 128-bit lanes: 0x88 picks lanes (0, 2), 0xDD lanes (1, 3) */
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}
static inline vf vf_load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vf_load_u8(const uint8_t *p) { /* 16 bytes -> 16 floats */
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf vf_load_i8(const int8_t *p) { /* 16 signed bytes -> 16 floats */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf vf_load_bf16(const uint16_t *p) { /* exact: the high half of a float32 */
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_set1(int32_t a) { return _mm512_set1_epi32(a); }
static inline vi vi_load(const int32_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline void vi_store(int32_t *p, vi a) { _mm512_storeu_si512((void *)p, a); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
static inline int32_t vi_sum(vi a) {
    __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
static inline vf vf_from_vi(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vi vi_round(vf a) { return _mm512_cvtps_epi32(a); } /* nearest, ties to even */
static inline vf vf_pow2i(vi n) { /* 2^n for n in [-126, 127] */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
}
/* a's 16 lanes as int16 (they fit: vpmovdw truncates) */
static inline void vi_store_i16(int16_t *p, vi a) { _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(a)); }

/* acc + per lane: the lane's two int16 times x2's two int16, summed (32 MACs). VNNI: the
 * instruction written out in place, because gcc 12 round-trips each accumulator of the
 * GEMM's micro-kernel through a register copy around the intrinsic (two vmovdqa per
 * vpdpwssd, filling the rename slots the multiply-adds need). */
static inline vi vi_madd16(vi acc, vi w, int32_t x2) {
#if TM_VNNI && !defined(TM_SIMDE_AVX512)
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(_mm512_set1_epi32(x2)));
    return acc;
#elif TM_VNNI
    return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(x2));
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_set1_epi32(x2)));
#endif
}

/* 16x16 int32 transpose in place: v[k] lane l <- v[l] lane k. Within each 128-bit lane a
 * 4x4 transpose (unpack 32, then 64), then the 4x4 matrix of 128-bit blocks (two rounds of
 * shuffle_i32x4). */
static inline void vi_transpose(vi v[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + j], 128-bit lane L: rows i..i+3, column 4L + j */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* u[4a + j] holds, in 128-bit lane L, rows 4a..4a+3 of column 4L + j. Output row
     * (column of the input) 4L + j gathers lane L of u[j], u[4 + j], u[8 + j], u[12 + j]. */
    for (int j = 0; j < 4; j++) {
        const __m512i a01 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);  /* L0 L1 of u[j] | L0 L1 of u[4+j] */
        const __m512i a23 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);  /* L2 L3 | L2 L3 */
        const __m512i b01 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        const __m512i b23 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
        v[j] = _mm512_shuffle_i32x4(a01, b01, 0x88);      /* lane 0 of each */
        v[4 + j] = _mm512_shuffle_i32x4(a01, b01, 0xDD);  /* lane 1 */
        v[8 + j] = _mm512_shuffle_i32x4(a23, b23, 0x88);  /* lane 2 */
        v[12 + j] = _mm512_shuffle_i32x4(a23, b23, 0xDD); /* lane 3 */
    }
}

static inline vb vb_zero(void) { return _mm512_setzero_si512(); }
static inline vb vb_load(const void *p) { return _mm512_loadu_si512(p); }
/* The first n (< 64) bytes, the rest zero: a partial group's code vector (tm.h); a masked
 * load (SIMDe 0.7.4 has none: through memory there) */
static inline vb vb_load_n(const void *p, int n) {
#if defined(TM_SIMDE_AVX512)
    uint8_t b[64] = {0};
    memcpy(b, p, (size_t)n);
    return vb_load(b);
#else
    return _mm512_maskz_loadu_epi8((__mmask64)((1ULL << n) - 1), p);
#endif
}
static inline void vb_nibbles(vb v, vb *lo, vb *hi) {
    const __m512i m = _mm512_set1_epi8(0x0f);
    *lo = _mm512_and_si512(v, m);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
}

/* Codes minus z as int16 pairs: lane k of *even = codes 4k, 4k+1 of c, of *odd = 4k+2, 4k+3
 * (the first of each pair in the low half) */
static inline void vb_widen_pairs(vb c, int z, vi *even, vi *odd) {
    const __m512i zz = _mm512_set1_epi16((short)z);
    /* int32 lane j of lo: pair j (codes 2j, 2j + 1) of the first 32 codes; of hi: the rest */
    const __m512i lo = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(c)), zz);
    const __m512i hi = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(c, 1)), zz);
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    *even = _mm512_permutex2var_epi32(lo, ie, hi);
    *odd = _mm512_permutex2var_epi32(lo, _mm512_add_epi32(ie, _mm512_set1_epi32(1)), hi);
}

/* c[s] |= bits 2s..2s+1 of v, moved to bits at..at+1 (s = 0..3; at 4: the top two bits
 * of four vectors of 6-bit codes, 0: 2-bit codes). 16-bit shifts: the mask keeps only
 * what stays in its byte. */
static inline __attribute__((always_inline)) void vb_add_crumbs(vb c[4], vb v, int at) {
    const __m512i m = _mm512_set1_epi8((char)(3 << at));
    for (int s = 0; s < 4; s++) {
        const int d = at - 2 * s;
        const __m512i t = d > 0 ? _mm512_slli_epi16(v, d) : d < 0 ? _mm512_srli_epi16(v, -d) : v;
        c[s] = _mm512_or_si512(c[s], _mm512_and_si512(t, m));
    }
}

/* The 8 code vectors of a 3-bit group from its three planes (simd_avx2.h) */
static inline __attribute__((always_inline)) void vb_codes3(vb p0, vb p1, vb p2, vb c[8]) {
    const __m512i m7 = _mm512_set1_epi8(7), m3 = _mm512_set1_epi8(3), m4 = _mm512_set1_epi8(4);
    c[0] = _mm512_and_si512(p0, m7), c[1] = _mm512_and_si512(_mm512_srli_epi16(p0, 3), m7);
    c[3] = _mm512_and_si512(p1, m7), c[4] = _mm512_and_si512(_mm512_srli_epi16(p1, 3), m7);
    c[6] = _mm512_and_si512(p2, m7), c[7] = _mm512_and_si512(_mm512_srli_epi16(p2, 3), m7);
    c[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(p0, 6), m3), _mm512_and_si512(_mm512_srli_epi16(p2, 4), m4));
    c[5] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(p1, 6), m3), _mm512_and_si512(_mm512_srli_epi16(p2, 5), m4));
}

/* A 16-byte table in every 128-bit lane, and codes (0..15) looked up in it (vpshufb) */
static inline vb vb_table(const uint8_t *t) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t)); }
static inline vb vb_lookup(vb table, vb c) { return _mm512_shuffle_epi8(table, c); }
static inline void vf_scales6(const uint8_t *lo, const uint8_t *hi, vf *d0, vf *d1) {
    __m128i c0, c1;
    tm_scales6_bytes(_mm_loadu_si128((const __m128i *)lo), _mm_loadl_epi64((const __m128i *)hi), &c0, &c1);
    *d0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c0)), *d1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c1));
}

/* grid entries by vpgatherdd, the sign bits a byte mask of a masked subtraction (SIMDe:
 * lane by lane, tm_grid_lanes) */
static inline vb vb_grid(const uint8_t *grid, const uint8_t *lo, const uint8_t *hi, int i, const uint8_t *s) {
#if defined(TM_SIMDE_AVX512)
    uint8_t r[64];
    tm_grid_lanes(grid, lo, hi, i, s, r, 16);
    return _mm512_loadu_si512(r);
#else
    __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)lo));
    if (hi) {
        const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)hi));
        idx = _mm512_mask_or_epi32(idx, _mm512_test_epi32_mask(h, _mm512_set1_epi32(1 << i)), idx,
                                   _mm512_set1_epi32(256));
    }
    const __m512i g = _mm512_i32gather_epi32(idx, (const void *)grid, 4);
    uint64_t bits;
    memcpy(&bits, s, 8);
    return _mm512_mask_sub_epi8(g, (__mmask64)bits, _mm512_setzero_si512(), g);
#endif
}

/* c[i] |= bit i of v, moved to bit `at` (i = 0..7; at 4: the top bits of eight vectors
 * of 5-bit codes). 16-bit shifts: the mask keeps only what stays in its byte. */
static inline __attribute__((always_inline)) void vb_add_bits(vb c[8], vb v, int at) {
    const __m512i m = _mm512_set1_epi8((char)(1 << at));
    for (int i = 0; i < 8; i++) {
        const __m512i s = i < at ? _mm512_slli_epi16(v, at - i) : i > at ? _mm512_srli_epi16(v, i - at) : v;
        c[i] = _mm512_or_si512(c[i], _mm512_and_si512(s, m));
    }
}

/* Wide layers only (a vector holds two 32-value blocks): the codes of a natural-order
 * chunk of two tail blocks as one vector, block u in bytes 0-31 and block u + 1 in bytes
 * 32-63. 8-bit codes are 64 bytes as they are; 4-bit ones 32 bytes, low nibbles block u
 * and high nibbles block u + 1 (linear.c's tail format). */
static inline vb vb_tail_pair(const uint8_t *p, int bits) {
    if (bits == 8) return _mm512_loadu_si512(p);
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), m = _mm256_set1_epi8(0x0f);
    const __m256i lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
/* Wide layers only: lo in lanes 0-7, hi in lanes 8-15 (a 16-block group's two K-quant
 * super-block scales; built in registers: 16 scalar stores and a vector load made a
 * Q4_K GEMV 1.8x slower, the load waiting on the stores) */
static inline vf vf_set_halves(float lo, float hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(lo)),
                                               _mm256_castps_pd(_mm256_set1_ps(hi)), 1));
}
/* Wide layers only: the sums of lanes 0-7 and of lanes 8-15 */
static inline void vi_sum_halves(vi a, int32_t *lo, int32_t *hi) {
    const __m256i l = _mm512_castsi512_si256(a), h = _mm512_extracti64x4_epi64(a, 1);
    /* both halves' 8 lanes at once: pairs, then quads, in 128-bit lanes */
    const __m256i a0 = _mm256_hadd_epi32(l, h);  /* [l01 l23 h01 h23 | l45 l67 h45 h67] */
    const __m256i a1 = _mm256_hadd_epi32(a0, a0); /* [l0-3 h0-3 . . | l4-7 h4-7 . .] */
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a1), _mm256_extracti128_si256(a1, 1));
    *lo = _mm_cvtsi128_si32(s);
    *hi = _mm_extract_epi32(s, 1);
}

/* n (<= 8) code vectors c (64 codes each, lane k = block k of a group) against the
 * activations q = 256 hi + lo (signed high bytes xh, unsigned low bytes xl). Lane k of the
 * result: the exact sum of c * q over bytes 4k..4k+3 of every vector.
 * VNNI: per vector one vpdpbusd on the high bytes (codes unsigned, activations signed) and
 *   one on the low bytes (activations unsigned, codes signed: 4- and 6-bit codes are,
 *   8-bit ones enter as c - 128, see TM_A16_LEFT_OUT8); two accumulators per pass.
 * Without: AVX2's vpmaddubsw / vpmaddwd sums on 512-bit registers (simd_avx2.h gives the
 *   bounds that keep them exact). */
static inline vi group_dot(const vb *c, int n, const int8_t *xh, const uint8_t *xl, int bits) {
#if TM_VNNI
    __m512i h[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, l[2] = {h[0], h[0]};
    const __m512i flip = _mm512_set1_epi8(bits == 8 ? (char)0x80 : 0);
    for (int i = 0; i < n; i++) {
        h[i & 1] = _mm512_dpbusd_epi32(h[i & 1], c[i], _mm512_loadu_si512(xh + 64 * i));
        l[i & 1] = _mm512_dpbusd_epi32(l[i & 1], _mm512_loadu_si512(xl + 64 * i), _mm512_xor_si512(c[i], flip));
    }
    return _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h[0], h[1]), 8), _mm512_add_epi32(l[0], l[1]));
#else
    const __m512i zero = _mm512_setzero_si512(), ones = _mm512_set1_epi16(1), k256 = _mm512_set1_epi16(256);
    if (bits <= 4) { /* (3-bit codes too: at most 7) */
        __m512i h = zero, l0 = zero, l1 = zero;
        for (int i = 0; i < n; i++)
            h = _mm512_add_epi16(h, _mm512_maddubs_epi16(c[i], _mm512_loadu_si512(xh + 64 * i)));
        for (int i = 0; i < n; i++) { /* at most four low-byte products per int16 sum */
            const __m512i p = _mm512_maddubs_epi16(_mm512_loadu_si512(xl + 64 * i), c[i]);
            if (i < 4)
                l0 = _mm512_add_epi16(l0, p);
            else
                l1 = _mm512_add_epi16(l1, p);
        }
        const __m512i lo = _mm512_add_epi32(_mm512_madd_epi16(l0, ones), _mm512_madd_epi16(l1, ones));
        return _mm512_add_epi32(_mm512_madd_epi16(h, k256), lo);
    }
    if (bits == 6) { /* n is even: 4 per half group */
        __m512i acc = zero;
        for (int i = 0; i < n; i += 2) {
            const __m512i h0 = _mm512_maddubs_epi16(c[i], _mm512_loadu_si512(xh + 64 * i));
            const __m512i h1 = _mm512_maddubs_epi16(c[i + 1], _mm512_loadu_si512(xh + 64 * i + 64));
            acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_add_epi16(h0, h1), k256));
        }
        for (int i = 0; i < n; i++) {
            const __m512i l = _mm512_maddubs_epi16(_mm512_loadu_si512(xl + 64 * i), c[i]);
            acc = _mm512_add_epi32(acc, _mm512_madd_epi16(l, ones));
        }
        return acc;
    }
    /* 8-bit: per 128-bit lane, blocks [0 1] of that lane in a, [2 3] in b, two int32
     * each; the shuffles add the two (AVX-512 has no vphaddd) */
    __m512i a = zero, b = zero;
    for (int i = 0; i < n; i++) {
        const __m512i lo = _mm512_loadu_si512(xl + 64 * i), hi = _mm512_loadu_si512(xh + 64 * i);
        a = _mm512_add_epi32(a, _mm512_madd_epi16(_mm512_unpacklo_epi8(c[i], zero), _mm512_unpacklo_epi8(lo, hi)));
        b = _mm512_add_epi32(b, _mm512_madd_epi16(_mm512_unpackhi_epi8(c[i], zero), _mm512_unpackhi_epi8(lo, hi)));
    }
    const __m512 fa = _mm512_castsi512_ps(a), fb = _mm512_castsi512_ps(b);
    const __m512i even = _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, _MM_SHUFFLE(2, 0, 2, 0)));
    const __m512i odd = _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_epi32(even, odd);
#endif
}

#if TM_VNNI
#define TM_DOT8 1
/* group_dot for 8-bit activations (|q| <= 127), read as int8 from the low-byte plane (the
 * same bits): one vpdpbusd per vector, codes unsigned (8-bit ones as stored) times q
 * signed, the exact sum of c * q; half group_dot's multiply-adds. */
static inline vi group_dot8(const vb *c, int n, const int8_t *x, int bits) {
    (void)bits;
    __m512i a[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int i = 0; i < n; i++) a[i & 1] = _mm512_dpbusd_epi32(a[i & 1], c[i], _mm512_loadu_si512(x + 64 * i));
    return _mm512_add_epi32(a[0], a[1]);
}
/* acc + per lane: the lane's four unsigned bytes (codes) times x4's four signed bytes,
 * summed (64 MACs): the 8-bit GEMM's core (gemm.c). Written out in place like vi_madd16. */
static inline vi vi_dot8(vi acc, vi w, int32_t x4) {
#if !defined(TM_SIMDE_AVX512)
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(_mm512_set1_epi32(x4)));
    return acc;
#else
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4));
#endif
}
#endif
