// CUDA kernels of GGML_OP_KVQ and of ggml_set_rows into the kivi types. kvq-cpu.c is the specification:
// every cell is read through the same value (fp16 or quantized) as there, and quantized blocks are
// bit-identical to kvq-quants.c's.

#include "kvq-cuda-attn.cuh"
#include "kvq-cuda-mma.cuh"

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
// quantization (kivi_quantize_block in kvq-quants.c, bit for bit)
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

// One block of 32 values into a 4-byte aligned block: fp16 d and m, then the codes (byte i % nbytes,
// bit (i / nbytes)*bits), assembled as 32-bit words; the range clipped by `clip` (ggml_kvq_quantize_block).
template <int bits>
static __device__ void kvq_quantize_block(const float * x, uint32_t * block, const float clip) {
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
    if (lo_key > hi_key) {
#pragma unroll
        for (int w = 0; w < 1 + nbytes/4; ++w) {
            block[w] = 0;
        }
        return;
    }
    lo = __fmul_rn(kvq_saturate(lo), clip);
    hi = __fmul_rn(kvq_saturate(hi), clip);
    const float d_wanted = __fdiv_rn(__fsub_rn(hi, lo), (float) qmax);
    const half  dh = __float2half_rn(d_wanted > KVQ_FP16_MAX ? KVQ_FP16_MAX : d_wanted);
    const half  mh = __float2half_rn(lo);
    const float d  = __half2float(dh);
    const float m  = __half2float(mh);
    const float id = d > 0.0f ? __frcp_rn(d) : 0.0f;

    uint32_t qs[nbytes/4] = {};
#pragma unroll
    for (int i = 0; i < QK_KIVI; ++i) {
        if (kvq_is_nan(x[i])) {
            continue;
        }
        const float t = __fmul_rn(__fsub_rn(kvq_saturate(x[i]), m), id);
        const int   q = (int) rintf(t < 0.0f ? 0.0f : (t > qmax ? (float) qmax : t));
        qs[i % nbytes / 4] |= (uint32_t) q << (8*(i % nbytes % 4) + i / nbytes*bits);
    }
    block[0] = (uint32_t) __half_as_ushort(dh) | (uint32_t) __half_as_ushort(mh) << 16;
#pragma unroll
    for (int w = 0; w < nbytes/4; ++w) {
        block[1 + w] = qs[w];
    }
}

//
// SEAL_K: quantize every K tile the batch completes (kvq_seal_k in kvq-cpu.c)
//
// grid: (channels / KVQ_BLOCK_SIZE, candidate tiles); a thread quantizes one channel of one tile, so that
// neighbouring threads read neighbouring fp16 values.
//

template <int bits>
static __global__ void kvq_seal_k_kernel(char * k_tiles, const size_t k_tiles_nb1, kvq_source src,
                                         const int64_t * cells, const int n_embd, const float clip) {
    const int c = blockIdx.x*blockDim.x + threadIdx.x;
    if (c >= n_embd) {
        return;
    }
    // grid z: the segments; checked up to their last token
    int64_t       strm;
    const int64_t first = kvq_segment(src, cells, (int64_t) blockIdx.z*src.n_tps + src.n_tps - 1, &strm);
    const int64_t tile  = first/QK_KIVI + blockIdx.y;
    k_tiles += strm*(src.kv_size/QK_KIVI)*k_tiles_nb1;
    if (tile*QK_KIVI + QK_KIVI - 1 > first + src.n_tokens - 1) {
        return;
    }
    const int head = c / src.head_dim;
    const int hc   = c % src.head_dim;

    // the batch's cells rounded to fp16, the earlier ones from the ring (never a sink row: the ring holds
    // every recent cell, sinks included)
    float x[QK_KIVI];
#pragma unroll
    for (int u = 0; u < QK_KIVI; ++u) {
        const int64_t cell = tile*QK_KIVI + u;
        x[u] = cell >= first ? kvq_round_fp16(kvq_cur_row(src, cell - first, head)[hc])
                             : __half2float(((const half *) (src.fp16 + (src.n_sink + cell % src.n_ring)*src.fp16_nb1))[c]);
    }
    kvq_quantize_block<bits>(x, (uint32_t *) (k_tiles + tile*k_tiles_nb1 + (size_t) c*kvq_block_bytes(bits)), clip);
}

