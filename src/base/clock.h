/* clock.h: the one monotonic clock petrel times things with (stats, I/O wait, disk busy). */
#ifndef PETREL_BASE_CLOCK_H
#define PETREL_BASE_CLOCK_H
#include <stdint.h>
/* Nanoseconds of CLOCK_MONOTONIC. */
uint64_t pt_now_ns(void);
#endif
