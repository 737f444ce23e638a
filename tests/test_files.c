/* test_files.c: output files and exit codes (issue 20). Outputs appear whole or not at all and
 * never replace what they must not (a symlink, FIFO, device, the input model); every failure,
 * including a full stdout or a side file that cannot be written, exits non-zero with one line;
 * the strict size/count parser; chat refusing what cannot fit and going on; a prompt that fills
 * the context with -n 1; and faults injected through the write seam (base/outfile.h) during
 * convert: short writes, ENOSPC, EIO. CLI cases run $PETREL_BIN (skipped when unset). */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/outfile.h"
#include "experts/xs.h"
#include "io/convert.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "test.h"

static const char *bin(void) {
    const char *b = getenv("PETREL_BIN");
    if (!b) test_skip("PETREL_BIN unset (make test sets it): files CLI tests skipped");
    return b;
}

/* A path in a per-test folder (fresh name each call). */
static const char *tpath(const char *name) {
    static char buf[8][600];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/files-%s", test_tmpdir(), name);
    return buf[k];
}

static int exists(const char *p) {
    struct stat st;
    return lstat(p, &st) == 0;
}

/* Runs cmd; it must fail with exactly one line on stderr (and that line containing want, when
 * given). Returns the exit status. */
static char g_out[1 << 16], g_err[1 << 14];
static int must_fail(const char *cmd, const char *want) {
    int rc = test_sh(cmd, g_out, sizeof g_out, g_err, sizeof g_err);
    CHECK_MSG(rc != 0, "%s: exit 0 (stderr: %s)", cmd, g_err);
    CHECK_MSG(test_count_lines(g_err) == 1, "%s: stderr has %d lines: %s", cmd, test_count_lines(g_err), g_err);
    if (want) CHECK_MSG(strstr(g_err, want) != NULL, "%s: stderr lacks \"%s\": %s", cmd, want, g_err);
    return rc;
}

static void write_text(const char *p, const char *s) {
    FILE *f = fopen(p, "w");
    CHECK(f != NULL);
    if (!f) return;
    fputs(s, f);
    fclose(f);
}

