/* Runs every exported kernel of tokenmill/kernels on seeded random inputs and writes the
 * outputs, so that builds for different instruction sets can be compared (used by
 * tests/test_kernels_aarch64.py, which builds it for AArch64 with NEON + dotprod, plain
 * NEON and no SIMD at all and runs it under qemu-user).
 *
 *     kernels_driver OUT      OUT: records [int32 name length][name][int32 n][n float32]
 *
 * Random packed codes are random bytes: every byte string is a valid packed row, and
 * builds with the same vector width (NEON and scalar: 4 blocks per group) read the same
 * bytes the same way. Inputs depend only on the seed, never on the build. */
#include <stdio.h>

#include "../tokenmill/kernels/tm.h"

static uint64_t rng = 88172645463325252ull;
static uint32_t next_u32(void) { /* xorshift64 */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 32);
}
static float uniform(void) { return (float)(next_u32() >> 8) / 16777216.f * 2.f - 1.f; } /* [-1, 1) */

static void *fill_bytes(size_t n) {
    uint8_t *p = malloc(n);
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)next_u32();
    return p;
}
static float *fill_floats(size_t n, float scale) {
    float *p = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = uniform() * scale;
    return p;
}
static uint16_t to_half(float f) { /* positive normal range only: scales */
    uint32_t b;
    memcpy(&b, &f, 4);
    return (uint16_t)(((b >> 31) << 15) | ((((b >> 23) & 0xff) - 112) << 10) | ((b >> 13) & 0x3ff));
}
static void *fill_scales(size_t n, int f16, float scale) {
    if (!f16) return fill_floats(n, scale);
    uint16_t *p = malloc(n * 2);
    for (size_t i = 0; i < n; i++) p[i] = to_half(scale * (0.5f + 0.5f * (uniform() + 1.f)));
    return p;
}

static FILE *out;
static void emit(const char *name, const float *v, int n) {
    const int len = (int)strlen(name);
    fwrite(&len, 4, 1, out);
    fwrite(name, 1, len, out);
    fwrite(&n, 4, 1, out);
    fwrite(v, 4, n, out);
}

static void linear_cases(void) {
    const int ks[] = {32, 64, 128 + 96, 576, 1024 + 480}, ns[] = {1, 7, 33}, ts[] = {1, 3, 8, 9};
    for (int bits = 4; bits <= 8; bits += 4)
        for (int mins = 0; mins < 2; mins++)
            for (int f16 = 0; f16 < 2; f16++)
                for (int ki = 0; ki < 5; ki++)
                    for (int ni = 0; ni < 3; ni++) {
                        const int k = ks[ki], n = ns[ni];
                        tm_weight w = {fill_bytes((size_t)n * k * bits / 8), fill_scales((size_t)n * k / 32, f16, 0.01f),
                                       mins ? fill_scales((size_t)n * k / 32, f16, 0.01f) : NULL, bits, f16, n, k};
                        float *bias = fill_floats(n, 1.f), *lanes = malloc((size_t)(n < 2 ? 2 : n) * k * 4);
                        char name[128];
                        for (int ti = 0; ti < 4; ti++)
                            for (int act16 = 0; act16 < 2; act16++) {
                                const int t = ts[ti];
                                float *x = fill_floats((size_t)t * k, 2.f), *y = malloc((size_t)t * n * 4);
                                tm_linear(&w, x, t, y, ti == 1 ? bias : NULL, 2, act16);
                                snprintf(name, sizeof name, "linear b%d m%d f%d k%d n%d t%d a%d", bits, mins, f16, k, n, t,
                                         act16 ? 16 : 8);
                                emit(name, y, t * n);
                                tm_gemm(&w, x, t, y, ti == 1 ? bias : NULL, 2, act16); /* same case */
                                snprintf(name, sizeof name, "gemm b%d m%d f%d k%d n%d t%d a%d", bits, mins, f16, k, n, t,
                                         act16 ? 16 : 8);
                                emit(name, y, t * n);
                                free(x), free(y);
                            }
                        tm_dequant_lanes(&w, 0, n, lanes, 2);
                        snprintf(name, sizeof name, "lanes b%d m%d f%d k%d n%d", bits, mins, f16, k, n);
                        emit(name, lanes, n * k);
                        int64_t ids[2] = {n - 1, 0};
                        tm_dequant_rows(&w, ids, 2, lanes);
                        snprintf(name, sizeof name, "rows b%d m%d f%d k%d n%d", bits, mins, f16, k, n);
                        emit(name, lanes, 2 * k);
                        free((void *)w.codes), free((void *)w.scales), free((void *)w.mins), free(bias), free(lanes);
                    }
    float *x = fill_floats(3 * 1504, 1.f), *o = malloc(3 * 1504 * 4);
    tm_lanes_f32(x, 3, 1504, o, 2);
    emit("lanes_f32", o, 3 * 1504);
    free(x), free(o);
}

