/* request.c: OpenAI request bodies into serve_request (see request.h). Every field is checked
 * for its JSON type and range before use; numbers must be finite; strings are copied out of the
 * cJSON tree so the tree is freed before the request is queued. */
#include "serve/request.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

#define PARAM(p, s) do { if (p) snprintf((p), 64, "%s", (s)); } while (0)

static char *dup_n(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}

/* A number field: absent or null leaves *out; else it must be a finite number in [lo, hi]. */
static int get_num(const cJSON *o, const char *name, double lo, double hi, double *out, int *given, char *param,
                   petrel_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (given) *given = 0;
    if (!v || cJSON_IsNull(v)) return 0;
    PARAM(param, name);
    if (!cJSON_IsNumber(v)) return pt_err(err, PETREL_EINVAL, "'%s' must be a number", name);
    double d = v->valuedouble;
    if (!isfinite(d) || d < lo || d > hi) return pt_err(err, PETREL_EINVAL, "'%s' is %g, out of range [%g, %g]", name, d, lo, hi);
    PARAM(param, "");
    *out = d;
    if (given) *given = 1;
    return 0;
}

static int get_int(const cJSON *o, const char *name, double lo, double hi, long *out, int *given, char *param, petrel_error *err) {
    double d = 0;
    int g = 0;
    if (get_num(o, name, lo, hi, &d, &g, param, err)) return PETREL_EINVAL;
    if (given) *given = g;
    if (!g) return 0;
    if (d != floor(d)) {
        PARAM(param, name);
        return pt_err(err, PETREL_EINVAL, "'%s' must be an integer", name);
    }
    *out = (long)d;
    return 0;
}

static int get_bool(const cJSON *o, const char *name, int *out, char *param, petrel_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsBool(v)) {
        PARAM(param, name);
        return pt_err(err, PETREL_EINVAL, "'%s' must be a boolean", name);
    }
    *out = cJSON_IsTrue(v);
    return 0;
}

int serve_parse_ids_array(const cJSON *a, int32_t **ids, int *n, const char *param, petrel_error *err) {
    int m = cJSON_GetArraySize(a);
    *ids = NULL;
    *n = 0;
    int32_t *p = malloc(sizeof(int32_t) * (size_t)(m ? m : 1));
    if (!p) return pt_err(err, PETREL_ENOMEM, "out of memory");
    int k = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, a) {
        if (!cJSON_IsNumber(e) || !isfinite(e->valuedouble) || e->valuedouble != floor(e->valuedouble) || e->valuedouble < 0 ||
            e->valuedouble > 2147483647.0) {
            free(p);
            return pt_err(err, PETREL_EINVAL, "'%s' must hold token ids (integers >= 0); item %d is not one", param, k);
        }
        p[k++] = (int32_t)e->valuedouble;
    }
    *ids = p;
    *n = k;
    return 0;
}

/* content: a string, null, or an array of parts {type: "text", text} joined together. */
static int flatten_content(const cJSON *c, int k, char **out, petrel_error *err) {
    if (!c || cJSON_IsNull(c)) { *out = dup_n("", 0); return *out ? 0 : pt_err(err, PETREL_ENOMEM, "out of memory"); }
    if (cJSON_IsString(c)) { *out = dup_n(c->valuestring, strlen(c->valuestring)); return *out ? 0 : pt_err(err, PETREL_ENOMEM, "out of memory"); }
    if (!cJSON_IsArray(c)) return pt_err(err, PETREL_EINVAL, "messages[%d].content must be a string, null or an array of text parts", k);
    size_t n = 0;
    const cJSON *p;
    cJSON_ArrayForEach(p, c) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(p, "type"), *x = cJSON_GetObjectItemCaseSensitive(p, "text");
        if (!cJSON_IsObject(p) || !cJSON_IsString(t) || strcmp(t->valuestring, "text") || !cJSON_IsString(x))
            return pt_err(err, PETREL_EINVAL, "messages[%d].content: only parts {\"type\": \"text\", \"text\": \"...\"} are supported", k);
        n += strlen(x->valuestring);
    }
    char *s = malloc(n + 1);
    if (!s) return pt_err(err, PETREL_ENOMEM, "out of memory");
    size_t o = 0;
    cJSON_ArrayForEach(p, c) {
        const char *x = cJSON_GetObjectItemCaseSensitive(p, "text")->valuestring;
        size_t l = strlen(x);
        memcpy(s + o, x, l);
        o += l;
    }
    s[o] = 0;
    *out = s;
    return 0;
}

