/* Shared declarations of tokenmill's native kernels (linear.c, gemm.c, attention.c, stack.c).
 *
 * The library is plain C compiled at first use with the system gcc (kernels/build.py),
 * loaded with ctypes, -march=native by default (TOKENMILL_MARCH overrides it). Which
 * vector code a build runs (tm_isa()) is chosen by one thing, the simd.h layer the target
 * compiles in; every kernel is written once over that layer:
 *
 *   avx512[+vnni]  x86-64-v4 (AVX-512 F/BW/DQ/VL), with VNNI where the CPU has it:
 *                  simd_avx512.h, 16 lanes
 *   avx2[+vnni]    x86-64-v3 (AVX2, FMA, F16C), with AVX-VNNI where the CPU has it:
 *                  simd_avx2.h, 8 lanes
 *   neon[+dotprod] AArch64: simd_neon.h, 4 lanes
 *   scalar         anything else: simd_scalar.h (the reference every other path is tested
 *                  against), 4 lanes
 */
#ifndef TM_H
#define TM_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

#define TM_GB TM_W /* blocks per lane-order group: one vector of 32-bit lanes */

#define TM_ABI 22 /* tm_info() / 1000: bumped when a struct or signature changes */

#define QK 32            /* values per block */
#define GW (TM_GB * QK)  /* values per full lane-order group */
#define TCHUNK 8         /* activation rows computed together per weight row */
#define ROWBLOCK 16      /* weight rows a thread keeps hot while looping over T chunks */
/* Software prefetch distance of the GEMV in code bytes (prefetch_codes in linear.c: per
 * group, into L2): 8 KB, the shortest at which the decode GEMVs of real-size layers reach
 * the DRAM rate (benchmarks/README.md: shorter ones fall short, longer ones stream alike).
 * TOKENMILL_PREFETCH=N (bytes) overrides it; -DPREFETCH=N fixes it at build time. */
#ifdef PREFETCH
#define TM_PREFETCH_FIXED 1
#else
extern int tm_prefetch;
#define PREFETCH tm_prefetch
#endif

/* Plain block scales' forms (tm_weight.scale_f16) */
#define TM_SCALE_F32 0
#define TM_SCALE_F16 1
#define TM_SCALE_E8M0 2 /* exponent bytes e: 2^(e - 128), e in [2, 254] (MXFP4's, halved) */

/* Weight kinds (tm_weight.bits). */
#define TM_F16 16  /* float16 [n, k], natural order, no scales */
#define TM_BF16 17 /* bfloat16 [n, k], natural order, no scales */
#define TM_Q8_0 8  /* tm_layer.kv_bits only: a KV cache of q8_0 blocks (attention.c) */
#define TM_F32 32  /* float32 [n, k], natural order, no scales */
#define TM_GRID8 12 /* grid i-quants' own bits (IQ3_XXS): 12 bytes per block (linear.c) */
#define TM_GRID9 13 /* the same with 9-bit grid indices (IQ3_S): 13 bytes per block */

/* The grid i-quants as their file has them (linear.c): grid indices, sign bits and a
 * 4-bit scale code s per block (d = dsup (2 s + 1)); bits is then the bytes per block. */
static inline int grid_kind(int bits) { return bits == TM_GRID8 || bits == TM_GRID9; }

/* One weight, filled once per layer from Python (ctypes.Structure mirror: TmWeight).
 * bits 4, 5, 6 or 8: the packed blocks of linear.c (5: Q5_0/Q5_1/Q5_K's codes, whole
 * groups; 6: Q6_K, int8 scales per 16 values times dsup, no mins); TM_F16 / TM_BF16 / TM_F32: float rows.
 * Block scales (and mins) come in one of two forms:
 *   plain       float16 (scale_f16 = 1), float32 (0) or E8M0 exponent bytes (2) [n, k/32] each
 *   K-quant     (dsup != NULL) GGUF Q4_K/Q5_K's own: a uint8 code per block [n, k/32]
 *               (6 bits), times a float16 per 256 values [n, k/256]: d = dsup * scale
 *               code, m = -msup * min code. 18.5 bytes per 32 values for 4-bit codes,
 *               like the file (float32 scales would make it 24). */
