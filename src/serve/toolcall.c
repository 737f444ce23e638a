/* toolcall.c: GLM-5.2 tool-call blocks in generated text (see toolcall.h). */
#include "serve/toolcall.h"

#include <stdlib.h>
#include <string.h>

static const char OPEN[] = "<tool_call>", CLOSE[] = "</tool_call>";
#define OPEN_N (sizeof OPEN - 1)
#define CLOSE_N (sizeof CLOSE - 1)

void tc_init(tc_parser *p, const cJSON *tools) {
    memset(p, 0, sizeof *p);
    p->tools = tools;
}

void tc_free(tc_parser *p) {
    free(p->buf.p);
    memset(p, 0, sizeof *p);
}

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* The schema type of tool `name`'s property `key` is (or admits) "string". */
static int arg_is_string(const cJSON *tools, const char *name, const char *key, const char *v, size_t vn) {
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(t, "function");
        if (!cJSON_IsObject(f)) f = t;
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(f, "name");
        if (!cJSON_IsString(nm) || strcmp(nm->valuestring, name)) continue;
        const cJSON *pr = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(f, "parameters"), "properties");
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(pr, key), "type");
        if (cJSON_IsString(ty)) return !strcmp(ty->valuestring, "string");
        if (cJSON_IsArray(ty)) {
            int str = 0, nul = 0;
            const cJSON *e;
            cJSON_ArrayForEach(e, ty) {
                if (cJSON_IsString(e) && !strcmp(e->valuestring, "string")) str = 1;
                if (cJSON_IsString(e) && !strcmp(e->valuestring, "null")) nul = 1;
            }
            return str && !(nul && vn == 4 && !memcmp(v, "null", 4));
        }
        return 0;
    }
    return 0;
}

static const char *find(const char *h, size_t hn, const char *s) { return memmem(h, hn, s, strlen(s)); }

/* A value: the JSON it spells unless the schema says string or it is not whole valid JSON. */
static cJSON *arg_value(const cJSON *tools, const char *name, const char *key, const char *v, size_t vn) {
    if (!arg_is_string(tools, name, key, v, vn)) {
        const char *end = NULL;
        cJSON *j = vn ? cJSON_ParseWithLengthOpts(v, vn, &end, 0) : NULL;
        while (j && end && end < v + vn && is_ws(*end)) end++;
        if (j && end == v + vn) return j;
        cJSON_Delete(j);
    }
    char *s = malloc(vn + 1);
    if (!s) return NULL;
    memcpy(s, v, vn);
    s[vn] = 0;
    cJSON *j = cJSON_CreateString(s);
    free(s);
    return j;
}

int tc_parse_body(const char *b, size_t n, const cJSON *tools, char **name_out, char **args_out) {
    *name_out = *args_out = NULL;
    const char *end = b + n, *k = find(b, n, "<arg_key>");
    const char *ne = k ? k : end, *ns = b;
    while (ns < ne && is_ws(*ns)) ns++;
    while (ne > ns && is_ws(ne[-1])) ne--;
    if (ne == ns || memchr(ns, '<', (size_t)(ne - ns)) || memchr(ns, '>', (size_t)(ne - ns)) || memchr(ns, 0, (size_t)(ne - ns))) return -1;
    char *name = malloc((size_t)(ne - ns) + 1);
    cJSON *args = cJSON_CreateObject();
    if (!name || !args) goto fail;
    memcpy(name, ns, (size_t)(ne - ns));
    name[ne - ns] = 0;
    const char *p = k ? k : end;
    while (p < end) {
        if ((size_t)(end - p) < 9 || memcmp(p, "<arg_key>", 9)) goto fail;
        p += 9;
        const char *ke = find(p, (size_t)(end - p), "</arg_key>");
        if (!ke || find(p, (size_t)(ke - p), "<arg_")) goto fail;
        size_t kl = (size_t)(ke - p);
        if (memchr(p, 0, kl)) goto fail; /* a NUL cannot be in a member name */
        char *key = malloc(kl + 1);
        if (!key) goto fail;
        memcpy(key, p, kl);
        key[kl] = 0;
        p = ke + 10;
        while (p < end && is_ws(*p)) p++;
        const char *ve = NULL;
        if ((size_t)(end - p) >= 11 && !memcmp(p, "<arg_value>", 11)) ve = find(p + 11, (size_t)(end - p - 11), "</arg_value>");
        if (!ve) { free(key); goto fail; }
        p += 11;
        cJSON *v = arg_value(tools, name, key, p, (size_t)(ve - p));
        if (!v) { free(key); goto fail; }
        if (cJSON_GetObjectItemCaseSensitive(args, key)) cJSON_ReplaceItemInObjectCaseSensitive(args, key, v);
        else cJSON_AddItemToObject(args, key, v);
        free(key);
        p = ve + 12;
        while (p < end && is_ws(*p)) p++;
    }
    char *txt = cJSON_PrintUnformatted(args);
    cJSON_Delete(args);
    if (!txt) { free(name); return -1; }
    *name_out = name;
    *args_out = txt;
    return 0;
fail:
    free(name);
    cJSON_Delete(args);
    return -1;
}

/* The length of the longest suffix of b[0..n) that is a proper prefix of s. */
static size_t partial_tail(const char *b, size_t n, const char *s, size_t sn) {
    for (size_t l = sn - 1; l > 0; l--)
        if (l <= n && !memcmp(b + n - l, s, l)) return l;
    return 0;
}

static void drop_front(sbuf *b, size_t k) {
    memmove(b->p, b->p + k, b->n - k);
    b->n -= k;
}

void tc_feed(tc_parser *p, const char *b, size_t n, tc_text_fn text, tc_call_fn call, void *user) {
    if (!n) return;
    sb_add(&p->buf, b, n);
    if (p->buf.oom) return;
    for (;;) {
        if (!p->inside) {
            const char *o = find(p->buf.p, p->buf.n, OPEN);
            if (!o) {
                size_t keep = partial_tail(p->buf.p, p->buf.n, OPEN, OPEN_N);
                if (p->buf.n > keep) text(user, p->buf.p, p->buf.n - keep);
                drop_front(&p->buf, p->buf.n - keep);
                return;
            }
            size_t at = (size_t)(o - p->buf.p);
            if (at) text(user, p->buf.p, at);
            drop_front(&p->buf, at + OPEN_N);
            p->inside = 1;
        } else {
            const char *c = find(p->buf.p, p->buf.n, CLOSE);
            if (!c) return;
            size_t at = (size_t)(c - p->buf.p);
            char *name = NULL, *args = NULL;
            if (tc_parse_body(p->buf.p, at, p->tools, &name, &args) == 0) call(user, name, args);
            else { /* not a call: the block goes out as the model wrote it */
                text(user, OPEN, OPEN_N);
                text(user, p->buf.p, at + CLOSE_N);
            }
            free(name);
            free(args);
            drop_front(&p->buf, at + CLOSE_N);
            p->inside = 0;
        }
    }
}

void tc_flush(tc_parser *p, tc_text_fn text, void *user) {
    if (p->inside) text(user, OPEN, OPEN_N);
    if (p->buf.n) text(user, p->buf.p, p->buf.n);
    p->buf.n = 0;
    p->inside = 0;
}
