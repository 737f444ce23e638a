/* test_colibri.c: the colibri artifact reader (src/io/colibri.c) against artifacts built here.
 *
 * No real colibri artifact is at hand, so build_artifact() makes one from the bundled tiny
 * model by following shared/docs/colibri-format.md literally, with its own quantizers (not
 * petrel's): int4 group 64 for routed experts, int8 per row for attention / embeddings /
 * lm_head, int4 per row for the dense MLP, int4 g32 / g16 for the shared expert and one q_a_proj
 * (to reach every conversion path), an int8 MTP layer in out-mtp-00001, F32 norms / router /
 * biases, optional indexer weights in out-idx-00001. Main shards are cut so that experts
 * straddle shards in every way (gate | up, payloads | scales, one scale array | the next) and a
 * dense tensor's payload and scales are split.
 *
 * The exact check: an engine over the artifact and one over a Hugging Face folder holding the
 * DEQUANTIZED values (q * s, as F32) give the same logits within 1e-5: the reader decodes
 * every format exactly. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "io/colibri.h"
#include "kernels/kernels.h"
#include "io/convert.h"
#include "io/safetensors.h"
#include "model/engine.h"
#include "quant/qtypes.h"
#include "test.h"

/* Flip to 1 once forward.c/dsa.c handle engines without indexer weights (engine->no_indexer):
 * a forward over a no-indexer artifact then runs up to index_topk keys and refuses beyond. */
#ifndef COLIBRI_TEST_NO_INDEXER_FORWARD
#define COLIBRI_TEST_NO_INDEXER_FORWARD 1
#endif

/* ---- reference quantizers, straight from colibri-format.md ---- */

enum { F_F32, F_I8, F_I4ROW, F_I4G };

/* int8 per row: s = max|w| / 127 (floor 1e-8), q = clamp(round(w / s), -128, 127). */
static void quant_i8(const float *w, int64_t O, int64_t I, uint8_t *pay, float *qs, float *deq) {
    for (int64_t o = 0; o < O; o++) {
        float m = 0;
        for (int64_t j = 0; j < I; j++) m = fmaxf(m, fabsf(w[o * I + j]));
        float s = fmaxf(m / 127.f, 1e-8f);
        qs[o] = s;
        for (int64_t j = 0; j < I; j++) {
            float q = fminf(fmaxf(rintf(w[o * I + j] / s), -128.f), 127.f);
            pay[o * I + j] = (uint8_t)(int8_t)q;
            deq[o * I + j] = q * s;
        }
    }
}

/* int4 per group gs (gs = I: per row): s = max|w| / 7, q = clamp(rint(w / s), -8, 7), nibble
 * q + 8, even column in the low nibble, rows padded to ceil(I / 2) bytes. */
static void quant_i4(const float *w, int64_t O, int64_t I, int64_t gs, uint8_t *pay, float *qs, float *deq) {
    int64_t G = (I + gs - 1) / gs, rb = (I + 1) / 2;
    memset(pay, 0, (size_t)(O * rb));
    for (int64_t o = 0; o < O; o++)
        for (int64_t g = 0; g < G; g++) {
            int64_t j0 = g * gs, j1 = j0 + gs < I ? j0 + gs : I;
            float m = 0;
            for (int64_t j = j0; j < j1; j++) m = fmaxf(m, fabsf(w[o * I + j]));
            float s = fmaxf(m / 7.f, 1e-8f);
            qs[o * G + g] = s;
            for (int64_t j = j0; j < j1; j++) {
                float q = fminf(fmaxf(rintf(w[o * I + j] / s), -8.f), 7.f);
                pay[o * rb + j / 2] |= (uint8_t)(((int)q + 8) << ((j & 1) * 4));
                deq[o * I + j] = q * s;
            }
        }
}

/* ---- artifact entries ---- */

enum { K_MAIN, K_MTP, K_IDX };

typedef struct {
    char name[200];
    st_dtype dt;
    int ndim;
    int64_t shape[2];
    void *data; /* owned */
    int kind;
} entry;

typedef struct {
    entry *v;
    int n, cap;
} elist;

static entry *add(elist *l, const char *name, st_dtype dt, int ndim, int64_t d0, int64_t d1, void *data, int kind) {
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 256;
        l->v = realloc(l->v, sizeof(entry) * (size_t)l->cap);
    }
    entry *e = &l->v[l->n++];
    snprintf(e->name, sizeof e->name, "%s", name);
    e->dt = dt;
    e->ndim = ndim;
    e->shape[0] = d0;
    e->shape[1] = d1;
    e->data = data;
    e->kind = kind;
    return e;
}

static void elist_free(elist *l) {
    for (int i = 0; i < l->n; i++) free(l->v[i].data);
    free(l->v);
    memset(l, 0, sizeof *l);
}

static const entry *efind(const elist *l, const char *name) {
    for (int i = 0; i < l->n; i++)
        if (!strcmp(l->v[i].name, name)) return &l->v[i];
    return NULL;
}

/* Adds `name` quantized as fmt (gs for F_I4G) to `art` (payload + .qs) and its dequantized
 * values to `hf` (F32 2-D). */
