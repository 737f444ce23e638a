/* pool.c: the thread pool (see pool.h). One job at a time, described by one 64-bit word:
 *   claim = gen (20 bits) | n_tasks (22 bits) | next (22 bits)
 * caller: publish fn/ctx, reset done, store the new claim word, bump the futex word `wake`
 *         (waking sleepers if any), claim and run tasks itself, then spin until done == n_tasks.
 * worker: wait for `wake` to change (spin, then futex), then claim tasks by CAS on the word.
 * A CAS succeeds only on the current word, and a job is not finished while one of its claimed
 * tasks runs, so a worker that wakes late (or never) can neither run a stale task nor delay the
 * caller: the caller only waits for claimed tasks, never for workers to check in (which matters
 * when threads outnumber free cores). gen in the word rules out ABA on the CAS.
 * Lost wake-ups are impossible: a worker increments n_sleep before FUTEX_WAIT (which re-checks
 * `wake` atomically), the caller bumps `wake` before reading n_sleep, both seq_cst. */
#include "base/pool.h"

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct pt_pool {
    int n_threads;
    void (*init)(void);        /* run by each worker as it starts */
    pthread_t *th;
    pthread_mutex_t run_lock;  /* one job at a time */
    _Atomic uint32_t gen;      /* bumped once per job; futex word */
    _Atomic int stop;
    _Atomic uint64_t claim;    /* gen | n_tasks | next, see above */
    _Atomic int done;          /* tasks of the current job finished */
    _Atomic int n_sleep;       /* workers in (or entering) FUTEX_WAIT */
    uint32_t jobs;             /* job counter (caller side) */
    unsigned long long n_jobs, tail_ns; /* pool_stats (caller side, under run_lock) */
    pt_task_fn fn;
    void *ctx;
};

typedef struct { pt_pool *p; int id; } worker_arg;

/* Set while this thread runs tasks: a nested pool_run goes inline with the same thread index. */
static _Thread_local int in_pool_task, cur_thread;

static long futex(_Atomic uint32_t *addr, int op, uint32_t val) {
    return syscall(SYS_futex, (uint32_t *)addr, op, val, NULL, NULL, 0);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define NEXT_BITS 22
#define NEXT_MASK ((1ull << NEXT_BITS) - 1)
#define MAX_TASKS ((int)NEXT_MASK)

static void run_tasks(pt_pool *p, int thread) {
    in_pool_task = 1;
    cur_thread = thread;
    uint64_t c = atomic_load_explicit(&p->claim, memory_order_acquire);
    for (;;) {
        uint64_t next = c & NEXT_MASK, n = (c >> NEXT_BITS) & NEXT_MASK;
        if (next >= n) break;
        if (!atomic_compare_exchange_weak_explicit(&p->claim, &c, c + 1, memory_order_acquire,
                                                   memory_order_acquire))
            continue; /* c reloaded */
        p->fn(p->ctx, (int)next, thread);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
        c = atomic_load_explicit(&p->claim, memory_order_acquire);
    }
    in_pool_task = 0;
}

/* ~2 ms of spinning before sleeping: covers the gap between matmuls of one token. */
#define SPIN_SECONDS 2e-3

static void *worker_main(void *arg_) {
    worker_arg *arg = arg_;
    pt_pool *p = arg->p;
    int id = arg->id;
    free(arg);
    if (p->init) p->init();
    uint32_t seen = 0; /* gen starts at 0: a job published before this thread ran is still seen */
    for (;;) {
        uint32_t g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (g == seen) {
            double t0 = now_s();
            for (int spins = 0; (g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen;
                 spins++) {
                _mm_pause();
                if ((spins & 255) == 255 && now_s() - t0 > SPIN_SECONDS) {
                    atomic_fetch_add(&p->n_sleep, 1);
                    futex(&p->gen, FUTEX_WAIT_PRIVATE, seen);
                    atomic_fetch_sub(&p->n_sleep, 1);
                    t0 = now_s();
                }
            }
        }
        seen = g;
        if (atomic_load(&p->stop)) break;
        run_tasks(p, id);
    }
    return NULL;
}

pt_pool *pool_create(int n_threads) { return pool_create_init(n_threads, NULL); }

pt_pool *pool_create_init(int n_threads, void (*init)(void)) {
    if (n_threads <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = c > 0 ? (int)c : 1;
    }
    if (n_threads > 1024) n_threads = 1024;
    pt_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_threads = n_threads;
    p->init = init;
    pthread_mutex_init(&p->run_lock, NULL);
    p->th = calloc((size_t)n_threads, sizeof *p->th);
    if (!p->th) { free(p); return NULL; }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *a = malloc(sizeof *a);
        if (!a || (a->p = p, a->id = i, pthread_create(&p->th[i], NULL, worker_main, a)) != 0) {
            free(a);
            p->n_threads = i; /* keep the workers that did start */
            break;
        }
    }
    return p;
}

void pool_destroy(pt_pool *p) {
    if (!p) return;
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->gen, 1);
    futex(&p->gen, FUTEX_WAKE_PRIVATE, INT32_MAX);
    for (int i = 1; i < p->n_threads; i++) pthread_join(p->th[i], NULL);
    pthread_mutex_destroy(&p->run_lock);
    free(p->th);
    free(p);
}

int pool_threads(const pt_pool *p) { return p ? p->n_threads : 1; }

/* Runs every task on this thread, marked as inside a task so nested calls stay inline. */
static void run_inline(int n_tasks, pt_task_fn fn, void *ctx, int thread) {
    int was = in_pool_task, was_thread = cur_thread;
    in_pool_task = 1;
    cur_thread = thread;
    for (int t = 0; t < n_tasks; t++) fn(ctx, t, thread);
    in_pool_task = was;
    cur_thread = was_thread;
}

void pool_run(pt_pool *p, int n_tasks, pt_task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!p || in_pool_task) {
        run_inline(n_tasks, fn, ctx, in_pool_task ? cur_thread : 0);
        return;
    }
    pthread_mutex_lock(&p->run_lock); /* another thread's job: wait for it (thread ids stay unique) */
    if (p->n_threads == 1 || n_tasks == 1 || n_tasks > MAX_TASKS) {
        run_inline(n_tasks, fn, ctx, 0);
        pthread_mutex_unlock(&p->run_lock);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    p->jobs++;
    uint64_t word = ((uint64_t)(p->jobs & 0xfffff) << (2 * NEXT_BITS)) |
                    ((uint64_t)n_tasks << NEXT_BITS);
    atomic_store_explicit(&p->claim, word, memory_order_release); /* publishes fn, ctx, done */
    atomic_fetch_add(&p->gen, 1); /* seq_cst: orders before the n_sleep read */
    if (atomic_load(&p->n_sleep) > 0) futex(&p->gen, FUTEX_WAKE_PRIVATE, INT32_MAX);
    run_tasks(p, 0);
    double t0 = now_s();
    while (atomic_load_explicit(&p->done, memory_order_acquire) != n_tasks) _mm_pause();
    p->tail_ns += (unsigned long long)((now_s() - t0) * 1e9);
    p->n_jobs++;
    pthread_mutex_unlock(&p->run_lock);
}

void pool_stats(const pt_pool *p, unsigned long long *jobs, unsigned long long *tail_ns) {
    *jobs = p ? p->n_jobs : 0;
    *tail_ns = p ? p->tail_ns : 0;
}

int pool_in_task(void) { return in_pool_task; }
