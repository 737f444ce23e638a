/* convert.c: the pack writer (see convert.h for the contract, pack.h for the format).
 *
 * Phases: list (weights_bind over a recording wsource) -> plan (formats, offsets, the header
 * JSON with placeholder checksums, whose length is final because checksums are fixed-width hex)
 * -> resume check (journal) -> convert items -> final header -> verify -> rename.
 * Invariants: the planned header and the final header have the same length; an item is journaled
 * only after its bytes were written; a journaled item is trusted only after its checksum is
 * re-read from the file. */
#include "io/convert.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "base/err.h"
#include "base/outfile.h"
#include "base/pool.h"
#include "io/calib.h"
#include "io/pack.h"
#include "kernels/kernels.h"
#include "model/engine.h"
#include "quant/quant.h"

const char *const convert_class_names[CV_CLASS_COUNT] = {"experts", "attention", "dense", "embed", "mtp"};
static const char *const qnames[CVQ_COUNT] = {"default", "f32", "bf16", "q8", "q8row", "q4", "q4x"};

int convert_quant_parse(const char *s) {
    for (int i = 1; i < CVQ_COUNT; i++)
        if (!strcmp(s, qnames[i])) return i;
    return -1;
}
const char *convert_quant_name(int q) { return q >= 0 && q < CVQ_COUNT ? qnames[q] : "?"; }

/* ---- listing ---- */

typedef struct ent {
    char *name;                 /* owned */
    int64_t rows, cols;
    int vector;
    int layer, expert, part;    /* expert parts: layer, expert, 0/1/2; else expert = -1 */
    pt_wview src;               /* the source view as first seen (qtype, scales layout) */
} ent;

typedef struct lister {
    const wsource *inner;
    ent *e;
    int n, cap;
    int oom;
} lister;

static int expert_name(const char *name, int *layer, int *expert) {
    int l, e, n = 0;
    char proj[8];
    if (sscanf(name, "model.layers.%d.mlp.experts.%d.%4[a-z]_proj.weight%n", &l, &e, proj, &n) != 3 || name[n]) return -1;
    *layer = l;
    *expert = e;
    return !strcmp(proj, "gate") ? 0 : !strcmp(proj, "up") ? 1 : !strcmp(proj, "down") ? 2 : -1;
}

static void list_add(lister *ls, const char *name, int64_t rows, int64_t cols, int vector, const pt_wview *v) {
    if (ls->n == ls->cap) {
        int cap = ls->cap ? ls->cap * 2 : 1024;
        ent *t = realloc(ls->e, sizeof(ent) * (size_t)cap);
        if (!t) { ls->oom = 1; return; }
        ls->e = t;
        ls->cap = cap;
    }
    ent *e = &ls->e[ls->n];
    memset(e, 0, sizeof *e);
    if (!(e->name = strdup(name))) { ls->oom = 1; return; }
    e->rows = rows;
    e->cols = cols;
    e->vector = vector;
    e->expert = -1;
    if (v) e->src = *v;
    if (!vector) e->part = expert_name(name, &e->layer, &e->expert);
    if (e->part < 0) e->expert = -1;
    ls->n++;
}

static int ls_matrix(void *ctx, const char *name, int64_t rows, int64_t cols, pt_wview *out, petrel_error *err) {
    lister *ls = ctx;
    PT_TRY(ls->inner->matrix(ls->inner->ctx, name, rows, cols, out, err));
    list_add(ls, name, rows, cols, 0, out);
    return ls->oom ? pt_err(err, PETREL_ENOMEM, "out of memory listing tensors") : 0;
}
static int ls_vector(void *ctx, const char *name, int64_t n, float *out, petrel_error *err) {
    lister *ls = ctx;
    PT_TRY(ls->inner->vector(ls->inner->ctx, name, n, out, err));
    list_add(ls, name, 1, n, 1, NULL);
    return ls->oom ? pt_err(err, PETREL_ENOMEM, "out of memory listing tensors") : 0;
}
static int ls_has(void *ctx, const char *name) {
    lister *ls = ctx;
    return ls->inner->has(ls->inner->ctx, name);
}

/* ---- planning ---- */

typedef struct tplan {
    pt_qtype q;
    int scale_dtype;
    int copy;                   /* source already in this format: copy bytes */
    int q4x;                    /* PT_Q4_G64 through pt_quant_row_q4x */
    int block_rows, block_cols; /* FP8 */
} tplan;

typedef struct elayer_plan {
    int layer;
    int ent[3];                 /* index of expert 0's gate/up/down entries (shapes, src type) */
    int *ents;                  /* owned [E * 3]: entry index of (e, part) */
    pack_tensor part[3];
    tplan tp[3];
    uint64_t first_offset, record_bytes;
    uint64_t *xxh;              /* owned [E] */
} elayer_plan;

typedef struct cv {
    const convert_src *src;
    const convert_opts *o;
    petrel_error *err;
    int L, E;
    ent *e;
    int n;
    int *res;                   /* resident entry indices */
    int n_res;
    pack_tensor *rt;            /* [n_res] resident plan */
    tplan *rtp;                 /* [n_res] */
    elayer_plan *el;
    int n_el;
    uint64_t data_start, file_size;
    uint64_t file_off[PACK_MAX_FILES]; /* side files (src->files) */
    char *json;                 /* current header text */
    size_t json_len;
    /* run state */
    int fd;
    uint8_t *done;              /* [items] */
    int items, n_done_run;
    uint64_t written;
    uint64_t t_start, t_last;
    FILE *journal;
    int header_written;         /* OUT.partial holds a pack header (a failure must spoil it) */
    int opened;                 /* this run opened (or created) OUT.partial */
} cv;

static int cls_of(const ent *e, int L) {
    int l = -1;
    if (sscanf(e->name, "model.layers.%d.", &l) == 1 && l == L) return CV_MTP;
    if (e->expert >= 0) return CV_EXPERTS;
    if (strstr(e->name, "self_attn.")) return CV_ATTN;
    if (!strcmp(e->name, "model.embed_tokens.weight") || !strcmp(e->name, "lm_head.weight")) return CV_EMBED;
    return CV_DENSE;
}

