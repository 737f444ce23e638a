/* jinja_chat.c: locating a model folder's chat template (chat_template.jinja, or the
 * chat_template field of tokenizer_config.json, a string or a list of named templates). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/err.h"
#include "base/file.h"
#include "text/jinja.h"


int jinja_load_chat_template(const char *dir, char **out, size_t *out_len, petrel_error *err) {
    char path[4096];
    *out = NULL;
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    size_t len;
    struct stat st;
    if (stat(path, &st) == 0) { /* present: it must be readable (an unreadable one is an error, not skipped) */
        int rc = pt_read_file(path, (size_t)1 << 30, out, &len, err);
        if (rc == 0 && out_len) *out_len = len;
        return rc;
    }
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    char *text;
    int rc = pt_read_file(path, (size_t)1 << 30, &text, &len, err);
    if (rc < 0) return pt_err(err, PETREL_EIO, "%s has no chat_template.jinja and no readable tokenizer_config.json", dir);
    rc = jinja_chat_template_from_config(text, len, path, out, out_len, err);
    free(text);
    return rc;
}

int jinja_chat_template_from_config(const char *text, size_t len, const char *path, char **out, size_t *out_len, petrel_error *err) {
    *out = NULL;
    cJSON *j = cJSON_ParseWithLength(text, len);
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
