/* test_serve.c: `petrel serve` (src/serve) over real HTTP on localhost. The server runs
 * in-process on a free port (and once as $PETREL_BIN serve); a small socket client here speaks
 * HTTP/1.1 (chunked replies de-chunked) and checks the OpenAI framing byte for byte.
 *   - greedy /v1/completions ids == `petrel generate` ids, for a prompt of ids and of text
 *   - 8 concurrent streams (more than --parallel, so some queue) == the same requests alone
 *   - error bodies {"error": {message, type, code}} with the right 4xx, API key, stop strings,
 *     a client that goes away mid-stream frees its place, SIGTERM exits cleanly. */
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "experts/xs.h"
#include "io/convert.h"
#include "runtime/chat.h"
#include "serve/request.h"
#include "serve/server.h"
#include "serve/toolcall.h"
#include "test.h"
#include "text/jinja.h"
#include "text/tokenizer.h"

static petrel_engine *g_eng;
static tokenizer *g_tok;
static jinja_template *g_tmpl;

static int fixture(void) {
    if (g_eng) return 0;
    petrel_error err = {0};
    petrel_open_opts oo = {0};
    const char *m = test_data("trained");
    char *src = NULL;
    size_t sl = 0;
    char tp[4200];
    snprintf(tp, sizeof tp, "%s/tokenizer.json", m);
    if (tok_load(tp, &g_tok, &err) || petrel_model_chat_template(m, &src, &sl, &err) || jinja_compile(src, sl, &g_tmpl, &err) ||
        petrel_engine_open(m, &oo, &g_eng, &err)) {
        free(src);
        test_fail(__FILE__, __LINE__, "fixture: %s", err.msg);
        return -1;
    }
    free(src);
    return 0;
}

static serve *start(serve_opts *o) {
    if (fixture()) return NULL;
    serve *sv = NULL;
    petrel_error err = {0};
    if (serve_start(g_eng, g_tok, g_tmpl, o, &sv, &err)) {
        test_fail(__FILE__, __LINE__, "serve_start: %s", err.msg);
        return NULL;
    }
    return sv;
}

typedef struct reply {
    int status;
    char *head, *body; /* malloc'd; body de-chunked */
    size_t body_len;
} reply;
static void reply_free(reply *r) { free(r->head); free(r->body); memset(r, 0, sizeof *r); }

static int connect_to(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) { if (fd >= 0) close(fd); return -1; }
    struct timeval tv = {60, 0}; /* never hang the suite */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

static int send_req(int fd, const char *method, const char *path, const char *hdrs, const char *body, size_t blen) {
    char h[1024];
    int n = snprintf(h, sizeof h, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n%sContent-Length: %zu\r\n\r\n",
                     method, path, hdrs ? hdrs : "", blen);
    if (send(fd, h, (size_t)n, MSG_NOSIGNAL) != n) return -1;
    size_t off = 0;
    while (off < blen) {
        ssize_t k = send(fd, body + off, blen - off, MSG_NOSIGNAL);
        if (k <= 0) return -1;
        off += (size_t)k;
    }
    return 0;
}

/* One request; the whole reply read until the server closes. */
static int http(int port, const char *method, const char *path, const char *hdrs, const char *body, reply *r) {
    memset(r, 0, sizeof *r);
    int fd = connect_to(port);
    if (fd < 0) return -1;
    if (send_req(fd, method, path, hdrs, body ? body : "", body ? strlen(body) : 0)) { close(fd); return -1; }
    size_t cap = 4096, n = 0;
    char *b = malloc(cap);
    for (;;) {
        if (n + 4096 > cap) b = realloc(b, cap *= 2);
        ssize_t k = recv(fd, b + n, cap - n - 1, 0);
        if (k < 0 && errno == EINTR) continue; /* a signal to the process (seen after a test that streamed experts; its source is not pinned down): not the end */
        if (k <= 0) break;
        n += (size_t)k;
    }
    close(fd);
    b[n] = 0;
    char *sep = strstr(b, "\r\n\r\n");
    if (!sep || sscanf(b, "HTTP/1.%*d %d", &r->status) != 1) { free(b); return -1; }
    *sep = 0;
    r->head = strdup(b);
    char *p = sep + 4, *end = b + n;
    r->body = malloc((size_t)(end - p) + 1);
    if (strcasestr(r->head, "transfer-encoding: chunked")) {
        size_t o = 0;
        while (p < end) {
            char *q;
            unsigned long cl = strtoul(p, &q, 16);
            q = strstr(p, "\r\n");
            if (!q || cl == 0) break;
            q += 2;
            if (q + cl > end) cl = (size_t)(end - q);
            memcpy(r->body + o, q, cl);
            o += cl;
            p = q + cl + 2;
        }
        r->body_len = o;
    } else {
        r->body_len = (size_t)(end - p);
        memcpy(r->body, p, r->body_len);
    }
    r->body[r->body_len] = 0;
    free(b);
    return 0;
}

/* A JSON reply's cJSON (NULL with a recorded failure when not JSON). */
static cJSON *json_of(const reply *r) {
    cJSON *j = cJSON_Parse(r->body ? r->body : "");
    if (!j) test_fail(__FILE__, __LINE__, "not JSON (status %d): %.300s", r->status, r->body ? r->body : "");
    return j;
}

/* An OpenAI error reply: status, {"error": {"message": string, "type": string, "code": ...}}. */
static void check_error(int port, const char *method, const char *path, const char *hdrs, const char *body, int want, const char *want_code,
                        const char *want_param, int line) {
    reply r;
    if (http(port, method, path, hdrs, body, &r)) { test_fail(__FILE__, line, "no reply"); return; }
    if (r.status != want) test_fail(__FILE__, line, "status %d, want %d: %.300s", r.status, want, r.body);
    cJSON *j = json_of(&r), *e = cJSON_GetObjectItem(j, "error");
    if (!cJSON_IsObject(e) || !cJSON_IsString(cJSON_GetObjectItem(e, "message")) || !cJSON_IsString(cJSON_GetObjectItem(e, "type")) ||
        !cJSON_GetObjectItem(e, "code") || !cJSON_GetObjectItem(e, "param"))
        test_fail(__FILE__, line, "not an OpenAI error body: %.300s", r.body);
    const cJSON *c = cJSON_GetObjectItem(e, "code"), *p = cJSON_GetObjectItem(e, "param");
    if (want_code && !(cJSON_IsString(c) && !strcmp(c->valuestring, want_code))) test_fail(__FILE__, line, "code is not %s: %.300s", want_code, r.body);
    if (want_param && !(cJSON_IsString(p) && !strcmp(p->valuestring, want_param))) test_fail(__FILE__, line, "param is not %s: %.300s", want_param, r.body);
    cJSON_Delete(j);
    reply_free(&r);
}
#define CHECK_ERROR(port, m, p, h, b, st, code, param) check_error(port, m, p, h, b, st, code, param, __LINE__)

/* A stream's events, checked for the exact SSE framing: each event is "data: JSON\n\n" or a
 * ": keep-alive\n\n" comment, the last "data: [DONE]\n\n". Fills the concatenated text, the
 * token ids (return_token_ids), the finish reason and the usage; 0 when well-formed. */
typedef struct sse_out {
    char text[16384], reasoning[16384], finish[16];
    int32_t ids[2048];
    int n_ids, prompt_tokens, completion_tokens, n_events, n_chunks;
} sse_out;
static int parse_sse(const char *b, size_t n, int chat, sse_out *o) {
    memset(o, 0, sizeof *o);
    const char *p = b, *end = b + n;
    int done = 0;
    while (p < end) {
        const char *e = strstr(p, "\n\n");
        if (!e || done) return -1;
        o->n_events++;
        if (!strncmp(p, ": keep-alive\n\n", 14)) { p = e + 2; continue; }
        if (strncmp(p, "data: ", 6) || memchr(p, '\n', (size_t)(e - p)) ) return -2;
        if (!strncmp(p, "data: [DONE]\n\n", 14)) { done = 1; p = e + 2; continue; }
        cJSON *j = cJSON_ParseWithLength(p + 6, (size_t)(e - p - 6));
        if (!j) return -3;
        const char *obj = cJSON_GetStringValue(cJSON_GetObjectItem(j, "object"));
        if (!obj || strcmp(obj, chat ? "chat.completion.chunk" : "text_completion") || !cJSON_IsString(cJSON_GetObjectItem(j, "id"))) { cJSON_Delete(j); return -4; }
        cJSON *u = cJSON_GetObjectItem(j, "usage");
        if (cJSON_IsObject(u)) {
            o->prompt_tokens = cJSON_GetObjectItem(u, "prompt_tokens")->valueint;
            o->completion_tokens = cJSON_GetObjectItem(u, "completion_tokens")->valueint;
        }
        cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
        if (c) {
            o->n_chunks++;
            cJSON *d = chat ? cJSON_GetObjectItem(c, "delta") : c;
            const char *t = cJSON_GetStringValue(cJSON_GetObjectItem(d, chat ? "content" : "text"));
            if (t) strncat(o->text, t, sizeof o->text - strlen(o->text) - 1);
            const char *rs = cJSON_GetStringValue(cJSON_GetObjectItem(d, "reasoning_content"));
            if (rs) strncat(o->reasoning, rs, sizeof o->reasoning - strlen(o->reasoning) - 1);
            cJSON *ids = cJSON_GetObjectItem(c, "token_ids"), *x;
            cJSON_ArrayForEach(x, ids) if (o->n_ids < 2048) o->ids[o->n_ids++] = x->valueint;
            const char *f = cJSON_GetStringValue(cJSON_GetObjectItem(c, "finish_reason"));
            if (f) snprintf(o->finish, sizeof o->finish, "%s", f);
        }
        cJSON_Delete(j);
        p = e + 2;
    }
    return done ? 0 : -5;
}

static int ids_of(cJSON *arr, int32_t *ids, int cap) {
    int n = 0;
    cJSON *x;
    cJSON_ArrayForEach(x, arr) if (n < cap) ids[n++] = x->valueint;
    return n;
}

/* `petrel generate` greedy ids after ids, with the LoRA adapter folder lora (or none): -1 when
 * PETREL_BIN is unset (the caller skips). */
static int generate_lora_ids(const char *ids, int n, const char *lora, int32_t *out) {
    const char *bin = getenv("PETREL_BIN");
    if (!bin) return -1;
    char cmd[4096], o[16384], e[4096];
    snprintf(cmd, sizeof cmd, "%s generate --model %s --ids %s -n %d%s%s", bin, test_data("trained"), ids, n, lora ? " --lora " : "", lora ? lora : "");
    if (test_sh(cmd, o, sizeof o, e, sizeof e) != 0) { test_fail(__FILE__, __LINE__, "generate failed: %s", e); return -2; }
    int k = 0;
    char *p = o, *q;
    for (long v; k < n && (v = strtol(p, &q, 10), q != p); p = q) out[k++] = (int32_t)v;
    return k;
}
static int generate_ids(const char *ids, int n, int32_t *out) { return generate_lora_ids(ids, n, NULL, out); }

