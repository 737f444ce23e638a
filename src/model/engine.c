/* engine.c: opening a model (Hugging Face checkpoint folder or file, colibri folder) into an
 * immutable petrel_engine, and sessions: the per-timeline latent KV cache and scratch arena,
 * sized once at create so the token loop never allocates. */
#include <errno.h>
#include <libgen.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/err.h"
#include "base/mem.h"
#include "cuda/cu.h"
#include "io/colibri.h"
#include "io/pack.h"
#include "kernels/kernels.h"
#include "model/engine.h"
#include "model/scratch.h"
#include "kv/kv.h"

#include <xxhash.h>

/* A colibri artifact: its own weight source. Without indexer weights the engine still opens
 * (weights_bind sets no_indexer; forward then refuses contexts past index_topk). */
static int open_colibri(petrel_engine *e, const char *dir, petrel_error *err) {
    PT_TRY(colibri_open(dir, &e->cfg, &e->coli, err));
    wsource ws;
    colibri_wsource(e->coli, &ws);
    return weights_bind(&e->w, &e->cfg, &ws, err);
}

void load_pg_fn(uint64_t done, uint64_t total, void *ud) {
    load_pg *g = ud;
    int pct = total ? (int)(done * 100 / total) : 100;
    if (!g->t0) g->t0 = pt_now_ns();
    if (!g->verbose && !g->shown && pt_now_ns() - g->t0 < 1000000000ull) return; /* quick loads stay quiet */
    if (g->shown && pct / 10 == g->last / 10 && pct != 100) return;
    g->shown = 1;
    g->last = pct;
    fprintf(stderr, "\rloading %s: %3d%% of %.2f GB%s", g->what, pct, (double)total / 1e9, g->note ? g->note : "");
    if (pct == 100) fputc('\n', stderr);
}

/* A petrel pack: config and weights from the one file. Resident tensors (and, when nothing
 * streams, the expert records) are copied into huge-page memory first (pack_load_resident).
 * Under a memory budget the token embedding stays in the file: a token needs one row of it,
 * and its ~1 GB buys ~50 expert slots instead. */
static int open_pack(petrel_engine *e, const char *path, const petrel_open_opts *o, petrel_error *err) {
    PT_TRY(pack_open(path, &e->pack, err));
    PT_TRY(pack_load_config(e->pack, &e->cfg, err));
    int streaming = o && (o->mem_budget || o->expert_slots);
    load_pg pg = {.what = "weights", .verbose = o && o->verbose};
    uint64_t copied = 0;
    if (!o || !o->inspect_only) {
        PT_TRY(pack_load_resident(e->pack, !streaming, o && o->mem_budget, &copied, o && (o->verbose || o->load_progress) ? load_pg_fn : NULL, &pg, err));
        if (!streaming) PT_TRY(stream_load_experts(e, o, err)); /* every record read and checked */
    }
    wsource ws;
    wsource_pack(&ws, e->pack);
    PT_TRY(weights_bind(&e->w, &e->cfg, &ws, err));
    if (e->pack->copy && kt_r16_available(&e->kt)) weights_relayout_r16(&e->w, &e->cfg, e->pack->copy, e->pack->copy + e->pack->file_size);
    /* The copy stays writable: making it read-only (mprotect, as open did before 2026-12-04)
     * made the first read of each of its huge pages cost kernel time, ~3 GB/s instead of ~30
     * on the dev box's kernel (bench/RESULTS.md), which every expert paid on its first use. */
    if (!o || !o->inspect_only) pack_drop_cache(e->pack, !streaming && !e->pack->copy_experts);
    return 0;
}

/* A model given as a file that is not a pack must be a safetensors file (its folder holds
 * config.json): anything else gets a line saying what the file is not, instead of the folder's
 * missing config.json. A file whose header says petrel-pack behind a wrong magic is a damaged
 * pack. */
