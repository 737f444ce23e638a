/* cu_kernels.h: the CUDA kernels of the forward (kernels.cu) as launch functions on a stream,
 * for model.cu. C++ (nvcc) only. All pointers are device pointers; every launch is
 * asynchronous. Shapes in comments are [rows][cols], row-major.
 *
 * Weights keep their stored format in HBM (f32, bf16, f16, q8_row, q8_g32, q4_g64 in the plain
 * layout of src/quant/quant.h) with scales converted to f32 at upload; kernels dequantize on
 * the fly and accumulate in f32 (the quantized path's decode GEMVs over q8_g32 / q4_g64 take
 * int8 activations as the CPU's do: cuk_gemv_q; tensor-core GEMMs take bf16 operands; every
 * other product keeps f32 activations). A stacked weight holds the
 * routed experts of a layer one after another (estride bytes, sstride scales apart). */
#ifndef PETREL_CUDA_KERNELS_H
#define PETREL_CUDA_KERNELS_H
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

struct dw {
    int qt;                 /* pt_qtype */
    int64_t rows, cols, rb; /* rb: bytes per row */
    const uint8_t *d;       /* data */
    const float *s;         /* scales (f32), NULL for unscaled formats */
    int64_t sc;             /* scales per row */
    int g;                  /* columns per scale (q8_row: cols) */
    int64_t estride, sstride; /* stacked experts: bytes / scales between experts */
};

/* The calling thread's launch mode: on, each launch lets the next kernels of its stream start
 * before it ends (programmatic dependent launch; every kernel waits for its predecessor's end
 * before writing memory or reading what kernels write, so results are the same bits; only the
 * model's weights are read before). Returns the mode it replaces. */
int cuk_pdl(int on);

/* y[slot][rows] = W_e x[row]: the GEMV form (each weight row read once for up to 8 x rows).
 * slot_e / slot_x NULL: slots are the n x rows of expert 0; else slot i takes expert slot_e[i]
 * and x row slot_x[i] (x rows may repeat), one slot at a time. fixed_slots: slot_e was written
 * before the forward (the heads' products) and W is the model's, so both may be read before the
 * kernel's wait for the one before it. */
void cuk_gemv(cudaStream_t st, const dw &W, const float *x, int64_t ldx, float *y, int64_t ldy, int n, const int32_t *slot_e,
              const int32_t *slot_x, int fixed_slots = 0);
/* y[slot][rows] = silu(G_e x) * (U_e x): a SwiGLU's gate and up products in one GEMV pass (the
 * same slots as cuk_gemv; ldy = G.rows). G and U of one format and shape; otherwise two passes
 * and cuk_silu_mul, with ub [n][ldy] for the up product. */
void cuk_gemv_swiglu(cudaStream_t st, const dw &G, const dw &U, const float *x, int64_t ldx, float *y, int64_t ldy, int n,
                     const int32_t *slot_e, const int32_t *slot_x, float *ub);
/* The quantized path's GEMV (act_quant on), for q8_g32 and q4_g64 weights (cuk_gemv_q_ok):
 * cuk_actq quantizes n x rows [n][cols] as the CPU's int8 activations do (per group of the
 * weight format's: q4 1, q8 0) into X (q [n][ldq] int8, d [n][ldd] group scales, s [n][lds]
 * sums of each 32 values, q4 only); cuk_gemv_q / cuk_gemv_swiglu_q then take x rows from X (the
 * same slots as cuk_gemv; X must hold the format W wants). */
struct cu_xq {
    int8_t *q;
    float *d;
    int32_t *s;
    int64_t ldq, ldd, lds;
};
int cuk_gemv_q_ok(const dw &W); /* 0 no, 1 q8_g32, 2 q4_g64 */
/* The quantized path's GEMM (int8 tensor cores; the same tiles, list and x map as cuk_gemm) on
 * x rows quantized by cuk_actq in the plain order (q8 mode 0, q4 mode 2); cuk_gemm_q_ok: 0 no,
 * 1 q8_g32, 2 q4_g64, of whole 64 columns */
int cuk_gemm_q_ok(const dw &W);
/* the measured int8 tensor-core peak in TOP/s (mma.m16n8k32 s8 chains, no memory traffic), best
 * of 3 runs over sms x 4 blocks; *ms the best run's time */
