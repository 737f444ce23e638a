/* lora.c: PEFT LoRA adapters: reading adapter_config.json and adapter_model.safetensors into
 * per-(layer, target, expert) deltas, applying them to rows (unmerged) and merging them into
 * f32 / bf16 bases (lora.h says what they mean). */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <cjson/cJSON.h>
#include <math.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "base/err.h"
#include "base/file.h"
#include "base/pool.h"
#include "io/safetensors.h"
#include "model/lora.h"

const char *const lora_target_names[LT_COUNT] = {
    "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj",
    "self_attn.indexer.wq_b", "self_attn.indexer.wk", "self_attn.indexer.weights_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj",
    "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj",
    "eh_proj", "lm_head"};

/* leaf names PEFT's target_modules may give, and the parameter names of target_parameters */
static const char *const known_leaves[] = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "wq_b", "wk",
                                           "weights_proj", "gate_proj", "up_proj", "down_proj", "eh_proj", "lm_head", NULL};

struct lora_adapter {
    char name[256], path[4096];
    int L, E;                 /* layers with deltas: 0..L (L = the MTP layer); experts per layer */
    lora_mat *mats;           /* [(L + 1) * LT_COUNT], r == 0: none (LT_EXP_* unused here) */
    lora_mat *exp;            /* [(L + 1) * 3 * E] or NULL: routed experts' deltas */
    uint32_t *layer_mask;     /* [L + 1]: bit t set when the layer has a delta on target t */
    float **bufs;             /* owned arrays the mats point into */
    int n_bufs, cap_bufs;
    uint64_t bytes, hash;
    int max_rank;
};

const char *lora_name(const lora_adapter *a) { return a->name; }
uint64_t lora_bytes(const lora_adapter *a) { return a->bytes; }
uint64_t lora_hash(const lora_adapter *a) { return a->hash; }
int lora_max_rank(const lora_adapter *a) { return a->max_rank; }

void lora_free(lora_adapter *a) {
    if (!a) return;
    for (int i = 0; i < a->n_bufs; i++) free(a->bufs[i]);
    free(a->bufs);
    free(a->mats);
    free(a->exp);
    free(a->layer_mask);
    free(a);
}

const lora_mat *lora_get(const lora_adapter *a, int layer, lora_target t, int expert) {
    if (layer < 0 || layer > a->L || !(a->layer_mask[layer] >> t & 1u)) return NULL;
    const lora_mat *m;
    if (t >= LT_EXP_GATE && t <= LT_EXP_DOWN) {
        if (!a->exp || expert < 0 || expert >= a->E) return NULL;
        m = &a->exp[((size_t)layer * 3 + (t - LT_EXP_GATE)) * a->E + expert];
    } else m = &a->mats[(size_t)layer * LT_COUNT + t];
    return m->r ? m : NULL;
}

int lora_set_has(const lora_set *s, int layer, lora_target t) {
    if (!s) return 0;
    for (int i = 0; i < s->n; i++)
        if (layer >= 0 && layer <= s->a[i]->L && (s->a[i]->layer_mask[layer] >> t & 1u)) return 1;
    return 0;
}

void lora_set_finish(lora_set *s) {
    uint64_t h = 0;
    for (int i = 0; i < s->n; i++) {
        uint64_t v[2] = {s->a[i]->hash, 0};
        memcpy(&v[1], &s->scale[i], sizeof s->scale[i]);
        h = XXH3_64bits_withSeed(v, sizeof v, h ^ 0x6c6f7261u);
    }
    s->id = s->n ? (h ? h : 1) : 0;
}

/* ---- applying ----
 * Rows go in blocks of LORA_RB. For a block, phase 1 computes u[row][k] = s * (A_k . x_row)
 * (tasks over groups of ranks), phase 2 adds y_row[o] += u[row][k] Bt_k[o] for k = 0 .. r-1
 * (tasks over chunks of outputs, every row of the block, k ascending). Both phases are parallel
 * on the kernel pool (inline when called from inside a pool task). Each u is one dot and each
 * output element one chain of fmas in k order, whatever the partition, the thread or the number
 * of rows, so a row's result is the same alone or in any batch (row independence). */

#define LORA_RB 16
#define LORA_KG 4     /* ranks per phase-1 task */
#define LORA_OC 1024  /* outputs per phase-2 task (a multiple of 16) */

typedef struct add_job {
    const kn_table *kt;
    const lora_mat *m;
    float sc;
    const float *x;
    float *y;
    int ldx, ldy, nb, o0, on, trans;
    float *u;             /* [nb][r] */
} add_job;

static void u_task(void *ctx, int t, int thread) {
    (void)thread;
    const add_job *j = ctx;
    const lora_mat *m = j->m;
    int k1 = (t + 1) * LORA_KG < m->r ? (t + 1) * LORA_KG : m->r;
    for (int k = t * LORA_KG; k < k1; k++)
        for (int i = 0; i < j->nb; i++) {
            const float *xr = j->x + (size_t)i * j->ldx;
            j->u[i * m->r + k] = j->sc * (j->trans ? kt_dot(j->kt, m->Bt + (size_t)k * m->ldb + j->o0, xr, j->on)
                                                   : kt_dot(j->kt, m->A + (size_t)k * m->in, xr, m->in));
        }
}

