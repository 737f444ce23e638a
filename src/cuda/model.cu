/* model.cu: the CUDA backend's host side (cu.h): the weights uploaded to HBM in their stored
 * formats, the sessions' latent caches, and the forward's schedule of kernels on one stream.
 *
 * The schedule is src/model/forward.c's layer loop, step for step (same operations, same
 * order, same row semantics), with every row's cache given by its segment; a forward of more
 * rows than m->rows runs in chunks of whole segments' pieces, one after another, so a later
 * piece sees the keys an earlier one wrote. Products take the GEMV form for up to 8 rows (and
 * for routed experts while a chunk's choices are at most 64), the tiled GEMM form above. */
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "experts/xs.h"
#include "model/ops.h"
#include "quant/quant.h"
}
#include "cuda/cu_model.h"

static const char *const prof_names[PROF_PARTS] = {"embed", "attention projections + norms", "indexer + top-k", "head products (W_UK, W_UV)",
                                                   "attention core (scores, softmax, P C)", "o_proj + residual + norm", "dense mlp",
                                                   "router", "routed experts: gate, up", "routed experts: down", "routed experts: combine",
                                                   "shared expert + residual + norm", "lm_head", "copies"};
/* one piece of a segment: rows [r0, r0 + n) of the call at positions pos0.. of kv */
typedef struct piece {
    const cu_seg *s;
    int r0, pos0, n;
} piece;

int cu_fail(petrel_error *err, cudaError_t rc, const char *what) {
    return pt_err(err, rc == cudaErrorMemoryAllocation ? PETREL_ENOMEM : PETREL_EIO, "cuda: %s: %s", what, cudaGetErrorString(rc));
}

void *dalloc(cu_model *m, size_t bytes, const char *what, petrel_error *err) {
    if (bytes == 0) bytes = 16;
    if (m->budget && m->used + bytes > m->budget) {
        pt_err(err, PETREL_ENOMEM, "cuda: %s (%.2f GB) does not fit the VRAM budget: %.2f of %.2f GB taken", what, bytes / 1e9, m->used / 1e9,
               m->budget / 1e9);
        return NULL;
    }
    void *p = NULL;
    cudaError_t rc = cudaMalloc(&p, bytes);
    if (rc != cudaSuccess) {
        cudaGetLastError();
        pt_err(err, PETREL_ENOMEM, "cuda: %s (%.2f GB): %s", what, bytes / 1e9, cudaGetErrorString(rc));
        return NULL;
    }
    if (m->n_allocs == m->cap_allocs) {
        int nc = m->cap_allocs ? 2 * m->cap_allocs : 256;
        void **na = (void **)realloc(m->allocs, sizeof(void *) * nc);
        if (!na) {
            cudaFree(p);
            pt_err(err, PETREL_ENOMEM, "out of memory");
            return NULL;
        }
        m->allocs = na, m->cap_allocs = nc;
    }
    m->allocs[m->n_allocs++] = p;
    m->used += bytes;
    return p;
}

/* A host-to-device copy that has landed when it returns: cudaMemcpy from pageable memory may
 * return once the bytes are staged, before the DMA into the device finishes, and the backend's
 * kernels run on a non-blocking stream that does not wait for the legacy stream's copies (a
 * test failed once in a way a half-uploaded input explains). */
static cudaError_t h2d(void *dst, const void *src, size_t bytes) {
    cudaError_t rc = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
    return rc == cudaSuccess ? cudaStreamSynchronize(0) : rc;
}

static int up_copy(void *dst, const void *src, size_t bytes, petrel_error *err) {
    cudaError_t rc = h2d(dst, src, bytes);
    return rc == cudaSuccess ? 0 : cu_fail(err, rc, "upload");
}

static int up_vec(cu_model *m, const float *v, int64_t n, float **out, petrel_error *err) {
    *out = NULL;
    if (!v) return 0;
    if (!(*out = (float *)dalloc(m, sizeof(float) * n, "a norm vector", err))) return PETREL_ENOMEM;
    m->wbytes += sizeof(float) * n;
    return up_copy(*out, v, sizeof(float) * n, err);
}

static int w_supported(const pt_wview *W, const char *name, petrel_error *err) {
    if (W->layout != PT_LAYOUT_PLAIN && !(W->layout == PT_LAYOUT_R16 && (W->qtype == PT_Q8_G32 || W->qtype == PT_Q4_G64)))
        return pt_err(err, PETREL_EUNSUPPORTED, "cuda: %s has a layout the GPU does not read", name);
    switch (W->qtype) {
    case PT_F32: case PT_BF16: case PT_F16: case PT_Q8_ROW: case PT_Q8_G32: case PT_Q4_G64: case PT_FP8_E4M3: return 0;
    default:
        return pt_err(err, PETREL_EUNSUPPORTED, "cuda: %s is %s, which the GPU path does not read yet (convert the model to a pack: petrel convert)",
                      name, pt_qtype_name(W->qtype));
    }
}

/* FP8 with block scales: expanded to f32 at upload (exact; 4 bytes a weight) */
static int up_fp8(cu_model *m, const pt_wview *Ws, int E, const char *name, dw *out, petrel_error *err) {
    const pt_wview *W = &Ws[0];
    out->qt = PT_F32, out->rows = W->rows, out->cols = W->cols, out->rb = W->cols * 4;
    size_t db = (size_t)W->rows * W->cols * 4;
    out->estride = (int64_t)db;
    uint8_t *d = (uint8_t *)dalloc(m, db * E, name, err);
    float *h = d ? (float *)malloc(db) : NULL;
    if (!d) return PETREL_ENOMEM;
    if (!h) return pt_err(err, PETREL_ENOMEM, "out of memory");
    int rc = 0;
    for (int e = 0; e < E && !rc; e++) {
        for (int64_t r = 0; r < W->rows; r++) pt_dequant_row(&Ws[e], r, h + r * W->cols);
        rc = up_copy(d + db * e, h, db, err);
    }
    free(h);
    out->d = d;
    m->wbytes += db * E;
    return rc;
}

/* views of one format and width, stacked into one allocation: as experts (rows_stack 0: one
 * shape, E = n; n = 1 a plain weight) or by rows (rows_stack 1: the products of one x, one
 * after another, out[i] each one's view and *all the whole stack). The stored bytes go over
 * PCIe as they are, in pieces of whole 16-row blocks, and a kernel turns them into the plain
 * layout with f32 scales (cuk_unpack, as the expert tiers do): the host only copies. */
/* the first of the views that cannot share one allocation with the others (format, width,
 * layout, scales; as experts also the rows; by rows a row-interleaved one of rows not whole
 * 16-row blocks), or -1 */
static int views_differ(const pt_wview *const *Vs, int n, int rows_stack) {
    const pt_wview *W = Vs[0];
    for (int e = 0; e < n; e++) {
        const pt_wview *V = Vs[e];
        if (V->qtype != W->qtype || V->cols != W->cols || V->row_bytes != W->row_bytes || V->layout != W->layout || !V->scale != !W->scale ||
            (V->scale && V->scale_dtype != W->scale_dtype) || V->scale_cols != W->scale_cols || (!rows_stack && V->rows != W->rows) ||
            (rows_stack && V->layout == PT_LAYOUT_R16 && V->rows % 16))
            return e;
    }
    return -1;
}

static int up_views(cu_model *m, const pt_wview *const *Vs, int n, int rows_stack, const char *name, dw *out, dw *all, petrel_error *err) {
    const pt_wview *W = Vs[0];
    PT_TRY(w_supported(W, name, err));
    int bad = views_differ(Vs, n, rows_stack);
    if (bad >= 0)
        return pt_err(err, PETREL_EUNSUPPORTED, "cuda: %s: %s %d differs in format or shape from the first (or is row-interleaved with rows not whole 16-row blocks)",
                      name, rows_stack ? "part" : "expert", bad);
    int64_t rows = 0, maxrows = 0;
    for (int e = 0; e < n; e++) rows += Vs[e]->rows, maxrows = Vs[e]->rows > maxrows ? Vs[e]->rows : maxrows;
    dw D = dw{};
    D.qt = W->qtype, D.cols = W->cols, D.rb = W->row_bytes;
    D.g = (int)pt_qtype_group(W->qtype, W->cols);
    D.sc = pt_qtype_scales_per_row(W->qtype, W->cols);
    D.rows = rows_stack ? rows : W->rows;
    size_t db = (size_t)rows * W->row_bytes, sn = (size_t)rows * D.sc; /* all of it */
    D.estride = rows_stack ? 0 : (int64_t)W->rows * W->row_bytes, D.sstride = rows_stack ? 0 : (int64_t)W->rows * D.sc;
    uint8_t *d = (uint8_t *)dalloc(m, db, name, err);
    if (!d) return PETREL_ENOMEM;
    float *s = NULL;
    if (sn && !(s = (float *)dalloc(m, sizeof(float) * sn, name, err))) return PETREL_ENOMEM;
    D.d = d, D.s = s;
    const int r16 = W->layout == PT_LAYOUT_R16;
    const size_t srow = sn ? (size_t)W->scale_cols * pt_scale_dtype_bytes(W->scale_dtype) : 0; /* stored scale bytes a row */
    /* a piece: whole 16-row blocks, about 64 MB of stored bytes */
    int64_t prow = (int64_t)((64u << 20) / (W->row_bytes + srow + 1));
    prow = prow < 16 ? 16 : prow / 16 * 16;
    if (prow > maxrows) prow = maxrows;
    uint8_t *raw = NULL; /* a piece's stored data (r16) and scales, on the device */
    size_t rawd = r16 ? (size_t)prow * W->row_bytes : 0, raws = (size_t)prow * srow;
    cudaError_t ce = rawd + raws ? cudaMalloc(&raw, rawd + raws) : cudaSuccess;
    if (ce != cudaSuccess) {
        cudaGetLastError();
        return cu_fail(err, ce, "upload staging");
    }
    int rc = 0;
    int64_t row0 = 0; /* the view's first row in the allocation */
    for (int e = 0; e < n && !rc; e++) {
        const pt_wview *V = Vs[e];
        if (rows_stack) {
            out[e] = D;
            out[e].rows = V->rows, out[e].d = d + (size_t)row0 * W->row_bytes, out[e].s = s ? s + (size_t)row0 * D.sc : NULL;
        }
        for (int64_t r0 = 0; r0 < V->rows && !rc; r0 += prow) {
            int64_t k = V->rows - r0 < prow ? V->rows - r0 : prow;
            uint8_t *dd = d + (size_t)(row0 + r0) * W->row_bytes;
            rc = up_copy(r16 ? raw : dd, V->data + (size_t)r0 * W->row_bytes, (size_t)k * W->row_bytes, err);
            if (!rc && sn) rc = up_copy(raw + rawd, (const uint8_t *)V->scale + (size_t)r0 * srow, (size_t)k * srow, err);
            if (rc) break;
            cuk_unpack(m->st, D.qt, r16, r16 ? raw : NULL, sn ? raw + rawd : NULL, V->scale_dtype, k, W->row_bytes, W->scale_cols, D.sc, dd,
                       sn ? s + (size_t)(row0 + r0) * D.sc : NULL);
            ce = cudaStreamSynchronize(m->st); /* the staging is reused by the next piece */
            if (ce != cudaSuccess) rc = cu_fail(err, ce, "upload");
        }
        row0 += V->rows;
    }
    if (raw) cudaFree(raw);
    if (!rows_stack) *out = D;
    if (all) *all = D;
    m->wbytes += db + sizeof(float) * sn;
    return rc;
}

/* E views of one shape stacked into one allocation (E = 1: a plain weight) */
static int up_stack(cu_model *m, const pt_wview *Ws, int E, const char *name, dw *out, petrel_error *err) {
    memset(out, 0, sizeof *out);
    PT_TRY(w_supported(&Ws[0], name, err));
    for (int e = 1; e < E; e++)
        if (Ws[e].qtype != Ws[0].qtype || Ws[e].rows != Ws[0].rows || Ws[e].cols != Ws[0].cols || Ws[e].row_bytes != Ws[0].row_bytes)
            return pt_err(err, PETREL_EUNSUPPORTED, "cuda: %s: expert %d differs in format or shape from expert 0", name, e);
    if (Ws[0].qtype == PT_FP8_E4M3) return up_fp8(m, Ws, E, name, out, err);
    const pt_wview **vs = (const pt_wview **)malloc(sizeof *vs * (size_t)E);
    if (!vs) return pt_err(err, PETREL_ENOMEM, "out of memory");
    for (int e = 0; e < E; e++) vs[e] = &Ws[e];
    int rc = up_views(m, vs, E, 0, name, out, NULL, err);
    free(vs);
    return rc;
}
static int up_w(cu_model *m, const pt_wview *W, const char *name, dw *out, petrel_error *err) { return up_stack(m, W, 1, name, out, err); }

extern "C" int cu_built(void) { return 1; }

extern "C" int cu_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

/* n weights that read one x: stacked by rows (st) where all take the int8 GEMV in one format
 * and one column-part count (so a row's product over a prefix of the stack has each weight's
 * own bits), else each uploaded alone (st->n 0) */
static int up_products(cu_model *m, const pt_wview *const *vs, dw *const *out, int n, int l, const char *what, cu_stack *st, petrel_error *err) {
    char nm[128];
    memset(st, 0, sizeof *st);
    if (n < 2 || (vs[0]->qtype != PT_Q8_G32 && vs[0]->qtype != PT_Q4_G64) || views_differ(vs, n, 1) >= 0) {
        for (int i = 0; i < n; i++) {
            snprintf(nm, sizeof nm, "layer %d %s part %d", l, what, i);
            PT_TRY(up_w(m, vs[i], nm, out[i], err));
        }
        return 0;
    }
    dw v[4];
    snprintf(nm, sizeof nm, "layer %d %s", l, what);
    PT_TRY(up_views(m, vs, n, 1, nm, v, &st->all, err));
    int64_t end = 0, kp = -1;
    for (int i = 0; i < n; i++) *out[i] = v[i], end += v[i].rows, st->end[i] = end;
    st->n = n;
    for (int i = 0; i < n && st->n; i++) { /* every member's and every prefix's parts alike */
        dw p = st->all;
        p.rows = st->end[i];
        int a = cuk_gemv_q_parts(v[i]), b = cuk_gemv_q_parts(p);
        if (kp < 0) kp = a;
        if (a != kp || b != kp) st->n = 0;
    }
    return 0;
}

