#include "llama-kvq.h"

#include "llama-kvq-layers.h"
#include "llama-kvq-select.h"

#include "ggml.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

const char * llama_kvq_version(void) {
    return PYKVQ_VERSION;
}

// Settings are process-wide: llama_context_params' layout is mirrored by llama-cpp-python and must not
// change, so they cannot travel with it.
static std::mutex       kvq_params_mutex;
static llama_kvq_params kvq_params = { LLAMA_KVQ_FROM_MODEL, LLAMA_KVQ_FROM_MODEL, false, 0, LLAMA_KVQ_FROM_MODEL,
                                       LLAMA_KVQ_FROM_MODEL, LLAMA_KVQ_FROM_MODEL, LLAMA_KVQ_FROM_MODEL };
static std::string      kvq_error;
static std::string      kvq_layer_spec;
static std::string      kvq_layer_spec_out;   // what llama_kvq_get_layer_types hands out
static std::string      kvq_clip_spec;
static std::string      kvq_clip_spec_out;    // what llama_kvq_get_clip hands out
static std::string      kvq_rotation_spec;
static std::string      kvq_rotation_spec_out; // what llama_kvq_get_rotation hands out
static std::string      kvq_dither_spec;
static std::string      kvq_dither_spec_out;  // what llama_kvq_get_dither hands out
static ggml_type        kvq_swa_type_k = GGML_TYPE_COUNT;
static ggml_type        kvq_swa_type_v = GGML_TYPE_COUNT;

struct llama_kvq_params llama_kvq_default_params(void) {
    return { /*.window =*/ 128, /*.n_sink =*/ 0, /*.rotate =*/ false, /*.n_rollback =*/ 0, /*.select_hh =*/ 0.0f,
             /*.select_recent =*/ 0.0f, /*.select_observe =*/ 0, /*.select_depth =*/ 1.0f };
}

bool llama_kvq_set_params(struct llama_kvq_params params) {
    std::lock_guard<std::mutex> lock(kvq_params_mutex);
    if (params.window < LLAMA_KVQ_FROM_MODEL) {
        kvq_error = "the recent window must be 0 or more tokens (or -1: the model's kvq.window), got " +
                    std::to_string(params.window);
        return false;
    }
    if (params.n_sink < LLAMA_KVQ_FROM_MODEL) {
        kvq_error = "the sink count must be 0 or more tokens (or -1: the model's kvq.sinks), got " +
                    std::to_string(params.n_sink);
        return false;
    }
    // the ring is held in memory for every layer and sequence: a bound keeps a typo from asking for gigabytes
    if (params.n_rollback < 0 || params.n_rollback > 4096) {
        kvq_error = "the rollback depth must be 0 to 4096 tokens, got " + std::to_string(params.n_rollback);
        return false;
    }
    const std::string select_error = llama_kvq_check_select(params.select_hh, params.select_recent, params.select_observe,
                                                              params.select_depth);
    if (!select_error.empty()) {
        kvq_error = select_error;
        return false;
    }
    kvq_params = params;
    kvq_error.clear();
    return true;
}

struct llama_kvq_params llama_kvq_get_params(void) {
    std::lock_guard<std::mutex> lock(kvq_params_mutex);
    return kvq_params;
}

const char * llama_kvq_last_error(void) {
    std::lock_guard<std::mutex> lock(kvq_params_mutex);
    return kvq_error.c_str();
}

static bool kvq_parse_count(const char * value, int32_t & out) {
    char * end = nullptr;
    const long v = std::strtol(value, &end, 10);
    if (end == value || *end != '\0' || v < INT32_MIN || v > INT32_MAX) {
        return false;
    }
    out = (int32_t) v;
    return true;
}

bool llama_kvq_set_swa_types(enum ggml_type type_k, enum ggml_type type_v) {
    std::lock_guard<std::mutex> lock(kvq_params_mutex);
    for (const ggml_type type : { type_k, type_v }) {
        if (type != GGML_TYPE_COUNT && (type < 0 || type > GGML_TYPE_COUNT ||
                                        llama_kvq_cache_type_by_name(ggml_type_name(type)) != type)) {
            kvq_error = "type " + std::to_string((int) type) + " for the sliding-window cache: not a KV cache type (valid: " +
                        llama_kvq_cache_type_names() + ")";
            return false;
        }
    }
    kvq_swa_type_k = type_k;
    kvq_swa_type_v = type_v;
    kvq_error.clear();
    return true;
}