/* An assistant message's tool_calls: [{id?, type?: "function", function: {name, arguments}}],
 * arguments a JSON object or its text; copied into o with arguments as an object. */
static int copy_tool_calls(const cJSON *tc, int k, cJSON *o, petrel_error *err) {
    if (!cJSON_IsArray(tc)) return pt_err(err, PETREL_EINVAL, "messages[%d].tool_calls must be an array", k);
    cJSON *arr = cJSON_AddArrayToObject(o, "tool_calls");
    if (!arr) return pt_err(err, PETREL_ENOMEM, "out of memory");
    int i = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, tc) {
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(c, "type"), *f = cJSON_GetObjectItemCaseSensitive(c, "function");
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(c, "id");
        if (!cJSON_IsObject(c) || !cJSON_IsObject(f))
            return pt_err(err, PETREL_EINVAL, "messages[%d].tool_calls[%d] must be an object with a 'function' object", k, i);
        if (ty && !cJSON_IsNull(ty) && !(cJSON_IsString(ty) && !strcmp(ty->valuestring, "function")))
            return pt_err(err, PETREL_EINVAL, "messages[%d].tool_calls[%d].type must be \"function\"", k, i);
        if (id && !cJSON_IsNull(id) && !cJSON_IsString(id)) return pt_err(err, PETREL_EINVAL, "messages[%d].tool_calls[%d].id must be a string", k, i);
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(f, "name"), *ar = cJSON_GetObjectItemCaseSensitive(f, "arguments");
        if (!cJSON_IsString(nm) || !nm->valuestring[0]) return pt_err(err, PETREL_EINVAL, "messages[%d].tool_calls[%d].function.name must be a non-empty string", k, i);
        cJSON *args = NULL;
        if (cJSON_IsString(ar)) {
            args = ar->valuestring[0] ? cJSON_Parse(ar->valuestring) : cJSON_CreateObject();
            if (!cJSON_IsObject(args)) {
                cJSON_Delete(args);
                return pt_err(err, PETREL_EINVAL, "messages[%d].tool_calls[%d].function.arguments is not the text of a JSON object", k, i);
            }
        } else if (cJSON_IsObject(ar)) args = cJSON_Duplicate(ar, 1);
        else if (!ar || cJSON_IsNull(ar)) args = cJSON_CreateObject();
        else return pt_err(err, PETREL_EINVAL, "messages[%d].tool_calls[%d].function.arguments must be a string (JSON text) or an object", k, i);
        cJSON *co = cJSON_CreateObject(), *fo = co ? cJSON_AddObjectToObject(co, "function") : NULL;
        if (!args || !fo || (cJSON_IsString(id) && !cJSON_AddStringToObject(co, "id", id->valuestring)) || !cJSON_AddStringToObject(co, "type", "function") ||
            !cJSON_AddStringToObject(fo, "name", nm->valuestring)) {
            cJSON_Delete(args);
            cJSON_Delete(co);
            return pt_err(err, PETREL_ENOMEM, "out of memory");
        }
        cJSON_AddItemToObject(fo, "arguments", args);
        cJSON_AddItemToArray(arr, co);
        i++;
    }
    return 0;
}