static int up_layer(cu_model *m, const layer_w *lw, int l, cu_layer *G, petrel_error *err) {
    const petrel_config *c = m->c;
    char nm[96];
#define UPW(field, src) (snprintf(nm, sizeof nm, "layer %d %s", l, #src), up_w(m, &lw->src, nm, &G->field, err))
    PT_TRY(up_vec(m, lw->input_layernorm, c->hidden_size, &G->in_norm, err));
    PT_TRY(up_vec(m, lw->post_attention_layernorm, c->hidden_size, &G->post_norm, err));
    PT_TRY(up_vec(m, lw->q_a_layernorm, c->q_lora_rank, &G->q_a_norm, err));
    PT_TRY(up_vec(m, lw->kv_a_layernorm, c->kv_lora_rank, &G->kv_a_norm, err));
    G->has_idx = lw->has_indexer;
    { /* the products of x, and those of the normed q_a, each stacked by rows where they share a
       * format (one GEMV for one row over the layer's prefix of them: stack_gemv) */
        const pt_wview *xs[4] = {&lw->q_a_proj, &lw->kv_a_proj_with_mqa, &lw->idx_wk, &lw->idx_weights_proj};
        dw *xo[4] = {&G->q_a, &G->kv_a, &G->ik, &G->iwp};
        const pt_wview *qs[2] = {&lw->q_b_proj, &lw->idx_wq_b};
        dw *qo[2] = {&G->q_b, &G->iq};
        PT_TRY(up_products(m, xs, xo, G->has_idx ? 4 : 2, l, "q_a, kv_a (and the indexer's wk, weights_proj)", &G->on_x, err));
        PT_TRY(up_products(m, qs, qo, G->has_idx ? 2 : 1, l, "q_b (and the indexer's wq_b)", &G->on_qa, err));
    }
    PT_TRY(UPW(kv_b, kv_b_proj));
    G->uk_t = dw{};
    if (!cuk_mla_uk_direct(G->kv_b, c->kv_lora_rank, c->qk_nope_head_dim)) { /* W_UK^T of every head in f32 (exact): q~ = W_UK^T q_nope as a plain product */
        int NH = c->num_attention_heads, Dn = c->qk_nope_head_dim, Dv = c->v_head_dim, R = c->kv_lora_rank;
        size_t per = (size_t)R * Dn;
        float *ht = (float *)malloc(sizeof(float) * per * NH), *row = (float *)malloc(sizeof(float) * R);
        float *dt = ht && row ? (float *)dalloc(m, sizeof(float) * per * NH, "W_UK^T", err) : NULL;
        int rc = 0;
        if (!ht || !row) rc = pt_err(err, PETREL_ENOMEM, "out of memory");
        else if (!dt) rc = PETREL_ENOMEM;
        for (int h = 0; h < NH && !rc; h++)
            for (int d = 0; d < Dn; d++) {
                pt_dequant_row(&lw->kv_b_proj, (int64_t)h * (Dn + Dv) + d, row);
                for (int cc = 0; cc < R; cc++) ht[h * per + (size_t)cc * Dn + d] = row[cc];
            }
        if (!rc) rc = up_copy(dt, ht, sizeof(float) * per * NH, err);
        free(ht), free(row);
        if (rc) return rc;
        G->uk_t.qt = PT_F32, G->uk_t.rows = R, G->uk_t.cols = Dn, G->uk_t.rb = (int64_t)Dn * 4, G->uk_t.d = (const uint8_t *)dt;
        G->uk_t.estride = (int64_t)(per * 4);
        m->wbytes += per * NH * 4;
    }
    PT_TRY(UPW(o, o_proj));
    if (lw->has_indexer) {
        PT_TRY(up_vec(m, lw->idx_k_norm_w, c->index_head_dim, &G->ik_w, err));
        PT_TRY(up_vec(m, lw->idx_k_norm_b, c->index_head_dim, &G->ik_b, err));
    }
    G->is_moe = lw->is_moe;
    if (!lw->is_moe) {
        PT_TRY(UPW(gate, gate_proj));
        PT_TRY(UPW(up, up_proj));
        PT_TRY(UPW(down, down_proj));
    } else {
        PT_TRY(UPW(router, router));
        PT_TRY(up_vec(m, lw->e_score_correction_bias, c->n_routed_experts, &G->bias, err));
        G->has_shared = lw->has_shared;
        if (lw->has_shared) {
            PT_TRY(UPW(sg, sh_gate));
            PT_TRY(UPW(su, sh_up));
            PT_TRY(UPW(sd, sh_down));
        }
    }
#undef UPW
    return 0;
}

/* layer l's routed experts, all of them, stacked (the model is not tiered) */
static int up_experts(cu_model *m, const layer_w *lw, int l, cu_layer *G, petrel_error *err) {
    char nm[96];
    int E = m->c->n_routed_experts;
    snprintf(nm, sizeof nm, "layer %d routed experts", l);
    PT_TRY(up_stack(m, lw->exp_gate, E, nm, &G->eg, err));
    PT_TRY(up_stack(m, lw->exp_up, E, nm, &G->eu, err));
    return up_stack(m, lw->exp_down, E, nm, &G->ed, err);
}

/* the decode graphs: dropped when what they point at moves (scratch, RoPE tables) */
static void graphs_clear(cu_model *m) {
    for (int i = 0; i < CU_GRAPHS; i++)
        if (m->graphs[i].ex) cudaGraphExecDestroy(m->graphs[i].ex), m->graphs[i].ex = NULL;
}
static cudaGraphExec_t graph_get(cu_model *m, const int *key) {
    for (int i = 0; i < CU_GRAPHS; i++)
        if (m->graphs[i].ex && !memcmp(m->graphs[i].key, key, sizeof m->graphs[i].key)) {
            m->graphs[i].used = ++m->graph_tick;
            return m->graphs[i].ex;
        }
    return NULL;
}
static void graph_put(cu_model *m, const int *key, cudaGraphExec_t ex) {
    int v = 0;
    for (int i = 1; i < CU_GRAPHS; i++)
        if (!m->graphs[i].ex || (m->graphs[v].ex && m->graphs[i].used < m->graphs[v].used)) v = i;
    if (m->graphs[v].ex) cudaGraphExecDestroy(m->graphs[v].ex);
    memcpy(m->graphs[v].key, key, sizeof m->graphs[v].key);
    m->graphs[v].ex = ex, m->graphs[v].used = ++m->graph_tick;
}

