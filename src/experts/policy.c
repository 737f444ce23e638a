/* policy.c: which resident expert to evict, per layer. Shared by the store and trace replay so
 * the replayed hit rate is the store's.
 *
 * XS_POL_FREQ keeps a decayed use count for every expert of the layer (resident or not): each
 * use adds `inc`, and inc grows by 2^(1/halflife) per access of the layer, which is the same as
 * decaying every count without touching them (rescaled when inc gets large). The victim is the
 * resident expert with the lowest decayed count, ties to the least recently used. Routing has a
 * power-law popularity that drifts slowly, so a count with a half-life of a few hundred tokens
 * tracks the popular set better than recency alone.
 * Pins: the n_pins = pin_frac * cap experts with the most lifetime uses (history loaded from the
 * usage file + this run) are never chosen while any unpinned candidate exists. Re-pinned every
 * repin_every accesses. XS_POL_LRU ignores counts (pins still apply). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "experts/xs.h"

void xs_policy_defaults(xs_policy_params *p) {
    p->kind = XS_POL_FREQ;
    p->halflife = 128;
    p->pin_frac = 0.25;
    p->repin_every = 64;
}

int xs_pol_init(xs_pol *p, int n_experts, int cap, const xs_policy_params *prm) {
    memset(p, 0, sizeof *p);
    if (prm) p->prm = *prm;
    else xs_policy_defaults(&p->prm);
    if (p->prm.halflife <= 0) p->prm.halflife = 128;
    if (p->prm.repin_every <= 0) p->prm.repin_every = 64;
    if (p->prm.pin_frac < 0) p->prm.pin_frac = 0;
    if (p->prm.pin_frac > 0.9) p->prm.pin_frac = 0.9;
    p->n_experts = n_experts;
    p->cap = cap;
    p->n_pins = (int)(p->prm.pin_frac * cap);
    p->inc = 1.0;
    p->score = calloc((size_t)n_experts, sizeof *p->score);
    p->uses = calloc((size_t)n_experts, sizeof *p->uses);
    p->last = calloc((size_t)n_experts, sizeof *p->last);
    p->pinned = calloc((size_t)n_experts, 1);
    if (!p->score || !p->uses || !p->last || !p->pinned) {
        xs_pol_deinit(p);
        return -1;
    }
    return 0;
}

void xs_pol_deinit(xs_pol *p) {
    free(p->score);
    free(p->uses);
    free(p->last);
    free(p->pinned);
    memset(p, 0, sizeof *p);
}

void xs_pol_begin(xs_pol *p) {
    p->clock++;
    p->inc *= exp2(1.0 / p->prm.halflife);
    if (p->inc > 1e200) { /* rescale: relative order is unchanged */
        for (int e = 0; e < p->n_experts; e++) p->score[e] /= p->inc;
        p->inc = 1.0;
    }
    if (++p->since_repin >= p->prm.repin_every) {
        p->since_repin = 0;
        xs_pol_repin(p);
    }
}

void xs_pol_use(xs_pol *p, int e) {
    p->score[e] += p->inc;
    p->uses[e]++;
    p->last[e] = p->clock;
}

int xs_pol_evict_before(const xs_pol *p, int a, int b) {
    if (p->pinned[a] != p->pinned[b]) return p->pinned[b]; /* unpinned goes first */
    if (p->prm.kind == XS_POL_FREQ && p->score[a] != p->score[b]) return p->score[a] < p->score[b];
    if (p->last[a] != p->last[b]) return p->last[a] < p->last[b];
    return a < b;
}

void xs_pol_repin(xs_pol *p) {
    memset(p->pinned, 0, (size_t)p->n_experts);
    /* n_pins is small relative to E: repeated selection of the max unpinned with uses > 0 */
    for (int k = 0; k < p->n_pins; k++) {
        int best = -1;
        for (int e = 0; e < p->n_experts; e++)
            if (!p->pinned[e] && p->uses[e] && (best < 0 || p->uses[e] > p->uses[best])) best = e;
        if (best < 0) break;
        p->pinned[best] = 1;
    }
}
