// CUDA kernels of the flash-attention prefill (ggml-kvq.h; kvq-cpu-wide.c is the specification): WIDE lays a
// segment's K or V out as F16 wide cells for upstream's tensor-core flash attention, WIDE_MASK shows each
// query each cell once, the way the attention contract reads it.

#include "kvq-cuda-source.cuh"

static __device__ __forceinline__ float kvq_wide_value(const float * row, int c) {
    return kvq_round_fp16(row[c]);
}

static __device__ __forceinline__ float kvq_wide_value(const half * row, int c) {
    return __half2float(row[c]);
}

// value `u` of a kivi block: m + d*code
static __device__ __forceinline__ float kvq_wide_dequant(const char * block, int bits, int u) {
    const int nbytes = QK_KIVI*bits/8;
    const int code   = (((const uint8_t *) block)[4 + u % nbytes] >> ((u / nbytes)*bits)) & ((1 << bits) - 1);
    const half * dm  = (const half *) block;
    return __half2float(dm[1]) + __half2float(dm[0])*(float) code;
}

// grid (n_wide, channel blocks, segments); a thread writes one channel of one wide cell
static __global__ void kvq_wide_kernel(char * dst, const size_t dst_nb1, const size_t dst_nb2, const char * quantized,
        const size_t q_nb1, const int bits, const bool is_k, kvq_source src, const int64_t * cells, const int n_embd,
        const ggml_kvq_wide_layout l, const int window) {
    const int c = blockIdx.y*blockDim.x + threadIdx.x;
    if (c >= n_embd) {
        return;
    }
    const int64_t w = blockIdx.x;
    int64_t       strm;
    const int64_t first  = kvq_segment(src, cells, (int64_t) blockIdx.z*src.n_tps, &strm);
    const int64_t end    = first + src.n_tokens;     // no cell from here on holds anything yet
    const int64_t sealed = end/QK_KIVI*QK_KIVI;       // K tiles below are sealed

    int64_t j;
    bool    fp16;
    if (w < l.n_a) {
        j    = w;
        fp16 = j < src.n_sink;
    } else if (w < l.n_a + l.n_b) {
        j    = ggml_kvq_wide_b0(first, window, src.n_sink) + w - l.n_a;
        fp16 = is_k;
    } else {
        j    = ggml_kvq_wide_c0(first, window, src.n_sink) + w - l.n_a - l.n_b;
        fp16 = true;
    }
    // zeros where nothing is read (the mask hides those cells; stale values must not be inf or nan)
    float x = 0.0f;
    if (w < l.n_a + l.n_b + l.n_c && j < end && (fp16 || !is_k || j < sealed)) {
        const int    bb = kvq_block_bytes(bits);
        const int    hc = c % src.head_dim;
        if (fp16) {
            kvq_with_fp16_row(src, first, j, c / src.head_dim, [&](const auto * row) { x = kvq_wide_value(row, hc); });
        } else if (is_k) {
            const char * tile = quantized + (strm*(src.kv_size/QK_KIVI) + j/QK_KIVI)*q_nb1;
            x = kvq_wide_dequant(tile + (size_t) c*bb, bits, (int) (j % QK_KIVI));
        } else {
            const char * row = quantized + (strm*src.kv_size + j)*q_nb1;
            x = kvq_wide_dequant(row + (size_t) (c/QK_KIVI)*bb, bits, c % QK_KIVI);
        }
    }
    ((half *) (dst + blockIdx.z*dst_nb2 + w*dst_nb1))[c] = __float2half_rn(x);
}

struct kvq_wide_mask_params {
    const char    * mask;
    const int64_t * cells;
    char          * dst;
    size_t  mask_nb1;
    size_t  mask_nb3;
    size_t  dst_nb1;
    size_t  dst_nb3;
    int64_t mask_ne0;
    int64_t mask_ne1;
    int64_t kv_size;
    int     n_tps;
    int     window;
    int     n_sink;
    bool    mask_f16;
    bool    mask_all_streams;
    ggml_kvq_wide_layout l;
};