static int file_is(const char *p, const char *s) {
    char buf[256] = {0};
    FILE *f = fopen(p, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    return n == strlen(s) && !memcmp(buf, s, n);
}

/* No file whose name starts with prefix (temporaries "X.<pid>.<n>.tmp", partials) in dir. */
static int leftovers(const char *path) {
    char cmd[1400], out[4096], err[256];
    snprintf(cmd, sizeof cmd, "ls -d '%s'.* 2>/dev/null", path);
    test_sh(cmd, out, sizeof out, err, sizeof err);
    return out[0] != 0;
}

/* ---- targets that must not be replaced ---- */

TEST(files, convert_refuses_its_own_input) {
    const char *b = bin();
    if (!b) return;
    const char *m = tpath("own-input");
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s'", m, test_data("tiny"), m);
    CHECK_EQ_INT(system(cmd), 0);
    const char *outs[] = {"model.safetensors", "config.json", "tokenizer.json"};
    for (int i = 0; i < 3; i++) {
        snprintf(cmd, sizeof cmd, "%s convert --in %s --out %s/%s --quiet", b, m, m, outs[i]);
        must_fail(cmd, "input");
    }
    /* the input file itself, given as a file */
    snprintf(cmd, sizeof cmd, "%s convert --in %s/model.safetensors --out %s/model.safetensors --quiet", b, m, m);
    must_fail(cmd, "input");
    snprintf(cmd, sizeof cmd, "cmp -s '%s/model.safetensors' '%s/model.safetensors' && cmp -s '%s/config.json' '%s/config.json'", m,
             test_data("tiny"), m, test_data("tiny"));
    CHECK_MSG(system(cmd) == 0, "the input model was changed");
    snprintf(cmd, sizeof cmd, "%s info --model %s >/dev/null", b, m);
    CHECK_EQ_INT(test_sh(cmd, g_out, sizeof g_out, g_err, sizeof g_err), 0);
    /* a pack file as the input of logits / trace-out: refused the same way */
    snprintf(cmd, sizeof cmd, "%s logits --model %s --ids 1,2 --out %s/config.json", b, m, m);
    must_fail(cmd, "input");
    snprintf(cmd, sizeof cmd, "cmp -s '%s/config.json' '%s/config.json'", m, test_data("tiny"));
    CHECK(system(cmd) == 0);
    /* a new file inside the model folder that the model does not read is fine */
    snprintf(cmd, sizeof cmd, "%s logits --model %s --ids 1,2 --out %s/logits.f32", b, m, m);
    CHECK_EQ_INT(test_sh(cmd, g_out, sizeof g_out, g_err, sizeof g_err), 0);
}

/* The special files every writing option must refuse, left as they were. */
static void check_special_targets(const char *b, const char *what, const char *fmt) {
    char cmd[2048];
    const char *dir = tpath(what);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s' && echo keep > '%s/real' && ln -s real '%s/link' && mkfifo '%s/fifo'", dir, dir,
             dir, dir, dir);
    CHECK_EQ_INT(system(cmd), 0);
    char dev[700];
    snprintf(dev, sizeof dev, "%s/full", dir); /* a device node of our own (never /dev/...): /dev/full */
    snprintf(cmd, sizeof cmd, "mknod '%s' c 1 7 2>/dev/null", dev);
    int have_dev = system(cmd) == 0;
    const char *targets[] = {"link", "fifo", "full", "missing/x", ""};
    for (int i = 0; i < 5; i++) {
        if (i == 2 && !have_dev) continue;
        char t[800], c2[1600];
        snprintf(t, sizeof t, "%s/%s", dir, targets[i]);
        snprintf(c2, sizeof c2, fmt, t);
        snprintf(cmd, sizeof cmd, "timeout 60 %s %s </dev/null", b, c2);
        int rc = must_fail(cmd, NULL);
        CHECK_MSG(rc != 124, "%s: hung (opened the FIFO?)", cmd);
    }
    struct stat st;
    char p[800];
    snprintf(p, sizeof p, "%s/link", dir);
    CHECK(lstat(p, &st) == 0 && S_ISLNK(st.st_mode));
    snprintf(p, sizeof p, "%s/real", dir);
    CHECK_MSG(file_is(p, "keep\n"), "%s: written through the link", what);
    snprintf(p, sizeof p, "%s/fifo", dir);
    CHECK(lstat(p, &st) == 0 && S_ISFIFO(st.st_mode));
    if (have_dev) CHECK(lstat(dev, &st) == 0 && S_ISCHR(st.st_mode));
    snprintf(cmd, sizeof cmd, "ls '%s' | wc -l", dir);
    test_sh(cmd, g_out, sizeof g_out, g_err, sizeof g_err);
    CHECK_MSG(atoi(g_out) == 3 + have_dev, "%s: files left in %s: %s", what, dir, g_out);
}

TEST(files, convert_refuses_special_targets) {
    const char *b = bin();
    if (!b) return;
    char fmt[700];
    snprintf(fmt, sizeof fmt, "convert --in %s --out %%s --quiet", test_data("tiny"));
    check_special_targets(b, "sp-convert", fmt);
}

TEST(files, synth_logits_trace_refuse_special_targets) {
    const char *b = bin();
    if (!b) return;
    char fmt[700];
    check_special_targets(b, "sp-synth", "synth --shape glm5.2 --dense-layers 1 --moe-layers 0 --out %s --quiet");
    snprintf(fmt, sizeof fmt, "logits --model %s --ids 1,2,3 --out %%s", test_data("tiny"));
    check_special_targets(b, "sp-logits", fmt);
    snprintf(fmt, sizeof fmt, "generate --model %s --ids 1,2,3 -n 2 --trace-out %%s", test_data("tiny"));
    check_special_targets(b, "sp-trace", fmt);
}

/* ---- failures that used to exit 0 ---- */

