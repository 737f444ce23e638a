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
/* The strict parsers (cli/parse.c). A count: decimal digits only ('-' only where lo < 0), in
 * [lo, hi]. A size: a whole number of bytes with an optional K/M/G/T suffix (Ki/KiB/KB... too,
 * all powers of 1024), no fractions, in [lo, hi], no overflow. The _msg forms fill `why` (e.g.
 * "is out of range: want 1..1024") and return -1 on a bad value; cli_opt_* print the one line
 * "petrel: CMD: FLAG: "VALUE" WHY" and return -1. */
#define CLI_SIZE_MAX (1ull << 60) /* 1 EiB: larger sizes are refused */
int cli_parse_count_msg(const char *s, long lo, long hi, long *out, char *why, size_t whysz);
int cli_parse_size_msg(const char *s, uint64_t lo, uint64_t hi, uint64_t *out, char *why, size_t whysz);
int cli_opt_count(const char *cmd, const char *flag, const char *v, long lo, long hi, long *out);
int cli_opt_size(const char *cmd, const char *flag, const char *v, uint64_t lo, uint64_t hi, uint64_t *out);
/* FLAG VALUE, one of the n names (NULL-free): its index, or -1 with the one line
 * "petrel: CMD: FLAG: "VALUE" is not A, B or C" printed. */
int cli_opt_choice(const char *cmd, const char *flag, const char *v, const char *const *names, int n);
/* --draft VALUE: "auto" (-1, SPEC_AUTO) or 0..16; -1 with the one line printed. */
int cli_opt_draft(const char *cmd, const char *v, int *out);
/* --stats, then --draft last: a command's own line about its default follows it */
#define CLI_DRAFT_HELP                                                                             \
    "  --stats              print one JSON line on stderr at the end: tokens, forwards,\n"         \
    "                       tokens_per_forward, acceptance_by_position, steps and ms by K\n"       \
    "  --draft K|auto       speculative decoding with the model's MTP head: K drafts per step\n"   \
    "                       (1..16), 0 = off, auto = a cost model picks K per step (0 included)\n"
/* Short forms without the message: 0 or -1. cli_parse_size allows 0..CLI_SIZE_MAX. */
int cli_parse_size(const char *s, uint64_t *out);
int cli_parse_int(const char *s, long lo, long hi, long *out);
/* An unsigned 64-bit decimal (digits only); 0 or -1. */
int cli_parse_u64(const char *s, uint64_t *out);

/* Output files (src/base/outfile.h): refuses (one line printed, returns 1) a target that is not
 * a regular file, is in a missing folder, or is the input (input: a file or model folder, may be
 * NULL); 0 if it may be written. */
int cli_out_check(const char *cmd, const char *path, const char *input);

/* Common model-loading options understood by every command that loads a model. */
typedef struct cli_model_opts {
    const char *model;
    petrel_open_opts open;
    petrel_lora_spec lora[8]; /* --lora DIR[=SCALE], in order (open.lora points here at open) */
    char lora_dir[8][4096];
} cli_model_opts;
/* If argv[*i] is a model option (--model, --threads, --mem-budget, --expert-slots), consumes it
 * (and its value) and returns 1; returns 0 if not one; -1 on a bad value (message printed). */
int cli_model_opt(int argc, char **argv, int *i, cli_model_opts *mo);
/* petrel_engine_open with the options; prints the memory plan on stderr when streaming. Checks
 * the --trace-out target first. */
int cli_engine_open(const cli_model_opts *mo, petrel_engine **eng, petrel_error *err);
/* The end of a command that opened an engine: when rc is 0, writes what the engine owes (the
 * --trace-out file) and turns a failure into rc 1 with one line; then closes eng (may be NULL).
 * Returns the command's exit status. */
int cli_engine_close(const char *cmd, petrel_engine *eng, int rc);
/* A prompt's progress on stderr ("prompt: 12345 tokens, 37%"), for petrel_session_set_progress:
 * printed only once a forward call has run for a second, and only when stderr is a terminal or
 * `verbose`; user is a cli_progress. */
