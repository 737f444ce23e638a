/* mla.c: Multi-head Latent Attention over the latent cache, in two forms that agree in exact
 * arithmetic (tests hold them to each other):
 *   reconstructed  per head, expand k_nope = W_UK c and v = W_UV c for the cached keys, then
 *                  ordinary attention. Cheap per key; pays one expansion per key and window.
 *   absorbed       q~ = W_UK^T q_nope (512 wide); score = q~ . c_t + q_pe . k_pe_t; attend over
 *                  latents and apply W_UV once. Cheap per window; the form for one-token rows.
 * Both attend over the selected keys of each row (sel, ascending), scale 1/sqrt(qk_head_dim).
 * Input q is [T][NH][nope + rope] with RoPE applied; the current rows' c / k_pe are already in
 * the cache. Output: [T][NH * v_head_dim]. */
#include <math.h>
#include <string.h>

#include "base/err.h"
#include "kernels/kernels.h"
#include "model/engine.h"
#include "model/ops.h"

/* y[n][W.cols] = x[n][W.rows] . W  (the transposed product), reading each weight row once. */
static void matmul_t(const pt_wview *W, const float *x, int n, float *y, float *rowbuf) {
    memset(y, 0, sizeof(float) * (size_t)n * (size_t)W->cols);
    for (int64_t r = 0; r < W->rows; r++) {
        pt_dequant_row(W, r, rowbuf);
        for (int i = 0; i < n; i++) op_axpy(y + (size_t)i * W->cols, x[(size_t)i * W->rows + r], rowbuf, (int)W->cols);
    }
}

static int use_absorbed(const petrel_session *s, int T, int N) {
    if (s->mla == MLA_ABSORBED) return 1;
    if (s->mla == MLA_RECONSTRUCTED) return 0;
    /* Reconstruction costs one expansion per cached key; it wins when the window is a large
     * share of the keys (prefill), absorption otherwise (decode, short verify windows). */
    return T == 1 || N > 6 * T;
}

int mla_attention(petrel_session *s, int l, const layer_w *lw, const float *x, const float *qr, const float *q,
                  int T, const int32_t *sel, const int *sel_n, int sel_stride, float *out, petrel_error *err) {
    (void)x;
    (void)qr;
    const petrel_config *c = &s->eng->cfg;
    int NH = c->num_attention_heads, Dn = c->qk_nope_head_dim, Dr = c->qk_rope_head_dim, Dv = c->v_head_dim;
    int Rkv = c->kv_lora_rank, Dqk = c->qk_head_dim;
    int N = s->len + T;
    const float scale = (float)(1.0 / sqrt((double)Dqk));
    const float *cc = s->kv_c[l], *pe = s->kv_pe[l];
    size_t mark = s->ar.used;
    int maxsel = 0;
    for (int r = 0; r < T; r++) if (sel_n[r] > maxsel) maxsel = sel_n[r];
    float *p = ar_alloc(&s->ar, sizeof(float) * (size_t)(maxsel > 0 ? maxsel : 1));
    float *oh = ar_alloc(&s->ar, sizeof(float) * (size_t)T * Dv);
    if (!p || !oh) return pt_err(err, PETREL_ENOMEM, "attention scratch exhausted (layer %d)", l);
    if (use_absorbed(s, T, N)) {
        float *qn = ar_alloc(&s->ar, sizeof(float) * (size_t)T * Dn);
        float *qt = ar_alloc(&s->ar, sizeof(float) * (size_t)T * Rkv);
        float *lat = ar_alloc(&s->ar, sizeof(float) * (size_t)T * Rkv);
        float *rowbuf = ar_alloc(&s->ar, sizeof(float) * (size_t)Rkv);
        if (!qn || !qt || !lat || !rowbuf) return pt_err(err, PETREL_ENOMEM, "attention scratch exhausted (layer %d)", l);
        for (int h = 0; h < NH; h++) {
            for (int r = 0; r < T; r++) memcpy(qn + (size_t)r * Dn, q + ((size_t)r * NH + h) * Dqk, sizeof(float) * (size_t)Dn);
            matmul_t(&lw->w_uk[h], qn, T, qt, rowbuf);
            for (int r = 0; r < T; r++) {
                const float *qpe = q + ((size_t)r * NH + h) * Dqk + Dn, *qtr = qt + (size_t)r * Rkv;
                const int32_t *sr = sel + (size_t)r * sel_stride;
                int n = sel_n[r];
                for (int i = 0; i < n; i++) {
                    int t = sr[i];
                    p[i] = scale * (op_dot(qtr, cc + (size_t)t * Rkv, Rkv) + op_dot(qpe, pe + (size_t)t * Dr, Dr));
                }
                op_softmax(p, n);
                float *lr = lat + (size_t)r * Rkv;
                memset(lr, 0, sizeof(float) * (size_t)Rkv);
                for (int i = 0; i < n; i++) op_axpy(lr, p[i], cc + (size_t)sr[i] * Rkv, Rkv);
            }
            kn_matmul(&lw->w_uv[h], lat, T, oh);
            for (int r = 0; r < T; r++) memcpy(out + ((size_t)r * NH + h) * Dv, oh + (size_t)r * Dv, sizeof(float) * (size_t)Dv);
        }
    } else {
        float *kh = ar_alloc(&s->ar, sizeof(float) * (size_t)N * Dn);
        float *vh = ar_alloc(&s->ar, sizeof(float) * (size_t)N * Dv);
        if (!kh || !vh) return pt_err(err, PETREL_ENOMEM, "attention scratch exhausted (layer %d)", l);
        for (int h = 0; h < NH; h++) {
            kn_matmul(&lw->w_uk[h], cc, N, kh);
            kn_matmul(&lw->w_uv[h], cc, N, vh);
            for (int r = 0; r < T; r++) {
                const float *qh = q + ((size_t)r * NH + h) * Dqk;
                const int32_t *sr = sel + (size_t)r * sel_stride;
                int n = sel_n[r];
                for (int i = 0; i < n; i++) {
                    int t = sr[i];
                    p[i] = scale * (op_dot(qh, kh + (size_t)t * Dn, Dn) + op_dot(qh + Dn, pe + (size_t)t * Dr, Dr));
                }
                op_softmax(p, n);
                float *o = out + ((size_t)r * NH + h) * Dv;
                memset(o, 0, sizeof(float) * (size_t)Dv);
                for (int i = 0; i < n; i++) op_axpy(o, p[i], vh + (size_t)sr[i] * Dv, Dv);
            }
        }
    }
    s->ar.used = mark;
    return 0;
}
