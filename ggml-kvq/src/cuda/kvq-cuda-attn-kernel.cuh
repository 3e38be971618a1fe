// ATTN on CUDA cores, the kernel (kvq-cuda.cu plans and launches it; kvq-cuda-mma-kernel.cuh is its tensor-core
// twin). kvq-cpu-attn.c is the specification: every cell is read through the same value (fp16 or quantized) as there.
#pragma once

#include "kvq-cuda-attn.cuh"

static __device__ __forceinline__ float2 kvq_load2(const half * row, int c) {
    return __half22float2(*(const half2 *) (row + c));
}

static __device__ __forceinline__ float2 kvq_load2(const float * row, int c) {
    return make_float2(kvq_round_fp16(row[c]), kvq_round_fp16(row[c + 1]));
}

template <typename T>
static __device__ __forceinline__ float4 kvq_load4(const T * row, int c) {
    const float2 a = kvq_load2(row, c);
    const float2 b = kvq_load2(row, c + 2);
    return make_float4(a.x, a.y, b.x, b.y);
}

//
// ATTN (kvq-cpu-attn.c)
//
// One block serves ncols query heads of one KV head (GQA: each K/V tile is read once for all of them)
// for one query token, over one split of the context: grid (n_splits, n_head_kv*n_groups, tokens of the launch),
// KVQ_NWARPS warps. A warp takes a 32-cell tile at a time (the tiles of a split go round the warps):
//   1. scores, lane u <- cell u: quantized K straight from the tile's codes (kvq_tile_scores), fp16 K
//      (window, sinks, the query's own tile, the batch) by a per-lane dot product;
//   2. online softmax per query head over the tile (fp32), the weights to shared memory;
//   3. V: the warp walks the tile's cells, each lane decoding four channels at a time from the
//      quantized row or the fp16 one; a latent layer's quantized V, K's tile, is weighed per channel over the
//      whole tile instead (kvq_latent_v_tile).
// The warps' states are merged in shared memory; with n_splits > 1 each split writes its (max, sum,
// unnormalised output) and the block that finishes last for its (token, heads) merges them all.
// A split is tiles_per_split tiles (a constant of the kernel) at fixed cells, whatever the batch, the context's
// length or the GPU:
// a query's output then depends on its own cells only (splits past them merge in as exact zeros), so the same
// tokens decoded in other batches, or after a state load, attend bit for bit alike. Prefill runs the same
// kernel, one query per block.
//


// shared memory of one warp: q*d of its K tile, at the end its output accumulators
static __host__ __device__ int kvq_attn_slice(int ncols, int head_dim, int head_dim_v) {
    return ncols*(head_dim > head_dim_v ? head_dim : head_dim_v);
}

// Where the four codes 4k .. 4k+3 of a block sit: in four consecutive bytes under one shift, for every
// width, so that one 32-bit load yields them.
struct kvq_quad {
    int      offset;  // from the start of the block, d and m included
    int      shift;
    uint32_t mask;
};

// byte 4k % nbytes under shift 4k/nbytes*bits, nbytes = 4*bits, without divisions (bits is a power of two)
static __device__ __forceinline__ kvq_quad kvq_quad_at(int k, int bits) {
    return { 2*(int) sizeof(half) + 4*(k & (bits - 1)), k & ~(bits - 1), 0x01010101u*((1u << bits) - 1) };
}

// byte k of `codes` as a float: as the low mantissa bits of 2^23, minus 2^23 (exact, cheaper than I2F)
static __device__ __forceinline__ float kvq_code(uint32_t codes, int k) {
    return __int_as_float(__byte_perm(codes, 0x4B000000, 0x7650 | k)) - 8388608.0f;
}

static __device__ __forceinline__ float4 kvq_quad_codes(const char * block, const kvq_quad & quad) {
    const uint32_t codes = (*(const uint32_t *) (block + quad.offset) >> quad.shift) & quad.mask;
    return make_float4(kvq_code(codes, 0), kvq_code(codes, 1), kvq_code(codes, 2), kvq_code(codes, 3));
}

// (d, m) of a block
static __device__ __forceinline__ float2 kvq_block_dm(const char * block) {
    return __half22float2(*(const half2 *) block);
}