typedef struct tm_weight {
    const uint8_t *codes;
    const void *scales;
    const void *mins;  /* NULL: no mins, zero point Z applies */
    int32_t bits;      /* 2 to 6, 8, TM_GRID8, TM_GRID9, TM_F16, TM_BF16 or TM_F32 */
    int32_t scale_f16; /* plain scales: TM_SCALE_F16, TM_SCALE_F32 or TM_SCALE_E8M0 */
    int32_t n;         /* rows (out features) */
    int32_t k;         /* columns (in features); packed: a multiple of 32 */
    const uint16_t *dsup, *msup; /* K-quant super-block scales [n, k/256], or NULL */
    const struct tm_weight *next; /* the next rows, in their own format (a fused layer of
                                     parts that pack differently), or NULL */
    const uint8_t *lut; /* bits TM_GRID8 / TM_GRID9: the grid, 4 bytes per entry (its values
                           + 128); else 4-bit codes that index a table (GGUF IQ4_NL, IQ4_XS, MXFP4 and the
                           grid i-quants of up to 16 points), or 3-bit ones (those of up to
                           8: IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0, in Q3_K's
                           form): its values + 128, so that w = d * (lut[c] - 128), computed
                           as 8-bit codes with Z = 128 once looked up in registers; or NULL */
    int32_t scale_zero; /* K-quant scale codes: d = dsup * (code - scale_zero); 0, or 32
                           for IQ4_XS's signed 6-bit codes */
    int32_t sup_shift; /* dsup's values are its float16s times 2^-sup_shift (tm_dsup): the
                          grid i-quants' d (2s + 1) / 2^n with the file's own d; else 0 */
} tm_weight;

/* The model's shapes, shared by every layer (ctypes mirror: TmShape). */
typedef struct {
    int32_t n_layers, d, H, Hkv, hd, f; /* f: the MLP's intermediate size */
    /* MLP activation of the gate: 0 SiLU, 1 GELU (tanh approximation), 2 gpt-oss's
     * clamped SwiGLU: (clamp(u, -limit, limit) + 1) * g' sigmoid(alpha g'), g' = min(g, limit) */
    int32_t act;
    float eps;                        /* RMSNorm epsilon (also the q/k norms') */
    float swiglu_limit, swiglu_alpha; /* act 2 only */
} tm_shape;

/* A Mixture-of-Experts MLP (ctypes mirror: TmMoe), layers/moe.py's in the fused stack:
 * a float router [E, d] picks k of E gated experts per row, their outputs weighted by
 * the router's probabilities, plus an optional shared expert gated by sigmoid(x . g), or
 * ungated. */
typedef struct {
    int32_t E, k;          /* experts, and how many each row uses */
    int32_t fe, fs;        /* an expert's width, the shared expert's (0: none) */
    int32_t softmax_first; /* 1: softmax over E, then the top k; 0: softmax of the top-k logits */
    int32_t norm_topk;     /* softmax_first: renormalize the k weights to sum to 1 */
    const float *router, *router_bias;        /* [E, d], [E] or NULL */
    const tm_weight *const *up, *const *down; /* [E] each: up [2fe, d] (gate; up), down [d, fe] */
    const tm_weight *shared_up, *shared_down; /* [2fs, d], [d, fs], or NULL */
    const float *shared_gate;                 /* [d], or NULL: the shared expert is ungated */
    const float *const *up_bias, *const *down_bias; /* [E] each: [2fe], [d] (gpt-oss), or NULL */
} tm_moe;

/* One transformer block as the native decode paths see it (ctypes mirror: TmLayer),
 * built once per layer and used by both: the per-layer decode attention reads its
 * attention fields, the whole-step stack all of them. Linear layers are tm_weights (NULL
 * where a layer is not native: the stack cannot run then); every float pointer may be
 * NULL where the family has no such tensor (biases, sandwich norms, q/k norms, rotary). */
