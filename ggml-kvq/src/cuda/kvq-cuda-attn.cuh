// The attention kernels' common parts (ATTN: kvq-cuda-attn-kernel.cuh on CUDA cores, kvq-cuda-mma-kernel.cuh on tensor
// cores): their parameters, the query's view of the cache, and the split-K merge of their online-softmax states.
#pragma once

#include "kvq-cuda-source.cuh"

struct kvq_attn_params {
    const char    * q;
    const char    * k_tiles;
    const char    * v_rows;
    const char    * mask;       // [n_kv, n_tps, 1, n_seq] per stream, or [n_kv, n_tokens, 1, 1] over all cells
    const int64_t * cells;
    char          * dst;
    float         * part;     // split-K: [(z*n_tok + token of the block)*n_head + head][split][head_dim_v] unnormalised outputs
    float         * part_ms;  // split-K: [... as part][split] (max, sum)
    int           * arrived;  // split-K: [z][n_head_kv*n_groups] splits done, zero at the launch
    kvq_source      k;
    kvq_source      v;
    size_t q_nb1;
    size_t q_nb2;
    size_t k_tiles_nb1;
    size_t v_rows_nb1;
    size_t mask_nb1;
    size_t mask_nb3;
    int64_t mask_ne0;
    int64_t mask_ne1;
    int64_t mask_stream_cols; // mask column of a stream's cell 0 = stream*mask_stream_cols
    size_t dst_nb1;
    size_t dst_nb2;
    int    n_head;
    int    n_gqa;            // query heads per KV head
    int    n_groups;         // blocks per KV head and token (ncols query heads each)
    int    n_kv;             // cells of one stream the mask may cover
    int    k_bits;
    int    v_bits;
    int    window;
    int    n_splits;
    int    tiles_per_split;  // context tiles per split, at fixed cells (see ATTN in kvq-cuda-attn-kernel.cuh)
    int    n_tok;            // consecutive tokens of a segment per block (the tensor cores pack them beside their heads)
    int    bps;              // blocks per segment: n_tps/n_tok rounded up
    int    z0;               // the launch's first block along z (launches take the batch in chunks)
    float  scale;
    float  softcap;
    const float * sinks;    // [n_head] learned sink logits, or nullptr
    bool   mask_f16;
    bool   copy16;           // tensor cores: K tiles and V rows copy to shared memory in 16-byte pieces
    bool   latent;           // V is the first v.head_dim channels of K, read as K is (ggml_kvq_attn_latent)
};

// the mask has one row per batch token, in planes of mask_ne1 rows (one plane per stream, or one for all)
static __device__ __forceinline__ float kvq_mask_value(const kvq_attn_params & p, int64_t t, int64_t col) {
    const char * row = p.mask + (t / p.mask_ne1)*p.mask_nb3 + (t % p.mask_ne1)*p.mask_nb1;
    return p.mask_f16 ? __half2float(((const half *) row)[col]) : ((const float *) row)[col];
}

// the query heads a block takes: n_groups blocks of ncols heads share a KV head, the last one's padded
struct kvq_block_heads {
    int hk;  // the KV head
    int h0;  // the first query head
    int nh;  // real query heads, at most ncols
};

static __device__ __forceinline__ kvq_block_heads kvq_block_heads_at(const kvq_attn_params & p, const int ncols) {
    kvq_block_heads r;
    r.hk = blockIdx.y / p.n_groups;
    r.h0 = r.hk*p.n_gqa + blockIdx.y % p.n_groups*ncols;
    r.nh = min(ncols, (r.hk + 1)*p.n_gqa - r.h0);
    return r;
}

// the batch tokens a block takes: n consecutive ones of one segment from `first` on
struct kvq_block_tokens {
    int first;
    int n;
};

static __device__ __forceinline__ kvq_block_tokens kvq_block_tokens_at(const kvq_attn_params & p) {
    const int z   = p.z0 + blockIdx.z;
    const int sub = z % p.bps*p.n_tok;
    return { z / p.bps*p.k.n_tps + sub, min(p.n_tok, p.k.n_tps - sub) };
}

