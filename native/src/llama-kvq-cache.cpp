// The kivi layers of llama_kv_cache (members declared by native/patches, defined here).
//
// A kivi layer keeps K as sealed per-channel tiles, V as per-token rows, and the sinks and the recent
// window in fp16 (ggml-kvq.h). Each sequence has a part of its own whose k-th cell holds its k-th token: the
// attention contract is judged on positions, and the cells stand in for them. The parts are llama.cpp's
// per-sequence streams (kv_unified = false), or in a unified cache fixed regions of n_ctx/n_seq_max cells,
// sequence s from cell s*kvq_part_cells on: tiles never mix sequences, so a unified kivi cache cannot share
// its cells out freely, and its sequences cannot share cells (a token of several sequences, a partial copy).

#include "llama-kv-cache.h"

#include "llama-impl.h"
#include "llama-io.h"
#include "llama-kvq-cache.h"
#include "llama-kvq-layers.h"
#include "llama-model.h"

#include "ggml-kvq.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>

static bool kvq_either_kivi(ggml_type type_k, ggml_type type_v) {
    return ggml_kvq_is_kivi(type_k) || ggml_kvq_is_kivi(type_v);
}

static std::string kvq_types_text(ggml_type type_k, ggml_type type_v) {
    return std::string(ggml_type_name(type_k)) + "/" + ggml_type_name(type_v);
}

// fp16 cells (sinks + ring) of each kivi layer; 0 without one. Per-layer types may put any type on layer 0.
template <typename kv_layers>
static int64_t kvq_n_fp16(const kv_layers & layers) {
    for (const auto & layer : layers) {
        if (layer.k_fp16 != nullptr) {
            return layer.k_fp16->ne[1];
        }
    }
    return 0;
}

// the fp16 ring's cells (after the sinks): what a sliding-window part drops at a time, whole rings
template <typename kv_layers>
static uint32_t kvq_n_ring(const kv_layers & layers, int32_t n_sink) {
    return (uint32_t) (kvq_n_fp16(layers) - n_sink);
}

// where the rows of a part start in a non-kivi layer of a kivi cache: its stream, or its region of the one stream
static size_t kvq_plain_part_offset(const ggml_tensor * t, uint32_t part, bool in_regions, uint32_t part_cells) {
    return in_regions ? (size_t) part*part_cells*t->nb[1] : (size_t) part*t->nb[2];
}

// a per-layer spec of the model's own (pykvq calibrate writes them), "" when it has none
static std::string kvq_model_spec(const llama_model & model, const char * key) {
    char buf[4096];
    // version 2 added kvq.kv_clip, 3 kvq.kv_rotate, 4 kvq.kv_dither; older files are read as they are
    const std::string version = llama_model_meta_val_str(&model, "kvq.version", buf, sizeof(buf)) >= 0 ? buf : "1";
    if (version != "1" && version != "2" && version != "3" && version != "4") {
        throw std::runtime_error("the model's kvq.* metadata is version " + version +
                                 "; this pykvq reads versions 1 to 4 (later ones come from a newer pykvq)");
    }
    const int32_t n = llama_model_meta_val_str(&model, key, buf, sizeof(buf));
    if (n >= (int32_t) sizeof(buf)) {
        throw std::runtime_error(std::string("the model's ") + key + " metadata is longer than " +
                                 std::to_string(sizeof(buf)) + " bytes");
    }
    return n < 0 ? "" : std::string(buf, n);
}

// Where a per-layer setting comes from: the command line (process-wide), else the model's metadata
struct kvq_spec_source {
    std::string spec;     // "" or "none": the default everywhere
    std::string source;   // for messages
};

static kvq_spec_source kvq_spec_for(const llama_model & model, const std::string & given, const char * key,
                                    const char * flag) {
    if (!given.empty()) {
        return { given, flag };
    }
    return { kvq_model_spec(model, key), std::string("the model's ") + key };
}

// The K and V type of every layer: --kv-layers (llama_kvq_set_layer_types), else the model's kvq.kv_layers, else
// type_k/type_v everywhere
struct kvq_layer_plan {
    llama_kvq_layer_types types;
    std::string           spec;         // "" or "none": type_k/type_v everywhere
    std::string           source;       // where the spec came from, for messages
    bool                  from_model;   // the types are the model's kvq.kv_layers
};

static kvq_layer_plan kvq_plan_layers(const llama_model & model, uint32_t n_layer, ggml_type type_k, ggml_type type_v) {
    const kvq_spec_source given = kvq_spec_for(model, llama_kvq_layer_spec(), "kvq.kv_layers", "--kv-layers");
    const bool from_model = llama_kvq_layer_spec().empty() && !given.spec.empty() && given.spec != "none";
    kvq_layer_plan plan = { {}, given.spec, given.source, from_model };
    try {
        plan.types = llama_kvq_resolve_layer_spec(plan.spec, (int32_t) n_layer, type_k, type_v);
    } catch (const std::invalid_argument & err) {
        throw std::runtime_error(plan.source + ": " + err.what());
    }
    return plan;
}

// A per-layer setting: the command line's spec, else the model's; `spec` says which applies ("" when neither)
template <typename Resolve>
static auto kvq_plan_setting(const llama_model & model, const std::string & given_spec, const char * key,
                             const char * flag, std::string & spec, Resolve resolve) {
    const kvq_spec_source given = kvq_spec_for(model, given_spec, key, flag);
    spec = given.spec == "none" ? "" : given.spec;
    try {
        return resolve(given.spec);
    } catch (const std::invalid_argument & err) {
        throw std::runtime_error(given.source + ": " + err.what());
    }
}

// pykvq calibrate's clip ratios at each width: the model's kvq.kv_clip gives each tensor its ratio at its width in
// kvq.kv_layers, so a cache whose types come from elsewhere (--kv-layers, type_k/type_v) would clip a tensor at the
// ratio of a width it does not run at (1-bit V's 0.7 at 2 bits, 2-bit K's 0.9 at 4)
static const struct {
    ggml_type    type;
    const char * key;
} kvq_width_clip_keys[] = {
    { GGML_TYPE_KIVI4, "kvq.calibration.kivi4_clip" },
    { GGML_TYPE_KIVI2, "kvq.calibration.kivi2_clip" },
    { GGML_TYPE_KIVI1, "kvq.calibration.kivi1_clip" },
};

// Each tensor's clip ratio at the width it runs at, from the model's ratios per width; false (clips untouched) where
// a kivi width in use has none. `spec` names the keys read, for the cache's description.
static bool kvq_clips_by_width(const llama_model & model, const std::vector<ggml_type> & types_k,
                               const std::vector<ggml_type> & types_v, int32_t n_layer, llama_kvq_layer_clips & clips,
                               std::string & spec) {
    llama_kvq_layer_clips out = { std::vector<float>(n_layer, 1.0f), std::vector<float>(n_layer, 1.0f) };
    std::string keys;
    for (const auto & width : kvq_width_clip_keys) {
        const bool used = std::find(types_k.begin(), types_k.end(), width.type) != types_k.end() ||
                          std::find(types_v.begin(), types_v.end(), width.type) != types_v.end();
        if (!used) {
            continue;
        }
        const std::string width_spec = kvq_model_spec(model, width.key);
        if (width_spec.empty()) {
            return false;
        }
        llama_kvq_layer_clips ratios;
        try {
            ratios = llama_kvq_resolve_clip_spec(width_spec, n_layer);
        } catch (const std::invalid_argument & err) {
            throw std::runtime_error(std::string("the model's ") + width.key + ": " + err.what());
        }
        for (int32_t il = 0; il < n_layer; ++il) {
            if (types_k[il] == width.type) {
                out.k[il] = ratios.k[il];
            }
            if (types_v[il] == width.type) {
                out.v[il] = ratios.v[il];
            }
        }
        keys += (keys.empty() ? "the model's " : ", ") + std::string(width.key);
    }
    if (keys.empty()) {
        return false;
    }
    clips = std::move(out);
    spec  = keys + " at each tensor's width";
    return true;
}

llama_kvq_swa_plan llama_kvq_plan_swa_cache(const llama_model & model, const llama_hparams & hparams, ggml_type type_k,
        ggml_type type_v, const llama_memory_i::layer_filter_cb & filter_swa) {
    llama_kvq_swa_plan plan = { type_k, type_v, false };
    llama_kvq_get_swa_types(&plan.type_k, &plan.type_v);
    const bool given = plan.type_k != GGML_TYPE_COUNT || plan.type_v != GGML_TYPE_COUNT;
    if (plan.type_k == GGML_TYPE_COUNT) {
        plan.type_k = type_k;
    }
    if (plan.type_v == GGML_TYPE_COUNT) {
        plan.type_v = type_v;
    }
    const kvq_layer_plan swa = kvq_plan_layers(model, hparams.n_layer_all, plan.type_k, plan.type_v);
    if (given && !swa.spec.empty() && swa.spec != "none") {
        throw std::runtime_error(swa.source + " gives the sliding-window layers their types, which --kv-type-swa " +
                                 kvq_types_text(plan.type_k, plan.type_v) + " would not change: give their types "
                                 "there, or --kv-layers none for --kv-type-swa");
    }
    for (uint32_t il = 0; il < hparams.n_layer_all; ++il) {
        if (filter_swa(il) && kvq_either_kivi(swa.types.k[il], swa.types.v[il])) {
            plan.kivi = true;
        }
    }
    return plan;
}

// a setting LLAMA_KVQ_FROM_MODEL: the model's kvq.* value (a count of 0 to INT32_MAX), else the default
static int32_t kvq_setting_for(const llama_model & model, int32_t value, const char * key, const char * flag,
                               int32_t fallback) {
    if (value != LLAMA_KVQ_FROM_MODEL) {
        return value;
    }
    char buf[64];
    const int32_t n = llama_model_meta_val_str(&model, key, buf, sizeof(buf));
    if (n < 0) {
        return fallback;
    }
    char * end = nullptr;
    const long long v = std::strtoll(buf, &end, 10);
    if (n == 0 || n >= (int32_t) sizeof(buf) || *end != '\0' || v < 0 || v > INT32_MAX) {
        throw std::runtime_error(std::string("the model's ") + key + " metadata '" + buf +
                                 "' is not a token count of 0 or more (" + flag + " N overrides it)");
    }
    return (int32_t) v;
}

// the process-wide settings, the window and sinks LLAMA_KVQ_FROM_MODEL resolved for this model
// MiniKV's selection left to the model: its kvq.select ("HH,RW[,N[,D]]"), else none
static void kvq_select_for(const llama_model & model, llama_kvq_params & params) {
    params.select_hh      = 0.0f;
    params.select_recent  = 0.0f;
    params.select_observe = 0;
    params.select_depth   = 1.0f;
    char buf[64];
    const int32_t n = llama_model_meta_val_str(&model, "kvq.select", buf, sizeof(buf));
    if (n < 0) {
        return;
    }
    float hh = 0.0f;
    float recent = 0.0f;
    int32_t observe = 0;
    float depth = 1.0f;
    const bool parsed = n < (int32_t) sizeof(buf) && llama_kvq_parse_select(buf, hh, recent, observe, depth);
    const std::string problem = parsed ? llama_kvq_check_select(hh, recent, observe, depth) :
                                         "it does not read as HH,RW[,N[,D]]";
    if (!parsed || !problem.empty() || observe == LLAMA_KVQ_FROM_MODEL) {
        throw std::runtime_error(std::string("the model's kvq.select metadata '") + buf + "' is not a prompt selection: " +
                                 (problem.empty() ? "no value to take from the model" : problem) +
                                 " (--kv-select HH,RW[,N[,D]] or --kv-select off overrides it)");
    }
    params.select_hh      = hh;
    params.select_recent  = recent;
    params.select_observe = observe;
    params.select_depth   = depth;
}

