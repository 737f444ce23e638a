/* tiers.cu: the expert tiers of the CUDA backend: HBM slots over the host's RAM over the SSD.
 *
 * GLM-5.2's routed experts (~380 GB at int4) do not fit one GPU. When a model's experts do not
 * all fit the VRAM budget, or the host streams them under a memory budget (the expert store of
 * src/experts: RAM slots over the pack), or vram_expert_slots asks for it, each MoE layer keeps
 * S experts in HBM slots (plain layout, f32 scales: what the GEMV / GEMM kernels read), and
 *
 *   1. after the layer's router, the chunk's routing comes back to the host (one small copy,
 *      one stream sync);
 *   2. the distinct experts it chose, ascending, are taken in waves of at most S; a wave's
 *      experts that are not in a slot (misses) get slots the policy frees (src/experts/policy.c,
 *      the CPU store's adaptive decayed frequency, over this layer's HBM accesses; a slot of the
 *      current wave is never taken);
 *   3. a miss's bytes come from the host: the engine's resident views, or an acquire from the
 *      expert store (a RAM hit, or a read from the SSD); they are copied over PCIe in their
 *      stored form (direct DMA when the store's slot memory could be registered) and turned into
 *      the slot's plain layout and f32 scales by a kernel (cuk_unpack);
 *   4. the wave's choices run on their slots through the same expert kernels as the resident
 *      path (experts_compute; the form, GEMV or GEMM, chosen by the whole chunk's choices as
 *      there), into yk directly when one wave holds the whole chunk, else into scratch and then
 *      scattered to their places; the combine then sums them in ascending expert id as always.
 *
 * The kernels see the same bytes in the same order with the same tiles per expert, so tiered
 * logits are bitwise those of the fully resident GPU path (tests/test_cuda.c).
 *
 * The other way to serve a miss (host_experts on, KTransformers' way): compute its rows on the
 * host CPU from RAM while the GPU copies and runs the rest. For chunks of at most CU_HOST_ROWS
 * choices (decode, small batches) the misses are split between the two by a cost model: the
 * link's measured bandwidth (probed at open) against the host's measured time per expert byte
 * (a running average of what the host computations took), so both finish together. The host's
 * kernels are the CPU engine's with exact f32 activations (plain layouts; row-interleaved packs
 * take the int8-activation kernel), so its outputs agree with the GPU's to float rounding, not
 * bitwise: the choice is off by default. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "base/clock.h"
#include "experts/xs.h"
#include "kernels/kernels.h"
#include "quant/quant.h"
}
#include "cuda/cu_model.h"

#define CU_HOST_ROWS 64 /* choices per chunk up to which misses may run on the host */

struct cu_tier_layer {
    int32_t *slot_of; /* [E]: the slot holding expert e, -1 */
    int32_t *exp_of;  /* [S]: the expert in slot s, -1 */
    xs_pol pol;       /* eviction order over this layer's HBM accesses */
    int pol_ok;
};

struct cu_tiers {
    int S, E, K;
    cu_tier_layer *L;      /* [num_hidden_layers]; MoE layers only */
    uint8_t *raw;          /* device: one weight's raw bytes (row-interleaved data, stored scales) */
    size_t raw_data;       /* where the scales start in raw */
    int32_t *h_idx;        /* pinned [rows * K]: the chunk's routing */
    int32_t *h_w;          /* pinned [3][rows * K]: the waves' choices (slot, x row, place) */
    int32_t *u, *miss;     /* [E]: the chunk's experts ascending, a wave's misses */
    uint8_t *chosen, *inwave; /* [E] */
    xs_expert_ref *refs;   /* [E] */
    float *f32;            /* pinned: an FP8 weight expanded to f32 (grown on demand) */
    size_t f32_cap;
    void **reg;            /* host ranges registered (pinned) for direct copies: the store's
                              slot memory, or the resident experts' pages */
    int n_reg;
    uint64_t reg_bytes;
    cu_tier_stats st;
    /* host compute of misses (host_experts): the cost model and the buffers */
    int host;              /* host_experts on */
    kn_table kt;           /* the host's kernels: the engine's, exact f32 activations */
    double link_ns_b;      /* ns per byte over PCIe (probed at open) */
    double host_ns_b;      /* ns per expert byte on the host (running average) */
    float *hx, *hy;        /* pinned [CU_HOST_ROWS / K][H] the chunk's x rows, [CU_HOST_ROWS][H] host outputs */
    float *xs, *gb, *ub;   /* [CU_HOST_ROWS][H], [CU_HOST_ROWS][I] x 2 */
    uint64_t expert_bytes; /* host bytes of one expert (gate, up, down) */
};

