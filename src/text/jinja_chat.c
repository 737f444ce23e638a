/* jinja_chat.c: locating a model folder's chat template (chat_template.jinja, or the
 * chat_template field of tokenizer_config.json, a string or a list of named templates). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "text/jinja.h"

static int read_file(const char *path, char **out, size_t *len, petrel_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return pt_err(err, PETREL_EIO, "cannot open %s: %s", path, strerror(errno));
    size_t cap = 65536, n = 0;
    char *b = malloc(cap + 1);
    if (!b) { fclose(f); return pt_err(err, PETREL_ENOMEM, "out of memory reading %s", path); }
    for (;;) {
        if (n == cap) {
            if (cap > ((size_t)1 << 30)) { free(b); fclose(f); return pt_err(err, PETREL_ERANGE, "%s is too large", path); }
            char *nb = realloc(b, cap * 2 + 1);
            if (!nb) { free(b); fclose(f); return pt_err(err, PETREL_ENOMEM, "out of memory reading %s", path); }
            b = nb;
            cap *= 2;
        }
        size_t k = fread(b + n, 1, cap - n, f);
        n += k;
        if (k == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) { free(b); return pt_err(err, PETREL_EIO, "cannot read %s", path); }
    b[n] = 0;
    *out = b;
    *len = n;
    return 0;
}

int jinja_load_chat_template(const char *dir, char **out, size_t *out_len, petrel_error *err) {
    char path[4096];
    *out = NULL;
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    size_t len;
    FILE *probe = fopen(path, "rb");
    if (probe) {
        fclose(probe);
        int rc = read_file(path, out, &len, err);
        if (rc == 0 && out_len) *out_len = len;
        return rc;
    }
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    char *text;
    int rc = read_file(path, &text, &len, err);
    if (rc < 0) return pt_err(err, PETREL_EIO, "%s has no chat_template.jinja and no readable tokenizer_config.json", dir);
    cJSON *j = cJSON_ParseWithLength(text, len);
    free(text);
    if (!j) return pt_err(err, PETREL_EFORMAT, "%s is not valid JSON", path);
    const cJSON *ct = cJSON_GetObjectItemCaseSensitive(j, "chat_template");
    const char *tmpl = NULL;
    if (cJSON_IsString(ct)) {
        tmpl = ct->valuestring;
    } else if (cJSON_IsArray(ct)) {
        const cJSON *first = NULL, *e;
        cJSON_ArrayForEach(e, ct) {
            const cJSON *nm = cJSON_GetObjectItemCaseSensitive(e, "name");
            const cJSON *tp = cJSON_GetObjectItemCaseSensitive(e, "template");
            if (!cJSON_IsString(tp)) continue;
            if (!first) first = tp;
            if (cJSON_IsString(nm) && !strcmp(nm->valuestring, "default")) { tmpl = tp->valuestring; break; }
        }
        if (!tmpl && first) tmpl = first->valuestring;
    }
    if (!tmpl) {
        cJSON_Delete(j);
        return pt_err(err, PETREL_EFORMAT, "%s has no chat_template", path);
    }
    len = strlen(tmpl);
    *out = malloc(len + 1);
    if (!*out) { cJSON_Delete(j); return pt_err(err, PETREL_ENOMEM, "out of memory"); }
    memcpy(*out, tmpl, len + 1);
    if (out_len) *out_len = len;
    cJSON_Delete(j);
    return 0;
}
