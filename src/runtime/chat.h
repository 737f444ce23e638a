/* chat.h: pieces of a chat turn around the chat template: the message list (a cJSON array of
 * {role, content[, reasoning_content]}), rendering it with add_generation_prompt /
 * enable_thinking, and splitting generated text into thinking (between <think> and </think>) and
 * answer as it streams. Used by `petrel chat` and `petrel run --chat`. */
#ifndef PETREL_RUNTIME_CHAT_H
#define PETREL_RUNTIME_CHAT_H
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "petrel.h"
#include "text/jinja.h"
#include "text/tokenizer.h"

/* Appends {role, content} (and reasoning_content when reasoning is not NULL) to the array. */
int chat_add_message(cJSON *messages, const char *role, const char *content, const char *reasoning,
                     petrel_error *err);
/* Renders the template with variables messages, add_generation_prompt and enable_thinking
 * (enable_thinking < 0 leaves it undefined). *out is malloc'd and NUL-terminated. */
int chat_render(const jinja_template *t, const cJSON *messages, int add_generation_prompt,
                int enable_thinking, char **out, size_t *out_len, petrel_error *err);
/* 1 if text ends inside a thinking block: its last "<think>" comes after its last "</think>". */
int chat_ends_in_think(const char *text, size_t len);

/* A malloc'd, NUL-terminated copy of s[0..n) in which every byte that is not part of a valid
 * UTF-8 sequence is replaced by U+FFFD (generated text may hold stray bytes; the tokenizer
 * refuses invalid UTF-8). NULL when out of memory. */
char *chat_utf8_clean(const char *s, size_t n);
/* The offset of the first byte of s[0..n) that is not part of a valid UTF-8 sequence; n if the
 * text is valid UTF-8. */
size_t chat_utf8_check(const char *s, size_t n);

/* Streaming split of generated pieces into thinking and answer. The tags are recognized as
 * the tokenizer's single "<think>" / "</think>" tokens (as GLM generates them) and are not
 * passed on. */
typedef void (*chat_out_fn)(void *user, int thinking, const char *bytes, size_t len);
typedef struct chat_split {
    int32_t open_id, close_id; /* -1 when the tokenizer lacks them (no splitting) */
    const char *open_s, *close_s;
    size_t open_n, close_n;
    int in_think;
} chat_split;
void chat_split_init(chat_split *cs, const tokenizer *t, int in_think);
/* Routes one piece (as given by gen_generate's callback) to out. */
void chat_split_piece(chat_split *cs, int32_t id, const char *bytes, size_t len, chat_out_fn out,
                      void *user);
#endif
