/* stream.c: glue between the engine and the expert store (src/experts). With --mem-budget or
 * --expert-slots on a petrel pack, routed experts are not read from the map: each MoE layer
 * acquires the experts its rows chose from per-layer slot banks filled by one aligned read per
 * expert (io_uring / O_DIRECT where possible). The plan (resident weights, KV, scratch, slots)
 * is computed against the budget at open and refused when it cannot be met.
 * Store layers are MoE-layer indices; moe_index maps checkpoint layers to them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "base/outfile.h"
#include "experts/xs.h"
#include "io/pack.h"
#include "kv/kv.h"
#include "model/engine.h"
#include "model/plan.h"



static int rec_cb(void *ctx, int layer, int expert, uint64_t *off, uint64_t *bytes, uint64_t *xxh, petrel_error *err) {
    const petrel_engine *e = ctx;
    if (pack_expert_record(e->pack, e->moe_layer[layer], expert, off, bytes, xxh))
        return pt_err(err, PETREL_EINVAL, "the pack has no record for it"); /* the store names layer and expert */
    return 0;
}

static int views_cb(void *ctx, int layer, int expert, const uint8_t *rec, pt_wview *g, pt_wview *u, pt_wview *d, petrel_error *err) {
    (void)expert;
    const petrel_engine *e = ctx;
    if (pack_expert_views(e->pack, e->moe_layer[layer], rec, g, u, d))
        return pt_err(err, PETREL_EINVAL, "the pack has no expert layout for this layer"); /* named by the store */
    return 0;
}

/* The fully resident path: every record of the pack through the expert I/O pool (xs_load_all),
 * into the pack's copy when it holds the experts, else only to check them (they are then served
 * from the file map). Store layers here are the pack's expert layers (the MTP layer included);
 * messages name them by checkpoint layer, as `petrel info` does. */
static int load_rec_cb(void *ctx, int layer, int expert, uint64_t *off, uint64_t *bytes, uint64_t *xxh, petrel_error *err) {
    const pack *p = ctx;
    if (pack_expert_record(p, p->elayers[layer].layer, expert, off, bytes, xxh))
        return pt_err(err, PETREL_EFORMAT, "the pack has no record for it (layer %d has %d experts)", p->elayers[layer].layer,
                      p->elayers[layer].n_experts);
    return 0;
}

int stream_load_experts(petrel_engine *e, const petrel_open_opts *o, petrel_error *err) {
    const pack *p = e->pack;
    int verify = !(o && o->no_verify);
    if (!p || !p->n_elayers || (!p->copy_experts && !verify)) return 0;
    int E = 0, *ids = malloc(sizeof(int) * (size_t)p->n_elayers);
    if (!ids) return pt_err(err, PETREL_ENOMEM, "out of memory");
    for (int i = 0; i < p->n_elayers; i++) {
        ids[i] = p->elayers[i].layer;
        if (p->elayers[i].n_experts > E) E = p->elayers[i].n_experts;
    }
    xs_source src = {.ctx = (void *)p, .path = pack_path(p), .fd = pack_fd(p), .n_layers = p->n_elayers, .n_experts = E,
                     .record = load_rec_cb, .layer_ids = ids};
    /* Into the copy: O_DIRECT where the file system takes it (the probe falls back to buffered
     * reads), so records go straight from the disk into the huge pages: 5.13 GB of 1d1m's
     * experts loaded in 1.2 s instead of 6 s through the page cache, which they also no longer
     * evict the rest of the model from (bench/RESULTS.md, 2026-12-05 06:20-06:55). Buffered where
     * the page cache already holds the file (pack_cached: memory speed, nothing evicted). Only
     * checking (served from the map): buffered, so the pages the map serves later are the ones read. */
    xs_store_opts so = {.io_mode = p->copy_experts && !pack_cached(p) ? XS_IO_AUTO : XS_IO_BUFFERED, .retries = 1, .verify = verify ? 1 : -1};
    load_pg pg = {.what = p->copy_experts ? "experts" : "experts (checking them)", .verbose = o && o->verbose,
                  .note = verify ? ", checksums checked" : ", checksums not checked (no_verify)"};
    int rc = xs_load_all(&src, p->copy_experts ? p->copy : NULL, &so, o && (o->verbose || o->load_progress) ? load_pg_fn : NULL, &pg, err);
    free(ids);
    return rc;
}