void llama_kvq_get_swa_types(enum ggml_type * type_k, enum ggml_type * type_v) {
    std::lock_guard<std::mutex> lock(kvq_params_mutex);
    *type_k = kvq_swa_type_k;
    *type_v = kvq_swa_type_v;
}

// "type_swa": a type name for both, "" to follow the context's types
static bool kvq_set_swa_type_name(const char * value) {
    const ggml_type type = value[0] == '\0' ? GGML_TYPE_COUNT : llama_kvq_cache_type_by_name(value);
    if (value[0] != '\0' && type == GGML_TYPE_COUNT) {
        std::lock_guard<std::mutex> lock(kvq_params_mutex);
        kvq_error = std::string("unknown KV cache type '") + value + "' for the sliding-window cache (valid: " +
                    llama_kvq_cache_type_names() + ")";
        return false;
    }
    return llama_kvq_set_swa_types(type, type);
}

bool llama_kvq_set_param(const char * name, const char * value) {
    llama_kvq_params params = llama_kvq_get_params();
    bool ok = false;
    if (std::strcmp(name, "window") == 0) {
        ok = kvq_parse_count(value, params.window);
    } else if (std::strcmp(name, "sinks") == 0) {
        ok = kvq_parse_count(value, params.n_sink);
    } else if (std::strcmp(name, "rollback") == 0) {
        ok = kvq_parse_count(value, params.n_rollback);
    } else if (std::strcmp(name, "rotate") == 0) {
        return llama_kvq_set_rotation(value);
    } else if (std::strcmp(name, "select") == 0) {
        ok = llama_kvq_parse_select(value, params.select_hh, params.select_recent, params.select_observe,
                                    params.select_depth);
    } else if (std::strcmp(name, "layers") == 0) {
        return llama_kvq_set_layer_types(value);
    } else if (std::strcmp(name, "clip") == 0) {
        return llama_kvq_set_clip(value);
    } else if (std::strcmp(name, "dither") == 0) {
        return llama_kvq_set_dither(value);
    } else if (std::strcmp(name, "type_swa") == 0) {
        return kvq_set_swa_type_name(value);
    } else {
        std::lock_guard<std::mutex> lock(kvq_params_mutex);
        kvq_error = std::string("unknown kivi setting '") + name + "' (valid: window, sinks, rollback, rotate, select, layers, clip, dither, type_swa)";
        return false;
    }
    if (!ok) {
        std::lock_guard<std::mutex> lock(kvq_params_mutex);
        kvq_error = std::string("invalid value '") + value + "' for kivi setting " + name +
                    (std::strcmp(name, "select") == 0   ? " (HH,RW[,N[,D]]: the heavy-hitter and recent shares of the "
                                                          "prompt, the observation window and the pyramid depth, e.g. "
                                                          "0.25,0.25 or 0.25,0.25,32 or 0.25,0.25,0,3, or off)" :
                                                          " (a whole number of tokens)");
        return false;
    }
    // on a command line a count is a count: leaving the flag out is what takes the model's value
    const bool is_window = std::strcmp(name, "window") == 0;
    if ((is_window && params.window < 0) || (std::strcmp(name, "sinks") == 0 && params.n_sink < 0)) {
        std::lock_guard<std::mutex> lock(kvq_params_mutex);
        kvq_error = std::string("the kivi ") + (is_window ? "window" : "sink count") + " must be 0 or more tokens, got " +
                    value;
        return false;
    }
    return llama_kvq_set_params(params);
}

// kvq_params_mutex held
static bool kvq_parses(const std::string & spec, void (*check)(const std::string &)) {
    try {
        check(spec);
    } catch (const std::invalid_argument & err) {
        kvq_error = err.what();
        return false;
    }
    kvq_error.clear();
    return true;
}

static bool kvq_set_spec(const char * spec, void (*check)(const std::string &), std::string & setting) {
    const std::string text = spec ? spec : "";
    std::lock_guard<std::mutex> lock(kvq_params_mutex);
    if (!kvq_parses(text, check)) {
        return false;
    }
    setting = text;
    return true;
}

