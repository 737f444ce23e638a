/* none.c: the CUDA backend's seam (cu.h) in a build without it (the default `make`): no GPUs,
 * and every call says how to get one. `make cuda` links src/cuda/model.cu + kernels.cu instead. */
#include <string.h>

#include "base/err.h"
#include "cuda/cu.h"

#define NO_CUDA "this petrel was built without CUDA (build build/petrel-cuda with `make cuda`)"

int cu_built(void) { return 0; }
int cu_device_count(void) { return 0; }
int cu_model_open(const struct petrel_engine *e, int device, uint64_t vram_budget, int vram_expert_slots, int host_experts, cu_model **out,
                  petrel_error *err) {
    (void)e, (void)device, (void)vram_budget, (void)vram_expert_slots, (void)host_experts;
    *out = NULL;
    return pt_err(err, PETREL_EUNSUPPORTED, "--device cuda: " NO_CUDA);
}
void cu_model_close(cu_model *m) { (void)m; }
const char *cu_model_describe(const cu_model *m) { (void)m; return ""; }
int cu_model_chunk_rows(const cu_model *m) { (void)m; return 0; }
uint64_t cu_model_weight_bytes(const cu_model *m) { (void)m; return 0; }
int cu_model_stacks(const cu_model *m) { (void)m; return 0; }
void cu_model_use_stacks(cu_model *m, int on) { (void)m, (void)on; }
void cu_model_use_mapped_logits(cu_model *m, int on) { (void)m, (void)on; }
void cu_model_use_graphs(cu_model *m, int on) { (void)m, (void)on; }
void cu_model_use_pdl(cu_model *m, int on) { (void)m, (void)on; }
void cu_model_use_fork(cu_model *m, int on) { (void)m, (void)on; }
void cu_model_use_bf16_experts(cu_model *m, int form) { (void)m, (void)form; }
void cu_model_use_bf16_dense(cu_model *m, int on) { (void)m, (void)on; }
void cu_model_use_expanded_attn(cu_model *m, int form) { (void)m, (void)form; }
unsigned long long cu_model_fork_count(const cu_model *m) { (void)m; return 0; }
unsigned long long cu_model_expanded_count(const cu_model *m) { (void)m; return 0; }
int cu_model_graph_count(const cu_model *m) { (void)m; return 0; }
void cu_model_tier_stats(const cu_model *m, cu_tier_stats *out) {
    (void)m;
    memset(out, 0, sizeof *out);
}
int cu_kv_create(cu_model *m, int cap, cu_kv **out, petrel_error *err) {
    (void)m, (void)cap;
    *out = NULL;
    return pt_err(err, PETREL_EUNSUPPORTED, NO_CUDA);
}
void cu_kv_free(cu_kv *k) { (void)k; }
int cu_kv_copy(cu_model *m, cu_kv *dst, const cu_kv *src, int n, petrel_error *err) {
    (void)m, (void)dst, (void)src, (void)n;
    return pt_err(err, PETREL_EUNSUPPORTED, NO_CUDA);
}
int cu_forward(cu_model *m, const cu_seg *seg, int nseg, const int32_t *ids, int T, float *logits, const int32_t *lrows, int nlog, float *hidden,
               uint64_t *experts_run, petrel_error *err) {
    (void)m, (void)seg, (void)nseg, (void)ids, (void)T, (void)logits, (void)lrows, (void)nlog, (void)hidden, (void)experts_run;
    return pt_err(err, PETREL_EUNSUPPORTED, NO_CUDA);
}
double cu_hbm_probe(cu_model *m, uint64_t bytes) {
    (void)m, (void)bytes;
    return 0;
}
double cu_tc_int8_peak(cu_model *m) { (void)m; return 0; }
double cu_tc_bf16_peak(cu_model *m) { (void)m; return 0; }
double cu_model_profile_experts_ms(const cu_model *m) { (void)m; return 0; }
double cu_h2d_probe(cu_model *m, uint64_t bytes) {
    (void)m, (void)bytes;
    return 0;
}
void cu_model_profile(cu_model *m, int on) { (void)m, (void)on; }
void cu_model_profile_report(const cu_model *m, char *buf, size_t n) {
    (void)m;
    if (n) buf[0] = 0;
}
int cu_matmul_check(const pt_wview *W, const float *x, int n, float *y, int path, petrel_error *err) {
    (void)W, (void)x, (void)n, (void)y, (void)path;
    return pt_err(err, PETREL_EUNSUPPORTED, NO_CUDA);
}
int cu_swiglu_check(const pt_wview *Wg, const pt_wview *Wu, const float *x, int n, float *y, int slots, petrel_error *err) {
    (void)Wg, (void)Wu, (void)x, (void)n, (void)y, (void)slots;
    return pt_err(err, PETREL_EUNSUPPORTED, NO_CUDA);
}
int cu_head_check(const pt_wview *kvb, const float *x, int T, int NH, int Dn, int Dr, int Dv, int uv, int tc, float *y, petrel_error *err) {
    (void)kvb, (void)x, (void)T, (void)NH, (void)Dn, (void)Dr, (void)Dv, (void)uv, (void)tc, (void)y;
    return pt_err(err, PETREL_EUNSUPPORTED, NO_CUDA);
}
int cu_dsa_scores_check(const float *q, const float *w, const float *keys, int T, int Hi, int Di, int n, float *score, petrel_error *err) {
    (void)q, (void)w, (void)keys, (void)T, (void)Hi, (void)Di, (void)n, (void)score;
    return pt_err(err, PETREL_EUNSUPPORTED, NO_CUDA);
}
int cu_tf32_split_check(const float *x, int n, uint32_t *out, petrel_error *err) {
    (void)x, (void)n, (void)out;
    return pt_err(err, PETREL_EUNSUPPORTED, NO_CUDA);
}
int cu_topk_check(const float *v, int n, int k, int32_t *idx, petrel_error *err) {
    (void)v, (void)n, (void)k, (void)idx;
    return pt_err(err, PETREL_EUNSUPPORTED, NO_CUDA);
}
int cu_swiglu_bf16_check(const float *g, const float *u, int n, int cols, int q, uint16_t *fused, uint16_t *twin, uint16_t *rev, petrel_error *err) {
    (void)g, (void)u, (void)n, (void)cols, (void)q, (void)fused, (void)twin, (void)rev;
    return pt_err(err, PETREL_EUNSUPPORTED, NO_CUDA);
}
int cu_moe_sort_check(const int32_t *idx, int T, int K, int E, int tm, int32_t *list, int32_t *tiles, int *ntiles, petrel_error *err) {
    (void)idx, (void)T, (void)K, (void)E, (void)tm, (void)list, (void)tiles, (void)ntiles;
    return pt_err(err, PETREL_EUNSUPPORTED, NO_CUDA);
}
int cu_attn_check(const float *q, const float *qt, const float *kv, int cap, const int32_t *sel, int ld_sel, const int *seln, int T, int NH, int Dn,
                  int Dr, int Rkv, float scale, int flash, float *lat, petrel_error *err) {
    (void)q, (void)qt, (void)kv, (void)cap, (void)sel, (void)ld_sel, (void)seln, (void)T, (void)NH, (void)Dn, (void)Dr, (void)Rkv, (void)scale;
    (void)flash, (void)lat;
    return pt_err(err, PETREL_EUNSUPPORTED, NO_CUDA);
}
int cu_nt_check(const float *A, int M, const float *B, int N, int K, float *D, petrel_error *err) {
    (void)A, (void)M, (void)B, (void)N, (void)K, (void)D;
    return pt_err(err, PETREL_EUNSUPPORTED, NO_CUDA);
}
int cu_attn_expanded_check(const pt_wview *kvb, const float *q, const float *kv, int pos0, int T, int NH, int Dn, int Dr, int Dv, float scale, int form,
                           float *o, petrel_error *err) {
    (void)kvb, (void)q, (void)kv, (void)pos0, (void)T, (void)NH, (void)Dn, (void)Dr, (void)Dv, (void)scale, (void)form, (void)o;
    return pt_err(err, PETREL_EUNSUPPORTED, NO_CUDA);
}
int cu_route_check(const float *lg, const float *bias, int T, int E, int K, int n_group, int topk_group, int norm, float scale, int regs,
                   int32_t *idx, float *wts, petrel_error *err) {
    (void)lg, (void)bias, (void)T, (void)E, (void)K, (void)n_group, (void)topk_group, (void)norm, (void)scale, (void)regs, (void)idx, (void)wts;
    return pt_err(err, PETREL_EUNSUPPORTED, NO_CUDA);
}