// the settings a cache of this model takes; select_from_model says whether the selection came from kvq.select
static llama_kvq_params kvq_params_for(const llama_model & model, bool * select_from_model = nullptr) {
    const llama_kvq_params defaults = llama_kvq_default_params();
    llama_kvq_params params = llama_kvq_get_params();
    params.window = kvq_setting_for(model, params.window, "kvq.window", "--kv-window", defaults.window);
    params.n_sink = kvq_setting_for(model, params.n_sink, "kvq.sinks", "--kv-sinks", defaults.n_sink);
    const bool from_model = llama_kvq_select_from_model(params);
    if (from_model) {
        kvq_select_for(model, params);
    }
    if (select_from_model != nullptr) {
        *select_from_model = from_model && llama_kvq_select_on(params.select_hh, params.select_recent);
    }
    return params;
}

uint32_t llama_kvq_swa_part_cells(const llama_model & model, uint32_t n_ubatch, uint32_t kv_size) {
    const llama_hparams & hparams = model.hparams;
    const llama_kvq_params params = kvq_params_for(model);
    // as kvq_init bounds the window; the ring is what one drop frees at least
    const int64_t window = std::min<int64_t>(params.window, kv_size);
    const int64_t ring   = ggml_kvq_ring_size((int32_t) std::min<int64_t>(window + params.n_rollback, kv_size));
    // kvq_n_droppable keeps a ring more than the window
    const int64_t cells  = (int64_t) hparams.n_swa + n_ubatch + 2*ring;
    return (uint32_t) std::min<int64_t>(GGML_PAD(cells, QK_KIVI), kv_size);
}

// the mask, mass, kept set and reseal of a selecting layer (llama_kv_cache::kvq_build_attn), with room to spare
static constexpr uint32_t KVQ_SELECT_NODES_PER_LAYER = 112;

// Whatever the process-wide settings say now: a context reserves its graphs again later (LoRA, backend samplers),
// when they may have changed, and its cache keeps the settings it was made with
uint32_t llama_kvq_graph_extra_nodes(const llama_model & model) {
    return KVQ_SELECT_NODES_PER_LAYER*model.hparams.n_layer();
}

void llama_kv_cache::kvq_init(const llama_model & model, ggml_type type_k, ggml_type type_v, uint32_t n_stream_wanted,
        uint32_t kv_size) {
    kvq_params = kvq_params_for(model, &kvq_select_from_model);
    kvq_layer_plan plan = kvq_plan_layers(model, hparams.n_layer_all, type_k, type_v);
    const std::string & spec   = plan.spec;
    const std::string & source = plan.source;
    kvq_types_k = std::move(plan.types.k);
    kvq_types_v = std::move(plan.types.v);
    const int32_t n_layer = (int32_t) hparams.n_layer_all;
    // --kv-clip, else (types not the model's kvq.kv_layers) the model's ratios per width, else its kvq.kv_clip
    std::string clip_spec;
    const bool by_width = llama_kvq_clip_spec().empty() && !plan.from_model &&
                          kvq_clips_by_width(model, kvq_types_k, kvq_types_v, n_layer, kvq_clips, clip_spec);
    if (!by_width) {
        kvq_clips = kvq_plan_setting(model, llama_kvq_clip_spec(), "kvq.kv_clip", "--kv-clip", clip_spec,
                [n_layer](const std::string & s) { return llama_kvq_resolve_clip_spec(s, n_layer); });
    }
    std::string rotation_spec;
    kvq_rotation = kvq_plan_setting(model, llama_kvq_rotation_spec(), "kvq.kv_rotate", "--kv-rotate", rotation_spec,
            [n_layer, this](const std::string & s) { return llama_kvq_resolve_rotation_spec(s, n_layer, kvq_params.rotate); });
    std::string dither_spec;
    kvq_v_spread = kvq_plan_setting(model, llama_kvq_dither_spec(), "kvq.kv_dither", "--kv-dither", dither_spec,
            [n_layer](const std::string & s) { return llama_kvq_resolve_dither_spec(s, n_layer); });
    kvq_rotated = { std::vector<bool>(n_layer, false), std::vector<bool>(n_layer, false) };

    bool any_kivi = false;
    for (uint32_t il = 0; il < kvq_types_k.size(); ++il) {
        const ggml_type tk = kvq_types_k[il];
        const ggml_type tv = kvq_types_v[il];
        if (ggml_kvq_is_kivi(tk) != ggml_kvq_is_kivi(tv)) {
            // name where the pair came from: a model's kvq.kv_layers is not on the command line
            throw std::runtime_error((spec.empty() || spec == "none" ? "" : source + ": ") + "KV cache layer " +
                                     std::to_string(il) + " " + kvq_types_text(tk, tv) +
                                     ": a kivi K type needs a kivi V type and the other way round (kivi4, kivi2, kivi1)");
        }
        any_kivi = any_kivi || kvq_either_kivi(tk, tv);
    }
    if (!any_kivi) {
        // a model's kvq.select is for its kivi caches: one of upstream types, asked for by name, keeps prompts whole
        if (kvq_select_from_model) {
            LLAMA_LOG_INFO("%s: the model's kvq.select is not used: no layer of this %s cache is kivi\n", __func__,
                           kvq_types_text(type_k, type_v).c_str());
            kvq_select_from_model    = false;
            kvq_params.select_hh     = 0.0f;
            kvq_params.select_recent = 0.0f;
        }
        return;
    }
    const std::string types = kvq_types_text(type_k, type_v);
    if (v_trans) {
        throw std::runtime_error("KV cache " + types + ": kivi types need flash attention (-fa on)");
    }
    GGML_ASSERT(n_stream_wanted == n_seq_max || n_stream_wanted == 1);
    const bool unified = n_stream_wanted == 1;
    kvq_n_part     = unified ? n_seq_max : n_stream_wanted;
    kvq_part_cells = unified ? kv_size / n_seq_max / QK_KIVI * QK_KIVI : kv_size;
    kvq_dead.assign(kvq_n_part, {});
    if (kvq_part_cells == 0 || kv_size % QK_KIVI != 0) {
        throw std::runtime_error("KV cache " + types + ": " + std::to_string(kv_size) + " cells for " +
                                 std::to_string(n_seq_max) + " sequences: kivi types need a multiple of 32 cells " +
                                 (unified ? "for each sequence of a unified cache" : "per sequence"));
    }
    // a sliding-window layer masks the first tokens once the window has passed them, and cells leave the front of
    // its parts (kvq_drop_dead): sinks would keep nothing the attention reads
    if (n_swa != 0) {
        kvq_params.n_sink = 0;
    }
    // a window or sink count past a sequence's cells keeps nothing more in fp16: bounded by the context, huge values
    // cannot overflow the ring's size
    kvq_params.window = std::min<int32_t>(kvq_params.window, (int32_t) kvq_part_cells);
    kvq_params.n_sink = std::min<int32_t>(kvq_params.n_sink, (int32_t) kvq_part_cells);
    if (kvq_params.window + kvq_params.n_sink >= (int32_t) kvq_part_cells) {
        // legal (it reproduces f16 exactly), but the quantized copy is kept beside the fp16 one for nothing
        LLAMA_LOG_WARN("%s: kivi KV cache: window %d and sinks %d cover all %u cells of a sequence: attention reads "
                       "every token in fp16 and the quantized copy is held as well, more memory than f16 KV\n",
                       __func__, kvq_params.window, kvq_params.n_sink, kvq_part_cells);
    }
    if (other != nullptr) {
        throw std::runtime_error("KV cache " + types + ": kivi types do not support a cache that shares another's cells yet");
    }
    if (rotation_spec.empty()) {
        rotation_spec = kvq_params.rotate ? "on" : "off";
    }
    LLAMA_LOG_INFO("%s: kivi %sKV cache: window = %d, sinks = %d, rollback = %d, rotation = %s, %u %s of %u cells%s%s%s%s%s%s\n",
            __func__, n_swa != 0 ? "sliding-window " : "", kvq_params.window, kvq_params.n_sink, kvq_params.n_rollback, rotation_spec.c_str(),
            kvq_n_part, unified ? "sequence regions" : "sequence streams", kvq_part_cells,
            spec.empty() || spec == "none" ? "" : ", layer types = ", spec == "none" ? "" : spec.c_str(),
            clip_spec.empty() ? "" : ", clip = ", clip_spec.c_str(),
            dither_spec.empty() ? "" : ", V dither = ", dither_spec.c_str());
}

static std::string kvq_select_name(bool from_model) {
    return from_model ? "prompt selection (the model's kvq.select)" : "prompt selection (--kv-select)";
}

// The graphs known to attend their latent through the K-only path GGML_OP_KVQ is hooked into (mistral4 runs
// deepseek2's; kimi-linear's and bailingmoe3's hybrids attend it in their attention layers); the sparse (DSA)
// families attend through their indexers' top-k masks
static bool kvq_latent_graph(llm_arch arch) {
    switch (arch) {
        case LLM_ARCH_DEEPSEEK2:
        case LLM_ARCH_MISTRAL4:
        case LLM_ARCH_KIMI_LINEAR:
        case LLM_ARCH_BAILINGMOE3:
            return true;
        default:
            return false;
    }
}

// What the fused kernels do not compute is refused here, at context creation, rather than answered wrongly: they
// take Q, K, V, the mask, the KQ scale, the logit soft-cap and learned sinks, and nothing else of llama.cpp's
// attention.
static void kvq_check_attention(const llama_model & model, const llama_hparams & hparams, uint32_t il,
        const std::string & types, bool selects, bool select_from_model) {
    const bool learned_sinks = il < model.layers.size() && model.layers[il].attn_sinks != nullptr;
    if ((hparams.attn_soft_cap || learned_sinks) && selects) {
        throw std::runtime_error("KV cache layer " + std::to_string(il) + " " + types + ": " +
                                 kvq_select_name(select_from_model) + " scores the prompt's tokens without the model's " +
                                 (learned_sinks ? "learned attention sinks (gpt-oss)" :
                                                  "attention logit soft-capping (Gemma 2)") +
                                 "; turn selection off for this model (--kv-select off)");
    }
    std::string missing;
    if (hparams.use_alibi) {
        missing = "ALiBi position biases";
    } else if (!hparams.causal_attn) {
        missing = "non-causal attention";
    } else if (hparams.n_rel_attn_bkts > 0) {
        missing = "relative position biases (T5)";
    } else if (hparams.is_mla() && !kvq_latent_graph(model.arch)) {
        missing = std::string("multi-head latent attention in the ") + llm_arch_name(model.arch) +
                  " architecture (kivi types read MLA's V from K's tiles in deepseek2's, mistral4's, kimi-linear's"
                  " and bailingmoe3's)";
    }
    if (!missing.empty()) {
        throw std::runtime_error("KV cache layer " + std::to_string(il) + " " + types + ": the model uses " + missing +
                                 ", which kivi types do not support yet; use an upstream type for this model "
                                 "(e.g. -ctk q8_0 -ctv q8_0)");
    }
}

// What an MLA layer's kivi cache, which holds K alone, cannot take: its attention reads V from K's tiles and fp16
// cells (ggml_kvq_attn_latent)
void llama_kv_cache::kvq_check_latent(uint32_t il) const {
    const char * why = nullptr;
    if (kvq_selects_prompts()) {
        why = "prompt selection (--kv-select) keeps the selected tokens' V rows";
    } else if (kvq_rotation.k[il] || kvq_rotation.v[il]) {
        why = "upstream's Hadamard rotation (--kv-rotate) rotates V rows, and llama.cpp's latent attention path none";
    } else if (kvq_v_spread[il] > 0.0f) {
        why = "V's dithered rounding (--kv-dither) draws V rows' codes";
    } else if (kvq_clips.v[il] != 1.0f) {
        why = "a V clip ratio (--kv-clip v:...) clips V rows";
    }
    if (why != nullptr) {
        throw std::runtime_error("KV cache layer " + std::to_string(il) + " " +
                                 kvq_types_text(kvq_types_k[il], kvq_types_v[il]) + ": " + why +
                                 "; a multi-head latent attention layer holds no V of its own (its V is its K's first "
                                 "channels, read from K's tiles): turn it off for this model");
    }
}

