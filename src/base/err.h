/* err.h: filling a petrel_error. Library code reports failures through these and returns the
 * code; it never prints or exits. */
#ifndef PETREL_BASE_ERR_H
#define PETREL_BASE_ERR_H
#include "petrel.h"

#if defined(__GNUC__)
#define PT_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define PT_PRINTF(a, b)
#endif

/* Sets err (may be NULL) to code and the formatted message; returns code. */
int pt_err(petrel_error *err, int code, const char *fmt, ...) PT_PRINTF(3, 4);
/* Prefixes the existing message with more context ("while loading X: ..."); returns err->code. */
int pt_err_ctx(petrel_error *err, const char *fmt, ...) PT_PRINTF(2, 3);
const char *pt_err_name(int code);

#define PT_TRY(expr)              \
    do {                          \
        int pt_rc_ = (expr);      \
        if (pt_rc_ < 0) return pt_rc_; \
    } while (0)
#endif
