/* test_pack.c: petrel packs (src/io/pack.*), the converter (src/io/convert.*) and synth
 * (src/model/synth.*): bf16 packs reproduce the goldens and their source bitwise; a q8 pack
 * equals an engine bound to the same quantized data; expert records round-trip through the
 * record API; corrupted packs are refused; an interrupted conversion resumes to an identical
 * file; synth packs open and run. */
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>
#include <xxhash.h>

#include "base/err.h"
#include "base/file.h"
#include "io/convert.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "kernels/kernels.h"
#include "model/engine.h"
#include "model/synth.h"
#include "quant/quant.h"
#include "test.h"


static const char *tmp(const char *name) { return test_tmp(name); }

static int convert_to(const char *fixture, const char *out, int quant, int stop_after, convert_result *res) {
    convert_opts o = {0};
    o.quant = quant;
    o.stop_after = stop_after;
    petrel_error err = {0};
    convert_result r;
    int rc = convert_hf(test_data(fixture), out, &o, res ? res : &r, &err);
    if (rc && !stop_after) test_fail(__FILE__, __LINE__, "convert %s: %s", fixture, err.msg);
    return rc;
}

/* Logits [T][V] of ids through a fresh session of eng (caller frees). */
static float *run_logits(petrel_engine *eng, const int32_t *ids, int T) {
    int V = eng->cfg.vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)T * V);
    petrel_session *s;
    petrel_error err = {0};
    if (petrel_session_create(eng, T, &s, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); free(lg); return NULL; }
    if (petrel_session_forward(s, ids, T, lg, 1, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); free(lg); lg = NULL; }
    petrel_session_free(s);
    return lg;
}

static petrel_engine *open_eng(const char *path) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(path, NULL, &e, &err)) test_fail(__FILE__, __LINE__, "open %s: %s", path, err.msg);
    return e;
}

/* bf16 pack: goldens within 1e-4 and bitwise equal to the source's logits. */
static void check_bf16(const char *fixture) {
    char out[600];
    snprintf(out, sizeof out, "%s", tmp(fixture));
    strcat(out, "-bf16.pack");
    if (convert_to(fixture, out, CVQ_BF16, 0, NULL)) return;
    petrel_engine *pk = open_eng(out), *src = open_eng(test_data(fixture));
    st_set *gold = NULL;
    petrel_error err = {0};
    char gp[600];
    snprintf(gp, sizeof gp, "%s/golden.safetensors", test_data(fixture));
    CHECK(st_open(gp, &gold, &err) == 0);
    if (!pk || !src || !gold) goto done;
    int V = pk->cfg.vocab_size, np = 0;
    for (int pi = 0;; pi++) {
        const st_tensor *ids = test_gold(gold, pi, "ids"), *ref = test_gold(gold, pi, "logits");
        if (!ids || !ref) break;
        np++;
        int T = (int)ids->shape[0];
        float *a = run_logits(pk, (const int32_t *)ids->data, T), *b = run_logits(src, (const int32_t *)ids->data, T);
        if (a && b) {
            double e = test_rel_l2(a, (const float *)ref->data, (size_t)T * V);
            CHECK_MSG(e < 1e-4, "%s bf16 pack prompt %d: rel L2 %.3g vs golden", fixture, pi, e);
            CHECK_MSG(!memcmp(a, b, sizeof(float) * (size_t)T * V), "%s bf16 pack prompt %d: logits differ from the source's", fixture, pi);
        }
        free(a);
        free(b);
    }
    CHECK(np > 0);
done:
    st_close(gold);
    petrel_engine_close(pk);
    petrel_engine_close(src);
}
TEST(pack, bf16_tiny_golden) { check_bf16("tiny"); }
TEST(pack, bf16_fp8_golden) { check_bf16("tiny-fp8"); }
TEST(pack, bf16_odd_golden) { check_bf16("odd"); }
TEST(pack, bf16_odd2_golden) { check_bf16("odd2"); }

/* ---- a q8 pack equals an engine bound to the same quantized data ---- */

typedef struct qsrc {
    const wsource *inner;
    void *bufs[4096];
    int n;
} qsrc;
static int q_matrix(void *ctx, const char *name, int64_t rows, int64_t cols, pt_wview *out, petrel_error *err) {
    qsrc *q = ctx;
    pt_wview v;
    PT_TRY(q->inner->matrix(q->inner->ctx, name, rows, cols, &v, err));
    size_t nl = strlen(name);
    int router = nl > 16 && !strcmp(name + nl - 16, ".mlp.gate.weight");
    pt_qtype t = router ? PT_F32 : PT_Q8_G32;
    int64_t rb = pt_qtype_row_bytes(t, cols), spr = pt_qtype_scales_per_row(t, cols);
    uint8_t *d = malloc((size_t)(rows * rb));
    uint16_t *s = spr ? malloc(sizeof(uint16_t) * (size_t)(rows * spr)) : NULL;
    float *f = malloc(sizeof(float) * (size_t)cols);
    for (int64_t r = 0; r < rows; r++) {
        pt_dequant_row(&v, r, f);
        pt_quant_row(t, f, cols, d + r * rb, s ? s + r * spr : NULL, PT_BF16);
    }
    free(f);
    if (q->n + 2 > 4096) return pt_err(err, PETREL_ENOMEM, "test: too many tensors");
    q->bufs[q->n++] = d;
    q->bufs[q->n++] = s;
    *out = pt_wview_make(t, rows, cols, d, s, PT_BF16);
    return 0;
}
static int q_vector(void *ctx, const char *name, int64_t n, float *out, petrel_error *err) {
    qsrc *q = ctx;
    return q->inner->vector(q->inner->ctx, name, n, out, err);
}
static int q_has(void *ctx, const char *name) {
    qsrc *q = ctx;
    return q->inner->has(q->inner->ctx, name);
}

