/* gold.c: looking up a golden file's tensors, converting a fixture to a pack, KL against goldens (kept apart
 * from runner.c so that the kernel-only test build, bench/build_bench.sh, needs no model I/O). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "io/convert.h"
#include "io/safetensors.h"
#include "test.h"

const char *test_pack_of(const char *fixture, int quant) {
    static char path[8][600];
    static int slot, serial;
    char *p = path[slot++ & 7];
    snprintf(p, 600, "%s/%s-q%d-%d.pack", test_tmpdir(), fixture, quant, serial++);
    convert_opts o;
    memset(&o, 0, sizeof o);
    o.quant = quant;
    convert_result res;
    petrel_error err = {0};
    if (convert_hf(test_data(fixture), p, &o, &res, &err)) {
        test_fail(__FILE__, __LINE__, "convert %s: %s", fixture, err.msg);
        return NULL;
    }
    return p;
}

const struct st_tensor *test_gold(const struct st_set *g, int prompt, const char *part) {
    char n[128];
    snprintf(n, sizeof n, "prompt_%d.%s", prompt, part);
    return st_find(g, n);
}

double test_kl_rows(const float *ref, const float *lg, int T, int V) {
    double kl = 0;
    for (int t = 0; t < T; t++) {
        const float *a = ref + (size_t)t * V, *b = lg + (size_t)t * V;
        double ma = a[0], mb = b[0], za = 0, zb = 0, x = 0;
        for (int v = 1; v < V; v++) { if (a[v] > ma) ma = a[v]; if (b[v] > mb) mb = b[v]; }
        for (int v = 0; v < V; v++) { za += exp(a[v] - ma); zb += exp(b[v] - mb); }
        for (int v = 0; v < V; v++) x += exp(a[v] - ma) / za * ((a[v] - ma - log(za)) - (b[v] - mb - log(zb)));
        kl += x;
    }
    return kl;
}