/* GGUF K-quant scales as stored: uint8 codes per block times float16 per 256 values */
static void kquant_cases(void) {
    for (int bits = 4; bits <= 8; bits += 4)
        for (int ki = 1; ki <= 3; ki += 2) {
            const int k = 256 * ki, n = 9, nb = k / 32;
            uint8_t *sc = fill_bytes((size_t)n * nb), *mc = fill_bytes((size_t)n * nb);
            for (int i = 0; i < n * nb; i++) sc[i] &= 63, mc[i] &= 63;
            tm_weight w = {fill_bytes((size_t)n * k * bits / 8), sc, mc, bits, 0, n, k,
                           fill_scales((size_t)n * k / 256, 1, 1e-3f), fill_scales((size_t)n * k / 256, 1, 1e-3f)};
            char name[64];
            for (int t = 1; t <= 5; t += 4) {
                float *x = fill_floats((size_t)t * k, 1.f), *y = malloc((size_t)t * n * 4);
                tm_linear(&w, x, t, y, NULL, 2, 1);
                snprintf(name, sizeof name, "kquant b%d k%d t%d", bits, k, t);
                emit(name, y, t * n);
                tm_gemm(&w, x, t, y, NULL, 2, 1);
                snprintf(name, sizeof name, "gemm kquant b%d k%d t%d", bits, k, t);
                emit(name, y, t * n);
                free(x), free(y);
            }
            float *lanes = malloc((size_t)n * k * 4);
            tm_dequant_lanes(&w, 0, n, lanes, 2);
            snprintf(name, sizeof name, "lanes kquant b%d k%d", bits, k);
            emit(name, lanes, n * k);
            free(lanes), free((void *)w.codes), free(sc), free(mc), free((void *)w.dsup), free((void *)w.msup);
        }
}

/* 6-bit codes (GGUF Q6_K), 3-bit ones (Q3_K) and 2-bit ones (Q2_K, a min code in each scale
 * byte's high nibble and msup) in Q6_K's form: byte scales per 16 values times float16 per 256 */
static void six_bit_cases(void) {
    const int kinds[] = {2, 3, 6};
    for (int bi = 0; bi < 3; bi++)
    for (int ki = 1; ki <= 3; ki += 2) {
        const int k = 256 * ki, n = 9, bits = kinds[bi];
        tm_weight w = {fill_bytes((size_t)n * k * bits / 8), fill_bytes((size_t)n * k / 16), NULL, bits, 0, n, k,
                       fill_scales((size_t)n * k / 256, 1, 1e-3f),
                       bits == 2 ? fill_scales((size_t)n * k / 256, 1, 1e-3f) : NULL};
        char name[64];
        for (int t = 1; t <= 5; t += 4) {
            float *x = fill_floats((size_t)t * k, 1.f), *y = malloc((size_t)t * n * 4);
            tm_linear(&w, x, t, y, NULL, 2, 1);
            snprintf(name, sizeof name, "six b%d k%d t%d", bits, k, t);
            emit(name, y, t * n);
            tm_gemm(&w, x, t, y, NULL, 2, 1);
            snprintf(name, sizeof name, "gemm six b%d k%d t%d", bits, k, t);
            emit(name, y, t * n);
            free(x), free(y);
        }
        float *lanes = malloc((size_t)n * k * 4);
        tm_dequant_lanes(&w, 0, n, lanes, 2);
        snprintf(name, sizeof name, "lanes six b%d k%d", bits, k);
        emit(name, lanes, n * k);
        free(lanes), free((void *)w.codes), free((void *)w.scales), free((void *)w.dsup), free((void *)w.msup);
    }
}

