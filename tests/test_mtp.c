/* test_mtp.c: the MTP (NextN) head through the same attention and MoE code as the main layers
 * (fwd_mtp, layer index num_hidden_layers, dense attention over its own cache), against the
 * reference's prompt_N.mtp_logits: row i is fed the main model's final-normed hidden state at
 * position i and the embedding of token i+1, at position i. Also row independence: the rows
 * fed one at a time give the same bits as one pass. */
#include <stdlib.h>
#include <string.h>

#include "io/safetensors.h"
#include "experts/xs.h"
#include "model/engine.h"
#include "test.h"

static void check_mtp(const char *name) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(test_data(name), NULL, &e, &err)) { test_fail(__FILE__, __LINE__, "open %s: %s", name, err.msg); return; }
    CHECK_MSG(e->w.has_mtp, "%s has no MTP layer", name);
    char p[600];
    snprintf(p, sizeof p, "%s/golden.safetensors", test_data(name));
    st_set *g;
    if (st_open(p, &g, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); petrel_engine_close(e); return; }
    const petrel_config *c = &e->cfg;
    int V = c->vocab_size, H = c->hidden_size, L = c->num_hidden_layers, checked = 0;
    for (int pi = 0;; pi++) {
        const st_tensor *ids = test_gold(g, pi, "ids"), *ref = test_gold(g, pi, "mtp_logits");
        if (!ids) break;
        int T = (int)ids->shape[0];
        if (!ref || T < 2) continue;
        const int32_t *id = (const int32_t *)ids->data;
        /* the main model's final-normed hidden states (trace capture) */
        fwd_trace tr = {0};
        tr.hidden = malloc(sizeof(float) * (size_t)(L + 1) * T * H);
        petrel_session *s, *s1;
        CHECK(petrel_session_create(e, T, &s, &err) == 0);
        CHECK(petrel_session_create(e, T, &s1, &err) == 0);
        s->trace = &tr;
        CHECK(petrel_session_forward(s, id, T, NULL, 0, &err) == 0);
        s->trace = NULL;
        const float *hid = tr.hidden + (size_t)L * T * H;
        int n = T - 1;
        float *lg = malloc(sizeof(float) * (size_t)n * V), *lg1 = malloc(sizeof(float) * (size_t)n * V);
        fwd_seg one = {s, 0, n};
        int rc = fwd_mtp(s, &one, 1, id + 1, hid, n, lg, &err);
        CHECK_MSG(rc == 0, "%s prompt %d: fwd_mtp: %s", name, pi, err.msg);
        if (rc == 0) {
            double d = test_rel_l2(lg, (const float *)ref->data, (size_t)n * V);
            CHECK_MSG(d < 1e-4, "%s prompt %d: MTP logits rel L2 error %.3g", name, pi, d);
            if (getenv("PETREL_TEST_VERBOSE")) fprintf(stderr, "  %s prompt %d MTP rows %d rel err %.3g\n", name, pi, n, d);
            CHECK_EQ_INT(s->mtp_len, n);
            checked++;
        }
        /* the same rows one at a time (a decode step's MTP row): bitwise equal */
        int ok = 1;
        for (int r = 0; r < n && ok; r++) {
            fwd_seg o1 = {s1, 0, 1};
            ok = fwd_mtp(s1, &o1, 1, id + 1 + r, hid + (size_t)r * H, 1, lg1 + (size_t)r * V, &err) == 0;
        }
        CHECK(ok);
        if (ok && rc == 0) CHECK_MSG(!memcmp(lg, lg1, sizeof(float) * (size_t)n * V), "%s prompt %d: MTP rows one at a time differ from one pass", name, pi);
        /* the public form (petrel_session_mtp_logits, what `petrel logits --mtp` runs): the same bits */
        petrel_session *s2;
        CHECK(petrel_session_create(e, T, &s2, &err) == 0);
        float *lg2 = malloc(sizeof(float) * (size_t)n * V);
        CHECK_MSG(petrel_session_mtp_logits(s2, id, T, lg2, &err) == 0, "%s", err.msg);
        if (rc == 0) CHECK_MSG(!memcmp(lg, lg2, sizeof(float) * (size_t)n * V), "%s prompt %d: petrel_session_mtp_logits differs from fwd_mtp", name, pi);
        CHECK_EQ_INT(petrel_session_len(s2), T);
        CHECK(petrel_session_mtp_logits(s2, id, T, lg2, &err) == PETREL_EINVAL && strstr(err.msg, "empty session")); /* holds T tokens now */
        CHECK(petrel_session_truncate(s2, 0, &err) == 0);
        CHECK(petrel_session_mtp_logits(s2, id, 1, lg2, &err) == PETREL_EINVAL && strstr(err.msg, "at least 2"));
        free(lg2);
        petrel_session_free(s2);
        /* truncation rolls the MTP cache back with the main one */
        CHECK(petrel_session_truncate(s, 1, &err) == 0);
        CHECK_EQ_INT(s->mtp_len, 1);
        free(lg);
        free(lg1);
        free(tr.hidden);
        petrel_session_free(s);
        petrel_session_free(s1);
    }
    CHECK(checked > 0);
    st_close(g);
    petrel_engine_close(e);
}

