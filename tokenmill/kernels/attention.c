/* Decode attention over the paged KV cache: one call per layer does, for every decode row
 * and K/V head, the q/k RMSNorm, RoPE, the cache write of the new k/v and
 * softmax(q K^T * scale) V. The cache holds float32, float16, bfloat16 or q8_0 blocks
 * (tm_layer.kv_bits); scores, softmax and the value sums are float32 whatever it holds.
 * q8_0 (llama.cpp's layout): each 32 values of a head's row are 34 bytes, a float16 scale d
 * then 32 int8 q, the value q * d, dequantized as it is read; a cache "element" index idx
 * (a multiple of 32 at each block) lives in block idx / 32, at byte (idx / 32) * 34. The inner loops are
 * written once over simd.h, and once for every cache type: `bits` is a constant at each
 * call of the always-inline loops, so each type gets loops of its own with no test inside. */
#include "tm.h"

#define TM_INLINE static inline __attribute__((always_inline))

#define Q8_BLOCK 32
#define Q8_BYTES 34

/* The q8_0 block holding element idx of base. */
TM_INLINE const uint8_t *q8_block(const void *base, size_t idx) {
    return (const uint8_t *)base + idx / Q8_BLOCK * Q8_BYTES;
}

/* A q8_0 block's scale d, as float32 (it may sit at any byte: copied out). */
TM_INLINE float q8_scale(const uint8_t *blk) {
    uint16_t h;
    memcpy(&h, blk, 2);
    return tm_half_to_float(h);
}

/* TM_W cache floats from element idx of base, as float32 (q8_0: TM_W divides 32, so the
 * TM_W values share one block). */
TM_INLINE vf kv_load(const void *base, size_t idx, int bits) {
    if (bits == TM_Q8_0) {
        const uint8_t *blk = q8_block(base, idx);
        return vf_mul(vf_load_i8((const int8_t *)blk + 2 + idx % Q8_BLOCK), vf_set1(q8_scale(blk)));
    }
    if (bits == TM_F16) return vf_load_f16((const uint16_t *)base + idx);
    if (bits == TM_BF16) return vf_load_bf16((const uint16_t *)base + idx);
    return vf_load((const float *)base + idx);
}

/* One cache float, as float32. */
TM_INLINE float kv_at(const void *base, size_t idx, int bits) {
    if (bits == TM_Q8_0) {
        const uint8_t *blk = q8_block(base, idx);
        return (float)((const int8_t *)blk)[2 + idx % Q8_BLOCK] * q8_scale(blk);
    }
    if (bits == TM_F16) return tm_half_to_float(((const uint16_t *)base)[idx]);
    if (bits == TM_BF16) return tm_bf16_to_float(((const uint16_t *)base)[idx]);
    return ((const float *)base)[idx];
}

/* float32 -> IEEE half, rounded to nearest even as torch's .to(float16) rounds (so a K/V
 * row written here equals one the torch path writes): one instruction where the CPU has
 * it, else the bit manipulation (overflow to inf, subnormals, NaN kept a NaN). */
static inline uint16_t tm_float_to_half(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, 0); /* 0: _MM_FROUND_TO_NEAREST_INT */
#elif defined(__aarch64__)
    __fp16 h = (__fp16)f;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504: inf */
    if (ax < 0x38800000u) {                                      /* below 2^-14: subnormal */
        const float a = fabsf(f) * 16777216.f; /* units of 2^-24, rounded to nearest even */
        return (uint16_t)(sign | (uint32_t)nearbyintf(a));
    }
    const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u); /* to nearest even at bit 13 */
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
#endif
}

/* float32 -> bfloat16, rounded to nearest even (a NaN stays a NaN). */
static inline uint16_t tm_float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* Store x [n] float32 as the cache's values at element idx of base (q8_0: idx and n
 * multiples of 32). A q8_0 block: d = max|x| / 127, q = x * (1 / d) rounded to nearest
 * even (nearbyintf in the default rounding mode), d stored as float16: the same float32
 * operations as dtypes.quantize_q8_0, so both paths write the same bytes for the same x. */
