/* Linear layers: y [T, N] = x [T, K] @ W^T (+ bias) over weights kept compressed.
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
 * Column order of the codes in a row ("lane order"), for G = TM_GB blocks per group
 * (the build's vector width in 32-bit lanes: 16 AVX-512, 8 AVX2, 4 NEON and scalar;
 * tm_group_blocks() tells Python, which packs for the host at load):
 *  - full groups of G blocks (32 G values) first. Value j = 4*i + t (i < 8, t < 4) of
 *    block k of a group sits at position p = i*4G + k*4 + t, so vector i (4G bytes)
 *    holds in 32-bit lane k four consecutive values of block k: dot products over the
 *    8 vectors leave block k's whole int32 dot in lane k, with no horizontal reduction
 *    per block, and one float multiply-add applies the G blocks' scales at once.
 *  - then the tail (nb % G blocks) in natural order, in chunks of 64 values (two
 *    blocks; the last chunk may hold one block, 32 values).
 * 8-bit codes sit at byte p. 4-bit codes: in a full group, byte c*4G + r holds
 * position 2c*4G + r in its low nibble and (2c+1)*4G + r in its high nibble; in a
 * tail chunk of n values, byte r holds value r (low) and value n/2 + r (high).
 *
 * Activations are quantized per 32-block in the same lane order, to 8 bits like
 * llama.cpp's q8 (xq = round(x / dx), dx = max|x| / 127) or to 16 bits (dx = max|x| /
 * 32767: ~250x smaller error, the default). The dot of a block is then
 *     d * dx * (sum c*xq - Z * sum xq) + m * sum x
 * in exact int32 arithmetic up to the final float scaling (sum x is the exact float
 * sum: the min term adds no activation-quantization error). Every build computes the
 * same integers; results differ only in the order of the float sums.
 *
 * How every build multiplies codes by activations: the activations as two byte planes
 * (signed high byte, unsigned low byte), multiplied by group_dot of the simd.h layer:
 * vpdpbusd on AVX-512 VNNI and AVX-VNNI, vpmaddubsw (4- and 6-bit codes) or vpmaddwd
 * (8-bit) on AVX2 and AVX-512 without VNNI, sdot/udot or smlal on NEON, plain C on scalar.
 * 8-bit activations on the VNNI layers and plain AVX2 skip the high plane (all 0 or -1
 * there): the low plane is q itself as int8, and group_dot8 multiplies it by the codes in
 * one vpdpbusd per vector (AVX2: one vpmaddubsw, codes of at most 6 bits; 8-bit codes keep
 * both planes), half the work, the same integers.
 *
 * 5-bit codes (GGUF Q5_0, Q5_1, Q5_K, exactly: c = the file's 5-bit q, Z = 16 for Q5_0,
 * mins for the others, scales as for the 4-bit types). Per group: the low 4 bits as a
 * 4-bit group (GW/2 bytes),
 * then one plane of top bits (GW/8 bytes, one vector): byte r holds vector i's code at
 * position r in bit i. 20 bytes per 32 values plus the scales, like the file's 22-24.
 *   codes   uint8 [N, K*5/8]
 *
 * 6-bit codes (GGUF Q6_K, exactly): w = d16 * (c - 32) with a scale per 16 values, d16 =
 * dsup * sc (a float16 per 256 values times a signed byte per 16, as the file has them).
 * Per group: the low 4 bits as a 4-bit group (GW/2 bytes), then the
 * top 2 bits (GW/4 bytes): byte c*4G + r holds vector 4c + s of the group at bits 2s.
 *   codes   uint8 [N, K*3/4];  scales int8 [N, K/16], per group [half h][block k]
 *   (block k's values 0-15 are vectors 0-3 of the group, 16-31 vectors 4-7); dsup [N, K/256]
 * Each half's dot goes through group_dot (n = 4) with its own zero-point sum.
 *
 * Partial groups (2-, 3-, 5- and 6-bit codes: tm.h partial_group): a row whose blocks are
 * not whole groups (a MoE expert's 768 values on AVX-512, Qwen2.5's 896) ends in its nb %
 * TM_GB blocks laid out as a group of that many (every vector 4 bytes a block, per-16
 * scales [half][its blocks]); its vectors are read zero-extended (the lanes past them zero
 * codes), its activations sit in a whole group's lanes (quantize_x, the rest zero), its
 * scales beside zeros.
 *
 * 3-bit codes (GGUF Q3_K, exactly: q in 0..7, w = d16 * (q - 4), d16 = dsup * sc with a
 * signed scale per 16 values): Q6_K's form at 3 bits per value. Per
 * group three planes of GW/8 bytes, byte r of each for position r of the 8 vectors:
 * vectors 0, 1 and the low two bits of 2 in plane 0 (bits 0-2, 3-5, 6-7), 3, 4 and 5 the
 * same in plane 1, 6 and 7 in plane 2 (bits 0-2, 3-5) with the top bits of 2 and 5 (bits
 * 6, 7): most codes whole in a byte, two instructions each to unpack (simd.h tm_code3,
 * vb_codes3). tm_group_codes reads them as q (Z = 4), and the dots take codes of at most
 * 7: every product of a half's four vectors adds in int16.
 *   codes   uint8 [N, K*3/8];  scales: the file's 6-bit codes sc + 32, 12 bytes per 256 values
 *   uint8 [N, K*3/64] (per group its blocks' low nibbles, then their top pairs: tm.h
 *   scale6_group), read by vf_scales6; dsup [N, K/256] as for 6-bit
 *
 * 2-bit codes (GGUF Q2_K, exactly: q in 0..3, w = d16 q - m16 per 16 values, d16 = dsup *
 * sc and m16 = msup * m, sc and m the low and high nibbles of the file's byte per 16
 * values): two planes per group (byte c*4G + r holds vector 4c + s at bits 2s, like 6-bit
 * codes' top bits), read as q (zero point 0) by the 3-bit dots.
 * The min's term m16 sum x is taken as m16 dx sum q (the zh sums), as llama.cpp's q8_K
 * sums do: within the activations' rounding. 10.5 bytes per 32 values, the file's own.
 *   codes   uint8 [N, K/4];  scales uint8 [N, K/16] (sc + 16 m, per group [half][block]);
 *   dsup, msup [N, K/256]
 *
 * 3-bit table codes (GGUF IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0, exactly: w =
 * dsup * sc * point, at most 8 points, the table's): 3-bit codes' planes and scales, read
 * as q and looked up to 8-bit codes (Z = 128); each half's dot less its zero-point
 * term (zh: 128 sum q and what group_dot adds to 8-bit codes). The scales per 32 of
 * IQ2_XXS, IQ1_S and TQ enter as two equal ones per 16.
 *
 * Grid kinds (bits TM_GRID9 = 13 / TM_GRID8 = 12: GGUF IQ3_S / IQ3_XXS as their file has
 * them, rearranged for the lanes; w = d (2 s + 1) / 2^n * sign * grid magnitude): per
 * block 8 grid indices (each 4 values, an entry of 4 magnitudes), with TM_GRID9 their 9th
 * bits, and 32 sign bits: 13 or 12 bytes. Per group of G blocks (a row's last, partial one:
 * its blocks): vector i's G low index bytes (lane k: block k's index i) for i = 0..7, then
 * G bytes of 9th bits (bit i: index i's), then per vector i the G sign nibbles, block 2m
 * low and 2m + 1 high in byte m (bit t of lane k's: value 4 i + t of block k). vb_grid
 * gathers each vector's entries (their magnitudes + 128, from w->lut) and negates the
 * signed bytes (mod 256), giving 8-bit codes with Z = 128 for the table codes' dots. The
 * scale codes s are nibbles [N, K/64] (block 2j low, 2j + 1 high) under dsup [N, K/256].
 *   codes   uint8 [N, K/32 * bits];  scales uint8 [N, K/64];  dsup [N, K/256]
 *
 * Float weights (bits TM_F16 / TM_BF16 / TM_F32): [N, K] in natural order, converted to
 * float32 in registers (F16C / shifts / NEON fcvtl) and multiplied by float32 x.
 */
#include "tm.h"

/* ------------------------------------------------------------------------------ */
/* Activation quantization (per call, on the calling thread: T*K is small)         */
/* ------------------------------------------------------------------------------ */

typedef struct {
    int8_t *q;   /* [T][kpad] high bytes (signed) of the int16 activations, lane order */
    uint8_t *ql; /* [T][kpad] their low bytes (unsigned): q16 = 256 q + ql */
    float *dx;   /* [T][gpad] block scales (0 in padding) */
    float *sx;   /* [T][gpad] exact float sums of x per block */
    int32_t *zc; /* [T][gpad] Z * sum(q) per block */
    int32_t *zh; /* [T][2 gpad] 32 * sum(q) per 16-value half, per group [h][k]: the
                    zero point of 6-bit codes, whose scales are per half */
    /* Wide layers (AVX-512) only, per pair p of tail blocks (b, b + 1), as tail_dot adds
     * them lane by lane: [T][npair][TM_W] each, lanes 0-7 block b's, 8-15 block b + 1's */
    int32_t *tz; /* zc of b spread over lanes 0-7 (each lane its 4 values' share), of b + 1 over 8-15 */
    float *tdx;  /* dx of b in lanes 0-7, of b + 1 in lanes 8-15 */
    float *tsx;  /* sx of b in lane 0, of b + 1 in lane 8, zero elsewhere */
    int kpad, gpad, npair;
    int one; /* 8-bit activations on a layer with group_dot8: one pass over ql as int8 */
} xq_t;

