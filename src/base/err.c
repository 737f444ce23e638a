/* err.c: error message formatting for petrel_error. */
#include "base/err.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int pt_err(petrel_error *err, int code, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->code = code;
    }
    return code;
}

int pt_err_ctx(petrel_error *err, const char *fmt, ...) {
    if (!err) return PETREL_EINVAL;
    char prefix[512], old[sizeof err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof old);
    size_t pl = strlen(prefix);
    if (pl > sizeof err->msg - 3) pl = sizeof err->msg - 3;
    memcpy(err->msg, prefix, pl);
    memcpy(err->msg + pl, ": ", 2);
    size_t room = sizeof err->msg - pl - 3, ol = strnlen(old, sizeof old - 1);
    if (ol > room) ol = room;
    memcpy(err->msg + pl + 2, old, ol);
    err->msg[pl + 2 + ol] = 0;
    return err->code ? err->code : PETREL_EINVAL;
}

const char *pt_err_name(int code) {
    switch (code) {
    case PETREL_OK: return "ok";
    case PETREL_EINVAL: return "invalid input";
    case PETREL_EIO: return "I/O error";
    case PETREL_EFORMAT: return "bad format";
    case PETREL_ENOMEM: return "out of memory";
    case PETREL_EUNSUPPORTED: return "unsupported";
    case PETREL_ERANGE: return "out of range";
    default: return "error";
    }
}
