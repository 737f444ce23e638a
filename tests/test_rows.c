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
    const char *pk = test_pack_of(name, quant);
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (!pk) return;
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

/* Random mixes of sessions in batches: K sessions with sequences of different lengths (most
 * longer than index_topk, so DSA selects), fed through petrel_batch_forward in random slices
 * (0..7 rows per session per batch, sessions in random order); every row's logits must be
 * bitwise those of its session run alone in one pass. */
static void check_batches(const char *what, petrel_engine *e, int K, int maxlen, int rounds) {
    int V = e->cfg.vocab_size;
    petrel_error err = {0};
    for (int round = 0; round < rounds; round++) {
        int len[8], fed[8];
        int32_t *ids[8];
        float *ref[8];
        petrel_session *ss[8];
        for (int k = 0; k < K; k++) {
            len[k] = 1 + (int)(rnd() % (uint32_t)maxlen);
            ids[k] = malloc(sizeof(int32_t) * (size_t)len[k]);
            for (int i = 0; i < len[k]; i++) ids[k][i] = (int32_t)(rnd() % (uint32_t)V);
            ref[k] = run_chunks(e, ids[k], len[k], &len[k], 1, MLA_AUTO);
            fed[k] = 0;
            CHECK(petrel_session_create(e, len[k], &ss[k], &err) == 0);
        }
        petrel_batch *b = NULL;
        CHECK(petrel_batch_create(e, 8 * K, &b, &err) == 0);
        petrel_row rows[64];
        float *lg = malloc(sizeof(float) * (size_t)(8 * K) * V);
        int bad = 0, steps = 0;
        for (;;) {
            int order[8], n = 0, left = 0;
            for (int k = 0; k < K; k++) order[k] = k;
            for (int k = K - 1; k > 0; k--) { int j = (int)(rnd() % (uint32_t)(k + 1)), t = order[k]; order[k] = order[j]; order[j] = t; }
            int who[64], at[64];
            for (int q = 0; q < K; q++) {
                int k = order[q], take = (int)(rnd() % 8u);
                if (take > len[k] - fed[k]) take = len[k] - fed[k];
                for (int i = 0; i < take; i++) {
                    rows[n] = (petrel_row){ss[k], ids[k][fed[k] + i], 1};
                    who[n] = k, at[n] = fed[k] + i, n++;
                }
            }
            for (int k = 0; k < K; k++) left += len[k] - fed[k];
            if (!left) break;
            if (!n) continue;
            if (petrel_batch_forward(b, rows, n, lg, &err)) { test_fail(__FILE__, __LINE__, "%s: batch: %s", what, err.msg); bad = 1; break; }
            steps++;
            for (int i = 0; i < n; i++) {
                fed[who[i]]++;
                if (ref[who[i]] && memcmp(lg + (size_t)i * V, ref[who[i]] + (size_t)at[i] * V, sizeof(float) * (size_t)V)) {
                    if (bad++ < 3)
                        test_fail(__FILE__, __LINE__, "%s round %d: session %d row %d (of %d) differs batched (batch of %d rows)", what, round, who[i],
                                  at[i], len[who[i]], n);
                }
            }
        }
        CHECK(bad == 0 && steps > 0);
        for (int k = 0; k < K; k++) {
            CHECK_EQ_INT(petrel_session_len(ss[k]), len[k]);
            petrel_session_free(ss[k]);
            free(ids[k]);
            free(ref[k]);
        }
        petrel_batch_free(b);
        free(lg);
    }
}

static petrel_engine *open_path(const char *path, int slots) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    petrel_open_opts o = {0};
    o.expert_slots = slots;
    if (petrel_engine_open(path, &o, &e, &err)) test_fail(__FILE__, __LINE__, "open %s: %s", path, err.msg);
    return e;
}

static const char *pack_of(const char *name, int quant) { return test_pack_of(name, quant); }

