// CPU kernels of MiniKV's attention mass (ggml-kvq.h): SCORE_LSE, each query row's log-sum-exp over the wide
// cells it sees; SCORE_ADD, each cell's probabilities from the segment's queries, added to the layer's scores.

#include "kvq-cpu-score.h"
#include "kvq-cpu-impl.h"
#include "vec.h"

#include <math.h>

#define KVQ_SCORE_MAX_HEAD 512

// the segment's inputs, as both kernels read them
typedef struct {
    const struct ggml_tensor * q;
    const struct ggml_tensor * k_wide;
    const struct ggml_tensor * mask;
    int64_t head_dim;
    int64_t n_gqa;     // query heads per KV head
    int64_t n_tps;     // tokens per segment
    float   scale;
} kvq_score_inputs;

static kvq_score_inputs kvq_score_inputs_of(const struct ggml_tensor * q, const struct ggml_tensor * k_wide,
                                            const struct ggml_tensor * mask, float scale) {
    GGML_ASSERT(q->ne[0] <= KVQ_SCORE_MAX_HEAD);
    const kvq_score_inputs in = { q, k_wide, mask, q->ne[0], q->ne[1]/(k_wide->ne[0]/q->ne[0]), mask->ne[1], scale };
    return in;
}

// query (t, h) of the batch in fp16, as upstream's flash attention converts Q for f16 K
static void kvq_score_query(const kvq_score_inputs * in, int64_t t, int64_t h, ggml_fp16_t * q16) {
    const float * row = (const float *) ((const char *) in->q->data + t*in->q->nb[2] + h*in->q->nb[1]);
    for (int64_t c = 0; c < in->head_dim; ++c) {
        q16[c] = GGML_CPU_FP32_TO_FP16(row[c]);
    }
}

static float kvq_score_mask(const kvq_score_inputs * in, int64_t t, int64_t w) {
    const ggml_fp16_t * row = (const ggml_fp16_t *) ((const char *) in->mask->data + (t / in->n_tps)*in->mask->nb[3] +
                                                     (t % in->n_tps)*in->mask->nb[1]);
    return GGML_CPU_FP16_TO_FP32(row[w]);
}

// scaled score of query q16 (KV head hk) against wide cell w of token t's segment, mask included
static float kvq_score_at(const kvq_score_inputs * in, int64_t t, int64_t hk, int64_t w, ggml_fp16_t * q16, float m) {
    ggml_fp16_t * k = (ggml_fp16_t *) ((const char *) in->k_wide->data + (t / in->n_tps)*in->k_wide->nb[2] +
                                       w*in->k_wide->nb[1]) + hk*in->head_dim;
    float s;
    ggml_vec_dot_f16((int) in->head_dim, &s, 0, k, 0, q16, 0, 1);
    return s*in->scale + m;
}

void kvq_score_lse(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const kvq_score_inputs in = kvq_score_inputs_of(dst->src[0], dst->src[1], dst->src[2], ggml_get_op_params_f32(dst, 3));
    const int64_t n_head = in.q->ne[1];
    const int64_t n_wide = in.k_wide->ne[1];
    ggml_fp16_t q16[KVQ_SCORE_MAX_HEAD];

    for (int64_t r = params->ith; r < ggml_nelements(dst); r += params->nth) {
        const int64_t t = r / n_head;
        const int64_t h = r % n_head;
        kvq_score_query(&in, t, h, q16);
        float max = -INFINITY;
        float sum = 0.0f;
        for (int64_t w = 0; w < n_wide; ++w) {
            const float m = kvq_score_mask(&in, t, w);
            if (m == -INFINITY) {
                continue;
            }
            const float s = kvq_score_at(&in, t, h / in.n_gqa, w, q16, m);
            if (s > max) {
                sum = sum*expf(max - s) + 1.0f;
                max = s;
            } else {
                sum += expf(s - max);
            }
        }
        ((float *) dst->data)[r] = sum > 0.0f ? max + logf(sum) : -INFINITY;
    }
}

// Cells are dealt to threads in runs of QK_KIVI per (segment, KV head): each thread adds to its own cells only,
// and turns a query into fp16 once per run
void kvq_score_add(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * scores = dst->src[0];
    const float   * lse     = (const float *) dst->src[4]->data;
    const int64_t * cells   = (const int64_t *) dst->src[5]->data;
    const kvq_score_inputs in = kvq_score_inputs_of(dst->src[1], dst->src[2], dst->src[3], ggml_get_op_params_f32(dst, 3));
    const int32_t window    = ggml_get_op_params_i32(dst, 1);
    const int32_t n_sink    = ggml_get_op_params_i32(dst, 2);
    const int32_t n_seq     = kvq_n_seq(dst);
    const int64_t kv_size   = kvq_kv_size(dst);
    const int64_t n_kv      = ggml_get_op_params_i32(dst, 7);
    const int64_t n_head    = in.q->ne[1];
    const int64_t n_head_kv = scores->ne[1];
    const int64_t n_runs    = (n_kv + QK_KIVI - 1)/QK_KIVI;
    const struct ggml_kvq_wide_layout l = ggml_kvq_wide_layout_for(n_kv, in.n_tps, window);
    ggml_fp16_t q16[KVQ_SCORE_MAX_HEAD];

    for (int64_t item = params->ith; item < n_seq*n_head_kv*n_runs; item += params->nth) {
        const int64_t seg    = item / (n_head_kv*n_runs);
        const int64_t hk     = item / n_runs % n_head_kv;
        const int64_t j0     = item % n_runs*QK_KIVI;
        const int64_t j1     = j0 + QK_KIVI < n_kv ? j0 + QK_KIVI : n_kv;
        const int64_t t0     = seg*in.n_tps;
        const int64_t stream = cells[t0] / kv_size;
        const int64_t first  = cells[t0] % kv_size;
        GGML_ASSERT(stream < scores->ne[2]);
        float mass[QK_KIVI] = { 0 };
        for (int64_t t = t0; t < t0 + in.n_tps; ++t) {
            for (int64_t h = hk*in.n_gqa; h < (hk + 1)*in.n_gqa; ++h) {
                kvq_score_query(&in, t, h, q16);
                const float row_lse = lse[t*n_head + h];
                for (int64_t j = j0; j < j1; ++j) {
                    // the wide mask shows the query this cell through one of its columns at most
                    for (int way = 0; way < 3; ++way) {
                        const int64_t w = ggml_kvq_wide_col_of_way(&l, first, j, way, window, n_sink);
                        const float   m = w < 0 ? -INFINITY : kvq_score_mask(&in, t, w);
                        if (m != -INFINITY) {
                            mass[j - j0] += expf(kvq_score_at(&in, t, hk, w, q16, m) - row_lse);
                        }
                    }
                }
            }
        }
        float * out = (float *) ((char *) scores->data + stream*scores->nb[2] + hk*scores->nb[1]);
        for (int64_t j = j0; j < j1; ++j) {
            out[j] += mass[j - j0];
        }
    }
}
