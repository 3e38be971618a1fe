// ATTN on tensor cores (kvq-cuda-mma.cu), selectable beside the CUDA-core kernel (kvq-cuda-attn-kernel.cuh).
#pragma once

#include "kvq-cuda-attn.cuh"

#define KVQ_MMA_COLS            8   // query heads per block: the N of mma.m16n8k16
#define KVQ_MMA_TILES_PER_SPLIT 16  // context tiles per block, KVQ_MMA_TILES_PER_SPLIT/KVQ_NWARPS per warp
#define KVQ_MMA_STAGES          2   // tiles in flight per warp (cp.async ring)

// Whether this attention runs on tensor cores: asked for with GGML_KVQ_CUDA_MMA=1 (until a GPU run has judged
// it, the CUDA-core kernel stays the default), on an NVIDIA GPU of compute capability 8.0 or more, with K and V
// heads of one size among 64, 96, 128 and 256, or a latent layer's 576-wide K and 512-wide V, and the shared memory
// its widths need.
bool kvq_attn_mma_wanted(int device, const kvq_attn_params & p);

// one launch over `grid` = (n_splits, n_head_kv*n_groups, tokens) with p.tiles_per_split == KVQ_MMA_TILES_PER_SPLIT
void kvq_attn_mma_launch(const kvq_attn_params & p, dim3 grid, cudaStream_t stream);