bool llama_kv_cache::kvq_create_layer(ggml_context * ctx, uint32_t il, ggml_type type_k, ggml_type type_v,
        const char * name_tag) {
    // upstream refuses a quantized V of the context's types without flash attention; a layer's own (--kv-type-swa,
    // per-layer types) would be read transposed, as garbage
    if (v_trans && ggml_is_quantized(type_v)) {
        throw std::runtime_error("KV cache layer " + std::to_string(il) + " " + kvq_types_text(type_k, type_v) +
                                 ": a quantized V cache needs flash attention (-fa on)");
    }
    if (!kvq_either_kivi(type_k, type_v)) {
        if (kvq_selects_prompts()) {
            throw std::runtime_error("KV cache layer " + std::to_string(il) + " " + kvq_types_text(type_k, type_v) +
                                     ": " + kvq_select_name(kvq_select_from_model) + " keeps the selected tokens "
                                     "in kivi layers only; give every layer a kivi type (--kv-layers) or turn "
                                     "selection off (--kv-select off)");
        }
        return false;
    }
    const uint32_t dk = hparams.n_embd_head_k(il);
    const uint32_t dv = hparams.n_embd_head_v(il);
    // an MLA layer's keys hold the latent and the RoPE channels (DeepSeek's 512 + 64)
    const bool     latent = hparams.is_mla();
    const uint32_t max_k  = latent ? 576 : 512;
    if (dk % QK_KIVI != 0 || dv % QK_KIVI != 0 || dk > max_k || dv > 512) {
        throw std::runtime_error("KV cache " + kvq_types_text(type_k, type_v) + ": unsupported head size " + std::to_string(dk) + "/" + std::to_string(dv) + " in layer " +
                                 std::to_string(il) + " (kivi types need a multiple of 32, at most " +
                                 std::to_string(max_k) + " for K and 512 for V)");
    }
    kvq_check_attention(model, hparams, il, kvq_types_text(type_k, type_v), kvq_selects_prompts(), kvq_select_from_model);
    if (latent) {
        kvq_check_latent(il);
    }
    const uint32_t n_embd_k = hparams.n_embd_k_gqa(il);
    const uint32_t n_embd_v = hparams.n_embd_v_gqa(il);
    // the ring holds the window, and n_rollback more cells so that that many tokens can be removed exactly
    const int64_t  n_fp16   = kvq_params.n_sink + ggml_kvq_ring_size(kvq_params.window + kvq_params.n_rollback);

    kv_layer layer = {};
    layer.il     = il;
    layer.k      = ggml_new_tensor_3d(ctx, type_k, (int64_t) n_embd_k*QK_KIVI, kvq_part_cells/QK_KIVI, kvq_n_part);
    layer.k_fp16 = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, n_embd_k, n_fp16, kvq_n_part);
    ggml_format_name(layer.k,      "cache_%sk_tiles_l%d", name_tag, il);
    ggml_format_name(layer.k_fp16, "cache_%sk_fp16_l%d",  name_tag, il);
    if (!latent) {
        layer.v      = ggml_new_tensor_3d(ctx, type_v, n_embd_v, kvq_part_cells, kvq_n_part);
        layer.v_fp16 = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, n_embd_v, n_fp16, kvq_n_part);
        ggml_format_name(layer.v,      "cache_%sv_l%d",       name_tag, il);
        ggml_format_name(layer.v_fp16, "cache_%sv_fp16_l%d",  name_tag, il);
    }
    // per stream: its tiles and V rows (upstream copies these views in update() for seq_cp across streams)
    for (uint32_t s = 0; s < n_stream && !kvq_in_regions(); ++s) {
        layer.k_stream.push_back(ggml_view_2d(ctx, layer.k, layer.k->ne[0], layer.k->ne[1], layer.k->nb[1], s*layer.k->nb[2]));
        layer.v_stream.push_back(latent ? nullptr :
                                 ggml_view_2d(ctx, layer.v, layer.v->ne[0], layer.v->ne[1], layer.v->nb[1], s*layer.v->nb[2]));
    }

    map_layer_ids[il] = layers.size();
    layers.push_back(layer);
    return true;
}

ggml_type llama_kv_cache::kvq_type_v(const kv_layer & layer) const {
    return layer.v != nullptr ? layer.v->type : kvq_types_v[layer.il];
}

// the tensors of a layer that hold data: an MLA layer (kivi or upstream's) holds no V
static std::vector<ggml_tensor *> kvq_held(std::initializer_list<ggml_tensor *> tensors) {
    std::vector<ggml_tensor *> held;
    std::copy_if(tensors.begin(), tensors.end(), std::back_inserter(held), [](ggml_tensor * t) { return t != nullptr; });
    return held;
}

// the sealed tiles of a part's first n_cells cells
static size_t kvq_tile_bytes(const ggml_tensor * tiles, uint32_t n_cells) {
    return (size_t) (n_cells / QK_KIVI) * tiles->nb[1];
}

static void kvq_copy_bytes(ggml_tensor * t, size_t src_offset, size_t dst_offset, size_t n) {
    std::vector<uint8_t> buf(n);
    ggml_backend_tensor_get(t, buf.data(), src_offset, n);
    ggml_backend_tensor_set(t, buf.data(), dst_offset, n);
}

bool llama_kv_cache::kvq_in_regions() const {
    return kvq_n_part > 0 && n_stream == 1;
}

static bool kvq_slot_fail(const std::string & why) {
    LLAMA_LOG_ERROR("kivi KV cache: %s\n", why.c_str());
    return false;
}

// A sequence's part holds its tokens in its first cells, in order: its k-th cell holds its k-th token. Positions
// are the tokens' own and may repeat or jump (M-RoPE's images), so cells are counted, never taken from a span.
static uint32_t kvq_n_cells(const llama_kv_cells & cells, llama_seq_id seq) {
    return (uint32_t) cells.seq_pos_get(seq).size();
}

// the index in its part of the first cell of the sequence at position p or later (its cell count when none is)
static llama_pos kvq_cell_at(const llama_kv_cells & cells, llama_seq_id seq, llama_pos p) {
    const auto & held = cells.seq_pos_get(seq);
    return (llama_pos) std::distance(held.begin(), held.lower_bound({ p, 0 }));
}

// Cells a sliding-window part drops from its front before n_new more tokens go in: whole rings of cells that no
// query attends any more, not even after the deepest removal kvq_can_remove allows (a suffix of at most a ring:
// --kv-rollback widens the ring). A multiple of the ring keeps each cell's ring slot and tile boundaries, and the
// attention contract is judged on cell distances, which a drop keeps too.
uint32_t llama_kv_cache::kvq_n_droppable(const llama_kv_cells & cells, llama_seq_id seq, uint32_t n_held,
        uint32_t n_new) const {
    if (!kvq_drop_dead || n_held + n_new <= kvq_part_cells) {
        return 0;
    }
    const uint32_t  n_ring  = kvq_n_ring(layers, kvq_params.n_sink);
    const llama_pos pos_min = cells.seq_pos_min(seq);
    const llama_pos p_next  = cells.seq_pos_max(seq) + 1 - (llama_pos) n_ring;
    uint32_t n_dead = 0;
    while (p_next >= 0 && n_dead < n_held && llama_hparams::is_masked_swa(n_swa, swa_type, pos_min + n_dead, p_next)) {
        ++n_dead;
    }
    return n_dead / n_ring * n_ring;
}

// what each sequence's part holds, for the message of a full one
static std::string kvq_part_text(bool regions, uint32_t n_part, uint32_t part_cells, bool drops) {
    const std::string cells = std::to_string(part_cells) + " cells";
    const std::string text  = regions ? "a unified kivi cache gives each of its " + std::to_string(n_part) +
                                        " sequences " + cells + " (n_ctx / n_seq_max in whole 32-cell tiles)"
                                      : "a kivi cache gives each sequence " + cells;
    return drops ? text + ": the window of its sliding-window layers, a ubatch and two rings" : text;
}

// The k-th token of a sequence goes to its part's k-th cell, so its positions must not go back. Upstream checks that
// they run on one by one for every model but those with several positions per token (M-RoPE: Qwen2-VL and later),
// whose image embeddings share a position and whose text after an image jumps ahead; a kivi cache takes those as
// they are, except where it reads positions as cell distances (a sliding-window cache's drops, prompt selection),
// which need them one by one. Refused, nothing goes in.
static bool kvq_one_by_one(const llama_hparams & hparams, bool drop_dead, bool selects) {
    return hparams.n_pos_per_embd() == 1 || drop_dead || selects;
}

static bool kvq_check_positions(const llama_ubatch & ubatch, const llama_kv_cells_vec & v_cells,
        const std::vector<uint32_t> & seq_to_stream, bool regions, uint32_t n_part, bool one_by_one) {
    std::vector<llama_pos> p_last(n_part, -1);
    for (uint32_t seq = 0; seq < n_part; ++seq) {
        const llama_kv_cells & cells = v_cells[regions ? 0 : seq_to_stream[seq]];
        p_last[seq] = cells.seq_pos_max(seq);
    }
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        const llama_seq_id seq  = ubatch.seq_id[i][0];
        const llama_pos    pos  = ubatch.pos[i];
        const llama_pos    last = p_last[seq];
        const bool in_order = last < 0 || (one_by_one ? (int64_t) pos == (int64_t) last + 1 : pos >= last);
        if (!in_order) {
            return kvq_slot_fail("sequence " + std::to_string(seq) + " goes on at position " + std::to_string(pos) +
                                 " after " + std::to_string(last) + ": kivi types hold a sequence's tokens in " +
                                 (one_by_one ? "consecutive positions here (a sliding-window cache, prompt selection)"
                                             : "the order of their positions") +
                                 "; decode such input with an f16 or q8_0 cache");
        }
        p_last[seq] = pos;
    }
    return true;
}

