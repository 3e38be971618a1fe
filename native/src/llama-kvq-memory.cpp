#include "llama-kvq.h"

#include "llama-context.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"
#include "llama-memory.h"
#include "llama-model.h"

// The buffers are what the cache really holds, scales, windows and alignment included; the f16 figure
// is what upstream's default cache would allocate for the same cells, so that the two compare directly.
bool llama_kvq_memory_info(const struct llama_context * ctx, struct llama_kvq_memory_info * info) {
    if (ctx == nullptr || info == nullptr) {
        return false;
    }
    const llama_memory_t mem = llama_get_memory(ctx);
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
    const auto * kv   = iswa != nullptr ? iswa->get_base() : dynamic_cast<const llama_kv_cache *>(mem);
    info->n_seq_cells = kv != nullptr ? kv->kvq_seq_cells() : llama_n_ctx_seq(ctx);
    if (iswa != nullptr) {
        for (const auto & [buft, size] : iswa->get_swa()->memory_breakdown()) {
            info->swa_bytes += size;
        }
        info->swa_n_cells = (uint64_t) iswa->get_swa()->get_size()*iswa->get_swa()->get_n_stream();
    }
    for (uint32_t il = 0; il < hparams.n_layer(); ++il) {
        if (!hparams.has_kv(il)) {
            continue;
        }
        info->n_layers_kv += 1;
        const uint64_t width = hparams.n_embd_k_gqa(il) + hparams.n_embd_v_gqa(il);
        if (iswa != nullptr && hparams.is_swa(il)) {
            info->swa_n_elements += info->swa_n_cells * width;
        } else {
            info->n_elements += n_cells * width;
        }
    }
    info->n_elements += info->swa_n_elements;
    info->f16_bytes = info->n_elements * sizeof(ggml_fp16_t);
    return true;
}
