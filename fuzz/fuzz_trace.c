/* fuzz_trace.c: libFuzzer target for the routing-trace reader (src/experts/trace.c, what `bench
 * --route-trace / --trace` and `plan --route-trace` read) and the usage-history reader of `petrel
 * plan` (src/model/plan.c, `<model>.petrel-usage`). The input is written to a private temporary
 * file and read as a trace; a trace it accepts must be consistent (every id in range, -1 or
 * ascending within a row) and, when small, replays through the policy, LRU and Belady with hits
 * never above accesses. The same bytes are then read as a usage history of 2 layers x 8 experts:
 * a refusal is one line, an accepted one gives a hit rate in [0, 1]. Never a crash or a leak. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "experts/xs.h"
#include "model/plan.h"

static char path[64];

int LLVMFuzzerTestOneInput(const uint8_t *b, size_t n) {
    if (!path[0]) {
        snprintf(path, sizeof path, "/tmp/fuzz_trace_XXXXXX");
        int fd = mkstemp(path);
        if (fd < 0) abort();
        close(fd);
    }
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (n && fwrite(b, 1, n, f) != n) abort();
    fclose(f);
    petrel_error err;
    xs_trace t;
    if (xs_trace_read(&t, path, &err) == 0) {
        size_t cells = (size_t)t.n_tokens * t.n_layers;
        for (size_t c = 0; c < cells; c++) {
            const int16_t *d = t.ids + c * t.topk;
            for (int k = 0; k < t.topk; k++) {
                if (d[k] < -1 || d[k] >= t.n_experts) abort();
                if (k && d[k] >= 0 && (d[k - 1] < 0 || d[k - 1] == d[k])) abort(); /* ids first, distinct */
            }
        }
        if (cells * (size_t)t.topk <= 4096) {
            xs_policy_params p;
            xs_policy_defaults(&p);
            xs_replay_stats st;
            if (xs_trace_replay(&t, &p, 1 + (int)(n % 8), &st, &err) == 0 &&
                (st.policy_hits > st.accesses || st.lru_hits > st.accesses || st.belady_hits > st.accesses))
                abort();
        }
        xs_trace_deinit(&t);
    } else if (!err.msg[0] || strchr(err.msg, '\n')) {
        abort();
    }
    double rate;
    uint64_t acc;
    int found;
    if (plan_usage_hit_rate(path, 2, 8, 3, &rate, &acc, &found, &err) == 0) {
        if (found && (rate < 0 || rate > 1)) abort();
    } else if (!err.msg[0] || strchr(err.msg, '\n')) {
        abort();
    }
    return 0;
}
