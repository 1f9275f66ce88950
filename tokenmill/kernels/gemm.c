/* The integer prefill GEMM: y [T, N] = x [T, K] @ W^T for packed weights and many rows
 * of x (a prompt), in the GEMV's exact integer arithmetic (linear.c).
 *
 * Why: the other prefill path converts W to float32 tiles for torch's float32 GEMM, which
 * is bound by the FMA units (8 multiply-adds per instruction on AVX2). vpmaddwd multiplies
 * 16 pairs of int16 per instruction: on a Zen 3 core this micro-kernel runs ~60 G
 * multiply-adds/s, float32 GEMM ~38 (benchmarks/README.md). The activations are the
 * GEMV's own integers (tm_quant_block: 16-bit by default), the codes are exact, every block
 * dot is an exact int32, so a prompt's rows get the same numbers as decode's GEMV up to
 * the order of the float sums.
 *
 * Data flow of one call
 *   x [T, K] float32 -> xq int16 [T, K] (natural order), dx [T, nb] block scales,
 *                        sx [T, nb] float sums (for the mins)            (calling thread)
 *   per tile of RT = GR * TM_W weight rows (one thread each):
 *     codes - Z as int16, two per int32 ("pairs"): tw int32 [K/2, RT]: pair p of every row
 *     side by side, so one vector load holds pair p of TM_W rows
 *     unit scales td float [nu, RT] (a unit: a 32-block, or a 16-value half for 6-bit
 *     codes, whose scales are per 16), mins tm float [nb, RT]
 *   per NT tokens (micro-kernel): for each unit, S = 16 (8) steps of
 *     s[g][t] += madd16(pair p of rows g, pair p of token t broadcast)     int32, exact
 *   then acc[g][t] += s * (d_unit * dx_t) (+ m_block * sx_t): float, in registers.
 *
 * Exactness: |c - Z| <= 128 and |q| <= 32767, so a 32-value unit sums to < 2^31; 6-bit
 * units are 16 values (|c - 32| <= 32).
 *
 * 8-bit activations on TM_DOT8 builds: the codes stay unsigned bytes, four per
 * int32 ("quads": tw [K/4, RT]), the activations int8, and vpdpbusd adds four
 * products per lane: half the instructions per unit of the 16-bit path, and half the tile.
 * The zero point leaves as an integer: sum (c - Z) q = sum c q - Z sum q, with sum q per
 * unit and token computed once per call. |c| <= 255, |q| <= 127: exact in int32. Plain
 * AVX2 has vpdpbusd as vpmaddubsw + vpmaddwd, exact for codes of at most 6 bits
 * (TM_DOT8_BITS): 8-bit codes keep the 16-bit path's int16 pairs there.
 *
 * AMX builds (simd_amx.h: AMX-TILE and AMX-INT8, where the OS grants the tiles) take the
 * same tile of code quads as the B operand of a tile product per block and 16 tokens'
 * activations as A, for both precisions: int8 q as they are, 16-bit q as a high and a low
 * byte row (q = 256 h + l + 128). The integers per block are the micro-kernel's, and the
 * float steps after them the same in the same order, so outputs are equal bit for bit
 * (amx_tokens).
 */
#include "tm.h"
#include "simd_amx.h"

#ifndef GR
#define GR 2             /* row vectors per micro-tile */
#endif
#define RT (GR * TM_W)   /* weight rows per tile: 16 on AVX2 */
#ifndef NT /* tokens per micro-tile: GR x NT int32 + GR x NT float accumulators (AVX-512's
              32 registers hold 4 tokens: 1.1-1.15x the GEMM's speed at 128-512 tokens on a
              Sapphire Rapids core over 3; AVX2's 16 hold 3) */
#define NT (TM_W == 16 ? 4 : 3)
#endif
#define NT_MAX 4 /* micro-kernels are instantiated for 1..NT_MAX tokens */
_Static_assert(NT <= NT_MAX, "NT is at most NT_MAX");
#define TOKEN_PASS 1024  /* tokens per pass over the weights: their int16 rows stay in L3 */

