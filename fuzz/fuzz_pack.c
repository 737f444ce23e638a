/* fuzz_pack.c: libFuzzer target for the pack header parser (src/io/pack.c). The input is used
 * twice: as a whole file image (prefix included, so magic/version/length checks are reached),
 * and as the JSON header behind a valid prefix with a correct header checksum (so the directory
 * validation is reached). pack_parse must reject bad input with an error, never crash. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "io/pack.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    pack p;
    petrel_error err;
    if (pack_parse(data, size, size, "fuzz", &p, &err) == 0) pack_deinit(&p);
    size_t n = PACK_PREFIX + size;
    uint8_t *b = malloc(n ? n : 1);
    if (!b) return 0;
    memset(b, 0, PACK_PREFIX);
    memcpy(b, PACK_MAGIC, 8);
    uint32_t ver = PACK_VERSION;
    uint64_t hl = size, hh = XXH64(data, size, 0);
    /* claim a file large enough for typical directories so range checks, not size, decide */
    uint64_t fs = (uint64_t)1 << 30;
    memcpy(b + 8, &ver, 4);
    memcpy(b + 16, &hl, 8);
    memcpy(b + 24, &fs, 8);
    memcpy(b + 32, &hh, 8);
    memcpy(b + PACK_PREFIX, data, size);
    if (pack_parse(b, n, fs, "fuzz", &p, &err) == 0) pack_deinit(&p);
    free(b);
    return 0;
}