TEST(serve, completions_greedy_equal_generate) {
    serve_opts o = {.parallel = 4};
    serve *sv = start(&o);
    if (!sv) return;
    int port = serve_port(sv);
    int32_t want[64];
    int nw = generate_ids("630,2095,482,1486", 24, want);
    if (nw == -1) { serve_stop(sv); serve_free(sv); test_skip("PETREL_BIN unset: no `petrel generate` to compare with"); return; }
    CHECK_EQ_INT(nw, 24);
    /* the prompt as ids, and as the text those ids are the tokens of */
    const char *bodies[2] = {
        "{\"prompt\":[630,2095,482,1486],\"max_tokens\":24,\"temperature\":0,\"ignore_eos\":true,\"return_token_ids\":true}",
        "{\"prompt\":\"The os module provides\",\"max_tokens\":24,\"temperature\":0,\"ignore_eos\":true,\"return_token_ids\":true,\"model\":\"petrel\"}"};
    for (int b = 0; b < 2; b++) {
        reply r;
        CHECK(http(port, "POST", "/v1/completions", NULL, bodies[b], &r) == 0);
        CHECK_EQ_INT(r.status, 200);
        CHECK(strcasestr(r.head, "content-type: application/json") != NULL);
        cJSON *j = json_of(&r);
        cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
        int32_t got[64], pids[16];
        int ng = ids_of(cJSON_GetObjectItem(c, "token_ids"), got, 64), np = ids_of(cJSON_GetObjectItem(j, "prompt_token_ids"), pids, 16);
        CHECK_EQ_INT(np, 4);
        CHECK(np == 4 && pids[0] == 630 && pids[1] == 2095 && pids[2] == 482 && pids[3] == 1486);
        CHECK_EQ_INT(ng, 24);
        for (int k = 0; k < ng && k < nw; k++) CHECK_MSG(got[k] == want[k], "body %d: id %d: %d != generate's %d", b, k, got[k], want[k]);
        CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(c, "finish_reason")), "length"));
        CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(j, "object")), "text_completion"));
        /* the text is the tokens' text */
        char *txt = NULL;
        size_t tl = 0;
        petrel_error e = {0};
        CHECK(tok_decode(g_tok, want, (size_t)nw, &txt, &tl, &e) == 0);
        const char *gt = cJSON_GetStringValue(cJSON_GetObjectItem(c, "text"));
        CHECK(gt && txt && !strcmp(gt, txt));
        free(txt);
        cJSON *u = cJSON_GetObjectItem(j, "usage");
        CHECK_EQ_INT(cJSON_GetObjectItem(u, "prompt_tokens")->valueint, 4);
        CHECK_EQ_INT(cJSON_GetObjectItem(u, "completion_tokens")->valueint, 24);
        CHECK_EQ_INT(cJSON_GetObjectItem(u, "total_tokens")->valueint, 28);
        cJSON_Delete(j);
        reply_free(&r);
    }
    serve_stop(sv);
    serve_free(sv);
}

#define N_CONC 8
static const char *conc_prompts[N_CONC] = {
    "The os module provides",
    "To read a file line by line,",
    "import sys",
    "The :func:`open` function returns a",
    "Exceptions",
    "A list comprehension consists of brackets containing an expression followed by a :keyword:`for` clause",
    "def",
    "The standard library"};

typedef struct conc_arg {
    int port, idx, chat;
    sse_out out;
    int status, rc;
} conc_arg;

static void conc_body(const conc_arg *a, char *body, size_t cap) {
    if (a->chat)
        snprintf(body, cap, "{\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],\"max_tokens\":%d,\"temperature\":0,\"stream\":true,"
                 "\"stream_options\":{\"include_usage\":true},\"return_token_ids\":true}", conc_prompts[a->idx], 12 + 3 * a->idx);
    else
        snprintf(body, cap, "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"stream\":true,\"stream_options\":{\"include_usage\":true},"
                 "\"return_token_ids\":true,\"ignore_eos\":true}", conc_prompts[a->idx], 16 + 5 * a->idx);
}

static void *conc_main(void *p) {
    conc_arg *a = p;
    char body[1024];
    conc_body(a, body, sizeof body);
    reply r;
    a->rc = http(a->port, "POST", a->chat ? "/v1/chat/completions" : "/v1/completions", NULL, body, &r);
    if (a->rc) return NULL;
    a->status = r.status;
    if (!strcasestr(r.head, "content-type: text/event-stream")) a->rc = -10;
    else a->rc = parse_sse(r.body, r.body_len, a->chat, &a->out);
    reply_free(&r);
    return NULL;
}

static long metric(int port, const char *name) {
    reply r;
    if (http(port, "GET", "/metrics", NULL, NULL, &r)) return -1;
    long v = -1;
    char key[128];
    snprintf(key, sizeof key, "\n%s ", name);
    char *p = strstr(r.body, key);
    if (p) v = strtol(p + strlen(key), NULL, 10);
    reply_free(&r);
    return v;
}

TEST(serve, concurrent_streams_equal_alone) {
    serve_opts o = {.parallel = 5}; /* 8 clients: 3 wait for a place */
    serve *sv = start(&o);
    if (!sv) return;
    int port = serve_port(sv);
    for (int chat = 0; chat < 2; chat++) {
        static conc_arg alone[N_CONC], conc[N_CONC];
        for (int i = 0; i < N_CONC; i++) { /* one at a time */
            alone[i] = (conc_arg){.port = port, .idx = i, .chat = chat};
            conc_main(&alone[i]);
            CHECK_MSG(alone[i].rc == 0 && alone[i].status == 200, "alone %d (chat %d): rc %d status %d", i, chat, alone[i].rc, alone[i].status);
        }
        long f0 = metric(port, "petrel_forwards_total"), r0 = metric(port, "petrel_batch_rows_total");
        pthread_t th[N_CONC];
        for (int i = 0; i < N_CONC; i++) {
            conc[i] = (conc_arg){.port = port, .idx = i, .chat = chat};
            pthread_create(&th[i], NULL, conc_main, &conc[i]);
        }
        for (int i = 0; i < N_CONC; i++) pthread_join(th[i], NULL);
        long f1 = metric(port, "petrel_forwards_total"), r1 = metric(port, "petrel_batch_rows_total");
        int decode_rows = 0;
        for (int i = 0; i < N_CONC; i++) {
            sse_out *a = &alone[i].out, *c = &conc[i].out;
            CHECK_MSG(conc[i].rc == 0 && conc[i].status == 200, "concurrent %d (chat %d): rc %d status %d", i, chat, conc[i].rc, conc[i].status);
            CHECK_MSG(a->n_ids == c->n_ids && !memcmp(a->ids, c->ids, sizeof(int32_t) * (size_t)a->n_ids), "stream %d (chat %d): ids differ from alone", i, chat);
            CHECK_MSG(!strcmp(a->text, c->text) && !strcmp(a->reasoning, c->reasoning), "stream %d (chat %d): text differs from alone", i, chat);
            CHECK_EQ_INT(c->completion_tokens, c->n_ids);
            CHECK(c->prompt_tokens > 0);
            CHECK(!strcmp(c->finish, "length") || !strcmp(c->finish, "stop"));
            if (!chat) CHECK_EQ_INT(c->n_ids, 16 + 5 * i);
            if (!chat) CHECK(!strcmp(c->finish, "length"));
            decode_rows += c->n_ids;
        }
        /* batched for real: fewer forwards than the requests' decode steps */
        CHECK_MSG(f1 - f0 < decode_rows && r1 - r0 > f1 - f0, "forwards %ld, rows %ld for %d tokens: not batched", f1 - f0, r1 - r0, decode_rows);
    }
    /* a completions stream of a prompt given as ids equals its JSON reply */
    serve_stop(sv);
    serve_free(sv);
}

TEST(serve, errors) {
    serve_opts o = {.parallel = 2, .ctx = 64, .max_body = 2048};
    serve *sv = start(&o);
    if (!sv) return;
    int p = serve_port(sv);
    const char *C = "/v1/completions", *CC = "/v1/chat/completions";
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\": \"x\",", 400, NULL, NULL);
    CHECK_ERROR(p, "POST", C, NULL, "", 400, NULL, NULL);
    CHECK_ERROR(p, "POST", C, NULL, "[1,2]", 400, NULL, NULL);
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\":\"x\"} trailing", 400, NULL, NULL);
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\":5}", 400, NULL, "prompt");
    CHECK_ERROR(p, "POST", C, NULL, "{}", 400, NULL, "prompt");
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\":\"x\",\"max_tokens\":\"3\"}", 400, NULL, "max_tokens");
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\":\"x\",\"max_tokens\":-1}", 400, NULL, "max_tokens");
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\":\"x\",\"max_tokens\":1.5}", 400, NULL, "max_tokens");
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\":\"x\",\"temperature\":-1}", 400, NULL, "temperature");
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\":\"x\",\"top_p\":0}", 400, NULL, "top_p");
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\":\"x\",\"stream\":1}", 400, NULL, "stream");
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\":\"x\",\"stop\":[1]}", 400, NULL, "stop");
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\":\"x\",\"n\":3}", 400, NULL, "n"); /* more choices than --parallel */
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\":[1,99999]}", 400, NULL, "prompt");
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\":[1,-2]}", 400, NULL, "prompt");
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\":\"x\",\"model\":\"gpt-4\"}", 404, "model_not_found", "model");
    CHECK_ERROR(p, "POST", CC, NULL, "{\"messages\":\"hi\"}", 400, NULL, "messages");
    CHECK_ERROR(p, "POST", CC, NULL, "{\"messages\":[]}", 400, NULL, "messages");
    CHECK_ERROR(p, "POST", CC, NULL, "{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", 400, NULL, "messages");
    CHECK_ERROR(p, "POST", CC, NULL, "{\"messages\":[{\"role\":\"user\",\"content\":7}]}", 400, NULL, "messages");
    /* a prompt longer than the context (64), and a prompt + max_tokens beyond it */
    char big[1024] = "{\"prompt\":[";
    for (int k = 0; k < 70; k++) strcat(big, k ? ",300" : "300");
    strcat(big, "]}");
    CHECK_ERROR(p, "POST", C, NULL, big, 400, "context_length_exceeded", "prompt");
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\":[300,301],\"max_tokens\":100}", 400, "context_length_exceeded", "max_tokens");
    /* over the body limit */
    char *huge = malloc(8192);
    memset(huge, ' ', 8191);
    huge[8191] = 0;
    memcpy(huge, "{\"prompt\":\"x\"", 13);
    huge[8190] = '}';
    CHECK_ERROR(p, "POST", C, NULL, huge, 413, "request_too_large", NULL);
    free(huge);
    CHECK_ERROR(p, "GET", C, NULL, NULL, 405, NULL, NULL);
    CHECK_ERROR(p, "GET", "/v1/nothing", NULL, NULL, 404, NULL, NULL);
    CHECK_ERROR(p, "POST", "/detokenize", NULL, "{\"tokens\":[\"a\"]}", 400, NULL, "tokens");
    /* still serving, and max_tokens 0 / the context exactly full are fine */
    reply r;
    CHECK(http(p, "POST", C, NULL, "{\"prompt\":[300,301],\"max_tokens\":0}", &r) == 0);
    CHECK_EQ_INT(r.status, 200);
    CHECK(strstr(r.body, "\"finish_reason\":\"length\"") && strstr(r.body, "\"completion_tokens\":0"));
    reply_free(&r);
    CHECK(http(p, "POST", C, NULL, "{\"prompt\":[300,301],\"max_tokens\":63,\"ignore_eos\":true,\"temperature\":0}", &r) == 0);
    CHECK_EQ_INT(r.status, 200);
    CHECK(strstr(r.body, "\"completion_tokens\":63") != NULL);
    reply_free(&r);
    serve_stop(sv);
    serve_free(sv);
}

TEST(serve, api_key) {
    serve_opts o = {.api_key = "sk-test-123"};
    serve *sv = start(&o);
    if (!sv) return;
    int p = serve_port(sv);
    reply r;
    CHECK(http(p, "GET", "/health", NULL, NULL, &r) == 0);
    CHECK_EQ_INT(r.status, 200);
    reply_free(&r);
    CHECK_ERROR(p, "GET", "/v1/models", NULL, NULL, 401, "invalid_api_key", NULL);
    CHECK_ERROR(p, "GET", "/v1/models", "Authorization: Bearer sk-test-12\r\n", NULL, 401, "invalid_api_key", NULL);
    CHECK_ERROR(p, "GET", "/v1/models", "Authorization: Bearer sk-test-1234\r\n", NULL, 401, "invalid_api_key", NULL);
    CHECK_ERROR(p, "GET", "/v1/models", "Authorization: sk-test-123\r\n", NULL, 401, "invalid_api_key", NULL);
    CHECK_ERROR(p, "POST", "/v1/completions", NULL, "{\"prompt\":\"x\"}", 401, "invalid_api_key", NULL);
    CHECK_ERROR(p, "GET", "/metrics", NULL, NULL, 401, "invalid_api_key", NULL);
    CHECK(http(p, "GET", "/v1/models", "Authorization: Bearer sk-test-123\r\n", NULL, &r) == 0);
    CHECK_EQ_INT(r.status, 200);
    CHECK(strstr(r.body, "\"object\":\"list\"") && strstr(r.body, "\"id\":\"petrel\""));
    reply_free(&r);
    serve_stop(sv);
    serve_free(sv);
}

