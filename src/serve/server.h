/* server.h: petrel's OpenAI-compatible HTTP server (libmicrohttpd, one thread per connection)
 * around one scheduler thread that owns the engine.
 *
 * The scheduler runs continuous batching over petrel_batch_forward: each step is one forward of
 * one decode row per generating request plus prompt chunks of requests still reading their
 * prompts (at most max_rows rows, so a long prompt delays running streams by one chunk per
 * step). At most `parallel` requests hold a session; the rest wait in arrival order. A
 * request's prompt first takes its longest cached prefix from the engine's prefix cache and
 * registers its pages there once read. Rows are independent of their batch (petrel.h), so a
 * request's tokens at temperature 0 are those of the same request alone. A finished, failed or
 * cancelled request (its client went away) frees its session at the next step.
 *
 * A request of n choices is n jobs: the first reads the prompt, the others wait outside the
 * queue and, when its prompt is read, fork its session copy-on-write and sample their first
 * token from the same logits (seed + i), then decode as rows of the same forwards. A job's
 * answer text passes through the GLM-5.2 tool-call parser when the request has tools
 * (src/serve/toolcall.h); tool_choice required / named force the answer's first tokens.
 * logprobs are taken from each row before the sampler changes it.
 *
 * Connection threads parse and validate a request (src/serve/request.h), render the chat
 * template, tokenize, queue it, and then either wait for it (JSON reply) or stream it as
 * server-sent events (`data: {...}\n\n` ... `data: [DONE]\n\n`, `: keep-alive` comments while
 * nothing new is ready). Library code: nothing is printed; errors go to petrel_error. */
#ifndef PETREL_SERVE_SERVER_H
#define PETREL_SERVE_SERVER_H
#include <stddef.h>
#include <stdint.h>

#include "petrel.h"
#include "text/jinja.h"
#include "text/tokenizer.h"

typedef struct serve_opts {
    const char *host;       /* IPv4 address to bind; NULL = 127.0.0.1 ("localhost" too) */
    int port;               /* 0 = a free port (serve_port says which) */
    int parallel;           /* requests running at once (holding a session); 0 = 8 */
    int ctx;                /* positions per request (prompt + reply); 0 = min(4096, model) */
    const char *api_key;    /* borrowed; NULL/"" = none. Required as "Bearer KEY" on every
                               endpoint except /health; compared in constant time */
    const char *model_name; /* borrowed; the id /v1/models lists and requests may name */
    size_t max_body;        /* request body limit in bytes; 0 = 4 MiB */
    int max_rows;           /* rows per forward; 0 = 512 */
    int keepalive_ms;       /* SSE comment after this long without news; 0 = 5000 */
    int max_connections;    /* 0 = 512 */
    const char *session_dir; /* borrowed; NULL = none: finished requests' KV saved there and loaded
                                into the prefix cache at start (src/serve/persist.h) */
    int session_dir_max;    /* files kept in session_dir; 0 = 256 */
    int draft;              /* MTP drafts per step (spec.h): 0 off, 1..16, or SPEC_AUTO (-1, the
                               cost model); jobs with logprobs, forced tokens or n > 1 never draft */
    const char *force_answer; /* a test seam: every chat answer begins with this text (taken as
                               forced tokens, as tool_choice "required" takes "<tool_call>"), so
                               tests control what the tool-call parser sees; NULL = none */
} serve_opts;

typedef struct serve serve;
/* Starts the scheduler and the HTTP daemon. eng, tok and tmpl (may be NULL: chat completions
 * then fail with a 400 naming the missing template) are borrowed and must outlive the server. */
int serve_start(petrel_engine *eng, const tokenizer *tok, const jinja_template *tmpl, const serve_opts *o,
                serve **out, petrel_error *err);
int serve_port(const serve *s);
/* --session-dir: files loaded into the prefix cache at start / skipped (another model, adapter
 * set or KV type, damaged), and written since. */
void serve_session_files(const serve *s, int *loaded, int *skipped, long *written);
/* Stops accepting, ends the running and queued requests (streams get an error event and
 * [DONE]), joins every thread. Then serve_free. */
void serve_stop(serve *s);
void serve_free(serve *s);
#endif
