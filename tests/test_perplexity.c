/* test_perplexity.c: `petrel perplexity` ($PETREL_BIN) on the trained fixture (tests/data/trained):
 * its PPL on the text of golden prompt 0 equals exp(mean cross entropy) computed here from the
 * Hugging Face reference logits of the same ids; strided and non-overlapping windows score what
 * the documented rule says (checked against windows run here through the library); --save-logits
 * + --kl-base of the same model gives KL 0 and top-1 100 %, a q8 pack a small positive KL; every
 * bad input (empty / binary text, a text shorter than one window, --ctx above the model's
 * context, bad --stride, a --kl-base file of another vocab, other ids, other windows, truncated,
 * corrupt) exits non-zero with one line. Skipped (and reported) when PETREL_BIN is unset. */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "io/safetensors.h"
#include "model/engine.h"
#include "test.h"
#include "text/tokenizer.h"

static const char *bin(void) {
    const char *b = getenv("PETREL_BIN");
    if (!b) test_skip("PETREL_BIN unset (make test sets it): perplexity tests skipped");
    return b;
}

/* The ids and reference logits of trained prompt 0, and its text in a temp file (written once). */
typedef struct gold0 {
    st_set *g;
    const int32_t *ids;
    const float *logits;
    int T, V;
    char text[600];
} gold0;

static int gold0_open(gold0 *o) {
    petrel_error e = {0};
    char p[600];
    snprintf(p, sizeof p, "%s/golden.safetensors", test_data("trained"));
    if (st_open(p, &o->g, &e)) { test_fail(__FILE__, __LINE__, "%s", e.msg); return -1; }
    const st_tensor *ids = test_gold(o->g, 0, "ids"), *lg = test_gold(o->g, 0, "logits");
    if (!ids || !lg) { test_fail(__FILE__, __LINE__, "prompt_0 missing"); st_close(o->g); return -1; }
    o->ids = (const int32_t *)ids->data;
    o->logits = (const float *)lg->data;
    o->T = (int)ids->shape[0];
    o->V = (int)lg->shape[1];
    snprintf(o->text, sizeof o->text, "%s/prompt0.txt", test_tmpdir());
    struct stat st;
    if (stat(o->text, &st) == 0) return 0;
    tokenizer *t;
    snprintf(p, sizeof p, "%s/tokenizer.json", test_data("trained"));
    if (tok_load(p, &t, &e)) { test_fail(__FILE__, __LINE__, "%s", e.msg); st_close(o->g); return -1; }
    char *s = NULL;
    size_t n = 0, m = 0;
    int32_t *re = NULL;
    int rc = tok_decode(t, o->ids, (size_t)o->T, &s, &n, &e);
    if (!rc) rc = tok_encode(t, s, n, &re, &m, &e);
    CHECK_MSG(rc == 0, "%s", e.msg);
    /* the text round-trips to the same ids, so the command scores exactly the golden's prompt */
    CHECK_EQ_INT(m, o->T);
    for (size_t i = 0; !rc && i < m && i < (size_t)o->T; i++) CHECK_MSG(re[i] == o->ids[i], "id %zu: %d != %d", i, re[i], o->ids[i]);
    FILE *f = fopen(o->text, "wb");
    CHECK(f && fwrite(s, 1, n, f) == n);
    if (f) fclose(f);
    free(s);
    free(re);
    tok_free(t);
    return rc ? -1 : 0;
}

/* Runs `petrel perplexity ARGS --json` and parses its stdout; NULL (after a failed check) when
 * the command failed. */
static cJSON *ppl_json(const char *args) {
    char cmd[4096], out[8192], err[4096];
    snprintf(cmd, sizeof cmd, "%s perplexity %s --json", bin(), args);
    int rc = test_sh(cmd, out, sizeof out, err, sizeof err);
    CHECK_MSG(rc == 0, "%s: exit %d: %s", cmd, rc, err);
    if (rc) return NULL;
    cJSON *j = cJSON_Parse(out);
    CHECK_MSG(j != NULL, "not JSON: %s", out);
    return j;
}
static double jnum(const cJSON *j, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, k);
    CHECK_MSG(cJSON_IsNumber(v), "no number \"%s\"", k);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

