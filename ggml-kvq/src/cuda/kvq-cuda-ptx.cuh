// The PTX instructions of the tensor-core attention (kvq-cuda-mma-kernel.cuh): mma.sync and cp.async.
#pragma once

#include "kvq-cuda.cuh"

// d += a*b: m16n8k16, fp16 operands, fp32 accumulators
static __device__ __forceinline__ void kvq_mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef AMPERE_MMA_AVAILABLE
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    GGML_UNUSED(d);
    GGML_UNUSED(a);
    GGML_UNUSED(b);
    NO_DEVICE_CODE;
#endif // AMPERE_MMA_AVAILABLE
}

// Copies, commits and waits clobber memory, so that nvcc keeps each read of a stage after the wait that completes
// its copies and before the copy that refills it, whatever barriers happen to sit beside them
template <int bytes>
static __device__ __forceinline__ void kvq_cp_async(char * dst_s, const char * src) {
#ifdef CP_ASYNC_AVAILABLE
    const unsigned dst = (unsigned) __cvta_generic_to_shared(dst_s);
    if constexpr (bytes == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" : : "r"(dst), "l"(src) : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" : : "r"(dst), "l"(src), "n"(bytes) : "memory");
    }
#else
    GGML_UNUSED(dst_s);
    GGML_UNUSED(src);
    NO_DEVICE_CODE;
#endif // CP_ASYNC_AVAILABLE
}

static __device__ __forceinline__ void kvq_cp_async_commit() {
#ifdef CP_ASYNC_AVAILABLE
    asm volatile("cp.async.commit_group;" : : : "memory");
#endif // CP_ASYNC_AVAILABLE
}

// waits until at most n of this thread's copy groups are pending
template <int n>
static __device__ __forceinline__ void kvq_cp_async_wait() {
#ifdef CP_ASYNC_AVAILABLE
    asm volatile("cp.async.wait_group %0;" : : "n"(n) : "memory");
#endif // CP_ASYNC_AVAILABLE
}