static void add_matrix(elist *art, elist *hf, const char *name, const float *w, int64_t O, int64_t I, int fmt, int gs, int kind) {
    float *deq = malloc(sizeof(float) * (size_t)(O * I));
    char qn[220];
    snprintf(qn, sizeof qn, "%s.qs", name);
    if (fmt == F_F32) {
        memcpy(deq, w, sizeof(float) * (size_t)(O * I));
        float *c = malloc(sizeof(float) * (size_t)(O * I));
        memcpy(c, w, sizeof(float) * (size_t)(O * I));
        add(art, name, ST_F32, 2, O, I, c, kind);
    } else if (fmt == F_I8) {
        uint8_t *pay = malloc((size_t)(O * I));
        float *qs = malloc(sizeof(float) * (size_t)O);
        quant_i8(w, O, I, pay, qs, deq);
        add(art, name, ST_U8, 1, O * I, 0, pay, kind);
        add(art, qn, ST_F32, 1, O, 0, qs, kind);
    } else {
        int64_t g = fmt == F_I4ROW ? I : gs, G = (I + g - 1) / g, rb = (I + 1) / 2;
        uint8_t *pay = malloc((size_t)(O * rb));
        float *qs = malloc(sizeof(float) * (size_t)(O * G));
        quant_i4(w, O, I, g, pay, qs, deq);
        add(art, name, ST_U8, 1, O * rb, 0, pay, kind);
        add(art, qn, ST_F32, 1, O * G, 0, qs, kind);
    }
    if (hf) add(hf, name, ST_F32, 2, O, I, deq, kind);
    else free(deq);
}

static int write_list(const char *path, const entry *const *es, int n) {
    st_write_tensor *ts = calloc((size_t)n + 1, sizeof *ts);
    for (int i = 0; i < n; i++) {
        ts[i].name = es[i]->name;
        ts[i].dtype = es[i]->dt;
        ts[i].ndim = es[i]->ndim;
        ts[i].shape[0] = es[i]->shape[0];
        ts[i].shape[1] = es[i]->shape[1];
        ts[i].data = es[i]->data;
    }
    petrel_error err = {0};
    int rc = st_write(path, ts, n, &err);
    if (rc) test_fail(__FILE__, __LINE__, "st_write %s: %s", path, err.msg);
    free(ts);
    return rc;
}

static void copy_file(const char *from, const char *to) {
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    CHECK(a && b);
    if (a && b) {
        char buf[4096];
        size_t n;
        while ((n = fread(buf, 1, sizeof buf, a)) > 0) CHECK(fwrite(buf, 1, n, b) == n);
    }
    if (a) fclose(a);
    if (b) fclose(b);
}

static void mkdir_p(const char *d) { CHECK(mkdir(d, 0755) == 0 || errno == EEXIST); }

/* The format a tiny-model tensor gets in the test artifact. */
static int pick_format(const char *name, int li, int L, int *gs) {
    *gs = 0;
    size_t n = strlen(name);
    if (n > 15 && !strcmp(name + n - 15, "mlp.gate.weight")) return F_F32; /* router */
    if (strstr(name, "indexer.weights_proj")) return F_F32;
    if (li == L) return F_I8;                                               /* MTP: int8 throughout */
    if (strstr(name, ".mlp.experts.")) { *gs = 64; return F_I4G; }
    if (strstr(name, ".mlp.shared_experts.down_proj")) { *gs = 16; return F_I4G; }
    if (strstr(name, ".mlp.shared_experts.")) { *gs = 32; return F_I4G; }
    if (li == 0 && strstr(name, ".mlp.")) return F_I4ROW;                   /* dense MLP */
    if (li == 2 && strstr(name, "self_attn.q_a_proj")) { *gs = 16; return F_I4G; }
    return F_I8;
}

static int layer_of(const char *name) {
    int li = -1;
    if (sscanf(name, "model.layers.%d.", &li) != 1) return -1;
    return li;
}

/* Builds a colibri artifact from tests/data/FIXTURE in `dir` (with or without out-idx shards),
 * and, if hf_dir, a Hugging Face folder of the dequantized values. `drop` (may be NULL) names
 * a tensor left out of the artifact. The shard cuts below name tiny's tensors; another fixture
 * simply gets fewer shards. */
