/* x86-64 AVX2 + FMA + F16C (x86-64-v3) primitives: 256-bit vectors, 8 lanes.
 * See simd.h for the contract every simd_*.h fulfils.
 *
 * AVX-VNNI (Intel Alder Lake and later client cores, Sapphire Rapids, Zen 5; gcc defines
 * __AVXVNNI__ under -march=native there): vpdpbusd multiplies unsigned by signed bytes
 * and adds four products into each int32 lane, vpdpwssd does the same for int16 pairs,
 * both without saturation. They replace the vpmaddubsw / vpmaddwd / add chains of
 * group_dot and vi_madd16. TM_EMULATE_AVXVNNI builds the same code over an exact AVX2
 * emulation of the two instructions: how the tests prove the path on a CPU without them
 * (QEMU's TCG does not implement AVX-VNNI either). */
#include <immintrin.h>
#include "simd_x86.h"

#define TM_W 8
#if defined(__AVXVNNI__)
#define TM_VNNI 1
#define TM_SIMD_NAME "avx2+vnni"
/* acc + per int32 lane the four products of u's unsigned bytes by s's signed bytes */
static inline __m256i vnni_dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
/* acc + per int32 lane the two products of a's int16 by b's int16 */
static inline __m256i vnni_dpwssd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#elif defined(TM_EMULATE_AVXVNNI)
#define TM_VNNI 1
#define TM_SIMD_NAME "avx2+vnni(emulated)"
static inline __m256i vnni_dpbusd(__m256i acc, __m256i u, __m256i s) {
    /* even and odd bytes as int16 (u zero-, s sign-extended): every product and pair sum
     * is exact in vpmaddwd's int32 */
    const __m256i ue = _mm256_and_si256(u, _mm256_set1_epi16(0xff)), uo = _mm256_srli_epi16(u, 8);
    const __m256i se = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), so = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ue, se), _mm256_madd_epi16(uo, so)));
}
static inline __m256i vnni_dpwssd(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}
#else
#define TM_VNNI 0
#define TM_SIMD_NAME "avx2"
#endif
#if TM_VNNI
/* vpdpbusd's low-byte pass runs on 8-bit codes as c - 128 (it needs one signed operand):
 * quantize_x folds the missing 128 * sum(low bytes) into its zero-point term. */
#define TM_A16_LEFT_OUT8(hsum, lsum) (-128 * (lsum))
#endif

typedef __m256 vf;  /* 8 floats */
typedef __m256i vi; /* 8 int32 */
typedef __m256i vb; /* 32 bytes: lane k holds bytes 4k..4k+3 */
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm256_set1_ps(a); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vf_abs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
/* sign bit of s on the magnitude of a */
static inline vf vf_copysign(vf a, vf s) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    return _mm256_or_ps(_mm256_andnot_ps(sign, a), _mm256_and_ps(sign, s));
}
/* a where x < 0, else b */
static inline vf vf_select_neg(vf x, vf a, vf b) { return _mm256_blendv_ps(b, a, x); }
static inline vf vf_round(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline float vf_sum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vf_hmax(vf a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
/* lane u = the sum of v[u]'s lanes: a hadd tree, then the two 128-bit halves added */
static inline vf vf_hsums(const vf v[8]) {
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
static inline vf vf_load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vf_load_u8(const uint8_t *p) { /* 8 bytes -> 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf vf_load_i8(const int8_t *p) { /* 8 signed bytes -> 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf vf_load_bf16(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vi vi_set1(int32_t a) { return _mm256_set1_epi32(a); }
static inline vi vi_load(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void vi_store(int32_t *p, vi a) { _mm256_storeu_si256((__m256i *)p, a); }
static inline vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
static inline int32_t vi_sum(vi a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
static inline vf vf_from_vi(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vi vi_round(vf a) { return _mm256_cvtps_epi32(a); } /* nearest, ties to even */
static inline vf vf_pow2i(vi n) { /* 2^n for n in [-126, 127] */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
/* a's 8 lanes as int16 (they fit) */
static inline void vi_store_i16(int16_t *p, vi a) {
    _mm_storeu_si128((__m128i *)p, _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)));
}

/* acc + per lane: the lane's two int16 times x2's two int16, summed (vpmaddwd: 16 MACs) */
static inline vi vi_madd16(vi acc, vi w, int32_t x2) {
#if TM_VNNI
    return vnni_dpwssd(acc, w, _mm256_set1_epi32(x2));
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_set1_epi32(x2)));
#endif
}

/* 8x8 int32 transpose in place: v[k] lane l <- v[l] lane k */
static inline void vi_transpose(vi v[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        v[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

static inline vb vb_zero(void) { return _mm256_setzero_si256(); }
static inline vb vb_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
/* The first n (< 32) bytes, the rest zero: a partial group's code vector (tm.h) */
static inline vb vb_load_n(const void *p, int n) {
    uint8_t b[32] = {0};
    memcpy(b, p, (size_t)n);
    return vb_load(b);
}
static inline void vb_nibbles(vb v, vb *lo, vb *hi) {
    const __m256i m = _mm256_set1_epi8(0x0f);
    *lo = _mm256_and_si256(v, m);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
}

/* Codes minus z as int16 pairs: lane k of *even = codes 4k, 4k+1 of c, of *odd = 4k+2, 4k+3
 * (the first of each pair in the low half) */
static inline void vb_widen_pairs(vb c, int z, vi *even, vi *odd) {
    const __m256i zz = _mm256_set1_epi16((short)z), idx = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i lo = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(c)), zz);
    const __m256i hi = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(c, 1)), zz);
    const __m256i a = _mm256_permutevar8x32_epi32(lo, idx), b = _mm256_permutevar8x32_epi32(hi, idx);
    *even = _mm256_permute2x128_si256(a, b, 0x20); /* blocks 0-3 | 4-7 */
    *odd = _mm256_permute2x128_si256(a, b, 0x31);
}

