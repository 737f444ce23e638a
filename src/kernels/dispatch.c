/* dispatch.c: the kernel tables (kn_table: the variants one engine runs, filled at open from
 * CPUID and its options; a process default for tools and tests) and kt_matmul on the thread pool.
 *
 * kn_matmul: prepares x once (kn_internal.h: padded, q4 de-interleaved) on the calling thread,
 * then splits the output rows into tasks of whole 16-row units (a 64-byte line of y, so no two
 * threads write one cache line) handed out dynamically by the pool. Each output element is
 * computed by exactly one task in the ISA kernel's fixed order: results do not depend on the
 * thread count or the schedule. Formats or shapes a SIMD kernel does not take fall back to the
 * scalar reference (also row-parallel).
 *
 * kn_matmul_many: every job is classified (int8-activation VNNI path, ISA kernel, reference),
 * activations are prepared once per distinct (x, n, cols, preparation), and the row tasks of all
 * jobs go to ONE pool_run (a task index maps to its job by binary search over task offsets).
 * kn_matmul is kn_matmul_many of one job. kn_matmul_t runs over 64-column tiles of y.
 *
 * AMX (r16_amx.c): detected from CPUID (leaf 7: AMX-TILE, AMX-INT8, AMX-BF16) and XCR0 (tile
 * state enabled), then the process asks the kernel for the tile data permission once
 * (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); without it AMX is unavailable. A table
 * with amx set runs R16 products of at least amx_min_rows rows on the tile kernel (bitwise the
 * VNNI result, so the threshold changes speed only); each task loads its own tile
 * configuration, so pool workers need no setup. Activations are prepared for whole 16-row tiles
 * (pad rows zeroed). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/mem.h"
#include "base/pool.h"
#include "kernels/kernels.h"
#include "kernels/kn_internal.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ISA_SCALAR KN_ISA_SCALAR
#define ISA_AVX2 KN_ISA_AVX2
#define ISA_AVX512 KN_ISA_AVX512

static pthread_once_t detect_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static int best_isa = ISA_SCALAR, has_vnni, has_amx, has_amx_bf16;
/* The process default table (tools, tests): kn_force_isa / kn_set_act_quant / kn_set_r16 change
 * it; engines fill their own (kn_table_init) and never read it. */
static kn_table g_def = {ISA_SCALAR, 0, 1, 1, 0, 0, KN_AMX_MIN_ROWS, 4096, 0, 1};
static pt_pool *g_pool;
static int g_threads;
/* kn_set_observer: a calibration hook (src/io/calib.c) shown every kn_matmul input */
static kn_observer_fn g_obs;
static void *g_obs_ctx;

void kn_set_observer(kn_observer_fn fn, void *ctx) {
    g_obs = fn;
    g_obs_ctx = ctx;
}

/* kn_set_profile: wall time and weight bytes per kind of product (benchmarks) */
static kn_prof *g_prof;
void kn_set_profile(kn_prof *p) { g_prof = p; }

static uint64_t prof_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The row of (the first job's) key; the last row takes what does not fit. */
static kn_prof_row *prof_row(kn_prof *p, const pt_wview *W, const pt_wview *W2, int n, int jobs, int kind) {
    int64_t rows2 = W2 ? W2->rows : 0;
    for (int i = 0; i < p->n_rows; i++) {
        kn_prof_row *r = &p->row[i];
        if (r->rows == W->rows && r->cols == W->cols && r->qtype == (int)W->qtype && r->layout == W->layout && r->n == n && r->jobs == jobs &&
            r->rows2 == rows2 && r->kind == kind)
            return r;
    }
    if (p->n_rows >= KN_PROF_ROWS) {
        p->row[KN_PROF_ROWS - 1].rows = -1;
        return &p->row[KN_PROF_ROWS - 1];
    }
    kn_prof_row *r = &p->row[p->n_rows++];
    *r = (kn_prof_row){W->rows, W->cols, rows2, (int)W->qtype, W->layout, n, jobs, kind, W->data, W2 ? W2->data : NULL, 0, 0, 0, 0};
    return r;
}

/* CPUID + XGETBV directly (clang 14's __builtin_cpu_supports rejects "f16c"): the OS must save
 * the YMM (and for AVX-512 the opmask/ZMM) state, XCR0 bits 1-2 and 5-7. */
static void detect_isa(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx) return;
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    if ((xlo & 6) != 6) return;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return;
    int avx2 = (b >> 5) & 1, f = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1,
        vl = (b >> 31) & 1, vnni = (c >> 11) & 1;
    if (avx2 && fma && f16c) best_isa = ISA_AVX2;
    if (best_isa == ISA_AVX2 && f && dq && bw && vl && (xlo & 0xe6) == 0xe6) {
        best_isa = ISA_AVX512;
        has_vnni = vnni;
    }
    /* AMX: CPUID.7.0:EDX bit 24 AMX-TILE, 25 AMX-INT8, 22 AMX-BF16; XCR0 bits 17-18 (XTILECFG,
     * XTILEDATA) enabled by the OS; then this process's permission to use the tile data
     * (Linux 5.16+: arch_prctl(ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18)). */
    int tile = (d >> 24) & 1, i8 = (d >> 25) & 1, bf = (d >> 22) & 1;
    if (best_isa == ISA_AVX512 && has_vnni && tile && i8 && (xlo & 0x60000) == 0x60000 &&
        syscall(SYS_arch_prctl, 0x1023, 18) == 0) {
        has_amx = 1;
        has_amx_bf16 = bf;
    }
}