typedef struct {
    const tm_weight *qkv, *o, *up, *down; /* up: [gate; up] stacked, [2f, d] */
    const float *qkv_bias, *o_bias, *up_bias, *down_bias;
    const float *attn_norm, *mlp_norm;            /* RMSNorm weights [d] */
    const float *post_attn_norm, *post_mlp_norm;  /* Gemma's sandwich norms [d] or NULL */
    const float *q_norm, *k_norm;                 /* [hd], or [H hd] and [Hkv hd] (qk_full) */
    const float *rcos, *rsin;                     /* [P, rot_dim] or NULL */
    void *k_cache, *v_cache;                      /* [num_slots, Hkv, hd] of kv_bits values */
    int32_t rot_dim, window, act16;               /* act16: activation bits of the linears */
    int32_t qk_full;  /* 1: q/k norms over the whole projection (OLMo 2), 0: each head apart */
    float scale;      /* attention score scale */
    float softcap;    /* > 0: scores -> softcap * tanh(scores / softcap) (Gemma 2); 0: none */
    float residual_scale; /* x += residual_scale * sublayer (Granite; 1 elsewhere) */
    const tm_moe *moe;    /* an MoE layer's MLP (up, down and up_bias unused then), or NULL */
    const float *sinks;   /* [H]: each head's sink logit, one more softmax term (gpt-oss), or NULL */
    int32_t kv_bits;      /* the cache's values: TM_F32, TM_F16, TM_BF16 (tm_weight's codes) or TM_Q8_0 */
} tm_layer;

/* Tensor parallelism: called with a row-parallel projection's partial sums [n] (the
 * output and down projections), which it replaces by their sum over the ranks. */
typedef void (*tm_allreduce_fn)(float *buf, int32_t n, void *ctx);

typedef struct {
    const tm_shape *shape;
    const tm_layer *layers;  /* [shape->n_layers] */
    const float *final_norm; /* [d]: applied to x after the last layer */
    tm_allreduce_fn allreduce; /* NULL: one rank holds every head (no tensor parallelism) */
    void *allreduce_ctx;
} tm_stack;

/* The decode rows of one step (ctypes mirror: TmRows): Bd rows, one new token each. */
typedef struct {
    const int64_t *positions; /* [Bd] position of each row's token */
    const int64_t *new_slots; /* [Bd] cache slot its k/v is written to */
    const int64_t *slots;     /* [Bd, cmax] the context slots it reads (padded) */
    const int64_t *ctx_lens;  /* [Bd] its context length, the new token included */
    int32_t Bd, cmax;
} tm_rows;

/* ---- the exported entry points (ctypes binds them: kernels/__init__.py) ---- */
int tm_info(void);
int tm_group_blocks(void);
int tm_kquant_scales(void);
int tm_prefetch_bytes(void);
const char *tm_isa(void);
const char *tm_amx(void); /* gemm.c */
int tm_struct_size(int which);
void tm_dequant_lanes(const tm_weight *w, int r0, int r1, float *out, int nthreads);
void tm_lanes_f32(const float *x, int T, int K, float *out, int nthreads);
int tm_dequant_rows(const tm_weight *w, const int64_t *ids, int n, float *out);
int tm_pack_gguf(int qtype, const uint8_t *src, int64_t rows, int k, int as_8bit, uint8_t *codes,
                 void *scales, void *mins, uint16_t *sup, int nthreads);
int tm_decode_stack(const tm_stack *s, const tm_rows *rows, float *x, int nthreads);
int tm_linear(const tm_weight *w, const float *x, int T, float *y, const float *bias, int nthreads,
              int act16);
int tm_linear_jobs(const tm_weight *const *w, const float *const *x, const int *T, float *const *y,
                   const float *const *bias, int n, int nthreads, int act16);
int tm_decode_attention(const tm_shape *s, const tm_layer *L, const tm_rows *rows, const float *qkv,
                        float *out, int nthreads);
int tm_gemm(const tm_weight *w, const float *x, int T, float *y, const float *bias, int nthreads,
            int act16);