TEST(serve, stop_strings_chat_tokenize) {
    serve_opts o = {0};
    serve *sv = start(&o);
    if (!sv) return;
    int p = serve_port(sv);
    reply r;
    /* the greedy text, then the same request stopping at a piece of it */
    CHECK(http(p, "POST", "/v1/completions", NULL, "{\"prompt\":\"The os module provides\",\"max_tokens\":24,\"temperature\":0,\"ignore_eos\":true}", &r) == 0);
    cJSON *j = json_of(&r);
    const char *full = cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "text"));
    CHECK(full && strlen(full) > 20);
    char stop[16] = "", body[512];
    if (full && strlen(full) > 20) memcpy(stop, full + 12, 5);
    cJSON *stop_j = cJSON_CreateString(stop);
    char *esc = cJSON_PrintUnformatted(stop_j);
    cJSON_Delete(stop_j);
    for (int s = 0; s < 2; s++) {
        snprintf(body, sizeof body, "{\"prompt\":\"The os module provides\",\"max_tokens\":24,\"temperature\":0,\"ignore_eos\":true,\"stop\":[%s],\"stream\":%s}",
                 esc, s ? "true" : "false");
        reply r2;
        CHECK(http(p, "POST", "/v1/completions", NULL, body, &r2) == 0);
        CHECK_EQ_INT(r2.status, 200);
        char text[16384] = "", fin[16] = "";
        if (s) {
            sse_out so;
            CHECK(parse_sse(r2.body, r2.body_len, 0, &so) == 0);
            snprintf(text, sizeof text, "%s", so.text);
            snprintf(fin, sizeof fin, "%s", so.finish);
        } else {
            cJSON *j2 = json_of(&r2), *c = cJSON_GetArrayItem(cJSON_GetObjectItem(j2, "choices"), 0);
            snprintf(text, sizeof text, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(c, "text")) ? cJSON_GetStringValue(cJSON_GetObjectItem(c, "text")) : "?");
            snprintf(fin, sizeof fin, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(c, "finish_reason")) ? cJSON_GetStringValue(cJSON_GetObjectItem(c, "finish_reason")) : "?");
            cJSON_Delete(j2);
        }
        const char *at = full ? strstr(full, stop) : NULL;
        CHECK_MSG(at && strlen(text) == (size_t)(at - full) && !strncmp(text, full, strlen(text)), "stream %d: stop at \"%s\": got \"%s\"", s, stop, text);
        CHECK_MSG(!strcmp(fin, "stop"), "finish %s", fin);
        reply_free(&r2);
    }
    free(esc);
    cJSON_Delete(j);
    reply_free(&r);
    /* chat, not streamed: an assistant message and usage */
    CHECK(http(p, "POST", "/v1/chat/completions", NULL,
               "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"What is os?\"}]}],"
               "\"max_tokens\":16,\"temperature\":0.7,\"seed\":3,\"chat_template_kwargs\":{\"enable_thinking\":false}}", &r) == 0);
    CHECK_EQ_INT(r.status, 200);
    j = json_of(&r);
    cJSON *m = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "message");
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(j, "object")) ? cJSON_GetStringValue(cJSON_GetObjectItem(j, "object")) : "", "chat.completion"));
    CHECK(cJSON_IsString(cJSON_GetObjectItem(m, "content")));
    CHECK(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "completion_tokens")->valueint <= 16);
    char *first = cJSON_PrintUnformatted(m);
    cJSON_Delete(j);
    reply_free(&r);
    /* the same seed gives the same reply */
    CHECK(http(p, "POST", "/v1/chat/completions", NULL,
               "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"What is os?\"}]}],"
               "\"max_tokens\":16,\"temperature\":0.7,\"seed\":3,\"chat_template_kwargs\":{\"enable_thinking\":false}}", &r) == 0);
    j = json_of(&r);
    char *second = cJSON_PrintUnformatted(cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "message"));
    CHECK(first && second && !strcmp(first, second));
    free(first);
    free(second);
    cJSON_Delete(j);
    reply_free(&r);
    /* tokenize / detokenize round trip */
    CHECK(http(p, "POST", "/tokenize", NULL, "{\"prompt\":\"The os module provides\"}", &r) == 0);
    CHECK(r.status == 200 && strstr(r.body, "\"tokens\":[630,2095,482,1486]"));
    reply_free(&r);
    CHECK(http(p, "POST", "/detokenize", NULL, "{\"tokens\":[630,2095,482,1486]}", &r) == 0);
    CHECK(r.status == 200 && strstr(r.body, "\"prompt\":\"The os module provides\""));
    reply_free(&r);
    serve_stop(sv);
    serve_free(sv);
}

TEST(serve, disconnect_frees_place) {
    serve_opts o = {.parallel = 1};
    serve *sv = start(&o);
    if (!sv) return;
    int p = serve_port(sv);
    const char *body = "{\"prompt\":\"The os module provides\",\"max_tokens\":1000,\"temperature\":0,\"ignore_eos\":true,\"stream\":true}";
    int fd = connect_to(p);
    CHECK(fd >= 0 && send_req(fd, "POST", "/v1/completions", NULL, body, strlen(body)) == 0);
    char buf[256];
    CHECK(recv(fd, buf, sizeof buf, 0) > 0); /* it is streaming */
    close(fd);
    /* with one place, the next request runs only once the first is dropped */
    reply r;
    CHECK(http(p, "POST", "/v1/completions", NULL, "{\"prompt\":[300,301],\"max_tokens\":4,\"temperature\":0}", &r) == 0);
    CHECK_EQ_INT(r.status, 200);
    reply_free(&r);
    long gen = metric(p, "petrel_generation_tokens_total");
    CHECK_MSG(gen < 1000, "the dropped stream ran to its end (%ld tokens)", gen);
    /* the same for a request that is not streamed: its client closes while it waits */
    const char *body2 = "{\"prompt\":\"The os module provides\",\"max_tokens\":1000,\"temperature\":0,\"ignore_eos\":true}";
    fd = connect_to(p);
    CHECK(fd >= 0 && send_req(fd, "POST", "/v1/completions", NULL, body2, strlen(body2)) == 0);
    usleep(20000);
    close(fd);
    CHECK(http(p, "POST", "/v1/completions", NULL, "{\"prompt\":[300,301],\"max_tokens\":4,\"temperature\":0}", &r) == 0);
    CHECK_EQ_INT(r.status, 200);
    reply_free(&r);
    long gen2 = metric(p, "petrel_generation_tokens_total");
    CHECK_MSG(gen2 - gen < 1000, "the dropped request ran to its end (%ld tokens)", gen2 - gen);
    long running = -1;
    for (int t = 0; t < 100 && running != 0; t++) { /* dropped at the scheduler's next step */
        running = metric(p, "petrel_running_sequences");
        if (running) usleep(10000);
    }
    CHECK_EQ_INT(running, 0);
    serve_stop(sv);
    serve_free(sv);
}

TEST(serve, request_parser) {
    serve_request r;
    char param[64];
    petrel_error e = {0};
    CHECK(serve_request_parse("{\"prompt\":\"hi\",\"max_tokens\":5,\"temperature\":0.5,\"top_k\":3,\"seed\":7,\"stop\":\"x\"}", strlen("{\"prompt\":\"hi\",\"max_tokens\":5,\"temperature\":0.5,\"top_k\":3,\"seed\":7,\"stop\":\"x\"}"), 0, &r, param, &e) == 0);
    CHECK(r.prompt && !strcmp(r.prompt, "hi") && r.max_tokens == 5 && r.sp.top_k == 3 && r.seed_set && r.sp.seed == 7 && r.n_stop == 1);
    serve_request_free(&r);
    CHECK(serve_request_parse("{\"messages\":[{\"role\":\"developer\",\"content\":null}],\"max_completion_tokens\":9}", strlen("{\"messages\":[{\"role\":\"developer\",\"content\":null}],\"max_completion_tokens\":9}"), 1, &r, param, &e) == 0);
    CHECK(r.messages && r.max_tokens == 9);
    serve_request_free(&r);
    CHECK(serve_request_parse("{\"prompt\":\"hi\",\"temperature\":1e999}", strlen("{\"prompt\":\"hi\",\"temperature\":1e999}"), 0, &r, param, &e) != 0);
    CHECK(!strcmp(param, "temperature"));
    CHECK(serve_request_parse("{\"prompt\":\"hi\",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}", strlen("{\"prompt\":\"hi\",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}"), 0, &r, param, &e) != 0);
    CHECK(serve_request_parse(NULL, 0, 0, &r, param, &e) != 0);
}

/* $PETREL_BIN serve with the given arguments (argv[0] is the binary, NULL-terminated) as a child
 * whose stdout is a pipe: the port from its URL line (0 when none came), *pid and *fd to stop it. */
static int spawn_serve(char *const *argv, pid_t *pid, int *fd) {
    int pfd[2];
    *pid = -1;
    *fd = -1;
    if (pipe(pfd)) { test_fail(__FILE__, __LINE__, "pipe"); return 0; }
    *pid = fork();
    if (*pid == 0) {
        dup2(pfd[1], 1);
        close(pfd[0]);
        execv(argv[0], argv);
        _exit(127);
    }
    close(pfd[1]);
    *fd = pfd[0];
    char line[512] = "";
    size_t n = 0;
    while (n < sizeof line - 1 && read(pfd[0], line + n, 1) == 1 && line[n] != '\n') n++;
    line[n] = 0;
    char *u = strstr(line, "http://127.0.0.1:");
    int port = u ? atoi(u + 17) : 0;
    CHECK_MSG(port > 0, "no URL line: \"%s\"", line);
    return port;
}

/* SIGTERM to a spawned server: it must exit with status 0. */
static void stop_serve(pid_t pid, int fd) {
    if (pid > 0) {
        kill(pid, SIGTERM);
        int st = 0;
        waitpid(pid, &st, 0);
        CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status %d", st);
    }
    if (fd >= 0) close(fd);
}

/* $PETREL_BIN serve: the URL line when ready, then SIGTERM exits with status 0. */
TEST(serve, cli_sigterm) {
    const char *bin = getenv("PETREL_BIN");
    if (!bin) { test_skip("PETREL_BIN unset (make test sets it)"); return; }
    char *const argv[] = {(char *)bin, "serve", "--model", (char *)test_data("trained"), "--port", "0", "--api-key", "k", NULL};
    pid_t pid;
    int fd;
    int port = spawn_serve(argv, &pid, &fd);
    if (port > 0) {
        reply r;
        CHECK(http(port, "GET", "/health", NULL, NULL, &r) == 0 && r.status == 200);
        reply_free(&r);
        CHECK_ERROR(port, "GET", "/v1/models", NULL, NULL, 401, "invalid_api_key", NULL);
    }
    stop_serve(pid, fd);
}

