/* test_lora.c: LoRA adapters as PEFT writes them (src/model/lora.h).
 *
 * Three real PEFT adapters (tests/data/lora-*, made by tests/gen/lora/make_adapter.py and
 * ../shared/fixtures/gen/make_lora_fixture.py with the reference logits of the adapted model in
 * float64): lora-trained (r 8 on the attention projections, f32), lora-mlp (r 4 with rank and
 * alpha patterns and rsLoRA on kv_a_proj_with_mqa, the indexer and the routed experts through
 * PEFT's parameter wrappers of the fused expert tensors, bf16), lora-tiny (r 16 on a bf16 base,
 * regex targets, f16). Checked: the adapted logits (prefill, decode, merged), the base logits
 * without an adapter, a q8 pack's KL, mixed batches bitwise equal to rows alone, streamed equal
 * to resident, the reconstructed twin, per-expert modules and the other targets against the
 * merged twin, the prefix cache and session files keyed by the adapter set, and bad adapters. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/convert.h"
#include "io/safetensors.h"
#include "model/engine.h"
#include "test.h"

static petrel_engine *open_lora(const char *model, const char *const *dirs, int n, int merge, int select, petrel_error *err) {
    petrel_lora_spec sp[8];
    for (int i = 0; i < n; i++) sp[i] = (petrel_lora_spec){dirs[i], NULL, 0};
    petrel_open_opts o = {.n_threads = 2, .lora = sp, .n_lora = n, .lora_merge = merge, .lora_select = select};
    petrel_engine *e = NULL;
    return petrel_engine_open(model, &o, &e, err) == 0 ? e : NULL;
}

/* Logits [T][V] of ids in one pass (chunk 0) or token by token (chunk 1); NULL on failure. */
static float *logits_of(petrel_engine *e, const int32_t *ids, int T, int decode) {
    int V = e->cfg.vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)T * V);
    petrel_session *s = NULL;
    petrel_error err = {0};
    int rc = lg ? petrel_session_create(e, T, &s, &err) : -1;
    for (int t = 0; !rc && t < T; t += decode ? 1 : T)
        rc = petrel_session_forward(s, ids + t, decode ? 1 : T, lg + (size_t)t * V, 1, &err);
    petrel_session_free(s);
    if (rc) {
        test_fail(__FILE__, __LINE__, "forward: %s", err.msg);
        free(lg);
        return NULL;
    }
    return lg;
}

/* The worst relative L2 over a fixture's prompts of the engine's logits against part. */
static double worst_vs_gold(petrel_engine *e, const char *fixture, const char *part, int decode) {
    char p[600];
    snprintf(p, sizeof p, "%s/golden.safetensors", test_data(fixture));
    st_set *g = NULL;
    petrel_error err = {0};
    if (st_open(p, &g, &err)) {
        test_fail(__FILE__, __LINE__, "%s", err.msg);
        return 1;
    }
    double worst = 0;
    int V = e->cfg.vocab_size, np = 0;
    for (int pi = 0;; pi++) {
        const st_tensor *ids = test_gold(g, pi, "ids"), *ref = test_gold(g, pi, part);
        if (!ids || !ref) break;
        int T = (int)ids->shape[0];
        CHECK_EQ_INT(ref->shape[1], V);
        float *lg = logits_of(e, (const int32_t *)ids->data, T, decode);
        if (!lg) break;
        double r = test_rel_l2(lg, (const float *)ref->data, (size_t)T * V);
        if (r > worst) worst = r;
        free(lg);
        np++;
    }
    CHECK(np >= 2);
    st_close(g);
    return worst;
}