extern "C" void cu_model_close(cu_model *m) {
    if (!m) return;
    cudaSetDevice(m->dev);
    graphs_clear(m);
    for (int i = 0; i < m->n_allocs; i++) cudaFree(m->allocs[i]);
    if (m->scr) cudaFree(m->scr);
    if (m->rope_cos) cudaFree(m->rope_cos);
    if (m->rope_sin) cudaFree(m->rope_sin);
    if (m->st) cudaStreamDestroy(m->st);
    if (m->side) cudaStreamDestroy(m->side);
    if (m->fork) cudaEventDestroy(m->fork);
    if (m->join) cudaEventDestroy(m->join);
    for (int i = 0; i < PROF_EVENTS && m->prof; i++) cudaEventDestroy(m->ev[i]);
    if (m->pin) cudaFreeHost(m->pin);
    if (m->pin_logits) cudaFreeHost(m->pin_logits);
    free(m->hrow), free(m->hri), free(m->pieces);
    cut_close(m);
    free(m->allocs);
    free(m->L);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

/* the TMA GEMM's bf16 weights (cu_model.w8 2): the largest q8 product a prompt runs through mm;
 * none where it does not fit the VRAM budget (mm then keeps cuk_gemm_w8g) */
static void wb_alloc(cu_model *m) {
    int64_t cap = 0;
    for (int l = 0; l < m->c->num_hidden_layers; l++) {
        const cu_layer &ly = m->L[l];
        const dw *ws[] = {&ly.q_a, &ly.q_b, &ly.kv_a, &ly.kv_b, &ly.o, &ly.iq, &ly.ik, &ly.iwp, &ly.gate, &ly.up, &ly.down, &ly.sg, &ly.su, &ly.sd};
        for (const dw *W : ws)
            if (W->d && cuk_gemm_w8_ok(*W) && W->rows * W->cols > cap) cap = W->rows * W->cols;
    }
    petrel_error ignored = {};
    if (cap > 0 && !m->wb && (m->wb = (__nv_bfloat16 *)dalloc(m, sizeof(__nv_bfloat16) * (size_t)cap, "the TMA GEMM's bf16 weights", &ignored))) m->wb_cap = cap;
}

extern "C" int cu_model_open(const petrel_engine *e, int device, uint64_t vram_budget, int vram_expert_slots, int host_experts, cu_model **out,
                             petrel_error *err) {
    *out = NULL;
    int nd = cu_device_count();
    if (nd <= 0) return pt_err(err, PETREL_EUNSUPPORTED, "--device cuda: no CUDA GPU is visible to this process");
    if (device < 0 || device >= nd) return pt_err(err, PETREL_EINVAL, "--device cuda:%d: this machine has %d GPU%s (cuda:0..%d)", device, nd, nd == 1 ? "" : "s", nd - 1);
    const petrel_config *c = &e->cfg;
    if (c->num_experts_per_tok > 32 || c->n_routed_experts > 1024)
        return pt_err(err, PETREL_EUNSUPPORTED, "cuda: %d experts with %d per token exceed the GPU router's 1024 / 32", c->n_routed_experts, c->num_experts_per_tok);
    if (c->qk_rope_head_dim > 256) return pt_err(err, PETREL_EUNSUPPORTED, "cuda: qk_rope_head_dim %d exceeds 256", c->qk_rope_head_dim);
    if (c->index_head_dim > 512) /* the DSA scores' keys and q rows in one block's shared memory */
        return pt_err(err, PETREL_EUNSUPPORTED, "cuda: index_head_dim %d exceeds 512", c->index_head_dim);
    cu_model *m = (cu_model *)calloc(1, sizeof *m);
    if (!m) return pt_err(err, PETREL_ENOMEM, "out of memory");
    pthread_mutex_init(&m->mu, NULL);
    m->e = e, m->c = c, m->dev = device;
    m->tc = e->kt.act_quant != 0;
    cudaError_t rc = cudaSetDevice(device);
    if (rc != cudaSuccess) {
        cu_model_close(m);
        return cu_fail(err, rc, "set device");
    }
    size_t fr = 0, tot = 0;
    cudaMemGetInfo(&fr, &tot);
    m->budget = vram_budget ? vram_budget : (fr > (1ull << 30) ? fr - (1ull << 30) : fr);
    if ((rc = cudaStreamCreateWithFlags(&m->st, cudaStreamNonBlocking)) != cudaSuccess ||
        (rc = cudaStreamCreateWithFlags(&m->side, cudaStreamNonBlocking)) != cudaSuccess ||
        (rc = cudaEventCreateWithFlags(&m->fork, cudaEventDisableTiming)) != cudaSuccess ||
        (rc = cudaEventCreateWithFlags(&m->join, cudaEventDisableTiming)) != cudaSuccess) {
        cu_model_close(m);
        return cu_fail(err, rc, "stream");
    }
    int L = c->num_hidden_layers, r = 0;
    if (!(m->L = (cu_layer *)calloc((size_t)L, sizeof(cu_layer)))) r = pt_err(err, PETREL_ENOMEM, "out of memory");
    m->rows = CU_ROWS;
    m->use_graphs = 1;
    /* a prompt's products in bf16 on warpgroup MMA (q4 experts, q8 rest) with their loads on the
     * TMA unit, and its attention expanded, one bf16 pass where the weights are quantized: faster
     * than the int8 forms and nearer the exact path (bench/RESULTS.md, 2026-12-06: KL 0.0061
     * against int8's 0.0122 on GLM-5.2 shapes); the TMA forms give the wgmma forms' bits, +10 %
     * on a 2048-token prompt (2026-12-07 07:50) */
    m->w4 = 3, m->w8 = 2, m->xattn = 3;
    const model_w *w = &e->w;
    if (!r) r = up_w(m, &w->embed_tokens, "embed_tokens", &m->embed, err);
    if (!r) {
        if (w->lm_head.data == w->embed_tokens.data && w->lm_head.scale == w->embed_tokens.scale) m->head = m->embed;
        else r = up_w(m, &w->lm_head, "lm_head", &m->head, err);
    }
    if (!r) r = up_vec(m, w->norm, c->hidden_size, &m->norm, err);
    if (!r) {
        int NH = c->num_attention_heads;
        int32_t *hh = (int32_t *)malloc(sizeof(int32_t) * 8 * NH);
        if (!hh || !(m->heads = (int32_t *)dalloc(m, sizeof(int32_t) * 8 * NH, "head ids", err))) r = hh ? PETREL_ENOMEM : pt_err(err, PETREL_ENOMEM, "out of memory");
        for (int i = 0; !r && i < 8 * NH; i++) hh[i] = i % NH;
        if (!r) r = up_copy(m->heads, hh, sizeof(int32_t) * 8 * NH, err);
        free(hh);
    }
    for (int l = 0; l < L && !r; l++) r = up_layer(m, &w->layers[l], l, &m->L[l], err);
    if (!r && m->w8 >= 2) wb_alloc(m);
    m->kvb_gemm = m->kvb_quant = !r && L > 0;
    for (int l = 0; l < L && !r; l++) m->kvb_gemm &= cuk_gemm_w8_ok(m->L[l].kv_b), m->kvb_quant &= cuk_w_quantized(m->L[l].kv_b);
    if (!r && e->route) { /* trace-driven routing (benchmarks): the trace to HBM */
        const xs_trace *tr = e->route;
        size_t n = (size_t)tr->n_tokens * tr->n_layers * tr->topk;
        m->route_tokens = tr->n_tokens, m->route_layers = tr->n_layers;
        if (!(m->route = (int16_t *)dalloc(m, sizeof(int16_t) * n, "the routing trace", err))) r = PETREL_ENOMEM;
        else r = up_copy(m->route, tr->ids, sizeof(int16_t) * n, err);
    }
    int tiered = 0;
    if (!r) r = cut_open(m, vram_expert_slots, host_experts, &tiered, err);
    for (int l = 0; l < L && !r && !tiered; l++)
        if (m->L[l].is_moe) r = up_experts(m, &w->layers[l], l, &m->L[l], err);
    if (!r && !tiered) /* a prompt's chunks read every expert they route to: as few chunks as the VRAM left allows */
        m->rows = cu_chunk_rows(c, m->budget > m->used ? m->budget - m->used : 0, CU_ROWS);
    if (!r && (rc = cudaMallocHost(&m->pin, (size_t)m->rows * PIN_ROW_BYTES)) != cudaSuccess) r = cu_fail(err, rc, "pinned staging");
    if (!r && (rc = cudaMallocHost(&m->pin_logits, sizeof(float) * CU_PIN_LOGITS * (size_t)c->vocab_size)) != cudaSuccess)
        r = cu_fail(err, rc, "pinned logits");
    if (!r && cudaHostGetDevicePointer((void **)&m->pin_logits_dev, m->pin_logits, 0) != cudaSuccess) {
        cudaGetLastError(); /* not mapped: the logits are copied down after the head */
        m->pin_logits_dev = NULL;
    }
    if (!r) {
        m->hrow = (int32_t *)malloc(sizeof(int32_t) * 4 * (size_t)m->rows);
        m->hri = (cu_rowinfo *)malloc(sizeof(cu_rowinfo) * (size_t)m->rows);
        m->pieces = malloc(sizeof(piece) * (size_t)m->rows);
        if (!m->hrow || !m->hri || !m->pieces) r = pt_err(err, PETREL_ENOMEM, "out of memory");
    }
    if (r) {
        cu_model_close(m);
        return r;
    }
    cudaDeviceProp p;
    cudaGetDeviceProperties(&p, device);
    int dn = snprintf(m->desc, sizeof m->desc, "%.120s (cuda:%d, %.1f GiB), weights %.2f GB in HBM", p.name, device, tot / 1073741824.0, m->wbytes / 1e9);
    if (!m->tiers && dn > 0 && (size_t)dn < sizeof m->desc) dn += snprintf(m->desc + dn, sizeof m->desc - (size_t)dn, ", prompts in chunks of %d rows", m->rows);
    if (m->tiers && dn > 0 && (size_t)dn < sizeof m->desc) cut_describe(m, m->desc + dn, sizeof m->desc - (size_t)dn);
    *out = m;
    return 0;
}

extern "C" const char *cu_model_describe(const cu_model *m) { return m->desc; }
extern "C" int cu_model_chunk_rows(const cu_model *m) { return m->rows; }
extern "C" uint64_t cu_model_weight_bytes(const cu_model *m) { return m->wbytes; }
/* a launch-mode switch: set under the lock, and the graphs dropped (a graph keeps the launches
 * and attributes it was captured with) */
static void set_mode(cu_model *m, int *flag, int v) {
    pthread_mutex_lock(&m->mu);
    *flag = v;
    graphs_clear(m);
    pthread_mutex_unlock(&m->mu);
}
extern "C" void cu_model_use_stacks(cu_model *m, int on) { set_mode(m, &m->no_stacks, !on); }
extern "C" void cu_model_use_mapped_logits(cu_model *m, int on) { set_mode(m, &m->no_mapped_logits, !on); }
extern "C" void cu_model_use_pdl(cu_model *m, int on) { set_mode(m, &m->no_pdl, !on); }
extern "C" void cu_model_use_fork(cu_model *m, int on) { set_mode(m, &m->no_fork, !on); }
extern "C" void cu_model_use_bf16_experts(cu_model *m, int form) { set_mode(m, &m->w4, form); }
extern "C" void cu_model_use_bf16_dense(cu_model *m, int on) {
    set_mode(m, &m->w8, on);
    pthread_mutex_lock(&m->mu);
    if (on >= 2 && !m->wb) { /* the TMA form's scratch, first asked for now */
        cudaSetDevice(m->dev);
        wb_alloc(m);
    }
    pthread_mutex_unlock(&m->mu);
}
extern "C" void cu_model_use_expanded_attn(cu_model *m, int form) { set_mode(m, &m->xattn, form); }
extern "C" void cu_model_use_graphs(cu_model *m, int on) { set_mode(m, &m->use_graphs, on); }
extern "C" unsigned long long cu_model_fork_count(const cu_model *m) { return m->forks; }
extern "C" unsigned long long cu_model_expanded_count(const cu_model *m) { return m->xruns; }
extern "C" int cu_model_graph_count(const cu_model *m) {
    int n = 0;
    for (int i = 0; i < CU_GRAPHS; i++) n += m->graphs[i].ex != NULL;
    return n;
}
extern "C" int cu_model_stacks(const cu_model *m) {
    int n = 0;
    for (int l = 0; l < m->c->num_hidden_layers; l++) n += (m->L[l].on_x.n > 0) + (m->L[l].on_qa.n > 0);
    return n;
}

/* RoPE tables for positions < cap (op_rope_table's values, computed on the host) */
static int rope_grow(cu_model *m, int cap, petrel_error *err) {
    if (cap <= m->rope_cap) return 0;
    int half = m->c->qk_rope_head_dim / 2;
    size_t n = (size_t)cap * half;
    float *hc = (float *)malloc(sizeof(float) * n), *hs = (float *)malloc(sizeof(float) * n);
    if (!hc || !hs) {
        free(hc), free(hs);
        return pt_err(err, PETREL_ENOMEM, "out of memory");
    }
    for (int p = 0; p < cap; p++) op_rope_table(m->c->rope_theta, m->c->qk_rope_head_dim, p, hc + (size_t)p * half, hs + (size_t)p * half);
    float *dc = NULL, *ds = NULL;
    cudaError_t rc = cudaMalloc(&dc, sizeof(float) * n);
    if (rc == cudaSuccess) rc = cudaMalloc(&ds, sizeof(float) * n);
    if (rc == cudaSuccess) rc = h2d(dc, hc, sizeof(float) * n);
    if (rc == cudaSuccess) rc = h2d(ds, hs, sizeof(float) * n);
    free(hc), free(hs);
    if (rc != cudaSuccess) {
        cudaGetLastError();
        cudaFree(dc), cudaFree(ds);
        return cu_fail(err, rc, "RoPE tables");
    }
    cudaStreamSynchronize(m->st);
    graphs_clear(m); /* they point at the old tables */
    if (m->rope_cos) cudaFree(m->rope_cos), cudaFree(m->rope_sin);
    m->rope_cos = dc, m->rope_sin = ds, m->rope_cap = cap;
    return 0;
}

extern "C" int cu_kv_create(cu_model *m, int cap, cu_kv **out, petrel_error *err) {
    *out = NULL;
    const petrel_config *c = m->c;
    pthread_mutex_lock(&m->mu);
    cudaSetDevice(m->dev);
    int rc = rope_grow(m, cap, err);
    size_t nkv = (size_t)c->num_hidden_layers * cap * (c->kv_lora_rank + c->qk_rope_head_dim), nix = (size_t)c->num_hidden_layers * cap * c->index_head_dim;
    cu_kv *k = rc ? NULL : (cu_kv *)calloc(1, sizeof *k);
    if (!rc && !k) rc = pt_err(err, PETREL_ENOMEM, "out of memory");
    if (!rc && m->budget && m->used + (nkv + nix) * 4 > m->budget)
        rc = pt_err(err, PETREL_ENOMEM, "cuda: a session of %d positions needs %.2f GB of KV; the VRAM budget has %.2f GB left", cap, (nkv + nix) * 4 / 1e9,
                    (m->budget - m->used) / 1e9);
    cudaError_t ce = cudaSuccess;
    if (!rc && (ce = cudaMalloc(&k->kv, nkv * 4)) == cudaSuccess) ce = cudaMalloc(&k->ix, nix * 4 + 16);
    if (!rc && ce != cudaSuccess) {
        cudaGetLastError();
        rc = cu_fail(err, ce, "session KV");
    }
    if (!rc) {
        cudaMemsetAsync(k->kv, 0, nkv * 4, m->st);
        cudaMemsetAsync(k->ix, 0, nix * 4, m->st);
        m->used += (nkv + nix) * 4;
        k->m = m, k->cap = cap;
        *out = k;
    } else if (k) {
        cudaFree(k->kv);
        free(k);
    }
    pthread_mutex_unlock(&m->mu);
    return rc;
}

extern "C" void cu_kv_free(cu_kv *k) {
    if (!k) return;
    cu_model *m = k->m;
    const petrel_config *c = m->c;
    pthread_mutex_lock(&m->mu);
    cudaSetDevice(m->dev);
    cudaStreamSynchronize(m->st);
    cudaFree(k->kv);
    cudaFree(k->ix);
    m->used -= (size_t)c->num_hidden_layers * k->cap * (c->kv_lora_rank + c->qk_rope_head_dim + c->index_head_dim) * 4;
    pthread_mutex_unlock(&m->mu);
    free(k);
}

extern "C" int cu_kv_copy(cu_model *m, cu_kv *dst, const cu_kv *src, int n, petrel_error *err) {
    const petrel_config *c = m->c;
    if (n > dst->cap || n > src->cap) return pt_err(err, PETREL_ERANGE, "cuda: a copy of %d positions into a cache of %d", n, dst->cap);
    int D = c->kv_lora_rank + c->qk_rope_head_dim, Di = c->index_head_dim;
    pthread_mutex_lock(&m->mu);
    cudaSetDevice(m->dev);
    cudaError_t rc = cudaSuccess;
    for (int l = 0; l < c->num_hidden_layers && rc == cudaSuccess; l++) {
        rc = cudaMemcpyAsync(dst->kv + (size_t)l * dst->cap * D, src->kv + (size_t)l * src->cap * D, sizeof(float) * n * D, cudaMemcpyDeviceToDevice, m->st);
        if (rc == cudaSuccess)
            rc = cudaMemcpyAsync(dst->ix + (size_t)l * dst->cap * Di, src->ix + (size_t)l * src->cap * Di, sizeof(float) * n * Di, cudaMemcpyDeviceToDevice, m->st);
    }
    if (rc == cudaSuccess) rc = cudaStreamSynchronize(m->st);
    pthread_mutex_unlock(&m->mu);
    return rc == cudaSuccess ? 0 : cu_fail(err, rc, "KV copy");
}

/* ---- the forward ---- */

/* nkx: the keys of an expanded prompt chunk (0: none); fa: it runs the one bf16 pass (no S, the
 * keys and values in bf16 beside their f32 expansion; 2: that expansion one GEMM into kx, no vx) */
static size_t carve(uint8_t *base, const petrel_config *c, int T, int nmax, int nall, int nlog, int tiered, int nkx, int fa, fscr *f) {
    size_t off = 0;
#define TAKE(p, type, n) (off = (off + 255) / 256 * 256, f->p = base ? (type *)(base + off) : NULL, off += sizeof(type) * (size_t)(n))
    int H = c->hidden_size, NH = c->num_attention_heads, K = c->num_experts_per_tok, E = c->n_routed_experts;
    int I = c->moe_intermediate_size * K;
    int Ish = c->moe_intermediate_size * (c->n_shared_experts > 0 ? c->n_shared_experts : 1);
    if (c->intermediate_size > I) I = c->intermediate_size;
    if (Ish > I) I = Ish;
    int ntile = (T * K + 63) / 64 + E + 1;
    TAKE(ids, int32_t, T);
    TAKE(always, int32_t, T);
    TAKE(ri, cu_rowinfo, T);
    TAKE(h, float, (size_t)T * H);
    TAKE(x, float, (size_t)T * H);
    TAKE(y, float, (size_t)T * H);
    TAKE(mo, float, (size_t)T * H);
    TAKE(qa, float, (size_t)T * c->q_lora_rank);
    TAKE(q, float, (size_t)T * NH * c->qk_head_dim);
    TAKE(kva, float, (size_t)T * (c->kv_lora_rank + c->qk_rope_head_dim));
    TAKE(o, float, (size_t)T * NH * c->v_head_dim);
    TAKE(qt, float, (size_t)T * NH * c->kv_lora_rank);
    TAKE(lat, float, (size_t)T * NH * c->kv_lora_rank);
    TAKE(S, float, nkx && fa ? 1 : (size_t)T * NH * nmax * (T <= 8 ? CU_ATTN_DSPLIT : 1));
    const int kxw = fa && c->qk_nope_head_dim + c->v_head_dim > c->qk_head_dim ? c->qk_nope_head_dim + c->v_head_dim : c->qk_head_dim;
    TAKE(kx, float, (size_t)NH * nkx * kxw + 1);
    TAKE(vx, float, fa == 2 ? 1 : (size_t)NH * nkx * c->v_head_dim + 1); /* fa 2: V by the keys' GEMM, into kx */
    TAKE(xb, __nv_bfloat16, nkx && fa ? cuk_attn_fa_bytes(NH, nkx, c->qk_head_dim, c->v_head_dim, c->kv_lora_rank) / 2 : 1);
    TAKE(partial, float, (size_t)(T <= 8 ? T * CU_ATTN_SPLITS : 1) * NH * c->kv_lora_rank);
    TAKE(qi, float, (size_t)T * c->index_n_heads * c->index_head_dim);
    TAKE(ki, float, (size_t)T * c->index_head_dim);
    TAKE(iw, float, (size_t)T * c->index_n_heads);
    f->on_x_cap = c->q_lora_rank + c->kv_lora_rank + c->qk_rope_head_dim + c->index_head_dim + c->index_n_heads;
    f->on_qa_cap = NH * c->qk_head_dim + c->index_n_heads * c->index_head_dim;
    TAKE(on_x, float, f->on_x_cap);
    TAKE(on_qa, float, f->on_qa_cap);
    TAKE(sc, float, (size_t)T * nall);
    TAKE(sel, int32_t, (size_t)T * c->index_topk);
    TAKE(seln, int32_t, T);
    TAKE(lg, float, (size_t)T * E);
    TAKE(idx, int32_t, (size_t)T * K);
    TAKE(wts, float, (size_t)T * K);
    TAKE(slot_x, int32_t, (size_t)T * K);
    TAKE(list, int32_t, (size_t)T * K);
    TAKE(tiles, int32_t, 3 * (size_t)ntile);
    TAKE(ntiles, int32_t, 1);
    TAKE(mark, int32_t, E);
    TAKE(count, unsigned long long, 1);
    TAKE(gb, float, (size_t)T * I);
    TAKE(ub, float, (size_t)T * I);
    TAKE(yk, float, (size_t)T * K * H);
    TAKE(xl, float, (size_t)T * H);
    TAKE(logits, float, (size_t)(nlog > 0 ? nlog : 1) * c->vocab_size);
    /* the expert tiers' waves: a wave's choices (slot, x row, place in yk) and its outputs */
    TAKE(w_idx, int32_t, tiered ? (size_t)T * K : 1);
    TAKE(w_x, int32_t, tiered ? (size_t)T * K : 1);
    TAKE(w_pos, int32_t, tiered ? (size_t)T * K : 1);
    TAKE(w_y, float, tiered ? (size_t)T * K * H : 1);
    /* the quantized path's int8 x (GEMV forms only: up to 8 rows, or T * K expert choices) */
    int xr = T * K <= CU_EXP_GEMV && T * K > 8 ? T * K : 8, xc = H;
    const int wide[] = {c->q_lora_rank, NH * c->v_head_dim, c->intermediate_size, c->moe_intermediate_size,
                        c->moe_intermediate_size * (c->n_shared_experts > 0 ? c->n_shared_experts : 1)};
    for (int i = 0; i < 5; i++) xc = wide[i] > xc ? wide[i] : xc;
    xc = (xc + 63) / 64 * 64;
    /* and the GEMM's: T rows of any product's width, or the T * K choices' down products */
    int64_t cap = (int64_t)xr * xc, gemm = (int64_t)T * xc, down = (int64_t)T * K * ((c->moe_intermediate_size + 63) / 64 * 64);
    cap = gemm > cap ? gemm : cap;
    cap = down > cap ? down : cap;
    f->xq_cap = cap;
    TAKE(xq, int8_t, (size_t)cap);
    TAKE(xqd, float, (size_t)cap / 32);
    TAKE(xqs, int32_t, (size_t)cap / 32);
    TAKE(xh, __nv_bfloat16, (size_t)cap);
    /* the shared expert on the side stream (up to 8 rows): its gate / up outputs and int8 x */
    const int side = T <= 8 ? T : 0;
    const int64_t scap = (int64_t)side * (((H > Ish ? H : Ish) + 63) / 64 * 64);
    f->sxq_cap = scap;
    TAKE(sgb, float, (size_t)side * Ish + 1);
    TAKE(sub, float, (size_t)side * Ish + 1);
    TAKE(sxq, int8_t, (size_t)scap + 1);
    TAKE(sxqd, float, (size_t)scap / 32 + 1);
    TAKE(sxqs, int32_t, (size_t)scap / 32 + 1);
#undef TAKE
    return off + 256;
}

size_t cu_chunk_scratch_bytes(const petrel_config *c, int rows) {
    fscr f;
    int topk = c->index_topk > 0 ? c->index_topk : rows;
    return carve(NULL, c, rows, rows < topk ? rows : topk, rows + topk, rows, 1, 0, 0, &f); /* the expanded attention only where room is left */
}

int cu_chunk_rows(const petrel_config *c, uint64_t left, int least) {
    for (int r = CU_ROWS_MAX; r > least; r /= 2)
        if (4 * (uint64_t)cu_chunk_scratch_bytes(c, r) <= left) return r;
    return least;
}

/* The quantized path's products on int8 x (act_quant on, q8_g32 / q4_g64 weights): x's n rows
 * [n][ldx] of cols values quantized into f's int8 buffer for W's format and form (the GEMV's,
 * or with gemm the GEMM's plain order); 0 when W does not take it. */
static int quant_x(const cu_model *m, const fscr &f, const dw &W, const float *x, int64_t ldx, int n, cu_xq *X, int gemm = 0) {
    int ok = m->tc ? (gemm ? cuk_gemm_q_ok(W) : cuk_gemv_q_ok(W)) : 0, q4 = ok == 2;
    if (!ok || (int64_t)n * W.cols > f.xq_cap) return 0;
    *X = cu_xq{f.xq, f.xqd, f.xqs, W.cols, W.cols / (q4 ? 64 : 32), W.cols / 32};
    cuk_actq(m->st, x, ldx, n, (int)W.cols, q4 ? (gemm ? 2 : 1) : 0, *X);
    return 1;
}

/* y[n][W.rows] = x[n][W.cols] W^T by the form for n rows: up to 8 the GEMV, else the GEMM, each
 * on int8 x where the quantized path takes the format (else the f32 forms; tc: the bf16
 * tensor-core GEMM where the format allows) */
/* whether mm takes W for n rows on the bf16 warpgroup MMA (x first rounded into f.xh) */
static int mm_bf16(const cu_model *m, const fscr &f, const dw &W, int n) {
    return n > 8 && m->w8 && m->tc && cuk_gemm_w8_ok(W) && (int64_t)n * W.cols <= f.xq_cap;
}
/* y = x W^T; xh_ready: f.xh holds x as mm's bf16 form rounds it (the product before read the same
 * x of as many columns on that form) */
static void mm(const cu_model *m, const fscr &f, const dw &W, const float *x, float *y, int n, const cu_xq *xq = NULL, int xh_ready = 0) {
    cu_xq X;
    if (n <= 8 && xq) cuk_gemv_q(m->st, W, *xq, y, W.rows, n, NULL, NULL); /* x quantized for W's format already */
    else if (n <= 8 && quant_x(m, f, W, x, W.cols, n, &X)) cuk_gemv_q(m->st, W, X, y, W.rows, n, NULL, NULL);
    else if (n <= 8) cuk_gemv(m->st, W, x, W.cols, y, W.rows, n, NULL, NULL);
    else if (mm_bf16(m, f, W, n)) { /* the bf16 warpgroup-MMA form (cu_model_use_bf16_dense); for many rows its TMA twin (the same bits) */
        if (!xh_ready) cuk_xbf16g8(m->st, x, W.cols, n, (int)W.cols, f.xh, W.cols);
        if (m->w8 >= 2 && n >= CU_TMA_ROWS && W.rows * W.cols <= m->wb_cap) {
            cuk_w8_bf16g(m->st, W, m->wb);
            if (!cuk_gemm_tma(m->st, m->wb, W.rows, W.cols, f.xh, W.cols, y, W.rows, n)) return;
        }
        cuk_gemm_w8g(m->st, W, f.xh, W.cols, y, W.rows, n, NULL, NULL, 0, NULL, NULL);
    } else if (quant_x(m, f, W, x, W.cols, n, &X, 1)) cuk_gemm_q(m->st, W, X, y, W.rows, n, NULL, NULL, 0, NULL, NULL);
    else cuk_gemm(m->st, W, x, W.cols, y, W.rows, n, NULL, NULL, 0, NULL, NULL, m->tc);
}

/* ys[i] = x ws[i]^T for products that read the same x [n][cols]: on int8 x, x is quantized once
 * for the products of the first one's format (run first, while the buffer holds it), the
 * others each by mm */
static void mm_x(const cu_model *m, const fscr &f, const dw *const *ws, float *const *ys, int nw, const float *x, int n) {
    cu_xq X;
    int q = nw > 0 && n <= 8 && quant_x(m, f, *ws[0], x, ws[0]->cols, n, &X), fmt = q ? cuk_gemv_q_ok(*ws[0]) : 0;
    int64_t hcols = -1; /* on the bf16 form, x rounded once into f.xh for the products of as many columns */
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < nw; i++) {
            int shared = q && cuk_gemv_q_ok(*ws[i]) == fmt && ws[i]->cols == ws[0]->cols;
            if (shared != !pass) continue;
            const int h = mm_bf16(m, f, *ws[i], n);
            mm(m, f, *ws[i], x, ys[i], n, shared ? &X : NULL, h && ws[i]->cols == hcols);
            hcols = h ? ws[i]->cols : -1;
        }
}