/* The official `openai` npm package (tests/node, installed by make deps) against the server. */
TEST(serve, openai_npm_client) {
    char o[16384], e[4096];
    if (test_sh("command -v node", o, sizeof o, e, sizeof e) != 0) { test_skip("node is not installed: the openai npm client test needs it"); return; }
    char mod[4200];
    snprintf(mod, sizeof mod, "%s/../node/node_modules/openai/package.json", test_data(""));
    if (access(mod, R_OK)) { test_skip("tests/node/node_modules/openai is missing (make deps installs it with npm)"); return; }
    serve_opts so = {.api_key = "sk-npm", .ctx = 1024};
    serve *sv = start(&so);
    if (!sv) return;
    serve_opts to = {.api_key = "sk-npm", .ctx = 1024,
                     .force_answer = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call><|observation|>"};
    serve *tv = start(&to);
    if (!tv) { serve_stop(sv); serve_free(sv); return; }
    char cmd[4400];
    snprintf(cmd, sizeof cmd, "node %s/../node/openai_client.mjs %d sk-npm %d", test_data(""), serve_port(sv), serve_port(tv));
    int rc = test_sh(cmd, o, sizeof o, e, sizeof e);
    CHECK_MSG(rc == 0 && strstr(o, "all ok"), "openai client (rc %d):\n%s%s", rc, o, e);
    serve_stop(tv);
    serve_free(tv);
    serve_stop(sv);
    serve_free(sv);
}

/* A long prompt's prefill is covered by ": keep-alive" comments (here every millisecond), and
 * the stream is still framed exactly; /metrics is Prometheus text. */
TEST(serve, keepalive_and_metrics) {
    serve_opts o = {.keepalive_ms = 1, .max_rows = 64}; /* 64-row chunks: many forwards before the first token */
    serve *sv = start(&o);
    if (!sv) return;
    int p = serve_port(sv);
    char *body = malloc(16384);
    strcpy(body, "{\"prompt\":[");
    for (int k = 0; k < 1000; k++) sprintf(body + strlen(body), k ? ",%d" : "%d", 300 + k % 500);
    strcat(body, "],\"max_tokens\":4,\"temperature\":0,\"ignore_eos\":true,\"stream\":true,\"return_token_ids\":true}");
    reply r;
    CHECK(http(p, "POST", "/v1/completions", NULL, body, &r) == 0);
    CHECK_EQ_INT(r.status, 200);
    sse_out so;
    CHECK(parse_sse(r.body, r.body_len, 0, &so) == 0);
    CHECK_EQ_INT(so.n_ids, 4);
    CHECK_MSG(!strncmp(r.body, ": keep-alive\n\n", 14), "no keep-alive before the first token: %.80s", r.body);
    reply_free(&r);
    /* the same prompt again takes its whole pages from the prefix cache: same tokens */
    char *body2 = malloc(16384), *at = strstr(body, "\"stream\":true");
    snprintf(body2, 16384, "%.*s\"stream\":false%s", (int)(at - body), body, at + 13);
    CHECK(http(p, "POST", "/v1/completions", NULL, body2, &r) == 0);
    free(body2);
    CHECK_EQ_INT(r.status, 200);
    cJSON *j = json_of(&r);
    int32_t ids2[8];
    int n2 = ids_of(cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "token_ids"), ids2, 8);
    CHECK(n2 == 4 && !memcmp(ids2, so.ids, sizeof(int32_t) * 4));
    cJSON *ct = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "prompt_tokens_details"), "cached_tokens");
    CHECK_MSG(cJSON_IsNumber(ct) && ct->valueint == 960, "cached tokens: %s", r.body); /* 15 whole pages of 64 of 999 */
    cJSON_Delete(j);
    reply_free(&r);
    free(body);
    CHECK(http(p, "GET", "/metrics", NULL, NULL, &r) == 0);
    CHECK(r.status == 200 && strcasestr(r.head, "content-type: text/plain"));
    CHECK(strstr(r.body, "# TYPE petrel_generation_tokens_total counter\npetrel_generation_tokens_total 8\n") != NULL);
    CHECK(strstr(r.body, "petrel_prompt_tokens_total 2000\n") != NULL);
    CHECK(strstr(r.body, "petrel_time_to_first_token_seconds_count 2\n") != NULL);
    CHECK(strstr(r.body, "# TYPE petrel_inter_token_latency_seconds histogram\n") && strstr(r.body, "petrel_inter_token_latency_seconds_count 6\n")); /* 3 gaps a request */
    CHECK(strstr(r.body, "# TYPE petrel_batch_rows histogram\n") && strstr(r.body, "petrel_batch_rows_bucket{le=\"64\"} "));
    CHECK(metric(p, "petrel_batch_rows_count") == metric(p, "petrel_forwards_total") && metric(p, "petrel_batch_rows_sum") == metric(p, "petrel_batch_rows_total"));
    /* nothing running: the last request's session is freed right after its reply is sent, so a
     * loaded machine may still see its pages for a moment */
    long in_use = -1;
    for (int i = 0; i < 200 && (in_use = metric(p, "petrel_kv_pages_in_use")) != 0; i++) usleep(10000);
    CHECK_MSG(metric(p, "petrel_kv_pages_total") > 0 && in_use == 0, "kv pages in use: %ld", in_use);
    CHECK(strstr(r.body, "\npetrel_expert_hit_rate ") && strstr(r.body, "\npetrel_disk_read_bytes_total 0\n")); /* resident: no reads */
    reply_free(&r);
    serve_stop(sv);
    serve_free(sv);
}

typedef struct fail_arg { int port; const char *body; int status; char text[512]; } fail_arg;
static void *fail_main(void *p) {
    fail_arg *a = p;
    reply r;
    if (http(a->port, "POST", "/v1/completions", NULL, a->body, &r) == 0) {
        a->status = r.status;
        snprintf(a->text, sizeof a->text, "%s", r.body);
        reply_free(&r);
    }
    return NULL;
}

/* A request whose forward fails (here: a KV pool too small for its prompt) ends with an error
 * body; the requests sharing its batch still get their tokens, and the server keeps serving. */
TEST(serve, failed_request_spares_others) {
    if (fixture()) return;
    petrel_engine *eng = NULL;
    petrel_error err = {0};
    petrel_open_opts oo = {.kv_bytes = 1u << 20}; /* 4 pages of 64 positions on this fixture */
    if (petrel_engine_open(test_data("trained"), &oo, &eng, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    serve_opts o = {.parallel = 4};
    serve *sv = NULL;
    if (serve_start(eng, g_tok, g_tmpl, &o, &sv, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); petrel_engine_close(eng); return; }
    int p = serve_port(sv);
    char *big = malloc(16384);
    strcpy(big, "{\"prompt\":[");
    for (int k = 0; k < 900; k++) sprintf(big + strlen(big), k ? ",%d" : "%d", 300 + k % 500);
    strcat(big, "],\"max_tokens\":4,\"temperature\":0}");
    const char *small = "{\"prompt\":[630,2095,482,1486],\"max_tokens\":8,\"temperature\":0,\"ignore_eos\":true}";
    fail_arg a[3] = {{p, big, 0, ""}, {p, small, 0, ""}, {p, small, 0, ""}};
    pthread_t th[3];
    for (int i = 0; i < 3; i++) pthread_create(&th[i], NULL, fail_main, &a[i]);
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    CHECK_MSG(a[0].status == 503 && strstr(a[0].text, "\"error\"") && strstr(a[0].text, "KV pool"), "long prompt: %d %s", a[0].status, a[0].text);
    for (int i = 1; i < 3; i++) CHECK_MSG(a[i].status == 200 && strstr(a[i].text, "\"completion_tokens\":8"), "short %d: %d %s", i, a[i].status, a[i].text);
    fail_main(&a[1]);
    CHECK_EQ_INT(a[1].status, 200);
    free(big);
    serve_stop(sv);
    serve_free(sv);
    petrel_engine_close(eng);
}

/* Admission from the KV pool: three requests that each fit the small pool but not together
 * wait their turn and all finish; one that can never fit is refused at once with the numbers. */
TEST(serve, kv_admission_queues) {
    if (fixture()) return;
    petrel_engine *eng = NULL;
    petrel_error err = {0};
    petrel_open_opts oo = {.kv_bytes = 1u << 20}; /* 4 pages of 64 positions on this fixture */
    if (petrel_engine_open(test_data("trained"), &oo, &eng, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    long long fr = 0, tot = 0;
    int pp = 0;
    petrel_kv_usage(eng, &fr, &tot, &pp);
    CHECK(tot >= 3 * 64 && tot < 9 * 64 && pp == 64); /* room for one or two of the requests below, not three */
    serve_opts o = {.parallel = 4};
    serve *sv = NULL;
    if (serve_start(eng, g_tok, g_tmpl, &o, &sv, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); petrel_engine_close(eng); return; }
    int p = serve_port(sv);
    static char mid[3][4096], huge[8192];
    for (int r = 0; r < 3; r++) { /* 100-token prompts + 40 tokens: 3 pages each */
        strcpy(mid[r], "{\"prompt\":[");
        for (int k = 0; k < 100; k++) sprintf(mid[r] + strlen(mid[r]), k ? ",%d" : "%d", 200 + (k * 7 + r * 13) % 900);
        strcat(mid[r], "],\"max_tokens\":40,\"temperature\":0,\"ignore_eos\":true}");
    }
    snprintf(huge, sizeof huge, "{\"prompt\":[1,2,3],\"max_tokens\":%lld,\"temperature\":0}", tot + 100);
    fail_arg a[4] = {{p, mid[0], 0, ""}, {p, mid[1], 0, ""}, {p, mid[2], 0, ""}, {p, huge, 0, ""}};
    pthread_t th[4];
    for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, fail_main, &a[i]);
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 3; i++) CHECK_MSG(a[i].status == 200 && strstr(a[i].text, "\"completion_tokens\":40"), "request %d: %d %s", i, a[i].status, a[i].text);
    char want[64];
    snprintf(want, sizeof want, "KV pool holds %lld", tot);
    CHECK_MSG(a[3].status == 503 && strstr(a[3].text, want), "never-fitting request: %d %s", a[3].status, a[3].text);
    serve_stop(sv);
    serve_free(sv);
    petrel_engine_close(eng);
}

/* ---------- tools, logprobs, n > 1 ---------- */

typedef struct tc_sink { char text[4096]; char calls[8][2][512]; int n_calls; } tc_sink;
static void sink_text(void *u, const char *b, size_t n) { tc_sink *s = u; strncat(s->text, b, n < sizeof s->text - strlen(s->text) - 1 ? n : sizeof s->text - strlen(s->text) - 1); }
static void sink_call(void *u, const char *name, const char *args) {
    tc_sink *s = u;
    if (s->n_calls < 8) snprintf(s->calls[s->n_calls][0], 512, "%s", name), snprintf(s->calls[s->n_calls][1], 512, "%s", args), s->n_calls++;
}
/* The text fed in pieces of `step` bytes (0: every split point once, checked equal). */
static void tc_run(const char *in, const cJSON *tools, size_t step, tc_sink *out) {
    memset(out, 0, sizeof *out);
    tc_parser p;
    tc_init(&p, tools);
    size_t n = strlen(in);
    for (size_t o = 0; o < n; o += step) tc_feed(&p, in + o, o + step > n ? n - o : step, sink_text, sink_call, out);
    tc_flush(&p, sink_text, out);
    tc_free(&p);
}

/* The parser inverts the template's rendering of tool calls: names, string values as written,
 * other values as JSON, the schema's "string" keeping "3" a string; text around blocks passes;
 * a block that does not parse, or is left open, comes back as text; any split of the input
 * gives the same result. */
TEST(serve, toolcall_parser) {
    cJSON *tools = cJSON_Parse("[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","
                               "\"properties\":{\"city\":{\"type\":\"string\"},\"zip\":{\"type\":\"string\"},\"days\":{\"type\":\"integer\"}}}}}]");
    static const struct { const char *in, *text; int n; const char *name0, *args0, *name1, *args1; } cases[] = {
        {"<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value>"
         "<arg_key>zip</arg_key><arg_value>75001</arg_value><arg_key>opts</arg_key><arg_value>{\"u\": \"C\", \"l\": [1, true, null]}</arg_value></tool_call>",
         "", 1, "get_weather", "{\"city\":\"Paris\",\"days\":3,\"zip\":\"75001\",\"opts\":{\"u\":\"C\",\"l\":[1,true,null]}}", NULL, NULL},
        {"Let me look.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n</tool_call><tool_call>now</tool_call>after",
         "Let me look.after", 2, "get_weather", "{\"city\":\"New York\"}", "now", "{}"},
        {"no calls < here <tool_ and <tool_cal", "no calls < here <tool_ and <tool_cal", 0, NULL, NULL, NULL, NULL},
        {"x<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>y", "x<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>y", 0, NULL, NULL, NULL, NULL},
        {"<tool_call>f<arg_key>a</arg_key>junk<arg_value>1</arg_value></tool_call>", "<tool_call>f<arg_key>a</arg_key>junk<arg_value>1</arg_value></tool_call>", 0, NULL, NULL, NULL, NULL},
        {"<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>", "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>", 0, NULL, NULL, NULL, NULL},
        {"<tool_call>f<arg_key>s</arg_key><arg_value>two words, \"quoted\"</arg_value><arg_key>s</arg_key><arg_value>-1.5e3</arg_value></tool_call>", "", 1, "f",
         "{\"s\":-1500}", NULL, NULL},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (size_t step = 1; step <= strlen(cases[c].in); step += step < 4 ? 1 : 7) {
            tc_sink s;
            tc_run(cases[c].in, tools, step, &s);
            CHECK_MSG(!strcmp(s.text, cases[c].text), "case %zu step %zu: text \"%s\"", c, step, s.text);
            CHECK_MSG(s.n_calls == cases[c].n, "case %zu step %zu: %d calls", c, step, s.n_calls);
            if (s.n_calls >= 1 && cases[c].n >= 1)
                CHECK_MSG(!strcmp(s.calls[0][0], cases[c].name0) && !strcmp(s.calls[0][1], cases[c].args0), "case %zu: call 0 %s %s", c, s.calls[0][0], s.calls[0][1]);
            if (s.n_calls >= 2 && cases[c].n >= 2)
                CHECK_MSG(!strcmp(s.calls[1][0], cases[c].name1) && !strcmp(s.calls[1][1], cases[c].args1), "case %zu: call 1 %s %s", c, s.calls[1][0], s.calls[1][1]);
        }
    /* what the template renders for a history's tool call parses back to the same call */
    cJSON *vars = cJSON_Parse("{\"messages\":[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"function\":"
                              "{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\",\"days\":3,\"zip\":\"75001\",\"x\":[1,{\"y\":false}]}}}]}]}");
    cJSON_AddItemReferenceToObject(vars, "tools", tools);
    char *txt = NULL;
    petrel_error e = {0};
    if (fixture() == 0 && jinja_render_compiled(g_tmpl, vars, NULL, &txt, NULL, &e) == 0) {
        const char *a = strstr(txt, "<|assistant|><think></think>");
        CHECK(a != NULL);
        tc_sink s;
        if (a) tc_run(a + strlen("<|assistant|><think></think>"), tools, 3, &s);
        CHECK_MSG(a && s.n_calls == 1 && !strcmp(s.calls[0][0], "get_weather") && !strcmp(s.calls[0][1], "{\"city\":\"Paris\",\"days\":3,\"zip\":\"75001\",\"x\":[1,{\"y\":false}]}") &&
                      !strcmp(s.text, ""),
                  "rendered history: \"%s\" -> %d calls, text \"%s\"", a ? a : "", s.n_calls, s.text);
    } else
        test_fail(__FILE__, __LINE__, "render: %s", e.msg);
    free(txt);
    cJSON_Delete(vars);
    cJSON_Delete(tools);
}

static int parse_ok(const char *b, int chat, serve_request *r) {
    char param[64];
    petrel_error e = {0};
    return serve_request_parse(b, strlen(b), chat, r, param, &e);
}
static void parse_bad(const char *b, int chat, const char *want_param, int line) {
    serve_request r;
    char param[64] = "?";
    petrel_error e = {0};
    if (serve_request_parse(b, strlen(b), chat, &r, param, &e) == 0) { test_fail(__FILE__, line, "accepted: %s", b); serve_request_free(&r); return; }
    if (!e.msg[0] || strcmp(param, want_param)) test_fail(__FILE__, line, "param \"%s\" (want \"%s\"), message \"%s\"", param, want_param, e.msg);
}
#define PARSE_BAD(b, chat, p) parse_bad(b, chat, p, __LINE__)

TEST(serve, request_tools_logprobs_n) {
    serve_request r;
    const char *T = "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\"}}}]";
    char b[1024];
    snprintf(b, sizeof b, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\","
             "\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\": 1}\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"ok\"}],%s,"
             "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"f\"}},\"n\":3,\"logprobs\":true,\"top_logprobs\":5,\"parallel_tool_calls\":false}", T);
    CHECK(parse_ok(b, 1, &r) == 0);
    CHECK(r.tools && cJSON_GetArraySize(r.tools) == 1 && r.tool_choice == SERVE_TOOLS_NAMED && r.tool_name && !strcmp(r.tool_name, "f"));
    CHECK(r.n == 3 && r.logprobs == 1 && r.top_logprobs == 5);
    cJSON *args = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(cJSON_GetArrayItem(r.messages, 1), "tool_calls"), 0), "function"), "arguments");
    CHECK(cJSON_IsObject(args) && cJSON_GetObjectItem(args, "a") && cJSON_GetObjectItem(args, "a")->valueint == 1);
    serve_request_free(&r);
    CHECK(parse_ok("{\"prompt\":\"x\",\"logprobs\":3}", 0, &r) == 0 && r.logprobs == 1 && r.top_logprobs == 3);
    serve_request_free(&r);
    CHECK(parse_ok("{\"prompt\":\"x\",\"logprobs\":null,\"n\":1}", 0, &r) == 0 && r.logprobs == 0);
    serve_request_free(&r);
    CHECK(parse_ok("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[],\"tool_choice\":\"auto\"}", 1, &r) == 0 && !r.tools && r.tool_choice == SERVE_TOOLS_NONE);
    serve_request_free(&r);
    const char *M = "\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]";
    static const struct { const char *tail; const char *param; } bad[] = {
        {",\"n\":0", "n"}, {",\"n\":129", "n"}, {",\"n\":1.5", "n"}, {",\"logprobs\":1", "logprobs"}, {",\"top_logprobs\":3", "top_logprobs"},
        {",\"logprobs\":true,\"top_logprobs\":21", "top_logprobs"}, {",\"tools\":{}", "tools"}, {",\"tools\":[{\"type\":\"x\"}]", "tools"},
        {",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"\"}}]", "tools"}, {",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":[]}}]", "tools"},
        {",\"tool_choice\":\"required\"", "tool_choice"}, {",\"tool_choice\":\"maybe\"", "tool_choice"}, {",\"tool_choice\":7", "tool_choice"},
        {",\"parallel_tool_calls\":1", "parallel_tool_calls"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        snprintf(b, sizeof b, "{%s%s}", M, bad[k].tail);
        parse_bad(b, 1, bad[k].param, __LINE__);
    }
    snprintf(b, sizeof b, "{%s,%s,\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"g\"}}}", M, T);
    PARSE_BAD(b, 1, "tool_choice");
    PARSE_BAD("{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":\"[1]\"}}]}]}", 1, "messages");
    PARSE_BAD("{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":\"{bad\"}}]}]}", 1, "messages");
    PARSE_BAD("{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"arguments\":\"{}\"}}]}]}", 1, "messages");
    PARSE_BAD("{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":{}}]}", 1, "messages");
    PARSE_BAD("{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"tool_calls\":[{\"function\":{\"name\":\"f\"}}]}]}", 1, "messages");
    PARSE_BAD("{\"messages\":[{\"role\":\"tool\",\"content\":\"x\",\"tool_call_id\":5}]}", 1, "messages");
    PARSE_BAD("{\"prompt\":\"x\",\"logprobs\":true}", 0, "logprobs");
    PARSE_BAD("{\"prompt\":\"x\",\"logprobs\":-1}", 0, "logprobs");
    PARSE_BAD("{\"prompt\":\"x\",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]}", 0, "tools");
    CHECK(parse_ok("{\"prompt\":\"x\",\"tools\":[]}", 0, &r) == 0 && !r.tools); /* an empty list is no tools */
    serve_request_free(&r);
}

