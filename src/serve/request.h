/* request.h: the JSON bodies of POST /v1/completions and /v1/chat/completions, parsed and
 * validated into a serve_request. Pure: no engine, no tokenizer, no I/O, so it is fuzzed alone
 * (fuzz/fuzz_serve_request.c). Every rejection names the field ("param") and says what is
 * wrong; the server turns it into an OpenAI-style 400 body. Unknown fields are ignored (clients
 * send `user`, `logit_bias: null`, ...); known fields with a wrong type or out of range are
 * refused rather than silently dropped.
 *
 * Tools (chat only): `tools` is kept as given (a deep copy) for the chat template and for the
 * argument schemas the tool-call parser reads (src/serve/toolcall.h); an assistant message's
 * `tool_calls` are copied with `function.arguments` turned from its JSON text into the object
 * the GLM-5.2 template iterates (a text that is not a JSON object is refused). */
#ifndef PETREL_SERVE_REQUEST_H
#define PETREL_SERVE_REQUEST_H
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "petrel.h"
#include "runtime/sampler.h"

#define SERVE_MAX_STOP 4
#define SERVE_MAX_STOP_LEN 256
#define SERVE_MAX_N 128        /* choices per request */
#define SERVE_MAX_TOP_LOGPROBS 20
#define SERVE_MAX_TOOLS 128

enum { SERVE_TOOLS_AUTO, SERVE_TOOLS_NONE, SERVE_TOOLS_REQUIRED, SERVE_TOOLS_NAMED };

typedef struct serve_request {
    int chat;                 /* 1: /v1/chat/completions */
    char *model;              /* owned; NULL when not given */
    int lora;                 /* set by the server: the LoRA adapter "model" names, -1 the base */
    char *prompt;             /* owned; completions: the prompt as text (NULL when given as ids) */
    size_t prompt_len;
    int32_t *prompt_ids;      /* owned; completions: the prompt as token ids (range not checked) */
    int n_prompt_ids;
    cJSON *messages;          /* owned; chat: array of {role, content[, reasoning_content]},
                                 content flattened to a string */
    int enable_thinking;      /* chat_template_kwargs.enable_thinking; -1 when not given */
    int stream, include_usage;
    long max_tokens;          /* -1 when not given */
    sampler_params sp;        /* OpenAI defaults: temperature 1, top_p 1, top_k off */
    int seed_set;
    char *stop[SERVE_MAX_STOP]; /* owned strings, n_stop of them */
    int n_stop;
    int ignore_eos;           /* vLLM's extension: do not stop at eos ids */
    int return_token_ids;     /* vLLM's extension: prompt_token_ids / token_ids in the reply */
    int n;                    /* choices, 1..SERVE_MAX_N */
    int logprobs;             /* 1: log probabilities of the chosen tokens */
    int top_logprobs;         /* 0..SERVE_MAX_TOP_LOGPROBS alternatives per token (chat:
                                 top_logprobs; completions: the logprobs integer) */
    cJSON *tools;             /* owned; chat: the tools array, NULL when none (or empty) */
    int tool_choice;          /* SERVE_TOOLS_*; AUTO when tools are given and it is not */
    char *tool_name;          /* owned; SERVE_TOOLS_NAMED: the function to call */
} serve_request;

/* Parses body[0..len) (need not be NUL-terminated). On error returns PETREL_EINVAL with err
 * filled and param (may be NULL, size >= 64) naming the field ("" when the body itself is bad);
 * *r is then empty (nothing to free, but serve_request_free is harmless). */
int serve_request_parse(const char *body, size_t len, int chat, serve_request *r, char *param,
                        petrel_error *err);
void serve_request_free(serve_request *r);

/* POST /tokenize and /detokenize bodies: {"prompt": "text"} or {"messages": [...]} (chat
 * rendering is the caller's), and {"tokens": [ids]}. */
int serve_parse_ids_array(const cJSON *a, int32_t **ids, int *n, const char *param, petrel_error *err);
#endif
