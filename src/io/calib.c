/* calib.c: gathers per-input-column mean x^2 for every matrix of a source model over a text (see
 * calib.h). The matrices are listed by running weights_bind over a recording wrapper of the
 * engine's own safetensors source, so each name comes with the address range of its mapped
 * bytes; the kernel observer then finds the matrix of a product by the address of its view
 * (row sub-views such as MLA's W_UK / W_UV fall inside kv_b_proj). Sums are kept in double under
 * one mutex (products of one forward may run on several threads). */
#include "io/calib.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "base/file.h"
#include "kernels/kernels.h"
#include "model/engine.h"
#include "model/weights.h"
#include "quant/quant.h"
#include "text/tokenizer.h"

typedef struct centry {
    char *name;              /* owned */
    const uint8_t *lo, *hi;  /* view: the mapped bytes [lo, hi) */
    int64_t cols;
    double *sum;             /* owned [cols]: sum of x_j^2 */
    double *hs;              /* owned [cols][cols] sum of x x^T (upper triangle while running;
                                made symmetric and divided by rows at the end), or NULL for
                                matrices wider than CALIB_FULL_COLS */
    double *u;               /* owned [cols][cols] pt_q4x_prepare(hs), or NULL */
    int64_t rows;            /* rows added */
    float *imp;              /* owned [cols]: sum / rows, made at the end */
    pt_q4x_ctx q4x;          /* views of imp, hs, u */
} centry;

struct calib_stats {
    centry *e;               /* owned [n], sorted by lo */
    int n, cap;
    int oom;
    pthread_mutex_t mu;
    const wsource *inner;    /* borrowed while listing */
};

static int is_router(const char *name) {
    size_t n = strlen(name);
    return n > 16 && !strcmp(name + n - 16, ".mlp.gate.weight");
}

static int rec_matrix(void *ctx, const char *name, int64_t rows, int64_t cols, pt_wview *out, petrel_error *err) {
    calib_stats *s = ctx;
    PT_TRY(s->inner->matrix(s->inner->ctx, name, rows, cols, out, err));
    if (is_router(name) || !out->data) return 0;
    if (s->n == s->cap) {
        int cap = s->cap ? s->cap * 2 : 256;
        centry *t = realloc(s->e, sizeof(centry) * (size_t)cap);
        if (!t) return pt_err(err, PETREL_ENOMEM, "out of memory listing tensors");
        s->e = t;
        s->cap = cap;
    }
    centry *e = &s->e[s->n];
    memset(e, 0, sizeof *e);
    e->name = strdup(name);
    e->sum = calloc((size_t)cols, sizeof(double));
    if (cols <= CALIB_FULL_COLS) e->hs = calloc((size_t)(cols * cols), sizeof(double));
    if (!e->name || !e->sum || (cols <= CALIB_FULL_COLS && !e->hs)) {
        free(e->name);
        free(e->sum);
        free(e->hs);
        return pt_err(err, PETREL_ENOMEM, "out of memory listing tensors");
    }
    e->lo = out->data;
    e->hi = out->data + rows * out->row_bytes;
    e->cols = cols;
    s->n++;
    return 0;
}
static int rec_vector(void *ctx, const char *name, int64_t n, float *out, petrel_error *err) {
    calib_stats *s = ctx;
    return s->inner->vector(s->inner->ctx, name, n, out, err);
}
static int rec_has(void *ctx, const char *name) {
    calib_stats *s = ctx;
    return s->inner->has(s->inner->ctx, name);
}