static const char *WEATHER_TOOLS = "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather\",\"parameters\":{\"type\":\"object\","
                                   "\"properties\":{\"city\":{\"type\":\"string\"},\"days\":{\"type\":\"integer\"}}}}}]";

/* Tools end to end: a history with tool calls (arguments as JSON text) and tool results is
 * rendered as the template renders the same history with argument objects; the answer's
 * tool-call markup (forced through the test seam) comes back as tool_calls with finish_reason
 * "tool_calls", in JSON and as SSE deltas; tool_choice required / named make the answer begin
 * with "<tool_call>" / "<tool_call>NAME"; tool_choice none renders no tools. */
TEST(serve, tools_end_to_end) {
    serve_opts o = {.parallel = 4};
    serve *sv = start(&o);
    if (!sv) return;
    int p = serve_port(sv);
    char body[4096];
    const char *hist = "[{\"role\":\"user\",\"content\":\"Weather in Paris?\"},{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\","
                       "\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"Paris\\\", \\\"days\\\": 2}\"}}]},"
                       "{\"role\":\"tool\",\"tool_call_id\":\"call_1\",\"content\":\"sunny, 21 C\"},{\"role\":\"user\",\"content\":\"And tomorrow?\"}]";
    snprintf(body, sizeof body, "{\"messages\":%s,\"tools\":%s,\"max_tokens\":0,\"return_token_ids\":true}", hist, WEATHER_TOOLS);
    reply r;
    CHECK(http(p, "POST", "/v1/chat/completions", NULL, body, &r) == 0);
    CHECK_EQ_INT(r.status, 200);
    cJSON *j = json_of(&r);
    static int32_t got[4096];
    int ng = ids_of(cJSON_GetObjectItem(j, "prompt_token_ids"), got, 4096);
    cJSON_Delete(j);
    reply_free(&r);
    /* the expected prompt: the same history with the arguments as an object */
    cJSON *vars = cJSON_CreateObject(), *msgs = cJSON_Parse(hist);
    cJSON *fn = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(cJSON_GetArrayItem(msgs, 1), "tool_calls"), 0), "function");
    cJSON_ReplaceItemInObject(fn, "arguments", cJSON_Parse("{\"city\": \"Paris\", \"days\": 2}"));
    cJSON_AddItemToObject(vars, "messages", msgs);
    cJSON_AddItemToObject(vars, "tools", cJSON_Parse(WEATHER_TOOLS));
    cJSON_AddBoolToObject(vars, "add_generation_prompt", 1);
    char *txt = NULL;
    size_t tl = 0;
    petrel_error e = {0};
    int32_t *want = NULL;
    size_t nw = 0;
    CHECK(jinja_render_compiled(g_tmpl, vars, NULL, &txt, &tl, &e) == 0 && tok_encode(g_tok, txt, tl, &want, &nw, &e) == 0);
    CHECK_MSG(txt && strstr(txt, "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
                                 "<|observation|><tool_response>sunny, 21 C</tool_response><|user|>And tomorrow?") &&
                  strstr(txt, "<tools>\n{\"name\": \"get_weather\""),
              "rendered: %s", txt ? txt : "");
    CHECK_MSG(ng == (int)nw && want && !memcmp(got, want, sizeof(int32_t) * nw), "prompt ids: %d vs %zu", ng, nw);
    free(txt);
    free(want);
    cJSON_Delete(vars);
    /* tool_choice none: the same request renders no tools */
    snprintf(body, sizeof body, "{\"messages\":%s,\"tools\":%s,\"tool_choice\":\"none\",\"max_tokens\":0}", hist, WEATHER_TOOLS);
    CHECK(http(p, "POST", "/v1/chat/completions", NULL, body, &r) == 0);
    j = json_of(&r);
    int pt = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "prompt_tokens") ? cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "prompt_tokens")->valueint : 0;
    CHECK_MSG(pt > 0 && pt < ng - 50, "tool_choice none: %d prompt tokens vs %d with tools", pt, ng);
    cJSON_Delete(j);
    reply_free(&r);
    /* required and named: the answer begins with the call's markup (here the model goes on
     * with documentation text, so the unclosed block comes back as content) */
    for (int named = 0; named < 2; named++) {
        snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"Weather?\"}],\"tools\":%s,\"tool_choice\":%s,\"max_tokens\":6,\"temperature\":0,"
                 "\"chat_template_kwargs\":{\"enable_thinking\":false}}", WEATHER_TOOLS, named ? "{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}" : "\"required\"");
        CHECK(http(p, "POST", "/v1/chat/completions", NULL, body, &r) == 0);
        CHECK_EQ_INT(r.status, 200);
        j = json_of(&r);
        cJSON *m = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "message");
        const char *ct = cJSON_GetStringValue(cJSON_GetObjectItem(m, "content"));
        cJSON *tcs = cJSON_GetObjectItem(m, "tool_calls");
        const char *nm = cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetArrayItem(tcs, 0), "function"), "name"));
        CHECK_MSG((ct && !strncmp(ct, named ? "<tool_call>get_weather" : "<tool_call>", named ? 22 : 11)) || (nm && (!named || !strncmp(nm, "get_weather", 11))),
                  "named %d: %s", named, r.body);
        cJSON_Delete(j);
        reply_free(&r);
    }
    serve_stop(sv);
    serve_free(sv);
    /* the model's answer as tool-call markup (forced by the test seam), ended by <|observation|> */
    serve_opts o2 = {.parallel = 4, .force_answer = "I will check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
                                                   "<arg_value>3</arg_value></tool_call><tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call><|observation|>"};
    sv = start(&o2);
    if (!sv) return;
    p = serve_port(sv);
    for (int s = 0; s < 2; s++) {
        snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"Weather?\"}],\"tools\":%s,\"max_tokens\":100,\"temperature\":0,\"stream\":%s,"
                 "\"stream_options\":{\"include_usage\":true},\"chat_template_kwargs\":{\"enable_thinking\":false}}", WEATHER_TOOLS, s ? "true" : "false");
        CHECK(http(p, "POST", "/v1/chat/completions", NULL, body, &r) == 0);
        CHECK_EQ_INT(r.status, 200);
        char names[2][64] = {"", ""}, args[2][256] = {"", ""}, ids[2][64] = {"", ""}, content[256] = "", finish[32] = "";
        int ncalls = 0;
        if (!s) {
            j = json_of(&r);
            cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), *m = cJSON_GetObjectItem(c, "message"), *x;
            snprintf(finish, sizeof finish, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(c, "finish_reason")) ? cJSON_GetStringValue(cJSON_GetObjectItem(c, "finish_reason")) : "");
            snprintf(content, sizeof content, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(m, "content")) ? cJSON_GetStringValue(cJSON_GetObjectItem(m, "content")) : "(null)");
            cJSON_ArrayForEach(x, cJSON_GetObjectItem(m, "tool_calls")) if (ncalls < 2) {
                cJSON *f = cJSON_GetObjectItem(x, "function");
                snprintf(names[ncalls], 64, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(f, "name")));
                snprintf(args[ncalls], 256, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(f, "arguments")));
                snprintf(ids[ncalls], 64, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(x, "id")));
                CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(x, "type")), "function"));
                ncalls++;
            }
            cJSON_Delete(j);
        } else { /* SSE: each call arrives whole in one delta, with its index, id and type */
            CHECK(strstr(r.body, "data: [DONE]\n\n") != NULL);
            for (char *q = r.body; (q = strstr(q, "data: {")) != NULL; q += 6) {
                char *end = strstr(q, "\n\n");
                cJSON *ev = cJSON_ParseWithLength(q + 6, (size_t)(end - q - 6)), *c = cJSON_GetArrayItem(cJSON_GetObjectItem(ev, "choices"), 0);
                cJSON *d = cJSON_GetObjectItem(c, "delta"), *x;
                const char *f = cJSON_GetStringValue(cJSON_GetObjectItem(c, "finish_reason"));
                if (f) snprintf(finish, sizeof finish, "%s", f);
                if (cJSON_GetStringValue(cJSON_GetObjectItem(d, "content"))) strncat(content, cJSON_GetStringValue(cJSON_GetObjectItem(d, "content")), 100);
                cJSON_ArrayForEach(x, cJSON_GetObjectItem(d, "tool_calls")) {
                    int ix = cJSON_GetObjectItem(x, "index") ? cJSON_GetObjectItem(x, "index")->valueint : -1;
                    CHECK_EQ_INT(ix, ncalls);
                    if (ncalls < 2 && ix == ncalls) {
                        cJSON *fn2 = cJSON_GetObjectItem(x, "function");
                        snprintf(names[ncalls], 64, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(fn2, "name")));
                        snprintf(args[ncalls], 256, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(fn2, "arguments")));
                        snprintf(ids[ncalls], 64, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(x, "id")));
                        ncalls++;
                    }
                }
                cJSON_Delete(ev);
            }
        }
        CHECK_MSG(ncalls == 2 && !strcmp(names[0], "get_weather") && !strcmp(args[0], "{\"city\":\"Paris\",\"days\":3}") && !strcmp(names[1], "get_weather") &&
                      !strcmp(args[1], "{\"city\":\"Rome\"}") && ids[0][0] && strcmp(ids[0], ids[1]),
                  "stream %d: %d calls: %s %s / %s %s", s, ncalls, names[0], args[0], names[1], args[1]);
        CHECK_MSG(!strcmp(content, "I will check."), "stream %d: content \"%s\"", s, content);
        CHECK_MSG(!strcmp(finish, "tool_calls"), "stream %d: finish %s", s, finish);
        reply_free(&r);
    }
    /* without tools in the request the same text is plain content */
    CHECK(http(p, "POST", "/v1/chat/completions", NULL, "{\"messages\":[{\"role\":\"user\",\"content\":\"Weather?\"}],\"max_tokens\":100,\"chat_template_kwargs\":{\"enable_thinking\":false}}", &r) == 0);
    CHECK_MSG(strstr(r.body, "\"content\":\"I will check.<tool_call>get_weather<arg_key>city") && strstr(r.body, "\"finish_reason\":\"stop\"") && !strstr(r.body, "\"tool_calls\""),
              "no tools: %s", r.body);
    reply_free(&r);
    serve_stop(sv);
    serve_free(sv);
}

