// What upstream's cache files call of pykvq's cache code besides llama_kv_cache's own kvq_ members.
#pragma once

#include "llama-memory.h"

#include "ggml.h"

#include <cstdint>

struct llama_hparams;
struct llama_model;

// The sliding-window half of an iSWA cache (Gemma 2/3, gpt-oss, Cohere 2): its types (llama_kvq_set_swa_types,
// else the context's), and whether it must hold the whole context: a kivi layer keeps each token of a sequence in
// its own cell, so cells that leave the window are masked, never reused. Throws std::runtime_error when a layer
// reads another layer's kivi cache (shared KV layers).
struct llama_kvq_swa_plan {
    ggml_type type_k;
    ggml_type type_v;
    bool      full;
};

llama_kvq_swa_plan llama_kvq_plan_swa_cache(const llama_model & model, const llama_hparams & hparams, ggml_type type_k,
        ggml_type type_v, const llama_memory_i::layer_filter_cb & filter_swa,
        const llama_memory_i::layer_reuse_cb & reuse);
