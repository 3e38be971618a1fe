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

// Settings of the kivi layers of a KV cache (DESIGN.md §4-5).
// window and n_sink may be LLAMA_KVQ_FROM_MODEL: the model's kvq.window / kvq.sinks metadata (pykvq calibrate
// writes them), else the default; that is what the process-wide settings hold until set (the selection too).
#define LLAMA_KVQ_FROM_MODEL (-1)

struct llama_kvq_params {
    int32_t window;   // W: the most recent tokens kept (and attended) in fp16, default 128
    int32_t n_sink;   // S: the first tokens of a sequence kept in fp16 for good, default 0
    bool    rotate;   // apply upstream's Hadamard rotation to kivi K/V (mixes channels), default false; what the
                      // kivi layers do when neither llama_kvq_set_rotation nor the model's kvq.kv_rotate says
    int32_t n_rollback; // extra fp16 ring cells: the last n_rollback tokens of a sequence can be removed exactly
                        // (speculative decoding, regeneration), default 0
    // MiniKV's selection (off: both 0): a prompt decoded into an empty sequence keeps, per layer and KV head, only
    // its select_hh heaviest hitters (the tokens that drew the most attention during the prompt) and its last
    // select_recent tokens, both fractions of the prompt (each in (0, 1], together at most 1), plus the sinks. The
    // kept tokens fill the sequence's first cells, quantized as a prompt of that length would be, and keep their
    // meaning (RoPE is applied before they are stored); generation appends as usual. The prompt must reach the
    // cache in one ubatch (-ub at least its length), one sequence per ubatch, and every layer of the cache must be
    // kivi. A prompt no longer than the window is kept whole. All four LLAMA_KVQ_FROM_MODEL (what the process-wide
    // settings hold until set): the model's kvq.select ("HH,RW[,N[,D]]"), if it has one; a prompt that such a setting
    // cannot select (spanning ubatches, sharing one with another sequence's) is kept whole, with a log line.
    float   select_hh;
    float   select_recent;
    // the prompt's last select_observe tokens are the queries whose attention picks the heavy hitters, each token
    // scored with the 8 tokens before it as well (SnapKV's observation window, its pooling reaching forward: what the
    // end of the prompt, a question, looks at, and the tokens after that, the answer it copies); 0: all of the
    // prompt's queries, no pooling (MiniKV's accumulated score). Default 0.
    int32_t select_observe;
    // MiniKV's pyramid (PyramidKV's policy): the heavy-hitter share falls linearly from the cache's bottom layer
    // to its top one, select_hh * (2 - 1/depth) down to select_hh / depth, select_hh on average; 1: every layer
    // alike (the default). Cells are shared by all layers, so a sequence holds what its bottom layer keeps; an
    // upper layer's surplus cells are masked out of its attention.
    float   select_depth;
};

// the defaults: what a window or sink count LLAMA_KVQ_FROM_MODEL becomes for a model without kvq.window/kvq.sinks
LLAMA_API struct llama_kvq_params llama_kvq_default_params(void);

// Process-wide settings used by every KV cache created afterwards (llama_init_from_model). Returns false,
// keeping the previous settings, when they are invalid; llama_kvq_last_error() says why.
LLAMA_API bool                    llama_kvq_set_params(struct llama_kvq_params params);
LLAMA_API struct llama_kvq_params llama_kvq_get_params(void);
LLAMA_API const char *            llama_kvq_last_error(void);

// One setting by name, as the tools' command lines give it: "window", "sinks" and "rollback" take a count,
// "rotate" a rotation spec (llama_kvq_set_rotation), "layers" a per-layer spec (llama_kvq_set_layer_types), "clip" a per-layer clip spec
// (llama_kvq_set_clip), "dither" a V dither spec (llama_kvq_set_dither), "type_swa" a type name
// (llama_kvq_set_swa_types). Returns false (see llama_kvq_last_error) for an unknown name or a bad value.
LLAMA_API bool llama_kvq_set_param(const char * name, const char * value);

