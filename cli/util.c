/* util.c: argument parsing helpers shared by the subcommands. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/err.h"
#include "base/outfile.h"
#include "cli.h"

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

/* cli_parse_size / cli_parse_int and the other strict parsers: cli/parse.c */

int cli_out_check(const char *cmd, const char *path, const char *input) {
    petrel_error e = {0};
    if (pt_out_check(path, input, &e) == 0) return 0;
    return cli_fail("%s: %s", cmd, e.msg);
}

/* Kernel choices: --act-quant on|off|q8, --relayout on|off, --isa NAME, --prefetch P (see
 * petrel_open_opts); the KV and GPU options. */
static int kernel_opt(int argc, char **argv, int *i, cli_model_opts *mo) {
    const char *a = argv[*i];
    int aq = !strcmp(a, "--act-quant"), rl = !strcmp(a, "--relayout"), isa = !strcmp(a, "--isa");
    int kvt = !strcmp(a, "--kv-type"), kvs = !strcmp(a, "--kv-size");
    int dev = !strcmp(a, "--device"), vram = !strcmp(a, "--vram-budget"), vslots = !strcmp(a, "--vram-expert-slots");
    int hexp = !strcmp(a, "--host-experts"), pf = !strcmp(a, "--prefetch");
    if (!aq && !rl && !isa && !kvt && !kvs && !dev && !vram && !vslots && !hexp && !pf) return 0;
    if (*i + 1 >= argc) { cli_fail("%s needs a value", a); return -1; }
    const char *v = argv[++*i];
    if (pf) { /* off | auto | BYTES, then :l1 / :l2 and :half / :all (not after off) */
        char base[32];
        long n = 0;
        int lv = 0, lines = 0, bad = 0;
        const char *colon = strchr(v, ':');
        size_t bl = colon ? (size_t)(colon - v) : strlen(v);
        if (bl == 0 || bl >= sizeof base) bad = 1;
        else {
            memcpy(base, v, bl);
            base[bl] = 0;
            char *end;
            if (!strcmp(base, "auto")) n = 0;
            else if (!strcmp(base, "off")) n = -1, bad = colon != NULL;
            else if (n = strtol(base, &end, 10), *end || n < 64 || n > 65536) bad = 1;
        }
        for (const char *c = colon; c && !bad; c = strchr(c + 1, ':')) {
            const char *e = strchr(c + 1, ':');
            size_t l = e ? (size_t)(e - c - 1) : strlen(c + 1);
            if (l == 2 && !strncmp(c + 1, "l1", 2) && !lv) lv = 1;
            else if (l == 2 && !strncmp(c + 1, "l2", 2) && !lv) lv = 2;
            else if (l == 4 && !strncmp(c + 1, "half", 4) && !lines) lines = 1;
            else if (l == 3 && !strncmp(c + 1, "all", 3) && !lines) lines = 2;
            else bad = 1;
        }
        if (bad) {
            cli_fail("--prefetch: \"%s\" is not off, or auto or BYTES (64 .. 65536) with optional :l1 or :l2 and :half or :all", v);
            return -1;
        }
        mo->open.prefetch = (int)n;
        mo->open.prefetch_level = lv;
        mo->open.prefetch_lines = lines;
    } else if (dev) {
        mo->open.device = v; /* checked by the engine's open before it loads anything */
    } else if (vram) {
        if (cli_opt_size(NULL, "--vram-budget", v, 1, CLI_SIZE_MAX, &mo->open.vram_budget)) return -1;
    } else if (hexp) {
        if (!strcmp(v, "auto")) mo->open.host_experts = 1;
        else if (!strcmp(v, "off")) mo->open.host_experts = 0;
        else { cli_fail("--host-experts: \"%s\" is not auto or off", v); return -1; }
    } else if (vslots) {
        long n;
        if (cli_opt_count(NULL, "--vram-expert-slots", v, 1, 1 << 16, &n)) return -1;
        mo->open.vram_expert_slots = (int)n;
    } else if (kvt) {
        if (strcmp(v, "f32") && strcmp(v, "bf16") && strcmp(v, "int8") && strcmp(v, "auto")) {
            cli_fail("--kv-type: \"%s\" is not one of f32, bf16, int8, auto", v);
            return -1;
        }
        mo->open.kv_type = v;
    } else if (kvs) {
        if (cli_opt_size(NULL, "--kv-size", v, 1, CLI_SIZE_MAX, &mo->open.kv_bytes)) return -1;
    } else if (isa) {
        if (strcmp(v, "auto") && strcmp(v, "scalar") && strcmp(v, "avx2") && strcmp(v, "avx512") && strcmp(v, "amx") &&
            strcmp(v, "amx-bf16")) {
            cli_fail("--isa: \"%s\" is not one of scalar, avx2, avx512, amx, amx-bf16, auto", v);
            return -1;
        }
        mo->open.isa = v;
    } else if (aq) {
        if (!strcmp(v, "on")) mo->open.act_quant = 1;
        else if (!strcmp(v, "off")) mo->open.act_quant = -1;
        else if (!strcmp(v, "q8")) mo->open.act_quant = 2;
        else { cli_fail("--act-quant: \"%s\" is not on, off or q8", v); return -1; }
    } else {
        if (!strcmp(v, "on")) mo->open.relayout = 1;
        else if (!strcmp(v, "off")) mo->open.relayout = -1;
        else { cli_fail("--relayout: \"%s\" is not on or off", v); return -1; }
    }
    return 1;
}

