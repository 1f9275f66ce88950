/* AArch64 Advanced SIMD (NEON) primitives: 128-bit vectors, 4 lanes.
 * See simd.h for the contract every simd_*.h fulfils. Every AArch64 CPU has these
 * (fp16 <-> fp32 conversion included). The int16 dot has two forms:
 *   with the dot-product extension (armv8.2-a+dotprod: Graviton 2+, Apple M1+, Cortex-A76+)
 *       sdot on the activations' signed high bytes, udot on their unsigned low bytes:
 *       32 products per two instructions;
 *   without it: the bytes zipped into int16, the codes widened, smlal into int32. */
#include <arm_neon.h>

#define TM_W 4
#if defined(__ARM_FEATURE_DOTPROD)
#define TM_SIMD_NAME "neon+dotprod"
/* The high-byte dot of 8-bit codes runs on c - 128 (sdot multiplies signed bytes):
 * quantize_x folds the missing 128 * 256 * sum(high bytes) into its zero-point term. */
#define TM_A16_LEFT_OUT8(hsum, lsum) (-32768 * (hsum))
#else
#define TM_SIMD_NAME "neon"
#endif

typedef float32x4_t vf; /* 4 floats */
typedef int32x4_t vi;   /* 4 int32 */
typedef uint8x16_t vb;  /* 16 bytes: lane k holds bytes 4k..4k+3 */
static inline vf vf_zero(void) { return vdupq_n_f32(0.f); }
static inline vf vf_set1(float a) { return vdupq_n_f32(a); }
static inline vf vf_load(const float *p) { return vld1q_f32(p); }
static inline void vf_store(float *p, vf a) { vst1q_f32(p, a); }
static inline vf vf_add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vf_sub(vf a, vf b) { return vsubq_f32(a, b); }
static inline vf vf_mul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vf_div(vf a, vf b) { return vdivq_f32(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
static inline vf vf_max(vf a, vf b) { return vmaxq_f32(a, b); }
static inline vf vf_min(vf a, vf b) { return vminq_f32(a, b); }
static inline vf vf_abs(vf a) { return vabsq_f32(a); }
static inline vf vf_copysign(vf a, vf s) {
    const uint32x4_t sign = vdupq_n_u32(0x80000000u);
    return vbslq_f32(sign, s, a);
}
static inline vf vf_select_neg(vf x, vf a, vf b) {
    return vbslq_f32(vreinterpretq_u32_s32(vshrq_n_s32(vreinterpretq_s32_f32(x), 31)), a, b);
}
static inline vf vf_round(vf a) { return vrndnq_f32(a); }
static inline float vf_sum(vf a) { return vaddvq_f32(a); }
static inline float vf_hmax(vf a) { return vmaxvq_f32(a); }
static inline vf vf_hsums(const vf v[4]) { return vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3])); }
static inline vf vf_load_f16(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
static inline vf vf_load_u8(const uint8_t *p) { /* 4 bytes -> 4 floats */
    uint32_t b;
    memcpy(&b, p, 4);
    return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(b))))));
}
static inline vf vf_load_i8(const int8_t *p) { /* 4 signed bytes -> 4 floats */
    int32_t b;
    memcpy(&b, p, 4);
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(b))))));
}
static inline vf vf_load_bf16(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }

static inline vi vi_zero(void) { return vdupq_n_s32(0); }
static inline vi vi_set1(int32_t a) { return vdupq_n_s32(a); }
static inline vi vi_load(const int32_t *p) { return vld1q_s32(p); }
static inline void vi_store(int32_t *p, vi a) { vst1q_s32(p, a); }
static inline vi vi_add(vi a, vi b) { return vaddq_s32(a, b); }
static inline vi vi_sub(vi a, vi b) { return vsubq_s32(a, b); }
static inline int32_t vi_sum(vi a) { return vaddvq_s32(a); }
static inline vf vf_from_vi(vi a) { return vcvtq_f32_s32(a); }
static inline vi vi_round(vf a) { return vcvtnq_s32_f32(a); } /* nearest, ties to even */
static inline vf vf_pow2i(vi n) {
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n, vdupq_n_s32(127)), 23));
}
static inline void vi_store_i16(int16_t *p, vi a) { vst1_s16(p, vmovn_s32(a)); }
/* 4x4 int32 transpose in place: v[k] lane l <- v[l] lane k */
static inline void vi_transpose(vi v[4]) {
    const int32x4_t t0 = vtrn1q_s32(v[0], v[1]), t1 = vtrn2q_s32(v[0], v[1]);
    const int32x4_t t2 = vtrn1q_s32(v[2], v[3]), t3 = vtrn2q_s32(v[2], v[3]);
    v[0] = vreinterpretq_s32_s64(vtrn1q_s64(vreinterpretq_s64_s32(t0), vreinterpretq_s64_s32(t2)));
    v[1] = vreinterpretq_s32_s64(vtrn1q_s64(vreinterpretq_s64_s32(t1), vreinterpretq_s64_s32(t3)));
    v[2] = vreinterpretq_s32_s64(vtrn2q_s64(vreinterpretq_s64_s32(t0), vreinterpretq_s64_s32(t2)));
    v[3] = vreinterpretq_s32_s64(vtrn2q_s64(vreinterpretq_s64_s32(t1), vreinterpretq_s64_s32(t3)));
}
/* acc + per lane: the lane's two int16 times x2's two int16, summed (smull, pairwise add) */
static inline vi vi_madd16(vi acc, vi w, int32_t x2) {
    const int16x8_t a = vreinterpretq_s16_s32(w), b = vreinterpretq_s16_s32(vdupq_n_s32(x2));
    return vaddq_s32(acc, vpaddq_s32(vmull_s16(vget_low_s16(a), vget_low_s16(b)), vmull_high_s16(a, b)));
}

static inline vb vb_zero(void) { return vdupq_n_u8(0); }
static inline vb vb_load(const void *p) { return vld1q_u8((const uint8_t *)p); }
/* The first n (< 16) bytes, the rest zero: a partial group's code vector (tm.h) */
static inline vb vb_load_n(const void *p, int n) {
    uint8_t b[16] = {0};
    memcpy(b, p, (size_t)n);
    return vb_load(b);
}
/* Codes minus z as int16 pairs: lane k of *even = codes 4k, 4k+1 of c, of *odd = 4k+2, 4k+3 */
static inline void vb_widen_pairs(vb c, int z, vi *even, vi *odd) {
    const int16x8_t zz = vdupq_n_s16((int16_t)z);
    const int32x4_t lo = vreinterpretq_s32_s16(vsubq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(c))), zz));
    const int32x4_t hi = vreinterpretq_s32_s16(vsubq_s16(vreinterpretq_s16_u16(vmovl_high_u8(c)), zz));
    *even = vuzp1q_s32(lo, hi);
    *odd = vuzp2q_s32(lo, hi);
}

/* c[s] |= bits 2s..2s+1 of v, moved to bits at..at+1 (s = 0..3; 4: 6-bit codes' top
 * bits, 0: 2-bit codes); vshlq_u8 shifts right by a negative count */
static inline void vb_add_crumbs(vb c[4], vb v, int at) {
    const uint8x16_t m = vdupq_n_u8((uint8_t)(3 << at));
    for (int s = 0; s < 4; s++) c[s] = vorrq_u8(c[s], vandq_u8(vshlq_u8(v, vdupq_n_s8((int8_t)(at - 2 * s))), m));
}
/* The 8 code vectors of a 3-bit group from its three planes (simd_avx2.h) */
static inline void vb_codes3(vb p0, vb p1, vb p2, vb c[8]) {
    const uint8x16_t m7 = vdupq_n_u8(7), m4 = vdupq_n_u8(4);
    c[0] = vandq_u8(p0, m7), c[1] = vandq_u8(vshrq_n_u8(p0, 3), m7);
    c[3] = vandq_u8(p1, m7), c[4] = vandq_u8(vshrq_n_u8(p1, 3), m7);
    c[6] = vandq_u8(p2, m7), c[7] = vandq_u8(vshrq_n_u8(p2, 3), m7);
    c[2] = vorrq_u8(vshrq_n_u8(p0, 6), vandq_u8(vshrq_n_u8(p2, 4), m4));
    c[5] = vorrq_u8(vshrq_n_u8(p1, 6), vandq_u8(vshrq_n_u8(p2, 5), m4));
}
/* A 16-byte table, and codes (0..15) looked up in it (tbl) */
static inline vb vb_table(const uint8_t *t) { return vld1q_u8(t); }
static inline vb vb_lookup(vb table, vb c) { return vqtbl1q_u8(table, c); }
static inline void vf_scales6(const uint8_t *lo, const uint8_t *hi, vf *d0, vf *d1) {
    int8_t s0[4], s1[4];
    tm_scales6_lanes(lo, hi, 4, s0, s1);
    *d0 = vf_load_i8(s0), *d1 = vf_load_i8(s1);
}

