/* kernels.h: the compute kernels the model code calls. Every kernel has a scalar reference
 * (kn_ref_*) that stays built and tested; kn_* dispatch to the fastest variant for this CPU
 * (a kernel table, kn_table below: per engine, chosen at open; kn_force_isa sets the process
 * default's for tests and benchmarks).
 *
 * Row independence: row i of a result depends only on row i of the input, never on how many
 * rows share the call or how many threads run it, so batching cannot change outputs (bitwise,
 * for a fixed ISA level).
 *
 * Threads: kn_init creates one persistent pool (src/base/pool.h) used by kn_matmul; model code
 * may run its own parallel loops on kn_pool(). Kernels are safe to call from several threads at
 * once (matmul jobs on the shared pool then take turns). */
#ifndef PETREL_KERNELS_H
#define PETREL_KERNELS_H
#include <stdint.h>

#include "quant/qtypes.h"

struct pt_pool;

/* The kernel table: which variants an engine runs, chosen once at open from CPUID and its options
 * (isa, act_quant, relayout), so two engines in one process may differ and nothing process-wide
 * changes their numerics. Every kt_* kernel takes one; each kn_* form is its kt_* twin on the
 * process default table (kn_default: tools, converters, tests), the only table kn_force_isa,
 * kn_set_act_quant and kn_set_r16 change. */
enum { KN_ISA_SCALAR = 0, KN_ISA_AVX2 = 1, KN_ISA_AVX512 = 2 };
typedef struct kn_table {
    int isa;        /* KN_ISA_*: the SIMD level of matmuls and helpers */
    int vnni;       /* AVX-512 VNNI usable (int8-activation and r16 kernels) */
    int act_quant;  /* 0 exact f32 activations, 1 int8 for q4 weights, 2 also q8 (needs vnni) */
    int r16;        /* weights may be laid out 16 rows interleaved at open (needs vnni) */
    int amx;        /* AMX-INT8 tiles run R16 products of >= amx_min_rows rows (bitwise = VNNI) */
    int amx_bf16;   /* AMX-BF16 runs plain bf16-weight products of >= amx_min_rows rows (not exact) */
    int amx_min_rows; /* below this many rows the VNNI kernel is faster (measured, bench/KERNELS.md) */
    int pf_bytes;   /* the R16 kernels' software prefetch: bytes ahead of the weight stream (0: none) */
    int pf_l2;      /* ... into L2 (1) or L1 (0) */
    int pf_all;     /* ... every 64-byte line (1, the default) or every other line (0); all three
                     * from the open options (kn_table_prefetch), speed only */
} kn_table;
/* isa NULL or "auto": the best this CPU has (AMX-INT8 where the CPU and OS allow it); "scalar",
 * "avx2", "avx512" (AVX-512 without AMX), "amx" (AVX-512 + AMX-INT8: fails without it),
 * "amx-bf16" (amx + the inexact AMX-BF16 path for bf16 weights). act_quant 0 = default (1), -1
 * off, 1, 2; relayout 0 = default (on), -1 off, 1 on. -1: unknown or unavailable. */
int kn_table_init(kn_table *t, const char *isa, int act_quant, int relayout);
/* The R16 kernels' software prefetch: bytes 0 = the default (4096), -1 = none, else the distance
 * (64 .. 65536, rounded down to whole lines); level 0 = default (L1), 1 = into L1, 2 = into L2;
 * lines 0 = default (every line), 1 = every other line, 2 = every line. -1: out of range. */
int kn_table_prefetch(kn_table *t, int bytes, int level, int lines);
/* The same on the process default table (tools and benchmarks). */
int kn_set_prefetch(int bytes, int level, int lines);
/* This CPU has AMX-INT8 (and AMX-BF16), and the OS granted the tile data permission
 * (arch_prctl ARCH_REQ_XCOMP_PERM, asked once per process at the first call). */