/* log-softmax of a row in double, the server's undecodable ids left out */
static void log_softmax_masked(const float *l, int V, double *out) {
    double m = -INFINITY, z = 0;
    for (int i = 0; i < V; i++) {
        size_t n = 0;
        out[i] = tok_id_to_bytes(g_tok, i, &n) ? l[i] : -INFINITY;
        if (out[i] > m) m = out[i];
    }
    for (int i = 0; i < V; i++) z += exp(out[i] - m);
    for (int i = 0; i < V; i++) out[i] -= m + log(z);
}

/* logprobs are the model's: for a prompt's first sampled token they equal the log-softmax of
 * the engine's logits for that prompt (computed here alone), the top alternatives are the
 * highest of them in order; at temperature 0 the chosen token is the top one; a stream carries
 * the same numbers; completions' logprobs integer gives the legacy shape. */
TEST(serve, logprobs_are_the_models) {
    serve_opts o = {.parallel = 4};
    serve *sv = start(&o);
    if (!sv) return;
    int p = serve_port(sv);
    reply r;
    const char *b = "{\"prompt\":[630,2095,482,1486],\"max_tokens\":6,\"temperature\":0.8,\"seed\":11,\"logprobs\":4,\"return_token_ids\":true,\"ignore_eos\":true}";
    CHECK(http(p, "POST", "/v1/completions", NULL, b, &r) == 0);
    CHECK_EQ_INT(r.status, 200);
    cJSON *j = json_of(&r), *c = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), *lp = cJSON_GetObjectItem(c, "logprobs");
    int32_t ids[8];
    int n = ids_of(cJSON_GetObjectItem(c, "token_ids"), ids, 8);
    CHECK_EQ_INT(n, 6);
    CHECK_EQ_INT(cJSON_GetArraySize(cJSON_GetObjectItem(lp, "tokens")), 6);
    CHECK_EQ_INT(cJSON_GetArraySize(cJSON_GetObjectItem(lp, "top_logprobs")), 6);
    CHECK_EQ_INT(cJSON_GetArraySize(cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "top_logprobs"), 0)), 4); /* {token: logprob} */
    double lp0 = cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "token_logprobs"), 0)->valuedouble;
    char *text = strdup(cJSON_GetStringValue(cJSON_GetObjectItem(c, "text")));
    int off5 = cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "text_offset"), 5)->valueint;
    cJSON_Delete(j);
    reply_free(&r);
    /* the same in a stream: the entries concatenated */
    char sb[512];
    snprintf(sb, sizeof sb, "%.*s,\"stream\":true}", (int)strlen(b) - 1, b);
    CHECK(http(p, "POST", "/v1/completions", NULL, sb, &r) == 0);
    double slp[8];
    int ns = 0;
    for (char *q = r.body; (q = strstr(q, "data: {")) != NULL; q += 6) {
        char *end = strstr(q, "\n\n");
        cJSON *ev = cJSON_ParseWithLength(q + 6, (size_t)(end - q - 6)), *x;
        cJSON_ArrayForEach(x, cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(ev, "choices"), 0), "logprobs"), "token_logprobs")) if (ns < 8) slp[ns++] = x->valuedouble;
        cJSON_Delete(ev);
    }
    CHECK_EQ_INT(ns, 6);
    CHECK(ns > 0 && slp[0] == lp0);
    reply_free(&r);
    /* chat, greedy: the chosen token is the first of the top alternatives */
    CHECK(http(p, "POST", "/v1/chat/completions", NULL, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":5,\"temperature\":0,\"logprobs\":true,\"top_logprobs\":3}", &r) == 0);
    j = json_of(&r);
    cJSON *ct = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "logprobs"), "content"), *x;
    int k = 0;
    cJSON_ArrayForEach(x, ct) {
        cJSON *top = cJSON_GetObjectItem(x, "top_logprobs");
        CHECK_EQ_INT(cJSON_GetArraySize(top), 3);
        CHECK(cJSON_GetObjectItem(cJSON_GetArrayItem(top, 0), "logprob")->valuedouble == cJSON_GetObjectItem(x, "logprob")->valuedouble);
        CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetArrayItem(top, 0), "token")), cJSON_GetStringValue(cJSON_GetObjectItem(x, "token"))));
        CHECK(cJSON_GetObjectItem(cJSON_GetArrayItem(top, 1), "logprob")->valuedouble <= cJSON_GetObjectItem(cJSON_GetArrayItem(top, 0), "logprob")->valuedouble);
        CHECK(cJSON_IsArray(cJSON_GetObjectItem(x, "bytes")));
        k++;
    }
    CHECK_EQ_INT(k, 5);
    cJSON_Delete(j);
    reply_free(&r);
    serve_stop(sv);
    serve_free(sv);
    /* the engine's own distribution for the first token */
    int V = petrel_engine_vocab_size(g_eng);
    float *lg = malloc(sizeof(float) * (size_t)V);
    double *ls = malloc(sizeof(double) * (size_t)V);
    petrel_session *s = NULL;
    petrel_error e = {0};
    const int32_t pr[4] = {630, 2095, 482, 1486};
    CHECK(petrel_session_create(g_eng, 16, &s, &e) == 0 && petrel_session_forward(s, pr, 4, lg, 0, &e) == 0);
    log_softmax_masked(lg, V, ls);
    CHECK_MSG(fabs(ls[ids[0]] - lp0) < 1e-5, "first token %d: logprob %.7f, the model's %.7f", ids[0], lp0, ls[ids[0]]);
    /* text_offset counts the bytes of the tokens before */
    size_t o5 = 0, bn = 0;
    for (int t = 0; t < 5; t++) o5 += tok_id_to_bytes(g_tok, ids[t], &bn) ? bn : 0;
    CHECK_EQ_INT(off5, (int)o5);
    CHECK(text && strlen(text) >= o5);
    petrel_session_free(s);
    free(lg);
    free(ls);
    free(text);
}

typedef struct nres { int32_t ids[4][64]; int n[4]; char text[4][2048]; int usage_out; } nres;
static void n_request(int port, const char *body, int stream, int nc, nres *o) {
    memset(o, 0, sizeof *o);
    reply r;
    if (http(port, "POST", "/v1/completions", NULL, body, &r) || r.status != 200) { test_fail(__FILE__, __LINE__, "n request: %d %s", r.status, r.body ? r.body : ""); reply_free(&r); return; }
    if (!stream) {
        cJSON *j = json_of(&r), *c;
        cJSON_ArrayForEach(c, cJSON_GetObjectItem(j, "choices")) {
            int i = cJSON_GetObjectItem(c, "index")->valueint;
            if (i < 0 || i >= nc) { test_fail(__FILE__, __LINE__, "index %d", i); continue; }
            o->n[i] = ids_of(cJSON_GetObjectItem(c, "token_ids"), o->ids[i], 64);
            snprintf(o->text[i], sizeof o->text[i], "%s", cJSON_GetStringValue(cJSON_GetObjectItem(c, "text")));
        }
        o->usage_out = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "completion_tokens")->valueint;
        cJSON_Delete(j);
    } else {
        int finished[4] = {0, 0, 0, 0};
        for (char *q = r.body; (q = strstr(q, "data: {")) != NULL; q += 6) {
            char *end = strstr(q, "\n\n");
            cJSON *ev = cJSON_ParseWithLength(q + 6, (size_t)(end - q - 6)), *c = cJSON_GetArrayItem(cJSON_GetObjectItem(ev, "choices"), 0), *x;
            cJSON *u = cJSON_GetObjectItem(ev, "usage");
            if (u) o->usage_out = cJSON_GetObjectItem(u, "completion_tokens")->valueint;
            if (c) {
                int i = cJSON_GetObjectItem(c, "index")->valueint;
                if (i >= 0 && i < nc) {
                    cJSON_ArrayForEach(x, cJSON_GetObjectItem(c, "token_ids")) if (o->n[i] < 64) o->ids[i][o->n[i]++] = x->valueint;
                    const char *t = cJSON_GetStringValue(cJSON_GetObjectItem(c, "text"));
                    if (t) strncat(o->text[i], t, sizeof o->text[i] - strlen(o->text[i]) - 1);
                    if (cJSON_GetStringValue(cJSON_GetObjectItem(c, "finish_reason"))) finished[i]++;
                }
            }
            cJSON_Delete(ev);
        }
        for (int i = 0; i < nc; i++) CHECK_MSG(finished[i] == 1, "choice %d: %d finish chunks", i, finished[i]);
        CHECK(strstr(r.body, "data: [DONE]\n\n") != NULL);
    }
    reply_free(&r);
}