//
// RING_PUT: the batch's values into sink rows and ring slots, as fp16 (kvq_ring_put in kvq-cpu.c)
//

static __global__ void kvq_ring_put_kernel(kvq_source src, const int64_t * cells, const int n_embd) {
    const int c = blockIdx.x*blockDim.x + threadIdx.x;
    if (c >= n_embd) {
        return;
    }
    int64_t       strm;
    const int64_t first = kvq_segment(src, cells, blockIdx.y, &strm);
    const int     t     = blockIdx.y % src.n_tps;  // within the segment
    const int64_t cell  = first + t;
    const half    x     = __float2half_rn(kvq_cur_row(src, t, c / src.head_dim)[c % src.head_dim]);

    // only the n_ring most recent cells keep a ring slot: distinct slots, so threads never collide
    if (cell > first + src.n_tokens - 1 - src.n_ring) {
        ((half *) (src.fp16 + (src.n_sink + cell % src.n_ring)*src.fp16_nb1))[c] = x;
    }
    if (cell < src.n_sink) {
        ((half *) (src.fp16 + cell*src.fp16_nb1))[c] = x;
    }
}

//
// set_rows into a kivi tensor: upstream's ggml_set_rows (rows broadcast over dims 2 and 3, like
// set-rows.cu), and STORE_V (the same with a clip ratio), one thread per 32-value block
//

template <typename idx_t, int bits>
static __global__ void kvq_set_rows_kernel(
        const char * src0, const char * src1, char * dst, const int64_t n_blocks,
        const size_t nb01, const size_t nb02, const size_t nb03,
        const size_t nb10, const size_t nb11, const size_t nb12,
        const size_t nb1, const size_t nb2, const size_t nb3,
        const uint3 blocks_per_row, const uint3 ne01, const uint3 ne02, const uint3 ne11, const uint3 ne12,
        const float clip) {
    const int64_t i = (int64_t) blockDim.x*blockIdx.x + threadIdx.x;
    if (i >= n_blocks) {
        return;
    }
    uint2 dm = fast_div_modulo((uint32_t) i, blocks_per_row);
    const uint32_t ib = dm.y;
    dm = fast_div_modulo(dm.x, ne01);
    const uint32_t i01 = dm.y;
    dm = fast_div_modulo(dm.x, ne02);
    const uint32_t i02 = dm.y;
    const uint32_t i03 = dm.x;
    const uint32_t i11 = fastmodulo(i02, ne11);
    const uint32_t i12 = fastmodulo(i03, ne12);

    const int64_t row = *(const idx_t *) (src1 + i01*nb10 + i11*nb11 + i12*nb12);
    const float * x   = (const float *) (src0 + i01*nb01 + i02*nb02 + i03*nb03) + ib*QK_KIVI;

    float xs[QK_KIVI];
#pragma unroll
    for (int u = 0; u < QK_KIVI; ++u) {
        xs[u] = x[u];
    }
    kvq_quantize_block<bits>(xs, (uint32_t *) (dst + row*nb1 + i02*nb2 + i03*nb3 + (size_t) ib*kvq_block_bytes(bits)), clip);
}

//
// ATTN (kvq_attn_row in kvq-cpu.c)
//
// One block serves ncols query heads of one KV head (GQA: each K/V tile is read once for all of them)
// for one query token, over one split of the context: grid (n_splits, n_head_kv*n_groups, tokens of the launch),
// KVQ_NWARPS warps. A warp takes a 32-cell tile at a time (the tiles of a split go round the warps):
//   1. scores, lane u <- cell u: quantized K straight from the tile's codes (kvq_tile_scores), fp16 K
//      (window, sinks, the query's own tile, the batch) by a per-lane dot product;
//   2. online softmax per query head over the tile (fp32), the weights to shared memory;
//   3. V: the warp walks the tile's cells, each lane decoding four channels at a time from the
//      quantized row or the fp16 one.
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