int kn_amx_available(void);
int kn_amx_bf16_available(void);
/* The AMX int8 peak: multiply-adds per second of TDPBSSD on register tiles, `threads` threads at
 * once (each its own, for ~20 ms); 0 without AMX. For benchmarks' peak fractions. */
double kn_amx_peak_macs(int threads);
/* Default minimum rows for the AMX path, measured on the device's 16-core Xeon (bench/KERNELS.md,
 * "AMX"): cold q4 experts run at 0.5-0.8x the VNNI kernel's speed below 16 rows, 1.0x at 16-24,
 * 1.27x at 32; the 512-token slice prefill was fastest with 32 (523 tok/s vs 455-457 with 16 or
 * 4, 502 without AMX, one run). Results are bitwise the same either way. */
#ifndef KN_AMX_MIN_ROWS
#define KN_AMX_MIN_ROWS 32
#endif
const kn_table *kn_default(void);
const char *kt_isa_name(const kn_table *t);
int kt_r16_available(const kn_table *t);
int kt_act_quant_active(const kn_table *t, const pt_wview *W);

/* y[n][W->rows] = x[n][W->cols] * W^T  (f32 accumulation), any pt_qtype. x and y are dense
 * row-major, must not overlap, need no alignment. Parallel over output rows. */
void kn_matmul(const pt_wview *W, const float *x, int n, float *y);
void kt_matmul(const kn_table *t, const pt_wview *W, const float *x, int n, float *y);
void kn_ref_matmul(const pt_wview *W, const float *x, int n, float *y);

/* Int8 activations for plain-layout weights (default 1: q4 only). kn_set_act_quant(1): kn_matmul / kn_matmul_many on PT_Q4_G64
 * weights, (2): also PT_Q8_G32 and PT_Q8_ROW, where the CPU has AVX-512 VNNI. Each x row is
 * quantized once per call to int8 per group of 64 (q4) or 32 (q8) columns, d = max|x_g| / 127,
 * q = round(x / d), and the dots run in exact integer arithmetic (vpdpbusd) scaled per group.
 * Error vs the exact f32 path: each activation moves by at most d/2 = max|x_g| / 254, so
 * |y - y_f32| <= sum_j |w_j| max|x_g(j)| / 254; measured ~0.4 % of |y| (rms) on uniform random
 * x (bench/KERNELS.md). Rows stay bitwise independent of n, batching and threads. Other formats,
 * CPUs without VNNI, kn_force_isa "avx2"/"scalar": always exact f32 activations. The default
 * is 1 (q4, where the routed experts are: R16 matrices use int8 activations anyway, so plain q4
 * experts match); the engine's open options (act_quant, --act-quant) change it. Not thread-safe
 * against running kernels. kn_act_quant_active(W): would kn_matmul(W) quantize x? */
void kn_set_act_quant(int mode);
int kn_act_quant(void);
int kn_act_quant_active(const pt_wview *W);
/* Scalar oracle of the int8-activation math (same quantized activations, exact integer group
 * dots, double accumulation); formats without it: kn_ref_matmul. */
void kn_ref_matmul_actq(const pt_wview *W, const float *x, int n, float *y);

/* Row-interleaved weights (PT_LAYOUT_R16, quant/qtypes.h; math in src/kernels/r16.c): the
 * int8-activation layout for PT_Q8_G32 / PT_Q4_G64 that kn_matmul streams at close to memory
 * bandwidth. kn_r16_available: this CPU has AVX-512 VNNI and kn_set_r16(0) was not called
 * (open option relayout, --relayout off); without it callers keep the plain layout (the scalar
 * R16 kernel is correct but slow). Process-wide, like the ISA and act-quant choices, until the
 * kernel table becomes per engine. kn_r16_supported: format and shape allow it (rows % 16, cols % group).
 * kn_r16_repack rewrites W's data and scales IN PLACE (both must be writable) and sets
 * W->layout; returns 0, or -1 if unsupported or out of memory (W unchanged). kn_matmul and
 * kn_matmul_many then use int8 activations for W (error as described for kn_set_act_quant);
 * kn_ref_matmul and pt_dequant_row read the layout exactly. */