TEST(mtp, tiny_golden) { check_mtp("tiny"); }
TEST(mtp, fp8_golden) { check_mtp("tiny-fp8"); }
TEST(mtp, odd2_golden) { check_mtp("odd2"); }
TEST(mtp, trained_golden) { check_mtp("trained"); }

TEST(mtp, absent_refused) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(test_data("odd"), NULL, &e, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    petrel_session *s;
    CHECK(petrel_session_create(e, 4, &s, &err) == 0);
    float h[256] = {0};
    int32_t t = 1;
    fwd_seg one = {s, 0, 1};
    CHECK(e->cfg.hidden_size <= 256);
    CHECK(fwd_mtp(s, &one, 1, &t, h, 1, NULL, &err) == PETREL_EUNSUPPORTED);
    int32_t two[2] = {1, 2};
    float lg[2048];
    CHECK(e->cfg.vocab_size <= 2048);
    CHECK(!petrel_engine_has_mtp(e));
    CHECK(petrel_session_mtp_logits(s, two, 2, lg, &err) == PETREL_EUNSUPPORTED && strstr(err.msg, "no MTP"));
    petrel_session_free(s);
    petrel_engine_close(e);
}

/* The trained MTP head drafts the main model's next greedy choice: on prompt 0 (unseen text)
 * the fixture's README reports ~57 % agreement; a broken head would agree with nothing. */
TEST(mtp, trained_drafts_agree) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(test_data("trained"), NULL, &e, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    char p[600];
    snprintf(p, sizeof p, "%s/golden.safetensors", test_data("trained"));
    st_set *g;
    if (st_open(p, &g, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); petrel_engine_close(e); return; }
    const st_tensor *ids = test_gold(g, 0, "ids");
    int T = (int)ids->shape[0], V = e->cfg.vocab_size, H = e->cfg.hidden_size, L = e->cfg.num_hidden_layers;
    const int32_t *id = (const int32_t *)ids->data;
    fwd_trace tr = {0};
    tr.hidden = malloc(sizeof(float) * (size_t)(L + 1) * T * H);
    float *main_lg = malloc(sizeof(float) * (size_t)T * V), *mtp_lg = malloc(sizeof(float) * (size_t)T * V);
    petrel_session *s;
    CHECK(petrel_session_create(e, T, &s, &err) == 0);
    s->trace = &tr;
    CHECK(petrel_session_forward(s, id, T, main_lg, 1, &err) == 0);
    s->trace = NULL;
    fwd_seg one = {s, 0, T - 1};
    CHECK(fwd_mtp(s, &one, 1, id + 1, tr.hidden + (size_t)L * T * H, T - 1, mtp_lg, &err) == 0);
    int agree = 0, n = T - 2;
    for (int i = 0; i < n; i++) { /* MTP row i and the main model at position i + 1 both predict token i + 2 */
        const float *a = mtp_lg + (size_t)i * V, *b = main_lg + (size_t)(i + 1) * V;
        int ba = 0, bb = 0;
        for (int v = 1; v < V; v++) {
            if (a[v] > a[ba]) ba = v;
            if (b[v] > b[bb]) bb = v;
        }
        agree += ba == bb;
    }
    double rate = (double)agree / n;
    if (getenv("PETREL_TEST_VERBOSE")) fprintf(stderr, "  MTP draft agrees with greedy on %.1f %% of %d positions\n", 100 * rate, n);
    CHECK_MSG(rate > 0.45 && rate < 0.75, "MTP drafts agree with the main model's greedy choice on %.1f %% of positions (~57 %% expected)", 100 * rate);
    free(tr.hidden);
    free(main_lg);
    free(mtp_lg);
    petrel_session_free(s);
    st_close(g);
    petrel_engine_close(e);
}

