/* test_integrity.c: every failure loud, every byte checked (issue 20). A pack opened with every
 * expert resident checks each expert record at load (--no-verify skips exactly that); faults
 * injected through the expert I/O seam during that load fail the open with one line; files that
 * are not models say what they are not; pack messages name the file once and number layers as
 * `petrel info` does; a pack carries its tokenizer, chat template and generation config and runs
 * without --tokenizer / --template; config and template errors that used to pass silently are
 * refused. CLI cases run $PETREL_BIN (skipped when unset). */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/err.h"
#include "experts/xs.h"
#include "io/convert.h"
#include "io/pack.h"
#include "model/config.h"
#include "model/engine.h"
#include "text/jinja.h"
#include "test.h"

static const char *tmp(const char *name) {
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", test_tmpdir(), name);
    return buf[k];
}

static const char *bin(void) {
    const char *b = getenv("PETREL_BIN");
    if (!b) fprintf(stderr, "note: PETREL_BIN unset, CLI tests skipped\n");
    return b;
}

/* The tiny fixture as a bf16 pack, converted once per run (integrity-tiny.pack). */
static const char *tiny_pack(void) {
    static char path[512];
    if (path[0]) return path;
    snprintf(path, sizeof path, "%s", tmp("integrity-tiny.pack"));
    convert_opts o = {0};
    petrel_error err = {0};
    convert_result r;
    if (convert_hf(test_data("tiny"), path, &o, &r, &err)) {
        test_fail(__FILE__, __LINE__, "convert tiny: %s", err.msg);
        path[0] = 0;
        return NULL;
    }
    return path;
}

static uint8_t *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)sz + 1);
    if (b && fread(b, 1, (size_t)sz, f) != (size_t)sz) { free(b); b = NULL; }
    fclose(f);
    *n = (size_t)sz;
    return b;
}

static void spit(const char *path, const uint8_t *b, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) { test_fail(__FILE__, __LINE__, "cannot write %s", path); return; }
    fwrite(b, 1, n, f);
    fclose(f);
}