int kn_r16_available(void);
void kn_set_r16(int on);
int kn_r16_supported(const pt_wview *W);
int kn_r16_repack(pt_wview *W);

/* Several independent matmuls y_k = x_k W_k^T in ONE pool dispatch: the rows of all jobs are
 * split across threads together (e.g. the gate and up projections of all routed experts of a
 * token). Jobs may share x (activations are then prepared once); y buffers must not overlap
 * each other or any x. Each job's result is bitwise what kn_matmul would give. */
typedef struct kn_job {
    const pt_wview *W;
    const float *x; /* [n][W->cols] */
    int n;
    float *y;       /* [n][W->rows] */
} kn_job;
void kn_matmul_many(const kn_job *jobs, int n_jobs);
void kt_matmul_many(const kn_table *t, const kn_job *jobs, int n_jobs);
void kn_ref_matmul_many(const kn_job *jobs, int n_jobs);

/* Observer (calibration, src/io/calib.c): while set, kn_matmul and kn_matmul_many show fn each
 * product's weight view and input rows x[n][W->cols] before computing it (kn_matmul_t is not
 * shown). fn may be called from several threads at once and must not call kernels. NULL: off
 * (one predictable branch per call). Not thread-safe against running kernels. */
typedef void (*kn_observer_fn)(void *ctx, const pt_wview *W, const float *x, int n);
void kn_set_observer(kn_observer_fn fn, void *ctx);

/* Profile (benchmarks: `petrel bench --profile` on the CPU). While set, every kernel dispatch
 * made outside a pool task (kt_matmul, kt_matmul_many, kt_matmul_t, kt_attn_core from the
 * model's thread; products nested in the model's own parallel loops, e.g. MLA's per-head W_UK /
 * W_UV, are not seen) adds to the row of its key (kind, first job's shape, format, layout, rows
 * n, job count, the second job's rows): calls, wall time of the activation preparation and of
 * the pool dispatch, and the bytes of its weights (payload and scales; for the attention core
 * the cached keys it reads, rows = queries, any number of keys). Rows past KN_PROF_ROWS go to the last row
 * (key rows = -1). The pool's own figures (jobs, the caller's wait for the last task) are in
 * pool_stats. Tools only: not thread-safe against running kernels; NULL turns it off (one
 * predictable branch per call). */
#define KN_PROF_ROWS 96
enum { KN_PROF_MATMUL, KN_PROF_MATMUL_T, KN_PROF_ATTN };
typedef struct kn_prof_row {
    int64_t rows, cols;    /* the first job's weight shape; -1: the overflow row */
    int64_t rows2;         /* the second job's rows (0: one job) */
    int qtype, layout, n, jobs, kind; /* kind: KN_PROF_* */
    const uint8_t *data, *data2; /* the first call's first and second weights (to name them) */
    uint64_t calls, prep_ns, run_ns, wbytes;
} kn_prof_row;
typedef struct kn_prof {
    kn_prof_row row[KN_PROF_ROWS];
    int n_rows;
} kn_prof;
void kn_set_profile(kn_prof *p);

/* Transposed product: y[n][W->cols] = x[n][W->rows] . W, i.e. y[i][c] = sum_r x[i][r] W[r][c]
 * (each weight row read once, accumulated axpy-style, r ascending, f32 fma). Any pt_qtype;
 * parallel over 64-column tiles; rows of y independent of n (bitwise). Exact f32 activations. */
void kn_matmul_t(const pt_wview *W, const float *x, int n, float *y);
void kt_matmul_t(const kn_table *t, const pt_wview *W, const float *x, int n, float *y);
void kn_ref_matmul_t(const pt_wview *W, const float *x, int n, float *y);

