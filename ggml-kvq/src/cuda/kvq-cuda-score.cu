// CUDA kernels of MiniKV's attention mass (ggml-kvq.h; kvq-cpu-score.c is the specification): SCORE_LSE, each
// query row's log-sum-exp over the wide cells it sees; SCORE_ADD, each cell's probabilities from the segment's
// queries, added to the layer's scores.

#include "kvq-cuda-source.cuh"

struct kvq_score_params {
    const char * q;
    const char * k_wide;
    const char * mask;
    size_t  q_nb1;
    size_t  q_nb2;
    size_t  k_nb1;
    size_t  k_nb2;
    size_t  mask_nb1;
    size_t  mask_nb3;
    int64_t n_wide;
    int     head_dim;
    int     n_head;
    int     n_gqa;      // query heads per KV head
    int     n_tps;      // tokens per segment
    int     t_first;    // the first of a segment's tokens that scores
    float   scale;
};

static kvq_score_params kvq_score_params_of(const ggml_tensor * q, const ggml_tensor * k_wide, const ggml_tensor * mask,
                                            int32_t n_observe, float scale) {
    GGML_ASSERT(q->type == GGML_TYPE_F32 && q->nb[0] == sizeof(float) && q->ne[0] <= KVQ_MAX_HEAD);
    GGML_ASSERT(k_wide->type == GGML_TYPE_F16 && ggml_is_contiguous(k_wide));
    GGML_ASSERT(mask->type == GGML_TYPE_F16 && ggml_is_contiguous(mask));
    kvq_score_params p = {};
    p.q        = (const char *) q->data;
    p.k_wide   = (const char *) k_wide->data;
    p.mask     = (const char *) mask->data;
    p.q_nb1    = q->nb[1];
    p.q_nb2    = q->nb[2];
    p.k_nb1    = k_wide->nb[1];
    p.k_nb2    = k_wide->nb[2];
    p.mask_nb1 = mask->nb[1];
    p.mask_nb3 = mask->nb[3];
    p.n_wide   = k_wide->ne[1];
    p.head_dim = (int) q->ne[0];
    p.n_head   = (int) q->ne[1];
    p.n_gqa    = (int) (q->ne[1]/(k_wide->ne[0]/q->ne[0]));
    p.n_tps    = (int) mask->ne[1];
    p.t_first  = (int) ggml_kvq_score_first_row(mask->ne[1], n_observe);
    p.scale    = scale;
    return p;
}

// query (t, h) in fp16 values, as the attention takes it, into shared memory
static __device__ void kvq_score_load_query(const kvq_score_params & p, int64_t t, int h, float * q_s) {
    const float * row = (const float *) (p.q + t*p.q_nb2 + h*p.q_nb1);
    for (int c = threadIdx.x; c < p.head_dim; c += blockDim.x) {
        q_s[c] = kvq_round_fp16(row[c]);
    }
}

static __device__ __forceinline__ float kvq_score_mask(const kvq_score_params & p, int64_t t, int64_t w) {
    const char * row = p.mask + (t / p.n_tps)*p.mask_nb3 + (t % p.n_tps)*p.mask_nb1;
    return __half2float(((const half *) row)[w]);
}

// scaled score of the query in q_s (KV head hk) against wide cell w of token t's segment, mask m added
static __device__ float kvq_score_at(const kvq_score_params & p, int64_t t, int hk, int64_t w, const float * q_s, float m) {
    const half * k = (const half *) (p.k_wide + (t / p.n_tps)*p.k_nb2 + w*p.k_nb1) + (int64_t) hk*p.head_dim;
    float s = 0.0f;
    for (int c = 0; c < p.head_dim; ++c) {
        s += q_s[c]*__half2float(k[c]);
    }
    return s*p.scale + m;
}

// grid (tokens, query heads), one warp: each lane folds every 32nd wide cell, then the warp folds the lanes
static __global__ void kvq_score_lse_kernel(const kvq_score_params p, float * lse) {
    __shared__ float q_s[KVQ_MAX_HEAD];
    const int64_t t = blockIdx.x;
    const int     h = blockIdx.y;
    if (t % p.n_tps < p.t_first) {
        if (threadIdx.x == 0) {
            lse[t*p.n_head + h] = -INFINITY;
        }
        return;
    }
    kvq_score_load_query(p, t, h, q_s);
    __syncwarp();

    float max = -INFINITY;
    float sum = 0.0f;
    for (int64_t w = threadIdx.x; w < p.n_wide; w += WARP_SIZE) {
        const float m = kvq_score_mask(p, t, w);
        if (m == -INFINITY) {
            continue;
        }
        const float s = kvq_score_at(p, t, h / p.n_gqa, w, q_s, m);
        if (s > max) {
            sum = sum*expf(max - s) + 1.0f;
            max = s;
        } else {
            sum += expf(s - max);
        }
    }
    for (int offset = WARP_SIZE/2; offset > 0; offset >>= 1) {
        const float other_max = __shfl_xor_sync(0xffffffff, max, offset);
        const float other_sum = __shfl_xor_sync(0xffffffff, sum, offset);
        const float new_max   = fmaxf(max, other_max);
        if (new_max != -INFINITY) {
            sum = sum*expf(max - new_max) + other_sum*expf(other_max - new_max);
            max = new_max;
        }
    }
    if (threadIdx.x == 0) {
        lse[t*p.n_head + h] = sum > 0.0f ? max + logf(sum) : -INFINITY;
    }
}

