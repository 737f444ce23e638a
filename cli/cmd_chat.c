/* cmd_chat.c: `petrel chat` is an interactive chat through the model's chat template. Each
 * stdin line is a user turn (a pipe works too; EOF ends). Every turn renders the whole
 * conversation with add_generation_prompt=true and feeds only what the KV cache does not hold
 * yet (common-prefix reuse, see runtime/generate.h). Thinking (between <think> and </think>) is
 * shown apart from the answer; the reply joins the conversation as
 * {role: assistant, content, reasoning_content}. */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/file.h"
#include "base/sbuf.h"
#include "base/err.h"
#include "base/outfile.h"
#include "cli.h"
#include "runtime/chat.h"
#include "runtime/generate.h"
#include "runtime/spec.h"
#include "runtime/sampler.h"
#include "text/jinja.h"
#include "text/tokenizer.h"

static const char *usage =
    "usage: petrel chat --model DIR [--system TEXT] [--no-think] [sampling options]\n"
    "Interactive chat: each line read from stdin is one user message (pipes work: one turn per\n"
    "line, EOF ends). The conversation is rendered through the model's chat template with\n"
    "add_generation_prompt=true each turn; only tokens not already in the KV cache are run.\n"
    "Replies stream to stdout, one per turn, ending with a newline. Thinking (text between <think>\n"
    "and </think>) is shown dimmed on a terminal; when stdout is not a terminal it goes to stderr,\n"
    "prefixed \"[thinking] \", so stdout holds only the answers. A reply ends at an eos id of the\n"
    "model or at <|user|>, <|observation|> or <|endoftext|>. When the context is full the reply\n"
    "is cut (said on stderr); when the conversation no longer fits, the oldest messages are dropped\n"
    "(said on stderr). A message that cannot fit even alone is refused, saying how many tokens fit,\n"
    "and so is a line that is not valid UTF-8; the chat goes on with the next line. The line /clear\n"
    "drops the conversation so far (the system message stays).\n"
    "  --system TEXT        a system message at the start of the conversation\n"
    "  --session FILE       resume the conversation saved in FILE (its latent KV, and the messages in\n"
    "                       FILE.messages.json) if it exists: no prefill of the history; save both at\n"
    "                       the end of input\n"
    "  --no-think           render with enable_thinking=false (no thinking)\n"
    "  --hide-thinking      do not show the thinking at all\n"
    "  -n N                 most tokens per reply (default -1: until eos or the context is full)\n"
    "  --ctx N              context size in tokens (default 4096, capped at max_position_embeddings)\n"
    "  --template FILE      the Jinja chat template (default: the model's own,\n"
    "                       chat_template.jinja or tokenizer_config.json chat_template, from its\n"
    "                       folder or stored in its pack)\n"
    "  --tokenizer FILE     tokenizer.json, or a pack holding one (default: the model's own,\n"
    "                       DIR/tokenizer.json or the copy stored in its pack)\n"
    "With -v, stderr also gets per-turn token counts, cache reuse and speed.\n"
    "  --draft K|auto       speculative decoding with the MTP head: K drafts per step (1..16),\n"
    "                       0 = off, auto (the default on a model with an MTP layer) = a cost model\n" CLI_SAMPLING_OPTS_HELP
    CLI_MODEL_OPTS_HELP
    "The bundled tests/data/tiny model has random weights: its replies are gibberish by design.\n";


typedef struct {
    int tty;            /* stdout is a terminal: thinking dimmed on stdout */
    int hide_think;
    int think_open;     /* a thinking segment is being shown */
    int write_failed;
    sbuf content, reasoning;
    chat_split cs;
} turn_out;

static void close_think(turn_out *o) {
    if (!o->think_open) return;
    if (o->tty) fputs("\033[0m\n", stdout);
    else fputc('\n', stderr);
    o->think_open = 0;
}

static void on_split(void *user, int thinking, const char *b, size_t n) {
    turn_out *o = user;
    sb_add(thinking ? &o->reasoning : &o->content, b, n);
    if (thinking) {
        if (o->hide_think) return;
        FILE *f = o->tty ? stdout : stderr;
        if (!o->think_open) {
            fputs(o->tty ? "\033[2m" : "[thinking] ", f);
            o->think_open = 1;
        }
        fwrite(b, 1, n, f);
        fflush(f);
        return;
    }
    close_think(o);
    if (fwrite(b, 1, n, stdout) != n) o->write_failed = 1;
}

