/* petrel.c: the command-line entry point; dispatches to one subcommand per file. */
#include <errno.h>
#include <string.h>

#include "cli.h"

typedef struct { const char *name; int (*fn)(int, char **); const char *help; } command;

static const command commands[] = {
    {"info", cmd_info, "print a model's config, tensor inventory and memory"},
    {"logits", cmd_logits, "write float32 logits for every position of a prompt"},
    {"generate", cmd_generate, "greedy-generate token ids from token ids"},
    {"batch", cmd_batch, "greedy-generate after many prompts at once (continuous batching)"},
    {"tokenize", cmd_tokenize, "encode text to token ids with a tokenizer.json"},
    {"detokenize", cmd_detokenize, "decode token ids to text with a tokenizer.json"},
    {"template", cmd_template, "render a chat template (Jinja) over a request's messages"},
    {"run", cmd_run, "generate text after a prompt (streamed to stdout)"},
    {"chat", cmd_chat, "interactive chat through the model's chat template"},
    {"convert", cmd_convert, "write a petrel pack (quantized) from a Hugging Face checkpoint"},
    {"synth", cmd_synth, "write a GLM-5.2-shaped pack with random weights (benchmarks)"},
    {"bench", cmd_bench, "measure decode/prefill speed against the memory-bandwidth floor"},
    {"plan", cmd_plan, "will a model run here: memory plan for a budget, hit rate, predicted tok/s"},
    {"serve", cmd_serve, "OpenAI-compatible HTTP server with continuous batching"},
    {"bench-serve", cmd_bench_serve, "drive a running petrel serve with N streaming clients: tok/s, TTFT, ITL"},
    {"perplexity", cmd_perplexity, "perplexity of a text file (and KL divergence from saved logits)"},
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *f) {
    fprintf(f, "petrel: inference for the GLM-5 family (glm_moe_dsa)\n\n"
               "usage: petrel COMMAND [options]   (petrel COMMAND --help for its options)\n\ncommands:\n");
    for (size_t i = 0; i < N_COMMANDS; i++) fprintf(f, "  %-11s %s\n", commands[i].name, commands[i].help);
}

/* Every command returns through here: output still buffered for stdout is written now, and a
 * stdout that could not take it all (a full disk, /dev/full, a closed pipe) fails the command
 * with one line, unless it already failed (and said why). */
static int finish_stdout(const char *cmd, int rc) {
    errno = 0;
    int bad = fflush(stdout) != 0 || ferror(stdout);
    int e = errno;
    if (fclose(stdout) != 0 && !bad) { bad = 1; e = errno; }
    if (bad && rc == 0) {
        fprintf(stderr, "petrel: %s: writing to stdout failed: %s\n", cmd, e ? strerror(e) : "write error");
        return 1;
    }
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (!strcmp(argv[1], commands[i].name)) return finish_stdout(commands[i].name, commands[i].fn(argc - 1, argv + 1));
    fprintf(stderr, "petrel: unknown command \"%s\" (petrel --help lists them)\n", argv[1]);
    return 2;
}
