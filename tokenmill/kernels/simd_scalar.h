/* Portable C primitives: a "vector" of 4 lanes held in a small array, one loop per
 * operation. This is the reference the SIMD layers are tested against, and what a
 * CPU without AVX2 or NEON runs; at -O3 the compiler turns most of these loops into
 * the host's 128-bit instructions (SSE on x86-64-v2). See simd.h for the contract. */
#include <math.h>

#define TM_W 4
#define TM_SIMD_NAME "scalar"

typedef struct {
    float v[4];
} vf;
typedef struct {
    int32_t v[4];
} vi;
typedef struct {
    uint8_t v[16];
} vb;

#define TM_MAP(T, expr) \
    T r;                \
    for (int i = 0; i < 4; i++) r.v[i] = (expr); \
    return r

static inline vf vf_zero(void) { TM_MAP(vf, 0.f); }
static inline vf vf_set1(float a) { TM_MAP(vf, a); }
static inline vf vf_load(const float *p) { TM_MAP(vf, p[i]); }
static inline void vf_store(float *p, vf a) {
    for (int i = 0; i < 4; i++) p[i] = a.v[i];
}
static inline vf vf_add(vf a, vf b) { TM_MAP(vf, a.v[i] + b.v[i]); }
static inline vf vf_sub(vf a, vf b) { TM_MAP(vf, a.v[i] - b.v[i]); }
static inline vf vf_mul(vf a, vf b) { TM_MAP(vf, a.v[i] * b.v[i]); }
static inline vf vf_div(vf a, vf b) { TM_MAP(vf, a.v[i] / b.v[i]); }
static inline vf vf_fma(vf a, vf b, vf c) { TM_MAP(vf, fmaf(a.v[i], b.v[i], c.v[i])); }
static inline vf vf_max(vf a, vf b) { TM_MAP(vf, a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
static inline vf vf_min(vf a, vf b) { TM_MAP(vf, a.v[i] < b.v[i] ? a.v[i] : b.v[i]); }
static inline vf vf_abs(vf a) { TM_MAP(vf, fabsf(a.v[i])); }
static inline vf vf_copysign(vf a, vf s) { TM_MAP(vf, copysignf(a.v[i], s.v[i])); }
static inline vf vf_select_neg(vf x, vf a, vf b) { TM_MAP(vf, signbit(x.v[i]) ? a.v[i] : b.v[i]); }
static inline vf vf_round(vf a) { TM_MAP(vf, rintf(a.v[i])); } /* current mode: ties to even */
static inline float vf_sum(vf a) { return (a.v[0] + a.v[2]) + (a.v[1] + a.v[3]); }
static inline float vf_hmax(vf a) {
    const float x = a.v[0] > a.v[1] ? a.v[0] : a.v[1], y = a.v[2] > a.v[3] ? a.v[2] : a.v[3];
    return x > y ? x : y;
}
static inline vf vf_hsums(const vf v[4]) { TM_MAP(vf, vf_sum(v[i])); }
static inline vf vf_load_f16(const uint16_t *p) { TM_MAP(vf, tm_half_to_float(p[i])); }
static inline vf vf_load_u8(const uint8_t *p) { TM_MAP(vf, (float)p[i]); }
static inline vf vf_load_i8(const int8_t *p) { TM_MAP(vf, (float)p[i]); }
static inline vf vf_load_bf16(const uint16_t *p) { TM_MAP(vf, tm_bf16_to_float(p[i])); }

static inline vi vi_zero(void) { TM_MAP(vi, 0); }
static inline vi vi_set1(int32_t a) { TM_MAP(vi, a); }
static inline vi vi_load(const int32_t *p) { TM_MAP(vi, p[i]); }
static inline void vi_store(int32_t *p, vi a) {
    for (int i = 0; i < 4; i++) p[i] = a.v[i];
}
static inline vi vi_add(vi a, vi b) { TM_MAP(vi, a.v[i] + b.v[i]); }
static inline vi vi_sub(vi a, vi b) { TM_MAP(vi, a.v[i] - b.v[i]); }
static inline int32_t vi_sum(vi a) { return a.v[0] + a.v[1] + a.v[2] + a.v[3]; }
static inline vf vf_from_vi(vi a) { TM_MAP(vf, (float)a.v[i]); }
static inline vi vi_round(vf a) { TM_MAP(vi, (int32_t)lrintf(a.v[i])); }
static inline vf vf_pow2i(vi n) { TM_MAP(vf, ldexpf(1.f, n.v[i])); }
static inline void vi_store_i16(int16_t *p, vi a) {
    for (int i = 0; i < 4; i++) p[i] = (int16_t)a.v[i];
}

/* acc + per lane: the lane's two int16 (low, high half) times x2's two int16, summed */
static inline vi vi_madd16(vi acc, vi w, int32_t x2) {
    const int32_t xl = (int16_t)(x2 & 0xffff), xh = x2 >> 16;
    TM_MAP(vi, acc.v[i] + (int16_t)(w.v[i] & 0xffff) * xl + (w.v[i] >> 16) * xh);
}

static inline vb vb_zero(void) {
    vb r;
    memset(r.v, 0, 16);
    return r;
}
static inline vb vb_load(const void *p) {
    vb r;
    memcpy(r.v, p, 16);
    return r;
}
/* The first n (< 16) bytes, the rest zero: a partial group's code vector (tm.h) */
static inline vb vb_load_n(const void *p, int n) {
    uint8_t b[16] = {0};
    memcpy(b, p, (size_t)n);
    return vb_load(b);
}
static inline void vb_nibbles(vb v, vb *lo, vb *hi) {
    for (int i = 0; i < 16; i++) {
        lo->v[i] = v.v[i] & 15;
        hi->v[i] = v.v[i] >> 4;
    }
}

/* Codes minus z as int16 pairs: lane k of *even = codes 4k, 4k+1 of c, of *odd = 4k+2, 4k+3 */
static inline void vb_widen_pairs(vb c, int z, vi *even, vi *odd) {
    for (int k = 0; k < 4; k++) {
        even->v[k] = tm_code_pair(c.v + 4 * k, z);
        odd->v[k] = tm_code_pair(c.v + 4 * k + 2, z);
    }
}

/* 4x4 int32 transpose in place: v[k] lane l <- v[l] lane k */
static inline void vi_transpose(vi v[4]) {
    vi t[4];
    for (int k = 0; k < 4; k++)
        for (int l = 0; l < 4; l++) t[k].v[l] = v[l].v[k];
    for (int k = 0; k < 4; k++) v[k] = t[k];
}

/* c[s] |= bits 2s..2s+1 of v, moved to bits at..at+1 (s = 0..3) */
static inline void vb_add_crumbs(vb c[4], vb v, int at) {
    for (int s = 0; s < 4; s++)
        for (int i = 0; i < 16; i++) c[s].v[i] |= ((v.v[i] >> (2 * s)) & 3) << at;
}

/* The 8 code vectors of a 3-bit group from its three planes (tm_code3) */
static inline void vb_codes3(vb p0, vb p1, vb p2, vb c[8]) {
    const vb p[3] = {p0, p1, p2};
    for (int i = 0; i < 8; i++)
        for (int e = 0; e < 16; e++) c[i].v[e] = tm_code3(p[0].v[e], p[1].v[e], p[2].v[e], i);
}

/* A 16-byte table, and codes (0..15) looked up in it */
static inline vb vb_table(const uint8_t *t) {
    vb r;
    memcpy(r.v, t, 16);
    return r;
}
static inline vb vb_lookup(vb table, vb c) {
    vb r;
    for (int i = 0; i < 16; i++) r.v[i] = table.v[c.v[i] & 15];
    return r;
}
static inline void vf_scales6(const uint8_t *lo, const uint8_t *hi, vf *d0, vf *d1) {
    int8_t s0[4], s1[4];
    tm_scales6_lanes(lo, hi, 4, s0, s1);
    *d0 = vf_load_i8(s0), *d1 = vf_load_i8(s1);
}
static inline vb vb_grid(const uint8_t *grid, const uint8_t *lo, const uint8_t *hi, int i, const uint8_t *s) {
    vb r;
    tm_grid_lanes(grid, lo, hi, i, s, r.v, 4);
    return r;
}

/* c[i] |= bit i of v, moved to bit `at` (i = 0..7; 4: 5-bit codes' top bits) */
static inline void vb_add_bits(vb c[8], vb v, int at) {
    for (int s = 0; s < 8; s++)
        for (int i = 0; i < 16; i++) c[s].v[i] |= ((v.v[i] >> s) & 1) << at;
}

/* lane k = block k's sum of c * q, q = 256 hi + lo, over n (<= 8) code vectors */
static inline vi group_dot(const vb *c, int n, const int8_t *xh, const uint8_t *xl, int bits) {
    (void)bits;
    vi r = vi_zero();
    for (int i = 0; i < n; i++)
        for (int k = 0; k < 4; k++)
            for (int t = 0; t < 4; t++) {
                const int p = 16 * i + 4 * k + t;
                r.v[k] += c[i].v[4 * k + t] * (256 * xh[p] + xl[p]);
            }
    return r;
}

#undef TM_MAP