static int on_piece(void *user, int32_t id, const char *b, size_t n) {
    turn_out *o = user;
    chat_split_piece(&o->cs, id, b, n, on_split, o);
    if (fflush(stdout) != 0) o->write_failed = 1;
    return o->write_failed;
}

static char *slurp(const char *path, size_t *len, petrel_error *err) {
    char *s = NULL;
    return pt_read_file(path, 64u << 20, &s, len, err) < 0 ? NULL : s;
}

/* Renders msgs (add_generation_prompt) and encodes the text. */
static int render_ids(const jinja_template *t, const tokenizer *tok, const cJSON *msgs, int think, int32_t **ids, size_t *n,
                      int *in_think, petrel_error *err) {
    char *text = NULL;
    size_t tl = 0;
    int rc = chat_render(t, msgs, 1, think, &text, &tl, err);
    if (rc < 0) return rc;
    if (in_think) *in_think = chat_ends_in_think(text, tl);
    rc = tok_encode(tok, text, tl, ids, n, err);
    free(text);
    return rc;
}

/* Tokens of the conversation made of the system messages and the last message of msgs (with
 * that message's content replaced by "" when empty_last): what the last message needs alone. */
static int alone_tokens(const jinja_template *t, const tokenizer *tok, const cJSON *msgs, int think, int empty_last, size_t *n,
                        petrel_error *err) {
    cJSON *a = cJSON_CreateArray();
    int sz = cJSON_GetArraySize(msgs);
    for (int k = 0; a && k < sz; k++) {
        const cJSON *m = cJSON_GetArrayItem(msgs, k);
        const cJSON *r = cJSON_GetObjectItemCaseSensitive(m, "role");
        int sys = cJSON_IsString(r) && !strcmp(r->valuestring, "system");
        if (!sys && k != sz - 1) continue;
        cJSON *d = cJSON_Duplicate(m, 1);
        if (!d) { cJSON_Delete(a); a = NULL; break; }
        if (k == sz - 1 && empty_last) cJSON_ReplaceItemInObjectCaseSensitive(d, "content", cJSON_CreateString(""));
        cJSON_AddItemToArray(a, d);
    }
    if (!a) return pt_err(err, PETREL_ENOMEM, "out of memory");
    int32_t *ids = NULL;
    int rc = render_ids(t, tok, a, think, &ids, n, NULL, err);
    free(ids);
    cJSON_Delete(a);
    return rc;
}

/* Renders the conversation and encodes it, dropping the oldest non-system messages while it
 * does not fit in ctx - 1 tokens (room for at least one reply token). A last message that cannot
 * fit even alone is refused before anything is dropped: PETREL_ERANGE with *refused = 1 and
 * *need / *fit its tokens and the most that fit (what the system messages and the template's
 * framing leave). */
static int build_prompt(const jinja_template *t, const tokenizer *tok, cJSON *msgs, int think, int ctx,
                        int32_t **ids, size_t *n, int *in_think, int *refused, long *need, long *fit, petrel_error *err) {
    int dropped = 0;
    *refused = 0;
    for (;;) {
        int rc = render_ids(t, tok, msgs, think, ids, n, in_think, err);
        if (rc < 0) return rc;
        if (*n < (size_t)ctx) break;
        if (!dropped) { /* too long: does the new message fit at all? */
            size_t na = 0, nb = 0;
            if ((rc = alone_tokens(t, tok, msgs, think, 0, &na, err)) < 0 || (rc = alone_tokens(t, tok, msgs, think, 1, &nb, err)) < 0) {
                free(*ids);
                *ids = NULL;
                return rc;
            }
            if (na >= (size_t)ctx) {
                free(*ids);
                *ids = NULL;
                *refused = 1;
                *need = (long)(na > nb ? na - nb : na);
                *fit = (long)ctx - 1 - (long)nb;
                if (*fit < 0) *fit = 0;
                return pt_err(err, PETREL_ERANGE, "message refused: it takes %ld tokens and at most %ld fit", *need, *fit);
            }
        }
        /* too long: drop the first message that is not a system message, unless it is the last */
        int sz = cJSON_GetArraySize(msgs), k = 0;
        while (k < sz) {
            const cJSON *r = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(msgs, k), "role");
            if (!cJSON_IsString(r) || strcmp(r->valuestring, "system")) break;
            k++;
        }
        if (k >= sz - 1) {
            size_t have = *n;
            free(*ids);
            *ids = NULL;
            return pt_err(err, PETREL_ERANGE, "context full: the message needs %zu tokens but the context holds %d (raise --ctx)", have, ctx);
        }
        free(*ids);
        *ids = NULL;
        cJSON_DeleteItemFromArray(msgs, k);
        dropped++;
    }
    if (dropped) fprintf(stderr, "petrel chat: context full: dropped the %d oldest message%s\n", dropped, dropped > 1 ? "s" : "");
    return 0;
}