double cuk_mma_peak(cudaStream_t st, unsigned int *sink, int sms, float *ms);
/* the bf16 warpgroup MMA's peak, TFLOP/s (wgmma.m64n128k16 chains, no memory traffic) */
double cuk_wgmma_peak(cudaStream_t st, unsigned int *sink, int sms, float *ms);
void cuk_gemm_q(cudaStream_t st, const dw &W, const cu_xq &X, float *y, int64_t ldy, int n, const int32_t *tiles, const int *ntiles_dev,
                int max_tiles, const int32_t *list, const int32_t *xmap);
/* The routed experts' prompt GEMM on bf16 tensor cores (cuk_gemm_w4_ok: q4 weights with groups
 * of a power of two >= 32 columns, whole 64 columns): y = bf16(x) W^T with each weight bf16(bf16(q -
 * 8) * bf16(scale)), f32 sums; no per-group epilogue (the unpacking costs about as much per
 * product at ~64 rows an expert: as fast as the int8 GEMM, bench/RESULTS.md); not the CPU's int8
 * bits (closer to f32). x rows come from cuk_xbf16p ([n][cols] f32 to
 * bf16 in the kernel's column order, ldxh a multiple of 8); tiles from cuk_moe_sort with tm 128
 * (tiles NULL: n plain rows), list and xmap as cuk_gemm's. */
int cuk_gemm_w4_ok(const dw &W);
void cuk_xbf16p(cudaStream_t st, const float *x, int64_t ldx, int n, int cols, __nv_bfloat16 *xh, int64_t ldxh);
void cuk_gemm_w4(cudaStream_t st, const dw &W, const __nv_bfloat16 *xh, int64_t ldxh, float *y, int64_t ldy, int n, const int32_t *tiles,
                 const int *ntiles_dev, int max_tiles, const int32_t *list, const int32_t *xmap);
/* The same product on warpgroup MMA (wgmma, sm_90a; the same operands, cuk_gemm_w4_ok's
 * weights): the weights unpacked once a block into wgmma's register operand, x from shared
 * memory; x rows from cuk_xbf16g (its own column order), tiles from cuk_moe_sort with tm
 * cuk_gemm_w4g_rows(). */
int cuk_gemm_w4g_rows(void); /* the x rows of its tiles (cuk_moe_sort's tm) */
void cuk_xbf16g(cudaStream_t st, const float *x, int64_t ldx, int n, int cols, __nv_bfloat16 *xh, int64_t ldxh);
/* bf16(silu(g) * u) of gate and up rows [n][cols] (ld apart) in cuk_xbf16g's order: the bits of
 * cuk_silu_mul then cuk_xbf16g, without the f32 pass between */
void cuk_swiglu_bf16g(cudaStream_t st, const float *g, const float *u, int64_t ld, int n, int cols, __nv_bfloat16 *xh, int64_t ldxh);
/* the same in cuk_xbf16g8's order (the q8 products' input: the dense and shared experts' down) */
void cuk_swiglu_bf16g8(cudaStream_t st, const float *g, const float *u, int64_t ld, int n, int cols, __nv_bfloat16 *xh, int64_t ldxh);
void cuk_gemm_w4g(cudaStream_t st, const dw &W, const __nv_bfloat16 *xh, int64_t ldxh, float *y, int64_t ldy, int n, const int32_t *tiles,
                  const int *ntiles_dev, int max_tiles, const int32_t *list, const int32_t *xmap);
/* The same product with its loads on the TMA unit (k_gemm_w4t: the same bits as cuk_gemm_w4g):
 * x rows gathered in the tiles' order first (xg row i: cuk_xbf16g_rows of x row m2[m1[i]], m2
 * NULL: m1[i]; or cuk_swiglu_bf16g_rows of gate / up rows m[i]), so a tile's rows are one box;
 * W ne experts stacked (cuk_gemm_w4t_ok: q4 groups of 32 or 64, dense strides, the driver's tensor
 * maps). Returns -1 (nothing launched) where it does not take them. */
