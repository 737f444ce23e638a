/* cmd_info.c: `petrel info` prints a model's config, its per-layer schedule, the tensor
 * inventory by kind with the memory each part takes, and the KV cache cost per token. */
#include <string.h>

#include "cli.h"
#include "io/colibri.h"
#include "io/pack.h"
#include "model/engine.h"

static const char *usage =
    "usage: petrel info --model DIR\n"
    "Prints the config, the layer schedule, the tensor inventory by kind and memory use.\n" CLI_MODEL_OPTS_HELP;

static void human(uint64_t b, char *buf, size_t n) {
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int i = 0;
    while (v >= 1024 && i < 4) { v /= 1024; i++; }
    snprintf(buf, n, i ? "%.2f %s" : "%.0f %s", v, u[i]);
}

CLI_CMD(info) {
    cli_model_opts mo = {0};
    for (int i = 1; i < argc; i++) {
        int r = cli_model_opt(argc, argv, &i, &mo);
        if (r < 0) return 1;
        if (r) continue;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { fputs(usage, stdout); return 0; }
        return cli_fail("info: unknown option \"%s\" (petrel info --help)", argv[i]);
    }
    if (!mo.model) return cli_fail("info: --model is required");
    petrel_error err = {0};
    petrel_engine *eng;
    mo.open.inspect_only = 1; /* a description: no copy of gigabytes of weights */
    if (cli_engine_open(&mo, &eng, &err)) return cli_fail_err("info", &err);
    const petrel_config *c = &eng->cfg;
    const model_w *w = &eng->w;
    char b0[32];
    printf("model            %s\n", mo.model);
    printf("model_type       %s\n", c->model_type);
    printf("vocab_size %d, hidden_size %d, num_hidden_layers %d\n", c->vocab_size, c->hidden_size, c->num_hidden_layers);
    printf("attention        MLA: %d heads, q_lora_rank %d, kv_lora_rank %d, qk_nope %d + qk_rope %d, v_head_dim %d\n",
           c->num_attention_heads, c->q_lora_rank, c->kv_lora_rank, c->qk_nope_head_dim, c->qk_rope_head_dim, c->v_head_dim);
    printf("rope             theta %g, %s (indexer %s)\n", c->rope_theta, c->rope_interleave ? "interleaved" : "half-split",
           c->indexer_rope_interleave ? "interleaved" : "half-split");
    printf("indexer          DSA: %d heads x %d, index_topk %d\n", c->index_n_heads, c->index_head_dim, c->index_topk);
    printf("mlp              dense intermediate %d; MoE %d experts (top-%d, %d groups, top-%d groups), expert width %d, %d shared, scale %g%s\n",
           c->intermediate_size, c->n_routed_experts, c->num_experts_per_tok, c->n_group, c->topk_group, c->moe_intermediate_size,
           c->n_shared_experts, c->routed_scaling_factor, c->norm_topk_prob ? ", normalized" : "");
    printf("rms_norm_eps     %g; max_position_embeddings %d\n", c->rms_norm_eps, c->max_position_embeddings);
    printf("eos ids         ");
    for (int i = 0; i < c->n_eos; i++) printf(" %d", c->eos_token_id[i]);
    printf("\n");
    if (eng->coli)
        printf("format           colibri artifact: %d main + %d mtp + %d indexer shards; %d matrices zero-copy, %d converted\n", eng->coli->n_main,
               eng->coli->n_mtp, eng->coli->n_idx, eng->coli->n_zero_copy, eng->coli->n_converted);
    if (eng->no_indexer) printf("indexer weights  ABSENT: contexts are limited to index_topk = %d tokens\n", c->index_topk);
    if (c->fp8_block_rows) printf("quantization     fp8 e4m3, %dx%d block scales\n", c->fp8_block_rows, c->fp8_block_cols);
    printf("layers           (D = dense MLP, M = MoE; F = own indexer, s = shared selection)\n                 ");
    int nfull = 0, nmoe = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        printf("%c%c ", c->layer_is_moe[l] ? 'M' : 'D', c->layer_indexer_full[l] ? 'F' : 's');
        nfull += c->layer_indexer_full[l];
        nmoe += c->layer_is_moe[l];
        if (l % 20 == 19 && l + 1 < c->num_hidden_layers) printf("\n                 ");
    }
    printf("\n                 %d dense + %d MoE layers; %d full indexer layers, %d shared\n", c->num_hidden_layers - nmoe, nmoe, nfull,
           c->num_hidden_layers - nfull);
    if (w->has_mtp) printf("mtp              present: layer %d (enorm, hnorm, eh_proj, shared_head.norm, MoE decoder layer%s)\n",
                           c->num_hidden_layers, w->mtp.has_indexer ? " with indexer" : ", no indexer");
    else printf("mtp              %s\n", c->num_nextn_predict_layers ? "declared in config.json but its tensors are absent" : "none");
    if (eng->pack) { /* what run / chat take from the pack itself */
        const pack *p = eng->pack;
        printf("stored files     ");
        for (int i = 0; i < p->n_files; i++) {
            human(p->files[i].bytes, b0, sizeof b0);
            printf("%s%s (%s)", i ? ", " : "", p->files[i].name, b0);
        }
        if (p->generation_config_json) printf("%sgeneration_config.json", p->n_files ? ", " : "");
        if (!p->n_files && !p->generation_config_json) printf("none");
        int tmpl = pack_find_file(p, "chat_template.jinja") || pack_find_file(p, "tokenizer_config.json");
        printf("\n                 %s\n", pack_find_file(p, "tokenizer.json") && tmpl ? "run and chat need no --tokenizer / --template"
                                       : "run needs --tokenizer, chat --tokenizer and --template (the pack does not store them)");
    }
    printf("\ntensors by kind                  count        memory\n");
    uint64_t total = 0;
    char b[32];
    for (int k = 0; k < WK_COUNT; k++) {
        if (!w->kind_count[k]) continue;
        human(w->kind_bytes[k], b, sizeof b);
        printf("  %-28s %7d  %12s\n", weight_kind_names[k], w->kind_count[k], b);
        total += w->kind_bytes[k];
    }
    human(total, b, sizeof b);
    printf("  %-28s %7s  %12s\n", "total", "", b);
    uint64_t kv = 0;
    for (int l = 0; l < c->num_hidden_layers; l++)
        kv += (uint64_t)(c->kv_lora_rank + c->qk_rope_head_dim + (c->layer_indexer_full[l] ? c->index_head_dim : 0)) * 4;
    human(kv, b, sizeof b);
    printf("\nkv cache         %s per token (f32 latent c + k_pe, indexer keys on full layers)\n", b);
    return cli_engine_close("info", eng, 0);
}
