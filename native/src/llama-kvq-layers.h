// Per-layer KV cache types, clip ratios, rotation and V's dither (llama-kvq-layers.cpp has the spec language).
#pragma once

#include "ggml.h"

#include <string>
#include <vector>

struct llama_kvq_layer_types {
    std::vector<ggml_type> k;
    std::vector<ggml_type> v;
};

// the types a KV cache can hold, as the tools list them; a name's type, GGML_TYPE_COUNT when none
std::string llama_kvq_cache_type_names(void);
ggml_type   llama_kvq_cache_type_by_name(const std::string & name);

// throws std::invalid_argument naming the part of the spec that does not parse; "" and "none" are valid
void llama_kvq_check_layer_spec(const std::string & spec);

// the K and V type of each of n_layer layers; type_k/type_v where the spec is "" or "none" or leaves a part
// out. Throws std::invalid_argument naming the offending part (bounds, overlaps, gaps).
llama_kvq_layer_types llama_kvq_resolve_layer_spec(const std::string & spec, int32_t n_layer, ggml_type type_k,
                                                   ggml_type type_v);

// the process-wide spec set with llama_kvq_set_layer_types ("" when none)
std::string llama_kvq_layer_spec(void);

// SKVQ's clip ratio of each layer's K and V (1: no clipping)
struct llama_kvq_layer_clips {
    std::vector<float> k;
    std::vector<float> v;
};

// as for the types: "" and "none" are valid (no clipping anywhere), a part left out is not clipped
void                  llama_kvq_check_clip_spec(const std::string & spec);
llama_kvq_layer_clips llama_kvq_resolve_clip_spec(const std::string & spec, int32_t n_layer);

// the process-wide spec set with llama_kvq_set_clip ("" when none)
std::string llama_kvq_clip_spec(void);

// whether upstream's Hadamard rotation turns each layer's K and V
struct llama_kvq_layer_rotation {
    std::vector<bool> k;
    std::vector<bool> v;
};

// "on", "off" (or "none") for every layer, or the per-layer form with on/off values, a part left out off; ""
// (no setting) is `fallback` everywhere
void                     llama_kvq_check_rotation_spec(const std::string & spec);
llama_kvq_layer_rotation llama_kvq_resolve_rotation_spec(const std::string & spec, int32_t n_layer, bool fallback);

// the process-wide spec set with llama_kvq_set_rotation ("" when none)
std::string llama_kvq_rotation_spec(void);

// the spread of V's dithered rounding in each layer (ggml_kvq_store_set_v_dither; 0: nearest): "" and "none" (0
// everywhere), a bare spread in [0, 1] for every layer, or the per-layer form with a v: part only (every layer named)
void               llama_kvq_check_dither_spec(const std::string & spec);
std::vector<float> llama_kvq_resolve_dither_spec(const std::string & spec, int32_t n_layer);

// the process-wide spec set with llama_kvq_set_dither ("" when none)
std::string llama_kvq_dither_spec(void);