// the ncols values of one channel of a [channel][ncols] array in shared memory
template <int ncols>
static __device__ __forceinline__ void kvq_load_cols(const float * src, float (&dst)[ncols]) {
    if constexpr (ncols % 4 == 0) {
#pragma unroll
        for (int i = 0; i < ncols/4; ++i) {
            const float4 v = ((const float4 *) src)[i];
            dst[4*i + 0] = v.x;
            dst[4*i + 1] = v.y;
            dst[4*i + 2] = v.z;
            dst[4*i + 3] = v.w;
        }
    } else if constexpr (ncols == 2) {
        const float2 v = *(const float2 *) src;
        dst[0] = v.x;
        dst[1] = v.y;
    } else {
        dst[0] = src[0];
    }
}


// Scores of the ncols query heads against the 32 cells of a quantized K tile (the head's head_dim
// channel blocks), from the codes directly: score_u = sum_c (q_c d_c) code_{c,u} + sum_c q_c m_c.
// Lane u gets the scores of cell u. The whole warp must call it.
template <int ncols>
static __device__ void kvq_tile_scores(const char * blocks, const int bits, const int head_dim, const kvq_quad & quad,
                                       const float * q_s, float * qd_s, float (&score)[ncols]) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int bb   = kvq_block_bytes(bits);

    // lanes over channels: q*d into shared memory, the offset sum_c q*m in registers
    float offset[ncols] = {};
    for (int c = lane; c < head_dim; c += WARP_SIZE) {
        const float2 dm = kvq_block_dm(blocks + c*bb);
        float q[ncols];
        kvq_load_cols(q_s + c*ncols, q);
#pragma unroll
        for (int g = 0; g < ncols; ++g) {
            qd_s[c*ncols + g] = q[g]*dm.x;
            offset[g] += q[g]*dm.y;
        }
    }
    __syncwarp();

    // lane 4*quad + slot sums the cells 4*quad .. 4*quad+3 over the channels c = slot (mod 4), one 32-bit
    // load of codes per channel
    const int slot = lane % 4;
    float part[ncols][4] = {};
#pragma unroll 4
    for (int c = slot; c < head_dim; c += 4) {
        const float4 code = kvq_quad_codes(blocks + c*bb, quad);
        float qd[ncols];
        kvq_load_cols(qd_s + c*ncols, qd);
#pragma unroll
        for (int g = 0; g < ncols; ++g) {
            part[g][0] += qd[g]*code.x;
            part[g][1] += qd[g]*code.y;
            part[g][2] += qd[g]*code.z;
            part[g][3] += qd[g]*code.w;
        }
    }
    __syncwarp(); // qd_s belongs to the next tile

    // reduce-scatter over the four slots: lane 4*quad + slot ends with cell 4*quad + slot
    const bool hi  = slot & 2;
    const bool odd = slot & 1;
#pragma unroll
    for (int g = 0; g < ncols; ++g) {
        const float keep0 = (hi ? part[g][2] : part[g][0]) + __shfl_xor_sync(0xFFFFFFFF, hi ? part[g][0] : part[g][2], 2);
        const float keep1 = (hi ? part[g][3] : part[g][1]) + __shfl_xor_sync(0xFFFFFFFF, hi ? part[g][1] : part[g][3], 2);
        score[g] = (odd ? keep1 : keep0) + __shfl_xor_sync(0xFFFFFFFF, odd ? keep0 : keep1, 1) + warp_reduce_sum(offset[g]);
    }
}

// scores of the ncols query heads against one fp16 K row (one lane)
template <int ncols, typename T>
static __device__ void kvq_dot_fp16(const T * row, const float * q_s, const int head_dim, float (&score)[ncols]) {
#pragma unroll
    for (int g = 0; g < ncols; ++g) {
        score[g] = 0.0f;
    }
    for (int c = 0; c < head_dim; c += 2) {
        const float2 k = kvq_load2(row, c);
        float q0[ncols];
        float q1[ncols];
        kvq_load_cols(q_s + c*ncols, q0);
        kvq_load_cols(q_s + (c + 1)*ncols, q1);
#pragma unroll
        for (int g = 0; g < ncols; ++g) {
            score[g] += q0[g]*k.x + q1[g]*k.y;
        }
    }
}