/* Which rows come here (GEMM_MIN_ROWS and its measurements): tm_linear_path, linear.c. */

/* ------------------------------------------------------------------------------ */
/* Weight tiles                                                                    */
/* ------------------------------------------------------------------------------ */

/* Row r's unit scales to td[u * RT], its block mins to tm[b * RT]. */
static void tile_scales(const tm_weight *w, int r, float *td, float *tm) {
    const int nb = w->k / QK;
    if (sixteen_scales(w->bits)) { /* unit = half h of block b: scale dsup * its code */
        /* 2-bit units have mins: tm [nu, RT] */
        for (int b = 0; b < nb; b++) {
            const size_t sup = (size_t)r * (nb / 8) + b / 8;
            const float ds = tm_dsup(w, sup);
            for (int h = 0; h < 2; h++) {
                const int u = 2 * b + h, code = tm_half_scale(w, r, b, h);
                if (!unit_mins(w)) {
                    td[(size_t)u * RT] = ds * (float)code;
                    continue;
                }
                const int byte = code; /* 2-bit codes: sc + 16 m */
                td[(size_t)u * RT] = ds * (float)(byte & 15);
                tm[(size_t)u * RT] = -(tm_half_to_float(w->msup[sup]) * (float)(byte >> 4));
            }
        }
        return;
    }
    for (int b = 0; b < nb; b++) {
        td[(size_t)b * RT] = tm_block_scale(w, r, b);
        if (w->mins) tm[(size_t)b * RT] = tm_block_min(w, r, b);
    }
}

/* The tile of rows [r0, r0 + RT), one int32 word per pair or quad of codes in natural
 * order: 16-bit (eight = 0): codes minus the zero point as int16 pairs, pair p (values
 * 2p, 2p + 1) of row r0 + l at tw[p * RT + l]; 8-bit (eight, TM_DOT8 builds): the codes as
 * stored (unsigned, zero point not taken) four to a word, quad q (values 4q..4q+3) at
 * tw[q * RT + l]. Unit scales at td[u * RT + l], block mins at tm[b * RT + l]. Rows past
 * N repeat row N - 1 (computed, never stored). Full groups: a group's code vector i holds
 * quad i of each of its TM_W blocks in lane k, so TM_W rows' vectors, widened to pairs or
 * as they are, transposed in registers give block k's words of every row in one vector,
 * and the tile is written a vector at a time (plain C took 1.1 ns per weight on Zen 3,
 * ~10% of a 512-token prefill and ~30% at 128 tokens). */
