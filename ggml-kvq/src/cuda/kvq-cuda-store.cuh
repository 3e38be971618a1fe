// The kernels that write a batch into a kivi cache layer (kvq-cpu.c is the specification, byte for byte):
// SEAL_K, RING_PUT, STORE_V (and upstream's set_rows into a kivi type), and STORE, which does SEAL_K, STORE_V and both
// RING_PUTs of a one-token-per-segment batch in one launch. Launched by kvq-cuda.cu; tests/cuda_emulation runs them on the CPU.
#pragma once

#include "kvq-cuda-quantize.cuh"

//
// device parts, each for one channel c of a segment (a source narrowed by kvq_segment, whose first cell is `first`)
//

// SEAL_K of `tile`: the batch's cells rounded to fp16, the earlier ones from the ring (never a sink row: the ring
// holds every recent cell, sinks included)
template <int bits>
static __device__ __forceinline__ void kvq_seal_channel(char * k_tiles, const size_t k_tiles_nb1, const kvq_source & src,
                                                        const int64_t first, const int64_t tile, const int c,
                                                        const float clip) {
    const int head = c / src.head_dim;
    const int hc   = c % src.head_dim;
    float x[QK_KIVI];
#pragma unroll
    for (int u = 0; u < QK_KIVI; ++u) {
        const int64_t cell = tile*QK_KIVI + u;
        x[u] = cell >= first ? kvq_round_fp16(kvq_cur_row(src, cell - first, head)[hc])
                             : __half2float(((const half *) (src.fp16 + (src.n_sink + cell % src.n_ring)*src.fp16_nb1))[c]);
    }
    kvq_quantize_block<bits>(x, (uint32_t *) (k_tiles + tile*k_tiles_nb1 + (size_t) c*kvq_block_bytes(bits)), clip);
}

// RING_PUT of the segment's token t: into its ring slot while it is among the n_ring most recent cells, and into
// its sink row for good when it is a sink
static __device__ __forceinline__ void kvq_ring_put_channel(const kvq_source & src, const int64_t first, const int t,
                                                            const int c) {
    const int64_t cell = first + t;
    const half    x    = kvq_float2half_as_cpu(kvq_cur_row(src, t, c / src.head_dim)[c % src.head_dim]);
    if (cell > first + src.n_tokens - 1 - src.n_ring) {
        ((half *) (src.fp16 + (src.n_sink + cell % src.n_ring)*src.fp16_nb1))[c] = x;
    }
    if (cell < src.n_sink) {
        ((half *) (src.fp16 + cell*src.fp16_nb1))[c] = x;
    }
}

//
// SEAL_K: quantize every K tile the batch completes. grid: (channels / blockDim.x, candidate tiles, segments); a
// thread quantizes one channel of one tile, so that neighbouring threads read neighbouring fp16 values.
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
    if (tile*QK_KIVI + QK_KIVI - 1 > first + src.n_tokens - 1) {
        return;
    }
    kvq_seal_channel<bits>(k_tiles + strm*(src.kv_size/QK_KIVI)*k_tiles_nb1, k_tiles_nb1, src, first, tile, c, clip);
}

//
// RING_PUT: the batch's values into sink rows and ring slots, as fp16. grid: (channels / blockDim.x, tokens)
//

static __global__ void kvq_ring_put_kernel(kvq_source src, const int64_t * cells, const int n_embd) {
    const int c = blockIdx.x*blockDim.x + threadIdx.x;
    if (c >= n_embd) {
        return;
    }
    int64_t       strm;
    const int64_t first = kvq_segment(src, cells, blockIdx.y, &strm);
    kvq_ring_put_channel(src, first, blockIdx.y % src.n_tps, c);
}

//
// STORE: a decode step's K and V (a latent layer's K alone), one token per segment. grid: (channels / blockDim.x,
// segments); a thread does channel c of K and of V: its ring slot (and sink row), the K tile the token completes, and
// with the other lanes of its warp the V block of their 32 channels. The ring slot a token writes is none that the tile reads (n_ring
// >= QK_KIVI), so the parts need no order among them.
//

struct kvq_store_params {
    char          * k_tiles;
    size_t          k_tiles_nb1;
    char          * v_rows;
    size_t          v_rows_nb1;
    kvq_source      k;
    kvq_source      v;
    const int64_t * k_cells;
    const int64_t * v_cells;    // the V row of each segment's token
    int             n_embd_k;
    int             n_embd_v;
    int             k_bits;
    int             v_bits;
    float           clip_k;
    float           clip_v;
    ggml_kvq_v_dither v_dither;
};

