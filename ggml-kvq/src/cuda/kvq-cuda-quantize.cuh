// Quantization of one kivi block on the GPU, bit for bit kvq-quants.c's kivi_quantize_block: the kernels that
// store K and V (kvq-cuda-store.cuh) and set_rows into the kivi types (kvq-cuda.cu).
#pragma once

#include "kvq-cuda-source.cuh"

//
// ggml-cuda builds with -use_fast_math: divisions, reciprocals and the code arithmetic use the _rn
// intrinsics (IEEE rounding, never contracted into an FMA), and the comparisons run on integer keys,
// which flushing subnormals to zero cannot reorder.
//

static __device__ __forceinline__ bool kvq_is_nan(float x) {
    return (__float_as_uint(x) & 0x7FFFFFFFu) > 0x7F800000u;
}

// integer key that orders non-NaN floats as float comparison does, with -0 == +0
static __device__ __forceinline__ int kvq_order_key(float x) {
    const int i = __float_as_int(x);
    return i >= 0 ? i : -(i & 0x7FFFFFFF);
}

static __device__ __forceinline__ float kvq_saturate(float x) {
    return x > KVQ_FP16_MAX ? KVQ_FP16_MAX : (x < -KVQ_FP16_MAX ? -KVQ_FP16_MAX : x);
}

// the codes' grid of the range [lo, hi]: fp16 step and minimum as stored, and the values the codes are computed from
// (kvq-quants.c's kivi_range_grid)
struct kvq_grid {
    half  dh;
    half  mh;
    float d;
    float m;
    float id;
};

template <int qmax>
static __device__ __forceinline__ kvq_grid kvq_range_grid(const float lo, const float hi) {
    const float d_wanted = __fdiv_rn(__fsub_rn(hi, lo), (float) qmax);
    kvq_grid g;
    g.dh = __float2half_rn(d_wanted > KVQ_FP16_MAX ? KVQ_FP16_MAX : d_wanted);
    g.mh = __float2half_rn(lo);
    g.d  = __half2float(g.dh);
    g.m  = __half2float(g.mh);
    g.id = g.d > 0.0f ? __frcp_rn(g.d) : 0.0f;
    return g;
}

// (x - m)/d clamped to the codes' range (kivi_clamped_step)
template <int qmax>
static __device__ __forceinline__ float kvq_clamped_step(const float x, const float m, const float id) {
    const float t = __fmul_rn(__fsub_rn(kvq_saturate(x), m), id);
    return t < 0.0f ? 0.0f : (t > qmax ? (float) qmax : t);
}

// the block's sum of squared errors under [lo, hi], in value order (kivi_range_sse)
template <int qmax>
static __device__ float kvq_range_sse(const float * x, const float lo, const float hi) {
    const kvq_grid g = kvq_range_grid<qmax>(lo, hi);
    float sse = 0.0f;
#pragma unroll
    for (int i = 0; i < QK_KIVI; ++i) {
        if (kvq_is_nan(x[i])) {
            continue;
        }
        const float q = rintf(kvq_clamped_step<qmax>(x[i], g.m, g.id));
        const float e = __fsub_rn(__fadd_rn(g.m, __fmul_rn(g.d, q)), kvq_saturate(x[i]));
        sse = __fadd_rn(sse, __fmul_rn(e, e));
    }
    return sse;
}

#define KVQ_MSE_ENDS       (GGML_KVQ_MSE_STEPS + 1)
#define KVQ_MSE_CANDIDATES (KVQ_MSE_ENDS*KVQ_MSE_ENDS)

// GGML_KVQ_CLIP_MSE's candidate k: [lo, hi] with its low end moved in k / KVQ_MSE_ENDS steps of the width and its high
// end k % KVQ_MSE_ENDS (kivi_candidate_grids)
static __device__ __forceinline__ void kvq_mse_candidate(const float lo, const float hi, const int k, float & l, float & h) {
    const float w = __fsub_rn(hi, lo);
    l = __fadd_rn(lo, __fmul_rn(w, __fmul_rn((float) (k / KVQ_MSE_ENDS), GGML_KVQ_MSE_STEP)));
    h = __fsub_rn(hi, __fmul_rn(w, __fmul_rn((float) (k % KVQ_MSE_ENDS), GGML_KVQ_MSE_STEP)));
}