/* w's GEMV and integer GEMM of 1 and 5 rows at 8- and 16-bit activations, then its rows in
 * lane order: records "<label> t<T> a<act16>", "gemm <label> ..." and "lanes <label>" */
static void products(const tm_weight *w, const char *label) {
    char name[96];
    for (int t = 1; t <= 5; t += 4)
        for (int act16 = 0; act16 < 2; act16++) {
            float *x = fill_floats((size_t)t * w->k, 1.f), *y = malloc((size_t)t * w->n * 4);
            tm_linear(w, x, t, y, NULL, 2, act16);
            snprintf(name, sizeof name, "%s t%d a%d", label, t, act16);
            emit(name, y, t * w->n);
            tm_gemm(w, x, t, y, NULL, 2, act16);
            snprintf(name, sizeof name, "gemm %s t%d a%d", label, t, act16);
            emit(name, y, t * w->n);
            free(x), free(y);
        }
    float *lanes = malloc((size_t)w->n * w->k * 4);
    tm_dequant_lanes(w, 0, w->n, lanes, 2);
    snprintf(name, sizeof name, "lanes %s", label);
    emit(name, lanes, w->n * w->k);
    free(lanes);
}

/* 5-bit codes (GGUF Q5_0 / Q5_1 / Q5_K): rows of whole groups, float16 scales with and
 * without mins, and K-quant scale codes */
static void five_bit_cases(void) {
    for (int kind = 0; kind < 3; kind++) /* 0: Z = 16, 1: mins, 2: K-quant scales and mins */
        for (int ki = 1; ki <= 3; ki += 2) {
            const int k = 256 * ki, n = 9, nb = k / 32;
            tm_weight w = {fill_bytes((size_t)n * k * 5 / 8), NULL, NULL, 5, 1, n, k};
            if (kind < 2) {
                w.scales = fill_scales((size_t)n * nb, 1, 0.01f);
                w.mins = kind ? fill_scales((size_t)n * nb, 1, 0.01f) : NULL;
            } else {
                uint8_t *sc = fill_bytes((size_t)n * nb), *mc = fill_bytes((size_t)n * nb);
                for (int i = 0; i < n * nb; i++) sc[i] &= 63, mc[i] &= 63;
                w.scales = sc, w.mins = mc, w.scale_f16 = 0;
                w.dsup = fill_scales((size_t)n * k / 256, 1, 1e-3f), w.msup = fill_scales((size_t)n * k / 256, 1, 1e-3f);
            }
            char label[64];
            snprintf(label, sizeof label, "five c%d k%d", kind, k);
            products(&w, label);
            free((void *)w.codes), free((void *)w.scales), free((void *)w.mins);
            free((void *)w.dsup), free((void *)w.msup);
        }
}

/* 4-bit codes that index a table (GGUF IQ4_NL, IQ4_XS, MXFP4: float16 or E8M0 exponent-byte
 * scales), tails included; and 3-bit ones in Q3_K's form (the grid types of at most 8
 * points: IQ2_XS, IQ1_S, TQ2_0, ...), int8 codes per 16 times float16 per 256 read times 2^-3 */