/* Quantizes x [T, K] float32 per 32-block for a weight with zero point z: q = round(x /
 * dx), dx = max|x| / qmax, qmax 127 (8-bit) or 32767 (act16), stored in lane order as two
 * byte planes (the operands of byte dot products; see group_dot in simd.h). Returns 0 on
 * OOM. */
static size_t xq_layout(int T, int K, int halves, xq_t *xq, size_t *fbytes, size_t *qbytes,
                        size_t *base, size_t *pbytes) {
    const int nb = K / QK, full = nb / TM_GB * TM_GB;
    xq->gpad = (nb + TM_GB - 1) / TM_GB * TM_GB;
    xq->kpad = xq->gpad * QK;
    *fbytes = ((size_t)T * xq->gpad * 4 + 63) & ~(size_t)63;
    *qbytes = ((size_t)T * xq->kpad + 63) & ~(size_t)63;
    *base = (halves ? 5 : 3) * *fbytes + 2 * *qbytes; /* zh: scales per 16 only */
    xq->npair = 4 * TM_GB > QK ? (nb - full) / 2 : 0;    /* whole pairs of tail blocks */
    *pbytes = (size_t)T * xq->npair * TM_W * 4;
    return *base + 3 * *pbytes;
}

/* The bytes quantize_x needs for x [T, K] against a weight with scales per 16 values
 * (halves) or not (64-byte multiples) */
static size_t xq_bytes(int T, int K, int halves) {
    xq_t xq;
    size_t f, q, b, p;
    return (xq_layout(T, K, halves, &xq, &f, &q, &b, &p) + 63) & ~(size_t)63;
}

/* What the layer's dot leaves out of 8-bit codes' sums over values whose q, high bytes and
 * low bytes sum to qs, hs and ls: group_dot8's (one: 8-bit activations in one plane) or
 * group_dot's (simd.h) */
static inline int32_t left_out8(int one, int32_t qs, int32_t hs, int32_t ls) {
    (void)qs, (void)hs, (void)ls;
    return one ? TM_A8_LEFT_OUT8(qs) : TM_A16_LEFT_OUT8(hs, ls);
}

/* x [T, w->k] for weight w: its zero point, the bits its dots see (dot_bits), where its
 * tail blocks sit (tail_in_lanes of its codes) and whether its scales are per 16 values
 * (sixteen_scales: the zero-point terms then come per half, zh) */
static int quantize_x(const float *x, int T, const tm_weight *w, int act16, xq_t *xq, char *buf) {
    const int K = w->k, z = zero_point(w), bits = dot_bits(w), halves = sixteen_scales(w->bits);
    const int tails = tail_in_lanes(w->bits);
    const int nb = K / QK, full = nb / TM_GB * TM_GB;
    size_t fbytes, qbytes, base, pbytes;
    const size_t total = xq_layout(T, K, halves, xq, &fbytes, &qbytes, &base, &pbytes);
    if (!buf) buf = tm_scratch(total); /* else the caller's, of xq_bytes */
    if (!buf) return 0;
    memset(buf, 0, total);
    xq->tz = (int32_t *)(buf + base);
    xq->tdx = (float *)(buf + base + pbytes);
    xq->tsx = (float *)(buf + base + 2 * pbytes);
    xq->zh = halves ? (int32_t *)(buf + 3 * fbytes + 2 * qbytes) : NULL; /* 2 per block */
    xq->dx = (float *)buf;
    xq->sx = (float *)(buf + fbytes);
    xq->zc = (int32_t *)(buf + 2 * fbytes);
    xq->q = (int8_t *)(buf + 3 * fbytes);
    xq->ql = (uint8_t *)(buf + 3 * fbytes + qbytes);
    const float qmax = act16 ? 32767.f : 127.f;
    xq->one = !act16 && TM_DOT8;
    /* what the layer's group_dot or group_dot8 adds to 8-bit codes' dots (simd.h), taken
     * back with the zero point */
    const int left = bits == 8;
    for (int r = 0; r < T; r++) {
        int8_t *hr = xq->q + (size_t)r * xq->kpad;
        uint8_t *lr = xq->ql + (size_t)r * xq->kpad;
        for (int b = 0; b < nb; b++) {
            int16_t qv[QK];
            float dxb, sum;
            const int32_t qsum = tm_quant_block(x + (size_t)r * K + (size_t)b * QK, qmax, qv, &dxb, &sum);
            int8_t hv[QK];
            uint8_t lv[QK];
            int32_t hsum = 0, lsum = 0;
            for (int j = 0; j < QK; j++) {
                hv[j] = (int8_t)(qv[j] >> 8); /* arithmetic: q = 256 (q >> 8) + (q & 255) */
                lv[j] = (uint8_t)(qv[j] & 255);
                hsum += hv[j];
                lsum += lv[j];
            }
            /* tail blocks go through group_dot too */
            const int32_t left_out = left ? left_out8(xq->one, qsum, hsum, lsum) : 0;
            (void)hsum, (void)lsum;
            /* whole groups' blocks (and a partial group's, of 5- and 6-bit dots: padded to
             * a whole group, the lanes past it left zero) in lane order, other tails natural */
            const int lanes = b < full || tails;
            const size_t pos = lanes ? (size_t)(b / TM_GB) * GW + (size_t)(b % TM_GB) * 4 : lane_pos(nb, b, 0);
            if (lanes) { /* four values at a time to their lanes */
                for (int i = 0; i < 8; i++) {
                    memcpy(hr + pos + i * 4 * TM_GB, hv + 4 * i, 4);
                    memcpy(lr + pos + i * 4 * TM_GB, lv + 4 * i, 4);
                }
            } else {
                memcpy(hr + pos, hv, QK);
                memcpy(lr + pos, lv, QK);
            }
            const size_t xi = (size_t)r * xq->gpad + b;
            xq->dx[xi] = dxb;
            xq->sx[xi] = sum;
            xq->zc[xi] = z * qsum + left_out;
            if (b >= full && (b - full) / 2 < xq->npair) { /* a pair's lanes (tail_dot) */
                const int h = (b - full) % 2; /* its half */
                const size_t pi = ((size_t)r * xq->npair + (b - full) / 2) * TM_W + h * (TM_W / 2);
                xq->tsx[pi] = sum;
                /* lane l holds values 4l..4l+3 of the block: its share of the zero point
                 * (z * q plus what group_dot adds), so that each lane's integer is the
                 * exact sum of (c - Z) q over its four values, small like the result
                 * (the whole zc in one lane would cancel against the others in float) */
                for (int l = 0; l < TM_W / 2; l++) {
                    int32_t qs = 0, hs = 0, ls = 0;
                    for (int j = 4 * l; j < 4 * l + 4; j++) qs += qv[j], hs += hv[j], ls += lv[j];
                    xq->tz[pi + l] = z * qs + (left ? left_out8(xq->one, qs, hs, ls) : 0);
                    xq->tdx[pi + l] = dxb;
                    (void)hs, (void)ls;
                }
            }
            if (halves) { /* the zero point per 16-value half (scales per half): z sum q
                           (2-bit codes: 32 sum q, their min term's) and what group_dot
                           adds to 8-bit codes' dots over the half */
                int32_t half0 = 0, h0 = 0, l0 = 0;
                for (int j = 0; j < QK / 2; j++) half0 += qv[j], h0 += hv[j], l0 += lv[j];
                const size_t hi = (size_t)r * 2 * xq->gpad + (size_t)(b / TM_GB) * 2 * TM_GB + b % TM_GB;
                const int zq = unit_mins(w) ? 32 : z;
                xq->zh[hi] = zq * half0 + (left ? left_out8(xq->one, half0, h0, l0) : 0);
                xq->zh[hi + TM_GB] =
                    zq * (qsum - half0) + (left ? left_out8(xq->one, qsum - half0, hsum - h0, lsum - l0) : 0);
                (void)h0, (void)l0;
            }
        }
    }
    return 1;
}

/* ------------------------------------------------------------------------------ */
/* Packed GEMV / small-T GEMM                                                      */
/* ------------------------------------------------------------------------------ */

/* The nb % TM_GB tail blocks of row r (codes at `tc`, natural order in chunks of two
 * blocks) against T activation rows from t0, into tail[t] (and acc[t]), through
 * group_dot too. Up to 8 lanes (a block fills 32 / (4 TM_W) code vectors): each block's
 * dot is the sum of the lanes; a chunk of two 4-bit blocks is one nibble split (low
 * nibbles block 2q, high nibbles block 2q+1). 16 lanes (AVX-512: a vector holds 64
 * codes): two blocks per vector, their codes side by side like their activations
 * (natural order), block u's dot the sum of lanes 0-7 and block u + 1's of lanes 8-15.
 * A pair goes into acc[t] lane by lane, each half scaled by its block's d * dx, each
 * lane less its share of the zero point (xq's tz): no horizontal sums or scalar scaling
 * per activation row, rows_dot's one vf_sum adds the lanes (the tail costs ~a third of a
 * 576-column GEMV, SmolLM2's qkv, o and up; this took 10-15% off those at T = 2-4 on
 * Zen 4). A lone last block leaves lanes 8-15 zero codes
 * against zero activations (the padding of quantize_x). */