// ... of a launch planned with one token a block: the block's z
static __device__ __forceinline__ kvq_block_tokens kvq_block_token_at(const kvq_attn_params & p) {
    return { p.z0 + (int) blockIdx.z, 1 };
}

// online softmax state of a part of the context, for one output channel
struct kvq_partial {
    float max;
    float sum;
    float acc;  // unnormalised output
};

// merges the states of n disjoint parts: max at ms[k*ms_stride], sum right after it, acc at acc[k*acc_stride]
static __device__ kvq_partial kvq_fold(const float * ms, const int ms_stride, const float * acc, const int acc_stride,
                                       const int n) {
    kvq_partial r = { -INFINITY, 0.0f, 0.0f };
    for (int k = 0; k < n; ++k) {
        r.max = fmaxf(r.max, ms[k*ms_stride]);
    }
    if (r.max == -INFINITY) {
        return r; // nothing attended
    }
    for (int k = 0; k < n; ++k) {
        const float f = expf(ms[k*ms_stride] - r.max);
        r.sum += f*ms[k*ms_stride + 1];
        r.acc += f*acc[k*acc_stride];
    }
    return r;
}

static __device__ __forceinline__ float kvq_normalize(const kvq_partial & r) {
    return r.sum > 0.0f ? r.acc/r.sum : 0.0f;
}

// the output of head h: with a learned sink, one more logit in its softmax, whose value is zero
static __device__ __forceinline__ float kvq_head_output(kvq_partial r, const float * sinks, int h) {
    if (sinks != nullptr) {
        const float m = fmaxf(r.max, sinks[h]);
        const float f = expf(r.max - m);
        r = { m, r.sum*f + expf(sinks[h] - m), r.acc*f };
    }
    return kvq_normalize(r);
}

// the split partials' row of the block's token tt, head h
static __device__ __forceinline__ int64_t kvq_partial_row(const kvq_attn_params & p, const int tt, const int h) {
    return ((int64_t) blockIdx.z*p.n_tok + tt)*p.n_head + h;
}

// the output of head h for the block's token tt
static __device__ __forceinline__ float * kvq_head_dst(const kvq_attn_params & p, const kvq_block_tokens & bt, const int tt,
                                                      const int h) {
    return (float *) (p.dst + (bt.first + tt)*p.dst_nb2 + h*p.dst_nb1);
}

// Split-K: the block that finishes last among the splits of its (tokens, query heads) merges their partials into the
// output: no second launch. Every thread's partials are made visible before the block counts itself in (the
// threadFenceReduction pattern); the whole block must call it. A long context has hundreds of splits, merged by this
// one block while the rest of the GPU waits, so each thread folds four consecutive channels of a column at once, in
// split order as kvq_fold does (the same bits), with the loads of several splits in flight, where a fold per channel
// waited on its loads split after split. The loads bypass L1, which may hold lines of the partials read before they
// were written. (A warp-wide maximum made ptxas spill the head-256 GQA-2 kernel, which this one does not.)
static __device__ void kvq_merge_if_last(const kvq_attn_params & p, const kvq_block_tokens & bt, const int h0, const int nh) {
    __threadfence();
    __syncthreads();
    const bool last = __syncthreads_or(threadIdx.x == 0 &&
                                       atomicAdd(p.arrived + blockIdx.z*gridDim.y + blockIdx.y, 1) == p.n_splits - 1);
    if (!last) {
        return;
    }
    __threadfence();
    const int Dv = p.v.head_dim;
    for (int quad = threadIdx.x; quad < bt.n*nh*Dv/4; quad += blockDim.x) {
        const int      col = 4*quad / Dv;
        const int      tt  = col / nh;
        const int      g   = col % nh;
        const int      c   = 4*quad % Dv;
        const int64_t  row = kvq_partial_row(p, tt, h0 + g);
        const float2 * ms  = (const float2 *) (p.part_ms + 2*row*p.n_splits);
        const float4 * acc = (const float4 *) (p.part + row*p.n_splits*Dv + c);
        float max = -INFINITY;
#pragma unroll 16
        for (int k = 0; k < p.n_splits; ++k) {
            max = fmaxf(max, __ldcg(ms + k).x);
        }
        float  sum = 0.0f;
        float4 a   = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (max != -INFINITY) { // else nothing attended
#pragma unroll 8
            for (int k = 0; k < p.n_splits; ++k) {
                const float2 st = __ldcg(ms + k);
                const float4 x  = __ldcg(acc + (int64_t) k*(Dv/4));
                const float  f  = expf(st.x - max);
                sum += f*st.y;
                a.x += f*x.x;
                a.y += f*x.y;
                a.z += f*x.z;
                a.w += f*x.w;
            }
        }
        float * out = kvq_head_dst(p, bt, tt, h0 + g) + c;
        out[0] = kvq_head_output({ max, sum, a.x }, p.sinks, h0 + g);
        out[1] = kvq_head_output({ max, sum, a.y }, p.sinks, h0 + g);
        out[2] = kvq_head_output({ max, sum, a.z }, p.sinks, h0 + g);
        out[3] = kvq_head_output({ max, sum, a.w }, p.sinks, h0 + g);
    }
}