CLI_CMD(chat) {
    cli_model_opts mo = {0};
    sampler_params sp;
    sampler_params_default(&sp);
    const char *tok_opt = NULL, *tmpl_path = NULL, *system = NULL, *session = NULL;
    long ngen = -1, ctx_opt = 4096;
    int think = 1, hide = 0, verbose = 0, seed_set = 0;
    spec_params dp = {.draft = SPEC_AUTO};
    for (int i = 1; i < argc; i++) {
        int r = cli_model_opt(argc, argv, &i, &mo);
        if (r == 0) r = cli_sampling_opt("chat", argc, argv, &i, &sp, &seed_set);
        if (r < 0) return 1;
        if (r) continue;
        const char *a = argv[i];
        int has = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(usage, stdout); return 0; }
        else if (!strcmp(a, "--no-think")) think = 0;
        else if (!strcmp(a, "--hide-thinking")) hide = 1;
        else if (!strcmp(a, "--session") && i + 1 < argc) session = argv[++i];
        else if (!strcmp(a, "--draft") && has) { if (cli_opt_draft("chat", argv[++i], &dp.draft)) return 1; }
        else if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) verbose = 1;
        else if (!strcmp(a, "--tokenizer") && has) tok_opt = argv[++i];
        else if (!strcmp(a, "--template") && has) tmpl_path = argv[++i];
        else if (!strcmp(a, "--system") && has) system = argv[++i];
        else if ((!strcmp(a, "-n") || !strcmp(a, "--n") || !strcmp(a, "--max-tokens")) && has) {
            if (cli_parse_int(argv[++i], -1, 1 << 30, &ngen)) return cli_fail("chat: -n: \"%s\" is not a count (or -1)", argv[i]);
        } else if ((!strcmp(a, "--ctx") || !strcmp(a, "-c")) && has) {
            if (cli_parse_int(argv[++i], 2, 1 << 30, &ctx_opt)) return cli_fail("chat: --ctx: \"%s\" is not a size >= 2", argv[i]);
        } else return cli_fail("chat: unknown or incomplete option \"%s\" (petrel chat --help)", a);
    }
    if (mo.open.verbose) verbose = 1; /* cli_model_opt takes -v / --verbose (engine load plan too) */
    if (!mo.model) return cli_fail("chat: --model is required");
    /* the cost model's choices follow the clock and change which draws a step makes: seeded
     * sampling stays reproducible by not drafting unless asked to (greedy output never depends
     * on the drafts) */
    if (dp.draft == SPEC_AUTO && seed_set && sp.temperature > 0 && sp.top_k != 1) dp.draft = 0;
    if (!seed_set) sp.seed = cli_random_seed();
    char tbuf[4096];
    const char *tok_path = cli_tokenizer_path("chat", tok_opt, mo.model, tbuf, sizeof tbuf);
    if (!tok_path) return 1;

    petrel_error err = {0};
    tokenizer *tok = NULL;
    jinja_template *tmpl = NULL;
    petrel_engine *eng = NULL;
    cJSON *msgs = NULL;
    gen_ctx g;
    int have_gen = 0, rc = 0;
    char *src = NULL, *line = NULL;
    size_t sl = 0, lcap = 0;
    turn_out o = {0};
    if (cli_tok_load(tok_path, &tok, &err) < 0) { rc = cli_fail_err("chat", &err); goto done; }
    if (tmpl_path) src = slurp(tmpl_path, &sl, &err);
    else if (petrel_model_chat_template(mo.model, &src, &sl, &err) < 0) src = NULL;
    if (!src) { rc = cli_fail_err("chat", &err); goto done; }
    if (jinja_compile(src, sl, &tmpl, &err) < 0) { rc = cli_fail_err("chat: chat template", &err); goto done; }
    if (session && pt_out_check(session, mo.model, &err) < 0) { rc = cli_fail_err("chat: --session", &err); goto done; } /* before the work */
    if (cli_engine_open(&mo, &eng, &err) < 0) { rc = cli_fail_err("chat", &err); goto done; }
    int maxpos = petrel_engine_max_positions(eng);
    int ctx = ctx_opt < maxpos ? (int)ctx_opt : maxpos;
    if (gen_init(&g, eng, tok, ctx, &sp, &err) < 0) { rc = cli_fail_err("chat", &err); goto done; }
    have_gen = 1;
    if (gen_enable_spec(&g, &dp, &err) < 0) { rc = cli_fail_err("chat", &err); goto done; }
    cli_progress pg = {.verbose = verbose};
    petrel_session_set_progress(g.s, cli_progress_fn, &pg);
    int32_t stops[3];
    int n_stop = 0;
    static const char *const stop_names[] = {"<|user|>", "<|observation|>", "<|endoftext|>"};
    for (int k = 0; k < 3; k++) {
        int32_t id = tok_token_to_id(tok, stop_names[k]);
        if (id >= 0) stops[n_stop++] = id;
    }
    gen_opts go = {.max_tokens = (int)ngen, .stop_ids = stops, .n_stop = n_stop};
    char msgs_path[4200] = "";
    if (session) snprintf(msgs_path, sizeof msgs_path, "%s.messages.json", session);
    if (session && access(session, F_OK) == 0) { /* resume: the cache and the conversation it holds */
        size_t ml = 0;
        char *mj = access(msgs_path, F_OK) == 0 ? slurp(msgs_path, &ml, &err) : NULL;
        msgs = mj ? cJSON_ParseWithLength(mj, ml) : NULL;
        free(mj);
        if (!msgs || !cJSON_IsArray(msgs)) { rc = cli_fail("chat: --session: %s is missing or not a JSON array of messages", msgs_path); goto done; }
        if (gen_load(&g, session, &err) < 0) { rc = cli_fail_err("chat: --session", &err); goto done; }
        if (verbose) fprintf(stderr, "petrel chat: resumed %d messages, %d cached tokens from %s\n", cJSON_GetArraySize(msgs), g.n_ids, session);
    } else {
        msgs = cJSON_CreateArray();
        if (!msgs || (system && chat_add_message(msgs, "system", system, NULL, &err) < 0)) { rc = cli_fail("chat: out of memory"); goto done; }
    }
    int interactive = isatty(STDIN_FILENO);
    o.tty = isatty(STDOUT_FILENO);
    o.hide_think = hide;
    if (verbose) fprintf(stderr, "petrel chat: context %d tokens, seed %llu\n", ctx, (unsigned long long)sp.seed);
    for (;;) {
        if (interactive) { fputs("> ", stderr); fflush(stderr); }
        ssize_t ll = getline(&line, &lcap, stdin);
        if (ll < 0) break;
        while (ll > 0 && (line[ll - 1] == '\n' || line[ll - 1] == '\r')) line[--ll] = 0;
        if (ll == 0) continue;
        if (!strcmp(line, "/clear")) { /* drop the history; the system message stays */
            cJSON_Delete(msgs);
            msgs = cJSON_CreateArray();
            if (!msgs || (system && chat_add_message(msgs, "system", system, NULL, &err) < 0)) { rc = cli_fail("chat: out of memory"); break; }
            fprintf(stderr, "petrel chat: history cleared\n");
            continue;
        }
        /* a bad line is refused and the chat goes on (run refuses such a prompt too) */
        size_t bad = memchr(line, 0, (size_t)ll) ? (size_t)((char *)memchr(line, 0, (size_t)ll) - line) : chat_utf8_check(line, (size_t)ll);
        if (bad < (size_t)ll) {
            fprintf(stderr, "petrel chat: message refused: %s at byte %zu (send UTF-8 text)\n", line[bad] ? "invalid UTF-8" : "a NUL byte", bad);
            continue;
        }
        int arc = chat_add_message(msgs, "user", line, NULL, &err);
        if (arc < 0) { rc = cli_fail_err("chat", &err); break; }
        int32_t *ids = NULL;
        size_t n = 0;
        int in_think = 0, refused = 0;
        long need = 0, fit = 0;
        if (build_prompt(tmpl, tok, msgs, think, ctx, &ids, &n, &in_think, &refused, &need, &fit, &err) < 0) {
            if (!refused) { rc = cli_fail_err("chat", &err); break; }
            cJSON_DeleteItemFromArray(msgs, cJSON_GetArraySize(msgs) - 1); /* the chat goes on without it */
            if (fit == 0)
                fprintf(stderr, "petrel chat: message refused: the system message and the template's framing fill the %d-token context; shorten --system%s\n",
                        ctx, ctx < maxpos ? " or raise --ctx" : "");
            else if (ctx < maxpos)
                fprintf(stderr, "petrel chat: message refused: it takes %ld tokens and at most %ld fit in the %d-token context; send a shorter message (or raise --ctx, up to %d)\n",
                        need, fit, ctx, maxpos);
            else
                fprintf(stderr, "petrel chat: message refused: it takes %ld tokens and at most %ld fit in the %d-token context (the model's maximum); send a shorter message\n",
                        need, fit, ctx);
            continue;
        }
        gen_stats st = {0};
        int grc = gen_prompt(&g, ids, (int)n, &st, &err);
        free(ids);
        if (grc < 0) { rc = cli_fail_err("chat", &err); break; }
        o.content.n = o.reasoning.n = 0;
        if (o.content.p) o.content.p[0] = 0;
        if (o.reasoning.p) o.reasoning.p[0] = 0;
        o.think_open = 0;
        chat_split_init(&o.cs, tok, in_think);
        if (gen_generate(&g, &go, on_piece, &o, &st, &err) < 0) { close_think(&o); fputc('\n', stdout); rc = cli_fail_err("chat", &err); break; }
        close_think(&o);
        fputc('\n', stdout);
        if (fflush(stdout) != 0 || o.write_failed) { rc = cli_fail("chat: writing to stdout failed"); break; }
        if (o.content.oom || o.reasoning.oom) { rc = cli_fail("chat: out of memory"); break; }
        if (st.stop == GEN_STOP_CONTEXT)
            fprintf(stderr, "petrel chat: context full (%d tokens): the reply was cut off (/clear drops the history%s)\n", ctx,
                    ctx < maxpos ? "; or raise --ctx" : "");
        if (verbose)
            fprintf(stderr, "petrel chat: prompt %d tokens (%d cached) in %.3f s; reply %d tokens in %.3f s (%.2f tok/s); stop: %s\n",
                    st.n_prompt, st.n_reused, st.prompt_s, st.n_gen, st.gen_s, st.gen_s > 0 ? st.n_gen / st.gen_s : 0.0,
                    gen_stop_name(st.stop));
        /* the reply as text (stray bytes become U+FFFD so the next render still encodes) */
        char *content = chat_utf8_clean(o.content.p ? o.content.p : "", o.content.n);
        char *reasoning = chat_utf8_clean(o.reasoning.p ? o.reasoning.p : "", o.reasoning.n);
        arc = content && reasoning ? chat_add_message(msgs, "assistant", content, o.reasoning.n || in_think ? reasoning : NULL, &err)
                                   : pt_err(&err, PETREL_ENOMEM, "out of memory");
        free(content);
        free(reasoning);
        if (arc < 0) { rc = cli_fail_err("chat", &err); break; }
    }
    if (!rc && ferror(stdin)) rc = cli_fail("chat: reading stdin failed");
    if (!rc && session) { /* the cache, then the messages, each whole or not at all */
        char *mj = cJSON_PrintUnformatted(msgs);
        pt_outfile of;
        if (!mj) rc = cli_fail("chat: out of memory");
        else if (gen_save(&g, session, &err) < 0 || pt_out_open(&of, msgs_path, mo.model, &err) < 0) rc = cli_fail_err("chat: --session", &err);
        else if (pt_out_write(&of, mj, strlen(mj), &err) < 0) {
            pt_out_abort(&of);
            rc = cli_fail_err("chat: --session", &err);
        } else if (pt_out_commit(&of, &err) < 0) rc = cli_fail_err("chat: --session", &err);
        free(mj);
    }
done:
    free(line);
    free(src);
    free(o.content.p);
    free(o.reasoning.p);
    cJSON_Delete(msgs);
    if (have_gen) gen_free(&g);
    rc = cli_engine_close("chat", eng, rc);
    jinja_free(tmpl);
    tok_free(tok);
    return rc;
}