/* n > 1: choice i of a seeded request is the n = 1 request with seed + i, token for token (the
 * choices fork the prompt's KV copy-on-write and decode in the same forwards), JSON and SSE;
 * greedy choices are all the greedy text; usage sums the choices. */
TEST(serve, n_choices_fork) {
    serve_opts o = {.parallel = 4};
    serve *sv = start(&o);
    if (!sv) return;
    int p = serve_port(sv);
    char body[512];
    nres alone[3], multi;
    for (int i = 0; i < 3; i++) {
        snprintf(body, sizeof body, "{\"prompt\":\"The os module provides\",\"max_tokens\":20,\"temperature\":0.9,\"top_p\":0.95,\"seed\":%d,\"ignore_eos\":true,\"return_token_ids\":true}", 40 + i);
        n_request(p, body, 0, 1, &alone[i]);
    }
    CHECK_MSG(alone[0].n[0] != alone[1].n[0] || memcmp(alone[0].ids[0], alone[1].ids[0], sizeof(int32_t) * 20), "seeds 40 and 41 sampled the same text");
    long f0 = metric(p, "petrel_forwards_total");
    for (int stream = 0; stream < 2; stream++) {
        snprintf(body, sizeof body, "{\"prompt\":\"The os module provides\",\"max_tokens\":20,\"temperature\":0.9,\"top_p\":0.95,\"seed\":40,\"n\":3,\"ignore_eos\":true,"
                 "\"return_token_ids\":true,\"stream\":%s,\"stream_options\":{\"include_usage\":true}}", stream ? "true" : "false");
        n_request(p, body, stream, 3, &multi);
        for (int i = 0; i < 3; i++)
            CHECK_MSG(multi.n[i] == 20 && alone[i].n[0] == 20 && !memcmp(multi.ids[i], alone[i].ids[0], sizeof(int32_t) * 20) && !strcmp(multi.text[i], alone[i].text[0]),
                      "stream %d choice %d: \"%s\" vs alone \"%s\"", stream, i, multi.text[i], alone[i].text[0]);
        CHECK_EQ_INT(multi.usage_out, 60);
    }
    long f1 = metric(p, "petrel_forwards_total");
    CHECK_MSG(f1 - f0 <= 2 * 21, "%ld forwards for two requests of 3 x 20 tokens: the choices are not batched", f1 - f0);
    n_request(p, "{\"prompt\":\"import sys\",\"max_tokens\":12,\"temperature\":0,\"n\":2,\"ignore_eos\":true,\"return_token_ids\":true}", 0, 2, &multi);
    n_request(p, "{\"prompt\":\"import sys\",\"max_tokens\":12,\"temperature\":0,\"ignore_eos\":true,\"return_token_ids\":true}", 0, 1, &alone[0]);
    for (int i = 0; i < 2; i++) CHECK(multi.n[i] == 12 && !memcmp(multi.ids[i], alone[0].ids[0], sizeof(int32_t) * 12));
    /* n = 4 (all of --parallel) beside other requests, and max_tokens 0 */
    n_request(p, "{\"prompt\":\"def\",\"max_tokens\":5,\"n\":4,\"seed\":1}", 0, 4, &multi);
    CHECK_EQ_INT(multi.usage_out, 20);
    n_request(p, "{\"prompt\":\"def\",\"max_tokens\":0,\"n\":3}", 0, 3, &multi);
    CHECK_EQ_INT(multi.usage_out, 0);
    CHECK_ERROR(p, "POST", "/v1/completions", NULL, "{\"prompt\":\"x\",\"n\":5}", 400, NULL, "n");
    /* a dropped n = 3 stream gives its three places back: an n = 4 request then runs */
    const char *drop = "{\"prompt\":\"The os module provides\",\"max_tokens\":1000,\"n\":3,\"ignore_eos\":true,\"stream\":true}";
    int fd = connect_to(p);
    char buf[256];
    CHECK(fd >= 0 && send_req(fd, "POST", "/v1/completions", NULL, drop, strlen(drop)) == 0 && recv(fd, buf, sizeof buf, 0) > 0);
    if (fd >= 0) close(fd);
    long g0 = metric(p, "petrel_generation_tokens_total");
    n_request(p, "{\"prompt\":\"def\",\"max_tokens\":5,\"n\":4,\"ignore_eos\":true}", 0, 4, &multi);
    CHECK_EQ_INT(multi.usage_out, 20);
    CHECK_MSG(metric(p, "petrel_generation_tokens_total") - g0 < 1000, "the dropped choices ran on");
    long running = -1;
    for (int t = 0; t < 100 && running != 0; t++) {
        running = metric(p, "petrel_running_sequences");
        if (running) usleep(10000);
    }
    CHECK_EQ_INT(running, 0);
    serve_stop(sv);
    serve_free(sv);
}

typedef struct c64 { int port; char body[512]; int status, rc; sse_out out; } c64;
static void *c64_main(void *p) {
    c64 *a = p;
    reply r;
    a->rc = http(a->port, "POST", "/v1/completions", NULL, a->body, &r);
    if (a->rc) return NULL;
    a->status = r.status;
    a->rc = parse_sse(r.body, r.body_len, 0, &a->out);
    reply_free(&r);
    return NULL;
}

/* 64 concurrent streaming clients at temperature 0 against `petrel serve` on a pack under
 * --mem-budget 128M: every stream equals the same request made alone (row independence),
 * framed exactly, nothing lost (the budget's KV pool is 66 pages; each request takes one), and
 * the server's peak RSS, read from /proc outside it, stays under the budget (measured: 36 MiB). */
TEST(serve, clients_64_equal_alone_under_budget) {
    const char *bin = getenv("PETREL_BIN");
    if (!bin) { test_skip("PETREL_BIN unset (make test sets it)"); return; }
    const char *pk = test_pack_of("trained", CVQ_Q8);
    if (!pk) return;
    char *const argv[] = {(char *)bin, "serve", "--model", (char *)pk, "--mem-budget", "128M", "--parallel", "64", "--port", "0", NULL};
    pid_t pid;
    int fd;
    int port = spawn_serve(argv, &pid, &fd);
    if (port > 0) {
        static c64 alone[64], conc[64];
        for (int i = 0; i < 64; i++) {
            alone[i].port = port;
            snprintf(alone[i].body, sizeof alone[i].body, "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,\"stream\":true,"
                     "\"stream_options\":{\"include_usage\":true},\"return_token_ids\":true}", conc_prompts[i % N_CONC], 8 + (i * 5) % 24);
            conc[i] = alone[i];
        }
        for (int i = 0; i < 64; i++) c64_main(&alone[i]);
        pthread_t th[64];
        for (int i = 0; i < 64; i++) pthread_create(&th[i], NULL, c64_main, &conc[i]);
        for (int i = 0; i < 64; i++) pthread_join(th[i], NULL);
        int same = 0;
        for (int i = 0; i < 64; i++) {
            sse_out *a = &alone[i].out, *c = &conc[i].out;
            int ok = alone[i].rc == 0 && conc[i].rc == 0 && alone[i].status == 200 && conc[i].status == 200 && a->n_ids == 8 + (i * 5) % 24 &&
                     c->n_ids == a->n_ids && !memcmp(a->ids, c->ids, sizeof(int32_t) * (size_t)a->n_ids) && !strcmp(a->text, c->text) &&
                     c->completion_tokens == c->n_ids && !strcmp(c->finish, "length");
            CHECK_MSG(ok, "client %d: rc %d/%d status %d/%d, %d vs %d ids", i, alone[i].rc, conc[i].rc, alone[i].status, conc[i].status, a->n_ids, c->n_ids);
            same += ok;
        }
        CHECK_EQ_INT(same, 64);
        reply r;
        CHECK(http(port, "GET", "/metrics", NULL, NULL, &r) == 0 && strstr(r.body, "petrel_requests_total{result=\"ok\"} 128\n") && strstr(r.body, "{result=\"error\"} 0\n"));
        reply_free(&r);
        char path[64], st[4096] = "";
        snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
        FILE *f = fopen(path, "r");
        size_t got = f ? fread(st, 1, sizeof st - 1, f) : 0;
        if (f) fclose(f);
        st[got] = 0;
        char *h = strstr(st, "VmHWM:");
        long kb = h ? strtol(h + 6, NULL, 10) : -1;
        CHECK_MSG(kb > 0 && kb < 128 * 1024, "peak RSS %ld KiB, budget 131072 KiB", kb);
    }
    stop_serve(pid, fd);
}

/* Connections over --max-connections get an OpenAI 503 body (code too_many_connections), not a
 * closed socket; once the others close, requests are served again. */
TEST(serve, too_many_connections) {
    serve_opts o = {.max_connections = 2, .parallel = 2};
    serve *sv = start(&o);
    if (!sv) return;
    int p = serve_port(sv);
    const char *body = "{\"prompt\":\"The os module provides\",\"max_tokens\":1000,\"temperature\":0,\"ignore_eos\":true,\"stream\":true}";
    int fd[2];
    char buf[256];
    for (int k = 0; k < 2; k++) {
        fd[k] = connect_to(p);
        CHECK(fd[k] >= 0 && send_req(fd[k], "POST", "/v1/completions", NULL, body, strlen(body)) == 0 && recv(fd[k], buf, sizeof buf, 0) > 0);
    }
    CHECK_ERROR(p, "GET", "/health", NULL, NULL, 503, "too_many_connections", NULL);
    CHECK_ERROR(p, "POST", "/v1/completions", NULL, "{\"prompt\":\"x\"}", 503, "too_many_connections", NULL);
    for (int k = 0; k < 2; k++)
        if (fd[k] >= 0) close(fd[k]);
    int status = 0;
    for (int t = 0; t < 200 && status != 200; t++) { /* the daemon notices the closed ones */
        reply r;
        if (http(p, "GET", "/health", NULL, NULL, &r) == 0) status = r.status;
        reply_free(&r);
        if (status != 200) usleep(10000);
    }
    CHECK_EQ_INT(status, 200);
    serve_stop(sv);
    serve_free(sv);
}

/* LoRA adapters served as models of their own: /v1/models lists them, a request's "model"
 * picks one, requests for the base and for two adapters run in one batch, and each equals
 * `petrel generate --lora DIR` (or no adapter) token for token. */
typedef struct lora_req { int port; const char *model; int32_t got[32]; int n; } lora_req;
static void *lora_main(void *p) {
    lora_req *a = p;
    char body[512];
    snprintf(body, sizeof body, "{\"prompt\":[630,2095,482,1486],\"max_tokens\":16,\"temperature\":0,\"ignore_eos\":true,\"return_token_ids\":true%s%s%s}",
             a->model ? ",\"model\":\"" : "", a->model ? a->model : "", a->model ? "\"" : "");
    reply r;
    if (http(a->port, "POST", "/v1/completions", NULL, body, &r) == 0 && r.status == 200) {
        cJSON *j = json_of(&r);
        a->n = ids_of(cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "token_ids"), a->got, 32);
        cJSON_Delete(j);
    }
    reply_free(&r);
    return NULL;
}

