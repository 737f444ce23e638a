/* fuzz_serve_request.c: libFuzzer target for the server's request parsing (src/serve/request.c):
 * the input is a JSON body parsed both as a /v1/completions and as a /v1/chat/completions
 * request. serve_request_parse must accept or reject it with an error naming the field, never
 * crash, leak or read past the input (the body is not NUL-terminated: a copy of exactly size
 * bytes is parsed). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "serve/request.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *b = malloc(size ? size : 1);
    if (!b) return 0;
    memcpy(b, data, size);
    for (int chat = 0; chat < 2; chat++) {
        serve_request r;
        char param[64];
        petrel_error err;
        if (serve_request_parse(b, size, chat, &r, param, &err) == 0) {
            if (r.chat != chat || (chat && !r.messages) || (!chat && !r.prompt && !r.n_prompt_ids)) abort();
            if (r.n_stop > SERVE_MAX_STOP) abort();
            serve_request_free(&r);
        } else if (!err.msg[0])
            abort(); /* every rejection says why */
    }
    free(b);
    return 0;
}