static int64_t dtype_bytes(int sdt) { return sdt == PT_F32 ? 4 : 2; }

/* the HBM form of one stored weight: its header as up_stack makes it (no data) */
static int slot_shape(const pt_wview *W, int l, const char *what, dw *o, petrel_error *err) {
    memset(o, 0, sizeof *o);
    int ok = W->layout == PT_LAYOUT_PLAIN || (W->layout == PT_LAYOUT_R16 && (W->qtype == PT_Q8_G32 || W->qtype == PT_Q4_G64));
    switch (W->qtype) {
    case PT_F32: case PT_BF16: case PT_F16: case PT_Q8_ROW: case PT_Q8_G32: case PT_Q4_G64: case PT_FP8_E4M3: break;
    default: ok = 0;
    }
    if (!ok || !W->rows || !W->cols)
        return pt_err(err, PETREL_EUNSUPPORTED, "cuda: layer %d %s is %s in a layout the GPU's expert slots do not read", l, what, pt_qtype_name(W->qtype));
    o->rows = W->rows, o->cols = W->cols;
    if (W->qtype == PT_FP8_E4M3) { /* expanded to f32, as at upload */
        o->qt = PT_F32, o->rb = W->cols * 4;
    } else {
        o->qt = W->qtype, o->rb = W->row_bytes;
        o->g = (int)pt_qtype_group(W->qtype, W->cols);
        o->sc = pt_qtype_scales_per_row(W->qtype, W->cols);
    }
    o->estride = (o->rows * o->rb + 255) / 256 * 256;
    o->sstride = (o->rows * o->sc + 63) / 64 * 64;
    return 0;
}

/* raw staging a weight needs: its data when row-interleaved, then its stored scales */
static void raw_need(const pt_wview *W, size_t *data, size_t *scales) {
    size_t d = W->layout == PT_LAYOUT_R16 ? (size_t)(W->rows * W->row_bytes) : 0;
    size_t s = W->scale && W->qtype != PT_FP8_E4M3 ? (size_t)(W->rows * W->scale_cols * dtype_bytes(W->scale_dtype)) : 0;
    d = (d + 255) / 256 * 256;
    if (d > *data) *data = d;
    if (s > *scales) *scales = s;
}

typedef struct hrange {
    uintptr_t a, b;
} hrange;
static int hr_cmp(const void *x, const void *y) {
    const hrange *p = (const hrange *)x, *q = (const hrange *)y;
    return p->a < q->a ? -1 : p->a > q->a;
}
static void hr_add(hrange *r, int *n, const void *p, size_t bytes) {
    if (!p || !bytes) return;
    r[*n].a = (uintptr_t)p, r[*n].b = (uintptr_t)p + bytes, (*n)++;
}

/* Copies over PCIe run at the link's speed only from pinned memory (pageable memory goes
 * through the driver's bounce buffers: ~7 GB/s measured against ~55 on the H200's host). So the
 * host tier is registered with the GPU: the store's slot block, or the pages of the resident
 * experts (every MoE layer's span of data and scales, merged where they touch). Where the OS
 * refuses (a locked-memory limit), copies stay pageable: slower, still exact. */