int engine_check_model_file(const char *path, petrel_error *err) {
    uint8_t b[96] = {0};
    FILE *f = fopen(path, "rb");
    if (!f) return pt_err(err, PETREL_EIO, "cannot open model %s: %s", path, strerror(errno));
    size_t n = fread(b, 1, sizeof b, f);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fclose(f);
    static const char pk[] = "{\"format\":\"petrel-pack\"";
    if (n >= PACK_PREFIX + sizeof pk - 1 && !memcmp(b + PACK_PREFIX, pk, sizeof pk - 1))
        return pt_err(err, PETREL_EFORMAT, "%s: bad magic: a petrel pack header follows, but the file does not start with \"%s\" (the pack is "
                                           "corrupted; convert it again)", path, PACK_MAGIC);
    uint64_t hl = 0;
    if (n >= 9) memcpy(&hl, b, 8);
    size_t pl = strlen(path);
    int st_name = pl >= 12 && !strcmp(path + pl - 12, ".safetensors");
    if (st_name || (n >= 9 && b[8] == '{' && hl >= 2 && size > 8 && hl <= (uint64_t)size - 8)) return 0; /* safetensors: st_open judges it */
    return pt_err(err, PETREL_EFORMAT, "%s is not a model: not a folder, not a petrel pack (no \"%s\" magic), not a .safetensors file", path,
                  PACK_MAGIC);
}

/* The engine's kernel table from its options (nothing process-wide changes). */
static int kernel_table(kn_table *t, const petrel_open_opts *o, petrel_error *err) {
    if (o && (o->act_quant < -1 || o->act_quant > 2))
        return pt_err(err, PETREL_EINVAL, "act_quant %d: want -1 (off), 0 (the default), 1 (q4) or 2 (q4 and q8)", o->act_quant);
    if (o && (o->relayout < -1 || o->relayout > 1)) return pt_err(err, PETREL_EINVAL, "relayout %d: want -1 (off), 0 (the default) or 1 (on)", o->relayout);
    if (kn_table_init(t, o ? o->isa : NULL, o ? o->act_quant : 0, o ? o->relayout : 0) < 0) {
        if (o && o->isa && !strncmp(o->isa, "amx", 3) && !kn_amx_available())
            return pt_err(err, PETREL_EUNSUPPORTED, "kernel set \"%s\": this CPU or OS has no usable AMX (needs AMX-TILE/AMX-INT8%s in CPUID, the tile state in XCR0 "
                          "and Linux's tile permission, 5.16+); use avx512 or auto", o->isa, strcmp(o->isa, "amx-bf16") ? "" : "/AMX-BF16");
        return pt_err(err, PETREL_EUNSUPPORTED, "kernel set \"%s\" is unknown or this CPU lacks it (scalar, avx2, avx512, amx, amx-bf16, auto)", o->isa);
    }
    if (o && kn_table_prefetch(t, o->prefetch, o->prefetch_level, o->prefetch_lines) < 0)
        return pt_err(err, PETREL_EINVAL, "prefetch %d / level %d / lines %d: want -1 (none), 0 (default) or 64 .. 65536 bytes, level 0, 1 (L1) or 2 (L2), "
                      "and lines 0 (default), 1 (every other) or 2 (every line)", o->prefetch, o->prefetch_level, o->prefetch_lines);
    return 0;
}

/* The model's identity for session files: a hash over the shapes that define the cache and the
 * numerics, and over what the weights are: a pack's tensor and expert checksums; a Hugging Face
 * or colibri folder's tensor table (names, dtypes, shapes, byte ranges) - its bytes are not
 * read, so two checkpoints that differ only inside equal-sized tensors share an identity. */
static uint64_t engine_identity(const petrel_engine *e) {
    const petrel_config *c = &e->cfg;
    XXH64_state_t *h = XXH64_createState();
    if (!h) return 0;
    XXH64_reset(h, 0x70657472656cull);
    int32_t shape[] = {c->num_hidden_layers, c->hidden_size, c->num_attention_heads, c->kv_lora_rank, c->qk_rope_head_dim, c->qk_nope_head_dim,
                       c->v_head_dim, c->q_lora_rank, c->index_head_dim, c->index_n_heads, c->index_topk, c->vocab_size,
                       c->n_routed_experts, c->num_experts_per_tok, e->w.has_mtp};
    XXH64_update(h, shape, sizeof shape);
    XXH64_update(h, &c->rope_theta, sizeof c->rope_theta);
    XXH64_update(h, c->layer_indexer_full, (size_t)c->num_hidden_layers);
    if (e->pack) {
        for (int i = 0; i < e->pack->n_tensors; i++) XXH64_update(h, &e->pack->tensors[i].xxh64, 8);
        for (int i = 0; i < e->pack->n_elayers; i++)
            XXH64_update(h, e->pack->elayers[i].xxh64, 8 * (size_t)e->pack->elayers[i].n_experts);
    }
    const st_set *set = e->src ? e->src : e->coli ? e->coli->set : NULL;
    for (int i = 0; set && i < set->n_tensors; i++) {
        const st_tensor *t = &set->tensors[i];
        XXH64_update(h, t->name, strlen(t->name) + 1);
        int64_t d[ST_MAX_DIMS + 4] = {t->dtype, t->ndim, (int64_t)t->begin, (int64_t)t->end};
        for (int k = 0; k < t->ndim && k < ST_MAX_DIMS; k++) d[4 + k] = t->shape[k];
        XXH64_update(h, d, sizeof d);
    }
    uint64_t v = XXH64_digest(h);
    XXH64_freeState(h);
    return v;
}