// where a query reads: its segment's tiles, V rows and fp16 rows, and the cells it reads quantized
struct kvq_query {
    kvq_source    k;
    kvq_source    v;
    const char  * k_tiles;  // its stream's
    const char  * v_rows;
    int64_t       first;    // its segment's first cell
    int64_t       col0;     // mask column of its stream's cell 0
    int64_t       end;      // cells from here on have no value (the batch ends there)
    int64_t       lim_v;    // V below lim_v and K below lim_k are quantized, unless sinks
    int64_t       lim_k;
};

static __device__ __forceinline__ kvq_query kvq_query_at(const kvq_attn_params & p, const int t) {
    kvq_query     r;
    int64_t       strm;
    r.k     = p.k;
    r.v     = p.v;
    r.first = kvq_segment(r.k, p.cells, t, &strm);
    kvq_segment(r.v, p.cells, t, &strm);
    const int64_t i = r.first + t % p.k.n_tps;
    r.k_tiles = p.k_tiles + strm*(p.k.kv_size/QK_KIVI)*p.k_tiles_nb1;
    r.v_rows  = p.v_rows + strm*p.k.kv_size*p.v_rows_nb1;
    r.col0    = strm*p.mask_stream_cols;
    r.end     = min(min((int64_t) p.n_kv, p.mask_ne0 - r.col0), r.first + r.k.n_tokens);
    r.lim_k   = ggml_kvq_lim_k(i, p.window);
    r.lim_v   = p.latent ? r.lim_k : ggml_kvq_lim_v(i, p.window);
    return r;
}

// The block's result for its nh query heads from h0 on, its tokens bt, split `split`: column col = tt*nh + g is
// token tt's head g, the warps' states (max and sum at w_s[warp*w_stride + 2*col], the unnormalised output at
// slice_s[warp*slice + col*Dv]) folded per channel into the output, or into the split's partial and merged by the
// last split. The whole block calls it, after a barrier that makes the states visible.
static __device__ void kvq_attn_write_block(const kvq_attn_params & p, const float * w_s, const int w_stride,
                                            const float * slice_s, const int slice, const int nh, const int h0,
                                            const kvq_block_tokens & bt, const int split) {
    const int Dv = p.v.head_dim;
    for (int idx = threadIdx.x; idx < bt.n*nh*Dv; idx += blockDim.x) {
        const int col = idx / Dv;
        const int tt  = col / nh;
        const int g   = col % nh;
        const int c   = idx % Dv;
        const kvq_partial r = kvq_fold(w_s + 2*col, w_stride, slice_s + col*Dv + c, slice, KVQ_NWARPS);
        if (p.n_splits == 1) {
            kvq_head_dst(p, bt, tt, h0 + g)[c] = kvq_head_output(r, p.sinks, h0 + g);
        } else {
            const int64_t ps = kvq_partial_row(p, tt, h0 + g)*p.n_splits + split;
            p.part[ps*Dv + c] = r.acc;
            if (c == 0) {
                p.part_ms[2*ps + 0] = r.max;
                p.part_ms[2*ps + 1] = r.sum;
            }
        }
    }
    if (p.n_splits > 1) {
        kvq_merge_if_last(p, bt, h0, nh);
    }
}

//
// host side
//