static int build_artifact_of(const char *fixture, const char *dir, int with_idx, const char *hf_dir, const char *drop) {
    petrel_error err = {0};
    st_set *src;
    char fx[256];
    snprintf(fx, sizeof fx, "%s/model.safetensors", fixture);
    if (st_open(test_data(fx), &src, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return -1; }
    snprintf(fx, sizeof fx, "%s/config.json", fixture);
    petrel_config cfg;
    if (config_load_dir(test_data(fixture), &cfg, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); st_close(src); return -1; }
    int L = cfg.num_hidden_layers;
    elist art = {0}, hf = {0};
    for (int i = 0; i < src->n_tensors; i++) {
        const st_tensor *t = &src->tensors[i];
        if (!strcmp(t->name, "__metadata__")) continue;
        int64_t n = st_numel(t);
        float *w = malloc(sizeof(float) * (size_t)n);
        for (int64_t k = 0; k < n; k++)
            w[k] = t->dtype == ST_F32 ? ((const float *)t->data)[k] : pt_bf16_to_f32(((const uint16_t *)t->data)[k]);
        int li = layer_of(t->name);
        int kind = strstr(t->name, ".self_attn.indexer.") ? K_IDX : li == L ? K_MTP : K_MAIN;
        if (t->ndim == 1) {
            float *c = malloc(sizeof(float) * (size_t)n);
            memcpy(c, w, sizeof(float) * (size_t)n);
            add(&art, t->name, ST_F32, 1, n, 0, c, kind);
            add(&hf, t->name, ST_F32, 1, n, 0, w, kind);
            continue;
        }
        int gs, fmt = pick_format(t->name, li, L, &gs);
        add_matrix(&art, &hf, t->name, w, t->shape[0], t->shape[1], fmt, gs, kind);
        free(w);
    }
    /* Main shards in colibri's order: per layer its dense tensors (payload, scales), then the
     * expert payloads (down, gate, up per expert), then their scales; cut where noted. */
    const entry **ord = calloc((size_t)art.n, sizeof(entry *));
    int no = 0;
    char nm[256];
#define EMIT(e_) do { const entry *e__ = (e_); if (e__ && (!drop || strcmp(e__->name, drop))) ord[no++] = e__; } while (0)
#define EMIT2(name_) do { EMIT(efind(&art, name_)); snprintf(nm, sizeof nm, "%s.qs", name_); EMIT(efind(&art, nm)); } while (0)
    EMIT2("model.embed_tokens.weight");
    for (int l = 0; l < L; l++) {
        char pre[64];
        snprintf(pre, sizeof pre, "model.layers.%d.", l);
        for (int i = 0; i < art.n; i++) {
            const entry *e = &art.v[i];
            size_t nl = strlen(e->name);
            if (strncmp(e->name, pre, strlen(pre)) || strstr(e->name, ".experts.") || e->kind != K_MAIN) continue;
            if (nl > 3 && !strcmp(e->name + nl - 3, ".qs")) continue;
            EMIT2(e->name);
        }
        static const char *proj[3] = {"down_proj", "gate_proj", "up_proj"};
        for (int pass = 0; pass < 2; pass++)
            for (int x = 0; x < cfg.n_routed_experts; x++)
                for (int p = 0; p < 3; p++) {
                    snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.%d.%s.weight%s", l, x, proj[p], pass ? ".qs" : "");
                    EMIT(efind(&art, nm));
                }
    }
    EMIT2("model.norm.weight");
    EMIT2("lm_head.weight");
    static const char *cuts[] = {
        "model.layers.1.mlp.experts.3.up_proj.weight",     /* gate | up of one expert */
        "model.layers.2.mlp.experts.0.down_proj.weight.qs", /* every layer-2 payload | its scales */
        "model.layers.3.mlp.experts.5.up_proj.weight.qs",  /* gate scales | up scales */
        "model.layers.4.self_attn.o_proj.weight.qs",       /* a dense payload | its scales */
    };
    int rc = 0, shard = 1, start = 0;
    char path[1024];
    for (int i = 0; i <= no && rc == 0; i++) {
        int cut = i == no;
        for (int c = 0; c < 4 && !cut; c++) cut = !strcmp(ord[i]->name, cuts[c]);
        if (!cut || i == start) continue;
        snprintf(path, sizeof path, "%s/out-%05d.safetensors", dir, shard++);
        rc = write_list(path, ord + start, i - start);
        start = i;
    }
    for (int k = K_MTP; k <= K_IDX && rc == 0; k++) {
        if (k == K_IDX && !with_idx) continue;
        int m = 0;
        for (int i = 0; i < art.n; i++)
            if (art.v[i].kind == k && (!drop || strcmp(art.v[i].name, drop))) ord[m++] = &art.v[i];
        snprintf(path, sizeof path, "%s/out-%s-00001.safetensors", dir, k == K_MTP ? "mtp" : "idx");
        rc = write_list(path, ord, m);
    }
#undef EMIT
#undef EMIT2
    /* Every tensor went somewhere (a lost one would be a bug in this builder). */
    int expect = 0;
    for (int i = 0; i < art.n; i++)
        expect += (art.v[i].kind != K_IDX || with_idx) && (!drop || strcmp(art.v[i].name, drop));
    int placed = no;
    for (int i = 0; i < art.n; i++) placed += art.v[i].kind != K_MAIN && (art.v[i].kind != K_IDX || with_idx) && (!drop || strcmp(art.v[i].name, drop));
    CHECK_EQ_INT(placed, expect);
    snprintf(path, sizeof path, "%s/config.json", dir);
    copy_file(test_data(fx), path);
    snprintf(path, sizeof path, "%s/.coli_usage", dir); /* a sidecar: must be ignored */
    FILE *f = fopen(path, "w");
    if (f) { fprintf(f, "-1 6 16\n-2 1 colibri\n1 3 17\n"); fclose(f); }
    if (hf_dir && rc == 0) {
        const entry **all = calloc((size_t)hf.n, sizeof(entry *));
        for (int i = 0; i < hf.n; i++) all[i] = &hf.v[i];
        snprintf(path, sizeof path, "%s/model.safetensors", hf_dir);
        rc = write_list(path, all, hf.n);
        free(all);
        snprintf(path, sizeof path, "%s/config.json", hf_dir);
        copy_file(test_data(fx), path);
    }
    free(ord);
    elist_free(&art);
    elist_free(&hf);
    config_deinit(&cfg);
    st_close(src);
    return rc;
}

static int build_artifact(const char *dir, int with_idx, const char *hf_dir, const char *drop) {
    return build_artifact_of("tiny", dir, with_idx, hf_dir, drop);
}

/* The shared artifacts, built once per run. */
static char g_idx[512], g_noidx[512], g_hf[512];
static int g_built;

static int artifacts(void) {
    if (g_built) return g_built > 0 ? 0 : -1;
    g_built = -1;
    snprintf(g_idx, sizeof g_idx, "%s/coli-idx", test_tmpdir());
    snprintf(g_noidx, sizeof g_noidx, "%s/coli-noidx", test_tmpdir());
    snprintf(g_hf, sizeof g_hf, "%s/coli-hf-deq", test_tmpdir());
    mkdir_p(g_idx);
    mkdir_p(g_noidx);
    mkdir_p(g_hf);
    if (build_artifact(g_idx, 1, g_hf, NULL) || build_artifact(g_noidx, 0, NULL, NULL)) return -1;
    g_built = 1;
    return 0;
}


static int g_act_quant; /* the open option act_quant for open_eng: -1 exact f32 activations */
static petrel_engine *open_eng(const char *path) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(path, &(petrel_open_opts){.act_quant = g_act_quant}, &e, &err)) test_fail(__FILE__, __LINE__, "open %s: %s", path, err.msg);
    return e;
}