TEST(pack, q8_equals_quantized_views) {
    const char *out = tmp("tiny-q8.pack");
    if (convert_to("tiny", out, CVQ_Q8, 0, NULL)) return;
    petrel_engine *pk = open_eng(out), *ref = open_eng(test_data("tiny"));
    if (!pk || !ref) { petrel_engine_close(pk); petrel_engine_close(ref); return; }
    static qsrc q;
    memset(&q, 0, sizeof q);
    wsource inner, qws = {&q, q_matrix, q_vector, q_has};
    wsource_safetensors(&inner, &ref->st_src, ref->src, &ref->cfg);
    q.inner = &inner;
    weights_deinit(&ref->w, &ref->cfg);
    petrel_error err = {0};
    CHECK(weights_bind(&ref->w, &ref->cfg, &qws, &err) == 0);
    /* the engine lays a pack's resident q8 matrices out for int8 activations: do the same */
    if (kn_r16_available()) weights_relayout_r16(&ref->w, &ref->cfg, NULL, NULL);
    /* and stores routed experts row-interleaved: lay the reference's out wherever the pack's are */
    for (int l = 0; l < ref->cfg.num_hidden_layers; l++) {
        layer_w *rl = &ref->w.layers[l], *pl = &pk->w.layers[l];
        if (!rl->is_moe) continue;
        for (int x = 0; x < ref->cfg.n_routed_experts; x++) {
            pt_wview *rv[3] = {&rl->exp_gate[x], &rl->exp_up[x], &rl->exp_down[x]}, *pv[3] = {&pl->exp_gate[x], &pl->exp_up[x], &pl->exp_down[x]};
            for (int k = 0; k < 3; k++)
                if (pv[k]->layout == PT_LAYOUT_R16) CHECK(kn_r16_repack(rv[k]) == 0);
        }
    }
    int32_t ids[7] = {5, 17, 300, 42, 7, 999, 3};
    float *a = run_logits(pk, ids, 7), *b = run_logits(ref, ids, 7);
    if (a && b) CHECK_MSG(!memcmp(a, b, sizeof(float) * 7 * (size_t)pk->cfg.vocab_size), "q8 pack logits differ from quantized-view logits");
    if (kn_r16_available()) /* the relayout really happened (the tiny shapes allow it) */
        CHECK(pk->w.lm_head.layout == PT_LAYOUT_R16 && pk->w.layers[0].o_proj.layout == PT_LAYOUT_R16 &&
              pk->w.layers[0].kv_b_proj.layout == PT_LAYOUT_PLAIN && pk->w.embed_tokens.layout == PT_LAYOUT_PLAIN);
    free(a);
    free(b);
    petrel_engine_close(pk);
    petrel_engine_close(ref);
    for (int i = 0; i < q.n; i++) free(q.bufs[i]);
}

/* Pages of the file at path in the page cache, as a fraction (mincore over a fresh map). */
static double cached_fraction(const char *path) {
    int fd = open(path, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) || st.st_size == 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    long pg = sysconf(_SC_PAGESIZE);
    size_t n = ((size_t)st.st_size + (size_t)pg - 1) / (size_t)pg, in = 0;
    unsigned char *v = malloc(n);
    double f = -1;
    if (m != MAP_FAILED && v && mincore(m, (size_t)st.st_size, v) == 0) {
        for (size_t i = 0; i < n; i++) in += v[i] & 1;
        f = (double)in / (double)n;
    }
    free(v);
    if (m != MAP_FAILED) munmap(m, (size_t)st.st_size);
    close(fd);
    return f;
}

/* A resident open leaves the pack out of the page cache (the copy serves it): cache the whole
 * file, open, and most of its pages are gone; the engine still runs. */
TEST(pack, open_drops_the_file_cache) {
    const char *out = tmp("tiny-q4-cache.pack");
    if (convert_to("tiny", out, CVQ_Q4, 0, NULL)) return;
    struct statfs sf;
    if (statfs(out, &sf) == 0 && sf.f_type == 0x01021994) { test_skip("the test folder is tmpfs: its pages cannot leave the cache"); return; }
    FILE *f = fopen(out, "rb");
    char buf[1 << 16];
    while (f && fread(buf, 1, sizeof buf, f) > 0) {}
    if (f) fclose(f);
    double before = cached_fraction(out);
    pack *p = NULL;
    petrel_error err = {0};
    CHECK(pack_open(out, &p, &err) == 0);
    CHECK_MSG(!p || pack_cached(p) == (before >= 0.9), "pack_cached says %d with %.2f of the file cached", p ? pack_cached(p) : -1, before);
    petrel_engine *e = open_eng(out);
    if (!e) {
        pack_close(p);
        return;
    }
    double after = cached_fraction(out);
    CHECK_MSG(before > 0.9 && after >= 0 && after < 0.25, "page-cache share of the pack: %.2f before the open, %.2f after", before, after);
    CHECK_MSG(!p || pack_cached(p) == (after >= 0.9), "pack_cached says %d with %.2f of the file cached", p ? pack_cached(p) : -1, after);
    pack_close(p);
    int32_t ids[3] = {5, 17, 300};
    float *lg = run_logits(e, ids, 3);
    CHECK(lg != NULL);
    free(lg);
    petrel_engine_close(e);
}

