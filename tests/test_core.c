/* test_core.c: properties of the forward pass (absorbed == reconstructed MLA; DSA with
 * index_topk >= keys == dense causal attention; prefill == decode; group-limited routing ==
 * brute force; top-k) and bad input (safetensors headers, tensors, config.json, prompts), each
 * of which must give a clear error and no crash. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/safetensors.h"
#include "model/engine.h"
#include "model/ops.h"
#include "test.h"

static uint64_t rng_state = 88172645463325252ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}
static float rndf(void) { return (float)rnd() / 2147483648.0f - 1.0f; }


static petrel_engine *open_tiny(const char *name) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(test_data(name), NULL, &e, &err)) test_fail(__FILE__, __LINE__, "open: %s", err.msg);
    return e;
}

/* Logits [T][V] of a random prompt with session hooks set by `setup`. */
static float *run(petrel_engine *e, const int32_t *ids, int T, mla_mode mla, int always_score, int decode) {
    int V = e->cfg.vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)T * V);
    petrel_session *s;
    petrel_error err = {0};
    CHECK(petrel_session_create(e, T, &s, &err) == 0);
    s->mla = mla;
    s->dsa_always_score = always_score;
    if (decode) for (int t = 0; t < T; t++) CHECK(petrel_session_forward(s, ids + t, 1, lg + (size_t)t * V, 0, &err) == 0);
    else CHECK(petrel_session_forward(s, ids, T, lg, 1, &err) == 0);
    petrel_session_free(s);
    return lg;
}

TEST(core, absorbed_equals_reconstructed) {
    const char *names[] = {"tiny", "tiny-fp8"};
    for (int f = 0; f < 2; f++) {
        petrel_engine *e = open_tiny(names[f]);
        if (!e) return;
        int T = 37, V = e->cfg.vocab_size;
        int32_t ids[37];
        for (int i = 0; i < T; i++) ids[i] = (int32_t)(rnd() % (uint32_t)V);
        float *a = run(e, ids, T, MLA_ABSORBED, 0, 0), *b = run(e, ids, T, MLA_RECONSTRUCTED, 0, 0);
        double err = test_rel_l2(a, b, (size_t)T * V);
        CHECK_MSG(err < 1e-5, "%s: absorbed vs reconstructed rel err %.3g", names[f], err);
        free(a);
        free(b);
        petrel_engine_close(e);
    }
}

TEST(core, prefill_equals_decode_random) {
    petrel_engine *e = open_tiny("tiny");
    if (!e) return;
    int T = 50, V = e->cfg.vocab_size;
    int32_t ids[50];
    for (int i = 0; i < T; i++) ids[i] = (int32_t)(rnd() % (uint32_t)V);
    float *a = run(e, ids, T, MLA_AUTO, 0, 0), *b = run(e, ids, T, MLA_AUTO, 0, 1);
    double err = test_rel_l2(a, b, (size_t)T * V);
    CHECK_MSG(err < 1e-5, "prefill vs decode rel err %.3g", err);
    free(a);
    free(b);
    petrel_engine_close(e);
}

/* With index_topk >= the number of keys, DSA's scored selection (forced through the scoring
 * and top-k path) is every causal key, so the result must equal dense causal attention. */
TEST(core, dsa_large_topk_is_dense) {
    petrel_engine *e = open_tiny("tiny");
    if (!e) return;
    int T = 30, V = e->cfg.vocab_size;
    e->cfg.index_topk = 1000;
    int32_t ids[30];
    for (int i = 0; i < T; i++) ids[i] = (int32_t)(rnd() % (uint32_t)V);
    float *dense = run(e, ids, T, MLA_RECONSTRUCTED, 0, 0), *scored = run(e, ids, T, MLA_RECONSTRUCTED, 1, 0);
    double err = test_rel_l2(scored, dense, (size_t)T * V);
    CHECK_MSG(err < 1e-6, "scored selection vs dense rel err %.3g", err);
    /* and a small index_topk really changes the result (the test can fail) */
    e->cfg.index_topk = 4;
    float *sparse = run(e, ids, T, MLA_RECONSTRUCTED, 0, 0);
    CHECK(test_rel_l2(sparse, dense, (size_t)T * V) > 1e-3);
    free(dense);
    free(scored);
    free(sparse);
    petrel_engine_close(e);
}