static int is_router(const char *name) {
    size_t n = strlen(name);
    return n > 16 && !strcmp(name + n - 16, ".mlp.gate.weight");
}

static int class_quant(const convert_opts *o, int cls) {
    int q = o->cls[cls];
    if (q != CVQ_DEFAULT) return q;
    q = o->quant != CVQ_DEFAULT ? o->quant : CVQ_BF16;
    if (cls == CV_MTP && (q == CVQ_Q4 || q == CVQ_Q4X)) q = CVQ_Q8;
    /* --quant q4x: the always-active dense MLPs and shared experts stay int8 (a few % of a
     * small model's bytes, ~0.5 % of GLM-5.2's; they carry every token) */
    if (cls == CV_DENSE && q == CVQ_Q4X) q = CVQ_Q8;
    return q;
}

/* Chooses the stored format of a matrix. */
static int plan_matrix(cv *c, const ent *e, int cls, tplan *tp) {
    memset(tp, 0, sizeof *tp);
    const pt_wview *s = &e->src;
    int virt = c->src->row != NULL;
    int q = is_router(e->name) ? CVQ_F32 : class_quant(c->o, cls);
    /* --quant q4x is a recipe: the DSA indexer (small, and its top-k cut turns small errors
     * into other keys) stays int8 unless --attention names a format itself */
    if (q == CVQ_Q4X && cls == CV_ATTN && c->o->cls[CV_ATTN] == CVQ_DEFAULT && strstr(e->name, ".self_attn.indexer.")) q = CVQ_Q8;
    switch (q) {
    case CVQ_F32: tp->q = PT_F32; break;
    case CVQ_BF16:
        if (!virt && (s->qtype == PT_FP8_E4M3 || s->qtype == PT_F16)) tp->q = s->qtype;
        else tp->q = PT_BF16;
        break;
    case CVQ_Q8: tp->q = PT_Q8_G32; tp->scale_dtype = PT_BF16; break;
    case CVQ_Q8ROW: tp->q = PT_Q8_ROW; tp->scale_dtype = PT_F32; break;
    case CVQ_Q4: tp->q = PT_Q4_G64; tp->scale_dtype = PT_BF16; break;
    case CVQ_Q4X: tp->q = PT_Q4_G64; tp->scale_dtype = PT_BF16; tp->q4x = 1; break;
    default: return pt_err(c->err, PETREL_EINVAL, "bad quant choice %d", q);
    }
    if (!virt && s->qtype == tp->q && s->row_bytes == pt_qtype_row_bytes(tp->q, e->cols)) {
        tp->copy = 1;
        if (tp->q == PT_FP8_E4M3) {
            tp->scale_dtype = s->scale_dtype;
            tp->block_rows = s->block_rows;
            tp->block_cols = s->block_cols;
        } else if (tp->q == PT_Q8_G32 || tp->q == PT_Q4_G64) {
            tp->scale_dtype = s->scale_dtype;
            if (s->scale_cols != pt_qtype_scales_per_row(tp->q, e->cols)) tp->copy = 0;
        } else if (tp->q == PT_Q8_ROW && s->scale_dtype != PT_F32) tp->copy = 0;
        if (!tp->copy) tp->scale_dtype = tp->q == PT_Q8_ROW ? PT_F32 : PT_BF16;
    }
    if (tp->q == PT_FP8_E4M3 && !tp->copy) return pt_err(c->err, PETREL_EUNSUPPORTED, "%s: cannot quantize to FP8", e->name);
    if (!tp->scale_dtype) tp->scale_dtype = PT_F32;
    return 0;
}