/* The engine's KV pool (petrel_open_opts kv_type, kv_bytes). */
static int kv_open(petrel_engine *e, const petrel_open_opts *o, petrel_error *err) {
    const petrel_config *c = &e->cfg;
    kv_pool_opts ko = kv_engine_opts((kv_scheme)e->kv_scheme, o && o->kv_page_positions ? o->kv_page_positions : KV_PAGE_DEFAULT);
    if (ko.page_positions < 1 || ko.page_positions > 4096)
        return pt_err(err, PETREL_EINVAL, "kv_page_positions %d: want 1 .. 4096", ko.page_positions);
    kv_shape sh;
    kv_shape_from_config(c, e->w.has_mtp, &sh);
    int ctx = o && o->plan_context > 0 ? o->plan_context : 4096;
    uint64_t tok = kv_bytes_per_token_opts(&sh, &ko), bytes = o ? o->kv_bytes : 0;
    if (!bytes) {
        if (o && o->mem_budget) bytes = tok * (uint64_t)(ctx + 2 * ko.page_positions); /* the plan's KV, whole pages */
        else {
            uint64_t half = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE) / 2;
            bytes = tok * (uint64_t)(ctx > 4096 ? ctx : 4096) * 16;
            if (half && bytes > half) bytes = half;
        }
    }
    e->identity = engine_identity(e);
    return kv_pool_create(&sh, &ko, bytes, &e->kv, err);
}

/* The adapters of the open options: read and checked, the default set made, merged when asked. */
static int lora_open(petrel_engine *e, const petrel_open_opts *o, petrel_error *err) {
    if (!o || o->n_lora <= 0) return 0;
    if (o->n_lora > LORA_SET_MAX) return pt_err(err, PETREL_EINVAL, "%d LoRA adapters given; at most %d", o->n_lora, LORA_SET_MAX);
    if (!o->lora) return pt_err(err, PETREL_EINVAL, "n_lora %d without adapters", o->n_lora);
    for (int i = 0; i < o->n_lora; i++) {
        const petrel_lora_spec *sp = &o->lora[i];
        if (!sp->path || !*sp->path) return pt_err(err, PETREL_EINVAL, "LoRA adapter %d has no folder", i + 1);
        if (!isfinite(sp->scale)) return pt_err(err, PETREL_EINVAL, "LoRA adapter %s: scale is not a number", sp->path);
        for (int j = 0; j < i; j++)
            if (sp->name && o->lora[j].name && !strcmp(sp->name, o->lora[j].name))
                return pt_err(err, PETREL_EINVAL, "two LoRA adapters are named %s", sp->name);
        PT_TRY(lora_load(sp->path, sp->name, &e->cfg, &e->lora[i], err));
        e->n_lora = i + 1;
        e->lora_scale[i] = sp->scale != 0 ? sp->scale : 1.0f;
        e->lora_bytes += lora_bytes(e->lora[i]);
        if (lora_max_rank(e->lora[i]) > e->lora_max_rank) e->lora_max_rank = lora_max_rank(e->lora[i]);
    }
    lora_set all = {0};
    for (int i = 0; i < e->n_lora; i++) all.a[i] = e->lora[i], all.scale[i] = e->lora_scale[i];
    all.n = e->n_lora;
    lora_set_finish(&all);
    if (o->lora_merge) {
        uint64_t mb = 0;
        PT_TRY(lora_merge(&all, &e->w, &e->cfg, o->mem_budget || o->expert_slots, &mb, err));
        e->lora_bytes += mb;
        e->lora_merged = 1;
        e->lora_default = all; /* its id joins the identity; then cleared */
        return 0;
    }
    if (!o->lora_select) e->lora_default = all;
    return 0;
}

int petrel_engine_lora_count(const petrel_engine *e) { return e->n_lora; }
const char *petrel_engine_lora_name(const petrel_engine *e, int i) { return i >= 0 && i < e->n_lora ? lora_name(e->lora[i]) : NULL; }

