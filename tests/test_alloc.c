/* test_alloc.c: the token loop never allocates (ENGINE.md principle 3). The test binary
 * interposes malloc/calloc/realloc/posix_memalign/aligned_alloc (on glibc, forwarding to
 * __libc_*), counting calls from any thread while a window is open; decode steps and batched
 * steps of several sessions run inside the window after a warm-up. Under the sanitizers (which
 * own malloc) the test is skipped and says so. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/mem.h"
#include "io/convert.h"
#include "model/engine.h"
#include "test.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define ALLOC_COUNTING 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define ALLOC_COUNTING 0
#endif
#endif
#if !defined(ALLOC_COUNTING) && defined(__GLIBC__)
#define ALLOC_COUNTING 1
#endif
#ifndef ALLOC_COUNTING
#define ALLOC_COUNTING 0
#endif

#if ALLOC_COUNTING
extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
static int counting;
static unsigned long n_alloc;
static void note(void) {
    if (__atomic_load_n(&counting, __ATOMIC_RELAXED)) __atomic_fetch_add(&n_alloc, 1, __ATOMIC_RELAXED);
}
void *malloc(size_t n) { note(); return __libc_malloc(n); }
void *calloc(size_t a, size_t b) { note(); return __libc_calloc(a, b); }
void *realloc(void *p, size_t n) { note(); return __libc_realloc(p, n); }
void *aligned_alloc(size_t al, size_t n) { note(); return __libc_memalign(al, n); }
void *memalign(size_t al, size_t n) { note(); return __libc_memalign(al, n); }
int posix_memalign(void **out, size_t al, size_t n) {
    note();
    void *p = __libc_memalign(al, n);
    if (!p) return 12; /* ENOMEM */
    *out = p;
    return 0;
}
static void window(int on) {
    if (on) __atomic_store_n(&n_alloc, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&counting, on, __ATOMIC_RELAXED);
}

/* Decode steps of one session, then batched steps of three sessions (one decode row each and a
 * prompt chunk), all after warm-up steps: no allocation inside. */
static void check_no_alloc(const char *path, int slots) {
    petrel_engine *e = NULL;
    petrel_error err = {0};
    petrel_open_opts o = {0};
    o.expert_slots = slots;
    if (petrel_engine_open(path, &o, &e, &err)) { test_fail(__FILE__, __LINE__, "open %s: %s", path, err.msg); return; }
    int V = e->cfg.vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)V * 16);
    petrel_session *s[3];
    for (int k = 0; k < 3; k++) CHECK(petrel_session_create(e, 128, &s[k], &err) == 0);
    int32_t ids[40];
    for (int i = 0; i < 40; i++) ids[i] = (int32_t)((i * 37 + 11) % V);
    for (int k = 0; k < 3; k++) CHECK(petrel_session_forward(s[k], ids, 20 + k, lg, 0, &err) == 0);
    petrel_batch *b = NULL;
    CHECK(petrel_batch_create(e, 16, &b, &err) == 0);
    petrel_row rows[16];
    for (int warm = 0; warm < 2; warm++) { /* first touches: per-thread kernel buffers */
        int32_t t = ids[warm];
        CHECK(petrel_session_forward(s[0], &t, 1, lg, 0, &err) == 0);
        int n = 0;
        rows[n++] = (petrel_row){s[0], 3, 1};
        rows[n++] = (petrel_row){s[1], 4, 1};
        for (int i = 0; i < 6; i++) rows[n++] = (petrel_row){s[2], ids[i], i == 5};
        CHECK(petrel_batch_forward(b, rows, n, lg, &err) == 0);
    }
    window(1);
    for (int step = 0; step < 4; step++) {
        int32_t t = ids[step + 5];
        int rc = petrel_session_forward(s[0], &t, 1, lg, 0, &err);
        int n = 0;
        rows[n++] = (petrel_row){s[0], 3, 1};
        rows[n++] = (petrel_row){s[1], 4, 1};
        for (int i = 0; i < 6; i++) rows[n++] = (petrel_row){s[2], ids[i + 10], i == 5};
        rc |= petrel_batch_forward(b, rows, n, lg, &err);
        if (rc) break;
    }
    window(0);
    unsigned long got = n_alloc;
    CHECK_MSG(got == 0, "%s: %lu allocations in the token loop (decode and batched steps)", path, got);
    /* the counter works: an allocation inside the window is seen */
    window(1);
    void *volatile p = malloc(16);
    window(0);
    free(p);
    CHECK_EQ_INT(n_alloc, 1);
    petrel_batch_free(b);
    for (int k = 0; k < 3; k++) petrel_session_free(s[k]);
    petrel_engine_close(e);
    free(lg);
}
#endif