/* tools: [{type: "function", function: {name, description?, parameters?}}] (kept as given). */
static int parse_tools(const cJSON *j, serve_request *r, char *param, petrel_error *err) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(j, "tools"), *tc = cJSON_GetObjectItemCaseSensitive(j, "tool_choice");
    int nt = 0;
    if (t && !cJSON_IsNull(t) && !(cJSON_IsArray(t) && cJSON_GetArraySize(t) == 0)) {
        PARAM(param, "tools");
        if (!r->chat) return pt_err(err, PETREL_EINVAL, "'tools' is for /v1/chat/completions");
        if (!cJSON_IsArray(t)) return pt_err(err, PETREL_EINVAL, "'tools' must be an array of tools");
        nt = cJSON_GetArraySize(t);
        if (nt > SERVE_MAX_TOOLS) return pt_err(err, PETREL_EINVAL, "'tools' holds %d tools, at most %d are allowed", nt, SERVE_MAX_TOOLS);
        int i = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, t) {
            const cJSON *ty = cJSON_GetObjectItemCaseSensitive(e, "type"), *f = cJSON_GetObjectItemCaseSensitive(e, "function");
            if (!cJSON_IsObject(e) || !cJSON_IsString(ty) || strcmp(ty->valuestring, "function"))
                return pt_err(err, PETREL_EINVAL, "tools[%d] must be {\"type\": \"function\", \"function\": {...}}", i);
            const cJSON *nm = cJSON_GetObjectItemCaseSensitive(f, "name"), *d = cJSON_GetObjectItemCaseSensitive(f, "description"),
                        *pa = cJSON_GetObjectItemCaseSensitive(f, "parameters");
            if (!cJSON_IsObject(f) || !cJSON_IsString(nm) || !nm->valuestring[0])
                return pt_err(err, PETREL_EINVAL, "tools[%d].function must be an object with a non-empty string 'name'", i);
            if (d && !cJSON_IsNull(d) && !cJSON_IsString(d)) return pt_err(err, PETREL_EINVAL, "tools[%d].function.description must be a string", i);
            if (pa && !cJSON_IsNull(pa) && !cJSON_IsObject(pa)) return pt_err(err, PETREL_EINVAL, "tools[%d].function.parameters must be a JSON schema object", i);
            i++;
        }
        if (nt && !(r->tools = cJSON_Duplicate(t, 1))) return pt_err(err, PETREL_ENOMEM, "out of memory");
        PARAM(param, "");
    }
    r->tool_choice = nt ? SERVE_TOOLS_AUTO : SERVE_TOOLS_NONE;
    if (!tc || cJSON_IsNull(tc)) return 0;
    PARAM(param, "tool_choice");
    if (cJSON_IsString(tc)) {
        const char *v = tc->valuestring;
        if (!strcmp(v, "none")) r->tool_choice = SERVE_TOOLS_NONE;
        else if (!strcmp(v, "auto")) r->tool_choice = nt ? SERVE_TOOLS_AUTO : SERVE_TOOLS_NONE;
        else if (!strcmp(v, "required")) {
            if (!nt) return pt_err(err, PETREL_EINVAL, "'tool_choice' is \"required\" but no 'tools' are given");
            r->tool_choice = SERVE_TOOLS_REQUIRED;
        } else
            return pt_err(err, PETREL_EINVAL, "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
    } else {
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(tc, "type"), *f = cJSON_GetObjectItemCaseSensitive(tc, "function");
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(f, "name");
        if (!cJSON_IsObject(tc) || !cJSON_IsString(ty) || strcmp(ty->valuestring, "function") || !cJSON_IsString(nm))
            return pt_err(err, PETREL_EINVAL, "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
        int found = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, r->tools) {
            const cJSON *n2 = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(e, "function"), "name");
            if (cJSON_IsString(n2) && !strcmp(n2->valuestring, nm->valuestring)) found = 1;
        }
        if (!found) return pt_err(err, PETREL_EINVAL, "'tool_choice' names the function \"%.100s\", which is not in 'tools'", nm->valuestring);
        if (!(r->tool_name = dup_n(nm->valuestring, strlen(nm->valuestring)))) return pt_err(err, PETREL_ENOMEM, "out of memory");
        r->tool_choice = SERVE_TOOLS_NAMED;
    }
    PARAM(param, "");
    return 0;
}