int tm_gemm_min_rows(void);
/* How a product of T rows runs (tm_linear_path in linear.c, the one rule): */
#define TM_PATH_GEMV 0  /* the GEMV (linear.c), a few rows at a time */
#define TM_PATH_GEMM 1  /* the integer GEMM (gemm.c): packed weights, many rows */
#define TM_PATH_TILES 2 /* W as float32 tiles for the caller's float32 GEMM (Python's torch) */
int tm_linear_path(int bits, int T, int tiles, char *reason, int cap);
int tm_team_adapt(int on);
void tm_team_stats(int64_t *out);
int tm_team_at(int requested, int useful, int64_t now);
void tm_team_note(int nt, int64_t start, int64_t master_done, int64_t end);

/* ---- small shared helpers ---- */

static inline int tm_threads(int requested) {
#ifdef _OPENMP
    return requested > 0 ? requested : omp_get_max_threads();
#else
    (void)requested;
    return 1;
#endif
}

static inline int tm_thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Thread teams (team.c). A parallel region asks tm_team for its size (the threads
 * requested, <= 0: all, less those a recent region had to wait for, at most `useful`),
 * its master notes tm_now() when its own share is done (the loop `nowait`), and after
 * the region tm_team_done judges the wait at the barrier:
 *
 *     const int nt = tm_team(nthreads, ntasks);
 *     int64_t start = tm_now(), done = start;
 *     #pragma omp parallel num_threads(nt) if (nt > 1)
 *     {
 *         #pragma omp for schedule(...) nowait
 *         for (...) ...;
 *         if (tm_thread_id() == 0) done = tm_now();
 *     }
 *     tm_team_done(nt, start, done);
 */
int64_t tm_now(void); /* ns, CLOCK_MONOTONIC */
int tm_team(int requested, int useful);
void tm_team_done(int nt, int64_t start, int64_t master_done);

/* A grow-only buffer: no malloc on the hot paths once it has grown. Returns NULL on OOM. */
typedef struct {
    void *p;
    size_t cap;
} tm_buf;

static inline void *tm_buf_get(tm_buf *b, size_t bytes) {
    if (bytes > b->cap) {
        free(b->p);
        b->cap = (bytes + bytes / 2 + 63) & ~(size_t)63;
        b->p = aligned_alloc(64, b->cap);
        if (!b->p) b->cap = 0;
    }
    return b->p;
}

/* Scratch per calling thread (and per file). Returns NULL on OOM. */
static __thread tm_buf tm_scratch_buf;
static inline void *tm_scratch(size_t bytes) { return tm_buf_get(&tm_scratch_buf, bytes); }

static inline float tm_scale_at(const void *p, int kind, size_t idx) {
    if (kind == TM_SCALE_E8M0) return ldexpf(1.f, ((const uint8_t *)p)[idx] - 128);
    return kind ? tm_half_to_float(((const uint16_t *)p)[idx]) : ((const float *)p)[idx];
}

/* Bytes of one plain scale of a form */
static inline size_t tm_scale_bytes(int kind) { return kind == TM_SCALE_E8M0 ? 1 : kind ? 2 : 4; }

/* Super-block scale i of w (dsup's float16 times 2^-sup_shift): exact in float32. */
static inline float tm_dsup(const tm_weight *w, size_t i) {
    return ldexpf(tm_half_to_float(w->dsup[i]), -w->sup_shift);
}

/* Scale d and min m of block b of row r, in either form (see tm_weight). */
static inline float tm_block_scale(const tm_weight *w, int r, int b) {
    const size_t i = (size_t)r * (w->k / QK) + b;
    if (!w->dsup) return tm_scale_at(w->scales, w->scale_f16, i);
    if (grid_kind(w->bits)) /* a nibble s per block, two to a byte: d (2 s + 1) */
        return tm_dsup(w, (size_t)r * (w->k / 256) + b / 8) *
               (float)(2 * ((((const uint8_t *)w->scales)[i / 2] >> (4 * (i & 1))) & 15) + 1);
    return tm_dsup(w, (size_t)r * (w->k / 256) + b / 8) *
           (float)(((const uint8_t *)w->scales)[i] - w->scale_zero);
}

static inline float tm_block_min(const tm_weight *w, int r, int b) {
    const size_t i = (size_t)r * (w->k / QK) + b;
    if (!w->mins) return 0.f;
    if (!w->dsup) return tm_scale_at(w->mins, w->scale_f16, i);
    return -(tm_half_to_float(w->msup[(size_t)r * (w->k / 256) + b / 8]) * ((const uint8_t *)w->mins)[i]);
}

