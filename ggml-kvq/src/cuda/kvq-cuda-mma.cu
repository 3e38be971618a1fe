// ATTN on tensor cores, the host side: when it runs and its launch (the kernel: kvq-cuda-mma-kernel.cuh).

#include "kvq-cuda-mma-kernel.cuh"

#include <cstdlib>
#include <cstring>

// the head sizes with a kernel: ordinary layers' K and V of one size (96: Phi-3's), and DeepSeek's multi-head latent attention
// (576-wide K: a 512-wide latent, which is V, and 64 RoPE channels)
static bool kvq_attn_mma_shape(const kvq_attn_params & p) {
    const int D  = p.k.head_dim;
    const int DV = p.v.head_dim;
    if (p.latent) {
        return D == 576 && DV == 512;
    }
    return DV == D && (D == 64 || D == 96 || D == 128 || D == 256);
}

bool kvq_attn_mma_wanted(const int device, const kvq_attn_params & p) {
    const char * env = std::getenv("GGML_KVQ_CUDA_MMA");
    if (env == nullptr || std::strcmp(env, "1") != 0) {
        return false;
    }
    const ggml_cuda_device_info::cuda_device_info & info = ggml_cuda_info().devices[device];
    // a latent layer's kivi4 K needs 105 KB, more than GPUs of compute capability 8.6/8.9 give a block
    return ampere_mma_available(info.cc) && kvq_attn_mma_shape(p) &&
           kvq_attn_mma_smem(p.k.head_dim, p.v.head_dim, p.k_bits, p.v_bits, kvq_attn_mma_packed(p)) <= info.smpbo;
}

template <int D, int DV, bool packed>
static void kvq_attn_mma_launch_k(const kvq_attn_params & p, const dim3 grid, cudaStream_t stream) {
    // the most any kivi widths need, raised once per device as far as the device allows (kvq_attn_mma_wanted
    // keeps the launches within it)
    const size_t smpbo = ggml_cuda_info().devices[ggml_cuda_get_device()].smpbo;
    CUDA_SET_SHARED_MEMORY_LIMIT((kvq_attn_mma_kernel<D, DV, packed>), std::min(kvq_attn_mma_smem(D, DV, 4, 4, packed), smpbo));
    ggml_cuda_kernel_launch(kvq_attn_mma_kernel<D, DV, packed>, ggml_cuda_kernel_launch_params(grid, KVQ_NWARPS*WARP_SIZE,
                            kvq_attn_mma_smem(D, DV, p.k_bits, p.v_bits, packed), stream), p);
}

template <int D, int DV>
static void kvq_attn_mma_launch_d(const kvq_attn_params & p, const dim3 grid, cudaStream_t stream) {
    kvq_attn_mma_dispatch<D, DV>(p, [&](auto packed) { kvq_attn_mma_launch_k<D, DV, packed()>(p, grid, stream); });
}

void kvq_attn_mma_launch(const kvq_attn_params & p, const dim3 grid, cudaStream_t stream) {
    GGML_ASSERT(p.tiles_per_split == KVQ_MMA_TILES_PER_SPLIT && kvq_attn_mma_shape(p));
    if (p.latent) {
        kvq_attn_mma_launch_d<576, 512>(p, grid, stream);
        return;
    }
    switch (p.k.head_dim) {
        case 64:  kvq_attn_mma_launch_d<64, 64>(p, grid, stream);   break;
        case 96:  kvq_attn_mma_launch_d<96, 96>(p, grid, stream);   break;
        case 128: kvq_attn_mma_launch_d<128, 128>(p, grid, stream); break;
        default:  kvq_attn_mma_launch_d<256, 256>(p, grid, stream); break;
    }
}
