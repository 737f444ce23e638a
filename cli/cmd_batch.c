/* cmd_batch.c: `petrel batch` runs many prompts as one continuously batched greedy generation.
 *
 * Every prompt gets a session; up to --max-batch sessions run at once. Each forward is one
 * petrel_batch_forward over rows of several sessions: first one decode row per generating
 * session, then prompt chunks of the sessions still reading their prompts, up to --max-rows rows
 * in all. A session that has its N tokens frees its place for the next prompt. Rows are
 * independent of their batch (bitwise), so each prompt's tokens are exactly those of
 * `petrel generate` on it alone. Results are printed in input order, "INDEX: ids" (INDEX is the
 * prompt's 0-based line index) or "INDEX: text" with --text. A bad line (empty, an id outside the
 * vocabulary, too long for the context) fails that prompt with a line on stderr; the others
 * still run, and the exit status is then 1. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "runtime/sampler.h"
#include "runtime/spec.h"
#include "text/tokenizer.h"

static const char *usage =
    "usage: petrel batch --model M --prompts FILE -n N [--text] [--max-batch B] [--max-rows R]\n"
    "Greedy-generates N tokens after every prompt of FILE, all prompts continuously batched:\n"
    "decode rows and prompt chunks of up to B sessions share each forward pass. Prints one line\n"
    "per prompt in input order, \"INDEX: ids...\" (INDEX: the prompt's 0-based line index), the\n"
    "same ids `petrel generate` prints for that prompt alone.\n"
    "  --prompts FILE       one prompt per line: comma-separated token ids, or text with --text\n"
    "                       ('-' reads stdin)\n"
    "  -n N                 tokens to generate per prompt (default 16)\n"
    "  --text               lines are text (tokenized as `petrel run` does: special tokens\n"
    "                       written in it are recognized, nothing is added); prints the text\n"
    "  --tokenizer FILE     tokenizer.json for --text (default: MODEL/tokenizer.json)\n"
    "  --max-batch B        sessions generating at once (default 8)\n"
    "  --max-rows R         rows per forward pass (default 512)\n"
    "  --stop-at-eos        stop a prompt after the model's eos id, as generate --stop-at-eos\n"
    "  --draft K|auto       speculative decoding with the MTP head (default 0 = off): each session\n"
    "                       drafts K tokens and verifies its own window of K + 1 rows inside the\n"
    "                       same batch forward; the ids are the same. Prompts are then read one\n"
    "                       session at a time as they are admitted (not mixed into decode batches)\n"
    "  --stats              one JSON line on stderr at the end (tokens, forwards, acceptance, ...)\n"
    "Prompts that share a prefix of whole KV pages (64 tokens) with one read before take it from\n"
    "the engine's prefix cache instead of running it again (the ids are the same).\n"
    "A bad line fails that prompt (a line on stderr naming it); the others still run; the exit\n"
    "status is then 1.\n" CLI_MODEL_OPTS_HELP;

typedef struct job {
    int32_t *ids;       /* owned: prompt then generated ids */
    int n_prompt, n_out, fed, failed, done;
    petrel_session *s;  /* owned while running */
    sampler smp;        /* --draft: greedy, and the timeline */
    spec_seq q;
    int have_q;
} job;

/* Reads FILE into lines (owned copies, without the newline; a final newline ends the last
 * line, it does not start an empty one). */
static int read_lines(const char *path, char ***lines, int *n) {
    errno = 0;
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f) return -1;
    size_t cap = 0, len = 0;
    char *buf = NULL;
    int c;
    *n = 0;
    *lines = NULL;
    int lcap = 0, oom = 0;
    for (;;) {
        c = fgetc(f);
        if (c == EOF && len == 0) break;
        if (c == EOF || c == '\n') {
            if (*n == lcap) {
                lcap = lcap ? 2 * lcap : 16;
                char **t = realloc(*lines, sizeof(char *) * (size_t)lcap);
                if (!t) { oom = 1; break; }
                *lines = t;
            }
            char *l = malloc(len + 1);
            if (!l) { oom = 1; break; }
            if (len) memcpy(l, buf, len);
            l[len] = 0;
            if (len && l[len - 1] == '\r') l[len - 1] = 0;
            (*lines)[(*n)++] = l;
            len = 0;
            if (c == EOF) break;
            continue;
        }
        if (len + 1 >= cap) {
            cap = cap ? 2 * cap : 256;
            char *t = realloc(buf, cap);
            if (!t) { oom = 1; break; }
            buf = t;
        }
        buf[len++] = (char)c;
    }
    int bad = ferror(f) || oom;
    if (oom) errno = ENOMEM;
    free(buf);
    if (f != stdin) fclose(f);
    if (bad) { /* nothing half-read is handed on */
        for (int i = 0; i < *n; i++) free((*lines)[i]);
        free(*lines);
        *lines = NULL;
        *n = 0;
    }
    return bad ? -1 : 0;
}