/* ------------------------------------------------------------------------------ */
/* The packed format's helpers, shared by linear.c and gemm.c (the format: linear.c) */
/* ------------------------------------------------------------------------------ */

/* Codes with a scale per 16 values: Q6_K's form, 3-bit Q3_K's, and 2-bit Q2_K's with a min
 * per 16 values too (unit_mins). */
static inline int sixteen_scales(int bits) { return bits == 2 || bits == 3 || bits == 6; }

/* 3-bit codes' scales (Q3_K's, and the 3-bit table codes'): a 6-bit code c = scale + 32 per
 * 16 values, as the file has them, 12 bytes per 256 values. Per group (a row's last,
 * partial one: its G blocks) G bytes of low nibbles (block k's: half 0 low, half 1 high),
 * then G / 2 bytes of top pairs (block k's at bits 4 (k & 1), half h's 2 h further); a row's
 * nb * 3 / 2 bytes, groups in order. scale6_group points at block b's group, its width G. */
static inline const uint8_t *scale6_group(const void *scales, int nb, int r, int b, int *G) {
    const int g = b / TM_GB;
    *G = g == nb / TM_GB ? nb % TM_GB : TM_GB;
    return (const uint8_t *)scales + ((size_t)r * nb + (size_t)g * TM_GB) * 3 / 2;
}
static inline int scale6_at(const void *scales, int nb, int r, int b, int h) {
    int G;
    const uint8_t *p = scale6_group(scales, nb, r, b, &G);
    const int k = b % TM_GB;
    return (((p[k] >> (4 * h)) & 15) | ((p[G + k / 2] >> (4 * (k & 1) + 2 * h)) & 3) << 4) - 32;
}

/* 2-bit codes (Q2_K): each 16 values' scale byte holds its scale code (low nibble) and its
 * min code (high nibble), as the file has them: w = dsup * sc * q - msup * m. */
static inline int unit_mins(const tm_weight *w) { return w->bits == 2; }

static inline int zero_point(const tm_weight *w) {
    if (w->lut) return 128;
    if (unit_mins(w)) return 0;
    return w->mins ? 0 : (w->bits == 3 ? 4 : w->bits == 4 ? 8 : w->bits == 5 ? 16 : w->bits == 6 ? 32 : 128);
}

/* The code bits the dot products see: table codes are looked up to 8-bit ones first, 2-bit
 * codes enter as 3-bit ones (at most 7: the dots' small-code bounds). */
static inline int dot_bits(const tm_weight *w) { return w->lut ? 8 : w->bits == 2 ? 3 : w->bits; }

/* Bytes of one full lane-order group of codes (GW values) of `bits` 2, 3, 4, 5, 6 or 8, or
 * of a grid kind's (its bytes per block). */
static inline size_t group_bytes(int bits) { return grid_kind(bits) ? (size_t)TM_GB * bits : (size_t)GW * bits / 8; }

/* 2-, 3-, 5- and 6-bit codes have no natural-order tail (their bit planes need lanes): a
 * row of them is groups, its last one partial where nb % TM_GB blocks are left (a MoE
 * expert's 768 values on AVX-512: 8 of 16; Qwen2.5's 896: 12), laid out in lane order as
 * a whole group of those blocks (vectors of 4 nb % TM_GB bytes), read zero-extended (the
 * lanes past them zero codes against zero activations). Rows of any length. */
static inline int tail_in_lanes(int bits) { return bits == 2 || bits == 3 || bits == 5 || bits == 6 || grid_kind(bits); }
/* The blocks of a row's last, partial group (0: none) */
static inline int partial_group(int bits, int nb) { return tail_in_lanes(bits) ? nb % TM_GB : 0; }

/* Where the scale of half h of block b sits among a row's per-16 scales (nb blocks): per
 * group [half][block of the group], a partial group's [half][its blocks]. */
