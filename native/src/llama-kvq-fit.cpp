#include "llama-kvq-fit.h"

#include "fit.h"
#include "log.h"

// Compiled into libllama-common, beside the fit it wraps.
enum llama_kvq_fit_status llama_kvq_fit_params(
        const char * path_model,
        struct llama_model_params * mparams,
        struct llama_context_params * cparams,
        float * tensor_split,
        struct llama_model_tensor_buft_override * tensor_buft_overrides,
        size_t * margins,
        uint32_t n_ctx_min,
        bool verbose) {
    // the common log prints to stderr by itself: a Python caller wants the fit's warnings only when it asks
    common_log_set_verbosity_thold(verbose ? LOG_LEVEL_TRACE : LOG_LEVEL_ERROR);
    const common_params_fit_status status = common_fit_params(path_model, mparams, cparams, tensor_split,
            tensor_buft_overrides, margins, n_ctx_min, nullptr, verbose ? GGML_LOG_LEVEL_DEBUG : GGML_LOG_LEVEL_ERROR);
    common_log_flush(common_log_main());
    switch (status) {
        case COMMON_PARAMS_FIT_STATUS_SUCCESS: return LLAMA_KVQ_FIT_FITTED;
        case COMMON_PARAMS_FIT_STATUS_FAILURE: return LLAMA_KVQ_FIT_NO_FIT;
        case COMMON_PARAMS_FIT_STATUS_ERROR:   return LLAMA_KVQ_FIT_ERROR;
    }
    return LLAMA_KVQ_FIT_ERROR;
}