static void table_cases(void) {
    static const uint8_t lut[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
    static const uint8_t lut6[16] = {85, 103, 120, 136, 153, 171};
    const int ks[] = {256, 1024 + 480, 256, 1024, 1024 + 480};
    for (int ki = 0; ki < 5; ki++) {
        const int k = ks[ki], n = 9, three = ki == 2 || ki == 3, e8m0 = ki == 4;
        tm_weight w = {fill_bytes((size_t)n * k / 2), fill_scales((size_t)n * k / 32, 1, 0.01f), NULL, 4, 1, n, k};
        w.lut = lut;
        if (e8m0) { /* MXFP4's exponent bytes: scales 2^-8 .. 2^7 */
            uint8_t *e = fill_bytes((size_t)n * k / 32);
            for (size_t i = 0; i < (size_t)n * k / 32; i++) e[i] = (uint8_t)(120 + e[i] % 16);
            free((void *)w.scales);
            w.scales = e, w.scale_f16 = TM_SCALE_E8M0;
        }
        if (three) { /* random planes (codes 6 and 7: the table's zeros), random 6-bit scale codes */
            uint8_t *sc = fill_bytes((size_t)n * k / 16);
            for (size_t i = 0; i < (size_t)n * k / 16; i++) sc[i] = (uint8_t)(2 * (sc[i] & 15) + 1);
            free((void *)w.codes), free((void *)w.scales);
            w.codes = fill_bytes((size_t)n * k * 3 / 8), w.bits = 3;
            w.scales = sc, w.scale_f16 = 0, w.dsup = fill_scales((size_t)n * k / 256, 1, 1e-3f);
            w.lut = lut6, w.sup_shift = 3;
        }
        char label[64];
        snprintf(label, sizeof label, "table%s k%d", three ? "3" : e8m0 ? "e8m0" : "", k);
        products(&w, label);
        free((void *)w.codes), free((void *)w.scales), free((void *)w.dsup);
    }
}

/* The grid kinds (IQ3_XXS: TM_GRID8, IQ3_S: TM_GRID9): random index, 9th-bit and sign
 * bytes, random scale nibbles under float16 d per 256 (read times 2^-2), a random grid;
 * 768 values end in a partial lane group where a group is 16 blocks */
static void grid_cases(void) {
    const int ks[] = {256, 768, 2048};
    for (int kind = TM_GRID8; kind <= TM_GRID9; kind++)
        for (int ki = 0; ki < 3; ki++) {
            const int k = ks[ki], n = 9;
            uint8_t *grid = fill_bytes((size_t)(kind == TM_GRID9 ? 512 : 256) * 4);
            tm_weight w = {fill_bytes((size_t)n * (k / 32) * kind), fill_bytes((size_t)n * k / 64), NULL, kind, 0, n, k,
                           fill_scales((size_t)n * k / 256, 1, 1e-3f)};
            w.lut = grid, w.sup_shift = 2;
            char label[64];
            snprintf(label, sizeof label, "grid b%d k%d", kind, k);
            products(&w, label);
            free((void *)w.codes), free((void *)w.scales), free((void *)w.dsup), free(grid);
        }
}

static void float_cases(void) {
    const int kinds[] = {TM_F16, TM_BF16, TM_F32}, ks[] = {8, 64, 1000};
    for (int ki = 0; ki < 3; ki++)
        for (int kk = 0; kk < 3; kk++) {
            const int kind = kinds[ki], k = ks[kk], n = 5, es = kind == TM_F32 ? 4 : 2;
            void *codes;
            if (kind == TM_F32) {
                codes = fill_floats((size_t)n * k, 0.1f);
            } else {
                uint16_t *h = malloc((size_t)n * k * 2);
                for (size_t i = 0; i < (size_t)n * k; i++) {
                    const float f = uniform() * 0.1f;
                    uint32_t b;
                    memcpy(&b, &f, 4);
                    h[i] = kind == TM_BF16 ? (uint16_t)(b >> 16) : (uint16_t)(to_half(fabsf(f) + 1e-3f) | (f < 0) << 15);
                }
                codes = h;
            }
            (void)es;
            tm_weight w = {codes, NULL, NULL, kind, 0, n, k};
            for (int t = 1; t <= 9; t += 4) {
                float *x = fill_floats((size_t)t * k, 1.f), *y = malloc((size_t)t * n * 4);
                tm_linear(&w, x, t, y, NULL, 2, 1);
                char name[64];
                snprintf(name, sizeof name, "float kind%d k%d t%d", kind, k, t);
                emit(name, y, t * n);
                free(x), free(y);
            }
            free(codes);
        }
}

/* A cache of n floats stored as kv_bits (TM_F32, or TM_F16 / TM_BF16 by truncation; f16:
 * values below 2^-14 become 0, so no subnormal needs the conversion's rounding). */
static void *as_cache(float *x, size_t n, int kv_bits) {
    if (kv_bits == TM_F32) return x;
    if (kv_bits == TM_Q8_0) { /* n / 32 blocks of 34 bytes: float16 d = max|x| / 127, int8 q */
        uint8_t *c = malloc(n / 32 * 34);
        for (size_t b = 0; b < n / 32; b++) {
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[b * 32 + i]));
            const uint16_t h = to_half(amax / 127.f); /* x in [-1, 1): d far above 2^-14 */
            memcpy(c + b * 34, &h, 2);
            const float d = tm_half_to_float(h);
            for (int i = 0; i < 32; i++) {
                const float r = roundf(x[b * 32 + i] / d);
                ((int8_t *)c)[b * 34 + 2 + i] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
            }
        }
        free(x);
        return c;
    }
    uint16_t *h = malloc(n * 2);
    for (size_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, &x[i], 4);
        h[i] = kv_bits == TM_BF16 ? (uint16_t)(b >> 16) : fabsf(x[i]) < 6.2e-5f ? 0 : to_half(x[i]);
    }
    free(x);
    return h;
}