TEST(rows, batch_mix_tiny) {
    petrel_engine *e = open_path(test_data("tiny"), 0);
    if (e) check_batches("tiny", e, 5, 40, 3);
    petrel_engine_close(e);
}
TEST(rows, batch_mix_trained) {
    petrel_engine *e = open_path(test_data("trained"), 0);
    if (e) check_batches("trained", e, 4, 90, 1);
    petrel_engine_close(e);
}
TEST(rows, batch_mix_fp8) {
    petrel_engine *e = open_path(test_data("tiny-fp8"), 0);
    if (e) check_batches("tiny-fp8", e, 3, 30, 1);
    petrel_engine_close(e);
}
TEST(rows, batch_mix_q4_pack) {
    petrel_engine *e = open_path(pack_of("trained", CVQ_Q4), 0);
    if (e) check_batches("trained q4 pack", e, 4, 60, 1);
    petrel_engine_close(e);
}
TEST(rows, batch_mix_streamed) { /* experts streamed through one slot per layer */
    const char *pk = pack_of("odd", CVQ_Q4);
    petrel_engine *e = open_path(pk, 1);
    if (e) {
        CHECK(e->xs != NULL);
        check_batches("odd q4 streamed", e, 4, 40, 1);
    }
    petrel_engine_close(e);
}

TEST(rows, batch_bad_input) {
    petrel_engine *e = open_path(test_data("tiny"), 0), *e2 = open_path(test_data("odd"), 0);
    if (!e || !e2) { petrel_engine_close(e); petrel_engine_close(e2); return; }
    petrel_error err = {0};
    petrel_session *a, *b2, *other;
    CHECK(petrel_session_create(e, 4, &a, &err) == 0);
    CHECK(petrel_session_create(e, 16, &b2, &err) == 0);
    CHECK(petrel_session_create(e2, 16, &other, &err) == 0);
    petrel_batch *b;
    CHECK(petrel_batch_create(e, 8, &b, &err) == 0);
    CHECK(petrel_batch_create(e, 0, &(petrel_batch *){NULL}, &err) == PETREL_EINVAL);
    petrel_row r1[3] = {{a, 1, 1}, {b2, 2, 1}, {a, 3, 1}}; /* a's rows apart */
    CHECK(petrel_batch_forward(b, r1, 3, NULL, &err) == PETREL_EINVAL && strstr(err.msg, "consecutive"));
    petrel_row r2[1] = {{a, e->cfg.vocab_size, 1}};
    CHECK(petrel_batch_forward(b, r2, 1, NULL, &err) == PETREL_EINVAL && strstr(err.msg, "out of range"));
    petrel_row r3[5] = {{a, 1, 0}, {a, 1, 0}, {a, 1, 0}, {a, 1, 0}, {a, 1, 1}}; /* 5 > capacity 4 */
    CHECK(petrel_batch_forward(b, r3, 5, NULL, &err) == PETREL_ERANGE);
    petrel_row r4[1] = {{other, 1, 1}};
    CHECK(petrel_batch_forward(b, r4, 1, NULL, &err) == PETREL_EINVAL);
    CHECK(petrel_batch_forward(b, r4, 0, NULL, &err) == PETREL_EINVAL);
    petrel_row r5[9];
    for (int i = 0; i < 9; i++) r5[i] = (petrel_row){b2, 1, 0};
    CHECK(petrel_batch_forward(b, r5, 9, NULL, &err) == PETREL_EINVAL); /* over the batch's 8 */
    CHECK_EQ_INT(petrel_session_len(a), 0); /* nothing appended by failed calls */
    CHECK_EQ_INT(petrel_session_len(b2), 0);
    petrel_row ok[2] = {{a, 1, 0}, {b2, 2, 1}};
    CHECK(petrel_batch_forward(b, ok, 2, NULL, &err) == 0);
    CHECK_EQ_INT(petrel_session_len(a), 1);
    CHECK_EQ_INT(petrel_session_len(b2), 1);
    petrel_batch_free(b);
    petrel_session_free(a);
    petrel_session_free(b2);
    petrel_session_free(other);
    petrel_engine_close(e);
    petrel_engine_close(e2);
}

/* `petrel batch` == `petrel generate` per prompt: prompts of very different lengths (1 to 300
 * tokens, longer than index_topk), more prompts than --max-batch so finished sessions hand
 * their place on, small --max-rows so long prompts take several forwards, bad lines failing
 * alone. */
