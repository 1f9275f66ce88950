/* The decode step of every layer in one call (tm_decode_stack): per layer, RMSNorm, the
 * fused QKV projection, decode attention (attention.c), the output projection, the
 * residual adds (with Gemma's sandwich norms), the gated MLP. The linear layers are
 * tm_linear (linear.c) on packed or 16-bit float weights. */
#include "tm.h"

/* out [f] = act(g [f]) * u [f]; act(x) = x * sigmoid(x) (SiLU) or the tanh-GELU
 * 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), both through exp(-|.|) <= 1; or
 * gpt-oss's clamped SwiGLU (s->act 2, see tm_shape). */
static void gated_act(const float *g, const float *u, int f, const tm_shape *s, float *out) {
    const int act = s->act;
    int i = 0;
    if (act == 2) { /* gpt-oss's clamped SwiGLU: element by element (a few k per expert) */
        const float limit = s->swiglu_limit, alpha = s->swiglu_alpha;
        for (; i < f; i++) {
            const float x = g[i] < limit ? g[i] : limit;
            const float v = u[i] < -limit ? -limit : u[i] > limit ? limit : u[i];
            out[i] = (v + 1.f) * x / (1.f + expf(-alpha * x));
        }
        return;
    }
    const vf one = vf_set1(1.f), half = vf_set1(0.5f);
    for (; i + TM_W <= f; i += TM_W) {
        const vf x = vf_load(g + i);
        vf a;
        if (act == 0) {
            const vf e = vf_exp(vf_sub(vf_zero(), vf_abs(x))); /* exp(-|x|) */
            const vf r = vf_div(one, vf_add(one, e));
            a = vf_mul(x, vf_select_neg(x, vf_mul(r, e), r)); /* x<0: e/(1+e) */
        } else {
            const vf x3 = vf_mul(vf_mul(x, x), x);
            const vf z = vf_mul(vf_set1(0.7978845608028654f), vf_fma(vf_set1(0.044715f), x3, x));
            const vf e = vf_exp(vf_mul(vf_set1(-2.f), vf_abs(z)));
            const vf t = vf_copysign(vf_div(vf_sub(one, e), vf_add(one, e)), z); /* tanh z */
            a = vf_mul(vf_mul(half, x), vf_add(one, t));
        }
        vf_store(out + i, vf_mul(a, vf_load(u + i)));
    }
    for (; i < f; i++) {
        const float x = g[i];
        float a;
        if (act == 0) {
            a = x / (1.f + expf(-x));
        } else {
            a = 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
        }
        out[i] = a * u[i];
    }
}

/* dst [Bd, d] = rmsnorm of each row of src (in place when dst == src); without weights w
 * (OLMo 2 norms after its sublayers only) a copy. */
static void norm_rows(const float *src, int Bd, int d, const float *w, float eps, float *dst) {
    if (!w) {
        if (dst != src) memcpy(dst, src, (size_t)Bd * d * sizeof(float));
        return;
    }
    for (int b = 0; b < Bd; b++) tm_rms_norm(src + (size_t)b * d, d, w, eps, dst + (size_t)b * d);
}

/* The residual add of a sublayer's output h [Bd, d]: x += s * (post_norm ? rmsnorm(h) : h),
 * s the layer's residual_scale (Granite's multiplier, 1 elsewhere). */
static void add_residual(float *x, float *h, int Bd, int d, float s, const float *post_norm, float eps) {
    if (post_norm) norm_rows(h, Bd, d, post_norm, eps, h);
    for (size_t i = 0; i < (size_t)Bd * d; i++) x[i] += s * h[i]; /* 1 * h is h exactly */
}

/* tm_decode_stack's activations (h, qkv, att, proj, up, mid), one grow-only tm_buf per
 * thread, separate from tm_scratch: the kernels it calls use tm_scratch on this thread;
 * moe_buf the MoE sublayer's (router logits, choices, an expert's rows). */
static __thread tm_buf stack_buf, moe_buf;

/* The k largest of v [n], best first (ties: the lower index first): ids [k]. */
static void top_k(const float *v, int n, int k, int *ids) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        ids[j] = best;
    }
}

/* A gated MLP over n rows: out [n, d] = down(act(gate(x)) * up(x)), x [n, d]; up [n, 2f]
 * and mid [n, f] scratch. */
static int gated_mlp(const tm_shape *s, const tm_weight *wu, const tm_weight *wd, const float *ub,
                     const float *db, int f, const float *x, int n, float *up, float *mid, float *out,
                     int nthreads, int act16) {
    int rc = tm_linear(wu, x, n, up, ub, nthreads, act16);
    if (rc != 1) return rc;
    for (int b = 0; b < n; b++) {
        const float *u = up + (size_t)b * 2 * f;
        gated_act(u, u + f, f, s, mid + (size_t)b * f);
    }
    return tm_linear(wd, mid, n, out, db, nthreads, act16);
}