/* c[s] |= bits 2s..2s+1 of v, moved to bits at..at+1 (s = 0..3; at 4: the top two bits
 * of four vectors of 6-bit codes, 0: 2-bit codes). 16-bit shifts: the mask keeps only
 * what stays in its byte. */
static inline __attribute__((always_inline)) void vb_add_crumbs(vb c[4], vb v, int at) {
    const __m256i m = _mm256_set1_epi8((char)(3 << at));
    for (int s = 0; s < 4; s++) {
        const int d = at - 2 * s;
        const __m256i t = d > 0 ? _mm256_slli_epi16(v, d) : d < 0 ? _mm256_srli_epi16(v, -d) : v;
        c[s] = _mm256_or_si256(c[s], _mm256_and_si256(t, m));
    }
}

/* The 8 code vectors of a 3-bit group from its three planes (linear.c): vector 0, 1 and 2's
 * low two bits in p0 (bits 0-2, 3-5, 6-7), 3, 4 and 5's in p1, 6 and 7 in p2 with 2 and 5's
 * top bits at 6 and 7. 16-bit shifts: the masks keep only what stays in its byte. */
static inline __attribute__((always_inline)) void vb_codes3(vb p0, vb p1, vb p2, vb c[8]) {
    const __m256i m7 = _mm256_set1_epi8(7), m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);
    c[0] = _mm256_and_si256(p0, m7), c[1] = _mm256_and_si256(_mm256_srli_epi16(p0, 3), m7);
    c[3] = _mm256_and_si256(p1, m7), c[4] = _mm256_and_si256(_mm256_srli_epi16(p1, 3), m7);
    c[6] = _mm256_and_si256(p2, m7), c[7] = _mm256_and_si256(_mm256_srli_epi16(p2, 3), m7);
    c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p0, 6), m3), _mm256_and_si256(_mm256_srli_epi16(p2, 4), m4));
    c[5] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p1, 6), m3), _mm256_and_si256(_mm256_srli_epi16(p2, 5), m4));
}

/* A 16-byte table in both 128-bit lanes, and codes (0..15) looked up in it (vpshufb) */
static inline vb vb_table(const uint8_t *t) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t)); }
static inline vb vb_lookup(vb table, vb c) { return _mm256_shuffle_epi8(table, c); }
static inline void vf_scales6(const uint8_t *lo, const uint8_t *hi, vf *d0, vf *d1) {
    int32_t h4;
    memcpy(&h4, hi, 4);
    __m128i c0, c1;
    tm_scales6_bytes(_mm_loadl_epi64((const __m128i *)lo), _mm_cvtsi32_si128(h4), &c0, &c1);
    *d0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c0)), *d1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c1));
}

/* grid entries by vpgatherdd; the 32 sign bits to byte masks (byte j: bit j of s) */
static inline vb vb_grid(const uint8_t *grid, const uint8_t *lo, const uint8_t *hi, int i, const uint8_t *s) {
    __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)lo));
    if (hi) {
        const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)hi));
        idx = _mm256_or_si256(idx, _mm256_and_si256(_mm256_sllv_epi32(h, _mm256_set1_epi32(8 - i)),
                                                     _mm256_set1_epi32(256)));
    }
    const __m256i g = _mm256_i32gather_epi32((const int *)(const void *)grid, idx, 4);
    int32_t bits;
    memcpy(&bits, s, 4);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2,
                                            2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i sel = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i m = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(bits), spread), sel), sel);
    return _mm256_sub_epi8(_mm256_xor_si256(g, m), m); /* (g ^ -1) + 1 = -g where m */
}

/* c[i] |= bit i of v, moved to bit `at` (i = 0..7; at 4: the top bits of eight vectors
 * of 5-bit codes). 16-bit shifts: the mask keeps only what stays in its byte. */