static void y_task(void *ctx, int t, int thread) {
    (void)thread;
    const add_job *j = ctx;
    const lora_mat *m = j->m;
    int width = j->trans ? m->in : j->on, c0 = t * LORA_OC, c1 = c0 + LORA_OC < width ? c0 + LORA_OC : width;
    for (int k = 0; k < m->r; k++) {
        const float *b = j->trans ? m->A + (size_t)k * m->in : m->Bt + (size_t)k * m->ldb + j->o0;
        for (int i = 0; i < j->nb; i++) kt_axpy(j->kt, j->y + (size_t)i * j->ldy + c0, j->u[i * m->r + k], b + c0, c1 - c0);
    }
}

static void add_run(const kn_table *kt, const lora_set *s, int layer, lora_target t, int expert, const float *x, int ldx, int n, float *y,
                    int ldy, int o0, int on, int trans) {
    if (!s || n <= 0) return;
    float u[LORA_RB * LORA_MAX_RANK];
    for (int i = 0; i < s->n; i++) {
        const lora_mat *m = lora_get(s->a[i], layer, t, expert);
        if (!m) continue;
        int width = trans ? m->in : on;
        int nu = (m->r + LORA_KG - 1) / LORA_KG, ny = (width + LORA_OC - 1) / LORA_OC;
        for (int r0 = 0; r0 < n; r0 += LORA_RB) {
            add_job j = {kt, m, s->scale[i] * m->scale, x + (size_t)r0 * ldx, y + (size_t)r0 * ldy, ldx, ldy, n - r0 < LORA_RB ? n - r0 : LORA_RB, o0, on,
                         trans, u};
            if (nu == 1) u_task(&j, 0, 0);
            else pool_run(kn_pool(), nu, u_task, &j);
            if (ny == 1) y_task(&j, 0, 0);
            else pool_run(kn_pool(), ny, y_task, &j);
        }
    }
}

void lora_add(const kn_table *kt, const lora_set *s, int layer, lora_target t, int expert, const float *x, int ldx, int n, float *y,
              int ldy, int o0, int on) {
    add_run(kt, s, layer, t, expert, x, ldx, n, y, ldy, o0, on, 0);
}

void lora_add_t(const kn_table *kt, const lora_set *s, int layer, lora_target t, const float *x, int ldx, int n, float *y, int ldy,
                int o0, int on) {
    add_run(kt, s, layer, t, -1, x, ldx, n, y, ldy, o0, on, 1);
}

void lora_add_rows(const kn_table *kt, const lora_set *const *sets, int layer, lora_target t, int expert, const float *x, int ldx, int n,
                   float *y, int ldy) {
    if (!sets) return;
    for (int r0 = 0; r0 < n;) {
        int r1 = r0 + 1;
        while (r1 < n && sets[r1] == sets[r0]) r1++;
        const lora_set *s = sets[r0];
        if (s && s->n && lora_set_has(s, layer, t)) {
            const lora_mat *m = NULL;
            for (int i = 0; i < s->n && !m; i++) m = lora_get(s->a[i], layer, t, expert);
            if (m) lora_add(kt, s, layer, t, expert, x + (size_t)r0 * ldx, ldx, r1 - r0, y + (size_t)r0 * ldy, ldy, 0, m->out);
        }
        r0 = r1;
    }
}

/* ---- loading ---- */

typedef struct ld {
    lora_adapter *a;
    const petrel_config *c;
    const char *dir;
    cJSON *cfg;
    int r_default, rslora;
    double alpha_default;
    const cJSON *rank_pattern, *alpha_pattern;
    petrel_error *err;
} ld;

static float *own(lora_adapter *a, size_t n) {
    if (a->n_bufs == a->cap_bufs) {
        int nc = a->cap_bufs ? 2 * a->cap_bufs : 64;
        float **nb = realloc(a->bufs, sizeof *nb * (size_t)nc);
        if (!nb) return NULL;
        a->bufs = nb;
        a->cap_bufs = nc;
    }
    float *p = malloc(sizeof(float) * (n ? n : 1));
    if (p) a->bufs[a->n_bufs++] = p, a->bytes += sizeof(float) * n;
    return p;
}

static void to_f32(const st_tensor *t, int64_t i, float *out) {
    const uint8_t *p = t->data;
    if (t->dtype == ST_F32) memcpy(out, p + 4 * i, 4);
    else {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        *out = t->dtype == ST_BF16 ? pt_bf16_to_f32(h) : pt_f16_to_f32(h);
    }
}