static void build_tile(const tm_weight *w, int r0, int32_t *tw, float *td, float *tm, int eight) {
    const int nb = w->k / QK, z = zero_point(w), words = QK / (eight ? 4 : 2); /* per block */
    const size_t rb = row_bytes(w);
    const uint8_t *rp[RT];
    for (int l = 0; l < RT; l++) rp[l] = w->codes + (size_t)(r0 + l < w->n ? r0 + l : w->n - 1) * rb;
    int b0 = 0; /* the blocks before b0 are in the tile */
#if !defined(GEMM_SCALAR_TILES) /* (the define: to test block_codes on whole rows) */
    const int nfull = nb / TM_GB;
    const vb table = vb_table(w->lut ? w->lut : tm_no_table); /* table codes' (once) */
    for (int s = 0; s < GR; s++) /* TM_W rows at a time */
        for (int g = 0; g < nfull; g++) {
            vb c[TM_W][8];
            for (int l = 0; l < TM_W; l++) {
                tm_weight_codes(w, rp[s * TM_W + l], g, table, c[l]);
            }
            for (int i = 0; i < 8; i++) { /* codes 4i..4i+3 of block k: quad i, pairs 2i, 2i + 1 */
                int32_t *d = tw + ((size_t)g * TM_W * words + (eight ? i : 2 * i)) * RT + s * TM_W;
#if TM_DOT8 /* (where code vectors are int32 vectors: the x86 layers) */
                if (eight) {
                    vi v[TM_W];
                    for (int l = 0; l < TM_W; l++) v[l] = c[l][i];
                    vi_transpose(v); /* v[k] lane l: row l's quad i of block k */
                    for (int k = 0; k < TM_W; k++) vi_store(d + (size_t)k * words * RT, v[k]);
                    continue;
                }
#endif
                vi even[TM_W], odd[TM_W];
                for (int l = 0; l < TM_W; l++) vb_widen_pairs(c[l][i], z, &even[l], &odd[l]);
                vi_transpose(even); /* lane l: row l */
                vi_transpose(odd);
                for (int k = 0; k < TM_W; k++) {
                    vi_store(d + (size_t)k * words * RT, even[k]);
                    vi_store(d + (size_t)k * words * RT + RT, odd[k]);
                }
            }
        }
    b0 = nfull * TM_GB;
#endif
    for (int l = 0; l < RT; l++) {
        for (int b = b0; b < nb; b++) { /* the tail blocks */
            uint8_t c[QK];
            tm_block_codes(w, rp[l], b, c);
            int32_t *d = tw + (size_t)b * words * RT + l;
            for (int j = 0; j < words; j++)
                d[j * RT] = eight ? (int32_t)(c[4 * j] | (uint32_t)c[4 * j + 1] << 8 | (uint32_t)c[4 * j + 2] << 16 |
                                              (uint32_t)c[4 * j + 3] << 24)
                                  : tm_code_pair(c + 2 * j, z);
        }
        tile_scales(w, r0 + l < w->n ? r0 + l : w->n - 1, td + l, tm + l);
    }
}

/* ------------------------------------------------------------------------------ */
/* The micro-kernel: RT rows x n (<= NT) tokens over all of K                      */
/* ------------------------------------------------------------------------------ */

/* acc + one step's products: int16 pairs (vpdpwssd / vpmaddwd), or with EIGHT (TM_DOT8
 * builds only) unsigned code quads times int8 activations (vpdpbusd) */
static inline __attribute__((always_inline)) vi madd_step(vi acc, vi w, int32_t x, int EIGHT) {
#if TM_DOT8
    if (EIGHT) return vi_dot8(acc, w, x);
#endif
    (void)EIGHT;
    return vi_madd16(acc, w, x);
}

/* n tokens from the one whose row xq, dx, sx (and xs) point at (row strides K and nb, nu);
 * n, SIX (6-bit: 16-value units), MINS and EIGHT are constants after inlining. xq: int16
 * [n, K], or with EIGHT int8 [n, K]; xs the int sums of q per unit [n, nu] (with EIGHT, for
 * the zero point z; MINS weights have z = 0). MINS: a min per block times its float sum sx,
 * or with SIX (2-bit codes) a min per unit tm [nu, RT] times dx xs, as the GEMV takes it.
 * out: [n, RT]. (Slicing K so that a slice of the tile stays in L1 measured slower: the
 * tile streams from L2 fine.) */
