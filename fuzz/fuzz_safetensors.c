/* fuzz_safetensors.c: libFuzzer target for the untrusted parsers of checkpoint metadata: the
 * safetensors header (st_parse) and config.json (config_parse). The first input byte picks the
 * parser. Build with `make fuzz`; run build-fuzz/fuzz_safetensors fuzz/corpus/safetensors. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "io/safetensors.h"
#include "model/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    petrel_error err = {0};
    if (data[0] & 1) {
        st_tensor *ts = NULL;
        int n = 0;
        if (st_parse(data + 1, size - 1, "fuzz", 0, &ts, &n, &err) == 0) {
            /* every accepted tensor must lie inside the buffer */
            for (int i = 0; i < n; i++) {
                const uint8_t *end = ts[i].data + (ts[i].end - ts[i].begin);
                if (ts[i].data < data + 1 || end > data + size) abort();
            }
        }
        for (int i = 0; i < n; i++) free(ts[i].name);
        free(ts);
    } else {
        petrel_config cfg;
        if (config_parse((const char *)data + 1, size - 1, "fuzz.json", &cfg, &err) == 0) config_deinit(&cfg);
    }
    return 0;
}
