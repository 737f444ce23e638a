/* cu.h: the CUDA backend's seam (src/cuda/, `make cuda`). The C engine calls these; they are
 * built from model.cu + kernels.cu + tiers.cu with nvcc, or from none.c (every call a clear
 * PETREL_EUNSUPPORTED, cu_device_count 0) in the default CPU-only build.
 *
 * What runs on the GPU (one device, weights in HBM): the whole forward of a batch of
 * rows of one or more sessions: embeddings, norms, MLA attention over each session's latent
 * cache (absorbed form), the DSA indexer with its top-k (the tie rule of op_topk), the dense
 * and shared MLPs, the router and the routed experts, the final norm and the head. Logits (and
 * the final-normed hidden states on request) come back to the host, which samples.
 * Exactness: every product accumulates in f32 over exactly dequantized weights (activations
 * stay f32), so an f32 or bf16 model's logits match the CPU's f32 path to float rounding (~1e-6).
 * The one inexact default: products of more than 8 rows (prefill, large batches) over q4 / q8
 * weights run on tensor cores with bf16 operands (open option act_quant -1, --act-quant off:
 * exact there too), like the CPU's int8 activations for q4.
 * FP8 block-scaled weights are expanded to f32 at upload (exact, 4 bytes a weight).
 * Routed experts that do not fit HBM live in tiers: HBM slots over the host's RAM over the
 * pack on the SSD (cu_model_open, tiers.cu); tiered logits equal the resident path's bitwise.
 * Trace-driven routing (benchmarks, open option route_trace) replaces the routers' choices as on
 * the CPU. Not yet on the GPU (refused with a line saying so): the MTP layer, LoRA adapters,
 * bf16/int8 KV pages, recording a routing trace, session files and shared prefixes. */
#ifndef PETREL_CUDA_CU_H
#define PETREL_CUDA_CU_H
#include <stdint.h>

#include "petrel.h"
#include "quant/qtypes.h"