TEST(lora, trained_adapter_prefill_decode_merged) {
    const char *d[] = {test_data("lora-trained")};
    petrel_error err = {0};
    petrel_engine *e = open_lora(test_data("trained"), d, 1, 0, 0, &err);
    CHECK_MSG(e, "%s", err.msg);
    if (!e) return;
    CHECK_EQ_INT(petrel_engine_lora_count(e), 1);
    double a = worst_vs_gold(e, "lora-trained", "logits", 0), b = worst_vs_gold(e, "lora-trained", "logits", 1);
    CHECK_MSG(a < 1e-5 && b < 1e-5, "adapted logits vs reference: prefill %.3g, decode %.3g", a, b);
    CHECK_MSG(worst_vs_gold(e, "lora-trained", "base_logits", 0) > 0.1, "the adapter changes nothing");
    petrel_engine_close(e);
    e = open_lora(test_data("trained"), d, 1, 1, 0, &err);
    CHECK_MSG(e, "%s", err.msg);
    if (!e) return;
    a = worst_vs_gold(e, "lora-trained", "logits", 0);
    CHECK_MSG(a < 1e-5, "merged: %.3g", a);
    petrel_engine_close(e);
    /* no adapter: the base logits as before */
    e = open_lora(test_data("trained"), d, 0, 0, 0, &err);
    CHECK_MSG(e, "%s", err.msg);
    if (!e) return;
    a = worst_vs_gold(e, "lora-trained", "base_logits", 0);
    CHECK_MSG(a < 1e-5, "base: %.3g", a);
    petrel_engine_close(e);
}

/* rank / alpha patterns, rsLoRA, the indexer, kv_a and the fused experts (parameter wrappers),
 * bf16 tensors; and the bf16 tiny base with f16 tensors and regex targets */
TEST(lora, held_out_adapters) {
    static const char *const fx[][2] = {{"trained", "lora-mlp"}, {"tiny", "lora-tiny"}};
    for (int k = 0; k < 2; k++) {
        const char *d[] = {test_data(fx[k][1])};
        for (int merge = 0; merge < 2; merge++) {
            petrel_error err = {0};
            petrel_engine *e = open_lora(test_data(fx[k][0]), d, 1, merge, 0, &err);
            CHECK_MSG(e, "%s: %s", fx[k][1], err.msg);
            if (!e) continue;
            double a = worst_vs_gold(e, fx[k][1], "logits", 0), b = merge ? 0 : worst_vs_gold(e, fx[k][1], "logits", 1);
            CHECK_MSG(a < 1e-5 && b < 1e-5, "%s merge %d: prefill %.3g decode %.3g", fx[k][1], merge, a, b);
            petrel_engine_close(e);
        }
    }
}

/* On a q8 pack of the base: the adapted logits' KL against the reference within 10 % of the q8
 * base's against its own. */
static double mean_kl(petrel_engine *e, const char *fixture, const char *part) {
    char p[600];
    snprintf(p, sizeof p, "%s/golden.safetensors", test_data(fixture));
    st_set *g = NULL;
    petrel_error err = {0};
    if (st_open(p, &g, &err)) return 1e9;
    double kl = 0;
    long npos = 0;
    int V = e->cfg.vocab_size;
    for (int pi = 0;; pi++) {
        const st_tensor *ids = test_gold(g, pi, "ids"), *ref = test_gold(g, pi, part);
        if (!ids || !ref) break;
        int T = (int)ids->shape[0];
        float *lg = logits_of(e, (const int32_t *)ids->data, T, 0);
        if (lg) kl += test_kl_rows((const float *)ref->data, lg, T, V), npos += T;
        free(lg);
    }
    st_close(g);
    return npos ? kl / npos : 1e9;
}

TEST(lora, q8_pack_kl) {
    const char *pk = test_pack_of("trained", CVQ_Q8);
    if (!pk) return;
    const char *d[] = {test_data("lora-trained")};
    petrel_error err = {0};
    petrel_engine *e = open_lora(pk, d, 1, 0, 0, &err);
    CHECK_MSG(e, "%s", err.msg);
    if (!e) return;
    double kl_a = mean_kl(e, "lora-trained", "logits");
    petrel_engine_close(e);
    e = open_lora(pk, d, 0, 0, 0, &err);
    if (!e) return;
    double kl_b = mean_kl(e, "lora-trained", "base_logits");
    petrel_engine_close(e);
    CHECK_MSG(kl_a <= 1.1 * kl_b && kl_b > 0, "q8 adapted KL %.3g vs q8 base %.3g", kl_a, kl_b);
    /* a q8 base cannot be merged */
    e = open_lora(pk, d, 1, 1, 0, &err);
    CHECK(!e && strstr(err.msg, "merg") && strstr(err.msg, "q8"));
    petrel_engine_close(e);
}

/* Sessions with no adapter, one, the other, both: their rows in one batch (prompt chunks and
 * decode rows) bitwise equal to each session run alone; streamed experts equal resident. */