/* PEFT's get_pattern_key: the first key k of a pattern dict with re.match(r"(.*\.)?(k)$", name). */
static int pattern_lookup(const cJSON *pat, const char *name, double *val, const char *what, const char *dir, petrel_error *err) {
    if (!pat || !cJSON_IsObject(pat)) return 0;
    for (const cJSON *it = pat->child; it; it = it->next) {
        if (!cJSON_IsNumber(it)) return pt_err(err, PETREL_EFORMAT, "%s/adapter_config.json: %s[\"%s\"] is not a number", dir, what, it->string);
        char re[1200];
        snprintf(re, sizeof re, "^(?:.*\\.)?(?:%s)$", it->string);
        int ec;
        PCRE2_SIZE eo;
        pcre2_code *code = pcre2_compile((PCRE2_SPTR)re, PCRE2_ZERO_TERMINATED, 0, &ec, &eo, NULL);
        if (!code) return pt_err(err, PETREL_EFORMAT, "%s/adapter_config.json: %s key \"%s\" is not a valid pattern", dir, what, it->string);
        pcre2_match_data *md = pcre2_match_data_create_from_pattern(code, NULL);
        int hit = md && pcre2_match(code, (PCRE2_SPTR)name, strlen(name), 0, 0, md, NULL) >= 0;
        pcre2_match_data_free(md);
        pcre2_code_free(code);
        if (hit) {
            *val = it->valuedouble;
            return 1;
        }
    }
    return 0;
}

/* Expected [out, in] of a target on a layer; 0 when the model has no such linear there. */
static int target_shape(const petrel_config *c, int l, lora_target t, int *out, int *in) {
    int H = c->hidden_size, NH = c->num_attention_heads, L = c->num_hidden_layers;
    int has_mtp = c->num_nextn_predict_layers > 0;
    if (t == LT_HEAD) return *out = c->vocab_size, *in = H, l == 0;
    if (l < 0 || l > L || (l == L && !has_mtp)) return 0;
    int moe = c->layer_is_moe[l], idx = l < L && c->layer_indexer_full[l];
    switch (t) {
    case LT_Q_A: *out = c->q_lora_rank, *in = H; return 1;
    case LT_Q_B: *out = NH * c->qk_head_dim, *in = c->q_lora_rank; return 1;
    case LT_KV_A: *out = c->kv_lora_rank + c->qk_rope_head_dim, *in = H; return 1;
    case LT_KV_B: *out = NH * (c->qk_nope_head_dim + c->v_head_dim), *in = c->kv_lora_rank; return 1;
    case LT_O: *out = H, *in = NH * c->v_head_dim; return 1;
    case LT_IDX_Q_B: *out = c->index_n_heads * c->index_head_dim, *in = c->q_lora_rank; return idx;
    case LT_IDX_K: *out = c->index_head_dim, *in = H; return idx;
    case LT_IDX_W: *out = c->index_n_heads, *in = H; return idx;
    case LT_GATE: case LT_UP: *out = c->intermediate_size, *in = H; return !moe;
    case LT_DOWN: *out = H, *in = c->intermediate_size; return !moe;
    case LT_SH_GATE: case LT_SH_UP: *out = c->moe_intermediate_size * c->n_shared_experts, *in = H; return moe && c->n_shared_experts > 0;
    case LT_SH_DOWN: *out = H, *in = c->moe_intermediate_size * c->n_shared_experts; return moe && c->n_shared_experts > 0;
    case LT_EXP_GATE: case LT_EXP_UP: *out = c->moe_intermediate_size, *in = H; return moe;
    case LT_EXP_DOWN: *out = H, *in = c->moe_intermediate_size; return moe;
    case LT_EH: *out = H, *in = 2 * H; return l == L;
    default: return 0;
    }
}

/* A module name (without "base_model.model.") to (layer, target, expert); expert -2: PEFT's
 * parameter wrapper of the fused experts (the tensors' shapes say which parameter). */
static int parse_module(const char *mod, const petrel_config *c, int *layer, lora_target *t, int *expert) {
    *expert = -1;
    if (!strcmp(mod, "lm_head")) return *layer = 0, *t = LT_HEAD, 0;
    int l, n = 0;
    if (sscanf(mod, "model.layers.%d.%n", &l, &n) != 1 || n == 0 || l < 0) return -1;
    const char *rest = mod + n;
    *layer = l;
    int e, m = 0;
    if (sscanf(rest, "mlp.experts.%d.%n", &e, &m) == 1 && m > 0) {
        if (e < 0 || e >= c->n_routed_experts) return -1;
        *expert = e;
        const char *leaf = rest + m;
        if (!strcmp(leaf, "gate_proj")) return *t = LT_EXP_GATE, 0;
        if (!strcmp(leaf, "up_proj")) return *t = LT_EXP_UP, 0;
        if (!strcmp(leaf, "down_proj")) return *t = LT_EXP_DOWN, 0;
        return -1;
    }
    if (!strncmp(rest, "mlp.experts", 11)) { /* mlp.experts(.base_layer)* */
        const char *p = rest + 11;
        while (!strncmp(p, ".base_layer", 11)) p += 11;
        if (*p) return -1;
        *expert = -2;
        *t = LT_EXP_GATE;
        return 0;
    }
    for (int k = 0; k < LT_COUNT; k++)
        if (k < LT_EXP_GATE || k > LT_EXP_DOWN)
            if (!strcmp(rest, lora_target_names[k])) return *t = (lora_target)k, 0;
    return -1;
}

static lora_mat *slot(lora_adapter *a, int l, lora_target t, int e) {
    if (t >= LT_EXP_GATE && t <= LT_EXP_DOWN) return &a->exp[((size_t)l * 3 + (t - LT_EXP_GATE)) * a->E + e];
    return &a->mats[(size_t)l * LT_COUNT + t];
}

/* Copies A [r][in] (rows a0 .. a0+r of the tensor) and the B columns {k * bstride + b0} (its first
 * `out` rows) into a mat. */
