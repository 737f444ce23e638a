/* cmd_convert.c: `petrel convert` writes a petrel pack (src/io/pack.h) from a Hugging Face
 * checkpoint, with per-class number formats. Resumable: rerunning after an interruption keeps
 * the verified part of OUT.partial. Also holds the quant-option parser shared with synth. */
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "io/colibri.h"
#include "io/convert.h"
#include "kernels/kernels.h"

static const char *usage =
    "usage: petrel convert --in SRC --out PACK [--quant bf16|q8|q4] [class overrides]\n"
    "Writes a petrel pack from a Hugging Face folder (bf16 or FP8, sharded or not) or a colibri\n"
    "artifact folder (out-*.safetensors shards; int4/int8 payloads are decoded exactly).\n"
    "  --out PACK       written as PACK.partial (+ PACK.partial.journal) and renamed to PACK only\n"
    "                   when complete and verified; a failed run leaves only those two, for resuming\n"
    "                   (rerun the same command). A symlink, FIFO, device or a file of the input\n"
    "                   model as PACK is refused.\n"
    "  --quant Q        format for every class (default bf16; bf16 keeps FP8/f16 sources as they are)\n"
    "  --experts Q      routed experts            --attention Q  attention incl. indexer\n"
    "  --dense Q        dense MLPs + shared experts --embed Q     embeddings + lm_head\n"
    "  --mtp Q          the MTP layer (default q8 when --quant q4: int4 breaks drafting)\n"
    "  Q is one of f32, bf16, q8 (int8 / 32 columns), q8row (int8 / row), q4 (int4 / 64 columns).\n"
    "  Norms, biases and the router are always f32.\n"
    "  --expert-layout L  r16 (default): q8/q4 routed experts stored 16 rows interleaved, the layout\n"
    "                   of the AVX-512 VNNI kernels (same bytes, read with one stream); plain: row by\n"
    "                   row (for CPUs without AVX-512 VNNI, which run r16 with a slow scalar kernel)\n"
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
    if (q < 0) { cli_fail("%s: \"%s\" is not one of f32, bf16, q8, q8row, q4", a, v); return -1; }
    if (cls < 0) o->quant = q;
    else o->cls[cls] = q;
    return 1;
}

CLI_CMD(convert) {
    const char *in = NULL, *out = NULL;
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
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            if (cli_parse_int(argv[++i], 0, 1024, &thr)) return cli_fail("convert: --threads: \"%s\" is not a number", argv[i]);
        } else return cli_fail("convert: unknown or incomplete option \"%s\" (petrel convert --help)", argv[i]);
    }
    if (!in) return cli_fail("convert: --in is required");
    if (!out) return cli_fail("convert: --out is required");
    if (cli_out_check("convert", out, in)) return 1; /* not a link, FIFO, device, nor the input */
    kn_init((int)thr);
    petrel_error err = {0};
    convert_result res;
    int rc = colibri_detect(in) ? colibri_convert(in, out, &o, &res, &err) : convert_hf(in, out, &o, &res, &err);
    if (rc) return cli_fail_err("convert", &err);
    fprintf(stderr, "convert: wrote %s: %d items, %.1f MB%s\n", out, res.items, (double)res.file_bytes / 1e6,
            res.resumed ? " (resumed)" : "");
    return 0;
}