/* The cache back as float32, to emit. */
static float *cache_floats(const void *c, size_t n, int kv_bits) {
    float *f = malloc(n * sizeof(float));
    if (kv_bits == TM_Q8_0) { /* q * d, block i / 32 */
        const uint8_t *b = c;
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, b + i / 32 * 34, 2);
            f[i] = (float)((const int8_t *)b)[i / 32 * 34 + 2 + i % 32] * tm_half_to_float(h);
        }
        return f;
    }
    for (size_t i = 0; i < n; i++)
        f[i] = kv_bits == TM_F32    ? ((const float *)c)[i]
               : kv_bits == TM_BF16 ? tm_bf16_to_float(((const uint16_t *)c)[i])
                                    : tm_half_to_float(((const uint16_t *)c)[i]);
    return f;
}

static void attention_cases(void) {
    /* Bd rows decoding over a paged cache, each row over its own slots (a row writes its
     * new k/v while the others read theirs); GQA 4/2, MHA 2/2 and MQA 6/1, hd 16 and 64;
     * float32, float16, bfloat16 and q8_0 caches (q8_0 where hd is whole 32-value blocks,
     * as KVCache requires); with and without attention sinks */
    const int cfg[][3] = {{4, 2, 16}, {2, 2, 64}, {6, 1, 64}}, kvs[4] = {TM_F32, TM_F16, TM_BF16, TM_Q8_0};
    for (int c = 0; c < 3; c++)
        for (int kv = 0; kv < 4; kv++)
        for (int window = 0; window <= 8; window += 8) {
            const int H = cfg[c][0], Hkv = cfg[c][1], hd = cfg[c][2], Bd = 3, slots_n = 128, cmax = 40, rot = hd;
            if (kvs[kv] == TM_Q8_0 && hd % 32) continue;
            float *qkv = fill_floats((size_t)Bd * (H + 2 * Hkv) * hd, 1.f);
            const int bits = kvs[kv];
            const size_t nc = (size_t)slots_n * Hkv * hd;
            void *kc = as_cache(fill_floats(nc, 1.f), nc, bits), *vc = as_cache(fill_floats(nc, 1.f), nc, bits);
            float *sinks = window ? fill_floats(H, 2.f) : NULL;
            float *qn = fill_floats(hd, 1.f), *kn = fill_floats(hd, 1.f);
            float *rc = fill_floats((size_t)64 * rot, 1.f), *rs = fill_floats((size_t)64 * rot, 1.f);
            int64_t pos[3] = {5, 39, 17}, lens[3] = {6, 40, 18}, newslot[3], slots[3 * 40];
            for (int b = 0; b < Bd; b++) {
                for (int j = 0; j < cmax; j++) slots[b * cmax + j] = b * cmax + (j * 7) % cmax;
                newslot[b] = slots[b * cmax + lens[b] - 1];
            }
            float *o = malloc((size_t)Bd * H * hd * 4);
            const tm_shape shape = {1, H * hd, H, Hkv, hd, 0, 0, 1e-6f};
            tm_layer layer = {0};
            layer.q_norm = c ? qn : NULL, layer.k_norm = c ? kn : NULL, layer.rcos = rc, layer.rsin = rs;
            layer.k_cache = kc, layer.v_cache = vc, layer.rot_dim = rot, layer.window = window;
            layer.scale = 1.f / sqrtf((float)hd);
            layer.kv_bits = bits, layer.sinks = sinks;
            const tm_rows rows = {pos, newslot, slots, lens, Bd, cmax};
            tm_decode_attention(&shape, &layer, &rows, qkv, o, 2);
            char name[64];
            snprintf(name, sizeof name, "attention c%d kv%d w%d", c, bits, window);
            emit(name, o, Bd * H * hd);
            snprintf(name, sizeof name, "kcache c%d kv%d w%d", c, bits, window);
            float *kf = cache_floats(kc, nc, bits);
            emit(name, kf, (int)nc);
            free(qkv), free(kc), free(vc), free(qn), free(kn), free(rc), free(rs), free(o), free(kf), free(sinks);
        }
}

