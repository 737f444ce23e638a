/* test_cli.c: the command-line contracts of logits / generate / info, run as a subprocess
 * ($PETREL_BIN, set by `make test`): outputs in the documented format and, on every failure, a
 * non-zero exit with one line on stderr. Skipped (and reported) when PETREL_BIN is unset. */
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cjson/cJSON.h>

#include "io/convert.h"
#include "io/safetensors.h"
#include "test.h"

static const char *bin(void) {
    const char *b = getenv("PETREL_BIN");
    if (!b) test_skip("PETREL_BIN unset (make test sets it): CLI tests skipped");
    return b;
}


TEST(cli, generate_prints_ids) {
    const char *b = bin();
    if (!b) return;
    char cmd[1024], out[4096], err[4096];
    snprintf(cmd, sizeof cmd, "%s generate --model %s --ids 5,17,300 -n 7", b, test_data("tiny"));
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
    int n = 0;
    for (char *t = strtok(out, " \n"); t; t = strtok(NULL, " \n")) {
        int v = atoi(t);
        CHECK(v >= 0 && v < 1024);
        n++;
    }
    CHECK_EQ_INT(n, 7);
}

TEST(cli, logits_file_matches_golden) {
    const char *b = bin();
    if (!b) return;
    petrel_error e = {0};
    st_set *g;
    char p[600];
    snprintf(p, sizeof p, "%s/golden.safetensors", test_data("tiny"));
    if (st_open(p, &g, &e)) { test_fail(__FILE__, __LINE__, "%s", e.msg); return; }
    const st_tensor *ids = st_find(g, "prompt_1.ids"), *ref0 = st_find(g, "prompt_1.logits"), *mref = st_find(g, "prompt_1.mtp_logits");
    CHECK(ids && ref0 && mref);
    if (!ids || !ref0 || !mref) { st_close(g); return; }
    char idstr[1024] = "";
    for (int i = 0; i < ids->shape[0]; i++) {
        char t[16];
        snprintf(t, sizeof t, i ? ",%d" : "%d", ((const int32_t *)ids->data)[i]);
        strcat(idstr, t);
    }
    static const char *const mode[3] = {"", " --decode", " --mtp"}; /* --mtp: the MTP head's T - 1 rows */
    for (int dec = 0; dec < 3; dec++) {
        char cmd[2048], out[256], err[4096], of[300];
        const st_tensor *ref = dec == 2 ? mref : ref0;
        snprintf(of, sizeof of, "%s/logits%d.bin", test_tmpdir(), dec);
        snprintf(cmd, sizeof cmd, "%s logits --model %s --ids %s --out %s%s", b, test_data("tiny"), idstr, of, mode[dec]);
        CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
        FILE *f = fopen(of, "rb");
        CHECK(f != NULL);
        if (!f) continue;
        size_t n = (size_t)((ids->shape[0] - (dec == 2)) * 1024);
        CHECK_EQ_INT(ref->shape[0] * ref->shape[1], n);
        float *lg = malloc(n * 4 + 4);
        CHECK_EQ_INT(fread(lg, 4, n + 1, f), n);
        fclose(f);
        double num = 0, den = 0;
        for (size_t i = 0; i < n; i++) {
            double d = lg[i] - ((const float *)ref->data)[i];
            num += d * d;
            den += (double)((const float *)ref->data)[i] * ((const float *)ref->data)[i];
        }
        CHECK_MSG(sqrt(num / den) < 1e-4, "CLI logits%s rel err %.3g", mode[dec], sqrt(num / den));
        free(lg);
    }
    st_close(g);
}

TEST(cli, info_reports) {
    const char *b = bin();
    if (!b) return;
    char cmd[1024], out[16384], err[4096];
    snprintf(cmd, sizeof cmd, "%s info --model %s", b, test_data("tiny-fp8"));
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
    CHECK(strstr(out, "routed experts") != NULL);
    CHECK(strstr(out, "mtp              present") != NULL);
    CHECK(strstr(out, "fp8") != NULL);
}

