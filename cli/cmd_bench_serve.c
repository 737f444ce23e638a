/* cmd_bench_serve.c: `petrel bench-serve` drives a running `petrel serve` with N concurrent
 * streaming clients over HTTP (localhost sockets, HTTP/1.0 so the SSE bytes come unchunked) and
 * reports, for each N, aggregate generated tokens per second, time to the first token and the
 * inter-token latency (p50, p99). Every request asks for exactly --max-tokens tokens
 * (ignore_eos) with return_token_ids, so a chunk that carries several tokens counts them all:
 * its gap to the previous chunk is split evenly over its tokens. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"

static const char *usage =
    "usage: petrel bench-serve --port P [--host 127.0.0.1] [--clients 1,8,32] [--requests N]\n"
    "                          [--max-tokens T] [--api-key KEY]\n"
    "Streams completions from a running `petrel serve` with each client count in turn (every client\n"
    "sends --requests requests one after another, default 2, of --max-tokens tokens, default 64,\n"
    "at temperature 0 on prompts that differ per client) and prints one line per count: aggregate\n"
    "tok/s, time to first token p50/p99 and inter-token latency p50/p99 in ms.\n";

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct bs_client {
    const char *host, *key;
    int port, idx, requests, max_tokens;
    double *ttft, *itl; /* [requests], [requests * max_tokens] */
    int n_ttft, n_itl, tokens, failed;
} bs_client;

static const char *bs_prompts[] = {"The os module provides", "To read a file line by line,", "import sys", "Exceptions are",
                                   "The standard library", "A list comprehension", "def main():", "The :func:`open` function"};

static void *bs_main(void *p) {
    bs_client *c = p;
    for (int r = 0; r < c->requests; r++) {
        char body[512], req[1024];
        int bl = snprintf(body, sizeof body,
                          "{\"prompt\":\"%s (%d)\",\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,\"stream\":true,\"return_token_ids\":true}",
                          bs_prompts[c->idx % 8], c->idx, c->max_tokens);
        char auth[300] = "";
        if (c->key) snprintf(auth, sizeof auth, "Authorization: Bearer %.250s\r\n", c->key);
        int rl = snprintf(req, sizeof req, "POST /v1/completions HTTP/1.0\r\nHost: %s\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s",
                          c->host, auth, bl, body);
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)c->port)};
        inet_pton(AF_INET, c->host, &a.sin_addr);
        double t0 = now_s(), prev = 0;
        if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) || send(fd, req, (size_t)rl, MSG_NOSIGNAL) != rl) {
            if (fd >= 0) close(fd);
            c->failed++;
            continue;
        }
        char buf[65536];
        size_t n = 0;
        int got = 0;
        for (;;) {
            ssize_t k = recv(fd, buf + n, sizeof buf - 1 - n, 0);
            if (k <= 0) break;
            double t = now_s();
            n += (size_t)k;
            buf[n] = 0;
            /* whole events: count the token ids of each "token_ids":[...] */
            char *e, *s = buf;
            while ((e = strstr(s, "\n\n"))) {
                *e = 0;
                char *ti = strstr(s, "\"token_ids\":[");
                int nt = 0;
                if (ti) {
                    ti += 13;
                    if (*ti != ']') nt = 1;
                    for (; *ti && *ti != ']'; ti++) nt += *ti == ',';
                }
                if (nt) {
                    if (!got) c->ttft[c->n_ttft++] = t - t0;
                    else
                        for (int q = 0; q < nt && c->n_itl < c->requests * c->max_tokens; q++) c->itl[c->n_itl++] = (t - prev) / nt;
                    got += nt;
                    prev = t;
                }
                s = e + 2;
            }
            n = strlen(s);
            memmove(buf, s, n + 1);
            if (n > sizeof buf - 4096) n = 0; /* an oversized event: drop it */
        }
        close(fd);
        c->tokens += got;
        if (got != c->max_tokens) c->failed++;
    }
    return NULL;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double pct(double *v, int n, double p) {
    if (!n) return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    int i = (int)(p * (n - 1) + 0.5);
    return v[i];
}