int cuk_gemm_w4t_ok(const dw &W, int ne);
void cuk_xbf16g_rows(cudaStream_t st, const float *x, int64_t ldx, int n, int cols, const int32_t *m1, const int32_t *m2, __nv_bfloat16 *xh, int64_t ldxh);
void cuk_swiglu_bf16g_rows(cudaStream_t st, const float *g, const float *u, int64_t ld, int n, int cols, const int32_t *m, __nv_bfloat16 *xh, int64_t ldxh);
int cuk_gemm_w4t(cudaStream_t st, const dw &W, int ne, const __nv_bfloat16 *xg, int64_t ldxg, float *y, int64_t ldy, int n, const int32_t *tiles,
                 const int *ntiles_dev, int max_tiles, const int32_t *list);
/* The same form for q8 weights (q8_g32 and other power-of-two groups >= 32, whole 64 columns):
 * w = bf16(q bf16(s)); x rows from cuk_xbf16g8 (its own column order), plain rows or tiles as
 * cuk_gemm_w4g's (`bench --cuda-dense wgmma`). */
int cuk_gemm_w8_ok(const dw &W);
void cuk_xbf16g8(cudaStream_t st, const float *x, int64_t ldx, int n, int cols, __nv_bfloat16 *xh, int64_t ldxh);
void cuk_gemm_w8g(cudaStream_t st, const dw &W, const __nv_bfloat16 *xh, int64_t ldxh, float *y, int64_t ldy, int n, const int32_t *tiles,
                  const int *ntiles_dev, int max_tiles, const int32_t *list, const int32_t *xmap);
/* The same product for a chunk of many rows (model.cu's CU_TMA_ROWS): cuk_w8_bf16g writes W's
 * weights once as bf16 (wb: rows x cols, cuk_gemm_w8g's values in cuk_xbf16g8's column order),
 * then cuk_gemm_tma multiplies them with x from cuk_xbf16g8 by TMA and warpgroup MMA from shared
 * memory: the same bits as cuk_gemm_w8g. Returns -1 (nothing launched) where the driver has no
 * tensor maps or the operands do not fit them (16-byte aligned, ldxh a multiple of 8). */
void cuk_w8_bf16g(cudaStream_t st, const dw &W, __nv_bfloat16 *wb);
int cuk_gemm_tma(cudaStream_t st, const __nv_bfloat16 *wb, int64_t rows, int64_t cols, const __nv_bfloat16 *xh, int64_t ldxh, float *y, int64_t ldy, int n);
/* the column parts a row of W is summed in (cuk_gemv_q, plain rows): two weights of one format
 * and width with the same count give a row the same bits */
int cuk_gemv_q_parts(const dw &W);
void cuk_actq(cudaStream_t st, const float *x, int64_t ldx, int n, int cols, int q4, const cu_xq &X); /* q4: 0 q8, 1 q4 (the GEMV's order and sums of 32), 2 q4 in plain order and a sum a group (the GEMM's) */
void cuk_gemv_q(cudaStream_t st, const dw &W, const cu_xq &X, float *y, int64_t ldy, int n, const int32_t *slot_e, const int32_t *slot_x);
void cuk_gemv_swiglu_q(cudaStream_t st, const dw &G, const dw &U, const cu_xq &X, float *y, int64_t ldy, int n, const int32_t *slot_e,
                       const int32_t *slot_x, float *ub);
/* The tiled GEMM form (64 x 64 tiles, shared memory) over tiles (expert, first entry, count)
 * of a row list: tile t covers entries list[first .. first + count) (count <= 64) of expert e;
 * entry i reads x row (xmap ? xmap[list[i]] : list[i]) and writes y row list[i]. tiles NULL:
 * dense, n rows of expert 0 (list, xmap ignored). ntiles_dev: the tile count on the device
 * (grid sized for max_tiles). */
void cuk_gemm(cudaStream_t st, const dw &W, const float *x, int64_t ldx, float *y, int64_t ldy, int n, const int32_t *tiles,
              const int *ntiles_dev, int max_tiles, const int32_t *list, const int32_t *xmap, int tc);
/* tc: the tensor-core form (bf16 operands, f32 sums; not exact) for the formats it takes
 * (cuk_gemm_tc_ok: q4 and q8 weights); others, and tc 0, the exact f32 form. */
int cuk_gemm_tc_ok(const dw &W);

