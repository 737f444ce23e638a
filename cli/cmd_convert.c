/* cmd_convert.c: `petrel convert` writes a petrel pack (src/io/pack.h) from a Hugging Face
 * checkpoint, with per-class number formats. Resumable: rerunning after an interruption keeps
 * the verified part of OUT.partial. Also holds the quant-option parser shared with synth. */
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "io/calib.h"
#include "io/colibri.h"
#include "io/convert.h"
#include "kernels/kernels.h"

static const char *usage =
    "usage: petrel convert --in SRC --out PACK [--quant bf16|q8|q4|q4x] [class overrides]\n"
    "Writes a petrel pack from a Hugging Face folder (bf16 or FP8, sharded or not) or a colibri\n"
    "artifact folder (out-*.safetensors shards; int4/int8 payloads are decoded exactly).\n"
    "  --out PACK       written as PACK.partial (+ PACK.partial.journal) and renamed to PACK only\n"
    "                   when complete and verified; a failed run leaves only those two, for resuming\n"
    "                   (rerun the same command). A symlink, FIFO, device or a file of the input\n"
    "                   model as PACK is refused.\n"
    "  --quant Q        format for every class (default bf16; bf16 keeps FP8/f16 sources as they are)\n"
    "  --experts Q      routed experts            --attention Q  attention incl. indexer\n"
    "  --dense Q        dense MLPs + shared experts --embed Q     embeddings + lm_head\n"
    "  --mtp Q          the MTP layer (default q8 when --quant q4/q4x: int4 breaks drafting)\n"
    "  Q is one of f32, bf16, q8 (int8 / 32 columns), q8row (int8 / row), q4 (int4 / 64 columns,\n"
    "  round to nearest, as earlier packs), q4x (the same int4 bytes and kernels; scales searched\n"
    "  per group, and with --calib GPTQ-style rounding against the calibration's activations).\n"
    "  --quant q4x is a recipe: int4 q4x for experts, attention and embeddings, q8 for the dense\n"
    "  MLPs, shared experts, DSA indexer and MTP (+4 % bytes on tests/data/trained, ~0.5 % on\n"
    "  GLM-5.2; with --calib half q4's KL divergence there); a class named explicitly wins.\n"
    "  Norms, biases and the router are always f32.\n"
    "  --expert-layout L  r16 (default): q8/q4 routed experts stored 16 rows interleaved, the layout\n"
    "                   of the AVX-512 VNNI kernels (same bytes, read with one stream); plain: row by\n"
    "                   row (for CPUs without AVX-512 VNNI, which run r16 with a slow scalar kernel)\n"
    "  --calib TEXT     run the source model (a Hugging Face folder) over this UTF-8 text first and\n"
    "                   fit q4x to the activations seen there: each matrix's mean x^2 per input\n"
    "                   column (an importance matrix) and, up to 1024 columns, E[x x^T] for GPTQ;\n"
    "                   use text like the model's, but not the text you evaluate on\n"
    "  --calib-ctx N    tokens per calibration window (default 512)\n"
    "  --calib-tokens N use at most the first N tokens of TEXT (default all)\n"
    "  --threads N      conversion threads (default: all cores)\n"
    "  --quiet          no progress lines\n";