static void batch_vs_generate(const char *model, int nprompt, int maxlen, int ngen, const char *extra) {
    const char *b = getenv("PETREL_BIN");
    if (!b) { test_skip("PETREL_BIN unset (make test sets it): batch CLI test skipped"); return; }
    char path[600];
    snprintf(path, sizeof path, "%s/prompts-%d.txt", test_tmpdir(), nprompt);
    FILE *f = fopen(path, "w");
    if (!f) { test_fail(__FILE__, __LINE__, "cannot write %s", path); return; }
    int V = 1024;
    char (*want)[4096] = calloc((size_t)nprompt + 2, 4096);
    char *cmd = malloc(16384), *out = malloc(1 << 16), *err = malloc(8192);
    for (int i = 0; i < nprompt; i++) {
        int n = i == 0 ? 1 : i == 1 ? maxlen : 1 + (int)(rnd() % (uint32_t)maxlen);
        char *ids = malloc((size_t)n * 8 + 8);
        size_t o = 0;
        for (int k = 0; k < n; k++) o += (size_t)sprintf(ids + o, k ? ",%u" : "%u", rnd() % (uint32_t)V);
        fprintf(f, "%s\n", ids);
        snprintf(cmd, 16384, "%s generate --model %s --ids %s -n %d", b, model, ids, ngen);
        CHECK_EQ_INT(test_sh(cmd, want[i], 4096, err, 8192), 0);
        free(ids);
    }
    fprintf(f, "\n5,%d,7\n", 999999); /* an empty prompt, an id outside the vocabulary */
    fclose(f);
    snprintf(cmd, 16384, "%s batch --model %s --prompts %s -n %d %s", b, model, path, ngen, extra);
    int rc = test_sh(cmd, out, 1 << 16, err, 8192);
    CHECK_EQ_INT(rc, 1); /* two prompts failed */
    CHECK_MSG(strstr(err, "line ") && strstr(err, "empty prompt") && strstr(err, "outside the vocabulary"), "stderr: %s", err);
    CHECK_EQ_INT(test_count_lines(out), nprompt);
    char *line = out;
    for (int i = 0; i < nprompt && line && *line; i++) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        char head[32];
        snprintf(head, sizeof head, "%d: ", i);
        CHECK_MSG(!strncmp(line, head, strlen(head)), "line %d: %s", i, line);
        char *w = want[i];
        w[strcspn(w, "\n")] = 0;
        CHECK_MSG(!strcmp(line + strlen(head), w), "prompt %d: batch \"%s\" vs generate \"%s\"", i, line + strlen(head), w);
        line = nl ? nl + 1 : NULL;
    }
    free(want);
    free(cmd);
    free(out);
    free(err);
}
TEST(rows, batch_cli_equals_generate) { batch_vs_generate(test_data("tiny"), 7, 120, 6, "--max-batch 3 --max-rows 40"); }
TEST(rows, batch_cli_trained) { batch_vs_generate(test_data("trained"), 4, 300, 5, "--max-batch 2 --max-rows 64"); }

TEST(rows, batch_cli_text) {
    const char *b = getenv("PETREL_BIN");
    if (!b) { test_skip("PETREL_BIN unset (make test sets it): batch CLI test skipped"); return; }
    char path[600], cmd[2048], out[8192], err[4096], one[4096];
    snprintf(path, sizeof path, "%s/text-prompts.txt", test_tmpdir());
    FILE *f = fopen(path, "w");
    if (!f) return;
    fputs("The os module provides\nTo read a file line by line,\n", f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "%s batch --model %s --prompts %s -n 12 --text", b, test_data("trained"), path);
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
    CHECK_EQ_INT(test_count_lines(out), 2);
    /* the first line's text is what `run --temp 0` writes for that prompt (newlines escaped) */
    snprintf(cmd, sizeof cmd, "%s run --model %s -p 'The os module provides' -n 12 --temp 0", b, test_data("trained"));
    CHECK_EQ_INT(test_sh(cmd, one, sizeof one, err, sizeof err), 0);
    char esc[8192];
    size_t o = 0;
    for (size_t k = 0; one[k] && o + 3 < sizeof esc; k++) {
        if (one[k] == '\n') esc[o++] = '\\', esc[o++] = 'n';
        else if (one[k] == '\\') esc[o++] = '\\', esc[o++] = '\\';
        else esc[o++] = one[k];
    }
    esc[o] = 0;
    CHECK_MSG(!strncmp(out, "0: ", 3) && !strncmp(out + 3, esc, strlen(esc)), "batch: %s\nrun: %s", out, esc);
}

