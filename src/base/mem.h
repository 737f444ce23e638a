/* mem.h: the big buffers a forward streams through (session and batch scratch, activation
 * copies, the expert slots, bandwidth probes): aligned to 2 MiB when they are at least that
 * large and advised into transparent huge pages where the OS gives them (THP "madvise" or
 * "always"; elsewhere the advice is a no-op). In 4 KiB pages every first touch is a fault of its
 * own: a 512-token prefill's 0.27 GiB of scratch paid ~0.7 s of faults on its first run in a VM
 * (bench/RESULTS.md, 2026-12-05 06:20-06:55), none in huge pages. */
#ifndef PETREL_BASE_MEM_H
#define PETREL_BASE_MEM_H
#include <stddef.h>

#define PT_HUGE_PAGE ((size_t)2 << 20)

/* bytes of memory aligned to at least align (a power of two, >= sizeof(void *)), and to
 * PT_HUGE_PAGE with the huge-page advice when bytes >= PT_HUGE_PAGE. Not zeroed. NULL when out
 * of memory or bytes is 0. Release with free(). */
void *pt_alloc_big(size_t bytes, size_t align);
#endif