enum { TAIL_NV = QK / (4 * TM_GB) > 0 ? QK / (4 * TM_GB) : 1 }; /* vectors per block */

/* The integer dot of n code vectors with the activations at offset xo of one activation
 * row: group_dot over both byte planes, or group_dot8 over one (xq->one). */
static inline __attribute__((always_inline)) vi dot_codes(const vb *c, int n, const xq_t *xq, size_t xo,
                                                          int bits) {
#if TM_DOT8
    if (xq->one) return group_dot8(c, n, (const int8_t *)xq->ql + xo, bits == 5 ? 6 : bits);
#endif
    /* 5-bit codes take the 6-bit way (n even): their sums would overflow the 4-bit one's
     * int16 (8 pairs of 31 * 128 each) */
    return group_dot(c, n, xq->q + xo, xq->ql + xo, bits == 5 ? 6 : bits);
}

static inline __attribute__((always_inline)) void tail_dot(const tm_weight *w, const xq_t *xq, int r,
                                                           int t0, int T, int bits, int lut,
                                                           const uint8_t *tc, float *tail, vf *acc) {
    const int nb = w->k / QK, nfull = nb / TM_GB, nbt = nb % TM_GB;
    /* table codes: 4-bit in the row, 8-bit once looked up (lut: a constant after inlining) */
    const int db = lut ? 8 : bits;
    const vb table = vb_table(lut ? w->lut : tm_no_table);
#if 4 * TM_GB > QK
    for (int u = 0; u < nbt; u += 2) {
        const int n = u + 1 < nbt ? 2 : 1, b = nfull * TM_GB + u;
        vb c;
        if (n == 2) { /* a whole chunk: vb_tail_pair loads it (simd_avx512.h) */
            c = vb_tail_pair(tc + (size_t)QK * u * bits / 8, bits);
            if (lut) c = vb_lookup(table, c);
        } else { /* the last, lone block: its codes and 32 zero bytes (in-bounds reads) */
            uint8_t cv[4 * TM_GB] __attribute__((aligned(64))) = {0};
            tail_block_codes(tc, bits, u, nbt, lut ? w->lut : NULL, cv);
            c = vb_load(cv);
        }
        float d[2], m[2];
        for (int h = 0; h < n; h++) d[h] = tm_block_scale(w, r, b + h), m[h] = tm_block_min(w, r, b + h);
        if (n == 2) { /* the pair's lanes into acc (xq's tz, tdx, tsx: quantize_x) */
            const vf dv = vf_set_halves(d[0], d[1]), mv = vf_set_halves(m[0], m[1]);
            for (int t = 0; t < T; t++) {
                const size_t tt = (size_t)(t0 + t), pi = (tt * xq->npair + u / 2) * TM_W;
                const size_t xo = tt * xq->kpad + (size_t)b * QK;
                const vi s = vi_sub(dot_codes(&c, 1, xq, xo, db), vi_load(xq->tz + pi));
                acc[t] = vf_fma(vf_mul(vf_from_vi(s), vf_load(xq->tdx + pi)), dv, acc[t]);
                if (w->mins) acc[t] = vf_fma(mv, vf_load(xq->tsx + pi), acc[t]);
            }
            continue;
        }
        for (int t = 0; t < T; t++) {
            const size_t tt = (size_t)(t0 + t), xi = tt * xq->gpad + b;
            const size_t xo = tt * xq->kpad + (size_t)b * QK;
            int32_t s[2];
            vi_sum_halves(dot_codes(&c, 1, xq, xo, db), &s[0], &s[1]);
            for (int h = 0; h < n; h++)
                tail[t] += d[h] * (xq->dx[xi + h] * (float)(s[h] - xq->zc[xi + h])) + m[h] * xq->sx[xi + h];
        }
    }
#else
    for (int u = 0; u < nbt;) {
        vb ca[TAIL_NV], cb[TAIL_NV];
        int n = 1;
        if (bits == 8) {
            for (int v = 0; v < TAIL_NV; v++) cb[v] = ca[v] = vb_load(tc + (size_t)QK * u + 4 * TM_GB * v);
        } else if (u + 1 < nbt) { /* a 64-value chunk: two blocks from one nibble split */
            for (int v = 0; v < TAIL_NV; v++) {
                vb_nibbles(vb_load(tc + QK * (u / 2) + 4 * TM_GB * v), &ca[v], &cb[v]);
                if (lut) ca[v] = vb_lookup(table, ca[v]), cb[v] = vb_lookup(table, cb[v]);
            }
            n = 2;
        } else { /* the last, lone block: 16 bytes, value j low (j < 16) or high nibble */
            uint8_t cv[QK];
            tail_block_codes(tc, bits, u, nbt, lut ? w->lut : NULL, cv);
            for (int v = 0; v < TAIL_NV; v++) cb[v] = ca[v] = vb_load(cv + 4 * TM_GB * v);
        }
        for (int h = 0; h < n; h++) {
            const int b = nfull * TM_GB + u + h;
            const float d = tm_block_scale(w, r, b), m = tm_block_min(w, r, b);
            for (int t = 0; t < T; t++) {
                const size_t tt = (size_t)(t0 + t), xi = tt * xq->gpad + b;
                const size_t xo = tt * xq->kpad + (size_t)b * QK;
                const int32_t s = vi_sum(dot_codes(h ? cb : ca, TAIL_NV, xq, xo, db)) - xq->zc[xi];
                tail[t] += d * (xq->dx[xi] * (float)s) + m * xq->sx[xi];
            }
        }
        u += n;
    }
    (void)acc, (void)table;
#endif
}

/* Software prefetch of the n code bytes PREFETCH ahead of a group's p, into L2 (the codes
 * run on into the next rows, so the stream crosses rows unbroken). Per group rather than
 * per row, and into L2 rather than L1: a row's worth into L1 at its start prefetched, for
 * long rows (Q6_K ffn_down's 6.7 KB), lines of the row already being read, and left them
 * well under the DRAM rate; this streams them at it (benchmarks/README.md, "The GEMV's
 * prefetch"). */
static inline void prefetch_codes(const uint8_t *p, size_t n, size_t ahead) {
    for (size_t off = 0; off < n; off += 64) __builtin_prefetch(p + ahead + off, 0, 2);
}

/* Rows of 1 KB of codes and more: Llama 3's 2048-wide and longer. */
static inline int long_row(size_t rb) { return rb >= 1024; }

/* How far ahead a GEMV over rows of rb code bytes prefetches (codes, and scales to match):
 * PREFETCH, but at most 2 KB for short rows (SmolLM2's 576- and 1536-wide ones: 8 KB
 * there decoded slower than 2 KB on Zen 4, while long rows want the 8 KB;
 * benchmarks/README.md) */
static inline size_t prefetch_ahead(size_t rb) {
    return !long_row(rb) && PREFETCH > 2048 ? 2048 : (size_t)PREFETCH;
}

/* Row r's K-quant super-block scales to float: dsup [k / 256], and msup = -(the mins'
 * super-block scales). k / 256 <= KSUP_MAX (the callers check). */
enum { KSUP_MAX = 256 }; /* rows of up to 65536 values */
static inline void ksup_row(const tm_weight *w, int r, float *dsup, float *msup) {
    const int ns = w->k / 256;
    const uint16_t *ds = w->dsup + (size_t)r * ns, *ms = w->msup ? w->msup + (size_t)r * ns : NULL;
    const float pow2 = ldexpf(1.f, -w->sup_shift); /* (tm_dsup) */
    int i = 0;
    for (; i + TM_W <= ns; i += TM_W) {
        vf_store(dsup + i, vf_mul(vf_load_f16(ds + i), vf_set1(pow2)));
        if (ms) vf_store(msup + i, vf_sub(vf_zero(), vf_load_f16(ms + i)));
    }
    for (; i < ns; i++) {
        dsup[i] = tm_half_to_float(ds[i]) * pow2;
        if (ms) msup[i] = -tm_half_to_float(ms[i]);
    }
}

/* The super-block scales of group g's TM_GB blocks, one per lane: a super-block is 8
 * blocks, so one scale for a whole group of up to 8 blocks, two on AVX-512. */
static inline vf sup_lanes(const float *sup, int g) {
#if TM_GB <= 8
    return vf_set1(sup[g * TM_GB / 8]);
#else
    return vf_set_halves(sup[2 * g], sup[2 * g + 1]);
#endif
}

/* Group g of row r (codes at row) in Q6_K's form, two halves per block (2- and 3-bit
 * codes: 3-bit dots; 3-bit table codes: looked up to 8 bits), into acc[t]; pb: a partial
 * group's blocks (scales [half][pb]), 0 for a whole group (a constant after inlining, so
 * whole groups carry no padding). */
