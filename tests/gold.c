/* gold.c: looking up a golden file's tensors (kept apart from runner.c so that the kernel-only
 * test build, bench/build_bench.sh, needs no safetensors reader). */
#include <stdio.h>

#include "io/safetensors.h"
#include "test.h"

const struct st_tensor *test_gold(const struct st_set *g, int prompt, const char *part) {
    char n[128];
    snprintf(n, sizeof n, "prompt_%d.%s", prompt, part);
    return st_find(g, n);
}