/* The first nw products of one x (ws, into *ys[i]): for one row on int8 x, where the layer
 * stacked them (S), one GEMV over the stack's first nw into buf [cap], and *ys[i] pointed at
 * each one's rows there (each product's bits as alone: up_products); otherwise mm_x */
static void stack_gemv(const cu_model *m, const fscr &f, const cu_stack &S, const dw *const *ws, float **const *ys, int nw, const float *x, float *buf,
                       int64_t cap, int n) {
    cu_xq X;
    if (nw > 1 && n == 1 && S.n >= nw && S.end[nw - 1] <= cap && !m->no_stacks) {
        dw P = S.all;
        P.rows = S.end[nw - 1];
        if (quant_x(m, f, P, x, P.cols, 1, &X)) {
            cuk_gemv_q(m->st, P, X, buf, P.rows, 1, NULL, NULL);
            for (int i = 0; i < nw; i++) *ys[i] = buf + (i ? S.end[i - 1] : 0);
            return;
        }
    }
    float *y[4];
    for (int i = 0; i < nw; i++) y[i] = *ys[i];
    mm_x(m, f, ws, y, nw, x, n);
}

static void swiglu(const cu_model *m, const dw &g, const dw &u, const dw &d, const float *x, int n, const fscr &f, float *out) {
    cu_xq X;
    if (n <= 8 && g.qt == u.qt && g.g == u.g && quant_x(m, f, g, x, g.cols, n, &X)) {
        cuk_gemv_swiglu_q(m->st, g, u, X, f.gb, g.rows, n, NULL, NULL, f.ub);
    } else if (n <= 8) {
        cuk_gemv_swiglu(m->st, g, u, x, g.cols, f.gb, g.rows, n, NULL, NULL, f.ub);
    } else {
        mm(m, f, g, x, f.gb, n);
        mm(m, f, u, x, f.ub, n, NULL, mm_bf16(m, f, g, n) && mm_bf16(m, f, u, n) && g.cols == u.cols); /* x in bf16 once for both */
        if (mm_bf16(m, f, d, n) && d.cols == g.rows) { /* the down product's bf16 input in one pass (the same bits as below) */
            cuk_swiglu_bf16g8(m->st, f.gb, f.ub, g.rows, n, (int)g.rows, f.xh, d.cols);
            mm(m, f, d, f.gb, out, n, NULL, 1);
            return;
        }
        cuk_silu_mul(m->st, f.gb, f.ub, (int64_t)n * g.rows);
    }
    mm(m, f, d, f.gb, out, n);
}

/* the end of layer l: h += a (+ b: a + b first), then the next layer's input norm into x, or
 * after the last layer the final norm into xl when anything reads it (f.need_xl) */
static void residual_norm(const cu_model *m, int l, float *a, const float *b, const fscr &f, int t) {
    const petrel_config *c = m->c;
    int H = c->hidden_size;
    if (l + 1 < c->num_hidden_layers) cuk_add_rmsnorm(m->st, f.x, f.h, a, b, m->L[l + 1].in_norm, H, t, c->rms_norm_eps);
    else if (f.need_xl) cuk_add_rmsnorm(m->st, f.xl, f.h, a, b, m->norm, H, t, c->rms_norm_eps);
    else {
        if (b) cuk_add(m->st, a, b, (int64_t)t * H);
        cuk_add(m->st, f.h, a, (int64_t)t * H);
    }
}

void experts_compute(cu_model *m, const cu_layer &G, const fscr &f, const int32_t *idx, const int32_t *xrow, int n, int sort_t, int sort_k,
                     int sort_e, float *y, int gemv) {
    cudaStream_t st = m->st;
    int H = m->c->hidden_size, I = (int)G.eg.rows;
    if (gemv) {
        cu_xq X;
        if (G.eg.qt == G.eu.qt && G.eg.g == G.eu.g && quant_x(m, f, G.eg, f.x, H, f.t, &X)) cuk_gemv_swiglu_q(st, G.eg, G.eu, X, f.gb, I, n, idx, xrow, f.ub);
        else cuk_gemv_swiglu(st, G.eg, G.eu, f.x, H, f.gb, I, n, idx, xrow, f.ub);
        prof_mark(m, P_EXPERTS);
        if (quant_x(m, f, G.ed, f.gb, I, n, &X)) cuk_gemv_q(st, G.ed, X, y, H, n, idx, NULL);
        else cuk_gemv(st, G.ed, f.gb, I, y, H, n, idx, NULL);
        return;
    }
    const int fits = (int64_t)f.t * H <= f.xq_cap && (int64_t)n * I <= f.xq_cap;
    const int mt = (n + 63) / 64 + sort_e + 1; /* tiles of 64 or 128 rows: at most this many */
    /* on the quantized path, q4 experts on the bf16 GEMM where asked (128-row tiles: an expert's
     * rows of a 2048-row chunk in one) */
    if (m->tc && m->w4 && fits && cuk_gemm_w4_ok(G.eg) && cuk_gemm_w4_ok(G.eu) && cuk_gemm_w4_ok(G.ed)) {
        const int wg = m->w4 >= 2; /* warpgroup MMA: its tiles and x order */
        cuk_moe_sort(st, idx, sort_t, sort_k, sort_e, wg ? cuk_gemm_w4g_rows() : 128, f.list, f.tiles, f.ntiles);
        if (m->w4 == 3 && cuk_gemm_w4t_ok(G.eg, sort_e) && cuk_gemm_w4t_ok(G.eu, sort_e) && cuk_gemm_w4t_ok(G.ed, sort_e)) {
            /* its loads on the TMA unit: x gathered in the tiles' order into y (free until the
             * down product writes it: n rows of H floats hold n rows of H bf16) */
            __nv_bfloat16 *xg = (__nv_bfloat16 *)y;
            cuk_xbf16g_rows(st, f.x, H, n, H, f.list, xrow, xg, H);
            /* a launch refused (a tensor map that would not encode) falls through to the form
             * below, which recomputes every product from f.x */
            if (!cuk_gemm_w4t(st, G.eg, sort_e, xg, H, f.gb, I, n, f.tiles, f.ntiles, mt, f.list) &&
                !cuk_gemm_w4t(st, G.eu, sort_e, xg, H, f.ub, I, n, f.tiles, f.ntiles, mt, f.list)) {
                cuk_swiglu_bf16g_rows(st, f.gb, f.ub, I, n, I, f.list, f.xh, I); /* the down product's x, gathered too */
                prof_mark(m, P_EXPERTS);
                if (!cuk_gemm_w4t(st, G.ed, sort_e, f.xh, I, y, H, n, f.tiles, f.ntiles, mt, f.list)) return;
            }
        }
        auto xbf16 = wg ? cuk_xbf16g : cuk_xbf16p;
        auto gemm = wg ? cuk_gemm_w4g : cuk_gemm_w4;
        xbf16(st, f.x, H, f.t, H, f.xh, H);
        gemm(st, G.eg, f.xh, H, f.gb, I, n, f.tiles, f.ntiles, mt, f.list, xrow);
        gemm(st, G.eu, f.xh, H, f.ub, I, n, f.tiles, f.ntiles, mt, f.list, xrow);
        if (wg) cuk_swiglu_bf16g(st, f.gb, f.ub, I, n, I, f.xh, I); /* the down product's x in one pass */
        else cuk_silu_mul(st, f.gb, f.ub, (int64_t)n * I);
        prof_mark(m, P_EXPERTS);
        if (!wg) xbf16(st, f.gb, I, n, I, f.xh, I);
        gemm(st, G.ed, f.xh, I, y, H, n, f.tiles, f.ntiles, mt, f.list, NULL);
        return;
    }
    /* on int8 x when the quantized path takes all three products, else the f32 / bf16 forms */
    cu_xq X;
    const int q = m->tc && cuk_gemm_q_ok(G.eg) && cuk_gemm_q_ok(G.eg) == cuk_gemm_q_ok(G.eu) && cuk_gemm_q_ok(G.ed) && fits;
    cuk_moe_sort(st, idx, sort_t, sort_k, sort_e, 64, f.list, f.tiles, f.ntiles);
    if (q) { /* the chunk's x rows quantized once for gate and up (the choices map to them), then each choice's down input */
        quant_x(m, f, G.eg, f.x, H, f.t, &X, 1);
        cuk_gemm_q(st, G.eg, X, f.gb, I, n, f.tiles, f.ntiles, mt, f.list, xrow);
        cuk_gemm_q(st, G.eu, X, f.ub, I, n, f.tiles, f.ntiles, mt, f.list, xrow);
    } else {
        cuk_gemm(st, G.eg, f.x, H, f.gb, I, n, f.tiles, f.ntiles, mt, f.list, xrow, m->tc);
        cuk_gemm(st, G.eu, f.x, H, f.ub, I, n, f.tiles, f.ntiles, mt, f.list, xrow, m->tc);
    }
    cuk_silu_mul(st, f.gb, f.ub, (int64_t)n * I);
    prof_mark(m, P_EXPERTS);
    if (q) {
        quant_x(m, f, G.ed, f.gb, I, n, &X, 1);
        cuk_gemm_q(st, G.ed, X, y, H, n, f.tiles, f.ntiles, mt, f.list, NULL);
    } else {
        cuk_gemm(st, G.ed, f.gb, I, y, H, n, f.tiles, f.ntiles, mt, f.list, NULL, m->tc);
    }
}

/* what a chunk's kernels need from its rows (launch sizes: bucketed for up to 8 rows) */
struct chunk_k {
    int t, nmax, nall, need_q, nl;
    const int32_t *hl; /* the logits rows among the chunk's (host) */
    int keys;          /* the most keys a row has (nall is its launch size) */
    int xkeys;         /* > 0: the chunk's attention expanded over these first keys of one session's cache xkv (cap xcap) */
    const float *xkv;
    int xcap;
    int xform;         /* its form (cuk_mla_attn_expanded) */
    float *head_y;     /* where the head writes the nl logits rows: f.logits, or mapped pinned host memory */
};

/* the experts a forward runs are counted on the device where rows may share experts; one row's
 * K router choices are distinct, so chunk_forward counts those on the host (no kernel) */
static int experts_counted_on_device(const cu_model *m, int t) { return t > 1 || m->route; }

/* A chunk's kernels from the embedding to the head, its rows' arrays on the device and f carved:
 * launched on the stream, or captured there as a decode step's graph (chunk_forward) */
