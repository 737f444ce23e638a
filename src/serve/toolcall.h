/* toolcall.h: GLM-5.2's tool-call markup in generated text, parsed back into OpenAI tool calls.
 *
 * The GLM-5.2 chat template renders an assistant's tool calls in the history as
 *     <tool_call>NAME<arg_key>K1</arg_key><arg_value>V1</arg_value>...</tool_call>
 * (one block per call, back to back, no whitespace), where a string value is written as is and
 * any other value as JSON (`tojson`). The model writes the same markup, so this parser inverts
 * exactly that: NAME is the text before the first <arg_key> (surrounding whitespace dropped),
 * each value is a string when the tool's JSON schema says the property is a "string" (or the
 * value is not valid JSON), else the JSON value it spells; whitespace between the tags is
 * tolerated. The arguments come back as one JSON object text, as OpenAI sends them.
 *
 * Streaming: tc_feed takes the answer text as it is generated, passes text outside the blocks
 * on at once (holding back only a tail that may be the start of "<tool_call>"), and reports each
 * call when its "</tool_call>" arrives. A block that does not parse (no name, a key without a
 * value, text between the arguments) or is still open at the end goes out as plain text, so
 * nothing the model wrote is lost. Pure: no engine, no I/O (fuzzed and unit tested over
 * strings). */
#ifndef PETREL_SERVE_TOOLCALL_H
#define PETREL_SERVE_TOOLCALL_H
#include <stddef.h>

#include <cjson/cJSON.h>

#include "base/sbuf.h"

typedef void (*tc_text_fn)(void *user, const char *bytes, size_t len);
/* name and arguments (a JSON object's text) are NUL-terminated, valid only during the call. */
typedef void (*tc_call_fn)(void *user, const char *name, const char *arguments);

typedef struct tc_parser {
    const cJSON *tools; /* borrowed: the request's tools array (schemas), may be NULL */
    int inside;         /* 1: between <tool_call> and </tool_call> */
    sbuf buf;           /* outside: a held tail that may begin "<tool_call>"; inside: the body */
} tc_parser;

void tc_init(tc_parser *p, const cJSON *tools);
void tc_feed(tc_parser *p, const char *b, size_t n, tc_text_fn text, tc_call_fn call, void *user);
/* End of the text: whatever is held goes out as text. */
void tc_flush(tc_parser *p, tc_text_fn text, void *user);
void tc_free(tc_parser *p);

/* One block's body (the text between <tool_call> and </tool_call>): 0 with *name and *args
 * (malloc'd; args a compact JSON object) or -1 when it is not a tool call. */
int tc_parse_body(const char *b, size_t n, const cJSON *tools, char **name, char **args);
#endif