static __device__ __forceinline__ kvq_quad kvq_quad_at(int k, int bits) {
    const int nbytes = QK_KIVI*bits/8;
    return { 2*(int) sizeof(half) + 4*k % nbytes, 4*k/nbytes*bits, 0x01010101u*((1u << bits) - 1) };
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

    const int warp   = threadIdx.x / WARP_SIZE;
    const int lane   = threadIdx.x % WARP_SIZE;
    const int split  = blockIdx.x;
    const int hk     = blockIdx.y / p.n_groups;
    const int h0     = hk*p.n_gqa + blockIdx.y % p.n_groups*ncols;  // the block's first query head
    const int nh     = min(ncols, (hk + 1)*p.n_gqa - h0);           // its real heads; the rest pads to ncols
    const int t      = p.t0 + blockIdx.z;
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
        if (__any_sync(0xFFFFFFFF, quant_k)) {
            kvq_tile_scores(qr.k_tiles + tile*p.k_tiles_nb1 + (size_t) hk*D*k_bb, p.k_bits, D, k_quad, q_s, my_slice_s, score);
        }
        if (attended && !quant_k) {
            kvq_with_fp16_row(qr.k, qr.first, j, hk, [&](const auto * row) { kvq_dot_fp16(row, q_s, D, score); });
        }

#pragma unroll
        for (int g = 0; g < ncols; ++g) {
            const float s       = attended ? ggml_kvq_capped(score[g]*p.scale, p.softcap) + mv : -INFINITY;
            const float new_max = fmaxf(run_max[g], warp_reduce_max(s));
            const float rescale = expf(run_max[g] - new_max);
            const float w       = expf(s - new_max);
            run_sum[g] = run_sum[g]*rescale + warp_reduce_sum(w);
            run_max[g] = new_max;
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

        for (int u = 0; u < WARP_SIZE; ++u) {
            if (!(attended_cells & (1u << u))) {
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

    kvq_attn_write_block(p, w_s, WARP_SIZE*ncols, slice_s, slice, nh, h0, t, split);
}

//
// host side
//



static void kvq_seal_k(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * k_tiles = dst->src[0];
    const kvq_source    src     = kvq_make_source(dst, dst->src[1], dst->src[2]);
    const int64_t     * cells   = kvq_cells(dst->src[3], dst->src[2]);
    const int           n_embd  = src.head_dim*(int) dst->src[2]->ne[1];
    GGML_ASSERT(ggml_kvq_is_kivi(k_tiles->type) && ggml_is_contiguous(k_tiles));
    GGML_ASSERT(k_tiles->ne[0] == (int64_t) n_embd*QK_KIVI);
    kvq_assert_words(k_tiles);

    // the tiles ending inside a segment are among the first ceil(n_tps/32) from its first/32 on
    const dim3 grid((n_embd + KVQ_BLOCK_SIZE - 1)/KVQ_BLOCK_SIZE, (src.n_tps + QK_KIVI - 1)/QK_KIVI, src.n_tokens/src.n_tps);
    char * data = (char *) k_tiles->data;
    const float clip = ggml_get_op_params_f32(dst, GGML_KVQ_CLIP_PARAM);
    cudaStream_t stream = ctx.stream();
    switch (ggml_kvq_bits(k_tiles->type)) {
        case 1:  kvq_seal_k_kernel<1><<<grid, KVQ_BLOCK_SIZE, 0, stream>>>(data, k_tiles->nb[1], src, cells, n_embd, clip); break;
        case 2:  kvq_seal_k_kernel<2><<<grid, KVQ_BLOCK_SIZE, 0, stream>>>(data, k_tiles->nb[1], src, cells, n_embd, clip); break;
        default: kvq_seal_k_kernel<4><<<grid, KVQ_BLOCK_SIZE, 0, stream>>>(data, k_tiles->nb[1], src, cells, n_embd, clip); break;
    }
    CUDA_CHECK(cudaGetLastError());
}

static void kvq_ring_put(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const kvq_source src    = kvq_make_source(dst, dst->src[0], dst->src[1]);
    const int64_t  * cells  = kvq_cells(dst->src[2], dst->src[1]);
    const int        n_embd = src.head_dim*(int) dst->src[1]->ne[1];

    const dim3 grid((n_embd + KVQ_BLOCK_SIZE - 1)/KVQ_BLOCK_SIZE, src.n_tokens);
    kvq_ring_put_kernel<<<grid, KVQ_BLOCK_SIZE, 0, ctx.stream()>>>(src, cells, n_embd);
    CUDA_CHECK(cudaGetLastError());
}

// query heads per block: all of a KV head's when they fit (each K/V tile is then read once for them),
// padded to a power of two, at most 8 and at most KVQ_COLS_X_DIM / (head size)
static int kvq_attn_ncols(int n_gqa, int head_dim, int head_dim_v) {
    int ncols = 1;
    while (ncols < n_gqa && 2*ncols <= 8 && kvq_attn_slice(2*ncols, head_dim, head_dim_v) <= KVQ_COLS_X_DIM) {
        ncols *= 2;
    }
    return ncols;
}

template <int ncols, int nvq>
static void kvq_attn_launch(const kvq_attn_params & p, const dim3 grid, cudaStream_t stream) {
    const int    slice = kvq_attn_slice(ncols, p.k.head_dim, p.v.head_dim);
    const size_t smem  = sizeof(float)*(ncols*p.k.head_dim + KVQ_NWARPS*(slice + WARP_SIZE*ncols));
    kvq_attn_kernel<ncols, nvq><<<grid, KVQ_NWARPS*WARP_SIZE, smem, stream>>>(p);
}

template <int nvq>
static void kvq_attn_launch_cols(const kvq_attn_params & p, const int ncols, const dim3 grid, cudaStream_t stream) {
    switch (ncols) {
        case 1: kvq_attn_launch<1, nvq>(p, grid, stream); break;
        case 2: kvq_attn_launch<2, nvq>(p, grid, stream); break;
        case 4: kvq_attn_launch<4, nvq>(p, grid, stream); break;
        default:
            // kvq_attn_ncols gives 8 only for head sizes up to KVQ_COLS_X_DIM/8 = 256
            if constexpr (nvq <= 2) {
                kvq_attn_launch<8, nvq>(p, grid, stream);
            } else {
                GGML_ABORT("fatal error");
            }
            break;
    }
}

static void kvq_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    kvq_attn_params p = kvq_attn_make_params(dst);
    const int n_head    = p.n_head;
    const int n_head_kv = p.n_head/p.n_gqa;
    const int n_tokens  = p.k.n_tokens;

    const bool mma   = kvq_attn_mma_wanted(ctx.device, p);
    const int  ncols = mma ? KVQ_MMA_COLS : kvq_attn_ncols(p.n_gqa, p.k.head_dim, p.v.head_dim);
    const int  nvq   = p.v.head_dim <= 128 ? 1 : (p.v.head_dim <= 256 ? 2 : 4);
    kvq_attn_plan(p, ncols, mma ? KVQ_MMA_TILES_PER_SPLIT : KVQ_TILES_PER_SPLIT);

    // the partials of a long context over a large batch would not fit, so launches take the batch in chunks of
    // tokens
    const int64_t per_token = (int64_t) n_head*p.n_splits*(p.v.head_dim + 2);
    const int     chunk     = p.n_splits == 1 ? n_tokens : (int) std::clamp<int64_t>(KVQ_MAX_PARTIALS/per_token, 1, n_tokens);
    const int     n_rows    = n_head_kv*p.n_groups;

    ggml_cuda_pool_alloc<float> part(ctx.pool());
    ggml_cuda_pool_alloc<int>   arrived(ctx.pool());
    if (p.n_splits > 1) {
        part.alloc(chunk*per_token);
        arrived.alloc((int64_t) chunk*n_rows);
        p.part    = part.get();
        p.part_ms = p.part + (int64_t) chunk*n_head*p.n_splits*p.v.head_dim;
        p.arrived = arrived.get();
    }

    cudaStream_t stream = ctx.stream();
    for (p.t0 = 0; p.t0 < n_tokens; p.t0 += chunk) {
        const int n = std::min(chunk, n_tokens - p.t0);
        if (p.n_splits > 1) {
            CUDA_CHECK(cudaMemsetAsync(p.arrived, 0, sizeof(int)*n*n_rows, stream));
        }
        const dim3 grid(p.n_splits, n_rows, n);
        if (mma) {
            kvq_attn_mma_launch(p, grid, stream);
        } else {
            switch (nvq) {
                case 1:  kvq_attn_launch_cols<1>(p, ncols, grid, stream); break;
                case 2:  kvq_attn_launch_cols<2>(p, ncols, grid, stream); break;
                default: kvq_attn_launch_cols<4>(p, ncols, grid, stream); break;
            }
        }
        CUDA_CHECK(cudaGetLastError());
    }
}

template <typename idx_t, int bits>
static void kvq_set_rows_launch(const ggml_tensor * src0, const ggml_tensor * src1, ggml_tensor * dst, float clip,
                                cudaStream_t stream) {
    GGML_TENSOR_BINARY_OP_LOCALS

    const int64_t n_blocks = ne00/QK_KIVI*ne01*ne02*ne03;
    if (n_blocks == 0) {
        return;
    }
    // fastdiv works on 32-bit indices
    GGML_ASSERT(n_blocks <= INT32_MAX);
    kvq_set_rows_kernel<idx_t, bits><<<(n_blocks + KVQ_BLOCK_SIZE - 1)/KVQ_BLOCK_SIZE, KVQ_BLOCK_SIZE, 0, stream>>>(
        (const char *) src0->data, (const char *) src1->data, (char *) dst->data, n_blocks,
        nb01, nb02, nb03, nb10, nb11, nb12, nb1, nb2, nb3,
        init_fastdiv_values(ne00/QK_KIVI), init_fastdiv_values(ne01), init_fastdiv_values(ne02),
        init_fastdiv_values(ne11), init_fastdiv_values(ne12), clip);
    CUDA_CHECK(cudaGetLastError());
}

template <int bits>
static void kvq_set_rows_bits(const ggml_tensor * src0, const ggml_tensor * src1, ggml_tensor * dst, float clip,
                              cudaStream_t stream) {
    if (src1->type == GGML_TYPE_I64) {
        kvq_set_rows_launch<int64_t, bits>(src0, src1, dst, clip, stream);
    } else {
        kvq_set_rows_launch<int32_t, bits>(src0, src1, dst, clip, stream);
    }
}

// rows src0 F32 into the rows src1 (I64 or I32) of the kivi tensor dst, ranges clipped by `clip`
static void kvq_set_rows(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                         ggml_tensor * dst, float clip) {
    GGML_ASSERT(src0->type == GGML_TYPE_F32 && src0->nb[0] == sizeof(float));
    GGML_ASSERT(src1->type == GGML_TYPE_I64 || src1->type == GGML_TYPE_I32);
    GGML_ASSERT(ggml_kvq_is_kivi(dst->type) && src0->ne[0] % QK_KIVI == 0 && src0->ne[0] == dst->ne[0]);
    kvq_assert_words(dst);

    cudaStream_t stream = ctx.stream();
    switch (ggml_kvq_bits(dst->type)) {
        case 1:  kvq_set_rows_bits<1>(src0, src1, dst, clip, stream); break;
        case 2:  kvq_set_rows_bits<2>(src0, src1, dst, clip, stream); break;
        default: kvq_set_rows_bits<4>(src0, src1, dst, clip, stream); break;
    }
}

void ggml_cuda_kvq_set_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    kvq_set_rows(ctx, dst->src[0], dst->src[1], dst, 1.0f);
}

// STORE_V: upstream's set_rows with a clip ratio; dst is a view of the V rows (src[0])
static void kvq_store_v(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    kvq_set_rows(ctx, dst->src[1], dst->src[2], dst, ggml_get_op_params_f32(dst, GGML_KVQ_CLIP_PARAM));
}

void ggml_cuda_op_kvq(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    switch ((ggml_kvq_op) ggml_get_op_params_i32(dst, 0)) {
        case GGML_KVQ_OP_SEAL_K:    kvq_seal_k(ctx, dst);         break;
        case GGML_KVQ_OP_ATTN:      kvq_attn(ctx, dst);           break;
        case GGML_KVQ_OP_RING_PUT:  kvq_ring_put(ctx, dst);       break;
        case GGML_KVQ_OP_WIDE:      kvq_cuda_wide(ctx, dst);      break;
        case GGML_KVQ_OP_WIDE_MASK: kvq_cuda_wide_mask(ctx, dst); break;
        case GGML_KVQ_OP_SCORE_LSE: kvq_cuda_score_lse(ctx, dst); break;
        case GGML_KVQ_OP_SCORE_ADD: kvq_cuda_score_add(ctx, dst); break;
        case GGML_KVQ_OP_STORE_V:   kvq_store_v(ctx, dst);        break;
        default:                    GGML_ABORT("unknown kvq op");
    }
}

static bool kvq_attn_supported(const ggml_tensor * op) {
    const ggml_tensor * q     = op->src[0];
    const ggml_tensor * k_cur = op->src[5];
    const ggml_tensor * v_cur = op->src[6];
    const ggml_tensor * mask  = op->src[7];
    return q->type == GGML_TYPE_F32 && kvq_head_dim_ok(k_cur->ne[0]) && kvq_head_dim_ok(v_cur->ne[0]) &&
           ggml_kvq_is_kivi(op->src[1]->type) && ggml_kvq_is_kivi(op->src[2]->type) &&
           (mask->type == GGML_TYPE_F16 || mask->type == GGML_TYPE_F32) &&
           q->ne[1] % k_cur->ne[1] == 0 && q->ne[2] <= KVQ_MAX_GRID_YZ;
}

static bool kvq_set_rows_supported(const ggml_tensor * dst, const ggml_tensor * src0, const ggml_tensor * src1) {
    return ggml_kvq_is_kivi(dst->type) && src0->type == GGML_TYPE_F32 &&
           (src1->type == GGML_TYPE_I64 || src1->type == GGML_TYPE_I32) &&
           src0->ne[0] % QK_KIVI == 0 && ggml_nelements(src0)/QK_KIVI <= INT32_MAX;
}

bool ggml_cuda_kvq_supports_op(const ggml_tensor * op) {
    switch (op->op) {
        case GGML_OP_SET_ROWS:
            return kvq_set_rows_supported(op, op->src[0], op->src[1]);
        case GGML_OP_KVQ:
            switch ((ggml_kvq_op) ggml_get_op_params_i32(op, 0)) {
                case GGML_KVQ_OP_SEAL_K:   return ggml_kvq_is_kivi(op->src[0]->type) && op->src[2]->ne[2] <= KVQ_MAX_GRID_YZ;
                case GGML_KVQ_OP_ATTN:     return kvq_attn_supported(op);
                case GGML_KVQ_OP_RING_PUT: return op->src[1]->ne[2] <= KVQ_MAX_GRID_YZ;
                case GGML_KVQ_OP_WIDE:
                    return ggml_kvq_is_kivi(op->src[0]->type) && op->ne[1] <= INT32_MAX && op->ne[2] <= KVQ_MAX_GRID_YZ &&
                           (op->ne[0] + KVQ_BLOCK_SIZE - 1)/KVQ_BLOCK_SIZE <= KVQ_MAX_GRID_YZ;
                case GGML_KVQ_OP_WIDE_MASK:
                    return (op->src[0]->type == GGML_TYPE_F16 || op->src[0]->type == GGML_TYPE_F32) &&
                           op->src[1]->ne[0] <= INT32_MAX;
                case GGML_KVQ_OP_SCORE_LSE:
                    return op->src[0]->ne[0] <= KVQ_MAX_HEAD && op->ne[0] <= KVQ_MAX_GRID_YZ && op->ne[1] <= INT32_MAX;
                case GGML_KVQ_OP_SCORE_ADD:
                    return op->src[1]->ne[0] <= KVQ_MAX_HEAD && op->ne[1] <= KVQ_MAX_GRID_YZ &&
                           ggml_get_op_params_i32(op, 4) <= KVQ_MAX_GRID_YZ;
                case GGML_KVQ_OP_STORE_V:  return kvq_set_rows_supported(op, op->src[1], op->src[2]);
                default:                   return false;
            }
        default:
            return false;
    }
}