// grid: the batch's tokens; a block fills its token's row
static __global__ void kvq_wide_mask_kernel(const kvq_wide_mask_params p) {
    const int64_t r     = blockIdx.x;
    const int64_t seg   = r / p.n_tps;
    const int64_t g     = p.cells[seg*p.n_tps];
    const int64_t first = g % p.kv_size;
    const int64_t i     = first + r % p.n_tps;
    const int64_t col0  = p.mask_all_streams ? g / p.kv_size * p.kv_size : 0;
    const int64_t n_j   = min(p.mask_ne0 - col0, p.l.n_a);
    half * y = (half *) (p.dst + seg*p.dst_nb3 + (r % p.n_tps)*p.dst_nb1);
    for (int64_t w = threadIdx.x; w < p.l.n_wide; w += blockDim.x) {
        y[w] = __float2half(-INFINITY);
    }
    __syncthreads();
    const char * row = p.mask + (r / p.mask_ne1)*p.mask_nb3 + (r % p.mask_ne1)*p.mask_nb1;
    for (int64_t j = threadIdx.x; j < n_j; j += blockDim.x) {
        const float m = p.mask_f16 ? __half2float(((const half *) row)[col0 + j]) : ((const float *) row)[col0 + j];
        if (m == -INFINITY) {
            continue;
        }
        const int64_t w = ggml_kvq_wide_col(&p.l, first, i, j, p.window, p.n_sink);
        // a query sees only cells up to its own (causal attention, which kivi caches assume)
        if (j > i || w >= p.l.n_a + p.l.n_b + p.l.n_c) {
            __trap();
        }
        y[w] = __float2half_rn(m);
    }
}

// op params 7 and 8 of WIDE / WIDE_MASK: n_kv (cells of a stream block A covers), is_k
static ggml_kvq_wide_layout kvq_wide_layout_of(const ggml_tensor * dst, int64_t n_tps) {
    return ggml_kvq_wide_layout_for(ggml_get_op_params_i32(dst, 7), n_tps, ggml_get_op_params_i32(dst, 1));
}

void kvq_cuda_wide(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * quantized = dst->src[0];
    const kvq_source    src       = kvq_make_source(dst, dst->src[1], dst->src[2]);
    const int64_t     * cells     = kvq_cells(dst->src[3], dst->src[2]);
    const int           n_embd    = src.head_dim*(int) dst->src[2]->ne[1];
    const ggml_kvq_wide_layout l  = kvq_wide_layout_of(dst, src.n_tps);
    GGML_ASSERT(ggml_kvq_is_kivi(quantized->type) && ggml_is_contiguous(quantized));
    GGML_ASSERT(dst->type == GGML_TYPE_F16 && dst->ne[0] == n_embd && dst->ne[1] == l.n_wide && dst->nb[0] == sizeof(half));
    GGML_ASSERT(l.n_wide <= INT32_MAX && src.n_tokens/src.n_tps <= KVQ_MAX_GRID_YZ);

    const dim3 grid((unsigned) l.n_wide, (n_embd + KVQ_BLOCK_SIZE - 1)/KVQ_BLOCK_SIZE, src.n_tokens/src.n_tps);
    kvq_wide_kernel<<<grid, KVQ_BLOCK_SIZE, 0, ctx.stream()>>>((char *) dst->data, dst->nb[1], dst->nb[2],
        (const char *) quantized->data, quantized->nb[1], ggml_kvq_bits(quantized->type),
        ggml_get_op_params_i32(dst, 8) != 0, src, cells, n_embd, l, ggml_get_op_params_i32(dst, 1));
    CUDA_CHECK(cudaGetLastError());
}

void kvq_cuda_wide_mask(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * mask   = dst->src[0];
    const ggml_tensor * k_idxs = dst->src[1];
    const int32_t       n_seq  = ggml_get_op_params_i32(dst, 4);
    GGML_ASSERT(mask->type == GGML_TYPE_F16 || mask->type == GGML_TYPE_F32);
    GGML_ASSERT(k_idxs->type == GGML_TYPE_I64 && ggml_is_contiguous(k_idxs) && k_idxs->ne[0] % n_seq == 0);
    GGML_ASSERT(dst->type == GGML_TYPE_F16 && ggml_is_contiguous(dst) && mask->ne[1]*mask->ne[3] == k_idxs->ne[0]);

    kvq_wide_mask_params p = {};
    p.mask             = (const char *) mask->data;
    p.cells            = (const int64_t *) k_idxs->data;
    p.dst              = (char *) dst->data;
    p.mask_nb1         = mask->nb[1];
    p.mask_nb3         = mask->nb[3];
    p.dst_nb1          = dst->nb[1];
    p.dst_nb3          = dst->nb[3];
    p.mask_ne0         = mask->ne[0];
    p.mask_ne1         = mask->ne[1];
    p.kv_size          = ggml_get_op_params_i32(dst, 5);
    p.n_tps            = (int) (k_idxs->ne[0]/n_seq);
    p.window           = ggml_get_op_params_i32(dst, 1);
    p.n_sink           = ggml_get_op_params_i32(dst, 2);
    p.mask_f16         = mask->type == GGML_TYPE_F16;
    p.mask_all_streams = ggml_get_op_params_i32(dst, 6) != 0;
    p.l                = kvq_wide_layout_of(dst, p.n_tps);
    GGML_ASSERT(dst->ne[0] == p.l.n_wide);

    kvq_wide_mask_kernel<<<(unsigned) k_idxs->ne[0], KVQ_BLOCK_SIZE, 0, ctx.stream()>>>(p);
    CUDA_CHECK(cudaGetLastError());
}