/* ---- expert records ---- */

TEST(pack, expert_records_roundtrip) {
    const char *out = tmp("tiny-q4.pack");
    if (convert_to("tiny", out, CVQ_Q4, 0, NULL)) return;
    pack *p;
    petrel_error err = {0};
    if (pack_open(out, &p, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    CHECK(pack_verify(p, &err) == 0);
    petrel_engine *eng = open_eng(out);
    if (!eng) { pack_close(p); return; }
    const petrel_config *c = &eng->cfg;
    CHECK(eng->w.has_mtp);
    int nrec = 0;
    for (int l = 0; l <= c->num_hidden_layers; l++) {
        const layer_w *lw = l < c->num_hidden_layers ? &eng->w.layers[l] : &eng->w.mtp;
        uint64_t off, bytes, h;
        if (!lw->is_moe) { CHECK(pack_expert_record(p, l, 0, &off, &bytes, &h) == PETREL_EINVAL); continue; }
        CHECK(pack_expert_record(p, l, c->n_routed_experts, &off, &bytes, &h) == PETREL_EINVAL);
        for (int e = 0; e < c->n_routed_experts; e++) {
            CHECK(pack_expert_record(p, l, e, &off, &bytes, &h) == 0);
            CHECK(off % 4096 == 0 && bytes % 4096 == 0 && bytes > 0);
            uint8_t *buf = aligned_alloc(4096, (size_t)bytes);
            CHECK(pack_read_expert(p, l, e, buf, &err) == 0);
            CHECK(XXH64(buf, (size_t)bytes, 0) == h);
            pt_wview g, u, d;
            CHECK(pack_expert_views(p, l, buf, &g, &u, &d) == 0);
            CHECK(g.qtype == (l < c->num_hidden_layers ? PT_Q4_G64 : PT_Q8_G32) && g.rows == c->moe_intermediate_size && g.cols == c->hidden_size);
            CHECK(d.rows == c->hidden_size && d.cols == c->moe_intermediate_size);
            /* the record's views hold the same bytes as the resident views */
            const pt_wview *rv[3] = {&lw->exp_gate[e], &lw->exp_up[e], &lw->exp_down[e]}, *bv[3] = {&g, &u, &d};
            for (int k = 0; k < 3; k++) {
                CHECK(!memcmp(rv[k]->data, bv[k]->data, (size_t)(rv[k]->rows * rv[k]->row_bytes)));
                CHECK(rv[k]->qtype == bv[k]->qtype && !memcmp(rv[k]->scale, bv[k]->scale, (size_t)(rv[k]->rows * rv[k]->scale_cols * 2)));
            }
            free(buf);
            nrec++;
        }
    }
    CHECK_EQ_INT(nrec, (c->num_hidden_layers - c->first_k_dense_replace + 1) * c->n_routed_experts);
    petrel_engine_close(eng);
    pack_close(p);
}

/* ---- corruption ---- */

static void spit(const char *path, const uint8_t *b, size_t n) {
    FILE *f = fopen(path, "wb");
    fwrite(b, 1, n, f);
    fclose(f);
}
static int open_code(const char *path, char *msg, size_t msz) {
    pack *p;
    petrel_error err = {0};
    int rc = pack_open(path, &p, &err);
    if (rc == 0) pack_close(p);
    snprintf(msg, msz, "%s", err.msg);
    return rc;
}
/* Replaces `key` value in the header with text `val` (padded with spaces to keep the length)
 * and fixes the header checksum. */
static int patch_header(uint8_t *b, const char *key, const char *val) {
    uint64_t hl;
    memcpy(&hl, b + 16, 8);
    char *h = (char *)b + PACK_PREFIX;
    char *k = memmem(h, hl, key, strlen(key));
    if (!k) return -1;
    char *v = k + strlen(key), *end = v;
    while (*end != ',' && *end != '}') end++;
    size_t old = (size_t)(end - v), nl = strlen(val);
    if (nl > old) return -1;
    memcpy(v, val, nl);
    memset(v + nl, ' ', old - nl);
    uint64_t hh = XXH64(h, hl, 0);
    memcpy(b + 32, &hh, 8);
    return 0;
}

TEST(pack, corrupt_refused) {
    const char *good = tmp("tiny-c.pack"), *bad = tmp("bad.pack");
    if (convert_to("tiny", good, CVQ_Q4, 0, NULL)) return;
    size_t n;
    uint8_t *b = test_read_file(good, &n);
    if (!b) { test_fail(__FILE__, __LINE__, "read %s", good); return; }
    char msg[1024];
    /* truncated */
    spit(bad, b, n - 4096);
    CHECK_EQ_INT(open_code(bad, msg, sizeof msg), PETREL_EFORMAT);
    CHECK_MSG(strstr(msg, "truncated"), "message: %s", msg);
    spit(bad, b, 40);
    CHECK_EQ_INT(open_code(bad, msg, sizeof msg), PETREL_EFORMAT);
    /* bad magic */
    uint8_t *c = malloc(n);
    memcpy(c, b, n);
    c[0] = 'X';
    spit(bad, c, n);
    CHECK_EQ_INT(open_code(bad, msg, sizeof msg), PETREL_EFORMAT);
    CHECK_MSG(strstr(msg, "magic"), "message: %s", msg);
    CHECK(!pack_is_pack(bad));
    /* wrong version */
    memcpy(c, b, n);
    c[8] = 9;
    spit(bad, c, n);
    CHECK_EQ_INT(open_code(bad, msg, sizeof msg), PETREL_EUNSUPPORTED);
    CHECK_MSG(strstr(msg, "version"), "message: %s", msg);
    /* header byte flipped */
    memcpy(c, b, n);
    c[PACK_PREFIX + 30] ^= 0x20;
    spit(bad, c, n);
    CHECK_EQ_INT(open_code(bad, msg, sizeof msg), PETREL_EFORMAT);
    CHECK_MSG(strstr(msg, "checksum"), "message: %s", msg);
    /* directory entries out of bounds (valid header checksum) */
    memcpy(c, b, n);
    CHECK(patch_header(c, "\"first_offset\":", "99999744") == 0 || patch_header(c, "\"first_offset\":", "999424") == 0);
    spit(bad, c, n);
    CHECK_EQ_INT(open_code(bad, msg, sizeof msg), PETREL_EFORMAT);
    CHECK_MSG(strstr(msg, "out of bounds"), "message: %s", msg);
    memcpy(c, b, n);
    CHECK(patch_header(c, "\"bytes\":", "7") == 0);
    spit(bad, c, n);
    CHECK_EQ_INT(open_code(bad, msg, sizeof msg), PETREL_EFORMAT);
    memcpy(c, b, n);
    CHECK(patch_header(c, "\"qtype\":", "\"q9\"") == 0);
    spit(bad, c, n);
    CHECK_EQ_INT(open_code(bad, msg, sizeof msg), PETREL_EFORMAT);
    /* flipped byte inside an expert record: opens, but verify and the read path refuse it */
    pack *p;
    petrel_error err = {0};
    CHECK(pack_open(good, &p, &err) == 0);
    uint64_t off, bytes, h;
    CHECK(pack_expert_record(p, 2, 5, &off, &bytes, &h) == 0);
    pack_close(p);
    memcpy(c, b, n);
    c[off + 100] ^= 1;
    spit(bad, c, n);
    CHECK(pack_open(bad, &p, &err) == 0);
    err.msg[0] = 0;
    CHECK_EQ_INT(pack_verify(p, &err), PETREL_EFORMAT);
    CHECK_MSG(strstr(err.msg, "layer 2 expert 5"), "message: %s", err.msg);
    uint8_t *rb = malloc((size_t)bytes);
    CHECK_EQ_INT(pack_read_expert(p, 2, 5, rb, &err), PETREL_EFORMAT);
    CHECK(pack_read_expert(p, 2, 4, rb, &err) == 0);
    CHECK(pack_read_expert(p, 3, 5, rb, &err) == 0);
    free(rb);
    pack_close(p);
    /* a flipped byte in a resident tensor is found by pack_verify */
    memcpy(c, b, n);
    CHECK(pack_open(good, &p, &err) == 0);
    const pack_tensor *t = pack_find(p, "model.layers.1.self_attn.o_proj.weight");
    CHECK(t != NULL);
    if (t) c[t->offset + 3] ^= 0x40;
    pack_close(p);
    spit(bad, c, n);
    CHECK(pack_open(bad, &p, &err) == 0);
    CHECK_EQ_INT(pack_verify(p, &err), PETREL_EFORMAT);
    CHECK_MSG(strstr(err.msg, "o_proj"), "message: %s", err.msg);
    /* ... and by the engine's load, which checks every resident tensor it copies */
    err.msg[0] = 0;
    CHECK(pack_load_resident(p, 1, 0, &off, NULL, NULL, &err) == PETREL_EFORMAT && !p->copy);
    CHECK_MSG(strstr(err.msg, "o_proj") && strstr(err.msg, "checksum"), "message: %s", err.msg);
    pack_close(p);
    petrel_engine *eng = NULL;
    CHECK(petrel_engine_open(bad, NULL, &eng, &err) == PETREL_EFORMAT && !eng);
    /* the embedding left on disk under a budget is still checked, through the map */
    memcpy(c, b, n);
    CHECK(pack_open(good, &p, &err) == 0);
    const pack_tensor *et = pack_find(p, "model.embed_tokens.weight");
    CHECK(et != NULL && pack_find(p, "lm_head.weight") != NULL);
    if (et) c[et->offset + et->bytes / 2] ^= 0x10;
    pack_close(p);
    spit(bad, c, n);
    CHECK(pack_open(bad, &p, &err) == 0);
    err.msg[0] = 0;
    CHECK(pack_load_resident(p, 0, 1, &off, NULL, NULL, &err) == PETREL_EFORMAT && !p->copy && !p->on_disk);
    CHECK_MSG(strstr(err.msg, "embed_tokens") && strstr(err.msg, "checksum"), "message: %s", err.msg);
    pack_close(p);
    petrel_open_opts bo = {0};
    bo.mem_budget = 1ull << 30;
    CHECK(petrel_engine_open(bad, &bo, &eng, &err) == PETREL_EFORMAT && !eng);
    CHECK(petrel_engine_open(good, &bo, &eng, &err) == 0 && eng && eng->pack->on_disk == pack_find(eng->pack, "model.embed_tokens.weight"));
    petrel_engine_close(eng);
    free(c);
    free(b);
}

/* ---- resume ---- */

TEST(pack, resume_identical) {
    const char *full = tmp("tiny-full.pack"), *res = tmp("tiny-res.pack");
    if (convert_to("tiny", full, CVQ_Q4, 0, NULL)) return;
    convert_result r;
    CHECK_EQ_INT(convert_to("tiny", res, CVQ_Q4, 60, &r), PETREL_ERANGE);
    struct stat st;
    CHECK(stat(res, &st) < 0);
    char partial[600];
    snprintf(partial, sizeof partial, "%s.partial", res);
    CHECK(stat(partial, &st) == 0);
    /* second interruption, then damage one journaled item: it must be redone */
    CHECK_EQ_INT(convert_to("tiny", res, CVQ_Q4, 40, &r), PETREL_ERANGE);
    CHECK_EQ_INT(r.resumed, 60);
    pack *p;
    petrel_error err = {0};
    CHECK(pack_open(full, &p, &err) == 0);
    const pack_tensor *t = pack_find(p, "model.embed_tokens.weight");
    uint64_t off = t ? t->offset : 4096;
    pack_close(p);
    int fd = open(partial, O_RDWR);
    uint8_t x = 0x5a;
    CHECK(pwrite(fd, &x, 1, (off_t)off + 10) == 1);
    close(fd);
    CHECK(convert_to("tiny", res, CVQ_Q4, 0, &r) == 0);
    CHECK_EQ_INT(r.resumed, 99);
    size_t na, nb;
    uint8_t *a = test_read_file(full, &na), *b = test_read_file(res, &nb);
    CHECK(a && b && na == nb && !memcmp(a, b, na));
    free(a);
    free(b);
    char jp[700];
    snprintf(jp, sizeof jp, "%s.journal", partial);
    CHECK(stat(partial, &st) < 0 && stat(jp, &st) < 0);
}

/* ---- synth ---- */

static const char *small_cfg =
    "{\"model_type\": \"glm_moe_dsa\", \"vocab_size\": 300, \"hidden_size\": 96, \"intermediate_size\": 160,"
    " \"moe_intermediate_size\": 48, \"num_hidden_layers\": 3, \"num_attention_heads\": 2, \"q_lora_rank\": 40,"
    " \"kv_lora_rank\": 32, \"qk_nope_head_dim\": 16, \"qk_rope_head_dim\": 8, \"v_head_dim\": 16,"
    " \"n_routed_experts\": 8, \"n_shared_experts\": 1, \"num_experts_per_tok\": 2, \"first_k_dense_replace\": 1,"
    " \"index_topk\": 4, \"index_head_dim\": 16, \"index_n_heads\": 2, \"num_nextn_predict_layers\": 1,"
    " \"indexer_types\": [\"full\", \"shared\", \"full\"], \"max_position_embeddings\": 256}";

TEST(pack, synth_small_runs) {
    const char *a = tmp("synth-a.pack"), *b = tmp("synth-b.pack");
    convert_opts o = {0};
    o.quant = CVQ_Q8;
    o.cls[CV_EXPERTS] = CVQ_Q4;
    petrel_error err = {0};
    convert_result r;
    CHECK(synth_write(small_cfg, a, &o, 7, 1, &r, &err) == 0);
    CHECK(synth_write(small_cfg, b, &o, 7, 1, &r, &err) == 0);
    size_t na, nb;
    uint8_t *x = test_read_file(a, &na), *y = test_read_file(b, &nb);
    CHECK_MSG(x && y && na == nb && !memcmp(x, y, na), "synth is not deterministic");
    free(x);
    free(y);
    petrel_engine *eng = open_eng(a);
    if (!eng) return;
    CHECK(eng->w.has_mtp);
    CHECK(eng->w.layers[1].exp_gate[0].qtype == PT_Q4_G64 && eng->w.layers[0].q_a_proj.qtype == PT_Q8_G32);
    CHECK(eng->w.layers[1].router.qtype == PT_F32 && !eng->w.layers[1].has_indexer && eng->w.layers[2].has_indexer);
    CHECK(eng->w.mtp.exp_gate[0].qtype == PT_Q8_G32);
    int32_t ids[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 299};
    float *lg = run_logits(eng, ids, 12);
    int finite = lg != NULL;
    for (int i = 0; lg && i < 12 * 300; i++) finite &= isfinite(lg[i]) != 0;
    CHECK(finite);
    free(lg);
    petrel_engine_close(eng);
    /* the GLM-5.2 config text parses with the real schedule */
    char *cj = synth_glm52_config(3, 5);
    petrel_config c;
    CHECK(config_parse(cj, strlen(cj), "glm52", &c, &err) == 0);
    CHECK(c.hidden_size == 6144 && c.layer_indexer_full[2] && !c.layer_indexer_full[3] && c.layer_indexer_full[6] && c.layer_is_moe[3] && !c.layer_is_moe[2]);
    config_deinit(&c);
    free(cj);
}

/* ---- expert layout ---- */

TEST(pack, expert_layout_r16_vs_plain) {
    const char *a = tmp("tiny-r16.pack"), *b = tmp("tiny-plain.pack");
    if (convert_to("tiny", a, CVQ_Q4, 0, NULL)) return;
    convert_opts o = {0};
    o.quant = CVQ_Q4;
    o.expert_plain = 1;
    convert_result r;
    petrel_error err = {0};
    CHECK_MSG(convert_hf(test_data("tiny"), b, &o, &r, &err) == 0, "%s", err.msg);
    pack *p = NULL, *q = NULL;
    CHECK(pack_open(a, &p, &err) == 0 && pack_open(b, &q, &err) == 0);
    int n_r16 = 0, n_plain_b = 0;
    for (int i = 0; p && q && i < p->n_elayers; i++)
        for (int k = 0; k < 3; k++) {
            const pack_tensor *t = &p->elayers[i].part[k];
            n_r16 += t->layout == PT_LAYOUT_R16;
            CHECK(t->layout == (pack_r16_ok(t->qtype, t->rows, t->cols, t->scale_dtype) ? PT_LAYOUT_R16 : PT_LAYOUT_PLAIN));
            n_plain_b += q->elayers[i].part[k].layout == PT_LAYOUT_PLAIN;
        }
    CHECK(n_r16 > 0);                          /* the tiny shapes allow it for some parts */
    CHECK(q && n_plain_b == 3 * q->n_elayers);
    if (p) CHECK(pack_verify(p, &err) == 0);    /* checksums cover the laid-out bytes */
    pack_close(p);
    pack_close(q);
    /* the same weights either way: dequantized rows are equal, logits agree to f32 rounding */
    petrel_engine *ea = open_eng(a), *eb = open_eng(b);
    if (!ea || !eb) { petrel_engine_close(ea); petrel_engine_close(eb); return; }
    for (int l = 0; l < ea->cfg.num_hidden_layers; l++) {
        if (!ea->w.layers[l].is_moe) continue;
        const pt_wview *va = &ea->w.layers[l].exp_gate[3], *vb = &eb->w.layers[l].exp_gate[3];
        float ra[4096], rb[4096];
        for (int64_t row = 0; row < va->rows && va->cols <= 4096; row += 5) {
            pt_dequant_row(va, row, ra);
            pt_dequant_row(vb, row, rb);
            CHECK(!memcmp(ra, rb, sizeof(float) * (size_t)va->cols));
        }
    }
    int32_t ids[7] = {5, 17, 300, 42, 7, 999, 3};
    float *la = run_logits(ea, ids, 7), *lb = run_logits(eb, ids, 7);
    if (la && lb) {
        double rel = test_rel_l2(la, lb, 7 * (size_t)ea->cfg.vocab_size);
        CHECK_MSG(rel < 1e-4, "r16 vs plain experts: rel L2 %.3g", rel);
        if (getenv("PACK_VERBOSE")) fprintf(stderr, "  r16 vs plain experts: rel L2 %.3g\n", rel);
    }
    free(la);
    free(lb);
    petrel_engine_close(ea);
    petrel_engine_close(eb);
    /* a header naming an unknown layout is refused; a version-1 pack (no layouts) is read */
    size_t n;
    uint8_t *buf = test_read_file(a, &n);
    if (!buf) return;
    char msg[1024];
    uint8_t *c = malloc(n);
    memcpy(c, buf, n);
    CHECK(patch_header(c, "\"layout\":", "\"xyz\"") == 0);
    spit(tmp("bad-layout.pack"), c, n);
    CHECK_EQ_INT(open_code(tmp("bad-layout.pack"), msg, sizeof msg), PETREL_EFORMAT);
    CHECK_MSG(strstr(msg, "layout"), "message: %s", msg);
    free(c);
    free(buf);
    buf = test_read_file(b, &n);
    if (!buf) return;
    buf[8] = 1; /* prefix version */
    spit(tmp("v1.pack"), buf, n);
    CHECK_EQ_INT(open_code(tmp("v1.pack"), msg, sizeof msg), 0);
    free(buf);
}

TEST(pack, resident_copy) {
    const char *a = tmp("tiny-copy.pack");
    if (convert_to("tiny", a, CVQ_Q8, 0, NULL)) return;
    petrel_error err = {0};
    petrel_engine *e1 = NULL, *e2 = NULL;
    petrel_open_opts insp = {0};
    insp.inspect_only = 1;
    CHECK(petrel_engine_open(a, NULL, &e1, &err) == 0);
    CHECK(petrel_engine_open(a, &insp, &e2, &err) == 0);
    if (e1 && e2) {
        /* a normal open serves weights from the huge-page copy (experts too: they fit) ... */
        CHECK(e1->pack->copy && e1->pack->copy_experts);
        CHECK(e1->w.lm_head.data >= e1->pack->copy && e1->w.lm_head.data < e1->pack->copy + e1->pack->file_size);
        /* ... an inspection leaves them mapped in their stored layout */
        CHECK(!e2->pack->copy && e2->w.lm_head.layout == PT_LAYOUT_PLAIN);
        CHECK(e2->w.lm_head.data >= e2->pack->map && e2->w.lm_head.data < e2->pack->map + e2->pack->file_size);
    }
    petrel_engine_close(e1);
    petrel_engine_close(e2);
}

/* pack_read_ranges, O_DIRECT (what a resident open uses) and buffered: every byte of every
 * tensor lands at its file offset, ranges in any order, overlapping or touching; a resident open
 * gives the logits of an open served from the file map, and a flipped byte of a resident tensor
 * is refused (the checksums run over what the reads put in the copy). */
/* A q4 pack of the odd fixture at src, its bytes (*b, *n) and the pack open on it; 0 when the
 * test cannot go on (a failed check says why, or the fixture is absent). */
static int odd_pack_open(const char *src, uint8_t **b, size_t *n, pack **p) {
    petrel_error err = {0};
    *b = NULL, *p = NULL;
    if (convert_to("odd", src, CVQ_Q4, 0, NULL)) return 0;
    *b = test_read_file(src, n);
    CHECK(*b && pack_open(src, p, &err) == 0);
    if (*b && *p) return 1;
    free(*b);
    return 0;
}

TEST(pack, resident_read_ranges) {
    const char *src = tmp("odd-rd.pack");
    size_t n = 0;
    uint8_t *b;
    pack *p;
    petrel_error err = {0};
    if (!odd_pack_open(src, &b, &n, &p)) return;
    size_t cap = (n + 4095) / 4096 * 4096;
    uint8_t *dst = aligned_alloc(4096, cap);
    pack_range *rg = malloc(sizeof *rg * (size_t)(2 * p->n_tensors + 2));
    for (int direct = 0; direct < 2; direct++) {
        memset(dst, 0xA5, cap);
        int nr = 0;
        for (int i = p->n_tensors - 1; i >= 0; i--) { /* reverse order; scales apart */
            const pack_tensor *t = &p->tensors[i];
            rg[nr++] = (pack_range){t->offset, t->offset + t->bytes};
            if (t->scale_bytes) rg[nr++] = (pack_range){t->scale_offset, t->scale_offset + t->scale_bytes};
        }
        rg[nr++] = (pack_range){p->tensors[0].offset + 1, p->tensors[0].offset + 2}; /* inside another */
        CHECK(pack_read_ranges(p, dst, rg, nr, direct, NULL, NULL, &err) == 0);
        for (int i = 0; i < p->n_tensors; i++) {
            const pack_tensor *t = &p->tensors[i];
            CHECK_MSG(!memcmp(dst + t->offset, b + t->offset, (size_t)t->bytes) &&
                          !memcmp(dst + t->scale_offset, b + t->scale_offset, (size_t)t->scale_bytes),
                      "%s: tensor %s not read whole", direct ? "direct" : "buffered", t->name);
        }
    }
    const pack_tensor *t = pack_find(p, "lm_head.weight");
    CHECK(t != NULL);
    uint64_t flip_at = t ? t->offset + t->bytes / 2 : 0;
    pack_close(p);
    free(rg);
    free(dst);
    int32_t ids[5] = {3, 141, 59, 26, 53};
    petrel_open_opts mapped = {0};
    mapped.inspect_only = 1; /* weights served from the file map, no copy */
    petrel_engine *e0 = NULL, *e1 = open_eng(src);
    CHECK(petrel_engine_open(src, &mapped, &e0, &err) == 0);
    float *l0 = e0 ? run_logits(e0, ids, 5) : NULL, *l1 = e1 ? run_logits(e1, ids, 5) : NULL;
    CHECK(e1 && e1->pack->copy);
    CHECK(l0 && l1 && !memcmp(l0, l1, sizeof(float) * 5 * (size_t)e1->cfg.vocab_size));
    free(l0);
    free(l1);
    petrel_engine_close(e0);
    petrel_engine_close(e1);
    if (flip_at) {
        const char *bad = tmp("odd-rd-bad.pack");
        b[flip_at] ^= 0x10;
        spit(bad, b, n);
        petrel_engine *e = NULL;
        petrel_error e2 = {0};
        int rc = petrel_engine_open(bad, NULL, &e, &e2);
        CHECK_MSG(rc == PETREL_EFORMAT && strstr(e2.msg, "lm_head.weight") && strstr(e2.msg, "checksum"), "%d %s", rc, e2.msg);
        petrel_engine_close(e);
    }
    free(b);
}

/* The pack's file replaced under the same name after the open (a new download moved over it):
 * the O_DIRECT reads at open and the expert store's reopen must still read the file that was
 * opened, never the new one (pt_reopen: /proc/self/fd, else the path checked by inode). */
TEST(pack, reads_after_replace_stay_on_the_opened_file) {
    const char *src = tmp("odd-rp.pack"), *other = tmp("odd-rp.new");
    size_t n = 0;
    uint8_t *b;
    pack *p;
    petrel_error err = {0};
    if (!odd_pack_open(src, &b, &n, &p)) return;
    uint8_t *z = malloc(n);
    for (size_t i = 0; z && i < n; i++) z[i] = (uint8_t)(b[i] ^ 0x5A);
    if (z) spit(other, z, n);
    CHECK(z && rename(other, src) == 0);
    /* the helper itself: the opened file through its descriptor, the new one by path alone */
    int fd = pt_reopen(p->fd, src, O_RDONLY), fd2 = pt_reopen(-1, src, O_RDONLY);
    uint8_t h1[64] = {0}, h2[64] = {0};
    CHECK(fd >= 0 && fd2 >= 0 && pread(fd, h1, sizeof h1, 0) == (ssize_t)sizeof h1 && pread(fd2, h2, sizeof h2, 0) == (ssize_t)sizeof h2);
    CHECK(!memcmp(h1, b, sizeof h1) && !memcmp(h2, z, sizeof h2));
    if (fd >= 0) close(fd);
    if (fd2 >= 0) close(fd2);
    size_t cap = (n + 4095) / 4096 * 4096;
    uint8_t *dst = aligned_alloc(4096, cap);
    for (int direct = 0; direct < 2 && dst; direct++) {
        memset(dst, 0, cap);
        pack_range rg = {0, n};
        CHECK(pack_read_ranges(p, dst, &rg, 1, direct, NULL, NULL, &err) == 0);
        CHECK_MSG(!memcmp(dst, b, n), "%s read after the replace did not read the opened file", direct ? "direct" : "buffered");
    }
    pack_close(p);
    free(dst);
    free(z);
    free(b);
}

/* petrel_engine_note: a q4 pack (experts in the r16 layout) opened with a kernel set without
 * VNNI (--isa avx2 / scalar) says its experts run slowly; with the CPU's best set the note is
 * there exactly when that set has no VNNI; a Hugging Face folder never has one. */
TEST(pack, note_r16_without_vnni) {
    const char *pk = test_pack_of("tiny", CVQ_Q4);
    if (!pk) return;
    const char *isas[3] = {"avx2", "scalar", NULL};
    for (int i = 0; i < 3; i++) {
        petrel_open_opts o = {0};
        o.isa = isas[i];
        petrel_engine *e = NULL;
        petrel_error err = {0};
        if (petrel_engine_open(pk, &o, &e, &err)) { test_fail(__FILE__, __LINE__, "open %s: %s", isas[i] ? isas[i] : "auto", err.msg); continue; }
        CHECK(pack_has_r16(e->pack));
        const char *note = petrel_engine_note(e);
        CHECK_MSG((*note != 0) == !e->kt.vnni && strchr(note, '\n') == NULL, "isa %s (vnni %d): note \"%s\"", isas[i] ? isas[i] : "auto", e->kt.vnni, note);
        if (isas[i]) CHECK(strstr(note, "VNNI") != NULL);
        petrel_engine_close(e);
    }
    petrel_engine *h = NULL;
    petrel_error err = {0};
    petrel_open_opts o = {0};
    o.isa = "scalar";
    CHECK(petrel_engine_open(test_data("tiny"), &o, &h, &err) == 0);
    if (h) CHECK_MSG(*petrel_engine_note(h) == 0, "%s", petrel_engine_note(h));
    petrel_engine_close(h);
}

/* petrel_model_is_pack / petrel_model_has_file (what run and chat ask before loading a
 * tokenizer): a pack is known by its magic, not its name; has_file agrees with petrel_model_file
 * on a pack and a folder; an unopenable model is an error, not "absent". */
TEST(pack, model_side_file_queries) {
    const char *pk = test_pack_of("tiny", CVQ_BF16), *dir = test_data("tiny");
    if (!pk) return;
    char st[600], renamed[600];
    snprintf(st, sizeof st, "%s/model.safetensors", dir);
    snprintf(renamed, sizeof renamed, "%s/model-as.safetensors", test_tmpdir());
    CHECK(petrel_model_is_pack(pk) == 1);
    CHECK(petrel_model_is_pack(dir) == 0 && petrel_model_is_pack(st) == 0 && petrel_model_is_pack("/nonexistent") == 0);
    CHECK(link(pk, renamed) == 0 || symlink(pk, renamed) == 0);
    CHECK(petrel_model_is_pack(renamed) == 1);
    const char *names[3] = {"tokenizer.json", "chat_template.jinja", "no_such_file.json"};
    const char *models[3] = {pk, dir, st};
    for (int m = 0; m < 3; m++)
        for (int i = 0; i < 3; i++) {
            petrel_error err = {0};
            char *buf = NULL;
            int want = petrel_model_file(models[m], names[i], &buf, NULL, &err) == 0;
            free(buf);
            CHECK_MSG(petrel_model_has_file(models[m], names[i], &err) == want, "%s: %s", models[m], names[i]);
        }
    petrel_error err = {0};
    CHECK(petrel_model_has_file(pk, "tokenizer.json", &err) == 1);
    CHECK(petrel_model_has_file("/nonexistent/model", "tokenizer.json", &err) < 0 && strstr(err.msg, "/nonexistent/model"));
}