static inline __attribute__((always_inline)) void micro(const int32_t *tw, const float *td, const float *tm,
                                                        const void *xq, const int32_t *xs, const float *dx,
                                                        const float *sx, int K, int z, int n, int SIX, int MINS,
                                                        int EIGHT, float *out) {
    const int nb = K / QK, upb = SIX ? 2 : 1, nu = nb * upb;  /* units per block, per row */
    const int S = QK / upb / (EIGHT ? 4 : 2);                 /* steps (words) per unit */
    const int32_t *xp[NT_MAX];
    for (int t = 0; t < n; t++) xp[t] = (const int32_t *)((const char *)xq + (size_t)t * K * (EIGHT ? 1 : 2));
    vf acc[GR][NT_MAX];
    for (int g = 0; g < GR; g++)
        for (int t = 0; t < n; t++) acc[g][t] = vf_zero();
    for (int b = 0; b < nb; b++) {
        for (int h = 0; h < upb; h++) {
            const int u = b * upb + h;
            const int32_t *wu = tw + (size_t)u * S * RT;
            const size_t pu = (size_t)u * S;
            vi s[GR][NT_MAX];
            for (int g = 0; g < GR; g++)
                for (int t = 0; t < n; t++) s[g][t] = vi_zero();
#pragma GCC unroll 1 /* unrolled, gcc computes all products first and spills them */
            for (int st = 0; st < S; st++) {
                vi wv[GR];
                for (int g = 0; g < GR; g++) wv[g] = vi_load(wu + st * RT + g * TM_W);
                for (int t = 0; t < n; t++) {
                    const int32_t x = xp[t][pu + st];
                    for (int g = 0; g < GR; g++) s[g][t] = madd_step(s[g][t], wv[g], x, EIGHT);
                }
            }
            for (int g = 0; g < GR; g++) {
                const vf d = vf_load(td + (size_t)u * RT + g * TM_W);
                for (int t = 0; t < n; t++) {
                    vf sf = vf_from_vi(s[g][t]);
                    if (EIGHT && !MINS) /* sum (c - z) q = sum c q - z sum q: < 2^21, exact */
                        sf = vf_sub(sf, vf_set1((float)(z * xs[(size_t)t * nu + u])));
                    acc[g][t] = vf_fma(sf, vf_mul(d, vf_set1(dx[(size_t)t * nb + b])), acc[g][t]);
                }
            }
            if (SIX && MINS)
                for (int g = 0; g < GR; g++) {
                    const vf m = vf_load(tm + (size_t)u * RT + g * TM_W);
                    for (int t = 0; t < n; t++) {
                        const float qd = (float)xs[(size_t)t * nu + u] * dx[(size_t)t * nb + b];
                        acc[g][t] = vf_fma(m, vf_set1(qd), acc[g][t]);
                    }
                }
        }
        if (MINS && !SIX)
            for (int g = 0; g < GR; g++) {
                const vf m = vf_load(tm + (size_t)b * RT + g * TM_W);
                for (int t = 0; t < n; t++) acc[g][t] = vf_fma(m, vf_set1(sx[(size_t)t * nb + b]), acc[g][t]);
            }
    }
    for (int t = 0; t < n; t++)
        for (int g = 0; g < GR; g++) vf_store(out + t * RT + g * TM_W, acc[g][t]);
}

typedef void (*micro_fn)(const int32_t *, const float *, const float *, const void *, const int32_t *,
                         const float *, const float *, int, int, float *);
#define DEF_MICRO(E, N, SIX, MINS)                                                                            \
    static void micro_##E##_##N##_##SIX##_##MINS(const int32_t *tw, const float *td, const float *tm,         \
                                                 const void *xq, const int32_t *xs, const float *dx,          \
                                                 const float *sx, int K, int z, float *out) {                 \
        micro(tw, td, tm, xq, xs, dx, sx, K, z, N, SIX, MINS, E, out);                                        \
    }
#define DEF_MICRO_N(E, SIX, MINS) \
    DEF_MICRO(E, 1, SIX, MINS) DEF_MICRO(E, 2, SIX, MINS) DEF_MICRO(E, 3, SIX, MINS) DEF_MICRO(E, 4, SIX, MINS)