/* -log softmax(row)[target] in double */
static double nll_of(const float *row, int V, int target) {
    double m = row[0], z = 0;
    for (int v = 1; v < V; v++) if (row[v] > m) m = row[v];
    for (int v = 0; v < V; v++) z += exp((double)row[v] - m);
    return m + log(z) - row[target];
}

TEST(perplexity, matches_reference_cross_entropy) {
    if (!bin()) return;
    gold0 g;
    if (gold0_open(&g)) return;
    double ce = 0;
    for (int t = 1; t < g.T; t++) ce += nll_of(g.logits + (size_t)(t - 1) * g.V, g.V, g.ids[t]);
    ce /= g.T - 1;
    double want = exp(ce);
    /* one window of ctx T-1 positions predicts every token after the first */
    char args[1400];
    snprintf(args, sizeof args, "--model %s --file %s --ctx %d", test_data("trained"), g.text, g.T - 1);
    cJSON *j = ppl_json(args);
    if (j) {
        double ppl = jnum(j, "ppl");
        CHECK_MSG(fabs(ppl - want) <= 1e-4 * want, "PPL %.9g, reference exp(mean CE) %.9g (rel %.3g)", ppl, want, fabs(ppl - want) / want);
        CHECK_NEAR(jnum(j, "mean_nll"), ce, 1e-4 * ce);
        CHECK_EQ_INT(jnum(j, "tokens"), g.T);
        CHECK_EQ_INT(jnum(j, "scored"), g.T - 1);
        CHECK_EQ_INT(jnum(j, "windows"), 1);
        CHECK_EQ_INT(jnum(j, "stride"), g.T - 1);
        if (getenv("PETREL_TEST_VERBOSE")) fprintf(stderr, "  perplexity %.9g, reference %.9g\n", ppl, want);
        cJSON_Delete(j);
    }
    /* a window of all T tokens scores the same T - 1 predictions */
    snprintf(args, sizeof args, "--model %s --file %s --ctx %d", test_data("trained"), g.text, g.T);
    j = ppl_json(args);
    if (j) {
        CHECK_MSG(fabs(jnum(j, "ppl") - want) <= 1e-4 * want, "--ctx T: PPL %.9g, reference %.9g", jnum(j, "ppl"), want);
        CHECK_EQ_INT(jnum(j, "scored"), g.T - 1);
        CHECK_EQ_INT(jnum(j, "windows"), 1);
        cJSON_Delete(j);
    }
    /* the text report says the same */
    char cmd[2000], out[4096], err[4096];
    snprintf(cmd, sizeof cmd, "%s perplexity %s", bin(), args);
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
    double ppl = strncmp(out, "perplexity ", 11) ? 0 : atof(out + 11);
    CHECK_MSG(fabs(ppl - want) <= 1e-4 * want, "text report \"%s\", want %.6f", out, want);
    st_close(g.g);
}

/* The scoring rule, run here independently of the command's chunking: window w = ids[w*stride,
 * min(w*stride + ctx, T)) in a fresh session with logits at every position; it scores tokens
 * t in (end of window w-1, end of window w] (window -1 ends at 0), t < T. */
static double rule_nll(petrel_engine *eng, const int32_t *ids, int T, int ctx, int stride, int *windows) {
    int V = petrel_engine_vocab_size(eng);
    float *lg = malloc(sizeof(float) * (size_t)ctx * V);
    double sum = 0;
    int scored = 0, prev_end = 0;
    *windows = 0;
    for (int b = 0; prev_end < T - 1; b += stride) {
        int e = b + ctx < T ? b + ctx : T;
        petrel_session *s;
        petrel_error err = {0};
        CHECK(petrel_session_create(eng, ctx, &s, &err) == 0);
        CHECK(petrel_session_forward(s, ids + b, e - b, lg, 1, &err) == 0);
        for (int t = prev_end + 1; t <= e && t < T; t++, scored++) sum += nll_of(lg + (size_t)(t - 1 - b) * V, V, ids[t]);
        petrel_session_free(s);
        prev_end = e;
        ++*windows;
    }
    CHECK_EQ_INT(scored, T - 1);
    free(lg);
    return sum / scored;
}