static inline size_t half_scale_index(int nb, int b, int h) {
    const int g = b / TM_GB, width = g == nb / TM_GB ? nb % TM_GB : TM_GB;
    return (size_t)g * 2 * TM_GB + (size_t)h * width + b % TM_GB;
}

/* The scale code of half h of block b of row r, for the scalar readers of codes with a
 * scale per 16 values (sixteen_scales): 3-bit codes' 6-bit code less 32 (scale6_at),
 * 6-bit codes' int8, 2-bit codes' byte sc + 16 m. */
static inline int tm_half_scale(const tm_weight *w, int r, int b, int h) {
    const int nb = w->k / QK;
    if (w->bits == 3) return scale6_at(w->scales, nb, r, b, h);
    const uint8_t byte = ((const uint8_t *)w->scales)[(size_t)r * 2 * nb + half_scale_index(nb, b, h)];
    return w->bits == 2 ? byte : (int8_t)byte;
}

static inline size_t row_bytes(const tm_weight *w) {
    return grid_kind(w->bits) ? (size_t)(w->k / QK) * w->bits : (size_t)w->k * (size_t)w->bits / 8;
}

/* Lane-order position of value j of block b in a row of nb blocks (= 8-bit code byte). */
static inline size_t lane_pos(int nb, int b, int j) {
    const int full = nb / TM_GB * TM_GB;
    if (b >= full) return (size_t)b * QK + j; /* tail: natural order */
    return (size_t)(b / TM_GB) * GW + (size_t)(j >> 2) * 4 * TM_GB + (b % TM_GB) * 4 + (j & 3);
}

/* The 32 codes of tail block u (of nbt) in natural order, from the row's tail bytes;
 * looked up in lut where there is one. */
static inline void tail_block_codes(const uint8_t *tail, int bits, int u, int nbt, const uint8_t *lut,
                                    uint8_t out[QK]) {
    if (bits == 8) {
        memcpy(out, tail + (size_t)QK * u, QK);
        return;
    }
    const uint8_t *p = tail + QK * (u / 2); /* chunk u/2: 32 bytes, or 16 if a lone block */
    if (u / 2 * 2 + 1 < nbt) {
        const int shift = (u & 1) * 4; /* 64-value chunk: block 2q low nibbles, 2q+1 high */
        for (int j = 0; j < QK; j++) out[j] = (p[j] >> shift) & 15;
    } else {
        for (int j = 0; j < QK / 2; j++) {
            out[j] = p[j] & 15;
            out[QK / 2 + j] = p[j] >> 4;
        }
    }
    if (lut)
        for (int j = 0; j < QK; j++) out[j] = lut[out[j]];
}

/* One code vector of a group: a whole group's 4 TM_GB bytes, or a partial group's `part`
 * (4 bytes a block) zero-extended */
static inline vb tm_code_vector(const uint8_t *p, int part) { return part ? vb_load_n(p, part) : vb_load(p); }

/* The 8 code vectors of the group whose bytes start at p (pb: a row's last, partial
 * group's blocks, its vectors 4 pb bytes; 0 for a whole group): lane k of vector i holds
 * codes 4i..4i+3 of block k (4-bit: the nibble split; 5- and 6-bit: low nibbles plus the
 * top bits; 3-bit: q from its three planes; 2-bit: q from its two, see linear.c). Every
 * offset is in vectors of vs bytes. */
static inline __attribute__((always_inline)) void tm_codes_at(const uint8_t *p, int bits, int pb, vb c[8]) {
    const int part = 4 * pb; /* bytes a partial vector holds (0: a whole one) */
    const size_t vs = pb ? (size_t)part : 4 * TM_GB;
    if (bits == 8) {
        for (int i = 0; i < 8; i++) c[i] = tm_code_vector(p + i * vs, part);
        return;
    }
    if (bits == 3) {
        vb_codes3(tm_code_vector(p, part), tm_code_vector(p + vs, part), tm_code_vector(p + 2 * vs, part), c);
        return;
    }
    if (bits == 2) {
        for (int i = 0; i < 8; i++) c[i] = vb_zero();
        vb_add_crumbs(c, tm_code_vector(p, part), 0);
        vb_add_crumbs(c + 4, tm_code_vector(p + vs, part), 0);
        return;
    }
    for (int i = 0; i < 4; i++) vb_nibbles(tm_code_vector(p + i * vs, part), &c[2 * i], &c[2 * i + 1]);
    if (bits == 5) vb_add_bits(c, tm_code_vector(p + 4 * vs, part), 4);
    if (bits == 6) {
        vb_add_crumbs(c, tm_code_vector(p + 4 * vs, part), 4);
        vb_add_crumbs(c + 4, tm_code_vector(p + 5 * vs, part), 4);
    }
}