TEST(files, trace_out_missing_folder_fails) {
    const char *b = bin();
    if (!b) return;
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s generate --model %s --ids 1,2,3 -n 2 --trace-out /nonexistent/t.txt", b, test_data("tiny"));
    must_fail(cmd, "--trace-out");
    CHECK_MSG(g_out[0] == 0, "generated before refusing: %s", g_out);
    /* a good trace is written whole, with no temporary left */
    const char *t = tpath("trace.txt");
    snprintf(cmd, sizeof cmd, "%s generate --model %s --ids 1,2,3 -n 2 --trace-out %s", b, test_data("tiny"), t);
    CHECK_EQ_INT(test_sh(cmd, g_out, sizeof g_out, g_err, sizeof g_err), 0);
    FILE *f = fopen(t, "r");
    CHECK(f != NULL);
    if (f) {
        char line[200] = "";
        CHECK(fgets(line, sizeof line, f) && !strncmp(line, "# petrel-trace v1", 17));
        fclose(f);
    }
    CHECK(!leftovers(t));
}

TEST(files, full_stdout_fails) {
    const char *b = bin();
    if (!b) return;
    const char *m = test_data("tiny");
    const char *cmds[] = {"generate --model %s --ids 1,2,3 -n 3", "info --model %s", "tokenize --model %s -- hello world",
                          "detokenize --model %s 72 101", "run --model %s -p hi -n 4 --seed 1", "logits --help", "info --help"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        char c2[1024], cmd[1400];
        snprintf(c2, sizeof c2, cmds[i], m);
        snprintf(cmd, sizeof cmd, "%s %s >/dev/full", b, c2);
        must_fail(cmd, "stdout");
    }
}

/* A write that fails (here: the file-size limit, EFBIG, a real write error) leaves no file at
 * all, and an existing file at the target as it was. */
TEST(files, failed_write_leaves_nothing) {
    const char *b = bin();
    if (!b) return;
    char cmd[2048];
    const char *lf = tpath("logits.f32");
    unlink(lf);
    snprintf(cmd, sizeof cmd, "(trap '' XFSZ; ulimit -f 1; exec %s logits --model %s --ids 1,2,3 --out %s)", b, test_data("tiny"), lf);
    must_fail(cmd, "write");
    CHECK_MSG(!exists(lf), "a failed logits write left %s", lf);
    CHECK(!leftovers(lf));
    write_text(lf, "old\n");
    must_fail(cmd, "write");
    CHECK_MSG(file_is(lf, "old\n"), "a failed logits write changed the existing %s", lf);
    CHECK(!leftovers(lf));
    /* convert: the pack cannot even be sized; nothing is left, not even a journal */
    const char *pk = tpath("efbig.pack");
    snprintf(cmd, sizeof cmd, "(trap '' XFSZ; ulimit -f 64; exec %s convert --in %s --out %s --quiet)", b, test_data("tiny"), pk);
    must_fail(cmd, NULL);
    CHECK(!exists(pk));
    CHECK_MSG(!leftovers(pk), "convert left files beside %s", pk);
}

/* ---- the strict parser ---- */