TEST(perplexity, strided_windows_follow_the_rule) {
    if (!bin()) return;
    gold0 g;
    if (gold0_open(&g)) return;
    petrel_engine *eng;
    petrel_error e = {0};
    if (petrel_engine_open(test_data("trained"), NULL, &eng, &e)) { test_fail(__FILE__, __LINE__, "%s", e.msg); st_close(g.g); return; }
    /* overlapping (stride < ctx), non-overlapping (default stride), and a short last window */
    static const int cases[][3] = {{100, 60, 5}, {100, 0, 4}, {128, 128, 3}, {300, 7, 2}};
    for (int c = 0; c < 4; c++) {
        int ctx = cases[c][0], stride = cases[c][1] ? cases[c][1] : ctx, nw;
        double want = rule_nll(eng, g.ids, g.T, ctx, stride, &nw);
        CHECK_EQ_INT(nw, cases[c][2]);
        char args[1400];
        snprintf(args, sizeof args, "--model %s --file %s --ctx %d", test_data("trained"), g.text, ctx);
        if (cases[c][1]) snprintf(args + strlen(args), sizeof args - strlen(args), " --stride %d", stride);
        cJSON *j = ppl_json(args);
        if (!j) continue;
        CHECK_MSG(fabs(jnum(j, "mean_nll") - want) <= 1e-6 * want, "ctx %d stride %d: mean NLL %.9g, rule %.9g", ctx, stride, jnum(j, "mean_nll"),
                  want);
        CHECK_EQ_INT(jnum(j, "windows"), nw);
        CHECK_EQ_INT(jnum(j, "scored"), g.T - 1);
        cJSON_Delete(j);
    }
    petrel_engine_close(eng);
    st_close(g.g);
}

TEST(perplexity, kl_same_model_is_zero) {
    if (!bin()) return;
    gold0 g;
    if (gold0_open(&g)) return;
    char lp[600], args[2000];
    snprintf(lp, sizeof lp, "%s/same.logp", test_tmpdir());
    snprintf(args, sizeof args, "--model %s --file %s --ctx 200 --stride 150 --save-logits %s", test_data("trained"), g.text, lp);
    cJSON *j = ppl_json(args);
    double ppl0 = j ? jnum(j, "ppl") : 0;
    cJSON_Delete(j);
    struct stat st;
    CHECK(stat(lp, &st) == 0);
    /* header 40, ids, one float row per scored token, checksum */
    CHECK_EQ_INT(st.st_size, 40 + 4 * g.T + 4LL * g.V * (g.T - 1) + 8);
    /* without --ctx the run takes the base file's window and stride */
    snprintf(args, sizeof args, "--model %s --file %s --kl-base %s", test_data("trained"), g.text, lp);
    j = ppl_json(args);
    if (j) {
        CHECK_EQ_INT(jnum(j, "ctx"), 200);
        CHECK_EQ_INT(jnum(j, "stride"), 150);
        CHECK(fabs(jnum(j, "kl_mean")) < 1e-9);
        CHECK(fabs(jnum(j, "kl_p99")) < 1e-9);
        CHECK_NEAR(jnum(j, "top1_agreement"), 1.0, 0);
        CHECK_NEAR(jnum(j, "ppl"), ppl0, 1e-12 * ppl0);
        CHECK_NEAR(jnum(j, "base_ppl"), ppl0, 1e-6 * ppl0);
        cJSON_Delete(j);
    }
    st_close(g.g);
}

