/* cmd_run.c: `petrel run` generates text after a prompt and streams it to stdout as it is
 * produced (whole UTF-8 characters only). The prompt is raw completion text by default; --chat
 * wraps it as one user message through the model's chat template. Also holds the sampling-option
 * parser and tokenizer lookup shared with `petrel chat`. */
#include <errno.h>
#include <libgen.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/err.h"
#include "base/file.h"
#include "base/outfile.h"
#include "cli.h"
#include "runtime/chat.h"
#include "runtime/generate.h"
#include "runtime/sampler.h"
#include "runtime/spec.h"
#include "text/jinja.h"
#include "text/tokenizer.h"

static const char *usage =
    "usage: petrel run --model DIR -p TEXT [-n N] [sampling options] [--chat] [-v]\n"
    "Streams the text generated after TEXT to stdout as it is produced. stdout holds exactly the\n"
    "generated text (a newline is added at the end only when stdout is a terminal); the prompt is\n"
    "not echoed. Generation stops at the model's eos ids (config.json + generation_config.json),\n"
    "after N tokens, or when the model's max_position_embeddings is reached.\n"
    "By default TEXT is a raw completion prompt: it is tokenized as is (special tokens such as\n"
    "<|user|> written in it are recognized; nothing is added). With --chat, TEXT becomes one user\n"
    "message rendered through the model's chat template (add_generation_prompt=true), and\n"
    "<|user|>, <|observation|> and <|endoftext|> also end the reply.\n"
    "  -p, --prompt TEXT    the prompt ('-' reads it from stdin)\n"
    "  -n N                 most tokens to generate (default 128; -1 = until eos or full context)\n"
    "  --raw                use TEXT as is, no chat template (the default; cancels --chat)\n"
    "  --chat               wrap TEXT as a user message through the chat template\n"
    "  --system TEXT        with --chat: a system message before it\n"
    "  --session FILE       load the session (latent KV and token ids) from FILE if it exists, so\n"
    "                       the prompt's cached prefix is not run again; save it there at the end\n"
    "  --no-think           with --chat: render with enable_thinking=false\n"
    "  --template FILE      with --chat: the Jinja chat template (default: the model's own,\n"
    "                       chat_template.jinja or tokenizer_config.json chat_template, from its\n"
    "                       folder or stored in its pack)\n"
    "  --tokenizer FILE     tokenizer.json, or a pack holding one (default: the model's own,\n"
    "                       DIR/tokenizer.json or the copy stored in its pack)\n"
    "With -v, stderr also gets the seed, prompt size, speed and stop reason.\n" CLI_DRAFT_HELP
    "                       (default auto on a model with an MTP layer; with --seed and\n"
    "                       sampling, off unless given: the output stays reproducible)\n" CLI_SAMPLING_OPTS_HELP
    CLI_MODEL_OPTS_HELP
    "The bundled tests/data/tiny model has random weights: its text is gibberish by design.\n";

/* ---- shared with cmd_chat.c ---- */

static int parse_float(const char *s, double lo, double hi, float *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !isfinite(v) || v < lo || v > hi) return -1;
    *out = (float)v;
    return 0;
}

