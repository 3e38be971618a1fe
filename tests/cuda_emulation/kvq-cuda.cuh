// Emulation of the CUDA environment that pykvq's kernels are written against, for compiling them as host C++ and
// running them on the CPU (emulator.cpp): this file stands in for ggml-kvq/src/cuda/kvq-cuda.cuh, whose
// common.cuh needs a CUDA compiler. Threads are OS threads; warp and block collectives meet at barriers.
#pragma once

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "ggml.h"
#include "ggml-impl.h"
#include "ggml-kvq.h"

// cuda_fp16.h brings the CUDA runtime's host definitions (dim3, cudaStream_t, __align__); the function and
// variable space specifiers mean nothing here
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __launch_bounds__(...)

#define WARP_SIZE 32
// the kernels' code paths for compute capability 8.0 and up; their PTX comes from the emulated kvq-cuda-ptx.cuh
#define AMPERE_MMA_AVAILABLE
#define CP_ASYNC_AVAILABLE
#define NO_DEVICE_CODE std::abort()

struct ggml_backend_cuda_context;

extern thread_local dim3 threadIdx;
extern thread_local dim3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;

using std::max;
using std::min;

// collectives of the calling thread's warp (lanes exchange 32-bit words) and block
uint32_t kvq_emu_exchange(uint32_t word, int src_lane);
uint32_t kvq_emu_ballot(bool pred);
void     kvq_emu_syncwarp();
void     kvq_emu_syncthreads();
bool     kvq_emu_syncthreads_or(bool pred);

template <typename T>
static inline T __shfl_sync(unsigned, T v, int src, int = WARP_SIZE) {
    static_assert(sizeof(T) == 4, "32-bit shuffles");
    uint32_t w;
    memcpy(&w, &v, 4);
    w = kvq_emu_exchange(w, src % WARP_SIZE);
    memcpy(&v, &w, 4);
    return v;
}

template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = WARP_SIZE) {
    return __shfl_sync(mask, v, (int) (threadIdx.x % WARP_SIZE) ^ lane_mask, width);
}

static inline unsigned __ballot_sync(unsigned, bool pred) { return kvq_emu_ballot(pred); }
static inline bool __all_sync(unsigned, bool pred) { return kvq_emu_ballot(pred) == 0xFFFFFFFFu; }
static inline bool __any_sync(unsigned, bool pred) { return kvq_emu_ballot(pred) != 0; }
static inline void __syncwarp(unsigned = 0xFFFFFFFFu) { kvq_emu_syncwarp(); }
static inline void __syncthreads() { kvq_emu_syncthreads(); }
static inline bool __syncthreads_or(bool pred) { return kvq_emu_syncthreads_or(pred); }
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline int atomicAdd(int * address, int v) { return __atomic_fetch_add(address, v, __ATOMIC_SEQ_CST); }
static inline float2 __ldcg(const float2 * p) { return *p; }
static inline float4 __ldcg(const float4 * p) { return *p; }
[[noreturn]] static inline void __trap() { std::abort(); }

template <int width = WARP_SIZE>
static inline float warp_reduce_sum(float x) {
    for (int offset = width/2; offset > 0; offset >>= 1) {
        x += __shfl_xor_sync(0xFFFFFFFF, x, offset, width);
    }
    return x;
}

template <int width = WARP_SIZE>
static inline float warp_reduce_max(float x) {
    for (int offset = width/2; offset > 0; offset >>= 1) {
        x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFF, x, offset, width));
    }
    return x;
}

// PTX prmt: byte k of the result is byte (s >> 4k) & 7 of y:x, or with bit 3 of that nibble its sign replicated
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t bytes  = (uint64_t) y << 32 | x;
    unsigned       result = 0;
    for (int k = 0; k < 4; ++k) {
        const unsigned sel = s >> 4*k & 0xF;
        unsigned       b   = (unsigned) (bytes >> 8*(sel & 7)) & 0xFF;
        if (sel & 8) {
            b = b & 0x80 ? 0xFF : 0;
        }
        result |= b << 8*k;
    }
    return result;
}

static inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, sizeof(f));
    return f;
}

static inline unsigned __float_as_uint(float x) {
    unsigned u;
    memcpy(&u, &x, sizeof(u));
    return u;
}

static inline int __float_as_int(float x) {
    return (int) __float_as_uint(x);
}

// the _rn intrinsics: single IEEE operations, as host float arithmetic is when nothing contracts it (-std=c++20)
static inline float __fmul_rn(float a, float b) { return a*b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a/b; }
static inline float __frcp_rn(float a) { return 1.0f/a; }

// ggml-cuda's fastdiv values: here the divisor alone (in z, where common.cuh keeps it), divided plainly
static inline uint3 init_fastdiv_values(uint64_t d) { return make_uint3(0, 0, (unsigned) d); }
static inline uint2 fast_div_modulo(uint32_t n, const uint3 d) { return make_uint2(n / d.z, n % d.z); }
static inline uint32_t fastmodulo(uint32_t n, const uint3 d) { return n % d.z; }

// programmatic dependent launch: the emulation runs one kernel at a time
static inline void ggml_cuda_pdl_sync() {}
static inline void ggml_cuda_pdl_lc() {}