// The k-th token of sequence s goes to the k-th cell of its part (a stream, or in a unified cache the region from
// cell s*kvq_part_cells on), after the sequence's cells: it only ever loses a suffix, or in a sliding-window cache
// rings of cells from the front (slot_info::kvq_drops), so they are the first ones of the part
llama_kv_cache::slot_info llama_kv_cache::kvq_find_slot(const llama_ubatch & ubatch) const {
    const bool regions = kvq_in_regions();
    std::vector<uint32_t> n_new(kvq_n_part, 0);
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        if (ubatch.n_seq_id[i] != 1) {
            // llama_context::decode gives each sequence its copy (llama_kvq_unshare_batch) unless every token's rows
            // are read (embeddings, NextN)
            kvq_slot_fail("a token of several sequences at once (a shared prompt) in a context that outputs every "
                          "token's rows (embeddings): kivi types keep every sequence's tokens apart; "
                          "decode it for each sequence, or once and copy the sequence (llama_memory_seq_cp)");
            return {};
        }
        const llama_seq_id seq = ubatch.seq_id[i][0];
        if (seq < 0 || (uint32_t) seq >= kvq_n_part) {
            kvq_slot_fail("sequence id " + std::to_string(seq) + ": this cache holds " + std::to_string(kvq_n_part) +
                          " sequences, ids 0 .. " + std::to_string(kvq_n_part - 1) + " (n_seq_max)");
            return {};
        }
        n_new[seq]++;
    }
    const bool one_by_one = kvq_one_by_one(hparams, kvq_drop_dead, kvq_selects_prompts());
    if (!kvq_check_positions(ubatch, v_cells, seq_to_stream, regions, kvq_n_part, one_by_one)) {
        return {};
    }
    slot_info res = {};
    // streams: one slot per sequence of the ubatch, its tokens in a row (split_equal)
    const uint32_t n_slots = regions ? 1 : ubatch.n_seqs_unq;
    res.s0 = regions ? 0 : LLAMA_MAX_SEQ;
    res.resize(n_slots);
    std::vector<uint32_t> next(kvq_n_part, 0);
    for (uint32_t seq = 0; seq < kvq_n_part; ++seq) {
        if (n_new[seq] == 0) {
            continue;
        }
        const uint32_t strm  = regions ? 0 : seq_to_stream[seq];
        const uint32_t first = regions ? seq*kvq_part_cells : 0;
        const llama_kv_cells & cells = v_cells[strm];
        const uint32_t  n_held  = kvq_n_cells(cells, seq);
        const uint32_t  n_drop  = kvq_n_droppable(cells, seq, n_held, n_new[seq]);
        if (n_held - n_drop + n_new[seq] > kvq_part_cells) {
            kvq_slot_fail("sequence " + std::to_string(seq) + " is full: " +
                          kvq_part_text(regions, kvq_n_part, kvq_part_cells, kvq_drop_dead));
            return {};
        }
        if (n_drop > 0) {
            res.kvq_drops.push_back({ strm, first, n_drop, n_held });
        }
        // a prompt decoded into an empty sequence, alone in its ubatch (kvq_check_select), into kivi layers (an iSWA
        // hybrid's global cache may hold none: LFM2's attention layers all slide)
        if (n_held == 0 && ubatch.n_seqs_unq == 1 && kvq_selects_prompts() && kvq_active() &&
            !(seq < kvq_select_whole.size() && kvq_select_whole[seq])) {
            res.kvq_select = llama_kvq_select_for(kvq_params, n_new[seq]);
            res.kvq_select.part = regions ? seq : strm;
        }
        next[seq] = first + n_held - n_drop;
    }
    const uint32_t n_per_slot = ubatch.n_tokens / n_slots;
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        const llama_seq_id seq = ubatch.seq_id[i][0];
        const uint32_t     s   = i / n_per_slot;
        GGML_ASSERT(regions || seq == ubatch.seq_id_unq[s]);
        res.strm[s] = regions ? 0 : seq_to_stream[seq];
        res.s0 = std::min<uint32_t>(res.s0, res.strm[s]);
        res.s1 = std::max<uint32_t>(res.s1, res.strm[s]);
        res.idxs[s].push_back(next[seq]++);
    }
    return res;
}

// A drop's cells, before the ubatch that needed the room goes in (apply_ubatch)
void llama_kv_cache::kvq_apply_drops(const slot_info & sinfo) {
    for (const llama_kvq_drop & drop : sinfo.kvq_drops) {
        llama_kv_cells & cells = v_cells[drop.strm];
        const llama_kv_cells live = cells.cp(drop.first + drop.n_drop, drop.n_held - drop.n_drop);
        for (uint32_t k = 0; k < drop.n_held; ++k) {
            cells.rm(drop.first + k);
        }
        cells.set(drop.first, live);
    }
}

bool llama_kv_cache::kvq_selects_prompts() const {
    return n_swa == 0 && llama_kvq_select_on(kvq_params.select_hh, kvq_params.select_recent);
}

// A selecting ubatch needs the whole prompt: refused, before any of the batch goes in, when an empty sequence's
// tokens span ubatches (-ub) or share one with another sequence's; a selection the model's kvq.select asks for
// keeps such a prompt whole instead (kvq_select_whole), as a tool that knows nothing of it batches as it always does
bool llama_kv_cache::kvq_check_select(const std::vector<llama_ubatch> & ubatches) const {
    kvq_select_whole.assign(kvq_n_part, false);
    if (!kvq_active() || !kvq_selects_prompts()) {
        return true;
    }
    // the sequences a prompt may start: those the cache holds nothing of
    std::vector<bool> empty(kvq_n_part);
    for (uint32_t seq = 0; seq < kvq_n_part; ++seq) {
        empty[seq] = v_cells[kvq_in_regions() ? 0 : seq_to_stream[seq]].seq_pos_min(seq) < 0;
    }
    std::vector<int64_t>  first(kvq_n_part, -1);
    std::vector<uint32_t> n_tokens(kvq_n_part, 0);
    std::vector<bool>     spans(kvq_n_part, false);
    std::vector<bool>     shares(kvq_n_part, false);
    for (size_t u = 0; u < ubatches.size(); ++u) {
        const llama_ubatch & ub = ubatches[u];
        for (uint32_t i = 0; i < ub.n_tokens; ++i) {
            const llama_seq_id seq = ub.seq_id[i][0];
            if (seq < 0 || (uint32_t) seq >= kvq_n_part || !empty[seq]) {
                continue;
            }
            if (first[seq] < 0) {
                first[seq] = (int64_t) u;
            }
            spans[seq]  = spans[seq] || first[seq] != (int64_t) u;
            shares[seq] = shares[seq] || ub.n_seqs_unq > 1;
            n_tokens[seq]++;
        }
    }
    const std::string name = kvq_select_name(kvq_select_from_model);
    for (uint32_t seq = 0; seq < kvq_n_part; ++seq) {
        if (first[seq] < 0 || llama_kvq_select_for(kvq_params, n_tokens[seq]).n_prompt == 0 || (!spans[seq] && !shares[seq])) {
            continue;
        }
        const std::string why = spans[seq] ?
            name + " reads the whole prompt in one ubatch, and the " + std::to_string(n_tokens[seq]) +
            "-token prompt of sequence " + std::to_string(seq) + " spans several" :
            name + " takes one prompt per ubatch, and sequence " + std::to_string(seq) + "'s shares one with another's";
        const std::string fix = spans[seq] ?
            "raise the batch and ubatch sizes to at least " + std::to_string(n_tokens[seq]) + " (-b, -ub)" :
            "decode each sequence's prompt in a call of its own";
        if (!kvq_select_from_model) {
            return kvq_slot_fail(why + ": " + fix);
        }
        LLAMA_LOG_INFO("%s: %s: kept whole (to select it, %s)\n", __func__, why.c_str(), fix.c_str());
        kvq_select_whole[seq] = true;
    }
    return true;
}

// A selecting ubatch's cells (slot_info::kvq_select) after apply_ubatch placed the prompt: the first n_keep hold
// the kept tokens (the graph writes them there), at the prompt's last n_keep positions, consecutive as the kivi
// layout reads them; a cell stands in for a position by distance only, and every later query sees them all
void llama_kv_cache::kvq_apply_select(const slot_info & sinfo, const llama_ubatch & ubatch) {
    kvq_forget_dead(sinfo);
    const llama_kvq_select & sel = sinfo.kvq_select;
    if (sel.n_prompt == 0) {
        return;
    }
    llama_kv_cells & cells = v_cells[sinfo.strm[0]];
    const auto & idxs = sinfo.idxs[0];
    const llama_seq_id seq = ubatch.seq_id[0][0];
    const uint32_t n_keep = sel.n_keep();
    for (uint32_t i = 0; i < sel.n_prompt; ++i) {
        cells.rm(idxs[i]);
    }
    for (uint32_t c = 0; c < n_keep; ++c) {
        cells.pos_set(idxs[c], ubatch.pos[sel.n_prompt - n_keep + c]);
        cells.seq_add(idxs[c], seq);
    }
    std::vector<uint32_t> & dead = kvq_dead[sel.part];
    dead.assign(layers.size(), 0);
    for (uint32_t ikv = 0; ikv < layers.size(); ++ikv) {
        dead[ikv] = sel.n_dead(ikv, (uint32_t) layers.size());
    }
    if (std::all_of(dead.begin(), dead.end(), [](uint32_t n) { return n == 0; })) {
        dead.clear();
    }
}

// MiniKV's pyramid: a part's cells fill in order, so a token placed at or before a dead cell means the cells from
// there on were freed (seq_rm) and are written again: they are no longer dead
void llama_kv_cache::kvq_forget_dead(const slot_info & sinfo) {
    if (!kvq_masks_dead()) {
        return;
    }
    const uint32_t n_sink = (uint32_t) kvq_params.n_sink;
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        for (uint32_t idx : sinfo.idxs[s]) {
            uint32_t part;
            uint32_t k;
            kvq_part_of(sinfo.strm[s], idx, part, k);
            for (uint32_t & n : kvq_dead[part]) {
                n = std::min(n, k > n_sink ? k - n_sink : 0);
            }
        }
    }
}

void llama_kv_cache::kvq_copy_dead(uint32_t part_src, uint32_t part_dst) {
    if (kvq_active()) {
        kvq_dead[part_dst] = kvq_dead[part_src];
    }
}

bool llama_kv_cache::kvq_masks_dead() const {
    return std::any_of(kvq_dead.begin(), kvq_dead.end(), [](const std::vector<uint32_t> & d) { return !d.empty(); });
}

// what each cache layer masks of each of the ubatch's streams, F32 [n_kv, 1, 1, n_stream*n_layer], while some
// part holds dead cells (kvq_masks_dead): a graph built without it is not reused once one does
ggml_tensor * llama_kv_cache::kvq_build_input_dead(ggml_context * ctx, uint32_t n_kv, const llama_ubatch & ubatch,
        bool unified) const {
    if (!kvq_masks_dead()) {
        return nullptr;
    }
    const int64_t n_stream = unified ? 1 : ubatch.n_seqs_unq;
    ggml_tensor * dead = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, n_kv, 1, 1, n_stream*(int64_t) layers.size());
    ggml_set_input(dead);
    ggml_set_name(dead, "kvq_dead");
    return dead;
}

void llama_kv_cache::kvq_set_input_dead(ggml_tensor * dst, const slot_info & sinfo) const {
    GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer));
    const int64_t  n_kv     = dst->ne[0];
    const int64_t  n_stream = dst->ne[3] / (int64_t) layers.size();
    const uint32_t n_sink   = (uint32_t) kvq_params.n_sink;
    float * data = (float *) dst->data;
    std::fill(data, data + ggml_nelements(dst), 0.0f);
    for (int64_t s = 0; s < n_stream; ++s) {
        const uint32_t strm = sinfo.strm[n_stream > 1 ? s : 0];
        for (int64_t cell = 0; cell < n_kv; ++cell) {
            uint32_t part;
            uint32_t k;
            kvq_part_of(strm, (uint32_t) cell, part, k);
            if (part >= kvq_n_part) {
                break;  // the cells past the last region of a unified cache
            }
            const std::vector<uint32_t> & dead = kvq_dead[part];
            for (size_t ikv = 0; ikv < dead.size(); ++ikv) {
                if (k >= n_sink && k < n_sink + dead[ikv]) {
                    data[((int64_t) ikv*n_stream + s)*n_kv + cell] = -INFINITY;
                }
            }
        }
    }
}

// the mask of layer ikv: the ubatch's, with the cells its selected prompts left dead masked out
static ggml_tensor * kvq_mask_dead(ggml_context * ctx, ggml_tensor * kq_mask, ggml_tensor * dead, int32_t ikv) {
    const int64_t n_stream = kq_mask->ne[3];
    ggml_tensor * row = ggml_view_4d(ctx, dead, dead->ne[0], 1, 1, n_stream, dead->nb[1], dead->nb[2], dead->nb[3],
                                     ikv*n_stream*dead->nb[3]);
    return ggml_add(ctx, kq_mask, row);
}

static void kvq_build_move_rows(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * t, size_t src, size_t dst,
        int64_t n_rows) {
    if (n_rows == 0) {
        return;
    }
    ggml_tensor * from = ggml_view_2d(ctx, t, t->ne[0], n_rows, t->nb[1], src);
    ggml_tensor * to   = ggml_view_2d(ctx, t, t->ne[0], n_rows, t->nb[1], dst);
    ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_cont(ctx, from), to));
}