/* A copy of the tiny pack with one byte flipped inside expert record (layer, expert). */
static const char *corrupt_expert(const char *name, int layer, int expert) {
    const char *good = tiny_pack();
    if (!good) return NULL;
    pack *p;
    petrel_error err = {0};
    uint64_t off = 0, bytes = 0;
    if (pack_open(good, &p, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return NULL; }
    CHECK(pack_expert_record(p, layer, expert, &off, &bytes, NULL) == 0);
    pack_close(p);
    size_t n;
    uint8_t *b = slurp(good, &n);
    if (!b || !bytes) { free(b); return NULL; }
    b[off + bytes / 3] ^= 0x04;
    const char *bad = tmp(name);
    spit(bad, b, n);
    free(b);
    return bad;
}

static int occurrences(const char *s, const char *w) {
    int k = 0;
    for (const char *q = strstr(s, w); q; q = strstr(q + 1, w)) k++;
    return k;
}

/* ---------------------------------------------------------------- resident experts checked */

TEST(integrity, resident_expert_corruption_refused) {
    const char *bad = corrupt_expert("integrity-expert.pack", 2, 5);
    if (!bad) return;
    petrel_engine *eng = NULL;
    petrel_error err = {0};
    /* fully resident (the default): refused at open, naming the record as info numbers layers */
    CHECK_EQ_INT(petrel_engine_open(bad, NULL, &eng, &err), PETREL_EFORMAT);
    CHECK(eng == NULL);
    CHECK_MSG(strstr(err.msg, "layer 2 expert 5") && strstr(err.msg, "checksum mismatch"), "msg: %s", err.msg);
    CHECK_MSG(occurrences(err.msg, bad) == 1, "the path once: %s", err.msg);
    CHECK(strchr(err.msg, '\n') == NULL);
    /* no_verify: opens (the one thing it skips) */
    petrel_open_opts nv = {0};
    nv.no_verify = 1;
    CHECK_MSG(petrel_engine_open(bad, &nv, &eng, &err) == 0, "%s", err.msg);
    CHECK(eng && eng->pack->copy_experts);
    petrel_engine_close(eng);
    eng = NULL;
    /* inspect-only opens use no expert and check none */
    petrel_open_opts io = {0};
    io.inspect_only = 1;
    CHECK_MSG(petrel_engine_open(bad, &io, &eng, &err) == 0, "%s", err.msg);
    petrel_engine_close(eng);
    eng = NULL;
    /* the intact pack still opens and its copy holds every record, checked */
    CHECK_MSG(petrel_engine_open(tiny_pack(), NULL, &eng, &err) == 0, "%s", err.msg);
    if (eng) {
        const pack *p = eng->pack;
        for (int i = 0; i < p->n_elayers; i++)
            for (int e = 0; e < p->elayers[i].n_experts; e++)
                CHECK(pack_check_expert(p, p->elayers[i].layer, e, p->copy + p->elayers[i].first_offset + (uint64_t)e * p->elayers[i].record_bytes, &err) == 0);
    }
    petrel_engine_close(eng);
}

/* The streamed path names the same record the same way (it said "expert 1/5": a MoE index). */
TEST(integrity, streamed_expert_layers_numbered_as_info) {
    const char *bad = corrupt_expert("integrity-expert2.pack", 2, 5);
    if (!bad) return;
    petrel_engine *eng = NULL;
    petrel_error err = {0};
    petrel_open_opts so = {0};
    so.expert_slots = 16;
    CHECK_MSG(petrel_engine_open(bad, &so, &eng, &err) == 0, "%s", err.msg);
    if (!eng) return;
    petrel_session *s = NULL;
    CHECK(petrel_session_create(eng, 8, &s, &err) == 0);
    int32_t ids[6] = {5, 17, 300, 42, 7, 99};
    int rc = 0;
    /* route until expert 5 of layer 2 is needed: a few prompts cover all 16 experts */
    for (int k = 0; k < 40 && rc == 0 && s; k++) {
        petrel_session_truncate(s, 0, &err);
        for (int i = 0; i < 6; i++) ids[i] = (ids[i] * 7 + 13 + k) % 1024;
        rc = petrel_session_forward(s, ids, 6, NULL, 0, &err);
    }
    CHECK_EQ_INT(rc, PETREL_EFORMAT);
    CHECK_MSG(strstr(err.msg, "layer 2 expert 5: checksum mismatch") != NULL, "msg: %s", err.msg);
    CHECK_MSG(occurrences(err.msg, bad) == 1, "msg: %s", err.msg);
    petrel_session_free(s);
    petrel_engine_close(eng);
}

TEST(integrity, cli_resident_corruption_and_no_verify) {
    const char *b = bin();
    if (!b) return;
    const char *bad = corrupt_expert("integrity-expert3.pack", 3, 0);
    if (!bad) return;
    char cmd[2048], out[8192], err[4096];
    snprintf(cmd, sizeof cmd, "%s generate --model %s --ids 5,17,300 -n 3", b, bad);
    CHECK(test_sh(cmd, out, sizeof out, err, sizeof err) != 0);
    CHECK_MSG(test_count_lines(err) == 1 && strstr(err, "layer 3 expert 0: checksum mismatch"), "stderr: %s", err);
    snprintf(cmd, sizeof cmd, "%s generate --model %s --ids 5,17,300 -n 3 --no-verify", b, bad);
    CHECK_MSG(test_sh(cmd, out, sizeof out, err, sizeof err) == 0, "stderr: %s", err);
    snprintf(cmd, sizeof cmd, "%s generate --help", b);
    CHECK(test_sh(cmd, out, sizeof out, err, sizeof err) == 0);
    CHECK_MSG(strstr(out, "--no-verify") && strstr(out, "skip the checksums"), "help: %s", out);
}

/* ---------------------------------------------------------------- faults during a resident load */

typedef struct lfault {
    int layer, expert, kind;
    int calls;
} lfault;

static void lfault_fn(void *ctx, int layer, int expert, int attempt, xs_fault *f) {
    (void)attempt;
    lfault *lf = ctx;
    if (layer != lf->layer || expert != lf->expert) return;
    lf->calls++;
    f->kind = lf->kind;
    f->err_no = 5; /* EIO */
    f->short_bytes = 100;
}

TEST(integrity, faults_during_resident_load) {
    const char *good = tiny_pack();
    if (!good) return;
    int kinds[2] = {XS_FAULT_ERROR, XS_FAULT_SHORT};
    const char *want[2] = {"layer 2 expert 3: read failed", "layer 2 expert 3: short read"};
    for (int k = 0; k < 2; k++) {
        lfault lf = {1, 3, kinds[k], 0}; /* the load's layer 1 is the pack's second expert layer: checkpoint layer 2 */
        xs_io_fault_ctx = &lf;
        xs_io_fault_hook = lfault_fn;
        petrel_engine *eng = NULL;
        petrel_error err = {0};
        int rc = petrel_engine_open(good, NULL, &eng, &err);
        xs_io_fault_hook = NULL;
        xs_io_fault_ctx = NULL;
        CHECK_EQ_INT(rc, PETREL_EIO);
        CHECK(eng == NULL);
        CHECK_MSG(lf.calls >= 2, "retried: %d calls", lf.calls);
        CHECK_MSG(strstr(err.msg, want[k]) && occurrences(err.msg, good) == 1 && !strchr(err.msg, '\n'), "msg: %s", err.msg);
        petrel_engine_close(eng);
    }
    /* once the fault is gone the same pack opens */
    petrel_engine *eng = NULL;
    petrel_error err = {0};
    CHECK_MSG(petrel_engine_open(good, NULL, &eng, &err) == 0, "%s", err.msg);
    petrel_engine_close(eng);
}

/* ---------------------------------------------------------------- what a file is not */

TEST(integrity, non_model_files_say_what_they_are) {
    const char *good = tiny_pack();
    if (!good) return;
    petrel_engine *eng = NULL;
    petrel_error err = {0};
    char cfg[600];
    snprintf(cfg, sizeof cfg, "%s/config.json", test_data("tiny"));
    CHECK_EQ_INT(petrel_engine_open(cfg, NULL, &eng, &err), PETREL_EFORMAT);
    CHECK_MSG(strstr(err.msg, "is not a model") && strstr(err.msg, "not a petrel pack") && !strstr(err.msg, "cannot open"), "msg: %s", err.msg);
    const char *txt = tmp("integrity-notes.txt");
    spit(txt, (const uint8_t *)"hello, not a model\n", 19);
    CHECK_EQ_INT(petrel_engine_open(txt, NULL, &eng, &err), PETREL_EFORMAT);
    CHECK_MSG(strstr(err.msg, "is not a model") && occurrences(err.msg, txt) == 1, "msg: %s", err.msg);
    /* a pack with a corrupt magic is named a damaged pack */
    size_t n;
    uint8_t *b = slurp(good, &n);
    if (!b) return;
    b[1] ^= 0x20;
    const char *bad = tmp("integrity-magic.pack");
    spit(bad, b, n);
    CHECK_EQ_INT(petrel_engine_open(bad, NULL, &eng, &err), PETREL_EFORMAT);
    CHECK_MSG(strstr(err.msg, "bad magic") && strstr(err.msg, "corrupted") && occurrences(err.msg, bad) == 1, "msg: %s", err.msg);
    /* pack errors name the file once */
    b[1] ^= 0x20;
    spit(bad, b, n - 4096);
    CHECK_EQ_INT(petrel_engine_open(bad, NULL, &eng, &err), PETREL_EFORMAT);
    CHECK_MSG(strstr(err.msg, "truncated") && occurrences(err.msg, bad) == 1, "msg: %s", err.msg);
    free(b);
    CHECK(eng == NULL);
}

TEST(integrity, cli_non_model_file_one_line) {
    const char *b = bin();
    if (!b) return;
    char cmd[2048], out[4096], err[4096];
    snprintf(cmd, sizeof cmd, "%s info --model %s/config.json", b, test_data("tiny"));
    CHECK(test_sh(cmd, out, sizeof out, err, sizeof err) != 0);
    CHECK_MSG(test_count_lines(err) == 1 && strstr(err, "is not a model") && !strstr(err, "cannot open"), "stderr: %s", err);
}

/* ---------------------------------------------------------------- config and template errors */

TEST(integrity, first_k_dense_replace_disagreeing_with_mlp_layer_types) {
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", test_data("tiny"));
    size_t n;
    uint8_t *b = slurp(path, &n);
    if (!b) { test_fail(__FILE__, __LINE__, "cannot read %s", path); return; }
    b[n] = 0;
    char *at = strstr((char *)b, "\"first_k_dense_replace\": 1");
    CHECK(at != NULL);
    petrel_config cfg;
    petrel_error err = {0};
    CHECK_MSG(config_parse((const char *)b, n, "tiny/config.json", &cfg, &err) == 0, "%s", err.msg);
    config_deinit(&cfg);
    if (at) at[strlen("\"first_k_dense_replace\": ")] = '2'; /* the list still says 1 dense layer */
    err.msg[0] = 0;
    CHECK_EQ_INT(config_parse((const char *)b, n, "tiny/config.json", &cfg, &err), PETREL_EFORMAT);
    CHECK_MSG(strstr(err.msg, "first_k_dense_replace") && strstr(err.msg, "mlp_layer_types") && !strchr(err.msg, '\n'), "msg: %s", err.msg);
    free(b);
}

TEST(integrity, jinja_division_by_zero_raises) {
    const char *bad[] = {"{{ 1/0 }}", "{{ 1.5 / 0.0 }}", "{{ 7 // 0 }}", "{{ 7 % 0 }}", "{% set x = 0 %}{{ 3 / x }}"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char *out = NULL;
        petrel_error err = {0};
        int rc = jinja_render(bad[i], strlen(bad[i]), NULL, &out, NULL, &err);
        CHECK_MSG(rc < 0, "%s rendered \"%s\"", bad[i], out ? out : "");
        CHECK_MSG(strstr(err.msg, "by zero"), "%s: %s", bad[i], err.msg);
        free(out);
    }
    /* non-zero divisors are unchanged */
    const char *ok[][2] = {{"{{ 7 // 2 }}", "3"}, {"{{ 1 / 4 }}", "0.25"}, {"{{ 6 % 3 }}", "0"}, {"{{ 7.5 % 2 }}", "1.5"}};
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) {
        char *out = NULL;
        petrel_error err = {0};
        CHECK_MSG(jinja_render(ok[i][0], strlen(ok[i][0]), NULL, &out, NULL, &err) == 0, "%s: %s", ok[i][0], err.msg);
        CHECK_MSG(out && !strcmp(out, ok[i][1]), "%s gave \"%s\", want %s", ok[i][0], out ? out : "", ok[i][1]);
        free(out);
    }
}
