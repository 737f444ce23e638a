/* mem.c: big buffers in transparent huge pages (mem.h). */
#include "base/mem.h"

#include <stdlib.h>
#include <sys/mman.h>

void *pt_alloc_big(size_t bytes, size_t align) {
    if (!bytes) return NULL;
    if (align < sizeof(void *)) align = sizeof(void *);
    int huge = bytes >= PT_HUGE_PAGE;
    if (huge && align < PT_HUGE_PAGE) align = PT_HUGE_PAGE;
    void *p = NULL;
    if (posix_memalign(&p, align, bytes)) return NULL;
#ifdef MADV_HUGEPAGE
    /* the advice covers the 2 MiB ranges wholly inside [p, p + bytes); a kernel without THP
     * refuses it, which changes nothing but the page size */
    if (huge) (void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
}