/* A prompt that fills the whole context still gets its one token (prompt + n - 1 positions, as
 * `petrel generate`), and one that would need more is refused alone. */
TEST(rows, batch_cli_full_context) {
    const char *b = getenv("PETREL_BIN");
    if (!b) { test_skip("PETREL_BIN unset (make test sets it): batch CLI test skipped"); return; }
    petrel_engine *e = open_path(test_data("tiny"), 0);
    if (!e) return;
    int P = e->cfg.max_position_embeddings, V = e->cfg.vocab_size;
    petrel_engine_close(e);
    char path[600];
    snprintf(path, sizeof path, "%s/full-ctx.txt", test_tmpdir());
    FILE *f = fopen(path, "w");
    if (!f) return;
    for (int line = 0; line < 2; line++) { /* P ids (fits with -n 1), then P + 1 (does not) */
        for (int k = 0; k < P + line; k++) fprintf(f, k ? ",%u" : "%u", rnd() % (uint32_t)V);
        fputc('\n', f);
    }
    fclose(f);
    char cmd[1200], *out = malloc(1 << 16), err[4096];
    snprintf(cmd, sizeof cmd, "%s batch --model %s --prompts %s -n 1", b, test_data("tiny"), path);
    CHECK_EQ_INT(test_sh(cmd, out, 1 << 16, err, sizeof err), 1);
    CHECK_MSG(!strncmp(out, "0: ", 3) && test_count_lines(out) == 1, "stdout: %s", out);
    CHECK_MSG(strstr(err, "line 2") && strstr(err, "context"), "stderr: %s", err);
    free(out);
}

/* The kernel table is the engine's: two engines of one process with different act_quant (and
 * ISA) run side by side, each giving exactly what it gives alone, and they differ. */
TEST(rows, kernel_table_per_engine) {
    const char *pk = test_pack_of("tiny", CVQ_Q4);
    if (!pk) return;
    petrel_error err = {0};
    petrel_open_opts oa = {0}, ob = {0}, oc = {0};
    oa.act_quant = -1; /* exact f32 activations on plain layouts */
    oa.relayout = -1;
    ob.act_quant = 1;
    oc.isa = "scalar";
    petrel_engine *a = NULL, *b = NULL, *c = NULL;
    CHECK(petrel_engine_open(pk, &oa, &a, &err) == 0 && petrel_engine_open(pk, &ob, &b, &err) == 0 && petrel_engine_open(pk, &oc, &c, &err) == 0);
    if (!a || !b || !c) goto out;
    int V = a->cfg.vocab_size, T = 9;
    int32_t ids[9] = {1, 5, 9, 33, 2, 7, 40, 3, 11};
    float *l[6];
    for (int k = 0; k < 6; k++) l[k] = malloc(sizeof(float) * (size_t)V * T);
    petrel_engine *order[6] = {a, b, c, b, a, c}; /* interleaved: each engine twice */
    for (int k = 0; k < 6; k++) {
        petrel_session *s = NULL;
        CHECK(petrel_session_create(order[k], T, &s, &err) == 0);
        CHECK(s && petrel_session_forward(s, ids, T, l[k], 1, &err) == 0);
        petrel_session_free(s);
    }
    size_t n = sizeof(float) * (size_t)V * T;
    CHECK_MSG(!memcmp(l[0], l[4], n), "the exact-activation engine changed when another engine ran");
    CHECK_MSG(!memcmp(l[1], l[3], n), "the int8-activation engine changed when another engine ran");
    CHECK_MSG(!memcmp(l[2], l[5], n), "the scalar engine changed when another engine ran");
    CHECK_MSG(strcmp(kt_isa_name(&c->kt), "scalar") == 0, "isa scalar not taken: %s", kt_isa_name(&c->kt));
    if (a->kt.vnni) CHECK_MSG(memcmp(l[0], l[1], n) != 0, "act_quant made no difference on a VNNI machine");
    CHECK(test_rel_l2(l[2], l[0], (size_t)V * T) < 1e-4); /* scalar and SIMD exact f32: the same model */
    for (int k = 0; k < 6; k++) free(l[k]);
out:
    petrel_engine_close(a);
    petrel_engine_close(b);
    petrel_engine_close(c);
}