static tm_weight *packed(int n, int k, int bits) {
    tm_weight *w = malloc(sizeof *w);
    *w = (tm_weight){fill_bytes((size_t)n * k * bits / 8), fill_scales((size_t)n * k / 32, 1, 0.003f),
                     bits == 4 ? fill_scales((size_t)n * k / 32, 1, 0.003f) : NULL, bits, 1, n, k};
    return w;
}

static void stack_cases(void) {
    const int L = 2, d = 64, H = 4, Hkv = 2, hd = 16, f = 96, Bd = 2, slots_n = 32, cmax = 12;
    for (int act = 0; act < 2; act++) {
        tm_layer layers[2];
        for (int l = 0; l < L; l++)
            layers[l] = (tm_layer){packed((H + 2 * Hkv) * hd, d, 4), packed(d, H * hd, 8), packed(2 * f, d, 4),
                                   packed(d, f, 8), NULL, fill_floats(d, 0.1f), NULL, NULL, fill_floats(d, 1.f),
                                   fill_floats(d, 1.f), act ? fill_floats(d, 1.f) : NULL,
                                   act ? fill_floats(d, 1.f) : NULL, NULL, NULL, fill_floats(16 * hd, 1.f),
                                   fill_floats(16 * hd, 1.f), fill_floats((size_t)slots_n * Hkv * hd, 1.f),
                                   fill_floats((size_t)slots_n * Hkv * hd, 1.f), hd, act ? 4 : 0, 1, 0.25f};
        const tm_shape shape = {L, d, H, Hkv, hd, f, act, 1e-6f};
        tm_stack s = {&shape, layers, fill_floats(d, 1.f)};
        float *x = fill_floats((size_t)Bd * d, 1.f);
        int64_t pos[2] = {3, 11}, lens[2] = {4, 12}, newslot[2], slots[2 * 12];
        for (int b = 0; b < Bd; b++) {
            for (int j = 0; j < cmax; j++) slots[b * cmax + j] = b * cmax + (j * 5) % cmax;
            newslot[b] = slots[b * cmax + lens[b] - 1];
        }
        const tm_rows rows = {pos, newslot, slots, lens, Bd, cmax};
        tm_decode_stack(&s, &rows, x, 2);
        char name[32];
        snprintf(name, sizeof name, "stack act%d", act);
        emit(name, x, Bd * d);
        free(x);
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s OUT\n", argv[0]);
        return 2;
    }
    out = fopen(argv[1], "wb");
    if (!out) return 1;
    printf("%s %d\n", tm_isa(), tm_group_blocks());
    linear_cases();
    kquant_cases();
    six_bit_cases();
    five_bit_cases();
    table_cases();
    grid_cases();
    float_cases();
    attention_cases();
    stack_cases();
    return fclose(out) != 0;
}