// A drop's data (tiles, V rows, the rows of other layers; the ring stays: a multiple of its size keeps the slots)
// as the first nodes of the ubatch's graph, which a backend runs after the previous ubatch's graph and before this
// one's own writes; through a copy, as the two ranges overlap
void llama_kv_cache::kvq_build_drops(ggml_context * ctx, ggml_cgraph * gf, const slot_info & sinfo) const {
    for (const llama_kvq_drop & drop : sinfo.kvq_drops) {
        uint32_t part;
        uint32_t k;
        kvq_part_of(drop.strm, drop.first, part, k);
        const uint32_t n_live = drop.n_held - drop.n_drop;
        for (const kv_layer & layer : layers) {
            if (layer.k_fp16 == nullptr) {
                for (ggml_tensor * t : kvq_held({ layer.k, layer.v })) {
                    const size_t first = kvq_plain_part_offset(t, part, kvq_in_regions(), kvq_part_cells);
                    kvq_build_move_rows(ctx, gf, t, first + drop.n_drop*t->nb[1], first, n_live);
                }
                continue;
            }
            kvq_build_move_rows(ctx, gf, layer.k, part*layer.k->nb[2] + drop.n_drop/QK_KIVI*layer.k->nb[1],
                                part*layer.k->nb[2], (n_live + QK_KIVI - 1)/QK_KIVI);
            if (layer.v != nullptr) {
                kvq_build_move_rows(ctx, gf, layer.v, part*layer.v->nb[2] + drop.n_drop*layer.v->nb[1],
                                    part*layer.v->nb[2], n_live);
            }
        }
    }
}

// Whether seq_cp would copy these positions: a unified kivi cache copies a sequence from its first token, and one
// that stops earlier is the whole copy less a suffix, as far as seq_rm allows (logs why not)
bool llama_kv_cache::kvq_can_copy(llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) const {
    if (!kvq_in_regions() || seq_id_src == seq_id_dst) {
        return true;
    }
    if ((uint32_t) seq_id_src >= kvq_n_part || (uint32_t) seq_id_dst >= kvq_n_part) {
        return kvq_slot_fail("seq_cp " + std::to_string(seq_id_src) + " -> " + std::to_string(seq_id_dst) +
                             ": this cache holds " + std::to_string(kvq_n_part) + " sequences (n_seq_max); nothing copied");
    }
    const llama_kv_cells & cells = v_cells[0];
    const llama_pos pos_min = cells.seq_pos_min(seq_id_src);
    const llama_pos pos_max = cells.seq_pos_max(seq_id_src);
    const uint32_t  n       = kvq_n_cells(cells, seq_id_src);
    if (n > 0 && p0 > pos_min) {
        return kvq_slot_fail("seq_cp " + std::to_string(seq_id_src) + " -> " + std::to_string(seq_id_dst) +
                             " of positions [" + std::to_string(p0) + ", " + std::to_string(p1) + "): kivi types copy "
                             "a sequence from its first token (" + std::to_string(pos_min) + "); nothing copied");
    }
    const bool to_end = p1 < 0 || p1 > pos_max;
    return n == 0 || to_end || kvq_can_remove_stream(cells, seq_id_src, p1, -1);
}

// seq_cp in a unified kivi cache: the region of dst becomes a copy of src's (cells and data)
void llama_kv_cache::kvq_seq_cp(llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) {
    if (seq_id_src == seq_id_dst || !kvq_can_copy(seq_id_src, seq_id_dst, p0, p1)) {
        return;
    }
    llama_kv_cells & cells = v_cells[0];
    const uint32_t  n       = kvq_n_cells(cells, seq_id_src);
    const bool      to_end  = p1 < 0 || p1 > cells.seq_pos_max(seq_id_src);
    seq_rm(seq_id_dst, -1, -1);

    const uint32_t src0 = seq_id_src*kvq_part_cells;
    const uint32_t dst0 = seq_id_dst*kvq_part_cells;
    std::vector<uint32_t> src_idxs(n);
    std::vector<uint32_t> dst_idxs(n);
    for (uint32_t k = 0; k < n; ++k) {
        src_idxs[k] = src0 + k;
        dst_idxs[k] = dst0 + k;
    }
    cells.set(dst_idxs, cells.cp(src_idxs));
    for (uint32_t idx : dst_idxs) {
        cells.seq_add(idx, seq_id_dst);
        cells.seq_rm(idx, seq_id_src);
    }
    kvq_copy_dead(seq_id_src, seq_id_dst);
    // the data follows in update(), once the graph that may still be writing it is done; copies run in order
    sc_info.ssrc.push_back(seq_id_src);
    sc_info.sdst.push_back(seq_id_dst);
    if (!to_end) {
        seq_rm(seq_id_dst, p1, -1);
    }
}

// seq_cp's data, whole parts (a stream, or a unified cache's region): a part holds nothing past its sequence's
// cells that a copy could spoil, and copies made again give the same bytes
void llama_kv_cache::kvq_copy_parts(const stream_copy_info & copies) const {
    for (size_t i = 0; i < copies.ssrc.size(); ++i) {
        const uint32_t src = copies.ssrc[i];
        const uint32_t dst = copies.sdst[i];
        for (const kv_layer & layer : layers) {
            if (layer.k_fp16 == nullptr) {
                // a layer of another type (per-layer types): plain rows, one per cell
                for (ggml_tensor * t : kvq_held({ layer.k, layer.v })) {
                    kvq_copy_bytes(t, kvq_plain_part_offset(t, src, kvq_in_regions(), kvq_part_cells),
                                   kvq_plain_part_offset(t, dst, kvq_in_regions(), kvq_part_cells),
                                   (size_t) kvq_part_cells*t->nb[1]);
                }
                continue;
            }
            // sealed tiles, V rows, fp16 sinks and ring: one slice per part
            for (ggml_tensor * t : kvq_held({ layer.k, layer.v, layer.k_fp16, layer.v_fp16 })) {
                kvq_copy_bytes(t, src*t->nb[2], dst*t->nb[2], t->nb[2]);
            }
        }
    }
}

// Upstream rotates K (V) when its cache type is quantized, every layer alike. In a cache with kivi layers each layer
// decides: a kivi layer as the rotation setting says for it, any other as upstream would, when its type is quantized.
// `rotated` gets what each layer of this cache rotates; whether any does.
bool llama_kv_cache::kvq_rotates(const std::vector<ggml_type> & types, const std::vector<bool> & setting,
                                 std::vector<bool> & rotated) const {
    bool any_kivi      = false;
    bool any_quantized = false;
    // the layers this cache holds: the two caches of an iSWA model may be of different types
    for (const kv_layer & layer : layers) {
        const ggml_type type = types[layer.il];
        any_kivi      = any_kivi || ggml_kvq_is_kivi(type);
        any_quantized = any_quantized || ggml_is_quantized(type);
    }
    bool any = false;
    for (const kv_layer & layer : layers) {
        const ggml_type type = types[layer.il];
        rotated[layer.il] = ggml_kvq_is_kivi(type) ? setting[layer.il] : any_kivi ? ggml_is_quantized(type) : any_quantized;
        any = any || rotated[layer.il];
    }
    return any;
}

// whether layer il's K (V) is rotated; a layer that reads another's cache (shared KV) was turned as that one
bool llama_kv_cache::kvq_layer_rotated(int32_t il, bool v) const {
    const int32_t owner = layers[map_layer_ids.at(il)].il;
    return v ? attn_rot_v && kvq_rotated.v[owner] : attn_rot_k && kvq_rotated.k[owner];
}

ggml_tensor * llama_kv_cache::kvq_layer_rot(ggml_tensor * rot, int32_t il, bool v) const {
    return rot != nullptr && kvq_layer_rotated(il, v) ? rot : nullptr;
}

bool llama_kv_cache::kvq_active() const {
    for (const kv_layer & layer : layers) {
        if (layer.k_fp16 != nullptr) {
            return true;
        }
    }
    return false;
}

// Saved state of a kivi cache, after upstream's cell metadata: every setting that changes what the bytes mean
// (checked on load: data of another type, window or sink count would be read into the wrong layout, rotated
// codes would be read as plain ones), then per layer the dead cells a pyramid selection left after the sinks, the
// sealed K tiles, the V rows and the fp16 sinks and ring.
static constexpr uint32_t KVQ_STATE_MAGIC    = 0x3551564b; // "KVQ5"
static constexpr uint32_t KVQ_STATE_MAGIC_V4 = 0x3451564b; // "KVQ4": before a layer's dead cells were recorded
static constexpr uint32_t KVQ_STATE_MAGIC_V1 = 0x3151564b; // "KVQ1": before the rotation was recorded
static constexpr uint32_t KVQ_STATE_MAGIC_V2 = 0x3251564b; // "KVQ2": the rotation setting, not what was rotated
static constexpr uint32_t KVQ_STATE_MAGIC_V3 = 0x3351564b; // "KVQ3": what the whole cache rotates, not each layer

struct kvq_state_header {
    uint32_t magic;
    uint32_t n_layer;
    int32_t  window;
    int32_t  n_sink;
    int64_t  n_fp16;
    uint32_t n_cells;
    int32_t  rotate;   // KVQ_ROT_K | KVQ_ROT_V: what any layer rotates, whatever made it (type or setting); then
                       // per layer its K and V type ids, (from KVQ4) what it rotates and (from KVQ5) its dead cells
};

enum { KVQ_ROT_K = 1, KVQ_ROT_V = 2 };

static int32_t kvq_rotation_bits(bool rot_k, bool rot_v) {
    return (rot_k ? KVQ_ROT_K : 0) | (rot_v ? KVQ_ROT_V : 0);
}

int32_t llama_kv_cache::kvq_layer_rotation(int32_t il) const {
    return kvq_rotation_bits(kvq_layer_rotated(il, false), kvq_layer_rotated(il, true));
}

static std::string kvq_rotation_text(int32_t rotate) {
    static const char * texts[] = { "off", "on for K", "on for V", "on for K and V" };
    return rotate >= 0 && rotate <= (KVQ_ROT_K | KVQ_ROT_V) ? texts[rotate] : "invalid";
}

// one block per saved part: its first n_cells cells
void llama_kv_cache::kvq_state_write_part(llama_io_write_i & io, uint32_t part, uint32_t n_cells) const {
    const kvq_state_header header = { KVQ_STATE_MAGIC, (uint32_t) layers.size(), kvq_params.window, kvq_params.n_sink,
                                      kvq_n_fp16(layers), n_cells, kvq_rotation_bits(attn_rot_k, attn_rot_v) };
    io.write(&header, sizeof(header));
    const std::vector<uint32_t> & dead = kvq_dead[part];
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        const kv_layer & layer = layers[ikv];
        const int32_t types[4] = { (int32_t) layer.k->type, (int32_t) kvq_type_v(layer), kvq_layer_rotation(layer.il),
                                   dead.empty() ? 0 : (int32_t) dead[ikv] };
        io.write(types, sizeof(types));
        if (layer.k_fp16 == nullptr) {
            // a layer of another type (per-layer types): the part's rows, one per cell
            for (ggml_tensor * t : kvq_held({ layer.k, layer.v })) {
                io.write_tensor(t, kvq_plain_part_offset(t, part, kvq_in_regions(), kvq_part_cells), (size_t) n_cells*t->nb[1]);
            }
            continue;
        }
        io.write_tensor(layer.k,      part*layer.k->nb[2],      kvq_tile_bytes(layer.k, n_cells));
        if (layer.v != nullptr) {
            io.write_tensor(layer.v,      part*layer.v->nb[2],      (size_t) n_cells * layer.v->nb[1]);
        }
        io.write_tensor(layer.k_fp16, part*layer.k_fp16->nb[2], layer.k_fp16->nb[2]);
        if (layer.v_fp16 != nullptr) {
            io.write_tensor(layer.v_fp16, part*layer.v_fp16->nb[2], layer.v_fp16->nb[2]);
        }
    }
}

// the part of cell `cell` of stream `strm`, and the cell's index within the part
void llama_kv_cache::kvq_part_of(uint32_t strm, uint32_t cell, uint32_t & part, uint32_t & k) const {
    part = kvq_in_regions() ? cell / kvq_part_cells : strm;
    k    = cell % kvq_part_cells;
}