static inline void kv_store(void *base, size_t idx, const float *x, int n, int bits) {
    if (bits == TM_Q8_0) {
        uint8_t *blk = (uint8_t *)base + idx / Q8_BLOCK * Q8_BYTES;
        for (int b = 0; b < n; b += Q8_BLOCK, blk += Q8_BYTES) {
            float amax = 0.f;
            for (int i = 0; i < Q8_BLOCK; i++) amax = fmaxf(amax, fabsf(x[b + i]));
            const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
            const uint16_t h = tm_float_to_half(d);
            memcpy(blk, &h, 2);
            int8_t *q = (int8_t *)blk + 2;
            for (int i = 0; i < Q8_BLOCK; i++) {
                float r = nearbyintf(x[b + i] * inv);
                r = r > 127.f ? 127.f : r < -127.f ? -127.f : r;
                q[i] = (int8_t)r;
            }
        }
        return;
    }
    if (bits == TM_F32) {
        memcpy((float *)base + idx, x, n * sizeof(float));
        return;
    }
    uint16_t *d = (uint16_t *)base + idx;
    for (int i = 0; i < n; i++) d[i] = bits == TM_F16 ? tm_float_to_half(x[i]) : tm_float_to_bf16(x[i]);
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

/* sc [m] = scale * (q . K_j), K_j = the hd cache floats from element sl[j] * stride of base. */
/* q . K_j as TM_W partial sums, K_j the hd (a multiple of 32) q8_0 values from element k of
 * base: each block's int8 dot in float32, then scaled by its d once. */
TM_INLINE vf q8_dot(const float *q, const void *base, size_t k, int hd) {
    const uint8_t *blk = q8_block(base, k);
    vf a = vf_zero();
    for (int b = 0; b < hd; b += Q8_BLOCK, blk += Q8_BYTES) {
        const int8_t *x = (const int8_t *)blk + 2;
        vf s = vf_mul(vf_load(q + b), vf_load_i8(x));
        for (int i = TM_W; i < Q8_BLOCK; i += TM_W) s = vf_fma(vf_load(q + b + i), vf_load_i8(x + i), s);
        a = vf_fma(s, vf_set1(q8_scale(blk)), a);
    }
    return a;
}

TM_INLINE void attn_scores(const float *q, const void *base, const int64_t *sl, size_t stride,
                           int m, int hd, float scale, float *sc, int bits) {
    int j = 0;
    if (bits == TM_Q8_0) { /* hd % 32 == 0 (KVCache refuses others) */
        for (; j + TM_W <= m; j += TM_W) {
            vf v[TM_W];
            for (int u = 0; u < TM_W; u++) v[u] = q8_dot(q, base, (size_t)sl[j + u] * stride, hd);
            vf_store(sc + j, vf_mul(vf_hsums(v), vf_set1(scale)));
        }
        for (; j < m; j++) sc[j] = vf_sum(q8_dot(q, base, (size_t)sl[j] * stride, hd)) * scale;
        return;
    }
    if (hd % TM_W == 0)
        for (; j + TM_W <= m; j += TM_W) { /* TM_W keys at a time: one horizontal-sum tree */
            vf v[TM_W];
            for (int u = 0; u < TM_W; u++) {
                const size_t k = (size_t)sl[j + u] * stride;
                vf a = vf_mul(vf_load(q), kv_load(base, k, bits));
                for (int i = TM_W; i < hd; i += TM_W) a = vf_fma(vf_load(q + i), kv_load(base, k + i, bits), a);
                v[u] = a;
            }
            vf_store(sc + j, vf_mul(vf_hsums(v), vf_set1(scale)));
        }
    for (; j < m; j++) {
        const size_t k = (size_t)sl[j] * stride;
        if (bits == TM_F32) {
            sc[j] = vf_dot(q, (const float *)base + k, hd) * scale;
            continue;
        }
        float dot = 0.f;
        for (int i = 0; i < hd; i++) dot += q[i] * kv_at(base, k + i, bits);
        sc[j] = dot * scale;
    }
}

/* acc [rep, hd] = sum_j p[r * m + j] * V_j for each of the rep rows of p, V_j as in
 * attn_scores. The accumulators of a few rows x 4 vectors of features stay in registers
 * while the keys stream by (instead of a load and a store of acc per key and row). */
/* rows per register block: 4 x 4 accumulators where there are 32 vector registers
 * (AVX-512, NEON; the scalar build's are arrays), 2 x 4 on AVX2's 16 */
#define VROWS (TM_W == 8 ? 2 : 4)
TM_INLINE void attn_values(const float *p, int m, int rep, const void *base, const int64_t *sl,
                           size_t stride, int hd, float *acc, int bits) {
    if (hd % TM_W == 0) {
        for (int r0 = 0; r0 < rep; r0 += VROWS) {
            const int nr = rep - r0 < VROWS ? rep - r0 : VROWS;
            for (int d0 = 0; d0 < hd; d0 += 4 * TM_W) {
                const int nv = (hd - d0 < 4 * TM_W ? hd - d0 : 4 * TM_W) / TM_W;
                vf a[VROWS][4], vv[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
                for (int r = 0; r < VROWS; r++)
                    for (int i = 0; i < 4; i++) a[r][i] = vf_zero();
                for (int j = 0; j < m; j++) {
                    const size_t v = (size_t)sl[j] * stride + d0;
                    for (int i = 0; i < 4; i++)
                        if (i < nv) vv[i] = kv_load(base, v + TM_W * i, bits);
                    for (int r = 0; r < VROWS; r++)
                        if (r < nr) {
                            const vf pr = vf_set1(p[(size_t)(r0 + r) * m + j]);
                            for (int i = 0; i < 4; i++)
                                if (i < nv) a[r][i] = vf_fma(pr, vv[i], a[r][i]);
                        }
                }
                for (int r = 0; r < VROWS; r++)
                    for (int i = 0; i < 4; i++)
                        if (r < nr && i < nv) vf_store(acc + (size_t)(r0 + r) * hd + d0 + TM_W * i, a[r][i]);
            }
        }
        return;
    }
    memset(acc, 0, (size_t)rep * hd * sizeof(float));
    for (int j = 0; j < m; j++) {
        const size_t v = (size_t)sl[j] * stride;
        for (int r = 0; r < rep; r++) {
            float *a = acc + (size_t)r * hd;
            const float pr = p[(size_t)r * m + j];
            if (bits == TM_F32)
                vf_axpy(a, pr, (const float *)base + v, hd);
            else
                for (int i = 0; i < hd; i++) a[i] += pr * kv_at(base, v + i, bits);
        }
    }
}

/* Scores (phase 0) or values (phase 1) of one (row, K/V head) task, the loops specialized
 * to the cache's type; kc, vc: the caches from this K/V head's first float (element off). */
static void attend(const float *q, const void *kc, const void *vc, size_t off, const int64_t *sl,
                   size_t stride, int m, int rep, int hd, float scale, float *sc, float *acc, int bits,
                   int phase) {
    /* off: a multiple of hd, so of 32 for q8_0 (whole blocks) */
    const size_t bytes = bits == TM_Q8_0 ? off / Q8_BLOCK * Q8_BYTES : off * (bits == TM_F32 ? 4 : 2);
    kc = (const char *)kc + bytes;
    vc = (const char *)vc + bytes;
    if (phase == 0) {
        for (int r = 0; r < rep; r++) {
            if (bits == TM_Q8_0)
                attn_scores(q + (size_t)r * hd, kc, sl, stride, m, hd, scale, sc + (size_t)r * m, TM_Q8_0);
            else if (bits == TM_F16)
                attn_scores(q + (size_t)r * hd, kc, sl, stride, m, hd, scale, sc + (size_t)r * m, TM_F16);
            else if (bits == TM_BF16)
                attn_scores(q + (size_t)r * hd, kc, sl, stride, m, hd, scale, sc + (size_t)r * m, TM_BF16);
            else
                attn_scores(q + (size_t)r * hd, kc, sl, stride, m, hd, scale, sc + (size_t)r * m, TM_F32);
        }
    } else if (bits == TM_Q8_0) {
        attn_values(sc, m, rep, vc, sl, stride, hd, acc, TM_Q8_0);
    } else if (bits == TM_F16) {
        attn_values(sc, m, rep, vc, sl, stride, hd, acc, TM_F16);
    } else if (bits == TM_BF16) {
        attn_values(sc, m, rep, vc, sl, stride, hd, acc, TM_BF16);
    } else {
        attn_values(sc, m, rep, vc, sl, stride, hd, acc, TM_F32);
    }
}

/* s [n] = exp(s - m), m = max(max(s), sink); returns the sum, exp(sink - m) included (an
 * attention sink: a softmax term with no value; -INFINITY for none), and m in *mx_out. */
static inline float softmax_exp(float *s, int n, float sink, float *mx_out) {
    float mx = sink;
    int j = 0;
    if (n >= TM_W) {
        vf vmx = vf_load(s);
        for (j = TM_W; j + TM_W <= n; j += TM_W) vmx = vf_max(vmx, vf_load(s + j));
        const float vm = vf_hmax(vmx);
        mx = vm > mx ? vm : mx;
    }
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    j = 0;
    float sum = 0.f;
    const vf vm = vf_set1(mx);
    vf acc = vf_zero();
    for (; j + TM_W <= n; j += TM_W) {
        const vf e = vf_exp(vf_sub(vf_load(s + j), vm));
        vf_store(s + j, e);
        acc = vf_add(acc, e);
    }
    sum = vf_sum(acc);
    for (; j < n; j++) {
        s[j] = expf(s[j] - mx);
        sum += s[j];
    }
    *mx_out = mx;
    return sum + expf(sink - mx);
}

/* What every task of one call reads: the layer, the rows and the shapes, unpacked once. */
typedef struct {
    int H, Hkv, hd, rep, cmax, rot_dim, window, qk_full, bits, stride;
    float eps, scale, softcap;
    const float *q_norm, *k_norm, *sinks, *rcos, *rsin, *qkv;
    void *k_cache, *v_cache;
    const int64_t *positions, *new_slots, *slots, *ctx_lens;
} attn_job;

/* Row b, K/V head g: norm, rotate and write the new k and v to the cache; the rep query
 * heads of the group, normed and rotated, into q [rep, hd]; kd [hd] scratch. */
static void prepare(const attn_job *J, int b, int g, float *q, float *kd) {
    const int H = J->H, Hkv = J->Hkv, hd = J->hd, rep = J->rep, rot_dim = J->rot_dim;
    const float eps = J->eps, *q_norm = J->q_norm, *k_norm = J->k_norm;
    const float *row = J->qkv + (size_t)b * J->stride;
    const float *c = J->rcos ? J->rcos + J->positions[b] * rot_dim : NULL;
    const float *s = J->rsin ? J->rsin + J->positions[b] * rot_dim : NULL;
    /* qk_full: the RMS factors of the row's whole q and k projections */
    const float q_inv = J->qk_full ? tm_rms_inv(row, H * hd, eps) : 0.f;
    const float k_inv = J->qk_full ? tm_rms_inv(row + (size_t)H * hd, Hkv * hd, eps) : 0.f;
    memcpy(kd, row + (size_t)(H + g) * hd, hd * sizeof(float));
    if (k_norm && J->qk_full)
        for (int i = 0; i < hd; i++) kd[i] = kd[i] * k_inv * k_norm[(size_t)g * hd + i];
    else if (k_norm)
        tm_rms_norm(kd, hd, k_norm, eps, kd);
    if (c) rope_inplace(kd, rot_dim, c, s);
    const size_t at = ((size_t)J->new_slots[b] * Hkv + g) * hd;
    kv_store(J->k_cache, at, kd, hd, J->bits);
    kv_store(J->v_cache, at, row + (size_t)(H + Hkv + g) * hd, hd, J->bits);
    for (int r = 0; r < rep; r++) {
        float *qr = q + (size_t)r * hd;
        const size_t h0 = (size_t)(g * rep + r) * hd; /* this head's offset in q */
        memcpy(qr, row + h0, hd * sizeof(float));
        if (q_norm && J->qk_full)
            for (int i = 0; i < hd; i++) qr[i] = qr[i] * q_inv * q_norm[h0 + i];
        else if (q_norm)
            tm_rms_norm(qr, hd, q_norm, eps, qr);
        if (c) rope_inplace(qr, rot_dim, c, s);
    }
}

/* Keys [k0, k1) of row b's visible context for K/V head g: scores sc [rep, k1 - k0], their
 * softmax terms, and acc [rep, hd] = the sum of the terms times the values; mx [rep] and
 * sum [rep] the max and the sum of each head's terms (sinks: the sink's term included,
 * for a task that sees the whole context, else -INFINITY). */
static void attend_range(const attn_job *J, int b, int g, int k0, int k1, const float *q, float *sc,
                         float *acc, float *mx, float *sum, int with_sinks) {
    const int hd = J->hd, rep = J->rep, m = k1 - k0;
    const int64_t *sl = J->slots + (size_t)b * J->cmax + k0;
    const size_t stride = (size_t)J->Hkv * hd; /* floats from one slot to the next */
    const size_t off = (size_t)g * hd;
    attend(q, J->k_cache, J->v_cache, off, sl, stride, m, rep, hd, J->scale, sc, acc, J->bits, 0);
    if (J->softcap > 0.f)
        for (size_t j = 0; j < (size_t)rep * m; j++) sc[j] = J->softcap * tanhf(sc[j] / J->softcap);
    for (int r = 0; r < rep; r++) {
        const float sink = with_sinks && J->sinks ? J->sinks[g * rep + r] : -INFINITY;
        sum[r] = softmax_exp(sc + (size_t)r * m, m, sink, &mx[r]);
    }
    attend(q, J->k_cache, J->v_cache, off, sl, stride, m, rep, hd, J->scale, sc, acc, J->bits, 1);
}

/* The keys row b sees: [j0, n). */
static inline void visible(const attn_job *J, int b, int *j0, int *n) {
    *n = (int)J->ctx_lens[b];
    *j0 = J->window > 0 && *n > J->window ? *n - J->window : 0;
}

static __thread tm_buf split_buf; /* the split path's shared q and partial results */

/* Parts to split each row's context into (flash-decoding): 1 while the rows and K/V heads
 * alone give every thread two tasks or the contexts are short; else enough that they do,
 * each part at least SPLIT_MIN keys. One long sequence on 2 cores with 3 K/V heads (SmolLM2)
 * otherwise keeps one core idle a third of the time. */
#define SPLIT_MIN 256
static int context_parts(int Bd, int Hkv, int cmax, int nthreads) {
    const int tasks = Bd * Hkv;
    if (nthreads < 2 || tasks >= 2 * nthreads || cmax < 2 * SPLIT_MIN) return 1;
    int parts = (2 * nthreads + tasks - 1) / tasks;
    if (parts > cmax / SPLIT_MIN) parts = cmax / SPLIT_MIN;
    return parts < 16 ? parts : 16;
}

/* Attention of Bd decode rows (one new token each) over a paged KV cache, whole layer
 * in one call: per row and K/V head, q/k RMSNorm (optional), RoPE, the cache write of
 * the new k/v, then softmax(q K^T * scale) V for the `rep` = H/Hkv query heads sharing
 * that K/V head. The layer L gives the q/k norms (each head apart, or with qk_full over
 * the row's whole q [H hd] and k [Hkv hd]: each task computes the row's two RMS factors
 * itself, H + Hkv dot products of hd, so tasks stay independent), the rotary tables
 * [P, rot_dim], the cache [num_slots, Hkv, hd], the sliding window (> 0: only the last
 * `window` keys are seen), the score scale, the soft-cap (> 0: each scaled score s
 * becomes softcap * tanh(s / softcap) before the softmax) and the sinks (a logit per head
 * in the softmax's sum, with no value: gpt-oss); `rows` the step's decode rows
 * (see tm_rows).
 *
 * Tasks are (row, K/V head) pairs; where they are too few for the threads, each row's
 * context is also split into parts (context_parts) whose partial softmax sums are merged
 * with their maxima (flash-decoding): the new k/v are written first, then every part is
 * scored, then the parts are merged.
 *
 *   qkv        [Bd, (H + 2 Hkv) hd]  fused projection output (q heads, k heads, v heads)
 *   out        [Bd, H hd]
 * Returns 1, or 0 if scratch could not be allocated. */
int tm_decode_attention(const tm_shape *sh, const tm_layer *L, const tm_rows *rows, const float *qkv,
                        float *out, int nthreads) {
    const int H = sh->H, Hkv = sh->Hkv, hd = sh->hd, Bd = rows->Bd, cmax = rows->cmax;
    const attn_job J = {
        .H = H, .Hkv = Hkv, .hd = hd, .rep = H / Hkv, .cmax = cmax, .rot_dim = L->rot_dim,
        .window = L->window, .qk_full = L->qk_full,
        /* anything but a 16-bit type or q8_0 is float32 (a zeroed tm_layer included) */
        .bits = L->kv_bits == TM_F16 || L->kv_bits == TM_BF16 || L->kv_bits == TM_Q8_0 ? L->kv_bits
                                                                                       : TM_F32,
        .stride = (H + 2 * Hkv) * hd, .eps = sh->eps, .scale = L->scale, .softcap = L->softcap,
        .q_norm = L->q_norm, .k_norm = L->k_norm, .sinks = L->sinks, .rcos = L->rcos,
        .rsin = L->rsin, .qkv = qkv, .k_cache = L->k_cache, .v_cache = L->v_cache,
        .positions = rows->positions, .new_slots = rows->new_slots, .slots = rows->slots,
        .ctx_lens = rows->ctx_lens,
    };
    const int rep = J.rep, groups = Bd * Hkv;
    const int parts = context_parts(Bd, Hkv, cmax, nthreads);
    const int nt = tm_team(nthreads, groups * parts);
    /* the split path's shared buffers: q [groups, rep, hd]; per (group, part): mx [rep],
     * sum [rep], acc [rep, hd] */
    const size_t part_floats = (size_t)rep * (hd + 2);
    float *shared = parts > 1 ? tm_buf_get(&split_buf, ((size_t)groups * rep * hd +
                                                        (size_t)groups * parts * part_floats) *
                                                           sizeof(float))
                              : NULL;
    if (parts > 1 && !shared) return 0;
    int ok = 1;
    int64_t start = tm_now(), done = start;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(& : ok)
    {
        /* per thread: q [rep, hd], accumulators [rep, hd], scores [rep, cmax], new k [hd],
         * mx [rep], sum [rep] */
        float *q = tm_scratch(((size_t)2 * rep * hd + (size_t)rep * cmax + hd + 2 * rep) * sizeof(float));
        if (!q) ok = 0;
        float *acc = q ? q + (size_t)rep * hd : NULL, *sc = acc ? acc + (size_t)rep * hd : NULL;
        float *kd = sc ? sc + (size_t)rep * cmax : NULL, *mx = kd ? kd + hd : NULL;
        float *sum = mx ? mx + rep : NULL;
        if (parts == 1) {
#pragma omp for schedule(static) nowait
            for (int task = 0; task < groups; task++) {
                if (!q) continue;
                const int b = task / Hkv, g = task % Hkv;
                int j0, n;
                prepare(&J, b, g, q, kd);
                visible(&J, b, &j0, &n);
                attend_range(&J, b, g, j0, n, q, sc, acc, mx, sum, 1);
                for (int r = 0; r < rep; r++) {
                    float *o = out + (size_t)b * H * hd + (size_t)(g * rep + r) * hd;
                    const float inv = 1.f / sum[r];
                    for (int i = 0; i < hd; i++) o[i] = acc[(size_t)r * hd + i] * inv;
                }
            }
        } else {
            float *qs = shared, *pr = shared + (size_t)groups * rep * hd;
            /* ---- every new k/v written (and each group's q made) before any part reads ---- */
#pragma omp for schedule(static)
            for (int task = 0; task < groups; task++)
                if (q) prepare(&J, task / Hkv, task % Hkv, qs + (size_t)task * rep * hd, kd);
            /* ---- each part of each group's context: its partial softmax and value sums ---- */
#pragma omp for schedule(static)
            for (int task = 0; task < groups * parts; task++) {
                if (!q) continue;
                const int grp = task / parts, part = task % parts, b = grp / Hkv, g = grp % Hkv;
                int j0, n;
                visible(&J, b, &j0, &n);
                const int k0 = j0 + (int)((int64_t)(n - j0) * part / parts);
                const int k1 = j0 + (int)((int64_t)(n - j0) * (part + 1) / parts);
                float *p = pr + (size_t)task * part_floats; /* mx [rep], sum [rep], acc [rep, hd] */
                if (k1 == k0) {
                    for (int r = 0; r < rep; r++) p[r] = -INFINITY, p[rep + r] = 0.f;
                    memset(p + 2 * rep, 0, (size_t)rep * hd * sizeof(float));
                    continue;
                }
                attend_range(&J, b, g, k0, k1, qs + (size_t)grp * rep * hd, sc, p + 2 * rep, p,
                             p + rep, 0);
            }
            /* ---- merge the parts: each rescaled to the largest maximum (and the sink) ---- */
#pragma omp for schedule(static) nowait
            for (int grp = 0; grp < groups; grp++) {
                const int b = grp / Hkv, g = grp % Hkv;
                for (int r = 0; r < rep; r++) {
                    const float sink = J.sinks ? J.sinks[g * rep + r] : -INFINITY;
                    float m = sink;
                    for (int part = 0; part < parts; part++) {
                        const float pm = pr[((size_t)grp * parts + part) * part_floats + r];
                        m = pm > m ? pm : m;
                    }
                    float total = expf(sink - m);
                    float *o = out + (size_t)b * H * hd + (size_t)(g * rep + r) * hd;
                    memset(o, 0, hd * sizeof(float));
                    for (int part = 0; part < parts; part++) {
                        const float *p = pr + ((size_t)grp * parts + part) * part_floats;
                        if (p[rep + r] == 0.f) continue; /* an empty part */
                        const float w = expf(p[r] - m);
                        total += p[rep + r] * w;
                        vf_axpy(o, w, p + 2 * rep + (size_t)r * hd, hd);
                    }
                    const float inv = 1.f / total;
                    for (int i = 0; i < hd; i++) o[i] *= inv;
                }
            }
        }
        if (tm_thread_id() == 0) done = tm_now();
    }
    tm_team_done(nt, start, done);
    return ok;
}