static void detect(void) {
    detect_isa();
    g_def.isa = best_isa;
    g_def.vnni = best_isa == ISA_AVX512 && has_vnni;
    g_def.amx = has_amx;
}

int kn_amx_available(void) {
    pthread_once(&detect_once, detect);
    return has_amx;
}
int kn_amx_bf16_available(void) {
    pthread_once(&detect_once, detect);
    return has_amx_bf16;
}

static void *amx_peak_thread(void *a) {
    double *r = a;
    kn_amx_peak_run(20000); /* warm-up: the tile unit's power-up */
    uint64_t t0 = 0, t1 = 0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    t0 = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    double m = (double)kn_amx_peak_run(200000);
    clock_gettime(CLOCK_MONOTONIC, &ts);
    t1 = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    *r = m / ((double)(t1 - t0) / 1e9);
    return NULL;
}

double kn_amx_peak_macs(int threads) {
    if (!kn_amx_available() || threads < 1) return 0;
    if (threads > 256) threads = 256;
    pthread_t th[256];
    double r[256] = {0}, sum = 0;
    int started[256] = {0};
    for (int i = 1; i < threads; i++) started[i] = pthread_create(&th[i], NULL, amx_peak_thread, &r[i]) == 0;
    amx_peak_thread(&r[0]);
    for (int i = 1; i < threads; i++)
        if (started[i]) pthread_join(th[i], NULL);
    for (int i = 0; i < threads; i++) sum += r[i];
    return sum;
}

int kn_table_init(kn_table *t, const char *isa, int act_quant, int relayout) {
    pthread_once(&detect_once, detect);
    int want = best_isa, amx = has_amx, amx_bf16 = 0;
    if (isa && strcmp(isa, "auto")) {
        amx = 0;
        if (!strcmp(isa, "scalar")) want = ISA_SCALAR;
        else if (!strcmp(isa, "avx2")) want = ISA_AVX2;
        else if (!strcmp(isa, "avx512")) want = ISA_AVX512;
        else if (!strcmp(isa, "amx")) { want = ISA_AVX512; amx = 1; if (!has_amx) return -1; }
        else if (!strcmp(isa, "amx-bf16")) { want = ISA_AVX512; amx = amx_bf16 = 1; if (!has_amx_bf16) return -1; }
        /* tests only: the AMX kernels with their tile instructions emulated (r16_amxemu_avx512.c) */
        else if (!strcmp(isa, "amx-emu")) { want = ISA_AVX512; amx = amx_bf16 = 2; if (!has_vnni) return -1; }
        else return -1;
        if (want > best_isa) return -1;
    }
    if (act_quant < -1 || act_quant > 2 || relayout < -1 || relayout > 1) return -1;
    t->isa = want;
    t->vnni = want == ISA_AVX512 && has_vnni;
    t->amx = t->vnni ? amx : 0;
    t->amx_bf16 = t->amx ? amx_bf16 : 0;
    t->amx_min_rows = KN_AMX_MIN_ROWS;
    t->act_quant = act_quant == 0 ? 1 : act_quant < 0 ? 0 : act_quant;
    t->r16 = relayout >= 0;
    kn_table_prefetch(t, 0, 0, 0);
    return 0;
}