static inline __attribute__((always_inline)) void six_group(const tm_weight *w, const xq_t *xq,
                                                            const uint8_t *row, int r, int g, int pb, int t0, int T,
                                                            int bits, int lut, vb table, const float *dsup,
                                                            const float *msup, size_t ahead, vf *acc) {
    const int nb = w->k / QK, sdb = lut ? 8 : bits <= 3 ? 3 : 6;
    vb c[8];
    prefetch_codes(row + (size_t)g * group_bytes(bits), group_bytes(bits), ahead);
    tm_codes_at(row + (size_t)g * group_bytes(bits), bits, pb, c);
    if (lut) tm_lookup_codes(table, c);
    const vf ds = sup_lanes(dsup, g);
    /* a byte per 16 values (2- and 6-bit codes; 3-bit ones: below) */
    const uint8_t *s0 = (const uint8_t *)w->scales + (bits == 3 ? 0 : (size_t)r * 2 * nb + (size_t)g * 2 * TM_GB);
    const uint8_t *s1 = s0 + (pb ? pb : TM_GB); /* the second halves' */
    uint8_t pad[2][TM_GB]; /* a partial group's pb + pb scale bytes, beside zeros */
    if (pb && bits != 3) {
        memset(pad, 0, sizeof pad);
        memcpy(pad[0], s0, (size_t)pb), memcpy(pad[1], s1, (size_t)pb);
        s0 = pad[0], s1 = pad[1];
    }
    vf d0, d1, m0 = vf_zero(), m1 = vf_zero();
    if (bits == 2) { /* byte = sc + 16 m: m = round((byte - 7.5) / 16), never a tie */
        const vf b0 = vf_load_u8(s0), b1 = vf_load_u8(s1);
        const vf h = vf_set1(0.0625f), off = vf_set1(7.5f), sixteen = vf_set1(16.f);
        const vf c0 = vf_round(vf_mul(vf_sub(b0, off), h)), c1 = vf_round(vf_mul(vf_sub(b1, off), h));
        d0 = vf_mul(vf_sub(b0, vf_mul(c0, sixteen)), ds), d1 = vf_mul(vf_sub(b1, vf_mul(c1, sixteen)), ds);
        /* -dmin m per 16 values, against zh = 32 sum q: the min's share, in exact steps */
        const vf ms = vf_mul(sup_lanes(msup, g), vf_set1(1.f / 32));
        m0 = vf_mul(c0, ms), m1 = vf_mul(c1, ms);
    } else if (bits == 3) { /* 6-bit codes (tm.h scale6_group), a partial group's beside zeros */
        int G;
        const uint8_t *lo = scale6_group(w->scales, nb, r, g * TM_GB, &G);
        uint8_t pad6[3 * TM_GB / 2];
        if (pb) {
            memset(pad6, 0, sizeof pad6);
            memcpy(pad6, lo, (size_t)G), memcpy(pad6 + TM_GB, lo + G, (size_t)G / 2);
            lo = pad6;
        }
        vf c0, c1;
        vf_scales6(lo, lo + TM_GB, &c0, &c1);
        d0 = vf_mul(c0, ds), d1 = vf_mul(c1, ds);
    } else {
        d0 = vf_mul(vf_load_i8((const int8_t *)s0), ds), d1 = vf_mul(vf_load_i8((const int8_t *)s1), ds);
    }
    for (int t = 0; t < T; t++) {
        const size_t tt = (size_t)(t0 + t), xi = tt * xq->gpad + (size_t)g * TM_GB;
        const size_t xo = tt * xq->kpad + (size_t)g * GW, xh = xo + 16 * TM_GB;
        const int32_t *zh = xq->zh + tt * 2 * xq->gpad + (size_t)g * 2 * TM_GB;
        const vf dx = vf_load(xq->dx + xi);
        /* the group's terms summed apart, then one multiply-add into acc[t]: a chain of
         * four through acc[t] left the 2-bit GEMV waiting on FMA latency */
        if (bits == 2) { /* dx (d16 sum c q - m16 sum q) per half: the sum of q as zh */
            const vi s0 = dot_codes(c, 4, xq, xo, 3), s1 = dot_codes(c + 4, 4, xq, xh, 3);
            const vf u = vf_fma(vf_from_vi(s1), d1, vf_mul(vf_from_vi(s0), d0));
            const vf v = vf_fma(vf_from_vi(vi_load(zh + TM_GB)), m1, vf_mul(vf_from_vi(vi_load(zh)), m0));
            acc[t] = vf_fma(vf_add(u, v), dx, acc[t]);
            continue;
        }
        const vi s0 = vi_sub(dot_codes(c, 4, xq, xo, sdb), vi_load(zh));
        const vi s1 = vi_sub(dot_codes(c + 4, 4, xq, xh, sdb), vi_load(zh + TM_GB));
        acc[t] = vf_fma(vf_fma(vf_from_vi(s1), d1, vf_mul(vf_from_vi(s0), d0)), dx, acc[t]);
    }
}

/* Group g of row r with a scale (and min) per 32 values, into acc[t]; pb as six_group's
 * (5-bit codes and grid kinds have partial groups). */
static inline __attribute__((always_inline)) void block_group(const tm_weight *w, const xq_t *xq,
                                                              const uint8_t *row, int r, int g, int pb, int t0, int T,
                                                              int bits, int lut, vb table, const float *dsup,
                                                              const float *msup, size_t ahead, vf *acc) {
    const int nb = w->k / QK, db = lut ? 8 : bits, f16 = w->scale_f16;
    const size_t srow = (size_t)r * nb, es = w->dsup ? 1 : tm_scale_bytes(f16);
    vb c[8];
    prefetch_codes(row + (size_t)g * group_bytes(bits), group_bytes(bits), ahead);
    if (grid_kind(bits)) {
        tm_grid_codes(w, row + (size_t)g * group_bytes(bits), pb, c);
    } else {
        tm_codes_at(row + (size_t)g * group_bytes(bits), bits, pb, c);
        if (lut) tm_lookup_codes(table, c);
    }
    /* the group's TM_GB scales (and mins) of es bytes; a partial group's pb beside zeros */
    const char *sp = (const char *)w->scales + (srow + (size_t)g * TM_GB) * es;
    const char *mp = w->mins ? (const char *)w->mins + (srow + (size_t)g * TM_GB) * es : NULL;
    _Alignas(64) char pad[2][4 * TM_GB];
    if (pb && !grid_kind(bits)) {
        memset(pad, 0, sizeof pad);
        memcpy(pad[0], sp, (size_t)pb * es), sp = pad[0];
        if (mp) memcpy(pad[1], mp, (size_t)pb * es), mp = pad[1];
    }
    vf d, m = vf_zero();
    if (grid_kind(bits)) { /* a scale nibble s per block (two to a byte): d (2 s + 1) */
        const uint8_t *sn = (const uint8_t *)w->scales + (srow + (size_t)g * TM_GB) / 2;
        _Alignas(64) uint8_t odd[TM_GB] = {0}; /* a partial group's pb, zeros beside */
        for (int k = 0; k < (pb ? pb : TM_GB); k++) odd[k] = (uint8_t)(2 * ((sn[k / 2] >> (4 * (k & 1))) & 15) + 1);
        d = vf_mul(vf_load_u8(odd), sup_lanes(dsup, g));
    } else if (w->dsup) { /* K-quant: codes times the super-block's scale (256 values) */
        const vf code = vf_load_u8((const uint8_t *)sp);
        d = vf_mul(vf_sub(code, vf_set1((float)w->scale_zero)), sup_lanes(dsup, g));
        if (mp) m = vf_mul(vf_load_u8((const uint8_t *)mp), sup_lanes(msup, g));
    } else {
        d = vf_scales(sp, f16, 0);
        if (mp) m = vf_scales(mp, f16, 0);
    }
    for (int t = 0; t < T; t++) {
        const size_t tt = (size_t)(t0 + t), xi = tt * xq->gpad + (size_t)g * TM_GB;
        const size_t xo = tt * xq->kpad + (size_t)g * GW;
        const vi s = vi_sub(dot_codes(c, 8, xq, xo, db), vi_load(xq->zc + xi));
        acc[t] = vf_fma(vf_mul(vf_from_vi(s), vf_load(xq->dx + xi)), d, acc[t]);
        if (w->mins) acc[t] = vf_fma(m, vf_load(xq->sx + xi), acc[t]);
    }
}

/* Rows [r0, r1) of W against T (<= TCHUNK) activation rows starting at t0; T and bits
 * are constants after inlining. Per full group: the 8 code vectors are loaded once and
 * reused by every activation row; per row one group_dot and one float multiply-add that
 * scales the group's TM_GB blocks at once. */
