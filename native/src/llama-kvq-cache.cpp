// The kivi layers of llama_kv_cache (members declared by native/patches, defined here).
//
// A kivi layer keeps K as sealed per-channel tiles, V as per-token rows, and the sinks and the recent
// window in fp16 (ggml-kvq.h). One sequence whose token at position p sits in cell p: the attention
// contract is judged on positions, and the cells stand in for them.

#include "llama-kv-cache.h"

#include "llama-impl.h"
#include "llama-kvq-layers.h"
#include "llama-model.h"

#include "ggml-kvq.h"

#include <limits>
#include <stdexcept>
#include <string>

static bool kvq_either_kivi(ggml_type type_k, ggml_type type_v) {
    return ggml_kvq_is_kivi(type_k) || ggml_kvq_is_kivi(type_v);
}

static std::string kvq_types_text(ggml_type type_k, ggml_type type_v) {
    return std::string(ggml_type_name(type_k)) + "/" + ggml_type_name(type_v);
}

// the model's own per-layer types (pykvq calibrate writes them), "" when it has none
static std::string kvq_model_layer_spec(const llama_model & model) {
    char buf[4096];
    if (llama_model_meta_val_str(&model, "kvq.version", buf, sizeof(buf)) >= 0 && std::string(buf) != "1") {
        throw std::runtime_error(std::string("the model's kvq.* metadata is version ") + buf +
                                 "; this pykvq reads version 1 (--kv-layers none ignores it)");
    }
    const int32_t n = llama_model_meta_val_str(&model, "kvq.kv_layers", buf, sizeof(buf));
    if (n >= (int32_t) sizeof(buf)) {
        throw std::runtime_error("the model's kvq.kv_layers metadata is longer than " + std::to_string(sizeof(buf)) + " bytes");
    }
    return n < 0 ? "" : std::string(buf, n);
}

void llama_kv_cache::kvq_init(const llama_model & model, ggml_type type_k, ggml_type type_v, uint32_t n_stream_wanted) {
    std::string spec = llama_kvq_layer_spec();
    std::string source = "--kv-layers";
    if (spec.empty()) {
        spec   = kvq_model_layer_spec(model);
        source = "the model's kvq.kv_layers";
    }
    try {
        llama_kvq_layer_types types = llama_kvq_resolve_layer_spec(spec, (int32_t) hparams.n_layer_all, type_k, type_v);
        kvq_types_k = std::move(types.k);
        kvq_types_v = std::move(types.v);
    } catch (const std::invalid_argument & err) {
        throw std::runtime_error(source + ": " + err.what());
    }

    bool any_kivi = false;
    for (uint32_t il = 0; il < kvq_types_k.size(); ++il) {
        const ggml_type tk = kvq_types_k[il];
        const ggml_type tv = kvq_types_v[il];
        if (ggml_kvq_is_kivi(tk) != ggml_kvq_is_kivi(tv)) {
            throw std::runtime_error("KV cache layer " + std::to_string(il) + " " + kvq_types_text(tk, tv) +
                                     ": a kivi K type needs a kivi V type and the other way round (kivi4, kivi2, kivi1)");
        }
        any_kivi = any_kivi || kvq_either_kivi(tk, tv);
    }
    if (!any_kivi) {
        return;
    }
    const std::string types = kvq_types_text(type_k, type_v);
    if (v_trans) {
        throw std::runtime_error("KV cache " + types + ": kivi types need flash attention (-fa on)");
    }
    if (n_seq_max != 1 || n_stream_wanted != 1) {
        throw std::runtime_error("KV cache " + types + ": kivi types support one sequence per context for now "
                                 "(n_seq_max = " + std::to_string(n_seq_max) + "); for llama-perplexity use -b equal to -c");
    }
    if (other != nullptr || n_swa != 0) {
        throw std::runtime_error("KV cache " + types + ": kivi types do not support shared or sliding-window caches yet");
    }
    LLAMA_LOG_INFO("%s: kivi KV cache: window = %d, sinks = %d, rotation = %s%s%s\n", __func__,
            kvq_params.window, kvq_params.n_sink, kvq_params.rotate ? "on" : "off",
            spec.empty() || spec == "none" ? "" : ", layer types = ", spec == "none" ? "" : spec.c_str());
}