typedef struct cli_progress {
    int verbose, shown, last_pct;
    double t0;
    long long total;
} cli_progress;
void cli_progress_fn(void *user, long long done, long long total);
#define CLI_MODEL_OPTS_HELP                                                        \
    "  --model DIR|FILE     Hugging Face folder, petrel pack or colibri folder\n"  \
    "  --threads N          compute threads; 0 = all cores (the default)\n"            \
    "  --mem-budget SIZE    whole-process memory budget: a whole number of bytes with an optional\n" \
    "                       K/M/G/T suffix, powers of 1024 (4G, 1536M; no fractions; default: none)\n" \
    "  --expert-slots N     routed-expert slots per layer, >= 1 (default: all resident, or from budget)\n" \
    "  --trace-out FILE     record the routing (token, MoE layer, expert ids) to FILE (written whole\n" \
    "                       at the end; a symlink, FIFO, device or the model itself is refused)\n"  \
    "  --no-verify          pack with every expert resident: skip the checksums of its\n"       \
    "                       routed-expert records at open (resident tensors and experts\n"     \
    "                       streamed under --mem-budget / --expert-slots are still checked)\n" \
    "  -v, --verbose        print the memory plan and progress on stderr\n"                \
    "  --act-quant on|off|q8 int8 activations for q4 weights (on, the default), also q8 (q8),\n" \
    "                       or exact f32 activations for plain-layout weights (off)\n"    \
    "  --relayout on|off    interleave q8/q4 matrices 16 rows at open for the AVX-512 VNNI\n" \
    "                       kernels (on, the default, where the CPU has VNNI)\n"          \
    "  --isa NAME           kernel set: auto (default: AMX where the CPU has it), scalar, avx2,\n" \
    "                       avx512 (no AMX), amx (AMX-INT8 tiles, bitwise = avx512), amx-bf16\n" \
    "                       (amx + AMX-BF16 for bf16 weights: faster, not exact)\n"                \
    "  --prefetch P         the int8 kernels' software prefetch (speed only): off, or auto (default:\n" \
    "                       4096) or BYTES ahead of the weight stream, then :l1 or :l2 (where to)\n" \
    "                       and :all or :half (every 64-byte line, the default, or every other)\n" \
    "  --kv-type T          latent KV storage: f32 (default, exact), bf16, int8 (c int8 with a\n" \
    "                       scale per token and layer), auto (= bf16); indexer keys stay f32\n" \
    "  --kv-size SIZE       the KV page pool (default: the plan's KV under --mem-budget, else room\n" \
    "                       for 16 sessions of 4096 tokens, at most half the memory; touched as used)\n" \
    "  --lora DIR[=SCALE]   apply a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)\n" \
    "                       on top of the weights, scaled by SCALE (default 1); repeat to sum up to 8\n" \
    "  --lora-merge         merge the adapters into the weights at open (f32/bf16 models, resident\n" \
    "                       experts): exact and faster to decode, but every session gets them\n" \
    "  --device D           where the forward runs: cpu (default), cuda or cuda:N (a build with\n" \
    "                       `make cuda`: build/petrel-cuda; weights in GPU memory, routed experts\n" \
    "                       that do not fit in HBM slots over host RAM over the SSD)\n" \
    "  --vram-budget SIZE   GPU memory the weights, caches and scratch may take (default: the\n" \
    "                       GPU's free memory less 1 GiB)\n" \
    "  --vram-expert-slots N  routed experts kept in GPU memory per MoE layer (default: all when\n" \
    "                       they fit, else what --vram-budget leaves); the rest are copied from\n" \
    "                       the host as routed (with --mem-budget: from the expert store)\n" \
    "  --host-experts auto|off  with routed experts off the GPU: auto splits a decode step's\n" \
    "                       misses between copies and the host CPU computing them (a measured cost\n" \
    "                       model; results then match to float rounding, not bitwise); off (default)\n"