/* The 8 code vectors of full group g of a packed row (tm_codes_at). */
static inline __attribute__((always_inline)) void tm_group_codes(const uint8_t *row, int g, int bits, vb c[8]) {
    tm_codes_at(row + (size_t)g * group_bytes(bits), bits, 0, c);
}

/* A grid kind's group at p (a row's last, partial group of pb blocks: pb > 0): per vector i
 * of the 8 its pb or TM_GB low index bytes (one a block), then (TM_GRID9) as many bytes
 * whose bit i is that index's 9th, then per vector its sign bits, half a byte a block. The
 * 8 code vectors: grid entries looked up (8-bit codes, Z = 128) and signed (vb_grid). */
static inline __attribute__((always_inline)) void tm_grid_codes(const tm_weight *w, const uint8_t *p, int pb,
                                                                vb c[8]) {
    const int hi = w->bits == TM_GRID9;
    _Alignas(64) uint8_t pad[TM_GRID9 * TM_GB];
    if (pb) { /* its bytes in a whole group's places, zeros beside (zero activations there) */
        memset(pad, 0, sizeof pad);
        for (int i = 0; i < 8 + hi; i++) memcpy(pad + i * TM_GB, p + i * pb, (size_t)pb);
        for (int i = 0; i < 8; i++) memcpy(pad + (8 + hi) * TM_GB + i * TM_GB / 2, p + (8 + hi) * pb + i * pb / 2, (size_t)pb / 2);
        p = pad;
    }
    const uint8_t *s = p + (8 + hi) * TM_GB;
    for (int i = 0; i < 8; i++) c[i] = vb_grid(w->lut, p + i * TM_GB, hi ? p + 8 * TM_GB : NULL, i, s + i * TM_GB / 2);
}

/* The 32 codes of block b of a row in natural order (lane order undone), as the kernels
 * read them (3-bit table codes and grid kinds looked up), any build. */
static inline void tm_block_codes(const tm_weight *w, const uint8_t *row, int b, uint8_t out[QK]) {
    const int nb = w->k / QK, nfull = nb / TM_GB;
    if (grid_kind(w->bits)) { /* vector i, lane k of its group (tm_grid_codes) */
        const int hi = w->bits == TM_GRID9, G = b / TM_GB == nfull ? nb % TM_GB : TM_GB, k = b % TM_GB;
        const uint8_t *g = row + (size_t)(b / TM_GB) * group_bytes(w->bits), *s = g + (8 + hi) * G;
        for (int i = 0; i < 8; i++) {
            const int e = g[i * G + k] | (hi ? ((g[8 * G + k] >> i) & 1) << 8 : 0);
            for (int t = 0; t < 4; t++) {
                const int j = 4 * k + t;
                const uint8_t v = w->lut[4 * e + t];
                out[4 * i + t] = (s[i * G / 2 + (j >> 3)] >> (j & 7)) & 1 ? (uint8_t)(0u - v) : v;
            }
        }
        return;
    }
    if (b >= nfull * TM_GB && !tail_in_lanes(w->bits)) {
        tail_block_codes(row + (size_t)nfull * GW * w->bits / 8, w->bits, b - nfull * TM_GB, nb % TM_GB, w->lut,
                         out);
        return;
    }
    /* in a group (or a row's last, partial one, its vectors 4 bytes a block): vector i of
     * the group, byte e of it */
    const size_t vbytes = b / TM_GB == nfull ? 4 * (size_t)(nb % TM_GB) : 4 * TM_GB;
    const uint8_t *g = row + (size_t)(b / TM_GB) * group_bytes(w->bits);
    for (int j = 0; j < QK; j++) {
        const size_t i = (size_t)j >> 2, e = (size_t)(b % TM_GB) * 4 + (j & 3);
        const int nib = w->bits < 4 || w->bits > 6 ? 0 : (g[(i >> 1) * vbytes + e] >> ((i & 1) * 4)) & 15;
        if (w->bits == 8) {
            out[j] = g[i * vbytes + e];
        } else if (w->bits == 4) {
            out[j] = (uint8_t)(w->lut ? w->lut[nib] : nib);
        } else if (w->bits == 5) {
            out[j] = (uint8_t)(nib | ((g[4 * vbytes + e] >> i) & 1) << 4);
        } else if (w->bits == 6) {
            out[j] = (uint8_t)(nib | ((g[(4 + (i >> 2)) * vbytes + e] >> (2 * (i & 3))) & 3) << 4);
        } else if (w->bits == 3) {
            out[j] = tm_code3(g[e], g[vbytes + e], g[2 * vbytes + e], (int)i);
            if (w->lut) out[j] = w->lut[out[j]]; /* 3-bit table codes */
        } else { /* 2-bit: vector 4c + s at bits 2s of plane c */
            out[j] = (g[(i >> 2) * vbytes + e] >> (2 * (i & 3))) & 3;
        }
    }
}

