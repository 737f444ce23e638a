/* cmd_logits.c: `petrel logits` writes little-endian float32 logits [T, vocab] for every
 * position of a prompt, from one batched pass or (--decode) one token at a time through the
 * cache. */
#include <stdlib.h>
#include <string.h>

#include "base/outfile.h"
#include "cli.h"

static const char *usage =
    "usage: petrel logits --model DIR --ids 1,2,3 --out FILE [--decode | --mtp]\n"
    "Writes little-endian float32 logits [T, vocab] for every prompt position to FILE.\n"
    "  --ids LIST           prompt token ids, comma separated\n"
    "  --out FILE           output file (written whole at the end, or not at all; a symlink,\n"
    "                       FIFO, device or a file of the model is refused)\n"
    "  --decode             feed the prompt one token at a time through the KV cache\n"
    "  --mtp                the MTP head's logits instead, [T-1, vocab]: row i from the main model's\n"
    "                       final-normed hidden state at position i and the embedding of id i+1\n" CLI_MODEL_OPTS_HELP;

CLI_CMD(logits) {
    cli_model_opts mo = {0};
    const char *ids_s = NULL, *out = NULL;
    int decode = 0, mtp = 0;
    for (int i = 1; i < argc; i++) {
        int r = cli_model_opt(argc, argv, &i, &mo);
        if (r < 0) return 1;
        if (r) continue;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { fputs(usage, stdout); return 0; }
        else if (!strcmp(argv[i], "--decode")) decode = 1;
        else if (!strcmp(argv[i], "--mtp")) mtp = 1;
        else if (!strcmp(argv[i], "--ids") && i + 1 < argc) ids_s = argv[++i];
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else return cli_fail("logits: unknown or incomplete option \"%s\" (petrel logits --help)", argv[i]);
    }
    if (!mo.model) return cli_fail("logits: --model is required");
    if (!ids_s) return cli_fail("logits: --ids is required");
    if (!out) return cli_fail("logits: --out is required");
    if (decode && mtp) return cli_fail("logits: --decode and --mtp do not combine (the MTP rows come from one pass)");
    if (cli_out_check("logits", out, mo.model)) return 1; /* before the model runs */
    char msg[256];
    int32_t *ids;
    int n = cli_parse_ids(ids_s, &ids, msg, sizeof msg);
    if (n < 0) return cli_fail("logits: --ids: %s", msg);
    if (n == 0) { free(ids); return cli_fail("logits: empty prompt: --ids holds no token ids"); }
    petrel_error err = {0};
    petrel_engine *eng;
    if (cli_engine_open(&mo, &eng, &err)) { free(ids); return cli_fail_err("logits", &err); }
    int V = petrel_engine_vocab_size(eng), rc = 0;
    petrel_session *s = NULL;
    float *lg = malloc(sizeof(float) * (size_t)n * (size_t)V);
    if (!lg) rc = cli_fail("logits: out of memory for %d x %d logits", n, V);
    if (!rc && mtp && (!petrel_engine_has_mtp(eng) || n < 2))
        rc = cli_fail("logits: --mtp: %s", n < 2 ? "the prompt needs at least 2 ids" : "this model has no MTP layer");
    if (!rc && petrel_session_create(eng, n, &s, &err)) rc = cli_fail_err("logits", &err);
    if (!rc && mtp) {
        if (petrel_session_mtp_logits(s, ids, n, lg, &err)) rc = cli_fail_err("logits", &err);
        n--; /* T - 1 rows written */
    } else if (!rc) {
        if (decode) {
            for (int i = 0; i < n && !rc; i++)
                if (petrel_session_forward(s, ids + i, 1, lg + (size_t)i * V, 0, &err)) rc = cli_fail_err("logits", &err);
        } else if (petrel_session_forward(s, ids, n, lg, 1, &err)) rc = cli_fail_err("logits", &err);
    }
    if (!rc) {
        pt_outfile f; /* whole or nothing: a failed write leaves no file */
        if (pt_out_open(&f, out, mo.model, &err) < 0 || pt_out_write(&f, lg, sizeof(float) * (size_t)n * V, &err) < 0 ||
            pt_out_commit(&f, &err) < 0) {
            pt_out_abort(&f);
            rc = cli_fail_err("logits", &err);
        }
    }
    petrel_session_free(s);
    rc = cli_engine_close("logits", eng, rc);
    free(lg);
    free(ids);
    return rc;
}
