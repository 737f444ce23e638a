/* cli.h: shared pieces of the petrel command-line front end. Each subcommand lives in its own
 * cli/cmd_*.c and is listed in the table in cli/petrel.c. Commands print one line on stderr on
 * failure ("petrel CMD: what is wrong") and return non-zero. */
#ifndef PETREL_CLI_H
#define PETREL_CLI_H
#include <stdint.h>
#include <stdio.h>

#include "petrel.h"

/* Prints "petrel: <msg>" to stderr and returns 1 (use as `return cli_fail(...)`). */
int cli_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Reports a library error and returns 1. */
int cli_fail_err(const char *what, const petrel_error *err);

/* Parses "1,2,3" (or space separated) into a malloc'd array; returns count or -1 with msg. */
int cli_parse_ids(const char *s, int32_t **out, char *msg, size_t msgsz);
/* Parses sizes like 4096, 512M, 4G, 1.5G into bytes; returns 0 or -1. */
int cli_parse_size(const char *s, uint64_t *out);
/* Parses an int option value with range check; returns 0 or -1. */
int cli_parse_int(const char *s, long lo, long hi, long *out);

/* Common model-loading options understood by every command that loads a model. */
typedef struct cli_model_opts {
    const char *model;
    petrel_open_opts open;
} cli_model_opts;
/* If argv[*i] is a model option (--model, --threads, --mem-budget, --expert-slots), consumes it
 * (and its value) and returns 1; returns 0 if not one; -1 on a bad value (message printed). */
int cli_model_opt(int argc, char **argv, int *i, cli_model_opts *mo);
#define CLI_MODEL_OPTS_HELP                                                        \
    "  --model DIR|FILE     Hugging Face folder, petrel pack or colibri folder\n"  \
    "  --threads N          compute threads (default: all cores)\n"                \
    "  --mem-budget SIZE    whole-process memory budget, e.g. 4G (default: none)\n" \
    "  --expert-slots N     routed-expert slots per layer (default: from budget)\n"

#define CLI_CMD(name) int cmd_##name(int argc, char **argv)
CLI_CMD(info);
CLI_CMD(logits);
CLI_CMD(generate);
#endif