/* Under a budget prefill is read-bound: a span of rows reads nearly every expert of every layer
 * once. The forward chunk takes the largest size whose scratch stays within
 * budget / PT_CHUNK_BUDGET_DIV (attention over a long prompt costs more in small chunks); the
 * layer-major prefill rows (pf_rows: whole chunks, at most the planned context, 0 when that is
 * not more than one chunk) take up to budget / PT_PF_BUDGET_DIV more. No budget: resident chunks,
 * no spans. */
void stream_chunk_plan(const petrel_config *c, int ctx, uint64_t budget, int *chunk, int *pf_rows, size_t *pf_bytes) {
    *chunk = PT_CHUNK_RESIDENT;
    *pf_rows = 0;
    *pf_bytes = 0;
    if (!budget) return;
    *chunk = PT_CHUNK_MIN;
    for (int ch = PT_CHUNK_MAX; ch > PT_CHUNK_MIN; ch /= 2)
        if (session_scratch_estimate(c, ctx, ch) <= budget / PT_CHUNK_BUDGET_DIV) {
            *chunk = ch;
            break;
        }
    uint64_t rb = session_prefill_row_bytes(c, ctx), rows = budget / PT_PF_BUDGET_DIV / rb;
    if (rows > (uint64_t)ctx) rows = (uint64_t)ctx;
    rows = rows / (uint64_t)*chunk * (uint64_t)*chunk;
    if (rows > (uint64_t)*chunk) {
        *pf_rows = (int)rows;
        *pf_bytes = (size_t)(rows * rb);
    }
}

/* Bytes of a routed expert's three matrices in the model's own formats (models that are not
 * packs, whose experts cannot stream yet: the plan still says what they would take). */
static uint64_t expert_view_bytes(const layer_w *lw, int x) {
    return pt_wview_bytes(&lw->exp_gate[x]) + pt_wview_bytes(&lw->exp_up[x]) + pt_wview_bytes(&lw->exp_down[x]);
}

/* Appends the KV bytes per token of every scheme, as engines keep them (--kv-type). */
static void kv_schemes_line(const kv_shape *sh, char *text, size_t n) {
    size_t w = strlen(text);
    if (w < n)
    {
        kv_pool_opts a = kv_engine_opts(KV_F32, 0), b = kv_engine_opts(KV_BF16, 0), d = kv_engine_opts(KV_INT8, 0);
        snprintf(text + w, n - w, "\n(KV per token: f32 %.1f, bf16 %.1f, int8 %.1f KiB: --kv-type)", kv_bytes_per_token_opts(sh, &a) / 1024.0,
                 kv_bytes_per_token_opts(sh, &b) / 1024.0, kv_bytes_per_token_opts(sh, &d) / 1024.0);
    }
}

