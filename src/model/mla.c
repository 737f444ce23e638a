/* mla.c: Multi-head Latent Attention over the latent cache, in two forms that agree in exact
 * arithmetic (tests hold them to each other):
 *   reconstructed  per head, expand k_nope = W_UK c and v = W_UV c for the cached keys, then
 *                  ordinary attention. Cheap per key; pays one expansion per key and window.
 *   absorbed       q~ = W_UK^T q_nope (kv_lora_rank wide); score = q~ . c_t + q_pe . k_pe_t;
 *                  attend over latents and apply W_UV once. The form for one-token rows.
 * Both attend over the selected keys of each row (sel, ascending), scale 1/sqrt(qk_head_dim).
 * Heads run in parallel on the kernel pool; each head's work is done by one thread in a fixed
 * order, so results do not depend on thread count or batch composition.
 * Input q is [T][NH][nope + rope] with RoPE applied; the current rows' c / k_pe are already in
 * the cache. Output: [T][NH * v_head_dim]. */
#include <math.h>
#include <string.h>

#include "base/err.h"
#include "base/pool.h"
#include "kernels/kernels.h"
#include "model/engine.h"

/* y[n][W.cols] = x[n][W.rows] . W  (the transposed product), reading each weight row once. */
static void matmul_t(const pt_wview *W, const float *x, int n, float *y, float *rowbuf) {
    memset(y, 0, sizeof(float) * (size_t)n * (size_t)W->cols);
    for (int64_t r = 0; r < W->rows; r++) {
        pt_dequant_row(W, r, rowbuf);
        for (int i = 0; i < n; i++) kn_axpy(y + (size_t)i * W->cols, x[(size_t)i * W->rows + r], rowbuf, W->cols);
    }
}

static int use_absorbed(const petrel_session *s, int T, int N) {
    if (s->mla == MLA_ABSORBED) return 1;
    if (s->mla == MLA_RECONSTRUCTED) return 0;
    /* Reconstruction costs one expansion per cached key; it wins when the window is a large
     * share of the keys (prefill), absorption otherwise (decode, short verify windows). */
    return T == 1 || N > 6 * T;
}

typedef struct {
    const petrel_config *c;
    const layer_w *lw;
    const float *q, *cc, *pe;
    const int32_t *sel;
    const int *sel_n;
    int sel_stride, T, N, absorbed;
    float scale;
    float *out;
    uint8_t *scratch;       /* per-thread slices of scratch_per bytes */
    size_t scratch_per;
} mla_job;

static void head_task(void *ctx, int h, int thread) {
    const mla_job *j = ctx;
    const petrel_config *c = j->c;
    int NH = c->num_attention_heads, Dn = c->qk_nope_head_dim, Dr = c->qk_rope_head_dim, Dv = c->v_head_dim;
    int Rkv = c->kv_lora_rank, Dqk = c->qk_head_dim, T = j->T;
    float *p = (float *)(j->scratch + (size_t)thread * j->scratch_per);
    float *oh = p + (j->N + 15) / 16 * 16;
    float *rest = oh + ((size_t)T * Dv + 15) / 16 * 16;
    if (j->absorbed) {
        float *qn = rest, *qt = qn + (size_t)T * Dn, *lat = qt + (size_t)T * Rkv, *rowbuf = lat + (size_t)T * Rkv;
        for (int r = 0; r < T; r++) memcpy(qn + (size_t)r * Dn, j->q + ((size_t)r * NH + h) * Dqk, sizeof(float) * (size_t)Dn);
        matmul_t(&j->lw->w_uk[h], qn, T, qt, rowbuf);
        for (int r = 0; r < T; r++) {
            const float *qpe = j->q + ((size_t)r * NH + h) * Dqk + Dn, *qtr = qt + (size_t)r * Rkv;
            const int32_t *sr = j->sel + (size_t)r * j->sel_stride;
            int n = j->sel_n[r];
            for (int i = 0; i < n; i++) {
                int t = sr[i];
                p[i] = j->scale * (kn_dot(qtr, j->cc + (size_t)t * Rkv, Rkv) + kn_dot(qpe, j->pe + (size_t)t * Dr, Dr));
            }
            kn_softmax(p, n);
            float *lr = lat + (size_t)r * Rkv;
            memset(lr, 0, sizeof(float) * (size_t)Rkv);
            for (int i = 0; i < n; i++) kn_axpy(lr, p[i], j->cc + (size_t)sr[i] * Rkv, Rkv);
        }
        kn_matmul(&j->lw->w_uv[h], lat, T, oh);
    } else {
        float *kh = rest, *vh = kh + (size_t)j->N * Dn;
        kn_matmul(&j->lw->w_uk[h], j->cc, j->N, kh);
        kn_matmul(&j->lw->w_uv[h], j->cc, j->N, vh);
        for (int r = 0; r < T; r++) {
            const float *qh = j->q + ((size_t)r * NH + h) * Dqk;
            const int32_t *sr = j->sel + (size_t)r * j->sel_stride;
            int n = j->sel_n[r];
            for (int i = 0; i < n; i++) {
                int t = sr[i];
                p[i] = j->scale * (kn_dot(qh, kh + (size_t)t * Dn, Dn) + kn_dot(qh + Dn, j->pe + (size_t)t * Dr, Dr));
            }
            kn_softmax(p, n);
            float *o = oh + (size_t)r * Dv;
            memset(o, 0, sizeof(float) * (size_t)Dv);
            for (int i = 0; i < n; i++) kn_axpy(o, p[i], vh + (size_t)sr[i] * Dv, Dv);
        }
    }
    for (int r = 0; r < T; r++) memcpy(j->out + ((size_t)r * NH + h) * Dv, oh + (size_t)r * Dv, sizeof(float) * (size_t)Dv);
}

size_t mla_scratch_bytes(const petrel_config *c, int T, int N, int n_threads) {
    size_t Dn = c->qk_nope_head_dim, Dv = c->v_head_dim, Rkv = c->kv_lora_rank;
    size_t abs_ = (size_t)T * Dn + 2 * (size_t)T * Rkv + Rkv, rec = (size_t)N * (Dn + Dv);
    size_t per = ((size_t)N + 16) + ((size_t)T * Dv + 16) + (abs_ > rec ? abs_ : rec);
    return (per * 4 + 64) * (size_t)n_threads + 64;
}

int mla_attention(petrel_session *s, int l, const layer_w *lw, const float *q, int T, const int32_t *sel, const int *sel_n,
                  int sel_stride, float *out, petrel_error *err) {
    const petrel_config *c = &s->eng->cfg;
    int N = s->len + T, nt = kn_threads();
    mla_job j = {c, lw, q, s->kv_c[l], s->kv_pe[l], sel, sel_n, sel_stride, T, N, use_absorbed(s, T, N),
                 (float)(1.0 / sqrt((double)c->qk_head_dim)), out, NULL, 0};
    size_t total = mla_scratch_bytes(c, T, N, nt);
    j.scratch_per = ((total - 64) / (size_t)nt) & ~(size_t)63;
    size_t mark = s->ar.used;
    j.scratch = ar_alloc(&s->ar, total);
    if (!j.scratch) return pt_err(err, PETREL_ENOMEM, "attention scratch exhausted (layer %d)", l);
    pool_run(kn_pool(), c->num_attention_heads, head_task, &j);
    s->ar.used = mark;
    return 0;
}
