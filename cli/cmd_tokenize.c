/* cmd_tokenize.c: `petrel tokenize` (text -> ids) and `petrel detokenize` (ids -> text) over a
 * Hugging Face tokenizer.json (src/text/tokenizer.h). */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/file.h"
#include "cli.h"
#include "text/tokenizer.h"

static const char *TOKENIZE_HELP =
    "usage: petrel tokenize (--tokenizer FILE | --model DIR) [--] [TEXT...]\n"
    "\n"
    "Encodes TEXT with a Hugging Face tokenizer.json and prints the token ids on stdout,\n"
    "separated by single spaces, ending with a newline (an empty text prints an empty line).\n"
    "No BOS/EOS is added; special tokens written in the text (e.g. <|user|>) are recognized.\n"
    "Several TEXT arguments are joined with single spaces; with no TEXT the text is read from\n"
    "stdin (all of it, bytes as they are). Use -- before a TEXT that starts with '-'.\n"
    "\n"
    "  --tokenizer FILE     the tokenizer.json file\n"
    "  --model DIR          a model folder: uses DIR/tokenizer.json\n"
    "  -h, --help           this help\n"
    "\n"
    "Invalid UTF-8 in the text is an error naming its byte offset. Errors: one line on stderr,\n"
    "exit status 1 (2 for bad usage).\n";

static const char *DETOKENIZE_HELP =
    "usage: petrel detokenize (--tokenizer FILE | --model DIR) [--] ID...\n"
    "\n"
    "Decodes token ids with a Hugging Face tokenizer.json and writes the text to stdout: exactly\n"
    "the decoded bytes, with no newline added. Special tokens are written out as their text.\n"
    "IDs are non-negative integers, as separate arguments and/or comma-separated (\"1,2 3\").\n"
    "With no ID the ids are read from stdin (separated by spaces, commas or newlines).\n"
    "\n"
    "  --tokenizer FILE     the tokenizer.json file\n"
    "  --model DIR          a model folder: uses DIR/tokenizer.json\n"
    "  -h, --help           this help\n"
    "\n"
    "An id outside the vocabulary is an error naming it. Errors: one line on stderr, exit\n"
    "status 1 (2 for bad usage).\n";

typedef struct { const char *tok; const char *model; int first_pos; int help; } tok_args;

/* Parses options up to "--" or the first positional; returns 0, or 2 after printing usage. */
static int parse_args(const char *cmd, int argc, char **argv, tok_args *a) {
    memset(a, 0, sizeof *a);
    a->first_pos = argc;
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        if (!strcmp(s, "--")) { a->first_pos = i + 1; return 0; }
        if (!strcmp(s, "-h") || !strcmp(s, "--help")) { a->help = 1; return 0; }
        if (!strcmp(s, "--tokenizer") || !strcmp(s, "--model")) {
            if (i + 1 >= argc) { cli_fail("%s: %s needs a value", cmd, s); return 2; }
            if (s[2] == 't') a->tok = argv[++i];
            else a->model = argv[++i];
            continue;
        }
        if (s[0] == '-' && s[1]) { cli_fail("%s: unknown option \"%s\" (petrel %s --help)", cmd, s, cmd); return 2; }
        a->first_pos = i;
        return 0;
    }
    return 0;
}

static int load(const char *cmd, const tok_args *a, tokenizer **t) {
    char path[4096];
    if (!a->tok && !a->model) { cli_fail("%s: give --tokenizer FILE or --model DIR (petrel %s --help)", cmd, cmd); return 2; }
    if (a->tok) snprintf(path, sizeof path, "%s", a->tok);
    else {
        struct stat st;
        if (stat(a->model, &st) == 0 && !S_ISDIR(st.st_mode)) snprintf(path, sizeof path, "%s", a->model);
        else snprintf(path, sizeof path, "%s/tokenizer.json", a->model);
    }
    petrel_error err = {0};
    if (cli_tok_load(path, t, &err) < 0) {
        fprintf(stderr, "petrel %s: %s\n", cmd, err.msg);
        return 1;
    }
    return 0;
}


CLI_CMD(tokenize) {
    tok_args a;
    int rc = parse_args("tokenize", argc, argv, &a);
    if (rc) return rc;
    if (a.help) { fputs(TOKENIZE_HELP, stdout); return 0; }
    tokenizer *t;
    if ((rc = load("tokenize", &a, &t))) return rc;
    char *text = NULL;
    size_t len = 0;
    if (a.first_pos >= argc) {
        petrel_error e = {0};
        if (pt_read_stream(stdin, "stdin", (size_t)1 << 30, &text, &len, &e)) { tok_free(t); return cli_fail_err("tokenize", &e); }
    } else {
        for (int i = a.first_pos; i < argc; i++) len += strlen(argv[i]) + 1;
        text = malloc(len + 1);
        if (!text) { tok_free(t); return cli_fail("tokenize: out of memory"); }
        len = 0;
        for (int i = a.first_pos; i < argc; i++) {
            if (i > a.first_pos) text[len++] = ' ';
            size_t l = strlen(argv[i]);
            memcpy(text + len, argv[i], l);
            len += l;
        }
    }
    int32_t *ids;
    size_t n;
    petrel_error err = {0};
    if (tok_encode(t, text, len, &ids, &n, &err) < 0) {
        free(text);
        tok_free(t);
        fprintf(stderr, "petrel tokenize: %s\n", err.msg);
        return 1;
    }
    for (size_t i = 0; i < n; i++) printf(i ? " %d" : "%d", (int)ids[i]);
    putchar('\n');
    free(ids);
    free(text);
    tok_free(t);
    return fflush(stdout) ? cli_fail("tokenize: cannot write stdout") : 0;
}

CLI_CMD(detokenize) {
    tok_args a;
    int rc = parse_args("detokenize", argc, argv, &a);
    if (rc) return rc;
    if (a.help) { fputs(DETOKENIZE_HELP, stdout); return 0; }
    /* parse the ids first: bad usage should not need the tokenizer */
    int32_t *ids = NULL;
    size_t n = 0;
    char msg[200];
    char *in = NULL;
    size_t in_len;
    if (a.first_pos >= argc) {
        petrel_error e = {0};
        if (pt_read_stream(stdin, "stdin", (size_t)1 << 30, &in, &in_len, &e)) return cli_fail_err("detokenize", &e);
    }
    int nargs = in ? 1 : argc - a.first_pos;
    for (int i = 0; i < nargs; i++) {
        int32_t *part;
        int k = cli_parse_ids(in ? in : argv[a.first_pos + i], &part, msg, sizeof msg);
        if (k < 0) { free(ids); free(in); return cli_fail("detokenize: %s", msg); }
        int32_t *p = realloc(ids, (n + (size_t)k + 1) * sizeof *p);
        if (!p) { free(part); free(ids); free(in); return cli_fail("detokenize: out of memory"); }
        ids = p;
        memcpy(ids + n, part, (size_t)k * sizeof *part);
        n += (size_t)k;
        free(part);
    }
    free(in);
    tokenizer *t;
    if ((rc = load("detokenize", &a, &t))) { free(ids); return rc; }
    char *out;
    size_t len;
    petrel_error err = {0};
    rc = tok_decode(t, ids, n, &out, &len, &err);
    free(ids);
    tok_free(t);
    if (rc < 0) {
        fprintf(stderr, "petrel detokenize: %s\n", err.msg);
        return 1;
    }
    fwrite(out, 1, len, stdout);
    free(out);
    return fflush(stdout) ? cli_fail("detokenize: cannot write stdout") : 0;
}