/* Prefill logits [T][V] of ids on a fresh session (NULL on failure; err filled). */
static float *run(petrel_engine *e, const int32_t *ids, int T, petrel_error *err) {
    int V = e->cfg.vocab_size;
    petrel_session *s;
    if (petrel_session_create(e, T, &s, err)) return NULL;
    float *lg = malloc(sizeof(float) * (size_t)T * V);
    if (petrel_session_forward(s, ids, T, lg, 1, err)) { free(lg); lg = NULL; }
    petrel_session_free(s);
    return lg;
}

/* ---- format decoding on synthetic tensors ---- */

static uint32_t rng_state = 12345;
static float frand(void) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return ((float)(rng_state >> 8) / 16777216.f - 0.5f) * (1.f + (float)(rng_state & 7));
}

TEST(colibri, formats) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/coli-formats", test_tmpdir());
    mkdir_p(dir);
    /* Shapes: [5, 768] (every group size divides 768) and [3, 101] (odd width, partial groups,
     * and 153-byte payloads that leave the next scales misaligned in the file). */
    struct { int64_t O, I; int fmt, gs; pt_qtype want; int zero_copy; } cs[] = {
        {5, 768, F_I8, 0, PT_Q8_ROW, 1},    {5, 768, F_I4ROW, 0, PT_Q4_G64, 0}, {5, 768, F_I4G, 16, PT_F32, 0},
        {5, 768, F_I4G, 32, PT_Q8_G32, 0},  {5, 768, F_I4G, 48, PT_F32, 0},     {5, 768, F_I4G, 64, PT_Q4_G64, 1},
        {5, 768, F_I4G, 96, PT_Q8_G32, 0},  {5, 768, F_I4G, 128, PT_Q4_G64, 0}, {5, 768, F_I4G, 192, PT_Q4_G64, 0},
        {5, 768, F_I4G, 256, PT_Q4_G64, 0}, {4, 50, F_I4ROW, 0, PT_Q4_G64, 1},  {3, 101, F_I4G, 64, PT_Q4_G64, 0},
        {3, 101, F_I4ROW, 0, PT_Q4_G64, 0}, {3, 101, F_I8, 0, PT_Q8_ROW, 0},    {3, 101, F_F32, 0, PT_F32, 0},
    };
    int nc = (int)(sizeof cs / sizeof cs[0]);
    elist art = {0}, hf = {0};
    for (int i = 0; i < nc; i++) {
        int64_t n = cs[i].O * cs[i].I;
        float *w = malloc(sizeof(float) * (size_t)n);
        for (int64_t k = 0; k < n; k++) w[k] = frand();
        if (i == 3) for (int64_t k = 0; k < 32; k++) w[k] = 0; /* an all-zero group: s = 1e-8, q = 0 */
        char name[64];
        snprintf(name, sizeof name, "w%d.weight", i);
        add_matrix(&art, &hf, name, w, cs[i].O, cs[i].I, cs[i].fmt, cs[i].gs, K_MAIN);
        free(w);
    }
    const entry **all = calloc((size_t)art.n, sizeof(entry *));
    for (int i = 0; i < art.n; i++) all[i] = &art.v[i];
    char path[600];
    snprintf(path, sizeof path, "%s/out-00001.safetensors", dir);
    write_list(path, all, art.n);
    free(all);
    colibri *c;
    petrel_error err = {0};
    CHECK(colibri_detect(dir));
    if (colibri_open(dir, NULL, &c, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); elist_free(&art); elist_free(&hf); return; }
    wsource ws;
    colibri_wsource(c, &ws);
    for (int i = 0; i < nc; i++) {
        char name[64];
        snprintf(name, sizeof name, "w%d.weight", i);
        pt_wview v;
        int rc = ws.matrix(ws.ctx, name, cs[i].O, cs[i].I, &v, &err);
        CHECK_MSG(rc == 0, "case %d: %s", i, err.msg);
        if (rc) continue;
        CHECK_MSG(v.qtype == cs[i].want, "case %d (fmt %d gs %d): qtype %s, want %s", i, cs[i].fmt, cs[i].gs, pt_qtype_name(v.qtype),
                  pt_qtype_name(cs[i].want));
        if (cs[i].zero_copy) {
            char qn[80];
            snprintf(qn, sizeof qn, "%s.qs", name);
            CHECK_MSG(v.data == st_find(c->set, name)->data, "case %d: payload is not zero-copy", i);
            CHECK_MSG(cs[i].fmt == F_F32 || v.scale == (const void *)st_find(c->set, qn)->data, "case %d: scales are not zero-copy", i);
        }
        const float *ref = efind(&hf, name)->data;
        float *row = malloc(sizeof(float) * (size_t)cs[i].I);
        int bad = 0;
        for (int64_t r = 0; r < cs[i].O; r++) {
            pt_dequant_row(&v, r, row);
            for (int64_t j = 0; j < cs[i].I; j++) bad += row[j] != ref[r * cs[i].I + j];
        }
        CHECK_MSG(bad == 0, "case %d (fmt %d gs %d): %d values differ from q * s", i, cs[i].fmt, cs[i].gs, bad);
        free(row);
    }
    CHECK_MSG(c->n_zero_copy >= 3 && c->n_converted >= 8, "zero-copy %d, converted %d", c->n_zero_copy, c->n_converted);
    colibri_close(c);
    elist_free(&art);
    elist_free(&hf);
    /* Inference rules alone. */
    coli_fmt f;
    int gs;
    CHECK(coli_infer_format("t", 4, 100, 4 * 50, 8, &f, &gs, &err) == 0 && f == COLI_I4_GROUP && gs == 64); /* 64 or 96: 64 */
    CHECK(coli_infer_format("t", 4, 64, 4 * 32, 8, &f, &gs, &err) == 0 && gs == 32);                        /* 32 divides 64 */
    CHECK(coli_infer_format("t", 4, 64, 4 * 32, 4, &f, &gs, &err) == 0 && f == COLI_I4_ROW);
    CHECK(coli_infer_format("t", 4, 64, 4 * 64, 4, &f, &gs, &err) == 0 && f == COLI_I8_ROW);
    CHECK(coli_infer_format("t", 4, 100, 4 * 50, 12, &f, &gs, &err) == 0 && gs == 48);                     /* only 48 gives 3 */
    CHECK(coli_infer_format("t", 4, 96, 4 * 48, 8, &f, &gs, &err) == 0 && gs == 64);                       /* 48 or 64: current builds' 64 */
    CHECK(coli_infer_format("t", 4, 200, 4 * 100, 8, &f, &gs, &err) == PETREL_EUNSUPPORTED && strstr(err.msg, "ambiguous")); /* 128 or 192 */
    CHECK(coli_infer_format("t", 4, 64, 4 * 24, 4, &f, &gs, &err) == PETREL_EUNSUPPORTED); /* int3 */
}