/* The MTP layer's routed experts stream through the expert store like the other layers': with
 * two slots per layer its logits equal the resident pack's bitwise, and its experts are read
 * through the store (store layer n_moe). */
TEST(mtp, streamed_experts) {
    const char *pk = test_pack_of("tiny", 0);
    if (!pk) return;
    petrel_error err = {0};
    petrel_engine *er = NULL, *es = NULL;
    petrel_open_opts o = {0};
    o.expert_slots = 2;
    if (petrel_engine_open(pk, NULL, &er, &err) || petrel_engine_open(pk, &o, &es, &err)) {
        test_fail(__FILE__, __LINE__, "%s", err.msg);
        petrel_engine_close(er);
        return;
    }
    const petrel_config *c = &er->cfg;
    int L = c->num_hidden_layers, H = c->hidden_size, V = c->vocab_size, T = 6;
    CHECK(es->xs != NULL);
    CHECK_EQ_INT(es->moe_index[L], es->n_moe);
    CHECK_EQ_INT(xs_store_layers(es->xs), es->n_moe + 1);
    int32_t id[7] = {3, 17, 5, 29, 11, 2, 41};
    float *lg[2], *hid[2];
    for (int k = 0; k < 2; k++) {
        petrel_engine *e = k ? es : er;
        fwd_trace tr = {0};
        tr.hidden = malloc(sizeof(float) * (size_t)(L + 1) * T * H);
        lg[k] = malloc(sizeof(float) * (size_t)T * V);
        petrel_session *s = NULL;
        CHECK(petrel_session_create(e, 16, &s, &err) == 0);
        s->trace = &tr;
        CHECK(petrel_session_forward(s, id, T, NULL, 0, &err) == 0);
        s->trace = NULL;
        hid[k] = tr.hidden;
        xs_stats a = {0}, b = {0};
        if (e->xs) xs_store_stats(e->xs, &a);
        fwd_seg one = {s, 0, T};
        CHECK_MSG(fwd_mtp(s, &one, 1, id + 1, tr.hidden + (size_t)L * T * H, T, lg[k], &err) == 0, "%s", err.msg);
        if (e->xs) {
            xs_store_stats(e->xs, &b);
            CHECK_MSG(b.accesses > a.accesses, "the MTP layer's experts did not go through the store");
        }
        petrel_session_free(s);
    }
    CHECK(!memcmp(hid[0], hid[1], sizeof(float) * (size_t)(L + 1) * T * H));
    CHECK_MSG(!memcmp(lg[0], lg[1], sizeof(float) * (size_t)T * V), "streamed MTP logits differ from resident");
    for (int k = 0; k < 2; k++) {
        free(lg[k]);
        free(hid[k]);
    }
    petrel_engine_close(er);
    petrel_engine_close(es);
}