#define DEF_MICROS(E) DEF_MICRO_N(E, 0, 0) DEF_MICRO_N(E, 0, 1) DEF_MICRO_N(E, 1, 0) DEF_MICRO_N(E, 1, 1)
#define MICRO_ROW(E, SIX, MINS)                                                                  \
    {micro_##E##_1_##SIX##_##MINS, micro_##E##_2_##SIX##_##MINS, micro_##E##_3_##SIX##_##MINS, \
     micro_##E##_4_##SIX##_##MINS}
#define MICRO_TABLE(E) {{MICRO_ROW(E, 0, 0), MICRO_ROW(E, 0, 1)}, {MICRO_ROW(E, 1, 0), MICRO_ROW(E, 1, 1)}}
DEF_MICROS(0)
#if TM_DOT8
DEF_MICROS(1)
/* [eight][six][mins][n - 1] (six with mins: 2-bit codes); the first NT of each row are used */
static const micro_fn MICRO[2][2][2][NT_MAX] = {MICRO_TABLE(0), MICRO_TABLE(1)};
#else
static const micro_fn MICRO[1][2][2][NT_MAX] = {MICRO_TABLE(0)};
#endif

/* ------------------------------------------------------------------------------ */
/* The entry point                                                                 */
/* ------------------------------------------------------------------------------ */

static __thread tm_buf act_buf;  /* the calling thread's quantized activations */
static __thread tm_buf tile_buf; /* each thread's weight tile */

/* One call's quantized activations, as the micro-kernels read them. */
typedef struct {
    const char *xq;       /* rows of q: see the forms */
    const int32_t *xs;    /* all but INT16: sum of q per unit [T, nu] (the tiles' forms: [nu, T]) */
    const float *dx, *sx; /* block scales and float sums [T, nb] */
} acts;

/* The forms of quantized activations: INT16 int16 [T, K] (the 16-bit micro-kernel); INT8
 * int8 [T, K] (vpdpbusd); for the tiles, TILE8 as INT8 and HILO, 16-bit q = 256 h + l + 128
 * as two int8 rows, h (the high byte) and l (the low byte - 128), 8 tokens' h rows then
 * their l rows: token t's h at row 16 (t / 8) + t % 8, its l 8 rows further. Rows past T
 * exist (the tiles read 16 rows) and hold nothing of use. The tiles' forms keep the scales
 * and sums token-minor (dx [nb, T], xs [nu, T]): a unit's 16 tokens' at one address. */
enum { INT16, INT8, TILE8, HILO };

/* Quantize x [T, K] per 32-block with qmax (tm_quant_block) into act_buf, in `form`; all
 * forms but INT16, and INT16 with 16-value units (upb 2: 2-bit codes' mins need them), also
 * get the sums of q per unit, `upb` units per block. Returns 0 on OOM. */
static int quantize_acts(const float *x, int T, int K, float qmax, int form, int upb, int nthreads, acts *a) {
    const int nb = K / QK, nu = nb * upb;
    const size_t qbytes = ((size_t)(T + 16) * K * 2 + 63) & ~(size_t)63;
    const int sums = form != INT16 || upb == 2;
    const size_t sbytes = sums ? (size_t)T * nu * 4 : 0, fbytes = (size_t)T * nb * 4;
    char *abuf = tm_buf_get(&act_buf, qbytes + sbytes + 2 * fbytes);
    if (!abuf) return 0;
    int32_t *xs = (int32_t *)(abuf + qbytes);
    float *dx = (float *)(abuf + qbytes + sbytes), *sx = dx + (size_t)T * nb;
    int8_t *q8 = (int8_t *)abuf;
    const int tr = form >= TILE8; /* token-minor scales and sums */
    *a = (acts){abuf, xs, dx, sx};
    const int nt = tm_team(nthreads, T);
    (void)nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int t = 0; t < T; t++)
        for (int b = 0; b < nb; b++) {
            const size_t o = (size_t)t * K + (size_t)b * QK, i = tr ? (size_t)b * T + t : (size_t)t * nb + b;
            if (form == INT16) {
                int16_t *q = (int16_t *)abuf + o;
                tm_quant_block(x + o, qmax, q, dx + i, sx + i);
                if (upb == 2) { /* the halves' sums of q */
                    int32_t h0 = 0, h1 = 0;
                    for (int j = 0; j < QK / 2; j++) h0 += q[j], h1 += q[QK / 2 + j];
                    xs[(size_t)t * nu + 2 * (size_t)b] = h0, xs[(size_t)t * nu + 2 * (size_t)b + 1] = h1;
                }
                continue;
            }
            int16_t q[QK];
            tm_quant_block(x + o, qmax, q, dx + i, sx + i);
            int32_t us[2] = {0, 0}; /* the sums of the block's halves (6-bit units) */
            const size_t h = ((size_t)16 * (t / 8) + t % 8) * K + (size_t)b * QK; /* HILO */
            for (int j = 0; j < QK; j++) {
                if (form != HILO) {
                    q8[o + j] = (int8_t)q[j];
                } else { /* arithmetic shift: q = 256 (q >> 8) + (q & 255) */
                    q8[h + j] = (int8_t)(q[j] >> 8);
                    q8[h + 8 * (size_t)K + j] = (int8_t)((q[j] & 255) - 128);
                }
                us[j >= QK / 2] += q[j];
            }
            const size_t u = tr ? (size_t)b * upb * T + t : (size_t)t * nu + (size_t)b * upb, us1 = tr ? T : 1;
            if (upb == 2)
                xs[u] = us[0], xs[u + us1] = us[1];
            else
                xs[u] = us[0] + us[1];
        }
    return 1;
}