static int fill(lora_adapter *a, lora_mat *m, const st_tensor *A, const st_tensor *B, int r, int in, int out, int a0, int bstride, int b0,
                float scale) {
    float *Af = own(a, (size_t)r * in), *Bt = own(a, (size_t)r * out);
    if (!Af || !Bt) return -1;
    int64_t bc = B->shape[1];
    for (int k = 0; k < r; k++) {
        for (int i = 0; i < in; i++) to_f32(A, (int64_t)(a0 + k) * in + i, &Af[(size_t)k * in + i]);
        for (int o = 0; o < out; o++) to_f32(B, (int64_t)o * bc + (int64_t)k * bstride + b0, &Bt[(size_t)k * out + o]);
    }
    *m = (lora_mat){r, in, out, out, scale, Af, Bt};
    return 0;
}

static int finite_mat(const lora_mat *m) {
    for (size_t i = 0; i < (size_t)m->r * m->in; i++)
        if (!isfinite(m->A[i])) return 0;
    for (size_t i = 0; i < (size_t)m->r * m->out; i++)
        if (!isfinite(m->Bt[i])) return 0;
    return 1;
}

/* The scale of the module (or parameter) `key` whose tensors hold rank r_tensor (mult: experts
 * sharing lora_A's rows), checked against the config's r / rank_pattern. */
static int scale_for(ld *d, const char *key, int r_tensor, int mult, float *scale) {
    double rv = d->r_default, av = d->alpha_default;
    PT_TRY(pattern_lookup(d->rank_pattern, key, &rv, "rank_pattern", d->dir, d->err));
    PT_TRY(pattern_lookup(d->alpha_pattern, key, &av, "alpha_pattern", d->dir, d->err));
    if ((int)rv * mult != r_tensor)
        return pt_err(d->err, PETREL_EFORMAT, "%s: %s has rank %d in adapter_model.safetensors but adapter_config.json says r = %d", d->dir, key,
                      r_tensor / mult, (int)rv);
    *scale = (float)(d->rslora ? av / sqrt(rv) : av / rv);
    return 0;
}

