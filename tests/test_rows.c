/* test_rows.c: row independence, bitwise. A row's logits must not depend on how its session's
 * rows are fed: one pass, token by token (decode), or any chunking, give the same bits. This is
 * what lets verify windows, batching and speculative decoding promise identical outputs
 * (ENGINE.md principle 2). Run over the golden fixtures' prompts (DSA selecting: the prompts are
 * longer than index_topk), f32/bf16/FP8 checkpoints and q8/q4 packs (int8 activations), and on
 * the trained fixture where the indexer's cut falls inside ties. */
#include <stdlib.h>
#include <string.h>

#include "io/convert.h"
#include "io/safetensors.h"
#include "model/engine.h"
#include "test.h"

static uint64_t rs = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (uint32_t)(rs >> 11);
}

/* Logits [T][V] of ids fed in chunks of the given sizes (sum T); NULL on failure. */
static float *run_chunks(petrel_engine *e, const int32_t *ids, int T, const int *chunks, int nc, mla_mode mla) {
    int V = e->cfg.vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)T * V);
    petrel_session *s;
    petrel_error err = {0};
    if (petrel_session_create(e, T, &s, &err)) {
        test_fail(__FILE__, __LINE__, "session: %s", err.msg);
        free(lg);
        return NULL;
    }
    s->mla = mla;
    int done = 0;
    for (int i = 0; i < nc && done < T; i++) {
        int n = chunks[i] < T - done ? chunks[i] : T - done;
        if (petrel_session_forward(s, ids + done, n, lg + (size_t)done * V, 1, &err)) {
            test_fail(__FILE__, __LINE__, "forward: %s", err.msg);
            break;
        }
        done += n;
    }
    petrel_session_free(s);
    if (done != T) {
        free(lg);
        return NULL;
    }
    return lg;
}

/* First differing row of two [T][V] blocks, or -1. */
static int first_diff(const float *a, const float *b, int T, int V) {
    for (int t = 0; t < T; t++)
        if (memcmp(a + (size_t)t * V, b + (size_t)t * V, sizeof(float) * (size_t)V)) return t;
    return -1;
}

static void check_engine(const char *what, petrel_engine *e, const char *gold_dir, int trials) {
    char p[600];
    snprintf(p, sizeof p, "%s/golden.safetensors", test_data(gold_dir));
    st_set *g;
    petrel_error err = {0};
    if (st_open(p, &g, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    int V = e->cfg.vocab_size, checked = 0;
    for (int pi = 0;; pi++) {
        const st_tensor *t = test_gold(g, pi, "ids");
        if (!t) break;
        int T = (int)t->shape[0];
        const int32_t *ids = (const int32_t *)t->data;
        int whole = T;
        float *a = run_chunks(e, ids, T, &whole, 1, MLA_AUTO);
        int *ones = malloc(sizeof(int) * (size_t)T);
        for (int i = 0; i < T; i++) ones[i] = 1;
        float *b = run_chunks(e, ids, T, ones, T, MLA_AUTO);
        if (a && b) {
            int d = first_diff(a, b, T, V);
            CHECK_MSG(d < 0, "%s prompt %d (T=%d): one pass and token-by-token differ first at row %d", what, pi, T, d);
        }
        for (int k = 0; k < trials && a; k++) { /* random chunkings */
            int nc = 0, *ch = ones;
            for (int done = 0; done < T; nc++) {
                int n = 1 + (int)(rnd() % (uint32_t)(T < 40 ? T : 40));
                ch[nc] = n;
                done += n;
            }
            float *c = run_chunks(e, ids, T, ch, nc, MLA_AUTO);
            if (c) {
                int d = first_diff(a, c, T, V);
                CHECK_MSG(d < 0, "%s prompt %d (T=%d): chunking %d (%d chunks) differs first at row %d", what, pi, T, k, nc, d);
            }
            free(c);
            for (int i = 0; i < T; i++) ones[i] = 1;
        }
        checked += a && b;
        free(a);
        free(b);
        free(ones);
    }
    CHECK(checked > 0);
    st_close(g);
}

static void check_fixture(const char *name, int trials) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(test_data(name), NULL, &e, &err)) { test_fail(__FILE__, __LINE__, "open %s: %s", name, err.msg); return; }
    check_engine(name, e, name, trials);
    petrel_engine_close(e);
}

static void check_pack(const char *name, int quant, int trials) {
    char pk[600];
    snprintf(pk, sizeof pk, "%s/rows-%s-%d.pack", test_tmpdir(), name, quant);
    convert_opts o;
    memset(&o, 0, sizeof o);
    o.quant = quant;
    convert_result res;
    petrel_error err = {0};
    if (convert_hf(test_data(name), pk, &o, &res, &err)) { test_fail(__FILE__, __LINE__, "convert %s: %s", name, err.msg); return; }
    petrel_engine *e = NULL;
    if (petrel_engine_open(pk, NULL, &e, &err)) { test_fail(__FILE__, __LINE__, "open %s: %s", pk, err.msg); return; }
    char what[700];
    snprintf(what, sizeof what, "%s pack quant %d", name, quant);
    check_engine(what, e, name, trials);
    petrel_engine_close(e);
}

TEST(rows, tiny_bf16) { check_fixture("tiny", 3); }
TEST(rows, fp8) { check_fixture("tiny-fp8", 2); }
TEST(rows, odd) { check_fixture("odd", 2); }
TEST(rows, odd2) { check_fixture("odd2", 2); }
TEST(rows, odd3) { check_fixture("odd3", 2); }
TEST(rows, trained_ties) { check_fixture("trained", 1); }
TEST(rows, tiny_q4_pack) { check_pack("tiny", CVQ_Q4, 2); }
TEST(rows, odd_q8_pack) { check_pack("odd", CVQ_Q8, 2); }
TEST(rows, trained_q4_pack) { check_pack("trained", CVQ_Q4, 1); }

/* The twin still agrees: the reconstructed form (test hook) within float rounding of absorbed. */
TEST(rows, reconstructed_twin_close) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(test_data("trained"), NULL, &e, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    int T = 120, V = e->cfg.vocab_size;
    int32_t ids[120];
    for (int i = 0; i < T; i++) ids[i] = (int32_t)(rnd() % (uint32_t)V);
    float *a = run_chunks(e, ids, T, &T, 1, MLA_AUTO), *b = run_chunks(e, ids, T, &T, 1, MLA_RECONSTRUCTED);
    if (a && b) {
        double d = test_rel_l2(a, b, (size_t)T * V);
        CHECK_MSG(d < 1e-5, "absorbed vs reconstructed rel err %.3g", d);
        CHECK(d > 0); /* two forms really ran */
    }
    free(a);
    free(b);
    petrel_engine_close(e);
}