static int pin_host(cu_model *m, int streams) {
    cu_tiers *T = m->tiers;
    const petrel_engine *e = m->e;
    const petrel_config *c = m->c;
    int L = c->num_hidden_layers, E = c->n_routed_experts, n = 0;
    hrange *r = (hrange *)malloc(sizeof(hrange) * ((size_t)L * 6 + 1));
    T->reg = (void **)calloc((size_t)L * 6 + 1, sizeof(void *));
    if (!r || !T->reg) {
        free(r);
        return 0; /* (no pinning: the copies stay pageable) */
    }
    if (streams) {
        uint8_t *base;
        size_t bytes;
        xs_store_memory(e->xs, &base, &bytes);
        hr_add(r, &n, base, bytes);
    } else
        for (int l = 0; l < L; l++) {
            if (!m->L[l].is_moe) continue;
            const layer_w *lw = &e->w.layers[l];
            const pt_wview *V[3] = {lw->exp_gate, lw->exp_up, lw->exp_down};
            for (int k = 0; k < 3; k++) { /* each weight kind's span over the layer's experts: data, scales */
                uintptr_t lo[2] = {UINTPTR_MAX, UINTPTR_MAX}, hi[2] = {0, 0};
                for (int x = 0; x < E; x++) {
                    const pt_wview *W = &V[k][x];
                    uintptr_t p[2] = {(uintptr_t)W->data, (uintptr_t)W->scale};
                    size_t b[2] = {(size_t)(W->rows * W->row_bytes), W->scale ? (size_t)(W->rows * W->scale_cols * dtype_bytes(W->scale_dtype)) : 0};
                    for (int j = 0; j < 2; j++)
                        if (p[j] && b[j]) {
                            if (p[j] < lo[j]) lo[j] = p[j];
                            if (p[j] + b[j] > hi[j]) hi[j] = p[j] + b[j];
                        }
                }
                for (int j = 0; j < 2; j++)
                    if (hi[j]) hr_add(r, &n, (const void *)lo[j], hi[j] - lo[j]);
            }
        }
    for (int i = 0; i < n; i++) r[i].a &= ~(uintptr_t)4095, r[i].b = (r[i].b + 4095) & ~(uintptr_t)4095;
    qsort(r, (size_t)n, sizeof *r, hr_cmp);
    int k = 0;
    for (int i = 0; i < n; i++) { /* merge what overlaps or touches */
        if (k && r[i].a <= r[k - 1].b) {
            if (r[i].b > r[k - 1].b) r[k - 1].b = r[i].b;
        } else
            r[k++] = r[i];
    }
    for (int i = 0; i < k; i++) {
        unsigned fl = streams ? cudaHostRegisterDefault : cudaHostRegisterReadOnly;
        if (cudaHostRegister((void *)r[i].a, r[i].b - r[i].a, fl) == cudaSuccess) {
            T->reg[T->n_reg++] = (void *)r[i].a;
            T->reg_bytes += r[i].b - r[i].a;
        } else
            cudaGetLastError();
    }
    free(r);
    return 0;
}

/* the host-compute side: buffers, the host's kernel table, the link's speed */
static int host_open(cu_model *m, uint64_t per, petrel_error *err) {
    cu_tiers *T = m->tiers;
    const petrel_config *c = m->c;
    int H = c->hidden_size, I = c->moe_intermediate_size;
    const layer_w *lw = NULL;
    for (int l = 0; l < c->num_hidden_layers && !lw; l++)
        if (m->L[l].is_moe) lw = &m->e->w.layers[l];
    if (!lw) return 0;
    if (lw->exp_gate[0].rows > I) I = (int)lw->exp_gate[0].rows;
    T->kt = m->e->kt;
    T->kt.act_quant = 0;
    cudaError_t ce = cudaMallocHost(&T->hx, sizeof(float) * 2 * (size_t)CU_HOST_ROWS * H);
    if (ce != cudaSuccess) return cu_fail(err, ce, "pinned host-expert buffers");
    T->hy = T->hx + (size_t)CU_HOST_ROWS * H;
    T->xs = (float *)malloc(sizeof(float) * CU_HOST_ROWS * ((size_t)H + 2 * (size_t)I));
    if (!T->xs) return pt_err(err, PETREL_ENOMEM, "out of memory");
    T->gb = T->xs + (size_t)CU_HOST_ROWS * H, T->ub = T->gb + (size_t)CU_HOST_ROWS * I;
    double gbs = cu_h2d_probe(m, 64ull << 20);
    T->link_ns_b = gbs > 0 ? 1.0 / gbs : 1.0 / 25; /* ns per byte = 1 / (GB/s) */
    T->host_ns_b = 2 * T->link_ns_b;                /* learned from the first host runs */
    T->expert_bytes = per;
    T->host = 1;
    return 0;
}