static int load_pair(ld *d, const char *mod, const st_tensor *A, const st_tensor *B) {
    lora_adapter *a = d->a;
    const petrel_config *c = d->c;
    petrel_error *err = d->err;
    int l, e;
    lora_target t;
    if (parse_module(mod, c, &l, &t, &e) < 0)
        return pt_err(err, PETREL_EFORMAT, "%s: adapter targets %s, which is not a linear of this model (%s; it has %s, %s, ... of "
                                           "model.layers.N)", d->dir, mod, c->model_type, lora_target_names[0], lora_target_names[1]);
    if (A->ndim != 2 || B->ndim != 2) return pt_err(err, PETREL_EFORMAT, "%s: %s: lora_A / lora_B are not matrices", d->dir, mod);
    for (const st_tensor *x = A; x; x = x == A ? B : NULL)
        if (x->dtype != ST_F32 && x->dtype != ST_BF16 && x->dtype != ST_F16)
            return pt_err(err, PETREL_EFORMAT, "%s: %s is %s; adapters are read in F32, BF16 or F16", d->dir, x->name, st_dtype_name(x->dtype));
    if (A->shape[0] != B->shape[1])
        return pt_err(err, PETREL_EFORMAT, "%s: %s: rank mismatch: lora_A has %lld rows, lora_B %lld columns", d->dir, mod, (long long)A->shape[0],
                      (long long)B->shape[1]);
    int rank = (int)A->shape[0];
    char key[512];
    if (e == -2) { /* PEFT's wrapper of a fused 3-D expert tensor: which one, by shape */
        int E = c->n_routed_experts, I = c->moe_intermediate_size, H = c->hidden_size, in = (int)A->shape[1], out = (int)B->shape[0];
        int gu = in == H && out == 2 * I, dn = in == I && out == H;
        if (l < 0 || l > c->num_hidden_layers || !c->layer_is_moe[l] || (!gu && !dn))
            return pt_err(err, PETREL_EFORMAT, "%s: %s: lora_A [%d x %d] / lora_B [%d x %d] fit neither gate_up_proj [%d -> %d] nor down_proj [%d -> %d] "
                                               "of layer %d's experts", d->dir, mod, rank, in, out, rank, H, 2 * I, I, H, l);
        if (rank % E) return pt_err(err, PETREL_EFORMAT, "%s: %s: lora_A's %d rows are not a multiple of the %d experts", d->dir, mod, rank, E);
        int r = rank / E;
        if (r > LORA_MAX_RANK) return pt_err(err, PETREL_EUNSUPPORTED, "%s: %s: rank %d exceeds %d", d->dir, mod, r, LORA_MAX_RANK);
        snprintf(key, sizeof key, "model.layers.%d.mlp.experts.%s", l, gu ? "gate_up_proj" : "down_proj");
        float sc;
        PT_TRY(scale_for(d, key, rank, E, &sc));
        for (int x = 0; x < E; x++) {
            if (gu) {
                lora_mat g, *mg = slot(a, l, LT_EXP_GATE, x), *mu = slot(a, l, LT_EXP_UP, x);
                if (mg->r || mu->r) return pt_err(err, PETREL_EFORMAT, "%s: layer %d expert %d's gate/up is adapted twice", d->dir, l, x);
                if (fill(a, &g, A, B, r, in, 2 * I, x * r, E, x, sc)) return pt_err(err, PETREL_ENOMEM, "out of memory");
                *mg = g;
                mg->out = I;
                *mu = g;
                mu->out = I;
                mu->Bt = g.Bt + I; /* ldb 2I: the up half */
                if (!finite_mat(&g)) return pt_err(err, PETREL_EFORMAT, "%s: %s holds non-finite values", d->dir, mod);
            } else {
                lora_mat *md = slot(a, l, LT_EXP_DOWN, x);
                if (md->r) return pt_err(err, PETREL_EFORMAT, "%s: layer %d expert %d's down_proj is adapted twice", d->dir, l, x);
                if (fill(a, md, A, B, r, in, out, x * r, E, x, sc)) return pt_err(err, PETREL_ENOMEM, "out of memory");
                if (!finite_mat(md)) return pt_err(err, PETREL_EFORMAT, "%s: %s holds non-finite values", d->dir, mod);
            }
        }
        a->layer_mask[l] |= gu ? (1u << LT_EXP_GATE | 1u << LT_EXP_UP) : 1u << LT_EXP_DOWN;
        if (r > a->max_rank) a->max_rank = r;
        return 0;
    }
    int out, in;
    if (!target_shape(c, l, t, &out, &in))
        return pt_err(err, PETREL_EFORMAT, "%s: adapter targets %s, which this model does not have (layer %d of %d%s)", d->dir, mod, l,
                      c->num_hidden_layers, c->layer_is_moe[l < c->num_hidden_layers ? l : 0] ? ", an MoE layer" : "");
    if (A->shape[1] != in || B->shape[0] != out)
        return pt_err(err, PETREL_EFORMAT, "%s: %s: delta is [%lld x %lld] (lora_B rows x lora_A columns) but the model's linear is [%d x %d]: an "
                                           "adapter for another model", d->dir, mod, (long long)B->shape[0], (long long)A->shape[1], out, in);
    if (rank > LORA_MAX_RANK || rank < 1) return pt_err(err, PETREL_EUNSUPPORTED, "%s: %s: rank %d (1..%d read)", d->dir, mod, rank, LORA_MAX_RANK);
    lora_mat *m = slot(a, l, t, e < 0 ? 0 : e);
    if (m->r) return pt_err(err, PETREL_EFORMAT, "%s: %s is adapted twice", d->dir, mod);
    float sc;
    PT_TRY(scale_for(d, mod, rank, 1, &sc));
    if (fill(a, m, A, B, rank, in, out, 0, 1, 0, sc)) return pt_err(err, PETREL_ENOMEM, "out of memory");
    if (!finite_mat(m)) return pt_err(err, PETREL_EFORMAT, "%s: %s holds non-finite values", d->dir, mod);
    a->layer_mask[l] |= 1u << t;
    if (rank > a->max_rank) a->max_rank = rank;
    return 0;
}

/* target_modules / target_parameters name things the model has (leaf names or dotted suffixes
 * of module names); "all-linear" and a regex string are checked through the tensors alone. */
static int check_targets(ld *d) {
    const cJSON *tm = cJSON_GetObjectItemCaseSensitive(d->cfg, "target_modules");
    const cJSON *tp = cJSON_GetObjectItemCaseSensitive(d->cfg, "target_parameters");
    for (const cJSON *lst = tm; lst; lst = lst == tm ? tp : NULL) {
        if (!cJSON_IsArray(lst)) continue;
        for (const cJSON *it = lst->child; it; it = it->next) {
            if (!cJSON_IsString(it)) return pt_err(d->err, PETREL_EFORMAT, "%s/adapter_config.json: a target is not a string", d->dir);
            const char *s = it->valuestring, *leaf = strrchr(s, '.');
            leaf = leaf ? leaf + 1 : s;
            int ok = 0;
            if (lst == tp) ok = !strcmp(leaf, "gate_up_proj") || !strcmp(leaf, "down_proj");
            else
                for (int k = 0; known_leaves[k] && !ok; k++) ok = !strcmp(leaf, known_leaves[k]);
            if (!ok)
                return pt_err(d->err, PETREL_EFORMAT, "%s/adapter_config.json: target %s \"%s\" is not a linear of this model (%s: q_a_proj, q_b_proj, "
                                                      "kv_a_proj_with_mqa, kv_b_proj, o_proj, wq_b, wk, weights_proj, gate_proj, up_proj, down_proj, "
                                                      "eh_proj, lm_head; experts' gate_up_proj, down_proj)",
                              d->dir, lst == tp ? "parameter" : "module", s, d->c->model_type);
        }
    }
    return 0;
}

