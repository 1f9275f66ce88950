/* GGUF blocks -> the packed format of linear.c, in one pass over the file's bytes.
 *
 * Loading a GGUF repacks every weight: codes to lane order, scales and mins apart from
 * the codes. The numpy path (layers/quant_linear.py: gguf_blocks.parse_* then _store)
 * makes several passes and temporaries per tensor; this makes one, row by row, the rows
 * split among threads, and writes exactly the same bytes (tests/test_pack_native checks
 * every type against it).
 *
 * Per row of k values (nb = k / 32 blocks), for GGUF type qtype:
 *   Q8_0                  8-bit codes q + 128, float16 scales [nb]
 *   Q5_0, Q5_1            5-bit codes q on rows of whole lane groups (Q5_0: Z = 16), float16
 *                         scales [nb] (and mins [nb], Q5_1); other rows 8-bit codes (Q5_0:
 *                         q + 112, Z = 128; Q5_1: q)
 *   Q4_0, Q4_1            4-bit codes, float16 scales [nb] (and mins, Q4_1)
 *   IQ4_NL, MXFP4         4-bit codes (indices into the type's table, looked up by the
 *                         kernels); IQ4_NL float16 scales [nb] (its d), MXFP4 its E8M0
 *                         exponent bytes [nb] as they are (TM_SCALE_E8M0: read as 2^(e -
 *                         128), the power of two halved, as gguf-py's e8m0_to_fp32_half
 *                         for the doubled FP4 table), rows of exponents outside [2, 254]
 *                         refused (2^-128 and 2^-127 are subnormal, 255 is NaN: the numpy
 *                         path keeps float32 scales)
 *   Q4_K (4-bit), Q5_K    uint8 scale and min codes [nb], super-block (d, dmin) float16
 *   (5-bit, or 8-bit)     [k / 256][2]
 *   Q6_K                  6-bit codes on rows of whole lane groups, int8 scales [k / 16]
 *                         per group [half][block], super-block d float16 [k / 256][1];
 *                         other rows requantized to 8-bit codes with float16 scales [nb]
 *   Q3_K                  3-bit codes q (rows of any whole super-blocks), the file's 6-bit
 *                         scale codes [k * 3 / 64] (tm.h scale6_group), d as for Q6_K
 *   Q2_K                  2-bit codes on rows of whole lane groups, the file's scale bytes
 *                         (scale + 16 min) [k / 16] as Q6_K's, (d, dmin) [k / 256][2]
 * The codes of a row first go to natural order (nat), then to lane order (lane: the
 * 8-bit layout, tail in natural order), from which the 4- and 6-bit bytes are cut.
 */
#include "tm.h"

enum { G_Q4_0 = 2, G_Q4_1 = 3, G_Q5_0 = 6, G_Q5_1 = 7, G_Q8_0 = 8, G_Q2_K = 10, G_Q3_K = 11, G_Q4_K = 12,
       G_Q5_K = 13, G_Q6_K = 14, G_IQ4_NL = 20, G_MXFP4 = 39 };

static inline uint16_t u16_at(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* Bytes per block and values per block of a supported type, 0 otherwise. */
static int type_size(int qtype, int *block) {
    *block = 32;
    switch (qtype) {
    case G_Q4_0: return 18;
    case G_Q4_1: return 20;
    case G_Q5_0: return 22;
    case G_Q5_1: return 24;
    case G_Q8_0: return 34;
    case G_IQ4_NL: return 18;
    case G_MXFP4: return 17;
    }
    *block = 256;
    switch (qtype) {
    case G_Q2_K: return 84;
    case G_Q3_K: return 110;
    case G_Q4_K: return 144;
    case G_Q5_K: return 176;
    case G_Q6_K: return 210;
    }
    return 0;
}

/* The packed code bits of a type: its own, or 8 for the 5- and 6-bit types with as_8bit
 * (Q2_K and Q3_K: 0, not packed here then). */
static int code_bits(int qtype, int as_8bit) {
    if (qtype == G_Q4_0 || qtype == G_Q4_1 || qtype == G_Q4_K || qtype == G_IQ4_NL || qtype == G_MXFP4) return 4;
    if (qtype == G_Q2_K || qtype == G_Q3_K) return as_8bit ? 0 : qtype == G_Q2_K ? 2 : 3;
    if (as_8bit || qtype == G_Q8_0) return 8;
    return qtype == G_Q6_K ? 6 : 5;
}

/* Q4_K / Q5_K: the 6-bit scale and min codes of sub-block j < 8 from their 12 bytes. */
static inline void k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = s[j] & 63, *mn = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        *mn = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* A Q6_K super-block's 256 codes (0..63) in natural order, from 128 bytes of low nibbles
 * (per half of 128 values: values 0-63 in the low nibbles of its 64 bytes, 64-127 in the
 * high ones) and 64 bytes of top bits (per half: value 32 s + j at bits 2 s of byte j). */
static inline void q6k_codes(const uint8_t *ql, const uint8_t *qh, uint8_t *q) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *l = ql + 64 * h, *t = qh + 32 * h;
        uint8_t *o = q + 128 * h;
        for (int j = 0; j < 32; j++) {
            o[j] = (uint8_t)((l[j] & 15) | (t[j] & 3) << 4);
            o[32 + j] = (uint8_t)((l[32 + j] & 15) | ((t[j] >> 2) & 3) << 4);
            o[64 + j] = (uint8_t)((l[j] >> 4) | ((t[j] >> 4) & 3) << 4);
            o[96 + j] = (uint8_t)((l[32 + j] >> 4) | ((t[j] >> 6) & 3) << 4);
        }
    }
}

