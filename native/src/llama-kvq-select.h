// MiniKV's selection of a prompt's tokens (llama_kvq_params::select_hh / select_recent): what a prompt keeps, and
// the graph nodes that pick and gather the kept tokens.
#pragma once

#include "ggml.h"
#include "llama-kvq.h"

#include <cstdint>
#include <string>

// What a prompt of n_prompt tokens keeps (slot_info::kvq_select): its first n_sink tokens, per KV head its
// heaviest hitters among the tokens between the sinks and the recent ones (n_hh in the cache's bottom layer,
// falling linearly to n_hh_top in its top one: MiniKV's pyramid) and its last n_recent tokens, in the sequence's
// first n_keep() cells, the bottom layer's count. A layer that keeps fewer leaves the cells right after the sinks
// dead (n_dead), so that every layer's recent tokens sit in the same cells. n_prompt 0: the ubatch selects nothing.
struct llama_kvq_select {
    uint32_t n_prompt = 0;
    uint32_t n_sink   = 0;
    uint32_t n_hh     = 0;
    uint32_t n_hh_top = 0;
    uint32_t n_recent = 0;
    uint32_t n_observe = 0;  // the prompt's last tokens whose attention picks the heavy hitters (0: all)
    uint32_t part     = 0;   // the sequence's part of the cache

    uint32_t n_keep() const { return n_sink + n_hh + n_recent; }

    // heavy hitters layer ikv of a cache of n_layer layers keeps
    uint32_t n_hh_at(uint32_t ikv, uint32_t n_layer) const;

    // dead cells after the sinks in layer ikv
    uint32_t n_dead(uint32_t ikv, uint32_t n_layer) const { return n_hh - n_hh_at(ikv, n_layer); }
};

// "" when the shares, the observation window and the pyramid depth are valid (both shares 0 is off; all four
// LLAMA_KVQ_FROM_MODEL: the model's kvq.select), else why not
std::string llama_kvq_check_select(float hh, float recent, int32_t observe, float depth);

// "HH,RW[,N[,D]]" (--kv-select, the model's kvq.select): two shares, the observation window (left out: 0) and the
// pyramid depth (left out: 1); "off" or "": none. False when it does not parse; llama_kvq_check_select judges the
// values.
bool llama_kvq_parse_select(const char * text, float & hh, float & recent, int32_t & observe, float & depth);

// whether the settings leave the selection to the model's kvq.select
bool llama_kvq_select_from_model(const llama_kvq_params & params);

bool llama_kvq_select_on(float hh, float recent);

// what a prompt keeps under a cache's settings (window and sinks resolved); none for a prompt no longer than the
// window, which the cache keeps whole anyway
llama_kvq_select llama_kvq_select_for(const llama_kvq_params & params, uint32_t n_prompt);

// causal mask of a sequence's first n tokens at its first n cells, F16 [n, n]
ggml_tensor * llama_kvq_causal_mask(ggml_context * ctx, int64_t n);

// the kept token indices I32 [n_keep, n_head_kv] of each KV head of layer ikv of n_layer, in prompt order, from the
// attention mass F32 [n_prompt, n_head_kv] each prompt token received (with an observation window, a token also gets
// the mass of the tokens just before it: what follows a token the window looks at); a dead cell holds the token
// after it, so that K tiles span what they would without it
ggml_tensor * llama_kvq_kept_tokens(ggml_context * ctx, ggml_tensor * mass, const llama_kvq_select & sel, uint32_t ikv,
        uint32_t n_layer);

// the kept rows of a prompt's K or V, cur F32 [head_dim, n_head_kv, n_prompt] -> [head_dim, n_head_kv, n_keep]
ggml_tensor * llama_kvq_gather_kept(ggml_context * ctx, ggml_tensor * cur, ggml_tensor * kept);

// the attention mass each token of a selecting ubatch's prompt received, F32 [n_prompt, n_head_kv]: summed over the
// prompt's scoring queries (sel.n_observe) and the query heads of each KV head, from the wide cells its prefill attends (ggml_kvq_score_lse /
// score_add). The prompt fills the first cells of part `part` of n_part parts of kv_size cells.
ggml_tensor * llama_kvq_prompt_mass(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k_wide, ggml_tensor * wide_mask,
        ggml_tensor * k_idxs, int32_t window, int32_t n_sink, int64_t n_kv, int64_t kv_size, int64_t n_part,
        const llama_kvq_select & sel, float scale);