TEST(alloc, token_loop_resident) {
#if ALLOC_COUNTING
    check_no_alloc(test_data("trained"), 0);
#else
    test_skip("the sanitizers own malloc: allocations cannot be counted");
#endif
}

TEST(alloc, token_loop_q4_streamed) {
#if ALLOC_COUNTING
    const char *pk = test_pack_of("odd", CVQ_Q4);
    if (!pk) return;
    check_no_alloc(pk, 0);
    check_no_alloc(pk, 1); /* experts streamed through one slot per layer */
#else
    test_skip("the sanitizers own malloc: allocations cannot be counted");
#endif
}

/* Whether the mapping holding p carries the huge-page advice (VmFlags "hg" in /proc/self/smaps):
 * 1 yes, 0 no, -1 unknown (no smaps). */
static int advised_huge(const void *p) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return -1;
    char line[512];
    int in = 0, found = 0;
    uintptr_t a = (uintptr_t)p;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {
            in = a >= lo && a < hi;
            continue;
        }
        if (in && !strncmp(line, "VmFlags:", 8)) {
            found = strstr(line, " hg") != NULL;
            break;
        }
    }
    fclose(f);
    return found;
}

/* Big buffers (src/base/mem.h): 2 MiB-aligned and advised into huge pages from 2 MiB up, the
 * asked alignment below; no buffer for 0 bytes or an impossible size; and a session's scratch comes from there (a batch's the same way) (their first touch faulted page by page in 4 KiB pages). */
TEST(alloc, big_buffers_in_huge_pages) {
    uint8_t *big = pt_alloc_big(PT_HUGE_PAGE * 3 + 100, 64), *small = pt_alloc_big(5000, 4096);
    CHECK(big != NULL && small != NULL);
    CHECK_EQ_INT((int)((uintptr_t)big % PT_HUGE_PAGE), 0);
    CHECK_EQ_INT((int)((uintptr_t)small % 4096), 0);
    memset(big, 1, PT_HUGE_PAGE * 3 + 100); /* all of it is ours */
    memset(small, 1, 5000);
    CHECK(pt_alloc_big(0, 64) == NULL);
#if ALLOC_COUNTING /* the sanitizers' allocator aborts on an impossible size instead */
    CHECK(pt_alloc_big(SIZE_MAX / 2, 64) == NULL);
#endif
    int thp = access("/sys/kernel/mm/transparent_hugepage/enabled", F_OK) == 0;
    if (thp && advised_huge(big) >= 0) {
        CHECK_EQ_INT(advised_huge(big), 1);
        petrel_engine *e = NULL;
        petrel_error err = {0};
        CHECK(petrel_engine_open(test_data("trained"), NULL, &e, &err) == 0);
        petrel_session *s = NULL;
        CHECK(petrel_session_create(e, 1024, &s, &err) == 0);
        CHECK(s->ar.cap >= PT_HUGE_PAGE); /* else the check says nothing */
        CHECK_EQ_INT(advised_huge(s->ar.base), 1);
        petrel_session_free(s);
        petrel_engine_close(e);
    }
    free(big);
    free(small);
    if (!thp) test_skip("no transparent huge pages in this kernel: alignment checked, the advice not");
}