int session_lora_alloc(petrel_session *s, int rows) {
    const petrel_engine *e = s->eng;
    if (!e->n_lora || e->lora_merged || rows <= s->row_lora_cap) return 0;
    const lora_set **b = realloc(s->row_lora_buf, sizeof *b * (size_t)rows);
    if (!b) return -1;
    s->row_lora_buf = b;
    s->row_lora_cap = rows;
    return 0;
}

int session_lora_rows(petrel_session *scr, const fwd_seg *seg, int nseg, int T, petrel_error *err) {
    scr->row_lora = NULL;
    int any = 0;
    for (int g = 0; g < nseg && !any; g++) any = seg[g].s->lora.n > 0;
    if (!any) return 0;
    if (session_lora_alloc(scr, T) < 0) return pt_err(err, PETREL_ENOMEM, "out of memory");
    for (int g = 0; g < nseg; g++)
        for (int i = 0; i < seg[g].n; i++) scr->row_lora_buf[seg[g].r0 + i] = seg[g].s->lora.n ? &seg[g].s->lora : NULL;
    scr->row_lora = scr->row_lora_buf;
    return 0;
}

int petrel_session_set_lora(petrel_session *s, const int *idx, const float *scale, int n, petrel_error *err) {
    const petrel_engine *e = s->eng;
    if (e->lora_merged) return pt_err(err, PETREL_EINVAL, "the LoRA adapters were merged into the weights at open: sessions cannot choose them");
    if (s->len) return pt_err(err, PETREL_EINVAL, "a session's adapters are set before its first token (this one holds %d)", s->len);
    if (n < 0 || n > LORA_SET_MAX) return pt_err(err, PETREL_EINVAL, "%d adapters: 0 to %d", n, LORA_SET_MAX);
    lora_set ls = {0};
    for (int i = 0; i < n; i++) {
        if (!idx || idx[i] < 0 || idx[i] >= e->n_lora)
            return pt_err(err, PETREL_EINVAL, "LoRA adapter %d: the engine has %d", idx ? idx[i] : -1, e->n_lora);
        float sc = scale ? scale[i] : e->lora_scale[idx[i]];
        if (!isfinite(sc)) return pt_err(err, PETREL_EINVAL, "LoRA adapter scale is not a number");
        ls.a[i] = e->lora[idx[i]];
        ls.scale[i] = sc;
    }
    ls.n = n;
    lora_set_finish(&ls);
    if (session_lora_alloc(s, s->pf.rows > s->max_batch ? s->pf.rows : s->max_batch) < 0) return pt_err(err, PETREL_ENOMEM, "out of memory");
    s->lora = ls;
    s->kv->salt = ls.id;
    return 0;
}

/* The open option device into *dev: -1 the CPU, else the CUDA GPU's index; what the GPU path
 * does not run yet is refused here, before anything loads. */
static int engine_device(const petrel_open_opts *o, int *out, petrel_error *err) {
    const char *d = o ? o->device : NULL;
    *out = -1;
    if (!d || !*d || !strcmp(d, "cpu")) {
        if (o && (o->vram_budget || o->vram_expert_slots || o->host_experts))
            return pt_err(err, PETREL_EINVAL, "%s applies to the GPU: add --device cuda (the forward runs on the CPU here)",
                          o->vram_budget ? "--vram-budget" : o->vram_expert_slots ? "--vram-expert-slots" : "--host-experts");
        return 0;
    }
    int dev = 0;
    if (strncmp(d, "cuda", 4) || (d[4] && d[4] != ':')) return pt_err(err, PETREL_EINVAL, "device \"%s\": want cpu, cuda or cuda:N", d);
    if (d[4] == ':') {
        char *end = NULL;
        long v = strtol(d + 5, &end, 10);
        if (!d[5] || *end || v < 0 || v > 1023) return pt_err(err, PETREL_EINVAL, "device \"%s\": want cuda:N with N a GPU index (0, 1, ...)", d);
        dev = (int)v;
    }
    const char *no = o->n_lora                    ? "LoRA adapters"
                     : o->trace_out                 ? "recording a routing trace (--trace-out)"
                     : o->kv_type && strcmp(o->kv_type, "f32") ? "bf16 / int8 KV pages (--kv-type): the GPU cache is f32"
                     : o->inspect_only              ? "inspect-only opens"
                                                    : NULL;
    if (no) return pt_err(err, PETREL_EUNSUPPORTED, "--device %s does not run %s yet", d, no);
    if (!cu_built()) return pt_err(err, PETREL_EUNSUPPORTED, "--device %s: this petrel was built without CUDA (build build/petrel-cuda with `make cuda`)", d);
    *out = dev;
    return 0;
}