/* The MoE MLP of Bd rows h [Bd, d] -> out [Bd, d], as layers/moe.py computes it: the router
 * picks each row's k experts; the rows are grouped by expert, so every active expert is
 * read once for all the rows that chose it (its job in tm_linear_jobs), and each row adds
 * only its own experts' outputs, in expert order. Returns 1, 0 on OOM, or tm_linear's
 * error code. */
static int moe_mlp(const tm_shape *s, const tm_moe *m, const float *h, int Bd, float *out, int nthreads,
                   int act16) {
    const int d = s->d, E = m->E, k = m->k, fw = m->fe > m->fs ? m->fe : m->fs, R = Bd * k;
    /* logits [Bd, E], weights [Bd, k], then per chosen (row, expert) pair, grouped by
     * expert: its weight rw [R], x [R, d], y [R, d], up [R, 2 fw], mid [R, fw]; then ids
     * [Bd, k] and the pairs' rows [R] (ints, last) */
    const size_t nf = (size_t)Bd * (E + k) + (size_t)R * (1 + 2 * d + 3 * fw);
    float *logits = tm_buf_get(&moe_buf, nf * sizeof(float) + (size_t)(Bd * k + R) * sizeof(int));
    if (!logits) return 0;
    float *wk = logits + (size_t)Bd * E, *rw = wk + (size_t)Bd * k, *x = rw + R;
    float *y = x + (size_t)R * d, *up = y + (size_t)R * d, *mid = up + (size_t)R * 2 * fw;
    int *ids = (int *)(mid + (size_t)R * fw), *rows = ids + (size_t)Bd * k;
    int rc;
    /* ---- route: each row's k experts and their weights (the experts' logits in
     * parallel: the router is E x d floats, as much as an expert's weights) ---- */
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && (size_t)Bd * E * d >= 65536)
    for (int i = 0; i < Bd * E; i++) {
        const int b = i / E, e = i % E;
        logits[i] = vf_dot(h + (size_t)b * d, m->router + (size_t)e * d, d) + (m->router_bias ? m->router_bias[e] : 0.f);
    }
    for (int b = 0; b < Bd; b++) {
        float *lg = logits + (size_t)b * E, *w = wk + (size_t)b * k;
        int *id = ids + (size_t)b * k;
        float mx = lg[0], sum = 0.f;
        for (int e = 1; e < E; e++) mx = lg[e] > mx ? lg[e] : mx;
        if (m->softmax_first) { /* softmax over E, the top k of it, renormalized or not */
            for (int e = 0; e < E; e++) sum += (lg[e] = expf(lg[e] - mx));
            for (int e = 0; e < E; e++) lg[e] /= sum;
            top_k(lg, E, k, id);
            float ws = 0.f;
            for (int j = 0; j < k; j++) ws += (w[j] = lg[id[j]]);
            if (m->norm_topk)
                for (int j = 0; j < k; j++) w[j] /= ws;
        } else { /* the top k logits, softmax over them */
            top_k(lg, E, k, id);
            const float top = lg[id[0]];
            for (int j = 0; j < k; j++) sum += (w[j] = expf(lg[id[j]] - top));
            for (int j = 0; j < k; j++) w[j] /= sum;
        }
    }
    memset(out, 0, (size_t)Bd * d * sizeof(float));
    /* ---- the active experts, in expert order, each over the rows that chose it: all
     * their up-projections in one tm_linear_jobs region, then all their down ones ---- */
    const tm_weight *wu[E], *wd[E];
    const float *xs[E], *ub[E], *db[E], *ms[E];
    float *ups[E], *ys[E];
    int n[E], at[E], na = 0, R0 = 0;
    for (int e = 0; e < E; e++) {
        int c = 0;
        for (int b = 0; b < Bd; b++)
            for (int j = 0; j < k; j++)
                if (ids[(size_t)b * k + j] == e) rows[R0 + c] = b, rw[R0 + c] = wk[(size_t)b * k + j], c++;
        if (!c) continue;
        /* every row chose it (always at one row): h itself, quantized once for all such
         * experts; else its rows gathered */
        xs[na] = c == Bd ? h : x + (size_t)R0 * d;
        for (int i = 0; i < c && c < Bd; i++)
            memcpy(x + (size_t)(R0 + i) * d, h + (size_t)rows[R0 + i] * d, d * sizeof(float));
        wu[na] = m->up[e], wd[na] = m->down[e];
        ub[na] = m->up_bias ? m->up_bias[e] : NULL, db[na] = m->down_bias ? m->down_bias[e] : NULL;
        ups[na] = up + (size_t)R0 * 2 * fw, ms[na] = mid + (size_t)R0 * fw, ys[na] = y + (size_t)R0 * d;
        n[na] = c, at[na] = R0, na++, R0 += c;
    }
    if ((rc = tm_linear_jobs(wu, xs, n, ups, ub, na, nthreads, act16)) != 1) return rc;
    for (int a = 0; a < na; a++)
        for (int i = 0; i < n[a]; i++) {
            const float *u = ups[a] + (size_t)i * 2 * m->fe;
            gated_act(u, u + m->fe, m->fe, s, (float *)ms[a] + (size_t)i * m->fe);
        }
    if ((rc = tm_linear_jobs(wd, ms, n, ys, db, na, nthreads, act16)) != 1) return rc;
    for (int a = 0; a < na; a++)
        for (int i = 0; i < n[a]; i++) {
            float *o = out + (size_t)rows[at[a] + i] * d;
            const float *yi = ys[a] + (size_t)i * d;
            const float g = rw[at[a] + i];
            for (int c = 0; c < d; c++) o[c] += yi[c] * g;
        }
    /* ---- the shared expert, gated per row (Qwen2-MoE), or not at all (Granite-MoE-shared:
     * no gate vector) ---- */
    if (m->shared_up) {
        if ((rc = gated_mlp(s, m->shared_up, m->shared_down, NULL, NULL, m->fs, h, Bd, up, mid, y,
                            nthreads, act16)) != 1)
            return rc;
        for (int b = 0; b < Bd; b++) {
            const float g = m->shared_gate
                                ? 1.f / (1.f + expf(-vf_dot(h + (size_t)b * d, m->shared_gate, d)))
                                : 1.f;
            float *o = out + (size_t)b * d;
            const float *yb = y + (size_t)b * d;
            for (int c = 0; c < d; c++) o[c] += g * yb[c];
        }
    }
    return 1;
}

