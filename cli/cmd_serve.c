/* cmd_serve.c: `petrel serve` runs the OpenAI-compatible HTTP server (src/serve/server.h) on a
 * model: opens the engine, the tokenizer and the chat template, starts the server, prints one
 * line with its URL on stdout when it is ready, and waits for SIGINT or SIGTERM (taken with
 * sigwait on the main thread: every other thread has them blocked), which end the running
 * streams with an error event and exit with status 0. */
#include <libgen.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "base/file.h"
#include "cli.h"
#include "serve/server.h"
#include "text/jinja.h"
#include "text/tokenizer.h"

static const char *usage =
    "usage: petrel serve --model M [--host 127.0.0.1] [--port 8080] [--parallel N] [--ctx N]\n"
    "                    [--api-key KEY | --api-key-file F] [options]\n"
    "An OpenAI-compatible HTTP server with continuous batching: POST /v1/chat/completions,\n"
    "POST /v1/completions (both with \"stream\": true as server-sent events), GET /v1/models,\n"
    "GET /health, GET /metrics (Prometheus text), POST /tokenize, POST /detokenize.\n"
    "Prints \"petrel serve: listening on http://HOST:PORT\" on stdout when ready; SIGINT or\n"
    "SIGTERM ends the running requests (streams get an error event) and exits.\n"
    "  --host ADDR          IPv4 address to listen on (default 127.0.0.1: this machine only)\n"
    "  --port N             TCP port (default 8080; 0 = any free port, printed)\n"
    "  --parallel N         requests generating at once; more wait in arrival order (default 8)\n"
    "  --ctx N              positions per request, prompt + reply (default 4096, capped at the\n"
    "                       model's max_position_embeddings)\n"
    "  --api-key KEY        require \"Authorization: Bearer KEY\" on every endpoint but /health\n"
    "  --api-key-file F     the same, the key read from F (first line), kept out of `ps`\n"
    "  --model-name NAME    the model id in /v1/models and requests (default: the model's folder\n"
    "                       or file name)\n"
    "  --batch-rows N       rows per forward pass: decode rows plus prompt chunks (default 512)\n"
    "  --max-body SIZE      largest request body (default 4M); larger ones get 413\n"
    "  --keepalive-ms N     SSE \": keep-alive\" comment after N ms without a token (default 5000)\n"
    "  --max-connections N  open connections served at once; the next few get 503 (default 512)\n"
    "  --template FILE      Jinja chat template (default: the model's own)\n"
    "  --tokenizer FILE     tokenizer.json (default: the model's own)\n"
    "  --draft K|auto       speculative decoding with the model's MTP head: K drafts per step (1..16),\n"
    "                       auto (the cost model picks K, 0 included) or 0 (off, the default);\n"
    "                       exact: greedy streams are plain greedy's; requests with logprobs, a\n"
    "                       forced tool call or n > 1 run without it\n"
    "  --session-dir DIR    save finished requests' KV as session files in DIR (created if missing)\n"
    "                       and load DIR's files into the prefix cache at start: a conversation's\n"
    "                       next turn or a repeated system prompt skips its prefill after a restart\n"
    "  --session-dir-max N  files kept in DIR, the oldest removed first (default 256)\n"
    "  --lora NAME=DIR      serve a PEFT LoRA adapter as the model NAME (repeatable, up to 8): listed\n"
    "                       in /v1/models, chosen by a request's \"model\"; the others run the base\n"
    "                       (serve reads --lora as NAME=DIR, not DIR=SCALE)\n" CLI_MODEL_OPTS_HELP;