// Types of the sliding-window cache of a model that interleaves sliding-window and global layers (upstream's
// iSWA cache: Gemma 2/3, gpt-oss, Cohere 2), for caches created afterwards. GGML_TYPE_COUNT (the default)
// follows the context's type_k / type_v, as upstream does; per-layer types (below) still decide the layers they
// name. A kivi sliding-window cache holds the window, a ubatch and two rings per sequence. Returns false (see
// llama_kvq_last_error) for a type a KV cache cannot hold. Also "type_swa" in llama_kvq_set_param (one type for
// K and V, "" to follow the context's).
LLAMA_API bool llama_kvq_set_swa_types(enum ggml_type type_k, enum ggml_type type_v);
LLAMA_API void llama_kvq_get_swa_types(enum ggml_type * type_k, enum ggml_type * type_v);

// Per-layer K and V types for KV caches created afterwards, e.g. "k:0-15=kivi2,16-=kivi1;v:*=kivi1" (ranges
// inclusive, "16-" up to the last layer, "*" all) or AsymKV's "asymkv:16/0" (K kivi2 in the first 16 layers
// and kivi1 after, V likewise with 0). A part left out keeps the context's type_k / type_v; a part given
// must name every layer once. "" (or NULL): no spec, a model's "kvq.kv_layers" metadata applies if it has
// one; "none": type_k / type_v everywhere, metadata ignored. Returns false (see llama_kvq_last_error) when
// the spec does not parse; layer bounds are checked when a cache is created for a model.
LLAMA_API bool         llama_kvq_set_layer_types(const char * spec);
LLAMA_API bool         llama_kvq_check_layer_types(const char * spec);   // parses only; sets nothing
LLAMA_API const char * llama_kvq_get_layer_types(void);   // valid until the next llama_kvq_set_layer_types

// A spec resolved for n_layer layers into types_k[n_layer] and types_v[n_layer]; false (see
// llama_kvq_last_error) when it does not parse or does not fit the layers.
LLAMA_API bool llama_kvq_resolve_layer_types(const char * spec, int32_t n_layer, enum ggml_type type_k,
                                             enum ggml_type type_v, enum ggml_type * types_k, enum ggml_type * types_v);

// SKVQ's clipped quantization for the kivi layers of KV caches created afterwards: per layer, a ratio in (0, 1]
// that narrows each quantization group's range [min, max] to [ratio*min, ratio*max] before its step is taken
// (values beyond it get the end codes), in the per-layer spec form with ratios for types, e.g.
// "k:*=0.9;v:0-3=1,4-=0.85" (a part left out: 1, no clipping); "mse" in place of a ratio searches each group for its
// range of least squared error (GGML_KVQ_CLIP_MSE). "" (or NULL): no spec, a model's "kvq.kv_clip"
// metadata applies if it has one (pykvq calibrate writes it); "none": no clipping, metadata ignored. Returns
// false (see llama_kvq_last_error) when the spec does not parse. Also "clip" in llama_kvq_set_param.
LLAMA_API bool         llama_kvq_set_clip(const char * spec);
LLAMA_API const char * llama_kvq_get_clip(void);   // valid until the next llama_kvq_set_clip

// A clip spec resolved for n_layer layers into clip_k[n_layer] and clip_v[n_layer]; false (see
// llama_kvq_last_error) when it does not parse or does not fit the layers.
LLAMA_API bool llama_kvq_resolve_clip(const char * spec, int32_t n_layer, float * clip_k, float * clip_v);

// Upstream's Hadamard rotation of K and V, per kivi layer, for KV caches created afterwards (it spreads outlier
// channels over the rest: it helps some layers of some models and hurts others, pykvq calibrate measures which):
// "on" or "off" for every layer, or the per-layer spec form with on/off values, e.g. "k:*=on;v:0-3=off,4-=on" (a part
// left out: off). "" (or NULL): no spec, a model's "kvq.kv_rotate" metadata applies if it has one, else
// llama_kvq_params.rotate. Layers of other types rotate as upstream's do: when their type is quantized. Returns
// false (see llama_kvq_last_error) when the spec does not parse. Also "rotate" in llama_kvq_set_param.
LLAMA_API bool         llama_kvq_set_rotation(const char * spec);
LLAMA_API const char * llama_kvq_get_rotation(void);   // valid until the next llama_kvq_set_rotation