static uint64_t up_to(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

static int fill_tensor(cv *c, const ent *e, const tplan *tp, uint64_t *cursor, pack_tensor *t) {
    memset(t, 0, sizeof *t);
    t->vector = e->vector;
    t->qtype = e->vector ? PT_F32 : tp->q;
    t->rows = e->rows;
    t->cols = e->cols;
    t->scale_dtype = e->vector ? PT_F32 : tp->scale_dtype;
    t->block_rows = tp ? tp->block_rows : 0;
    t->block_cols = tp ? tp->block_cols : 0;
    t->group = pt_qtype_group(t->qtype, t->cols);
    if (t->qtype == PT_FP8_E4M3) t->group = 0;
    if (pack_tensor_sizes(t->qtype, t->rows, t->cols, t->scale_dtype, t->block_rows, t->block_cols, &t->bytes, &t->scale_bytes) < 0)
        return pt_err(c->err, PETREL_EINVAL, "%s: cannot store [%lld, %lld] as %s", e->name, (long long)e->rows, (long long)e->cols, pack_qtype_key(t->qtype));
    *cursor = up_to(*cursor, PACK_TALIGN);
    t->offset = *cursor;
    *cursor += t->bytes;
    if (t->scale_bytes) {
        *cursor = up_to(*cursor, PACK_TALIGN);
        t->scale_offset = *cursor;
        *cursor += t->scale_bytes;
    }
    return 0;
}

static cJSON *tensor_json(const pack_tensor *t, const char *name, int with_hash, uint64_t h) {
    cJSON *o = cJSON_CreateObject();
    if (name) cJSON_AddStringToObject(o, "name", name);
    cJSON_AddStringToObject(o, "qtype", pack_qtype_key(t->qtype));
    cJSON_AddNumberToObject(o, "rows", (double)t->rows);
    cJSON_AddNumberToObject(o, "cols", (double)t->cols);
    cJSON_AddNumberToObject(o, "offset", (double)t->offset);
    cJSON_AddNumberToObject(o, "bytes", (double)t->bytes);
    cJSON_AddNumberToObject(o, "scale_offset", (double)t->scale_offset);
    cJSON_AddNumberToObject(o, "scale_bytes", (double)t->scale_bytes);
    cJSON_AddStringToObject(o, "scale_dtype", pack_qtype_key((pt_qtype)t->scale_dtype));
    cJSON_AddNumberToObject(o, "group", (double)t->group);
    if (t->qtype == PT_FP8_E4M3) {
        cJSON_AddNumberToObject(o, "block_rows", t->block_rows);
        cJSON_AddNumberToObject(o, "block_cols", t->block_cols);
    }
    if (t->vector) cJSON_AddBoolToObject(o, "vector", 1);
    if (t->layout == PT_LAYOUT_R16) cJSON_AddStringToObject(o, "layout", "r16");
    if (with_hash) {
        char hx[17];
        snprintf(hx, sizeof hx, "%016" PRIx64, h);
        cJSON_AddStringToObject(o, "xxh64", hx);
    }
    return o;
}

/* Header JSON from the plan; checksums from rt[].xxh64 and el[].xxh (zeros while planning). */
static int build_json(cv *c) {
    cJSON *root = cJSON_CreateObject();
    if (!root) return pt_err(c->err, PETREL_ENOMEM, "out of memory");
    cJSON_AddStringToObject(root, "format", "petrel-pack");
    cJSON_AddNumberToObject(root, "version", PACK_VERSION);
    cJSON_AddStringToObject(root, "config", c->src->config_json);
    if (c->src->generation_config_json) cJSON_AddStringToObject(root, "generation_config", c->src->generation_config_json);
    else cJSON_AddNullToObject(root, "generation_config");
    cJSON *q = cJSON_AddObjectToObject(root, "quant");
    for (int k = 0; k < CV_CLASS_COUNT; k++) cJSON_AddStringToObject(q, convert_class_names[k], convert_quant_name(class_quant(c->o, k)));
    cJSON *ts = cJSON_AddArrayToObject(root, "tensors");
    for (int i = 0; i < c->n_res; i++) cJSON_AddItemToArray(ts, tensor_json(&c->rt[i], c->e[c->res[i]].name, 1, c->rt[i].xxh64));
    cJSON *ex = cJSON_AddArrayToObject(root, "experts");
    for (int i = 0; i < c->n_el; i++) {
        elayer_plan *el = &c->el[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "layer", el->layer);
        cJSON_AddNumberToObject(o, "n_experts", c->E);
        cJSON_AddNumberToObject(o, "first_offset", (double)el->first_offset);
        cJSON_AddNumberToObject(o, "record_bytes", (double)el->record_bytes);
        cJSON *parts = cJSON_AddArrayToObject(o, "parts");
        for (int k = 0; k < 3; k++) cJSON_AddItemToArray(parts, tensor_json(&el->part[k], NULL, 0, 0));
        cJSON *hs = cJSON_AddArrayToObject(o, "xxh64");
        for (int e = 0; e < c->E; e++) {
            char hx[17];
            snprintf(hx, sizeof hx, "%016" PRIx64, el->xxh[e]);
            cJSON_AddItemToArray(hs, cJSON_CreateString(hx));
        }
        cJSON_AddItemToArray(ex, o);
    }
    if (c->src->n_files) { /* side files (pack.h "files"), listed last */
        cJSON *fs = cJSON_AddArrayToObject(root, "files");
        for (int i = 0; i < c->src->n_files; i++) {
            const convert_file *f = &c->src->files[i];
            cJSON *o = cJSON_CreateObject();
            char hx[17];
            snprintf(hx, sizeof hx, "%016" PRIx64, XXH64(f->data, f->len, 0));
            cJSON_AddStringToObject(o, "name", f->name);
            cJSON_AddNumberToObject(o, "offset", (double)c->file_off[i]);
            cJSON_AddNumberToObject(o, "bytes", (double)f->len);
            cJSON_AddStringToObject(o, "xxh64", hx);
            cJSON_AddItemToArray(fs, o);
        }
    }
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!s) return pt_err(c->err, PETREL_ENOMEM, "out of memory");
    free(c->json);
    c->json = s;
    c->json_len = strlen(s);
    return 0;
}