static inline __attribute__((always_inline)) void vb_add_bits(vb c[8], vb v, int at) {
    const __m256i m = _mm256_set1_epi8((char)(1 << at));
    for (int i = 0; i < 8; i++) {
        const __m256i s = i < at ? _mm256_slli_epi16(v, at - i) : i > at ? _mm256_srli_epi16(v, i - at) : v;
        c[i] = _mm256_or_si256(c[i], _mm256_and_si256(s, m));
    }
}

/* n (<= 8) code vectors c (32 codes each, lane k = block k of a group) against the
 * activations q = 256 hi + lo, given as their signed high bytes xh and unsigned low bytes
 * xl at the same positions. Lane k of the result: block k's sum of c * q, exact.
 * 3-bit codes (<= 7): the same, every product of a plane summed in int16.
 * 4-bit codes (<= 15): vpmaddubsw multiplies bytes without widening and never saturates
 *   (|pair| <= 2 * 15 * 255); eight high-byte or four low-byte products stay below 2^15
 *   in int16, so three vpmaddwd per group finish the sums in int32.
 * 6-bit codes (<= 63): vpmaddubsw too; a high-byte pair is at most 2 * 63 * 128 in
 *   magnitude, so two vectors' products add in int16 before vpmaddwd widens them; a
 *   low-byte pair (<= 2 * 255 * 63) is widened alone. 5.5 instructions per vector
 *   against 8 for the unpacking below.
 * 8-bit codes: bytes unpacked to int16 (in-lane, beside the activation's two bytes),
 *   then vpmaddwd; hadd puts the blocks back in order. */
#if TM_VNNI
/* With AVX-VNNI: per vector one vpdpbusd on the high bytes (codes unsigned, activations
 * signed) and one on the low bytes (activations unsigned, codes signed: 4- and 6-bit
 * codes are, 8-bit ones enter as c - 128, see TM_A16_LEFT_OUT8); two accumulators per
 * pass so consecutive vectors do not wait on each other's latency. */