/* Consumes a quant option (--quant or a class override); 1 consumed, 0 not one, -1 bad value. */
int cli_quant_opt(int argc, char **argv, int *i, convert_opts *o) {
    const char *a = argv[*i];
    if (!strcmp(a, "--expert-layout")) {
        if (*i + 1 >= argc) { cli_fail("%s needs a value", a); return -1; }
        const char *v = argv[++*i];
        if (strcmp(v, "r16") && strcmp(v, "plain")) { cli_fail("%s: \"%s\" is not r16 or plain", a, v); return -1; }
        o->expert_plain = !strcmp(v, "plain");
        return 1;
    }
    int cls = -2;
    if (!strcmp(a, "--quant")) cls = -1;
    for (int k = 0; k < CV_CLASS_COUNT; k++) {
        char n[32];
        snprintf(n, sizeof n, "--%s", convert_class_names[k]);
        if (!strcmp(a, n)) cls = k;
    }
    if (cls == -2) return 0;
    if (*i + 1 >= argc) { cli_fail("%s needs a value", a); return -1; }
    const char *v = argv[++*i];
    int q = convert_quant_parse(v);
    if (q < 0) { cli_fail("%s: \"%s\" is not one of f32, bf16, q8, q8row, q4, q4x", a, v); return -1; }
    if (cls < 0) o->quant = q;
    else o->cls[cls] = q;
    return 1;
}

CLI_CMD(convert) {
    const char *in = NULL, *out = NULL, *calib = NULL;
    long calib_ctx = 0, calib_tokens = 0;
    convert_opts o = {0};
    o.progress = 1;
    long thr = 0;
    for (int i = 1; i < argc; i++) {
        int r = cli_quant_opt(argc, argv, &i, &o);
        if (r < 0) return 1;
        if (r) continue;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { fputs(usage, stdout); return 0; }
        else if (!strcmp(argv[i], "--in") && i + 1 < argc) in = argv[++i];
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else if (!strcmp(argv[i], "--quiet")) o.progress = 0;
        else if (!strcmp(argv[i], "--calib") && i + 1 < argc) calib = argv[++i];
        else if (!strcmp(argv[i], "--calib-ctx") && i + 1 < argc) {
            if (cli_parse_int(argv[++i], 2, 1 << 20, &calib_ctx)) return cli_fail("convert: --calib-ctx: \"%s\" is not a number >= 2", argv[i]);
        } else if (!strcmp(argv[i], "--calib-tokens") && i + 1 < argc) {
            if (cli_parse_int(argv[++i], 2, 2147483647L, &calib_tokens)) return cli_fail("convert: --calib-tokens: \"%s\" is not a number >= 2", argv[i]);
        } else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            if (cli_parse_int(argv[++i], 0, 1024, &thr)) return cli_fail("convert: --threads: \"%s\" is not a number", argv[i]);
        } else return cli_fail("convert: unknown or incomplete option \"%s\" (petrel convert --help)", argv[i]);
    }
    if (!in) return cli_fail("convert: --in is required");
    if (!out) return cli_fail("convert: --out is required");
    if (cli_out_check("convert", out, in)) return 1; /* not a link, FIFO, device, nor the input */
    kn_init((int)thr);
    petrel_error err = {0};
    calib_stats *cs = NULL;
    if (calib) {
        int any = o.quant == CVQ_Q4X;
        for (int k = 0; k < CV_CLASS_COUNT; k++) any |= o.cls[k] == CVQ_Q4X;
        if (!any) return cli_fail("convert: --calib only affects q4x, and no class is q4x (add --quant q4x or --experts q4x)");
        calib_opts co = {(int)calib_ctx, (int)calib_tokens, (int)thr};
        calib_info ci;
        if (calib_run(in, calib, &co, &cs, &ci, &err)) return cli_fail_err("convert: calibration", &err);
        if (o.progress)
            fprintf(stderr, "convert: calibration: %lld tokens of %s in %d windows, statistics for %d of %d matrices\n",
                    (long long)ci.tokens, calib, ci.windows, ci.observed, ci.matrices);
        o.calib = cs;
    }
    convert_result res;
    int rc = colibri_detect(in) ? colibri_convert(in, out, &o, &res, &err) : convert_hf(in, out, &o, &res, &err);
    calib_free(cs);
    if (rc) return cli_fail_err("convert", &err);
    fprintf(stderr, "convert: wrote %s: %d items, %.1f MB%s\n", out, res.items, (double)res.file_bytes / 1e6,
            res.resumed ? " (resumed)" : "");
    return 0;
}