struct kvq_score_add_params {
    kvq_score_params       in;
    const float          * lse;
    const int64_t        * cells;
    char                 * scores;
    size_t                 scores_nb1;
    size_t                 scores_nb2;
    int64_t                kv_size;
    int64_t                n_kv;
    int                    window;
    int                    n_sink;
    ggml_kvq_wide_layout   l;
};

// grid (runs of cells, KV heads, segments); a thread owns one cell of one KV head and adds what every query of
// its segment gives it. The block shares each query: all its threads read the same one.
static __global__ void kvq_score_add_kernel(const kvq_score_add_params p) {
    __shared__ float q_s[KVQ_MAX_HEAD];
    const int     hk    = blockIdx.y;
    const int64_t t0    = (int64_t) blockIdx.z*p.in.n_tps;
    const int64_t j     = (int64_t) blockIdx.x*blockDim.x + threadIdx.x;
    const int64_t first = p.cells[t0] % p.kv_size;

    float mass = 0.0f;
    for (int64_t t = t0 + p.in.t_first; t < t0 + p.in.n_tps; ++t) {
        for (int h = hk*p.in.n_gqa; h < (hk + 1)*p.in.n_gqa; ++h) {
            __syncthreads();
            kvq_score_load_query(p.in, t, h, q_s);
            __syncthreads();
            if (j >= p.n_kv) {
                continue;
            }
            const float row_lse = p.lse[t*p.in.n_head + h];
            // the wide mask shows the query this cell through one of its columns at most
            for (int way = 0; way < 3; ++way) {
                const int64_t w = ggml_kvq_wide_col_of_way(&p.l, first, j, way, p.window, p.n_sink);
                const float   m = w < 0 ? -INFINITY : kvq_score_mask(p.in, t, w);
                if (m != -INFINITY) {
                    mass += expf(kvq_score_at(p.in, t, hk, w, q_s, m) - row_lse);
                }
            }
        }
    }
    if (j < p.n_kv) {
        const int64_t stream = p.cells[t0] / p.kv_size;
        ((float *) (p.scores + stream*p.scores_nb2 + hk*p.scores_nb1))[j] += mass;
    }
}

void kvq_cuda_score_lse(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const kvq_score_params p = kvq_score_params_of(dst->src[0], dst->src[1], dst->src[2], ggml_get_op_params_i32(dst, 1),
                                                   ggml_get_op_params_f32(dst, 3));
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst) && dst->ne[0] == p.n_head);
    const dim3 grid((unsigned) dst->ne[1], (unsigned) dst->ne[0]);
    kvq_score_lse_kernel<<<grid, WARP_SIZE, 0, ctx.stream()>>>(p, (float *) dst->data);
    CUDA_CHECK(cudaGetLastError());
}

void kvq_cuda_score_add(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * scores = dst->src[0];
    const int32_t       n_seq  = ggml_get_op_params_i32(dst, 4);
    GGML_ASSERT(scores->type == GGML_TYPE_F32 && ggml_is_contiguous(scores));
    GGML_ASSERT(dst->src[5]->type == GGML_TYPE_I64 && ggml_is_contiguous(dst->src[5]));

    kvq_score_add_params p = {};
    p.in         = kvq_score_params_of(dst->src[1], dst->src[2], dst->src[3], ggml_get_op_params_i32(dst, 9),
                                       ggml_get_op_params_f32(dst, 3));
    p.lse        = (const float *) dst->src[4]->data;
    p.cells      = (const int64_t *) dst->src[5]->data;
    p.scores     = (char *) scores->data;
    p.scores_nb1 = scores->nb[1];
    p.scores_nb2 = scores->nb[2];
    p.kv_size    = ggml_get_op_params_i32(dst, 5);
    p.n_kv       = ggml_get_op_params_i32(dst, 7);
    p.window     = ggml_get_op_params_i32(dst, 1);
    p.n_sink     = ggml_get_op_params_i32(dst, 2);
    p.l          = ggml_kvq_wide_layout_for(p.n_kv, p.in.n_tps, p.window);
    GGML_ASSERT(p.l.n_wide == p.in.n_wide);

    const dim3 grid((unsigned) ((p.n_kv + KVQ_BLOCK_SIZE - 1)/KVQ_BLOCK_SIZE), (unsigned) scores->ne[1], (unsigned) n_seq);
    kvq_score_add_kernel<<<grid, KVQ_BLOCK_SIZE, 0, ctx.stream()>>>(p);
    CUDA_CHECK(cudaGetLastError());
}
