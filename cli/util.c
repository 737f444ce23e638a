/* util.c: argument parsing helpers shared by the subcommands. */
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "model/engine.h"
#include "kernels/kernels.h"
#include "io/pack.h"

void cli_progress_fn(void *user, long long done, long long total) {
    cli_progress *p = user;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double now = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    if (total != p->total || done <= 0 || p->t0 == 0) { /* a new forward call */
        p->total = total;
        p->t0 = now;
        p->shown = 0;
        p->last_pct = -1;
    }
    if (!p->verbose && !isatty(STDERR_FILENO)) return;
    int pct = total > 0 ? (int)(100 * done / total) : 100;
    if (!p->shown && now - p->t0 < 1.0) return;
    if (pct == p->last_pct) return;
    p->shown = 1;
    p->last_pct = pct;
    fprintf(stderr, "\rprompt: %3d%% (%.0f s)", pct, now - p->t0);
    if (done >= total) {
        fputc('\n', stderr);
        p->t0 = 0;
    }
    fflush(stderr);
}

int cli_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("petrel: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 1;
}

int cli_fail_err(const char *what, const petrel_error *err) {
    fprintf(stderr, "petrel: %s: %s\n", what, err->msg[0] ? err->msg : "unknown error");
    return 1;
}

int cli_parse_ids(const char *s, int32_t **out, char *msg, size_t msgsz) {
    size_t cap = 16, n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids) { snprintf(msg, msgsz, "out of memory"); return -1; }
    const char *p = s;
    for (;;) {
        while (*p == ' ' || *p == ',' || *p == '\t' || *p == '\n') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end && *end != ',' && *end != ' ' && *end != '\t' && *end != '\n')) {
            snprintf(msg, msgsz, "bad token id near \"%.20s\" (want non-negative integers separated by commas)", p);
            free(ids);
            return -1;
        }
        if (n == cap) {
            cap *= 2;
            int32_t *t = realloc(ids, cap * sizeof *ids);
            if (!t) { free(ids); snprintf(msg, msgsz, "out of memory"); return -1; }
            ids = t;
        }
        ids[n++] = (int32_t)v;
        p = end;
    }
    *out = ids;
    return (int)n;
}

int cli_parse_size(const char *s, uint64_t *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno || v < 0) return -1;
    double mul = 1;
    switch (*end) {
    case 'k': case 'K': mul = 1024.0; end++; break;
    case 'm': case 'M': mul = 1024.0 * 1024; end++; break;
    case 'g': case 'G': mul = 1024.0 * 1024 * 1024; end++; break;
    case 't': case 'T': mul = 1024.0 * 1024 * 1024 * 1024; end++; break;
    default: break;
    }
    if (*end == 'i' || *end == 'B' || *end == 'b') end++;
    if (*end == 'B') end++;
    if (*end) return -1;
    *out = (uint64_t)(v * mul);
    return 0;
}

int cli_parse_int(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int cli_model_opt(int argc, char **argv, int *i, cli_model_opts *mo) {
    const char *a = argv[*i];
    int is_model = !strcmp(a, "--model") || !strcmp(a, "-m");
    int is_thr = !strcmp(a, "--threads") || !strcmp(a, "-t");
    int is_bud = !strcmp(a, "--mem-budget");
    int is_slots = !strcmp(a, "--expert-slots");
    int is_trace = !strcmp(a, "--trace-out");
    int is_verbose = !strcmp(a, "--verbose") || !strcmp(a, "-v");
    if (is_verbose) { mo->open.verbose = 1; return 1; }
    if (!strcmp(a, "--no-verify")) { mo->open.no_verify = 1; return 1; }
    if (!is_model && !is_thr && !is_bud && !is_slots && !is_trace) return 0;
    if (*i + 1 >= argc) { cli_fail("%s needs a value", a); return -1; }
    const char *v = argv[++*i];
    long n;
    if (is_model) mo->model = v;
    else if (is_trace) mo->open.trace_out = v;
    else if (is_thr) {
        if (cli_parse_int(v, 0, 1024, &n)) { cli_fail("--threads: \"%s\" is not a number in 0..1024", v); return -1; }
        mo->open.n_threads = (int)n;
    } else if (is_bud) {
        if (cli_parse_size(v, &mo->open.mem_budget)) { cli_fail("--mem-budget: \"%s\" is not a size (e.g. 4G, 512M)", v); return -1; }
    } else {
        if (cli_parse_int(v, 1, 1 << 16, &n)) { cli_fail("--expert-slots: \"%s\" is not a number >= 1", v); return -1; }
        mo->open.expert_slots = (int)n;
    }
    return 1;
}

int cli_engine_open(const cli_model_opts *mo, petrel_engine **eng, petrel_error *err) {
    int rc = petrel_engine_open(mo->model, &mo->open, eng, err);
    if (rc == 0 && (mo->open.mem_budget || mo->open.expert_slots)) {
        const char *plan = petrel_engine_plan(*eng);
        if (plan && *plan) fprintf(stderr, "petrel: memory plan for %s:\n%s%s", mo->model, plan, plan[strlen(plan) - 1] == '\n' ? "" : "\n");
    }
    if (rc == 0 && (*eng)->pack && pack_has_r16((*eng)->pack) && !kn_r16_available())
        fprintf(stderr, "petrel: note: %s stores its experts for AVX-512 VNNI kernels, which this CPU lacks; they run on the slow scalar path "
                        "(reconvert with --expert-layout plain)\n", mo->model);
    return rc;
}