CLI_CMD(serve) {
    cli_model_opts mo = {0};
    static char lora_names[8][256];
    serve_opts so = {.port = 8080};
    const char *tok_opt = NULL, *tmpl_path = NULL, *key_file = NULL, *name = NULL;
    long v = 0;
    uint64_t sz = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--lora")) { /* serve: --lora NAME=DIR, a model of its own that requests pick by name */
            const char *v = i + 1 < argc ? argv[++i] : NULL, *eq = v ? strchr(v, '=') : NULL;
            if (!eq || eq == v || !eq[1]) return cli_fail("serve: --lora wants NAME=DIR (the adapter's model name in requests and /v1/models)");
            if (mo.open.n_lora >= 8) return cli_fail("serve: --lora: at most 8 adapters");
            int k = mo.open.n_lora;
            size_t nl = (size_t)(eq - v);
            if (nl >= 256 || strlen(eq + 1) >= sizeof mo.lora_dir[k]) return cli_fail("serve: --lora %s: name or folder too long", v);
            snprintf(mo.lora_dir[k], sizeof mo.lora_dir[k], "%s", eq + 1);
            snprintf(lora_names[k], sizeof lora_names[k], "%.*s", (int)nl, v);
            mo.lora[k] = (petrel_lora_spec){mo.lora_dir[k], lora_names[k], 1.0f};
            mo.open.n_lora = k + 1;
            mo.open.lora_select = 1;
            continue;
        }
        int r = cli_model_opt(argc, argv, &i, &mo);
        if (r < 0) return 1;
        if (r) continue;
        const char *a = argv[i];
        int has = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(usage, stdout); return 0; }
        else if (!strcmp(a, "--host") && has) so.host = argv[++i];
        else if (!strcmp(a, "--port") && has) { if (cli_opt_count("serve", a, argv[++i], 0, 65535, &v)) return 1; so.port = (int)v; }
        else if (!strcmp(a, "--parallel") && has) { if (cli_opt_count("serve", a, argv[++i], 1, 1024, &v)) return 1; so.parallel = (int)v; }
        else if (!strcmp(a, "--ctx") && has) { if (cli_opt_count("serve", a, argv[++i], 2, 1 << 24, &v)) return 1; so.ctx = (int)v; }
        else if (!strcmp(a, "--batch-rows") && has) { if (cli_opt_count("serve", a, argv[++i], 1, 1 << 16, &v)) return 1; so.max_rows = (int)v; }
        else if (!strcmp(a, "--keepalive-ms") && has) { if (cli_opt_count("serve", a, argv[++i], 1, 3600000, &v)) return 1; so.keepalive_ms = (int)v; }
        else if (!strcmp(a, "--max-connections") && has) { if (cli_opt_count("serve", a, argv[++i], 1, 65536, &v)) return 1; so.max_connections = (int)v; }
        else if (!strcmp(a, "--max-body") && has) { if (cli_opt_size("serve", a, argv[++i], 1024, 1u << 30, &sz)) return 1; so.max_body = (size_t)sz; }
        else if (!strcmp(a, "--draft") && has) { if (cli_opt_draft("serve", argv[++i], &so.draft)) return 1; }
        else if (!strcmp(a, "--session-dir") && has) so.session_dir = argv[++i];
        else if (!strcmp(a, "--session-dir-max") && has) { if (cli_opt_count("serve", a, argv[++i], 1, 1 << 20, &v)) return 1; so.session_dir_max = (int)v; }
        else if (!strcmp(a, "--api-key") && has) so.api_key = argv[++i];
        else if (!strcmp(a, "--api-key-file") && has) key_file = argv[++i];
        else if (!strcmp(a, "--model-name") && has) name = argv[++i];
        else if (!strcmp(a, "--template") && has) tmpl_path = argv[++i];
        else if (!strcmp(a, "--tokenizer") && has) tok_opt = argv[++i];
        else return cli_fail("serve: unknown or incomplete option \"%s\" (petrel serve --help)", a);
    }
    if (!mo.model) return cli_fail("serve: --model is required");
    if (mo.open.lora_merge) return cli_fail("serve: --lora-merge: the server picks an adapter per request (\"model\": NAME); leave --lora-merge out");
    if (so.api_key && key_file) return cli_fail("serve: give --api-key or --api-key-file, not both");
    petrel_error err = {0};
    char *key = NULL, *src = NULL, *mcopy = NULL;
    size_t kl = 0, sl = 0;
    tokenizer *tok = NULL;
    jinja_template *tmpl = NULL;
    petrel_engine *eng = NULL;
    serve *sv = NULL;
    int rc = 0;
    if (key_file) {
        if (pt_read_file(key_file, 4096, &key, &kl, &err) < 0) return cli_fail_err("serve: --api-key-file", &err);
        key[strcspn(key, "\r\n")] = 0;
        if (!*key) { free(key); return cli_fail("serve: --api-key-file %s holds no key on its first line", key_file); }
        so.api_key = key;
    }
    if (so.api_key && !*so.api_key) { free(key); return cli_fail("serve: --api-key is empty"); }
    mcopy = strdup(mo.model);
    if (!name) {
        size_t l = mcopy ? strlen(mcopy) : 0;
        while (l > 1 && mcopy[l - 1] == '/') mcopy[--l] = 0;
        name = mcopy ? basename(mcopy) : "petrel";
    }
    so.model_name = name;
    char tbuf[4200];
    const char *tp = cli_tokenizer_path("serve", tok_opt, mo.model, tbuf, sizeof tbuf);
    if (!tp) { rc = 1; goto done; }
    if (cli_tok_load(tp, &tok, &err) < 0) { rc = cli_fail_err("serve", &err); goto done; }
    if (tmpl_path ? pt_read_file(tmpl_path, 16u << 20, &src, &sl, &err) < 0 : petrel_model_chat_template(mo.model, &src, &sl, &err) < 0) {
        if (tmpl_path) { rc = cli_fail_err("serve: --template", &err); goto done; }
        fprintf(stderr, "petrel serve: no chat template (%s): /v1/chat/completions will refuse requests\n", err.msg);
        src = NULL;
    }
    if (src && jinja_compile(src, sl, &tmpl, &err) < 0) { rc = cli_fail_err("serve: chat template", &err); goto done; }
    if (cli_engine_open(&mo, &eng, &err) < 0) { rc = cli_fail_err("serve", &err); goto done; }
    /* the signals go to sigwait below only: every thread started from here inherits the mask */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);
    if (serve_start(eng, tok, tmpl, &so, &sv, &err) < 0) { rc = cli_fail_err("serve", &err); goto done; }
    if (so.session_dir) {
        int ld = 0, sk = 0;
        serve_session_files(sv, &ld, &sk, NULL);
        fprintf(stderr, "petrel serve: %s: %d session files in the prefix cache%s%.0d%s\n", so.session_dir, ld, sk ? " (" : "", sk,
                sk ? " skipped: another model, KV type or adapter set, or damaged)" : "");
    }
    printf("petrel serve: listening on http://%s:%d (model %s, %d parallel)\n", so.host ? so.host : "127.0.0.1", serve_port(sv), name,
           so.parallel ? so.parallel : 8);
    fflush(stdout);
    int sig = 0;
    sigwait(&set, &sig);
    fprintf(stderr, "petrel serve: %s: stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    serve_stop(sv);
done:
    serve_free(sv);
    rc = eng ? cli_engine_close("serve", eng, rc) : rc;
    jinja_free(tmpl);
    tok_free(tok);
    free(src);
    free(key);
    free(mcopy);
    return rc;
}