// this lane's channels 4r .. 4r+3 (r = lane + 32k) of a quantized V row (the head's blocks); the quad
// within its block is lane % 8 for every k
template <int nvq>
static __device__ void kvq_dequant_v(const char * blocks, const int bb, const kvq_quad & quad, const int n_quad, float4 (&v)[nvq]) {
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int k = 0; k < nvq; ++k) {
        const int r = lane + k*WARP_SIZE;
        if (r >= n_quad) {
            v[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            continue;
        }
        const char * block = blocks + (r/8)*bb;
        const float2 dm    = kvq_block_dm(block);
        const float4 code  = kvq_quad_codes(block, quad);
        v[k] = make_float4(dm.x*code.x + dm.y, dm.x*code.y + dm.y, dm.x*code.z + dm.y, dm.x*code.w + dm.y);
    }
}

static __device__ __forceinline__ void kvq_add_lane(float4 & a, const int i, const float x) {
    switch (i) {
        case 0:  a.x += x; break;
        case 1:  a.y += x; break;
        case 2:  a.z += x; break;
        default: a.w += x; break;
    }
}

// A latent layer's quantized V (ggml_kvq_attn_latent: the first channels of K's tile) over a whole tile, into this
// lane's channels 4r .. 4r+3 (r = lane + 32k, as kvq_dequant_v's). Per channel, KIVI's factorisation the other way
// round (kvq_group_v_tiles on the CPU): d_c sum_u w_u q_uc + m_c sum_u w_u, so that a channel's codes are read a quad
// at a time and its scale and minimum once, not a byte and a block header per cell. w_s: the tile's weights
// [cell][ncols], 0 where the cell is read in fp16; w_sum: their sums.
template <int ncols, int nvq>
static __device__ void kvq_latent_v_tile(const char * blocks, const int bits, const int n_quad, const float * w_s,
                                         const float (&w_sum)[ncols], float4 (&acc)[ncols][nvq]) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int bb   = kvq_block_bytes(bits);
    // loops kept rolled: this path's registers count for every layer's launch of the kernel
#pragma unroll
    for (int k = 0; k < nvq; ++k) {
        const int r = lane + k*WARP_SIZE;
        if (r >= n_quad) {
            continue;
        }
#pragma unroll 1
        for (int i = 0; i < 4; ++i) {
            const char * block = blocks + (4*r + i)*bb;
            float cw[ncols] = {};
#pragma unroll 1
            for (int quad = 0; quad < QK_KIVI/4; ++quad) {
                const float4 code = kvq_quad_codes(block, kvq_quad_at(quad, bits));
                const float * w = w_s + 4*quad*ncols;
#pragma unroll
                for (int g = 0; g < ncols; ++g) {
                    cw[g] += w[g]*code.x + w[ncols + g]*code.y + w[2*ncols + g]*code.z + w[3*ncols + g]*code.w;
                }
            }
            const float2 dm = kvq_block_dm(block);
#pragma unroll
            for (int g = 0; g < ncols; ++g) {
                kvq_add_lane(acc[g][k], i, dm.x*cw[g] + dm.y*w_sum[g]);
            }
        }
    }
}