static const uint8_t tm_no_table[16]; /* zeros: the table of weights without one */

/* Table codes: the 8 code vectors of a group looked up (tm_group_codes, then this) */
static inline void tm_lookup_codes(vb table, vb c[8]) {
    for (int i = 0; i < 8; i++) c[i] = vb_lookup(table, c[i]);
}

/* The 8 code vectors of full group g of a packed row as the dots take them: table codes
 * looked up (table: vb_table(w->lut)), a grid kind's from its grid (tm_grid_codes). */
static inline __attribute__((always_inline)) void tm_weight_codes(const tm_weight *w, const uint8_t *row, int g,
                                                                  vb table, vb c[8]) {
    if (grid_kind(w->bits)) {
        tm_grid_codes(w, row + (size_t)g * group_bytes(w->bits), 0, c);
        return;
    }
    tm_group_codes(row, g, w->bits, c);
    if (w->lut) tm_lookup_codes(table, c);
}

/* One 32-block of activations v to integers: q = round(v * qmax / amax), ties to even
 * (qmax 127: 8-bit, 32767: 16-bit). Sets *dx = amax / qmax (the block's scale) and *sum
 * = the exact float sum of v; returns the sum of q. The GEMV's and the GEMM's quantizers
 * both use it, so both multiply the same integers. */
static inline int32_t tm_quant_block(const float *v, float qmax, int16_t q[QK], float *dx, float *sum) {
    vf mx = vf_zero(), sm = vf_zero();
    for (int c = 0; c < QK; c += TM_W) {
        const vf a = vf_load(v + c);
        mx = vf_max(mx, vf_abs(a));
        sm = vf_add(sm, a);
    }
    const float amax = vf_hmax(mx);
    const vf inv = vf_set1(amax > 0.f ? qmax / amax : 0.f);
    vi qs = vi_zero();
    for (int c = 0; c < QK; c += TM_W) {
        const vi qc = vi_round(vf_mul(vf_load(v + c), inv));
        qs = vi_add(qs, qc);
        vi_store_i16(q + c, qc);
    }
    *dx = amax / qmax;
    *sum = vf_sum(sm);
    return vi_sum(qs);
}

/* ------------------------------------------------------------------------------ */
/* Float helpers shared by attention.c and stack.c                                 */
/* ------------------------------------------------------------------------------ */

/* RMSNorm: out [n] = x * w / sqrt(mean(x^2) + eps), the sum of squares accumulated in
 * float like F.rms_norm; out may be x (in place). */
static inline float tm_rms_inv(const float *x, int n, float eps) {
    return 1.f / sqrtf(vf_dot(x, x, n) / n + eps);
}
static inline void tm_rms_norm(const float *x, int n, const float *w, float eps, float *out) {
    const float inv = tm_rms_inv(x, n, eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

#endif
