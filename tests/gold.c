/* gold.c: looking up a golden file's tensors and converting a fixture to a pack (kept apart
 * from runner.c so that the kernel-only test build, bench/build_bench.sh, needs no model I/O). */
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