// GGML_KVQ_CLIP_MSE: the candidate range of least squared error, the first least (kivi_search_range). n_lanes
// WARP_SIZE: the whole warp quantizes the same block, each lane tries every WARP_SIZE-th candidate, in order, and the
// lanes meet by shuffles, ties going to the lower candidate: the choice of one lane trying them all.
template <int qmax, int n_lanes>
static __device__ void kvq_search_range(const float * x, float & lo, float & hi) {
    static_assert(n_lanes == 1 || n_lanes == WARP_SIZE, "one lane or the whole warp");
    if (!(__fsub_rn(hi, lo) > 0.0f)) {
        return;
    }
    float best   = INFINITY;
    int   best_k = 0;
    for (int k = threadIdx.x % n_lanes; k < KVQ_MSE_CANDIDATES; k += n_lanes) {
        float l;
        float h;
        kvq_mse_candidate(lo, hi, k, l, h);
        const float sse = kvq_range_sse<qmax>(x, l, h);
        if (sse < best) {
            best   = sse;
            best_k = k;
        }
    }
#pragma unroll
    for (int offset = n_lanes/2; offset > 0; offset >>= 1) {
        const float other   = __shfl_xor_sync(0xFFFFFFFF, best, offset);
        const int   other_k = __shfl_xor_sync(0xFFFFFFFF, best_k, offset);
        if (other < best || (other == best && other_k < best_k)) {
            best   = other;
            best_k = other_k;
        }
    }
    const float range_lo = lo;
    const float range_hi = hi;
    kvq_mse_candidate(range_lo, range_hi, best_k, lo, hi);
}

// One block of 32 values into a 4-byte aligned block: fp16 d and m, then the codes (byte i % nbytes,
// bit (i / nbytes)*bits), assembled as 32-bit words; the range clipped by `clip`, the codes dithered by spread16
// and key (ggml_kvq_quantize_block_dithered; 0: nearest). n_lanes WARP_SIZE: every lane of the warp calls it with the
// same arguments, they share the block's range search, and lane 0 writes the block.
template <int bits, int n_lanes = 1>
static __device__ void kvq_quantize_block(const float * x, uint32_t * block, const float clip, const int32_t spread16 = 0,
                                          const uint64_t key = 0) {
    constexpr int nbytes = QK_KIVI*bits/8;
    constexpr int qmax   = (1 << bits) - 1;

    // the reference keeps the first minimum and maximum (strict comparisons); saturating them afterwards
    // gives the same bits as saturating every value first
    float lo =  INFINITY;
    float hi = -INFINITY;
    int   lo_key = kvq_order_key(lo);
    int   hi_key = kvq_order_key(hi);
#pragma unroll
    for (int i = 0; i < QK_KIVI; ++i) {
        if (kvq_is_nan(x[i])) {
            continue;
        }
        const int key = kvq_order_key(x[i]);
        if (key < lo_key) {
            lo_key = key;
            lo     = x[i];
        }
        if (key > hi_key) {
            hi_key = key;
            hi     = x[i];
        }
    }
    const bool writes = threadIdx.x % n_lanes == 0;
    if (lo_key > hi_key) {
        if (!writes) {
            return;
        }
#pragma unroll
        for (int w = 0; w < 1 + nbytes/4; ++w) {
            block[w] = 0;
        }
        return;
    }
    lo = kvq_saturate(lo);
    hi = kvq_saturate(hi);
    if (clip == GGML_KVQ_CLIP_MSE) {
        kvq_search_range<qmax, n_lanes>(x, lo, hi);
    } else {
        lo = __fmul_rn(lo, clip);
        hi = __fmul_rn(hi, clip);
    }
    if (!writes) {
        return;
    }
    const kvq_grid g = kvq_range_grid<qmax>(lo, hi);

    uint32_t qs[nbytes/4] = {};
#pragma unroll
    for (int i = 0; i < QK_KIVI; ++i) {
        if (kvq_is_nan(x[i])) {
            continue;
        }
        const float tc = kvq_clamped_step<qmax>(x[i], g.m, g.id);
        const int   q  = spread16 == 0 ? (int) rintf(tc) : ggml_kvq_dithered_code(tc, qmax, spread16, key + i);
        qs[i % nbytes / 4] |= (uint32_t) q << (8*(i % nbytes % 4) + i / nbytes*bits);
    }
    block[0] = (uint32_t) __half_as_ushort(g.dh) | (uint32_t) __half_as_ushort(g.mh) << 16;
#pragma unroll
    for (int w = 0; w < nbytes/4; ++w) {
        block[1 + w] = qs[w];
    }
}

// the same, for a width known at run time
template <int n_lanes = 1>
static __device__ __forceinline__ void kvq_quantize_block_bits(const float * x, uint32_t * block, const int bits,
                                                               const float clip, const int32_t spread16, const uint64_t key) {
    switch (bits) {
        case 1:  kvq_quantize_block<1, n_lanes>(x, block, clip, spread16, key); break;
        case 2:  kvq_quantize_block<2, n_lanes>(x, block, clip, spread16, key); break;
        default: kvq_quantize_block<4, n_lanes>(x, block, clip, spread16, key); break;
    }
}

