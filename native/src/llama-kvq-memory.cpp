#include "llama-kvq.h"
#include "llama-kvq-cache.h"

#include "llama-context.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"
#include "llama-memory-hybrid-iswa.h"
#include "llama-memory-hybrid.h"
#include "llama-memory.h"
#include "llama-model.h"

#include <algorithm>

// the KV cache of a hybrid model's memory (Qwen3.5, Nemotron-H, LFM2): its recurrent state is the same whatever
// the KV types, and no part of what a sequence's cells hold
static const llama_memory_i * kvq_attention_memory(const llama_memory_i * mem) {
    if (const auto * hybrid = dynamic_cast<const llama_memory_hybrid *>(mem)) {
        return hybrid->get_mem_attn();
    }
    if (const auto * hybrid = dynamic_cast<const llama_memory_hybrid_iswa *>(mem)) {
        return hybrid->get_mem_attn();
    }
    return mem;
}

// the cache whose cells bound what a sequence holds: an iSWA model's global one (the sliding-window one forgets)
static const llama_kv_cache * kvq_bounding_cache(const llama_memory_i * mem) {
    mem = kvq_attention_memory(mem);
    const auto * iswa = dynamic_cast<const llama_kv_cache_iswa *>(mem);
    return iswa != nullptr ? iswa->get_base() : dynamic_cast<const llama_kv_cache *>(mem);
}

bool llama_kvq_memory_has_kivi(const llama_memory_i * mem) {
    mem = kvq_attention_memory(mem);
    if (const auto * iswa = dynamic_cast<const llama_kv_cache_iswa *>(mem)) {
        return iswa->get_base()->kvq_active() || iswa->get_swa()->kvq_active();
    }
    const auto * kv = dynamic_cast<const llama_kv_cache *>(mem);
    return kv != nullptr && kv->kvq_active();
}

// The cells per stream of upstream's sliding-window cache (llama_kv_cache_iswa) where a kivi one holds more: the
// window and a ubatch, padded; a kivi cache as large as the global one is taken for --swa-full's
static uint64_t kvq_upstream_swa_cells(const llama_context * ctx, const llama_kv_cache & swa) {
    const uint32_t n_ctx_seq = llama_n_ctx_seq(ctx);
    if (!swa.kvq_active() || swa.get_size() >= n_ctx_seq) {
        return swa.get_size();
    }
    const llama_cparams & cparams = ctx->get_cparams();
    const uint64_t n_swa = llama_get_model(ctx)->hparams.n_swa;
    return std::min<uint64_t>(n_ctx_seq, GGML_PAD(n_swa*(cparams.kv_unified ? cparams.n_seq_max : 1) + cparams.n_ubatch,
                                                   256));
}

// The buffers are what the cache really holds, scales, windows and alignment included; the f16 figure
// is what upstream's default cache would allocate for the same layers and context: the same cells, but for a
// kivi sliding-window cache, which holds more than upstream's (two rings), upstream's own count.
bool llama_kvq_memory_info(const struct llama_context * ctx, struct llama_kvq_memory_info * info) {
    if (ctx == nullptr || info == nullptr) {
        return false;
    }
    const llama_memory_i * mem = kvq_attention_memory(llama_get_memory(ctx));
    if (mem == nullptr) {
        return false;
    }
    *info = {};
    for (const auto & [buft, size] : mem->memory_breakdown()) {
        info->bytes += size;
    }
    const llama_hparams & hparams = llama_get_model(ctx)->hparams;
    const uint64_t n_cells = llama_n_ctx(ctx);
    info->n_cells = n_cells;
    // an iSWA cache: its global layers bound what a sequence holds (the sliding-window ones forget)
    const auto * iswa = dynamic_cast<const llama_kv_cache_iswa *>(mem);
    const llama_kv_cache * kv = kvq_bounding_cache(mem);
    info->n_seq_cells = kv != nullptr ? kv->kvq_seq_cells() : llama_n_ctx_seq(ctx);
    if (iswa != nullptr) {
        for (const auto & [buft, size] : iswa->get_swa()->memory_breakdown()) {
            info->swa_bytes += size;
        }
        info->swa_n_cells = (uint64_t) iswa->get_swa()->get_size()*iswa->get_swa()->get_n_stream();
    }
    const uint64_t f16_swa_cells = iswa != nullptr ?
        kvq_upstream_swa_cells(ctx, *iswa->get_swa())*iswa->get_swa()->get_n_stream() : 0;
    uint64_t f16_elements = 0;
    for (uint32_t il = 0; il < hparams.n_layer(); ++il) {
        const bool in_swa = iswa != nullptr && iswa->get_swa()->kvq_holds_layer((int32_t) il);
        // a hybrid's attention cache holds the layers its filter took (all of Falcon-H1's, not Qwen3-Next's
        // recurrent ones, though they declare KV heads)
        if (!hparams.has_kv(il) || !(in_swa || (kv != nullptr && kv->kvq_holds_layer((int32_t) il)))) {
            continue;
        }
        info->n_layers_kv += 1;
        // multi-head latent attention keeps no V: it reads V from K's rows
        const uint64_t width = hparams.n_embd_k_gqa(il) + (hparams.is_mla() ? 0 : hparams.n_embd_v_gqa(il));
        if (in_swa) {
            info->swa_n_elements += info->swa_n_cells * width;
            f16_elements         += f16_swa_cells * width;
        } else {
            info->n_elements += n_cells * width;
            f16_elements     += n_cells * width;
        }
    }
    info->n_elements += info->swa_n_elements;
    info->f16_bytes = f16_elements * sizeof(ggml_fp16_t);
    return true;
}

// counted, not a span of positions: an M-RoPE model's image puts many cells at one position
int64_t llama_kvq_seq_cells(const struct llama_context * ctx, llama_seq_id seq_id) {
    const llama_kv_cache * kv = ctx != nullptr ? kvq_bounding_cache(llama_get_memory(ctx)) : nullptr;
    if (kv == nullptr) {
        return -1;
    }
    return kv->kvq_seq_n_cells(seq_id);
}