bool llama_kv_cache::kvq_create_layer(ggml_context * ctx, uint32_t il, ggml_type type_k, ggml_type type_v,
        uint32_t kv_size, const char * name_tag) {
    if (!kvq_either_kivi(type_k, type_v)) {
        return false;
    }
    GGML_ASSERT(kv_size % QK_KIVI == 0);
    const uint32_t dk = hparams.n_embd_head_k(il);
    const uint32_t dv = hparams.n_embd_head_v(il);
    if (dk % QK_KIVI != 0 || dv % QK_KIVI != 0 || dk > 512 || dv > 512) {
        throw std::runtime_error("KV cache " + kvq_types_text(type_k, type_v) + ": unsupported head size " + std::to_string(dk) + "/" + std::to_string(dv) + " in layer " +
                                 std::to_string(il) + " (kivi types need a multiple of 32, at most 512)");
    }
    const uint32_t n_embd_k = hparams.n_embd_k_gqa(il);
    const uint32_t n_embd_v = hparams.n_embd_v_gqa(il);
    const int64_t  n_fp16   = kvq_params.n_sink + ggml_kvq_ring_size(kvq_params.window);

    kv_layer layer = {};
    layer.il     = il;
    layer.k      = ggml_new_tensor_2d(ctx, type_k, (int64_t) n_embd_k*QK_KIVI, kv_size/QK_KIVI);
    layer.v      = ggml_new_tensor_2d(ctx, type_v, n_embd_v, kv_size);
    layer.k_fp16 = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_embd_k, n_fp16);
    layer.v_fp16 = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_embd_v, n_fp16);
    ggml_format_name(layer.k,      "cache_%sk_tiles_l%d", name_tag, il);
    ggml_format_name(layer.v,      "cache_%sv_l%d",       name_tag, il);
    ggml_format_name(layer.k_fp16, "cache_%sk_fp16_l%d",  name_tag, il);
    ggml_format_name(layer.v_fp16, "cache_%sv_fp16_l%d",  name_tag, il);
    // one stream: the stream views are the tensors themselves
    layer.k_stream = { layer.k };
    layer.v_stream = { layer.v };

    map_layer_ids[il] = layers.size();
    layers.push_back(layer);
    return true;
}

bool llama_kv_cache::kvq_active() const {
    for (const kv_layer & layer : layers) {
        if (layer.k_fp16 != nullptr) {
            return true;
        }
    }
    return false;
}

void llama_kv_cache::kvq_check_state() const {
    if (kvq_active()) {
        throw std::runtime_error("saving or loading the state of a kivi KV cache is not supported yet");
    }
}

bool llama_kv_cache::kvq_can_remove(llama_pos p0, llama_pos p1) const {
    if (!kvq_active()) {
        return true;
    }
    // kivi caches hold one sequence (kvq_check); a range past its end removes nothing, which callers such as
    // llama-cpp-python ask for before every decode
    if (p0 > v_cells[0].seq_pos_max(0)) {
        return true;
    }
    // removing part of a sequence would leave sealed tiles and ring slots stale: only a whole clear for now
    if (p0 > 0 || (p1 >= 0 && p1 != std::numeric_limits<llama_pos>::max())) {
        LLAMA_LOG_ERROR("%s: kivi KV cache: removing tokens [%d, %d) from a sequence is not supported yet\n", __func__, p0, p1);
        return false;
    }
    return true;
}

bool llama_kv_cache::kvq_is_layer(int32_t il) const {
    const auto it = map_layer_ids.find(il);
    return it != map_layer_ids.end() && layers[it->second].k_fp16 != nullptr;
}

ggml_tensor * llama_kv_cache::kvq_build_attn(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * q_cur, ggml_tensor * k_cur,
        ggml_tensor * v_cur, ggml_tensor * v_stored, ggml_tensor * kq_mask, ggml_tensor * k_idxs, float kq_scale, int32_t il) const {
    const kv_layer & layer = layers[map_layer_ids.at(il)];
    const int32_t n_sink = kvq_params.n_sink;

    ggml_tensor * k_sealed = ggml_kvq_seal_k(ctx, layer.k, layer.k_fp16, k_cur, k_idxs, n_sink);
    ggml_build_forward_expand(gf, k_sealed);
    ggml_build_forward_expand(gf, v_stored);

    ggml_tensor * out = ggml_kvq_attn(ctx, q_cur, k_sealed, v_stored, layer.k_fp16, layer.v_fp16, k_cur, v_cur,
                                      kq_mask, k_idxs, kvq_params.window, n_sink, kq_scale);
    ggml_build_forward_expand(gf, out);

    // the ring changes only after the attention has read it
    ggml_build_forward_expand(gf, ggml_kvq_ring_put(ctx, layer.k_fp16, k_cur, k_idxs, out, n_sink));
    ggml_build_forward_expand(gf, ggml_kvq_ring_put(ctx, layer.v_fp16, v_cur, k_idxs, out, n_sink));

    return ggml_reshape_2d(ctx, out, out->ne[0]*out->ne[1], out->ne[2]);
}