static bool kvq_head_dim_ok(int64_t n, int64_t max = KVQ_MAX_HEAD) {
    return n > 0 && n % QK_KIVI == 0 && n <= max;
}

// the attention's parameters from its op (ggml_kvq_attn), all but its plan of blocks and splits
static kvq_attn_params kvq_attn_make_params(const ggml_tensor * dst) {
    const ggml_tensor * q       = dst->src[0];
    const ggml_tensor * k_tiles = dst->src[1];
    const ggml_tensor * k_cur   = dst->src[5];
    const ggml_tensor * mask    = dst->src[7];
    // a latent layer's V is K's: its tiles, fp16 rows and batch
    const bool          latent  = ggml_kvq_attn_is_latent(dst);
    const ggml_tensor * v_rows  = latent ? k_tiles : dst->src[2];

    kvq_attn_params p = {};
    p.latent = latent;
    p.k = kvq_make_source(dst, dst->src[3], k_cur);
    p.v = latent ? p.k : kvq_make_source(dst, dst->src[4], dst->src[6]);
    p.v.head_dim = (int) dst->ne[0];
    p.cells = kvq_cells(dst->src[8], k_cur);

    const int n_head    = (int) q->ne[1];
    const int n_head_kv = (int) k_cur->ne[1];
    const int n_tokens  = p.k.n_tokens;
    GGML_ASSERT(q->type == GGML_TYPE_F32 && q->nb[0] == sizeof(float) && q->ne[2] == n_tokens);
    GGML_ASSERT(n_head % n_head_kv == 0 && p.v.n_tokens == n_tokens);
    GGML_ASSERT(latent ? n_head_kv == 1 && p.v.head_dim <= p.k.head_dim : dst->src[6]->ne[1] == n_head_kv);
    GGML_ASSERT(kvq_head_dim_ok(p.k.head_dim, latent ? KVQ_MAX_HEAD_LATENT : KVQ_MAX_HEAD) &&
                kvq_head_dim_ok(p.v.head_dim) && q->ne[0] == p.k.head_dim);
    GGML_ASSERT(ggml_kvq_is_kivi(k_tiles->type) && ggml_kvq_is_kivi(v_rows->type));
    GGML_ASSERT(k_tiles->ne[0] == (int64_t) p.k.head_dim*n_head_kv*QK_KIVI &&
                (latent || v_rows->ne[0] == (int64_t) p.v.head_dim*n_head_kv));
    GGML_ASSERT(mask->type == GGML_TYPE_F16 || mask->type == GGML_TYPE_F32);
    const bool mask_all_streams = ggml_get_op_params_i32(dst, 6) != 0;
    GGML_ASSERT(mask->ne[0] > 0 && mask->ne[1]*mask->ne[3] == n_tokens && k_tiles->ne[1]*QK_KIVI == p.k.kv_size);
    // a unified cache's mask may be wider than its regions (see ggml_kvq_attn)
    GGML_ASSERT(mask_all_streams || mask->ne[0] <= p.k.kv_size);
    GGML_ASSERT(ggml_is_contiguous(v_rows) && ggml_is_contiguous(k_tiles));
    GGML_ASSERT(p.k.n_ring == p.v.n_ring && p.k.n_ring >= ggml_kvq_ring_size(ggml_get_op_params_i32(dst, 1)));
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && dst->nb[0] == sizeof(float));
    kvq_assert_words(k_tiles);
    kvq_assert_words(v_rows);

    p.q           = (const char *) q->data;
    p.k_tiles     = (const char *) k_tiles->data;
    p.v_rows      = latent ? nullptr : (const char *) v_rows->data;
    p.mask        = (const char *) mask->data;
    p.dst         = (char *) dst->data;
    p.q_nb1       = q->nb[1];
    p.q_nb2       = q->nb[2];
    p.k_tiles_nb1 = k_tiles->nb[1];
    p.v_rows_nb1  = latent ? 0 : v_rows->nb[1];
    p.mask_nb1    = mask->nb[1];
    p.mask_nb3    = mask->nb[3];
    p.mask_ne0    = mask->ne[0];
    p.mask_ne1    = mask->ne[1];
    p.mask_stream_cols = mask_all_streams ? p.k.kv_size : 0;
    p.dst_nb1     = dst->nb[1];
    p.dst_nb2     = dst->nb[2];
    p.n_head      = n_head;
    p.n_gqa       = n_head/n_head_kv;
    p.n_kv        = (int) std::min<int64_t>(mask->ne[0], p.k.kv_size);
    p.k_bits      = ggml_kvq_bits(k_tiles->type);
    p.v_bits      = ggml_kvq_bits(v_rows->type);
    p.window      = ggml_get_op_params_i32(dst, 1);
    p.scale       = ggml_get_op_params_f32(dst, 3);
    p.softcap     = ggml_get_op_params_f32(dst, GGML_KVQ_SOFTCAP_PARAM);
    p.sinks       = dst->src[9] != nullptr ? (const float *) dst->src[9]->data : nullptr;
    p.mask_f16    = mask->type == GGML_TYPE_F16;
    const size_t v_head_bytes = (size_t) (p.v.head_dim/QK_KIVI)*ggml_kvq_block_bytes(p.v_bits);
    p.copy16 = ((uintptr_t) p.k_tiles | (uintptr_t) p.v_rows | p.k_tiles_nb1 | p.v_rows_nb1 | v_head_bytes) % 16 == 0;
    return p;
}

