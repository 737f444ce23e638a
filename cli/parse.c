/* parse.c: the one strict parser for counts and sizes given on the command line (--ctx, -n,
 * --threads, --expert-slots, --mem-budget, ...). A count is decimal digits only (a leading '-'
 * only where the range allows negatives): no spaces, '+', fractions, exponents, hex, "inf" or
 * "nan", and no trailing junk. A size is a count of bytes with an optional suffix K, M, G or T
 * (also Ki/KiB/KB, ... in either case), every one a power of 1024; fractions are refused
 * ("1.5G" -> write 1536M). Every value is range-checked without overflow. */
#include <stdarg.h>
#include <string.h>

#include "cli.h"

/* Digits (with an optional '-' when neg_ok) into *mag / *neg; *end after the digits. -1: none,
 * -2: more than 2^63. */
static int digits(const char *s, int neg_ok, unsigned long long *mag, int *neg, const char **end) {
    const char *p = s;
    *neg = 0;
    if (neg_ok && *p == '-') { *neg = 1; p++; }
    if (*p < '0' || *p > '9') return -1;
    unsigned long long v = 0;
    int big = 0;
    for (; *p >= '0' && *p <= '9'; p++) {
        unsigned d = (unsigned)(*p - '0');
        if (v > (9223372036854775807ull - d) / 10) big = 1;
        else v = v * 10 + d;
    }
    *mag = v;
    *end = p;
    return big ? -2 : 0;
}

int cli_parse_count_msg(const char *s, long lo, long hi, long *out, char *why, size_t whysz) {
    unsigned long long mag;
    int neg;
    const char *end;
    if (!s || !*s) { snprintf(why, whysz, "is empty (want a whole number in %ld..%ld)", lo, hi); return -1; }
    int r = digits(s, lo < 0, &mag, &neg, &end);
    if (r == -1 || *end) {
        snprintf(why, whysz, "is not a whole number (digits only) in %ld..%ld", lo, hi);
        return -1;
    }
    long long v = neg ? -(long long)mag : (long long)mag;
    if (r == -2 || v < lo || v > hi) { snprintf(why, whysz, "is out of range: want %ld..%ld", lo, hi); return -1; }
    *out = (long)v;
    return 0;
}

int cli_parse_size_msg(const char *s, uint64_t lo, uint64_t hi, uint64_t *out, char *why, size_t whysz) {
    static const char *const form = "a whole number of bytes, optionally with K, M, G or T (powers of 1024), e.g. 4G or 1536M";
    unsigned long long mag;
    int neg;
    const char *end;
    if (!s || !*s) { snprintf(why, whysz, "is empty (want %s)", form); return -1; }
    int r = digits(s, 0, &mag, &neg, &end);
    if (r == -1) { snprintf(why, whysz, "is not a size (want %s)", form); return -1; }
    if (*end == '.' || *end == ',') { snprintf(why, whysz, "is not a whole size: fractions are not accepted (write 1536M for 1.5G)"); return -1; }
    int shift = 0;
    switch (*end) {
    case 'k': case 'K': shift = 10; break;
    case 'm': case 'M': shift = 20; break;
    case 'g': case 'G': shift = 30; break;
    case 't': case 'T': shift = 40; break;
    case 'b': case 'B': break;
    case 0: break;
    default: snprintf(why, whysz, "is not a size (want %s)", form); return -1;
    }
    if (*end && shift) {
        end++;
        if (*end == 'i' || *end == 'I') end++;
        if (*end == 'b' || *end == 'B') end++;
    } else if (*end) end++; /* a lone B */
    if (*end) { snprintf(why, whysz, "is not a size (want %s)", form); return -1; }
    int over = r == -2 || (shift && mag > (UINT64_MAX >> shift));
    uint64_t v = over ? 0 : (uint64_t)mag << shift;
    if (over || v > hi) {
        static const char *const unit[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
        int u = 0;
        while (u < 6 && hi >> (10 * (u + 1)) << (10 * (u + 1)) == hi && hi >> (10 * (u + 1))) u++;
        snprintf(why, whysz, "is too large: at most %llu %s", (unsigned long long)(hi >> (10 * u)), unit[u]);
        return -1;
    }
    if (v < lo) {
        snprintf(why, whysz, "is too small: want at least %llu byte%s%s", (unsigned long long)lo, lo == 1 ? "" : "s",
                 v == 0 ? " (0 is not allowed)" : "");
        return -1;
    }
    *out = v;
    return 0;
}

int cli_parse_u64(const char *s, uint64_t *out) {
    unsigned long long mag;
    int neg;
    const char *end;
    if (!s) return -1;
    int r = digits(s, 0, &mag, &neg, &end);
    if (r == -1 || *end) return -1;
    if (r == -2) { /* past 2^63: accumulate the full 64 bits */
        uint64_t v = 0;
        for (const char *p = s; *p; p++) {
            uint64_t d = (uint64_t)(*p - '0');
            if (v > (UINT64_MAX - d) / 10) return -1;
            v = v * 10 + d;
        }
        *out = v;
        return 0;
    }
    *out = mag;
    return 0;
}

int cli_opt_count(const char *cmd, const char *flag, const char *v, long lo, long hi, long *out) {
    char why[200];
    if (cli_parse_count_msg(v, lo, hi, out, why, sizeof why) == 0) return 0;
    cli_fail("%s%s%s: \"%s\" %s", cmd ? cmd : "", cmd ? ": " : "", flag, v ? v : "", why);
    return -1;
}

int cli_opt_size(const char *cmd, const char *flag, const char *v, uint64_t lo, uint64_t hi, uint64_t *out) {
    char why[300];
    if (cli_parse_size_msg(v, lo, hi, out, why, sizeof why) == 0) return 0;
    cli_fail("%s%s%s: \"%s\" %s", cmd ? cmd : "", cmd ? ": " : "", flag, v ? v : "", why);
    return -1;
}

int cli_parse_int(const char *s, long lo, long hi, long *out) {
    char why[200];
    return cli_parse_count_msg(s, lo, hi, out, why, sizeof why);
}

int cli_parse_size(const char *s, uint64_t *out) {
    char why[300];
    return cli_parse_size_msg(s, 0, CLI_SIZE_MAX, out, why, sizeof why);
}

int cli_opt_choice(const char *cmd, const char *flag, const char *v, const char *const *names, int n) {
    char list[256] = "";
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        if (v && !strcmp(v, names[i])) return i;
        int w = snprintf(list + len, sizeof list - len, "%s%s", i == 0 ? "" : i + 1 < n ? ", " : " or ", names[i]);
        if (w > 0 && (size_t)w < sizeof list - len) len += (size_t)w;
    }
    cli_fail("%s: %s: \"%s\" is not %s", cmd, flag, v ? v : "", list);
    return -1;
}

int cli_opt_draft(const char *cmd, const char *v, int *out) {
    if (v && !strcmp(v, "auto")) {
        *out = -1; /* SPEC_AUTO */
        return 0;
    }
    long n = 0;
    char why[160];
    /* a '-' is taken as digits here so that "-1" reads as out of range, not as "not a number" */
    if (cli_parse_count_msg(v, -1000000, 1000000, &n, why, sizeof why) || n < 0 || n > 16) {
        cli_fail("%s: --draft: \"%s\" is out of range: want 0..16 (drafts per step; 0 = off) or auto", cmd, v ? v : "");
        return -1;
    }
    *out = (int)n;
    return 0;
}