// A rotation spec resolved for n_layer layers into rotate_k[n_layer] and rotate_v[n_layer] ("": fallback
// everywhere); false (see llama_kvq_last_error) when it does not parse or does not fit the layers.
LLAMA_API bool llama_kvq_resolve_rotation(const char * spec, int32_t n_layer, bool fallback, bool * rotate_k,
                                          bool * rotate_v);

// V's dithered rounding for the kivi layers of KV caches created afterwards. Rounded to nearest, identical tokens get
// identical V codes and so identical errors, which add up wherever attention spreads over repeated content (a 1-bit V
// layer can lose a pass key in repeated filler that way); dithered, a code rounds up once its value's fraction reaches
// a threshold drawn from [1/2 - spread/2, 1/2 + spread/2] (spread 1: stochastic rounding, unbiased, twice nearest's
// mean squared error; 0: nearest), the draw a fixed hash of (layer, the token's cell in its sequence, channel):
// deterministic, the same on every backend and cache layout. Only the stored codes change: format, attention and speed
// stay. A bare spread for every layer ("0.5"), or the per-layer form with a v: part only that names every layer, e.g.
// "v:0-9=1,10-=0"; K takes none. "" (or NULL): no spec, a model's "kvq.kv_dither" metadata applies if it has one (pykvq
// calibrate writes it); "none": nearest everywhere, metadata ignored. Returns false (see llama_kvq_last_error) when the
// spec does not parse. Also "dither" in llama_kvq_set_param.
LLAMA_API bool         llama_kvq_set_dither(const char * spec);
LLAMA_API const char * llama_kvq_get_dither(void);   // valid until the next llama_kvq_set_dither

// A dither spec resolved for n_layer layers into spread_v[n_layer]; false (see llama_kvq_last_error) when it does not
// parse or does not fit the layers.
LLAMA_API bool llama_kvq_resolve_dither(const char * spec, int32_t n_layer, float * spread_v);

// What a context's KV cache holds and costs. bytes: all of its buffers (scales, fp16 window and sinks and
// alignment included); f16_bytes: what upstream's f16 cache would take for the same layers and context (the same
// cells, but a sliding-window cache's as upstream sizes it: a kivi one holds more).
struct llama_kvq_memory_info {
    uint64_t bytes;
    uint64_t f16_bytes;
    uint64_t n_elements;   // K and V elements the cache holds at full occupancy, each layer at its cache's cells
    uint64_t n_cells;
    uint32_t n_layers_kv;
    uint32_t n_seq_cells;  // cells one sequence can hold: less than n_cells with streams, or a unified kivi cache
    uint64_t swa_bytes;    // of bytes, those of the sliding-window cache of an iSWA model (Gemma 2/3); 0 without one
    uint64_t swa_n_cells;  // its cells, all sequences': the window and a ubatch each, or n_ctx (--swa-full)
    uint64_t swa_n_elements; // of n_elements, the sliding-window cache's
};

// false when the context has no KV cache
LLAMA_API bool llama_kvq_memory_info(const struct llama_context * ctx, struct llama_kvq_memory_info * info);

// Cells sequence seq_id holds in the cache that bounds it (an iSWA model's global cache, not its sliding-window
// one, whose llama_memory_seq_pos_min has forgotten the start): fewer than its positions once prompt selection kept
// part of its prompt. -1 when the context has no such cache.
LLAMA_API int64_t llama_kvq_seq_cells(const struct llama_context * ctx, llama_seq_id seq_id);

#ifdef __cplusplus
}
#endif
