#include "llama-kvq.h"

#include "ggml.h"

#include <array>

// Upstream's list (common/arg.cpp before our patch), in its order, so that upstream's tools keep
// accepting and printing exactly what they did.
static constexpr std::array<ggml_type, 9> kvq_cache_types = {
    GGML_TYPE_F32,
    GGML_TYPE_F16,
    GGML_TYPE_BF16,
    GGML_TYPE_Q8_0,
    GGML_TYPE_Q4_0,
    GGML_TYPE_Q4_1,
    GGML_TYPE_IQ4_NL,
    GGML_TYPE_Q5_0,
    GGML_TYPE_Q5_1,
};

const char * llama_kvq_version(void) {
    return PYKVQ_VERSION;
}

size_t llama_kvq_n_cache_types(void) {
    return kvq_cache_types.size();
}

enum ggml_type llama_kvq_cache_type(size_t i) {
    // GGML_TYPE_COUNT rather than an abort: callers in Python iterate until they see it
    return i < kvq_cache_types.size() ? kvq_cache_types[i] : GGML_TYPE_COUNT;
}
