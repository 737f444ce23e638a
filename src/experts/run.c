/* run.c: the expert schedule of one MoE layer over one batch (xs_run, declared in xs.h).
 *
 * The model routes its rows and hands over which experts they chose; the run hands the experts
 * back chunk by chunk, in the order to run them, with their weight views, and takes each chunk
 * back when it has been computed. Everything about where the bytes are (slots, reads in flight,
 * misses, guesses for the next layer) is decided here, so the model code has no streaming
 * branches: with every expert resident the run is simply all chosen experts in ascending id. */
#include <string.h>

#include "base/clock.h"
#include "base/err.h"
#include "experts/xs.h"

int xs_run_ascending(const xs_run *r) { return !r->st || r->mode == XS_RUN_ASCENDING; }

int xs_run_begin(xs_run *r, const xs_run_args *a) {
    memset(r, 0, sizeof *r);
    r->st = a->st;
    r->layer = a->layer;
    r->mode = a->mode;
    r->order = a->order;
    r->refs = a->refs;
    r->res = a->resident;
    r->lookahead = a->lookahead;
    r->idle = a->idle;
    r->cb_ctx = a->cb_ctx;
    int E = a->n_experts;
    if (!r->st) { /* resident: every chosen expert, ascending, no waiting */
        for (int e = 0; e < E; e++)
            if (a->chosen[e]) r->order[r->n++] = e;
        r->n_hit = r->n;
        return r->n;
    }
    xs_store *st = r->st;
    int ml = r->layer;
    xs_access_begin(st, ml); /* the run's acquires are one access of the layer (xs_run_release ends it) */
    xs_la_score(st, ml, a->chosen);          /* the guesses made for this layer meet its routing */
    xs_cancel_prefetches(st, ml, a->chosen); /* wrong guesses not yet reading stop delaying misses */
    if (r->mode == XS_RUN_ASCENDING) {
        for (int e = 0; e < E; e++)
            if (a->chosen[e]) r->order[r->n++] = e;
        return r->n;
    }
    /* Ready order: experts whose bytes are in a slot first, then those still reading (in the
     * order their reads were queued), then the misses. Each expert's state is read once: reads
     * finish on other threads meanwhile, and a state read once per class could put an expert
     * in no class or in two. The queue order of loading ones is kept by insertion (a handful). */
    static const uint8_t pass_cls[3] = {XS_READY, XS_LOADING, XS_ABSENT};
    uint8_t cls[XS_MAX_EXPERTS];
    uint64_t seq[XS_MAX_EXPERTS];
    for (int e = 0; e < E; e++) {
        seq[e] = 0;
        cls[e] = a->chosen[e] ? (uint8_t)xs_store_state(st, ml, e, &seq[e]) : 255;
    }
    for (int pass = 0; pass < 3; pass++) {
        int u0 = r->n;
        for (int e = 0; e < E; e++) {
            if (cls[e] != pass_cls[pass]) continue;
            int j = r->n++;
            while (pass == 1 && j > u0 && seq[r->order[j - 1]] > seq[e]) {
                r->order[j] = r->order[j - 1];
                j--;
            }
            r->order[j] = e;
        }
        if (pass == 0) r->n_hit = r->n;
    }
    if (r->n_hit == 0) { /* nothing to compute before the first read lands: every read now */
        xs_prefetch(st, ml, r->order, r->n);
        if (r->lookahead) r->lookahead(r->cb_ctx);
        r->la_done = 1;
    }
    return r->n;
}

int xs_run_next(xs_run *r, const xs_expert_ref **out, petrel_error *err) {
    if (r->held) xs_run_release(r);
    if (r->pos >= r->n) return 0;
    if (!r->st) { /* resident: one chunk of views from the layer's tables */
        for (int i = 0; i < r->n; i++) {
            int e = r->order[i];
            r->refs[i] = (xs_expert_ref){.expert = e, .slot = -1, .gate = r->res.gate[e], .up = r->res.up[e], .down = r->res.down[e]};
        }
        *out = r->refs;
        r->pos = r->n;
        return r->n;
    }
    xs_store *st = r->st;
    int ml = r->layer, S = xs_store_slots(st), n;
    if (r->mode == XS_RUN_ASCENDING) {
        /* one at a time, reading ahead as far as the bank allows (the experts already run are
         * the ones a hint may replace; hints never replace hints not yet used) */
        int ahead = r->n - r->pos, room = S - 1;
        if (ahead > room) ahead = room;
        if (ahead > 0) xs_prefetch(st, ml, r->order + r->pos, ahead);
        n = 1;
    } else {
        n = r->pos < r->n_hit ? r->n_hit - r->pos : 1; /* the hits at once, then miss by miss */
        if (n > S) n = S;
        /* the first chunk that may wait for a read: the caller's idle work runs first (the
         * shared expert computes while the misses load); never in ascending or resident runs */
        if (r->pos >= r->n_hit && !r->idle_done) {
            r->idle_done = 1;
            if (r->idle) PT_TRY(r->idle(r->cb_ctx, err));
        }
    }
    uint64_t w0 = pt_now_ns();
    PT_TRY(xs_acquire(st, ml, r->order + r->pos, n, r->refs, err));
    r->io_ns += pt_now_ns() - w0;
    if (r->mode == XS_RUN_READY) {
        if (!r->la_done) { /* hits pinned: this layer's misses read, then the next layer's guesses */
            xs_prefetch(st, ml, r->order + r->pos + n, r->n - r->pos - n);
            if (r->lookahead) r->lookahead(r->cb_ctx);
            r->la_done = 1;
        } else if (r->n - r->pos - n > 0) {
            /* keep the next misses reading: the first call stops when every slot is busy, and a
             * prefill chunk may need more experts than there are slots */
            int rest = r->n - r->pos - n;
            xs_prefetch(st, ml, r->order + r->pos + n, rest < 16 ? rest : 16);
        }
    }
    r->held = n;
    r->pos += n;
    *out = r->refs;
    return n;
}

void xs_run_release(xs_run *r) {
    if (r->st && r->held) xs_release(r->st, r->layer, r->refs, r->held);
    r->held = 0;
}

void xs_run_end(xs_run *r) {
    xs_run_release(r);
    if (r->st) xs_access_end(r->st, r->layer);
}