/* The default, 4 KB ahead into L1 and every line, is the same on both CPU kinds: on the Intel
 * host no other distance or level did better (bench/RESULTS.md, 2026-12-04 17:35); on the AMD
 * dev box a sweep stayed within its noise. Every line rather than every other (RESULTS,
 * 2026-12-04 21:20): on both kinds the hardware did not complete the 128-byte pairs for products
 * of several rows, which then waited for the lines they were not given (the Intel host at 2
 * threads: decode 1.17-1.18 -> 1.10-1.11 of its floor, 8 batched rows 254-262 -> 226-227 ms). */
int kn_table_prefetch(kn_table *t, int bytes, int level, int lines) {
    pthread_once(&detect_once, detect);
    if (bytes < -1 || (bytes > 0 && (bytes < 64 || bytes > 65536)) || level < 0 || level > 2 || lines < 0 || lines > 2) return -1;
    t->pf_bytes = bytes == 0 ? 4096 : bytes < 0 ? 0 : bytes / 64 * 64;
    t->pf_l2 = level == 2;
    t->pf_all = lines != 1;
    return 0;
}

const kn_table *kn_default(void) {
    pthread_once(&detect_once, detect);
    return &g_def;
}

int kt_r16_available(const kn_table *t) { return t->r16 && t->isa == ISA_AVX512 && t->vnni; }
void kn_set_amx_min_rows(int rows) {
    pthread_once(&detect_once, detect);
    g_def.amx_min_rows = rows < 1 ? 1 : rows;
}
int kn_r16_available(void) { return kt_r16_available(kn_default()); }

int kn_set_prefetch(int bytes, int level, int lines) {
    pthread_once(&detect_once, detect);
    return kn_table_prefetch(&g_def, bytes, level, lines);
}

void kn_set_r16(int on) {
    pthread_once(&detect_once, detect);
    g_def.r16 = on != 0;
}

static void xp_prewarm(void);

void kn_init(int n_threads) {
    pthread_once(&detect_once, detect);
    pthread_mutex_lock(&init_lock);
    int want = n_threads > 0 ? n_threads : 0;
    if (!g_pool || (want > 0 && want != g_threads)) {
        pool_destroy(g_pool);
        g_pool = pool_create_init(want, xp_prewarm); /* nested products run on workers too: their buffers now */
        xp_prewarm();
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

const char *kt_isa_name(const kn_table *t) {
    if (t->amx == 2) return "amx-emu";
    if (t->amx) return t->amx_bf16 ? "amx-bf16" : "amx";
    return t->isa == ISA_AVX512 ? "avx512" : t->isa == ISA_AVX2 ? "avx2" : "scalar";
}
const char *kn_isa_name(void) { return kt_isa_name(kn_default()); }

int kn_force_isa(const char *name) {
    kn_table t;
    if (kn_table_init(&t, name, 0, 0) < 0) return -1;
    g_def.isa = t.isa;
    g_def.vnni = t.vnni;
    g_def.amx = t.amx;
    g_def.amx_bf16 = t.amx_bf16;
    return 0;
}

static const kn_mm_isa *mm_isa(const kn_table *t) {
    return t->isa == ISA_AVX512 ? &kn_mm_avx512 : t->isa == ISA_AVX2 ? &kn_mm_avx2 : NULL;
}

/* Prepared activations live in a per-thread buffer that only grows: prefill calls it with
 * megabytes, and a fresh malloc (mmap + page faults) per matmul would cost more than the copy.
 * It starts at XP_MIN_FLOATS, enough for decode and batched decode steps (up to 16 rows of
 * 32768 columns), so which pool thread first meets which product never makes a token step
 * allocate (tests/test_alloc.c). */
#define XP_MIN_FLOATS ((size_t)1 << 19)
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
        if (cap < XP_MIN_FLOATS) cap = XP_MIN_FLOATS;
        /* large buffers (prefill) on 2 MB pages where the OS allows: the AMX kernel's tile loads
         * read 16 rows of one activation tile at a stride of a whole row (kilobytes), 16 pages a
         * load with 4 KB pages */
        xp_buf = pt_alloc_big((cap * sizeof(float) + 63) & ~(size_t)63, 64);
        xp_cap = xp_buf ? cap : 0;
        pthread_setspecific(xp_key, xp_buf);
    }
    return xp_buf;
}

static void xp_prewarm(void) { (void)xp_get(XP_MIN_FLOATS); }

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