static int load_config(ld *d) {
    char path[4200], *txt = NULL;
    size_t len;
    snprintf(path, sizeof path, "%s/adapter_config.json", d->dir);
    PT_TRY(pt_read_file(path, 1u << 20, &txt, &len, d->err));
    d->cfg = cJSON_ParseWithLength(txt, len);
    free(txt);
    if (!d->cfg || !cJSON_IsObject(d->cfg)) return pt_err(d->err, PETREL_EFORMAT, "%s: not a JSON object", path);
    const cJSON *pt = cJSON_GetObjectItemCaseSensitive(d->cfg, "peft_type");
    if (!cJSON_IsString(pt) || strcmp(pt->valuestring, "LORA"))
        return pt_err(d->err, PETREL_EUNSUPPORTED, "%s: peft_type %s: only LORA adapters are read", path, cJSON_IsString(pt) ? pt->valuestring : "missing");
    const cJSON *am = cJSON_GetObjectItemCaseSensitive(d->cfg, "auto_mapping");
    const cJSON *bc = am ? cJSON_GetObjectItemCaseSensitive(am, "base_model_class") : NULL;
    if (cJSON_IsString(bc) && strncmp(bc->valuestring, "GlmMoeDsa", 9))
        return pt_err(d->err, PETREL_EFORMAT, "%s: an adapter for %s, not for this model (%s, GlmMoeDsaForCausalLM)", path, bc->valuestring,
                      d->c->model_type);
    static const char *const flags[] = {"use_dora", "fan_in_fan_out", "lora_bias", "use_qalora", NULL};
    for (int i = 0; flags[i]; i++)
        if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(d->cfg, flags[i])))
            return pt_err(d->err, PETREL_EUNSUPPORTED, "%s: %s is set; petrel reads plain LoRA (y = W x + s B A x)", path, flags[i]);
    const cJSON *bias = cJSON_GetObjectItemCaseSensitive(d->cfg, "bias");
    if (cJSON_IsString(bias) && strcmp(bias->valuestring, "none"))
        return pt_err(d->err, PETREL_EUNSUPPORTED, "%s: bias \"%s\": adapters with trained biases are not read", path, bias->valuestring);
    const cJSON *ms = cJSON_GetObjectItemCaseSensitive(d->cfg, "modules_to_save");
    if (cJSON_IsArray(ms) && cJSON_GetArraySize(ms) > 0)
        return pt_err(d->err, PETREL_EUNSUPPORTED, "%s: modules_to_save replaces whole modules; only low-rank deltas are read", path);
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(d->cfg, "r"), *al = cJSON_GetObjectItemCaseSensitive(d->cfg, "lora_alpha");
    if (!cJSON_IsNumber(r) || r->valueint < 1 || r->valueint > LORA_MAX_RANK)
        return pt_err(d->err, PETREL_EFORMAT, "%s: r missing or out of range (1..%d)", path, LORA_MAX_RANK);
    d->r_default = r->valueint;
    d->alpha_default = cJSON_IsNumber(al) ? al->valuedouble : 8.0; /* PEFT's default lora_alpha */
    d->rslora = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(d->cfg, "use_rslora"));
    d->rank_pattern = cJSON_GetObjectItemCaseSensitive(d->cfg, "rank_pattern");
    d->alpha_pattern = cJSON_GetObjectItemCaseSensitive(d->cfg, "alpha_pattern");
    return check_targets(d);
}

static int load_tensors(ld *d) {
    char path[4200];
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", d->dir);
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(path, sizeof path, "%s/adapter_model.bin", d->dir);
        FILE *g = fopen(path, "rb");
        if (g) fclose(g);
        return pt_err(d->err, PETREL_EIO, "%s: no adapter_model.safetensors%s", d->dir,
                      g ? " (adapter_model.bin is a pickle, not read: save with safe_serialization=True)" : "");
    }
    fclose(f);
    st_set *st = NULL;
    PT_TRY(st_open(path, &st, d->err));
    int rc = 0, pairs = 0;
    for (int i = 0; i < st->n_tensors && !rc; i++) {
        const char *nm = st->tensors[i].name, *p;
        if (strstr(nm, "lora_embedding_")) rc = pt_err(d->err, PETREL_EUNSUPPORTED, "%s: %s: embedding adapters are not read", path, nm);
        else if (strstr(nm, "lora_magnitude_vector")) rc = pt_err(d->err, PETREL_EUNSUPPORTED, "%s: %s: DoRA is not read", path, nm);
        else if (!(p = strstr(nm, ".lora_A.")) && !strstr(nm, ".lora_B."))
            rc = pt_err(d->err, PETREL_EFORMAT, "%s: tensor %s is not a LoRA A or B matrix", path, nm);
        else if (p) {
            const char *tail = p + 8;
            const char *dot = strchr(tail, '.');
            if (strcmp(tail, "weight") && !(dot && !strcmp(dot, ".weight")))
                rc = pt_err(d->err, PETREL_EUNSUPPORTED, "%s: %s: only lora_A/lora_B weights are read (no LoRA biases)", path, nm);
            if (rc) break;
            char mod[512], bname[1024];
            const char *m0 = !strncmp(nm, "base_model.model.", 17) ? nm + 17 : nm;
            size_t ml = (size_t)(p - m0);
            if (ml >= sizeof mod) { rc = pt_err(d->err, PETREL_EFORMAT, "%s: tensor name too long", path); break; }
            memcpy(mod, m0, ml);
            mod[ml] = 0;
            snprintf(bname, sizeof bname, "%.*s.lora_B.%s", (int)(p - nm), nm, tail);
            const st_tensor *B = st_find(st, bname);
            if (!B) rc = pt_err(d->err, PETREL_EFORMAT, "%s: %s has no lora_B (%s)", path, nm, bname);
            else rc = load_pair(d, mod, &st->tensors[i], B);
            pairs++;
        } else { /* a B must have its A */
            const char *q = strstr(nm, ".lora_B.");
            char aname[1024];
            snprintf(aname, sizeof aname, "%.*s.lora_A.%s", (int)(q - nm), nm, q + 8);
            if (!st_find(st, aname)) rc = pt_err(d->err, PETREL_EFORMAT, "%s: %s has no lora_A (%s)", path, nm, aname);
        }
    }
    if (!rc && !pairs) rc = pt_err(d->err, PETREL_EFORMAT, "%s: no LoRA tensors", path);
    st_close(st);
    return rc;
}