/* Where a per-16 scale goes: natural sub-block nat16 (block nat16 / 2, half nat16 % 2) of
 * a row of nb blocks, per group [half][block of the group] (tm.h half_scale_index,
 * quant_linear's half_scale_perm). */
static inline size_t half_scale_at(int nb, int nat16) { return half_scale_index(nb, nat16 / 2, nat16 % 2); }

/* Write 3-bit codes' 6-bit scale code c of half h of block b into a row's scales (nb
 * blocks, tm.h scale6_group's layout), its other bits kept. */
static inline void put_scale6(uint8_t *row, int nb, int b, int h, int c) {
    int G;
    uint8_t *p = (uint8_t *)scale6_group(row, nb, 0, b, &G);
    const int k = b % TM_GB, at = 4 * (k & 1) + 2 * h;
    p[k] = (uint8_t)((p[k] & ~(15 << (4 * h))) | (c & 15) << (4 * h));
    p[G + k / 2] = (uint8_t)((p[G + k / 2] & ~(3 << at)) | (c >> 4) << at);
}

/* Whether every MXFP4 block of a row has an exponent the kernels read as a byte (vf_scales'
 * E8M0 form: a normal float32 2^(e - 128)). */
static int mxfp4_row_fits_byte(const uint8_t *src, int k) {
    for (int b = 0; b < k / 32; b++)
        if (src[(size_t)b * 17] < 2 || src[(size_t)b * 17] > 254) return 0;
    return 1;
}

/* One row's blocks -> natural codes nat [k] for `bits`-bit packing, scales and mins (row
 * slices), sup. */