TEST(colibri, bad_input) {
    char dir[512], path[600];
    snprintf(dir, sizeof dir, "%s/coli-bad", test_tmpdir());
    mkdir_p(dir);
    int64_t O = 4, I = 64;
    elist art = {0};
    add(&art, "bytes.weight", ST_U8, 1, O * I + 1, 0, calloc((size_t)(O * I + 1), 1), K_MAIN);
    add(&art, "bytes.weight.qs", ST_F32, 1, O, 0, calloc((size_t)O, 4), K_MAIN);
    add(&art, "noqs.weight", ST_U8, 1, O * I / 2, 0, calloc((size_t)(O * I / 2), 1), K_MAIN);
    add(&art, "fmt.weight", ST_U8, 1, O * I / 2, 0, calloc((size_t)(O * I / 2), 1), K_MAIN);
    add(&art, "fmt.weight.qs", ST_F32, 1, O * 3, 0, calloc((size_t)(O * 3), 4), K_MAIN);
    add(&art, "qsdt.weight", ST_U8, 1, O * I, 0, calloc((size_t)(O * I), 1), K_MAIN);
    add(&art, "qsdt.weight.qs", ST_BF16, 1, O, 0, calloc((size_t)O, 2), K_MAIN);
    add(&art, "i32.weight", ST_I32, 1, O * I, 0, calloc((size_t)(O * I), 4), K_MAIN);
    add(&art, "vec.weight", ST_U8, 1, I, 0, calloc((size_t)I, 1), K_MAIN);
    add(&art, "vec.weight.qs", ST_F32, 1, 1, 0, calloc(1, 4), K_MAIN);
    add(&art, "shape.weight", ST_F32, 2, O, I + 1, calloc((size_t)(O * (I + 1)), 4), K_MAIN);
    const entry **all = calloc((size_t)art.n, sizeof(entry *));
    for (int i = 0; i < art.n; i++) all[i] = &art.v[i];
    snprintf(path, sizeof path, "%s/out-00001.safetensors", dir);
    write_list(path, all, art.n);
    free(all);
    elist_free(&art);
    colibri *c;
    petrel_error err = {0};
    if (colibri_open(dir, NULL, &c, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    wsource ws;
    colibri_wsource(c, &ws);
    pt_wview v;
    struct { const char *name, *must; } m[] = {
        {"bytes.weight", "257 bytes"}, {"noqs.weight", "noqs.weight.qs"}, {"fmt.weight", "12 scales"},
        {"qsdt.weight", "BF16"},       {"i32.weight", "I32"},             {"shape.weight", "[4, 65]"},
        {"absent.weight", "missing"},
    };
    for (size_t i = 0; i < sizeof m / sizeof m[0]; i++) {
        memset(&err, 0, sizeof err);
        int rc = ws.matrix(ws.ctx, m[i].name, O, I, &v, &err);
        CHECK_MSG(rc < 0, "%s: accepted", m[i].name);
        CHECK_MSG(strstr(err.msg, m[i].name) && strstr(err.msg, m[i].must), "%s: message \"%s\" lacks the tensor or \"%s\"", m[i].name,
                  err.msg, m[i].must);
        if (getenv("PETREL_TEST_VERBOSE")) fprintf(stderr, "  %s\n", err.msg);
    }
    float out[64];
    CHECK(ws.vector(ws.ctx, "vec.weight", I, out, &err) < 0 && strstr(err.msg, "vec.weight") && strstr(err.msg, "quantized"));
    colibri_close(c);
    /* A gap in the shard numbering is a missing shard. */
    snprintf(path, sizeof path, "%s/out-00003.safetensors", dir);
    copy_file(test_data("tiny/model.safetensors"), path);
    CHECK(colibri_open(dir, NULL, &c, &err) == PETREL_EFORMAT && strstr(err.msg, "out-00002.safetensors is missing"));
    /* A folder with an index file is a Hugging Face checkpoint, not a colibri artifact. */
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    FILE *f = fopen(path, "w");
    if (f) { fputs("{}", f); fclose(f); }
    CHECK(!colibri_detect(dir));
    CHECK(!colibri_detect(test_data("tiny")));
    /* A whole artifact missing one expert's scales: the engine refuses it, naming the tensor. */
    char d2[512];
    snprintf(d2, sizeof d2, "%s/coli-dropqs", test_tmpdir());
    mkdir_p(d2);
    const char *drop = "model.layers.3.mlp.experts.7.gate_proj.weight.qs";
    if (build_artifact(d2, 1, NULL, drop) == 0) {
        petrel_engine *e = NULL;
        CHECK(petrel_engine_open(d2, NULL, &e, &err) == PETREL_EFORMAT);
        CHECK_MSG(strstr(err.msg, drop) != NULL, "message: %s", err.msg);
        petrel_engine_close(e);
    }
}

/* ---- whole artifacts ---- */

TEST(colibri, straddle) {
    if (artifacts()) return;
    colibri *c;
    petrel_error err = {0};
    if (colibri_open(g_idx, NULL, &c, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    CHECK_EQ_INT(c->n_main, 5);
    CHECK_EQ_INT(c->n_mtp, 1);
    CHECK_EQ_INT(c->n_idx, 1);
#define FILEOF(n) (st_find(c->set, n) ? st_find(c->set, n)->file : -1)
    const char *pairs[][2] = {
        {"model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight"},
        {"model.layers.2.mlp.experts.0.down_proj.weight", "model.layers.2.mlp.experts.0.down_proj.weight.qs"},
        {"model.layers.2.mlp.experts.15.up_proj.weight", "model.layers.2.mlp.experts.15.up_proj.weight.qs"},
        {"model.layers.3.mlp.experts.5.gate_proj.weight.qs", "model.layers.3.mlp.experts.5.up_proj.weight.qs"},
        {"model.layers.4.self_attn.o_proj.weight", "model.layers.4.self_attn.o_proj.weight.qs"},
    };
    for (int i = 0; i < 5; i++) {
        int a = FILEOF(pairs[i][0]), b = FILEOF(pairs[i][1]);
        CHECK_MSG(a >= 0 && b >= 0 && a != b, "%s (file %d) and %s (file %d) should sit in different shards", pairs[i][0], a, pairs[i][1], b);
    }
    CHECK(FILEOF("model.layers.0.self_attn.indexer.wk.weight") != FILEOF("model.layers.0.self_attn.q_a_proj.weight"));
    CHECK(strstr(c->set->paths[FILEOF("model.layers.6.eh_proj.weight")], "out-mtp-00001") != NULL);
#undef FILEOF
    colibri_close(c);
    /* The engine binds all of it, straddling experts included, and routed experts are
     * zero-copy Q4_G64 views into the shard maps. */
    petrel_engine *e = open_eng(g_idx);
    if (!e) return;
    const layer_w *lw = &e->w.layers[2];
    CHECK(lw->exp_down[0].qtype == PT_Q4_G64 && lw->exp_gate[0].qtype == PT_Q4_G64);
    const st_tensor *t = st_find(e->coli->set, "model.layers.2.mlp.experts.0.down_proj.weight");
    const st_tensor *q = st_find(e->coli->set, "model.layers.2.mlp.experts.0.down_proj.weight.qs");
    CHECK(t && q && lw->exp_down[0].data == t->data && lw->exp_down[0].scale == (const void *)q->data);
    CHECK(e->w.layers[0].down_proj.qtype == PT_Q4_G64);   /* int4 per row, [64, 128]: scales repeated */
    CHECK(e->w.layers[0].gate_proj.qtype == PT_Q4_G64);   /* int4 per row, [128, 64]: zero-copy */
    CHECK(e->w.layers[1].sh_gate.qtype == PT_Q8_G32);     /* int4 g32 */
    CHECK(e->w.layers[1].sh_down.qtype == PT_F32);        /* int4 g16 */
    CHECK(e->w.layers[1].q_a_proj.qtype == PT_Q8_ROW);
    CHECK(e->w.layers[1].router.qtype == PT_F32);
    CHECK(e->w.has_mtp && e->w.eh_proj.qtype == PT_Q8_ROW && e->w.mtp.exp_gate[0].qtype == PT_Q8_ROW);
    CHECK(!e->no_indexer && e->w.layers[0].has_indexer && !e->w.layers[2].has_indexer);
    CHECK(e->w.layers[0].idx_wq_b.qtype == PT_Q8_ROW && e->w.layers[0].idx_weights_proj.qtype == PT_F32);
    petrel_engine_close(e);
}

TEST(colibri, logits_golden) {
    if (artifacts()) return;
    petrel_engine *e = open_eng(g_idx);
    st_set *gold = NULL;
    petrel_error err = {0};
    if (!e || st_open(test_data("tiny/golden.safetensors"), &gold, &err)) {
        test_fail(__FILE__, __LINE__, "%s", err.msg);
        petrel_engine_close(e);
        return;
    }
    int V = e->cfg.vocab_size, np = 0;
    for (int pi = 0;; pi++) {
        const st_tensor *ids = test_gold(gold, pi, "ids"), *ref = test_gold(gold, pi, "logits");
        if (!ids || !ref) break;
        int T = (int)ids->shape[0];
        float *lg = run(e, (const int32_t *)ids->data, T, &err);
        CHECK_MSG(lg != NULL, "%s", err.msg);
        if (!lg) continue;
        np++;
        double r = test_rel_l2(lg, (const float *)ref->data, (size_t)T * V);
        int agree = 0;
        for (int t = 0; t < T; t++) {
            const float *x = lg + (size_t)t * V, *y = (const float *)ref->data + (size_t)t * V;
            int ax = 0, ay = 0;
            for (int v = 1; v < V; v++) { if (x[v] > x[ax]) ax = v; if (y[v] > y[ay]) ay = v; }
            agree += ax == ay;
        }
        /* A loose bound on purpose: the tiny random-weight fixture is chaotic (MoE top-4 of 16
         * and DSA top-8 selections flip), so int8 on the embeddings alone moves its logits by
         * ~40% on long prompts although every weight is within 0.6%; int4 experts (~10% per
         * weight) give ~0.8. The exact check is logits_exact. Measured: 0.77 / 0.78 / 0.85 /
         * 0.89 for the four prompts. */
        CHECK_MSG(r < 1.0, "prompt %d: logits rel L2 error %.3g vs the bf16 reference", pi, r);
        if (getenv("PETREL_TEST_VERBOSE"))
            fprintf(stderr, "  colibri prompt %d T=%d: rel L2 vs golden %.3g, argmax agrees on %d/%d rows\n", pi, T, r, agree, T);
        free(lg);
    }
    CHECK(np > 0);
    st_close(gold);
    petrel_engine_close(e);
}

static void logits_exact_body(void);
/* exact loader checks: f32 activations (int8 activations are a kernel choice, tested apart) */
TEST(colibri, logits_exact) {
    g_act_quant = -1;
    logits_exact_body();
    g_act_quant = 0;
}
static void logits_exact_body(void) {
    if (artifacts()) return;
    petrel_engine *a = open_eng(g_idx), *b = open_eng(g_hf);
    st_set *gold = NULL;
    petrel_error err = {0};
    if (!a || !b || st_open(test_data("tiny/golden.safetensors"), &gold, &err)) {
        petrel_engine_close(a);
        petrel_engine_close(b);
        return;
    }
    int V = a->cfg.vocab_size, np = 0;
    for (int pi = 0;; pi++) {
        const st_tensor *ids = test_gold(gold, pi, "ids");
        if (!ids) break;
        int T = (int)ids->shape[0];
        float *la = run(a, (const int32_t *)ids->data, T, &err), *lb = run(b, (const int32_t *)ids->data, T, &err);
        CHECK(la && lb);
        if (la && lb) {
            np++;
            double r = test_rel_l2(la, lb, (size_t)T * V), mx = 0;
            for (size_t i = 0; i < (size_t)T * V; i++) mx = fmax(mx, fabs((double)la[i] - lb[i]));
            CHECK_MSG(r < 1e-5, "prompt %d: colibri vs dequantized F32 checkpoint: rel L2 %.3g (max abs %.3g)", pi, r, mx);
            if (getenv("PETREL_TEST_VERBOSE")) fprintf(stderr, "  colibri prompt %d T=%d: rel L2 vs dequantized F32 %.3g, max abs %.3g\n", pi, T, r, mx);
        }
        free(la);
        free(lb);
    }
    CHECK(np > 0);
    st_close(gold);
    petrel_engine_close(a);
    petrel_engine_close(b);
}

TEST(colibri, no_indexer) {
    if (artifacts()) return;
    petrel_engine *e = open_eng(g_noidx);
    if (!e) return;
    CHECK(e->coli && e->coli->n_idx == 0 && !e->coli->has_indexer);
    CHECK_EQ_INT(e->no_indexer, 1);
    for (int l = 0; l < e->cfg.num_hidden_layers; l++) CHECK(!e->w.layers[l].has_indexer);
    CHECK(e->cfg.layer_indexer_full[0] == 1); /* the engine keeps the real schedule */
    CHECK(e->w.has_mtp);
#if COLIBRI_TEST_NO_INDEXER_FORWARD
    petrel_engine *full = open_eng(g_idx);
    petrel_error err = {0};
    int K = e->cfg.index_topk, V = e->cfg.vocab_size;
    int32_t ids[64];
    for (int i = 0; i < 64; i++) ids[i] = (i * 37 + 5) % V;
    /* Up to index_topk keys every key is selected: identical to the artifact with indexer. */
    float *la = run(e, ids, K, &err), *lb = full ? run(full, ids, K, &err) : NULL;
    CHECK_MSG(la && lb, "%s", err.msg);
    if (la && lb) CHECK(memcmp(la, lb, sizeof(float) * (size_t)K * V) == 0);
    free(la);
    free(lb);
    /* Beyond it the selection would need the indexer: a clear error, not a silent answer. */
    memset(&err, 0, sizeof err);
    la = run(e, ids, K + 1, &err);
    CHECK(la == NULL && strstr(err.msg, "indexer") != NULL);
    free(la);
    petrel_engine_close(full);
#endif
    petrel_engine_close(e);
}

static void convert_body(void);
/* exact loader checks: f32 activations (int8 activations are a kernel choice, tested apart) */
TEST(colibri, convert) {
    g_act_quant = -1;
    convert_body();
    g_act_quant = 0;
}
static void convert_body(void) {
    if (artifacts()) return;
    char out[600];
    snprintf(out, sizeof out, "%s/coli.pack", test_tmpdir());
    convert_opts o;
    memset(&o, 0, sizeof o);
    o.quant = CVQ_F32;
    convert_result res;
    petrel_error err = {0};
    CHECK(colibri_detect(g_idx));
    if (colibri_convert(g_idx, out, &o, &res, &err)) { test_fail(__FILE__, __LINE__, "convert: %s", err.msg); return; }
    /* An f32 pack holds exactly the dequantized values: same logits as the artifact. */
    petrel_engine *a = open_eng(g_idx), *b = open_eng(out);
    int32_t ids[12];
    for (int i = 0; i < 12; i++) ids[i] = (i * 91 + 3) % 1024;
    float *la = a ? run(a, ids, 12, &err) : NULL, *lb = b ? run(b, ids, 12, &err) : NULL;
    CHECK(la && lb);
    if (la && lb) {
        double r = test_rel_l2(lb, la, (size_t)12 * a->cfg.vocab_size);
        CHECK_MSG(r < 1e-5, "pack from colibri vs colibri: rel L2 %.3g", r);
    }
    free(la);
    free(lb);
    petrel_engine_close(a);
    petrel_engine_close(b);
}

/* Other fixtures' shapes through the colibri reader: exactly the dequantized checkpoint's
 * logits. odd: hidden 96 (int4 groups of 64 end in a tail), 2 shared experts, no MTP; odd3:
 * every layer MoE, top-1. */
static void coli_shapes_exact(const char *fixture) {
    char dir[512], hf[512];
    snprintf(dir, sizeof dir, "%s/coli-%s", test_tmpdir(), fixture);
    snprintf(hf, sizeof hf, "%s/coli-%s-hf", test_tmpdir(), fixture);
    mkdir_p(dir);
    mkdir_p(hf);
    if (build_artifact_of(fixture, dir, 1, hf, NULL)) return;
    g_act_quant = -1;
    petrel_engine *a = open_eng(dir), *b = open_eng(hf);
    if (a && b) {
        CHECK(a->coli != NULL);
        int32_t ids[40];
        for (int i = 0; i < 40; i++) ids[i] = (i * 53 + 11) % a->cfg.vocab_size;
        petrel_error err = {0};
        float *la = run(a, ids, 40, &err), *lb = run(b, ids, 40, &err);
        CHECK_MSG(la && lb, "%s", err.msg);
        if (la && lb) {
            double r = test_rel_l2(la, lb, (size_t)40 * a->cfg.vocab_size);
            CHECK_MSG(r < 1e-5, "%s colibri vs dequantized F32 checkpoint: rel L2 %.3g", fixture, r);
        }
        free(la);
        free(lb);
    }
    petrel_engine_close(a);
    petrel_engine_close(b);
    g_act_quant = 0;
}
TEST(colibri, odd_shapes_exact) { coli_shapes_exact("odd"); }
TEST(colibri, odd3_shapes_exact) { coli_shapes_exact("odd3"); }

/* A LoRA adapter on the colibri int4 artifact (unmerged, exact f32 activations) equals the same
 * adapter merged into the dequantized F32 checkpoint of the same weights. */
TEST(colibri, lora_unmerged_equals_merged_twin) {
    if (artifacts()) return;
    petrel_lora_spec sp = {test_data("lora-tiny"), NULL, 0};
    petrel_engine *a = NULL, *b = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(g_idx, &(petrel_open_opts){.act_quant = -1, .lora = &sp, .n_lora = 1}, &a, &err) ||
        petrel_engine_open(g_hf, &(petrel_open_opts){.act_quant = -1, .lora = &sp, .n_lora = 1, .lora_merge = 1}, &b, &err)) {
        test_fail(__FILE__, __LINE__, "%s", err.msg);
        petrel_engine_close(a);
        return;
    }
    int32_t ids[7] = {1, 2, 3, 4, 5, 6, 7};
    int V = a->cfg.vocab_size;
    float *la = run(a, ids, 7, &err), *lb = run(b, ids, 7, &err);
    CHECK(la && lb);
    if (la && lb) {
        double r = test_rel_l2(la, lb, (size_t)7 * V);
        CHECK_MSG(r < 1e-5, "colibri + adapter vs merged dequantized twin: rel L2 %.3g", r);
    }
    free(la);
    free(lb);
    petrel_engine_close(a);
    petrel_engine_close(b);
}