/* Exact f32 attention core of absorbed MLA (src/model/mla.c): M queries against N cached keys
 * of a latent cache, each key t given by two row pointers (kc[t]: D floats of the latent c_t,
 * kp[t]: Dr floats of k_pe_t), so a paged cache passes its pages' rows without copying. Query m
 * attends keys 0 .. nk[m]-1 (nk NULL: all N; nk[m] <= N). Per query m and key t, exactly:
 *   s[m][t]   = scale * acc, acc = the fma chain over k ascending, from +0:
 *               acc = fma(q[m][k], kc[t][k], acc) for k < D, then fma(qpe[m][k], kp[t][k], acc)
 *   mx        = max over t < nk[m] of s;  e[t] = kn_exp(s - mx) (the polynomial of kn_softmax's
 *               AVX-512 form, written out in ref.c);  sum = e[0] + e[1] + ... in t order
 *   p[m][t]   = e[t] * (1 / sum) for t < nk[m], 0 past it
 *   lat[m][j] = the fma chain over t ascending (t < N) of p[m][t] * kc[t][j], from +0.
 * Every element is one sequential chain in a fixed order (no lane split, no horizontal sum), so
 * it is bitwise the same whichever block, remainder, query count or thread computes it, and the
 * AVX-512 kernel is bitwise equal to the scalar twin kn_ref_attn (tests/test_kernels.c); zeros
 * past nk[m] add exactly nothing (finite cache values). Threaded on kn_pool() (inline when
 * called from a pool task). scr: kn_attn_scratch_floats(M, N, D, Dr) floats, no alignment. */
typedef struct kn_attn {
    int M, D, Dr;
    int64_t N;
    const float *q;            /* q~ rows: q + m * q_stride, D floats */
    int64_t q_stride;
    const float *qpe;          /* rope query rows: qpe + m * qpe_stride, Dr floats */
    int64_t qpe_stride;
    const float *const *kc;    /* [N] latent rows, D floats each */
    const float *const *kp;    /* [N] rope-key rows, Dr floats each */
    const int *nk;             /* [M] keys per query, or NULL */
    float scale;
    float *lat;                /* out: lat + m * lat_stride, D floats */
    int64_t lat_stride;
} kn_attn;
size_t kn_attn_scratch_floats(int M, int64_t N, int D, int Dr);
void kn_attn_core(const kn_attn *a, float *scr);
void kt_attn_core(const kn_table *t, const kn_attn *a, float *scr);
void kn_ref_attn(const kn_attn *a, float *scr);
/* n independent problems a[i] (each with its own keys and scratch scr[i]) at once: each phase's
 * work of all of them in one pool dispatch (a batch's decode rows of different sessions);
 * results bitwise those of kt_attn_core on each. */
void kt_attn_core_many(const kn_table *t, const kn_attn *a, int n, float *const *scr);

/* DSA lightning-indexer scores of one query row over a run of keys (src/model/dsa.c):
 *   score[t] = sum over heads h of (dd > 0 ? w[h] * dd : 0),  dd = q_h . k_t
 * with heads padded to Hp = kn_dsa_heads(Hi) (a multiple of 16; padded heads have q = 0, w = 0)
 * and, per key t, exactly:
 *   dd[h]   = the fma chain over d ascending of qt[d][h] * k_t[d], from +0
 *   m[h]    = dd[h] > 0 ? w[h] * dd[h] : +0            (NaN dd counts as not > 0)
 *   u[i]    = m[i] + m[16 + i] + m[32 + i] + ...        (i < 16, left to right)
 *   score   = ((u8 + u4) + u2) + u1 folded as a tree:  a[i] = u[i] + u[i + 8] (i < 8),
 *             b[i] = a[i] + a[i + 4] (i < 4), c[i] = b[i] + b[i + 2] (i < 2), c[0] + c[1].
 * Every score is the same arithmetic whichever thread, run or ISA computes it: the AVX-512 kernel
 * is bitwise equal to kn_ref_dsa_scores (tests/test_kernels.c). Single-threaded: the caller
 * splits the keys. */