/* --lora DIR[=SCALE] (the last '=' followed by a number) and --lora-merge. */
static int lora_opt(int argc, char **argv, int *i, cli_model_opts *mo) {
    const char *a = argv[*i];
    if (!strcmp(a, "--lora-merge")) {
        mo->open.lora_merge = 1;
        return 1;
    }
    if (strcmp(a, "--lora")) return 0;
    if (*i + 1 >= argc) { cli_fail("--lora needs an adapter folder (DIR or DIR=SCALE)"); return -1; }
    const char *v = argv[++*i];
    if (mo->open.n_lora >= 8) { cli_fail("--lora: at most 8 adapters"); return -1; }
    int k = mo->open.n_lora;
    const char *eq = strrchr(v, '=');
    float scale = 1.0f;
    size_t dl = strlen(v);
    if (eq) {
        char *end;
        errno = 0;
        double d = strtod(eq + 1, &end);
        if (eq[1] && !*end && !errno && isfinite(d)) {
            scale = (float)d;
            dl = (size_t)(eq - v);
            if (d == 0) { cli_fail("--lora %s: a scale of 0 applies nothing (leave the adapter out)", v); return -1; }
        }
    }
    if (!dl || dl >= sizeof mo->lora_dir[k]) { cli_fail("--lora \"%s\": want an adapter folder, DIR or DIR=SCALE", v); return -1; }
    memcpy(mo->lora_dir[k], v, dl);
    mo->lora_dir[k][dl] = 0;
    mo->lora[k] = (petrel_lora_spec){mo->lora_dir[k], NULL, scale};
    mo->open.n_lora = k + 1;
    return 1;
}

int cli_model_opt(int argc, char **argv, int *i, cli_model_opts *mo) {
    int kr = kernel_opt(argc, argv, i, mo);
    if (kr) return kr;
    if ((kr = lora_opt(argc, argv, i, mo))) return kr;
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
        if (cli_opt_count(NULL, "--threads", v, 0, 1024, &n)) return -1;
        mo->open.n_threads = (int)n;
    } else if (is_bud) {
        if (cli_opt_size(NULL, "--mem-budget", v, 1, CLI_SIZE_MAX, &mo->open.mem_budget)) return -1;
    } else {
        if (cli_opt_count(NULL, "--expert-slots", v, 1, 1 << 16, &n)) return -1;
        mo->open.expert_slots = (int)n;
    }
    return 1;
}

int cli_engine_open(const cli_model_opts *mo, petrel_engine **eng, petrel_error *err) {
    *eng = NULL;
    if (mo->open.trace_out && pt_out_check(mo->open.trace_out, mo->model, err) < 0) /* before minutes of loading */
        return pt_err_ctx(err, "--trace-out");
    petrel_open_opts oo = mo->open;
    if (oo.n_lora) oo.lora = mo->lora;
    if (oo.lora_merge && !oo.n_lora) return pt_err(err, PETREL_EINVAL, "--lora-merge without --lora: no adapter to merge");
    oo.load_progress = oo.load_progress || isatty(STDERR_FILENO); /* a long load must not look hung */
    int rc = petrel_engine_open(mo->model, &oo, eng, err);
    if (rc == 0 && (mo->open.mem_budget || mo->open.expert_slots || mo->open.verbose)) { /* resident: with -v */
        const char *plan = petrel_engine_plan(*eng);
        if (plan && *plan) fprintf(stderr, "petrel: memory plan for %s:\n%s%s", mo->model, plan, plan[strlen(plan) - 1] == '\n' ? "" : "\n");
    }
    if (rc == 0 && mo->open.verbose && mo->open.device) fprintf(stderr, "petrel: device %s\n", petrel_engine_device(*eng));
    const char *note = rc == 0 ? petrel_engine_note(*eng) : "";
    if (*note) fprintf(stderr, "petrel: note: %s %s\n", mo->model, note);
    return rc;
}

int cli_engine_close(const char *cmd, petrel_engine *eng, int rc) {
    petrel_error err = {0};
    if (rc == 0 && eng && petrel_engine_finish(eng, &err) < 0) rc = cli_fail_err(cmd, &err);
    petrel_engine_close(eng);
    return rc;
}