/* bench --profile on the CPU: the decode step by product, named after the model's tensors, with
 * the head's bytes per token those of lm_head */
TEST(cli, bench_profile) {
    const char *b = bin();
    if (!b) return;
    static char cmd[1024], out[32768], err[4096];
    snprintf(cmd, sizeof cmd, "%s bench --model %s --steps 3 --prompt 6 --prefill-runs 1 --bw-mib 16 --profile", b, test_data("tiny"));
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
    CHECK_MSG(strstr(out, "decode step by product") && strstr(out, "thread pool:") && strstr(out, "q_b_proj") && strstr(out, "o_proj"),
              "%s", out);
    /* the prefill run by product too, before the decode step's table, with the prompt's rows */
    const char *pf = strstr(out, "prefill run by product"), *ds = strstr(out, "decode step by product");
    CHECK_MSG(pf && ds && pf < ds, "%s", out);
    if (pf && ds) {
        const char *q = strstr(pf, "\nq_b_proj ");
        CHECK_MSG(q && q < ds, "no q_b_proj row in the prefill table: %s", out);
        char name[32], shape[32], fmt[16];
        int rows = 0;
        if (q && sscanf(q + 1, "%31s %31s %15s %d", name, shape, fmt, &rows) == 4) CHECK_EQ_INT(rows, 6);
    }
    const char *h = strstr(out, "\nlm_head ");
    CHECK_MSG(h != NULL, "no lm_head row: %s", out);
    if (h) { /* product shape format rows jobs calls MB: one call per token */
        char name[32], shape[32], fmt[16];
        int rows, jobs;
        double calls, mb;
        CHECK_EQ_INT(sscanf(h + 1, "%31s %31s %15s %d %d %lf %lf", name, shape, fmt, &rows, &jobs, &calls, &mb), 7);
        CHECK(rows == 1 && jobs == 1 && calls == 1.0 && mb > 0);
    }
}

/* The JSON object on out's last line (trailing newlines cut from out), or NULL; *last: that line. */
static cJSON *last_json(char *out, const char **last) {
    size_t n = strlen(out);
    while (n && out[n - 1] == '\n') out[--n] = 0;
    const char *l = strrchr(out, '\n');
    *last = l ? l + 1 : out;
    return cJSON_Parse(*last);
}

/* bench --json: one JSON object on the last line, the open's time in it (reading, checking and
 * laying out the weights) and on the model line of the text report */
TEST(cli, bench_json_open_time) {
    const char *b = bin();
    if (!b) return;
    static char cmd[1024], out[32768], err[4096];
    snprintf(cmd, sizeof cmd, "%s bench --model %s --steps 2 --prompt 6 --prefill-runs 1 --bw-mib 16 --json", b, test_data("tiny"));
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
    const char *last;
    cJSON *j = last_json(out, &last);
    CHECK_MSG(j != NULL, "last line is not JSON: %s", last);
    const cJSON *o = j ? cJSON_GetObjectItem(j, "open_s") : NULL;
    CHECK_MSG(cJSON_IsNumber(o) && o->valuedouble > 0 && o->valuedouble < 600, "open_s: %s", last);
    cJSON_Delete(j);
    const char *m = strstr(out, "\nmodel: ");
    CHECK_MSG(m && strstr(m, "opened in ") && strstr(m, "opened in ") < strchr(m + 1, '\n'), "%s", out);
}

/* bench --batch on a resident model also times one more session right after each batched step
 * and reports the speedup pair by pair (batch_speedup_paired); under --profile it is not run (0). */