typedef struct kn_dsa {
    int Hp, Di;                /* padded heads, head dim */
    const float *qt;           /* [Di][Hp]: the query transposed, zero past the real heads */
    const float *w;            /* [Hp] head weights, zero past the real heads */
    const float *k;            /* keys: k + t * k_stride, Di floats each */
    int64_t k_stride;
    int64_t n;
    float *score;              /* out [n] */
} kn_dsa;
static inline int kn_dsa_heads(int Hi) { return (Hi + 15) / 16 * 16; }
void kt_dsa_scores(const kn_table *t, const kn_dsa *a);
void kn_ref_dsa_scores(const kn_dsa *a);

/* Kernel initialisation (CPUID, thread pool); idempotent; n_threads 0 = all cores. Calling it
 * again with a different count rebuilds the pool (not while kernels run). kn_matmul calls
 * kn_init(0) itself if nobody did. */
void kn_init(int n_threads);
int kn_threads(void);
struct pt_pool *kn_pool(void);
/* "scalar", "avx2", "avx512", "amx" or "amx-bf16". */
const char *kn_isa_name(void);
/* Forces an ISA level ("scalar", "avx2", "avx512", "amx", "amx-bf16"; "auto" = best available)
 * on the process default table. Returns 0, or -1 if this CPU/OS lacks it (nothing changes).
 * Not thread-safe against running kernels: for tests and benchmarks. kn_set_amx_min_rows: the
 * default table's AMX row threshold (tests: 1, so every row count takes the AMX path). */
int kn_force_isa(const char *name);
void kn_set_amx_min_rows(int rows);

/* Vector helpers. n is the length; pointers need no alignment. */
float kn_dot(const float *a, const float *b, int64_t n);                 /* sum a[j] b[j] */
void kn_axpy(float *y, float a, const float *x, int64_t n);              /* y += a x */
/* out = x / sqrt(mean(x^2) + eps) * w  (w NULL: no weight). out may equal x. */
void kn_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps);
/* In place: x = exp(x - max) / sum. -inf entries give 0; a row of only -inf gives all zeros
 * (never NaN). */
void kn_softmax(float *x, int64_t n);
/* out = silu(gate) * up, silu(g) = g / (1 + exp(-g)). out may equal gate or up. */
void kn_silu_mul(float *out, const float *gate, const float *up, int64_t n);
/* Greedy choice over x[n] (n >= 1): the lowest index of the largest value that is not NaN; n - 1
 * when every value is NaN (the rule of `best = i when x[i] > x[best] or x[best] is NaN`, which the
 * sampler always used). Exact: every table gives the same index. */
int64_t kn_argmax(const float *x, int64_t n);
float kt_dot(const kn_table *t, const float *a, const float *b, int64_t n);
void kt_axpy(const kn_table *t, float *y, float a, const float *x, int64_t n);
void kt_rmsnorm(const kn_table *t, float *out, const float *x, const float *w, int64_t n, float eps);
void kt_softmax(const kn_table *t, float *x, int64_t n);
void kt_silu_mul(const kn_table *t, float *out, const float *gate, const float *up, int64_t n);
int64_t kt_argmax(const kn_table *t, const float *x, int64_t n);
/* Indices of the k largest values of v[n], largest first; ties: lower index first. NaNs rank
 * below everything. k is clamped to [0, n]; returns the number written. O(n log k). */
int kn_topk(const float *v, int n, int k, int32_t *idx);

float kn_ref_dot(const float *a, const float *b, int64_t n);
void kn_ref_axpy(float *y, float a, const float *x, int64_t n);
void kn_ref_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps);
void kn_ref_softmax(float *x, int64_t n);
void kn_ref_silu_mul(float *out, const float *gate, const float *up, int64_t n);
int64_t kn_ref_argmax(const float *x, int64_t n);
#endif