TEST(core, topk_matches_sort) {
    for (int trial = 0; trial < 200; trial++) {
        int n = 1 + (int)(rnd() % 300), k = 1 + (int)(rnd() % (uint32_t)n);
        float *v = malloc(sizeof(float) * (size_t)n);
        int32_t *idx = malloc(4 * (size_t)n), *tmp = malloc(4 * (size_t)n);
        for (int i = 0; i < n; i++) v[i] = (trial % 3 == 0) ? (float)(rnd() % 5) : rndf(); /* many ties too */
        op_topk(v, n, k, idx, tmp);
        /* brute force: element i is in the top-k iff fewer than k elements rank above it */
        int in = 0;
        for (int i = 0; i < n; i++) {
            int above = 0;
            for (int j = 0; j < n; j++) above += v[j] > v[i] || (v[j] == v[i] && j > i);
            int want = above < k, got = 0;
            for (int t = 0; t < k; t++) got |= idx[t] == i;
            in += got;
            CHECK_MSG(want == got, "n=%d k=%d element %d", n, k, i);
        }
        CHECK_EQ_INT(in, k);
        for (int t = 1; t < k; t++) CHECK(idx[t - 1] < idx[t]);
        free(v);
        free(idx);
        free(tmp);
    }
}

/* Long rows (a 64K context's indexer scores): the radix select against a full sort by rank
 * (value, NaN lowest, -0 == +0, then the later position), with runs of equal scores that share
 * every digit, NaNs, signed zeros and infinities. */
static const float *g_rank_v;
static int rank_cmp(const void *a, const void *b) { /* descending rank */
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    float x = g_rank_v[i], y = g_rank_v[j];
    int xa = x != x ? (y != y ? i > j : 0) : (y != y ? 1 : (x > y || (x == y && i > j)));
    return xa ? -1 : 1;
}
static int asc_i32(const void *a, const void *b) { return *(const int32_t *)a - *(const int32_t *)b; }
TEST(core, topk_long_rows_match_full_sort) {
    for (int trial = 0; trial < 18; trial++) {
        int n = 1000 + (int)(rnd() % 70000), k = 1 + (int)(rnd() % (uint32_t)(trial % 2 ? n : 4096));
        float *v = malloc(sizeof(float) * (size_t)n);
        int32_t *idx = malloc(4 * (size_t)n), *tmp = malloc(4 * (size_t)n), *ord = malloc(4 * (size_t)n);
        for (int i = 0; i < n; i++) {
            uint32_t r = rnd() % 100;
            /* ReLU'd scores (mostly +-0, the cut inside the zeros), few distinct values, or spread */
            v[i] = trial % 3 == 2 ? (rnd() % 4 ? (rnd() % 2 ? 0.0f : -0.0f) : rndf() + 1.0f) : trial % 2 ? (float)(rnd() % 7) * 0.25f : rndf();
            if (r == 0) v[i] = __builtin_nanf("");
            else if (r == 1) v[i] = -0.0f;
            else if (r == 2) v[i] = 0.0f;
            else if (r == 3) v[i] = -__builtin_inff();
            else if (r == 4 && trial % 3 == 0) v[i] = __builtin_inff();
        }
        op_topk(v, n, k, idx, tmp);
        for (int i = 0; i < n; i++) ord[i] = i;
        g_rank_v = v;
        qsort(ord, (size_t)n, 4, rank_cmp);
        qsort(ord, (size_t)k, 4, asc_i32);
        CHECK_MSG(!memcmp(idx, ord, 4 * (size_t)k), "n=%d k=%d: the selection differs from a full sort by rank", n, k);
        free(v), free(idx), free(tmp), free(ord);
    }
}

