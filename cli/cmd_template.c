/* cmd_template.c: `petrel template` renders a chat template over a request JSON and prints the
 * prompt exactly (no added newline). Every top-level key of the request becomes a template
 * variable (messages, tools, add_generation_prompt, enable_thinking, reasoning_effort, ...);
 * keys it lacks stay undefined. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "base/file.h"
#include "cli.h"
#include "text/jinja.h"

static const char HELP[] =
    "usage: petrel template (--template FILE | --model DIR) --input REQ.json\n"
    "\n"
    "Renders a Jinja chat template (Hugging Face semantics: trim_blocks, lstrip_blocks) and prints\n"
    "the prompt to stdout exactly, with no newline added.\n"
    "\n"
    "  --template FILE   the template text (e.g. chat_template.jinja)\n"
    "  --model DIR|PACK  take DIR/chat_template.jinja, else the chat_template of\n"
    "                    DIR/tokenizer_config.json (a named list picks \"default\"); of a\n"
    "                    pack, the copies it stores\n"
    "  --input FILE      request JSON object, '-' for stdin; each top-level key is a variable:\n"
    "                    messages, tools, add_generation_prompt, enable_thinking,\n"
    "                    reasoning_effort, bos_token, ... (absent keys are undefined)\n"
    "  --help            this text\n";


CLI_CMD(template) {
    const char *tmpl_path = NULL, *model = NULL, *input = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(HELP, stdout);
            return 0;
        }
        const char **dst = !strcmp(a, "--template") ? &tmpl_path : !strcmp(a, "--model") ? &model
                         : !strcmp(a, "--input") ? &input : NULL;
        if (!dst) return cli_fail("template: unknown option \"%s\" (petrel template --help)", a);
        if (i + 1 >= argc) return cli_fail("template: %s needs a value", a);
        *dst = argv[++i];
    }
    if (!tmpl_path == !model) return cli_fail("template: give exactly one of --template FILE or --model DIR");
    if (!input) return cli_fail("template: --input REQ.json is required");

    petrel_error err = {0};
    char *tmpl = NULL;
    size_t tlen = 0;
    if (tmpl_path) {
        if (pt_read_file(tmpl_path, (size_t)1 << 30, &tmpl, &tlen, &err)) return cli_fail_err("template", &err);
    } else if (petrel_model_chat_template(model, &tmpl, &tlen, &err) < 0) {
        return cli_fail_err("template", &err);
    }
    size_t ilen = 0;
    char *req_text = NULL;
    if (pt_read_file(input, (size_t)1 << 30, &req_text, &ilen, &err)) {
        free(tmpl);
        return cli_fail_err("template", &err);
    }
    const char *end = NULL;
    cJSON *req = cJSON_ParseWithLengthOpts(req_text, ilen, &end, 0);
    if (!req || !cJSON_IsObject(req)) {
        long off = end ? (long)(end - req_text) : (long)(cJSON_GetErrorPtr() ? cJSON_GetErrorPtr() - req_text : 0);
        cJSON_Delete(req);
        free(req_text);
        free(tmpl);
        return cli_fail("template: %s is not a JSON object (near byte %ld)", input, off);
    }
    free(req_text);
    char *out = NULL;
    size_t olen = 0;
    int rc = jinja_render(tmpl, tlen, req, &out, &olen, &err);
    cJSON_Delete(req);
    free(tmpl);
    if (rc < 0) return cli_fail_err("template", &err);
    size_t w = fwrite(out, 1, olen, stdout);
    free(out);
    if (w != olen || fflush(stdout) != 0) return cli_fail("template: writing the output failed");
    return 0;
}