TEST(files, strict_sizes_and_counts) {
    const char *b = bin();
    if (!b) return;
    const char *m = test_data("tiny");
    const char *bad_budget[] = {"inf", "nan", "0", "0.5", "1.5G", "99999999T", "-1", "1e3", "", "4Gx", " 4G", "4 G", "0x10", "+4G", "4GG"};
    char cmd[1024];
    for (size_t i = 0; i < sizeof bad_budget / sizeof bad_budget[0]; i++) {
        snprintf(cmd, sizeof cmd, "%s info --model %s --mem-budget '%s'", b, m, bad_budget[i]);
        must_fail(cmd, "--mem-budget");
    }
    /* good sizes parse (then the folder is refused: budgets need a pack) */
    const char *good_budget[] = {"4G", "4096", "512M", "512MiB", "4GB", "1t", "64k"};
    for (size_t i = 0; i < sizeof good_budget / sizeof good_budget[0]; i++) {
        snprintf(cmd, sizeof cmd, "%s info --model %s --mem-budget '%s'", b, m, good_budget[i]);
        must_fail(cmd, "petrel pack");
    }
    const char *bad_counts[] = {"generate --model %s --ids 1 -n 1e3",     "generate --model %s --ids 1 -n ' 5'",
                                "generate --model %s --ids 1 -n 5x",      "generate --model %s --ids 1 -n -1",
                                "generate --model %s --ids 1 -n ''",      "info --model %s --threads -1",
                                "info --model %s --threads 2.5",          "info --model %s --expert-slots 0",
                                "info --model %s --expert-slots 99999999999999999999", "chat --model %s --ctx 0x100",
                                "run --model %s -p hi -n 1.5",            "run --model %s -p hi --seed 0x10",
                                "run --model %s -p hi --top-k +3",        "convert --in %s --out /nonexistent/x.pack --threads nan"};
    for (size_t i = 0; i < sizeof bad_counts / sizeof bad_counts[0]; i++) {
        char c2[512];
        snprintf(c2, sizeof c2, bad_counts[i], m);
        snprintf(cmd, sizeof cmd, "%s %s </dev/null", b, c2);
        must_fail(cmd, NULL);
        const char *flag = strstr(c2, " -"); /* the message names the flag */
        while (flag && strstr(flag + 1, " -")) flag = strstr(flag + 1, " -");
        if (flag) {
            char f[40];
            sscanf(flag + 1, "%39s", f);
            CHECK_MSG(strstr(g_err, f) != NULL, "%s: message does not name %s: %s", c2, f, g_err);
        }
    }
    /* 0 stays valid where it means something: generate -n 0 prints an empty line */
    snprintf(cmd, sizeof cmd, "%s generate --model %s --ids 1,2 -n 0", b, m);
    CHECK_EQ_INT(test_sh(cmd, g_out, sizeof g_out, g_err, sizeof g_err), 0);
    CHECK(!strcmp(g_out, "\n"));
}

/* ---- positions: the last generated token is never fed back ---- */

TEST(files, full_context_prompt_with_n1) {
    const char *b = bin();
    if (!b) return;
    static char cmd[8192], ids[4096];
    size_t k = 0;
    for (int i = 0; i < 512; i++) k += (size_t)snprintf(ids + k, sizeof ids - k, i ? ",%d" : "%d", 5 + (i * 7) % 900);
    snprintf(cmd, sizeof cmd, "%s generate --model %s --ids %s -n 1", b, test_data("tiny"), ids);
    CHECK_EQ_INT(test_sh(cmd, g_out, sizeof g_out, g_err, sizeof g_err), 0);
    CHECK_MSG(g_err[0] == 0, "stderr: %s", g_err);
    int v = -1;
    CHECK(sscanf(g_out, "%d", &v) == 1 && v >= 0 && v < 1024);
    /* two tokens need 513 positions: refused with one line */
    snprintf(cmd, sizeof cmd, "%s generate --model %s --ids %s -n 2", b, test_data("tiny"), ids);
    must_fail(cmd, NULL);
}

/* ---- chat goes on ---- */

