/* dispatch.c: picks kernel variants at start from CPUID and runs kn_matmul on the thread pool.
 *
 * kn_matmul: prepares x once (kn_internal.h: padded, q4 de-interleaved) on the calling thread,
 * then splits the output rows into tasks of whole 16-row units (a 64-byte line of y, so no two
 * threads write one cache line) handed out dynamically by the pool. Each output element is
 * computed by exactly one task in the ISA kernel's fixed order: results do not depend on the
 * thread count or the schedule. Formats or shapes a SIMD kernel does not take fall back to the
 * scalar reference (also row-parallel). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/pool.h"
#include "kernels/kernels.h"
#include "kernels/kn_internal.h"

enum { ISA_SCALAR, ISA_AVX2, ISA_AVX512 };

static pthread_once_t detect_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static int best_isa = ISA_SCALAR, cur_isa = ISA_SCALAR;
static pt_pool *g_pool;
static int g_threads;

static void detect(void) {
    /* __builtin_cpu_supports also checks that the OS saves the YMM/ZMM state (XGETBV). */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        best_isa = ISA_AVX2;
    if (best_isa == ISA_AVX2 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq"))
        best_isa = ISA_AVX512;
    cur_isa = best_isa;
}

void kn_init(int n_threads) {
    pthread_once(&detect_once, detect);
    pthread_mutex_lock(&init_lock);
    int want = n_threads > 0 ? n_threads : 0;
    if (!g_pool || (want > 0 && want != g_threads)) {
        pool_destroy(g_pool);
        g_pool = pool_create(want);
        g_threads = pool_threads(g_pool);
    }
    pthread_mutex_unlock(&init_lock);
}

static void ensure_init(void) {
    if (!__atomic_load_n(&g_pool, __ATOMIC_ACQUIRE)) kn_init(0);
}

int kn_threads(void) {
    ensure_init();
    return g_threads;
}

pt_pool *kn_pool(void) {
    ensure_init();
    return g_pool;
}

const char *kn_isa_name(void) {
    pthread_once(&detect_once, detect);
    return cur_isa == ISA_AVX512 ? "avx512" : cur_isa == ISA_AVX2 ? "avx2" : "scalar";
}

int kn_force_isa(const char *name) {
    pthread_once(&detect_once, detect);
    int want;
    if (!strcmp(name, "auto")) want = best_isa;
    else if (!strcmp(name, "scalar")) want = ISA_SCALAR;
    else if (!strcmp(name, "avx2")) want = ISA_AVX2;
    else if (!strcmp(name, "avx512")) want = ISA_AVX512;
    else return -1; /* "amx" and anything unknown */
    if (want > best_isa) return -1;
    cur_isa = want;
    return 0;
}

static const kn_mm_isa *mm_isa(void) {
    return cur_isa == ISA_AVX512 ? &kn_mm_avx512 : cur_isa == ISA_AVX2 ? &kn_mm_avx2 : NULL;
}

/* Prepared activations live in a per-thread buffer that only grows: prefill calls it with
 * megabytes, and a fresh malloc (mmap + page faults) per matmul would cost more than the copy. */
static _Thread_local float *xp_buf;
static _Thread_local size_t xp_cap;
static pthread_key_t xp_key; /* frees a thread's buffer when the thread exits */
static pthread_once_t xp_key_once = PTHREAD_ONCE_INIT;
static void xp_key_init(void) { pthread_key_create(&xp_key, free); }

static float *xp_get(size_t floats) {
    if (floats > xp_cap) {
        pthread_once(&xp_key_once, xp_key_init);
        free(xp_buf);
        size_t cap = floats + floats / 4;
        xp_buf = aligned_alloc(64, (cap * sizeof(float) + 63) & ~(size_t)63);
        xp_cap = xp_buf ? cap : 0;
        pthread_setspecific(xp_key, xp_buf);
    }
    return xp_buf;
}

static void prep_x(const float *x, int n, int64_t cols, int64_t xs, int q4_chunk, float *xp) {
    for (int i = 0; i < n; i++) {
        const float *src = x + (int64_t)i * cols;
        float *dst = xp + (int64_t)i * xs;
        if (!q4_chunk) {
            memcpy(dst, src, (size_t)cols * sizeof(float));
            memset(dst + cols, 0, (size_t)(xs - cols) * sizeof(float));
            continue;
        }
        int h = q4_chunk / 2;
        for (int64_t c = 0; c < xs; c += q4_chunk)
            for (int t = 0; t < h; t++) {
                int64_t je = c + 2 * t, jo = je + 1;
                dst[c + t] = je < cols ? src[je] : 0.f;
                dst[c + h + t] = jo < cols ? src[jo] : 0.f;
            }
    }
}

typedef struct {
    const pt_wview *W;
    const kn_mm_isa *isa; /* NULL: scalar reference */
    const float *x;       /* xp (isa) or the caller's x (reference) */
    int64_t xs, rows_per_task;
    int n;
    float *y;
} mm_job;

static void mm_task(void *ctx, int task, int thread) {
    (void)thread;
    mm_job *j = ctx;
    int64_t r0 = (int64_t)task * j->rows_per_task;
    int64_t r1 = r0 + j->rows_per_task < j->W->rows ? r0 + j->rows_per_task : j->W->rows;
    if (j->isa) j->isa->rows(j->W, r0, r1, j->x, j->xs, j->n, j->y);
    else kn_ref_matmul_rows(j->W, r0, r1, j->x, j->n, j->y);
}

void kn_matmul(const pt_wview *W, const float *x, int n, float *y) {
    if (n <= 0 || W->rows <= 0) return;
    ensure_init();
    mm_job job = {W, mm_isa(), x, W->cols, 0, n, y};
    if (job.isa && !job.isa->supports(W)) job.isa = NULL;
    if (job.isa) {
        int64_t xs = (W->cols + KN_XPAD - 1) / KN_XPAD * KN_XPAD;
        float *xp = xp_get((size_t)(xs * n));
        if (xp && xs > 0) {
            prep_x(x, n, W->cols, xs, W->qtype == PT_Q4_G64 ? job.isa->q4_chunk : 0, xp);
            job.x = xp;
            job.xs = xs;
        } else {
            job.isa = NULL;
        }
    }
    /* About 4 tasks per thread (dynamic balance against OS noise), at least 16 rows each and
     * at least ~64 KB of weights each so tiny matmuls do not pay for the fan-out. */
    int64_t units = (W->rows + 15) / 16;
    int64_t want_tasks = (int64_t)g_threads * 4;
    int64_t min_units = (64 << 10) / (16 * (W->row_bytes > 0 ? W->row_bytes : 1) * (int64_t)n + 1) + 1;
    int64_t per = (units + want_tasks - 1) / want_tasks;
    if (per < min_units) per = min_units;
    job.rows_per_task = per * 16;
    int64_t tasks = (W->rows + job.rows_per_task - 1) / job.rows_per_task;
    pool_run(g_pool, (int)tasks, mm_task, &job);
}

float kn_dot(const float *a, const float *b, int64_t n) { return kn_ref_dot(a, b, n); }
void kn_axpy(float *y, float a, const float *x, int64_t n) { kn_ref_axpy(y, a, x, n); }
void kn_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps) {
    kn_ref_rmsnorm(out, x, w, n, eps);
}
void kn_softmax(float *x, int64_t n) { kn_ref_softmax(x, n); }
void kn_silu_mul(float *out, const float *gate, const float *up, int64_t n) {
    kn_ref_silu_mul(out, gate, up, n);
}