int stream_plan(const petrel_engine *e, uint64_t budget, int expert_slots, int ctx, pt_mem_plan *out, petrel_error *err) {
    const petrel_config *c = &e->cfg;
    pt_mem_plan *p = out;
    memset(p, 0, sizeof *p);
    int L = c->num_hidden_layers, nm = 0;
    for (int l = 0; l < L; l++) nm += c->layer_is_moe[l] != 0;
    p->n_moe_main = nm;
    p->budget = budget;
    if (ctx <= 0) ctx = 4096;
    if (ctx > c->max_position_embeddings) ctx = c->max_position_embeddings;
    p->ctx = ctx;
    size_t pf_bytes = 0;
    stream_chunk_plan(c, ctx, budget, &p->chunk, &p->pf_rows, &pf_bytes);
    p->pf_bytes = pf_bytes;
    memcpy(p->kind_bytes, e->w.kind_bytes, sizeof p->kind_bytes);
    kv_shape ksh; /* latent KV bytes per token in the engine's scheme, every layer with a cache */
    kv_shape_from_config(c, e->w.has_mtp, &ksh);
    kv_pool_opts kso = kv_engine_opts((kv_scheme)e->kv_scheme, KV_PAGE_DEFAULT);
    p->kv_token = kv_bytes_per_token_opts(&ksh, &kso); /* as the engine keeps it */
    p->kv_bytes = p->kv_token * (uint64_t)ctx;
    double g = 1073741824.0;
    if (!budget && !expert_slots) { /* every weight resident: the plan says what a session adds */
        for (int k = 0; k < WK_COUNT; k++) p->resident_bytes += e->w.kind_bytes[k];
        p->resident_bytes += e->lora_bytes; /* LoRA adapters (and merged copies) */
        p->scratch_bytes = session_scratch_estimate(c, ctx, p->chunk);
        p->total_bytes = p->resident_bytes + p->kv_bytes + p->scratch_bytes;
        snprintf(p->text, sizeof p->text,
                 "resident weights  %9.2f GiB  (every expert resident%s)\n"
                 "KV cache          %9.2f GiB  (%d tokens x %.1f KiB, %s)\n"
                 "scratch           %9.2f GiB  (a session's forward of up to %d rows)\n"
                 "total             %9.2f GiB  for one session of %d tokens",
                 p->resident_bytes / g, e->lora_bytes ? ", LoRA adapters included" : "", (double)p->kv_bytes / g, ctx, p->kv_token / 1024.0,
                 kv_scheme_name((kv_scheme)e->kv_scheme), p->scratch_bytes / g, ctx < p->chunk ? ctx : p->chunk, p->total_bytes / g, ctx);
        kv_schemes_line(&ksh, p->text, sizeof p->text);
        return 0;
    }
    int mtp_streams = e->pack && e->w.has_mtp && !pack_expert_record(e->pack, L, 0, NULL, NULL, NULL);
    p->needs_pack = !e->pack;
    uint64_t rec_max = 0;
    for (int l = 0; l <= L; l++) {
        uint64_t off, bytes, x;
        if (l < L ? !c->layer_is_moe[l] : !mtp_streams) continue;
        if (!e->pack) bytes = expert_view_bytes(&e->w.layers[l], 0);
        else if (pack_expert_record(e->pack, l, 0, &off, &bytes, &x))
            return pt_err(err, PETREL_EFORMAT, "%s: no expert records for layer %d (an MoE layer in config.json)", e->path, l);
        if (bytes > rec_max) rec_max = bytes;
    }
    p->record_bytes = rec_max;
    p->n_store_layers = nm + mtp_streams;
    if (!nm) return 0; /* nothing to stream: no plan to print */
    p->streaming = 1;
    uint64_t resident = 0;
    for (int k = 0; k < WK_COUNT; k++)
        if (k != WK_EXPERTS) resident += e->w.kind_bytes[k];
    if (mtp_streams) /* the MTP layer's routed experts are counted with the MTP layer */
        for (int x = 0; x < c->n_routed_experts; x++) resident -= expert_view_bytes(&e->w.mtp, x);
    uint64_t embed_off = budget && e->pack ? pack_embed_on_disk_bytes(e->pack) : 0; /* read a row at a time (engine.c) */
    resident -= embed_off;
    resident += e->lora_bytes; /* LoRA adapters (and merged copies) */
    p->embed_on_disk = embed_off;
    p->resident_bytes = resident;
    p->scratch_bytes = session_scratch_estimate(c, ctx, p->chunk) + pf_bytes + (64u << 20); /* + code, allocator, I/O queues */
    xs_plan_in in = {.budget = budget, .expert_slots = expert_slots, .resident_bytes = resident, .kv_bytes = p->kv_bytes,
                     .scratch_bytes = p->scratch_bytes, .record_bytes = rec_max, .n_layers = p->n_store_layers,
                     .n_experts = c->n_routed_experts, .min_slots = 1}; /* fewer slots than top-k work: experts then run in chunks */
    PT_TRY(xs_plan_make(&in, &p->xs, err));
    p->total_bytes = p->xs.total_bytes;
    int pw = xs_plan_format(&p->xs, p->text, sizeof p->text);
    if (p->pf_rows && pw >= 0 && (size_t)pw < sizeof p->text)
        pw += snprintf(p->text + pw, sizeof p->text - (size_t)pw,
                       "\n(scratch: prompts run in chunks of %d rows, layer-major spans of %d rows, %.2f GiB of it)", p->chunk, p->pf_rows,
                       (double)pf_bytes / g);
    if (embed_off && pw >= 0 && (size_t)pw < sizeof p->text)
        snprintf(p->text + pw, sizeof p->text - (size_t)pw, "\n(not counted: embed_tokens, %.2f GiB, stays in the pack; a token reads its row)",
                 (double)embed_off / g);
    if (e->lora_bytes && pw >= 0 && (size_t)pw < sizeof p->text)
        snprintf(p->text + strlen(p->text), sizeof p->text - strlen(p->text), "\n(resident includes %.3f GiB of LoRA adapters)", (double)e->lora_bytes / g);
    kv_schemes_line(&ksh, p->text, sizeof p->text);
    return 0;
}