static int by_lo(const void *a, const void *b) {
    const centry *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* The entry whose bytes hold p (entries do not overlap), or NULL. */
static centry *find(calib_stats *s, const uint8_t *p) {
    int a = 0, b = s->n - 1;
    while (a <= b) {
        int m = (a + b) / 2;
        if (p < s->e[m].lo) b = m - 1;
        else if (p >= s->e[m].hi) a = m + 1;
        else return &s->e[m];
    }
    return NULL;
}

static void observe(void *ctx, const pt_wview *W, const float *x, int n) {
    calib_stats *s = ctx;
    centry *e = find(s, W->data);
    if (!e || e->cols != W->cols) return;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < n; i++) {
        const float *r = x + (size_t)i * (size_t)W->cols;
        for (int64_t j = 0; j < W->cols; j++) e->sum[j] += (double)r[j] * r[j];
        if (e->hs)
            for (int64_t a = 0; a < W->cols; a++) {
                double xa = r[a], *h = e->hs + a * W->cols;
                for (int64_t b = a; b < W->cols; b++) h[b] += xa * r[b];
            }
    }
    e->rows += n;
    pthread_mutex_unlock(&s->mu);
}

void calib_free(calib_stats *s) {
    if (!s) return;
    for (int i = 0; i < s->n; i++) {
        free(s->e[i].name);
        free(s->e[i].sum);
        free(s->e[i].hs);
        free(s->e[i].u);
        free(s->e[i].imp);
    }
    free(s->e);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static const centry *by_name(const calib_stats *s, const char *name) {
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->e[i].name, name)) return &s->e[i];
    return NULL;
}

const float *calib_importance(const calib_stats *s, const char *name, int64_t cols) {
    const centry *e = s ? by_name(s, name) : NULL;
    return e && e->cols == cols && e->rows > 0 ? e->imp : NULL;
}

const pt_q4x_ctx *calib_q4x(const calib_stats *s, const char *name, int64_t cols) {
    const centry *e = s ? by_name(s, name) : NULL;
    return e && e->cols == cols && e->rows > 0 ? &e->q4x : NULL;
}

int64_t calib_rows(const calib_stats *s, const char *name) {
    const centry *e = s ? by_name(s, name) : NULL;
    return e ? e->rows : 0;
}

/* Lists the engine's matrices into s (names, address ranges). */
static int list_matrices(petrel_engine *eng, calib_stats *s, petrel_error *err) {
    wsource inner;
    st_wsource sws;
    wsource_safetensors(&inner, &sws, eng->src, &eng->cfg);
    s->inner = &inner;
    wsource rec = {s, rec_matrix, rec_vector, rec_has};
    model_w w;
    int rc = weights_bind(&w, &eng->cfg, &rec, err);
    if (rc == 0) weights_deinit(&w, &eng->cfg);
    s->inner = NULL;
    if (rc < 0) return pt_err_ctx(err, "listing the model's tensors");
    qsort(s->e, (size_t)s->n, sizeof(centry), by_lo);
    return 0;
}

static int run_text(petrel_engine *eng, calib_stats *s, const int32_t *ids, int64_t n, int ctx, calib_info *info, petrel_error *err) {
    petrel_session *ses = NULL;
    PT_TRY(petrel_session_create(eng, ctx, &ses, err));
    ses->mla = MLA_RECONSTRUCTED; /* kv_b_proj then sees its input, the latent */
    int V = eng->cfg.vocab_size;
    float *logits = malloc(sizeof(float) * (size_t)ctx * (size_t)V);
    int rc = logits ? 0 : pt_err(err, PETREL_ENOMEM, "out of memory for calibration logits");
    kn_set_observer(observe, s);
    for (int64_t t0 = 0; rc == 0 && t0 < n; t0 += ctx) {
        int len = (int)(n - t0 < ctx ? n - t0 : ctx);
        if ((rc = petrel_session_truncate(ses, 0, err)) < 0) break;
        rc = petrel_session_forward(ses, ids + t0, len, logits, 1, err);
        info->windows++;
        info->tokens += len;
    }
    kn_set_observer(NULL, NULL);
    free(logits);
    petrel_session_free(ses);
    return rc;
}