static int parse_messages(const cJSON *m, serve_request *r, char *param, petrel_error *err) {
    PARAM(param, "messages");
    if (!cJSON_IsArray(m)) return pt_err(err, PETREL_EINVAL, "'messages' must be an array of messages");
    if (cJSON_GetArraySize(m) == 0) return pt_err(err, PETREL_EINVAL, "'messages' is empty");
    r->messages = cJSON_CreateArray();
    if (!r->messages) return pt_err(err, PETREL_ENOMEM, "out of memory");
    int k = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, m) {
        if (!cJSON_IsObject(e)) return pt_err(err, PETREL_EINVAL, "messages[%d] must be an object", k);
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(e, "role");
        if (!cJSON_IsString(role)) return pt_err(err, PETREL_EINVAL, "messages[%d].role must be a string", k);
        const char *rs = role->valuestring;
        if (!strcmp(rs, "developer")) rs = "system";
        if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant") && strcmp(rs, "tool"))
            return pt_err(err, PETREL_EINVAL, "messages[%d].role \"%.40s\" is not system, developer, user, assistant or tool", k, role->valuestring);
        char *content = NULL;
        if (flatten_content(cJSON_GetObjectItemCaseSensitive(e, "content"), k, &content, err)) return PETREL_EINVAL;
        cJSON *o = cJSON_CreateObject();
        if (!o || !cJSON_AddStringToObject(o, "role", rs) || !cJSON_AddStringToObject(o, "content", content)) {
            free(content);
            cJSON_Delete(o);
            return pt_err(err, PETREL_ENOMEM, "out of memory");
        }
        free(content);
        const cJSON *rc = cJSON_GetObjectItemCaseSensitive(e, "reasoning_content");
        if (rc && !cJSON_IsNull(rc)) {
            if (!cJSON_IsString(rc)) { cJSON_Delete(o); return pt_err(err, PETREL_EINVAL, "messages[%d].reasoning_content must be a string", k); }
            if (!cJSON_AddStringToObject(o, "reasoning_content", rc->valuestring)) { cJSON_Delete(o); return pt_err(err, PETREL_ENOMEM, "out of memory"); }
        }
        cJSON_AddItemToArray(r->messages, o);
        const cJSON *tc = cJSON_GetObjectItemCaseSensitive(e, "tool_calls");
        if (tc && !cJSON_IsNull(tc) && !(cJSON_IsArray(tc) && cJSON_GetArraySize(tc) == 0)) {
            if (strcmp(rs, "assistant")) return pt_err(err, PETREL_EINVAL, "messages[%d].tool_calls: only assistant messages hold tool calls", k);
            if (copy_tool_calls(tc, k, o, err)) return PETREL_EINVAL;
        }
        const cJSON *tid = cJSON_GetObjectItemCaseSensitive(e, "tool_call_id");
        if (tid && !cJSON_IsNull(tid)) {
            if (!cJSON_IsString(tid)) return pt_err(err, PETREL_EINVAL, "messages[%d].tool_call_id must be a string", k);
            if (!cJSON_AddStringToObject(o, "tool_call_id", tid->valuestring)) return pt_err(err, PETREL_ENOMEM, "out of memory");
        }
        k++;
    }
    PARAM(param, "");
    return 0;
}

static int parse_prompt(const cJSON *p, serve_request *r, char *param, petrel_error *err) {
    PARAM(param, "prompt");
    if (!p || cJSON_IsNull(p)) return pt_err(err, PETREL_EINVAL, "'prompt' is required");
    if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1 && cJSON_IsString(cJSON_GetArrayItem(p, 0))) p = cJSON_GetArrayItem(p, 0);
    if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1 && cJSON_IsArray(cJSON_GetArrayItem(p, 0))) p = cJSON_GetArrayItem(p, 0);
    if (cJSON_IsString(p)) {
        r->prompt_len = strlen(p->valuestring);
        if (!r->prompt_len) return pt_err(err, PETREL_EINVAL, "'prompt' is empty");
        r->prompt = dup_n(p->valuestring, r->prompt_len);
        if (!r->prompt) return pt_err(err, PETREL_ENOMEM, "out of memory");
    } else if (cJSON_IsArray(p)) {
        const cJSON *f = cJSON_GetArrayItem(p, 0);
        if (f && !cJSON_IsNumber(f)) return pt_err(err, PETREL_EINVAL, "'prompt': one prompt per request (a string or an array of token ids)");
        if (serve_parse_ids_array(p, &r->prompt_ids, &r->n_prompt_ids, "prompt", err)) return PETREL_EINVAL;
        if (!r->n_prompt_ids) return pt_err(err, PETREL_EINVAL, "'prompt' is empty");
    } else
        return pt_err(err, PETREL_EINVAL, "'prompt' must be a string or an array of token ids");
    PARAM(param, "");
    return 0;
}

static int parse_stop(const cJSON *s, serve_request *r, char *param, petrel_error *err) {
    if (!s || cJSON_IsNull(s)) return 0;
    PARAM(param, "stop");
    const cJSON *one[1] = {s};
    int n = cJSON_IsString(s) ? 1 : cJSON_IsArray(s) ? cJSON_GetArraySize(s) : -1;
    if (n < 0) return pt_err(err, PETREL_EINVAL, "'stop' must be a string or an array of strings");
    if (n > SERVE_MAX_STOP) return pt_err(err, PETREL_EINVAL, "'stop' holds %d strings, at most %d are allowed", n, SERVE_MAX_STOP);
    for (int k = 0; k < n; k++) {
        const cJSON *e = cJSON_IsString(s) ? one[0] : cJSON_GetArrayItem(s, k);
        if (!cJSON_IsString(e)) return pt_err(err, PETREL_EINVAL, "'stop'[%d] must be a string", k);
        size_t l = strlen(e->valuestring);
        if (l == 0) continue;
        if (l > SERVE_MAX_STOP_LEN) return pt_err(err, PETREL_EINVAL, "'stop'[%d] is %zu bytes, at most %d are allowed", k, l, SERVE_MAX_STOP_LEN);
        if (!(r->stop[r->n_stop] = dup_n(e->valuestring, l))) return pt_err(err, PETREL_ENOMEM, "out of memory");
        r->n_stop++;
    }
    PARAM(param, "");
    return 0;
}