static __global__ void kvq_store_kernel(const kvq_store_params p) {
    // launched with programmatic dependent launch (ggml_cuda_kernel_launch): the attention after it may start, and
    // waits for it in its own ggml_cuda_pdl_sync; nothing is read before what came before has finished
    ggml_cuda_pdl_lc();
    ggml_cuda_pdl_sync();
    const int c = blockIdx.x*blockDim.x + threadIdx.x;
    const int s = blockIdx.y;
    int64_t   strm;
    kvq_source    k     = p.k;
    const int64_t first = kvq_segment(k, p.k_cells, s, &strm);
    if (c < p.n_embd_k) {
        if (first % QK_KIVI == QK_KIVI - 1) {
            char * tiles = p.k_tiles + strm*(k.kv_size/QK_KIVI)*p.k_tiles_nb1;
            switch (p.k_bits) {
                case 1:  kvq_seal_channel<1>(tiles, p.k_tiles_nb1, k, first, first/QK_KIVI, c, p.clip_k); break;
                case 2:  kvq_seal_channel<2>(tiles, p.k_tiles_nb1, k, first, first/QK_KIVI, c, p.clip_k); break;
                default: kvq_seal_channel<4>(tiles, p.k_tiles_nb1, k, first, first/QK_KIVI, c, p.clip_k); break;
            }
        }
        kvq_ring_put_channel(k, first, 0, c);
    }
    if (c >= p.n_embd_v) {
        return; // past V's channels, or a latent layer's store (no V)
    }
    kvq_source v = p.v;
    kvq_segment(v, p.k_cells, s, &strm);
    kvq_ring_put_channel(v, first, 0, c);
    // the warp's 32 channels are one V block (n_embd_v and the thread blocks are whole warps): every lane quantizes it,
    // so that GGML_KVQ_CLIP_MSE's search runs across the lanes, and lane 0 writes it
    static_assert(QK_KIVI == WARP_SIZE && KVQ_BLOCK_SIZE % WARP_SIZE == 0, "a warp per V block");
    const int c0 = c - c % QK_KIVI;
    float x[QK_KIVI];
#pragma unroll
    for (int u = 0; u < QK_KIVI; ++u) {
        x[u] = kvq_cur_row(v, 0, (c0 + u) / v.head_dim)[(c0 + u) % v.head_dim];
    }
    kvq_quantize_block_bits<WARP_SIZE>(x, (uint32_t *) (p.v_rows + p.v_cells[s]*p.v_rows_nb1 +
                                                        (size_t) (c0/QK_KIVI)*kvq_block_bytes(p.v_bits)),
                                       p.v_bits, p.clip_v, p.v_dither.spread16,
                                       ggml_kvq_v_dither_key(p.v_dither, p.v_cells[s], c0));
}

// the launch of a STORE node (ggml_kvq_store's sources and op params); grid (kvq_store_grid_x(p), p.k.n_tokens)
static kvq_store_params kvq_store_make_params(const ggml_tensor * dst) {
    const ggml_tensor * k_tiles = dst->src[0];
    kvq_store_params p = {};
    p.k = kvq_make_source(dst, dst->src[1], dst->src[2]);
    GGML_ASSERT(p.k.n_tps == 1);
    GGML_ASSERT(ggml_kvq_is_kivi(k_tiles->type) && ggml_is_contiguous(k_tiles));
    kvq_assert_words(k_tiles);
    p.k_tiles     = (char *) k_tiles->data;
    p.k_tiles_nb1 = k_tiles->nb[1];
    p.k_cells     = kvq_cells(dst->src[3], dst->src[2]);
    p.n_embd_k    = p.k.head_dim*(int) dst->src[2]->ne[1];
    GGML_ASSERT(k_tiles->ne[0] == (int64_t) p.n_embd_k*QK_KIVI);
    p.k_bits      = ggml_kvq_bits(k_tiles->type);
    p.clip_k      = ggml_get_op_params_f32(dst, GGML_KVQ_CLIP_PARAM);
    const ggml_tensor * v_rows = dst->src[4];
    if (v_rows == nullptr) {
        return p; // a latent layer's store: K alone, n_embd_v 0
    }
    p.v = kvq_make_source(dst, dst->src[5], dst->src[6]);
    GGML_ASSERT(p.v.n_tokens == p.k.n_tokens);
    GGML_ASSERT(ggml_kvq_is_kivi(v_rows->type) && ggml_is_contiguous(v_rows));
    kvq_assert_words(v_rows);
    p.v_rows      = (char *) v_rows->data;
    p.v_rows_nb1  = v_rows->nb[1];
    p.v_cells     = kvq_cells(dst->src[7], dst->src[6]);
    p.n_embd_v    = p.v.head_dim*(int) dst->src[6]->ne[1];
    GGML_ASSERT(v_rows->ne[0] == p.n_embd_v && p.n_embd_v % QK_KIVI == 0);
    p.v_bits      = ggml_kvq_bits(v_rows->type);
    p.clip_v      = ggml_get_op_params_f32(dst, GGML_KVQ_CLIP_V_PARAM);
    p.v_dither    = ggml_kvq_store_v_dither(dst);
    return p;
}

static unsigned kvq_store_grid_x(const kvq_store_params & p) {
    return (unsigned) ((max(p.n_embd_k, p.n_embd_v) + KVQ_BLOCK_SIZE - 1)/KVQ_BLOCK_SIZE);
}

//
// STORE_V and upstream's set_rows into a kivi tensor: rows broadcast over dims 2 and 3 (as set-rows.cu), one thread
// per 32-value block, grid kvq_set_rows_grid(p)
//