CLI_CMD(batch) {
    cli_model_opts mo = {0};
    const char *prompts = NULL, *tok_opt = NULL;
    long ngen = 16, max_batch = 8, max_rows = 512;
    int text = 0, stop_eos = 0, stats = 0;
    spec_params dp = {.draft = 0};
    for (int i = 1; i < argc; i++) {
        int r = cli_model_opt(argc, argv, &i, &mo);
        if (r < 0) return 1;
        if (r) continue;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { fputs(usage, stdout); return 0; }
        else if (!strcmp(argv[i], "--text")) text = 1;
        else if (!strcmp(argv[i], "--stop-at-eos")) stop_eos = 1;
        else if (!strcmp(argv[i], "--stats")) stats = 1;
        else if (!strcmp(argv[i], "--draft") && i + 1 < argc) { if (cli_opt_draft("batch", argv[++i], &dp.draft)) return 1; }
        else if (!strcmp(argv[i], "--prompts") && i + 1 < argc) prompts = argv[++i];
        else if (!strcmp(argv[i], "--tokenizer") && i + 1 < argc) tok_opt = argv[++i];
        else if (!strcmp(argv[i], "-n") && i + 1 < argc) {
            if (cli_parse_int(argv[++i], 0, 1 << 24, &ngen)) return cli_fail("batch: -n: \"%s\" is not a count (0 .. 16777216)", argv[i]);
        } else if (!strcmp(argv[i], "--max-batch") && i + 1 < argc) {
            if (cli_parse_int(argv[++i], 1, 4096, &max_batch)) return cli_fail("batch: --max-batch: \"%s\" is not a count (1 .. 4096)", argv[i]);
        } else if (!strcmp(argv[i], "--max-rows") && i + 1 < argc) {
            if (cli_parse_int(argv[++i], 1, 1 << 16, &max_rows)) return cli_fail("batch: --max-rows: \"%s\" is not a count (1 .. 65536)", argv[i]);
        } else return cli_fail("batch: unknown or incomplete option \"%s\" (petrel batch --help)", argv[i]);
    }
    if (!mo.model) return cli_fail("batch: --model is required");
    if (!prompts) return cli_fail("batch: --prompts is required");
    char **lines;
    int nl;
    if (read_lines(prompts, &lines, &nl)) return cli_fail("batch: cannot read --prompts %s: %s", prompts, errno ? strerror(errno) : "read error");
    if (nl == 0) return cli_fail("batch: %s holds no prompts", prompts);
    petrel_error err = {0};
    tokenizer *tok = NULL;
    petrel_engine *eng = NULL;
    int rc = 0;
    if (text) {
        char tbuf[4200];
        const char *tp = cli_tokenizer_path("batch", tok_opt, mo.model, tbuf, sizeof tbuf);
        if (!tp) rc = 1;
        else if (tok_load(tp, &tok, &err) < 0) rc = cli_fail_err("batch", &err);
    }
    if (!rc && cli_engine_open(&mo, &eng, &err)) rc = cli_fail_err("batch", &err);
    job *jobs = rc ? NULL : calloc((size_t)nl, sizeof *jobs);
    if (!rc && !jobs) rc = cli_fail("batch: out of memory");
    int V = eng ? petrel_engine_vocab_size(eng) : 0, maxpos = eng ? petrel_engine_max_positions(eng) : 0, any_failed = 0;
    /* parse every line first: a bad one fails alone */
    for (int i = 0; !rc && i < nl; i++) {
        job *j = &jobs[i];
        int32_t *ids = NULL;
        int n = 0;
        char msg[1100];
        if (text) {
            size_t m = 0;
            if (tok_encode(tok, lines[i], strlen(lines[i]), &ids, &m, &err) < 0) snprintf(msg, sizeof msg, "%.1000s", err.msg), n = -1;
            else n = (int)m;
        } else n = cli_parse_ids(lines[i], &ids, msg, sizeof msg);
        if (n == 0) snprintf(msg, sizeof msg, "empty prompt");
        for (int k = 0; n > 0 && k < n; k++)
            if (ids[k] >= V) snprintf(msg, sizeof msg, "token id %d is outside the vocabulary (%d ids)", ids[k], V), n = -1;
        /* the last generated token is never fed back: prompt + n - 1 positions, as generate */
        if (n > 0 && (long)n + (ngen > 0 ? ngen - 1 : 0) > maxpos)
            snprintf(msg, sizeof msg, "%d prompt + %ld generated tokens need %ld positions, more than the model's context of %d", n, ngen,
                     (long)n + ngen - 1, maxpos), n = -1;
        if (n <= 0) {
            fprintf(stderr, "petrel batch: line %d (index %d): %s\n", i + 1, i, msg);
            free(ids);
            j->failed = 1;
            any_failed = 1;
            continue;
        }
        int32_t *all = realloc(ids, sizeof(int32_t) * ((size_t)n + (size_t)ngen + 1));
        if (!all) { free(ids); rc = cli_fail("batch: out of memory"); break; }
        j->ids = all;
        j->n_prompt = n;
        if (ngen == 0) j->done = 1;
    }
    petrel_batch *b = NULL;
    spec_ctx *sc = NULL;
    if (!rc && spec_check(eng, &dp, &err)) rc = cli_fail_err("batch", &err);
    if (!rc) dp.draft = spec_effective_draft(eng, dp.draft);
    if (!rc && dp.draft != 0 && max_batch > 64) rc = cli_fail("batch: --draft: at most 64 sessions at once (--max-batch)");
    if (!rc && dp.draft != 0 && spec_create(eng, &dp, (int)max_batch, &sc, &err)) rc = cli_fail_err("batch", &err);
    sampler_params gp;
    sampler_params_default(&gp);
    gp.temperature = 0;
    gp.penalty_last_n = 0;
    long n_forwards = 0;
    if (!rc && petrel_batch_create(eng, (int)max_rows, &b, &err)) rc = cli_fail_err("batch", &err);
    petrel_row *rows = rc ? NULL : malloc(sizeof(petrel_row) * (size_t)max_rows);
    int *owner = rc ? NULL : malloc(sizeof(int) * (size_t)max_rows);
    float *lg = rc ? NULL : malloc(sizeof(float) * (size_t)max_rows * (size_t)V);
    int *active = rc ? NULL : malloc(sizeof(int) * (size_t)max_batch);
    if (!rc && (!rows || !owner || !lg || !active)) rc = cli_fail("batch: out of memory");
    int n_active = 0, next = 0, printed = 0;
    long n_cached = 0; /* prompt tokens taken from the prefix cache */
    while (!rc) {
        /* admit prompts while there is room */
        while (n_active < max_batch && next < nl) {
            job *j = &jobs[next];
            if (j->failed || j->done) { next++; continue; }
            if (petrel_session_create(eng, j->n_prompt + (int)ngen - 1, &j->s, &err)) {
                fprintf(stderr, "petrel batch: line %d (index %d): %s\n", next + 1, next, err.msg);
                j->failed = any_failed = 1;
                next++;
                continue;
            }
            if (sc) { /* drafting: the prompt alone, then the first token */
                int32_t first = 0;
                int e2 = sampler_init(&j->smp, &gp, V, &err);
                if (!e2) e2 = spec_seq_init(&j->q, sc, j->s, &j->smp, NULL, 0, &err);
                j->have_q = !e2;
                if (!e2) e2 = spec_feed(&j->q, j->ids, j->n_prompt, lg, &err);
                if (e2) {
                    fprintf(stderr, "petrel batch: line %d (index %d): %s\n", next + 1, next, err.msg);
                    j->failed = any_failed = 1;
                    next++;
                    continue;
                }
                first = petrel_argmax(lg, V);
                j->fed = j->n_prompt;
                j->ids[j->n_prompt + j->n_out++] = first;
                if (j->n_out == ngen || (stop_eos && petrel_engine_is_eos(eng, first))) j->done = 1;
                else spec_set_token(&j->q, first);
            }
            if (!sc && ngen > 0) { /* a known prefix (a shared system prompt, an earlier line) comes from the cache */
                int got = petrel_session_prefix_get(j->s, j->ids, j->n_prompt - 1, &err);
                if (got > 0) {
                    j->fed = got;
                    n_cached += got;
                }
            }
            active[n_active++] = next++;
        }
        /* print finished results in input order */
        while (printed < nl && (jobs[printed].done || jobs[printed].failed)) {
            job *j = &jobs[printed];
            if (!j->failed) {
                printf("%d:", printed);
                if (text) {
                    char *out = NULL;
                    size_t len = 0;
                    if (tok_decode(tok, j->ids + j->n_prompt, (size_t)j->n_out, &out, &len, &err) < 0) {
                        fprintf(stderr, "petrel batch: index %d: %s\n", printed, err.msg);
                        any_failed = 1;
                    } else {
                        putchar(' ');
                        for (size_t k = 0; k < len; k++) /* one line per prompt: newlines escaped */
                            if (out[k] == '\n') fputs("\\n", stdout);
                            else if (out[k] == '\\') fputs("\\\\", stdout);
                            else putchar(out[k]);
                    }
                    free(out);
                } else
                    for (int k = 0; k < j->n_out; k++) printf(" %d", j->ids[j->n_prompt + k]);
                putchar('\n');
                fflush(stdout);
            }
            printed++;
        }
        if (!n_active) break;
        if (sc) { /* one speculative step: every active session's window in one forward */
            spec_seq *run[64];
            int m = 0;
            for (int a = 0; a < n_active; a++) {
                job *j = &jobs[active[a]];
                if (j->done) continue;
                j->q.limit = (int)(ngen - j->n_out);
                run[m++] = &j->q;
            }
            if (m && spec_step(sc, run, m, &err)) { rc = cli_fail_err("batch", &err); break; }
            if (m) n_forwards++;
            for (int a = 0; a < n_active; a++) {
                job *j = &jobs[active[a]];
                for (int k = 0; !j->done && k < j->q.nout; k++) {
                    int32_t t = j->q.out[k];
                    j->ids[j->n_prompt + j->n_out++] = t;
                    if (j->n_out == ngen || (stop_eos && petrel_engine_is_eos(eng, t))) j->done = 1;
                }
                if (!j->done && j->q.nout) spec_set_token(&j->q, j->q.out[j->q.nout - 1]);
                j->q.nout = 0;
            }
            for (int a = 0; a < n_active;) {
                job *j = &jobs[active[a]];
                if (j->done) {
                    if (j->have_q) spec_seq_free(&j->q), sampler_free(&j->smp), j->have_q = 0;
                    petrel_session_free(j->s);
                    j->s = NULL;
                    active[a] = active[--n_active];
                } else a++;
            }
            continue;
        }
        /* one forward: a decode row per generating session, then prompt chunks */
        int n = 0;
        for (int pass = 0; pass < 2; pass++)
            for (int a = 0; a < n_active && n < max_rows; a++) {
                job *j = &jobs[active[a]];
                int reading = j->fed < j->n_prompt;
                if (pass == 0 && !reading) {
                    rows[n] = (petrel_row){j->s, j->ids[j->n_prompt + j->n_out - 1], 1};
                    owner[n++] = active[a];
                } else if (pass == 1 && reading) {
                    int take = j->n_prompt - j->fed, room = (int)max_rows - n, chunk = petrel_session_chunk(j->s);
                    if (take > room) take = room;
                    if (take > chunk) take = chunk;
                    for (int k = 0; k < take; k++) {
                        rows[n] = (petrel_row){j->s, j->ids[j->fed + k], j->fed + k == j->n_prompt - 1};
                        owner[n++] = active[a];
                    }
                }
            }
        if (petrel_batch_forward(b, rows, n, lg, &err)) { rc = cli_fail_err("batch", &err); break; }
        n_forwards++;
        int li = 0;
        for (int r = 0; r < n; r++) {
            job *j = &jobs[owner[r]];
            if (j->fed < j->n_prompt && ++j->fed == j->n_prompt) petrel_session_prefix_put(j->s, &(petrel_error){0}); /* a hint */
            if (!rows[r].want_logits) continue;
            int32_t best = petrel_argmax(lg + (size_t)li++ * V, V);
            j->ids[j->n_prompt + j->n_out++] = best;
            if (j->n_out == ngen || (stop_eos && petrel_engine_is_eos(eng, best))) j->done = 1;
        }
        for (int a = 0; a < n_active;) { /* finished sessions free their place */
            job *j = &jobs[active[a]];
            if (j->done) {
                petrel_session_free(j->s);
                j->s = NULL;
                active[a] = active[--n_active];
            } else a++;
        }
    }
    if (!rc && stats) {
        char js[2048];
        if (sc) spec_stats_json(sc, js, sizeof js);
        else snprintf(js, sizeof js, "{\"draft\":0,\"forwards\":%ld,\"prefix_cached_tokens\":%ld,\"acceptance_by_position\":[]}", n_forwards, n_cached);
        fprintf(stderr, "%s\n", js);
    }
    for (int i = 0; jobs && i < nl; i++) {
        if (jobs[i].have_q) spec_seq_free(&jobs[i].q), sampler_free(&jobs[i].smp);
        petrel_session_free(jobs[i].s);
        free(jobs[i].ids);
    }
    for (int i = 0; i < nl; i++) free(lines[i]);
    free(lines);
    free(jobs);
    free(rows);
    free(owner);
    free(lg);
    free(active);
    petrel_batch_free(b);
    spec_free(sc);
    rc = eng ? cli_engine_close("batch", eng, rc) : rc; /* writes --trace-out */
    tok_free(tok);
    if (!rc && fflush(stdout)) rc = cli_fail("batch: cannot write the results to stdout");
    return rc ? rc : any_failed;
}
