/* pool.h: one persistent thread pool for parallel-for over tasks.
 *
 * The calling thread takes part as thread 0; n_threads-1 workers are created once and live until
 * pool_destroy. pool_run hands out task indices 0..n_tasks-1 dynamically (atomic counter) and
 * returns when every task has finished and every worker has left the job, so ctx may live on the
 * caller's stack. Workers spin briefly between jobs (decode issues thousands of small jobs per
 * second; a futex wake costs tens of microseconds) and then sleep on a futex.
 *
 * Invariants: which thread runs a task is not deterministic, so callers must make each task's
 * result independent of the thread (kn_matmul gives every output element to one task).
 * A pool_run from inside a task runs inline on the calling thread (same thread index); a call
 * while another thread's job runs waits for it. Thread indices are unique within a job, so a
 * task may use per-thread scratch indexed by `thread`. */
#ifndef PETREL_BASE_POOL_H
#define PETREL_BASE_POOL_H

typedef struct pt_pool pt_pool;
typedef void (*pt_task_fn)(void *ctx, int task, int thread);

/* n_threads <= 0: number of online CPUs. Returns NULL on failure (then run everything inline). */
pt_pool *pool_create(int n_threads);
/* The same, each worker calling init() once when it starts (per-thread buffers allocated up
 * front, so no task ever allocates them later). init may be NULL. */
pt_pool *pool_create_init(int n_threads, void (*init)(void));
void pool_destroy(pt_pool *p);
int pool_threads(const pt_pool *p); /* 1 for NULL */
/* Runs fn(ctx, t, thread) for t in [0, n_tasks); thread in [0, pool_threads). p may be NULL. */
void pool_run(pt_pool *p, int n_tasks, pt_task_fn fn, void *ctx);
/* Counters since pool_create (read between jobs): jobs dispatched to workers, and the caller's
 * total time from finishing its own share of tasks to the job's last task done (the tail of
 * load imbalance plus the synchronization). Inline jobs are not counted. */
/* Whether this thread is running a pool task now (a nested pool_run would go inline). */
int pool_in_task(void);
void pool_stats(const pt_pool *p, unsigned long long *jobs, unsigned long long *tail_ns);
#endif