int cli_sampling_opt(const char *cmd, int argc, char **argv, int *i, struct sampler_params *sp,
                     int *seed_set) {
    const char *a = argv[*i];
    static const char *const names[] = {"--temp", "--temperature", "--top-k", "--top-p", "--min-p",
                                        "--repeat-penalty", "--presence-penalty", "--frequency-penalty",
                                        "--repeat-last-n", "--seed"};
    int k = -1;
    for (int j = 0; j < (int)(sizeof names / sizeof names[0]); j++)
        if (!strcmp(a, names[j])) k = j;
    if (k < 0) return 0;
    if (*i + 1 >= argc) { cli_fail("%s: %s needs a value", cmd, a); return -1; }
    const char *v = argv[++*i];
    long n = 0;
    int bad = 0;
    switch (k) {
    case 0: case 1: bad = parse_float(v, 0, 1e6, &sp->temperature); break;
    case 2: bad = cli_parse_int(v, 0, 1L << 30, &n); sp->top_k = (int)n; break;
    case 3: bad = parse_float(v, 0, 1, &sp->top_p); if (!bad && sp->top_p <= 0) bad = 1; break;
    case 4: bad = parse_float(v, 0, 1, &sp->min_p); break;
    case 5: bad = parse_float(v, 1e-6, 1e6, &sp->repeat_penalty); break;
    case 6: bad = parse_float(v, -1e6, 1e6, &sp->presence_penalty); break;
    case 7: bad = parse_float(v, -1e6, 1e6, &sp->frequency_penalty); break;
    case 8: bad = cli_parse_int(v, 0, 1 << 24, &n); sp->penalty_last_n = (int)n; break;
    case 9: {
        uint64_t s = 0;
        bad = cli_parse_u64(v, &s) < 0; /* decimal digits only (cli/parse.c) */
        sp->seed = s;
        if (seed_set) *seed_set = 1;
        break;
    }
    }
    if (bad) {
        static const char *const want[] = {"a number >= 0", "a number >= 0", "an integer >= 0", "a number in (0, 1]",
                                           "a number in [0, 1]", "a number > 0", "a number", "a number",
                                           "an integer >= 0", "an unsigned integer"};
        cli_fail("%s: %s: \"%s\" is not %s", cmd, a, v, want[k]);
        return -1;
    }
    return 1;
}

uint64_t cli_random_seed(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = (uint64_t)ts.tv_sec * 1000000007ULL ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 32);
    x ^= x >> 31;
    x *= 0x9e3779b97f4a7c15ULL;
    return x ^ (x >> 29);
}

const char *cli_tokenizer_path(const char *cmd, const char *tok_opt, const char *model, char *buf,
                               size_t bufsz) {
    struct stat st;
    if (tok_opt) {
        if (stat(tok_opt, &st) || !S_ISREG(st.st_mode)) {
            cli_fail("%s: --tokenizer %s: no such file", cmd, tok_opt);
            return NULL;
        }
        return tok_opt;
    }
    if (stat(model, &st)) {
        cli_fail("%s: --model %s: no such folder or file", cmd, model);
        return NULL;
    }
    if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode)) {
        cli_fail("%s: --model %s is not a model: not a folder or a regular file", cmd, model);
        return NULL;
    }
    if (!S_ISDIR(st.st_mode) && petrel_model_is_pack(model)) { /* the copy stored in the pack (cli_tok_load) */
        petrel_error e = {0};
        int has = petrel_model_has_file(model, "tokenizer.json", &e);
        if (has < 0) {
            cli_fail("%s: %s", cmd, e.msg);
            return NULL;
        }
        if (!has) cli_fail("%s: %s stores no tokenizer.json (converted before packs carried one, or from a folder without it): give "
                           "--tokenizer FILE", cmd, model);
        return has ? model : NULL;
    }
    if (!S_ISDIR(st.st_mode)) { /* a .safetensors file: its folder's */
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s", model);
        snprintf(buf, bufsz, "%s/tokenizer.json", dirname(tmp));
    } else snprintf(buf, bufsz, "%s/tokenizer.json", model);
    if (stat(buf, &st) || !S_ISREG(st.st_mode)) {
        cli_fail("%s: no tokenizer: %s does not exist (give one with --tokenizer FILE)", cmd, buf);
        return NULL;
    }
    return buf;
}

int cli_tok_load(const char *path, struct tokenizer **out, petrel_error *err) {
    if (!petrel_model_is_pack(path)) return tok_load(path, out, err);
    char *json = NULL, name[4200];
    size_t len = 0;
    PT_TRY(petrel_model_file(path, "tokenizer.json", &json, &len, err));
    snprintf(name, sizeof name, "%s (its tokenizer.json)", path);
    int rc = tok_load_json(json, len, name, out, err);
    free(json);
    return rc;
}