static inline __attribute__((always_inline)) void rows_dot(const tm_weight *w, const xq_t *xq,
                                                           int r0, int r1, int t0, int T, int bits,
                                                           int lut, float *y, const float *bias) {
    const int nb = w->k / QK, nfull = nb / TM_GB, nbt = nb % TM_GB, six = sixteen_scales(bits);
    const vb table = vb_table(lut ? w->lut : tm_no_table);
    /* scale bytes per 32 values: K-quant codes 1 (6-bit: 2, one per 16), float16 2, float32 4,
     * E8M0 1 */
    const size_t rb = row_bytes(w), es = w->dsup ? (six ? 2 : 1) : tm_scale_bytes(w->scale_f16);
    const size_t ahead = prefetch_ahead(rb);
    for (int r = r0; r < r1; r++) {
        const uint8_t *row = w->codes + (size_t)r * rb;
        const size_t srow = (size_t)r * nb;
        { /* the scales matching the codes `ahead` bytes on (those: per group below; a grid
             kind's: a nibble per block of `bits` bytes) */
            const size_t at = grid_kind(bits) ? srow / 2 + ahead / (2 * (size_t)bits)
                                              : srow * es + ahead * es / (4 * (size_t)bits);
            __builtin_prefetch((const char *)w->scales + at, 0, 3);
            if (w->mins) __builtin_prefetch((const char *)w->mins + at, 0, 3);
        }
        vf acc[TCHUNK];
        for (int t = 0; t < T; t++) acc[t] = vf_zero();
        /* K-quants: the row's super-block scales (one per 256 values) as floats, converted
         * a vector at a time here rather than one scalar per group below */
        /* (a partial group's lanes past the row: zero, never garbage times 0) */
        float dsup[KSUP_MAX + 1], msup[KSUP_MAX + 1];
        if (w->dsup) {
            ksup_row(w, r, dsup, msup);
            dsup[w->k / 256] = msup[w->k / 256] = 0.f;
        }
#define GROUP(g, pb)                                                                        \
    (six ? six_group(w, xq, row, r, g, pb, t0, T, bits, lut, table, dsup, msup, ahead, acc) \
         : block_group(w, xq, row, r, g, pb, t0, T, bits, lut, table, dsup, msup, ahead, acc))
        for (int g = 0; g < nfull; g++) GROUP(g, 0); /* pb a constant 0: no padding */
        if (partial_group(bits, nb)) GROUP(nfull, nbt); /* a last, partial group */
#undef GROUP
        float tail[TCHUNK] = {0};
        if (nbt && !tail_in_lanes(bits)) { /* the tail blocks, natural order, through
                                                  group_dot too (tail_dot) */
            const uint8_t *tc = row + (size_t)nfull * GW * bits / 8;
            /* the groups' prefetches cover only their own bytes `ahead` on: without this,
             * on long rows the tail bytes of every row came from DRAM on demand (2880 Q8_0
             * values, a 10-block tail: 19 GB/s against 35 for 2560 or 3072; 28-30 with it).
             * Short rows' tails (SmolLM2's 576: 2 blocks) share lines the stream brings. */
            if (long_row(rb)) prefetch_codes(tc, (size_t)nbt * QK * bits / 8, ahead);
            tail_dot(w, xq, r, t0, T, bits, lut, tc, tail, acc);
        }
        const float bv = bias ? bias[r] : 0.f;
        for (int t = 0; t < T; t++) y[(size_t)(t0 + t) * w->n + r] = vf_sum(acc[t]) + tail[t] + bv;
    }
}

/* rows_dot with xq->one a constant: each row kernel is compiled twice where the layer has
 * group_dot8, so that neither dot pays for the other's branch and registers inside the
 * group loop (on plain AVX2, 16-bit decode of a 1B model lost ~12% to that) */
#if TM_DOT8
#define ROWS_DOT(w, xq, r0, r1, t0, T, B, LUT, y, bias)       \
    do {                                                      \
        xq_t xc = *(xq);                                      \
        if (xc.one) {                                         \
            xc.one = 1;                                       \
            rows_dot(w, &xc, r0, r1, t0, T, B, LUT, y, bias); \
        } else {                                              \
            xc.one = 0;                                       \
            rows_dot(w, &xc, r0, r1, t0, T, B, LUT, y, bias); \
        }                                                     \
    } while (0)
#else
#define ROWS_DOT rows_dot
#endif
#define DEF_ROWS(B, T)                                                                        \
    static void rows_b##B##_t##T(const tm_weight *w, const xq_t *xq, int r0, int r1, int t0, \
                                 float *y, const float *bias) {                               \
        ROWS_DOT(w, xq, r0, r1, t0, T, B, 0, y, bias);                                        \
    }
typedef void (*rows_fn)(const tm_weight *, const xq_t *, int, int, int, float *, const float *);
/* Instantiated for T = 1, 2, 4, 8 only (compile time); other counts are split. */
#define DEF_ROWS_ALL(B)                                                \
    DEF_ROWS(B, 1) DEF_ROWS(B, 2) DEF_ROWS(B, 4) DEF_ROWS(B, 8)        \
    static const rows_fn ROWS_B##B[4] = {rows_b##B##_t1, rows_b##B##_t2, \
                                         rows_b##B##_t4, rows_b##B##_t8};
DEF_ROWS_ALL(2)
DEF_ROWS_ALL(3)
DEF_ROWS_ALL(4)
/* Codes that index a table (tm_weight.lut): the dots of 8-bit codes; 4-bit ones with a scale
 * per 32 values, 3-bit ones (Q3_K's form) with a scale per 16, the halves' dots */
#define DEF_ROWS_LUT(B, T)                                                                    \
    static void rows_lut##B##_t##T(const tm_weight *w, const xq_t *xq, int r0, int r1, int t0, \
                                   float *y, const float *bias) {                              \
        ROWS_DOT(w, xq, r0, r1, t0, T, B, 1, y, bias);                                         \
    }
#define DEF_ROWS_LUT_ALL(B)                                                              \
    DEF_ROWS_LUT(B, 1) DEF_ROWS_LUT(B, 2) DEF_ROWS_LUT(B, 4) DEF_ROWS_LUT(B, 8)         \
    static const rows_fn ROWS_LUT##B[4] = {rows_lut##B##_t1, rows_lut##B##_t2, rows_lut##B##_t4, \
                                           rows_lut##B##_t8};
DEF_ROWS_LUT_ALL(3)
DEF_ROWS_LUT_ALL(4)
DEF_ROWS_LUT_ALL(12) /* the grid kinds: their codes, looked up in the grid, are 8-bit */
DEF_ROWS_LUT_ALL(13)
DEF_ROWS_ALL(5)
DEF_ROWS_ALL(6)
DEF_ROWS_ALL(8)

/* T (<= TCHUNK) rows as power-of-two pieces, e.g. 7 = 4 + 2 + 1: the rows [r0, r1)
 * (ROWBLOCK of them) stay in L1 between the pieces. */
static void rows_any(const tm_weight *w, const xq_t *xq, int r0, int r1, int t0, int T,
                     float *y, const float *bias) {
    const rows_fn *table = w->bits == TM_GRID8 ? ROWS_LUT12
                           : w->bits == TM_GRID9 ? ROWS_LUT13
                           : w->lut          ? (w->bits == 3 ? ROWS_LUT3 : ROWS_LUT4)
                           : w->bits == 2 ? ROWS_B2
                           : w->bits == 3 ? ROWS_B3
                           : w->bits == 4 ? ROWS_B4
                           : w->bits == 5 ? ROWS_B5
                           : w->bits == 6 ? ROWS_B6
                                          : ROWS_B8;
    for (int p = 3; p >= 0; p--)
        if (T & (1 << p)) {
            table[p](w, xq, r0, r1, t0, y, bias);
            t0 += 1 << p;
        }
}

/* ------------------------------------------------------------------------------ */
/* Dequantization of packed rows (the prefill GEMM's weight tiles)                 */
/* ------------------------------------------------------------------------------ */

/* Row r of W to out [K] float32 in lane order (the order of the packed codes). Each
 * element of a code vector belongs to block (element / 4) of its group: the scales
 * are spread that way once per group, so the inner loops are plain element-wise. */