// ncols query heads per block, n_tok tokens of a segment per block, splits of tiles_per_split tiles at fixed cells
// (see ATTN in kvq-cuda-attn-kernel.cuh)
static void kvq_attn_plan(kvq_attn_params & p, const int ncols, const int tiles_per_split, const int n_tok) {
    p.n_groups = (p.n_gqa + ncols - 1)/ncols;
    GGML_ASSERT((int64_t) p.n_head/p.n_gqa*p.n_groups <= KVQ_MAX_GRID_YZ);
    GGML_ASSERT(n_tok >= 1 && (n_tok == 1 || (p.n_groups == 1 && n_tok*p.n_gqa <= ncols)));
    p.tiles_per_split = tiles_per_split;
    p.n_splits = ((p.n_kv + QK_KIVI - 1)/QK_KIVI + tiles_per_split - 1)/tiles_per_split;
    p.n_tok    = std::min(n_tok, p.k.n_tps);
    p.bps      = (p.k.n_tps + p.n_tok - 1)/p.n_tok;
    p.z0       = 0;
}

// the blocks along z that take the whole batch
static int kvq_attn_n_blocks(const kvq_attn_params & p) {
    return p.k.n_tokens/p.k.n_tps*p.bps;
}

// the blocks along y: n_groups blocks of query heads per KV head
static int kvq_attn_n_rows(const kvq_attn_params & p) {
    return p.n_head/p.n_gqa*p.n_groups;
}

// the split partials of one block along z, in floats
static int64_t kvq_attn_block_partials(const kvq_attn_params & p) {
    return (int64_t) p.n_tok*p.n_head*p.n_splits*(p.v.head_dim + 2);
}

// points p at the split partials of a launch of `chunk` blocks: `part` holds kvq_attn_block_partials floats a block
// (the unnormalised outputs of them all, then their (max, sum) pairs), `arrived` a counter per block and row of heads
static void kvq_attn_use_partials(kvq_attn_params & p, float * part, int * arrived, const int chunk) {
    // the merge reads four channels of a partial and a (max, sum) pair at once
    GGML_ASSERT((uintptr_t) part % 16 == 0 && p.v.head_dim % 4 == 0);
    p.part    = part;
    p.part_ms = part + (int64_t) chunk*p.n_tok*p.n_head*p.n_splits*p.v.head_dim;
    p.arrived = arrived;
}

// blocks along z per launch: the partials of a long context over a large batch would not fit in max_partials
// floats, so launches take the batch in chunks of blocks (kvq_attn_params::z0), each zeroing its arrived counters
static int kvq_attn_launch_blocks(const kvq_attn_params & p, const int64_t max_partials) {
    const int n_blocks = kvq_attn_n_blocks(p);
    return p.n_splits == 1 ? n_blocks : (int) std::clamp<int64_t>(max_partials/kvq_attn_block_partials(p), 1, n_blocks);
}