static const char * kvq_get_spec(const std::string & setting, std::string & out) {
    std::lock_guard<std::mutex> lock(kvq_params_mutex);
    out = setting;
    return out.c_str();
}

// a copy of a spec setting, for a cache being made
static std::string kvq_spec_copy(const std::string & setting) {
    std::lock_guard<std::mutex> lock(kvq_params_mutex);
    return setting;
}

bool llama_kvq_check_layer_types(const char * spec) {
    std::lock_guard<std::mutex> lock(kvq_params_mutex);
    return kvq_parses(spec ? spec : "", llama_kvq_check_layer_spec);
}

bool llama_kvq_set_layer_types(const char * spec) {
    return kvq_set_spec(spec, llama_kvq_check_layer_spec, kvq_layer_spec);
}

const char * llama_kvq_get_layer_types(void) {
    return kvq_get_spec(kvq_layer_spec, kvq_layer_spec_out);
}

std::string llama_kvq_layer_spec(void) {
    return kvq_spec_copy(kvq_layer_spec);
}

bool llama_kvq_set_clip(const char * spec) {
    return kvq_set_spec(spec, llama_kvq_check_clip_spec, kvq_clip_spec);
}

const char * llama_kvq_get_clip(void) {
    return kvq_get_spec(kvq_clip_spec, kvq_clip_spec_out);
}

std::string llama_kvq_clip_spec(void) {
    return kvq_spec_copy(kvq_clip_spec);
}

bool llama_kvq_set_rotation(const char * spec) {
    return kvq_set_spec(spec, llama_kvq_check_rotation_spec, kvq_rotation_spec);
}

const char * llama_kvq_get_rotation(void) {
    return kvq_get_spec(kvq_rotation_spec, kvq_rotation_spec_out);
}

std::string llama_kvq_rotation_spec(void) {
    return kvq_spec_copy(kvq_rotation_spec);
}

bool llama_kvq_set_dither(const char * spec) {
    return kvq_set_spec(spec, llama_kvq_check_dither_spec, kvq_dither_spec);
}

const char * llama_kvq_get_dither(void) {
    return kvq_get_spec(kvq_dither_spec, kvq_dither_spec_out);
}

std::string llama_kvq_dither_spec(void) {
    return kvq_spec_copy(kvq_dither_spec);
}

bool llama_kvq_resolve_dither(const char * spec, int32_t n_layer, float * spread_v) {
    try {
        const std::vector<float> spreads = llama_kvq_resolve_dither_spec(spec ? spec : "", n_layer);
        std::copy(spreads.begin(), spreads.end(), spread_v);
    } catch (const std::invalid_argument & err) {
        std::lock_guard<std::mutex> lock(kvq_params_mutex);
        kvq_error = err.what();
        return false;
    }
    return true;
}

// a per-layer spec resolved into the caller's K and V arrays; false, with the reason kept, when it does not fit
template <typename Resolve, typename T>
static bool kvq_resolve_into(Resolve resolve, T * out_k, T * out_v) {
    try {
        const auto resolved = resolve();
        std::copy(resolved.k.begin(), resolved.k.end(), out_k);
        std::copy(resolved.v.begin(), resolved.v.end(), out_v);
    } catch (const std::invalid_argument & err) {
        std::lock_guard<std::mutex> lock(kvq_params_mutex);
        kvq_error = err.what();
        return false;
    }
    return true;
}

bool llama_kvq_resolve_rotation(const char * spec, int32_t n_layer, bool fallback, bool * rotate_k, bool * rotate_v) {
    return kvq_resolve_into([&] { return llama_kvq_resolve_rotation_spec(spec ? spec : "", n_layer, fallback); },
                            rotate_k, rotate_v);
}

bool llama_kvq_resolve_clip(const char * spec, int32_t n_layer, float * clip_k, float * clip_v) {
    return kvq_resolve_into([&] { return llama_kvq_resolve_clip_spec(spec ? spec : "", n_layer); }, clip_k, clip_v);
}

bool llama_kvq_resolve_layer_types(const char * spec, int32_t n_layer, enum ggml_type type_k, enum ggml_type type_v,
        enum ggml_type * types_k, enum ggml_type * types_v) {
    return kvq_resolve_into([&] { return llama_kvq_resolve_layer_spec(spec ? spec : "", n_layer, type_k, type_v); },
                            types_k, types_v);
}