static int chunk_kernels(cu_model *m, fscr &f, const fscr &f0, const chunk_k &ck, petrel_error *err) {
    const petrel_config *c = m->c;
    cudaStream_t st = m->st;
    int H = c->hidden_size, NH = c->num_attention_heads, Dn = c->qk_nope_head_dim, Dr = c->qk_rope_head_dim, Dv = c->v_head_dim;
    int Rq = c->q_lora_rank, Rkv = c->kv_lora_rank, Dqk = c->qk_head_dim, K = c->num_experts_per_tok, E = c->n_routed_experts;
    int Hi = c->index_n_heads, Di = c->index_head_dim, topk = c->index_topk;
    const int t = ck.t, nmax = ck.nmax, nall = ck.nall, need_q = ck.need_q, nl = ck.nl;
    const int32_t *hl = ck.hl;
#define PROF(part) prof_mark(m, part)
    cu_rope rope = {m->rope_cos, m->rope_sin, c->rope_interleave};
    cu_rope irope = {m->rope_cos, m->rope_sin, c->indexer_rope_interleave};
    cu_route_cfg rcfg = {E, K, c->n_group, c->topk_group, c->norm_topk_prob, c->routed_scaling_factor};
    const float scale = (float)(1.0 / sqrt((double)Dqk)), wscale = (float)(1.0 / sqrt((double)Hi) / sqrt((double)Di));
    /* up to 8 rows, resident and not profiled: parts of a layer on the side stream too */
    const int fork = !m->no_fork && !m->prof && !m->tiers && t <= 8 && f.sxq_cap > 0;
    const int count_dev = experts_counted_on_device(m, t);
    cuk_embed(st, m->embed, f.ids, t, f.h);
    if (count_dev) cudaMemsetAsync(f.count, 0, sizeof(unsigned long long), st);
    PROF(P_EMBED);
    int have_sel = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const cu_layer &G = m->L[l];
        if (l == 0) cuk_rmsnorm(st, f.x, H, f.h, H, G.in_norm, H, t, c->rms_norm_eps); /* later layers': with the residual */
        const int sel_here = c->layer_indexer_full[l] || !have_sel, ix_q = sel_here && G.has_idx && need_q;
        { /* the products of x (q_a, kv_a, the indexer's keys and head weights), then those of the
           * normed q_a (q_b, the indexer's queries): each x quantized once on int8 x, and for one
           * row one GEMV over the layer's stack of them where it has one */
            f.qa = f0.qa, f.kva = f0.kva, f.ki = f0.ki, f.iw = f0.iw, f.q = f0.q, f.qi = f0.qi;
            const dw *ws[4] = {&G.q_a, &G.kv_a, &G.ik, &G.iwp};
            float **ys[4] = {&f.qa, &f.kva, &f.ki, &f.iw};
            stack_gemv(m, f, G.on_x, ws, ys, sel_here && G.has_idx ? (ix_q ? 4 : 3) : 2, f.x, f.on_x, f.on_x_cap, t);
        }
        cuk_rmsnorm(st, f.qa, Rq, f.qa, Rq, G.q_a_norm, Rq, t, 1e-6);
        {
            const dw *ws[2] = {&G.q_b, &G.iq};
            float **ys[2] = {&f.q, &f.qi};
            stack_gemv(m, f, G.on_qa, ws, ys, ix_q ? 2 : 1, f.qa, f.on_qa, f.on_qa_cap, t);
        }
        if (sel_here && !G.has_idx && need_q)
            return pt_err(err, PETREL_EUNSUPPORTED, "layer %d has no DSA indexer weights: cannot select %d of %d keys", l, topk, ck.keys);
        /* the selection (the indexer's keys, then the top-k) on the side stream while the MLA
         * queries' rope and W_UK products run here: they share no buffer */
        const int dsa_side = fork && sel_here;
        auto select_keys = [&](cudaStream_t ds) {
            if (G.has_idx) cuk_dsa_prep(ds, need_q ? f.qi : NULL, f.ki, need_q ? f.iw : NULL, G.ik_w, G.ik_b, t, Hi, Di, Dr, wscale, l, f.ri, irope);
            cuk_dsa_select(ds, need_q && G.has_idx ? f.qi : NULL, f.iw, f.sc, need_q ? nall : 1, f.sel, topk, f.seln, t, Hi, Di, topk, l, f.ri, f.always, nall);
        };
        if (dsa_side) cudaEventRecord(m->fork, st), cudaStreamWaitEvent(m->side, m->fork, 0), select_keys(m->side), m->forks++;
        cuk_mla_prep(st, f.q, f.kva, G.kv_a_norm, t, NH, Dn, Dr, Rkv, l, f.ri, rope);
        PROF(P_ATTN_PROJ);
        if (sel_here && !dsa_side) {
            select_keys(st);
            PROF(P_INDEXER);
        }
        have_sel |= sel_here;
        if (ck.xkeys) { /* the heads' keys and values expanded, then o per head: no q~, no lat */
            if (dsa_side) cudaEventRecord(m->join, m->side), cudaStreamWaitEvent(st, m->join, 0);
            m->xruns++;
            if (cuk_mla_attn_expanded(st, G.kv_b, ck.xkv + (size_t)l * ck.xcap * (Rkv + Dr), ck.xkeys, f.q, f.kx, f.vx, f.S, nmax, f.seln, f.o, t, NH,
                                      Dn, Dr, Dv, Rkv, scale, ck.xform, f.xb,
                                      m->w8 >= 2 && ck.xkeys >= CU_TMA_ROWS && G.kv_b.rows * G.kv_b.cols <= m->wb_cap ? m->wb : NULL))
                return pt_err(err, PETREL_EUNSUPPORTED, "layer %d: the prompt's one-pass attention could not make its tensor maps", l);
            PROF(P_ATTN_CORE);
        } else {
            cuk_mla_uk(st, G.kv_b, G.uk_t, f.q, f.qt, t, NH, Dn, Dr, Dv, Rkv, m->heads, 1);
            if (dsa_side) cudaEventRecord(m->join, m->side), cudaStreamWaitEvent(st, m->join, 0);
            PROF(P_HEADS);
            cuk_mla_attn(st, f.q, f.qt, f.S, nmax, f.sel, topk, f.seln, nmax, f.lat, t, NH, Dn, Dr, Rkv, scale, l, f.ri, f.partial,
                         cuk_attn_splits(t, NH, Rkv, nmax), 2);
            PROF(P_ATTN_CORE);
            cuk_mla_uv(st, G.kv_b, f.lat, f.o, t, NH, Dn, Dv, Rkv, m->heads, 1);
            PROF(P_HEADS);
        }
        mm(m, f, G.o, f.o, f.y, t);
        cuk_add_rmsnorm(st, f.x, f.h, f.y, NULL, G.post_norm, H, t, c->rms_norm_eps);
        PROF(P_O_PROJ);
        if (!G.is_moe) {
            swiglu(m, G.gate, G.up, G.down, f.x, t, f, f.y);
            residual_norm(m, l, f.y, NULL, f, t);
            PROF(P_DENSE);
            continue;
        }
        /* the shared expert on the side stream (its own intermediates and int8 x, into f.y)
         * while the router and the routed experts run here; joined before the residual */
        const int sh_side = fork && G.has_shared;
        if (sh_side) {
            cudaEventRecord(m->fork, st), cudaStreamWaitEvent(m->side, m->fork, 0);
            fscr fs = f;
            fs.gb = f.sgb, fs.ub = f.sub, fs.xq = f.sxq, fs.xqd = f.sxqd, fs.xqs = f.sxqs, fs.xq_cap = f.sxq_cap;
            m->st = m->side; /* swiglu and its products launch on m->st */
            swiglu(m, G.sg, G.su, G.sd, f.x, t, fs, f.y);
            m->st = st;
            cudaEventRecord(m->join, m->side);
            m->forks++;
        }
        mm(m, f, G.router, f.x, f.lg, t);
        cuk_route(st, f.lg, G.bias, t, rcfg, f.idx, f.wts, f.slot_x);
        if (m->route) /* trace-driven routing: the trace's choices replace the router's (its layers spread as on the CPU) */
            cuk_route_given(st, f.lg, t, rcfg, m->route, m->route_tokens, m->route_layers, m->e->route_layer[m->e->moe_index[l]], f.ri, f.idx, f.wts);
        if (count_dev) {
            cudaMemsetAsync(f.mark, 0, sizeof(int32_t) * E, st);
            cuk_count_union(st, f.idx, t * K, f.mark, f.count);
        }
        PROF(P_ROUTER);
        int ns = t * K;
        if (m->tiers) PT_TRY(cut_experts(m, l, f, t, ns <= CU_EXP_GEMV, err));
        else experts_compute(m, G, f, f.idx, f.slot_x, ns, t, K, E, f.yk, ns <= CU_EXP_GEMV);
        PROF(P_EXPERTS_DOWN);
        cuk_moe_combine(st, f.yk, f.idx, f.wts, t, K, H, f.mo);
        PROF(P_COMBINE);
        if (sh_side) cudaStreamWaitEvent(st, m->join, 0);
        else if (G.has_shared) swiglu(m, G.sg, G.su, G.sd, f.x, t, f, f.y);
        residual_norm(m, l, f.mo, G.has_shared ? f.y : NULL, f, t);
        PROF(P_SHARED);
    }
    if (nl) {
        /* the head over the logits rows: gathered when they are not the chunk's last nl */
        const float *xh = f.xl + (size_t)hl[0] * H;
        int contiguous = 1;
        for (int j = 1; j < nl; j++) contiguous &= hl[j] == hl[0] + j;
        if (!contiguous) {
            for (int j = 0; j < nl; j++) cudaMemcpyAsync(f.x + (size_t)j * H, f.xl + (size_t)hl[j] * H, sizeof(float) * H, cudaMemcpyDeviceToDevice, st);
            xh = f.x;
        }
        mm(m, f, m->head, xh, ck.head_y ? ck.head_y : f.logits, nl);
        PROF(P_HEAD);
    }
#undef PROF
    return 0;
}

/* chunk_kernels in the model's launch mode: kernels start as their predecessors end
 * (programmatic dependent launch) unless turned off, profiled (events between the parts) or
 * tiered (experts on other streams and the host) */
static int chunk_run(cu_model *m, fscr &f, const fscr &f0, const chunk_k &ck, petrel_error *err) {
    const int was = cuk_pdl(!m->no_pdl && !m->prof && !m->tiers);
    const int r = chunk_kernels(m, f, f0, ck, err);
    cuk_pdl(was);
    return r;
}

static int chunk_forward(cu_model *m, const piece *pc, int np, const int32_t *ids, int T, float *logits, const int32_t *lrows, int nlog,
                         int *lnext, float *hidden, uint64_t *experts_run, petrel_error *err) {
    const petrel_config *c = m->c;
    cudaStream_t st = m->st;
    int H = c->hidden_size, topk = c->index_topk, V = c->vocab_size;
    /* the chunk's rows: ids, row info, the logits rows */
    int32_t *hid = m->hrow, *hal = hid + m->rows, *hl = hal + m->rows, *hcall = hl + m->rows;
    cu_rowinfo *hri = m->hri;
    int t = 0, nmax = 1, nall = 1, need_q = 0, nl = 0;
    for (int p = 0; p < np; p++)
        for (int i = 0; i < pc[p].n; i++, t++) {
            int r = pc[p].r0 + i, pos = pc[p].pos0 + i;
            hid[t] = ids[r];
            hcall[t] = r;
            hal[t] = pc[p].s->dsa_always_score;
            hri[t].kv = pc[p].s->kv->kv, hri[t].ix = pc[p].s->kv->ix, hri[t].cap = pc[p].s->kv->cap, hri[t].pos = pos;
            hri[t].rtok = pos + pc[p].s->route_offset, hri[t].pad_ = 0;
            int n = pos + 1, ns = n < topk ? n : topk;
            if (ns > nmax) nmax = ns;
            if (n > nall) nall = n;
            if (n > topk || hal[t]) need_q = 1;
        }
    /* the call's rows that want logits, in order (lnext: the next entry of lrows) */
    if (logits)
        while (*lnext < nlog) {
            int want = lrows ? lrows[*lnext] : T - nlog + *lnext, k = -1;
            for (int j = 0; j < t && k < 0; j++)
                if (hcall[j] == want) k = j;
            if (k < 0) break;
            hl[nl++] = k;
            (*lnext)++;
        }
    /* up to 8 rows: the launch sizes in buckets of 256 keys (each row's own key count is on the
     * device), so a decode step's launches repeat for 256 steps and replay as one graph */
    const int keys = nall;
    /* one session's rows (consecutive positions) that each select every key: the expanded
     * attention over the cache's first nall keys */
    int xkeys = m->xattn && np == 1 && t > 8 && !need_q ? nall : 0;
    if (t <= 8) {
        int b = (nmax + 255) / 256 * 256;
        nmax = topk > 0 && b > topk ? (topk > nmax ? topk : nmax) : b;
        if (need_q) nall = (nall + 255) / 256 * 256;
    }
#define PROF(part) prof_mark(m, part)
    m->n_ev = 0;
    fscr f;
    /* the form: 3 (one bf16 pass) on the quantized path of a quantized model (q8 / q4 kv_b in
     * every layer) where its widths fit, else 1 (f32 / bf16 weights and the exact mode keep f32
     * attention) */
    const int xform = m->xattn == 3 && (!m->tc || !m->kvb_quant || !cuk_attn_fa_ok(c->qk_head_dim, c->v_head_dim)) ? 1 : m->xattn;
    const int fa = xform == 3 ? (m->kvb_gemm ? 2 : 1) : 0;
    size_t need = carve(NULL, c, t, nmax, need_q ? nall : 1, nl, m->tiers != NULL, xkeys, fa, &f);
    if (xkeys && need > m->scr_cap && m->budget && m->used - m->scr_cap + need + need / 4 > m->budget) {
        xkeys = 0; /* no room under the VRAM budget for the expanded keys and values: the absorbed form */
        need = carve(NULL, c, t, nmax, need_q ? nall : 1, nl, m->tiers != NULL, 0, 0, &f);
    }
    if (need > m->scr_cap) {
        cudaStreamSynchronize(st);
        if (m->scr) cudaFree(m->scr), m->used -= m->scr_cap;
        graphs_clear(m); /* they point into the old scratch */
        m->scr = NULL, m->scr_cap = 0;
        size_t want = need + need / 4;
        if (m->budget && m->used + want > m->budget) return pt_err(err, PETREL_ENOMEM, "cuda: the forward's scratch (%.2f GB) does not fit the VRAM budget", want / 1e9);
        cudaError_t rc = cudaMalloc(&m->scr, want);
        if (rc != cudaSuccess) {
            cudaGetLastError();
            m->scr = NULL;
            return cu_fail(err, rc, "forward scratch");
        }
        m->scr_cap = want, m->used += want;
    }
    carve(m->scr, c, t, nmax, need_q ? nall : 1, nl, m->tiers != NULL, xkeys, xkeys ? fa : 0, &f);
    const fscr f0 = f; /* the carved places (a layer's stacked products point f's into on_x / on_qa) */
    f.need_xl = hidden || nl;
    f.t = t;
    /* the rows' arrays through pinned memory (the previous forward has finished with it) */
    uint8_t *pin = m->pin;
    memcpy(pin, hid, sizeof(int32_t) * t);
    memcpy(pin + 4 * (size_t)m->rows, hal, sizeof(int32_t) * t);
    memcpy(pin + 8 * (size_t)m->rows, hri, sizeof(cu_rowinfo) * t);
    /* their copies up, and the logits' down into pinned staging: issued on the stream, or captured
     * into a decode step's graph (pinned memory at fixed places: a replay copies what the host
     * wrote there before its launch), so a step is one launch and one synchronization */
    const int staged = nl <= CU_PIN_LOGITS;
    /* staged rows written by the head straight into the pinned staging (the device's stores cross
     * the link while the head's product runs; a copy after it took ~20 us of an H100 decode step,
     * cu_trace 2026-12-08 00:15) */
    float *mapped = nl && staged && m->pin_logits_dev && !m->no_mapped_logits ? m->pin_logits_dev : NULL;
    auto rows_up = [&]() {
        cudaMemcpyAsync(f.ids, pin, sizeof(int32_t) * t, cudaMemcpyHostToDevice, st);
        cudaMemcpyAsync(f.always, pin + 4 * (size_t)m->rows, sizeof(int32_t) * t, cudaMemcpyHostToDevice, st);
        cudaMemcpyAsync(f.ri, pin + 8 * (size_t)m->rows, sizeof(cu_rowinfo) * t, cudaMemcpyHostToDevice, st);
        PROF(P_COPY);
    };
    auto logits_down = [&]() { /* into pinned staging (a graph's copy: graphs run one logits row), else straight to the caller */
        return nl && !mapped ? cudaMemcpyAsync(staged ? m->pin_logits : logits + (size_t)(*lnext - nl) * V, f.logits, sizeof(float) * nl * V,
                                    cudaMemcpyDeviceToHost, st)
                  : cudaSuccess;
    };
    chunk_k ck = {t, nmax, need_q ? nall : 1, need_q, nl, hl, keys, xkeys, xkeys ? pc[0].s->kv->kv : NULL, xkeys ? pc[0].s->kv->cap : 0, xform, mapped};
    int r = 0;
    cudaError_t rc = cudaSuccess;
    /* one decode row (resident, no profile, no hidden states): the step's kernels as a graph,
     * captured once per bucket of launch sizes and replayed */
    cudaGraphExec_t ex = NULL;
    if (m->use_graphs && t == 1 && nl <= 1 && !hidden && !m->prof && !m->tiers) {
        const int key[4] = {ck.nmax, ck.nall, need_q, nl};
        ex = graph_get(m, key);
        if (!ex) {
            cudaGraph_t g = NULL;
            if (cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
                rows_up();
                r = chunk_run(m, f, f0, ck, err);
                const int down = r || logits_down() == cudaSuccess;
                if (cudaStreamEndCapture(st, &g) == cudaSuccess && !r && down && g && cudaGraphInstantiate(&ex, g, 0) == cudaSuccess) graph_put(m, key, ex);
                else ex = NULL;
                if (g) cudaGraphDestroy(g);
            }
            cudaGetLastError(); /* a capture that could not be made: the step launches directly (below) */
            if (r) return r;
            if (!ex) m->use_graphs = 0;
            f = f0, f.need_xl = hidden || nl, f.t = t;
        }
    }
    if (ex) rc = cudaGraphLaunch(ex, st);
    else {
        rows_up();
        r = chunk_run(m, f, f0, ck, err);
        if (!r) rc = logits_down();
    }
    if (r) return r;
    if (hidden && rc == cudaSuccess)
        for (int j = 0; j < t && rc == cudaSuccess; j++)
            rc = cudaMemcpyAsync(hidden + (size_t)hcall[j] * H, f.xl + (size_t)j * H, sizeof(float) * H, cudaMemcpyDeviceToHost, st);
    unsigned long long nrun = 0;
    if (!experts_counted_on_device(m, t)) /* one row runs K distinct experts a MoE layer */
        for (int l = 0; l < c->num_hidden_layers; l++) nrun += m->L[l].is_moe ? (unsigned long long)c->num_experts_per_tok : 0;
    else if (rc == cudaSuccess)
        rc = cudaMemcpyAsync(&nrun, f.count, sizeof nrun, cudaMemcpyDeviceToHost, st);
    if (rc == cudaSuccess) rc = cudaStreamSynchronize(st);
    if (rc == cudaSuccess) rc = cudaGetLastError();
    if (rc == cudaSuccess && experts_run) *experts_run += nrun;
    if (rc == cudaSuccess && nl && staged) memcpy(logits + (size_t)(*lnext - nl) * V, m->pin_logits, sizeof(float) * nl * V);
    PROF(P_COPY);
    if (m->prof && rc == cudaSuccess) {
        cudaEventSynchronize(m->ev[m->n_ev - 1]);
        for (int i = 1; i < m->n_ev; i++) {
            float ms = 0;
            cudaEventElapsedTime(&ms, m->ev[i - 1], m->ev[i]);
            m->prof_ms[m->ev_part[i]] += ms;
        }
    }
#undef PROF
    return rc == cudaSuccess ? 0 : cu_fail(err, rc, "forward");
}