static void parse_row(int qtype, int bits, const uint8_t *src, int k, uint8_t *nat, uint8_t *scales,
                      uint8_t *mins, uint16_t *sup) {
    int block;
    const int ts = type_size(qtype, &block), n = k / block;
    uint16_t *sc16 = (uint16_t *)scales, *mn16 = (uint16_t *)mins;
    for (int b = 0; b < n; b++) {
        const uint8_t *p = src + (size_t)b * ts;
        uint8_t *q = nat + (size_t)b * block;
        switch (qtype) {
        case G_Q8_0:
            sc16[b] = u16_at(p);
            for (int j = 0; j < 32; j++) q[j] = p[2 + j] ^ 0x80;
            break;
        case G_Q4_0:
        case G_Q4_1: {
            const int off = qtype == G_Q4_1 ? 4 : 2;
            sc16[b] = u16_at(p);
            if (qtype == G_Q4_1) mn16[b] = u16_at(p + 2);
            for (int j = 0; j < 16; j++) q[j] = p[off + j] & 15, q[16 + j] = p[off + j] >> 4;
            break;
        }
        case G_IQ4_NL:
        case G_MXFP4: { /* Q4_0's nibbles after a float16 d, or after an exponent byte */
            const int off = qtype == G_MXFP4 ? 1 : 2;
            if (qtype == G_MXFP4)
                scales[b] = p[0];
            else
                sc16[b] = u16_at(p);
            for (int j = 0; j < 16; j++) q[j] = p[off + j] & 15, q[16 + j] = p[off + j] >> 4;
            break;
        }
        case G_Q5_0:
        case G_Q5_1: {
            const int off = qtype == G_Q5_1 ? 4 : 2;
            const uint32_t qh = (uint32_t)p[off] | (uint32_t)p[off + 1] << 8 | (uint32_t)p[off + 2] << 16 |
                                (uint32_t)p[off + 3] << 24;
            /* Q5_0 as 8-bit codes: d * (q - 16) = d * ((q + 112) - 128) */
            const uint8_t *qs = p + off + 4, bias = qtype == G_Q5_0 && bits == 8 ? 112 : 0;
            sc16[b] = u16_at(p);
            if (qtype == G_Q5_1) mn16[b] = u16_at(p + 2);
            for (int j = 0; j < 32; j++) {
                const uint8_t lo = j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
                q[j] = (uint8_t)((lo | ((qh >> j) & 1) << 4) + bias);
            }
            break;
        }
        case G_Q4_K:
        case G_Q5_K: {
            sup[2 * b] = u16_at(p), sup[2 * b + 1] = u16_at(p + 2);
            const uint8_t *qh = p + 16, *qs = p + (qtype == G_Q5_K ? 48 : 16);
            for (int s = 0; s < 8; s++) {
                k_scale_min(p + 4, s, &scales[8 * b + s], &mins[8 * b + s]);
                const uint8_t *c = qs + 32 * (s / 2);
                const int shift = 4 * (s & 1);
                for (int j = 0; j < 32; j++) {
                    uint8_t v = (c[j] >> shift) & 15;
                    if (qtype == G_Q5_K) v |= ((qh[j] >> s) & 1) << 4;
                    q[32 * s + j] = v;
                }
            }
            break;
        }
        case G_Q6_K: {
            sup[b] = u16_at(p + 208);
            q6k_codes(p, p + 128, q);
            /* int8 sub-scales of 16 values, natural: block kb's halves are 2 kb, 2 kb + 1 */
            for (int s = 0; s < 16; s++) scales[half_scale_at(k / QK, 16 * b + s)] = p[192 + s];
            break;
        }
        case G_Q3_K: { /* 32 bytes of high bits (value 32 i + j: bit i of byte j), 64 of low
                        * pairs (per 128-value half, value 32 s + j at bits 2 s of byte j), 12
                        * of 6-bit scales (low nibbles in bytes 0-7, top pairs in 8-11), d */
            sup[b] = u16_at(p + 108);
            const uint8_t *hm = p, *qs = p + 32, *sc = p + 96;
            for (int h = 0; h < 2; h++)
                for (int s = 0; s < 4; s++)
                    for (int j = 0; j < 32; j++)
                        q[128 * h + 32 * s + j] = (uint8_t)(((qs[32 * h + j] >> (2 * s)) & 3) | ((hm[j] >> (4 * h + s)) & 1) << 2);
            for (int i = 0; i < 16; i++) {
                const int code = ((sc[i % 8] >> (4 * (i / 8))) & 15) | ((sc[8 + i % 4] >> (2 * (i / 4))) & 3) << 4;
                put_scale6(scales, k / QK, 8 * b + i / 2, i % 2, code);
            }
            break;
        }
        case G_Q2_K: { /* 16 scale bytes, 64 of 2-bit values (as Q3_K's low pairs), d, dmin */
            sup[2 * b] = u16_at(p + 80), sup[2 * b + 1] = u16_at(p + 82);
            const uint8_t *qs = p + 16;
            for (int h = 0; h < 2; h++)
                for (int s = 0; s < 4; s++)
                    for (int j = 0; j < 32; j++) q[128 * h + 32 * s + j] = (qs[32 * h + j] >> (2 * s)) & 3;
            for (int i = 0; i < 16; i++) scales[half_scale_at(k / QK, 16 * b + i)] = p[i];
            break;
        }
        }
    }
}

/* float32 -> IEEE half, rounding to nearest even (numpy's astype(float16)): overflow to
 * inf, subnormal halves kept. */
static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, a = x & 0x7fffffff;
    if (a >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (a > 0x7f800000 ? 0x200 : 0));
    if (a >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* >= 65520: inf */
    if (a < 0x38800000) {                                   /* below 2^-14: subnormal or 0 */
        float v;
        memcpy(&v, &a, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(v * 16777216.f)); /* units of 2^-24 */
    }
    const uint32_t e = a - 0x38000000; /* exponent bias 127 -> 15 */
    return (uint16_t)(sign | ((e + 0xfff + ((e >> 13) & 1)) >> 13));
}

/* A Q6_K row as 8-bit Q8_0-like blocks (where the caller asks: as_8bit, for a library
 * taken not to read 6-bit codes): the float32 values gguf-py's dequantize gives
 * (d * sub-scale, then times code - 32), requantized per 32 as quant_linear._quantize_rows
 * "q8" does (scale max|w| / 127 rounded to float16, codes rint(w / scale) + 128), the
 * same float32 operations in the same order: bit for bit its bytes. */