static int run_mixed(petrel_engine *e, float *out_batch, float *out_alone, int steps) {
    enum { NS = 4 };
    static const int sets[NS][2] = {{-1, -1}, {0, -1}, {1, -1}, {0, 1}};
    static const int32_t prompt[NS][5] = {{5, 17, 99, 3, 250}, {1, 2, 3, 4, 5}, {7, 7, 8, 9, 10}, {300, 20, 1, 64, 90}};
    int V = e->cfg.vocab_size, rc = 0;
    petrel_error err = {0};
    petrel_session *s[NS] = {0}, *a[NS] = {0};
    petrel_batch *b = NULL;
    rc |= petrel_batch_create(e, 64, &b, &err);
    for (int i = 0; i < NS && !rc; i++) {
        int idx[2], n = 0;
        for (int k = 0; k < 2; k++)
            if (sets[i][k] >= 0) idx[n++] = sets[i][k];
        rc |= petrel_session_create(e, 64, &s[i], &err) | petrel_session_create(e, 64, &a[i], &err);
        if (!rc) rc |= petrel_session_set_lora(s[i], idx, NULL, n, &err) | petrel_session_set_lora(a[i], idx, NULL, n, &err);
    }
    /* prompts: every session's 5 rows in one batch; alone: each its own forward */
    petrel_row rows[64];
    int nr = 0;
    for (int i = 0; i < NS; i++)
        for (int t = 0; t < 5; t++) rows[nr++] = (petrel_row){s[i], prompt[i][t], t == 4};
    if (!rc) rc = petrel_batch_forward(b, rows, nr, out_batch, &err);
    for (int i = 0; i < NS && !rc; i++) rc = petrel_session_forward(a[i], prompt[i], 5, out_alone + (size_t)i * V, 0, &err);
    for (int st = 1; st <= steps && !rc; st++) { /* decode rows of every session in one batch */
        nr = 0;
        for (int i = 0; i < NS; i++) rows[nr++] = (petrel_row){s[i], (int32_t)((i * 31 + st * 7) % V), 1};
        rc = petrel_batch_forward(b, rows, nr, out_batch + (size_t)st * NS * V, &err);
        for (int i = 0; i < NS && !rc; i++) rc = petrel_session_forward(a[i], &rows[i].token, 1, out_alone + ((size_t)st * NS + i) * V, 0, &err);
    }
    if (rc) test_fail(__FILE__, __LINE__, "mixed batch: %s", err.msg);
    for (int i = 0; i < NS; i++) petrel_session_free(s[i]), petrel_session_free(a[i]);
    petrel_batch_free(b);
    return rc;
}

TEST(lora, mixed_batch_bitwise_and_streamed) {
    const char *pk = test_pack_of("trained", CVQ_Q8);
    if (!pk) return;
    const char *d[] = {test_data("lora-trained"), test_data("lora-mlp")};
    petrel_error err = {0};
    petrel_engine *e = open_lora(pk, d, 2, 0, 1, &err);
    CHECK_MSG(e, "%s", err.msg);
    if (!e) return;
    int V = e->cfg.vocab_size, steps = 3;
    size_t n = (size_t)(steps + 1) * 4 * V;
    float *bt = calloc(n, sizeof(float)), *al = calloc(n, sizeof(float)), *bt2 = calloc(n, sizeof(float)), *al2 = calloc(n, sizeof(float));
    if (!run_mixed(e, bt, al, steps)) {
        CHECK_MSG(!memcmp(bt, al, n * sizeof(float)), "a row's logits depend on its batch");
        for (int i = 1; i < 4; i++) /* the sets differ from each other */
            CHECK(memcmp(al, al + (size_t)i * V, sizeof(float) * (size_t)V));
    }
    petrel_engine_close(e);
    /* the same with routed experts streamed from the pack (two slots per layer) */
    petrel_lora_spec sp[2] = {{d[0], "a", 0}, {d[1], "b", 0}};
    petrel_open_opts o = {.n_threads = 2, .lora = sp, .n_lora = 2, .lora_select = 1, .expert_slots = 2};
    e = NULL;
    CHECK_MSG(petrel_engine_open(pk, &o, &e, &err) == 0, "%s", err.msg);
    if (e) {
        CHECK(e->xs != NULL);
        CHECK(!strcmp(petrel_engine_lora_name(e, 1), "b"));
        if (!run_mixed(e, bt2, al2, steps)) CHECK_MSG(!memcmp(bt2, bt, n * sizeof(float)), "streamed experts differ from resident with adapters");
        petrel_engine_close(e);
    }
    free(bt), free(al), free(bt2), free(al2);
}

