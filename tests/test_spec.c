/* test_spec.c: speculative decoding (src/runtime/spec.c) against plain decoding.
 *   greedy: the tokens of drafting + verify equal plain greedy's, token for token, for several
 *           draft counts, one session alone and three in one batch, resident and streamed
 *           (expert_slots on a pack of the trained fixture); the trained head's drafts are
 *           accepted often enough to matter (tokens per forward > 1.3 at 3 drafts);
 *   one-pass: after generating, the MTP cache equals the one-pass MTP over the final tokens
 *           (bitwise): catch-up rows replace the rows drafted from the MTP's own hidden;
 *   sampling: the next token's distribution with drafting equals the target's exactly (a
 *           chi-square over seeded trials), and the test's own wrong acceptance rule fails it;
 *   refusals: --draft on a model without an MTP layer, counts outside 0..16. */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "io/safetensors.h"
#include "kv/kv.h"
#include "model/engine.h"
#include "runtime/sampler.h"
#include "runtime/generate.h"
#include "runtime/spec.h"
#include "text/tokenizer.h"
#include "test.h"

/* the prompt of prompt_<pi> of the trained fixture's golden set (its first n ids) */
static int32_t *gold_ids(int pi, int *n) {
    char p[600];
    snprintf(p, sizeof p, "%s/golden.safetensors", test_data("trained"));
    st_set *g;
    petrel_error err = {0};
    if (st_open(p, &g, &err)) return NULL;
    const st_tensor *t = test_gold(g, pi, "ids");
    int32_t *ids = NULL;
    if (t) {
        int m = (int)t->shape[0];
        if (*n <= 0 || *n > m) *n = m;
        ids = malloc(sizeof(int32_t) * (size_t)*n);
        memcpy(ids, t->data, sizeof(int32_t) * (size_t)*n);
    }
    st_close(g);
    return ids;
}

static int argmax(const float *l, int V) {
    int b = 0;
    for (int v = 1; v < V; v++)
        if (l[v] > l[b]) b = v;
    return b;
}

/* plain greedy: N tokens after ids[0..n) */
static void plain_greedy(petrel_engine *e, const int32_t *ids, int n, int N, int32_t *out) {
    petrel_error err = {0};
    int V = e->cfg.vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)V);
    petrel_session *s;
    CHECK(petrel_session_create(e, n + N, &s, &err) == 0);
    CHECK(petrel_session_forward(s, ids, n, lg, 0, &err) == 0);
    for (int i = 0; i < N; i++) {
        out[i] = argmax(lg, V);
        if (i + 1 < N) CHECK(petrel_session_forward(s, &out[i], 1, lg, 0, &err) == 0);
    }
    petrel_session_free(s);
    free(lg);
}

typedef struct tl {
    petrel_session *s;
    sampler smp;
    spec_seq q;
    int32_t out[256];
    int nout;
} tl;

/* Speculative greedy of nseq timelines in one spec context (stepped together), N tokens each. */
static void spec_greedy(petrel_engine *e, int draft, int32_t *const *ids, const int *n, int nseq, int N, int32_t **out, spec_ctx **keep,
                        petrel_session **keep_s) {
    petrel_error err = {0};
    int V = e->cfg.vocab_size;
    spec_params sp = {.draft = draft};
    spec_ctx *c = NULL;
    CHECK_MSG(spec_create(e, &sp, nseq, &c, &err) == 0, "%s", err.msg);
    if (!c) return;
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 0;
    tl t[4];
    float *lg = malloc(sizeof(float) * (size_t)V);
    for (int i = 0; i < nseq; i++) {
        CHECK(petrel_session_create(e, n[i] + N + 1, &t[i].s, &err) == 0);
        CHECK(sampler_init(&t[i].smp, &p, V, &err) == 0);
        CHECK(spec_seq_init(&t[i].q, c, t[i].s, &t[i].smp, NULL, 0, &err) == 0);
        CHECK_MSG(spec_feed(&t[i].q, ids[i], n[i], lg, &err) == 0, "%s", err.msg);
        t[i].out[0] = sampler_sample(&t[i].smp, lg, V);
        sampler_accept(&t[i].smp, t[i].out[0]);
        t[i].nout = 1;
        spec_set_token(&t[i].q, t[i].out[0]);
    }
    for (int guard = 0; guard < 4 * N; guard++) {
        spec_seq *run[4];
        int m = 0;
        for (int i = 0; i < nseq; i++)
            if (t[i].nout < N) {
                t[i].q.limit = N - t[i].nout;
                run[m++] = &t[i].q;
            }
        if (!m) break;
        int rc = spec_step(c, run, m, &err);
        CHECK_MSG(rc == 0, "spec_step: %s", err.msg);
        if (rc) break;
        for (int i = 0; i < m; i++) {
            tl *x = (tl *)((char *)run[i] - offsetof(tl, q));
            for (int j = 0; j < run[i]->nout; j++) x->out[x->nout++] = run[i]->out[j];
            spec_set_token(run[i], run[i]->out[run[i]->nout - 1]);
        }
    }
    for (int i = 0; i < nseq; i++) {
        CHECK_EQ_INT(t[i].nout, N);
        memcpy(out[i], t[i].out, sizeof(int32_t) * (size_t)N);
        spec_seq_free(&t[i].q);
        sampler_free(&t[i].smp);
        if (keep_s && i == 0) keep_s[0] = t[i].s;
        else petrel_session_free(t[i].s);
    }
    free(lg);
    if (keep) *keep = c;
    else spec_free(c);
}

