/* cmd_generate.c: `petrel generate` greedy-decodes N token ids after a prompt of ids and
 * prints them space-separated on stdout. Stops early at an eos id only with --stop-at-eos. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "base/outfile.h"
#include "cli.h"
#include "runtime/sampler.h"
#include "runtime/spec.h"

static const char *usage =
    "usage: petrel generate --model DIR --ids 1,2,3 -n N [--stop-at-eos] [--session-in F] [--session-out F]\n"
    "Prints the N greedy (argmax) token ids that follow the prompt, space-separated.\n"
    "  --ids LIST           prompt token ids, comma separated\n"
    "  -n N                 tokens to generate (default 16)\n"
    "  --stop-at-eos        stop after the model's eos id instead of always printing N\n"
    "  --session-out FILE   at the end, save the session (every id printed is in it) to FILE\n"
    "  --session-in FILE    continue a saved session: the --ids (optional then) are appended first;\n"
    "                       `--ids P -n 8 --session-out F` then `--session-in F -n 8` print what\n"
    "                       `--ids P -n 16` prints (these two run without drafting)\n" CLI_DRAFT_HELP
    "                       (default auto on a model with an MTP layer: the ids are the same)\n"
    "  --oracle-accept P    benchmarks of random-weight models: accept each draft with probability\n"
    "                       P instead of checking it (the ids are then NOT the model's)\n" CLI_MODEL_OPTS_HELP;

/* Greedy with drafting: the ids are plain greedy's (spec.h); a stop at eos inside a step's tokens
 * ends the output there. */
static int generate_spec(petrel_engine *eng, const spec_params *dp, const int32_t *ids, int n, long ngen, int stop_eos, int stats,
                         petrel_error *err) {
    int V = petrel_engine_vocab_size(eng), rc = 0;
    spec_ctx *c = NULL;
    petrel_session *s = NULL;
    sampler smp = {0};
    spec_seq q = {0};
    int have_q = 0;
    float *lg = malloc(sizeof(float) * (size_t)V);
    sampler_params sp;
    sampler_params_default(&sp);
    sp.temperature = 0;
    sp.penalty_last_n = 0;
    if (!lg) rc = cli_fail("generate: out of memory");
    if (!rc && (spec_create(eng, dp, 1, &c, err) || sampler_init(&smp, &sp, V, err) || petrel_session_create(eng, n + (int)ngen - 1, &s, err) ||
                spec_seq_init(&q, c, s, &smp, NULL, 0, err)))
        rc = cli_fail_err("generate", err);
    have_q = !rc;
    if (!rc && spec_feed(&q, ids, n, lg, err)) rc = cli_fail_err("generate", err);
    long done = 0;
    int stop = 0;
    if (!rc) {
        int32_t t = sampler_sample(&smp, lg, V);
        printf("%d", t);
        done = 1;
        stop = stop_eos && petrel_engine_is_eos(eng, t);
        spec_set_token(&q, t);
    }
    while (!rc && !stop && done < ngen) {
        q.limit = (int)(ngen - done);
        spec_seq *one = &q;
        if (spec_step(c, &one, 1, err)) { rc = cli_fail_err("generate", err); break; }
        for (int j = 0; j < q.nout && !stop; j++) {
            printf(" %d", q.out[j]);
            done++;
            stop = stop_eos && petrel_engine_is_eos(eng, q.out[j]);
        }
        if (fflush(stdout) != 0) { rc = cli_fail("generate: writing to stdout failed: %s", strerror(errno)); break; }
        spec_set_token(&q, q.out[q.nout - 1]);
    }
    if (!rc) printf("\n");
    if (!rc && stats) {
        char js[2048];
        spec_stats_json(c, js, sizeof js);
        fprintf(stderr, "%s\n", js);
    }
    if (have_q) spec_seq_free(&q);
    sampler_free(&smp);
    petrel_session_free(s);
    spec_free(c);
    free(lg);
    return rc;
}

