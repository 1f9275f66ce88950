/* The decode step of every layer in one call (tm_decode_stack): per layer, RMSNorm, the
 * fused QKV projection, decode attention (attention.c), the output projection, the
 * residual adds (with Gemma's sandwich norms), the gated MLP. The linear layers are
 * tm_linear (linear.c) on packed or 16-bit float weights. */
#include "tm.h"

/* out [f] = act(g [f]) * u [f]; act(x) = x * sigmoid(x) (SiLU) or the tanh-GELU
 * 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), both through exp(-|.|) <= 1. */
static void gated_act(const float *g, const float *u, int f, int act, float *out) {
    int i = 0;
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
static void add_residual(float *x, float *h, int Bd, int d, const tm_layer *L, const float *post_norm,
                         float eps) {
    if (post_norm) norm_rows(h, Bd, d, post_norm, eps, h);
    const float s = L->residual_scale;
    if (s == 1.f)
        for (size_t i = 0; i < (size_t)Bd * d; i++) x[i] += h[i];
    else
        for (size_t i = 0; i < (size_t)Bd * d; i++) x[i] += s * h[i];
}

/* tm_decode_stack's activations (h, qkv, att, proj, up, mid), one grow-only tm_buf per
 * thread, separate from tm_scratch: the kernels it calls use tm_scratch on this thread. */
static __thread tm_buf stack_buf;

/* x [Bd, d]: the embedded decode rows in, the final norm of the residual stream out.
 * Per layer, for the Bd rows together ([rmsnorm]: none where the family has no pre-norm):
 *     h = [rmsnorm](x); qkv = h Wqkv^T; attention over the paged cache (writes k/v);
 *     x += [post_norm](attn Wo^T); h = [rmsnorm](x); x += [post_norm](down(act(gate) * up))
 * Returns 1, 0 on OOM, or tm_linear's error code. */
int tm_decode_stack(const tm_stack *st, const tm_rows *rows, float *x, int nthreads) {
    const tm_shape *s = st->shape;
    const int Bd = rows->Bd, d = s->d, f = s->f, qdim = s->H * s->hd, qkvdim = (s->H + 2 * s->Hkv) * s->hd;
    const size_t need = (size_t)Bd * (d + qkvdim + qdim + d + 2 * f + f);
    float *h = tm_buf_get(&stack_buf, need * sizeof(float));
    if (!h) return 0;
    float *qkv = h + (size_t)Bd * d, *att = qkv + (size_t)Bd * qkvdim;
    float *proj = att + (size_t)Bd * qdim, *up = proj + (size_t)Bd * d, *mid = up + (size_t)Bd * 2 * f;
    int rc;
#define TRY(call) \
    if ((rc = (call)) != 1) return rc
    for (int l = 0; l < s->n_layers; l++) {
        const tm_layer *L = st->layers + l;
        /* ---- attention sublayer ---- */
        norm_rows(x, Bd, d, L->attn_norm, s->eps, h);
        TRY(tm_linear(L->qkv, h, Bd, qkv, L->qkv_bias, nthreads, L->act16));
        TRY(tm_decode_attention(s, L, rows, qkv, att, nthreads));
        TRY(tm_linear(L->o, att, Bd, proj, L->o_bias, nthreads, L->act16));
        if (st->allreduce) st->allreduce(proj, Bd * d, st->allreduce_ctx); /* sum over ranks */
        add_residual(x, proj, Bd, d, L, L->post_attn_norm, s->eps);
        /* ---- MLP sublayer ---- */
        norm_rows(x, Bd, d, L->mlp_norm, s->eps, h);
        TRY(tm_linear(L->up, h, Bd, up, L->up_bias, nthreads, L->act16));
        for (int b = 0; b < Bd; b++) {
            const float *ub = up + (size_t)b * 2 * f;
            gated_act(ub, ub + f, f, s->act, mid + (size_t)b * f);
        }
        TRY(tm_linear(L->down, mid, Bd, proj, L->down_bias, nthreads, L->act16));
        if (st->allreduce) st->allreduce(proj, Bd * d, st->allreduce_ctx);
        add_residual(x, proj, Bd, d, L, L->post_mlp_norm, s->eps);
    }
#undef TRY
    if (st->final_norm) norm_rows(x, Bd, d, st->final_norm, s->eps, x); /* NULL: a pipeline stage */
    return 1;
}