static void dequant_row_lanes(const tm_weight *w, int r, float *out) {
    const int nb = w->k / QK, nfull = nb / TM_GB, nbt = nb % TM_GB, z = zero_point(w);
    const int vb_bytes = 4 * TM_GB;
    const uint8_t *row = w->codes + (size_t)r * row_bytes(w);
    if (grid_kind(w->bits)) { /* block by block (tm_block_codes), to its lane-order places */
        for (int b = 0; b < nb; b++) {
            uint8_t c[QK];
            tm_block_codes(w, row, b, c);
            const float d = tm_block_scale(w, r, b);
            for (int j = 0; j < QK; j++) out[lane_pos(nb, b, j)] = (float)(c[j] - z) * d;
        }
        return;
    }
    if (partial_group(w->bits, nb)) /* its blocks in natural order, as tm_lanes_f32 keeps tails */
        for (int b = nfull * TM_GB; b < nb; b++) {
            uint8_t c[QK];
            tm_block_codes(w, row, b, c);
            float *o = out + (size_t)b * QK;
            if (!sixteen_scales(w->bits)) {
                const float d = tm_block_scale(w, r, b), m = tm_block_min(w, r, b);
                for (int j = 0; j < QK; j++) o[j] = (float)(c[j] - z) * d + m;
                continue;
            }
            const size_t sup = (size_t)r * (nb / 8) + b / 8;
            const float ds = tm_dsup(w, sup);
            for (int h = 0; h < 2; h++) {
                const int code = tm_half_scale(w, r, b, h); /* 2-bit codes: sc + 16 m */
                const float d = ds * (float)(w->bits == 2 ? code & 15 : code);
                const float m = w->bits == 2 ? tm_half_to_float(w->msup[sup]) * (float)(code >> 4) : 0.f;
                for (int j = 16 * h; j < 16 * h + 16; j++) o[j] = (float)(c[j] - z) * d - m;
            }
        }
    if (w->bits == 2) { /* whole groups (a partial one: above): q from the one plane, scale and min of half i / 4 */
        for (int g = 0; g < nfull; g++) {
            const uint8_t *p = row + (size_t)g * group_bytes(2), *sb = (const uint8_t *)w->scales + (size_t)r * 2 * nb + (size_t)g * 2 * TM_GB;
            const uint16_t *dsr = w->dsup + (size_t)r * (nb / 8), *msr = w->msup + (size_t)r * (nb / 8);
            for (int i = 0; i < 8; i++)
                for (int e = 0; e < vb_bytes; e++) {
                    const int sup = (g * TM_GB + e / 4) / 8, byte = sb[(i >> 2) * TM_GB + e / 4]; /* block e / 4 */
                    const float d = tm_half_to_float(dsr[sup]) * (float)(byte & 15), m = tm_half_to_float(msr[sup]) * (float)(byte >> 4);
                    out[(size_t)g * GW + i * vb_bytes + e] = d * (float)((p[(i >> 2) * vb_bytes + e] >> (2 * (i & 3))) & 3) - m;
                }
        }
        return;
    }
    if (sixteen_scales(w->bits)) { /* whole groups (a partial one: above): vector i of block k, scale of half i / 4 */
        const int three = w->bits == 3;
        for (int g = 0; g < nfull; g++) {
            const uint8_t *p = row + (size_t)g * group_bytes(w->bits);
            float de[2][4 * TM_GB]; /* per element of a vector: its block's scale, per half */
            for (int e = 0; e < 4 * TM_GB; e++) {
                const int b = g * TM_GB + e / 4; /* block e / 4 */
                const float ds = tm_dsup(w, (size_t)r * (nb / 8) + b / 8);
                de[0][e] = ds * (float)tm_half_scale(w, r, b, 0), de[1][e] = ds * (float)tm_half_scale(w, r, b, 1);
            }
            for (int i = 0; i < 8; i++) {
                /* 6-bit: low nibbles, then the top-bits plane; 3-bit: its three planes
                 * (q in 0..7, the value d16 * (q - 4)) */
                const uint8_t *lo = p + (i >> 1) * vb_bytes, *hi = p + GW / 2 + (i >> 2) * vb_bytes;
                const int ls = (i & 1) * 4, hs = 2 * (i & 3);
                const float *d = de[i >> 2];
                float *o = out + (size_t)g * GW + i * vb_bytes;
                for (int e = 0; e < vb_bytes; e++) {
                    if (!three) {
                        o[e] = d[e] * (float)((((lo[e] >> ls) & 15) | (((hi[e] >> hs) & 3) << 4)) - 32);
                        continue;
                    }
                    const int q = tm_code3(p[e], p[vb_bytes + e], p[2 * vb_bytes + e], i);
                    o[e] = d[e] * (float)(w->lut ? w->lut[q] - 128 /* table codes */ : q - 4);
                }
            }
        }
        return;
    }
    for (int g = 0; g < nfull; g++) {
        float de[4 * TM_GB], me[4 * TM_GB]; /* per element: its block's d and m */
        for (int k = 0; k < TM_GB; k++) {
            const float d = tm_block_scale(w, r, g * TM_GB + k), m = tm_block_min(w, r, g * TM_GB + k);
            for (int t = 0; t < 4; t++) de[4 * k + t] = d, me[4 * k + t] = m;
        }
        float *o = out + (size_t)g * GW;
        const uint8_t *gp = row + (size_t)g * group_bytes(w->bits);
        for (int i = 0; i < 8; i++) {
            const uint8_t *p = w->bits == 8 ? gp + i * vb_bytes : gp + (i >> 1) * vb_bytes;
            const int shift = w->bits == 8 ? 0 : (i & 1) * 4, mask = w->bits == 8 ? 255 : 15;
            const uint8_t *top = gp + GW / 2; /* 5-bit: bit i of byte e, the code's bit 4 */
            for (int e = 0; e < vb_bytes; e++) {
                int c = ((p[e] >> shift) & mask) | (w->bits == 5 ? ((top[e] >> i) & 1) << 4 : 0);
                if (w->lut) c = w->lut[c];
                o[i * vb_bytes + e] = (float)(c - z) * de[e] + me[e];
            }
        }
    }
    const uint8_t *tail = row + (size_t)nfull * GW * w->bits / 8;
    for (int u = 0; u < nbt && !tail_in_lanes(w->bits); u++) { /* (a partial group: above) */
        uint8_t cb[QK];
        tail_block_codes(tail, w->bits, u, nbt, w->lut, cb);
        const int b = nfull * TM_GB + u;
        const float d = tm_block_scale(w, r, b), m = tm_block_min(w, r, b);
        float *o = out + (size_t)b * QK;
        for (int j = 0; j < QK; j++) o[j] = (float)(cb[j] - z) * d + m;
    }
}

/* ------------------------------------------------------------------------------ */
/* Float weights: y = x W^T with W float16, bfloat16 or float32, float32 arithmetic */
/* ------------------------------------------------------------------------------ */

static inline int is_float(const tm_weight *w) {
    return w->bits == TM_F16 || w->bits == TM_BF16 || w->bits == TM_F32;
}

/* TM_W weights from column k of a float row, as float32. */
static inline vf load_w(const void *row, int kind, int k) {
    if (kind == TM_F32) return vf_load((const float *)row + k);
    const uint16_t *h = (const uint16_t *)row + k;
    return kind == TM_BF16 ? vf_load_bf16(h) : vf_load_f16(h);
}

static inline float w_at(const void *row, int kind, int k) {
    if (kind == TM_F32) return ((const float *)row)[k];
    const uint16_t h = ((const uint16_t *)row)[k];
    return kind == TM_BF16 ? tm_bf16_to_float(h) : tm_half_to_float(h);
}

/* Rows [r0, r1) against T (<= TCHUNK) rows of x from t0; T and KIND constant after
 * inlining. Two accumulators per activation row hide the FMA latency at T = 1. */
static inline __attribute__((always_inline)) void float_rows(const tm_weight *w, const float *x,
                                                             int r0, int r1, int t0, int T, int KIND,
                                                             float *y, const float *bias) {
    const int K = w->k, kv = K / (2 * TM_W) * (2 * TM_W), es = KIND == TM_F32 ? 4 : 2;
    for (int r = r0; r < r1; r++) {
        const char *row = (const char *)w->codes + (size_t)r * K * es;
        for (int off = 0; off < K * es; off += 64) __builtin_prefetch(row + PREFETCH + off, 0, 3);
        vf a0[TCHUNK], a1[TCHUNK];
        for (int t = 0; t < T; t++) a0[t] = a1[t] = vf_zero();
        for (int k = 0; k < kv; k += 2 * TM_W) {
            const vf w0 = load_w(row, KIND, k), w1 = load_w(row, KIND, k + TM_W);
            for (int t = 0; t < T; t++) {
                const float *xt = x + (size_t)(t0 + t) * K + k;
                a0[t] = vf_fma(w0, vf_load(xt), a0[t]);
                a1[t] = vf_fma(w1, vf_load(xt + TM_W), a1[t]);
            }
        }
        for (int t = 0; t < T; t++) {
            const float *xt = x + (size_t)(t0 + t) * K;
            float s = vf_sum(vf_add(a0[t], a1[t]));
            for (int k = kv; k < K; k++) s += w_at(row, KIND, k) * xt[k];
            y[(size_t)(t0 + t) * w->n + r] = s + (bias ? bias[r] : 0.f);
        }
    }
}

typedef void (*float_fn)(const tm_weight *, const float *, int, int, int, float *, const float *);
#define DEF_FLOAT(KIND, T)                                                                      \
    static void float_k##KIND##_t##T(const tm_weight *w, const float *x, int r0, int r1, int t0, \
                                     float *y, const float *bias) {                              \
        float_rows(w, x, r0, r1, t0, T, KIND, y, bias);                                          \
    }
#define DEF_FLOAT_ALL(KIND)                                                   \
    DEF_FLOAT(KIND, 1) DEF_FLOAT(KIND, 2) DEF_FLOAT(KIND, 4) DEF_FLOAT(KIND, 8) \
    static const float_fn FLOAT_K##KIND[4] = {float_k##KIND##_t1, float_k##KIND##_t2, \
                                              float_k##KIND##_t4, float_k##KIND##_t8};
DEF_FLOAT_ALL(16) /* TM_F16 */
DEF_FLOAT_ALL(17) /* TM_BF16 */
DEF_FLOAT_ALL(32) /* TM_F32 */