CLI_CMD(generate) {
    cli_model_opts mo = {0};
    const char *ids_s = NULL, *s_in = NULL, *s_out = NULL;
    long ngen = 16;
    int stop_eos = 0, stats = 0;
    spec_params dp = {.draft = SPEC_AUTO};
    for (int i = 1; i < argc; i++) {
        int r = cli_model_opt(argc, argv, &i, &mo);
        if (r < 0) return 1;
        if (r) continue;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { fputs(usage, stdout); return 0; }
        else if (!strcmp(argv[i], "--stop-at-eos")) stop_eos = 1;
        else if (!strcmp(argv[i], "--stats")) stats = 1;
        else if (!strcmp(argv[i], "--draft") && i + 1 < argc) { if (cli_opt_draft("generate", argv[++i], &dp.draft)) return 1; }
        else if (!strcmp(argv[i], "--oracle-accept") && i + 1 < argc) {
            char *end;
            dp.oracle_accept = strtod(argv[++i], &end);
            if (*end || end == argv[i] || !(dp.oracle_accept >= 0 && dp.oracle_accept <= 1))
                return cli_fail("generate: --oracle-accept: \"%s\" is not a probability in [0, 1]", argv[i]);
        }
        else if (!strcmp(argv[i], "--ids") && i + 1 < argc) ids_s = argv[++i];
        else if (!strcmp(argv[i], "--session-in") && i + 1 < argc) s_in = argv[++i];
        else if (!strcmp(argv[i], "--session-out") && i + 1 < argc) s_out = argv[++i];
        else if ((!strcmp(argv[i], "-n") || !strcmp(argv[i], "--n")) && i + 1 < argc) {
            if (cli_parse_int(argv[++i], 0, 1 << 24, &ngen)) return cli_fail("generate: -n: \"%s\" is not a count", argv[i]);
        } else return cli_fail("generate: unknown or incomplete option \"%s\" (petrel generate --help)", argv[i]);
    }
    if (!mo.model) return cli_fail("generate: --model is required");
    if (!ids_s && !s_in) return cli_fail("generate: --ids is required (or --session-in)");
    petrel_error oerr = {0};
    if (s_out && pt_out_check(s_out, mo.model, &oerr) < 0) return cli_fail("generate: --session-out: %s", oerr.msg); /* before the work */
    char msg[256];
    int32_t *ids = NULL;
    int n = 0;
    if (ids_s) {
        n = cli_parse_ids(ids_s, &ids, msg, sizeof msg);
        if (n < 0) return cli_fail("generate: --ids: %s", msg);
        if (n == 0 && !s_in) { free(ids); return cli_fail("generate: empty prompt: --ids holds no token ids"); }
    }
    petrel_error err = {0};
    petrel_engine *eng;
    if (cli_engine_open(&mo, &eng, &err)) { free(ids); return cli_fail_err("generate", &err); }
    int V = petrel_engine_vocab_size(eng), rc = 0;
    if (spec_check(eng, &dp, &err)) {
        free(ids);
        return cli_engine_close("generate", eng, cli_fail_err("generate", &err));
    }
    dp.draft = spec_effective_draft(eng, dp.draft);
    if (dp.draft != 0 && ngen > 1 && !s_in && !s_out) {
        rc = generate_spec(eng, &dp, ids, n, ngen, stop_eos, stats, &err);
        free(ids);
        return cli_engine_close("generate", eng, rc);
    }
    petrel_session *s = NULL;
    float *lg = malloc(sizeof(float) * (size_t)V);
    if (!lg) rc = cli_fail("generate: out of memory");
    /* the last generated id is printed, never fed back (n + ngen - 1 positions), unless the
     * session is saved: then it goes in too, so a continuation starts from everything printed */
    const long maxpos = petrel_engine_max_positions(eng);
    long cap = s_in ? maxpos : (long)n + (ngen > 0 ? ngen - 1 : 0) + (s_out ? 1 : 0);
    if (cap > maxpos) cap = maxpos;
    if (!rc && petrel_session_create(eng, (int)cap, &s, &err)) rc = cli_fail_err("generate", &err);
    if (!rc && s_in && petrel_session_load(s, s_in, &err)) rc = cli_fail_err("generate", &err);
    int have = 0; /* lg holds the last cached position's logits */
    if (!rc && n > 0 && (ngen > 0 || s_out)) {
        if (petrel_session_forward(s, ids, n, lg, 0, &err)) rc = cli_fail_err("generate", &err);
        else have = 1;
    }
    if (!rc && !have && ngen > 0) { /* a loaded session: its last position runs again for its logits */
        const int32_t *tk;
        int len = petrel_session_tokens(s, &tk);
        int32_t last = len > 0 ? tk[len - 1] : 0;
        if (len < 1) rc = cli_fail("generate: %s holds no tokens to continue from", s_in);
        else if (petrel_session_truncate(s, len - 1, &err) || petrel_session_forward(s, &last, 1, lg, 0, &err)) rc = cli_fail_err("generate", &err);
    }
    int32_t best = -1;
    for (long g = 0; !rc && g < ngen; g++) {
        best = petrel_argmax(lg, V);
        printf(g ? " %d" : "%d", best);
        if (fflush(stdout) != 0) { rc = cli_fail("generate: writing to stdout failed: %s", strerror(errno)); break; } /* stop at once */
        if (stop_eos && petrel_engine_is_eos(eng, best)) break;
        if ((g + 1 < ngen || s_out) && petrel_session_forward(s, &best, 1, lg, 0, &err)) rc = cli_fail_err("generate", &err);
    }
    if (!rc && s_out && petrel_session_save(s, s_out, &err)) rc = cli_fail_err("generate", &err);
    if (!rc) printf("\n");
    if (!rc && stats)
        fprintf(stderr, "{\"draft\":0,\"tokens\":%ld,\"forwards\":%ld,\"tokens_per_forward\":%.4f,\"acceptance_by_position\":[]}\n", ngen > 1 ? ngen - 1 : 0,
                ngen > 1 ? ngen - 1 : 0, ngen > 1 ? 1.0 : 0.0);
    petrel_session_free(s);
    rc = cli_engine_close("generate", eng, rc);
    free(lg);
    free(ids);
    return rc;
}