extern "C" int cu_forward(cu_model *m, const cu_seg *seg, int nseg, const int32_t *ids, int T, float *logits, const int32_t *lrows, int nlog,
                          float *hidden, uint64_t *experts_run, petrel_error *err) {
    for (int g = 0; g < nseg; g++)
        if (seg[g].pos0 < 0 || seg[g].pos0 + seg[g].n > seg[g].kv->cap)
            return pt_err(err, PETREL_ERANGE, "cuda: rows at positions %d..%d exceed the session's %d", seg[g].pos0, seg[g].pos0 + seg[g].n - 1, seg[g].kv->cap);
    pthread_mutex_lock(&m->mu);
    cudaSetDevice(m->dev);
    piece *pc = (piece *)m->pieces;
    int np = 0, rows = 0, lnext = 0, rc = 0, R = m->rows;
    /* chunks as large as open chose, halved while their scratch (as chunk_forward allocates it:
     * the most a chunk of R rows may need, and a quarter more) would not fit what the sessions'
     * KV left of the VRAM budget */
    while (m->budget && R > CU_ROWS) {
        uint64_t sb = cu_chunk_scratch_bytes(m->c, R);
        if (m->used - m->scr_cap + sb + sb / 4 <= m->budget) break;
        R /= 2;
    }
    for (int g = 0; g < nseg && !rc; g++)
        for (int i = 0; i < seg[g].n && !rc;) {
            int take = seg[g].n - i < R - rows ? seg[g].n - i : R - rows;
            pc[np].s = &seg[g], pc[np].r0 = seg[g].r0 + i, pc[np].pos0 = seg[g].pos0 + i, pc[np].n = take;
            np++, rows += take, i += take;
            int last = g == nseg - 1 && i == seg[g].n;
            if (rows == R || last) {
                rc = chunk_forward(m, pc, np, ids, T, logits, lrows, nlog, &lnext, hidden, experts_run, err);
                np = 0, rows = 0;
            }
        }
    if (!rc && logits && lnext != nlog) rc = pt_err(err, PETREL_EINVAL, "cuda: %d of %d logits rows are not rows of the batch (or not ascending)", nlog - lnext, nlog);
    pthread_mutex_unlock(&m->mu);
    return rc;
}

extern "C" double cu_hbm_probe(cu_model *m, uint64_t bytes) {
    pthread_mutex_lock(&m->mu);
    cudaSetDevice(m->dev);
    uint8_t *buf = NULL;
    unsigned int *sink = NULL;
    double best = 0;
    bytes &= ~(uint64_t)15;
    if (cudaMalloc(&buf, bytes + 256) == cudaSuccess && cudaMalloc(&sink, 4) == cudaSuccess) {
        cudaMemsetAsync(buf, 0, bytes, m->st);
        cudaEvent_t a, b;
        cudaEventCreate(&a), cudaEventCreate(&b);
        cuk_read(m->st, (const uint4 *)buf, bytes / 16, sink); /* warm */
        for (int rep = 0; rep < 3; rep++) {
            cudaEventRecord(a, m->st);
            cuk_read(m->st, (const uint4 *)buf, bytes / 16, sink);
            cudaEventRecord(b, m->st);
            cudaEventSynchronize(b);
            float ms = 0;
            cudaEventElapsedTime(&ms, a, b);
            if (ms > 0 && bytes / (ms * 1e6) > best) best = bytes / (ms * 1e6);
        }
        cudaEventDestroy(a), cudaEventDestroy(b);
    }
    cudaGetLastError();
    cudaFree(buf);
    cudaFree(sink);
    pthread_mutex_unlock(&m->mu);
    return best;
}

static double tc_peak(cu_model *m, int bf16) {
    pthread_mutex_lock(&m->mu);
    cudaSetDevice(m->dev);
    unsigned int *sink = NULL;
    double tops = 0;
    int sms = 0;
    float ms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, m->dev) == cudaSuccess && cudaMalloc(&sink, 4) == cudaSuccess)
        tops = bf16 ? cuk_wgmma_peak(m->st, sink, sms, &ms) : cuk_mma_peak(m->st, sink, sms, &ms);
    cudaGetLastError();
    cudaFree(sink);
    pthread_mutex_unlock(&m->mu);
    return tops;
}
extern "C" double cu_tc_int8_peak(cu_model *m) { return tc_peak(m, 0); }
extern "C" double cu_tc_bf16_peak(cu_model *m) { return tc_peak(m, 1); }

extern "C" double cu_model_profile_experts_ms(const cu_model *m) { return m->prof_ms[P_EXPERTS] + m->prof_ms[P_EXPERTS_DOWN]; }

extern "C" double cu_h2d_probe(cu_model *m, uint64_t bytes) {
    pthread_mutex_lock(&m->mu);
    cudaSetDevice(m->dev);
    uint8_t *dev = NULL, *host = NULL;
    double best = 0;
    if (cudaMalloc(&dev, bytes) == cudaSuccess && cudaMallocHost(&host, bytes) == cudaSuccess) {
        memset(host, 1, bytes);
        cudaEvent_t a, b;
        cudaEventCreate(&a), cudaEventCreate(&b);
        for (int rep = 0; rep < 4; rep++) { /* the first warms the link */
            cudaEventRecord(a, m->st);
            cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, m->st);
            cudaEventRecord(b, m->st);
            cudaEventSynchronize(b);
            float ms = 0;
            cudaEventElapsedTime(&ms, a, b);
            if (rep && ms > 0 && bytes / (ms * 1e6) > best) best = bytes / (ms * 1e6);
        }
        cudaEventDestroy(a), cudaEventDestroy(b);
    }
    cudaGetLastError();
    cudaFree(dev);
    if (host) cudaFreeHost(host);
    pthread_mutex_unlock(&m->mu);
    return best;
}

extern "C" void cu_model_profile(cu_model *m, int on) {
    pthread_mutex_lock(&m->mu);
    cudaSetDevice(m->dev);
    if (on && !m->prof)
        for (int i = 0; i < PROF_EVENTS; i++) cudaEventCreate(&m->ev[i]);
    if (!on && m->prof)
        for (int i = 0; i < PROF_EVENTS; i++) cudaEventDestroy(m->ev[i]);
    m->prof = on;
    memset(m->prof_ms, 0, sizeof m->prof_ms);
    pthread_mutex_unlock(&m->mu);
}

extern "C" void cu_model_profile_report(const cu_model *m, char *buf, size_t n) {
    size_t o = 0;
    if (n) buf[0] = 0;
    for (int p = 0; p < PROF_PARTS && o < n; p++) {
        int w = snprintf(buf + o, n - o, "  %-40s %10.3f ms\n", prof_names[p], m->prof_ms[p]);
        if (w < 0) break;
        o += (size_t)w;
    }
}

/* ---- checks for tests ---- */

static int check_model(cu_model *m, petrel_error *err) {
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    if (cu_device_count() <= 0) return pt_err(err, PETREL_EUNSUPPORTED, "no CUDA GPU");
    cudaSetDevice(0);
    cudaError_t rc = cudaStreamCreateWithFlags(&m->st, cudaStreamNonBlocking);
    return rc == cudaSuccess ? 0 : cu_fail(err, rc, "stream");
}
static void check_done(cu_model *m) {
    cudaStreamSynchronize(m->st);
    for (int i = 0; i < m->n_allocs; i++) cudaFree(m->allocs[i]);
    free(m->allocs);
    cudaStreamDestroy(m->st);
    pthread_mutex_destroy(&m->mu);
}

/* the checks' end: the device result to the host, the stream drained, any launch error named */
static int check_fetch(cu_model *m, void *host, const void *dev, size_t bytes, const char *what, petrel_error *err) {
    cudaError_t ce = cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, m->st);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(m->st);
    if (ce == cudaSuccess) ce = cudaGetLastError();
    return ce == cudaSuccess ? 0 : cu_fail(err, ce, what);
}

/* slots 0 .. n-1 of expert 0 on x rows n-1 .. 0: sl [2n] (experts, then x rows) */
static int check_reversed_slots(int32_t *sl, int n, petrel_error *err) {
    int32_t *hs = (int32_t *)malloc(sizeof(int32_t) * 2 * (size_t)n);
    if (!hs) return pt_err(err, PETREL_ENOMEM, "out of memory");
    for (int i = 0; i < n; i++) hs[i] = 0, hs[n + i] = n - 1 - i;
    int rc = up_copy(sl, hs, sizeof(int32_t) * 2 * (size_t)n, err);
    free(hs);
    return rc;
}