int cut_open(cu_model *m, int vram_slots, int host_experts, int *tiered, petrel_error *err) {
    const petrel_engine *e = m->e;
    const petrel_config *c = m->c;
    int L = c->num_hidden_layers, E = c->n_routed_experts, K = c->num_experts_per_tok, nmoe = 0;
    *tiered = 0;
    dw sh[3];
    uint64_t per = 0; /* HBM bytes of one expert slot (gate, up, down) */
    size_t rd = 0, rs = 0;
    for (int l = 0; l < L; l++) {
        if (!m->L[l].is_moe) continue;
        const layer_w *lw = &e->w.layers[l];
        const pt_wview *V[3] = {&lw->exp_gate[0], &lw->exp_up[0], &lw->exp_down[0]};
        uint64_t b = 0;
        for (int k = 0; k < 3; k++) {
            PT_TRY(slot_shape(V[k], l, "routed experts", &sh[k], err));
            b += (uint64_t)sh[k].estride + 4 * (uint64_t)sh[k].sstride;
            raw_need(V[k], &rd, &rs);
        }
        if (b > per) per = b;
        nmoe++;
    }
    if (!nmoe) return 0;
    int streams = e->xs != NULL;
    uint64_t left = m->budget > m->used ? m->budget - m->used : 0;
    uint64_t reserve = m->budget / 20 > (1ull << 30) ? m->budget / 20 : (1ull << 30); /* sessions' KV and the forward's scratch */
    uint64_t avail = left > reserve ? left - reserve : 0;
    if (!streams && (vram_slots == 0 || vram_slots >= E) && (vram_slots >= E || (uint64_t)nmoe * E * per <= avail)) return 0;
    /* Chunks of a prompt copy (or read) every expert they route to once: the more rows a chunk
     * has, the fewer passes over the experts a prompt makes. The largest chunk whose scratch
     * takes at most a quarter of what is left; its scratch joins the reserve. */
    int rows = cu_chunk_rows(c, left, m->rows);
    if (rows > m->rows) m->rows = rows, reserve += cu_chunk_scratch_bytes(c, rows);
    avail = left > reserve ? left - reserve : 0;
    avail = avail > rd + rs ? avail - rd - rs : 0;
    int S = vram_slots ? (vram_slots < E ? vram_slots : E) : (int)(avail / ((uint64_t)nmoe * per) < (uint64_t)E ? avail / ((uint64_t)nmoe * per) : E);
    if (S < 1 || (!vram_slots && S < K))
        return pt_err(err, PETREL_ENOMEM,
                      "cuda: the VRAM budget leaves %.2f GB for routed experts: %d slot%s per MoE layer of %.1f MB, fewer than the %d a token "
                      "chooses (raise --vram-budget, or set --vram-expert-slots)",
                      avail / 1e9, S, S == 1 ? "" : "s", per / 1e6, K);
    cu_tiers *T = (cu_tiers *)calloc(1, sizeof *T);
    if (!T) return pt_err(err, PETREL_ENOMEM, "out of memory");
    m->tiers = T;
    T->S = S, T->E = E, T->K = K, T->st.slots = S;
    T->L = (cu_tier_layer *)calloc((size_t)L, sizeof(cu_tier_layer));
    T->u = (int32_t *)malloc(sizeof(int32_t) * 2 * E);
    T->chosen = (uint8_t *)calloc(2 * (size_t)E, 1);
    T->refs = (xs_expert_ref *)calloc((size_t)E, sizeof(xs_expert_ref));
    if (!T->L || !T->u || !T->chosen || !T->refs) return pt_err(err, PETREL_ENOMEM, "out of memory");
    T->miss = T->u + E, T->inwave = T->chosen + E;
    cudaError_t ce = cudaMallocHost(&T->h_idx, sizeof(int32_t) * 4 * (size_t)m->rows * K);
    if (ce != cudaSuccess) return cu_fail(err, ce, "pinned routing staging");
    T->h_w = T->h_idx + (size_t)m->rows * K;
    T->raw_data = rd;
    if (!(T->raw = (uint8_t *)dalloc(m, rd + rs, "the expert tiers' copy staging", err))) return PETREL_ENOMEM;
    xs_policy_params prm;
    xs_policy_defaults(&prm);
    char nm[96];
    for (int l = 0; l < L; l++) {
        cu_layer *G = &m->L[l];
        if (!G->is_moe) continue;
        const layer_w *lw = &e->w.layers[l];
        dw *D[3] = {&G->eg, &G->eu, &G->ed};
        const pt_wview *V[3] = {&lw->exp_gate[0], &lw->exp_up[0], &lw->exp_down[0]};
        snprintf(nm, sizeof nm, "layer %d expert slots", l);
        for (int k = 0; k < 3; k++) {
            PT_TRY(slot_shape(V[k], l, "routed experts", D[k], err));
            if (!(D[k]->d = (const uint8_t *)dalloc(m, (size_t)D[k]->estride * S, nm, err))) return PETREL_ENOMEM;
            if (D[k]->sc && !(D[k]->s = (const float *)dalloc(m, sizeof(float) * (size_t)D[k]->sstride * S, nm, err))) return PETREL_ENOMEM;
        }
        cu_tier_layer *TL = &T->L[l];
        TL->slot_of = (int32_t *)malloc(sizeof(int32_t) * (size_t)(E + S));
        if (!TL->slot_of) return pt_err(err, PETREL_ENOMEM, "out of memory");
        TL->exp_of = TL->slot_of + E;
        for (int x = 0; x < E; x++) TL->slot_of[x] = -1;
        for (int s = 0; s < S; s++) TL->exp_of[s] = -1;
        if (xs_pol_init(&TL->pol, E, S, &prm)) return pt_err(err, PETREL_ENOMEM, "out of memory");
        TL->pol_ok = 1;
    }
    PT_TRY(pin_host(m, streams));
    if (host_experts) PT_TRY(host_open(m, per, err));
    *tiered = 1;
    return 0;
}