#if TM_AMX
/* ------------------------------------------------------------------------------ */
/* The tile path (simd_amx.h): RT rows x n (<= 16) tokens per call                 */
/* ------------------------------------------------------------------------------ */

/* 128 times the sum of each row's codes per block, c128 [nb, RT]: the term that HILO's
 * low bytes, stored less 128, leave out. */
static void tile_code_sums(const int32_t *tw, int nb, int32_t *c128) {
    for (int b = 0; b < nb; b++)
        for (int g = 0; g < GR; g++) {
            vi s = vi_zero();
            for (int st = 0; st < QK / 4; st++)
                s = vi_dot8(s, vi_load(tw + ((size_t)b * (QK / 4) + st) * RT + g * TM_W), 0x01010101);
            for (int i = 0; i < 7; i++) s = vi_add(s, s);
            vi_store(c128 + (size_t)b * RT + g * TM_W, s);
        }
}

/* The micro-kernel's float arithmetic, in its order, over the tiles' exact integer sums:
 * per block s = sum (c - z) q (the codes' tile holds c; z sum q leaves as an integer, which
 * is exact for 16-bit q too, where the float subtraction of the 8-bit path would not be),
 * acc += float(s) * (d_block * dx), then the mins. So the tiles give the VNNI GEMM's
 * outputs bit for bit. Tokens t0 .. t0 + n - 1 (n <= 16, HILO n <= 8, t0 a multiple of 8
 * there); n == the chunk lets the compiler keep acc in registers.
 *
 * Where the time goes (Sapphire Rapids class core): a block's tile product is ~5 ns, its
 * store to c ~4 ns, and reading c back into 16 tokens' floats ~10 ns, and the three barely
 * overlap, so the tiles reach ~1.3x vpdpbusd's GEMM with 8-bit activations and ~1.1-1.3x
 * the 16-bit one (two products per 16 tokens). 6-bit codes (16-value units: twice the
 * stores and reads per product) stay on VNNI, where they are faster. */
