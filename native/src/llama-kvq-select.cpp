#include "llama-kvq-select.h"

#include "ggml-kvq.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>

#define KVQ_SELECT_LEND 8

std::string llama_kvq_check_select(float hh, float recent, int32_t observe, float depth) {
    if (hh == LLAMA_KVQ_FROM_MODEL && recent == LLAMA_KVQ_FROM_MODEL && observe == LLAMA_KVQ_FROM_MODEL &&
        depth == LLAMA_KVQ_FROM_MODEL) {
        return "";
    }
    if (observe < 0) {
        return "the selection's observation window must be 0 (all of the prompt) or more tokens, got " +
               std::to_string(observe);
    }
    if (!std::isfinite(depth) || depth < 1.0f) {
        return "the selection's pyramid depth must be 1 (every layer alike) or more, got " + std::to_string(depth);
    }
    if (hh == 0.0f && recent == 0.0f) {
        return "";
    }
    const auto share = [](float x) { return std::isfinite(x) && x > 0.0f && x <= 1.0f; };
    if (!share(hh) || !share(recent)) {
        return "the selection's heavy-hitter and recent shares must each be in (0, 1], got " + std::to_string(hh) +
               "," + std::to_string(recent);
    }
    // a sum a rounding step over 1 still means "all of it"
    if (hh + recent > 1.0f + 1e-6f) {
        return "the selection's shares add up to " + std::to_string(hh + recent) +
               ", more than the whole prompt (heavy hitters + recent window <= 1)";
    }
    return "";
}

bool llama_kvq_parse_select(const char * text, float & hh, float & recent, int32_t & observe, float & depth) {
    if (std::strcmp(text, "off") == 0 || text[0] == '\0') {
        hh      = 0.0f;
        recent  = 0.0f;
        observe = 0;
        depth   = 1.0f;
        return true;
    }
    char * end = nullptr;
    const float h = std::strtof(text, &end);
    if (end == text || *end != ',') {
        return false;
    }
    const char * second = end + 1;
    const float r = std::strtof(second, &end);
    if (end == second || (*end != '\0' && *end != ',')) {
        return false;
    }
    long n = 0;
    if (*end == ',') {
        const char * third = end + 1;
        n = std::strtol(third, &end, 10);
        if (end == third || (*end != '\0' && *end != ',') || n < INT32_MIN || n > INT32_MAX) {
            return false;
        }
    }
    float d = 1.0f;
    if (*end == ',') {
        const char * fourth = end + 1;
        d = std::strtof(fourth, &end);
        if (end == fourth || *end != '\0') {
            return false;
        }
    }
    hh      = h;
    recent  = r;
    observe = (int32_t) n;
    depth   = d;
    return true;
}

bool llama_kvq_select_from_model(const llama_kvq_params & params) {
    return params.select_hh == LLAMA_KVQ_FROM_MODEL && params.select_recent == LLAMA_KVQ_FROM_MODEL;
}

bool llama_kvq_select_on(float hh, float recent) {
    return hh > 0.0f || recent > 0.0f;
}

llama_kvq_select llama_kvq_select_for(const llama_kvq_params & params, uint32_t n_prompt) {
    llama_kvq_select sel;
    if (!llama_kvq_select_on(params.select_hh, params.select_recent) ||
        n_prompt <= (uint32_t) std::max(params.window, params.n_sink)) {
        return sel;
    }
    const auto count = [n_prompt](float share) { return (uint32_t) std::lround((double) share * n_prompt); };
    sel.n_prompt  = n_prompt;
    sel.n_sink    = (uint32_t) params.n_sink;
    sel.n_recent  = std::min(std::max(count(params.select_recent), 1u), n_prompt - sel.n_sink);
    // PyramidKV's linear budget: bottom hh*(2 - 1/depth), top hh/depth
    const uint32_t n_cand = n_prompt - sel.n_sink - sel.n_recent;
    const float    depth  = params.select_depth;
    sel.n_hh      = std::min(count(params.select_hh*(2.0f - 1.0f/depth)), n_cand);
    sel.n_hh_top  = std::min(count(params.select_hh/depth), sel.n_hh);
    sel.n_observe = (uint32_t) params.select_observe;
    return sel;
}

uint32_t llama_kvq_select::n_hh_at(uint32_t ikv, uint32_t n_layer) const {
    if (n_layer <= 1) {
        return n_hh;
    }
    const double t = (double) ikv / (n_layer - 1);
    return (uint32_t) std::lround(n_hh + ((double) n_hh_top - n_hh)*t);
}

// zeros from an op rather than a leaf: a graph's leaves hold no data unless something sets them
static ggml_tensor * kvq_zeros(ggml_context * ctx, int64_t ne0, int64_t ne1, int64_t ne2 = 1) {
    ggml_tensor * row = ggml_scale(ctx, ggml_arange(ctx, 0.0f, (float) ne0, 1.0f), 0.0f);
    return ggml_repeat_4d(ctx, row, ne0, ne1, ne2, 1);
}

ggml_tensor * llama_kvq_causal_mask(ggml_context * ctx, int64_t n) {
    return ggml_cast(ctx, ggml_diag_mask_inf(ctx, kvq_zeros(ctx, n, n), 0), GGML_TYPE_F16);
}

