// ATTN on tensor cores (kvq-cuda-mma.cu), selectable beside the CUDA-core kernel (kvq-cuda-attn-kernel.cuh).
#pragma once

#include "kvq-cuda-attn.cuh"

#include <type_traits>

#define KVQ_MMA_COLS            8   // query heads per block: the N of mma.m16n8k16
#define KVQ_MMA_TILES_PER_SPLIT 16  // context tiles per block, KVQ_MMA_TILES_PER_SPLIT/KVQ_NWARPS per warp
#define KVQ_MMA_STAGES          2   // tiles in flight per warp (cp.async ring)

// Whether this attention runs on tensor cores: asked for with GGML_KVQ_CUDA_MMA=1 (until a GPU run has judged
// it, the CUDA-core kernel stays the default), on an NVIDIA GPU of compute capability 8.0 or more, with K and V
// heads of one size among 64, 96, 128 and 256, or a latent layer's 576-wide K and 512-wide V, and the shared memory
// its widths need.
bool kvq_attn_mma_wanted(int device, const kvq_attn_params & p);

// Whether the kernel of head sizes D and DV can take several tokens a block: not for latent layers (the multi-head
// latent attention models have 16 query heads or more)
static constexpr bool kvq_attn_mma_packs(const int D, const int DV) {
    return DV == D;
}

// Whether a layer's attention runs the packed kernel: its shape packs and two tokens or more fit beside a KV head's
// query heads in the N of the mma. The layer decides, never the batch: a decode step runs the packed kernel with one
// token a block, so that a token's bits never depend on how it was batched (two compilations of one expression need
// not round alike).
static inline bool kvq_attn_mma_packed(const kvq_attn_params & p) {
    return kvq_attn_mma_packs(p.k.head_dim, p.v.head_dim) && 2*p.n_gqa <= KVQ_MMA_COLS;
}

// Consecutive tokens of a sequence per block (at most: a segment's): as many as fit beside a KV head's query heads
// (2 for Llama-3's 4 query heads per KV head, 8 without GQA), so that a prefill chunk or a draft reads each tile once
// for them
static inline int kvq_attn_mma_tokens(const kvq_attn_params & p) {
    return kvq_attn_mma_packed(p) ? KVQ_MMA_COLS/p.n_gqa : 1;
}

// f(std::bool_constant<packed>) for the kernel a layer of head sizes D and DV runs: the packed one where
// kvq_attn_mma_packed, else the one-token one (planned with one token a block)
template <int D, int DV, typename F>
static auto kvq_attn_mma_dispatch(const kvq_attn_params & p, F f) {
    if constexpr (kvq_attn_mma_packs(D, DV)) {
        if (kvq_attn_mma_packed(p)) {
            return f(std::true_type{});
        }
    }
    GGML_ASSERT(p.n_tok == 1);
    return f(std::false_type{});
}

// one launch over `grid` = (n_splits, n_head_kv*n_groups, blocks of n_tok tokens) with p.tiles_per_split == KVQ_MMA_TILES_PER_SPLIT
void kvq_attn_mma_launch(const kvq_attn_params & p, dim3 grid, cudaStream_t stream);
