/* fuzz_serve_request.c: libFuzzer target for the server's request parsing (src/serve/request.c)
 * and the tool-call parser (src/serve/toolcall.c): the input is a JSON body parsed both as a
 * /v1/completions and as a /v1/chat/completions request (messages with tool_calls and tool
 * results, tools, tool_choice, n, logprobs / top_logprobs); serve_request_parse must accept or
 * reject it with an error naming the field, never crash, leak or read past the input (the body
 * is not NUL-terminated: a copy of exactly size bytes is parsed). The same bytes are then fed to
 * the tool-call parser in pieces (sizes from the input itself), with the request's tools when it
 * parsed: whatever is not a call must come back as text, byte for byte, and every call's
 * arguments must be a JSON object. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "serve/request.h"
#include "serve/toolcall.h"

typedef struct sink { size_t text, calls; } sink;
static void on_text(void *u, const char *b, size_t n) { (void)b; ((sink *)u)->text += n; }
static void on_call(void *u, const char *name, const char *args) {
    cJSON *a = cJSON_Parse(args);
    if (!cJSON_IsObject(a) || !name[0]) abort();
    cJSON_Delete(a);
    ((sink *)u)->calls++;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *b = malloc(size ? size : 1);
    if (!b) return 0;
    memcpy(b, data, size);
    cJSON *tools = NULL;
    for (int chat = 0; chat < 2; chat++) {
        serve_request r;
        char param[64];
        petrel_error err;
        if (serve_request_parse(b, size, chat, &r, param, &err) == 0) {
            if (r.chat != chat || (chat && !r.messages) || (!chat && !r.prompt && !r.n_prompt_ids)) abort();
            if (r.n_stop > SERVE_MAX_STOP || r.n < 1 || r.n > SERVE_MAX_N) abort();
            if (r.top_logprobs < 0 || r.top_logprobs > SERVE_MAX_TOP_LOGPROBS || (r.top_logprobs && !r.logprobs)) abort();
            if ((r.tool_choice == SERVE_TOOLS_NAMED) != (r.tool_name != NULL)) abort();
            if (r.tool_choice != SERVE_TOOLS_NONE && !r.tools) abort();
            if (!chat && r.tools) abort();
            if (r.tools && !tools) tools = r.tools, r.tools = NULL;
            serve_request_free(&r);
        } else if (!err.msg[0])
            abort(); /* every rejection says why */
    }
    /* the tool-call parser over the same bytes, in pieces of 1 + data[i] % 16 bytes */
    sink s = {0};
    tc_parser p;
    tc_init(&p, tools);
    for (size_t o = 0, i = 0; o < size; i++) {
        size_t k = 1 + (size_t)data[i % size] % 16;
        if (k > size - o) k = size - o;
        tc_feed(&p, b + o, k, on_text, on_call, &s);
        o += k;
    }
    tc_flush(&p, on_text, &s);
    tc_free(&p);
    if (!s.calls && s.text != size) abort(); /* no call: every byte comes back as text */
    cJSON_Delete(tools);
    free(b);
    return 0;
}