/* Row ops over T rows. */
void cuk_embed(cudaStream_t st, const dw &W, const int32_t *ids, int T, float *h);
void cuk_rmsnorm(cudaStream_t st, float *y, int64_t ldy, const float *x, int64_t ldx, const float *w, int n, int T, double eps);
void cuk_add(cudaStream_t st, float *h, const float *y, int64_t n);
/* h [T][n] += a (+ b, a + b first when b is not NULL), then y [T][n] = rmsnorm(h) with w */
void cuk_add_rmsnorm(cudaStream_t st, float *y, float *h, const float *a, const float *b, const float *w, int n, int T, double eps);
void cuk_silu_mul(cudaStream_t st, float *g, const float *u, int64_t n);

/* Per-row attention state: each row's session cache and position. */
struct cu_rowinfo {
    float *kv;   /* the session's latent cache: [L][cap][kv_lora_rank + rope] */
    float *ix;   /* its indexer keys: [L][cap][index_head_dim] */
    int cap, pos;
    int rtok;    /* trace-driven routing: the trace token the row takes (pos + the session's offset) */
    int pad_;
};
/* RoPE tables: cos/sin [pos][dim/2] (op_rope_table's values). */
struct cu_rope { const float *cos_, *sin_; int interleave; };

/* q [T][NH][Dn + Dr]: RoPE on each head's last Dr; kva [T][Rkv + Dr]: rmsnorm of c (kv_a_layernorm),
 * RoPE on k_pe; both written to layer l of the row's cache at its position. */
void cuk_mla_prep(cudaStream_t st, float *q, const float *kva, const float *kv_norm, int T, int NH, int Dn, int Dr, int Rkv, int l,
                  const cu_rowinfo *ri, cu_rope rope);
/* The head products, one tiled GEMM per head: q~ [T][NH][Rkv] = W_UK[h]^T q_nope[h] (kv_b rows
 * h*(Dn+Dv) .. +Dn) and o [T][NH][Dv] = W_UV[h] lat[h] (rows h*(Dn+Dv)+Dn .. +Dv), on tensor cores
 * (tc: tf32, each product in three, errors near f32 rounding) or by f32 fma in 64 x 64 tiles.
 * Up to 8 rows both take the GEMV form with the heads as slots (heads [T*NH]: slot i's head
 * i % NH), q~ from kv_b's q8_g32 rows directly (cuk_mla_uk_direct), else over ukt, an f32 copy of
 * W_UK^T made at upload ([NH][Rkv][Dn], stacked like experts). heads is written before the
 * forward (read before the kernels' waits, cuk_gemv's fixed slots). */
void cuk_mla_uk(cudaStream_t st, const dw &kvb, const dw &ukt, const float *q, float *qt, int T, int NH, int Dn, int Dr, int Dv, int Rkv,
                const int32_t *heads, int tc);
/* 1: up to 8 rows' q~ read W_UK from kv_b itself (q8_g32; no f32 copy is needed) */
int cuk_mla_uk_direct(const dw &kvb, int Rkv, int Dn);
void cuk_mla_uv(cudaStream_t st, const dw &kvb, const float *lat, float *o, int T, int NH, int Dn, int Dv, int Rkv, const int32_t *heads, int tc);
/* The attention core over each row's sel[r][0..seln[r]) keys of its cache layer l: scores
 * S [T*NH][ldS] = scale [q~ | q_pe] . [c | k_pe] (all heads of a row against one tile of its
 * keys at a time), softmax in place, lat [T][NH][Rkv] = P C. Split over nsplit key ranges
 * (partial: [nsplit][T][NH][Rkv]) when few rows leave the GPU idle, summed in split order. S
 * holds CU_ATTN_DSPLIT blocks of [T][NH][ldS] for T <= 8. With flash, shapes a one-pass form
 * takes (below) run it instead: partial then holds its key ranges' unnormalized outputs (at
 * most CU_ATTN_SPLITS ranges) and S their running max and sum. */
void cuk_mla_attn(cudaStream_t st, const float *q, const float *qt, float *S, int64_t ldS, const int32_t *sel, int64_t ld_sel,
                  const int *seln, int nmax, float *lat, int T, int NH, int Dn, int Dr, int Rkv, float scale, int l, const cu_rowinfo *ri,
                  float *partial, int nsplit, int flash);
/* D [M][N] = A [M][K] B [N][K]^T (f32 rows) on warpgroup MMA in tf32, each product in three
 * (k_nt_wg, the expanded attention's products) */