static void requant_q6k_row(const uint8_t *src, int k, uint8_t *nat, uint16_t *scales) {
    float w[256] __attribute__((aligned(64)));
    int32_t qi[QK] __attribute__((aligned(64)));
    uint8_t c[256];
    for (int b = 0; b < k / 256; b++) {
        const uint8_t *p = src + (size_t)b * 210;
        const float d = tm_half_to_float(u16_at(p + 208));
        q6k_codes(p, p + 128, c);
        for (int s = 0; s < 16; s++) { /* d * sub-scale first, then times code - 32 */
            const vf scale = vf_set1(d * (float)(int8_t)p[192 + s]), z = vf_set1(32.f);
            for (int j = 0; j < 16; j += TM_W)
                vf_store(w + 16 * s + j, vf_mul(vf_sub(vf_load_u8(c + 16 * s + j), z), scale));
        }
        for (int blk = 0; blk < 8; blk++) {
            const float *x = w + 32 * blk;
            vf mx = vf_zero();
            for (int j = 0; j < QK; j += TM_W) mx = vf_max(mx, vf_abs(vf_load(x + j)));
            const uint16_t dh = float_to_half(vf_hmax(mx) / 127.f);
            const float df = tm_half_to_float(dh);
            const vf inv = vf_set1(df == 0.f ? 0.f : 1.f / df), lo = vf_set1(-127.f), hi = vf_set1(127.f);
            scales[8 * b + blk] = dh;
            /* rint(x / d) clipped to +-127 (clipping first rounds the same) */
            for (int j = 0; j < QK; j += TM_W)
                vi_store(qi + j, vi_round(vf_min(vf_max(vf_mul(vf_load(x + j), inv), lo), hi)));
            for (int j = 0; j < QK; j++) nat[256 * b + 32 * blk + j] = (uint8_t)(qi[j] + 128);
        }
    }
}

/* Natural codes -> lane order, 8-bit layout (full groups transposed, the tail as is). */
static void to_lanes(const uint8_t *nat, int k, int bits, uint8_t *lane) {
    const int nb = k / QK, full = nb / TM_GB * TM_GB;
    for (int b = 0; b < full; b++)
        for (int i = 0; i < 8; i++) memcpy(lane + lane_pos(nb, b, 4 * i), nat + (size_t)b * QK + 4 * i, 4);
    const int pb = partial_group(bits, nb);
    if (pb) { /* a partial group: lane order, vectors of 4 pb bytes */
        for (int b = full; b < nb; b++)
            for (int i = 0; i < 8; i++)
                memcpy(lane + (size_t)full * QK + (size_t)i * 4 * pb + (size_t)(b - full) * 4,
                       nat + (size_t)b * QK + 4 * i, 4);
        return;
    }
    memcpy(lane + (size_t)full * QK, nat + (size_t)full * QK, (size_t)(nb - full) * QK);
}

/* One group's lane-order codes L (8 vectors of v bytes: a whole group's 4 TM_GB, a half
 * group's 2 TM_GB) -> its packed bytes o of `bits` < 8 (every plane v bytes a vector). */
static void cut_group(const uint8_t *L, uint8_t *o, int bits, int v) {
    if (bits == 3) { /* three planes of whole codes (simd.h tm_plane3) */
        for (int r = 0; r < v; r++) {
            uint8_t q[8];
            for (int i = 0; i < 8; i++) q[i] = L[i * v + r] & 7;
            for (int j = 0; j < 3; j++) o[j * v + r] = tm_plane3(q, j);
        }
        return;
    }
    if (bits == 2) { /* two planes: vector 4h + s at bits 2s of plane h */
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < v; r++) {
                uint8_t c = 0;
                for (int s = 0; s < 4; s++) c |= (uint8_t)((L[(4 * h + s) * v + r] & 3) << (2 * s));
                o[h * v + r] = c;
            }
        return;
    }
    for (int c = 0; c < 4; c++)
        for (int r = 0; r < v; r++)
            o[c * v + r] = (uint8_t)((L[2 * c * v + r] & 15) | (L[(2 * c + 1) * v + r] & 15) << 4);
    if (bits == 5)
        for (int r = 0; r < v; r++) {
            uint8_t c = 0;
            for (int i = 0; i < 8; i++) c |= ((L[i * v + r] >> 4) & 1) << i;
            o[4 * v + r] = c;
        }
    if (bits == 6)
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < v; r++) {
                uint8_t c = 0;
                for (int s = 0; s < 4; s++) c |= ((L[(4 * h + s) * v + r] >> 4) & 3) << (2 * s);
                o[4 * v + h * v + r] = c;
            }
}