static void greedy_equal(petrel_engine *e, const char *what, int quick) {
    int N = 24;
    int pis[3] = {3, 1, 0}, ns[3] = {0, 0, 40};
    int32_t *ids[3], *plain[3], *sp[3];
    for (int i = 0; i < 3; i++) {
        ids[i] = gold_ids(pis[i], &ns[i]);
        if (!ids[i]) { test_fail(__FILE__, __LINE__, "no golden prompt %d", pis[i]); return; }
        plain[i] = malloc(sizeof(int32_t) * (size_t)N);
        sp[i] = malloc(sizeof(int32_t) * (size_t)N);
        plain_greedy(e, ids[i], ns[i], N, plain[i]);
    }
    int drafts[3] = {1, 3, 16};
    for (int d = quick; d < 3 - quick; d++) /* quick: --draft 3 only */
        for (int i = 0; i < 3; i++) { /* alone */
            spec_ctx *c = NULL;
            spec_greedy(e, drafts[d], &ids[i], &ns[i], 1, N, &sp[i], &c, NULL);
            CHECK_MSG(!memcmp(sp[i], plain[i], sizeof(int32_t) * (size_t)N), "%s: --draft %d on prompt %d: speculative greedy differs from plain", what,
                      drafts[d], pis[i]);
            if (c && drafts[d] == 3 && i == 0) {
                const spec_stats *st = spec_get_stats(c);
                double tpf = (double)st->tokens / (double)st->steps;
                if (getenv("PETREL_TEST_VERBOSE")) fprintf(stderr, "  %s: draft 3 prompt %d: %.2f tokens per forward\n", what, pis[i], tpf);
                CHECK_MSG(tpf > 1.3, "%s: the trained MTP head gives only %.2f tokens per verify at --draft 3", what, tpf);
            }
            spec_free(c);
        }
    /* three timelines in one batch, each with its own window */
    spec_greedy(e, 3, ids, ns, 3, N, sp, NULL, NULL);
    for (int i = 0; i < 3; i++) {
        CHECK_MSG(!memcmp(sp[i], plain[i], sizeof(int32_t) * (size_t)N), "%s: batched --draft 3, prompt %d differs from plain greedy", what, pis[i]);
        free(ids[i]);
        free(plain[i]);
        free(sp[i]);
    }
}

TEST(spec, greedy_equals_plain) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(test_data("trained"), NULL, &e, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    greedy_equal(e, "resident", 0);
    petrel_engine_close(e);
}

