// ATTN on tensor cores, the host side: when it runs and its launch (the kernel: kvq-cuda-mma-kernel.cuh).

#include "kvq-cuda-mma-kernel.cuh"

#include <cstdlib>
#include <cstring>

bool kvq_attn_mma_wanted(const int device, const kvq_attn_params & p) {
    const char * env = std::getenv("GGML_KVQ_CUDA_MMA");
    if (env == nullptr || std::strcmp(env, "1") != 0) {
        return false;
    }
    const int D = p.k.head_dim;
    // a latent layer's V (K's first channels) has no tensor-core path: the CUDA-core kernel reads it from K's tiles
    return !p.latent && ampere_mma_available(ggml_cuda_info().devices[device].cc) && p.n_gqa <= KVQ_MMA_COLS &&
           p.v.head_dim == D && (D == 64 || D == 128 || D == 256);
}

template <int D>
static void kvq_attn_mma_launch_d(const kvq_attn_params & p, const dim3 grid, cudaStream_t stream) {
    // the most any kivi widths need, raised once per device
    CUDA_SET_SHARED_MEMORY_LIMIT(kvq_attn_mma_kernel<D>, kvq_attn_mma_smem(D, 4, 4));
    ggml_cuda_kernel_launch(kvq_attn_mma_kernel<D>, ggml_cuda_kernel_launch_params(grid, KVQ_NWARPS*WARP_SIZE,
                            kvq_attn_mma_smem(D, p.k_bits, p.v_bits), stream), p);
}

void kvq_attn_mma_launch(const kvq_attn_params & p, const dim3 grid, cudaStream_t stream) {
    GGML_ASSERT(p.tiles_per_split == KVQ_MMA_TILES_PER_SPLIT && p.n_groups == 1);
    switch (p.k.head_dim) {
        case 64:  kvq_attn_mma_launch_d<64>(p, grid, stream);  break;
        case 128: kvq_attn_mma_launch_d<128>(p, grid, stream); break;
        case 256: kvq_attn_mma_launch_d<256>(p, grid, stream); break;
        default:  GGML_ABORT("kvq tensor-core attention: unsupported head size %d", p.k.head_dim);
    }
}