void kn_set_act_quant(int mode) {
    pthread_once(&detect_once, detect);
    g_def.act_quant = mode < 0 ? 0 : mode > 2 ? 2 : mode;
}
int kn_act_quant(void) { return kn_default()->act_quant; }
int kt_act_quant_active(const kn_table *t, const pt_wview *W) {
    int kind = kn_actq_kind(W);
    return t->act_quant && t->isa == ISA_AVX512 && t->vnni && (kind == KN_ACTQ_Q4 || (kind == KN_ACTQ_Q8 && t->act_quant >= 2));
}
int kn_act_quant_active(const pt_wview *W) { return kt_act_quant_active(kn_default(), W); }

/* One matmul of a kn_matmul_many call, with its prepared activations and task split. */
enum { P_REF, P_ISA, P_ACTQ, P_R16, P_AMX, P_AMXBF };
typedef struct {
    const kn_table *t;
    const pt_wview *W;
    int path, n, prep; /* prep: 0 plain pad, else q4 chunk (P_ISA) or actq kind (P_ACTQ) */
    const kn_mm_isa *isa;
    const float *x;      /* caller's x */
    const void *xp;      /* prepared x (P_ISA: floats, P_ACTQ: records) */
    int64_t xs;          /* prepared row stride: floats (P_ISA) or bytes (P_ACTQ) */
    int64_t rows_per_task, task0;
    float *y;
} mm_part;

typedef struct {
    mm_part *parts;
    int n_parts;
} mm_ctx;

static void mm_task(void *ctx, int task, int thread) {
    (void)thread;
    mm_ctx *c = ctx;
    int lo = 0, hi = c->n_parts - 1; /* last part with task0 <= task */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (c->parts[mid].task0 <= task) lo = mid;
        else hi = mid - 1;
    }
    const mm_part *j = &c->parts[lo];
    int64_t r0 = (int64_t)(task - j->task0) * j->rows_per_task;
    int64_t r1 = r0 + j->rows_per_task < j->W->rows ? r0 + j->rows_per_task : j->W->rows;
    if (j->path == P_AMX) {
        if (j->t->amx == 2) kn_r16_rows_amx_emu(j->W, r0, r1, j->xp, j->xs, j->n, j->y);
        else kn_r16_rows_amx(j->W, r0, r1, j->xp, j->xs, j->n, j->y);
    } else if (j->path == P_AMXBF) {
        if (j->t->amx == 2) kn_amx_bf16_rows_emu(j->W, r0, r1, j->xp, j->xs, j->n, j->y);
        else kn_amx_bf16_rows(j->W, r0, r1, j->xp, j->xs, j->n, j->y);
    } else if (j->path == P_R16) {
        if (j->t->isa == ISA_AVX512 && j->t->vnni) kn_r16_rows_avx512(j->W, r0, r1, j->xp, j->xs, j->n, j->y, j->t->pf_bytes, j->t->pf_l2, j->t->pf_all);
        else kn_r16_rows_ref(j->W, r0, r1, j->xp, j->xs, j->n, j->y);
    } else if (j->path == P_ACTQ) kn_actq_rows_avx512(j->W, r0, r1, j->xp, j->xs, j->n, j->y);
    else if (j->path == P_ISA) j->isa->rows(j->W, r0, r1, j->xp, j->xs, j->n, j->y);
    else kn_ref_matmul_rows(j->W, r0, r1, j->x, j->n, j->y);
}

/* AMX paths: whole 16-row tiles of prepared activations (pad rows zeroed) */
static int64_t part_rows(const mm_part *p) { return p->path == P_AMX || p->path == P_AMXBF ? (p->n + 15) / 16 * 16 : p->n; }
static int64_t part_bytes(const mm_part *p) {
    return p->path == P_ACTQ || p->path == P_R16 || p->path == P_AMX || p->path == P_AMXBF ? p->xs * part_rows(p)
         : p->path == P_ISA ? p->xs * p->n * 4 : 0;
}

/* Prepared activations of rows [i0, i1) of part p (each row's bytes depend on its own x row only). */
static void prep_rows(const mm_part *p, int i0, int i1) {
    const float *x = p->x + (int64_t)i0 * p->W->cols;
    int n = i1 - i0;
    if (n <= 0) return;
    if (p->path == P_R16 || p->path == P_AMX) {
        uint8_t *xq = (uint8_t *)p->xp + p->xs * i0;
        if (p->t->isa == ISA_AVX512 && p->t->vnni) kn_r16_prep_avx512(p->W, x, n, xq);
        else kn_r16_prep(p->W, x, n, xq);
    } else if (p->path == P_AMXBF) kn_amx_bf16_prep(x, n, p->W->cols, (uint16_t *)((uint8_t *)p->xp + p->xs * i0), p->xs);
    else if (p->path == P_ACTQ) kn_actq_prep_avx512(p->prep, x, n, p->W->cols, (uint8_t *)p->xp + p->xs * i0);
    else prep_x(x, n, p->W->cols, p->xs, p->prep, (float *)p->xp + p->xs * i0);
}