static void float_any(const tm_weight *w, const float *x, int r0, int r1, int t0, int T, float *y,
                      const float *bias) {
    const float_fn *table = w->bits == TM_F32 ? FLOAT_K32 : w->bits == TM_BF16 ? FLOAT_K17 : FLOAT_K16;
    for (int p = 3; p >= 0; p--)
        if (T & (1 << p)) {
            table[p](w, x, r0, r1, t0, y, bias);
            t0 += 1 << p;
        }
}

/* ------------------------------------------------------------------------------ */
/* How a product runs                                                              */
/* ------------------------------------------------------------------------------ */

/* From how many rows of x tm_linear multiplies packed weights by the integer GEMM (gemm.c)
 * rather than in the GEMV, 0 on builds where it never does. Where it runs: AVX2 (vpmaddwd: 16 MACs per
 * instruction) and AVX-512 (32: vpdpwssd with VNNI, vpmaddwd without); not NEON (smull +
 * pairwise add: 8 MACs in 2 instructions, no faster than an FMA), not the scalar build.
 * The crossover, GEMV time / GEMM time on Zen 3, 2 threads, 7 interleaved rounds:
 * Llama-3.2-1B's 8192 x 2048, 2048 x 8192 and 3072 x 2048 weights, and SmolLM2-135M's
 * five shapes (576 to 3072 rows, 576 or 1536 columns):
 *     rows            6     8     10    12    16    24    32
 *     1B Q4_0       0.69  0.92  0.98  1.04  1.27  1.45  1.58
 *     1B Q4_K       0.66  0.84  0.93  1.02  1.21  1.47  1.58
 *     1B Q6_K       0.70  0.83  0.97  1.05  1.21  1.41  1.55
 *     1B Q8_0       0.82  1.04  1.11  1.25  1.43  1.66  1.83
 *     135M Q4_1     0.82  0.83  0.96  0.94  1.17  1.38  1.52
 *     135M Q8_0     0.88  0.92  1.03  1.18  1.27  1.50  1.64
 * The GEMV is compute-bound from a few rows (its cost per row stays flat), the GEMM's
 * tile building is paid once per call. On AVX2 prompts and batched decode steps of 16 rows
 * or more take the GEMM. AVX-512 VNNI's GEMV is stronger (vpdpbusd: 64 MACs per
 * instruction); GEMV time / GEMM time on a Sapphire Rapids-class Xeon, 2 threads, 7
 * interleaved rounds:
 *     rows            8     12    16    24    32
 *     1B Q4_K 8192  0.85  0.96  0.96  1.13  1.30
 *     1B Q4_K 2048  0.96  0.98  1.17  1.35  1.47
 *     1B Q8_0       1.06  1.00  0.87  1.02  1.13
 *     1B Q6_K       0.98  1.00  1.08  1.35  1.50
 *     1B Q4_0 3072  0.99  1.01  0.81  0.97  1.05
 * so there the GEMM takes 24 rows and more. */
#ifndef GEMM_MIN_ROWS
#define GEMM_MIN_ROWS (TM_W == 16 ? 24 : 16)
#endif
int tm_gemm_min_rows(void) { return TM_W >= 8 ? GEMM_MIN_ROWS : 0; }

/* Above this many rows of x, W converted to float32 tiles for a float32 GEMM (torch's, on
 * the Python side) beats the GEMV: float weights, and packed ones on builds without the
 * integer GEMM. On SmolLM2's shapes (2 threads) the crossover lies between 64 and 96 rows
 * (re-measure with benchmarks/gemv.py --t). */
#define GEMV_MAX_ROWS 80

/* How a product y [T, N] = x [T, K] @ W^T of a weight of `bits` (tm_weight.bits) runs: the
 * one rule, asked by tm_linear (so the fused decode stack too) and by Python's linear
 * layers (tiles = 1: the caller has a float32 GEMM for TM_PATH_TILES; tm_linear has none
 * and runs the GEMV there). Writes why into reason [cap] (NULL: not asked). */
int tm_linear_path(int bits, int T, int tiles, char *reason, int cap) {
    const int packed = (bits >= 2 && bits <= 6) || bits == 8 || grid_kind(bits), gemm = tm_gemm_min_rows();
    if (packed && gemm) {
        if (T >= gemm) {
            if (reason) snprintf(reason, cap, "T=%d rows >= %d: the integer GEMM beats the GEMV on %s", T, gemm, TM_SIMD_NAME);
            return TM_PATH_GEMM;
        }
        if (reason) snprintf(reason, cap, "T=%d rows < %d: the GEMV beats the integer GEMM's tile building on %s", T, gemm, TM_SIMD_NAME);
        return TM_PATH_GEMV;
    }
    const char *what = packed ? "packed weights on a build whose integer GEMM is no faster" : "float weights";
    if (T <= GEMV_MAX_ROWS) {
        if (reason) snprintf(reason, cap, "T=%d rows <= %d, %s: the GEMV", T, GEMV_MAX_ROWS, what);
        return TM_PATH_GEMV;
    }
    if (!tiles) {
        if (reason) snprintf(reason, cap, "T=%d rows, %s, and no float32 GEMM to take them: the GEMV", T, what);
        return TM_PATH_GEMV;
    }
    if (reason) snprintf(reason, cap, "T=%d rows > %d, %s: float32 tiles for a float32 GEMM beat the GEMV", T, GEMV_MAX_ROWS, what);
    return TM_PATH_TILES;
}

/* ------------------------------------------------------------------------------ */
/* The entry points                                                                */
/* ------------------------------------------------------------------------------ */

/* y [T, N] = x [T, K] @ W^T (+ bias). Packed weights: activations quantized per block
 * to 8 bits, or to 16 bits if act16; float weights: x stays float32. Returns 0 if
 * scratch memory ran out, -1 for K-quant scales on a build that reads plain ones only. */
static int linear_one(const tm_weight *w, const float *x, int T, float *y, const float *bias,
                      int nthreads, int act16);

/* Output buffer of a segment (per thread; linear_one uses tm_scratch). */
static __thread tm_buf seg_out;

int tm_linear(const tm_weight *w, const float *x, int T, float *y, const float *bias,
              int nthreads, int act16) {
    if (!w->next) return linear_one(w, x, T, y, bias, nthreads, act16);
    /* A chain of row segments in different formats (a fused Q4_K q/k beside a Q6_K v):
     * each segment into a buffer, then its columns into y [T, total rows]. */
    int total = 0;
    for (const tm_weight *s = w; s; s = s->next) total += s->n;
    int off = 0;
    for (const tm_weight *s = w; s; s = s->next) {
        float *seg_buf = tm_buf_get(&seg_out, (size_t)T * s->n * sizeof(float));
        if (!seg_buf) return 0;
        const int rc = linear_one(s, x, T, seg_buf, bias ? bias + off : NULL, nthreads, act16);
        if (rc != 1) return rc;
        for (int t = 0; t < T; t++)
            memcpy(y + (size_t)t * total + off, seg_buf + (size_t)t * s->n, (size_t)s->n * sizeof(float));
        off += s->n;
    }
    return 1;
}

static int linear_one(const tm_weight *w, const float *x, int T, float *y, const float *bias,
                      int nthreads, int act16) {
    if (w->dsup && w->k / 256 > KSUP_MAX) return -1;     /* ksup_row's buffers (+ 1 lane) */
    const int fw = is_float(w);
    if (tm_linear_path(w->bits, T, 0, NULL, 0) == TM_PATH_GEMM) /* the integer GEMM (gemm.c) */
        return tm_gemm(w, x, T, y, bias, nthreads, act16);
    xq_t xq;
    if (!fw && !quantize_x(x, T, w, act16, &xq, NULL)) return 0;
    const int n = w->n, nblk = (n + ROWBLOCK - 1) / ROWBLOCK;
    const int nt = tm_team(nthreads, nblk);
    int64_t start = tm_now(), done = start;
    /* guided: shrinking chunks of row blocks, few hand-outs when quiet (each one is an
     * atomic on a line both cores share); a stalled thread is team.c's business */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(guided) nowait
        for (int rb = 0; rb < nblk; rb++) {
            int r0 = rb * ROWBLOCK, r1 = r0 + ROWBLOCK < n ? r0 + ROWBLOCK : n;
            for (int t0 = 0; t0 < T; t0 += TCHUNK) {
                const int tc = T - t0 < TCHUNK ? T - t0 : TCHUNK;
                if (fw)
                    float_any(w, x, r0, r1, t0, tc, y, bias);
                else
                    rows_any(w, &xq, r0, r1, t0, tc, y, bias);
            }
        }
        if (tm_thread_id() == 0) done = tm_now();
    }
    tm_team_done(nt, start, done);
    return 1;
}

/* Several GEMVs in one parallel region: job j multiplies w[j] (packed, not a chain) by
 * x[j] [T[j], K_j] into y[j]; bias[j] may be NULL. A MoE layer's active experts as one
 * stream of row blocks: one region instead of one per expert, a thread's share running
 * on from one expert's rows into the next's (and the prefetch with it). Each x is
 * quantized once, into its own buffer (jobs with the same x, T, K and activation format
 * share it); every output row is tm_linear's. Jobs tm_linear would not run here (float
 * weights, chains, more than TCHUNK rows, 5- and 6-bit rows of partial groups) make the
 * call one tm_linear per job. Returns 1, 0 on OOM, or tm_linear's error. */