/* ---- run ---- */

typedef struct { int write_failed; } run_out;

static int on_piece(void *user, int32_t id, const char *b, size_t n) {
    (void)id;
    run_out *o = user;
    if (n && fwrite(b, 1, n, stdout) != n) o->write_failed = 1;
    if (fflush(stdout) != 0) o->write_failed = 1;
    return o->write_failed;
}


/* Renders TEXT as one user message (after an optional system message) through the template. */
static int chat_wrap(const char *tmpl_path, const char *model, const char *system, const char *text,
                     int think, char **out, size_t *out_len, petrel_error *err) {
    char *src = NULL;
    size_t sl = 0;
    int rc;
    if (tmpl_path) rc = pt_read_file(tmpl_path, 64u << 20, &src, &sl, err);
    else rc = petrel_model_chat_template(model, &src, &sl, err);
    if (rc < 0) return rc;
    jinja_template *t = NULL;
    rc = jinja_compile(src, sl, &t, err);
    free(src);
    if (rc < 0) return rc;
    cJSON *msgs = cJSON_CreateArray();
    rc = msgs ? 0 : pt_err(err, PETREL_ENOMEM, "out of memory");
    if (!rc && system) rc = chat_add_message(msgs, "system", system, NULL, err);
    if (!rc) rc = chat_add_message(msgs, "user", text, NULL, err);
    if (!rc) rc = chat_render(t, msgs, 1, think, out, out_len, err);
    cJSON_Delete(msgs);
    jinja_free(t);
    return rc;
}