static inline __attribute__((always_inline)) void amx_tokens(const int32_t *tw, const float *td, const float *tm,
                                                             const int32_t *c128, const acts *a, size_t t0, int n,
                                                             int T, int K, int z, int mins, int hilo, float *out) {
    const int nb = K / QK;
    int32_t c[2][16 * 16] __attribute__((aligned(64))); /* [set]: amx_dots */
    const int8_t *rows = (const int8_t *)a->xq + (hilo ? 2 * t0 : t0) * K;
    const int32_t *xs = a->xs + t0; /* [nb, T] (units are blocks here) */
    const float *dx = a->dx + t0, *sx = a->sx + t0; /* [nb, T] */
#define AMX_UNIT(set, b) amx_dots(set, c[set], rows + (size_t)(b) * QK, K, tw + (size_t)(b) * (QK / 4) * RT + g * TM_W, RT * 4)
    for (int g = 0; g < GR; g++) {
        vf acc[16];
#pragma GCC unroll 16
        for (int t = 0; t < n; t++) acc[t] = vf_zero();
        AMX_UNIT(0, 0);
        for (int b = 0; b < nb; b++) {
            if (b + 1 < nb) { /* the next block's products run while this one's are read */
                if ((b + 1) & 1)
                    AMX_UNIT(1, b + 1);
                else
                    AMX_UNIT(0, b + 1);
            }
            const int32_t *cb = c[b & 1];
            const vf d = vf_load(td + (size_t)b * RT + g * TM_W);
            const vi cs = hilo ? vi_load(c128 + (size_t)b * RT + g * TM_W) : vi_zero();
#pragma GCC unroll 16
            for (int t = 0; t < n; t++) {
                vi s = hilo ? vi_add(amx_hilo(cb, t), cs) : vi_load(cb + 16 * t);
                if (!mins) s = vi_sub(s, vi_set1(z * xs[(size_t)b * T + t]));
                acc[t] = vf_fma(vf_from_vi(s), vf_mul(d, vf_set1(dx[(size_t)b * T + t])), acc[t]);
            }
            if (mins) {
                const vf m = vf_load(tm + (size_t)b * RT + g * TM_W);
#pragma GCC unroll 16
                for (int t = 0; t < n; t++) acc[t] = vf_fma(m, vf_set1(sx[(size_t)b * T + t]), acc[t]);
            }
        }
        for (int t = 0; t < n; t++) vf_store(out + t * RT + g * TM_W, acc[t]);
    }
#undef AMX_UNIT
}

/* A full chunk (16 tokens, HILO 8: registers), or fewer (the last of a pass); [mins][hilo] */
#define DEF_AMX(MINS, HILO)                                                                                   \
    static void amx_##MINS##_##HILO(const int32_t *tw, const float *td, const float *tm, const int32_t *c128, \
                                    const acts *a, size_t t0, int n, int T, int K, int z, float *out) {       \
        if (n == (HILO ? 8 : 16))                                                                             \
            amx_tokens(tw, td, tm, c128, a, t0, HILO ? 8 : 16, T, K, z, MINS, HILO, out);                     \
        else                                                                                                  \
            amx_tokens(tw, td, tm, c128, a, t0, n, T, K, z, MINS, HILO, out);                                 \
    }
DEF_AMX(0, 0) DEF_AMX(0, 1) DEF_AMX(1, 0) DEF_AMX(1, 1)
typedef void (*amx_fn)(const int32_t *, const float *, const float *, const int32_t *, const acts *, size_t, int,
                       int, int, int, float *);
static const amx_fn AMX[2][2] = {{amx_0_0, amx_0_1}, {amx_1_0, amx_1_1}};
#endif

/* "+amx" (or "+amx(emulated)") where this library's GEMM runs on the tiles (compiled in,
 * and the OS grants them), else "": the suffix of tm_isa's name. */
const char *tm_amx(void) {
#if TM_AMX
    if (amx_ready()) return TM_AMX_NAME;
#endif
    return "";
}

/* y [T, N] = x [T, K] @ W^T (+ bias) for packed weights (bits 2 to 6 or 8; one segment),
 * activations quantized per 32-block to 16 bits if act16, else to the 8-bit range (on
 * TM_DOT8 builds multiplied as int8 by vi_dot8 where it takes the codes, elsewhere
 * widened to int16).
 * Returns 1, 0 on OOM, -1 for weights it does not take (float weights, and 2-, 3- and
 * 6-bit codes without their super-block scales). */