void cuk_nt_wg(cudaStream_t st, const float *A, int M, const float *B, int N, int K, float *D);
/* A prompt chunk's attention, expanded, where its T rows are one session's at consecutive
 * positions and every row selects all of its keys: row r's keys are the cache rows kv[0 ..
 * seln[r]) of the layer (kv: [nk][Rkv + Dr], seln ascending, at most nk). Each head's keys and
 * values are expanded once for the nk keys (Kx [NH][nk][Dn + Dr] = [W_UK_h c | k_pe], Vx
 * [NH][nk][Dv] = W_UV_h c), then per head S = scale q K_h^T (S [T][NH][ldS]), softmax, and
 * o [T][NH][Dv] = P V_h: the output W_UV takes to after cuk_mla_attn (no q~, no lat), with 448
 * products a (row, key, head) for GLM-5's heads against the absorbed form's 1088. All on tensor
 * cores (tf32, each product in three); the CPU's MLA_RECONSTRUCTED sums, in tile order. form 1:
 * the products on mma.sync tiles (k_head_mm); 2 on warpgroup MMA (k_nt_wg: both operands split
 * once into shared memory, Vx then [NH][Dv][nk]); 3 (where cuk_attn_fa_ok): scores, softmax
 * and P V in one pass on bf16 tensor cores (k_attn_fa: no S), K and V in bf16 in xb
 * (cuk_attn_fa_bytes), made by one bf16 GEMM of the keys where kv_b is q8 (its output in Kx,
 * which then holds nk NH (Dn + Dv) floats), else by form 1's expansion; ~3e-3 of the outputs
 * from the f32 forms. Not the same bits as each other. wb (form 3, or NULL): room for kv_b's
 * weights in bf16, where its product of the keys takes the TMA GEMM (cuk_gemm_tma: the same bits
 * as cuk_gemm_w8g's). Returns -1 where form 3's tensor maps cannot be made (the driver lacks
 * cuTensorMapEncodeTiled; cuk_attn_fa_ok refuses it there). */
int cuk_mla_attn_expanded(cudaStream_t st, const dw &kvb, const float *kv, int nk, const float *q, float *Kx, float *Vx, float *S, int64_t ldS,
                          const int *seln, float *o, int T, int NH, int Dn, int Dr, int Dv, int Rkv, float scale, int form, __nv_bfloat16 *xb,
                          __nv_bfloat16 *wb);
/* whether the one bf16 pass (form 3) takes heads of these widths (each up to 256), and the bytes
 * of its bf16 keys and values for nk keys (xb) */
int cuk_attn_fa_ok(int Dqk, int Dv);
size_t cuk_attn_fa_bytes(int NH, int nk, int Dqk, int Dv, int Rkv);
/* whether W's weights are quantized (q8, q4), not f32 / bf16 / f16 */
int cuk_w_quantized(const dw &W);
/* The one-pass forms cuk_mla_attn takes with flash (k_attn_flash: each block a range of keys
 * for 16 heads with an online softmax, then the ranges merged in order): 0 none (more than 8
 * rows, Rkv > 512, Rkv + Dr not a multiple of 4: the scores / softmax / P C kernels above),
 * else 2: the f32 fma form (1) and the tensor-core form, the products on tf32 pairs (x = hi +
 * lo). flash 2 takes the tensor-core form, 1 the fma form. Where no one pass runs, flash 2 and
 * 3 run the three kernels' score and P C tiles on tensor cores too (tf32 pairs, tile_mma), 0 and
 * 1 on f32 fma; flash 3 takes the three kernels on tensor cores whatever the rows. */
int cuk_attn_flash_ok(int T, int Rkv, int Dr);
/* the split count cuk_mla_attn takes for T rows of at most nmax keys (<= CU_ATTN_SPLITS); the
 * scores of up to 8 rows split their dimension in up to CU_ATTN_DSPLIT parts (S then holds
 * CU_ATTN_DSPLIT [T][NH][ldS] blocks) */
#define CU_ATTN_SPLITS 32
#define CU_ATTN_DSPLIT 9
int cuk_attn_splits(int T, int NH, int Rkv, int nmax);

/* DSA: qi [T][Hi][Di] RoPE (first Dr of each head, when qi), k [T][Di] layernorm + RoPE and
 * written to layer l's index keys; iw [T][Hi] scaled by wscale (when iw). */