int petrel_engine_open(const char *path, const petrel_open_opts *opts, petrel_engine **out, petrel_error *err) {
    *out = NULL;
    if (!path || !*path) return pt_err(err, PETREL_EINVAL, "no model path given");
    int dev;
    PT_TRY(engine_device(opts, &dev, err));
    petrel_open_opts gpu_opts;
    if (dev >= 0) { /* the GPU reads the stored layout */
        gpu_opts = *opts;
        gpu_opts.relayout = -1;
        opts = &gpu_opts;
    }
    kn_table kt;
    PT_TRY(kernel_table(&kt, opts, err));
    kv_scheme ks = KV_F32;
    if (opts && opts->kv_type) PT_TRY(kv_scheme_parse(opts->kv_type, &ks, err));
    struct stat st;
    if (stat(path, &st) < 0) return pt_err(err, PETREL_EIO, "cannot open model %s: no such file or folder", path);
    if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode))
        return pt_err(err, PETREL_EINVAL, "%s is not a model: a %s, not a folder or a regular file (give a Hugging Face folder, a .safetensors file or a pack)",
                      path, S_ISFIFO(st.st_mode) ? "FIFO" : S_ISCHR(st.st_mode) ? "character device" : S_ISBLK(st.st_mode) ? "block device"
                                                         : S_ISSOCK(st.st_mode) ? "socket" : "special file");
    char cj[4200];
    snprintf(cj, sizeof cj, "%s/config.json", path);
    if (S_ISDIR(st.st_mode) && access(cj, F_OK) < 0)
        return pt_err(err, PETREL_EIO, "%s is not a model folder: it has no config.json (a Hugging Face checkpoint or colibri folder has one)", path);
    petrel_engine *e = calloc(1, sizeof *e);
    if (!e) return pt_err(err, PETREL_ENOMEM, "out of memory");
    e->kt = kt;
    e->kv_scheme = (int)ks;
    snprintf(e->path, sizeof e->path, "%s", path);
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    if (!S_ISDIR(st.st_mode)) {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s", path);
        snprintf(dir, sizeof dir, "%s", dirname(tmp));
    }
    kn_init(opts ? opts->n_threads : 0); /* the pool at the asked size before the open uses it (checksums, relayout) */
    int is_pack = !S_ISDIR(st.st_mode) && pack_is_pack(path);
    if (!S_ISDIR(st.st_mode) && !is_pack) {
        int rc = engine_check_model_file(path, err);
        if (rc < 0) {
            free(e);
            return rc;
        }
    }
    int rc = is_pack ? open_pack(e, path, opts, err) : config_load_dir(dir, &e->cfg, err);
    if (is_pack) {
        if (rc < 0 && err && strncmp(err->msg, path, strlen(path))) pt_err_ctx(err, "%s", path); /* pack messages name the file */
    } else if (rc == 0 && S_ISDIR(st.st_mode) && colibri_detect(path)) {
        rc = open_colibri(e, path, err);
        if (rc < 0) pt_err_ctx(err, "%s", path);
    } else if (rc == 0 && (rc = st_open(path, &e->src, err)) == 0) {
        wsource ws;
        wsource_safetensors(&ws, &e->st_src, e->src, &e->cfg);
        rc = weights_bind(&e->w, &e->cfg, &ws, err);
        if (rc < 0) pt_err_ctx(err, "%s", path);
    }
    if (rc < 0) {
        petrel_engine_close(e);
        return rc;
    }
    e->no_indexer = e->w.no_indexer;
    if ((rc = lora_open(e, opts, err)) < 0 || (rc = stream_open(e, opts, err)) < 0 || (rc = kv_open(e, opts, err)) < 0) {
        petrel_engine_close(e);
        return rc;
    }
    if (dev >= 0 && (rc = cu_model_open(e, dev, opts->vram_budget, opts->vram_expert_slots, opts->host_experts, &e->cu, err)) < 0) {
        petrel_engine_close(e);
        return rc;
    }
    if (e->lora_merged) { /* session files of the merged model are its own; its sessions carry no set */
        e->identity ^= e->lora_default.id;
        memset(&e->lora_default, 0, sizeof e->lora_default);
    }
    *out = e;
    return 0;
}

void petrel_engine_close(petrel_engine *e) {
    if (!e) return;
    for (int i = 0; i < e->n_lora; i++) lora_free(e->lora[i]);
    cu_model_close(e->cu);
    kv_pool_free(e->kv);
    stream_close(e);
    weights_deinit(&e->w, &e->cfg);
    st_close(e->src);
    colibri_close(e->coli);
    pack_close(e->pack);
    config_deinit(&e->cfg);
    free(e);
}