/* The reconstructed attention twin with the kv_b_proj delta agrees with the absorbed form. */
TEST(lora, reconstructed_twin) {
    const char *d[] = {test_data("lora-trained")};
    petrel_error err = {0};
    petrel_engine *e = open_lora(test_data("trained"), d, 1, 0, 0, &err);
    if (!e) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    int V = e->cfg.vocab_size, T = 12;
    int32_t ids[12] = {5, 100, 7, 9, 300, 2, 44, 19, 1000, 3, 8, 12};
    float *a = logits_of(e, ids, T, 0), *b = malloc(sizeof(float) * (size_t)T * V);
    petrel_session *s = NULL;
    if (a && b && !petrel_session_create(e, T, &s, &err)) {
        s->mla = MLA_RECONSTRUCTED;
        CHECK(!petrel_session_forward(s, ids, T, b, 1, &err));
        double r = test_rel_l2(b, a, (size_t)T * V);
        CHECK_MSG(r < 1e-5, "reconstructed vs absorbed with the adapter: %.3g", r);
    }
    petrel_session_free(s);
    free(a), free(b);
    petrel_engine_close(e);
}

/* A synthetic adapter over the targets the PEFT fixtures leave out (dense MLP, shared experts,
 * per-expert modules, lm_head, q_b_proj at an odd rank), against its merged twin. */
static uint64_t rs_ = 0x2545f4914f6cdd1dull;
static float frand(void) {
    rs_ ^= rs_ << 13, rs_ ^= rs_ >> 7, rs_ ^= rs_ << 17;
    return (float)((double)(rs_ >> 11) / 9007199254740992.0 - 0.5);
}
static int write_adapter(const char *dir, const petrel_config *c, const char *cfg_json, int bad) {
    mkdir(dir, 0755);
    char p[700];
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    FILE *f = fopen(p, "w");
    if (!f) return -1;
    fputs(cfg_json, f);
    fclose(f);
    int H = c->hidden_size, I = c->intermediate_size, Im = c->moe_intermediate_size * c->n_shared_experts, Ie = c->moe_intermediate_size;
    struct { const char *mod; int out, in, r; } m[] = {
        {"model.layers.0.mlp.gate_proj", I, H, 3}, {"model.layers.0.mlp.down_proj", H, I, 3}, {"model.layers.1.mlp.shared_experts.up_proj", Im, H, 3},
        {"model.layers.1.mlp.shared_experts.down_proj", H, Im, 3}, {"model.layers.1.mlp.experts.0.gate_proj", Ie, H, 3},
        {"model.layers.1.mlp.experts.5.down_proj", H, Ie, 3}, {"model.layers.2.mlp.experts.3.up_proj", Ie, H, 3},
        {"model.layers.2.self_attn.q_b_proj", c->num_attention_heads * c->qk_head_dim, c->q_lora_rank, 3}, {"lm_head", c->vocab_size, H, 3}};
    int nm = (int)(sizeof m / sizeof m[0]);
    st_write_tensor ts[64];
    float *bufs[64];
    char names[64][160];
    int nt = 0;
    for (int i = 0; i < nm; i++) {
        int r = m[i].r, bc = bad == 1 && i == 2 ? r + 1 : r; /* bad 1: lora_B's columns disagree */
        int in = bad == 2 && i == 0 ? m[i].in + 1 : m[i].in;  /* bad 2: another model's shape */
        for (int ab = 0; ab < 2; ab++) {
            size_t n = ab ? (size_t)m[i].out * bc : (size_t)r * in;
            float *v = malloc(sizeof(float) * n);
            for (size_t k = 0; k < n; k++) v[k] = (ab ? 0.2f : 0.5f) * frand();
            snprintf(names[nt], sizeof names[nt], "base_model.model.%s.lora_%c.weight", bad == 3 && i == 1 ? "model.layers.0.self_attn.q_proj" : m[i].mod,
                     ab ? 'B' : 'A');
            ts[nt] = (st_write_tensor){names[nt], ST_F32, 2, {ab ? m[i].out : r, ab ? bc : in}, v};
            bufs[nt++] = v;
        }
    }
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", dir);
    petrel_error err = {0};
    int rc = st_write(p, ts, nt, &err);
    for (int i = 0; i < nt; i++) free(bufs[i]);
    return rc;
}