#ifdef __cplusplus
extern "C" {
#endif

struct petrel_engine;
typedef struct cu_model cu_model; /* the weights in HBM, the stream, scratch */
typedef struct cu_kv cu_kv;       /* one session's latent cache in HBM */

/* GPUs this process can use; 0 when built without CUDA or none is present. */
int cu_device_count(void);
/* 1 when this binary was built with the CUDA backend. */
int cu_built(void);
/* Uploads the engine's weights to GPU `device`; the VRAM the weights, KV and scratch may take
 * is vram_budget (0: the device's free memory less 1 GiB). The routed experts go to HBM whole
 * when they fit and the host holds them all; otherwise (they do not fit, the engine streams
 * them under a memory budget, or vram_expert_slots > 0 asks for that many per layer) each MoE
 * layer gets HBM slots over the host's tiers (RAM, the store's SSD reads): tiers.cu;
 * host_experts 1: misses of decode-sized chunks may be computed on the host CPU instead of
 * copied (a cost model splits them; float-rounding close to the GPU's, not bitwise). Refuses
 * what the GPU path does not handle yet with one line. */
int cu_model_open(const struct petrel_engine *e, int device, uint64_t vram_budget, int vram_expert_slots, int host_experts, cu_model **out,
                  petrel_error *err);
void cu_model_close(cu_model *m);
/* One line: "NVIDIA H200 (cuda:0, 139.8 GiB), weights 2.31 GB in HBM". */
const char *cu_model_describe(const cu_model *m);
/* the most rows one chunk of a forward takes (a prompt's expert weights are read once a chunk):
 * a session hands the GPU its prompt in pieces of this many rows, not the CPU's chunk */
int cu_model_chunk_rows(const cu_model *m);
uint64_t cu_model_weight_bytes(const cu_model *m);
/* how many of the layers' weight stacks (products of one x in one GEMV for one row) are in use;
 * cu_model_use_stacks(m, 0) runs each product alone instead (tests: the same bits either way) */
int cu_model_stacks(const cu_model *m);
void cu_model_use_stacks(cu_model *m, int on);
/* Up to CU_PIN_LOGITS logits rows: the head's product writes them straight into pinned host
 * memory (mapped: no copy after the step's last kernel); cu_model_use_mapped_logits(m, 0) writes
 * them in HBM and copies them down instead (tests: the same bits either way) */
void cu_model_use_mapped_logits(cu_model *m, int on);
/* A decode step of one row (resident experts, no profile) replays its kernels as a CUDA graph,
 * one per bucket of 256 keys; cu_model_use_graphs(m, 0) launches them directly instead (tests:
 * the same bits either way) */
void cu_model_use_graphs(cu_model *m, int on);
/* Kernels of a forward (resident, not profiled) are launched as programmatic dependents: each
 * may start while the one before it ends, and waits for that end before touching memory;
 * cu_model_use_pdl(m, 0) launches each after its predecessor's end instead (tests and
 * benchmarks: the same bits either way) */
void cu_model_use_pdl(cu_model *m, int on);
/* Forwards of up to 8 rows (resident, not profiled) run parts of a layer on a second stream:
 * the shared expert beside the router and routed experts, the DSA keys and top-k beside the MLA
 * queries' rope and W_UK products; cu_model_use_fork(m, 0) keeps every kernel on one stream
 * (tests and benchmarks: the same kernels on the same inputs, the same bits either way) */
void cu_model_use_fork(cu_model *m, int on);
/* A prompt's routed experts (chunks past the GEMV's rows, q4 experts on the quantized path) run
 * on a bf16 tensor-core GEMM (the scales in the dequantized weights, f32 sums): form 3 on
 * warpgroup MMA with the loads on the TMA unit (cuk_gemm_w4t, the default), 2 the same with each
 * thread's own copies (cuk_gemm_w4g; the same bits), 1 on mma.sync (cuk_gemm_w4); form 0 on the
 * int8 one (the CPU's int8 bits per product) */
void cu_model_use_bf16_experts(cu_model *m, int form);
/* A prompt's other q8 products (more than 8 rows: attention projections, the dense and shared
 * MLPs, the head) on the bf16 warpgroup-MMA GEMM (cuk_gemm_w8g, 1), the same bits with chunks of
 * CU_TMA_ROWS or more rows on the TMA GEMM over the weights unpacked once (2: the default; its
 * bf16 scratch allocated at open, or here when first asked for), or the int8 one (0: the CPU's
 * int8 bits). */
void cu_model_use_bf16_dense(cu_model *m, int on);
/* A prompt chunk whose rows are one session's and each select all of their keys (contexts up to
 * index_topk) runs its attention expanded (cuk_mla_attn_expanded: each head's keys and values
 * made once for the chunk, no W_UK / W_UV on the rows; a chunk whose expanded keys and values
 * do not fit what the VRAM budget leaves takes the absorbed form): 1 on mma.sync tiles, 2 on
 * warpgroup MMA, 3 (the default) scores, softmax and P V in one pass on bf16 tensor cores where
 * the model's weights are quantized and the quantized path runs (else form 1); 0 off (the
 * absorbed form's scores / softmax / P C). */
void cu_model_use_expanded_attn(cu_model *m, int form);
unsigned long long cu_model_fork_count(const cu_model *m); /* parts launched or captured on the second stream since open */
unsigned long long cu_model_expanded_count(const cu_model *m); /* layers of prompt chunks in the expanded attention since open */
int cu_model_graph_count(const cu_model *m); /* the decode graphs kept now (0: none made, or graphs off) */
/* The expert tiers' counters since open (all zero when every expert is in HBM): per MoE layer
 * of a forward, `uses` distinct experts ran, `hits` of them were in an HBM slot, the rest were
 * copied from the host (`bytes` over PCIe, `copy_ns` of host time issuing and waiting for
 * them); `waves`: layer passes that needed more than one wave of slots; `host` misses were
 * computed on the host CPU instead (host_experts), taking `host_ns`. uses = hits + copies + host. */
typedef struct cu_tier_stats {
    int slots;              /* HBM slots per MoE layer (0: not tiered) */
    uint64_t uses, hits, copies, bytes, copy_ns, waves, host, host_ns;
} cu_tier_stats;
void cu_model_tier_stats(const cu_model *m, cu_tier_stats *out);
/* A session's cache for positions 0 .. cap-1 (every layer's c, k_pe and indexer keys, f32). */
int cu_kv_create(cu_model *m, int cap, cu_kv **out, petrel_error *err);
void cu_kv_free(cu_kv *k);
/* Copies positions [0, n) of src's cache into dst (a fork). */
int cu_kv_copy(cu_model *m, cu_kv *dst, const cu_kv *src, int n, petrel_error *err);

/* A batch's segment: rows [r0, r0 + n) at positions pos0 .. pos0 + n - 1 of kv. */
typedef struct cu_seg {
    cu_kv *kv;
    int pos0, r0, n;
    int dsa_always_score; /* test hook of the session: score and top-k even when every key fits */
    int route_offset;     /* trace-driven routing: row at position p takes trace token p + this */
} cu_seg;
/* The forward over rows ids[0..T): writes each row's cache entries, then logits [nlog][V] of
 * rows lrows[0..nlog) (ascending; NULL: the last nlog rows; logits NULL: none) and, when
 * hidden is not NULL, every row's final-normed hidden state [T][H]. experts_run (may be NULL)
 * grows by the routed experts the call ran (each chunk's union of its rows' choices, per
 * layer). Calls on one model are serialized. */
int cu_forward(cu_model *m, const cu_seg *seg, int nseg, const int32_t *ids, int T, float *logits, const int32_t *lrows, int nlog,
               float *hidden, uint64_t *experts_run, petrel_error *err);
/* HBM read bandwidth in GB/s: the best of 3 passes of a read kernel over `bytes` of device
 * memory (0 on failure). For benchmarks' floors. */
double cu_hbm_probe(cu_model *m, uint64_t bytes);
/* Host-to-GPU copy bandwidth in GB/s: the best of 3 copies of `bytes` from pinned host memory
 * (0 on failure). For the expert tiers' PCIe floor. */
double cu_h2d_probe(cu_model *m, uint64_t bytes);
/* the int8 tensor cores' peak in TOP/s, measured (chains of mma.m16n8k32 s8, no memory traffic) */
double cu_tc_int8_peak(cu_model *m);
/* the bf16 tensor cores' peak in TFLOP/s, measured (chains of wgmma.m64n128k16, no memory traffic) */
double cu_tc_bf16_peak(cu_model *m);
/* the profiled routed experts' kernel time (gate, up and down, their quantization and SwiGLU), ms
 * summed since cu_model_profile turned profiling on */
double cu_model_profile_experts_ms(const cu_model *m);
/* Kernel-time profile (benchmarks, `petrel bench --profile`): while on, every forward times its
 * parts with events on the stream (a little slower); the report is one line per part with its
 * milliseconds summed since profiling was turned on. */
void cu_model_profile(cu_model *m, int on);
void cu_model_profile_report(const cu_model *m, char *buf, size_t n);

/* Kernel checks for tests (tests/test_cuda.c): y[n][W->rows] = x[n][W->cols] W^T on the GPU,
 * by the path the forward would take for n rows (gemv up to 8, tiled GEMM above), or forced:
 * path 1 GEMV, 2 GEMM (exact f32), 3 GEMM on tensor cores where the format takes it (q4, q8),
 * 4 the quantized path's GEMV on int8 x (q8_g32, q4_g64 of whole groups; else PETREL_EUNSUPPORTED),
 * 5 the same as n slots of the weight, slot i on x row n-1-i (y[i] = W x[n-1-i]), 6 the quantized
 * path's GEMM on int8 tensor cores (plain rows), 7 the same over a row list (every row one
 * expert's choice: the routed experts' tiles), 8 the bf16 GEMM over q4 weights (cuk_gemm_w4; else
 * PETREL_EUNSUPPORTED), 9 the same over a row list (128-row tiles), 10 and 11 as 8 and 9 on
 * warpgroup MMA (cuk_gemm_w4g), 12 and 13 the same over q8 weights (cuk_gemm_w8g), 14 the q8 TMA
 * GEMM over the weights unpacked once (cuk_gemm_tma), 15 and 16 as 10 and 11 with the loads on the
 * TMA unit (cuk_gemm_w4t; 16 with x gathered by the row list). */
int cu_matmul_check(const pt_wview *W, const float *x, int n, float *y, int path, petrel_error *err);
/* The quantized path's fused SwiGLU GEMV on the GPU: y[n][rows] = silu(Wg x) * (Wu x) on int8 x
 * (Wg, Wu: one int8 format (q8_g32 / q4_g64) and shape; n 1..8 plain rows, or with slots n slots
 * of the pair, slot i on x row n-1-i). */
int cu_swiglu_check(const pt_wview *Wg, const pt_wview *Wu, const float *x, int n, float *y, int slots, petrel_error *err);
/* The head products of T rows from kv_b [NH (Dn + Dv)][Rkv] as a forward runs them: uv 0
 * q~ [T][NH][Rkv] = W_UK[h]^T q_nope[h] from q [T][NH][Dn + Dr] (T <= 8: the decode form, a q8_g32
 * kv_b), uv 1 o [T][NH][Dv] = W_UV[h] lat[h] from lat [T][NH][Rkv]; past 8 rows the tiled form,
 * on tensor cores (tc) or by f32 fma. */
int cu_head_check(const pt_wview *kvb, const float *x, int T, int NH, int Dn, int Dr, int Dv, int uv, int tc, float *y, petrel_error *err);
/* The attention core of T rows on one layer's keys kv [cap][Rkv + Dr] (c | k_pe): row r over
 * keys sel[r][0 .. seln[r]) with q [T][NH][Dn + Dr] (its q_pe after Dn) and q~ qt [T][NH][Rkv]:
 * lat [T][NH][Rkv] = softmax(scale [q~ | q_pe] . keys) c; flash 0 the scores / softmax / P C
 * kernels, 1 the one-pass form on f32 fma, 2 the one-pass form on tensor cores (tf32 pairs),
 * 3 the three kernels on tensor cores; PETREL_EUNSUPPORTED where a one-pass form does not take
 * the shape (cuk_attn_flash_ok). */
int cu_attn_check(const float *q, const float *qt, const float *kv, int cap, const int32_t *sel, int ld_sel, const int *seln, int T, int NH, int Dn,
                  int Dr, int Rkv, float scale, int flash, float *lat, petrel_error *err);
/* D [M][N] = A [M][K] B [N][K]^T of f32 rows on warpgroup MMA (cuk_nt_wg: tf32, each product in
 * three). */
int cu_nt_check(const float *A, int M, const float *B, int N, int K, float *D, petrel_error *err);
/* The expanded attention (cuk_mla_attn_expanded) of T rows at positions pos0 .. pos0 + T - 1 of
 * one session over keys kv [pos0 + T][Rkv + Dr] (row r over keys 0 .. pos0 + r) with kv_b
 * [NH (Dn + Dv)][Rkv] and q [T][NH][Dn + Dr]: o [T][NH][Dv], what cu_attn_check's lat becomes
 * through W_UV; form as cuk_mla_attn_expanded's (1 mma.sync tiles, 2 warpgroup MMA, 3 the bf16
 * one pass), or 4: form 3 with kv_b's product of the keys on the TMA GEMM over its weights
 * unpacked to bf16 (the forward's way for chunks of CU_TMA_ROWS keys or more; a q8 kv_b the GEMM
 * takes, else PETREL_EINVAL). */
int cu_attn_expanded_check(const pt_wview *kvb, const float *q, const float *kv, int pos0, int T, int NH, int Dn, int Dr, int Dv, float scale, int form,
                           float *o, petrel_error *err);
/* The router (moe_route) of T rows of E logits on the GPU: idx / wts [T][K]; regs 1 the form
 * that keeps each lane's values in registers (E <= 256; larger E take the other), 0 the
 * shared-memory form. */
int cu_route_check(const float *lg, const float *bias, int T, int E, int K, int n_group, int topk_group, int norm, float scale, int regs,
                   int32_t *idx, float *wts, petrel_error *err);
/* The DSA indexer's scores on the GPU (cuk_dsa_select's scoring; kn_ref_dsa_scores defines them):
 * T rows of q [T][Hi][Di] and head weights w [T][Hi], each against the same n keys [n][Di];
 * score [T][n]. Di at most 512 (as cu_model_open requires of index_head_dim). */
int cu_dsa_scores_check(const float *q, const float *w, const float *keys, int T, int Hi, int Di, int n, float *score, petrel_error *err);
/* The tensor-core products' split of each x[i] into tf32 halves (hi, lo), out [n][4]: the
 * kernels' split (hi by integer rounding), then the two-cvt.rna form it replaced. */
int cu_tf32_split_check(const float *x, int n, uint32_t *out, petrel_error *err);
/* op_topk on the GPU for one row of n scores: idx[k] ascending. */
int cu_topk_check(const float *v, int n, int k, int32_t *idx, petrel_error *err);
/* The prompt's down-product input from gate and up rows g, u [n][cols] (cols a multiple of 64),
 * in column order q: 4 (the routed experts', cuk_xbf16g's) or 8 (the q8 products',
 * cuk_xbf16g8's): fused gets cuk_swiglu_bf16g's (q 8: cuk_swiglu_bf16g8's) bf16 bits, twin those
 * of cuk_silu_mul then the conversion of that order ([n][cols]); for q 4, rev those of
 * cuk_swiglu_bf16g_rows gathering rows n-1 .. 0 (for q 8 rev is not written). */
int cu_swiglu_bf16_check(const float *g, const float *u, int n, int cols, int q, uint16_t *fused, uint16_t *twin, uint16_t *rev, petrel_error *err);
/* cuk_moe_sort on the GPU: idx [T][K] expert ids (< E) to list [T K] (the slots t K + k grouped
 * by expert, ascending within one) and tiles [3 *ntiles] (expert, first place, count <= tm);
 * tiles holds E + T K / tm + 1 entries of 3. */
int cu_moe_sort_check(const int32_t *idx, int T, int K, int E, int tm, int32_t *list, int32_t *tiles, int *ntiles, petrel_error *err);

#ifdef __cplusplus
}
#endif
#endif