int plan_min_budget(const petrel_engine *e, int ctx, uint64_t *min, petrel_error *err) {
    pt_mem_plan p;
    petrel_error ig = {0};
    uint64_t lo = 1u << 20, hi = 1ull << 50; /* plan(hi) works unless the pack is broken */
    PT_TRY(stream_plan(e, hi, 0, ctx, &p, err));
    if (!p.streaming) { /* nothing streams: the minimum is the resident plan itself */
        PT_TRY(stream_plan(e, 0, 0, ctx, &p, err));
        *min = p.total_bytes;
        return 0;
    }
    /* the scratch grows with the budget (chunk, span): search the smallest that works */
    while (hi - lo > (1u << 20)) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (stream_plan(e, mid, 0, ctx, &p, &ig) == 0) hi = mid;
        else lo = mid;
    }
    *min = (hi + (1u << 20) - 1) >> 20 << 20;
    if (stream_plan(e, *min, 0, ctx, &p, &ig)) *min = hi;
    return 0;
}

/* What stream_open sets up after the plan: trace-driven routing, the routing recorder, and,
 * when the plan streams, the expert store with the plan's slots (and its usage history). */
static int stream_open_rest(petrel_engine *e, const petrel_open_opts *o, const pt_mem_plan *plan, petrel_error *err) {
    const petrel_config *c = &e->cfg;
    int L = c->num_hidden_layers, nm = e->n_moe;
    if (o && o->route_trace) { /* trace-driven routing (benchmarks): checked against the model now */
        if (!nm) return pt_err(err, PETREL_EINVAL, "--route-trace: %s has no MoE layers to route", e->path);
        e->route = calloc(1, sizeof(xs_trace));
        e->route_layer = malloc(sizeof(int) * (size_t)nm);
        if (!e->route || !e->route_layer) return pt_err(err, PETREL_ENOMEM, "out of memory");
        PT_TRY(xs_trace_read(e->route, o->route_trace, err));
        const xs_trace *t = e->route;
        if (t->n_experts != c->n_routed_experts || t->topk != c->num_experts_per_tok || t->n_tokens < 1)
            return pt_err(err, PETREL_EINVAL, "route trace %s: %d experts top-%d over %d tokens, but the model has %d experts top-%d", o->route_trace,
                          t->n_experts, t->topk, t->n_tokens, c->n_routed_experts, c->num_experts_per_tok);
        for (size_t i = 0; i < (size_t)t->n_tokens * t->n_layers * t->topk; i++)
            if (t->ids[i] < 0 || t->ids[i] >= t->n_experts)
                return pt_err(err, PETREL_EFORMAT, "route trace %s: token %zu layer %zu has no complete choice of %d experts", o->route_trace,
                              i / ((size_t)t->n_layers * t->topk), i / t->topk % t->n_layers, t->topk);
        for (int m = 0; m < nm; m++) e->route_layer[m] = (int)((long)m * t->n_layers / nm); /* spread evenly */
    }
    if (o && o->trace_out && nm) {
        e->trace = calloc(1, sizeof(xs_trace));
        e->trace_buf = malloc(sizeof(int32_t) * (size_t)e->chunk * (size_t)nm * (size_t)c->num_experts_per_tok);
        if (!e->trace || !e->trace_buf || xs_trace_init(e->trace, nm, c->n_routed_experts, c->num_experts_per_tok))
            return pt_err(err, PETREL_ENOMEM, "out of memory for the routing trace");
        snprintf(e->trace_out, sizeof e->trace_out, "%s", o->trace_out);
        PT_TRY(pt_out_check(e->trace_out, e->path, err)); /* refuse a bad target now, not after the run */
    }
    if (!plan->streaming) return 0;
    if (plan->n_store_layers > nm) e->moe_index[L] = nm; /* the MTP layer's routed experts stream like the others (store layer n_moe) */
    for (int l = 0; l <= L; l++)
        if (e->moe_index[l] >= 0) e->moe_layer[e->moe_index[l]] = l;
    xs_source src = {.ctx = e, .path = pack_path(e->pack), .fd = -1, .n_layers = plan->n_store_layers, .n_experts = c->n_routed_experts,
                     .top_k = c->num_experts_per_tok, .record = rec_cb, .views = views_cb, .layer_ids = e->moe_layer};
    PT_TRY(xs_store_create(&src, &plan->xs, NULL, &e->xs, err));
    char up[4200];
    int loaded = 0;
    xs_usage_path(e->path, up, sizeof up);
    petrel_error ignore = {0};
    if (!e->route) xs_usage_load(e->xs, up, &loaded, &ignore); /* history is optional; a trace-driven run starts cold, like its replay */
    return 0;
}