const petrel_config *petrel_engine_config(const petrel_engine *e) { return &e->cfg; }
int petrel_engine_vocab_size(const petrel_engine *e) { return e->cfg.vocab_size; }
int petrel_engine_max_positions(const petrel_engine *e) { return e->cfg.max_position_embeddings; }
int petrel_engine_is_eos(const petrel_engine *e, int32_t token) { return config_is_eos(&e->cfg, token); }
int32_t petrel_argmax(const float *logits, int n) { return (int32_t)kn_argmax(logits, n); }
const char *petrel_engine_plan(const petrel_engine *e) { return e->plan_text; }
const char *petrel_engine_device(const petrel_engine *e) { return e->cu ? cu_model_describe(e->cu) : "cpu"; }
const char *petrel_engine_note(const petrel_engine *e) {
    if (e->pack && pack_has_r16(e->pack) && !e->kt.vnni)
        return "stores its experts for AVX-512 VNNI kernels, which this CPU (or --isa) lacks; they run on the slow scalar path "
               "(reconvert with --expert-layout plain)";
    return "";
}

size_t session_prefill_row_bytes(const petrel_config *c, int ctx) {
    return pf_carve(NULL, c, 1, c->index_topk < ctx ? c->index_topk : ctx, NULL); /* with its alignment: a little over */
}

size_t session_scratch_estimate(const petrel_config *c, int ctx, int chunk) { return plan_session_arena(c, chunk, ctx); }

int petrel_session_create(petrel_engine *e, int max_tokens, petrel_session **out, petrel_error *err) {
    *out = NULL;
    const petrel_config *c = &e->cfg;
    if (max_tokens <= 0) return pt_err(err, PETREL_EINVAL, "session capacity must be at least 1 token (got %d)", max_tokens);
    if (max_tokens > c->max_position_embeddings)
        return pt_err(err, PETREL_ERANGE, "session capacity %d exceeds the model's max_position_embeddings %d", max_tokens, c->max_position_embeddings);
    petrel_session *s = calloc(1, sizeof *s);
    if (!s) return pt_err(err, PETREL_ENOMEM, "out of memory");
    s->eng = e;
    s->cap = max_tokens;
    int chunk = e->chunk > 0 ? e->chunk : PT_CHUNK_RESIDENT;
    s->max_batch = max_tokens < chunk ? max_tokens : chunk;
    int L = c->num_hidden_layers + (e->w.has_mtp ? 1 : 0); /* the MTP layer's cache is layer L */
    s->n_layers = L;
    int krc = kv_seq_create(e->kv, max_tokens, &s->kv, err);
    if (krc < 0) {
        free(s);
        return krc;
    }
    int ok = 1;
    if (ok) {
        s->ar.cap = plan_session_arena(c, s->max_batch, max_tokens);
        ok = (s->ar.base = pt_alloc_big(s->ar.cap, 64)) != NULL;
    }
    int M = (max_tokens < e->pf_rows ? max_tokens : e->pf_rows) / s->max_batch * s->max_batch; /* whole chunks */
    if (ok && M > s->max_batch) {
        int kst = c->index_topk < max_tokens ? c->index_topk : max_tokens;
        s->pf.rows = M;
        s->pf.sel_stride = kst;
        ok = (s->pf.block = pt_alloc_big(pf_carve(NULL, c, M, kst, NULL), 64)) != NULL; /* laid out by pf_carve at each span */
    }
    s->lora = e->lora_default;
    s->kv->salt = s->lora.id;
    if (ok && session_lora_alloc(s, s->pf.rows > s->max_batch ? s->pf.rows : s->max_batch) < 0) ok = 0;
    if (!ok) {
        petrel_session_free(s);
        return pt_err(err, PETREL_ENOMEM, "out of memory for a session of %d tokens", max_tokens);
    }
    if (e->cu && (krc = cu_kv_create(e->cu, max_tokens, &s->cu, err)) < 0) {
        petrel_session_free(s);
        return krc;
    }
    *out = s;
    return 0;
}

void petrel_session_free(petrel_session *s) {
    if (!s) return;
    cu_kv_free(s->cu);
    kv_seq_free(s->kv);
    free(s->ar.base);
    free(s->pf.block);
    free(s->row_lora_buf);
    free(s);
}

void petrel_session_set_route_offset(petrel_session *s, int offset) { s->route_offset = offset; }

