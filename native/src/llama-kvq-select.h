// MiniKV's selection of a prompt's tokens (llama_kvq_params::select_hh / select_recent): what a prompt keeps, and
// the graph nodes that pick and gather the kept tokens.
#pragma once

#include "ggml.h"
#include "llama-kvq.h"

#include <cstdint>
#include <string>

// What a prompt of n_prompt tokens keeps (slot_info::kvq_select): its first n_sink tokens, per KV head its n_hh
// heaviest hitters among the tokens between the sinks and the recent ones, and its last n_recent tokens, in that
// order in the sequence's first n_keep() cells. n_prompt 0: the ubatch selects nothing.
struct llama_kvq_select {
    uint32_t n_prompt = 0;
    uint32_t n_sink   = 0;
    uint32_t n_hh     = 0;
    uint32_t n_recent = 0;
    uint32_t n_observe = 0;  // the prompt's last tokens whose attention picks the heavy hitters (0: all)
    uint32_t part     = 0;   // the sequence's part of the cache

    uint32_t n_keep() const { return n_sink + n_hh + n_recent; }
};

// "" when the shares and the observation window are valid (both shares 0 is off; all three LLAMA_KVQ_FROM_MODEL:
// the model's kvq.select), else why not
std::string llama_kvq_check_select(float hh, float recent, int32_t observe);

// "HH,RW[,N]" (--kv-select, the model's kvq.select): two shares and the observation window (left out: 0); "off" or
// "": none. False when it does not parse; llama_kvq_check_select judges the values.
bool llama_kvq_parse_select(const char * text, float & hh, float & recent, int32_t & observe);

// whether the settings leave the selection to the model's kvq.select
bool llama_kvq_select_from_model(const llama_kvq_params & params);

bool llama_kvq_select_on(float hh, float recent);

// what a prompt keeps under a cache's settings (window and sinks resolved); none for a prompt no longer than the
// window, which the cache keeps whole anyway
llama_kvq_select llama_kvq_select_for(const llama_kvq_params & params, uint32_t n_prompt);

// causal mask of a sequence's first n tokens at its first n cells, F16 [n, n]
ggml_tensor * llama_kvq_causal_mask(ggml_context * ctx, int64_t n);

// the kept token indices I32 [n_keep, n_head_kv] of each KV head, in prompt order, from the attention mass F32
// [n_prompt, n_head_kv] each prompt token received (with an observation window pooled over neighbouring tokens, as
// SnapKV does)
ggml_tensor * llama_kvq_kept_tokens(ggml_context * ctx, ggml_tensor * mass, const llama_kvq_select & sel);

// the kept rows of a prompt's K or V, cur F32 [head_dim, n_head_kv, n_prompt] -> [head_dim, n_head_kv, n_keep]
ggml_tensor * llama_kvq_gather_kept(ggml_context * ctx, ggml_tensor * cur, ggml_tensor * kept);

// the attention mass each token of a selecting ubatch's prompt received, F32 [n_prompt, n_head_kv]: summed over the
// prompt's scoring queries (sel.n_observe) and the query heads of each KV head, from the wide cells its prefill attends (ggml_kvq_score_lse /
// score_add). The prompt fills the first cells of part `part` of n_part parts of kv_size cells.
ggml_tensor * llama_kvq_prompt_mass(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k_wide, ggml_tensor * wide_mask,
        ggml_tensor * k_idxs, int32_t window, int32_t n_sink, int64_t n_kv, int64_t kv_size, int64_t n_part,
        const llama_kvq_select & sel, float scale);