/* Rows of one sequence in one step: a speculative verification runs a sequence's last
 * token and its k guesses as k + 1 consecutive decode rows (engine/model_runner.py), row
 * j attending over the cache up to its own position, the chunk's earlier rows included.
 * tm_decode_attention writes each row's k/v and reads the context in the same task, in
 * parallel over (row, K/V head) tasks: a row could read an earlier row's slot before
 * another thread has written it. So such rows go in waves: wave w holds the w-th row of
 * every chain (the plain decode rows of other sequences in wave 0), each wave one call
 * whose rows are independent, after the waves before it have written their k/v.
 *
 * Row b continues row b - 1's chain when its context's last slot but one (the previous
 * position) is the slot row b - 1 writes: a new slot belongs to one sequence, so no other
 * row's context holds it. depth [Bd]: each row's wave. Returns the number of waves. */
static int chain_depths(const tm_rows *r, int *depth) {
    int waves = 1;
    for (int b = 0; b < r->Bd; b++) {
        const int64_t n = r->ctx_lens[b];
        const int chained = b > 0 && n >= 2 && r->slots[(size_t)b * r->cmax + n - 2] == r->new_slots[b - 1];
        depth[b] = chained ? depth[b - 1] + 1 : 0;
        if (depth[b] + 1 > waves) waves = depth[b] + 1;
    }
    return waves;
}

/* tm_decode_attention's rows gathered for one wave (grow-only, per thread). */
static __thread tm_buf wave_buf;

/* Decode attention of Bd rows (qkv [Bd, qkvdim] -> out [Bd, qdim]) where some rows may
 * follow others of the same sequence (chain_depths): one call when none do, else one
 * call per wave on the wave's rows gathered (their positions, slots, context lengths
 * and qkv rows; cmax the wave's longest context, as a plain decode of those rows would
 * have), the outputs scattered back. depth [Bd] scratch. Returns tm_decode_attention's
 * status. */
