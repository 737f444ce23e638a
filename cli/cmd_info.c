/* cmd_info.c: `petrel info` prints a model's config, its per-layer schedule, the tensor
 * inventory by kind with the memory each part takes, and the KV cache cost per token. */
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static const char *usage =
    "usage: petrel info --model DIR\n"
    "Prints the config, the layer schedule, the tensor inventory by kind and memory use.\n" CLI_MODEL_OPTS_HELP;

CLI_CMD(info) {
    cli_model_opts mo = {0};
    for (int i = 1; i < argc; i++) {
        int r = cli_model_opt(argc, argv, &i, &mo);
        if (r < 0) return 1;
        if (r) continue;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { fputs(usage, stdout); return 0; }
        return cli_fail("info: unknown option \"%s\" (petrel info --help)", argv[i]);
    }
    if (!mo.model) return cli_fail("info: --model is required");
    petrel_error err = {0};
    petrel_engine *eng;
    mo.open.inspect_only = 1; /* a description: no copy of gigabytes of weights */
    if (cli_engine_open(&mo, &eng, &err)) return cli_fail_err("info", &err);
    char *text = NULL;
    int rc = 0;
    if (petrel_engine_describe(eng, &text, &err)) rc = cli_fail_err("info", &err);
    else printf("model            %s\n%s", mo.model, text);
    free(text);
    return cli_engine_close("info", eng, rc);
}