TEST(files, chat_refuses_what_cannot_fit_and_goes_on) {
    const char *b = bin();
    if (!b) return;
    const char *in = tpath("chat-in.txt");
    FILE *f = fopen(in, "w");
    CHECK(f != NULL);
    if (!f) return;
    fputs("hello\n", f);
    for (int i = 0; i < 800; i++) fputs("word ", f); /* far more than 512 tokens */
    fputs("\n\xff\xfe bad bytes\nagain\n/clear\nonce more\n", f);
    fclose(f);
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "%s chat --model %s -n 3 --seed 3 --no-think --ctx 99999 < %s", b, test_data("tiny"), in);
    CHECK_EQ_INT(test_sh(cmd, g_out, sizeof g_out, g_err, sizeof g_err), 0);
    CHECK_MSG(strstr(g_err, "message refused") && strstr(g_err, "fit in the 512-token context"), "stderr: %s", g_err);
    CHECK_MSG(strstr(g_err, "raise --ctx") == NULL, "advice that cannot be followed (--ctx is at the maximum): %s", g_err);
    CHECK_MSG(strstr(g_err, "invalid UTF-8 at byte 0"), "stderr: %s", g_err);
    CHECK_MSG(strstr(g_err, "history cleared"), "stderr: %s", g_err);
    CHECK_MSG(test_count_lines(g_err) == 3, "stderr: %s", g_err);
    /* three replies (hello, again, once more), each ending with a newline */
    CHECK_MSG(test_count_lines(g_out) >= 3, "stdout: %s", g_out);
    /* with room to grow, the hint names --ctx too */
    snprintf(cmd, sizeof cmd, "%s chat --model %s -n 3 --seed 3 --no-think --ctx 64 < %s", b, test_data("tiny"), in);
    CHECK_EQ_INT(test_sh(cmd, g_out, sizeof g_out, g_err, sizeof g_err), 0);
    CHECK_MSG(strstr(g_err, "raise --ctx, up to 512"), "stderr: %s", g_err);
}

/* ---- faults injected through the write seam during convert ---- */

typedef struct wfault {
    int mode;      /* 1 ENOSPC from write k on; 2 EIO on every sync; 3 every write short (half);
                      4 write k short, then ENOSPC; 5 write k makes no progress */
    int k;
    int count;
} wfault;

static int fault_hook(void *ctx, int op, int fd, uint64_t off, size_t *n) {
    (void)fd;
    (void)off;
    wfault *w = ctx;
    if (op == PT_WOP_SYNC) return w->mode == 2 ? EIO : 0;
    int i = __atomic_fetch_add(&w->count, 1, __ATOMIC_RELAXED);
    switch (w->mode) {
    case 1: return i >= w->k ? ENOSPC : 0;
    case 3: if (*n > 1) *n /= 2; return 0;
    case 4:
        if (i == w->k && *n > 1) { *n /= 2; return 0; }
        return i > w->k ? ENOSPC : 0;
    case 5: if (i == w->k) *n = 0; return 0;
    }
    return 0;
}

static int convert_with(const char *out, wfault *w, convert_result *res, petrel_error *err) {
    convert_opts o = {0};
    o.quant = CVQ_Q8;
    pt_write_fault_ctx = w;
    pt_write_fault_hook = w ? fault_hook : NULL;
    int rc = convert_hf(test_data("tiny"), out, &o, res, err);
    pt_write_fault_hook = NULL;
    pt_write_fault_ctx = NULL;
    return rc;
}

/* A good pack at path: opens and every checksum verifies. */
static int good_pack(const char *path) {
    pack *p = NULL;
    petrel_error e = {0};
    if (pack_open(path, &p, &e) < 0) return 0;
    int ok = pack_verify(p, &e) == 0;
    pack_close(p);
    return ok;
}

/* After a failed convert: one line, no pack at out, and nothing beside it that opens as one. */
static void check_failed(int rc, const petrel_error *e, const char *out, const char *want) {
    CHECK_MSG(rc < 0, "convert succeeded under the fault");
    CHECK_MSG(e->msg[0] && !strchr(e->msg, '\n'), "message: %s", e->msg);
    if (want) CHECK_MSG(strstr(e->msg, want) != NULL, "message lacks \"%s\": %s", want, e->msg);
    CHECK_MSG(!exists(out), "a failed convert left %s", out);
    char partial[700];
    snprintf(partial, sizeof partial, "%s.partial", out);
    if (exists(partial)) {
        pack *p = NULL;
        petrel_error pe = {0};
        int opened = pack_open(partial, &p, &pe) == 0;
        if (opened) pack_close(p);
        CHECK_MSG(!opened, "%s opens as a pack after a failure", partial);
        char mark[9] = {0};
        FILE *f = fopen(partial, "rb");
        if (f) {
            CHECK(fread(mark, 1, 8, f) == 8);
            fclose(f);
        }
        CHECK_MSG(!strcmp(mark, "PETRELPT"), "%s does not say it is an unfinished conversion", partial);
        CHECK_MSG(strstr(e->msg, "resum") != NULL, "a partial output is kept but the message does not say so: %s", e->msg);
    }
}

