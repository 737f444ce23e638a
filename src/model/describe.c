/* describe.c: petrel_engine_describe, the text of `petrel info`: a model's config, its
 * per-layer schedule, where its weights came from (colibri shards, a pack's stored files), the
 * tensor inventory by kind with the memory each part takes, and the KV cache cost per token. */
#include <stdio.h>
#include <stdlib.h>

#include "base/err.h"
#include "base/sbuf.h"
#include "io/colibri.h"
#include "io/pack.h"
#include "model/engine.h"

static void human(uint64_t b, char *buf, size_t n) {
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int i = 0;
    while (v >= 1024 && i < 4) { v /= 1024; i++; }
    snprintf(buf, n, i ? "%.2f %s" : "%.0f %s", v, u[i]);
}

int petrel_engine_describe(const petrel_engine *e, char **out, petrel_error *err) {
    sbuf s = {0};
    const petrel_config *c = &e->cfg;
    const model_w *w = &e->w;
    char b0[32];
    sb_printf(&s, "model_type       %s\n", c->model_type);
    sb_printf(&s, "vocab_size %d, hidden_size %d, num_hidden_layers %d\n", c->vocab_size, c->hidden_size, c->num_hidden_layers);
    sb_printf(&s, "attention        MLA: %d heads, q_lora_rank %d, kv_lora_rank %d, qk_nope %d + qk_rope %d, v_head_dim %d\n",
              c->num_attention_heads, c->q_lora_rank, c->kv_lora_rank, c->qk_nope_head_dim, c->qk_rope_head_dim, c->v_head_dim);
    sb_printf(&s, "rope             theta %g, %s (indexer %s)\n", c->rope_theta, c->rope_interleave ? "interleaved" : "half-split",
              c->indexer_rope_interleave ? "interleaved" : "half-split");
    sb_printf(&s, "indexer          DSA: %d heads x %d, index_topk %d\n", c->index_n_heads, c->index_head_dim, c->index_topk);
    sb_printf(&s, "mlp              dense intermediate %d; MoE %d experts (top-%d, %d groups, top-%d groups), expert width %d, %d shared, scale %g%s\n",
              c->intermediate_size, c->n_routed_experts, c->num_experts_per_tok, c->n_group, c->topk_group, c->moe_intermediate_size,
              c->n_shared_experts, c->routed_scaling_factor, c->norm_topk_prob ? ", normalized" : "");
    sb_printf(&s, "rms_norm_eps     %g; max_position_embeddings %d\n", c->rms_norm_eps, c->max_position_embeddings);
    sb_printf(&s, "eos ids         ");
    for (int i = 0; i < c->n_eos; i++) sb_printf(&s, " %d", c->eos_token_id[i]);
    sb_add(&s, "\n", 1);
    if (e->coli)
        sb_printf(&s, "format           colibri artifact: %d main + %d mtp + %d indexer shards; %d matrices zero-copy, %d converted\n", e->coli->n_main,
                  e->coli->n_mtp, e->coli->n_idx, e->coli->n_zero_copy, e->coli->n_converted);
    if (e->no_indexer) sb_printf(&s, "indexer weights  ABSENT: contexts are limited to index_topk = %d tokens\n", c->index_topk);
    if (c->fp8_block_rows) sb_printf(&s, "quantization     fp8 e4m3, %dx%d block scales\n", c->fp8_block_rows, c->fp8_block_cols);
    sb_printf(&s, "layers           (D = dense MLP, M = MoE; F = own indexer, s = shared selection)\n                 ");
    int nfull = 0, nmoe = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        sb_printf(&s, "%c%c ", c->layer_is_moe[l] ? 'M' : 'D', c->layer_indexer_full[l] ? 'F' : 's');
        nfull += c->layer_indexer_full[l];
        nmoe += c->layer_is_moe[l];
        if (l % 20 == 19 && l + 1 < c->num_hidden_layers) sb_printf(&s, "\n                 ");
    }
    sb_printf(&s, "\n                 %d dense + %d MoE layers; %d full indexer layers, %d shared\n", c->num_hidden_layers - nmoe, nmoe, nfull,
              c->num_hidden_layers - nfull);
    if (w->has_mtp) sb_printf(&s, "mtp              present: layer %d (enorm, hnorm, eh_proj, shared_head.norm, MoE decoder layer%s)\n",
                              c->num_hidden_layers, w->mtp.has_indexer ? " with indexer" : ", no indexer");
    else sb_printf(&s, "mtp              %s\n", c->num_nextn_predict_layers ? "declared in config.json but its tensors are absent" : "none");
    if (e->pack) { /* what run / chat take from the pack itself */
        const pack *p = e->pack;
        sb_printf(&s, "stored files     ");
        for (int i = 0; i < p->n_files; i++) {
            human(p->files[i].bytes, b0, sizeof b0);
            sb_printf(&s, "%s%s (%s)", i ? ", " : "", p->files[i].name, b0);
        }
        if (p->generation_config_json) sb_printf(&s, "%sgeneration_config.json", p->n_files ? ", " : "");
        if (!p->n_files && !p->generation_config_json) sb_printf(&s, "none");
        int tmpl = pack_find_file(p, "chat_template.jinja") || pack_find_file(p, "tokenizer_config.json");
        sb_printf(&s, "\n                 %s\n", pack_find_file(p, "tokenizer.json") && tmpl ? "run and chat need no --tokenizer / --template"
                  : "run needs --tokenizer, chat --tokenizer and --template (the pack does not store them)");
    }
    sb_printf(&s, "\ntensors by kind                  count        memory\n");
    uint64_t total = 0;
    char b[32];
    for (int k = 0; k < WK_COUNT; k++) {
        if (!w->kind_count[k]) continue;
        human(w->kind_bytes[k], b, sizeof b);
        sb_printf(&s, "  %-28s %7d  %12s\n", weight_kind_names[k], w->kind_count[k], b);
        total += w->kind_bytes[k];
    }
    human(total, b, sizeof b);
    sb_printf(&s, "  %-28s %7s  %12s\n", "total", "", b);
    uint64_t kv = 0;
    for (int l = 0; l < c->num_hidden_layers; l++)
        kv += (uint64_t)(c->kv_lora_rank + c->qk_rope_head_dim + (c->layer_indexer_full[l] ? c->index_head_dim : 0)) * 4;
    human(kv, b, sizeof b);
    sb_printf(&s, "\nkv cache         %s per token (f32 latent c + k_pe, indexer keys on full layers)\n", b);
    if (s.oom || !s.p) {
        free(s.p);
        *out = NULL;
        return pt_err(err, PETREL_ENOMEM, "out of memory describing the model");
    }
    *out = s.p;
    return 0;
}
