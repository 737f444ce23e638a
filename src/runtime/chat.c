/* chat.c: chat message assembly, template rendering and the thinking/answer split (chat.h). */
#include "runtime/chat.h"

#include <stdlib.h>
#include <string.h>

#include "base/err.h"

int chat_add_message(cJSON *messages, const char *role, const char *content, const char *reasoning,
                     petrel_error *err) {
    cJSON *m = cJSON_CreateObject();
    if (!m || !cJSON_AddStringToObject(m, "role", role) || !cJSON_AddStringToObject(m, "content", content ? content : "") ||
        (reasoning && !cJSON_AddStringToObject(m, "reasoning_content", reasoning)) ||
        !cJSON_AddItemToArray(messages, m)) {
        cJSON_Delete(m);
        return pt_err(err, PETREL_ENOMEM, "chat: out of memory adding a message");
    }
    return 0;
}

int chat_render(const jinja_template *t, const cJSON *messages, int add_generation_prompt,
                int enable_thinking, char **out, size_t *out_len, petrel_error *err) {
    cJSON *vars = cJSON_CreateObject();
    int ok = vars && cJSON_AddItemReferenceToObject(vars, "messages", (cJSON *)messages) &&
             cJSON_AddBoolToObject(vars, "add_generation_prompt", add_generation_prompt != 0) &&
             (enable_thinking < 0 || cJSON_AddBoolToObject(vars, "enable_thinking", enable_thinking != 0));
    if (!ok) {
        cJSON_Delete(vars);
        return pt_err(err, PETREL_ENOMEM, "chat: out of memory rendering the template");
    }
    int rc = jinja_render_compiled(t, vars, NULL, out, out_len, err);
    cJSON_Delete(vars); /* deletes the reference, not the messages */
    if (rc < 0) pt_err_ctx(err, "chat template");
    return rc;
}

static const char *last_occurrence(const char *h, size_t hn, const char *needle) {
    size_t nn = strlen(needle);
    if (hn < nn) return NULL;
    for (size_t i = hn - nn + 1; i-- > 0;)
        if (!memcmp(h + i, needle, nn)) return h + i;
    return NULL;
}

int chat_ends_in_think(const char *text, size_t len) {
    const char *o = last_occurrence(text, len, "<think>"), *c = last_occurrence(text, len, "</think>");
    return o && (!c || o > c);
}

void chat_split_init(chat_split *cs, const tokenizer *t, int in_think) {
    memset(cs, 0, sizeof *cs);
    cs->open_id = tok_token_to_id(t, "<think>");
    cs->close_id = tok_token_to_id(t, "</think>");
    if (cs->open_id >= 0) cs->open_s = tok_id_to_bytes(t, cs->open_id, &cs->open_n);
    if (cs->close_id >= 0) cs->close_s = tok_id_to_bytes(t, cs->close_id, &cs->close_n);
    if (!cs->open_s) cs->open_id = -1;
    if (!cs->close_s) cs->close_id = -1;
    cs->in_think = in_think && cs->close_id >= 0;
}

void chat_split_piece(chat_split *cs, int32_t id, const char *bytes, size_t len, chat_out_fn out,
                      void *user) {
    int is_open = id >= 0 && id == cs->open_id, is_close = id >= 0 && id == cs->close_id;
    if (is_open || is_close) {
        const char *tag = is_open ? cs->open_s : cs->close_s;
        size_t tn = is_open ? cs->open_n : cs->close_n;
        if (len >= tn && !memcmp(bytes + len - tn, tag, tn)) {
            /* bytes before the tag were held back by the detokenizer: they end the old part */
            if (len > tn) out(user, cs->in_think, bytes, len - tn);
            cs->in_think = is_open;
            return;
        }
    }
    if (len) out(user, cs->in_think, bytes, len);
}

/* Length of the valid UTF-8 sequence at s (n bytes left), 0 if invalid. */
static size_t utf8_seq(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t len;
    unsigned lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) len = 2;
    else if (c >= 0xe0 && c <= 0xef) { len = 3; if (c == 0xe0) lo = 0xa0; if (c == 0xed) hi = 0x9f; }
    else if (c >= 0xf0 && c <= 0xf4) { len = 4; if (c == 0xf0) lo = 0x90; if (c == 0xf4) hi = 0x8f; }
    else return 0;
    if (n < len || s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xbf) return 0;
    return len;
}

size_t chat_utf8_check(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        size_t k = utf8_seq(u + i, n - i);
        if (!k) return i;
        i += k;
    }
    return n;
}

char *chat_utf8_clean(const char *s, size_t n) {
    char *o = malloc(n * 3 + 1), *p = o;
    if (!o) return NULL;
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        size_t k = utf8_seq(u + i, n - i);
        if (k) {
            memcpy(p, s + i, k);
            p += k;
            i += k;
        } else {
            memcpy(p, "\xEF\xBF\xBD", 3);
            p += 3;
            i++;
        }
    }
    *p = 0;
    return o;
}