TEST(files, convert_enospc_then_resume) {
    const char *out = tpath("enospc.pack");
    petrel_error e = {0};
    convert_result r;
    wfault w = {1, 5, 0};
    int rc = convert_with(out, &w, &r, &e);
    check_failed(rc, &e, out, "No space left");
    char partial[700];
    snprintf(partial, sizeof partial, "%s.partial", out);
    CHECK_MSG(exists(partial), "the items written before the fault were not kept for resuming");
    memset(&e, 0, sizeof e);
    rc = convert_with(out, NULL, &r, &e);
    CHECK_MSG(rc == 0, "resume after ENOSPC: %s", e.msg);
    CHECK(r.resumed > 0);
    CHECK(good_pack(out));
    CHECK(!exists(partial));
}

TEST(files, convert_enospc_at_first_write_leaves_nothing) {
    const char *out = tpath("enospc0.pack");
    petrel_error e = {0};
    convert_result r;
    wfault w = {1, 0, 0};
    int rc = convert_with(out, &w, &r, &e);
    check_failed(rc, &e, out, "No space left");
    CHECK_MSG(!leftovers(out), "files left beside %s with nothing to resume", out);
}

TEST(files, convert_eio_on_sync) {
    const char *out = tpath("eio.pack");
    petrel_error e = {0};
    convert_result r;
    wfault w = {2, 0, 0};
    int rc = convert_with(out, &w, &r, &e);
    check_failed(rc, &e, out, "Input/output error");
    /* every item was written before the header's sync failed: a rerun resumes them all */
    memset(&e, 0, sizeof e);
    rc = convert_with(out, NULL, &r, &e);
    CHECK_MSG(rc == 0, "rerun after EIO: %s", e.msg);
    CHECK(good_pack(out));
}

TEST(files, convert_short_writes) {
    /* short writes alone are completed: the pack is whole and verifies */
    const char *out = tpath("short.pack");
    petrel_error e = {0};
    convert_result r;
    wfault w = {3, 0, 0};
    int rc = convert_with(out, &w, &r, &e);
    CHECK_MSG(rc == 0, "convert with short writes: %s", e.msg);
    CHECK(w.count > 0);
    CHECK(good_pack(out));
    /* a short write and then a full disk fails; one that makes no progress fails */
    const char *out2 = tpath("short-enospc.pack");
    wfault w2 = {4, 3, 0};
    memset(&e, 0, sizeof e);
    rc = convert_with(out2, &w2, &r, &e);
    check_failed(rc, &e, out2, "No space left");
    const char *out3 = tpath("noprogress.pack");
    wfault w3 = {5, 2, 0};
    memset(&e, 0, sizeof e);
    rc = convert_with(out3, &w3, &r, &e);
    check_failed(rc, &e, out3, "no progress");
}

/* The outfile module itself: a failed write or sync removes the temporary and keeps the old
 * target; the trace writer goes through it. */