void cut_close(cu_model *m) {
    cu_tiers *T = m->tiers;
    if (!T) return;
    for (int i = 0; i < T->n_reg; i++) cudaHostUnregister(T->reg[i]);
    free(T->reg);
    if (T->h_idx) cudaFreeHost(T->h_idx);
    if (T->f32) cudaFreeHost(T->f32);
    if (T->hx) cudaFreeHost(T->hx);
    free(T->xs);
    for (int l = 0; T->L && l < m->c->num_hidden_layers; l++) {
        if (T->L[l].pol_ok) xs_pol_deinit(&T->L[l].pol);
        free(T->L[l].slot_of);
    }
    free(T->L), free(T->u), free(T->chosen), free(T->refs);
    free(T);
    m->tiers = NULL;
}

void cut_describe(const cu_model *m, char *buf, size_t n) {
    const cu_tiers *T = m->tiers;
    if (!T) {
        if (n) buf[0] = 0;
        return;
    }
    snprintf(buf, n, "; routed experts in %d HBM slot%s per MoE layer over the host's %s (%.2f GB of it pinned for copies)%s; chunks of %d rows", T->S,
             T->S == 1 ? "" : "s", m->e->xs ? "expert store (RAM slots over the SSD)" : "RAM", T->reg_bytes / 1e9,
             T->host ? ", misses split between copies and the host CPU" : "", m->rows);
}

extern "C" void cu_model_tier_stats(const cu_model *m, cu_tier_stats *out) {
    if (m && m->tiers) *out = m->tiers->st;
    else memset(out, 0, sizeof *out);
}

/* one stored weight V (expert x of layer l) into slot s of D */
static int copy_w(cu_model *m, const pt_wview *V, const dw &D, int s, int l, int x, petrel_error *err) {
    cu_tiers *T = m->tiers;
    cudaStream_t st = m->st;
    uint8_t *dd = (uint8_t *)D.d + (size_t)s * D.estride;
    float *ds = D.s ? (float *)D.s + (size_t)s * D.sstride : NULL;
    int fp8 = V->qtype == PT_FP8_E4M3;
    if (V->rows != D.rows || V->cols != D.cols || (fp8 ? D.qt != PT_F32 : (V->qtype != D.qt || V->row_bytes != D.rb)))
        return pt_err(err, PETREL_EUNSUPPORTED, "cuda: layer %d expert %d differs in format or shape from expert 0", l, x);
    cudaError_t ce;
    if (fp8) { /* expanded on the host into pinned memory, as at upload (no format keeps FP8 experts in packs) */
        size_t b = (size_t)V->rows * V->cols * 4;
        if (b > T->f32_cap) {
            if (T->f32) cudaFreeHost(T->f32), T->f32 = NULL, T->f32_cap = 0;
            if ((ce = cudaMallocHost(&T->f32, b)) != cudaSuccess) return cu_fail(err, ce, "pinned FP8 staging");
            T->f32_cap = b;
        }
        for (int64_t r = 0; r < V->rows; r++) pt_dequant_row(V, r, T->f32 + r * V->cols);
        ce = cudaMemcpyAsync(dd, T->f32, b, cudaMemcpyHostToDevice, st);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(st); /* the staging is reused by the next weight */
        T->st.bytes += b;
        return ce == cudaSuccess ? 0 : cu_fail(err, ce, "expert copy");
    }
    int r16 = V->layout == PT_LAYOUT_R16;
    size_t db = (size_t)V->rows * V->row_bytes, sb = ds ? (size_t)(V->rows * V->scale_cols * dtype_bytes(V->scale_dtype)) : 0;
    ce = cudaMemcpyAsync(r16 ? T->raw : dd, V->data, db, cudaMemcpyHostToDevice, st);
    if (ce == cudaSuccess && sb) ce = cudaMemcpyAsync(T->raw + T->raw_data, V->scale, sb, cudaMemcpyHostToDevice, st);
    if (ce != cudaSuccess) return cu_fail(err, ce, "expert copy");
    cuk_unpack(st, D.qt, r16, r16 ? T->raw : NULL, sb ? T->raw + T->raw_data : NULL, V->scale_dtype, V->rows, V->row_bytes, V->scale_cols, D.sc, dd, ds);
    T->st.bytes += db + sb;
    return 0;
}