int tm_gemm(const tm_weight *w, const float *x, int T, float *y, const float *bias, int nthreads, int act16) {
    if ((w->bits < 2 || w->bits > 6) && w->bits != 8 && !grid_kind(w->bits)) return -1;
    const int K = w->k, N = w->n, nb = K / QK, six = sixteen_scales(w->bits), nu = six ? 2 * nb : nb;
    if (six && !w->dsup) return -1;
    const int mins = w->mins != NULL || unit_mins(w), z = zero_point(w);
#if TM_AMX
    const int amx = !six && amx_ready(); /* (6-bit codes: see amx_tokens) */
#else
    const int amx = 0;
#endif
    /* eight: the tile holds code quads (8-bit activations where vi_dot8 takes the codes,
     * and the tiles' both) */
    const int eight = TM_DOT8 && ((!act16 && dot_bits(w) <= TM_DOT8_BITS) || amx);
    const int form = !eight ? INT16 : !amx ? INT8 : act16 ? HILO : TILE8;
    const int chunk = !amx ? NT : form == HILO ? 8 : 16; /* tokens per micro-kernel call */
    acts a;
    if (!quantize_acts(x, T, K, act16 ? 32767.f : 127.f, form, six ? 2 : 1, nthreads, &a)) return 0;
    /* ---- tiles of RT rows, one thread each, every token ---- */
    const int ntiles = (N + RT - 1) / RT;
    /* td [nu], tm [nb] (2-bit: [nu] = 2 nb), c128 [nb] (AMX only, never 2-bit): per RT rows */
    const size_t twords = (size_t)K / (eight ? 4 : 2) * RT, tfloats = (size_t)(nu + 2 * nb) * RT;
    int oom = 0;
    for (int tp = 0; tp < T; tp += TOKEN_PASS) {
        const int tend = T - tp < TOKEN_PASS ? T : tp + TOKEN_PASS;
        const int nt = tm_team(nthreads, ntiles);
        int64_t start = tm_now(), done = start;
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
#if TM_AMX
            if (amx) amx_config();
#endif
#pragma omp for schedule(dynamic) nowait
            for (int tile = 0; tile < ntiles; tile++) {
                int32_t *tw = tm_buf_get(&tile_buf, twords * 4 + tfloats * 4);
                if (!tw) {
                    oom = 1;
                    continue;
                }
                float *td = (float *)(tw + twords), *tm = td + (size_t)nu * RT;
                const int r0 = tile * RT, rows = N - r0 < RT ? N - r0 : RT;
                build_tile(w, r0, tw, td, tm, eight);
#if TM_AMX
                int32_t *c128 = (int32_t *)(tm + (size_t)nb * RT);
                if (form == HILO) tile_code_sums(tw, nb, c128);
#endif
                float out[16 * RT];
                for (int t0 = tp; t0 < tend; t0 += chunk) {
                    const int n = tend - t0 < chunk ? tend - t0 : chunk;
                    const size_t ti = (size_t)t0 * nb;
#if TM_AMX
                    if (amx)
                        AMX[mins][form == HILO](tw, td, tm, c128, &a, (size_t)t0, n, T, K, z, out);
                    else
#endif
                        MICRO[eight][six][mins][n - 1](tw, td, tm, a.xq + (size_t)t0 * K * (eight ? 1 : 2),
                                                       a.xs + (size_t)t0 * nu, a.dx + ti, a.sx + ti, K, z, out);
                    for (int t = 0; t < n; t++) {
                        float *yr = y + (size_t)(t0 + t) * N + r0;
                        for (int l = 0; l < rows; l++) yr[l] = out[t * RT + l] + (bias ? bias[r0 + l] : 0.f);
                    }
                }
            }
#if TM_AMX
            if (amx) amx_release();
#endif
            if (tm_thread_id() == 0) done = tm_now();
        }
        tm_team_done(nt, start, done);
    }
    return oom ? 0 : 1;
}