void cuk_dsa_prep(cudaStream_t st, float *qi, float *k, float *iw, const float *kn_w, const float *kn_b, int T, int Hi, int Di, int Dr,
                  float wscale, int l, const cu_rowinfo *ri, cu_rope rope);
/* Scores of rows with more keys than topk: sc [T][ldsc] over keys 0 .. pos; then each row's
 * selection sel[r][0..k) ascending (op_topk's order: value, then the later position), seln[r]
 * = k; rows with n <= topk and !always[r] get 0..n-1. */
void cuk_dsa_select(cudaStream_t st, const float *qi, const float *iw, float *sc, int64_t ldsc, int32_t *sel, int64_t ld_sel, int *seln,
                    int T, int Hi, int Di, int topk, int l, const cu_rowinfo *ri, const int *always, int nmax);
/* op_topk of v[n] into idx[k] ascending (k <= n), one block. */
void cuk_topk(cudaStream_t st, const float *v, int n, int k, int32_t *idx);
/* the tensor-core products' tf32 split of x[n] two ways, o [n][4]: cu_tf32_split_check */
void cuk_tf32_split_check(cudaStream_t st, const float *x, int n, uint32_t *o);

/* MoE: routing (moe_route) of T rows' router logits [T][E] into idx/wts [T][K]; the choice slots
 * sorted by expert (list: slots r*K+k, rows ascending within an expert) with the GEMM's tiles;
 * the combine out[r] = sum over the row's experts in ascending id of wts * yk[r*K+k]. */
struct cu_route_cfg {
    int E, K, n_group, topk_group, norm_topk_prob;
    float routed_scaling_factor;
};
/* regs 1: with E <= 256 each lane keeps its experts' values in registers; 0: from shared
 * memory (the form for any E; the same comparisons in the same order, so the same choices) */
void cuk_route(cudaStream_t st, const float *lg, const float *bias, int T, cu_route_cfg rc, int32_t *idx, float *wts, int32_t *slot_x, int regs = 1);
/* trace-driven routing (benchmarks): idx/wts [T][K] from the trace [n_tok][n_layers][K] at trace
 * layer tl for each row's token ri[r].rtok (modulo n_tok), weights as moe_route_given */
void cuk_route_given(cudaStream_t st, const float *lg, int T, cu_route_cfg rc, const int16_t *trace, int n_tok, int n_layers, int tl,
                     const cu_rowinfo *ri, int32_t *idx, float *wts);
/* the T*K choice slots sorted by expert into list (rows ascending within one) and tiles (expert,
 * first entry, count <= tm) for cuk_gemm and cuk_gemm_q (tm 64) */
void cuk_moe_sort(cudaStream_t st, const int32_t *idx, int T, int K, int E, int tm, int32_t *list, int32_t *tiles, int *ntiles);
/* count += the distinct experts among idx[0..n) (mark [E] zeroed by the caller) */
void cuk_count_union(cudaStream_t st, const int32_t *idx, int n, int32_t *mark, unsigned long long *count);
/* a read of n 16-byte words (the bandwidth probe); the xor of all lands in *sink */
void cuk_read(cudaStream_t st, const uint4 *p, size_t n, unsigned int *sink);
void cuk_moe_combine(cudaStream_t st, const float *yk, const int32_t *idx, const float *wts, int T, int K, int H, float *out);
/* The expert tiers' copies (tiers.cu): one weight's raw host bytes, already in HBM (raw_d: the
 * row-interleaved data, NULL when the data went straight to d; raw_s: the scales in their
 * stored dtype, sdt 0 f32 / 1 bf16 / 2 f16, scale_cols per row (or per 16-row block, r16)),
 * into a slot's plain layout d and f32 scales s [rows][sc]. */
void cuk_unpack(cudaStream_t st, int qt, int r16, const uint8_t *raw_d, const void *raw_s, int sdt, int64_t rows, int64_t rb, int64_t scale_cols,
                int64_t sc, uint8_t *d, float *s);
/* dst[pos[j]] = src[j], rows of n floats, j < m */
void cuk_scatter_rows(cudaStream_t st, const float *src, int m, int64_t n, const int32_t *pos, float *dst);
#endif
