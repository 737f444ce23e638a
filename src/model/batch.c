/* batch.c: petrel_batch_forward, rows of many sessions in one forward pass (include/petrel.h).
 *
 * The rows are grouped into segments (consecutive rows of one session) and run by fwd_rows, the
 * one layer loop: projections, routing and experts over every row together, DSA selection and
 * attention per segment over its own session's cache. Nothing in a row's arithmetic depends on
 * the other rows (kernels are row-independent, MLA runs the absorbed form for every row, MoE sums
 * each row's experts in a fixed order), so a row's result is bitwise the same alone or batched
 * (tests/test_rows.c holds it to that).
 *
 * Scratch for the rows lives in the batch (a cache-less session used only for its arena and
 * statistics, sized at create); a segment's attention scratch comes from its session's own
 * arena, sized at session create for its chunk. */
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "base/mem.h"
#include "model/engine.h"
#include "model/scratch.h"

struct petrel_batch {
    petrel_engine *eng;   /* borrowed */
    petrel_session scr;   /* scratch only: eng, arena, stats; no cache */
    int max_rows;
    fwd_seg *seg;         /* owned [max_rows] */
    int32_t *ids, *lrows; /* owned [max_rows] each */
};

int petrel_session_chunk(const petrel_session *s) { return s->max_batch; }

int petrel_batch_create(petrel_engine *eng, int max_rows, petrel_batch **out, petrel_error *err) {
    *out = NULL;
    if (!eng) return pt_err(err, PETREL_EINVAL, "no engine");
    if (max_rows <= 0 || max_rows > (1 << 20)) return pt_err(err, PETREL_EINVAL, "a batch holds 1 to %d rows (got %d)", 1 << 20, max_rows);
    const petrel_config *c = &eng->cfg;
    petrel_batch *b = calloc(1, sizeof *b);
    if (!b) return pt_err(err, PETREL_ENOMEM, "out of memory");
    b->eng = eng;
    b->max_rows = max_rows;
    b->scr.eng = eng;
    b->scr.max_batch = max_rows;
    /* the rows' state and the phases above it (scratch.h; attention runs in the sessions' arenas) */
    b->scr.ar.cap = plan_batch_arena(c, max_rows);
    b->scr.ar.base = pt_alloc_big(b->scr.ar.cap, 64);
    b->seg = malloc(sizeof(fwd_seg) * (size_t)max_rows);
    b->ids = malloc(sizeof(int32_t) * (size_t)max_rows);
    b->lrows = malloc(sizeof(int32_t) * (size_t)max_rows);
    if (!b->scr.ar.base || !b->seg || !b->ids || !b->lrows || session_lora_alloc(&b->scr, max_rows) < 0) {
        petrel_batch_free(b);
        return pt_err(err, PETREL_ENOMEM, "out of memory for a batch of %d rows", max_rows);
    }
    *out = b;
    return 0;
}

void petrel_batch_free(petrel_batch *b) {
    if (!b) return;
    free(b->scr.ar.base);
    free(b->scr.row_lora_buf);
    free(b->seg);
    free(b->ids);
    free(b->lrows);
    free(b);
}

int petrel_batch_forward(petrel_batch *b, const petrel_row *rows, int n, float *logits, petrel_error *err) {
    return batch_forward_h(b, rows, n, logits, NULL, err);
}

