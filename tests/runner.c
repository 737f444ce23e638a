/* runner.c: runs the registered tests. Usage: petrel-tests [GROUP|GROUP.NAME ...]
 * With no argument every test runs. Prints one line per failure and a final
 * "N passed, N failed" line; exits non-zero if anything failed. */
#include "test.h"


#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_TESTS 4096
static struct { const char *group, *name; test_fn fn; } tests[MAX_TESTS];
static int n_tests;
static int cur_failed, cur_skipped;
static const char *cur_group, *cur_name;

void test_register(const char *group, const char *name, test_fn fn) {
    if (n_tests < MAX_TESTS) {
        tests[n_tests].group = group;
        tests[n_tests].name = name;
        tests[n_tests].fn = fn;
        n_tests++;
    }
}

void test_fail(const char *file, int line, const char *fmt, ...) {
    if (cur_failed < 20) {
        fprintf(stderr, "FAIL %s.%s %s:%d: ", cur_group, cur_name, file, line);
        va_list ap;
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        fputc('\n', stderr);
    }
    cur_failed++;
}

void test_skip(const char *why) {
    if (!cur_skipped) fprintf(stderr, "skip    %s.%s: %s\n", cur_group, cur_name, why);
    cur_skipped = 1;
}

const char *test_data(const char *rel) {
    static char bufs[8][1024];
    static int slot;
    const char *root = getenv("PETREL_TEST_DATA");
    if (!root) root = "tests/data";
    char *b = bufs[slot++ & 7];
    snprintf(b, 1024, "%s/%s", root, rel);
    return b;
}

static char tmpdir[256];
static void rm_tmpdir(void) {
    if (tmpdir[0] && !getenv("PETREL_KEEP_TMP")) {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
    }
}
const char *test_tmpdir(void) {
    if (!tmpdir[0]) {
        snprintf(tmpdir, sizeof tmpdir, "/tmp/petrel-test-XXXXXX");
        if (!mkdtemp(tmpdir)) {
            perror("mkdtemp");
            exit(2);
        }
        atexit(rm_tmpdir);
    }
    return tmpdir;
}

void *test_read_file(const char *path, size_t *n) {
    if (n) *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *b = NULL;
    long sz = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    if (sz >= 0 && fseek(f, 0, SEEK_SET) == 0 && (b = malloc((size_t)sz + 1)) && fread(b, 1, (size_t)sz, f) != (size_t)sz) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (!b) return NULL;
    b[sz] = 0;
    if (n) *n = (size_t)sz;
    return b;
}

const char *test_tmp(const char *name) {
    static char bufs[8][600];
    static int slot;
    char *b = bufs[slot++ & 7];
    snprintf(b, sizeof bufs[0], "%s/%s", test_tmpdir(), name);
    return b;
}

double test_rel_l2(const float *a, const float *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

int test_sh(const char *cmd, char *out, size_t cap, char *errbuf, size_t ecap) {
    char full[8192], ef[300];
    snprintf(ef, sizeof ef, "%s/sh_stderr.txt", test_tmpdir());
    snprintf(full, sizeof full, "%s 2>%s", cmd, ef);
    FILE *p = popen(full, "r");
    if (!p) return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    while (fgetc(p) != EOF) {} /* drain what did not fit */
    int st = pclose(p);
    FILE *f = fopen(ef, "r");
    size_t m = f ? fread(errbuf, 1, ecap - 1, f) : 0;
    errbuf[m] = 0;
    if (f) fclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

int test_count_lines(const char *s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

static int selected(int i, int argc, char **argv) {
    if (argc <= 1) return 1;
    char full[256];
    snprintf(full, sizeof full, "%s.%s", tests[i].group, tests[i].name);
    for (int a = 1; a < argc; a++)
        if (!strcmp(argv[a], tests[i].group) || !strcmp(argv[a], full)) return 1;
    return 0;
}

int main(int argc, char **argv) {
    int passed = 0, failed = 0, skipped = 0;
    for (int i = 0; i < n_tests; i++) {
        if (!selected(i, argc, argv)) continue;
        cur_group = tests[i].group;
        cur_name = tests[i].name;
        cur_failed = 0;
        cur_skipped = 0;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        tests[i].fn();
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
        if (cur_skipped && !cur_failed) {
            skipped++;
            continue;
        }
        if (cur_failed) {
            failed++;
            fprintf(stderr, "not ok  %s.%s (%d checks failed)\n", cur_group, cur_name, cur_failed);
        } else {
            passed++;
            if (getenv("PETREL_TEST_VERBOSE")) fprintf(stderr, "ok      %s.%s (%.1f ms)\n", cur_group, cur_name, ms);
        }
    }
    if (skipped) printf("%d passed, %d failed, %d skipped (named above on stderr)\n", passed, failed, skipped);
    else printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