/* The AMX paths read whole 16-row tiles: the prepared rows past n are zeros. */
static void zero_pad_rows(const mm_part *p) {
    if (part_rows(p) > p->n) memset((uint8_t *)p->xp + p->xs * p->n, 0, (size_t)(p->xs * (part_rows(p) - p->n)));
}

/* Preparing a prompt chunk's activations (512 rows x 6144 columns: 3 M values; 0.3-3 ms a
 * product on one core) ran on the calling thread while the others waited, and so did the many
 * small preparations of a set of experts (16 rows each at 512 tokens). When a dispatch prepares
 * at least PREP_SPLIT_MIN values, the pool prepares them in row ranges of at least
 * PREP_TASK_MIN values (prep_ctx: task t belongs to part pend[b] for t0[b] <= t < t0[b + 1]). */
#define PREP_SPLIT_MIN (1 << 17)
#define PREP_TASK_MIN (1 << 14)
#define KN_PREP_PARTS 64
typedef struct {
    mm_part *parts;
    const int *pend;
    int n_pend;
    int64_t t0[KN_PREP_PARTS + 1];
    int64_t tasks;
    int rows[KN_PREP_PARTS];
} prep_ctx;
static void prep_task(void *ctx, int task, int thread) {
    (void)thread;
    const prep_ctx *c = ctx;
    int lo = 0, hi = c->n_pend - 1; /* the last part with t0 <= task */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (c->t0[mid] <= task) lo = mid;
        else hi = mid - 1;
    }
    int b = lo;
    const mm_part *p = &c->parts[c->pend[b]];
    int i0 = (int)(task - c->t0[b]) * c->rows[b], i1 = i0 + c->rows[b] < p->n ? i0 + c->rows[b] : p->n;
    prep_rows(p, i0, i1);
}

