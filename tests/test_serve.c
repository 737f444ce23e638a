/* test_serve.c: `petrel serve` (src/serve) over real HTTP on localhost. The server runs
 * in-process on a free port (and once as $PETREL_BIN serve); a small socket client here speaks
 * HTTP/1.1 (chunked replies de-chunked) and checks the OpenAI framing byte for byte.
 *   - greedy /v1/completions ids == `petrel generate` ids, for a prompt of ids and of text
 *   - 8 concurrent streams (more than --parallel, so some queue) == the same requests alone
 *   - error bodies {"error": {message, type, code}} with the right 4xx, API key, stop strings,
 *     a client that goes away mid-stream frees its place, SIGTERM exits cleanly. */
#include <arpa/inet.h>
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

#include "runtime/chat.h"
#include "serve/request.h"
#include "serve/server.h"
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

/* `petrel generate` greedy ids after ids (NULL with a skip when PETREL_BIN is unset). */
static int generate_ids(const char *ids, int n, int32_t *out) {
    const char *bin = getenv("PETREL_BIN");
    if (!bin) return -1;
    char cmd[2048], o[16384], e[4096];
    snprintf(cmd, sizeof cmd, "%s generate --model %s --ids %s -n %d", bin, test_data("trained"), ids, n);
    if (test_sh(cmd, o, sizeof o, e, sizeof e) != 0) { test_fail(__FILE__, __LINE__, "generate failed: %s", e); return -2; }
    int k = 0;
    char *p = o, *q;
    for (long v; k < n && (v = strtol(p, &q, 10), q != p); p = q) out[k++] = (int32_t)v;
    return k;
}

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
    CHECK_ERROR(p, "POST", C, NULL, "{\"prompt\":\"x\",\"n\":2}", 400, NULL, "n");
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

/* $PETREL_BIN serve: the URL line when ready, then SIGTERM exits with status 0. */
TEST(serve, cli_sigterm) {
    const char *bin = getenv("PETREL_BIN");
    if (!bin) { test_skip("PETREL_BIN unset (make test sets it)"); return; }
    int pfd[2];
    if (pipe(pfd)) { test_fail(__FILE__, __LINE__, "pipe"); return; }
    pid_t pid = fork();
    if (pid == 0) {
        dup2(pfd[1], 1);
        close(pfd[0]);
        execl(bin, bin, "serve", "--model", test_data("trained"), "--port", "0", "--api-key", "k", (char *)NULL);
        _exit(127);
    }
    close(pfd[1]);
    char line[512] = "";
    size_t n = 0;
    while (n < sizeof line - 1 && read(pfd[0], line + n, 1) == 1 && line[n] != '\n') n++;
    line[n] = 0;
    int port = 0;
    char *u = strstr(line, "http://127.0.0.1:");
    if (u) port = atoi(u + 17);
    CHECK_MSG(port > 0, "no URL line: \"%s\"", line);
    if (port > 0) {
        reply r;
        CHECK(http(port, "GET", "/health", NULL, NULL, &r) == 0 && r.status == 200);
        reply_free(&r);
        CHECK_ERROR(port, "GET", "/v1/models", NULL, NULL, 401, "invalid_api_key", NULL);
    }
    kill(pid, SIGTERM);
    int st = 0;
    waitpid(pid, &st, 0);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status %d", st);
    close(pfd[0]);
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
    char cmd[4400];
    snprintf(cmd, sizeof cmd, "node %s/../node/openai_client.mjs %d sk-npm", test_data(""), serve_port(sv));
    int rc = test_sh(cmd, o, sizeof o, e, sizeof e);
    CHECK_MSG(rc == 0 && strstr(o, "all ok"), "openai client (rc %d):\n%s%s", rc, o, e);
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
