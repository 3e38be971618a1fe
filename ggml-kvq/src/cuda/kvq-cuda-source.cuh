// Internals shared by the CUDA kernels of GGML_OP_KVQ (kvq-cuda.cu; kvq-cuda-wide.cu: the wide cells of the
// flash-attention prefill): the batch's segments and the fp16 side of a cache layer.
#pragma once

#include "kvq-cuda.cuh"

#define KVQ_MAX_HEAD      512
#define KVQ_MAX_HEAD_LATENT 576   // an MLA layer's K (ggml_kvq_attn_latent): DeepSeek's 512-wide latent and 64 RoPE channels
#define KVQ_MAX_GRID_YZ   65535   // tokens and KV heads go into grid dimensions y and z
#define KVQ_FP16_MAX      65504.0f
#define KVQ_BLOCK_SIZE    256     // threads per block of the elementwise kernels
#define KVQ_NWARPS        4       // warps per attention block, each on its own tiles of the context
#define KVQ_TILES_PER_SPLIT 4     // context tiles per attention block (one per warp): fixed, see ATTN in kvq-cuda-attn-kernel.cuh
#define KVQ_MAX_PARTIALS  (64 << 20) // floats of split partials per attention launch (256 MiB)
#define KVQ_COLS_X_DIM    2048    // most (query heads per block) x (head size): registers, < 48 KiB shared memory

// ggml_kvq_block_bytes, for device code and template arguments
static constexpr __host__ __device__ int kvq_block_bytes(int bits) {
    return 2*(int) sizeof(uint16_t) + QK_KIVI*bits/8;
}

static_assert(sizeof(block_kivi1) == kvq_block_bytes(1), "wrong kivi1 block size");
static_assert(sizeof(block_kivi2) == kvq_block_bytes(2), "wrong kivi2 block size");
static_assert(sizeof(block_kivi4) == kvq_block_bytes(4), "wrong kivi4 block size");

// the fp16 side of K or V (kvq_source in kvq-cpu.c): sink rows and ring slots, and the current batch
// The batch is n_tokens/n_tps segments of n_tps tokens, one per stream (ggml-kvq.h); kvq_segment narrows a
// source to one segment: its stream's fp16 rows, its own tokens
struct kvq_source {
    char       * fp16;      // F16 [n_embd, n_sink + n_ring, n_stream]
    const char * cur;       // F32 [head_dim, n_head_kv, n_tokens]
    size_t       fp16_nb1;
    size_t       fp16_nb2;
    size_t       cur_nb1;
    size_t       cur_nb2;
    int          head_dim;
    int          n_tokens;  // of the batch, of the segment after kvq_segment
    int          n_tps;     // tokens per segment
    int          n_sink;
    int          n_ring;
    int64_t      kv_size;   // cells per stream
};

//
// device helpers
//

static __device__ __forceinline__ float kvq_round_fp16(float x) {
    return __half2float(__float2half_rn(x));
}

// x as fp16 with the bits the CPU stores (kvq-cpu.c converts with F16C): a NaN keeps its sign and the top of its
// payload, quieted, where __float2half_rn gives every NaN as 0x7FFF
static __device__ __forceinline__ half kvq_float2half_as_cpu(float x) {
    const unsigned u = __float_as_uint(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        return __ushort_as_half((unsigned short) ((u >> 16 & 0x8000u) | 0x7E00u | (u >> 13 & 0x3FFu)));
    }
    return __float2half_rn(x);
}

// Segment of batch token t: its first cell within its stream (returned), the stream, and the source narrowed
// to it. The cells live on the device, so the CPU's check that a segment sits in consecutive cells of one
// stream (anything else is a bug of the cache) becomes a trap, as loud as GGML_ASSERT.
static __device__ __forceinline__ int64_t kvq_segment(kvq_source & src, const int64_t * cells, int64_t t, int64_t * stream) {
    const int64_t seg   = t / src.n_tps;
    const int64_t t0    = seg*src.n_tps;
    const int64_t g     = cells[t0];
    const int64_t first = g % src.kv_size;
    if (cells[t] != g + (t - t0) || first + src.n_tps > src.kv_size) {
        __trap();
    }
    *stream      = g / src.kv_size;
    src.fp16    += *stream*src.fp16_nb2;
    src.cur     += t0*src.cur_nb2;
    src.n_tokens = src.n_tps;
    return first;
}

static __device__ __forceinline__ const float * kvq_cur_row(const kvq_source & src, int64_t t, int head) {
    return (const float *) (src.cur + t*src.cur_nb2 + head*src.cur_nb1);
}

