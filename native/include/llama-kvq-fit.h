// pykvq: upstream's parameter fit (-fit on in llama.cpp's tools) for callers of the C API.
//
// common_fit_params is C++ and lives in libllama-common; this entry point gives it a C ABI, so that pykvq's
// Python commands place layers and size the context as llama.cpp's tools do, kivi caches measured as they are.
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

enum llama_kvq_fit_status {
    LLAMA_KVQ_FIT_FITTED   = 0, // the parameters left at their defaults now fit the free device memory
    LLAMA_KVQ_FIT_NO_FIT   = 1, // no placement is projected to fit: the parameters are as they were
    LLAMA_KVQ_FIT_ERROR    = 2, // the model or a context of it could not be made (the log says why)
};

// Fits the parameters of mparams left at llama_model_default_params()'s values (layers per device, tensor split,
// tensor overrides) and cparams->n_ctx when 0 to the devices' free memory less each device's margin (bytes;
// llama_max_devices() of them), not reducing an unset context below n_ctx_min per sequence. tensor_split
// (llama_max_devices() floats) and tensor_buft_overrides (llama_max_tensor_buft_overrides() entries) are the
// caller's buffers, which mparams points into afterwards: keep them until the model is loaded. The kivi settings
// in effect (llama_kvq_set_params and the rest) shape the caches measured. verbose: the fit's trace in
// llama.cpp's common log (stderr), otherwise its errors only. Not thread safe: it swaps llama's log callback.
enum llama_kvq_fit_status llama_kvq_fit_params(
        const char * path_model,
        struct llama_model_params * mparams,
        struct llama_context_params * cparams,
        float * tensor_split,
        struct llama_model_tensor_buft_override * tensor_buft_overrides,
        size_t * margins,
        uint32_t n_ctx_min,
        bool verbose);

#ifdef __cplusplus
}
#endif