CLI_CMD(bench_serve) {
    const char *host = "127.0.0.1", *key = NULL, *clients_s = "1,8,32";
    long port = 0, requests = 2, max_tokens = 64;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(usage, stdout); return 0; }
        else if (!strcmp(a, "--port") && has) { if (cli_opt_count("bench-serve", a, argv[++i], 1, 65535, &port)) return 1; }
        else if (!strcmp(a, "--requests") && has) { if (cli_opt_count("bench-serve", a, argv[++i], 1, 10000, &requests)) return 1; }
        else if (!strcmp(a, "--max-tokens") && has) { if (cli_opt_count("bench-serve", a, argv[++i], 1, 100000, &max_tokens)) return 1; }
        else if (!strcmp(a, "--host") && has) host = argv[++i];
        else if (!strcmp(a, "--api-key") && has) key = argv[++i];
        else if (!strcmp(a, "--clients") && has) clients_s = argv[++i];
        else return cli_fail("bench-serve: unknown or incomplete option \"%s\" (petrel bench-serve --help)", a);
    }
    if (!port) return cli_fail("bench-serve: --port is required (of a running petrel serve)");
    struct in_addr tmp;
    if (inet_pton(AF_INET, host, &tmp) != 1) return cli_fail("bench-serve: --host: \"%s\" is not an IPv4 address", host);
    int32_t *counts = NULL;
    char msg[256];
    int nc = cli_parse_ids(clients_s, &counts, msg, sizeof msg);
    if (nc <= 0) { free(counts); return cli_fail("bench-serve: --clients: %s", nc < 0 ? msg : "no counts"); }
    int rc = 0;
    printf("clients  requests  tokens  wall_s  tok/s  ttft_p50_ms  ttft_p99_ms  itl_p50_ms  itl_p99_ms  failed\n");
    for (int k = 0; k < nc && !rc; k++) {
        int N = counts[k];
        if (N < 1 || N > 1024) { rc = cli_fail("bench-serve: --clients: %d is not a count (1 .. 1024)", N); break; }
        bs_client *cl = calloc((size_t)N, sizeof *cl);
        pthread_t *th = calloc((size_t)N, sizeof *th);
        double *ttft = malloc(sizeof(double) * (size_t)N * (size_t)requests), *itl = malloc(sizeof(double) * (size_t)N * (size_t)requests * (size_t)max_tokens);
        if (!cl || !th || !ttft || !itl) { free(cl); free(th); free(ttft); free(itl); rc = cli_fail("bench-serve: out of memory"); break; }
        double t0 = now_s();
        for (int i = 0; i < N; i++) {
            cl[i] = (bs_client){.host = host, .key = key, .port = (int)port, .idx = i, .requests = (int)requests, .max_tokens = (int)max_tokens,
                                .ttft = ttft + (size_t)i * requests, .itl = itl + (size_t)i * requests * max_tokens};
            pthread_create(&th[i], NULL, bs_main, &cl[i]);
        }
        for (int i = 0; i < N; i++) pthread_join(th[i], NULL);
        double wall = now_s() - t0;
        long tokens = 0, failed = 0;
        int nt = 0, ni = 0;
        double *at = malloc(sizeof(double) * (size_t)N * (size_t)requests), *ai = malloc(sizeof(double) * (size_t)N * (size_t)requests * (size_t)max_tokens);
        for (int i = 0; at && ai && i < N; i++) {
            tokens += cl[i].tokens;
            failed += cl[i].failed;
            memcpy(at + nt, cl[i].ttft, sizeof(double) * (size_t)cl[i].n_ttft);
            nt += cl[i].n_ttft;
            memcpy(ai + ni, cl[i].itl, sizeof(double) * (size_t)cl[i].n_itl);
            ni += cl[i].n_itl;
        }
        if (at && ai)
            printf("%7d  %8ld  %6ld  %6.2f  %5.0f  %11.1f  %11.1f  %10.2f  %10.2f  %6ld\n", N, (long)N * requests, tokens, wall, tokens / wall,
                   1e3 * pct(at, nt, 0.5), 1e3 * pct(at, nt, 0.99), 1e3 * pct(ai, ni, 0.5), 1e3 * pct(ai, ni, 0.99), failed);
        fflush(stdout);
        if (failed) rc = 1;
        free(at);
        free(ai);
        free(cl);
        free(th);
        free(ttft);
        free(itl);
    }
    free(counts);
    return rc;
}
