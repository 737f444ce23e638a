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

static const char *tmp(const char *name) { return test_tmp(name); }

static const char *bin(void) {
    const char *b = getenv("PETREL_BIN");
    if (!b) test_skip("PETREL_BIN unset (make test sets it): CLI tests skipped");
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
    uint8_t *b = test_read_file(good, &n);
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
    /* ... and nothing else: a damaged resident tensor is still refused under no_verify */
    {
        const char *good = tiny_pack();
        pack *p;
        size_t n;
        uint8_t *bb = NULL;
        uint64_t off = 0;
        if (good && pack_open(good, &p, &err) == 0) {
            const pack_tensor *t = pack_find(p, "model.layers.2.self_attn.o_proj.weight");
            off = t ? t->offset + 5 : 0;
            pack_close(p);
            bb = test_read_file(good, &n);
        }
        CHECK(bb && off);
        if (bb && off) {
            bb[off] ^= 0x08;
            const char *badr = tmp("integrity-resident.pack");
            spit(badr, bb, n);
            CHECK_EQ_INT(petrel_engine_open(badr, &nv, &eng, &err), PETREL_EFORMAT);
            CHECK_MSG(strstr(err.msg, "o_proj") && strstr(err.msg, "checksum"), "msg: %s", err.msg);
        }
        free(bb);
    }
    /* inspect-only opens use no expert and check none */
    petrel_open_opts io = {0};
    io.inspect_only = 1;
    CHECK_MSG(petrel_engine_open(bad, &io, &eng, &err) == 0, "%s", err.msg);
    petrel_engine_close(eng);
    eng = NULL;
    /* the MTP layer's records are checked as well (checkpoint layer num_hidden_layers = 6) */
    const char *bad_mtp = corrupt_expert("integrity-expert-mtp.pack", 6, 15);
    CHECK(bad_mtp != NULL);
    if (bad_mtp) {
        CHECK_EQ_INT(petrel_engine_open(bad_mtp, NULL, &eng, &err), PETREL_EFORMAT);
        CHECK_MSG(strstr(err.msg, "layer 6 expert 15: checksum mismatch"), "msg: %s", err.msg);
    }
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
    /* no_verify does not switch off the streamed reads' checks (help: "still checked") */
    so.no_verify = 1;
    eng = NULL;
    s = NULL;
    CHECK_MSG(petrel_engine_open(bad, &so, &eng, &err) == 0, "%s", err.msg);
    if (!eng) return;
    CHECK(petrel_session_create(eng, 8, &s, &err) == 0);
    rc = 0;
    for (int k = 0; k < 40 && rc == 0 && s; k++) {
        petrel_session_truncate(s, 0, &err);
        for (int i = 0; i < 6; i++) ids[i] = (ids[i] * 7 + 13 + k) % 1024;
        rc = petrel_session_forward(s, ids, 6, NULL, 0, &err);
    }
    CHECK_EQ_INT(rc, PETREL_EFORMAT);
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
    uint8_t *b = test_read_file(good, &n);
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

/* special files and folders without a config say what they are, and never block (a FIFO) */
TEST(integrity, special_files_are_not_models) {
    char fifo[600], dir[600], cmd[2400], out[1024], err[1024];
    snprintf(fifo, sizeof fifo, "%s/integrity.fifo", test_tmpdir());
    snprintf(dir, sizeof dir, "%s/integrity-empty", test_tmpdir());
    snprintf(cmd, sizeof cmd, "rm -f %s && mkfifo %s && mkdir -p %s", fifo, fifo, dir);
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
    const char *paths[3] = {fifo, "/dev/null", dir};
    const char *want[3] = {"a FIFO", "a character device", "has no config.json"};
    for (int i = 0; i < 3; i++) {
        petrel_engine *eng = NULL;
        petrel_error e = {0};
        CHECK(petrel_engine_open(paths[i], NULL, &eng, &e) < 0 && !eng);
        CHECK_MSG(strstr(e.msg, want[i]) && occurrences(e.msg, paths[i]) == 1, "%s: %s", paths[i], e.msg);
        CHECK(!pack_is_pack(paths[i]));
        char *t = NULL;
        CHECK(petrel_model_file(paths[i], "tokenizer.json", &t, NULL, &e) < 0 && !t);
    }
    const char *b = bin();
    if (!b) return;
    const char *cmds[3] = {"info", "run -p hi", "generate --ids 1"};
    for (int i = 0; i < 3; i++) {
        snprintf(cmd, sizeof cmd, "timeout 20 %s %s --model %s < /dev/null", b, cmds[i], fifo);
        int rc = test_sh(cmd, out, sizeof out, err, sizeof err);
        CHECK_MSG(rc != 0 && rc != 124 && test_count_lines(err) == 1 && strstr(err, "not a model"), "%s: rc %d: %s", cmds[i], rc, err);
    }
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
    uint8_t *b = test_read_file(path, &n);
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

/* ---------------------------------------------------------------- self-contained packs */

static const char *pack_of(const char *fixture) {
    static char paths[2][512];
    int k = !strcmp(fixture, "trained");
    if (paths[k][0]) return paths[k];
    char name[64];
    snprintf(name, sizeof name, "integrity-%s-self.pack", fixture);
    snprintf(paths[k], sizeof paths[k], "%s", tmp(name));
    convert_opts o = {0};
    petrel_error err = {0};
    convert_result r;
    if (convert_hf(test_data(fixture), paths[k], &o, &r, &err)) {
        test_fail(__FILE__, __LINE__, "convert %s: %s", fixture, err.msg);
        paths[k][0] = 0;
        return NULL;
    }
    return paths[k];
}

TEST(integrity, pack_stores_side_files) {
    const char *fx[2] = {"trained", "tiny"};
    for (int k = 0; k < 2; k++) {
        const char *pk = pack_of(fx[k]);
        if (!pk) return;
        const char *names[3] = {"tokenizer.json", "tokenizer_config.json", "generation_config.json"};
        for (int i = 0; i < 3; i++) {
            char src[600];
            snprintf(src, sizeof src, "%s/%s", test_data(fx[k]), names[i]);
            size_t n1 = 0, n2 = 0;
            uint8_t *want = test_read_file(src, &n1);
            char *got = NULL;
            petrel_error err = {0};
            int rc = petrel_model_file(pk, names[i], &got, &n2, &err);
            if (!want) { /* tiny has no generation_config.json: the pack has none either */
                CHECK_MSG(rc == PETREL_EIO && strstr(err.msg, "stores no"), "%s %s: rc %d %s", fx[k], names[i], rc, err.msg);
                continue;
            }
            CHECK_MSG(rc == 0, "%s %s: %s", fx[k], names[i], err.msg);
            CHECK_MSG(got && n1 == n2 && !memcmp(want, got, n1), "%s %s differs from the source", fx[k], names[i]);
            free(want);
            free(got);
        }
        /* the chat template comes out the same as from the folder */
        char *t1 = NULL, *t2 = NULL;
        size_t l1 = 0, l2 = 0;
        petrel_error err = {0};
        CHECK_MSG(petrel_model_chat_template(test_data(fx[k]), &t1, &l1, &err) == 0, "%s", err.msg);
        CHECK_MSG(petrel_model_chat_template(pk, &t2, &l2, &err) == 0, "%s", err.msg);
        CHECK(t1 && t2 && l1 == l2 && !memcmp(t1, t2, l1));
        free(t1);
        free(t2);
    }
    /* a flipped byte in a stored file: pack_verify and the reader refuse it */
    const char *pk = pack_of("trained");
    if (!pk) return;
    pack *p;
    petrel_error err = {0};
    CHECK(pack_open(pk, &p, &err) == 0);
    const pack_file *f = pack_find_file(p, "tokenizer.json");
    CHECK(f != NULL);
    uint64_t off = f ? f->offset + f->bytes / 2 : 0;
    CHECK(pack_verify(p, &err) == 0);
    pack_close(p);
    size_t n;
    uint8_t *b = test_read_file(pk, &n);
    if (!b || !off) { free(b); return; }
    b[off] ^= 0x01;
    const char *bad = tmp("integrity-sidefile.pack");
    spit(bad, b, n);
    free(b);
    CHECK(pack_open(bad, &p, &err) == 0);
    CHECK_EQ_INT(pack_verify(p, &err), PETREL_EFORMAT);
    CHECK_MSG(strstr(err.msg, "tokenizer.json"), "msg: %s", err.msg);
    char *got = NULL;
    CHECK_EQ_INT(pack_read_file(p, "tokenizer.json", &got, NULL, &err), PETREL_EFORMAT);
    CHECK(got == NULL);
    pack_close(p);
}

/* run / chat on a pack need neither --tokenizer nor --template and give the folder's text. */
TEST(integrity, cli_pack_runs_without_tokenizer_or_template) {
    const char *b = bin();
    if (!b) return;
    const char *fx[2] = {"trained", "tiny"};
    for (int k = 0; k < 2; k++) {
        const char *pk = pack_of(fx[k]);
        if (!pk) return;
        const char *modes[3] = {"run -p 'Once upon a time' -n 8 --seed 1", "run --chat -p 'Hello there' -n 8 --seed 1",
                                "chat -n 8 --seed 1 < /dev/null"};
        for (int m = 0; m < 3; m++) {
            char cmd[2048], o1[8192], o2[8192], e1[4096], e2[4096];
            if (m == 2) {
                snprintf(cmd, sizeof cmd, "echo 'Hi, who are you?' | %s chat --model %s -n 8 --seed 1", b, test_data(fx[k]));
                CHECK_MSG(test_sh(cmd, o1, sizeof o1, e1, sizeof e1) == 0, "%s: %s", cmd, e1);
                snprintf(cmd, sizeof cmd, "echo 'Hi, who are you?' | %s chat --model %s -n 8 --seed 1", b, pk);
            } else {
                snprintf(cmd, sizeof cmd, "%s %s --model %s", b, modes[m], test_data(fx[k]));
                CHECK_MSG(test_sh(cmd, o1, sizeof o1, e1, sizeof e1) == 0, "%s: %s", cmd, e1);
                snprintf(cmd, sizeof cmd, "%s %s --model %s", b, modes[m], pk);
            }
            CHECK_MSG(test_sh(cmd, o2, sizeof o2, e2, sizeof e2) == 0, "%s: %s", cmd, e2);
            CHECK_MSG(o1[0] && !strcmp(o1, o2), "%s: folder \"%s\" vs pack \"%s\"", cmd, o1, o2);
        }
        char cmd[2048], out[16384], err[4096];
        snprintf(cmd, sizeof cmd, "%s info --model %s", b, pk);
        CHECK(test_sh(cmd, out, sizeof out, err, sizeof err) == 0);
        CHECK_MSG(strstr(out, "stored files") && strstr(out, "tokenizer.json (") && strstr(out, "need no --tokenizer"), "info: %s", out);
    }
    /* explicit flags still win: with a damaged stored tokenizer, --tokenizer FILE runs, the
     * default refuses with one line */
    const char *pk = pack_of("trained");
    pack *p;
    petrel_error pe = {0};
    if (pack_open(pk, &p, &pe)) return;
    const pack_file *f = pack_find_file(p, "tokenizer.json");
    uint64_t off = f ? f->offset + 10 : 0;
    pack_close(p);
    size_t n;
    uint8_t *buf = test_read_file(pk, &n);
    if (!buf || !off) { free(buf); return; }
    buf[off] ^= 0x01;
    const char *bad = tmp("integrity-badtok.pack");
    spit(bad, buf, n);
    free(buf);
    char cmd[2048], out[8192], err[4096];
    snprintf(cmd, sizeof cmd, "%s run --model %s -p 'Once upon a time' -n 4 --seed 1", b, bad);
    CHECK(test_sh(cmd, out, sizeof out, err, sizeof err) != 0);
    CHECK_MSG(test_count_lines(err) == 1 && strstr(err, "checksum mismatch") && strstr(err, "tokenizer.json"), "stderr: %s", err);
    snprintf(cmd, sizeof cmd, "%s run --model %s --tokenizer %s/tokenizer.json -p 'Once upon a time' -n 4 --seed 1", b, bad, test_data("trained"));
    CHECK_MSG(test_sh(cmd, out, sizeof out, err, sizeof err) == 0, "stderr: %s", err);
    /* --template overrides the stored one */
    const char *tp = tmp("integrity-tmpl.jinja");
    spit(tp, (const uint8_t *)"{{ messages[0].content }} and more", 34);
    char o1[8192], o2[8192];
    snprintf(cmd, sizeof cmd, "%s run --chat --model %s --template %s -p 'Once upon a time' -n 6 --seed 1", b, pk, tp);
    CHECK_MSG(test_sh(cmd, o1, sizeof o1, err, sizeof err) == 0, "stderr: %s", err);
    snprintf(cmd, sizeof cmd, "%s run --model %s -p 'Once upon a time and more' -n 6 --seed 1", b, pk);
    CHECK_MSG(test_sh(cmd, o2, sizeof o2, err, sizeof err) == 0, "stderr: %s", err);
    CHECK_MSG(!strcmp(o1, o2), "--template ignored: \"%s\" vs \"%s\"", o1, o2);
}

/* a pack without side files (from a folder without them, or written before packs carried them)
 * opens, stores none, and run says what to give in one line */
TEST(integrity, pack_without_side_files) {
    char dir[600], cmd[2048], out[8192], err[4096];
    snprintf(dir, sizeof dir, "%s/integrity-bare", test_tmpdir());
    snprintf(cmd, sizeof cmd, "mkdir -p %s && cp %s/config.json %s/ && ln -sf \"$(cd %s && pwd)/model.safetensors\" %s/model.safetensors", dir,
             test_data("tiny"), dir, test_data("tiny"), dir);
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
    const char *pk = tmp("integrity-bare.pack");
    convert_opts o = {0};
    petrel_error e = {0};
    convert_result r;
    CHECK_MSG(convert_hf(dir, pk, &o, &r, &e) == 0, "%s", e.msg);
    pack *p;
    CHECK_MSG(pack_open(pk, &p, &e) == 0, "%s", e.msg);
    if (p) CHECK_EQ_INT(p->n_files, 0);
    pack_close(p);
    char *t = NULL;
    CHECK_EQ_INT(petrel_model_chat_template(pk, &t, NULL, &e), PETREL_EIO);
    CHECK_MSG(strstr(e.msg, "stores no chat template") && strstr(e.msg, "--template"), "msg: %s", e.msg);
    const char *b = bin();
    if (!b) return;
    snprintf(cmd, sizeof cmd, "%s run --model %s -p hi -n 2", b, pk);
    CHECK(test_sh(cmd, out, sizeof out, err, sizeof err) != 0);
    CHECK_MSG(test_count_lines(err) == 1 && strstr(err, "stores no tokenizer.json") && strstr(err, "--tokenizer"), "stderr: %s", err);
    snprintf(cmd, sizeof cmd, "%s run --model %s --tokenizer %s/tokenizer.json -p hi -n 2 --seed 1", b, pk, test_data("tiny"));
    CHECK_MSG(test_sh(cmd, out, sizeof out, err, sizeof err) == 0, "stderr: %s", err);
}

/* ---------------------------------------------------------------- xs_load_all directly */

static int pk_rec(void *ctx, int layer, int expert, uint64_t *off, uint64_t *bytes, uint64_t *xxh, petrel_error *err) {
    const pack *p = ctx;
    if (pack_expert_record(p, p->elayers[layer].layer, expert, off, bytes, xxh)) return pt_err(err, PETREL_EINVAL, "no record");
    return 0;
}

/* into a copy laid out like the file, and check-only (base NULL: what a load whose experts do
 * not fit in memory does before serving them from the map); both backends */
TEST(integrity, load_all_into_copy_and_check_only) {
    const char *good = tiny_pack(), *bad = corrupt_expert("integrity-expert4.pack", 4, 9);
    if (!good || !bad) return;
    int backs[2] = {XS_BACKEND_URING, XS_BACKEND_PREAD};
    for (int k = 0; k < 2; k++)
        for (int which = 0; which < 2; which++) {
            pack *p;
            petrel_error err = {0};
            if (pack_open(which ? bad : good, &p, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
            int ids[16];
            for (int i = 0; i < p->n_elayers && i < 16; i++) ids[i] = p->elayers[i].layer;
            xs_source src = {.ctx = p, .path = p->path, .fd = p->fd, .n_layers = p->n_elayers, .n_experts = p->elayers[0].n_experts,
                             .record = pk_rec, .layer_ids = ids};
            xs_store_opts so = {.io_mode = XS_IO_BUFFERED, .backend = backs[k], .retries = 1, .io_threads = 2};
            uint8_t *copy = NULL;
            CHECK(posix_memalign((void **)&copy, 4096, (size_t)p->file_size) == 0);
            memset(copy, 0, (size_t)p->file_size);
            int rc1 = xs_load_all(&src, copy, &so, NULL, NULL, &err);
            int rc2 = xs_load_all(&src, NULL, &so, NULL, NULL, &err);
            if (!which) {
                CHECK_MSG(rc1 == 0 && rc2 == 0, "backend %d: %s", k, err.msg);
                for (int i = 0; i < p->n_elayers; i++) {
                    uint64_t o = p->elayers[i].first_offset, n = (uint64_t)p->elayers[i].n_experts * p->elayers[i].record_bytes;
                    CHECK(!memcmp(copy + o, p->map + o, (size_t)n));
                }
            } else {
                CHECK_EQ_INT(rc1, PETREL_EFORMAT);
                CHECK_EQ_INT(rc2, PETREL_EFORMAT);
                CHECK_MSG(strstr(err.msg, "layer 4 expert 9: checksum mismatch") && occurrences(err.msg, bad) == 1, "msg: %s", err.msg);
                so.verify = -1; /* no_verify: read, not checked */
                CHECK_EQ_INT(xs_load_all(&src, copy, &so, NULL, NULL, &err), 0);
            }
            free(copy);
            pack_close(p);
        }
}

TEST(integrity, cli_template_from_pack) {
    const char *b = bin(), *pk = pack_of("trained");
    if (!b || !pk) return;
    char cmd[2048], o1[8192], o2[8192], err[4096];
    snprintf(cmd, sizeof cmd, "%s template --model %s --input %s/jinja/conversations/basic.json", b, test_data("trained"), test_data("."));
    CHECK_MSG(test_sh(cmd, o1, sizeof o1, err, sizeof err) == 0, "%s", err);
    snprintf(cmd, sizeof cmd, "%s template --model %s --input %s/jinja/conversations/basic.json", b, pk, test_data("."));
    CHECK_MSG(test_sh(cmd, o2, sizeof o2, err, sizeof err) == 0, "%s", err);
    CHECK_MSG(o1[0] && !strcmp(o1, o2), "folder \"%s\" vs pack \"%s\"", o1, o2);
}

/* a side file that is there but cannot be stored (here a FIFO, which must not block) fails the
 * conversion in one line before any output exists: the pack would silently lack it */
TEST(integrity, convert_refuses_unreadable_side_file) {
    char dir[600], cmd[8192], out[1024], err[1024];
    snprintf(dir, sizeof dir, "%s/integrity-fifotok", test_tmpdir());
    snprintf(cmd, sizeof cmd, "mkdir -p %s && cp %s/config.json %s/ && ln -sf \"$(cd %s && pwd)/model.safetensors\" %s/model.safetensors && "
             "rm -f %s/tokenizer.json && mkfifo %s/tokenizer.json", dir, test_data("tiny"), dir, test_data("tiny"), dir, dir, dir);
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
    const char *pk = tmp("integrity-fifotok.pack");
    convert_opts o = {0};
    petrel_error e = {0};
    convert_result r;
    CHECK_EQ_INT(convert_hf(dir, pk, &o, &r, &e), PETREL_EIO);
    CHECK_MSG(strstr(e.msg, "tokenizer.json is not a regular file"), "msg: %s", e.msg);
    struct stat st;
    CHECK(stat(pk, &st) < 0);
}

/* convert --in: a pack, a stray file or a FIFO is named for what it is (was "cannot open
 * ./config.json" or a safetensors header error about config.json), and nothing is written */
TEST(integrity, convert_input_not_a_model) {
    const char *pk = tiny_pack();
    if (!pk) return;
    char cfg[600], fifo[600], cmd[1400], out[256], err[256];
    snprintf(cfg, sizeof cfg, "%s/config.json", test_data("tiny"));
    snprintf(fifo, sizeof fifo, "%s/integrity-in.fifo", test_tmpdir());
    snprintf(cmd, sizeof cmd, "rm -f %s && mkfifo %s", fifo, fifo);
    CHECK_EQ_INT(test_sh(cmd, out, sizeof out, err, sizeof err), 0);
    const char *ins[3] = {pk, cfg, fifo};
    const char *want[3] = {"is a petrel pack already", "is not a model", "not a folder or a regular file"};
    for (int i = 0; i < 3; i++) {
        const char *o = tmp("integrity-convert-out.pack");
        convert_opts co = {0};
        petrel_error e = {0};
        convert_result r;
        CHECK(convert_hf(ins[i], o, &co, &r, &e) < 0);
        CHECK_MSG(strstr(e.msg, want[i]) && !strstr(e.msg, "config.json:") && !strchr(e.msg, '\n'), "%s: %s", ins[i], e.msg);
        struct stat st;
        CHECK(stat(o, &st) < 0);
    }
}