// fp16 storage row of a cell before the batch: its sink row for good, else its ring slot
static __device__ __forceinline__ half * kvq_fp16_row(const kvq_source & src, int64_t cell) {
    const int64_t slot = cell < src.n_sink ? cell : src.n_sink + cell % src.n_ring;
    return (half *) (src.fp16 + slot*src.fp16_nb1);
}

// calls f with the fp16 values of `head` at `cell`: the batch's F32 row when the cell is in the batch
// (kvq_load2 rounds it to fp16), else its sink row or ring slot
template <typename F>
static __device__ __forceinline__ void kvq_with_fp16_row(const kvq_source & src, int64_t first, int64_t cell, int head, F f) {
    if (cell >= first) {
        f(kvq_cur_row(src, cell - first, head));
    } else {
        f((const half *) kvq_fp16_row(src, cell) + head*src.head_dim);
    }
}

//
// host helpers
//

// op params: { op, window, n_sink, scale, n_seq (streams in the batch), kv_size (cells per stream),
// mask_all_streams (attention: the mask's columns are the global cells) }
static kvq_source kvq_make_source(const ggml_tensor * dst, const ggml_tensor * fp16, const ggml_tensor * cur) {
    const int32_t n_sink  = ggml_get_op_params_i32(dst, 2);
    const int32_t n_seq   = ggml_get_op_params_i32(dst, 4);
    const int32_t kv_size = ggml_get_op_params_i32(dst, 5);
    GGML_ASSERT(fp16->type == GGML_TYPE_F16 && ggml_is_contiguous(fp16));
    // the kernels read fp16 rows two halves at a time, which a GPU faults on unless 4-byte aligned
    GGML_ASSERT((uintptr_t) fp16->data % (2*sizeof(ggml_fp16_t)) == 0 && cur->ne[0] % 2 == 0);
    GGML_ASSERT(cur->type == GGML_TYPE_F32 && cur->nb[0] == sizeof(float));
    GGML_ASSERT(fp16->ne[0] == cur->ne[0]*cur->ne[1]);
    GGML_ASSERT(n_sink >= 0 && fp16->ne[1] > n_sink && (fp16->ne[1] - n_sink) % QK_KIVI == 0);
    GGML_ASSERT(cur->ne[2] > 0 && cur->ne[2] <= KVQ_MAX_GRID_YZ);
    GGML_ASSERT(n_seq >= 1 && cur->ne[2] % n_seq == 0 && kv_size > 0 && kv_size % QK_KIVI == 0);
    return {
        /*.fp16     =*/ (char *) fp16->data,
        /*.cur      =*/ (const char *) cur->data,
        /*.fp16_nb1 =*/ fp16->nb[1],
        /*.fp16_nb2 =*/ fp16->nb[2],
        /*.cur_nb1  =*/ cur->nb[1],
        /*.cur_nb2  =*/ cur->nb[2],
        /*.head_dim =*/ (int) cur->ne[0],
        /*.n_tokens =*/ (int) cur->ne[2],
        /*.n_tps    =*/ (int) (cur->ne[2]/n_seq),
        /*.n_sink   =*/ n_sink,
        /*.n_ring   =*/ (int) (fp16->ne[1] - n_sink),
        /*.kv_size  =*/ kv_size,
    };
}


static const int64_t * kvq_cells(const ggml_tensor * k_idxs, const ggml_tensor * cur) {
    GGML_ASSERT(k_idxs->type == GGML_TYPE_I64 && k_idxs->ne[0] == cur->ne[2] && ggml_is_contiguous(k_idxs));
    return (const int64_t *) k_idxs->data;
}


// kivi data is read and written as 32-bit words (blocks are 8, 12 or 20 bytes)
static void kvq_assert_words(const ggml_tensor * t) {
    GGML_ASSERT((uintptr_t) t->data % sizeof(uint32_t) == 0);
    GGML_ASSERT(t->nb[1] % sizeof(uint32_t) == 0 && t->nb[2] % sizeof(uint32_t) == 0 && t->nb[3] % sizeof(uint32_t) == 0);
}


// WIDE and WIDE_MASK (kvq-cuda-wide.cu)
void kvq_cuda_wide(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
void kvq_cuda_wide_mask(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// SCORE_LSE and SCORE_ADD (kvq-cuda-score.cu)
void kvq_cuda_score_lse(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
void kvq_cuda_score_add(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