static __thread tm_buf jobs_buf;

enum { JOBS_MAX = 64 };

int tm_linear_jobs(const tm_weight *const *w, const float *const *x, const int *T, float *const *y,
                   const float *const *bias, int n, int nthreads, int act16) {
    int direct = n == 1;
    for (int j = 0; j < n && !direct; j++)
        direct = is_float(w[j]) || w[j]->next || T[j] > TCHUNK ||
                 tm_linear_path(w[j]->bits, T[j], 0, NULL, 0) == TM_PATH_GEMM ||
                 (w[j]->dsup && w[j]->k / 256 > KSUP_MAX);
    if (direct) {
        for (int j = 0; j < n; j++) {
            const int rc = tm_linear(w[j], x[j], T[j], y[j], bias[j], nthreads, act16);
            if (rc != 1) return rc;
        }
        return 1;
    }
    if (n > JOBS_MAX) { /* in pieces of JOBS_MAX */
        for (int j0 = 0; j0 < n; j0 += JOBS_MAX) {
            const int m = n - j0 < JOBS_MAX ? n - j0 : JOBS_MAX;
            const int rc = tm_linear_jobs(w + j0, x + j0, T + j0, y + j0, bias + j0, m, nthreads, act16);
            if (rc != 1) return rc;
        }
        return 1;
    }
    xq_t xq[JOBS_MAX];
    int src[JOBS_MAX], first[JOBS_MAX + 1]; /* whose quantized x a job reads; its first block */
    size_t off[JOBS_MAX], total = 0;
    for (int j = 0; j < n; j++) {
        src[j] = j;
        for (int i = 0; i < j && src[j] == j; i++)
            if (src[i] == i && x[i] == x[j] && T[i] == T[j] && w[i]->k == w[j]->k &&
                zero_point(w[i]) == zero_point(w[j]) && dot_bits(w[i]) == dot_bits(w[j]) &&
                sixteen_scales(w[i]->bits) == sixteen_scales(w[j]->bits) &&
                tail_in_lanes(w[i]->bits) == tail_in_lanes(w[j]->bits))
                src[j] = i;
        off[j] = total;
        if (src[j] == j) total += xq_bytes(T[j], w[j]->k, sixteen_scales(w[j]->bits));
    }
    char *buf = tm_buf_get(&jobs_buf, total);
    if (!buf) return 0;
    first[0] = 0;
    for (int j = 0; j < n; j++) {
        if (src[j] == j && !quantize_x(x[j], T[j], w[j], act16, &xq[j], buf + off[j]))
            return 0;
        first[j + 1] = first[j] + (w[j]->n + ROWBLOCK - 1) / ROWBLOCK;
    }
    const int nblk = first[n], nt = tm_team(nthreads, nblk);
    int64_t start = tm_now(), done = start;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int j = 0;
#pragma omp for schedule(guided) nowait
        for (int b = 0; b < nblk; b++) {
            while (b >= first[j + 1]) j++; /* a thread's blocks come in rising order */
            while (b < first[j]) j--;
            const int r0 = (b - first[j]) * ROWBLOCK;
            const int r1 = r0 + ROWBLOCK < w[j]->n ? r0 + ROWBLOCK : w[j]->n;
            rows_any(w[j], &xq[src[j]], r0, r1, 0, T[j], y[j], bias[j]);
        }
        if (tm_thread_id() == 0) done = tm_now();
    }
    tm_team_done(nt, start, done);
    return 1;
}

/* Row r of a float weight to out [K] float32 (natural order = its lane order). */
static void float_row(const tm_weight *w, int r, float *out) {
    const char *row = (const char *)w->codes + (size_t)r * w->k * (w->bits == TM_F32 ? 4 : 2);
    int k = 0;
    for (; k + TM_W <= w->k; k += TM_W) vf_store(out + k, load_w(row, w->bits, k));
    for (; k < w->k; k++) out[k] = w_at(row, w->bits, k);
}

static void row_lanes(const tm_weight *w, int r, float *out) {
    while (w->next && r >= w->n) { /* the segment holding row r */
        r -= w->n;
        w = w->next;
    }
    if (is_float(w))
        float_row(w, r, out);
    else
        dequant_row_lanes(w, r, out);
}

/* Rows [r0, r1) of W to out [r1 - r0, K] float32 in lane order (the caller permutes
 * x's columns the same way before its GEMM: tm_lanes_f32; 16-bit floats: natural). */
void tm_dequant_lanes(const tm_weight *w, int r0, int r1, float *out, int nthreads) {
    const int nt = tm_team(nthreads, r1 - r0);
    (void)nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int r = r0; r < r1; r++) row_lanes(w, r, out + (size_t)(r - r0) * w->k);
}

/* x [T, K] float32 -> out [T, K] with columns in lane order: the activation side of the
 * prefill GEMM against tm_dequant_lanes' weights (16-byte moves, one pass). */
void tm_lanes_f32(const float *x, int T, int K, float *out, int nthreads) {
    const int nfull = K / GW, nt = tm_team(nthreads, T);
    (void)nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && (size_t)T * K > 65536)
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * K;
        float *o = out + (size_t)t * K;
        for (int g = 0; g < nfull; g++) /* value j = 4i + u of block k -> i * 4G + k * 4 + u */
            for (int k = 0; k < TM_GB; k++)
                for (int i = 0; i < 8; i++)
                    memcpy(o + (size_t)g * GW + i * 4 * TM_GB + k * 4, xr + (size_t)g * GW + k * QK + 4 * i, 16);
        memcpy(o + (size_t)nfull * GW, xr + (size_t)nfull * GW, (size_t)(K - nfull * GW) * sizeof(float));
    }
}

/* Rows ids[0..n) of W to out [n, K] float32 in natural column order: the embedding
 * lookup of a quantized (tied) embedding table. Returns 1, -1 if an id is outside
 * [0, N) (nothing written), 0 on OOM. */
int tm_dequant_rows(const tm_weight *w, const int64_t *ids, int n, float *out) {
    const int K = w->k, nfull = is_float(w) ? 0 : K / GW;
    for (int e = 0; e < n; e++)
        if (ids[e] < 0 || ids[e] >= w->n) return -1;
    float *tmp = tm_scratch((size_t)K * sizeof(float));
    if (!tmp) return 0;
    for (int e = 0; e < n; e++) {
        float *o = out + (size_t)e * K;
        row_lanes(w, (int)ids[e], tmp);
        for (int g = 0; g < nfull; g++) /* un-transpose full groups, 4 values at a time */
            for (int k = 0; k < TM_GB; k++)
                for (int i = 0; i < 8; i++)
                    memcpy(o + (size_t)g * GW + k * QK + 4 * i, tmp + (size_t)g * GW + i * 4 * TM_GB + 4 * k, 16);
        memcpy(o + (size_t)nfull * GW, tmp + (size_t)nfull * GW, (size_t)(K - nfull * GW) * sizeof(float));
    }
    return 1;
}

/* ------------------------------------------------------------------------------ */
/* What this build is: Python checks these once at load                           */
/* ------------------------------------------------------------------------------ */

/* ABI version * 1000 + the vector width in 32-bit lanes. */
int tm_info(void) { return TM_ABI * 1000 + TM_W; }

/* The GEMV's prefetch distance (PREFETCH in tm.h), set before any kernel runs. */
#ifndef TM_PREFETCH_FIXED
int tm_prefetch = 8192;

__attribute__((constructor)) static void prefetch_init(void) {
    const char *env = getenv("TOKENMILL_PREFETCH");
    if (env && *env) {
        const long v = strtol(env, NULL, 10);
        tm_prefetch = v < 0 ? 0 : v > (1 << 20) ? (1 << 20) : (int)v;
        return;
    }
}
#endif

int tm_prefetch_bytes(void) { return PREFETCH; }

/* Blocks per lane-order group: the packing Python must produce for this build. */
int tm_group_blocks(void) { return TM_GB; }

/* Whether this build reads K-quant scales as stored (else Python passes float32 ones):
 * every build does now; kept so that Python asks rather than assumes. */
int tm_kquant_scales(void) { return 1; }

/* The instruction set the kernels run (see tm.h): the simd.h layer compiled in, plus the
 * GEMM's tiles where it uses them (tm_amx). */
const char *tm_isa(void) {
    static char name[48]; /* filled once; a race writes the same bytes */
    if (!name[0]) snprintf(name, sizeof name, "%s%s", TM_SIMD_NAME, tm_amx());
    return name;
}

/* Sizes of the structs Python mirrors with ctypes: caught at load if they drift. */
int tm_struct_size(int which) {
    switch (which) {
    case 0: return (int)sizeof(tm_weight);
    case 1: return (int)sizeof(tm_layer);
    case 2: return (int)sizeof(tm_stack);
    case 3: return (int)sizeof(tm_shape);
    case 4: return (int)sizeof(tm_rows);
    case 5: return (int)sizeof(tm_moe);
    default: return -1;
    }
}