extern "C" int cu_matmul_check(const pt_wview *W, const float *x, int n, float *y, int path, petrel_error *err) {
    cu_model m;
    PT_TRY(check_model(&m, err));
    dw G;
    int rc = up_w(&m, W, "test weight", &G, err);
    float *dx = NULL, *dy = NULL;
    if (!rc) dx = (float *)dalloc(&m, sizeof(float) * n * W->cols, "x", err), dy = (float *)dalloc(&m, sizeof(float) * n * W->rows, "y", err);
    if (!rc && (!dx || !dy)) rc = PETREL_ENOMEM;
    if (!rc) rc = up_copy(dx, x, sizeof(float) * n * W->cols, err);
    if (!rc) {
        int ok = cuk_gemv_q_ok(G);
        if (path == 4 || path == 5) { /* the quantized path's GEMV: plain rows by 8, or n slots of x rows n-1 .. 0 */
            int64_t cols = W->cols;
            int8_t *q = (int8_t *)dalloc(&m, (size_t)(n * cols), "xq", err);
            float *qd = (float *)dalloc(&m, sizeof(float) * (size_t)(n * (cols / 32 + 1)), "xq scales", err);
            int32_t *qs = (int32_t *)dalloc(&m, sizeof(int32_t) * (size_t)(n * (cols / 32 + 1)), "xq sums", err);
            int32_t *sl = (int32_t *)dalloc(&m, sizeof(int32_t) * 2 * (size_t)n, "slots", err);
            if (!ok) rc = pt_err(err, PETREL_EUNSUPPORTED, "the int8 GEMV takes q8_g32 and q4_g64 (whole groups), not %s [%lld x %lld]",
                                 pt_qtype_name(W->qtype), (long long)W->rows, (long long)cols);
            else if (!q || !qd || !qs || !sl) rc = PETREL_ENOMEM;
            if (!rc) {
                cu_xq X = {q, qd, qs, cols, cols / (ok == 2 ? 64 : 32), cols / 32};
                cuk_actq(m.st, dx, cols, n, (int)cols, ok == 2, X);
                if (path == 4) {
                    for (int r0 = 0; r0 < n; r0 += 8) {
                        cu_xq Xr = X;
                        Xr.q += r0 * X.ldq, Xr.d += r0 * X.ldd, Xr.s += r0 * X.lds;
                        cuk_gemv_q(m.st, G, Xr, dy + (size_t)r0 * W->rows, W->rows, n - r0 < 8 ? n - r0 : 8, NULL, NULL);
                    }
                } else {
                    rc = check_reversed_slots(sl, n, err);
                    if (!rc) cuk_gemv_q(m.st, G, X, dy, W->rows, n, sl, sl + n);
                }
            }
        } else if (path == 6 || path == 7) { /* the quantized path's GEMM: int8 tensor cores; 7 over a row list (one expert's tiles) */
            int64_t cols = W->cols;
            int okm = cuk_gemm_q_ok(G), mt = n / 64 + 2;
            int32_t *rl = path == 7 ? (int32_t *)dalloc(&m, sizeof(int32_t) * (size_t)(2 * n + 3 * mt + 1), "row list", err) : NULL;
            if (path == 7 && !rl) rc = PETREL_ENOMEM;
            int8_t *q = (int8_t *)dalloc(&m, (size_t)(n * cols), "xq", err);
            float *qd = (float *)dalloc(&m, sizeof(float) * (size_t)(n * (cols / 32 + 1)), "xq scales", err);
            int32_t *qs = (int32_t *)dalloc(&m, sizeof(int32_t) * (size_t)(n * (cols / 32 + 1)), "xq sums", err);
            if (!okm) rc = pt_err(err, PETREL_EUNSUPPORTED, "the int8 GEMM takes q8_g32 and q4_g64 of whole 64 columns, not %s [%lld x %lld]",
                                  pt_qtype_name(W->qtype), (long long)W->rows, (long long)cols);
            else if (!q || !qd || !qs) rc = PETREL_ENOMEM;
            if (!rc) {
                cu_xq X = {q, qd, qs, cols, cols / (okm == 2 ? 64 : 32), cols / 32};
                cuk_actq(m.st, dx, cols, n, (int)cols, okm == 2 ? 2 : 0, X);
                if (path == 7) { /* every row chooses expert 0 of 1: the list is the rows in order */
                    int32_t *idx = rl, *list = rl + n, *tiles = rl + 2 * n, *nt = tiles + 3 * mt;
                    cudaMemsetAsync(idx, 0, sizeof(int32_t) * (size_t)n, m.st);
                    cuk_moe_sort(m.st, idx, n, 1, 1, 64, list, tiles, nt);
                    cuk_gemm_q(m.st, G, X, dy, W->rows, n, tiles, nt, mt, list, NULL);
                } else {
                    cuk_gemm_q(m.st, G, X, dy, W->rows, n, NULL, NULL, 0, NULL, NULL);
                }
            }
        } else if (path == 14) { /* q8 on the TMA GEMM: the weights unpacked once into bf16 */
            int64_t cols = W->cols;
            __nv_bfloat16 *xh = (__nv_bfloat16 *)dalloc(&m, sizeof(__nv_bfloat16) * (size_t)(n * cols), "x bf16", err);
            __nv_bfloat16 *wb = (__nv_bfloat16 *)dalloc(&m, sizeof(__nv_bfloat16) * (size_t)(W->rows * cols), "weights bf16", err);
            if (!cuk_gemm_w8_ok(G))
                rc = pt_err(err, PETREL_EUNSUPPORTED, "the TMA GEMM takes q8 weights of groups of a power of two >= 32 columns and whole 64 columns, not %s [%lld x %lld]",
                            pt_qtype_name(W->qtype), (long long)W->rows, (long long)cols);
            else if (!xh || !wb) rc = PETREL_ENOMEM;
            if (!rc) {
                cuk_xbf16g8(m.st, dx, cols, n, (int)cols, xh, cols);
                cuk_w8_bf16g(m.st, G, wb);
                if (cuk_gemm_tma(m.st, wb, W->rows, cols, xh, cols, dy, W->rows, n))
                    rc = pt_err(err, PETREL_EUNSUPPORTED, "the TMA GEMM: the driver has no tensor maps, or the operands do not fit one");
            }
        } else if (path == 15 || path == 16) { /* q4 on the TMA-loaded wgmma GEMM: plain rows, or over a row list (x gathered by it) */
            int64_t cols = W->cols;
            int mt = n / 64 + 2;
            int32_t *rl = path == 16 ? (int32_t *)dalloc(&m, sizeof(int32_t) * (size_t)(3 * n + 3 * mt + 1), "row list", err) : NULL;
            __nv_bfloat16 *xh = (__nv_bfloat16 *)dalloc(&m, sizeof(__nv_bfloat16) * (size_t)(n * cols), "x bf16", err);
            if (!cuk_gemm_w4t_ok(G, 1))
                rc = pt_err(err, PETREL_EUNSUPPORTED, "the TMA-loaded GEMM takes q4 weights of groups of 32 or 64 columns and whole 256 columns, not %s [%lld x %lld]",
                            pt_qtype_name(W->qtype), (long long)W->rows, (long long)cols);
            else if (!xh || (path == 16 && !rl)) rc = PETREL_ENOMEM;
            if (!rc) {
                int launched = -1;
                if (path == 16) { /* every row chooses expert 0 of 1: the list is the rows in order; x rows
                                   * uploaded in reverse and gathered back through a second map */
                    int32_t *idx = rl, *list = rl + n, *tiles = rl + 2 * n, *nt = tiles + 3 * mt, *rev = nt + 1;
                    int32_t *hr = (int32_t *)malloc(sizeof(int32_t) * (size_t)n);
                    float *hx = (float *)malloc(sizeof(float) * (size_t)(n * cols));
                    float *dxr = (float *)dalloc(&m, sizeof(float) * (size_t)(n * cols), "x reversed", err);
                    rc = hr && hx && dxr ? 0 : PETREL_ENOMEM;
                    for (int i = 0; !rc && i < n; i++) hr[i] = n - 1 - i, memcpy(hx + (size_t)(n - 1 - i) * cols, x + (size_t)i * cols, sizeof(float) * cols);
                    if (!rc) rc = up_copy(rev, hr, sizeof(int32_t) * (size_t)n, err);
                    if (!rc) rc = up_copy(dxr, hx, sizeof(float) * (size_t)(n * cols), err);
                    free(hr), free(hx);
                    if (!rc) {
                        cudaMemsetAsync(idx, 0, sizeof(int32_t) * (size_t)n, m.st);
                        cuk_moe_sort(m.st, idx, n, 1, 1, cuk_gemm_w4g_rows(), list, tiles, nt);
                        cuk_xbf16g_rows(m.st, dxr, cols, n, (int)cols, list, rev, xh, cols);
                        launched = cuk_gemm_w4t(m.st, G, 1, xh, cols, dy, W->rows, n, tiles, nt, mt, list);
                    }
                } else {
                    cuk_xbf16g(m.st, dx, cols, n, (int)cols, xh, cols);
                    launched = cuk_gemm_w4t(m.st, G, 1, xh, cols, dy, W->rows, n, NULL, NULL, 0, NULL);
                }
                if (!rc && launched) rc = pt_err(err, PETREL_EUNSUPPORTED, "the TMA-loaded GEMM: the driver has no tensor maps, or the operands do not fit one");
            }
        } else if (path >= 8 && path <= 13) { /* the bf16 GEMM over q4 weights; 9 over a row list (one expert's 128-row tiles); 10, 11 on wgmma; 12, 13 on wgmma over q8 */
            int64_t cols = W->cols;
            int mt = n / 64 + 2;
            const int wg = path >= 10, q8 = path >= 12, listed = path % 2;
            auto xbf16 = q8 ? cuk_xbf16g8 : wg ? cuk_xbf16g : cuk_xbf16p;
            auto gemm = q8 ? cuk_gemm_w8g : wg ? cuk_gemm_w4g : cuk_gemm_w4;
            int32_t *rl = listed ? (int32_t *)dalloc(&m, sizeof(int32_t) * (size_t)(2 * n + 3 * mt + 1), "row list", err) : NULL;
            __nv_bfloat16 *xh = (__nv_bfloat16 *)dalloc(&m, sizeof(__nv_bfloat16) * (size_t)(n * cols), "x bf16", err);
            if (!(q8 ? cuk_gemm_w8_ok(G) : cuk_gemm_w4_ok(G)))
                rc = pt_err(err, PETREL_EUNSUPPORTED, "the bf16 GEMM takes %s weights of groups of a power of two >= 32 columns and whole 64 columns, not %s [%lld x %lld]",
                            q8 ? "q8" : "q4", pt_qtype_name(W->qtype), (long long)W->rows, (long long)cols);
            else if (!xh || (listed && !rl)) rc = PETREL_ENOMEM;
            if (!rc) {
                xbf16(m.st, dx, cols, n, (int)cols, xh, cols);
                if (listed) { /* every row chooses expert 0 of 1: the list is the rows in order */
                    int32_t *idx = rl, *list = rl + n, *tiles = rl + 2 * n, *nt = tiles + 3 * mt;
                    cudaMemsetAsync(idx, 0, sizeof(int32_t) * (size_t)n, m.st);
                    cuk_moe_sort(m.st, idx, n, 1, 1, wg ? cuk_gemm_w4g_rows() : 128, list, tiles, nt);
                    gemm(m.st, G, xh, cols, dy, W->rows, n, tiles, nt, mt, list, NULL);
                } else {
                    gemm(m.st, G, xh, cols, dy, W->rows, n, NULL, NULL, 0, NULL, NULL);
                }
            }
        } else if (path == 1 || (path == 0 && n <= 8)) {
            for (int r0 = 0; r0 < n; r0 += 8) cuk_gemv(m.st, G, dx + (size_t)r0 * W->cols, W->cols, dy + (size_t)r0 * W->rows, W->rows, n - r0 < 8 ? n - r0 : 8, NULL, NULL);
        } else {
            cuk_gemm(m.st, G, dx, W->cols, dy, W->rows, n, NULL, NULL, 0, NULL, NULL, path == 3);
        }
        if (!rc) rc = check_fetch(&m, y, dy, sizeof(float) * n * W->rows, "matmul", err);
    }
    check_done(&m);
    return rc;
}

extern "C" int cu_swiglu_check(const pt_wview *Wg, const pt_wview *Wu, const float *x, int n, float *y, int slots, petrel_error *err) {
    cu_model m;
    PT_TRY(check_model(&m, err));
    dw G, U;
    int rc = up_w(&m, Wg, "test gate", &G, err);
    if (!rc) rc = up_w(&m, Wu, "test up", &U, err);
    int ok = rc ? 0 : cuk_gemv_q_ok(G);
    int64_t cols = Wg->cols, rows = Wg->rows;
    if (!rc && (!ok || cuk_gemv_q_ok(U) != ok || Wu->rows != rows || Wu->cols != cols || n < 1 || (!slots && n > 8)))
        rc = pt_err(err, PETREL_EUNSUPPORTED, "the int8 SwiGLU check takes two weights of one int8 format and shape, 1..8 rows (any with slots)");
    float *dx = NULL, *dy = NULL, *du = NULL, *qd = NULL;
    int8_t *q = NULL;
    int32_t *qs = NULL, *sl = NULL;
    if (!rc) {
        dx = (float *)dalloc(&m, sizeof(float) * n * cols, "x", err), dy = (float *)dalloc(&m, sizeof(float) * n * rows, "y", err);
        du = (float *)dalloc(&m, sizeof(float) * n * rows, "up", err), q = (int8_t *)dalloc(&m, (size_t)(n * cols), "xq", err);
        qd = (float *)dalloc(&m, sizeof(float) * (size_t)(n * (cols / 32)), "xq scales", err);
        qs = (int32_t *)dalloc(&m, sizeof(int32_t) * (size_t)(n * (cols / 32)), "xq sums", err);
        sl = (int32_t *)dalloc(&m, sizeof(int32_t) * 2 * (size_t)n, "slots", err);
        if (!dx || !dy || !du || !q || !qd || !qs || !sl) rc = PETREL_ENOMEM;
    }
    if (!rc) rc = up_copy(dx, x, sizeof(float) * n * cols, err);
    if (!rc && slots) rc = check_reversed_slots(sl, n, err); /* slot i on x row n-1-i, as cu_matmul_check's path 5 */
    if (!rc) {
        cu_xq X = {q, qd, qs, cols, cols / (ok == 2 ? 64 : 32), cols / 32};
        cuk_actq(m.st, dx, cols, n, (int)cols, ok == 2, X);
        cuk_gemv_swiglu_q(m.st, G, U, X, dy, rows, n, slots ? sl : NULL, slots ? sl + n : NULL, du);
        rc = check_fetch(&m, y, dy, sizeof(float) * n * rows, "swiglu", err);
    }
    check_done(&m);
    return rc;
}

/* the head products of T rows as a forward runs them (cu.h) */
extern "C" int cu_head_check(const pt_wview *kvb, const float *x, int T, int NH, int Dn, int Dr, int Dv, int uv, int tc, float *y,
                             petrel_error *err) {
    cu_model m;
    PT_TRY(check_model(&m, err));
    dw K;
    int rc = up_w(&m, kvb, "test kv_b", &K, err), Rkv = (int)kvb->cols;
    if (!rc && (T < 1 || kvb->rows != (int64_t)NH * (Dn + Dv) || (!uv && T <= 8 && !cuk_mla_uk_direct(K, Rkv, Dn))))
        rc = pt_err(err, PETREL_EUNSUPPORTED, "the head products' check takes a kv_b of NH (Dn + Dv) rows (q8_g32 for W_UK of up to 8 rows)");
    const size_t xn = (size_t)T * NH * (uv ? Rkv : Dn + Dr), yn = (size_t)T * NH * (uv ? Dv : Rkv);
    float *dx = NULL, *dy = NULL;
    if (!rc) {
        dx = (float *)dalloc(&m, sizeof(float) * xn, "x", err);
        dy = (float *)dalloc(&m, sizeof(float) * yn, "y", err);
        if (!dx || !dy) rc = PETREL_ENOMEM;
    }
    if (!rc) rc = up_copy(dx, x, sizeof(float) * xn, err);
    if (!rc) {
        if (uv) cuk_mla_uv(m.st, K, dx, dy, T, NH, Dn, Dv, Rkv, NULL, tc);
        else cuk_mla_uk(m.st, K, dw{}, dx, dy, T, NH, Dn, Dr, Dv, Rkv, NULL, tc);
        rc = check_fetch(&m, y, dy, sizeof(float) * yn, uv ? "W_UV" : "W_UK", err);
    }
    check_done(&m);
    return rc;
}

extern "C" int cu_attn_check(const float *q, const float *qt, const float *kv, int cap, const int32_t *sel, int ld_sel, const int *seln, int T,
                             int NH, int Dn, int Dr, int Rkv, float scale, int flash, float *lat, petrel_error *err) {
    if (T < 1 || cap < 1 || ld_sel < 1) return pt_err(err, PETREL_EINVAL, "the attention check takes rows, keys and a selection");
    cu_model m;
    PT_TRY(check_model(&m, err));
    int D = Rkv + Dr, nmax = 1, rc = 0;
    for (int r = 0; r < T; r++) nmax = seln[r] > nmax ? seln[r] : nmax;
    float *dq = (float *)dalloc(&m, sizeof(float) * (size_t)T * NH * (Dn + Dr), "q", err);
    float *dqt = (float *)dalloc(&m, sizeof(float) * (size_t)T * NH * Rkv, "q~", err);
    float *dkv = (float *)dalloc(&m, sizeof(float) * (size_t)cap * D, "keys", err);
    int32_t *dsel = (int32_t *)dalloc(&m, sizeof(int32_t) * (size_t)T * ld_sel, "sel", err);
    int *dn = (int *)dalloc(&m, sizeof(int) * T, "seln", err);
    cu_rowinfo *dri = (cu_rowinfo *)dalloc(&m, sizeof(cu_rowinfo) * T, "rows", err);
    float *dS = (float *)dalloc(&m, sizeof(float) * (size_t)T * NH * nmax * (T <= 8 ? CU_ATTN_DSPLIT : 1), "S", err);
    float *dp = (float *)dalloc(&m, sizeof(float) * (size_t)(T <= 8 ? T * CU_ATTN_SPLITS : 1) * NH * Rkv, "partial", err);
    float *dl = (float *)dalloc(&m, sizeof(float) * (size_t)T * NH * Rkv, "lat", err);
    if (!dq || !dqt || !dkv || !dsel || !dn || !dri || !dS || !dp || !dl) rc = PETREL_ENOMEM;
    cu_rowinfo *hri = (cu_rowinfo *)calloc((size_t)T, sizeof(cu_rowinfo));
    if (!rc && !hri) rc = pt_err(err, PETREL_ENOMEM, "out of memory");
    for (int r = 0; !rc && r < T; r++) hri[r].kv = dkv, hri[r].cap = cap, hri[r].pos = seln[r] - 1;
    if (!rc) rc = up_copy(dq, q, sizeof(float) * (size_t)T * NH * (Dn + Dr), err);
    if (!rc) rc = up_copy(dqt, qt, sizeof(float) * (size_t)T * NH * Rkv, err);
    if (!rc) rc = up_copy(dkv, kv, sizeof(float) * (size_t)cap * D, err);
    if (!rc) rc = up_copy(dsel, sel, sizeof(int32_t) * (size_t)T * ld_sel, err);
    if (!rc) rc = up_copy(dn, seln, sizeof(int) * T, err);
    if (!rc) rc = up_copy(dri, hri, sizeof(cu_rowinfo) * T, err);
    if (!rc && flash && flash < 3 && cuk_attn_flash_ok(T, Rkv, Dr) < flash)
        rc = pt_err(err, PETREL_EUNSUPPORTED, "this one-pass attention form does not take the shape");
    if (!rc) {
        cuk_mla_attn(m.st, dq, dqt, dS, nmax, dsel, ld_sel, dn, nmax, dl, T, NH, Dn, Dr, Rkv, scale, 0, dri, dp, cuk_attn_splits(T, NH, Rkv, nmax), flash);
        rc = check_fetch(&m, lat, dl, sizeof(float) * (size_t)T * NH * Rkv, "attention", err);
    }
    free(hri);
    check_done(&m);
    return rc;
}