#define CLI_CMD(name) int cmd_##name(int argc, char **argv)
CLI_CMD(info);
CLI_CMD(logits);
CLI_CMD(generate);
CLI_CMD(batch);
CLI_CMD(tokenize); CLI_CMD(detokenize);
CLI_CMD(template);
CLI_CMD(run); CLI_CMD(chat);
CLI_CMD(convert); CLI_CMD(synth); CLI_CMD(bench);
CLI_CMD(perplexity);
CLI_CMD(plan);
CLI_CMD(serve); CLI_CMD(bench_serve);

/* petrel bench --draft (cli/bench_draft.c): decode with and without drafting, alternating. */
typedef struct bench_draft_opts {
    int draft;          /* 1..16 or -1 (auto) */
    double oracle;      /* --oracle-accept P, 0: off */
    long prompt, tokens, rounds;
    int batch;          /* sessions per step (0/1: one) */
    const char *golden; /* prompts from a golden.safetensors, or NULL: random prompts */
    int json;
} bench_draft_opts;
struct petrel_engine;
int bench_draft(struct petrel_engine *eng, const bench_draft_opts *o);

/* Quant options of convert and synth (--quant, --experts, --attention, --dense, --embed, --mtp)
 * into a convert_opts (src/io/convert.h): 1 consumed, 0 not one, -1 bad value (printed). */
struct convert_opts;
int cli_quant_opt(int argc, char **argv, int *i, struct convert_opts *o);

/* Sampling options shared by run and chat (cli/cmd_run.c). If argv[*i] is one (--temp, --top-k,
 * --top-p, --min-p, --repeat-penalty, --presence-penalty, --frequency-penalty, --repeat-last-n,
 * --seed), consumes it and its value and returns 1 (*seed_set = 1 for --seed); 0 if not one;
 * -1 on a bad value (message printed). */
struct sampler_params;
int cli_sampling_opt(const char *cmd, int argc, char **argv, int *i, struct sampler_params *sp,
                     int *seed_set);
/* A seed from the clock and the pid, for runs without --seed. */
uint64_t cli_random_seed(void);
/* The tokenizer.json to use: --tokenizer FILE if given, else the model's own: MODEL/tokenizer.json
 * for a folder (or the folder of a .safetensors file), the pack itself when it stores one (load
 * it with cli_tok_load); NULL (message printed) when there is none. buf may hold the result. */
const char *cli_tokenizer_path(const char *cmd, const char *tok_opt, const char *model, char *buf,
                               size_t bufsz);
/* Loads the tokenizer at path (what cli_tokenizer_path gave): a tokenizer.json, or a pack whose
 * stored copy is read (checksum checked). */
struct tokenizer;
int cli_tok_load(const char *path, struct tokenizer **out, petrel_error *err);
#define CLI_SAMPLING_OPTS_HELP                                                                   \
    "  --temp T             temperature; 0 = greedy (default 0.8)\n"                             \
    "  --top-k K            keep the K most likely tokens; 0 = off (default 40)\n"               \
    "  --top-p P            keep the smallest set with mass >= P; 1 = off (default 0.95)\n"      \
    "  --min-p M            drop tokens below M x the top probability; 0 = off (default 0.05)\n" \
    "  --repeat-penalty R   divide positive / multiply negative logits of recent tokens by R;\n" \
    "                       1 = off (default 1)\n"                                             \
    "  --presence-penalty X subtract X from the logit of every recent token (default 0)\n"      \
    "  --frequency-penalty F subtract F x its count from each recent token's logit (default 0)\n" \
    "  --repeat-last-n N    the penalties' window of recent tokens, prompt included (default 64)\n" \
    "  --seed S             PRNG seed: the same seed gives the same text (default: random)\n"   \
    "  Order: penalties, temperature, top-k, top-p, min-p, draw.\n"
#endif