/* The DSA tie rule on constructed ties: among equal scores the later position is kept, so the
 * cut inside a run of zeros (a trained indexer's ReLU'd scores) keeps the most recent keys. */
TEST(core, topk_ties_keep_later) {
    float v[12] = {0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 0, 0}; /* two positive, ten zero */
    int32_t idx[12], tmp[12];
    op_topk(v, 12, 5, idx, tmp); /* 2, 6 and the three latest zeros: 9, 10, 11 */
    int32_t want[5] = {2, 6, 9, 10, 11};
    for (int i = 0; i < 5; i++) CHECK_EQ_INT(idx[i], want[i]);
    float all[7] = {1, 1, 1, 1, 1, 1, 1}; /* all tied: the k latest */
    op_topk(all, 7, 3, idx, tmp);
    for (int i = 0; i < 3; i++) CHECK_EQ_INT(idx[i], 4 + i);
    float neg[6] = {-1, -0.0f, 0.0f, -1, -0.0f, -1}; /* -0 == +0: later of the three zeros wins */
    op_topk(neg, 6, 2, idx, tmp);
    CHECK_EQ_INT(idx[0], 2);
    CHECK_EQ_INT(idx[1], 4);
    float nan[5] = {NAN, 0, NAN, 0, 1}; /* NaN ranks below every number */
    op_topk(nan, 5, 3, idx, tmp);
    CHECK_EQ_INT(idx[0], 1);
    CHECK_EQ_INT(idx[1], 3);
    CHECK_EQ_INT(idx[2], 4);
}

/* Brute force: try every set of topk_group groups, keep the one with the largest summed group
 * score (earliest in enumeration order on ties, which is the lexicographically smallest set);
 * mask the other groups to 0.0; sort all experts by (value desc, id asc); take K. */
static void route_brute(const petrel_config *c, const float *logits, const float *bias, int32_t *idx, float *wts) {
    int E = c->n_routed_experts, G = c->n_group, gs = E / G, K = c->num_experts_per_tok;
    float s[256], ch[256], gsc[64];
    for (int e = 0; e < E; e++) { s[e] = 1.0f / (1.0f + expf(-logits[e])); ch[e] = s[e] + bias[e]; }
    for (int g = 0; g < G; g++) {
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int e = g * gs; e < (g + 1) * gs; e++) { if (ch[e] > b1) { b2 = b1; b1 = ch[e]; } else if (ch[e] > b2) b2 = ch[e]; }
        gsc[g] = gs >= 2 ? b1 + b2 : b1;
    }
    /* the best set of topk_group groups = the topk_group largest scores (ties: lower index) */
    int keep[64] = {0};
    for (int m = 0; m < (1 << G); m++) {
        if (__builtin_popcount((unsigned)m) != c->topk_group) continue;
        /* m is best iff no swap of a member for a non-member improves (by score, then index) */
        int best = 1;
        for (int a = 0; a < G && best; a++)
            for (int b = 0; b < G && best; b++)
                if ((m >> a & 1) && !(m >> b & 1) && (gsc[b] > gsc[a] || (gsc[b] == gsc[a] && b < a))) best = 0;
        if (best) { for (int g = 0; g < G; g++) keep[g] = m >> g & 1; break; }
    }
    float val[256];
    int ord[256];
    for (int e = 0; e < E; e++) { val[e] = keep[e / gs] ? ch[e] : 0.0f; ord[e] = e; }
    for (int i = 0; i < E; i++)
        for (int j = i + 1; j < E; j++)
            if (val[ord[j]] > val[ord[i]] || (val[ord[j]] == val[ord[i]] && ord[j] < ord[i])) { int t = ord[i]; ord[i] = ord[j]; ord[j] = t; }
    double sum = 0;
    for (int k = 0; k < K; k++) sum += s[ord[k]];
    for (int k = 0; k < K; k++) { idx[k] = ord[k]; wts[k] = (float)(s[ord[k]] / (sum + 1e-20)) * c->routed_scaling_factor; }
}