CLI_CMD(run) {
    cli_model_opts mo = {0};
    sampler_params sp;
    sampler_params_default(&sp);
    const char *prompt = NULL, *tok_opt = NULL, *tmpl_path = NULL, *system = NULL, *session = NULL;
    long ngen = 128;
    int chat = 0, think = 1, verbose = 0, seed_set = 0, stats = 0;
    spec_params dp = {.draft = SPEC_AUTO};
    for (int i = 1; i < argc; i++) {
        int r = cli_model_opt(argc, argv, &i, &mo);
        if (r == 0) r = cli_sampling_opt("run", argc, argv, &i, &sp, &seed_set);
        if (r < 0) return 1;
        if (r) continue;
        const char *a = argv[i];
        int has = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(usage, stdout); return 0; }
        else if (!strcmp(a, "--raw")) chat = 0;
        else if (!strcmp(a, "--chat")) chat = 1;
        else if (!strcmp(a, "--no-think")) think = 0;
        else if (!strcmp(a, "--stats")) stats = 1;
        else if (!strcmp(a, "--draft") && has) { if (cli_opt_draft("run", argv[++i], &dp.draft)) return 1; }
        else if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) verbose = 1;
        else if ((!strcmp(a, "-p") || !strcmp(a, "--prompt")) && has) prompt = argv[++i];
        else if (!strcmp(a, "--tokenizer") && has) tok_opt = argv[++i];
        else if (!strcmp(a, "--template") && has) tmpl_path = argv[++i];
        else if (!strcmp(a, "--system") && has) system = argv[++i];
        else if (!strcmp(a, "--session") && has) session = argv[++i];
        else if ((!strcmp(a, "-n") || !strcmp(a, "--n") || !strcmp(a, "--max-tokens")) && has) {
            if (cli_parse_int(argv[++i], -1, 1 << 30, &ngen)) return cli_fail("run: -n: \"%s\" is not a count (or -1)", argv[i]);
        } else return cli_fail("run: unknown or incomplete option \"%s\" (petrel run --help)", a);
    }
    if (mo.open.verbose) verbose = 1; /* cli_model_opt takes -v / --verbose (engine load plan too) */
    if (!mo.model) return cli_fail("run: --model is required");
    if (!prompt) return cli_fail("run: -p TEXT is required (the prompt)");
    petrel_error serr = {0};
    if (session && pt_out_check(session, mo.model, &serr) < 0) return cli_fail("run: --session: %s", serr.msg); /* before the work */
    /* the cost model's choices follow the clock and change which draws a step makes: seeded
     * sampling stays reproducible by not drafting unless asked to (greedy output never depends
     * on the drafts) */
    if (dp.draft == SPEC_AUTO && seed_set && sp.temperature > 0 && sp.top_k != 1) dp.draft = 0;
    if (!seed_set) sp.seed = cli_random_seed();
    char tbuf[4096];
    const char *tok_path = cli_tokenizer_path("run", tok_opt, mo.model, tbuf, sizeof tbuf);
    if (!tok_path) return 1;

    petrel_error err = {0};
    char *stdin_text = NULL, *rendered = NULL;
    size_t plen = 0;
    if (!strcmp(prompt, "-")) {
        if (pt_read_stream(stdin, "stdin", (size_t)1 << 30, &stdin_text, &plen, &err)) return cli_fail_err("run: reading the prompt", &err);
        prompt = stdin_text;
    } else plen = strlen(prompt);
    tokenizer *tok = NULL;
    petrel_engine *eng = NULL;
    int rc = 0;
    if (cli_tok_load(tok_path, &tok, &err) < 0) rc = cli_fail_err("run", &err);
    if (!rc && chat) {
        if (chat_wrap(tmpl_path, mo.model, system, prompt, think, &rendered, &plen, &err) < 0) rc = cli_fail_err("run", &err);
        else prompt = rendered;
    }
    if (!rc && cli_engine_open(&mo, &eng, &err) < 0) rc = cli_fail_err("run", &err);
    if (!rc) {
        if (verbose) fprintf(stderr, "petrel run: seed %llu\n", (unsigned long long)sp.seed);
        /* with --chat, GLM's turn markers end the reply too (they are eos in GLM-5 configs) */
        int32_t stops[3];
        int n_stop = 0;
        static const char *const stop_names[] = {"<|user|>", "<|observation|>", "<|endoftext|>"};
        for (int k = 0; chat && k < 3; k++)
            if ((stops[n_stop] = tok_token_to_id(tok, stop_names[k])) >= 0) n_stop++;
        cli_progress pg = {.verbose = verbose};
        gen_opts go = {.max_tokens = (int)ngen, .stop_ids = stops, .n_stop = n_stop, .progress = cli_progress_fn, .progress_user = &pg,
                       .session = session, .spec = &dp};
        gen_stats st = {0};
        run_out o = {0};
        if (generate_text(eng, tok, prompt, plen, &sp, &go, on_piece, &o, &st, &err) < 0) rc = cli_fail_err("run", &err);
        else if (o.write_failed) rc = cli_fail("run: writing to stdout failed");
        else {
            if (isatty(STDOUT_FILENO)) fputc('\n', stdout);
            fflush(stdout);
            if (st.stop == GEN_STOP_CONTEXT)
                fprintf(stderr, "petrel run: stopped: the context is full (%d prompt + %d generated tokens)\n", st.n_prompt, st.n_gen);
            if (stats) fprintf(stderr, "%s\n", st.json);
            if (verbose) {
                fprintf(stderr, "petrel run: prompt %d tokens in %.3f s (%.1f tok/s); generated %d tokens in %.3f s (%.2f tok/s); stop: %s\n",
                        st.n_prompt, st.prompt_s, st.prompt_s > 0 ? st.n_prompt / st.prompt_s : 0.0, st.n_gen, st.gen_s,
                        st.gen_s > 0 ? st.n_gen / st.gen_s : 0.0, gen_stop_name(st.stop));
            }
        }
    }
    rc = cli_engine_close("run", eng, rc);
    tok_free(tok);
    free(rendered);
    free(stdin_text);
    return rc;
}