void llama_kv_cache::kvq_state_write_data(llama_io_write_i & io, const cell_ranges_t & cr) const {
    // seq_cp data not yet copied (the state API has synchronized the context); update() makes the copies again
    kvq_copy_parts(sc_info);
    // a part's tokens fill its first cells, so the saved ranges are runs of whole parts: split at the part ends
    for (const auto & range : cr.data) {
        for (uint32_t cell = range.first; cell < range.second; ) {
            uint32_t part;
            uint32_t k;
            kvq_part_of(cr.strm, cell, part, k);
            if (k != 0) {
                throw std::runtime_error("kivi KV cache: only whole sequences can be saved");
            }
            const uint32_t n = std::min(range.second - cell, kvq_part_cells);
            kvq_state_write_part(io, part, n);
            cell += n;
        }
    }
}

// a type id read from a file: named only when it is one (a corrupt file holds anything)
static bool kvq_is_type_id(int32_t id) {
    return id >= 0 && id < GGML_TYPE_COUNT && ggml_get_type_traits((ggml_type) id)->blck_size != 0;
}

static bool kvq_state_fail(const std::string & why) {
    LLAMA_LOG_ERROR("kivi KV cache: cannot load this state: %s\n", why.c_str());
    return false;
}

bool llama_kv_cache::kvq_refuse_kivi_state(uint32_t first_word) const {
    if (first_word != KVQ_STATE_MAGIC && first_word != KVQ_STATE_MAGIC_V1 && first_word != KVQ_STATE_MAGIC_V2 &&
        first_word != KVQ_STATE_MAGIC_V3 && first_word != KVQ_STATE_MAGIC_V4) {
        return false;
    }
    // upstream's reader would take the magic for its V-transposition flag ("incompatible V transposition")
    const std::string held = layers.empty() ? "" : ", this cache holds " +
        kvq_types_text(layers[0].k->type, kvq_type_v(layers[0])) + " in layer " + std::to_string(layers[0].il);
    LLAMA_LOG_ERROR("KV cache: cannot load this state: it was saved from a kivi KV cache%s: load it with the KV types "
                    "it was saved with\n", held.c_str());
    return true;
}

bool llama_kv_cache::kvq_state_read_data(llama_io_read_i & io, uint32_t strm, uint32_t cell_count, const slot_info & sinfo) {
    // pending seq_cp data first, or update() would copy it over what this load restores
    kvq_copy_parts(sc_info);
    sc_info = {};
    // a whole-cache restore puts the cells first to last; in a unified cache they go to their sequences' regions
    std::vector<uint32_t> from;
    std::vector<uint32_t> to;
    std::vector<std::pair<uint32_t, uint32_t>> parts; // (part, n_cells)
    for (uint32_t done = 0; done < cell_count; ) {
        uint32_t part    = 0;
        uint32_t n_cells = 0;
        if (!kvq_state_read_part(io, strm, cell_count - done, sinfo.idxs[0].data() + done, from, to, part, n_cells)) {
            return false;
        }
        for (const auto & seen : parts) {
            if (seen.first == part) {
                return kvq_state_fail("it holds sequence " + std::to_string(part) + " twice");
            }
        }
        parts.emplace_back(part, n_cells);
        done += n_cells;
    }
    llama_kv_cells & cells = v_cells[strm];
    const llama_kv_cells moved = cells.cp(from);
    for (uint32_t idx : from) {
        cells.rm(idx);
    }
    cells.set(to, moved);
    for (const auto & part : parts) {
        if (!kvq_check_restored_part(strm, part.first, part.second)) {
            return false;
        }
    }
    return true;
}

// The cells of a restored part must be what the kivi layout reads: its sequence's tokens in the order of their
// positions (consecutive ones where kvq_check_positions asks for them), the k-th in the part's k-th cell, and no
// other cell of that sequence (a corrupt state's metadata says anything).
bool llama_kv_cache::kvq_check_restored_part(uint32_t strm, uint32_t part, uint32_t n_cells) const {
    const llama_kv_cells & cells = v_cells[strm];
    const uint32_t base = kvq_in_regions() ? part*kvq_part_cells : 0;
    if (cells.is_empty(base) || cells.seq_count(base) != 1) {
        return kvq_state_fail("its first cell of sequence part " + std::to_string(part) + " is not one sequence's");
    }
    const llama_seq_id seq = cells.seq_get(base);
    if (kvq_in_regions() ? (uint32_t) seq != part : seq_to_stream[seq] != strm) {
        return kvq_state_fail("it puts sequence " + std::to_string(seq) + " in the part of another");
    }
    const int64_t pos0 = cells.pos_get(base);
    if (pos0 < 0 || pos0 + n_cells - 1 > std::numeric_limits<llama_pos>::max()) {
        return kvq_state_fail("sequence " + std::to_string(seq) + " starts at position " + std::to_string(pos0));
    }
    const bool one_by_one = kvq_one_by_one(hparams, kvq_drop_dead, kvq_selects_prompts());
    llama_pos  last       = pos0;
    for (uint32_t k = 0; k < n_cells; ++k) {
        const uint32_t cell = base + k;
        if (cells.is_empty(cell) || cells.seq_count(cell) != 1 || !cells.seq_has(cell, seq) ||
            (one_by_one ? cells.pos_get(cell) != pos0 + k : cells.pos_get(cell) < last)) {
            return kvq_state_fail("the cells of sequence " + std::to_string(seq) + " are not its positions " +
                                  (one_by_one ? std::to_string(pos0) + " .. " + std::to_string(pos0 + n_cells - 1)
                                              : std::string("from ") + std::to_string(pos0)) + " in order");
        }
        last = cells.pos_get(cell);
    }
    uint32_t n_seq_cells = 0;
    for (uint32_t cell = 0; cell < cells.size(); ++cell) {
        n_seq_cells += !cells.is_empty(cell) && cells.seq_has(cell, seq);
    }
    if (n_seq_cells != n_cells) {
        return kvq_state_fail("it gives sequence " + std::to_string(seq) + " " + std::to_string(n_seq_cells) +
                              " cells, its data " + std::to_string(n_cells));
    }
    return true;
}

// A refused sequence load takes every cell of the sequence, at whatever position a corrupt state gave it (seq_rm
// takes positions 0 .. INT32_MAX - 1 only); any cache
void llama_kv_cache::kvq_forget_seq(llama_seq_id seq_id, uint32_t strm) {
    llama_kv_cells & cells = v_cells[strm];
    for (uint32_t cell = 0; cell < cells.size(); ++cell) {
        if (cells.seq_has(cell, seq_id)) {
            cells.seq_rm(cell, seq_id);
        }
    }
    v_heads[strm] = 0;
}

// A refused sequence load of a kivi cache: the sequence goes, and its part's data with it (a file load writes as it reads, and a
// corrupt value left in a free cell can still reach the attention's arithmetic)
void llama_kv_cache::kvq_state_clear(llama_seq_id seq_id, uint32_t strm) {
    kvq_forget_seq(seq_id, strm);
    const uint32_t part = kvq_in_regions() ? (uint32_t) seq_id : strm;
    for (const kv_layer & layer : layers) {
        if (layer.k_fp16 == nullptr) {
            for (ggml_tensor * t : kvq_held({ layer.k, layer.v })) {
                llama_clear_tensor_data(t, kvq_plain_part_offset(t, part, kvq_in_regions(), kvq_part_cells),
                                        (size_t) kvq_part_cells*t->nb[1]);
            }
            continue;
        }
        for (ggml_tensor * t : kvq_held({ layer.k, layer.v, layer.k_fp16, layer.v_fp16 })) {
            llama_clear_tensor_data(t, part*t->nb[2], t->nb[2]);
        }
    }
}

bool llama_kv_cache::kvq_state_read_part(llama_io_read_i & io, uint32_t strm, uint32_t n_left, const uint32_t * idxs,
        std::vector<uint32_t> & from, std::vector<uint32_t> & to, uint32_t & part, uint32_t & n_cells) {
    kvq_state_header header = {};
    io.read(&header, sizeof(header));
    // KVQ3 rotated every layer as its header says; KVQ4 selected no pyramid
    const size_t n_layer_fields = header.magic == KVQ_STATE_MAGIC_V3 ? 2 : header.magic == KVQ_STATE_MAGIC_V4 ? 3 : 4;
    if (header.magic == KVQ_STATE_MAGIC_V3 || header.magic == KVQ_STATE_MAGIC_V4) {
        header.magic = KVQ_STATE_MAGIC;
    }
    if (header.magic == KVQ_STATE_MAGIC_V1 || header.magic == KVQ_STATE_MAGIC_V2) {
        return kvq_state_fail("it was saved by an older pykvq (kivi state format " +
                              std::string(header.magic == KVQ_STATE_MAGIC_V1 ? "1" : "2") +
                              ", which does not record what the cache rotates): save it again with this one");
    }
    if (header.magic != KVQ_STATE_MAGIC) {
        return kvq_state_fail("it was not saved from a kivi KV cache");
    }
    const int64_t n_fp16 = kvq_n_fp16(layers);
    const int32_t rotate = kvq_rotation_bits(attn_rot_k, attn_rot_v);
    if (header.n_layer != layers.size() || header.window != kvq_params.window || header.n_sink != kvq_params.n_sink ||
        header.n_fp16 != n_fp16 || header.rotate != rotate) {
        return kvq_state_fail("it was saved with " + std::to_string(header.n_layer) + " layers, window " +
                              std::to_string(header.window) + ", sinks " + std::to_string(header.n_sink) + ", " +
                              std::to_string(header.n_fp16) + " fp16 cells (sinks + ring, --kv-rollback widens it), " +
                              "rotation " + kvq_rotation_text(header.rotate) +
                              "; this cache has " + std::to_string(layers.size()) + " layers, window " +
                              std::to_string(kvq_params.window) + ", sinks " + std::to_string(kvq_params.n_sink) +
                              ", " + std::to_string(n_fp16) + " fp16 cells, rotation " + kvq_rotation_text(rotate));
    }
    n_cells = header.n_cells;
    if (n_cells == 0 || n_cells > n_left) {
        return kvq_state_fail("its cell count does not match its metadata");
    }
    // the part: a stream, or in a unified cache the region of the cells' sequence
    part = kvq_in_regions() ? (uint32_t) v_cells[strm].seq_get(idxs[0]) : strm;
    if (part >= kvq_n_part || n_cells > kvq_part_cells) {
        return kvq_state_fail("it holds " + std::to_string(n_cells) + " cells of sequence " + std::to_string(part) +
                              "; this cache holds " + std::to_string(kvq_n_part) + " sequences of " +
                              std::to_string(kvq_part_cells) + " cells");
    }
    for (uint32_t k = 0; k < n_cells; ++k) {
        const uint32_t cell = (kvq_in_regions() ? part*kvq_part_cells : 0) + k;
        if (idxs[k] == cell) {
            continue;
        }
        if (!kvq_in_regions()) {
            return kvq_state_fail("the sequence must be restored into an empty stream, starting at cell 0");
        }
        from.push_back(idxs[k]);
        to.push_back(cell);
    }
    std::vector<uint32_t> dead(layers.size(), 0);
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        const kv_layer & layer = layers[ikv];
        // past the end of a truncated file llama_file reads nothing and says nothing: the ids no type has stay
        int32_t types[4] = { -1, -1, header.rotate, 0 };
        io.read(types, n_layer_fields*sizeof(int32_t));
        if (!kvq_is_type_id(types[0]) || !kvq_is_type_id(types[1])) {
            return kvq_state_fail("layer " + std::to_string(layer.il) + "'s record names no KV types: the state is "
                                  "truncated or corrupt");
        }
        if (types[0] != (int32_t) layer.k->type || types[1] != (int32_t) kvq_type_v(layer)) {
            return kvq_state_fail("layer " + std::to_string(layer.il) + " was saved as " +
                                  kvq_types_text((ggml_type) types[0], (ggml_type) types[1]) + ", this cache holds " +
                                  kvq_types_text(layer.k->type, kvq_type_v(layer)));
        }
        if (types[2] != kvq_layer_rotation(layer.il)) {
            return kvq_state_fail("layer " + std::to_string(layer.il) + " was saved with rotation " +
                                  kvq_rotation_text(types[2]) + ", this cache's is " +
                                  kvq_rotation_text(kvq_layer_rotation(layer.il)));
        }
        // dead cells lie between the sinks and the last cell, which holds a token every layer reads
        if (types[3] < 0 || (types[3] > 0 && (layer.k_fp16 == nullptr ||
                                              (int64_t) kvq_params.n_sink + types[3] >= (int64_t) n_cells))) {
            return kvq_state_fail("layer " + std::to_string(layer.il) + " has " + std::to_string(types[3]) +
                                  " dead cells of " + std::to_string(n_cells) + " (sinks " +
                                  std::to_string(kvq_params.n_sink) + ")");
        }
        dead[ikv] = (uint32_t) types[3];
        if (layer.k_fp16 == nullptr) {
            for (ggml_tensor * t : kvq_held({ layer.k, layer.v })) {
                io.read_tensor(t, kvq_plain_part_offset(t, part, kvq_in_regions(), kvq_part_cells), (size_t) n_cells*t->nb[1]);
            }
            continue;
        }
        io.read_tensor(layer.k,      part*layer.k->nb[2],      kvq_tile_bytes(layer.k, n_cells));
        if (layer.v != nullptr) {
            io.read_tensor(layer.v,      part*layer.v->nb[2],      (size_t) n_cells * layer.v->nb[1]);
        }
        io.read_tensor(layer.k_fp16, part*layer.k_fp16->nb[2], layer.k_fp16->nb[2]);
        if (layer.v_fp16 != nullptr) {
            io.read_tensor(layer.v_fp16, part*layer.v_fp16->nb[2], layer.v_fp16->nb[2]);
        }
    }
    const bool any_dead = std::any_of(dead.begin(), dead.end(), [](uint32_t n) { return n > 0; });
    kvq_dead[part] = any_dead ? std::move(dead) : std::vector<uint32_t>();
    return true;
}