TEST(perplexity, kl_q8_pack_small_and_positive) {
    if (!bin()) return;
    gold0 g;
    if (gold0_open(&g)) return;
    char pack[600], lp[600], cmd[2000], out[4096], err[4096], args[2000];
    snprintf(pack, sizeof pack, "%s/trained-q8.pack", test_tmpdir());
    snprintf(lp, sizeof lp, "%s/f32.logp", test_tmpdir());
    snprintf(cmd, sizeof cmd, "%s convert --in %s --out %s --quant q8", bin(), test_data("trained"), pack);
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
    snprintf(args, sizeof args, "--model %s --file %s --ctx 306 --save-logits %s", test_data("trained"), g.text, lp);
    cJSON *j = ppl_json(args);
    double ppl0 = j ? jnum(j, "ppl") : 0;
    cJSON_Delete(j);
    snprintf(args, sizeof args, "--model %s --tokenizer %s/tokenizer.json --file %s --ctx 306 --kl-base %s", pack, test_data("trained"), g.text, lp);
    j = ppl_json(args);
    if (j) {
        double kl = jnum(j, "kl_mean"), p99 = jnum(j, "kl_p99"), top1 = jnum(j, "top1_agreement");
        CHECK_MSG(kl > 1e-5 && kl < 0.05, "q8 mean KL %.3g", kl);
        CHECK_MSG(p99 >= kl && p99 < 0.5, "q8 p99 KL %.3g (mean %.3g)", p99, kl);
        CHECK_MSG(top1 > 0.9 && top1 <= 1.0, "q8 top-1 %.3f", top1);
        CHECK_MSG(fabs(jnum(j, "ppl") - ppl0) < 0.05 * ppl0, "q8 PPL %.4f vs f32 %.4f", jnum(j, "ppl"), ppl0);
        CHECK_NEAR(jnum(j, "base_ppl"), ppl0, 1e-6 * ppl0);
        if (getenv("PETREL_TEST_VERBOSE")) fprintf(stderr, "  q8: mean KL %.4g p99 %.4g top-1 %.4f\n", kl, p99, top1);
        cJSON_Delete(j);
    }
    /* the pack carries its tokenizer (convert stores it): without --tokenizer, the same score */
    snprintf(args, sizeof args, "--model %s --file %s --ctx 306", pack, g.text);
    cJSON *j2 = ppl_json(args);
    snprintf(args, sizeof args, "--model %s --tokenizer %s/tokenizer.json --file %s --ctx 306", pack, test_data("trained"), g.text);
    cJSON *j3 = ppl_json(args);
    CHECK(j2 && j3);
    if (j2 && j3) CHECK_NEAR(jnum(j2, "ppl"), jnum(j3, "ppl"), 0);
    cJSON_Delete(j2);
    cJSON_Delete(j3);
    st_close(g.g);
}

static void write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    CHECK(f && fwrite(p, 1, n, f) == n);
    if (f) fclose(f);
}