static int chained_attention(const tm_shape *s, const tm_layer *L, const tm_rows *rows, const int *depth,
                             int waves, const float *qkv, float *out, int nthreads) {
    if (waves == 1) return tm_decode_attention(s, L, rows, qkv, out, nthreads);
    const int Bd = rows->Bd, cmax = rows->cmax;
    const int qkvdim = (s->H + 2 * s->Hkv) * s->hd, qdim = s->H * s->hd;
    /* int64: positions, new_slots, ctx_lens [Bd] each, slots [Bd, cmax]; then floats:
     * qkv [Bd, qkvdim], out [Bd, qdim]; then the rows' indices [Bd] */
    const size_t ni = (size_t)Bd * (3 + (size_t)cmax), nf = (size_t)Bd * (qkvdim + qdim);
    int64_t *pos = tm_buf_get(&wave_buf, ni * 8 + nf * 4 + (size_t)Bd * sizeof(int));
    if (!pos) return 0;
    int64_t *nsl = pos + Bd, *ctx = nsl + Bd, *sl = ctx + Bd;
    float *wq = (float *)(sl + (size_t)Bd * cmax), *wo = wq + (size_t)Bd * qkvdim;
    int *idx = (int *)(wo + (size_t)Bd * qdim);
    for (int w = 0; w < waves; w++) {
        int n = 0, wmax = 1;
        for (int b = 0; b < Bd; b++)
            if (depth[b] == w) {
                idx[n++] = b;
                if (rows->ctx_lens[b] > wmax) wmax = (int)rows->ctx_lens[b];
            }
        for (int i = 0; i < n; i++) {
            const int b = idx[i];
            pos[i] = rows->positions[b], nsl[i] = rows->new_slots[b], ctx[i] = rows->ctx_lens[b];
            memcpy(sl + (size_t)i * wmax, rows->slots + (size_t)b * cmax, (size_t)wmax * sizeof(int64_t));
            memcpy(wq + (size_t)i * qkvdim, qkv + (size_t)b * qkvdim, (size_t)qkvdim * sizeof(float));
        }
        const tm_rows wr = {pos, nsl, sl, ctx, n, wmax};
        const int rc = tm_decode_attention(s, L, &wr, wq, wo, nthreads);
        if (rc != 1) return rc;
        for (int i = 0; i < n; i++)
            memcpy(out + (size_t)idx[i] * qdim, wo + (size_t)i * qdim, (size_t)qdim * sizeof(float));
    }
    return 1;
}

/* x [Bd, d]: the embedded decode rows in (a verification's rows of one sequence among
 * them, consecutive: chained_attention), the final norm of the residual stream out.
 * Per layer, for the Bd rows together ([rmsnorm]: none where the family has no pre-norm):
 *     h = [rmsnorm](x); qkv = h Wqkv^T; attention over the paged cache (writes k/v);
 *     x += [post_norm](attn Wo^T); h = [rmsnorm](x); x += [post_norm](down(act(gate) * up))
 * Returns 1, 0 on OOM, or tm_linear's error code. */
int tm_decode_stack(const tm_stack *st, const tm_rows *rows, float *x, int nthreads) {
    const tm_shape *s = st->shape;
    const int Bd = rows->Bd, d = s->d, f = s->f, qdim = s->H * s->hd, qkvdim = (s->H + 2 * s->Hkv) * s->hd;
    const size_t need = (size_t)Bd * (d + qkvdim + qdim + d + 2 * f + f);
    float *h = tm_buf_get(&stack_buf, need * sizeof(float) + (size_t)Bd * sizeof(int));
    if (!h) return 0;
    float *qkv = h + (size_t)Bd * d, *att = qkv + (size_t)Bd * qkvdim;
    float *proj = att + (size_t)Bd * qdim, *up = proj + (size_t)Bd * d, *mid = up + (size_t)Bd * 2 * f;
    int *depth = (int *)(mid + (size_t)Bd * f); /* [Bd] each row's attention wave */
    const int waves = chain_depths(rows, depth);
    int rc;
#define TRY(call) \
    if ((rc = (call)) != 1) return rc
    for (int l = 0; l < s->n_layers; l++) {
        const tm_layer *L = st->layers + l;
        /* ---- attention sublayer ---- */
        norm_rows(x, Bd, d, L->attn_norm, s->eps, h);
        TRY(tm_linear(L->qkv, h, Bd, qkv, L->qkv_bias, nthreads, L->act16));
        TRY(chained_attention(s, L, rows, depth, waves, qkv, att, nthreads));
        TRY(tm_linear(L->o, att, Bd, proj, L->o_bias, nthreads, L->act16));
        if (st->allreduce) st->allreduce(proj, Bd * d, st->allreduce_ctx); /* sum over ranks */
        add_residual(x, proj, Bd, d, L->residual_scale, L->post_attn_norm, s->eps);
        /* ---- MLP sublayer ---- */
        norm_rows(x, Bd, d, L->mlp_norm, s->eps, h);
        if (L->moe) {
            TRY(moe_mlp(s, L->moe, h, Bd, proj, nthreads, L->act16));
        } else {
            TRY(gated_mlp(s, L->up, L->down, L->up_bias, L->down_bias, f, h, Bd, up, mid, proj, nthreads,
                          L->act16));
        }
        if (st->allreduce) st->allreduce(proj, Bd * d, st->allreduce_ctx);
        add_residual(x, proj, Bd, d, L->residual_scale, L->post_mlp_norm, s->eps);
    }
#undef TRY
    if (st->final_norm) norm_rows(x, Bd, d, st->final_norm, s->eps, x); /* NULL: a pipeline stage */
    return 1;
}