TEST(core, group_routing_brute_force) {
    petrel_config c;
    memset(&c, 0, sizeof c);
    int shapes[][4] = {{16, 4, 2, 4}, {256, 8, 4, 8}, {64, 8, 3, 6}, {32, 1, 1, 8}, {12, 6, 6, 3}};
    for (int sh = 0; sh < 5; sh++) {
        c.n_routed_experts = shapes[sh][0];
        c.n_group = shapes[sh][1];
        c.topk_group = shapes[sh][2];
        c.num_experts_per_tok = shapes[sh][3];
        c.norm_topk_prob = 1;
        c.routed_scaling_factor = 2.5f;
        int E = c.n_routed_experts, K = c.num_experts_per_tok;
        for (int trial = 0; trial < 100; trial++) {
            float logits[256], bias[256], scratch[512], w1[16], w2[16];
            int32_t i1[16], i2[16];
            for (int e = 0; e < E; e++) { logits[e] = 3 * rndf(); bias[e] = 0.5f * rndf(); }
            moe_route(&c, logits, bias, i1, w1, scratch);
            route_brute(&c, logits, bias, i2, w2);
            double wsum = 0;
            for (int k = 0; k < K; k++) {
                int found = -1;
                for (int j = 0; j < K; j++) if (i1[j] == i2[k]) found = j;
                CHECK_MSG(found >= 0, "shape %d trial %d: expert %d missing", sh, trial, i2[k]);
                if (found >= 0) CHECK_NEAR(w1[found], w2[k], 1e-6);
                wsum += w1[k];
            }
            CHECK_NEAR(wsum, 2.5, 1e-5);
        }
    }
}

/* ---- bad input ---- */

static void write_bytes(const char *path, const void *buf, size_t n) {
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    if (!f) return;
    CHECK(fwrite(buf, 1, n, f) == n);
    fclose(f);
}

static int parse_mem(const char *hdr, size_t data_bytes, petrel_error *err) {
    size_t hl = strlen(hdr), n = 8 + hl + data_bytes;
    uint8_t *buf = calloc(1, n);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    memcpy(buf + 8, hdr, hl);
    st_tensor *ts = NULL;
    int nt = 0;
    int rc = st_parse(buf, n, "test.safetensors", 0, &ts, &nt, err);
    for (int i = 0; i < nt; i++) free(ts[i].name);
    free(ts);
    free(buf);
    return rc;
}