int stream_open(petrel_engine *e, const petrel_open_opts *o, petrel_error *err) {
    const petrel_config *c = &e->cfg;
    int L = c->num_hidden_layers, nm = 0;
    e->moe_index = malloc(sizeof(int) * (size_t)(L + 1));
    e->moe_layer = malloc(sizeof(int) * (size_t)(L + 1));
    if (!e->moe_index || !e->moe_layer) return pt_err(err, PETREL_ENOMEM, "out of memory");
    for (int l = 0; l <= L; l++) e->moe_index[l] = l < L && c->layer_is_moe[l] ? nm++ : -1;
    e->n_moe = nm;
    uint64_t budget = o ? o->mem_budget : 0;
    int slots = o ? o->expert_slots : 0, streaming = budget || slots;
    if (streaming && !e->pack)
        return pt_err(err, PETREL_EUNSUPPORTED,
                      "--mem-budget / --expert-slots stream experts from a petrel pack; convert this model first (petrel convert --in %s --out model.pack)",
                      e->path);
    pt_mem_plan *plan = malloc(sizeof *plan);
    if (!plan) return pt_err(err, PETREL_ENOMEM, "out of memory");
    int rc = stream_plan(e, budget, slots, o ? o->plan_context : 0, plan, err);
    if (rc == 0) {
        e->chunk = plan->chunk;
        e->pf_rows = plan->pf_rows;
        snprintf(e->plan_text, sizeof e->plan_text, "%s", plan->text);
        rc = stream_open_rest(e, o, plan, err);
    }
    free(plan);
    return rc;
}

void stream_trace_note(const petrel_engine *e, int layer, const int32_t *idx, int T, int K) {
    int ml = e->moe_index[layer];
    if (ml < 0) return;
    for (int r = 0; r < T && r < e->chunk; r++)
        memcpy(e->trace_buf + ((size_t)r * e->n_moe + ml) * K, idx + (size_t)r * K, sizeof(int32_t) * (size_t)K);
}

int stream_trace_flush(const petrel_engine *e, int T, petrel_error *err) {
    int K = e->cfg.num_experts_per_tok;
    for (int r = 0; r < T && r < e->chunk; r++) {
        int tok = e->trace->n_tokens;
        for (int ml = 0; ml < e->n_moe; ml++) PT_TRY(xs_trace_add(e->trace, tok, ml, e->trace_buf + ((size_t)r * e->n_moe + ml) * K, K, err));
    }
    return 0;
}

int petrel_engine_finish(petrel_engine *e, petrel_error *err) {
    if (!e || !e->trace) return 0;
    int rc = e->trace->n_tokens ? xs_trace_write(e->trace, e->trace_out, err) : 0;
    xs_trace_deinit(e->trace); /* written (or failed, said): close writes nothing more */
    free(e->trace);
    e->trace = NULL;
    return rc;
}

void stream_close(petrel_engine *e) {
    if (e->trace) {
        petrel_error ignore = {0};
        if (e->trace->n_tokens && xs_trace_write(e->trace, e->trace_out, &ignore))
            fprintf(stderr, "petrel: %s\n", ignore.msg); /* close cannot fail; say it */
        xs_trace_deinit(e->trace);
        free(e->trace);
        e->trace = NULL;
    }
    free(e->trace_buf);
    e->trace_buf = NULL;
    if (e->route) xs_trace_deinit(e->route);
    free(e->route);
    free(e->route_layer);
    e->route = NULL;
    e->route_layer = NULL;
    if (e->xs) {
        char up[4200];
        petrel_error ignore = {0};
        xs_usage_path(e->path, up, sizeof up);
        if (!e->route) xs_usage_save(e->xs, up, &ignore); /* best effort: a read-only folder just loses history; trace-driven
                                                              routing is not the model's own */
        xs_store_free(e->xs);
        e->xs = NULL;
    }
    free(e->moe_index);
    e->moe_index = NULL;
    free(e->moe_layer);
    e->moe_layer = NULL;
}
