/* synth.h: synthetic models with real shapes and random weights, written straight to a pack.
 *
 * Performance is measured on GLM-5.2-shaped slices (real layer shapes, fewer layers) because
 * the full model does not fit the development machines. Weights are generated row by row from
 * a seed (uniform, std 1/sqrt(fan_in); norms ~1; biases ~0), quantized and streamed to disk by
 * the converter, so memory stays bounded and the same seed gives the same file. */
#ifndef PETREL_MODEL_SYNTH_H
#define PETREL_MODEL_SYNTH_H
#include <stdint.h>

#include "io/convert.h"
#include "petrel.h"

/* config.json text of a GLM-5.2-shaped slice: dense_layers dense layers then moe_layers MoE
 * layers, GLM-5.2's indexer schedule (full at 0, 1, 2, 6, 10, ...). Caller frees. */
char *synth_glm52_config(int dense_layers, int moe_layers);

/* Writes a pack for the model described by config_json with random weights. with_mtp: include
 * the MTP layer when the config has num_nextn_predict_layers > 0. */
int synth_write(const char *config_json, const char *out_path, const convert_opts *o, uint64_t seed, int with_mtp,
                convert_result *res, petrel_error *err);
#endif