#define CFG_OK "{\"peft_type\": \"LORA\", \"r\": 3, \"lora_alpha\": 6, \"target_modules\": [\"gate_proj\", \"up_proj\", \"down_proj\", \"q_b_proj\", \"lm_head\"]}"

TEST(lora, other_targets_vs_merged) {
    petrel_engine *base = NULL;
    petrel_error err = {0};
    petrel_open_opts o0 = {.n_threads = 2};
    if (petrel_engine_open(test_data("tiny"), &o0, &base, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    const char *dir = test_tmp("lora-syn");
    CHECK(!write_adapter(dir, &base->cfg, CFG_OK, 0));
    int V = base->cfg.vocab_size, T = 10;
    int32_t ids[10] = {5, 17, 99, 3, 250, 8, 1, 2, 3, 700};
    float *b0 = logits_of(base, ids, T, 0);
    petrel_engine_close(base);
    const char *d[] = {dir};
    petrel_engine *u = open_lora(test_data("tiny"), d, 1, 0, 0, &err), *m = open_lora(test_data("tiny"), d, 1, 1, 0, &err);
    CHECK_MSG(u && m, "%s", err.msg);
    if (u && m && b0) {
        float *a = logits_of(u, ids, T, 0), *c = logits_of(m, ids, T, 1);
        if (a && c) {
            double r = test_rel_l2(a, c, (size_t)T * V), moved = test_rel_l2(a, b0, (size_t)T * V);
            CHECK_MSG(r < 1e-5, "unmerged vs merged: %.3g", r);
            CHECK_MSG(moved > 1e-3, "the adapter moves the logits by only %.3g", moved);
        }
        free(a), free(c);
    }
    free(b0);
    petrel_engine_close(u);
    petrel_engine_close(m);
}

/* Bad adapters: one clear line, the open fails, nothing loaded. */
TEST(lora, bad_adapters) {
    petrel_engine *base = NULL;
    petrel_error err = {0};
    petrel_open_opts o0 = {.n_threads = 1};
    if (petrel_engine_open(test_data("tiny"), &o0, &base, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    struct { const char *name, *cfg; int bad; const char *want; } cs[] = {
        {"rank", CFG_OK, 1, "rank mismatch"},
        {"shape", CFG_OK, 2, "another model"},
        {"module", CFG_OK, 3, "not a linear of this model"},
        {"target", "{\"peft_type\": \"LORA\", \"r\": 3, \"target_modules\": [\"q_proj\"]}", 0, "q_proj"},
        {"arch", "{\"peft_type\": \"LORA\", \"r\": 3, \"auto_mapping\": {\"base_model_class\": \"LlamaForCausalLM\"}}", 0, "LlamaForCausalLM"},
        {"dora", "{\"peft_type\": \"LORA\", \"r\": 3, \"use_dora\": true}", 0, "use_dora"},
        {"ia3", "{\"peft_type\": \"IA3\"}", 0, "IA3"},
        {"r", "{\"peft_type\": \"LORA\", \"r\": 5}", 0, "r = 5"},
        {"json", "{\"peft_type\": ", 0, "JSON"},
    };
    for (size_t k = 0; k < sizeof cs / sizeof cs[0]; k++) {
        char nm[64];
        snprintf(nm, sizeof nm, "lora-bad-%s", cs[k].name);
        const char *dir = test_tmp(nm);
        CHECK(!write_adapter(dir, &base->cfg, cs[k].cfg, cs[k].bad));
        const char *d[] = {dir};
        petrel_error e2 = {0};
        petrel_engine *e = open_lora(test_data("tiny"), d, 1, 0, 0, &e2);
        CHECK_MSG(!e && strstr(e2.msg, cs[k].want) && !strchr(e2.msg, '\n'), "%s: %s", cs[k].name, e2.msg);
        petrel_engine_close(e);
    }
    /* a truncated safetensors file, and a folder without one */
    const char *dir = test_tmp("lora-trunc");
    CHECK(!write_adapter(dir, &base->cfg, CFG_OK, 0));
    char p[700];
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", dir);
    struct stat st;
    if (!stat(p, &st)) CHECK(!truncate(p, st.st_size - 100));
    const char *d[] = {dir};
    petrel_engine *e = open_lora(test_data("tiny"), d, 1, 0, 0, &err);
    CHECK_MSG(!e && strstr(err.msg, "adapter_model.safetensors"), "truncated: %s", err.msg);
    petrel_engine_close(e);
    unlink(p);
    e = open_lora(test_data("tiny"), d, 1, 0, 0, &err);
    CHECK_MSG(!e && strstr(err.msg, "no adapter_model.safetensors"), "missing: %s", err.msg);
    petrel_engine_close(e);
    const char *none[] = {test_tmp("no-such-adapter")};
    e = open_lora(test_data("tiny"), none, 1, 0, 0, &err);
    CHECK_MSG(!e && strstr(err.msg, "adapter_config.json"), "no folder: %s", err.msg);
    petrel_engine_close(e);
    petrel_engine_close(base);
}

/* The prefix cache and session files keep adapter sets apart; sets are chosen before the first
 * token, never on a merged engine. */
TEST(lora, sets_prefix_and_session_files) {
    const char *d[] = {test_data("lora-trained")};
    petrel_error err = {0};
    petrel_engine *e = open_lora(test_data("trained"), d, 1, 0, 1, &err);
    if (!e) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    int32_t ids[140];
    for (int i = 0; i < 140; i++) ids[i] = (i * 37 + 11) % e->cfg.vocab_size;
    petrel_session *a = NULL, *b = NULL, *c = NULL;
    int zero = 0;
    CHECK(!petrel_session_create(e, 200, &a, &err) && !petrel_session_create(e, 200, &b, &err) && !petrel_session_create(e, 200, &c, &err));
    if (a && b && c) {
        CHECK(!petrel_session_set_lora(a, &zero, NULL, 1, &err));
        CHECK(!petrel_session_forward(a, ids, 140, NULL, 0, &err));
        CHECK(petrel_session_set_lora(a, NULL, NULL, 0, &err) < 0 && strstr(err.msg, "before its first token"));
        CHECK(petrel_session_prefix_put(a, &err) >= 2);
        CHECK_EQ_INT(petrel_session_prefix_get(b, ids, 139, &err), 0); /* b: the base model */
        CHECK(!petrel_session_set_lora(c, &zero, NULL, 1, &err));
        CHECK(petrel_session_prefix_get(c, ids, 139, &err) >= 128); /* c: the same adapter */
        int two = 2;
        CHECK(petrel_session_set_lora(b, &two, NULL, 1, &err) < 0);
        const char *f = test_tmp("lora.session");
        CHECK(!petrel_session_save(a, f, &err));
        petrel_session *d2 = NULL;
        CHECK(!petrel_session_create(e, 200, &d2, &err));
        CHECK(d2 && petrel_session_load(d2, f, &err) < 0); /* made under another set */
        CHECK(d2 && !petrel_session_set_lora(d2, &zero, NULL, 1, &err) && !petrel_session_load(d2, f, &err) && petrel_session_len(d2) == 140);
        petrel_session_free(d2);
    }
    petrel_session_free(a), petrel_session_free(b), petrel_session_free(c);
    petrel_engine_close(e);
    e = open_lora(test_data("trained"), d, 1, 1, 0, &err);
    CHECK_MSG(e, "%s", err.msg);
    if (e && !petrel_session_create(e, 16, &a, &err)) {
        CHECK(petrel_session_set_lora(a, &zero, NULL, 1, &err) < 0 && strstr(err.msg, "merged"));
        petrel_session_free(a);
    }
    petrel_engine_close(e);
}

/* The CLI: --lora DIR[=SCALE] on a command that loads a model, and its bad input. */
TEST(lora, cli) {
    const char *bin = getenv("PETREL_BIN");
    if (!bin) { test_skip("PETREL_BIN not set"); return; }
    char cmd[2048], out[4096], er[4096];
    const char *o1 = test_tmp("lora-cli-1.bin"), *o2 = test_tmp("lora-cli-2.bin"), *o0 = test_tmp("lora-cli-0.bin");
    snprintf(cmd, sizeof cmd, "%s logits --model %s --ids 1,2,3,4 --out %s && %s logits --model %s --ids 1,2,3,4 --out %s --lora %s && "
                              "%s logits --model %s --ids 1,2,3,4 --out %s --lora %s=0.5 --lora-merge",
             bin, test_data("trained"), o0, bin, test_data("trained"), o1, test_data("lora-trained"), bin, test_data("trained"), o2,
             test_data("lora-trained"));
    CHECK_MSG(test_sh(cmd, out, sizeof out, er, sizeof er) == 0, "%s", er);
    FILE *f0 = fopen(o0, "rb"), *f1 = fopen(o1, "rb"), *f2 = fopen(o2, "rb");
    float x0[64], x1[64], x2[64];
    if (f0 && f1 && f2 && fread(x0, 4, 64, f0) == 64 && fread(x1, 4, 64, f1) == 64 && fread(x2, 4, 64, f2) == 64) {
        double d1 = test_rel_l2(x1, x0, 64), d2 = test_rel_l2(x2, x0, 64); /* half the scale moves the logits less */
        CHECK_MSG(d1 > 1e-2 && d2 > 1e-3 && d2 < d1, "base to adapter %.3g, to half of it %.3g", d1, d2);
    } else CHECK(!"logits files");
    if (f0) fclose(f0);
    if (f1) fclose(f1);
    if (f2) fclose(f2);
    static const char *const bad[] = {"--lora", "--lora /nonexistent/adapter", "--lora-merge", "--lora DIR=0"};
    for (int k = 0; k < 4; k++) {
        char arg[700];
        snprintf(arg, sizeof arg, "%s", bad[k]);
        if (k == 3) snprintf(arg, sizeof arg, "--lora %s=0", test_data("lora-trained"));
        snprintf(cmd, sizeof cmd, "%s logits --model %s --ids 1,2 --out %s %s", bin, test_data("trained"), test_tmp("lora-cli-x.bin"), arg);
        int rc = test_sh(cmd, out, sizeof out, er, sizeof er);
        CHECK_MSG(rc == 1 && test_count_lines(er) == 1, "%s: rc %d: %s", bad[k], rc, er);
    }
}

/* Other base formats: FP8 (block scales) unmerged equals the adapter merged into the exact f32
 * conversion of the same weights. A q4 pack's adapted KL (measured 0.047 against its base's 0.038:
 * int4 errors weigh more on the adapted model; the issue's +10 % bound is q8's, tested above)
 * stays within 1.5x. */
TEST(lora, fp8_and_q4_bases) {
    const char *f32pk = test_pack_of("tiny-fp8", CVQ_F32), *q4pk = test_pack_of("trained", CVQ_Q4);
    if (!f32pk || !q4pk) return;
    const char *d[] = {test_data("lora-tiny")};
    petrel_error err = {0};
    petrel_lora_spec sp = {d[0], NULL, 0};
    petrel_engine *a = NULL, *b = NULL;
    if (petrel_engine_open(test_data("tiny-fp8"), &(petrel_open_opts){.n_threads = 2, .lora = &sp, .n_lora = 1}, &a, &err) ||
        petrel_engine_open(f32pk, &(petrel_open_opts){.n_threads = 2, .lora = &sp, .n_lora = 1, .lora_merge = 1}, &b, &err)) {
        test_fail(__FILE__, __LINE__, "%s", err.msg);
    } else {
        int32_t ids[9] = {9, 8, 7, 6, 5, 4, 3, 2, 1};
        float *la = logits_of(a, ids, 9, 0), *lb = logits_of(b, ids, 9, 1);
        if (la && lb) {
            double r = test_rel_l2(la, lb, (size_t)9 * a->cfg.vocab_size);
            CHECK_MSG(r < 1e-5, "FP8 + adapter vs merged f32 twin: %.3g", r);
        }
        free(la), free(lb);
    }
    petrel_engine_close(a);
    petrel_engine_close(b);
    const char *t[] = {test_data("lora-trained")};
    a = open_lora(q4pk, t, 1, 0, 0, &err);
    b = open_lora(q4pk, t, 0, 0, 0, &err);
    CHECK_MSG(a && b, "%s", err.msg);
    if (a && b) {
        double ka = mean_kl(a, "lora-trained", "logits"), kb = mean_kl(b, "lora-trained", "base_logits");
        CHECK_MSG(ka <= 1.5 * kb && kb > 0, "q4 adapted KL %.3g vs q4 base %.3g", ka, kb);
    }
    petrel_engine_close(a);
    petrel_engine_close(b);
}
