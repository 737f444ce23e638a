/* fuzz_cli_parse.c: libFuzzer target for the strict count/size parser of command-line values
 * (cli/parse.c, compiled in here: it is CLI code, not part of libpetrel). Any crash, sanitizer
 * report or a value accepted outside its range is a bug; refusals are expected and fine. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../cli/parse.c"

/* the CLI's failure printers, silent here */
int cli_fail(const char *fmt, ...) { (void)fmt; return 1; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 256) return 0;
    char s[257];
    memcpy(s, data, size);
    s[size] = 0;
    char why[256];
    long v;
    if (cli_parse_count_msg(s, -5, 1000000, &v, why, sizeof why) == 0 && (v < -5 || v > 1000000)) abort();
    if (cli_parse_count_msg(s, 1, 1 << 24, &v, why, sizeof why) == 0 && (v < 1 || v > (1 << 24))) abort();
    uint64_t u;
    if (cli_parse_size_msg(s, 1, (uint64_t)1 << 60, &u, why, sizeof why) == 0 && (u < 1 || u > (uint64_t)1 << 60)) abort();
    (void)cli_parse_u64(s, &u);
    return 0;
}