/* Runs parts (already classified) as one pool dispatch. */
static void run_parts(mm_part *parts, int np) {
    kn_prof *prof = g_prof && !pool_in_task() ? g_prof : NULL;
    uint64_t tp0 = prof ? prof_now() : 0;
    /* prepared activations: one buffer; parts with the same x, n, cols and preparation share */
    size_t total = 0;
    for (int k = 0; k < np; k++) total += (size_t)((part_bytes(&parts[k]) + 63) & ~63);
    uint8_t *buf = total ? (uint8_t *)xp_get((total + 3) / 4) : NULL;
    size_t off = 0;
    int pend[KN_PREP_PARTS], n_pend = 0; /* int8-activation parts: prepared together, below */
    int64_t pend_vals = 0;
    for (int k = 0; k < np; k++) {
        mm_part *p = &parts[k];
        if (p->path == P_REF) continue;
        if (!buf) { p->path = P_REF; continue; }
        int shared = -1;
        for (int q = 0; q < k && shared < 0; q++)
            if (parts[q].path == p->path && parts[q].x == p->x && parts[q].n == p->n &&
                parts[q].prep == p->prep && parts[q].W->cols == p->W->cols && parts[q].xp)
                shared = q;
        if (shared >= 0) { p->xp = parts[shared].xp; continue; }
        p->xp = buf + off;
        off += (size_t)((part_bytes(p) + 63) & ~63);
        if ((p->path == P_R16 || p->path == P_AMX || p->path == P_ACTQ) && n_pend < (int)(sizeof pend / sizeof pend[0])) {
            pend[n_pend++] = k; /* prepared below, by the pool when the dispatch's preparation is large */
            pend_vals += (int64_t)p->n * p->W->cols;
            continue;
        }
        prep_rows(p, 0, p->n);
        zero_pad_rows(p);
    }
    if (pend_vals >= PREP_SPLIT_MIN && g_threads > 1 && !pool_in_task()) {
        /* rows are prepared independently, so any split gives the same bytes */
        prep_ctx pc = {parts, pend, n_pend, {0}, 0, {0}};
        for (int b = 0; b < n_pend; b++) {
            const mm_part *p = &parts[pend[b]];
            int64_t per = (p->n + 2 * g_threads - 1) / (2 * g_threads), min_rows = PREP_TASK_MIN / p->W->cols + 1;
            pc.rows[b] = (int)(per > min_rows ? per : min_rows);
            pc.t0[b] = pc.tasks;
            pc.tasks += (p->n + pc.rows[b] - 1) / pc.rows[b];
        }
        pc.t0[n_pend] = pc.tasks;
        pool_run(g_pool, (int)pc.tasks, prep_task, &pc);
    } else
        for (int b = 0; b < n_pend; b++) prep_rows(&parts[pend[b]], 0, parts[pend[b]].n);
    for (int b = 0; b < n_pend; b++) zero_pad_rows(&parts[pend[b]]);
    /* Tasks: about 4 per thread over all parts (dynamic balance against OS noise), at most ~2 MB
     * of weights each, whole 16-row units (a 64-byte line of y), at least ~64 KB of weights each
     * so tiny matmuls do not pay for the fan-out. */
    double total_w = 0;
    for (int k = 0; k < np; k++) total_w += (double)parts[k].W->rows * parts[k].W->row_bytes;
    int64_t tasks = 0;
    for (int k = 0; k < np; k++) {
        mm_part *p = &parts[k];
        const pt_wview *W = p->W;
        int64_t units = (W->rows + 15) / 16;
        double share = total_w > 0 ? (double)W->rows * W->row_bytes / total_w : 1.0 / np;
        int64_t want_tasks = (int64_t)((double)g_threads * 4 * share + 0.999);
        /* and tasks of at most ~2 MB of weights: a large matrix (the head: 1 GB) in four tasks
         * per thread left the others waiting up to a whole task (milliseconds) for one thread
         * that a shared core slowed down */
        int64_t by_bytes = (int64_t)((double)W->rows * (double)W->row_bytes / (double)(2 << 20));
        if (want_tasks < by_bytes) want_tasks = by_bytes;
        if (want_tasks < 1) want_tasks = 1;
        int64_t min_units =
            (64 << 10) / (16 * (W->row_bytes > 0 ? W->row_bytes : 1) * (int64_t)p->n + 1) + 1;
        int64_t per = (units + want_tasks - 1) / want_tasks;
        if (per < min_units) per = min_units;
        p->rows_per_task = per * 16;
        p->task0 = tasks;
        tasks += (W->rows + p->rows_per_task - 1) / p->rows_per_task;
    }
    mm_ctx c = {parts, np};
    uint64_t tp1 = prof ? prof_now() : 0;
    pool_run(g_pool, (int)tasks, mm_task, &c);
    if (prof) {
        kn_prof_row *r = prof_row(prof, parts[0].W, np > 1 ? parts[1].W : NULL, parts[0].n, np, KN_PROF_MATMUL);
        r->calls++;
        r->prep_ns += tp1 - tp0;
        r->run_ns += prof_now() - tp1;
        for (int k = 0; k < np; k++) r->wbytes += pt_wview_bytes(parts[k].W);
    }
}

static void classify(const kn_table *t, mm_part *p, const pt_wview *W, const float *x, int n, float *y) {
    memset(p, 0, sizeof *p);
    p->t = t; p->W = W; p->x = x; p->n = n; p->y = y; p->path = P_REF;
    if (W->layout == PT_LAYOUT_R16) { /* prep: the group size, so R16 parts share only with R16 */
        p->path = t->amx && n >= t->amx_min_rows && t->isa == ISA_AVX512 && t->vnni ? P_AMX : P_R16;
        p->prep = W->qtype == PT_Q4_G64 ? 64 : 32;
        p->xs = kn_r16_xs(W);
        return;
    }
    if (t->amx_bf16 && W->qtype == PT_BF16 && W->layout == PT_LAYOUT_PLAIN && n >= t->amx_min_rows && W->cols > 0) {
        p->path = P_AMXBF;
        p->prep = -1; /* shares only with other bf16 AMX parts */
        p->xs = kn_amx_bf16_xbs(W->cols);
        return;
    }
    if (kt_act_quant_active(t, W)) {
        p->path = P_ACTQ;
        p->prep = kn_actq_kind(W);
        p->xs = kn_actq_row_bytes(p->prep, W->cols);
        return;
    }
    const kn_mm_isa *isa = mm_isa(t);
    if (isa && isa->supports(W) && W->cols > 0) {
        p->path = P_ISA;
        p->isa = isa;
        p->prep = W->qtype == PT_Q4_G64 ? isa->q4_chunk : 0;
        p->xs = (W->cols + KN_XPAD - 1) / KN_XPAD * KN_XPAD;
    }
}

