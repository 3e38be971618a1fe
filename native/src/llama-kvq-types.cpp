// The KV cache types llama.cpp's tools and pykvq accept (-ctk/-ctv, --kv-layers), for the C API.

#include "llama-kvq.h"

#include "ggml.h"

#include <array>

// Upstream's list (common/arg.cpp before our patch), in its order, so that upstream's tools keep
// accepting and printing exactly what they did; then pykvq's types.
static constexpr std::array<ggml_type, 12> kvq_cache_types = {
    GGML_TYPE_F32,
    GGML_TYPE_F16,
    GGML_TYPE_BF16,
    GGML_TYPE_Q8_0,
    GGML_TYPE_Q4_0,
    GGML_TYPE_Q4_1,
    GGML_TYPE_IQ4_NL,
    GGML_TYPE_Q5_0,
    GGML_TYPE_Q5_1,
    GGML_TYPE_KIVI4,
    GGML_TYPE_KIVI2,
    GGML_TYPE_KIVI1,
};

size_t llama_kvq_n_cache_types(void) {
    return kvq_cache_types.size();
}

enum ggml_type llama_kvq_cache_type(size_t i) {
    // GGML_TYPE_COUNT rather than an abort: callers in Python iterate until they see it
    return i < kvq_cache_types.size() ? kvq_cache_types[i] : GGML_TYPE_COUNT;
}