/* the misses miss[0..n) of MoE layer l into the slots already assigned to them */
static int fill_slots(cu_model *m, int l, const int32_t *miss, int n, petrel_error *err) {
    cu_tiers *T = m->tiers;
    const petrel_engine *e = m->e;
    const cu_layer &G = m->L[l];
    const cu_tier_layer &TL = T->L[l];
    uint64_t t0 = pt_now_ns();
    int rc = 0;
    if (!e->xs) {
        const layer_w *lw = &e->w.layers[l];
        for (int i = 0; i < n && !rc; i++) {
            int x = miss[i], s = TL.slot_of[x];
            rc = copy_w(m, &lw->exp_gate[x], G.eg, s, l, x, err);
            if (!rc) rc = copy_w(m, &lw->exp_up[x], G.eu, s, l, x, err);
            if (!rc) rc = copy_w(m, &lw->exp_down[x], G.ed, s, l, x, err);
        }
    } else {
        int ml = e->moe_index[l], cap = xs_store_slots(e->xs);
        for (int i0 = 0; i0 < n && !rc; i0 += cap) {
            int k = n - i0 < cap ? n - i0 : cap;
            if ((rc = xs_acquire(e->xs, ml, miss + i0, k, T->refs, err))) break;
            for (int i = 0; i < k && !rc; i++) {
                int x = miss[i0 + i], s = TL.slot_of[x];
                rc = copy_w(m, &T->refs[i].gate, G.eg, s, l, x, err);
                if (!rc) rc = copy_w(m, &T->refs[i].up, G.eu, s, l, x, err);
                if (!rc) rc = copy_w(m, &T->refs[i].down, G.ed, s, l, x, err);
            }
            cudaError_t ce = cudaStreamSynchronize(m->st); /* the copies read the store's slots: done before they go back */
            if (!rc && ce != cudaSuccess) rc = cu_fail(err, ce, "expert copy");
            xs_release(e->xs, ml, T->refs, k);
        }
    }
    T->st.copy_ns += pt_now_ns() - t0;
    T->st.copies += (uint64_t)n;
    return rc;
}

/* Misses hs[0..h) of MoE layer l computed on the host over the chunk's choices idx[0..n) (x rows
 * in T->hx): each choice's output into T->hy in expert order, its place in yk into pos; returns
 * the number of outputs in *nout. Updates the cost model's host time per byte. */