/* Lane-order codes -> the packed bytes of `bits` (linear.c's format). */
static void cut_codes(const uint8_t *lane, int k, int bits, uint8_t *out) {
    const int nb = k / QK, nfull = nb / TM_GB;
    if (bits == 8) {
        memcpy(out, lane, (size_t)k);
        return;
    }
    for (int g = 0; g < nfull; g++) cut_group(lane + (size_t)g * GW, out + (size_t)g * group_bytes(bits), bits, 4 * TM_GB);
    if (partial_group(bits, nb)) {
        cut_group(lane + (size_t)nfull * GW, out + (size_t)nfull * group_bytes(bits), bits, 4 * partial_group(bits, nb));
        return;
    }
    /* 4-bit tail: chunks of 64 values (a last lone block: 32), byte r = value r (low
     * nibble) and value n/2 + r (high) */
    const uint8_t *t = lane + (size_t)nfull * GW;
    uint8_t *o = out + (size_t)nfull * GW / 2;
    for (int left = k - nfull * GW; left > 0;) {
        const int n = left >= 64 ? 64 : 32;
        for (int r = 0; r < n / 2; r++) o[r] = (uint8_t)(t[r] | t[n / 2 + r] << 4);
        t += n, o += n / 2, left -= n;
    }
}

/* rows rows of GGUF type qtype (src: [rows][row bytes] as the file has them), k values
 * each, into codes [rows][k * bits / 8], scales and mins (float16 [rows][k / 32]; K-quants
 * uint8 codes [rows][k / 32]; Q6_K int8 [rows][k / 16]; mins NULL where the type has none)
 * and sup (K-quants: float16 [rows][k / 256][2], Q6_K [rows][k / 256][1]; else NULL);
 * with as_8bit (the caller's choice for rows not of whole lane groups) Q5_0, Q5_1 and
 * Q5_K as 8-bit codes, and Q6_K requantized to 8-bit codes, float16 scales [rows][k / 32],
 * no sup. Returns 1, 0 for a type or row length this does not pack (the caller's numpy
 * path does; also MXFP4 rows of exponents outside [2, 254]), -1 on OOM. */
int tm_pack_gguf(int qtype, const uint8_t *src, int64_t rows, int k, int as_8bit, uint8_t *codes,
                 void *scales, void *mins, uint16_t *sup, int nthreads) {
    int block;
    const int ts = type_size(qtype, &block), requant = qtype == G_Q6_K && as_8bit;
    const int bits = code_bits(qtype, as_8bit);
    if (!ts || !bits || k <= 0 || k % block) return 0;
    const size_t src_row = (size_t)(k / block) * ts, code_row = (size_t)k * bits / 8;
    size_t sc_row = (size_t)(sixteen_scales(bits) ? k / 16 : k / QK) * (block == 256 || qtype == G_MXFP4 ? 1 : 2);
    if (bits == 3) sc_row = (size_t)k * 3 / 64; /* 6-bit codes (tm.h scale6_group) */
    size_t sup_row = block == 256 ? (size_t)(k / 256) * (bits == 6 || bits == 3 ? 1 : 2) : 0;
    if (requant) sc_row = (size_t)(k / QK) * 2, sup_row = 0; /* float16 scales, no sup */
    const int nt = tm_threads(nthreads);
    uint8_t *buf = malloc((size_t)nt * 2 * (size_t)k); /* per thread: nat [k], lane [k] */
    if (!buf) return -1;
    int unfit = 0; /* an MXFP4 row whose exponents a byte scale cannot stand for: the caller repacks */
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *nat = buf + (size_t)tm_thread_id() * 2 * k, *lane = nat + k;
        if (qtype == G_MXFP4 && !mxfp4_row_fits_byte(src + (size_t)r * src_row, k)) {
#pragma omp atomic write
            unfit = 1;
            continue;
        }
        if (requant)
            requant_q6k_row(src + (size_t)r * src_row, k, nat, (uint16_t *)((uint8_t *)scales + (size_t)r * sc_row));
        else
            parse_row(qtype, bits, src + (size_t)r * src_row, k, nat, (uint8_t *)scales + (size_t)r * sc_row,
                      mins ? (uint8_t *)mins + (size_t)r * sc_row : NULL, sup ? sup + (size_t)r * sup_row : NULL);
        to_lanes(nat, k, bits, lane);
        cut_codes(lane, k, bits, codes + (size_t)r * code_row);
    }
    free(buf);
    return unfit ? 0 : 1;
}