TEST(spec, greedy_equals_plain_streamed) {
    const char *pk = test_pack_of("trained", 0);
    if (!pk) return;
    petrel_engine *e = NULL;
    petrel_error err = {0};
    petrel_open_opts o = {0};
    o.expert_slots = 3;
    if (petrel_engine_open(pk, &o, &e, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    CHECK(e->xs != NULL);
    greedy_equal(e, "streamed", 1);
    petrel_engine_close(e);
}

/* After generating with drafts, the MTP cache rows equal those of one pass of the MTP head over
 * the final tokens with the main model's hidden states: bitwise. */
TEST(spec, mtp_cache_equals_one_pass) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(test_data("trained"), NULL, &e, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    const petrel_config *c = &e->cfg;
    int n = 30, N = 20, L = c->num_hidden_layers, H = c->hidden_size, R = c->kv_lora_rank, Dr = c->qk_rope_head_dim;
    int32_t *ids = gold_ids(3, &n), out[20], *all = malloc(sizeof(int32_t) * (size_t)(n + N));
    int32_t *outp = out;
    petrel_session *s = NULL;
    spec_greedy(e, 3, &ids, &n, 1, N, &outp, NULL, &s);
    if (!s) { petrel_engine_close(e); free(ids); free(all); return; }
    memcpy(all, ids, sizeof(int32_t) * (size_t)n);
    memcpy(all + n, out, sizeof(int32_t) * (size_t)N);
    int len = petrel_session_len(s), m = s->mtp_len;
    CHECK(len >= n + N - 1 - SPEC_MAX_DRAFT);
    CHECK_MSG(m >= len - SPEC_PEND && m <= len, "mtp_len %d for %d positions", m, len);
    /* one pass: the main model's hidden states of all positions, the MTP head over them */
    fwd_trace tr = {0};
    tr.hidden = malloc(sizeof(float) * (size_t)(L + 1) * len * H);
    petrel_session *o;
    CHECK(petrel_session_create(e, len + 1, &o, &err) == 0);
    o->trace = &tr;
    CHECK(petrel_session_forward(o, all, len, NULL, 0, &err) == 0);
    o->trace = NULL;
    fwd_seg one = {o, 0, m};
    CHECK(fwd_mtp(o, &one, 1, all + 1, tr.hidden + (size_t)L * len * H, m, NULL, &err) == 0);
    float *ca = malloc(sizeof(float) * (size_t)m * R), *cb = malloc(sizeof(float) * (size_t)m * R);
    float *pa = malloc(sizeof(float) * (size_t)m * Dr), *pb = malloc(sizeof(float) * (size_t)m * Dr);
    CHECK(kv_decode(o->kv, L, 0, m, ca, pa, NULL, &err) == 0 && kv_decode(s->kv, L, 0, m, cb, pb, NULL, &err) == 0);
    CHECK_MSG(!memcmp(ca, cb, sizeof(float) * (size_t)m * R) && !memcmp(pa, pb, sizeof(float) * (size_t)m * Dr),
              "the MTP cache after drafting differs from the one-pass MTP over the same tokens");
    free(ca);
    free(cb);
    free(pa);
    free(pb);
    free(tr.hidden);
    petrel_session_free(o);
    petrel_session_free(s);
    free(ids);
    free(all);
    petrel_engine_close(e);
}

/* Sampling: the first token a step emits (accepted draft, residual draw or bonus) is
 * distributed as the target's row: chi-square over seeded trials. A wrong rule (on rejection
 * draw from p instead of max(0, p - q)) must fail the same test. */
static double chi_square_run(petrel_engine *e, int wrong, int trials, int *df) {
    petrel_error err = {0};
    int V = e->cfg.vocab_size, n = 30;
    int32_t *ids = gold_ids(3, &n);
    spec_params sp = {.draft = 2};
    spec_ctx *c = NULL;
    if (spec_create(e, &sp, 1, &c, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); free(ids); return -1; }
    spec_test_wrong_rule(c, wrong);
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 1.5f;
    p.top_k = 6;
    p.top_p = 1;
    p.min_p = 0;
    p.seed = 7;
    sampler smp;
    CHECK(sampler_init(&smp, &p, V, &err) == 0);
    petrel_session *s;
    CHECK(petrel_session_create(e, n + 8, &s, &err) == 0);
    spec_seq q;
    CHECK(spec_seq_init(&q, c, s, &smp, NULL, 0, &err) == 0);
    float *lg = malloc(sizeof(float) * (size_t)V), *pt = calloc((size_t)V, sizeof(float));
    CHECK(spec_feed(&q, ids, n, lg, &err) == 0);
    int32_t t0 = argmax(lg, V);
    /* the target's distribution of the token after t0 */
    CHECK(petrel_session_forward(s, &t0, 1, lg, 0, &err) == 0);
    int kept = sampler_filter(&smp, lg, V);
    for (int i = 0; i < kept; i++) pt[smp.cand[i]] = (float)sampler_prob(&smp, smp.cand[i]);
    CHECK(spec_truncate(&q, n, &err) >= 0);
    long *cnt = calloc((size_t)V, sizeof(long));
    for (int t = 0; t < trials; t++) {
        int keep = spec_truncate(&q, n, &err);
        if (keep < n) CHECK(spec_feed(&q, ids + keep, n - keep, lg, &err) == 0);
        spec_set_token(&q, t0);
        q.limit = 3;
        spec_seq *one = &q;
        if (spec_step(c, &one, 1, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); break; }
        cnt[q.out[0]]++;
        sampler_clear_history(&smp);
    }
    double chi = 0;
    *df = -1;
    for (int v = 0; v < V; v++) {
        if (pt[v] > 0) {
            double ex = pt[v] * trials;
            chi += (cnt[v] - ex) * (cnt[v] - ex) / ex;
            ++*df;
        } else if (cnt[v]) chi += 1e9; /* a token the target never samples */
    }
    const spec_stats *st = spec_get_stats(c);
    if (getenv("PETREL_TEST_VERBOSE"))
        fprintf(stderr, "  rule %s: chi-square %.1f, df %d, first-draft acceptance %.2f\n", wrong ? "wrong" : "right", chi, *df,
                st->drafted[1] ? (double)st->accepted[1] / st->drafted[1] : 0.0);
    spec_seq_free(&q);
    sampler_free(&smp);
    petrel_session_free(s);
    spec_free(c);
    free(lg);
    free(pt);
    free(cnt);
    free(ids);
    return chi;
}

TEST(spec, sampling_distribution) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(test_data("trained"), NULL, &e, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    int df = 0, dfw = 0;
    double chi = chi_square_run(e, 0, 400, &df), chiw = chi_square_run(e, 1, 400, &dfw);
    /* 99.9 % quantiles of chi-square: df 5 -> 20.5 (top-k 6) */
    double crit = df <= 5 ? 20.5 : 20.5 + 3.0 * (df - 5);
    CHECK_MSG(df >= 2, "the target row keeps only %d tokens: no test", df + 1);
    CHECK_MSG(chi >= 0 && chi < crit, "speculative sampling: chi-square %.1f over %d degrees of freedom (critical %.1f)", chi, df, crit);
    CHECK_MSG(chiw > crit, "the wrong acceptance rule passes the chi-square test (%.1f < %.1f): the test cannot fail", chiw, crit);
    petrel_engine_close(e);
}

TEST(spec, refusals) {
    petrel_engine *e = NULL, *t = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(test_data("odd"), NULL, &e, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    spec_params p = {.draft = 3};
    CHECK(spec_check(e, &p, &err) == PETREL_EUNSUPPORTED);
    CHECK(strstr(err.msg, "no MTP layer") != NULL);
    p.draft = SPEC_AUTO;
    CHECK(spec_check(e, &p, &err) == 0); /* auto is off on such a model */
    if (petrel_engine_open(test_data("trained"), NULL, &t, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); petrel_engine_close(e); return; }
    p.draft = -2;
    CHECK(spec_check(t, &p, &err) == PETREL_EINVAL);
    p.draft = 17;
    CHECK(spec_check(t, &p, &err) == PETREL_EINVAL);
    p.draft = 16;
    CHECK(spec_check(t, &p, &err) == 0);
    petrel_engine_close(e);
    petrel_engine_close(t);
}

/* ---- the CLI: --draft, --stats, refusals ($PETREL_BIN) ---- */

static int count_lines(const char *s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

TEST(spec, cli_draft) {
    const char *b = getenv("PETREL_BIN");
    if (!b) { test_skip("PETREL_BIN unset: CLI --draft tests skipped"); return; }
    static char cmd[4096], o1[65536], o2[65536], e[8192];
    const char *m = test_data("trained");
    /* generate: the same ids with and without drafting; --stats gives one JSON line */
    snprintf(cmd, sizeof cmd, "%s generate --model %s --ids 3,17,29,5,88,41,7 -n 40 --draft 0", b, m);
    CHECK_EQ_INT(test_sh(cmd, o1, sizeof o1, e, sizeof e), 0);
    snprintf(cmd, sizeof cmd, "%s generate --model %s --ids 3,17,29,5,88,41,7 -n 40 --draft 3 --stats", b, m);
    CHECK_EQ_INT(test_sh(cmd, o2, sizeof o2, e, sizeof e), 0);
    CHECK_MSG(!strcmp(o1, o2), "generate --draft 3 printed other ids:\n%s\nvs\n%s", o2, o1);
    CHECK_EQ_INT(count_lines(e), 1);
    CHECK(strstr(e, "\"tokens\":") && strstr(e, "\"forwards\":") && strstr(e, "\"tokens_per_forward\":") && strstr(e, "\"acceptance_by_position\":["));
    /* batch: each prompt's ids with drafting equal those without */
    const char *pf = test_tmp("spec_prompts.txt");
    FILE *f = fopen(pf, "w");
    if (!f) { test_fail(__FILE__, __LINE__, "cannot write %s", pf); return; }
    fputs("3,17,29,5,88,41,7\n1,2\n900,901,902,903,904,905,906,907,908,909,910\n44\n", f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "%s batch --model %s --prompts %s -n 20 --max-batch 3", b, m, pf);
    CHECK_EQ_INT(test_sh(cmd, o1, sizeof o1, e, sizeof e), 0);
    snprintf(cmd, sizeof cmd, "%s batch --model %s --prompts %s -n 20 --max-batch 3 --draft 3 --stats", b, m, pf);
    CHECK_EQ_INT(test_sh(cmd, o2, sizeof o2, e, sizeof e), 0);
    CHECK_MSG(!strcmp(o1, o2), "batch --draft 3 printed other ids:\n%s\nvs\n%s", o2, o1);
    CHECK(strstr(e, "\"acceptance_by_position\":[") != NULL);
    /* run greedy: the same text */
    snprintf(cmd, sizeof cmd, "%s run --model %s -p 'The cat' -n 30 --temp 0 --draft 0", b, m);
    CHECK_EQ_INT(test_sh(cmd, o1, sizeof o1, e, sizeof e), 0);
    snprintf(cmd, sizeof cmd, "%s run --model %s -p 'The cat' -n 30 --temp 0 --draft 4 --stats", b, m);
    CHECK_EQ_INT(test_sh(cmd, o2, sizeof o2, e, sizeof e), 0);
    CHECK_MSG(!strcmp(o1, o2), "run --draft 4 --temp 0 wrote other text");
    CHECK(strstr(e, "\"tokens_per_forward\":") != NULL);
    /* refusals: one line, non-zero */
    const char *bad[] = {"generate --model %s --ids 1,2 -n 4 --draft -1", "generate --model %s --ids 1,2 -n 4 --draft 17",
                         "run --model %s -p x --draft many", "batch --model %s --prompts /dev/null --draft 99"};
    for (int i = 0; i < 4; i++) {
        char c2[1024];
        snprintf(c2, sizeof c2, bad[i], m);
        snprintf(cmd, sizeof cmd, "%s %s", b, c2);
        CHECK_MSG(test_sh(cmd, o1, sizeof o1, e, sizeof e) != 0, "accepted: %s", c2);
        CHECK_MSG(count_lines(e) == 1 && strstr(e, "--draft"), "%s: stderr %s", c2, e);
    }
    snprintf(cmd, sizeof cmd, "%s generate --model %s --ids 1,2 -n 4 --draft 3", b, test_data("odd"));
    CHECK(test_sh(cmd, o1, sizeof o1, e, sizeof e) != 0);
    CHECK_MSG(count_lines(e) == 1 && strstr(e, "no MTP layer"), "stderr: %s", e);
}

/* petrel logits --mtp writes the MTP logits [T-1][V] of a prompt: the fixture's mtp_logits */
TEST(spec, cli_logits_mtp) {
    const char *b = getenv("PETREL_BIN");
    if (!b) { test_skip("PETREL_BIN unset: CLI tests skipped"); return; }
    char p[600];
    snprintf(p, sizeof p, "%s/golden.safetensors", test_data("trained"));
    st_set *g;
    petrel_error err = {0};
    if (st_open(p, &g, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    const st_tensor *ids = test_gold(g, 3, "ids"), *ref = test_gold(g, 3, "mtp_logits");
    if (!ids || !ref) { st_close(g); test_fail(__FILE__, __LINE__, "no prompt 3 mtp_logits"); return; }
    int T = (int)ids->shape[0];
    static char cmd[16384], o[4096], e[4096];
    const char *out = test_tmp("mtp.f32");
    int k = snprintf(cmd, sizeof cmd, "%s logits --model %s --mtp --out %s --ids ", b, test_data("trained"), out);
    for (int i = 0; i < T; i++) k += snprintf(cmd + k, sizeof cmd - (size_t)k, "%s%d", i ? "," : "", ((const int32_t *)ids->data)[i]);
    CHECK_EQ_INT(test_sh(cmd, o, sizeof o, e, sizeof e), 0);
    size_t n = (size_t)(T - 1) * (size_t)ref->shape[1];
    float *got = malloc(sizeof(float) * n);
    FILE *f = fopen(out, "rb");
    CHECK(f && fread(got, sizeof(float), n, f) == n && fgetc(f) == EOF);
    if (f) fclose(f);
    double d = test_rel_l2(got, (const float *)ref->data, n);
    CHECK_MSG(d < 1e-4, "logits --mtp: rel L2 error %.3g against mtp_logits", d);
    free(got);
    st_close(g);
}

/* The generation loop with drafting (run/chat): the same greedy tokens as without, across
 * turns that reuse the cached prefix (spec_truncate, then spec_feed), stops at max_tokens and
 * a full context. */
typedef struct gcol {
    int32_t ids[512];
    int n;
} gcol;
static int gcol_piece(void *u, int32_t id, const char *b, size_t n) {
    (void)b, (void)n;
    gcol *c = u;
    if (id >= 0 && c->n < 512) c->ids[c->n++] = id;
    return 0;
}

TEST(spec, gen_turns_equal_plain) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(test_data("trained"), NULL, &e, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    tokenizer *tok = NULL;
    if (tok_load(test_data("trained/tokenizer.json"), &tok, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); petrel_engine_close(e); return; }
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 0;
    int32_t a[] = {5, 17, 300, 42, 7, 99, 100, 101, 102}, b2[] = {5, 17, 300, 42, 8, 200};
    gcol out[2][4];
    memset(out, 0, sizeof out);
    for (int mode = 0; mode < 2; mode++) {
        gen_ctx g;
        CHECK(gen_init(&g, e, tok, 72, &p, &err) == 0);
        spec_params sp = {.draft = mode ? 3 : 0};
        CHECK(gen_enable_spec(&g, &sp, &err) == 0);
        CHECK((g.spec != NULL) == mode);
        gen_stats st;
        gen_opts o = {.max_tokens = 20};
        CHECK(gen_prompt(&g, a, 9, &st, &err) == 0);
        CHECK(gen_generate(&g, &o, gcol_piece, &out[mode][0], &st, &err) == 0);
        /* the next turn: the first turn's ids and the reply, then more */
        int32_t t2[128];
        int n2 = 0;
        for (int i = 0; i < 9; i++) t2[n2++] = a[i];
        for (int i = 0; i < out[mode][0].n; i++) t2[n2++] = out[mode][0].ids[i];
        t2[n2++] = 77;
        t2[n2++] = 78;
        CHECK(gen_prompt(&g, t2, n2, &st, &err) == 0);
        CHECK(st.n_reused >= n2 - 3);
        CHECK(gen_generate(&g, &o, gcol_piece, &out[mode][1], &st, &err) == 0);
        CHECK(gen_prompt(&g, b2, 6, &st, &err) == 0); /* a shorter, diverging prompt */
        CHECK(gen_generate(&g, &o, gcol_piece, &out[mode][2], &st, &err) == 0);
        gen_opts lots = {.max_tokens = -1}; /* until the context is full */
        CHECK(gen_prompt(&g, b2, 6, &st, &err) == 0);
        CHECK(gen_generate(&g, &lots, gcol_piece, &out[mode][3], &st, &err) == 0);
        if (mode) CHECK(strstr(st.json, "\"tokens_per_forward\":") != NULL);
        gen_free(&g);
    }
    for (int k = 0; k < 4; k++)
        CHECK_MSG(out[0][k].n == out[1][k].n && !memcmp(out[0][k].ids, out[1][k].ids, sizeof(int32_t) * (size_t)out[0][k].n),
                  "turn %d: %d tokens with drafting vs %d without, or other tokens", k, out[1][k].n, out[0][k].n);
    tok_free(tok);
    petrel_engine_close(e);
}