static int plan(cv *c) {
    const petrel_config *cfg = c->src->cfg;
    c->L = cfg->num_hidden_layers;
    c->E = cfg->n_routed_experts;
    c->res = malloc(sizeof(int) * (size_t)(c->n ? c->n : 1));
    c->rt = calloc((size_t)(c->n ? c->n : 1), sizeof(pack_tensor));
    c->rtp = calloc((size_t)(c->n ? c->n : 1), sizeof(tplan));
    c->el = calloc((size_t)c->L + 2, sizeof(elayer_plan));
    if (!c->res || !c->rt || !c->rtp || !c->el) return pt_err(c->err, PETREL_ENOMEM, "out of memory");
    /* expert layers: index entries by (layer, expert, part) */
    for (int i = 0; i < c->n; i++) {
        ent *e = &c->e[i];
        if (e->expert < 0) { c->res[c->n_res++] = i; continue; }
        if (e->layer < 0 || e->layer > c->L || e->expert >= c->E) return pt_err(c->err, PETREL_EFORMAT, "unexpected expert tensor %s", e->name);
        elayer_plan *el = NULL;
        for (int k = 0; k < c->n_el; k++)
            if (c->el[k].layer == e->layer) el = &c->el[k];
        if (!el) {
            el = &c->el[c->n_el++];
            el->layer = e->layer;
            el->ents = malloc(sizeof(int) * (size_t)c->E * 3);
            el->xxh = calloc((size_t)c->E, sizeof(uint64_t));
            if (!el->ents || !el->xxh) return pt_err(c->err, PETREL_ENOMEM, "out of memory");
            for (int k = 0; k < c->E * 3; k++) el->ents[k] = -1;
        }
        el->ents[e->expert * 3 + e->part] = i;
    }
    /* ascending layer order (bind order already is; keep it robust) */
    for (int a = 1; a < c->n_el; a++)
        for (int b = a; b > 0 && c->el[b].layer < c->el[b - 1].layer; b--) {
            elayer_plan t = c->el[b];
            c->el[b] = c->el[b - 1];
            c->el[b - 1] = t;
        }
    for (int k = 0; k < c->n_el; k++) {
        elayer_plan *el = &c->el[k];
        for (int x = 0; x < c->E * 3; x++)
            if (el->ents[x] < 0) return pt_err(c->err, PETREL_EFORMAT, "layer %d: expert %d %s_proj missing", el->layer, x / 3, x % 3 == 0 ? "gate" : x % 3 == 1 ? "up" : "down");
        for (int p = 0; p < 3; p++) {
            el->ent[p] = el->ents[p];
            const ent *e0 = &c->e[el->ent[p]];
            PT_TRY(plan_matrix(c, e0, cls_of(e0, c->L), &el->tp[p]));
            for (int x = 1; x < c->E; x++) {
                const ent *ex = &c->e[el->ents[x * 3 + p]];
                if (ex->src.qtype != e0->src.qtype || ex->rows != e0->rows || ex->cols != e0->cols)
                    return pt_err(c->err, PETREL_EUNSUPPORTED, "layer %d: experts differ in format or shape (%s)", el->layer, ex->name);
            }
        }
    }
    for (int i = 0; i < c->n_res; i++) {
        const ent *e = &c->e[c->res[i]];
        if (!e->vector) PT_TRY(plan_matrix(c, e, cls_of(e, c->L), &c->rtp[i]));
    }
    /* offsets, iterated until the header region size is stable */
    c->data_start = PACK_ALIGN;
    for (int iter = 0; iter < 8; iter++) {
        uint64_t cur = c->data_start;
        for (int i = 0; i < c->src->n_files; i++) { /* side files first, then the resident tensors */
            cur = up_to(cur, PACK_TALIGN);
            c->file_off[i] = cur;
            cur += c->src->files[i].len;
        }
        for (int i = 0; i < c->n_res; i++) PT_TRY(fill_tensor(c, &c->e[c->res[i]], c->e[c->res[i]].vector ? NULL : &c->rtp[i], &cur, &c->rt[i]));
        cur = up_to(cur, PACK_ALIGN);
        for (int k = 0; k < c->n_el; k++) {
            elayer_plan *el = &c->el[k];
            uint64_t rc = 0;
            for (int p = 0; p < 3; p++) {
                PT_TRY(fill_tensor(c, &c->e[el->ent[p]], &el->tp[p], &rc, &el->part[p]));
                pack_tensor *t = &el->part[p];
                if (!c->o->expert_plain && pack_r16_ok(t->qtype, t->rows, t->cols, t->scale_dtype)) t->layout = PT_LAYOUT_R16;
            }
            el->record_bytes = up_to(rc, PACK_ALIGN);
            el->first_offset = cur;
            cur += el->record_bytes * (uint64_t)c->E;
        }
        c->file_size = cur > c->data_start ? cur : c->data_start;
        PT_TRY(build_json(c));
        uint64_t ds = up_to(PACK_PREFIX + c->json_len, PACK_ALIGN);
        if (ds == c->data_start) return 0;
        c->data_start = ds;
    }
    return pt_err(c->err, PETREL_EINVAL, "pack layout did not converge");
}

/* ---- converting ---- */

typedef struct rowjob {
    const cv *c;
    const ent *e;
    const pt_wview *src;
    const tplan *tp;
    int64_t r0, n, per_task;
    uint8_t *pay, *sc;          /* destination of row r0 (payload, scales) */
    const pt_q4x_ctx *q4x;      /* q4x calibration statistics (borrowed) or NULL */
    float **fbuf;               /* per thread [cols] */
    int bad;
} rowjob;

static void row_task(void *ctx, int task, int thread) {
    rowjob *j = ctx;
    const cv *c = j->c;
    const tplan *tp = j->tp;
    int64_t cols = j->e->cols, rb = pt_qtype_row_bytes(tp->q, cols);
    int64_t spr = pt_qtype_scales_per_row(tp->q, cols);
    int es = pt_scale_dtype_bytes(tp->scale_dtype);
    int64_t a = (int64_t)task * j->per_task, b = a + j->per_task < j->n ? a + j->per_task : j->n;
    float *f = j->fbuf[thread];
    for (int64_t i = a; i < b; i++) {
        int64_t r = j->r0 + i;
        uint8_t *dst = j->pay + i * rb;
        if (tp->copy) {
            memcpy(dst, j->src->data + r * j->src->row_bytes, (size_t)rb);
            if (tp->q == PT_Q8_ROW) memcpy(j->sc + i * 4, (const float *)j->src->scale + r, 4);
            else if (tp->q == PT_Q8_G32 || tp->q == PT_Q4_G64)
                memcpy(j->sc + i * spr * es, (const uint8_t *)j->src->scale + r * spr * es, (size_t)(spr * es));
            continue;
        }
        if (c->src->row) c->src->row(c->src->row_ctx, j->e->name, j->e->rows, cols, r, f);
        else pt_dequant_row(j->src, r, f);
        int qr = tp->q4x ? pt_quant_row_q4x(f, cols, j->q4x, dst, j->sc + i * spr * es, tp->scale_dtype)
                         : pt_quant_row(tp->q, f, cols, dst, spr ? j->sc + i * spr * es : NULL, tp->scale_dtype);
        if (qr < 0) j->bad = 1;
    }
}

/* Converts rows [r0, r0 + n) of entry e into pay (payload of row r0) and sc (its scales). */
static int convert_rows(cv *c, const ent *e, const pt_wview *src, const tplan *tp, int64_t r0, int64_t n, uint8_t *pay, uint8_t *sc,
                        float **fbuf) {
    pt_pool *pool = kn_pool();
    int nt = pool_threads(pool);
    rowjob j = {c, e, src, tp, r0, n, 0, pay, sc, NULL, fbuf, 0};
    if (tp->q4x && c->o->calib) j.q4x = calib_q4x(c->o->calib, e->name, e->cols);
    int tasks = nt * 4;
    if (tasks > n) tasks = (int)n;
    j.per_task = (n + tasks - 1) / tasks;
    tasks = (int)((n + j.per_task - 1) / j.per_task);
    pool_run(pool, tasks, row_task, &j);
    if (j.bad) return pt_err(c->err, PETREL_EINVAL, "%s: quantization to %s failed", e->name, pack_qtype_key(tp->q));
    return 0;
}

