/* fuzz_template.c: libFuzzer target for the Jinja chat-template interpreter. The input bytes are
 * a template, compiled and rendered over a small fixed chat request (messages with tool calls,
 * tools, flags), with tight limits so that loops and recursion end quickly. Any crash, leak,
 * sanitizer report or hang is a bug; errors are expected and fine. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "text/jinja.h"

static const char CONTEXT[] =
    "{\"messages\": ["
    "{\"role\": \"system\", \"content\": \"You are helpful.\"},"
    "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"hi \\u00e9\"}, {\"type\": \"image\"}]},"
    "{\"role\": \"assistant\", \"content\": \"<think>r</think>ok\", \"reasoning_content\": \"r\","
    " \"tool_calls\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": {\"a\": 1, \"b\": [true, null]}}}]},"
    "{\"role\": \"tool\", \"content\": \"42\"}],"
    "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"type\": \"object\"}}}],"
    "\"add_generation_prompt\": true, \"enable_thinking\": false, \"reasoning_effort\": \"high\", \"n\": 3, \"x\": 1.5}";

static cJSON *ctx;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!ctx) ctx = cJSON_Parse(CONTEXT);
    if (size > 1 << 16) return 0;
    jinja_template *t = NULL;
    petrel_error err;
    if (jinja_compile((const char *)data, size, &t, &err) < 0) return 0;
    jinja_limits lim = {.max_output = 1 << 20, .max_memory = 64 << 20, .max_steps = 200000, .max_depth = 200};
    char *out = NULL;
    size_t len = 0;
    if (jinja_render_compiled(t, ctx, &lim, &out, &len, &err) == 0) free(out);
    jinja_free(t);
    return 0;
}