static int parse_obj(const cJSON *j, int chat, serve_request *r, char *param, petrel_error *err) {
    if (!cJSON_IsObject(j)) return pt_err(err, PETREL_EINVAL, "the request body must be a JSON object");
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(j, "model");
    if (m && !cJSON_IsNull(m)) {
        PARAM(param, "model");
        if (!cJSON_IsString(m)) return pt_err(err, PETREL_EINVAL, "'model' must be a string");
        if (!(r->model = dup_n(m->valuestring, strlen(m->valuestring)))) return pt_err(err, PETREL_ENOMEM, "out of memory");
        PARAM(param, "");
    }
    if (chat) {
        if (parse_messages(cJSON_GetObjectItemCaseSensitive(j, "messages"), r, param, err)) return PETREL_EINVAL;
    } else if (parse_prompt(cJSON_GetObjectItemCaseSensitive(j, "prompt"), r, param, err))
        return PETREL_EINVAL;
    if (get_bool(j, "stream", &r->stream, param, err)) return PETREL_EINVAL;
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(j, "stream_options");
    if (so && !cJSON_IsNull(so)) {
        if (!cJSON_IsObject(so)) { PARAM(param, "stream_options"); return pt_err(err, PETREL_EINVAL, "'stream_options' must be an object"); }
        if (get_bool(so, "include_usage", &r->include_usage, param, err)) return PETREL_EINVAL;
    }
    long mt = -1, mct = -1;
    int g1 = 0, g2 = 0;
    if (get_int(j, "max_tokens", 0, 1 << 30, &mt, &g1, param, err)) return PETREL_EINVAL;
    if (get_int(j, "max_completion_tokens", 0, 1 << 30, &mct, &g2, param, err)) return PETREL_EINVAL;
    r->max_tokens = g2 ? mct : g1 ? mt : -1;
    double d;
    int g;
    if (get_num(j, "temperature", 0, 100, &d, &g, param, err)) return PETREL_EINVAL;
    if (g) r->sp.temperature = (float)d;
    if (get_num(j, "top_p", 0, 1, &d, &g, param, err)) return PETREL_EINVAL;
    if (g) {
        if (d <= 0) { PARAM(param, "top_p"); return pt_err(err, PETREL_EINVAL, "'top_p' must be in (0, 1]"); }
        r->sp.top_p = (float)d;
    }
    long k = 0;
    if (get_int(j, "top_k", -1, 1 << 30, &k, &g, param, err)) return PETREL_EINVAL;
    if (g) r->sp.top_k = k < 0 ? 0 : (int)k;
    if (get_num(j, "min_p", 0, 1, &d, &g, param, err)) return PETREL_EINVAL;
    if (g) r->sp.min_p = (float)d;
    if (get_num(j, "presence_penalty", -2, 2, &d, &g, param, err)) return PETREL_EINVAL;
    if (g) r->sp.presence_penalty = (float)d;
    if (get_num(j, "frequency_penalty", -2, 2, &d, &g, param, err)) return PETREL_EINVAL;
    if (g) r->sp.frequency_penalty = (float)d;
    if (get_num(j, "repetition_penalty", 0.01, 100, &d, &g, param, err)) return PETREL_EINVAL;
    if (g) r->sp.repeat_penalty = (float)d;
    if (r->sp.presence_penalty != 0 || r->sp.frequency_penalty != 0 || r->sp.repeat_penalty != 1) r->sp.penalty_last_n = 1024;
    if (get_num(j, "seed", -9.2e18, 1.8e19, &d, &r->seed_set, param, err)) return PETREL_EINVAL;
    if (r->seed_set) {
        if (d != floor(d)) { PARAM(param, "seed"); return pt_err(err, PETREL_EINVAL, "'seed' must be an integer"); }
        r->sp.seed = d < 0 ? (uint64_t)(int64_t)d : (uint64_t)d;
    }
    long n = 1;
    if (get_int(j, "n", 1, SERVE_MAX_N, &n, NULL, param, err)) return PETREL_EINVAL;
    r->n = (int)n;
    if (chat) { /* logprobs: a boolean; top_logprobs: alternatives per token, needs logprobs */
        if (get_bool(j, "logprobs", &r->logprobs, param, err)) return PETREL_EINVAL;
        long tl = 0;
        int g3 = 0;
        if (get_int(j, "top_logprobs", 0, SERVE_MAX_TOP_LOGPROBS, &tl, &g3, param, err)) return PETREL_EINVAL;
        if (g3 && !r->logprobs) { PARAM(param, "top_logprobs"); return pt_err(err, PETREL_EINVAL, "'top_logprobs' needs 'logprobs': true"); }
        r->top_logprobs = (int)tl;
    } else { /* completions: logprobs is the number of alternatives (0: the chosen token only) */
        long lp = 0;
        int g3 = 0;
        if (get_int(j, "logprobs", 0, SERVE_MAX_TOP_LOGPROBS, &lp, &g3, param, err)) return PETREL_EINVAL;
        r->logprobs = g3;
        r->top_logprobs = (int)lp;
    }
    if (parse_tools(j, r, param, err)) return PETREL_EINVAL;
    const cJSON *ptc = cJSON_GetObjectItemCaseSensitive(j, "parallel_tool_calls");
    if (ptc && !cJSON_IsNull(ptc) && !cJSON_IsBool(ptc)) { PARAM(param, "parallel_tool_calls"); return pt_err(err, PETREL_EINVAL, "'parallel_tool_calls' must be a boolean"); }
    if (parse_stop(cJSON_GetObjectItemCaseSensitive(j, "stop"), r, param, err)) return PETREL_EINVAL;
    if (get_bool(j, "ignore_eos", &r->ignore_eos, param, err)) return PETREL_EINVAL;
    if (get_bool(j, "return_token_ids", &r->return_token_ids, param, err)) return PETREL_EINVAL;
    const cJSON *kw = cJSON_GetObjectItemCaseSensitive(j, "chat_template_kwargs");
    if (kw && !cJSON_IsNull(kw)) {
        if (!cJSON_IsObject(kw)) { PARAM(param, "chat_template_kwargs"); return pt_err(err, PETREL_EINVAL, "'chat_template_kwargs' must be an object"); }
        int et = -1;
        if (get_bool(kw, "enable_thinking", &et, param, err)) return PETREL_EINVAL;
        r->enable_thinking = et;
    }
    return 0;
}

