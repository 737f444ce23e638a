/* cmd_synth.c: `petrel synth` writes a pack with GLM-5.2's real shapes and random weights, for
 * benchmarks (the full model does not fit the development machines). */
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "io/convert.h"
#include "kernels/kernels.h"
#include "model/synth.h"

static const char *usage =
    "usage: petrel synth --shape glm5.2 --dense-layers N --moe-layers M --out PACK [options]\n"
    "Writes a pack with GLM-5.2 layer shapes and random weights (uniform, std 1/sqrt(fan_in)).\n"
    "  --quant Q / --experts Q / --attention Q / --dense Q / --embed Q / --mtp Q  as in convert\n"
    "  --expert-layout r16|plain  as in convert (default r16)\n"
    "                   (default: experts q4, everything else q8; --experts q4x writes the same\n"
    "                   bytes, read at the same speed, with ~5x the CPU time to write: random\n"
    "                   weights gain nothing from its search, so round to nearest stays the default)\n"
    "  --seed S         random seed (default 1)\n"
    "  --with-mtp       also write the MTP layer\n"
    "  --threads N      generation threads (default: all cores)\n"
    "  --quiet          no progress lines\n";

CLI_CMD(synth) {
    const char *shape = NULL, *out = NULL;
    long dense = -1, moe = -1, thr = 0, seed = 1;
    int mtp = 0;
    convert_opts o = {0};
    o.progress = 1;
    o.label = "synth";
    for (int i = 1; i < argc; i++) {
        int r = cli_quant_opt(argc, argv, &i, &o);
        if (r < 0) return 1;
        if (r) continue;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { fputs(usage, stdout); return 0; }
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc) shape = argv[++i];
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else if (!strcmp(argv[i], "--quiet")) o.progress = 0;
        else if (!strcmp(argv[i], "--with-mtp")) mtp = 1;
        else if (!strcmp(argv[i], "--dense-layers") && i + 1 < argc) {
            if (cli_parse_int(argv[++i], 0, 78, &dense)) return cli_fail("synth: --dense-layers: \"%s\" is not in 0..78", argv[i]);
        } else if (!strcmp(argv[i], "--moe-layers") && i + 1 < argc) {
            if (cli_parse_int(argv[++i], 0, 78, &moe)) return cli_fail("synth: --moe-layers: \"%s\" is not in 0..78", argv[i]);
        } else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
            if (cli_parse_int(argv[++i], 0, 2147483647L, &seed)) return cli_fail("synth: --seed: \"%s\" is not a number", argv[i]);
        } else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            if (cli_parse_int(argv[++i], 0, 1024, &thr)) return cli_fail("synth: --threads: \"%s\" is not a number", argv[i]);
        } else return cli_fail("synth: unknown or incomplete option \"%s\" (petrel synth --help)", argv[i]);
    }
    if (!shape || strcmp(shape, "glm5.2")) return cli_fail("synth: --shape glm5.2 is required (the only shape so far)");
    if (!out) return cli_fail("synth: --out is required");
    if (cli_out_check("synth", out, NULL)) return 1;
    if (dense < 0) dense = 1;
    if (moe < 0) moe = 1;
    if (dense + moe < 1 || dense + moe > 78) return cli_fail("synth: need 1..78 layers in all");
    if (o.quant == CVQ_DEFAULT) {
        o.quant = CVQ_Q8;
        if (o.cls[CV_EXPERTS] == CVQ_DEFAULT) o.cls[CV_EXPERTS] = CVQ_Q4;
    }
    kn_init((int)thr);
    char *cfg = synth_glm52_config((int)dense, (int)moe);
    if (!cfg) return cli_fail("synth: out of memory");
    petrel_error err = {0};
    convert_result res;
    int rc = synth_write(cfg, out, &o, (uint64_t)seed, mtp, &res, &err);
    free(cfg);
    if (rc) return cli_fail_err("synth", &err);
    fprintf(stderr, "synth: wrote %s: %d items, %.1f MB\n", out, res.items, (double)res.file_bytes / 1e6);
    return 0;
}
