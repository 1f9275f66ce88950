/* AVX-512 VNNI/BF16 specializations of linear.c (TM_AVX512 builds only): activation
 * quantization into two VNNI operands, the packed GEMV over groups of 16 blocks (one
 * 512-bit vector of 32-bit lanes), and the dequantized tiles of the prefill GEMM.
 * Included by linear.c, which defines the helpers used here (lane_pos, zero_point,
 * row_bytes) and documents the packed format. */

typedef struct {
    int8_t *q;   /* [T][kpad] int8 in lane order, zero padded (16-bit: high bytes) */
    uint8_t *ql; /* [T][kpad] 16-bit mode: low bytes (unsigned), else unused */
    float *dx;   /* [T][gpad] block scales (0 in padding) */
    float *sx;   /* [T][gpad] exact float sums of x per block */
    int32_t *zc; /* [T][gpad] Z * sum(q) per block */
    int32_t *zl; /* [T][gpad] 16-bit mode, 4-bit weights: Z * sum(ql) per block */
    int kpad, gpad;
} xq_t;


/* Quantizes x [T, K] float32 per 32-block for a weight with zero point z and `bits`.
 * 8-bit mode: q = round(x / dx), dx = max|x| / 127.
 * 16-bit mode (act16): q16 = round(x / dx), dx = max|x| / 32767, stored as its signed
 * high byte (q) and unsigned low byte (ql): q16 = 256 * q + ql, so each half is a
 * VNNI operand. Returns 0 on OOM. */
static int quantize_x(const float *x, int T, int K, int z, int bits, int act16, xq_t *xq) {
    const int nb = K / QK;
    xq->gpad = (nb + TM_GB - 1) / TM_GB * TM_GB;
    xq->kpad = xq->gpad * QK + 64; /* +64: full-width loads at the tail stay in bounds */
    const size_t qbytes = ((size_t)T * xq->kpad + 63) & ~(size_t)63;
    const size_t fbytes = (size_t)T * xq->gpad * 4;
    const size_t total = (act16 ? 2 : 1) * qbytes + 4 * fbytes;
    char *buf = tm_scratch(total);
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
            const size_t pos = lane_pos(nb, b, 0);
            if (b >= nb / TM_GB * TM_GB) {
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
    const int nb = w->k / QK, nfull = nb / TM_GB, nbt = nb % TM_GB, f16 = w->scale_f16;
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
            __m512 d = load_scales(w->scales, f16, srow + (size_t)g * TM_GB, 0xffff);
            __m512 m = w->mins ? load_scales(w->mins, f16, srow + (size_t)g * TM_GB, 0xffff)
                               : _mm512_setzero_ps();
            for (int t = 0; t < T; t++) {
                const size_t tt = (size_t)(t0 + t), xi = tt * xq->gpad + (size_t)g * TM_GB;
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
            __m512i wt[TM_GB / 2];
            for (int q = 0; q < nchunks; q++) wt[q] = tail_codes(tail, bits, q, nbt);
            const size_t s0 = srow + (size_t)nfull * TM_GB;
            __m512 d = load_scales(w->scales, f16, s0, tmask);
            __m512 m = w->mins ? load_scales(w->mins, f16, s0, tmask) : _mm512_setzero_ps();
            for (int t = 0; t < T; t++) {
                const size_t tt = (size_t)(t0 + t), xi = tt * xq->gpad + (size_t)nfull * TM_GB;
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


/* Row r of W to out [K] float32 in lane order (the order of the packed codes). */
static void dequant_row_lanes(const tm_weight *w, int r, float *out) {
    const int nb = w->k / QK, z = zero_point(w), f16 = w->scale_f16;
    const uint8_t *row = w->codes + (size_t)r * row_bytes(w);
    const size_t srow = (size_t)r * nb;
    const int nfull = nb / TM_GB, nbt = nb % TM_GB;
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
        __m512 d = load_scales(w->scales, f16, srow + (size_t)g * TM_GB, 0xffff);
        __m512 m = w->mins ? load_scales(w->mins, f16, srow + (size_t)g * TM_GB, 0xffff)
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
            size_t b = srow + (size_t)nfull * TM_GB + 2 * q + h / 2;
            __m512 d = _mm512_set1_ps(tm_scale_at(w->scales, f16, b));
            __m512 m = _mm512_set1_ps(w->mins ? tm_scale_at(w->mins, f16, b) : 0.f);
            __m512 c = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(parts[h]), zv));
            _mm512_storeu_ps(out + (size_t)nfull * GW + 64 * q + 16 * h, _mm512_fmadd_ps(c, d, m));
        }
    }
}