TEST(serve, lora_models) {
    if (fixture()) return;
    const char *dirs[2] = {test_data("lora-trained"), test_data("lora-mlp")};
    petrel_lora_spec sp[2] = {{dirs[0], "tr", 1.0f}, {dirs[1], "mlp", 1.0f}};
    petrel_open_opts oo = {.lora = sp, .n_lora = 2, .lora_select = 1};
    petrel_engine *e = NULL;
    petrel_error err = {0};
    if (petrel_engine_open(test_data("trained"), &oo, &e, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    serve_opts o = {.parallel = 4};
    serve *sv = NULL;
    if (serve_start(e, g_tok, g_tmpl, &o, &sv, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); petrel_engine_close(e); return; }
    int port = serve_port(sv);
    reply r;
    CHECK(http(port, "GET", "/v1/models", NULL, NULL, &r) == 0 && r.status == 200);
    cJSON *j = json_of(&r), *d = cJSON_GetObjectItem(j, "data");
    CHECK_EQ_INT(cJSON_GetArraySize(d), 3);
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetArrayItem(d, 1), "id")), "tr"));
    CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetArrayItem(d, 2), "parent")), "petrel"));
    cJSON_Delete(j);
    reply_free(&r);
    CHECK(http(port, "GET", "/v1/models/mlp", NULL, NULL, &r) == 0 && r.status == 200 && strstr(r.body, "\"mlp\""));
    reply_free(&r);
    check_error(port, "POST", "/v1/completions", NULL, "{\"prompt\":[1,2],\"model\":\"nope\"}", 404, "model_not_found", "model", __LINE__);
    lora_req q[3] = {{port, NULL, {0}, 0}, {port, "tr", {0}, 0}, {port, "mlp", {0}, 0}};
    pthread_t th[3];
    for (int i = 0; i < 3; i++) pthread_create(&th[i], NULL, lora_main, &q[i]);
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    int32_t want[3][32];
    const char *ld[3] = {NULL, dirs[0], dirs[1]};
    for (int i = 0; i < 3; i++) {
        int nw = generate_lora_ids("630,2095,482,1486", 16, ld[i], want[i]);
        if (nw == -1) { test_skip("PETREL_BIN unset: no `petrel generate` to compare with"); break; }
        CHECK_EQ_INT(q[i].n, 16);
        CHECK_EQ_INT(nw, 16);
        for (int k = 0; k < 16 && k < q[i].n; k++) CHECK_MSG(q[i].got[k] == want[i][k], "model %s: id %d: %d != generate's %d", q[i].model ? q[i].model : "base", k, q[i].got[k], want[i][k]);
    }
    CHECK(memcmp(q[0].got, q[1].got, sizeof q[0].got) || memcmp(q[1].got, q[2].got, sizeof q[0].got));
    serve_stop(sv);
    serve_free(sv);
    petrel_engine_close(e);
}

/* The I/O fault seam under streamed experts: while every expert read fails, each request ends
 * with an OpenAI error body (500, the read named), the server stays up (/health), and once the
 * disk reads again the same request gets its tokens. */
static void fail_all_reads(void *ctx, int layer, int expert, int attempt, xs_fault *f) {
    (void)layer, (void)expert, (void)attempt;
    if (*(volatile int *)ctx) f->kind = XS_FAULT_ERROR;
}

TEST(serve, expert_read_faults) {
    if (fixture()) return;
    const char *pk = test_pack_of("trained", CVQ_Q8);
    if (!pk) return;
    petrel_engine *eng = NULL;
    petrel_error err = {0};
    petrel_open_opts oo = {.expert_slots = 2};
    if (petrel_engine_open(pk, &oo, &eng, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
    serve_opts o = {.parallel = 4};
    serve *sv = NULL;
    if (serve_start(eng, g_tok, g_tmpl, &o, &sv, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); petrel_engine_close(eng); return; }
    int p = serve_port(sv);
    static volatile int armed = 1;
    xs_io_fault_ctx = (void *)&armed;
    xs_io_fault_hook = fail_all_reads;
    const char *body = "{\"prompt\":[630,2095,482,1486],\"max_tokens\":6,\"temperature\":0,\"ignore_eos\":true}";
    fail_arg a[2] = {{p, body, 0, ""}, {p, "{\"prompt\":[5,6,7],\"max_tokens\":6,\"temperature\":0,\"ignore_eos\":true}", 0, ""}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, fail_main, &a[i]);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++)
        CHECK_MSG(a[i].status == 500 && strstr(a[i].text, "\"error\"") && strstr(a[i].text, "read failed"), "request %d under faults: %d %s", i, a[i].status,
                  a[i].text);
    reply r;
    CHECK(http(p, "GET", "/health", NULL, NULL, &r) == 0 && r.status == 200);
    reply_free(&r);
    armed = 0;
    fail_main(&a[0]);
    CHECK_MSG(a[0].status == 200 && strstr(a[0].text, "\"completion_tokens\":6"), "after the faults: %d %s", a[0].status, a[0].text);
    xs_io_fault_hook = NULL;
    xs_io_fault_ctx = NULL;
    serve_stop(sv);
    serve_free(sv);
    petrel_engine_close(eng);
}

/* --session-dir: a finished request's KV is written to the folder; a new server (a fresh engine,
 * its prefix cache empty) loads it at start, the same request then skips the cached pages of its
 * prompt and answers the same tokens; a damaged file there is skipped, not fatal. */
static void sd_request(int port, const char *body, char *out, size_t cap) {
    reply r;
    out[0] = 0;
    if (http(port, "POST", "/v1/completions", NULL, body, &r) == 0 && r.status == 200) {
        cJSON *j = json_of(&r);
        const char *t = cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "text"));
        snprintf(out, cap, "%s", t ? t : "");
        cJSON_Delete(j);
    } else test_fail(__FILE__, __LINE__, "request: %d %.300s", r.status, r.body ? r.body : "");
    reply_free(&r);
}

TEST(serve, session_dir_across_restarts) {
    if (fixture()) return;
    const char *dir = test_tmp("sessions");
    char body[4096] = "{\"prompt\":[";
    for (int k = 0; k < 150; k++) sprintf(body + strlen(body), k ? ",%d" : "%d", 100 + (k * 37) % 3000);
    strcat(body, "],\"max_tokens\":8,\"temperature\":0,\"ignore_eos\":true}");
    char first[2048], second[2048];
    for (int run = 0; run < 2; run++) {
        petrel_engine *e = NULL;
        petrel_error err = {0};
        if (petrel_engine_open(test_data("trained"), &(petrel_open_opts){0}, &e, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); return; }
        serve_opts o = {.parallel = 2, .session_dir = dir};
        serve *sv = NULL;
        if (serve_start(e, g_tok, g_tmpl, &o, &sv, &err)) { test_fail(__FILE__, __LINE__, "%s", err.msg); petrel_engine_close(e); return; }
        int ld = -1, sk = -1;
        long wr = -1;
        serve_session_files(sv, &ld, &sk, NULL);
        int port = serve_port(sv);
        if (run == 0) CHECK(ld == 0 && sk == 0);
        else CHECK_MSG(ld == 1 && sk == 1, "loaded %d skipped %d", ld, sk);
        sd_request(port, body, run ? second : first, sizeof first);
        long cached = metric(port, "petrel_prompt_tokens_cached_total");
        if (run == 0) CHECK_EQ_INT(cached, 0);
        else CHECK_MSG(cached >= 128, "cached prompt tokens after the restart: %ld", cached);
        serve_stop(sv); /* writes what is queued */
        serve_session_files(sv, NULL, NULL, &wr);
        CHECK_EQ_INT(wr, run == 0 ? 1 : 0); /* the second run's session is already there */
        serve_free(sv);
        petrel_engine_close(e);
        if (run == 0) { /* a damaged file beside the good one */
            char p[700];
            snprintf(p, sizeof p, "%s/0000000000000000.psess", dir);
            FILE *f = fopen(p, "wb");
            if (f) fputs("not a session file", f), fclose(f);
        }
    }
    CHECK_MSG(first[0] && !strcmp(first, second), "before the restart: [%s] after: [%s]", first, second);
}

/* --draft: speculative decoding inside the scheduler. Greedy streams of several requests drafting
 * together equal plain `petrel generate`, a request with logprobs (which does not draft) runs
 * beside them, a sampled one finishes with its length. */
TEST(serve, draft_greedy_equals_plain) {
    if (fixture()) return;
    serve_opts o = {.parallel = 4, .draft = 3};
    serve *sv = start(&o);
    if (!sv) return;
    int port = serve_port(sv);
    int32_t want[32];
    int nw = generate_ids("630,2095,482,1486", 16, want);
    if (nw == -1) { serve_stop(sv); serve_free(sv); test_skip("PETREL_BIN unset: no `petrel generate` to compare with"); return; }
    lora_req q[3] = {{port, NULL, {0}, 0}, {port, NULL, {0}, 0}, {port, NULL, {0}, 0}};
    pthread_t th[3];
    for (int i = 0; i < 3; i++) pthread_create(&th[i], NULL, lora_main, &q[i]);
    reply r;
    CHECK(http(port, "POST", "/v1/completions", NULL, "{\"prompt\":[630,2095],\"max_tokens\":5,\"temperature\":0,\"logprobs\":2}", &r) == 0 && r.status == 200 &&
          strstr(r.body, "\"top_logprobs\""));
    reply_free(&r);
    CHECK(http(port, "POST", "/v1/completions", NULL, "{\"prompt\":[5,6,7],\"max_tokens\":12,\"temperature\":0.8,\"seed\":3,\"ignore_eos\":true}", &r) == 0 &&
          r.status == 200 && strstr(r.body, "\"completion_tokens\":12"));
    reply_free(&r);
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 3; i++) {
        CHECK_EQ_INT(q[i].n, 16);
        for (int k = 0; k < 16 && k < q[i].n; k++) CHECK_MSG(q[i].got[k] == want[k], "request %d: id %d: %d != plain %d", i, k, q[i].got[k], want[k]);
    }
    long fw = metric(port, "petrel_forwards_total"), tok = metric(port, "petrel_generation_tokens_total");
    CHECK_MSG(fw > 0 && tok > 0, "forwards %ld tokens %ld", fw, tok);
    /* a long prompt twice: the second takes its cached pages (MTP rows with them), same tokens */
    char ids[2048] = "", body[4096];
    for (int k = 0; k < 140; k++) sprintf(ids + strlen(ids), k ? ",%d" : "%d", 100 + (k * 37) % 3000);
    snprintf(body, sizeof body, "{\"prompt\":[%s],\"max_tokens\":10,\"temperature\":0,\"ignore_eos\":true}", ids);
    char t1[1024] = "", t2[1024] = "";
    long c0 = metric(port, "petrel_prompt_tokens_cached_total");
    sd_request(port, body, t1, sizeof t1);
    sd_request(port, body, t2, sizeof t2);
    long c1 = metric(port, "petrel_prompt_tokens_cached_total");
    CHECK_MSG(c1 - c0 >= 128, "cached prompt tokens of the repeat: %ld", c1 - c0);
    CHECK_MSG(t1[0] && !strcmp(t1, t2), "first [%s] repeat [%s]", t1, t2);
    serve_stop(sv);
    serve_free(sv);
}

/* Bad values of serve's own options: one line on stderr, exit status 1, no server started. */
TEST(serve, cli_bad_options) {
    const char *bin = getenv("PETREL_BIN");
    if (!bin) { test_skip("PETREL_BIN unset (make test sets it)"); return; }
    const char *bad[] = {"--lora foo", "--lora =dir", "--lora a=/nonexistent/adapter", "--lora a=DIR --lora-merge", "--draft 17", "--draft -1",
                         "--session-dir /proc/no/such/folder", "--session-dir-max 0"};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        char arg[700], cmd[2048], out[4096], er[4096];
        snprintf(arg, sizeof arg, "%s", bad[k]);
        if (strstr(bad[k], "=DIR")) snprintf(arg, sizeof arg, "--lora a=%s --lora-merge", test_data("lora-trained"));
        snprintf(cmd, sizeof cmd, "timeout 60 %s serve --model %s --port 0 %s", bin, test_data("trained"), arg);
        int rc = test_sh(cmd, out, sizeof out, er, sizeof er);
        CHECK_MSG(rc == 1 && test_count_lines(er) == 1 && !strstr(out, "listening"), "%s: rc %d: %s", bad[k], rc, er);
    }
}