int calib_run(const char *model_dir, const char *text_path, const calib_opts *o, calib_stats **out,
              calib_info *info, petrel_error *err) {
    *out = NULL;
    calib_info inf;
    memset(&inf, 0, sizeof inf);
    char *text = NULL;
    size_t tlen = 0;
    PT_TRY(pt_read_file(text_path, (size_t)1 << 30, &text, &tlen, err));
    if (tlen == 0) {
        free(text);
        return pt_err(err, PETREL_EINVAL, "calibration text %s is empty", text_path);
    }
    petrel_engine *eng = NULL;
    petrel_open_opts oo;
    memset(&oo, 0, sizeof oo);
    oo.n_threads = o ? o->n_threads : 0;
    int rc = petrel_engine_open(model_dir, &oo, &eng, err);
    if (rc == 0 && !eng->src)
        rc = pt_err(err, PETREL_EUNSUPPORTED, "--calib needs a Hugging Face checkpoint (bf16/FP8) as the source, not %s", model_dir);
    tokenizer *tok = NULL;
    if (rc == 0) {
        char tp[4200];
        snprintf(tp, sizeof tp, "%s/tokenizer.json", eng->path);
        if (eng->path[0] && strstr(eng->path, ".safetensors")) { /* a file: its folder */
            char *sl = strrchr(eng->path, '/');
            snprintf(tp, sizeof tp, "%.*s/tokenizer.json", sl ? (int)(sl - eng->path) : 1, sl ? eng->path : ".");
        }
        rc = tok_load(tp, &tok, err);
        if (rc < 0) pt_err_ctx(err, "calibration needs the model's tokenizer");
    }
    int32_t *ids = NULL;
    size_t nid = 0;
    if (rc == 0) {
        rc = tok_encode(tok, text, tlen, &ids, &nid, err);
        if (rc < 0) pt_err_ctx(err, "calibration text %s", text_path);
        else if (nid < 2) rc = pt_err(err, PETREL_EINVAL, "calibration text %s has %zu token%s (need at least 2)", text_path, nid, nid == 1 ? "" : "s");
    }
    if (rc == 0 && o && o->max_tokens > 0 && nid > (size_t)o->max_tokens) nid = (size_t)o->max_tokens;
    calib_stats *s = NULL;
    if (rc == 0) {
        s = calloc(1, sizeof *s);
        if (!s) rc = pt_err(err, PETREL_ENOMEM, "out of memory");
        else pthread_mutex_init(&s->mu, NULL);
    }
    if (rc == 0) rc = list_matrices(eng, s, err);
    if (rc == 0) {
        int ctx = o && o->ctx > 0 ? o->ctx : 512;
        if (ctx > eng->cfg.max_position_embeddings) ctx = eng->cfg.max_position_embeddings;
        rc = run_text(eng, s, ids, (int64_t)nid, ctx, &inf, err);
        if (rc < 0) pt_err_ctx(err, "running the calibration text");
    }
    for (int i = 0; rc == 0 && i < s->n; i++) {
        centry *e = &s->e[i];
        if (!e->rows) continue;
        if (!(e->imp = malloc(sizeof(float) * (size_t)e->cols))) { rc = pt_err(err, PETREL_ENOMEM, "out of memory"); break; }
        for (int64_t j = 0; j < e->cols; j++) e->imp[j] = (float)(e->sum[j] / (double)e->rows);
        inf.observed++;
        e->q4x.cols = e->cols;
        e->q4x.imp = e->imp;
        if (!e->hs) continue;
        int64_t n = e->cols;
        for (int64_t a = 0; a < n; a++)
            for (int64_t b = a; b < n; b++) e->hs[b * n + a] = e->hs[a * n + b] /= (double)e->rows;
        if (!(e->u = malloc(sizeof(double) * (size_t)(n * n)))) { rc = pt_err(err, PETREL_ENOMEM, "out of memory"); break; }
        if (pt_q4x_prepare(e->hs, n, e->u) < 0) { free(e->u); e->u = NULL; continue; } /* group search only */
        e->q4x.H = e->hs;
        e->q4x.U = e->u;
    }
    if (s) inf.matrices = s->n;
    free(ids);
    tok_free(tok);
    petrel_engine_close(eng);
    free(text);
    if (rc < 0) {
        calib_free(s);
        return rc;
    }
    if (info) *info = inf;
    *out = s;
    return 0;
}
