/* scratch.h: the memory plan of a forward pass. Every scratch buffer the layer code takes is
 * carved from an arena by one function per phase below; the plan sizes the arenas by running
 * the same functions on a sizing arena (ar_sizing: placeholders, no memory), so the sizes can
 * never drift from the allocations. A carve returns 0, or -1 when the arena is exhausted (the
 * caller says PETREL_ENOMEM with its phase's name).
 *
 * Where the phases live while a forward runs (T rows, keys up to N):
 *   rows     the rows' state across layers (residual, MoE input/output, RoPE, selections,
 *            routing) and one chunk's attention buffers; in the arena of the forward's scratch
 *            session (the session itself, or a batch's cache-less one)
 *   then, one at a time above the rows (the arena is reset to the rows' mark between phases):
 *     attention  dsa (indexer), mla (the attention core; in the segment's own session's arena),
 *                lookahead guesses before a dense layer's attention
 *     dense      the SwiGLU MLP, lookahead
 *     moe        the MoE layer's buffers, then above them one of: the shared expert's MLP,
 *                an expert's MLP (experts of unequal widths), lookahead
 *     head       the final-normed rows that want logits
 *   span     a streaming prompt's layer-major state, one block per session (pf_carve) */
#ifndef PETREL_MODEL_SCRATCH_H
#define PETREL_MODEL_SCRATCH_H
#include <stddef.h>
#include <stdint.h>

#include "experts/xs.h"
#include "model/engine.h"

/* A sizing arena: ar_alloc hands out placeholders (never NULL, never to be touched) and
 * a.used ends at the bytes the same carve takes from a real arena. */
arena ar_sizing(void);

typedef struct rows_scr {
    float *h, *xm, *out;    /* [T][H] residual; MoE input (normed) and output */
    rope_rows rope;         /* [T][rope/2] x 2 */
    int32_t *sel, *idx, *rl;/* [T][kst] DSA selection; [T][K] routing and choices by expert */
    int *sel_n;             /* [T] */
    float *wts;             /* [T][K] */
    int32_t *route_pos;     /* [T] trace tokens of the rows (trace-driven routing) */
    int kst;                /* selection stride */
} rows_scr;
/* The rows of a batch (T <= its chunk), their attention buffers b aliasing xm/out. */
int rows_carve(arena *a, const petrel_config *c, int T, int kst, rows_scr *r, attn_bufs *b);
/* A span's rows: one block per session, pf_carve lays it out from base (NULL: size only). */
size_t pf_carve(uint8_t *base, const petrel_config *c, int M, int kst, rows_scr *r);
int attn_carve(arena *a, const petrel_config *c, int T, attn_bufs *b);

typedef struct dsa_run { const float *k; int a, n; } dsa_run; /* f32 index keys of positions [a, a + n) */
typedef struct dsa_scr {
    float *qi, *ki, *iw, *score;  /* [T][Hi][Di], [T][Di], [T][Hi], [N] */
    float *qt, *wp;               /* [Di][Hp], [Hp]: a row's query transposed and weights, heads padded (kn_dsa) */
    dsa_run *runs;                /* [N]: the keys' runs, page by page */
    int32_t *tmp;                 /* [N] */
} dsa_scr;
int dsa_carve(arena *a, const petrel_config *c, int T, int N, dsa_scr *d);

typedef struct mlp_scr {
    float *gb, *ub;               /* [T][I] gate, up */
} mlp_scr;
int mlp_carve(arena *a, int T, int64_t I, mlp_scr *m);

typedef struct la_scr {
    float *lg, *scratch;          /* [T][E] the next router's logits, [2E] */
    int32_t *pids, *ranked;       /* [E], [T][K] */
} la_scr;
int la_carve(arena *a, const petrel_config *c, int T, la_scr *l);

typedef struct moe_scr {
    float *lg, *scratch;          /* [cap][E] router logits (in pieces of cap rows), [2E] */
    int32_t *start, *pos, *order; /* [E + 1], [E], [E] */
    xs_expert_ref *refs;          /* [E] */
    uint8_t *chosen;              /* [E] */
    float *xs, *ys, *gb, *ub;     /* [gcap][H], [wide][H], [wide][I] x 2 (wide = max(gcap, 32)) */
    int32_t *rl;                  /* [T][K] when the caller has none */
    float *yk, *ysh;              /* ready-order runs: [T][K][H] each choice's output, [T][H] shared */
    const struct lora_set **gset; /* [wide]: the LoRA set of each gathered row */
    int cap, gcap, wide;
} moe_scr;
/* T rows, chunk C (cap = min(T, C): the router's pieces); gcap = moe_gather_rows: the rows a set
 * of experts gathers (a batch of decode rows spreads its T * K choices over many experts of a
 * row or two each: gathering them all lets one dispatch run up to 32 experts instead of the few
 * whose rows fit T); ready: the experts may come in any order; own_rl: carve rl. */
int moe_carve(arena *a, const petrel_config *c, int T, int C, int ready, int own_rl, moe_scr *m);
int moe_gather_rows(int T, int C, int K);

int head_carve(arena *a, const petrel_config *c, int n, float **xl);

typedef struct mtp_scr {
    float *h, *cat, *wts;         /* [T][H], [T][2H], [T][K] */
    attn_bufs b;
    rope_rows rope;
    int *sel_n, *len;             /* [T], [nseg] */
    int32_t *idx;                 /* [T][K] */
} mtp_scr;
int mtp_carve(arena *a, const petrel_config *c, int T, int nseg, mtp_scr *m);

/* The plan: bytes of a session's arena (its forwards of up to `chunk` rows over `ctx` keys,
 * attention included) and of a batch's (rows of up to max_rows sessions; their attention runs
 * in the sessions' arenas). */
size_t plan_session_arena(const petrel_config *c, int chunk, int ctx);
size_t plan_batch_arena(const petrel_config *c, int max_rows);
#endif
