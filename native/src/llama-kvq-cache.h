// What upstream's cache files call of pykvq's cache code besides llama_kv_cache's own kvq_ members.
#pragma once

#include "llama-kvq-select.h"
#include "llama-memory.h"

#include "ggml.h"

#include <cstdint>

struct llama_hparams;
struct llama_model;

// The sliding-window half of an iSWA cache (Gemma 2/3, gpt-oss, Cohere 2): its types (llama_kvq_set_swa_types,
// else the context's), and whether a layer of it is kivi.
struct llama_kvq_swa_plan {
    ggml_type type_k;
    ggml_type type_v;
    bool      kivi;
};

llama_kvq_swa_plan llama_kvq_plan_swa_cache(const llama_model & model, const llama_hparams & hparams, ggml_type type_k,
        ggml_type type_v, const llama_memory_i::layer_filter_cb & filter_swa);

// Cells per sequence of a kivi sliding-window cache: a kivi layer keeps a sequence's k-th token in its part's k-th
// cell, so cells that leave the window are not reused in place; whole rings of them leave the front of the part
// instead (llama_kv_cache::kvq_drop_dead), and the part holds the window, a ubatch and two rings (what a rollback
// may still need, and what one drop frees at least).
uint32_t llama_kvq_swa_part_cells(const llama_model & model, uint32_t n_ubatch, uint32_t kv_size);

// Cells that leave the front of a sliding-window part before a ubatch goes in (slot_info::kvq_drops): cells
// [first + n_drop, first + n_held) move to [first, ...), data and metadata.
struct llama_kvq_drop {
    uint32_t strm;
    uint32_t first;
    uint32_t n_drop;
    uint32_t n_held;
};

// Graph nodes a context's graphs may need on top of upstream's budget: prompt selection adds some to every layer
// (a few hundred bytes of host memory each, so every context gets them)
uint32_t llama_kvq_graph_extra_nodes(const llama_model & model);

// Whether a context's memory has kivi layers: its KV cache, either half of an iSWA one, or a hybrid's
bool llama_kvq_memory_has_kivi(const llama_memory_i * mem);
