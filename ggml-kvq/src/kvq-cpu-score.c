// CPU kernels of MiniKV's attention mass (ggml-kvq.h): SCORE_LSE, each query row's log-sum-exp over the wide
// cells it sees; SCORE_ADD, each cell's probabilities from the segment's queries, added to the layer's scores.

#include "kvq-cpu-score.h"
#include "kvq-cpu-impl.h"
#include "vec.h"

#include <math.h>

#define KVQ_SCORE_HEAD_GROUP 64   // query heads of a row the LSE pass reads the mask once for

// the segment's inputs, as both kernels read them
typedef struct {
    const struct ggml_tensor * q;
    const struct ggml_tensor * k_wide;
    const struct ggml_tensor * mask;
    int64_t head_dim;
    int64_t n_gqa;     // query heads per KV head
    int64_t n_tps;     // tokens per segment
    int64_t t_first;   // the first of a segment's tokens that scores
    float   scale;
} kvq_score_inputs;

static kvq_score_inputs kvq_score_inputs_of(const struct ggml_tensor * q, const struct ggml_tensor * k_wide,
                                            const struct ggml_tensor * mask, int32_t n_observe, float scale) {
    GGML_ASSERT(q->ne[0] <= KVQ_CPU_MAX_HEAD);
    const kvq_score_inputs in = { q, k_wide, mask, q->ne[0], q->ne[1]/(k_wide->ne[0]/q->ne[0]), mask->ne[1],
                                  ggml_kvq_score_first_row(mask->ne[1], n_observe), scale };
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
    ggml_fp16_t * k = (ggml_fp16_t *) ((char *) in->k_wide->data + (t / in->n_tps)*in->k_wide->nb[2] +
                                       w*in->k_wide->nb[1]) + hk*in->head_dim;
    float s;
    ggml_vec_dot_f16((int) in->head_dim, &s, 0, k, 0, q16, 0, 1);
    return s*in->scale + m;
}

// A query row's mask is read once for many of its heads (the mask does not depend on the head): threads take whole
// tokens, and keep a running maximum and sum per head of a group
void kvq_score_lse(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const kvq_score_inputs in = kvq_score_inputs_of(dst->src[0], dst->src[1], dst->src[2], ggml_get_op_params_i32(dst, 1),
                                                    ggml_get_op_params_f32(dst, 3));
    const int64_t n_head = in.q->ne[1];
    const int64_t n_wide = in.k_wide->ne[1];
    ggml_fp16_t q16[KVQ_SCORE_HEAD_GROUP][KVQ_CPU_MAX_HEAD];
    float max[KVQ_SCORE_HEAD_GROUP];
    float sum[KVQ_SCORE_HEAD_GROUP];

    for (int64_t t = params->ith; t < in.q->ne[2]; t += params->nth) {
        if (t % in.n_tps < in.t_first) {
            float * out = (float *) dst->data + t*n_head;
            for (int64_t h = 0; h < n_head; ++h) {
                out[h] = -INFINITY;
            }
            continue;
        }
        for (int64_t h0 = 0; h0 < n_head; h0 += KVQ_SCORE_HEAD_GROUP) {
            const int64_t n_group = n_head - h0 < KVQ_SCORE_HEAD_GROUP ? n_head - h0 : KVQ_SCORE_HEAD_GROUP;
            for (int64_t g = 0; g < n_group; ++g) {
                kvq_score_query(&in, t, h0 + g, q16[g]);
                max[g] = -INFINITY;
                sum[g] = 0.0f;
            }
            for (int64_t w = 0; w < n_wide; ++w) {
                const float m = kvq_score_mask(&in, t, w);
                if (m == -INFINITY) {
                    continue;
                }
                for (int64_t g = 0; g < n_group; ++g) {
                    const float s = kvq_score_at(&in, t, (h0 + g) / in.n_gqa, w, q16[g], m);
                    if (s > max[g]) {
                        sum[g] = sum[g]*expf(max[g] - s) + 1.0f;
                        max[g] = s;
                    } else {
                        sum[g] += expf(s - max[g]);
                    }
                }
            }
            float * out = (float *) dst->data + t*n_head + h0;
            for (int64_t g = 0; g < n_group; ++g) {
                out[g] = sum[g] > 0.0f ? max[g] + logf(sum[g]) : -INFINITY;
            }
        }
    }
}

// Cells are dealt to threads in runs of QK_KIVI per (segment, KV head): each thread adds to its own cells only. Per
// query, the column through which it sees each cell of the run is found once for all of the KV head's query heads,
// and a query that sees none of the run (the causal mask's half) costs no more than that
void kvq_score_add(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * scores = dst->src[0];
    const float   * lse     = (const float *) dst->src[4]->data;
    const int64_t * cells   = (const int64_t *) dst->src[5]->data;
    const kvq_score_inputs in = kvq_score_inputs_of(dst->src[1], dst->src[2], dst->src[3], ggml_get_op_params_i32(dst, 9),
                                                    ggml_get_op_params_f32(dst, 3));
    const int32_t window    = ggml_get_op_params_i32(dst, 1);
    const int32_t n_sink    = ggml_get_op_params_i32(dst, 2);
    const int32_t n_seq     = kvq_n_seq(dst);
    const int64_t kv_size   = kvq_kv_size(dst);
    const int64_t n_kv      = ggml_get_op_params_i32(dst, 7);
    const int64_t n_head    = in.q->ne[1];
    const int64_t n_head_kv = scores->ne[1];
    const int64_t n_runs    = (n_kv + QK_KIVI - 1)/QK_KIVI;
    const struct ggml_kvq_wide_layout l = ggml_kvq_wide_layout_for(n_kv, in.n_tps, window);
    ggml_fp16_t q16[KVQ_CPU_MAX_HEAD];

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
        for (int64_t t = t0 + in.t_first; t < t0 + in.n_tps; ++t) {
            // the wide mask shows the query each cell through one of its columns at most
            int64_t seen_col[QK_KIVI];
            float   seen_mask[QK_KIVI];
            int64_t seen_cell[QK_KIVI];
            int     n_seen = 0;
            for (int64_t j = j0; j < j1; ++j) {
                for (int way = 0; way < 3; ++way) {
                    const int64_t w = ggml_kvq_wide_col_of_way(&l, first, j, way, window, n_sink);
                    const float   m = w < 0 ? -INFINITY : kvq_score_mask(&in, t, w);
                    if (m != -INFINITY) {
                        seen_col[n_seen]  = w;
                        seen_mask[n_seen] = m;
                        seen_cell[n_seen] = j - j0;
                        ++n_seen;
                        break;
                    }
                }
            }
            if (n_seen == 0) {
                continue;
            }
            for (int64_t h = hk*in.n_gqa; h < (hk + 1)*in.n_gqa; ++h) {
                kvq_score_query(&in, t, h, q16);
                const float row_lse = lse[t*n_head + h];
                for (int i = 0; i < n_seen; ++i) {
                    mass[seen_cell[i]] += expf(kvq_score_at(&in, t, hk, seen_col[i], q16, seen_mask[i]) - row_lse);
                }
            }
        }
        float * out = (float *) ((char *) scores->data + stream*scores->nb[2] + hk*scores->nb[1]);
        for (int64_t j = j0; j < j1; ++j) {
            out[j] += mass[j - j0];
        }
    }
}