TEST(cli, bench_batch_paired_speedup) {
    const char *b = bin();
    if (!b) return;
    static char cmd[1024], out[32768], err[4096];
    for (int prof = 0; prof < 2; prof++) {
        snprintf(cmd, sizeof cmd, "%s bench --model %s --steps 3 --prompt 6 --prefill-runs 1 --bw-mib 16 --batch 3 --json%s", b, test_data("tiny"),
                 prof ? " --profile" : "");
        CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
        const char *last;
        cJSON *j = last_json(out, &last);
        CHECK_MSG(j != NULL, "last line is not JSON: %s", last);
        const cJSON *p = j ? cJSON_GetObjectItem(j, "batch_speedup_paired") : NULL;
        if (prof) CHECK_MSG(cJSON_IsNumber(p) && p->valuedouble == 0, "with --profile: %s", last);
        else CHECK_MSG(cJSON_IsNumber(p) && p->valuedouble > 0 && p->valuedouble < 100, "batch_speedup_paired: %s", last);
        CHECK_MSG(prof || strstr(out, "batched decode, paired: "), "%s", out);
        cJSON_Delete(j);
    }
}

/* The int8 kernels' prefetch settings change speed only: a q4 pack (its matrices in the R16
 * layout where the CPU has VNNI) generates the same ids under every --prefetch form. */
TEST(cli, prefetch_settings_same_ids) {
    const char *b = bin();
    if (!b) return;
    const char *pk = test_pack_of("trained", CVQ_Q4);
    if (!pk) return;
    static const char *pf[] = {"", "--prefetch off", "--prefetch 64:l2:half", "--prefetch auto:all", "--prefetch 8192:l1:all", "--prefetch 4096:half"};
    static char cmd[1024], ref[4096], out[4096], err[4096];
    for (size_t i = 0; i < sizeof pf / sizeof pf[0]; i++) {
        snprintf(cmd, sizeof cmd, "%s generate --model %s --ids 5,17,300,2,9 -n 6 %s", b, pk, pf[i]);
        CHECK_MSG(test_sh(cmd, i ? out : ref, sizeof out, err, sizeof err) == 0, "%s: %s", pf[i], err);
        if (i) CHECK_MSG(!strcmp(out, ref), "%s: %s vs %s", pf[i], out, ref);
    }
}

/* bench --golden-out writes this engine's logits of bench's random prompt as a golden file
 * (prompt_0.ids [T], prompt_0.logits [T][vocab]); --golden on it from the same engine reads back
 * rel L2 error 0 and KL 0 */
TEST(cli, bench_golden_roundtrip) {
    const char *b = bin();
    if (!b) return;
    static char cmd[1024], out[8192], err[4096], path[600];
    snprintf(path, sizeof path, "%s/golden-out.safetensors", test_tmpdir());
    remove(path);
    snprintf(cmd, sizeof cmd, "%s bench --model %s --prompt 9 --golden-out %s", b, test_data("tiny"), path);
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
    CHECK_MSG(strstr(out, "golden: 9 positions"), "%s", out);
    st_set *g = NULL;
    petrel_error e = {0};
    CHECK_MSG(st_open(path, &g, &e) == 0, "%s", e.msg);
    if (g) {
        const st_tensor *ids = st_find(g, "prompt_0.ids"), *lg = st_find(g, "prompt_0.logits");
        CHECK(ids && ids->dtype == ST_I32 && ids->ndim == 1 && ids->shape[0] == 9);
        CHECK(lg && lg->dtype == ST_F32 && lg->ndim == 2 && lg->shape[0] == 9 && lg->shape[1] == 1024);
        st_close(g);
    }
    snprintf(cmd, sizeof cmd, "%s bench --model %s --golden %s --json", b, test_data("tiny"), path);
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
    const char *last;
    cJSON *j = last_json(out, &last);
    CHECK_MSG(j != NULL, "no JSON: %s", out);
    if (j) {
        CHECK_EQ_INT(cJSON_GetObjectItem(j, "positions")->valueint, 9);
        CHECK(cJSON_GetObjectItem(j, "rel_l2")->valuedouble == 0 && cJSON_GetObjectItem(j, "kl_mean")->valuedouble == 0);
        cJSON_Delete(j);
    }
}

