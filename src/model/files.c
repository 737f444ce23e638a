/* files.c: a model's side files (tokenizer.json, tokenizer_config.json, generation_config.json,
 * chat_template.jinja) for front ends, from wherever the model keeps them: a Hugging Face or
 * colibri folder (the folder of a .safetensors file), or the copies a pack stores inside
 * (pack.h "files", each checked against its checksum as it is read). Opening a pack here parses
 * its header only: no weights are touched. */
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/err.h"
#include "base/file.h"
#include "io/pack.h"
#include "text/jinja.h"

/* Where a model keeps `name`: *p the opened pack (1), or path the file beside the model's folder
 * (0, the file may not exist); < 0 when the model cannot be opened. */
static int side_file(const char *model, const char *name, pack **p, char *path, size_t cap, petrel_error *err) {
    *p = NULL;
    if (!model || !*model) return pt_err(err, PETREL_EINVAL, "no model path given");
    struct stat st;
    if (stat(model, &st) < 0) return pt_err(err, PETREL_EIO, "cannot open model %s: no such file or folder", model);
    if (!S_ISDIR(st.st_mode) && pack_is_pack(model)) {
        PT_TRY(pack_open(model, p, err));
        return 1;
    }
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s", model);
    snprintf(path, cap, "%s/%s", S_ISDIR(st.st_mode) ? model : dirname(tmp), name); /* a .safetensors file: its folder's */
    return 0;
}

static int is_file(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

int petrel_model_file(const char *model, const char *name, char **out, size_t *len, petrel_error *err) {
    *out = NULL;
    pack *p;
    char path[8400];
    int where = side_file(model, name, &p, path, sizeof path, err);
    if (where < 0) return where;
    if (where) {
        int rc = pack_read_file(p, name, out, len, err);
        pack_close(p);
        return rc;
    }
    if (!is_file(path)) {
        path[strlen(path) - strlen(name) - 1] = 0; /* the folder */
        return pt_err(err, PETREL_EIO, "%s has no %s", path, name);
    }
    return pt_read_file(path, (size_t)PACK_FILE_MAX_BYTES, out, len, err);
}

int petrel_model_has_file(const char *model, const char *name, petrel_error *err) {
    pack *p;
    char path[8400];
    int where = side_file(model, name, &p, path, sizeof path, err);
    if (where <= 0) return where < 0 ? where : is_file(path);
    int has = pack_find_file(p, name) != NULL;
    pack_close(p);
    return has;
}

int petrel_model_is_pack(const char *path) { return path && pack_is_pack(path); }

int petrel_model_chat_template(const char *model, char **out, size_t *len, petrel_error *err) {
    *out = NULL;
    struct stat st;
    if (!model || !*model) return pt_err(err, PETREL_EINVAL, "no model path given");
    if (stat(model, &st) < 0) return pt_err(err, PETREL_EIO, "cannot open model %s: no such file or folder", model);
    if (S_ISDIR(st.st_mode)) return jinja_load_chat_template(model, out, len, err);
    if (!pack_is_pack(model)) { /* a .safetensors file: its folder */
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s", model);
        return jinja_load_chat_template(dirname(tmp), out, len, err);
    }
    petrel_error e2 = {0};
    if (petrel_model_file(model, "chat_template.jinja", out, len, &e2) == 0) return 0;
    if (e2.code != PETREL_EIO || !strstr(e2.msg, "stores no")) { /* a damaged copy, not an absent one */
        if (err) *err = e2;
        return e2.code;
    }
    char *cfg = NULL;
    size_t cl = 0;
    int rc = petrel_model_file(model, "tokenizer_config.json", &cfg, &cl, err);
    if (rc < 0) {
        if (rc == PETREL_EIO && err && strstr(err->msg, "stores no"))
            return pt_err(err, PETREL_EIO, "%s stores no chat template (no chat_template.jinja, no tokenizer_config.json): convert it from a folder "
                                           "that has one, or give --template FILE", model);
        return rc;
    }
    char where[4200];
    snprintf(where, sizeof where, "%s (its tokenizer_config.json)", model);
    rc = jinja_chat_template_from_config(cfg, cl, where, out, len, err);
    free(cfg);
    return rc;
}
