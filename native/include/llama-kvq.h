// pykvq extension of the llama C API.
//
// Kept out of llama.h so that llama_context_params (mirrored field by field by llama-cpp-python)
// never changes layout; every pykvq setting is reached through functions declared here.
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// version of the pykvq extension API, "MAJOR.MINOR.PATCH"
LLAMA_API const char * llama_kvq_version(void);

// the ggml types a KV cache can be made of, in the order tools list them
LLAMA_API size_t         llama_kvq_n_cache_types(void);
LLAMA_API enum ggml_type llama_kvq_cache_type(size_t i);

#ifdef __cplusplus
}
#endif