TEST(perplexity, bad_input_is_one_line) {
    const char *b = bin();
    if (!b) return;
    gold0 g;
    if (gold0_open(&g)) return;
    const char *d = test_tmpdir(), *m = test_data("trained");
    char mcfg[600];
    snprintf(mcfg, sizeof mcfg, "%s/config.json", m);
    char empty[600], nul[600], badu[600], one[600], base[600], trunc[600], corrupt[600], tinyb[600], other[600], cmd[2000], out[8192], err[4096];
    snprintf(empty, sizeof empty, "%s/empty.txt", d);
    snprintf(nul, sizeof nul, "%s/nul.txt", d);
    snprintf(badu, sizeof badu, "%s/badutf8.txt", d);
    snprintf(one, sizeof one, "%s/one.txt", d);
    snprintf(base, sizeof base, "%s/base.logp", d);
    snprintf(trunc, sizeof trunc, "%s/trunc.logp", d);
    snprintf(corrupt, sizeof corrupt, "%s/corrupt.logp", d);
    snprintf(tinyb, sizeof tinyb, "%s/tiny.logp", d);
    snprintf(other, sizeof other, "%s/other.logp", d);
    write_file(empty, "", 0);
    write_file(nul, "some text\0more text after a NUL byte, like a binary file", 56);
    write_file(badu, "caf\xc3 text \xff\xfe that is not UTF-8", 29);
    write_file(one, "a", 1);
    /* base files: this text at ctx 100 (good), cut in half, one byte flipped; the tiny model's
     * (vocab 1024); another text (its first half) */
    snprintf(cmd, sizeof cmd, "%s perplexity --model %s --file %s --ctx 100 --save-logits %s", b, m, g.text, base);
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
    FILE *f = fopen(base, "rb");
    CHECK(f != NULL);
    if (f) {
        fseek(f, 0, SEEK_END);
        long n = ftell(f);
        fseek(f, 0, SEEK_SET);
        char *buf = malloc((size_t)n);
        CHECK(fread(buf, 1, (size_t)n, f) == (size_t)n);
        fclose(f);
        write_file(trunc, buf, (size_t)n / 2);
        buf[n / 2] ^= 0x40;
        write_file(corrupt, buf, (size_t)n);
        free(buf);
    }
    snprintf(cmd, sizeof cmd, "%s perplexity --model %s --file %s --ctx 100 --save-logits %s", b, test_data("tiny"), g.text, tinyb);
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
    snprintf(cmd, sizeof cmd, "head -c 1200 %s > %s/half.txt && %s perplexity --model %s --file %s/half.txt --ctx 100 --save-logits %s", g.text, d, b, m,
             d, other);
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);

    struct { const char *args, *want; } cases[] = {
        {"--file %E", "is empty"},
        {"--file %N", "NUL byte"},
        {"--file %U", "not UTF-8"},
        {"--file %O", "nothing to score"},
        {"--file %T --ctx 308", "307 tokens"},
        {"--file %T", "--ctx 307 or less"}, /* the default window (512) */
        {"--file %T --ctx 2000", "max_position_embeddings 1024"},
        {"--file %T --ctx 1", "--ctx"},
        {"--file %T --ctx abc", "--ctx"},
        {"--file %T --ctx 100 --stride 0", "--stride"},
        {"--file %T --ctx 100 --stride 101", "larger than"},
        {"--file %T --stride 600", "larger than"},
        {"--file /nonexistent/x.txt", "nonexistent"},
        {"--file %T --ctx 100 --kl-base %K", "vocab 1024"},
        {"--file %T --ctx 100 --kl-base %X", "token ids"},
        {"--file %T --ctx 100 --kl-base %R", "truncated"},
        {"--file %T --ctx 100 --kl-base %C", "corrupt"},
        {"--file %T --ctx 100 --kl-base %T", "not a --save-logits file"},
        {"--file %T --ctx 100 --kl-base %E", "truncated"},
        {"--file %T --ctx 100 --kl-base /nonexistent.logp", "nonexistent"},
        {"--file %T --ctx 90 --kl-base %B", "--ctx 100 --stride 100"},
        {"--file %T --ctx 100 --save-logits /nonexistent/dir/x.logp", "save-logits"},
        {"--file %T --ctx 100 --save-logits %T", "is the input"},
        {"--file %T --ctx 100 --save-logits %M", "input model folder"},
        {"--file %T --bogus", "bogus"},
        {"", "--file"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char args[1800] = "";
        for (const char *p = cases[c].args; *p; p++) {
            if (*p != '%') { strncat(args, p, 1); continue; }
            const char *sub = "";
            switch (*++p) {
            case 'E': sub = empty; break;
            case 'N': sub = nul; break;
            case 'U': sub = badu; break;
            case 'O': sub = one; break;
            case 'T': sub = g.text; break;
            case 'K': sub = tinyb; break;
            case 'X': sub = other; break;
            case 'R': sub = trunc; break;
            case 'C': sub = corrupt; break;
            case 'B': sub = base; break;
            case 'M': sub = mcfg; break;
            }
            strcat(args, sub);
        }
        snprintf(cmd, sizeof cmd, "%s perplexity --model %s %s", b, m, args);
        int rc = test_sh(cmd, out, sizeof out, err, sizeof err);
        CHECK_MSG(rc != 0 && rc != -1, "case %zu (%s) exited %d", c, cases[c].args, rc);
        CHECK_MSG(test_count_lines(err) == 1 && !strncmp(err, "petrel", 6), "case %zu (%s): stderr \"%s\"", c, cases[c].args, err);
        CHECK_MSG(strstr(err, cases[c].want) != NULL, "case %zu (%s): \"%s\" lacks \"%s\"", c, cases[c].args, err, cases[c].want);
        CHECK_MSG(out[0] == 0, "case %zu: stdout \"%s\"", c, out);
    }
    /* a failed run leaves no file behind (no partial --save-logits, no temporary) */
    snprintf(cmd, sizeof cmd, "%s perplexity --model %s --file %s --ctx 100 --kl-base %s --save-logits %s/never.logp 2>/dev/null; ls %s | grep -c never", b, m,
             g.text, corrupt, d, d);
    test_sh(cmd, out, sizeof out, err, sizeof err);
    CHECK_MSG(atoi(out) == 0, "files left: %s", out);
    st_close(g.g);
}