static inline vi group_dot(const vb *c, int n, const int8_t *xh, const uint8_t *xl, int bits) {
    __m256i h[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, l[2] = {h[0], h[0]};
    const __m256i flip = _mm256_set1_epi8(bits == 8 ? (char)0x80 : 0);
    for (int i = 0; i < n; i++) {
        h[i & 1] = vnni_dpbusd(h[i & 1], c[i], _mm256_loadu_si256((const __m256i *)(xh + 32 * i)));
        l[i & 1] = vnni_dpbusd(l[i & 1], _mm256_loadu_si256((const __m256i *)(xl + 32 * i)), _mm256_xor_si256(c[i], flip));
    }
    return _mm256_add_epi32(_mm256_slli_epi32(_mm256_add_epi32(h[0], h[1]), 8), _mm256_add_epi32(l[0], l[1]));
}
#define TM_DOT8 1
/* group_dot for 8-bit activations (|q| <= 127), read as int8 from the low-byte plane (the
 * same bits): one vpdpbusd per vector, the exact sum of c * q (see simd_avx512.h). */
static inline vi group_dot8(const vb *c, int n, const int8_t *x, int bits) {
    (void)bits;
    __m256i a[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int i = 0; i < n; i++)
        a[i & 1] = vnni_dpbusd(a[i & 1], c[i], _mm256_loadu_si256((const __m256i *)(x + 32 * i)));
    return _mm256_add_epi32(a[0], a[1]);
}
/* acc + per lane: the lane's four unsigned bytes (codes) times x4's four signed bytes,
 * summed (32 MACs): the 8-bit GEMM's core (gemm.c). */
static inline vi vi_dot8(vi acc, vi w, int32_t x4) { return vnni_dpbusd(acc, w, _mm256_set1_epi32(x4)); }
#else
#define TM_DOT8 1
/* vi_dot8 (vpmaddubsw's int16 pairs) saturates for 8-bit codes: the GEMM keeps them on
 * int16 pairs (TM_DOT8_BITS); group_dot8 takes them by the sign trick below. */
#define TM_DOT8_BITS 6
/* group_dot8 of 8-bit codes leaves out 128 times the sum of q (it multiplies c - 128) */
#define TM_A8_LEFT_OUT8(qsum) (-128 * (qsum))
/* group_dot for 8-bit activations (|q| <= 127) read as int8:
 * codes of at most 6 bits (llama.cpp's AVX2 scheme): one vpmaddubsw per vector (a pair <= 2 * 63 * 127, two
 *   vectors' pairs added still below 2^15), one vpmaddwd per two vectors;
 * 8-bit codes: v = c - 128 as int8, vpmaddubsw of |v| by q with v's sign (a pair <= 2 *
 *   128 * 127, exact for every byte, -128 included), one vpmaddwd per vector: the sum of
 *   (c - 128) q, that is c q plus TM_A8_LEFT_OUT8.
 * About half group_dot's instructions. */
static inline vi group_dot8(const vb *c, int n, const int8_t *x, int bits) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc = _mm256_setzero_si256();
    if (bits == 8) {
        for (int i = 0; i < n; i++) {
            const __m256i v = _mm256_xor_si256(c[i], _mm256_set1_epi8((char)0x80));
            const __m256i q = _mm256_loadu_si256((const __m256i *)(x + 32 * i));
            const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(q, v));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
        }
        return acc;
    }
    int i = 0;
    for (; i + 1 < n; i += 2) {
        const __m256i p0 = _mm256_maddubs_epi16(c[i], _mm256_loadu_si256((const __m256i *)(x + 32 * i)));
        const __m256i p1 = _mm256_maddubs_epi16(c[i + 1], _mm256_loadu_si256((const __m256i *)(x + 32 * i + 32)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
    }
    if (i < n)
        acc = _mm256_add_epi32(
            acc, _mm256_madd_epi16(_mm256_maddubs_epi16(c[i], _mm256_loadu_si256((const __m256i *)(x + 32 * i))), ones));
    return acc;
}
/* vpdpbusd as vpmaddubsw + vpmaddwd: exact for codes of at most 6 bits (TM_DOT8_BITS) */
static inline vi vi_dot8(vi acc, vi w, int32_t x4) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_set1_epi32(x4)), _mm256_set1_epi16(1)));
}
static inline vi group_dot(const vb *c, int n, const int8_t *xh, const uint8_t *xl, int bits) {
    const __m256i zero = _mm256_setzero_si256();
    if (bits == 3) { /* codes <= 7: a high-byte pair is at most 2 * 7 * 128 in magnitude, a
                        low-byte one 2 * 255 * 7, so eight vectors' products add in int16 */
        __m256i h = zero, l = zero;
        for (int i = 0; i < n; i++) {
            h = _mm256_add_epi16(h, _mm256_maddubs_epi16(c[i], _mm256_loadu_si256((const __m256i *)(xh + 32 * i))));
            l = _mm256_add_epi16(l, _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(xl + 32 * i)), c[i]));
        }
        return _mm256_add_epi32(_mm256_madd_epi16(h, _mm256_set1_epi16(256)), _mm256_madd_epi16(l, _mm256_set1_epi16(1)));
    }
    if (bits == 4) {
        __m256i h = zero, l0 = zero, l1 = zero;
        for (int i = 0; i < n; i++)
            h = _mm256_add_epi16(h, _mm256_maddubs_epi16(c[i], _mm256_loadu_si256((const __m256i *)(xh + 32 * i))));
        for (int i = 0; i < n; i++) { /* at most four low-byte products per int16 sum */
            const __m256i p = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(xl + 32 * i)), c[i]);
            if (i < 4)
                l0 = _mm256_add_epi16(l0, p);
            else
                l1 = _mm256_add_epi16(l1, p);
        }
        const __m256i ones = _mm256_set1_epi16(1);
        const __m256i lo = _mm256_add_epi32(_mm256_madd_epi16(l0, ones), _mm256_madd_epi16(l1, ones));
        return _mm256_add_epi32(_mm256_madd_epi16(h, _mm256_set1_epi16(256)), lo);
    }
    if (bits == 6) { /* n is even: 4 per half group */
        const __m256i ones = _mm256_set1_epi16(1), k256 = _mm256_set1_epi16(256);
        __m256i acc = zero;
        for (int i = 0; i < n; i += 2) {
            const __m256i h0 = _mm256_maddubs_epi16(c[i], _mm256_loadu_si256((const __m256i *)(xh + 32 * i)));
            const __m256i h1 = _mm256_maddubs_epi16(c[i + 1], _mm256_loadu_si256((const __m256i *)(xh + 32 * i + 32)));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(h0, h1), k256));
        }
        for (int i = 0; i < n; i++) {
            const __m256i l = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(xl + 32 * i)), c[i]);
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(l, ones));
        }
        return acc;
    }
    __m256i a = zero, b = zero; /* blocks [0 1 | 4 5] and [2 3 | 6 7], two int32 each */
    for (int i = 0; i < n; i++) {
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(xl + 32 * i));
        const __m256i hi = _mm256_loadu_si256((const __m256i *)(xh + 32 * i));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_unpacklo_epi8(c[i], zero), _mm256_unpacklo_epi8(lo, hi)));
        b = _mm256_add_epi32(b, _mm256_madd_epi16(_mm256_unpackhi_epi8(c[i], zero), _mm256_unpackhi_epi8(lo, hi)));
    }
    return _mm256_hadd_epi32(a, b);
}
#endif