int serve_request_parse(const char *body, size_t len, int chat, serve_request *r, char *param, petrel_error *err) {
    memset(r, 0, sizeof *r);
    r->chat = chat;
    r->enable_thinking = -1;
    r->max_tokens = -1;
    r->n = 1;
    sampler_params_default(&r->sp);
    r->sp.temperature = 1.0f; /* OpenAI's defaults */
    r->sp.top_k = 0;
    r->sp.top_p = 1.0f;
    r->sp.min_p = 0;
    r->sp.penalty_last_n = 0;
    PARAM(param, "");
    const char *end = NULL;
    cJSON *j = body && len ? cJSON_ParseWithLengthOpts(body, len, &end, 0) : NULL;
    if (!j) return pt_err(err, PETREL_EINVAL, "the request body is not valid JSON%s", body && len ? "" : " (empty)");
    while (end && end < body + len && (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r')) end++;
    if (end && end < body + len) {
        cJSON_Delete(j);
        return pt_err(err, PETREL_EINVAL, "the request body is not valid JSON (bytes after the value at offset %zu)", (size_t)(end - body));
    }
    int rc = parse_obj(j, chat, r, param, err);
    cJSON_Delete(j);
    if (rc) serve_request_free(r);
    return rc;
}

void serve_request_free(serve_request *r) {
    if (!r) return;
    free(r->model);
    free(r->prompt);
    free(r->prompt_ids);
    cJSON_Delete(r->messages);
    cJSON_Delete(r->tools);
    free(r->tool_name);
    for (int k = 0; k < r->n_stop; k++) free(r->stop[k]);
    int chat = r->chat;
    memset(r, 0, sizeof *r);
    r->chat = chat;
}