// token indices first .. first + n - 1 for every KV head, F32 [n, n_head_kv]
static ggml_tensor * kvq_token_range(ggml_context * ctx, uint32_t first, uint32_t n, int64_t n_head_kv) {
    ggml_tensor * row = ggml_arange(ctx, (float) first, (float) (first + n), 1.0f);
    return ggml_repeat_4d(ctx, row, n, n_head_kv, 1, 1);
}

// each token scored with the mass of the KVQ_SELECT_LEND tokens before it, its own added: a question at the end of the
// prompt looks at the words that lead to its answer ("the pass key is"), and copying the answer reads the tokens after
// them. SnapKV's pool centred on a token (3 before, 3 after) kept too few of those: a 5-digit key lost its last
// digits in most layers
static ggml_tensor * kvq_lend_scores(ggml_context * ctx, ggml_tensor * mass) {
    ggml_tensor * padded = ggml_pad_ext(ctx, ggml_cont(ctx, mass), KVQ_SELECT_LEND, 0, 0, 0, 0, 0, 0, 0);
    ggml_tensor * sum = nullptr;
    for (int j = 0; j <= KVQ_SELECT_LEND; ++j) {
        ggml_tensor * shifted = ggml_view_2d(ctx, padded, mass->ne[0], mass->ne[1], padded->nb[1],
                                             j*ggml_element_size(padded));
        sum = sum ? ggml_add(ctx, sum, shifted) : shifted;
    }
    return sum;
}

ggml_tensor * llama_kvq_kept_tokens(ggml_context * ctx, ggml_tensor * mass, const llama_kvq_select & sel, uint32_t ikv,
        uint32_t n_layer) {
    if (sel.n_observe > 0) {
        mass = kvq_lend_scores(ctx, mass);
    }
    const int64_t  n_head_kv = mass->ne[1];
    const uint32_t n_hh      = sel.n_hh_at(ikv, n_layer);
    // after the sinks: the heavy hitters, then the recent window
    ggml_tensor * live = kvq_token_range(ctx, sel.n_prompt - sel.n_recent, sel.n_recent, n_head_kv);
    if (n_hh > 0) {
        // candidates: the tokens between the sinks and the recent window
        const int64_t n_cand = sel.n_prompt - sel.n_sink - sel.n_recent;
        ggml_tensor * cand = ggml_cont(ctx, ggml_view_2d(ctx, mass, n_cand, n_head_kv, mass->nb[1],
                                                         sel.n_sink*ggml_element_size(mass)));
        // top_k gives the heaviest in no particular order: sort them by position, so that K tiles group
        // neighbouring tokens as a plain prompt's do (and keeping every token reproduces it)
        ggml_tensor * top    = ggml_cast(ctx, ggml_top_k(ctx, cand, n_hh), GGML_TYPE_F32);
        ggml_tensor * order  = ggml_argsort(ctx, top, GGML_SORT_ORDER_ASC);
        ggml_tensor * sorted = ggml_get_rows(ctx, ggml_reshape_3d(ctx, top, 1, n_hh, n_head_kv), order);
        ggml_tensor * hh     = ggml_scale_bias(ctx, ggml_reshape_2d(ctx, sorted, n_hh, n_head_kv), 1.0f, (float) sel.n_sink);
        live = ggml_concat(ctx, hh, live, 0);
    }
    const uint32_t n_dead = sel.n_dead(ikv, n_layer);
    if (n_dead > 0) {
        ggml_tensor * next = ggml_cont(ctx, ggml_view_2d(ctx, live, 1, n_head_kv, live->nb[1], 0));
        live = ggml_concat(ctx, ggml_repeat_4d(ctx, next, n_dead, n_head_kv, 1, 1), live, 0);
    }
    if (sel.n_sink > 0) {
        live = ggml_concat(ctx, kvq_token_range(ctx, 0, sel.n_sink, n_head_kv), live, 0);
    }
    return ggml_cast(ctx, live, GGML_TYPE_I32);
}

ggml_tensor * llama_kvq_gather_kept(ggml_context * ctx, ggml_tensor * cur, ggml_tensor * kept) {
    // [head_dim, n_prompt, n_head_kv]: one row per token of each head, as get_rows takes them
    ggml_tensor * rows = ggml_cont(ctx, ggml_permute(ctx, cur, 0, 2, 1, 3));
    ggml_tensor * got  = ggml_get_rows(ctx, rows, kept);
    return ggml_cont(ctx, ggml_permute(ctx, got, 0, 2, 1, 3));
}

ggml_tensor * llama_kvq_prompt_mass(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k_wide, ggml_tensor * wide_mask,
        ggml_tensor * k_idxs, int32_t window, int32_t n_sink, int64_t n_kv, int64_t kv_size, int64_t n_part,
        const llama_kvq_select & sel, float scale) {
    const int64_t n_head_kv = k_wide->ne[0]/q->ne[0];
    ggml_tensor * lse  = ggml_kvq_score_lse(ctx, q, k_wide, wide_mask, (int32_t) sel.n_observe, scale);
    ggml_tensor * mass = ggml_kvq_score_add(ctx, kvq_zeros(ctx, kv_size, n_head_kv, n_part), q, k_wide, wide_mask, lse,
                                            k_idxs, window, n_sink, n_kv, (int32_t) sel.n_observe, scale);
    return ggml_view_2d(ctx, mass, sel.n_prompt, n_head_kv, mass->nb[1], sel.part*mass->nb[2]);
}
