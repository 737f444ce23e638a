/* lookahead.c: the expert store's guesses of the next MoE layer's experts (xs.h). The model
 * hands over the rows' routing by the next layer's router; the store decides what to read
 * early from how right each rank of guesses has been (random-weight models route nearly
 * independently per layer, so most of their guesses would only waste reads). */
#include <string.h>

#include "experts/xs.h"

void xs_la_guess(xs_store *s, int layer, const int32_t *ranked, int T, int K, double gate, int32_t *scratch) {
    int cap = xs_store_slots(s) / 2, np = 0; /* a hint must not evict most of what the current
                                                token may still reuse */
    if (cap < 1) cap = 1;
    xs_store_lock(s); /* sessions on other threads guess and score too */
    uint8_t *pred = xs_la_guesses(s, layer);
    const double *prec = xs_la_precision(s, layer);
    int E = xs_store_experts(s);
    memset(pred, 0, (size_t)E);
    for (int k = 0; k < K; k++) /* best rank first across rows */
        for (int r = 0; r < T; r++) {
            int e = ranked[(size_t)r * K + k];
            if (pred[e]) continue;
            pred[e] = (uint8_t)(k + 1);
            if (np < cap && prec[k] >= gate) scratch[np++] = e;
        }
    xs_store_unlock(s);
    if (np) xs_prefetch(s, layer, scratch, np);
}

int xs_la_wanted(const xs_store *s, int layer) { return s && layer >= 0 && layer < xs_store_layers(s); }

void xs_la_score(xs_store *s, int layer, const uint8_t *chosen) {
    xs_store_lock(s);
    uint8_t *pred = xs_la_guesses(s, layer);
    double *prec = xs_la_precision(s, layer);
    int E = xs_store_experts(s), n[256] = {0}, good[256] = {0}, any = 0;
    for (int e = 0; e < E; e++)
        if (pred[e]) {
            n[pred[e] - 1]++;
            good[pred[e] - 1] += chosen[e];
            any = 1;
        }
    if (any) {
        for (int k = 0; k < 255; k++)
            if (n[k]) prec[k] = 0.9 * prec[k] + 0.1 * (double)good[k] / n[k];
        memset(pred, 0, (size_t)E);
    }
    xs_store_unlock(s);
}