int lora_load(const char *dir, const char *name, const petrel_config *c, lora_adapter **out, petrel_error *err) {
    *out = NULL;
    lora_adapter *a = calloc(1, sizeof *a);
    if (!a) return pt_err(err, PETREL_ENOMEM, "out of memory");
    snprintf(a->path, sizeof a->path, "%s", dir);
    snprintf(a->name, sizeof a->name, "%s", name && *name ? name : dir);
    a->L = c->num_hidden_layers;
    a->E = c->n_routed_experts;
    a->mats = calloc((size_t)(a->L + 1) * LT_COUNT, sizeof *a->mats);
    a->exp = calloc((size_t)(a->L + 1) * 3 * (size_t)a->E, sizeof *a->exp);
    a->layer_mask = calloc((size_t)a->L + 1, sizeof *a->layer_mask);
    ld d = {.a = a, .c = c, .dir = dir, .err = err};
    int rc = !a->mats || !a->exp || !a->layer_mask ? pt_err(err, PETREL_ENOMEM, "out of memory") : 0;
    if (!rc) rc = load_config(&d);
    if (!rc) rc = load_tensors(&d);
    cJSON_Delete(d.cfg);
    if (rc < 0) {
        lora_free(a);
        for (char *p = err ? err->msg : NULL; p && *p; p++) /* names from the files: one line whatever they hold */
            if ((unsigned char)*p < 0x20 || *p == 0x7f) *p = '?';
        return rc;
    }
    int any_exp = 0;
    for (int l = 0; l <= a->L; l++) any_exp |= (a->layer_mask[l] >> LT_EXP_GATE & 7u) != 0;
    if (!any_exp) {
        free(a->exp);
        a->exp = NULL;
    }
    /* the identity: every delta's numbers and place */
    uint64_t h = XXH3_64bits(c->model_type, strlen(c->model_type));
    for (int l = 0; l <= a->L; l++)
        for (int t = 0; t < LT_COUNT; t++) {
            int ne = t >= LT_EXP_GATE && t <= LT_EXP_DOWN ? a->E : 1;
            for (int e = 0; e < ne; e++) {
                const lora_mat *m = lora_get(a, l, (lora_target)t, e);
                if (!m) continue;
                int64_t tag[4] = {l, t, e, m->r};
                h = XXH3_64bits_withSeed(tag, sizeof tag, h);
                h = XXH3_64bits_withSeed(m->A, sizeof(float) * (size_t)m->r * m->in, h);
                for (int k = 0; k < m->r; k++) h = XXH3_64bits_withSeed(m->Bt + (size_t)k * m->ldb, sizeof(float) * (size_t)m->out, h);
                h = XXH3_64bits_withSeed(&m->scale, sizeof m->scale, h);
            }
        }
    a->hash = h;
    *out = a;
    return 0;
}

/* ---- merging ---- */

static int merge_one(model_w *w, pt_wview *W, const lora_mat *const *ms, const float *sc, int nm, const char *what, int l,
                     petrel_error *err) {
    if (W->qtype != PT_F32 && W->qtype != PT_BF16)
        return pt_err(err, PETREL_EUNSUPPORTED, "--lora-merge: layer %d %s is %s; merging needs f32 or bf16 weights (run the adapter unmerged)", l,
                      what, pt_qtype_name(W->qtype));
    /* the merged matrix is f32 whatever the base (bf16 + a delta is no longer bf16: exact) */
    int64_t rows = W->rows, cols = W->cols, es = W->qtype == PT_F32 ? 4 : 2;
    uint8_t *nb = malloc((size_t)(rows * cols * 4));
    if (!nb) return pt_err(err, PETREL_ENOMEM, "out of memory merging layer %d %s", l, what);
    double *acc = malloc(sizeof(double) * (size_t)cols);
    if (!acc) {
        free(nb);
        return pt_err(err, PETREL_ENOMEM, "out of memory");
    }
    for (int64_t o = 0; o < rows; o++) {
        const uint8_t *src = W->data + o * W->row_bytes;
        for (int64_t i = 0; i < cols; i++) {
            float v;
            if (es == 4) memcpy(&v, src + 4 * i, 4);
            else {
                uint16_t hh;
                memcpy(&hh, src + 2 * i, 2);
                v = pt_bf16_to_f32(hh);
            }
            acc[i] = v;
        }
        for (int j = 0; j < nm; j++) {
            const lora_mat *m = ms[j];
            for (int k = 0; k < m->r; k++) {
                double b = (double)sc[j] * m->scale * m->Bt[(size_t)k * m->ldb + o];
                const float *ar = m->A + (size_t)k * m->in;
                for (int64_t i = 0; i < cols; i++) acc[i] += b * ar[i];
            }
        }
        float *dst = (float *)(nb + o * cols * 4);
        for (int64_t i = 0; i < cols; i++) dst[i] = (float)acc[i];
    }
    free(acc);
    if (w->n_owned == w->cap_owned) {
        int nc = w->cap_owned ? 2 * w->cap_owned : 16;
        void **no = realloc(w->owned, sizeof *no * (size_t)nc);
        if (!no) {
            free(nb);
            return pt_err(err, PETREL_ENOMEM, "out of memory");
        }
        w->owned = no;
        w->cap_owned = nc;
    }
    w->owned[w->n_owned++] = nb;
    W->data = nb;
    W->qtype = PT_F32;
    W->row_bytes = cols * 4;
    W->scale = NULL;
    W->layout = PT_LAYOUT_PLAIN;
    return 0;
}