int batch_forward_h(petrel_batch *b, const petrel_row *rows, int n, float *logits, float *hidden, petrel_error *err) {
    petrel_engine *e = b->eng;
    const petrel_config *c = &e->cfg;
    if (n <= 0) return pt_err(err, PETREL_EINVAL, "empty batch: no rows to run");
    if (n > b->max_rows) return pt_err(err, PETREL_EINVAL, "batch of %d rows exceeds its capacity of %d", n, b->max_rows);
    int nseg = 0, nlog = 0;
    for (int r = 0; r < n; r++) {
        petrel_session *s = rows[r].session;
        if (!s || s->eng != e) return pt_err(err, PETREL_EINVAL, "batch row %d: no session, or a session of another engine", r);
        if (rows[r].token < 0 || rows[r].token >= c->vocab_size)
            return pt_err(err, PETREL_EINVAL, "batch row %d: token id %d is out of range (vocab_size %d)", r, rows[r].token, c->vocab_size);
        if (nseg && b->seg[nseg - 1].s == s) b->seg[nseg - 1].n++;
        else {
            for (int g = 0; g < nseg; g++)
                if (b->seg[g].s == s)
                    return pt_err(err, PETREL_EINVAL, "batch row %d: a session's rows must be consecutive (its rows also start at row %d)", r, b->seg[g].r0);
            b->seg[nseg++] = (fwd_seg){s, r, 1};
        }
        b->ids[r] = rows[r].token;
        if (rows[r].want_logits) b->lrows[nlog++] = r;
    }
    for (int g = 0; g < nseg; g++) {
        petrel_session *s = b->seg[g].s;
        int m = b->seg[g].n;
        if (s->len + m > s->cap)
            return pt_err(err, PETREL_ERANGE, "batch row %d: context full: %d cached + %d new tokens exceed the session's %d", b->seg[g].r0, s->len, m,
                          s->cap);
        if (m > s->max_batch)
            return pt_err(err, PETREL_EINVAL, "batch row %d: %d rows of one session exceed its chunk of %d (petrel_session_chunk)", b->seg[g].r0, m,
                          s->max_batch);
        if (e->no_indexer && s->len + m > c->index_topk)
            return pt_err(err, PETREL_EUNSUPPORTED, "batch row %d: a context of %d tokens needs the DSA indexer, which this model lacks", b->seg[g].r0,
                          s->len + m);
        if (s->trace) return pt_err(err, PETREL_EINVAL, "batch row %d: a traced session runs alone (petrel_session_forward)", b->seg[g].r0);
        s->ar.used = 0;
    }
    if (e->trace && (nseg > 1 || n > e->chunk))
        return pt_err(err, PETREL_EINVAL, "while recording a routing trace (--trace-out) a batch holds one session's rows, at most %d", e->chunk);
    return fwd_rows_h(&b->scr, b->seg, nseg, b->ids, n, logits, b->lrows, nlog, hidden, err);
}

int batch_mtp(petrel_batch *b, const petrel_row *rows, int n, const float *hidden, float *logits, float *hout, petrel_error *err) {
    petrel_engine *e = b->eng;
    if (n <= 0) return pt_err(err, PETREL_EINVAL, "empty MTP batch");
    if (n > b->max_rows) return pt_err(err, PETREL_EINVAL, "MTP batch of %d rows exceeds its capacity of %d", n, b->max_rows);
    int nseg = 0, nlog = 0;
    for (int r = 0; r < n; r++) {
        petrel_session *s = rows[r].session;
        if (!s || s->eng != e) return pt_err(err, PETREL_EINVAL, "MTP row %d: no session, or a session of another engine", r);
        if (nseg && b->seg[nseg - 1].s == s) b->seg[nseg - 1].n++;
        else {
            for (int g = 0; g < nseg; g++)
                if (b->seg[g].s == s) return pt_err(err, PETREL_EINVAL, "MTP row %d: a session's rows must be consecutive", r);
            b->seg[nseg++] = (fwd_seg){s, r, 1};
        }
        b->ids[r] = rows[r].token;
        if (rows[r].want_logits) b->lrows[nlog++] = r;
    }
    for (int g = 0; g < nseg; g++) {
        if (b->seg[g].n > b->seg[g].s->max_batch)
            return pt_err(err, PETREL_EINVAL, "MTP row %d: %d rows of one session exceed its chunk of %d", b->seg[g].r0, b->seg[g].n, b->seg[g].s->max_batch);
        b->seg[g].s->ar.used = 0;
    }
    return fwd_mtp_h(&b->scr, b->seg, nseg, b->ids, hidden, n, logits, b->lrows, nlog, hout, err);
}

const fwd_stats *batch_stats(const petrel_batch *b) { return &b->scr.stats; }