// The oldest cell whose fp16 value the cache must still hold once the sequence ends at cell n: the window of
// the next query, and the cells of its own (unsealed) tile.
static llama_pos kvq_oldest_fp16_cell(llama_pos n, int32_t window) {
    return std::min(n - window + 1, n / QK_KIVI * QK_KIVI);
}

bool llama_kv_cache::kvq_can_remove(llama_seq_id seq_id, llama_pos p0, llama_pos p1) const {
    if (!kvq_active()) {
        return true;
    }
    // part s holds sequence s, its k-th token in the part's k-th cell; seq_id -1 removes the range from every sequence
    for (uint32_t seq = 0; seq < kvq_n_part; ++seq) {
        if (seq_id >= 0 && (llama_seq_id) seq != seq_id) {
            continue;
        }
        const llama_kv_cells & cells = v_cells[kvq_in_regions() ? 0 : seq];
        const llama_pos pos_min = cells.seq_pos_min(seq);
        if (pos_min < 0) {
            continue;
        }
        if (kvq_drop_dead && p0 > 0 && p0 <= pos_min && (p1 < 0 || p1 > cells.seq_pos_max(seq))) {
            LLAMA_LOG_ERROR("%s: kivi sliding-window KV cache: cannot remove positions %d and on from sequence %d: its "
                            "cells before position %d left the window and were dropped, and the next token's window "
                            "reaches back before them; remove the whole sequence, or keep every cell with --swa-full\n",
                            __func__, p0, seq, pos_min);
            return false;
        }
        if (!kvq_can_remove_stream(cells, seq, p0, p1)) {
            return false;
        }
    }
    return true;
}

// the suffix rule for removing positions [p0, p1) of one sequence, judged on the cells that hold them
bool llama_kv_cache::kvq_can_remove_stream(const llama_kv_cells & cells, llama_seq_id seq_id, llama_pos p0,
        llama_pos p1) const {
    const llama_pos n  = kvq_n_cells(cells, seq_id);
    const llama_pos c0 = kvq_cell_at(cells, seq_id, p0);
    const llama_pos c1 = p1 < 0 ? p1 : kvq_cell_at(cells, seq_id, p1);
    const bool to_end = c1 < 0 || c1 >= n;
    // a range past the end removes nothing (llama-cpp-python asks for one before every decode); a whole clear
    // leaves nothing behind
    if (c0 >= n || (c0 <= 0 && to_end)) {
        return true;
    }
    // A suffix: sealed tiles before p0 and V rows stay valid, a tile p0 cuts goes back to fp16 (the ring still
    // holds its cells), stale ring slots belong to removed cells. Exact as long as the ring still holds every
    // cell the next query reads in fp16: those the removed cells' slots did not overwrite.
    const llama_pos n_ring = (llama_pos) kvq_n_ring(layers, kvq_params.n_sink);
    const llama_pos oldest = std::max(kvq_oldest_fp16_cell(c0, kvq_params.window), (llama_pos) kvq_params.n_sink);
    if (to_end && oldest >= n - n_ring) {
        return true;
    }
    // a selected prompt or an M-RoPE image leaves positions that are not token counts: name both
    const std::string positions = c0 == p0 && c1 == p1 ? "" :
        " (positions [" + std::to_string(p0) + ", " + std::to_string(p1) + "))";
    const llama_pos deepest = std::max<llama_pos>(0, n_ring + 1 - kvq_params.window);
    LLAMA_LOG_ERROR("%s: kivi KV cache: cannot remove tokens [%d, %d)%s of %d from sequence %d: only a suffix, and with "
                    "window %d only the last %d or fewer tokens (their fp16 window is gone beyond that; --kv-rollback N "
                    "keeps N more) or all of them\n",
                    __func__, c0, c1, positions.c_str(), n, seq_id, kvq_params.window, deepest);
    return false;
}

// seq_add / seq_div (context shift, self-extend) would move positions under sealed K tiles whose RoPE rotation
// is baked into their codes, and upstream aborts when a cache that cannot re-rotate K has shifted cells: refuse
// up front, leaving the cache as it was, so that the caller's next decode fails with an error at worst
bool llama_kv_cache::kvq_refuse_position_edit(const char * func) const {
    if (!kvq_active()) {
        return false;
    }
    LLAMA_LOG_ERROR("%s: kivi KV cache: token positions cannot be shifted or divided (context shift, self-extend); "
                    "the cache is left unchanged\n", func);
    return true;
}

bool llama_kv_cache::kvq_is_layer(int32_t il) const {
    const auto it = map_layer_ids.find(il);
    return it != map_layer_ids.end() && layers[it->second].k_fp16 != nullptr;
}

bool llama_kv_cache::kvq_holds_layer(int32_t il) const {
    return map_layer_ids.find(il) != map_layer_ids.end();
}

// a unified kivi cache still keeps each sequence in a region of its own
uint32_t llama_kv_cache::kvq_seq_cells() const {
    return kvq_active() ? kvq_part_cells : v_cells[0].size();
}

uint32_t llama_kv_cache::kvq_seq_n_cells(llama_seq_id seq_id) const {
    if (seq_id < 0 || (size_t) seq_id >= seq_to_stream.size()) {
        return 0;
    }
    return kvq_n_cells(v_cells[seq_to_stream[seq_id]], seq_id);
}

// Batches with at least this many tokens per sequence (prefill) attend through upstream's flash attention over
// wide cells (ggml-kvq.h) when the cache is in GPU memory: tensor-core kernels, where the fused kernel reads the
// cache once per query. On the CPU the fused kernel stays: its results do not depend on the batching at all,
// while flash attention's fp16 arithmetic moves them by rounding (SmolLM2 kivi2: PPL by about 1% with -ub),
// for a prefill 1.1x to 1.4x faster (SmolLM2, 1024 and 2048 tokens). LLAMA_KVQ_FA_PREFILL=N takes that path
// from N tokens on either.
static constexpr int64_t KVQ_WIDE_MIN_TOKENS = 128;

static int64_t kvq_wide_min_tokens(bool cache_on_host) {
    static const int64_t n_env = [] {
        const char * env = std::getenv("LLAMA_KVQ_FA_PREFILL");
        if (env == nullptr) {
            return (int64_t) 0;
        }
        char * end = nullptr;
        const long long n = std::strtoll(env, &end, 10);
        if (*env == '\0' || *end != '\0' || n < 1) {
            LLAMA_LOG_WARN("LLAMA_KVQ_FA_PREFILL=%s is not a token count of 1 or more; ignored\n", env);
            return (int64_t) 0;
        }
        return (int64_t) n;
    }();
    if (n_env > 0) {
        return n_env;
    }
    return cache_on_host ? std::numeric_limits<int64_t>::max() : KVQ_WIDE_MIN_TOKENS;
}

// [head_dim, n_wide, n_head_kv, n_seq] view of wide cells [n_embd, n_wide, n_seq], as flash attention takes K and V
static ggml_tensor * kvq_wide_heads(ggml_context * ctx, ggml_tensor * wide, int64_t head_dim) {
    ggml_tensor * t = ggml_view_4d(ctx, wide, head_dim, wide->ne[0]/head_dim, wide->ne[1], wide->ne[2],
                                   head_dim*wide->nb[0], wide->nb[1], wide->nb[2], 0);
    return ggml_permute(ctx, t, 0, 2, 1, 3);
}

// A tensor every kivi layer of a graph reads alike (the masks: same cells, same settings), built by the first
// layer and found by name by the others: a prompt-sized mask costs its memory and time once, not once per layer
template <typename F>
static ggml_tensor * kvq_graph_shared(ggml_cgraph * gf, const char * name, F build) {
    ggml_tensor * t = ggml_graph_get_tensor(gf, name);
    if (t == nullptr) {
        t = build();
        ggml_set_name(t, name);
        ggml_build_forward_expand(gf, t);
    }
    return t;
}

// upstream's flash attention over the wide cells of K and V (ggml_kvq_wide) and their mask
static ggml_tensor * kvq_build_wide_attn(ggml_context * ctx, ggml_tensor * q_cur, ggml_tensor * k_wide, ggml_tensor * v_wide,
        ggml_tensor * wide_mask, int64_t head_dim_v, int32_t n_seq, float kq_scale, float softcap, ggml_tensor * sinks) {
    // q [head_dim, n_head, n_tokens] as [head_dim, n_tps, n_head, n_seq]
    const int64_t n_tps = q_cur->ne[2]/n_seq;
    ggml_tensor * q = ggml_view_4d(ctx, q_cur, q_cur->ne[0], q_cur->ne[1], n_tps, n_seq,
                                   q_cur->nb[1], q_cur->nb[2], q_cur->nb[2]*n_tps, 0);
    q = ggml_permute(ctx, q, 0, 2, 1, 3);

    ggml_tensor * out = ggml_flash_attn_ext(ctx, q, kvq_wide_heads(ctx, k_wide, q_cur->ne[0]),
                                            kvq_wide_heads(ctx, v_wide, head_dim_v), wide_mask, kq_scale, 0.0f, softcap);
    ggml_prec_set_acc(out, GGML_PREC_F32);
    ggml_flash_attn_ext_add_sinks(out, sinks);
    // [head_dim_v, n_head, n_tps, n_seq] -> [head_dim_v, n_head, n_tokens]
    return ggml_reshape_3d(ctx, out, out->ne[0], out->ne[1], q_cur->ne[2]);
}

// What a kivi layer's step builds that the layers reading its cache read too (shared KV layers: Gemma 3n/4): the
// batch, the stored cache, the wide cells, and what the ring takes, published in the graph under the owning layer's
// number and found there by the readers, which upstream's graph builds after the owner
struct kvq_step {
    ggml_tensor * k_cur    = nullptr;
    ggml_tensor * v_cur    = nullptr;
    ggml_tensor * k_sealed = nullptr;
    ggml_tensor * v_stored = nullptr;
    ggml_tensor * k_wide   = nullptr;
    ggml_tensor * v_wide   = nullptr;
    ggml_tensor * k_ring   = nullptr;
    ggml_tensor * v_ring   = nullptr;