extern "C" int cu_nt_check(const float *A, int M, const float *B, int N, int K, float *D, petrel_error *err) {
    if (M < 1 || N < 1 || K < 1) return pt_err(err, PETREL_EINVAL, "the A B^T check takes rows and columns");
    cu_model m;
    PT_TRY(check_model(&m, err));
    float *da = (float *)dalloc(&m, sizeof(float) * (size_t)M * K, "A", err), *db = (float *)dalloc(&m, sizeof(float) * (size_t)N * K, "B", err);
    float *dd = (float *)dalloc(&m, sizeof(float) * (size_t)M * N, "D", err);
    int rc = da && db && dd ? up_copy(da, A, sizeof(float) * (size_t)M * K, err) : PETREL_ENOMEM;
    if (!rc) rc = up_copy(db, B, sizeof(float) * (size_t)N * K, err);
    if (!rc) {
        cuk_nt_wg(m.st, da, M, db, N, K, dd);
        rc = check_fetch(&m, D, dd, sizeof(float) * (size_t)M * N, "A B^T", err);
    }
    check_done(&m);
    return rc;
}

extern "C" int cu_attn_expanded_check(const pt_wview *kvb, const float *q, const float *kv, int pos0, int T, int NH, int Dn, int Dr, int Dv,
                                      float scale, int form, float *o, petrel_error *err) {
    if (T < 1 || pos0 < 0 || NH < 1 || kvb->rows != (int64_t)NH * (Dn + Dv))
        return pt_err(err, PETREL_EINVAL, "the expanded attention check takes rows and a kv_b of NH (Dn + Dv) rows");
    const int tma = form == 4; /* form 3 with kv_b's product of the keys on the TMA GEMM */
    if (tma) form = 3;
    if (form < 1 || form > 3 || (form == 3 && !cuk_attn_fa_ok(Dn + Dr, Dv)))
        return pt_err(err, PETREL_EINVAL, "the expanded attention check: no form %d for heads of %d / %d", form, Dn + Dr, Dv);
    cu_model m;
    PT_TRY(check_model(&m, err));
    dw K;
    const int Rkv = (int)kvb->cols, D = Rkv + Dr, nk = pos0 + T;
    int rc = up_w(&m, kvb, "test kv_b", &K, err);
    if (!rc && tma && !cuk_gemm_w8_ok(K))
        rc = pt_err(err, PETREL_EINVAL, "the expanded attention check: form 4 takes a q8 kv_b the TMA GEMM takes, not %s", pt_qtype_name(kvb->qtype));
    __nv_bfloat16 *dwb = !rc && tma ? (__nv_bfloat16 *)dalloc(&m, sizeof(__nv_bfloat16) * (size_t)(K.rows * K.cols), "kv_b bf16", err) : NULL;
    if (!rc && tma && !dwb) rc = PETREL_ENOMEM;
    float *dq = (float *)dalloc(&m, sizeof(float) * (size_t)T * NH * (Dn + Dr), "q", err);
    float *dkv = (float *)dalloc(&m, sizeof(float) * (size_t)nk * D, "keys", err);
    float *dkx = (float *)dalloc(&m, sizeof(float) * (size_t)NH * nk * (Dn + (Dr > Dv ? Dr : Dv)), "expanded keys", err);
    float *dvx = (float *)dalloc(&m, sizeof(float) * (size_t)NH * nk * Dv, "expanded values", err);
    float *dS = (float *)dalloc(&m, sizeof(float) * (size_t)T * NH * nk, "S", err);
    float *dout = (float *)dalloc(&m, sizeof(float) * (size_t)T * NH * Dv, "o", err);
    int *dn = (int *)dalloc(&m, sizeof(int) * T, "seln", err);
    __nv_bfloat16 *dxb = form == 3 ? (__nv_bfloat16 *)dalloc(&m, cuk_attn_fa_bytes(NH, nk, Dn + Dr, Dv, Rkv), "bf16 keys", err) : NULL;
    int *hn = (int *)malloc(sizeof(int) * T);
    if (!rc && (!dq || !dkv || !dkx || !dvx || !dS || !dout || !dn || !hn || (form == 3 && !dxb))) rc = PETREL_ENOMEM;
    for (int r = 0; !rc && r < T; r++) hn[r] = pos0 + r + 1;
    if (!rc) rc = up_copy(dq, q, sizeof(float) * (size_t)T * NH * (Dn + Dr), err);
    if (!rc) rc = up_copy(dkv, kv, sizeof(float) * (size_t)nk * D, err);
    if (!rc) rc = up_copy(dn, hn, sizeof(int) * T, err);
    if (!rc) {
        if (cuk_mla_attn_expanded(m.st, K, dkv, nk, dq, dkx, dvx, dS, nk, dn, dout, T, NH, Dn, Dr, Dv, Rkv, scale, form, dxb, dwb))
            rc = pt_err(err, PETREL_EUNSUPPORTED, "expanded attention: form 3's tensor maps could not be made");
        else
            rc = check_fetch(&m, o, dout, sizeof(float) * (size_t)T * NH * Dv, "expanded attention", err);
    }
    free(hn);
    check_done(&m);
    return rc;
}

extern "C" int cu_route_check(const float *lg, const float *bias, int T, int E, int K, int n_group, int topk_group, int norm, float scale, int regs,
                              int32_t *idx, float *wts, petrel_error *err) {
    if (T < 1 || E < 1 || E > 1024 || K < 1 || K > 32 || K > E) return pt_err(err, PETREL_EINVAL, "the router check takes 1..1024 experts and 1..32 choices");
    cu_model m;
    PT_TRY(check_model(&m, err));
    float *dl = (float *)dalloc(&m, sizeof(float) * (size_t)T * E, "logits", err), *db = (float *)dalloc(&m, sizeof(float) * E, "bias", err);
    int32_t *di = (int32_t *)dalloc(&m, sizeof(int32_t) * (size_t)T * K, "idx", err), *dx = (int32_t *)dalloc(&m, sizeof(int32_t) * (size_t)T * K, "x", err);
    float *dw_ = (float *)dalloc(&m, sizeof(float) * (size_t)T * K, "wts", err);
    int rc = dl && db && di && dx && dw_ ? 0 : PETREL_ENOMEM;
    if (!rc) rc = up_copy(dl, lg, sizeof(float) * (size_t)T * E, err);
    if (!rc) rc = up_copy(db, bias, sizeof(float) * E, err);
    if (!rc) {
        cu_route_cfg rcfg = {E, K, n_group, topk_group, norm, scale};
        cuk_route(m.st, dl, db, T, rcfg, di, dw_, dx, regs);
        rc = check_fetch(&m, idx, di, sizeof(int32_t) * (size_t)T * K, "route", err);
        if (!rc) rc = check_fetch(&m, wts, dw_, sizeof(float) * (size_t)T * K, "route", err);
    }
    check_done(&m);
    return rc;
}

extern "C" int cu_swiglu_bf16_check(const float *g, const float *u, int n, int cols, int q, uint16_t *fused, uint16_t *twin, uint16_t *rev,
                                    petrel_error *err) {
    if (n < 1 || cols < 64 || cols % 64 || (q != 4 && q != 8))
        return pt_err(err, PETREL_EINVAL, "the SwiGLU bf16 check takes n >= 1 rows of whole 64 columns in order 4 or 8");
    cu_model m;
    PT_TRY(check_model(&m, err));
    const size_t e = (size_t)n * cols;
    float *dg = (float *)dalloc(&m, sizeof(float) * e, "gate", err), *du = (float *)dalloc(&m, sizeof(float) * e, "up", err);
    __nv_bfloat16 *dh = (__nv_bfloat16 *)dalloc(&m, 3 * sizeof(__nv_bfloat16) * e, "h", err);
    int32_t *dm = (int32_t *)dalloc(&m, sizeof(int32_t) * (size_t)n, "rows", err), *hm = (int32_t *)malloc(sizeof(int32_t) * (size_t)n);
    int rc = dg && du && dh && dm && hm ? up_copy(dg, g, sizeof(float) * e, err) : PETREL_ENOMEM;
    if (!rc) rc = up_copy(du, u, sizeof(float) * e, err);
    for (int i = 0; !rc && i < n; i++) hm[i] = n - 1 - i;
    if (!rc) rc = up_copy(dm, hm, sizeof(int32_t) * (size_t)n, err);
    free(hm);
    if (!rc) {
        if (q == 4) {
            cuk_swiglu_bf16g(m.st, dg, du, cols, n, cols, dh, cols);
            cuk_swiglu_bf16g_rows(m.st, dg, du, cols, n, cols, dm, dh + 2 * e, cols);
        } else {
            cuk_swiglu_bf16g8(m.st, dg, du, cols, n, cols, dh, cols);
        }
        cuk_silu_mul(m.st, dg, du, (int64_t)e);
        if (q == 4) cuk_xbf16g(m.st, dg, cols, n, cols, dh + e, cols);
        else cuk_xbf16g8(m.st, dg, cols, n, cols, dh + e, cols);
        rc = check_fetch(&m, fused, dh, sizeof(uint16_t) * e, "swiglu bf16", err);
        if (!rc) rc = check_fetch(&m, twin, dh + e, sizeof(uint16_t) * e, "swiglu bf16", err);
        if (!rc && q == 4) rc = check_fetch(&m, rev, dh + 2 * e, sizeof(uint16_t) * e, "swiglu bf16", err);
    }
    check_done(&m);
    return rc;
}

extern "C" int cu_moe_sort_check(const int32_t *idx, int T, int K, int E, int tm, int32_t *list, int32_t *tiles, int *ntiles, petrel_error *err) {
    if (T < 1 || K < 1 || E < 1 || tm < 1) return pt_err(err, PETREL_EINVAL, "the sort check takes T, K, E and tm >= 1");
    for (int64_t i = 0; i < (int64_t)T * K; i++)
        if (idx[i] < 0 || idx[i] >= E) return pt_err(err, PETREL_EINVAL, "the sort check's expert ids are 0..E-1");
    cu_model m;
    PT_TRY(check_model(&m, err));
    const size_t n = (size_t)T * K, mt = (size_t)E + n / tm + 1;
    int32_t *di = (int32_t *)dalloc(&m, sizeof(int32_t) * n, "idx", err), *dl = (int32_t *)dalloc(&m, sizeof(int32_t) * n, "list", err);
    int32_t *dt = (int32_t *)dalloc(&m, sizeof(int32_t) * (3 * mt + 1), "tiles", err);
    int rc = di && dl && dt ? up_copy(di, idx, sizeof(int32_t) * n, err) : PETREL_ENOMEM;
    if (!rc) {
        cuk_moe_sort(m.st, di, T, K, E, tm, dl, dt, dt + 3 * mt);
        rc = check_fetch(&m, ntiles, dt + 3 * mt, sizeof(int), "sort", err);
        if (!rc && (*ntiles < 0 || (size_t)*ntiles > mt)) rc = pt_err(err, PETREL_ERANGE, "the sort made %d tiles (at most %zu)", *ntiles, mt);
        if (!rc) rc = check_fetch(&m, list, dl, sizeof(int32_t) * n, "sort", err);
        if (!rc) rc = check_fetch(&m, tiles, dt, sizeof(int32_t) * 3 * (size_t)*ntiles, "sort", err);
    }
    check_done(&m);
    return rc;
}

extern "C" int cu_dsa_scores_check(const float *q, const float *w, const float *keys, int T, int Hi, int Di, int n, float *score, petrel_error *err) {
    if (T < 1 || Hi < 1 || Di < 1 || n < 1 || Di > 512) return pt_err(err, PETREL_EINVAL, "cu_dsa_scores_check: empty shape or Di past 512");
    cu_model m;
    PT_TRY(check_model(&m, err));
    float *dq = (float *)dalloc(&m, sizeof(float) * T * Hi * Di, "q", err), *dw = (float *)dalloc(&m, sizeof(float) * T * Hi, "w", err);
    float *dk = (float *)dalloc(&m, sizeof(float) * (size_t)n * Di, "keys", err), *dsc = (float *)dalloc(&m, sizeof(float) * (size_t)T * n, "scores", err);
    int32_t *dsel = (int32_t *)dalloc(&m, sizeof(int32_t) * (size_t)T * n, "sel", err);
    int *dseln = (int *)dalloc(&m, sizeof(int) * T, "seln", err), *dalw = (int *)dalloc(&m, sizeof(int) * T, "always", err);
    cu_rowinfo *dri = (cu_rowinfo *)dalloc(&m, sizeof(cu_rowinfo) * T, "rows", err);
    int rc = dq && dw && dk && dsc && dsel && dseln && dalw && dri ? 0 : PETREL_ENOMEM;
    if (!rc) { /* every row at position n - 1 of one session whose layer 0 holds the keys, scored though every key fits */
        cu_rowinfo *ri = (cu_rowinfo *)calloc((size_t)T, sizeof *ri);
        int *alw = (int *)malloc(sizeof(int) * T);
        if (!ri || !alw) rc = pt_err(err, PETREL_ENOMEM, "cu_dsa_scores_check: out of memory");
        for (int r = 0; !rc && r < T; r++) ri[r].ix = dk, ri[r].cap = n, ri[r].pos = n - 1, alw[r] = 1;
        if (!rc) rc = up_copy(dq, q, sizeof(float) * T * Hi * Di, err);
        if (!rc) rc = up_copy(dw, w, sizeof(float) * T * Hi, err);
        if (!rc) rc = up_copy(dk, keys, sizeof(float) * (size_t)n * Di, err);
        if (!rc) rc = up_copy(dri, ri, sizeof(cu_rowinfo) * T, err);
        if (!rc) rc = up_copy(dalw, alw, sizeof(int) * T, err);
        free(ri), free(alw);
    }
    if (!rc) {
        cuk_dsa_select(m.st, dq, dw, dsc, n, dsel, n, dseln, T, Hi, Di, n, 0, dri, dalw, n);
        rc = check_fetch(&m, score, dsc, sizeof(float) * (size_t)T * n, "dsa scores", err);
    }
    check_done(&m);
    return rc;
}

extern "C" int cu_tf32_split_check(const float *x, int n, uint32_t *out, petrel_error *err) {
    if (n < 1) return pt_err(err, PETREL_EINVAL, "cu_tf32_split_check: no values");
    cu_model m;
    PT_TRY(check_model(&m, err));
    float *dx = (float *)dalloc(&m, sizeof(float) * (size_t)n, "x", err);
    uint32_t *d_o = (uint32_t *)dalloc(&m, sizeof(uint32_t) * 4 * (size_t)n, "split", err);
    int rc = dx && d_o ? up_copy(dx, x, sizeof(float) * (size_t)n, err) : PETREL_ENOMEM;
    if (!rc) {
        cuk_tf32_split_check(m.st, dx, n, d_o);
        rc = check_fetch(&m, out, d_o, sizeof(uint32_t) * 4 * (size_t)n, "tf32 split", err);
    }
    check_done(&m);
    return rc;
}

extern "C" int cu_topk_check(const float *v, int n, int k, int32_t *idx, petrel_error *err) {
    cu_model m;
    PT_TRY(check_model(&m, err));
    float *dv = (float *)dalloc(&m, sizeof(float) * (n > 0 ? n : 1), "v", err);
    int32_t *di = (int32_t *)dalloc(&m, sizeof(int32_t) * (k > 0 ? k : 1), "idx", err);
    int rc = dv && di ? up_copy(dv, v, sizeof(float) * n, err) : PETREL_ENOMEM;
    if (!rc) {
        cuk_topk(m.st, dv, n, k, di);
        rc = check_fetch(&m, idx, di, sizeof(int32_t) * k, "topk", err);
    }
    check_done(&m);
    return rc;
}