int petrel_session_len(const petrel_session *s) { return s->len; }

void petrel_kv_usage(const petrel_engine *e, long long *free_positions, long long *total_positions, int *page_positions) {
    int P = kv_pool_layout(e->kv)->P;
    if (page_positions) *page_positions = P;
    if (!free_positions && !total_positions) return; /* the page size alone: no pool lock, no scan */
    kv_pool_stats st;
    kv_pool_get_stats(e->kv, &st);
    if (free_positions) *free_positions = (long long)(st.pages_free + st.prefix_only) * P;
    if (total_positions) *total_positions = (long long)st.pages * P;
}

int petrel_session_kv_reserved(const petrel_session *s) { return kv_seq_reserved(s->kv); }

int petrel_engine_has_mtp(const petrel_engine *e) { return e->w.has_mtp; }

typedef struct mtp_hidden {
    float *all; /* [n][H] */
    int H;
} mtp_hidden;
static int keep_hidden(void *user, const float *hidden, int done, int T, petrel_error *err) {
    (void)err;
    mtp_hidden *h = user;
    memcpy(h->all + (size_t)done * h->H, hidden, sizeof(float) * (size_t)T * h->H);
    return 0;
}

int petrel_session_mtp_logits(petrel_session *s, const int32_t *ids, int n, float *logits, petrel_error *err) {
    const petrel_engine *e = s->eng;
    if (!e->w.has_mtp) return pt_err(err, PETREL_EUNSUPPORTED, "this model has no MTP layer");
    if (n < 2) return pt_err(err, PETREL_EINVAL, "the MTP head's logits need a prompt of at least 2 ids (got %d)", n);
    if (s->len) return pt_err(err, PETREL_EINVAL, "the MTP head's logits need an empty session (this one holds %d tokens)", s->len);
    int H = e->cfg.hidden_size, V = e->cfg.vocab_size, rc = 0;
    mtp_hidden h = {malloc(sizeof(float) * (size_t)n * H), H};
    float *buf = malloc(sizeof(float) * (size_t)session_span_rows(s) * H);
    if (!h.all || !buf) rc = pt_err(err, PETREL_ENOMEM, "out of memory");
    if (!rc) rc = session_forward_h(s, ids, n, NULL, 0, buf, keep_hidden, &h, err);
    for (int r0 = 0; !rc && r0 < n - 1; r0 += s->max_batch) { /* the MTP rows in pieces of a chunk */
        int t = n - 1 - r0 < s->max_batch ? n - 1 - r0 : s->max_batch;
        fwd_seg one = {s, 0, t};
        rc = fwd_mtp(s, &one, 1, ids + 1 + r0, h.all + (size_t)r0 * H, t, logits + (size_t)r0 * V, err);
    }
    free(h.all);
    free(buf);
    return rc;
}

void petrel_engine_expert_stats(const petrel_engine *e, petrel_expert_stats *out) {
    xs_stats xs = {0};
    if (e->xs) xs_store_stats(e->xs, &xs);
    *out = (petrel_expert_stats){xs.accesses, xs.hits, xs.bytes_read, xs.read_failures};
}

/* The GPU's caches are not paged into the host pool: files and prefixes wait for that. */
#define CU_NO_FILES "session files are not written from the GPU's cache yet (--device cuda)"

int petrel_session_save(const petrel_session *s, const char *path, petrel_error *err) {
    if (s->cu) return pt_err(err, PETREL_EUNSUPPORTED, "%s", CU_NO_FILES);
    return kv_save(s->kv, path, s->eng->identity ^ s->lora.id, err);
}

int petrel_session_load(petrel_session *s, const char *path, petrel_error *err) {
    if (s->cu) return pt_err(err, PETREL_EUNSUPPORTED, "%s", CU_NO_FILES);
    PT_TRY(kv_load(s->kv, path, s->eng->identity ^ s->lora.id, s->eng->cfg.vocab_size, err));
    s->len = s->kv->len;
    s->mtp_len = s->kv->mtp_len;
    return 0;
}

int petrel_session_tokens(const petrel_session *s, const int32_t **ids) {
    *ids = s->kv->tokens;
    return s->len;
}

struct petrel_snapshot {
    kv_seq *k;   /* owned: shares the session's pages */
    uint64_t id; /* the model's identity ^ the session's adapter set (the file's) */
};