TEST(files, outfile_whole_or_nothing) {
    const char *p = tpath("whole.txt");
    write_text(p, "old\n");
    for (int mode = 1; mode <= 2; mode++) {
        wfault w = {mode, 0, 0};
        pt_write_fault_ctx = &w;
        pt_write_fault_hook = fault_hook;
        pt_outfile o;
        petrel_error e = {0};
        int rc = pt_out_open(&o, p, NULL, &e);
        CHECK_EQ_INT(rc, 0);
        if (rc == 0) {
            pt_out_printf(&o, "new %d\n", mode);
            rc = pt_out_commit(&o, &e);
        }
        pt_write_fault_hook = NULL;
        CHECK(rc < 0 && e.msg[0] && !strchr(e.msg, '\n'));
        CHECK(file_is(p, "old\n"));
        CHECK(!leftovers(p));
    }
    xs_trace t;
    CHECK_EQ_INT(xs_trace_init(&t, 2, 8, 2), 0);
    int32_t ids[2] = {1, 3};
    petrel_error e = {0};
    CHECK_EQ_INT(xs_trace_add(&t, 0, 0, ids, 2, &e), 0);
    wfault w = {1, 0, 0};
    pt_write_fault_ctx = &w;
    pt_write_fault_hook = fault_hook;
    int rc = xs_trace_write(&t, p, &e);
    pt_write_fault_hook = NULL;
    CHECK(rc < 0 && strstr(e.msg, "trace"));
    CHECK(file_is(p, "old\n"));
    CHECK(!leftovers(p));
    CHECK_EQ_INT(xs_trace_write(&t, p, &e), 0);
    CHECK(!file_is(p, "old\n"));
    xs_trace_deinit(&t);
    /* a safetensors file (bench --golden-out's reference) the same way */
    write_text(p, "old\n");
    float v[3] = {1, 2, 3};
    st_write_tensor ts = {"v", ST_F32, 1, {3}, v};
    wfault ws = {1, 0, 0};
    pt_write_fault_ctx = &ws;
    pt_write_fault_hook = fault_hook;
    rc = st_write(p, &ts, 1, &e);
    pt_write_fault_hook = NULL;
    CHECK(rc < 0 && e.msg[0] && !strchr(e.msg, '\n'));
    CHECK(file_is(p, "old\n"));
    CHECK(!leftovers(p));
    CHECK_EQ_INT(st_write(p, &ts, 1, &e), 0);
    st_set *st = NULL;
    CHECK_MSG(st_open(p, &st, &e) == 0, "%s", e.msg);
    if (st) {
        const st_tensor *tv = st_find(st, "v");
        CHECK(tv && tv->shape[0] == 3 && !memcmp(tv->data, v, sizeof v));
        st_close(st);
    }
    /* refused targets */
    CHECK(pt_out_check(test_tmpdir(), NULL, &e) < 0);
    CHECK(pt_out_check("/nonexistent/x", NULL, &e) < 0);
    char cfg[600];
    snprintf(cfg, sizeof cfg, "%s/config.json", test_data("tiny"));
    CHECK(pt_out_check(cfg, test_data("tiny"), &e) < 0);
}

/* More targets of the same kinds: a socket, a link to a folder, a trailing slash, the input
 * reached through "..", through a linked folder, or as a hard link of a pack. */
TEST(files, more_refused_targets) {
    const char *dir = tpath("more");
    char cmd[2400];
    snprintf(cmd, sizeof cmd,
             "rm -rf '%s' && mkdir -p '%s/sub' && cp -r '%s' '%s/m' && ln -s m '%s/mlink' && ln -s sub '%s/dlink' && "
             "python3 -c \"import socket,sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])\" '%s/sock'",
             dir, dir, test_data("tiny"), dir, dir, dir, dir);
    int have_sock = system(cmd) == 0;
    petrel_error e = {0};
    char p[900], m[900];
    snprintf(m, sizeof m, "%s/m", dir);
    if (have_sock) {
        snprintf(p, sizeof p, "%s/sock", dir);
        CHECK(pt_out_check(p, NULL, &e) < 0 && strstr(e.msg, "socket"));
    }
    snprintf(p, sizeof p, "%s/dlink", dir);
    CHECK(pt_out_check(p, NULL, &e) < 0 && strstr(e.msg, "symbolic link"));
    snprintf(p, sizeof p, "%s/new/", dir);
    CHECK(pt_out_check(p, NULL, &e) < 0);
    snprintf(p, sizeof p, "%s/sub/../m/config.json", dir);
    CHECK_MSG(pt_out_check(p, m, &e) < 0 && strstr(e.msg, "input"), "%s: %s", p, e.msg);
    snprintf(p, sizeof p, "%s/mlink/model.safetensors", dir);
    CHECK_MSG(pt_out_check(p, m, &e) < 0 && strstr(e.msg, "input"), "%s: %s", p, e.msg);
    snprintf(p, sizeof p, "%s/m/model.safetensors", dir);
    CHECK_MSG(pt_out_check(p, m, &e) < 0, "%s: %s", p, e.msg);
    /* the input given as its single file: the file and its folder's model files are refused */
    char mf[900];
    snprintf(mf, sizeof mf, "%s/m/model.safetensors", dir);
    snprintf(p, sizeof p, "%s/m/config.json", dir);
    CHECK(pt_out_check(p, mf, &e) < 0);
    /* fine: a new name in the model folder that the model does not read, and a new file */
    snprintf(p, sizeof p, "%s/m/model.pack", dir);
    CHECK_MSG(pt_out_check(p, m, &e) == 0, "%s: %s", p, e.msg);
    snprintf(p, sizeof p, "%s/sub/out.bin", dir);
    CHECK_MSG(pt_out_check(p, m, &e) == 0, "%s: %s", p, e.msg);
    /* a hard link of a pack is the pack: logits --out refuses it */
    const char *b = bin();
    if (!b) return;
    snprintf(cmd, sizeof cmd, "%s convert --in %s --out %s/t.pack --quiet 2>/dev/null && ln %s/t.pack %s/t2.pack", b, test_data("tiny"), dir, dir, dir);
    CHECK_EQ_INT(system(cmd), 0);
    snprintf(cmd, sizeof cmd, "%s logits --model %s/t.pack --ids 1,2 --out %s/t2.pack", b, dir, dir);
    must_fail(cmd, "input");
    snprintf(cmd, sizeof cmd, "%s generate --model %s/t.pack --ids 1,2 -n 2 --trace-out %s/t.pack", b, dir, dir);
    must_fail(cmd, "input");
    snprintf(p, sizeof p, "%s/t.pack", dir);
    CHECK(good_pack(p));
}