void kt_matmul(const kn_table *t, const pt_wview *W, const float *x, int n, float *y) {
    if (n <= 0 || W->rows <= 0) return;
    if (g_obs) g_obs(g_obs_ctx, W, x, n);
    ensure_init();
    mm_part p;
    classify(t, &p, W, x, n, y);
    run_parts(&p, 1);
}
void kn_matmul(const pt_wview *W, const float *x, int n, float *y) { kt_matmul(kn_default(), W, x, n, y); }

void kt_matmul_many(const kn_table *t, const kn_job *jobs, int n_jobs) {
    ensure_init();
    mm_part stackp[64]; /* a set of 32 experts: 64 gate / up jobs (no allocation in the token loop) */
    mm_part *parts = n_jobs <= 64 ? stackp : malloc(sizeof(mm_part) * (size_t)n_jobs);
    if (!parts) { /* out of memory: one at a time (kt_matmul shows each job to the observer) */
        for (int k = 0; k < n_jobs; k++) kt_matmul(t, jobs[k].W, jobs[k].x, jobs[k].n, jobs[k].y);
        return;
    }
    if (g_obs)
        for (int k = 0; k < n_jobs; k++)
            if (jobs[k].n > 0 && jobs[k].W->rows > 0) g_obs(g_obs_ctx, jobs[k].W, jobs[k].x, jobs[k].n);
    int np = 0;
    for (int k = 0; k < n_jobs; k++)
        if (jobs[k].n > 0 && jobs[k].W->rows > 0)
            classify(t, &parts[np++], jobs[k].W, jobs[k].x, jobs[k].n, jobs[k].y);
    if (np) run_parts(parts, np);
    if (parts != stackp) free(parts);
}
void kn_matmul_many(const kn_job *jobs, int n_jobs) { kt_matmul_many(kn_default(), jobs, n_jobs); }

void kn_ref_matmul_many(const kn_job *jobs, int n_jobs) {
    for (int k = 0; k < n_jobs; k++)
        if (jobs[k].n > 0) kn_ref_matmul(jobs[k].W, jobs[k].x, jobs[k].n, jobs[k].y);
}

/* ---- transposed product: parallel over 64-column tiles ---- */
typedef struct {
    const pt_wview *W;
    const float *x;
    int n, simd;
    int64_t cols_per_task;
    float *y;
} mt_ctx;

static void mt_task(void *ctx, int task, int thread) {
    (void)thread;
    mt_ctx *c = ctx;
    int64_t c0 = (int64_t)task * c->cols_per_task;
    int64_t c1 = c0 + c->cols_per_task < c->W->cols ? c0 + c->cols_per_task : c->W->cols;
    if (c->simd) kn_matmul_t_cols_avx512(c->W, c0, c1, c->x, c->n, c->y);
    else kn_ref_matmul_t_cols(c->W, c0, c1, c->x, c->n, c->y);
}

void kn_matmul_t(const pt_wview *W, const float *x, int n, float *y) { kt_matmul_t(kn_default(), W, x, n, y); }

void kt_matmul_t(const kn_table *t, const pt_wview *W, const float *x, int n, float *y) {
    if (n <= 0 || W->cols <= 0) return;
    ensure_init();
    int simd = t->isa == ISA_AVX512 && W->layout == PT_LAYOUT_PLAIN && (W->qtype != PT_FP8_E4M3 ||
               (W->scale && W->block_rows > 0 && W->block_cols > 0 && W->block_cols % 16 == 0)) &&
               (W->qtype == PT_F32 || W->qtype == PT_BF16 || W->qtype == PT_F16 ||
                W->qtype == PT_FP8_E4M3 || W->scale);
    int64_t tiles = (W->cols + 63) / 64;
    int64_t want = (int64_t)g_threads * 2;
    int64_t per = (tiles + want - 1) / want;
    /* at least ~32 KB of weights per task */
    int64_t min_t = (32 << 10) / ((W->rows * W->row_bytes) / tiles + 1) + 1;
    if (per < min_t) per = min_t;
    mt_ctx c = {W, x, n, simd, per * 64, y};
    kn_prof *prof = g_prof && !pool_in_task() ? g_prof : NULL;
    uint64_t tp0 = prof ? prof_now() : 0;
    pool_run(g_pool, (int)((tiles + per - 1) / per), mt_task, &c);
    if (prof) {
        kn_prof_row *r = prof_row(prof, W, NULL, n, 1, KN_PROF_MATMUL_T);
        r->calls++;
        r->run_ns += prof_now() - tp0;
        r->wbytes += pt_wview_bytes(W);
    }
}