int petrel_session_snapshot(const petrel_session *src, petrel_snapshot **out, petrel_error *err) {
    *out = NULL;
    if (src->cu) return pt_err(err, PETREL_EUNSUPPORTED, "%s", CU_NO_FILES);
    petrel_snapshot *k = calloc(1, sizeof *k);
    if (!k) return pt_err(err, PETREL_ENOMEM, "out of memory");
    int rc = kv_seq_fork(src->kv, 0, &k->k, err);
    if (rc < 0) {
        free(k);
        return rc;
    }
    k->id = src->eng->identity ^ src->lora.id;
    *out = k;
    return 0;
}
int petrel_snapshot_tokens(const petrel_snapshot *k, const int32_t **ids) {
    *ids = k->k->tokens;
    return k->k->len;
}
uint64_t petrel_snapshot_id(const petrel_snapshot *k) { return k->id; }
int petrel_snapshot_save(const petrel_snapshot *k, const char *path, petrel_error *err) { return kv_save(k->k, path, k->id, err); }
void petrel_snapshot_free(petrel_snapshot *k) {
    if (!k) return;
    kv_seq_free(k->k);
    free(k);
}

int petrel_session_fork(const petrel_session *src, petrel_session **out, petrel_error *err) {
    *out = NULL;
    PT_TRY(petrel_session_create(src->eng, src->cap, out, err));
    petrel_session *s = *out;
    kv_seq *k = NULL;
    int rc = kv_seq_fork(src->kv, src->cap, &k, err);
    if (rc < 0) {
        petrel_session_free(s);
        *out = NULL;
        return rc;
    }
    kv_seq_free(s->kv);
    s->kv = k;
    if (src->cu && (rc = cu_kv_copy(src->eng->cu, s->cu, src->cu, src->len, err)) < 0) {
        petrel_session_free(s);
        *out = NULL;
        return rc;
    }
    s->len = src->len;
    s->mtp_len = src->mtp_len;
    s->lora = src->lora;
    return 0;
}

/* On the GPU nothing is shared yet: put keeps nothing, get finds nothing (0 tokens reused). */
int petrel_session_prefix_put(petrel_session *s, petrel_error *err) { return s->cu ? 0 : kv_prefix_put(s->kv, err); }

int petrel_session_prefix_get(petrel_session *s, const int32_t *ids, int n, petrel_error *err) {
    if (s->len) return pt_err(err, PETREL_EINVAL, "a cached prefix goes into an empty session (this one holds %d tokens)", s->len);
    if (s->cu) return 0;
    int got = kv_prefix_get(s->kv, ids, n, err);
    if (got < 0) return got;
    s->len = s->kv->len;
    s->mtp_len = s->kv->mtp_len;
    return got;
}

int petrel_session_truncate(petrel_session *s, int n_past, petrel_error *err) {
    if (n_past < 0 || n_past > s->len) return pt_err(err, PETREL_EINVAL, "cannot truncate a %d-token session to %d", s->len, n_past);
    PT_TRY(kv_seq_truncate(s->kv, n_past, err)); /* releases only the pages past the cut */
    s->len = n_past;
    if (s->mtp_len > n_past) s->mtp_len = n_past; /* MTP row i belongs to position i */
    return 0;
}

void session_mtp_truncate(petrel_session *s, int n) {
    if (n >= 0 && s->mtp_len > n) s->mtp_len = n;
    if (n >= 0 && s->kv->mtp_len > n) s->kv->mtp_len = n; /* the pages stay: the next rows overwrite them */
}

int session_mtp_skip(petrel_session *s, int n, petrel_error *err) {
    const petrel_config *c = &s->eng->cfg;
    int L = c->num_hidden_layers;
    if (s->n_layers <= L) return pt_err(err, PETREL_EINVAL, "session has no MTP cache");
    if (n > s->cap || n > s->len + 1) return pt_err(err, PETREL_EINVAL, "MTP rows up to %d skipped past the session's %d positions", n, s->len);
    static const float zeros[8192];
    if (c->kv_lora_rank > 8192 || c->qk_rope_head_dim > 8192) return pt_err(err, PETREL_EUNSUPPORTED, "MTP skip: kv_lora_rank %d too wide", c->kv_lora_rank);
    if (n <= s->mtp_len) return 0;
    PT_TRY(kv_seq_reserve(s->kv, s->mtp_len, n, err));
    for (int i = s->mtp_len; i < n; i++) PT_TRY(kv_write(s->kv, L, i, zeros, zeros, err)); /* rows never attended as real ones */
    PT_TRY(kv_seq_mtp_advance(s->kv, n - s->mtp_len, err));
    s->mtp_len = n;
    return 0;
}