struct kvq_set_rows_params {
    const char      * src0;
    const char      * src1;
    char            * dst;
    int64_t           n_blocks;
    size_t            nb01, nb02, nb03;
    size_t            nb10, nb11, nb12;
    size_t            nb1, nb2, nb3;
    uint3             blocks_per_row, ne01, ne02, ne11, ne12;   // fastdiv values
    float             clip;
    ggml_kvq_v_dither dither;
};

template <typename idx_t, int bits>
static __global__ void kvq_set_rows_kernel(const kvq_set_rows_params p) {
    const int64_t i = (int64_t) blockDim.x*blockIdx.x + threadIdx.x;
    if (i >= p.n_blocks) {
        return;
    }
    uint2 dm = fast_div_modulo((uint32_t) i, p.blocks_per_row);
    const uint32_t ib = dm.y;
    dm = fast_div_modulo(dm.x, p.ne01);
    const uint32_t i01 = dm.y;
    dm = fast_div_modulo(dm.x, p.ne02);
    const uint32_t i02 = dm.y;
    const uint32_t i03 = dm.x;
    const uint32_t i11 = fastmodulo(i02, p.ne11);
    const uint32_t i12 = fastmodulo(i03, p.ne12);

    const int64_t row = *(const idx_t *) (p.src1 + i01*p.nb10 + i11*p.nb11 + i12*p.nb12);
    const float * x   = (const float *) (p.src0 + i01*p.nb01 + i02*p.nb02 + i03*p.nb03) + ib*QK_KIVI;

    float xs[QK_KIVI];
#pragma unroll
    for (int u = 0; u < QK_KIVI; ++u) {
        xs[u] = x[u];
    }
    kvq_quantize_block<bits>(xs, (uint32_t *) (p.dst + row*p.nb1 + i02*p.nb2 + i03*p.nb3 + (size_t) ib*kvq_block_bytes(bits)),
                             p.clip, p.dither.spread16, ggml_kvq_v_dither_key(p.dither, row, (int64_t) ib*QK_KIVI));
}

// rows src0 F32 into the rows src1 (I64 or I32) of the kivi tensor dst, ranges clipped by `clip`, codes dithered as
// `dither` says
static kvq_set_rows_params kvq_set_rows_make_params(const ggml_tensor * src0, const ggml_tensor * src1, const ggml_tensor * dst,
                                                    const float clip, const ggml_kvq_v_dither & dither) {
    GGML_ASSERT(src0->type == GGML_TYPE_F32 && src0->nb[0] == sizeof(float));
    GGML_ASSERT(src1->type == GGML_TYPE_I64 || src1->type == GGML_TYPE_I32);
    GGML_ASSERT(ggml_kvq_is_kivi(dst->type) && src0->ne[0] % QK_KIVI == 0 && src0->ne[0] == dst->ne[0]);
    kvq_assert_words(dst);
    GGML_TENSOR_BINARY_OP_LOCALS

    kvq_set_rows_params p;
    p.src0 = (const char *) src0->data;
    p.src1 = (const char *) src1->data;
    p.dst  = (char *) dst->data;
    p.n_blocks = ne00/QK_KIVI*ne01*ne02*ne03;
    // fastdiv works on 32-bit indices
    GGML_ASSERT(p.n_blocks <= INT32_MAX);
    p.nb01 = nb01; p.nb02 = nb02; p.nb03 = nb03;
    p.nb10 = nb10; p.nb11 = nb11; p.nb12 = nb12;
    p.nb1  = nb1;  p.nb2  = nb2;  p.nb3  = nb3;
    if (p.n_blocks > 0) {
        p.blocks_per_row = init_fastdiv_values(ne00/QK_KIVI);
        p.ne01 = init_fastdiv_values(ne01);
        p.ne02 = init_fastdiv_values(ne02);
        p.ne11 = init_fastdiv_values(ne11);
        p.ne12 = init_fastdiv_values(ne12);
    }
    p.clip   = clip;
    p.dither = dither;
    return p;
}

static unsigned kvq_set_rows_grid(const kvq_set_rows_params & p) {
    return (unsigned) ((p.n_blocks + KVQ_BLOCK_SIZE - 1)/KVQ_BLOCK_SIZE);
}

// run(kernel) with the kernel for src1's index type and the destination's code width
template <typename F>
static void kvq_set_rows_dispatch(const ggml_tensor * src1, const int bits, F run) {
    const bool i64 = src1->type == GGML_TYPE_I64;
    switch (bits) {
        case 1:  i64 ? run(kvq_set_rows_kernel<int64_t, 1>) : run(kvq_set_rows_kernel<int32_t, 1>); break;
        case 2:  i64 ? run(kvq_set_rows_kernel<int64_t, 2>) : run(kvq_set_rows_kernel<int32_t, 2>); break;
        default: i64 ? run(kvq_set_rows_kernel<int64_t, 4>) : run(kvq_set_rows_kernel<int32_t, 4>); break;
    }
}