float kt_dot(const kn_table *t, const float *a, const float *b, int64_t n) {
    return t->isa == ISA_AVX512 ? kn_dot_avx512(a, b, n) : kn_ref_dot(a, b, n);
}
void kt_axpy(const kn_table *t, float *y, float a, const float *x, int64_t n) {
    if (t->isa == ISA_AVX512) kn_axpy_avx512(y, a, x, n);
    else kn_ref_axpy(y, a, x, n);
}
void kt_rmsnorm(const kn_table *t, float *out, const float *x, const float *w, int64_t n, float eps) {
    if (t->isa == ISA_AVX512) kn_rmsnorm_avx512(out, x, w, n, eps);
    else kn_ref_rmsnorm(out, x, w, n, eps);
}
void kt_softmax(const kn_table *t, float *x, int64_t n) {
    if (t->isa == ISA_AVX512) kn_softmax_avx512(x, n);
    else kn_ref_softmax(x, n);
}
void kt_silu_mul(const kn_table *t, float *out, const float *gate, const float *up, int64_t n) {
    if (t->isa == ISA_AVX512) kn_silu_mul_avx512(out, gate, up, n);
    else kn_ref_silu_mul(out, gate, up, n);
}
int64_t kt_argmax(const kn_table *t, const float *x, int64_t n) {
    if (n <= 0) return 0;
    return t->isa == ISA_AVX512 ? kn_argmax_avx512(x, n) : kn_ref_argmax(x, n);
}
/* The attention core (kernels.h: kn_attn): AVX-512, else the scalar twin (bitwise the same). */
void kt_attn_core_many(const kn_table *t, const kn_attn *a, int n, float *const *scr) {
    if (n <= 0) return;
    ensure_init();
    kn_prof *prof = g_prof && !pool_in_task() ? g_prof : NULL;
    uint64_t tp0 = prof ? prof_now() : 0;
    if (t->isa == ISA_AVX512) kn_attn_core_many_avx512(a, n, scr);
    else
        for (int i = 0; i < n; i++)
            if (a[i].M > 0) kn_ref_attn(&a[i], scr[i]);
    if (prof) { /* keyed by the first problem's queries and the problem count: the bytes are the keys read */
        pt_wview v;
        memset(&v, 0, sizeof v);
        v.qtype = PT_F32, v.rows = a[0].M;
        kn_prof_row *r = prof_row(prof, &v, NULL, 1, n, KN_PROF_ATTN);
        r->calls++;
        r->run_ns += prof_now() - tp0;
        for (int i = 0; i < n; i++) r->wbytes += (uint64_t)a[i].N * (uint64_t)(a[i].D + a[i].Dr) * 4;
    }
}
void kt_attn_core(const kn_table *t, const kn_attn *a, float *scr) {
    if (a->M <= 0) return;
    kt_attn_core_many(t, a, 1, &scr);
}

float kn_dot(const float *a, const float *b, int64_t n) { return kt_dot(kn_default(), a, b, n); }
void kn_axpy(float *y, float a, const float *x, int64_t n) { kt_axpy(kn_default(), y, a, x, n); }
void kn_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps) { kt_rmsnorm(kn_default(), out, x, w, n, eps); }
void kn_softmax(float *x, int64_t n) { kt_softmax(kn_default(), x, n); }
void kn_silu_mul(float *out, const float *gate, const float *up, int64_t n) { kt_silu_mul(kn_default(), out, gate, up, n); }
int64_t kn_argmax(const float *x, int64_t n) { return kt_argmax(kn_default(), x, n); }
void kn_attn_core(const kn_attn *a, float *scr) { kt_attn_core(kn_default(), a, scr); }
/* DSA scores (kernels.h: kn_dsa): AVX-512 for up to 64 padded heads, else the scalar twin. */
void kt_dsa_scores(const kn_table *t, const kn_dsa *a) {
    if (a->n <= 0) return;
    if (t->isa == ISA_AVX512 && a->Hp <= 64) kn_dsa_scores_avx512(a);
    else kn_ref_dsa_scores(a);
}