TEST(cli, failures_are_one_line) {
    const char *b = bin();
    if (!b) return;
    const char *tiny = test_data("tiny");
    char cases[][1024] = {"", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", ""};
    snprintf(cases[0], 1024, "%s generate --model /nonexistent --ids 1 -n 2", b);
    snprintf(cases[1], 1024, "%s generate --model %s --ids 1,99999 -n 2", b, tiny);
    snprintf(cases[2], 1024, "%s generate --model %s --ids '' -n 2", b, tiny);
    snprintf(cases[3], 1024, "%s generate --model %s --ids 1,x -n 2", b, tiny);
    snprintf(cases[4], 1024, "%s logits --model %s --ids 1 --out /nonexistent/dir/x", b, tiny);
    snprintf(cases[5], 1024, "%s info --model %s --bogus", b, tiny);
    snprintf(cases[6], 1024, "%s frobnicate", b);
    snprintf(cases[7], 1024, "%s bench --model %s --prefill-runs 0", b, tiny);
    snprintf(cases[8], 1024, "%s bench --model %s --prefill-runs 101", b, tiny);
    snprintf(cases[9], 1024, "%s bench --model %s --batch 0", b, tiny);
    snprintf(cases[10], 1024, "%s generate --model %s --ids 1 -n 2 --isa vax", b, tiny);
    snprintf(cases[11], 1024, "%s generate --model %s --ids 1 -n 2 --act-quant maybe", b, tiny);
    snprintf(cases[12], 1024, "%s generate --model %s --ids 1 -n 2 --relayout", b, tiny);
    snprintf(cases[13], 1024, "%s logits --model %s --ids 1,2 --out %s/x.bin --decode --mtp", b, tiny, test_tmpdir());
    snprintf(cases[14], 1024, "%s bench --model %s --cuda-fork maybe", b, tiny);
    snprintf(cases[15], 1024, "%s bench --model %s --steps 1 --prompt 2 --prefill-runs 1 --cuda-fork on", b, tiny); /* not on a GPU */
    snprintf(cases[16], 1024, "%s bench --model %s --steps 1 --prompt 2 --prefill-runs 1 --cuda-pdl off", b, tiny);
    snprintf(cases[17], 1024, "%s bench --model %s --cuda-experts fp8", b, tiny);
    snprintf(cases[18], 1024, "%s bench --model %s --steps 1 --prompt 2 --prefill-runs 1 --cuda-experts int8", b, tiny); /* not on a GPU */
    snprintf(cases[19], 1024, "%s bench --model %s --golden-out %s/g.st --golden %s/g.st", b, tiny, test_tmpdir(), test_tmpdir());
    snprintf(cases[20], 1024, "%s bench --model %s --golden-out %s/config.json", b, tiny, tiny); /* a file of the model */
    snprintf(cases[21], 1024, "%s bench --model %s --prompt 2 --golden-out /nonexistent/dir/g.st", b, tiny);
    snprintf(cases[22], 1024, "%s bench --model %s --cuda-dense fp8", b, tiny);
    snprintf(cases[23], 1024, "%s bench --model %s --steps 1 --prompt 2 --prefill-runs 1 --cuda-dense wgmma", b, tiny); /* not on a GPU */
    snprintf(cases[24], 1024, "%s bench --model %s --cuda-prompt-attn flash", b, tiny);
    snprintf(cases[25], 1024, "%s bench --model %s --steps 1 --prompt 2 --prefill-runs 1 --cuda-prompt-attn expanded", b, tiny); /* not on a GPU */
    for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
        char out[4096], err[4096];
        int rc = test_sh(cases[i], out, sizeof out, err, sizeof err);
        CHECK_MSG(rc != 0, "case %d exited 0", i);
        CHECK_MSG(test_count_lines(err) == 1, "case %d: stderr has %d lines: %s", i, test_count_lines(err), err);
        CHECK_MSG(strncmp(err, "petrel", 6) == 0, "case %d: stderr \"%s\"", i, err);
    }
}