/* grid entries by four scalar loads (no gather), signs by a bit test per byte */
static inline vb vb_grid(const uint8_t *grid, const uint8_t *lo, const uint8_t *hi, int i, const uint8_t *s) {
    uint32_t e[4];
    for (int k = 0; k < 4; k++) memcpy(&e[k], grid + 4 * (lo[k] | (hi ? ((hi[k] >> i) & 1) << 8 : 0)), 4);
    static const uint8_t sel[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t m = vtstq_u8(vcombine_u8(vdup_n_u8(s[0]), vdup_n_u8(s[1])), vld1q_u8(sel));
    const uint8x16_t g = vld1q_u8((const uint8_t *)e);
    return vsubq_u8(veorq_u8(g, m), m); /* (g ^ -1) + 1 = -g where m */
}

/* c[i] |= bit i of v, moved to bit `at` (i = 0..7; 4: 5-bit codes' top bits);
 * vshlq_u8 shifts right by a negative count */
static inline void vb_add_bits(vb c[8], vb v, int at) {
    const uint8x16_t m = vdupq_n_u8((uint8_t)(1 << at));
    for (int i = 0; i < 8; i++) c[i] = vorrq_u8(c[i], vandq_u8(vshlq_u8(v, vdupq_n_s8((int8_t)(at - i))), m));
}
static inline void vb_nibbles(vb v, vb *lo, vb *hi) {
    *lo = vandq_u8(v, vdupq_n_u8(0x0f));
    *hi = vshrq_n_u8(v, 4);
}

/* n (<= 8) code vectors c (16 codes each, lane k = block k of a group) against the
 * activations q = 256 hi + lo, given as their signed high bytes xh and unsigned low bytes
 * xl at the same positions. Lane k of the result: block k's sum of c * q (for 8-bit codes
 * with dotprod, less 32768 * the block's sum of high bytes: TM_A16_LEFT_OUT8). */
#if defined(__ARM_FEATURE_DOTPROD)
static inline vi group_dot(const vb *c, int n, const int8_t *xh, const uint8_t *xl, int bits) {
    int32x4_t h = vdupq_n_s32(0);
    uint32x4_t l = vdupq_n_u32(0);
    for (int i = 0; i < n; i++) {
        const uint8x16_t cs = bits == 8 ? veorq_u8(c[i], vdupq_n_u8(0x80)) : c[i];
        h = vdotq_s32(h, vreinterpretq_s8_u8(cs), vld1q_s8(xh + 16 * i)); /* sdot */
        l = vdotq_u32(l, c[i], vld1q_u8(xl + 16 * i));                      /* udot */
    }
    return vaddq_s32(vshlq_n_s32(h, 8), vreinterpretq_s32_u32(l));
}
#else
/* Without dotprod: the activation bytes zipped back into int16, the codes widened, then
 * smlal multiplies and accumulates four values of one block per instruction. */
static inline vi group_dot(const vb *c, int n, const int8_t *xh, const uint8_t *xl, int bits) {
    (void)bits;
    int32x4_t b0 = vdupq_n_s32(0), b1 = b0, b2 = b0, b3 = b0;
    for (int i = 0; i < n; i++) {
        const uint8x16_t lo = vld1q_u8(xl + 16 * i), hi = vreinterpretq_u8_s8(vld1q_s8(xh + 16 * i));
        const int16x8_t x0 = vreinterpretq_s16_u8(vzip1q_u8(lo, hi)), x1 = vreinterpretq_s16_u8(vzip2q_u8(lo, hi));
        const int16x8_t cl = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(c[i])));
        const int16x8_t ch = vreinterpretq_s16_u16(vmovl_high_u8(c[i]));
        b0 = vmlal_s16(b0, vget_low_s16(cl), vget_low_s16(x0));
        b1 = vmlal_high_s16(b1, cl, x0);
        b2 = vmlal_s16(b2, vget_low_s16(ch), vget_low_s16(x1));
        b3 = vmlal_high_s16(b3, ch, x1);
    }
    return vpaddq_s32(vpaddq_s32(b0, b1), vpaddq_s32(b2, b3));
}
#endif