// the same channels of an fp16 V row
template <int nvq, typename T>
static __device__ void kvq_load_v(const T * row, const int n_quad, float4 (&v)[nvq]) {
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int k = 0; k < nvq; ++k) {
        const int r = lane + k*WARP_SIZE;
        v[k] = r < n_quad ? kvq_load4(row, 4*r) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

// ncols: query heads per block; nvq: 4-channel V quads per lane (head_dim_v <= 128*nvq)
template <int ncols, int nvq>
static __global__ void __launch_bounds__(KVQ_NWARPS*WARP_SIZE) kvq_attn_kernel(const kvq_attn_params p) {
    static_assert(ncols*nvq <= 16, "V accumulators would spill");
    extern __shared__ float kvq_smem[];
    // launched with programmatic dependent launch: the kernel after it may start, as after upstream's flash
    // attention, and waits for it in its own ggml_cuda_pdl_sync; nothing is read before the store has finished
    ggml_cuda_pdl_lc();
    ggml_cuda_pdl_sync();

    const int warp   = threadIdx.x / WARP_SIZE;
    const int lane   = threadIdx.x % WARP_SIZE;
    const int split  = blockIdx.x;
    const kvq_block_heads bh = kvq_block_heads_at(p, ncols);
    const int hk     = bh.hk;
    const int h0     = bh.h0;
    const int nh     = bh.nh;
    const kvq_block_tokens bt = kvq_block_token_at(p);  // planned with one token a block
    const int t      = bt.first;
    const int D      = p.k.head_dim;
    const int Dv     = p.v.head_dim;
    const int n_quad = Dv/4;
    const int n_sink = p.k.n_sink;

    // shared memory: Q [D][ncols]; per warp a slice (kvq_attn_slice) and the softmax weights of its tile
    // [32][ncols], which at the end hold its accumulators and its (max, sum)
    const int slice = kvq_attn_slice(ncols, D, Dv);
    float * q_s     = kvq_smem;
    float * slice_s = q_s + ncols*D;
    float * w_s     = slice_s + KVQ_NWARPS*slice;
    float * my_slice_s = slice_s + warp*slice;
    float * my_w_s     = w_s + warp*WARP_SIZE*ncols;

    const kvq_query qr = kvq_query_at(p, t);

    // Q in fp16, as upstream's flash attention takes it for f16 K
    for (int idx = threadIdx.x; idx < ncols*D; idx += blockDim.x) {
        const int g = idx / D;
        const int c = idx % D;
        q_s[c*ncols + g] = g < nh ? kvq_round_fp16(((const float *) (p.q + t*p.q_nb2 + (h0 + g)*p.q_nb1))[c]) : 0.0f;
    }
    __syncthreads();

    const kvq_quad k_quad = kvq_quad_at(lane/4, p.k_bits);
    const kvq_quad v_quad = kvq_quad_at(lane%8, p.v_bits);
    const int      k_bb   = kvq_block_bytes(p.k_bits);
    const int      v_bb   = kvq_block_bytes(p.v_bits);

    float  run_max[ncols];
    float  run_sum[ncols];
    float4 acc[ncols][nvq];
#pragma unroll
    for (int g = 0; g < ncols; ++g) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
#pragma unroll
        for (int k = 0; k < nvq; ++k) {
            acc[g][k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }

    const int n_tiles  = (p.n_kv + QK_KIVI - 1)/QK_KIVI;
    const int tile_end = min(n_tiles, (split + 1)*p.tiles_per_split);
    for (int tile = split*p.tiles_per_split + warp; tile < tile_end; tile += KVQ_NWARPS) {
        const int64_t  j0             = (int64_t) tile*QK_KIVI;
        const int64_t  j              = j0 + lane;
        const float    mv             = j < qr.end ? kvq_mask_value(p, t, qr.col0 + j) : -INFINITY;
        const bool     attended       = mv != -INFINITY;
        const uint32_t attended_cells = __ballot_sync(0xFFFFFFFF, attended);
        if (attended_cells == 0) {
            continue; // e.g. the future of a prefill query: no K or V is read
        }

        float score[ncols];
        const bool quant_k = attended && j >= n_sink && j < qr.lim_k;
        // a latent layer's V of the cells read quantized comes from the tile as a whole (kvq_latent_v_tile)
        const bool quant_v_tile = p.latent && attended && j >= n_sink && j < qr.lim_v;
        if (__any_sync(0xFFFFFFFF, quant_k)) {
            kvq_tile_scores(qr.k_tiles + tile*p.k_tiles_nb1 + (size_t) hk*D*k_bb, p.k_bits, D, k_quad, q_s, my_slice_s, score);
        }
        if (attended && !quant_k) {
            kvq_with_fp16_row(qr.k, qr.first, j, hk, [&](const auto * row) { kvq_dot_fp16(row, q_s, D, score); });
        }

        float w_tile[ncols];
#pragma unroll
        for (int g = 0; g < ncols; ++g) {
            const float s       = attended ? ggml_kvq_capped(score[g]*p.scale, p.softcap) + mv : -INFINITY;
            const float new_max = fmaxf(run_max[g], warp_reduce_max(s));
            const float rescale = expf(run_max[g] - new_max);
            const float w       = expf(s - new_max);
            run_sum[g] = run_sum[g]*rescale + warp_reduce_sum(w);
            run_max[g] = new_max;
            w_tile[g]  = p.latent ? warp_reduce_sum(quant_v_tile ? w : 0.0f) : 0.0f;
#pragma unroll
            for (int k = 0; k < nvq; ++k) {
                acc[g][k].x *= rescale;
                acc[g][k].y *= rescale;
                acc[g][k].z *= rescale;
                acc[g][k].w *= rescale;
            }
            my_w_s[lane*ncols + g] = w;
        }
        __syncwarp();

        const uint32_t tile_v_cells = __ballot_sync(0xFFFFFFFF, quant_v_tile);
        for (int u = 0; u < WARP_SIZE; ++u) {
            if (!(attended_cells & ~tile_v_cells & (1u << u))) {
                continue;
            }
            const int64_t cell = j0 + u;
            float4 v[nvq];
            if (cell >= n_sink && cell < qr.lim_v) {
                kvq_dequant_v(qr.v_rows + cell*p.v_rows_nb1 + (size_t) hk*(Dv/QK_KIVI)*v_bb, v_bb, v_quad, n_quad, v);
            } else {
                kvq_with_fp16_row(qr.v, qr.first, cell, hk, [&](const auto * row) { kvq_load_v(row, n_quad, v); });
            }
            float w[ncols];
            kvq_load_cols(my_w_s + u*ncols, w);
#pragma unroll
            for (int g = 0; g < ncols; ++g) {
#pragma unroll
                for (int k = 0; k < nvq; ++k) {
                    acc[g][k].x += w[g]*v[k].x;
                    acc[g][k].y += w[g]*v[k].y;
                    acc[g][k].z += w[g]*v[k].z;
                    acc[g][k].w += w[g]*v[k].w;
                }
            }
        }
        if (tile_v_cells != 0) {
            // the fp16 cells' weights have been read: the tile's sums leave them out
            __syncwarp();
            if (!quant_v_tile) {
#pragma unroll
                for (int g = 0; g < ncols; ++g) {
                    my_w_s[lane*ncols + g] = 0.0f;
                }
            }
            __syncwarp();
            kvq_latent_v_tile(qr.k_tiles + tile*p.k_tiles_nb1, p.k_bits, n_quad, my_w_s, w_tile, acc);
        }
        __syncwarp(); // my_w_s belongs to the next tile
    }

    // merge the warps: each writes its state into its own slice, then the block folds them per channel
#pragma unroll
    for (int g = 0; g < ncols; ++g) {
#pragma unroll
        for (int k = 0; k < nvq; ++k) {
            const int r = lane + k*WARP_SIZE;
            if (r < n_quad) {
                ((float4 *) (my_slice_s + g*Dv))[r] = acc[g][k];
            }
        }
        if (lane == 0) {
            my_w_s[2*g + 0] = run_max[g];
            my_w_s[2*g + 1] = run_sum[g];
        }
    }
    __syncthreads();

    kvq_attn_write_block(p, w_s, WARP_SIZE*ncols, slice_s, slice, nh, h0, bt, split);
}

// query heads per block: all of a KV head's when they fit (each K/V tile is then read once for them),
// padded to a power of two, at most 8 and at most KVQ_COLS_X_DIM / (head size)
static __host__ int kvq_attn_ncols(int n_gqa, int head_dim, int head_dim_v) {
    int ncols = 1;
    while (ncols < n_gqa && 2*ncols <= 8 && kvq_attn_slice(2*ncols, head_dim, head_dim_v) <= KVQ_COLS_X_DIM) {
        ncols *= 2;
    }
    return ncols;
}

// shared memory of a block of the kernel for ncols query heads
static __host__ size_t kvq_attn_smem(const int ncols, const kvq_attn_params & p) {
    const int slice = kvq_attn_slice(ncols, p.k.head_dim, p.v.head_dim);
    return sizeof(float)*(ncols*p.k.head_dim + KVQ_NWARPS*(slice + WARP_SIZE*ncols));
}