/* every write goes through the seam (base/outfile.h: pt_pwrite_all) */
static int pwrite_all(int fd, const void *buf, size_t n, uint64_t off, petrel_error *err, const char *what) {
    return pt_pwrite_all(fd, buf, n, off, what, err);
}
static int pread_all(int fd, void *buf, size_t n, uint64_t off) {
    uint8_t *p = buf;
    while (n) {
        ssize_t r = pread(fd, p, n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        p += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

/* Checksum of file ranges [o1, o1+n1) ++ [o2, o2+n2), read through buf (cap bytes). */
static int hash_file(int fd, uint64_t o1, uint64_t n1, uint64_t o2, uint64_t n2, uint8_t *buf, size_t cap, uint64_t *out) {
    XXH64_state_t *st = XXH64_createState();
    if (!st) return -1;
    XXH64_reset(st, 0);
    uint64_t os[2] = {o1, o2}, ns[2] = {n1, n2};
    for (int k = 0; k < 2; k++)
        for (uint64_t d = 0; d < ns[k];) {
            size_t m = ns[k] - d < cap ? (size_t)(ns[k] - d) : cap;
            if (pread_all(fd, buf, m, os[k] + d) < 0) { XXH64_freeState(st); return -1; }
            XXH64_update(st, buf, m);
            d += m;
        }
    *out = XXH64_digest(st);
    XXH64_freeState(st);
    return 0;
}

#define CHUNK ((size_t)32 << 20)

static void progress(cv *c, const char *name, int force) {
    if (!c->o->progress) return;
    uint64_t now = pt_now_ns();
    if (!force && now - c->t_last < 500000000ull) return;
    c->t_last = now;
    int done = 0;
    for (int i = 0; i < c->items; i++) done += c->done[i];
    double s = (double)(now - c->t_start) / 1e9;
    fprintf(stderr, "\r%s: %d/%d items, %.0f MB written, %.0f MB/s  %-60.60s", c->o->label ? c->o->label : "convert", done, c->items,
            (double)c->written / 1e6, s > 0 ? (double)c->written / 1e6 / s : 0.0, name);
    if (force) fputc('\n', stderr);
    fflush(stderr);
}

static int journal_add(cv *c, int item, uint64_t h) {
    c->done[item] = 1;
    fprintf(c->journal, "%d %016" PRIx64 "\n", item, h);
    if (fflush(c->journal) != 0) return pt_err(c->err, PETREL_EIO, "cannot write the conversion journal");
    c->n_done_run++;
    if (c->o->stop_after && c->n_done_run >= c->o->stop_after) return pt_err(c->err, PETREL_ERANGE, "conversion interrupted after %d items (test hook)", c->n_done_run);
    return 0;
}

static int do_resident(cv *c, int i, uint8_t *chunk, float **fbuf) {
    const ent *e = &c->e[c->res[i]];
    pack_tensor *t = &c->rt[i];
    if (e->vector) {
        float *v = (float *)chunk;
        PT_TRY(c->src->ws->vector(c->src->ws->ctx, e->name, e->cols, v, c->err));
        PT_TRY(pwrite_all(c->fd, v, (size_t)t->bytes, t->offset, c->err, e->name));
        t->xxh64 = XXH64(v, (size_t)t->bytes, 0);
        c->written += t->bytes;
        return journal_add(c, i, t->xxh64);
    }
    pt_wview sv;
    PT_TRY(c->src->ws->matrix(c->src->ws->ctx, e->name, e->rows, e->cols, &sv, c->err));
    const tplan *tp = &c->rtp[i];
    uint8_t *scales = NULL;
    if (t->scale_bytes && !(scales = malloc((size_t)t->scale_bytes))) return pt_err(c->err, PETREL_ENOMEM, "out of memory for scales of %s", e->name);
    XXH64_state_t *st = XXH64_createState();
    if (!st) { free(scales); return pt_err(c->err, PETREL_ENOMEM, "out of memory"); }
    XXH64_reset(st, 0);
    int64_t rb = pt_qtype_row_bytes(tp->q, e->cols);
    int64_t per = (int64_t)(CHUNK / (size_t)rb);
    if (per < 1) per = 1;
    int64_t srb = e->rows ? (int64_t)(t->scale_bytes / (uint64_t)e->rows) : 0;
    int rc = 0;
    for (int64_t r0 = 0; r0 < e->rows && rc == 0; r0 += per) {
        int64_t n = e->rows - r0 < per ? e->rows - r0 : per;
        rc = convert_rows(c, e, &sv, tp, r0, n, chunk, tp->q == PT_FP8_E4M3 ? NULL : scales + r0 * srb, fbuf);
        if (rc == 0) rc = pwrite_all(c->fd, chunk, (size_t)(n * rb), t->offset + (uint64_t)(r0 * rb), c->err, e->name);
        if (rc == 0) XXH64_update(st, chunk, (size_t)(n * rb));
        c->written += (uint64_t)(n * rb);
        progress(c, e->name, 0);
    }
    if (rc == 0 && t->scale_bytes) {
        if (tp->q == PT_FP8_E4M3) memcpy(scales, sv.scale, (size_t)t->scale_bytes);
        rc = pwrite_all(c->fd, scales, (size_t)t->scale_bytes, t->scale_offset, c->err, e->name);
        XXH64_update(st, scales, (size_t)t->scale_bytes);
        c->written += t->scale_bytes;
    }
    t->xxh64 = XXH64_digest(st);
    XXH64_freeState(st);
    free(scales);
    if (rc < 0) return rc;
    return journal_add(c, i, t->xxh64);
}

static int do_record(cv *c, int k, int ex, uint8_t *rec, float **fbuf) {
    elayer_plan *el = &c->el[k];
    memset(rec, 0, (size_t)el->record_bytes);
    for (int p = 0; p < 3; p++) {
        const ent *e = &c->e[el->ents[ex * 3 + p]];
        pt_wview sv;
        PT_TRY(c->src->ws->matrix(c->src->ws->ctx, e->name, e->rows, e->cols, &sv, c->err));
        const pack_tensor *t = &el->part[p];
        PT_TRY(convert_rows(c, e, &sv, &el->tp[p], 0, e->rows, rec + t->offset, t->scale_bytes ? rec + t->scale_offset : NULL, fbuf));
        if (el->tp[p].q == PT_FP8_E4M3) memcpy(rec + t->scale_offset, sv.scale, (size_t)t->scale_bytes);
        if (t->layout == PT_LAYOUT_R16) {
            pt_wview v;
            pack_tensor_view(t, rec, &v);
            v.layout = PT_LAYOUT_PLAIN; /* as just written; repacked in place */
            if (kn_r16_repack(&v)) return pt_err(c->err, PETREL_ENOMEM, "out of memory laying out %s", e->name);
        }
    }
    uint64_t off = el->first_offset + (uint64_t)ex * el->record_bytes;
    PT_TRY(pwrite_all(c->fd, rec, (size_t)el->record_bytes, off, c->err, "an expert record"));
    el->xxh[ex] = XXH64(rec, (size_t)el->record_bytes, 0);
    c->written += el->record_bytes;
    int item = c->n_res;
    for (int q = 0; q < k; q++) item += c->E;
    progress(c, c->e[el->ents[ex * 3]].name, 0);
    return journal_add(c, item + ex, el->xxh[ex]);
}

/* Item index -> its file range(s); for checking journaled items. */
static void item_range(const cv *c, int item, uint64_t *o1, uint64_t *n1, uint64_t *o2, uint64_t *n2) {
    *o2 = *n2 = 0;
    if (item < c->n_res) {
        const pack_tensor *t = &c->rt[item];
        *o1 = t->offset;
        *n1 = t->bytes;
        *o2 = t->scale_offset;
        *n2 = t->scale_bytes;
        return;
    }
    item -= c->n_res;
    const elayer_plan *el = &c->el[item / c->E];
    *o1 = el->first_offset + (uint64_t)(item % c->E) * el->record_bytes;
    *n1 = el->record_bytes;
}
static void item_set_hash(cv *c, int item, uint64_t h) {
    if (item < c->n_res) c->rt[item].xxh64 = h;
    else c->el[(item - c->n_res) / c->E].xxh[(item - c->n_res) % c->E] = h;
}

/* What OUT.partial starts with until its pack header is written (and again after a failure):
 * not PACK_MAGIC, so it never opens as a pack, and it says what it is to anyone who looks. */
#define CV_PARTIAL_MARK "PETRELPT unfinished petrel convert output (resumable)\n"
_Static_assert(sizeof CV_PARTIAL_MARK - 1 <= PACK_PREFIX, "the mark fits the prefix");

/* The journal, created through no symbolic link (a link planted at the name is refused). */
static FILE *journal_create(const char *jpath) {
    int fd = open(jpath, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (fd >= 0 && !f) close(fd);
    return f;
}

/* Opens OUT.partial, resuming from the journal when it matches this plan. */
static int open_output(cv *c, const char *partial, const char *jpath, uint64_t fp, uint8_t *buf, size_t cap, convert_result *res) {
    FILE *j = fopen(jpath, "r");
    struct stat st;
    if (j && stat(partial, &st) == 0 && (uint64_t)st.st_size == c->file_size) {
        char line[256];
        uint64_t jfp = 0;
        if (fgets(line, sizeof line, j) && sscanf(line, "petrel-convert-journal 1 %" SCNx64, &jfp) == 1 && jfp == fp) {
            c->fd = open(partial, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
            c->opened = c->fd >= 0;
            while (c->fd >= 0 && fgets(line, sizeof line, j)) {
                int item;
                uint64_t h, o1, n1, o2, n2, got;
                if (sscanf(line, "%d %" SCNx64, &item, &h) != 2 || item < 0 || item >= c->items || !strchr(line, '\n')) continue;
                item_range(c, item, &o1, &n1, &o2, &n2);
                if (hash_file(c->fd, o1, n1, o2, n2, buf, cap, &got) == 0 && got == h) {
                    c->done[item] = 1;
                    item_set_hash(c, item, h);
                }
            }
        }
    }
    if (j) fclose(j);
    int kept = 0;
    for (int i = 0; i < c->items; i++) kept += c->done[i];
    if (res) res->resumed = kept;
    if (c->fd >= 0 && kept) {
        if (c->o->progress) fprintf(stderr, "%s: resuming %s: %d of %d items already written and verified\n", c->o->label ? c->o->label : "convert", partial, kept, c->items);
        c->journal = journal_create(jpath);
        if (!c->journal) return pt_err(c->err, PETREL_EIO, "cannot write %s: %s", jpath, strerror(errno));
        fprintf(c->journal, "petrel-convert-journal 1 %016" PRIx64 "\n", fp);
        for (int i = 0; i < c->items; i++)
            if (c->done[i]) {
                uint64_t h = i < c->n_res ? c->rt[i].xxh64 : c->el[(i - c->n_res) / c->E].xxh[(i - c->n_res) % c->E];
                fprintf(c->journal, "%d %016" PRIx64 "\n", i, h);
            }
        fflush(c->journal);
        return 0;
    }
    if (c->fd >= 0) close(c->fd);
    memset(c->done, 0, (size_t)c->items);
    c->fd = open(partial, O_RDWR | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (c->fd < 0) return pt_err(c->err, PETREL_EIO, "cannot create %s: %s", partial, strerror(errno));
    c->opened = 1;
    if (ftruncate(c->fd, (off_t)c->file_size) < 0) return pt_err(c->err, PETREL_EIO, "cannot size %s to %" PRIu64 " bytes: %s", partial, c->file_size, strerror(errno));
    PT_TRY(pwrite_all(c->fd, CV_PARTIAL_MARK, sizeof CV_PARTIAL_MARK - 1, 0, c->err, partial)); /* says what it is until the header */
    c->journal = journal_create(jpath);
    if (!c->journal) return pt_err(c->err, PETREL_EIO, "cannot write %s: %s", jpath, strerror(errno));
    fprintf(c->journal, "petrel-convert-journal 1 %016" PRIx64 "\n", fp);
    if (fflush(c->journal) != 0) return pt_err(c->err, PETREL_EIO, "cannot write %s: %s", jpath, strerror(errno));
    return 0;
}

static int write_header(cv *c, const char *partial) {
    size_t planned = c->json_len;
    PT_TRY(build_json(c));
    if (c->json_len != planned) return pt_err(c->err, PETREL_EINVAL, "internal: header length changed (%zu vs %zu)", c->json_len, planned);
    uint8_t pre[PACK_PREFIX] = {0};
    memcpy(pre, PACK_MAGIC, 8);
    uint32_t ver = PACK_VERSION, flags = 0;
    uint64_t hl = c->json_len, fs = c->file_size, hh = XXH64(c->json, c->json_len, 0);
    memcpy(pre + 8, &ver, 4);
    memcpy(pre + 12, &flags, 4);
    memcpy(pre + 16, &hl, 8);
    memcpy(pre + 24, &fs, 8);
    memcpy(pre + 32, &hh, 8);
    PT_TRY(pwrite_all(c->fd, pre, PACK_PREFIX, 0, c->err, partial));
    PT_TRY(pwrite_all(c->fd, c->json, c->json_len, PACK_PREFIX, c->err, partial));
    c->header_written = 1;
    if (pt_fsync(c->fd) < 0) return pt_err(c->err, PETREL_EIO, "fdatasync %s: %s", partial, strerror(errno));
    return 0;
}

/* After a failure: nothing may look like a good pack. OUT.partial and its journal stay only when
 * the journal holds finished items to resume from (and the message says so); a header already
 * written is replaced by CV_PARTIAL_MARK first, and if even that fails both are removed. */
static void failed_output(cv *c, const char *partial, const char *jpath, petrel_error *err) {
    int kept = 0;
    for (int i = 0; i < c->items; i++) kept += c->done[i];
    if (c->header_written) {
        int fd = c->fd >= 0 ? c->fd : open(partial, O_WRONLY | O_NOFOLLOW | O_CLOEXEC);
        int ok = fd >= 0 && pwrite(fd, CV_PARTIAL_MARK, sizeof CV_PARTIAL_MARK - 1, 0) == (ssize_t)sizeof CV_PARTIAL_MARK - 1 && fdatasync(fd) == 0;
        if (fd >= 0 && fd != c->fd) close(fd);
        if (!ok) kept = 0;
    }
    if (c->journal) { fclose(c->journal); c->journal = NULL; }
    if (!kept) {
        if (c->fd >= 0) { close(c->fd); c->fd = -1; }
        unlink(partial);
        unlink(jpath);
        return;
    }
    char note[600];
    snprintf(note, sizeof note, " (%d of %d items kept in %.400s for resuming: run the same command again; delete it to start over)", kept,
             c->items, partial);
    size_t l = strlen(err->msg), nl = strlen(note);
    if (l + nl < sizeof err->msg) memcpy(err->msg + l, note, nl + 1);
}

static void cv_free(cv *c) {
    for (int i = 0; i < c->n; i++) free(c->e[i].name);
    free(c->e);
    free(c->res);
    free(c->rt);
    free(c->rtp);
    if (c->el)
        for (int k = 0; k < c->n_el; k++) { free(c->el[k].ents); free(c->el[k].xxh); }
    free(c->el);
    free(c->json);
    free(c->done);
    if (c->journal) fclose(c->journal);
    if (c->fd >= 0) close(c->fd);
}

int convert_from_wsource(const convert_src *src, const char *out_path, const convert_opts *o, convert_result *res, petrel_error *err) {
    cv c;
    memset(&c, 0, sizeof c);
    c.src = src;
    c.o = o;
    c.err = err;
    c.fd = -1;
    if (res) memset(res, 0, sizeof *res);
    /* 0. the target: a new or regular file (never through a link, FIFO or device); callers that
     * know the input also refuse the input itself (pt_out_check with it) */
    PT_TRY(pt_out_check(out_path, NULL, err));
    /* 1. list */
    lister ls = {src->ws, NULL, 0, 0, 0};
    wsource lw = {&ls, ls_matrix, ls_vector, ls_has};
    model_w w;
    int rc = weights_bind(&w, src->cfg, &lw, err);
    if (rc == 0) weights_deinit(&w, src->cfg);
    c.e = ls.e;
    c.n = ls.n;
    if (rc < 0) { cv_free(&c); return pt_err_ctx(err, "listing the source's tensors"); }
    /* 2. plan */
    if ((rc = plan(&c)) < 0) { cv_free(&c); return rc; }
    c.items = c.n_res + c.n_el * c.E;
    uint64_t fp = XXH64(c.json, c.json_len, 0x706574726574ull);
    size_t maxrec = 0;
    for (int k = 0; k < c.n_el; k++)
        if (c.el[k].record_bytes > maxrec) maxrec = (size_t)c.el[k].record_bytes;
    int64_t maxcols = 1;
    for (int i = 0; i < c.n; i++)
        if (c.e[i].cols > maxcols) maxcols = c.e[i].cols;
    int nt = pool_threads(kn_pool());
    uint8_t *chunk = malloc(CHUNK + (size_t)maxcols * 4);
    uint8_t *rec = maxrec ? malloc(maxrec) : NULL;
    float **fbuf = calloc((size_t)nt, sizeof(float *));
    c.done = calloc((size_t)c.items + 1, 1);
    int ok = chunk && (rec || !maxrec) && fbuf && c.done;
    for (int t = 0; ok && t < nt; t++) ok = (fbuf[t] = malloc(sizeof(float) * (size_t)maxcols)) != NULL;
    char partial[4200], jpath[4300];
    snprintf(partial, sizeof partial, "%s.partial", out_path);
    snprintf(jpath, sizeof jpath, "%s.journal", partial);
    if (!ok) rc = pt_err(err, PETREL_ENOMEM, "out of memory for conversion buffers");
    /* 3. resume or start */
    if (rc == 0) rc = open_output(&c, partial, jpath, fp, chunk, CHUNK, res);
    c.t_start = c.t_last = pt_now_ns();
    /* 4. convert */
    for (int i = 0; rc == 0 && i < c.n_res; i++)
        if (!c.done[i]) rc = do_resident(&c, i, chunk, fbuf);
    for (int k = 0; rc == 0 && k < c.n_el; k++)
        for (int ex = 0; rc == 0 && ex < c.E; ex++)
            if (!c.done[c.n_res + k * c.E + ex]) rc = do_record(&c, k, ex, rec, fbuf);
    if (rc == 0) progress(&c, "done", 1);
    else if (o->progress) fputc('\n', stderr);
    /* 5. header, verify, rename */
    for (int i = 0; rc == 0 && i < src->n_files; i++) /* small, rewritten on every run; checked by pack_verify */
        rc = pwrite_all(c.fd, src->files[i].data, src->files[i].len, c.file_off[i], err, src->files[i].name);
    if (rc == 0) rc = write_header(&c, partial);
    if (rc == 0) {
        close(c.fd);
        c.fd = -1;
        pack *p;
        rc = pack_open(partial, &p, err);
        if (rc == 0) {
            if (o->progress) fprintf(stderr, "%s: verifying checksums of %s\n", o->label ? o->label : "convert", partial);
            rc = pack_verify(p, err);
            pack_close(p);
        }
        if (rc < 0) pt_err_ctx(err, "verifying the written pack");
    }
    if (rc == 0) rc = pt_out_check(out_path, NULL, err); /* again: it may have changed meanwhile */
    if (rc == 0 && rename(partial, out_path) < 0) rc = pt_err(err, PETREL_EIO, "cannot rename %s to %s: %s", partial, out_path, strerror(errno));
    if (rc == 0) pt_sync_parent(out_path);
    if (rc < 0 && c.opened) failed_output(&c, partial, jpath, err);
    if (rc == 0) {
        unlink(jpath);
        if (res) {
            res->items = c.items;
            res->file_bytes = c.file_size;
        }
    }
    if (fbuf)
        for (int t = 0; t < nt; t++) free(fbuf[t]);
    free(fbuf);
    free(chunk);
    free(rec);
    cv_free(&c);
    return rc;
}

int convert_configs_load(const char *dir, convert_configs *cc, petrel_error *err) {
    memset(cc, 0, sizeof *cc);
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    PT_TRY(pt_read_file(path, 16u << 20, &cc->config_json, NULL, err));
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    if (pt_read_file(path, 16u << 20, &cc->generation_config_json, NULL, NULL) < 0) cc->generation_config_json = NULL;
    int rc = config_load_dir(dir, &cc->cfg, err);
    cc->loaded = rc == 0;
    /* the tokenizer and chat template, so the pack is self-contained: absent is fine, present
     * but unreadable is an error (the pack would silently lack it) */
    static const char *const side[CONVERT_N_SIDE] = CONVERT_SIDE_FILES;
    for (int i = 0; rc == 0 && i < CONVERT_N_SIDE; i++) {
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dir, side[i]);
        if (stat(path, &st) < 0 && errno == ENOENT) continue;
        if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
            rc = pt_err(err, PETREL_EIO, "%s is not a regular file (the pack would store it as the model's %s)", path, side[i]);
            break;
        }
        char *data = NULL;
        size_t len = 0;
        rc = pt_read_file(path, (size_t)PACK_FILE_MAX_BYTES, &data, &len, err);
        if (rc == 0) cc->files[cc->n_files++] = (convert_file){side[i], data, len};
    }
    if (rc < 0) {
        convert_configs_free(cc);
        return rc;
    }
    return 0;
}

void convert_configs_free(convert_configs *cc) {
    if (cc->loaded) config_deinit(&cc->cfg);
    free(cc->config_json);
    free(cc->generation_config_json);
    for (int i = 0; i < cc->n_files; i++) free((char *)cc->files[i].data);
    memset(cc, 0, sizeof *cc);
}

int convert_hf(const char *in, const char *out_path, const convert_opts *o, convert_result *res, petrel_error *err) {
    struct stat st;
    if (stat(in, &st) < 0) return pt_err(err, PETREL_EIO, "cannot open %s: no such file or folder", in);
    if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode))
        return pt_err(err, PETREL_EINVAL, "%s is not a model: not a folder or a regular file", in);
    if (!S_ISDIR(st.st_mode) && pack_is_pack(in))
        return pt_err(err, PETREL_EINVAL, "%s is a petrel pack already: convert reads Hugging Face folders, .safetensors files and colibri folders", in);
    if (!S_ISDIR(st.st_mode)) PT_TRY(engine_check_model_file(in, err));
    char dir[4096], tmp[4096];
    snprintf(dir, sizeof dir, "%s", in);
    if (!S_ISDIR(st.st_mode)) {
        snprintf(tmp, sizeof tmp, "%s", in);
        snprintf(dir, sizeof dir, "%s", dirname(tmp));
    }
    convert_configs cc;
    PT_TRY(convert_configs_load(dir, &cc, err));
    st_set *set = NULL;
    int rc = st_open(in, &set, err);
    if (rc == 0) {
        st_wsource sws;
        wsource ws;
        wsource_safetensors(&ws, &sws, set, &cc.cfg);
        convert_src src = {cc.config_json, cc.generation_config_json, &cc.cfg, &ws, NULL, NULL, cc.files, cc.n_files};
        rc = convert_from_wsource(&src, out_path, o, res, err);
        st_close(set);
    }
    convert_configs_free(&cc);
    return rc;
}