static pt_wview *target_view(model_w *w, const petrel_config *c, int l, lora_target t, int e) {
    if (t == LT_HEAD) return &w->lm_head;
    if (t == LT_EH) return l == c->num_hidden_layers && w->has_mtp ? &w->eh_proj : NULL;
    layer_w *lw = l < c->num_hidden_layers ? &w->layers[l] : w->has_mtp ? &w->mtp : NULL;
    if (!lw) return NULL;
    switch (t) {
    case LT_Q_A: return &lw->q_a_proj;
    case LT_Q_B: return &lw->q_b_proj;
    case LT_KV_A: return &lw->kv_a_proj_with_mqa;
    case LT_KV_B: return &lw->kv_b_proj;
    case LT_O: return &lw->o_proj;
    case LT_IDX_Q_B: return lw->has_indexer ? &lw->idx_wq_b : NULL;
    case LT_IDX_K: return lw->has_indexer ? &lw->idx_wk : NULL;
    case LT_IDX_W: return lw->has_indexer ? &lw->idx_weights_proj : NULL;
    case LT_GATE: return &lw->gate_proj;
    case LT_UP: return &lw->up_proj;
    case LT_DOWN: return &lw->down_proj;
    case LT_SH_GATE: return lw->has_shared ? &lw->sh_gate : NULL;
    case LT_SH_UP: return lw->has_shared ? &lw->sh_up : NULL;
    case LT_SH_DOWN: return lw->has_shared ? &lw->sh_down : NULL;
    case LT_EXP_GATE: return lw->exp_gate ? &lw->exp_gate[e] : NULL;
    case LT_EXP_UP: return lw->exp_up ? &lw->exp_up[e] : NULL;
    case LT_EXP_DOWN: return lw->exp_down ? &lw->exp_down[e] : NULL;
    default: return NULL;
    }
}

int lora_merge(const lora_set *s, model_w *w, const petrel_config *c, int experts_streamed, uint64_t *bytes, petrel_error *err) {
    *bytes = 0;
    int L = c->num_hidden_layers;
    for (int l = 0; l <= L; l++)
        for (int t = 0; t < LT_COUNT; t++) {
            int ne = t >= LT_EXP_GATE && t <= LT_EXP_DOWN ? c->n_routed_experts : 1;
            if (!lora_set_has(s, l, (lora_target)t)) continue;
            if (ne > 1 && experts_streamed)
                return pt_err(err, PETREL_EUNSUPPORTED, "--lora-merge: layer %d's routed experts stream from the pack; merging needs them resident "
                                                        "(run the adapter unmerged)", l);
            for (int e = 0; e < ne; e++) {
                const lora_mat *ms[LORA_SET_MAX];
                float sc[LORA_SET_MAX];
                int nm = 0;
                for (int i = 0; i < s->n; i++) {
                    const lora_mat *m = lora_get(s->a[i], l, (lora_target)t, e);
                    if (m) ms[nm] = m, sc[nm++] = s->scale[i];
                }
                if (!nm) continue;
                pt_wview *W = target_view(w, c, l, (lora_target)t, e);
                if (!W) return pt_err(err, PETREL_EFORMAT, "--lora-merge: the model has no %s on layer %d", lora_target_names[t], l);
                PT_TRY(merge_one(w, W, ms, sc, nm, lora_target_names[t], l, err));
                *bytes += (uint64_t)W->rows * (uint64_t)W->row_bytes;
                if (t == LT_KV_B) { /* the head views into kv_b_proj */
                    layer_w *lw = l < L ? &w->layers[l] : &w->mtp;
                    int per = c->qk_nope_head_dim + c->v_head_dim;
                    for (int h = 0; h < c->num_attention_heads; h++) {
                        PT_TRY(weights_row_view(w, &lw->kv_b_proj, (int64_t)h * per, c->qk_nope_head_dim, &lw->w_uk[h], err));
                        PT_TRY(weights_row_view(w, &lw->kv_b_proj, (int64_t)h * per + c->qk_nope_head_dim, c->v_head_dim, &lw->w_uv[h], err));
                    }
                }
            }
        }
    return 0;
}