    template <typename F>
    void each(F f) {
        f(k_cur, "k_cur");
        f(v_cur, "v_cur");
        f(k_sealed, "k_sealed");
        f(v_stored, "v_stored");
        f(k_wide, "k_wide");
        f(v_wide, "v_wide");
        f(k_ring, "k_ring");
        f(v_ring, "v_ring");
    }
};

static void kvq_step_name(char * name, const char * what, int32_t il) {
    snprintf(name, GGML_MAX_NAME, "kvq_%s_l%d", what, il);
}

// views rather than the tensors themselves: upstream's own names (Kcur-3 ...) stay what eval callbacks look for; a
// view op (ggml_view_tensor's has no source), so that the graph allocator keeps the data until the readers are done
static void kvq_publish_step(ggml_context * ctx, ggml_cgraph * gf, kvq_step & step, int32_t il) {
    step.each([&](ggml_tensor *& t, const char * what) {
        if (t != nullptr) {
            t = ggml_view_4d(ctx, t, t->ne[0], t->ne[1], t->ne[2], t->ne[3], t->nb[1], t->nb[2], t->nb[3], 0);
            char name[GGML_MAX_NAME];
            kvq_step_name(name, what, il);
            ggml_set_name(t, name);
            ggml_build_forward_expand(gf, t);
        }
    });
}

static kvq_step kvq_published_step(ggml_cgraph * gf, int32_t il) {
    kvq_step step;
    step.each([&](ggml_tensor *& t, const char * what) {
        char name[GGML_MAX_NAME];
        kvq_step_name(name, what, il);
        t = ggml_graph_get_tensor(gf, name);
    });
    GGML_ASSERT(step.k_sealed != nullptr && "a layer reading a kivi layer's cache is built after that layer");
    return step;
}

// the last layer that reads cache layer ikv (its owner when no other does)
static int32_t kvq_last_reader(const std::unordered_map<int32_t, int32_t> & map_layer_ids, int32_t ikv, int32_t il_own) {
    int32_t last = il_own;
    for (const auto & [il, id] : map_layer_ids) {
        if (id == ikv) {
            last = std::max(last, il);
        }
    }
    return last;
}

ggml_tensor * llama_kv_cache::kvq_build_attn(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * q_cur, ggml_tensor * k_cur,
        ggml_tensor * v_cur, ggml_tensor * kq_mask, ggml_tensor * k_idxs, ggml_tensor * v_idxs, ggml_tensor * sinks,
        ggml_tensor * dead, const llama_ubatch & ubatch, const llama_kvq_select & select, float kq_scale, int32_t il) const {
    const int32_t ikv = map_layer_ids.at(il);
    const kv_layer & layer = layers[ikv];
    const int32_t window = kvq_params.window;
    const int32_t n_sink = kvq_params.n_sink;
    // a layer without K and V of its own reads an earlier layer's cache as that layer left it in this step
    const int32_t il_last = kvq_last_reader(map_layer_ids, ikv, (int32_t) layer.il);
    const bool    owns    = k_cur != nullptr;
    GGML_ASSERT(owns == (il == (int32_t) layer.il));

    // init_batch splits a kivi cache's batches per sequence: ubatch.n_seqs sequences, equally many tokens each
    GGML_ASSERT(ubatch.equal_seqs());
    const int32_t n_seq   = (int32_t) ubatch.n_seqs;
    const int64_t kv_size = kvq_part_cells;

    // a selecting ubatch's cells already say what it keeps (kvq_apply_select): its prompt attends under a causal
    // mask of its own, over its part's cells
    const bool selects = select.n_prompt > 0;
    const bool regions = kvq_in_regions() && !selects;
    if (selects) {
        kq_mask = kvq_graph_shared(gf, "kvq_select_mask", [&] {
            return llama_kvq_causal_mask(ctx, select.n_prompt);
        });
    } else if (dead != nullptr) {
        kq_mask = kvq_mask_dead(ctx, kq_mask, dead, ikv);
    }

    // an MLA layer holds no V: its attention reads V, the first head_dim_v channels of K, from K's tiles and cells
    const bool    latent = layer.v == nullptr;
    const int64_t head_dim_v = hparams.n_embd_head_v(layer.il);
    GGML_ASSERT(!(latent && selects));
    // V rows of every part, indexed by the global cells of k_idxs/v_idxs
    ggml_tensor * v_rows = latent ? nullptr : ggml_reshape_2d(ctx, layer.v, layer.v->ne[0], layer.v->ne[1]*layer.v->ne[2]);
    const float clip_k = kvq_clips.k[layer.il];
    const float clip_v = kvq_clips.v[layer.il];
    // every store of the layer's V rows rounds its codes the layer's way; a sliding-window cache's draws repeat
    // every ring, which its drops keep (kvq_n_droppable), so that --swa-full and the batch sizes change no code
    const int64_t dither_period = swa_type == LLAMA_SWA_TYPE_NONE ? kv_size : kvq_n_ring(layers, kvq_params.n_sink);
    const auto dithered = [&](ggml_tensor * store) {
        if (kvq_v_spread[layer.il] > 0.0f) {
            ggml_kvq_store_set_v_dither(store, kvq_v_spread[layer.il], (int32_t) layer.il, kv_size, dither_period);
        }
        return store;
    };
    const int64_t n_tokens = q_cur->ne[2];
    const bool    wide = n_tokens/n_seq >= kvq_wide_min_tokens(ggml_backend_buffer_is_host(layer.k->buffer));
    const int64_t n_kv = std::min<int64_t>(kv_size, kq_mask->ne[0]);
    ggml_tensor * wide_mask = nullptr;
    if (wide || selects) {
        // per mask: the two caches of an iSWA model mask differently
        char name[GGML_MAX_NAME];
        snprintf(name, sizeof(name), "kvq_wide_mask_%p", (void *) kq_mask);
        wide_mask = kvq_graph_shared(gf, name, [&] {
            return ggml_kvq_wide_mask(ctx, kq_mask, k_idxs, window, n_sink, n_seq, kv_size, regions, n_kv);
        });
    }

    // a decode step (one token per sequence) stores K and V (a latent layer's K alone) in one op, ring included,
    // before any reader attends (ggml_kvq_store says why that is safe); other steps store before, and change the ring
    // after, the last reader
    const bool decode = n_tokens == n_seq && !wide && !selects;

    kvq_step step;
    if (owns) {
        GGML_ASSERT(latent || ggml_row_size(v_cur->type, v_cur->ne[0]) == v_cur->nb[1]);
        step.k_cur = k_cur;
        step.v_cur = latent ? nullptr : v_cur;
    }
    if (owns && decode) {
        step.k_sealed = dithered(ggml_kvq_store(ctx, layer.k, v_rows, layer.k_fp16, layer.v_fp16, k_cur, step.v_cur,
                                                k_idxs, latent ? nullptr : v_idxs, n_sink, n_seq, clip_k, clip_v));
        step.v_stored = v_rows;
        ggml_build_forward_expand(gf, step.k_sealed);
    } else if (owns) {
        if (!latent) {
            step.v_stored = dithered(ggml_kvq_store_v(ctx, v_rows, ggml_view_2d(ctx, v_cur, v_rows->ne[0], v_cur->ne[2],
                                                                               v_cur->nb[2], 0), v_idxs, clip_v));
        }
        step.k_sealed = ggml_kvq_seal_k(ctx, layer.k, layer.k_fp16, k_cur, k_idxs, n_sink, n_seq, clip_k);
        ggml_build_forward_expand(gf, step.k_sealed);
        if (!latent) {
            ggml_build_forward_expand(gf, step.v_stored);
        }
        if (wide || selects) {
            step.k_wide = ggml_kvq_wide(ctx, step.k_sealed, layer.k_fp16, k_cur, k_idxs, window, n_sink, n_seq, kv_size, n_kv);
        }
        if (wide) {
            // a latent layer's V cells are its K cells' first head_dim_v channels (kvq_wide_heads takes them)
            step.v_wide = latent ? step.k_wide :
                ggml_kvq_wide(ctx, step.v_stored, layer.v_fp16, v_cur, k_idxs, window, n_sink, n_seq, kv_size, n_kv);
        }
        // what the ring holds: the batch, or the kept tokens of a selecting one
        step.k_ring = k_cur;
        step.v_ring = latent ? nullptr : v_cur;
    } else {
        step = kvq_published_step(gf, layer.il);
    }

    // as upstream's graph gives flash attention its soft-cap
    const float softcap = hparams.attn_soft_cap ? hparams.f_attn_logit_softcapping : 0.0f;
    ggml_tensor * out;
    if (wide) {
        out = kvq_build_wide_attn(ctx, q_cur, step.k_wide, step.v_wide, wide_mask, head_dim_v, n_seq, kq_scale,
                                  softcap, sinks);
    } else {
        out = latent ? ggml_kvq_attn_latent(ctx, q_cur, step.k_sealed, layer.k_fp16, step.k_cur, kq_mask, k_idxs,
                                            head_dim_v, window, n_sink, kq_scale, n_seq, regions)
                     : ggml_kvq_attn(ctx, q_cur, step.k_sealed, step.v_stored, layer.k_fp16, layer.v_fp16, step.k_cur,
                                     step.v_cur, kq_mask, k_idxs, window, n_sink, kq_scale, n_seq, regions);
        ggml_kvq_attn_set_softcap(out, softcap);
        ggml_kvq_attn_set_sinks(out, sinks);
    }
    ggml_build_forward_expand(gf, out);

    if (owns && selects) {
        // MiniKV: the kept tokens, chosen by the owner's queries
        ggml_tensor * mass = llama_kvq_prompt_mass(ctx, q_cur, step.k_wide, wide_mask, k_idxs, window, n_sink, n_kv, kv_size,
                                                   layer.k->ne[2], select, kq_scale);
        ggml_tensor * kept = llama_kvq_kept_tokens(ctx, mass, select, (uint32_t) ikv, (uint32_t) layers.size());
        step.k_ring = llama_kvq_gather_kept(ctx, k_cur, kept);
        step.v_ring = llama_kvq_gather_kept(ctx, v_cur, kept);
    }
    if (owns && il_last != il) {
        kvq_publish_step(ctx, gf, step, il);
    }
    if (il != il_last || decode) {
        return ggml_reshape_2d(ctx, out, out->ne[0]*out->ne[1], out->ne[2]);
    }

    // the last layer reading the cache changes it: every reader attends the cells as this step left them
    ggml_tensor * ring_idxs = k_idxs;
    if (selects) {
        // the kept tokens, sealed again into the first cells over kept tokens only, after the prompt's attention has
        // read the cells as the whole prompt left them
        const int64_t n_keep = select.n_keep();
        ring_idxs = ggml_view_1d(ctx, k_idxs, n_keep, 0);
        ggml_tensor * keep_v_idxs = ggml_view_1d(ctx, v_idxs, n_keep, 0);
        ggml_build_forward_expand(gf, ggml_kvq_seal_k(ctx, step.k_sealed, layer.k_fp16, step.k_ring, ring_idxs, n_sink, 1,
                                                      clip_k));
        ggml_build_forward_expand(gf, dithered(ggml_kvq_store_v(ctx, step.v_stored,
                                                                ggml_reshape_2d(ctx, step.v_ring, v_rows->ne[0], n_keep),
                                                                keep_v_idxs, clip_v)));
    }

    // the ring changes only after the attention has read it
    ggml_build_forward_expand(gf, ggml_kvq_ring_put(ctx, layer.k_fp16, step.k_ring, ring_idxs, out, n_sink, n_seq, kv_size));
    if (!latent) {
        ggml_build_forward_expand(gf, ggml_kvq_ring_put(ctx, layer.v_fp16, step.v_ring, ring_idxs, out, n_sink, n_seq, kv_size));
    }

    return ggml_reshape_2d(ctx, out, out->ne[0]*out->ne[1], out->ne[2]);
}
