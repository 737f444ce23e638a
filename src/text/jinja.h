/* jinja.h: a Jinja interpreter for chat templates (the templates shipped in Hugging Face
 * tokenizer_config.json / chat_template.jinja). It follows the semantics of @huggingface/jinja
 * (what transformers.js and the HF hub render with): trim_blocks and lstrip_blocks on, one
 * trailing newline of the template dropped, undefined prints as "", none prints as "",
 * booleans print as true/false, dicts and lists print as JSON, tojson defaults to
 * ensure_ascii=False. Where @huggingface/jinja has no answer (a filter it lacks), Python Jinja2's
 * behaviour is used.
 *
 * Variables come from a cJSON object: each top-level key becomes a template variable. Globals:
 * true/false/none (and True/False/None), namespace(), range(), raise_exception(), strftime_now(),
 * dict().
 *
 * Errors are one line with the template line number ("template line 7: unknown filter 'foo'").
 * Rendering is bounded (output size, memory, steps, recursion depth) so any input is safe.
 * A compiled template is immutable: several threads may render it at once. */
#ifndef PETREL_TEXT_JINJA_H
#define PETREL_TEXT_JINJA_H
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "petrel.h"

typedef struct jinja_template jinja_template;

/* Bounds on one render; a zero field takes the default. */
typedef struct jinja_limits {
    size_t max_output;  /* bytes of rendered text (default 64 MiB) */
    size_t max_memory;  /* bytes of working memory for values (default 512 MiB) */
    uint64_t max_steps; /* evaluation steps (default 200 million) */
    int max_depth;      /* nesting of evaluation / macro calls (default 400) */
} jinja_limits;

/* Parses a template. Syntax errors carry the line number. */
int jinja_compile(const char *src, size_t len, jinja_template **out, petrel_error *err);
void jinja_free(jinja_template *t);

/* Renders with the keys of vars (a JSON object, or NULL for none) as variables. *out is a
 * malloc'd NUL-terminated string (free it); *out_len its length (out_len may be NULL).
 * limits may be NULL for the defaults. */
int jinja_render_compiled(const jinja_template *t, const cJSON *vars, const jinja_limits *limits,
                          char **out, size_t *out_len, petrel_error *err);

/* Compile + render + free in one call. */
int jinja_render(const char *tmpl, size_t len, const cJSON *vars, char **out, size_t *out_len,
                 petrel_error *err);

/* Finds a model folder's chat template: DIR/chat_template.jinja, else the "chat_template" field
 * of DIR/tokenizer_config.json (a string, or a list of {name, template} from which "default"
 * is taken, else the first). *out is malloc'd, NUL-terminated. */
int jinja_load_chat_template(const char *model_dir, char **out, size_t *out_len, petrel_error *err);
/* The chat template in a tokenizer_config.json's text (as above; path names it in messages). */
int jinja_chat_template_from_config(const char *json, size_t len, const char *path, char **out, size_t *out_len,
                                    petrel_error *err);
#endif