TEST(files, more_sizes_and_counts) {
    const char *b = bin();
    if (!b) return;
    const char *m = test_data("tiny");
    char cmd[1024];
    const char *good[] = {"4gib", "00004G", "4KiB", "1B", "8tb"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        snprintf(cmd, sizeof cmd, "%s info --model %s --mem-budget '%s'", b, m, good[i]);
        must_fail(cmd, "petrel pack"); /* parsed; then refused: budgets need a pack */
    }
    const char *bad[] = {"1E", "4iB", "4Bi", "4G ", "4,5G", "18446744073709551616", "16777216T", "-0", "Infinity", "1G1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(cmd, sizeof cmd, "%s info --model %s --mem-budget '%s'", b, m, bad[i]);
        must_fail(cmd, "--mem-budget");
    }
    const char *bad_counts[] = {"generate --model %s --ids 1 -n 99999999999999999999", "generate --model %s --ids 1 -n 16777217",
                                "chat --model %s --ctx 1", "info --model %s --threads 1025", "run --model %s -p hi -n -2",
                                "run --model %s -p hi --seed -1", "run --model %s -p hi --seed 18446744073709551616",
                                "synth --shape glm5.2 --dense-layers 79 --out /nonexistent/x.pack"};
    for (size_t i = 0; i < sizeof bad_counts / sizeof bad_counts[0]; i++) {
        char c2[512];
        snprintf(c2, sizeof c2, bad_counts[i], m);
        snprintf(cmd, sizeof cmd, "%s %s </dev/null", b, c2);
        must_fail(cmd, NULL);
    }
    /* the system message alone filling the context: every message refused, said once each */
    const char *in = tpath("chat-sys.txt");
    write_text(in, "hi\nthere\n");
    static char sys[4000];
    size_t k = 0;
    for (int i = 0; i < 600; i++) k += (size_t)snprintf(sys + k, sizeof sys - k, "sys ");
    static char c3[6000];
    snprintf(c3, sizeof c3, "%s chat --model %s -n 2 --no-think --system '%s' < %s", b, m, sys, in);
    CHECK_EQ_INT(test_sh(c3, g_out, sizeof g_out, g_err, sizeof g_err), 0);
    CHECK_MSG(test_count_lines(g_err) == 2 && strstr(g_err, "shorten --system"), "stderr: %s", g_err);
}