static int host_run(cu_model *m, int l, const int32_t *hs, int h, const int32_t *idx, int n, int32_t *pos, int *nout, petrel_error *err) {
    cu_tiers *T = m->tiers;
    const petrel_engine *e = m->e;
    const layer_w *lw = &e->w.layers[l];
    int H = m->c->hidden_size, K = T->K, ml = e->moe_index[l], cap = e->xs ? xs_store_slots(e->xs) : h, j = 0;
    uint64_t t0 = pt_now_ns(), wait = 0; /* (the store's reads are not the host's compute: the model leaves them out) */
    kn_job jobs[2 * CU_HOST_ROWS];
    int st[CU_HOST_ROWS], cnt[CU_HOST_ROWS];
    for (int i0 = 0; i0 < h; i0 += cap) {
        int k = h - i0 < cap ? h - i0 : cap, j0 = j;
        if (e->xs) {
            uint64_t a = pt_now_ns();
            PT_TRY(xs_acquire(e->xs, ml, hs + i0, k, T->refs, err));
            wait += pt_now_ns() - a;
        }
        int64_t I = e->xs ? T->refs[0].gate.rows : lw->exp_gate[hs[i0]].rows;
        for (int b = 0; b < k; b++) { /* gather each expert's rows */
            int x = hs[i0 + b];
            st[b] = j;
            for (int i = 0; i < n; i++)
                if (idx[i] == x) memcpy(T->xs + (size_t)j * H, T->hx + (size_t)(i / K) * H, sizeof(float) * H), pos[j++] = i;
            cnt[b] = j - st[b];
            const pt_wview *g = e->xs ? &T->refs[b].gate : &lw->exp_gate[x], *u = e->xs ? &T->refs[b].up : &lw->exp_up[x];
            jobs[2 * b] = (kn_job){g, T->xs + (size_t)st[b] * H, cnt[b], T->gb + (size_t)(st[b] - j0) * I};
            jobs[2 * b + 1] = (kn_job){u, T->xs + (size_t)st[b] * H, cnt[b], T->ub + (size_t)(st[b] - j0) * I};
        }
        kt_matmul_many(&T->kt, jobs, 2 * k);
        kt_silu_mul(&T->kt, T->gb, T->gb, T->ub, (int64_t)(j - j0) * I);
        for (int b = 0; b < k; b++) {
            const pt_wview *d = e->xs ? &T->refs[b].down : &lw->exp_down[hs[i0 + b]];
            jobs[b] = (kn_job){d, T->gb + (size_t)(st[b] - j0) * I, cnt[b], T->hy + (size_t)st[b] * H};
        }
        kt_matmul_many(&T->kt, jobs, k);
        if (e->xs) xs_release(e->xs, ml, T->refs, k);
    }
    uint64_t dt = pt_now_ns() - t0;
    double per = (double)(dt - wait) / ((double)h * (double)T->expert_bytes);
    T->host_ns_b = 0.7 * T->host_ns_b + 0.3 * per;
    T->st.host += (uint64_t)h;
    T->st.host_ns += dt;
    *nout = j;
    return 0;
}