TEST(core, bad_safetensors_headers) {
    petrel_error err = {0};
    CHECK(parse_mem("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, &err) == 0);
    CHECK(parse_mem("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, &err) == PETREL_EFORMAT);
    CHECK(strstr(err.msg, "past the end") != NULL);
    CHECK(parse_mem("{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 16, &err) == PETREL_EFORMAT);
    CHECK(strstr(err.msg, "needs 12") != NULL);
    CHECK(parse_mem("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 16, &err) == PETREL_EFORMAT);
    CHECK(strstr(err.msg, "overlap") != NULL);
    CHECK(parse_mem("{\"a\":{\"dtype\":\"Q9\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, &err) == PETREL_EFORMAT);
    CHECK(strstr(err.msg, "unknown dtype") != NULL);
    CHECK(parse_mem("{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, &err) == PETREL_EFORMAT);
    CHECK(parse_mem("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, &err) == PETREL_EFORMAT);
    CHECK(parse_mem("{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, &err) == PETREL_EFORMAT);
    CHECK(parse_mem("{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],\"data_offsets\":[0,8]}}", 8, &err) == PETREL_EFORMAT);
    CHECK(parse_mem("{not json", 0, &err) == PETREL_EFORMAT);
    CHECK(parse_mem("[1,2]", 0, &err) == PETREL_EFORMAT);
    /* header length prefix larger than the file */
    uint8_t small[16] = {0xff, 0xff, 0, 0, 0, 0, 0, 0, '{', '}'};
    st_tensor *ts = NULL;
    int nt = 0;
    CHECK(st_parse(small, sizeof small, "x", 0, &ts, &nt, &err) == PETREL_EFORMAT);
    CHECK(strstr(err.msg, "header length") != NULL);
    CHECK(st_parse(small, 5, "x", 0, &ts, &nt, &err) == PETREL_EFORMAT);
    free(ts);
}

/* Copies tiny's tensors into DIR/model.safetensors, letting `edit` change or drop one. */
typedef void (*edit_fn)(st_write_tensor *t, int *keep);
static const char *make_variant(const char *tag, edit_fn edit, const char *config_text) {
    static char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", test_tmpdir(), tag);
    mkdir(dir, 0755);
    petrel_error err = {0};
    st_set *src;
    char p[600];
    snprintf(p, sizeof p, "%s/model.safetensors", test_data("tiny"));
    if (st_open(p, &src, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return dir; }
    st_write_tensor *ws = calloc((size_t)src->n_tensors, sizeof *ws);
    int n = 0;
    for (int i = 0; i < src->n_tensors; i++) {
        st_write_tensor w = {src->tensors[i].name, src->tensors[i].dtype, src->tensors[i].ndim, {0}, src->tensors[i].data};
        memcpy(w.shape, src->tensors[i].shape, sizeof w.shape);
        int keep = 1;
        if (edit) edit(&w, &keep);
        if (keep) ws[n++] = w;
    }
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    CHECK(st_write(p, ws, n, &err) == 0);
    free(ws);
    st_close(src);
    char *cfg = NULL;
    size_t len;
    snprintf(p, sizeof p, "%s/config.json", test_data("tiny"));
    if (!config_text) { CHECK(pt_read_file(p, 1 << 20, &cfg, &len, &err) == 0); config_text = cfg; }
    snprintf(p, sizeof p, "%s/config.json", dir);
    write_bytes(p, config_text, strlen(config_text));
    free(cfg);
    return dir;
}

static void drop_kv_b(st_write_tensor *t, int *keep) { if (!strcmp(t->name, "model.layers.2.self_attn.kv_b_proj.weight")) *keep = 0; }
static void drop_indexer(st_write_tensor *t, int *keep) { if (strstr(t->name, "layers.3.self_attn.indexer.wk")) *keep = 0; }
static void i32_q_a(st_write_tensor *t, int *keep) {
    (void)keep;
    if (!strcmp(t->name, "model.layers.0.self_attn.q_a_proj.weight")) t->dtype = ST_I16;
}
static void reshape_o(st_write_tensor *t, int *keep) {
    (void)keep;
    if (!strcmp(t->name, "model.layers.1.self_attn.o_proj.weight")) { t->shape[0] /= 2; t->shape[1] *= 2; }
}

static void expect_open_fails(const char *dir, int code, const char *needle) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    int rc = petrel_engine_open(dir, NULL, &e, &err);
    CHECK_MSG(rc == code, "open %s: rc %d (want %d): %s", dir, rc, code, err.msg);
    CHECK_MSG(strstr(err.msg, needle) != NULL, "message \"%s\" lacks \"%s\"", err.msg, needle);
    CHECK(e == NULL);
    if (e) petrel_engine_close(e);
}

TEST(core, bad_tensors) {
    expect_open_fails(make_variant("nokvb", drop_kv_b, NULL), PETREL_EFORMAT, "missing tensor \"model.layers.2.self_attn.kv_b_proj.weight\"");
    expect_open_fails(make_variant("noidx", drop_indexer, NULL), PETREL_EFORMAT, "model.layers.3.self_attn.indexer.wk.weight");
    expect_open_fails(make_variant("i16", i32_q_a, NULL), PETREL_EFORMAT, "dtype I16");
    expect_open_fails(make_variant("shape", reshape_o, NULL), PETREL_EFORMAT, "o_proj.weight\" has shape");
    /* a truncated file */
    const char *dir = make_variant("trunc", NULL, NULL);
    char p[600];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    CHECK(truncate(p, 100000) == 0);
    expect_open_fails(dir, PETREL_EFORMAT, "past the end");
    expect_open_fails("/nonexistent/model", PETREL_EIO, "/nonexistent/model");
}

static char *tiny_config_with(const char *from, const char *to) {
    char *cfg = NULL, p[600];
    size_t len;
    petrel_error err = {0};
    snprintf(p, sizeof p, "%s/config.json", test_data("tiny"));
    CHECK(pt_read_file(p, 1 << 20, &cfg, &len, &err) == 0);
    char *at = cfg ? strstr(cfg, from) : NULL;
    CHECK_MSG(at != NULL, "config lacks %s", from);
    if (!at) return cfg;
    char *out = malloc(len + strlen(to) + 1);
    size_t pre = (size_t)(at - cfg);
    memcpy(out, cfg, pre);
    strcpy(out + pre, to);
    strcat(out, at + strlen(from));
    free(cfg);
    return out;
}

TEST(core, bad_config) {
    struct { const char *from, *to, *needle; int code; } cases[] = {
        {"\"glm_moe_dsa\"", "\"llama\"", "model_type \"llama\"", PETREL_EUNSUPPORTED},
        {"\"hidden_size\": 64", "\"hidden_size\": \"64\"", "\"hidden_size\" must be an integer", PETREL_EFORMAT},
        {"\"num_experts_per_tok\": 4", "\"num_experts_per_tok\": 40", "num_experts_per_tok", PETREL_EFORMAT},
        {"\"qk_head_dim\": 24", "\"qk_head_dim\": 25", "qk_head_dim", PETREL_EFORMAT},
        {"\"n_group\": 4", "\"n_group\": 5", "n_group", PETREL_EFORMAT},
        {"\"vocab_size\": 1024", "\"vocab_sizes\": 1024", "missing field \"vocab_size\"", PETREL_EFORMAT},
        {"\"full\",\n    \"full\",", "\"shared\",\n    \"full\",", "layer 0", PETREL_EFORMAT},
        {"\"full\",\n    \"full\",", "\"full\",", "indexer_types", PETREL_EFORMAT},
        {"\"rope_type\": \"default\"", "\"rope_type\": \"yarn\"", "rope_type", PETREL_EUNSUPPORTED},
        {"\"eos_token_id\": 1", "\"eos_token_id\": 5000", "eos_token_id", PETREL_EFORMAT},
        {"\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": -1", "rms_norm_eps", PETREL_EFORMAT},
        {"{", "{{", "not valid JSON", PETREL_EFORMAT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *cfg = tiny_config_with(cases[i].from, cases[i].to);
        petrel_config c;
        petrel_error err = {0};
        int rc = config_parse(cfg, strlen(cfg), "config.json", &c, &err);
        CHECK_MSG(rc == cases[i].code, "case %zu: rc %d: %s", i, rc, err.msg);
        CHECK_MSG(strstr(err.msg, cases[i].needle) != NULL, "case %zu: \"%s\" lacks \"%s\"", i, err.msg, cases[i].needle);
        if (rc == 0) config_deinit(&c);
        free(cfg);
    }
    /* and an engine open with a contradictory config names config.json */
    char *cfg = tiny_config_with("\"q_lora_rank\": 48", "\"q_lora_rank\": 40");
    expect_open_fails(make_variant("qlora", NULL, cfg), PETREL_EFORMAT, "q_a_layernorm.weight\" has shape");
    free(cfg);
}

TEST(core, bad_prompts) {
    petrel_engine *e = open_tiny("tiny");
    if (!e) return;
    petrel_session *s;
    petrel_error err = {0};
    CHECK(petrel_session_create(e, 8, &s, &err) == 0);
    int32_t ids[] = {1, 2, 5000};
    float lg[1024];
    CHECK(petrel_session_forward(s, ids, 3, lg, 0, &err) == PETREL_EINVAL);
    CHECK(strstr(err.msg, "5000") != NULL);
    CHECK(petrel_session_forward(s, ids, 0, lg, 0, &err) == PETREL_EINVAL);
    CHECK(strstr(err.msg, "empty") != NULL);
    int32_t neg = -1;
    CHECK(petrel_session_forward(s, &neg, 1, lg, 0, &err) == PETREL_EINVAL);
    CHECK_EQ_INT(petrel_session_len(s), 0);
    int32_t many[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    CHECK(petrel_session_forward(s, many, 9, lg, 0, &err) == PETREL_ERANGE);
    CHECK(petrel_session_forward(s, many, 8, lg, 0, &err) == 0); /* still usable */
    CHECK_EQ_INT(petrel_session_len(s), 8);
    CHECK(petrel_session_truncate(s, 3, &err) == 0);
    CHECK(petrel_session_truncate(s, 5, &err) == PETREL_EINVAL);
    petrel_session_free(s);
    CHECK(petrel_session_create(e, 0, &s, &err) == PETREL_EINVAL);
    CHECK(petrel_session_create(e, 100000, &s, &err) == PETREL_ERANGE);
    petrel_engine_close(e);
}

/* The kernels' prefetch open options out of range are refused by the open with one message
 * naming them, and no engine is returned; the edges of the range open. */
TEST(core, bad_prefetch_options) {
    static const int bad[][3] = {{63, 0, 0}, {65537, 0, 0}, {-2, 0, 0}, {0, 3, 0}, {0, -1, 0}, {0, 0, 3}, {0, 0, -1}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        petrel_open_opts o = {0};
        o.prefetch = bad[i][0], o.prefetch_level = bad[i][1], o.prefetch_lines = bad[i][2];
        petrel_engine *e = (petrel_engine *)&o;
        petrel_error err = {0};
        CHECK_MSG(petrel_engine_open(test_data("tiny"), &o, &e, &err) == PETREL_EINVAL && strstr(err.msg, "prefetch") && !strchr(err.msg, '\n'),
                  "prefetch %d level %d lines %d: %s", bad[i][0], bad[i][1], bad[i][2], err.msg);
        CHECK(e == NULL);
    }
    static const int good[][3] = {{-1, 0, 0}, {64, 2, 1}, {65536, 1, 2}};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        petrel_open_opts o = {0};
        o.prefetch = good[i][0], o.prefetch_level = good[i][1], o.prefetch_lines = good[i][2];
        petrel_engine *e = NULL;
        petrel_error err = {0};
        CHECK_MSG(petrel_engine_open(test_data("tiny"), &o, &e, &err) == 0, "prefetch %d level %d lines %d: %s", good[i][0], good[i][1], good[i][2],
                  err.msg);
        petrel_engine_close(e);
    }
}

/* Truncate-and-rerun gives the same logits as a fresh session (rollback correctness). */
TEST(core, truncate_then_continue) {
    petrel_engine *e = open_tiny("tiny");
    if (!e) return;
    int V = e->cfg.vocab_size;
    int32_t ids[20];
    for (int i = 0; i < 20; i++) ids[i] = (int32_t)(rnd() % (uint32_t)V);
    float *a = malloc(sizeof(float) * V), *b = malloc(sizeof(float) * V);
    petrel_session *s;
    petrel_error err = {0};
    CHECK(petrel_session_create(e, 20, &s, &err) == 0);
    CHECK(petrel_session_forward(s, ids, 20, a, 0, &err) == 0);
    CHECK(petrel_session_truncate(s, 12, &err) == 0);
    int32_t junk[3] = {7, 8, 9};
    CHECK(petrel_session_forward(s, junk, 3, NULL, 0, &err) == 0);
    CHECK(petrel_session_truncate(s, 12, &err) == 0);
    CHECK(petrel_session_forward(s, ids + 12, 8, b, 0, &err) == 0);
    CHECK(test_rel_l2(b, a, (size_t)V) < 1e-6);
    petrel_session_free(s);
    free(a);
    free(b);
    petrel_engine_close(e);
}

/* While a context fits in index_topk the indexer's query side is skipped (every key is selected
 * anyway): bitwise invisible against the forced scoring path, for contexts just below, at and
 * just above index_topk, in one pass and token by token, on every fixture with an indexer. */
TEST(core, indexer_query_skip_invisible) {
    const char *names[] = {"tiny", "tiny-fp8", "trained"};
    for (int f = 0; f < 3; f++) {
        petrel_engine *e = open_tiny(names[f]);
        if (!e) return;
        int V = e->cfg.vocab_size, K = e->cfg.index_topk;
        for (int d = -1; d <= 2; d++) {
            int T = K + d;
            int32_t *ids = malloc(sizeof(int32_t) * (size_t)T);
            for (int i = 0; i < T; i++) ids[i] = (int32_t)(rnd() % (uint32_t)V);
            for (int dec = 0; dec < 2; dec++) {
                float *a = run(e, ids, T, MLA_AUTO, 0, dec), *b = run(e, ids, T, MLA_AUTO, 1, dec);
                CHECK_MSG(!memcmp(a, b, sizeof(float) * (size_t)T * V), "%s: %d tokens (index_topk %d)%s: skipping the indexer's queries changed the logits",
                          names[f], T, K, dec ? " decoded" : "");
                free(a);
                free(b);
            }
            free(ids);
        }
        petrel_engine_close(e);
    }
}

/* The public queries front ends use instead of the config (petrel.h): the context limit, the
 * end-of-sequence ids (the trained fixture lists three), the description `petrel info` prints,
 * and petrel_argmax's greedy rule (the
 * lowest index of the largest value that is not NaN; n - 1 when every value is NaN) against a
 * plain loop, over rows with planted ties, NaNs and infinities. */
TEST(core, public_engine_queries) {
    petrel_engine *e = open_tiny("trained");
    CHECK(e->cfg.max_position_embeddings > 0);
    CHECK_EQ_INT(petrel_engine_max_positions(e), e->cfg.max_position_embeddings);
    int V = petrel_engine_vocab_size(e), n_eos = 0;
    CHECK(e->cfg.n_eos >= 2);
    for (int t = 0; t < V; t++) n_eos += petrel_engine_is_eos(e, t);
    CHECK_EQ_INT(n_eos, e->cfg.n_eos);
    for (int i = 0; i < e->cfg.n_eos; i++) CHECK(petrel_engine_is_eos(e, e->cfg.eos_token_id[i]) == 1);
    CHECK(petrel_engine_is_eos(e, -1) == 0 && petrel_engine_is_eos(e, V) == 0);
    char *text = NULL;
    petrel_error err = {0};
    CHECK(petrel_engine_describe(e, &text, &err) == 0);
    char want[64];
    snprintf(want, sizeof want, "max_position_embeddings %d\n", e->cfg.max_position_embeddings);
    if (text) CHECK_MSG(strstr(text, "model_type       glm_moe_dsa\n") && strstr(text, want) && strstr(text, "\nkv cache ") &&
                        text[strlen(text) - 1] == '\n', "%s", text);
    free(text);
    petrel_engine_close(e);
    float x[300];
    for (int it = 0; it < 400; it++) {
        int n = 1 + (int)(rnd() % 300);
        for (int i = 0; i < n; i++) {
            uint32_t r = rnd() % 16;
            x[i] = r == 0 ? NAN : r == 1 ? 3.0f : r == 2 ? -INFINITY : r == 3 && it % 7 == 0 ? INFINITY : rndf();
        }
        if (it % 50 == 0)
            for (int i = 0; i < n; i++) x[i] = NAN;
        int best = 0;
        for (int i = 1; i < n; i++)
            if (x[i] > x[best] || x[best] != x[best]) best = i;
        CHECK_MSG(petrel_argmax(x, n) == best, "row %d (n %d): %d, want %d", it, n, petrel_argmax(x, n), best);
    }
}