int cut_experts(cu_model *m, int l, const fscr &f, int t, int gemv, petrel_error *err) {
    cu_tiers *T = m->tiers;
    cu_tier_layer &TL = T->L[l];
    const cu_layer &G = m->L[l];
    cudaStream_t st = m->st;
    int K = T->K, E = T->E, S = T->S, n = t * K, H = m->c->hidden_size;
    int hosting = T->host && n <= CU_HOST_ROWS; /* misses may run on the host: its x rows come along */
    cudaError_t ce = cudaMemcpyAsync(T->h_idx, f.idx, sizeof(int32_t) * n, cudaMemcpyDeviceToHost, st);
    if (ce == cudaSuccess && hosting) ce = cudaMemcpyAsync(T->hx, f.x, sizeof(float) * t * H, cudaMemcpyDeviceToHost, st);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(st);
    if (ce != cudaSuccess) return cu_fail(err, ce, "routing to the host");
    const int32_t *idx = T->h_idx;
    for (int i = 0; i < n; i++) /* all checked before any is marked: a failure leaves no marks behind */
        if (idx[i] < 0 || idx[i] >= E) return pt_err(err, PETREL_EIO, "cuda: layer %d routed a choice to expert %d of %d", l, idx[i], E);
    for (int i = 0; i < n; i++) T->chosen[idx[i]] = 1;
    int nu = 0;
    xs_pol_begin(&TL.pol);
    for (int x = 0; x < E; x++)
        if (T->chosen[x]) T->chosen[x] = 0, T->u[nu++] = x, xs_pol_use(&TL.pol, x);
    T->st.uses += (uint64_t)nu;
    if (nu > S) T->st.waves++;
    int used = 0; /* entries of h_w the waves took (their copies may still be pending) */
    for (int w0 = 0; w0 < nu; w0 += S) {
        int nw = nu - w0 < S ? nu - w0 : S, nmiss = 0;
        const int32_t *wave = T->u + w0;
        for (int i = 0; i < nw; i++) {
            T->inwave[wave[i]] = 1;
            if (TL.slot_of[wave[i]] < 0) T->miss[nmiss++] = wave[i];
        }
        T->st.hits += (uint64_t)(nw - nmiss);
        int h = 0; /* the last h misses run on the host, the rest are copied: both take about as long */
        if (hosting && nw == nu && nmiss) {
            h = (int)(nmiss * T->link_ns_b / (T->link_ns_b + T->host_ns_b) + 0.5);
            /* the copies enter HBM and the host's results do not: copy the misses the policy
             * ranks warmest, leave the coldest to the host (ordered, so the split is deterministic) */
            for (int i = 1; i < nmiss && h; i++)
                for (int k = i; k > 0 && xs_pol_evict_before(&TL.pol, T->miss[k - 1], T->miss[k]); k--) {
                    int32_t x = T->miss[k];
                    T->miss[k] = T->miss[k - 1], T->miss[k - 1] = x;
                }
            nmiss -= h;
        }
        for (int i = 0; i < nmiss; i++) { /* a free slot, else the policy's first victim outside the wave */
            int best = -1;
            for (int s = 0; s < S && (best < 0 || TL.exp_of[best] >= 0); s++) {
                int x = TL.exp_of[s];
                if (x >= 0 && T->inwave[x]) continue;
                if (best < 0 || x < 0 || xs_pol_evict_before(&TL.pol, x, TL.exp_of[best])) best = s;
            }
            if (TL.exp_of[best] >= 0) TL.slot_of[TL.exp_of[best]] = -1;
            TL.exp_of[best] = T->miss[i], TL.slot_of[T->miss[i]] = best;
        }
        int rc = nmiss ? fill_slots(m, l, T->miss, nmiss, err) : 0;
        if (rc) { /* the slots of this wave's misses hold nothing usable */
            for (int i = 0; i < nmiss; i++) TL.exp_of[TL.slot_of[T->miss[i]]] = -1, TL.slot_of[T->miss[i]] = -1;
            for (int i = 0; i < nw; i++) T->inwave[wave[i]] = 0;
            return rc;
        }
        int32_t *wslot = T->h_w + used, *wrow = wslot + n, *wpos = wrow + n;
        int j = 0, jh = 0;
        for (int i = 0; i < n; i++) /* the GPU's choices (the host's misses have no slot) */
            if (T->inwave[idx[i]] && TL.slot_of[idx[i]] >= 0) wslot[j] = TL.slot_of[idx[i]], wrow[j] = i / K, wpos[j] = i, j++;
        for (int i = 0; i < nw; i++) T->inwave[wave[i]] = 0;
        /* (one region of h_w per wave: its slot, x row and place arrays are n apart, at used,
         * used + n, used + 2n within [0, 3n), and the waves' regions do not overlap) */
        ce = cudaMemcpyAsync(f.w_idx, wslot, sizeof(int32_t) * j, cudaMemcpyHostToDevice, st);
        if (ce == cudaSuccess) ce = cudaMemcpyAsync(f.w_x, wrow, sizeof(int32_t) * j, cudaMemcpyHostToDevice, st);
        if (ce != cudaSuccess) return cu_fail(err, ce, "wave arrays");
        used += j;
        if (nw == nu && !h) { /* one wave, all on the GPU: every choice in its place */
            experts_compute(m, G, f, f.w_idx, f.w_x, j, j, 1, S, f.yk, gemv);
            continue;
        }
        if (j) experts_compute(m, G, f, f.w_idx, f.w_x, j, j, 1, S, f.w_y, gemv);
        if (h) { /* while the GPU copies and computes: the host's misses, then their outputs after the GPU's */
            PT_TRY(host_run(m, l, T->miss + nmiss, h, idx, n, wpos + j, &jh, err));
            ce = cudaMemcpyAsync(f.w_y + (size_t)j * H, T->hy, sizeof(float) * (size_t)jh * H, cudaMemcpyHostToDevice, st);
            if (ce != cudaSuccess) return cu_fail(err, ce, "host expert outputs");
        }
        ce = cudaMemcpyAsync(f.w_pos, wpos, sizeof(int32_t) * (j + jh), cudaMemcpyHostToDevice, st);
        if (ce != cudaSuccess) return cu_fail(err, ce, "wave arrays");
        used += jh;
        cuk_scatter_rows(st, f.w_y, j + jh, H, f.w_pos, f.yk);
    }
    return 0;
}
