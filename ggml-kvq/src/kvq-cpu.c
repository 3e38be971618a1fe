// CPU kernels of GGML_OP_KVQ (see ggml-kvq.h for the storage layout and the attention contract).

#include "kvq-cpu.h"
#include "kvq-cpu-impl.h"
#include "kvq-cpu-wide.h"
#include "kvq-cpu-score.h"
#include "vec.h"

#include <math.h>
#include <string.h>

#define KVQ_MAX_HEAD 512

//
// SEAL_K
//

// fp16 value of one channel of a cell that is in the batch or in the ring (never a sink row: sealing
// only reads the ring, which holds every recent cell, sinks included)
static float kvq_read_channel(const kvq_source * src, int64_t cell, int64_t channel) {
    if (cell >= src->first) {
        return kvq_round_fp16(kvq_cur_row(src, cell, channel / src->head_dim)[channel % src->head_dim]);
    }
    return GGML_CPU_FP16_TO_FP32(*kvq_fp16_slot(src, src->n_sink + cell % src->n_ring, channel));
}

// every tile of k_tiles that the batch completes
static void kvq_seal_tiles(const struct ggml_compute_params * params, const struct ggml_tensor * dst,
                           const struct ggml_tensor * k_tiles, const struct ggml_tensor * k_fp16,
                           const struct ggml_tensor * k_cur, const struct ggml_tensor * k_idxs) {
    const int     bits   = ggml_kvq_bits(k_tiles->type);
    const float   clip   = ggml_get_op_params_f32(dst, GGML_KVQ_CLIP_PARAM);
    const size_t  bb     = ggml_kvq_block_bytes(bits);
    const int64_t n_embd = k_cur->ne[0]*k_cur->ne[1];

    for (int64_t seg = 0; seg < kvq_n_seq(dst); ++seg) {
        const kvq_source src = kvq_make_source(k_fp16, k_cur, k_idxs, ggml_get_op_params_i32(dst, 2),
                                               kvq_n_seq(dst), kvq_kv_size(dst), seg);
        const int64_t last = src.first + src.n_tokens - 1;
        // every tile ending inside the segment; the first candidate always ends at or after `first`
        for (int64_t tile = src.first/QK_KIVI; tile*QK_KIVI + QK_KIVI - 1 <= last; ++tile) {
            uint8_t * row = (uint8_t *) k_tiles->data + (src.stream*(kvq_kv_size(dst)/QK_KIVI) + tile)*k_tiles->nb[1];
            for (int64_t c = params->ith; c < n_embd; c += params->nth) {
                float x[QK_KIVI];
                for (int u = 0; u < QK_KIVI; ++u) {
                    x[u] = kvq_read_channel(&src, tile*QK_KIVI + u, c);
                }
                ggml_kvq_quantize_block(x, row + c*bb, bits, clip);
            }
        }
    }
}

static void kvq_seal_k(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    kvq_seal_tiles(params, dst, dst->src[0], dst->src[1], dst->src[2], dst->src[3]);
}

//
// STORE_V
//

// rows r of x (F32, n_rows rows nb1 apart) into rows idxs[r] of v_rows, each group's range clipped by `clip`, its
// codes rounded as dst's V dither says (ggml_kvq_store_set_v_dither)
static void kvq_store_rows(const struct ggml_compute_params * params, const struct ggml_tensor * dst,
                           const struct ggml_tensor * v_rows, const char * x, size_t nb1, int64_t n_rows,
                           const struct ggml_tensor * idxs, float clip) {
    const int     bits     = ggml_kvq_bits(v_rows->type);
    const size_t  bb       = ggml_kvq_block_bytes(bits);
    const int64_t n_blocks = v_rows->ne[0]/QK_KIVI;
    const struct ggml_kvq_v_dither dither = ggml_kvq_store_v_dither(dst);

    for (int64_t r = params->ith; r < n_rows; r += params->nth) {
        const int64_t row = ((const int64_t *) idxs->data)[r];
        GGML_ASSERT(row >= 0 && row < ggml_nrows(v_rows));
        const float * xr = (const float *) (x + r*nb1);
        uint8_t     * y  = (uint8_t *) v_rows->data + row*v_rows->nb[1];
        for (int64_t ib = 0; ib < n_blocks; ++ib) {
            ggml_kvq_quantize_block_dithered(xr + ib*QK_KIVI, y + ib*bb, bits, clip, dither.spread16,
                                             ggml_kvq_v_dither_key(dither, row, ib*QK_KIVI));
        }
    }
}

static void kvq_store_v(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * v = dst->src[1];
    kvq_store_rows(params, dst, dst->src[0], v->data, v->nb[1], v->ne[1], dst->src[2],
                   ggml_get_op_params_f32(dst, GGML_KVQ_CLIP_PARAM));
}

//
// RING_PUT
//

static void kvq_store_fp16(const kvq_source * src, int64_t slot, int64_t offset, const float * x, int64_t n) {
    ggml_fp16_t * y = kvq_fp16_slot(src, slot, offset);
    for (int64_t c = 0; c < n; ++c) {
        y[c] = GGML_CPU_FP32_TO_FP16(x[c]);
    }
}

// the batch cur into the sink rows and ring slots of fp16
static void kvq_put_fp16(const struct ggml_compute_params * params, const struct ggml_tensor * dst,
                         const struct ggml_tensor * fp16, const struct ggml_tensor * cur,
                         const struct ggml_tensor * k_idxs) {
    const int64_t head_dim = cur->ne[0];
    const int64_t n_head   = cur->ne[1];

    for (int64_t seg = 0; seg < kvq_n_seq(dst); ++seg) {
        const kvq_source src = kvq_make_source(fp16, cur, k_idxs, ggml_get_op_params_i32(dst, 2),
                                               kvq_n_seq(dst), kvq_kv_size(dst), seg);
        const int64_t last = src.first + src.n_tokens - 1;
        for (int64_t t = params->ith; t < src.n_tokens; t += params->nth) {
            const int64_t cell = src.first + t;
            for (int64_t h = 0; h < n_head; ++h) {
                const float * x = kvq_cur_row(&src, cell, h);
                // only the n_ring most recent cells keep a ring slot: distinct slots, so threads never collide
                if (cell > last - src.n_ring) {
                    kvq_store_fp16(&src, src.n_sink + cell % src.n_ring, h*head_dim, x, head_dim);
                }
                if (cell < src.n_sink) {
                    kvq_store_fp16(&src, cell, h*head_dim, x, head_dim);
                }
            }
        }
    }
}

static void kvq_ring_put(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    kvq_put_fp16(params, dst, dst->src[0], dst->src[1], dst->src[2]);
}

//
// STORE: a decode step's SEAL_K, STORE_V and RING_PUTs. One token per segment: the ring slot it takes is none that
// the tile it may complete reads (n_ring >= QK_KIVI), so the parts need no barrier between them.
//

static void kvq_store(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * v_cur = dst->src[6];
    kvq_seal_tiles(params, dst, dst->src[0], dst->src[1], dst->src[2], dst->src[3]);
    kvq_store_rows(params, dst, dst->src[4], v_cur->data, v_cur->nb[2], v_cur->ne[2], dst->src[7],
                   ggml_get_op_params_f32(dst, GGML_KVQ_CLIP_V_PARAM));
    kvq_put_fp16(params, dst, dst->src[1], dst->src[2], dst->src[3]);
    kvq_put_fp16(params, dst, dst->src[5], v_cur, dst->src[3]);
}

//
// ATTN
//

// the attention of one segment (one stream's queries)
typedef struct {
    const struct ggml_tensor * q;
    const struct ggml_tensor * mask;
    const char * k_tiles;              // this stream's tiles
    size_t       k_tiles_nb1;
    const char * v_rows;               // this stream's rows
    size_t       v_rows_nb1;
    int64_t      t0;                   // the segment's first token in the batch
    int64_t      mask_col0;            // the mask column of the stream's cell 0
    int64_t      n_kv;                 // cells of the stream the mask covers
    int64_t      n_head_kv;
    kvq_source k;
    kvq_source v;
    int32_t window;
    float   scale;
    float   softcap;
    const float * sinks;               // [n_head] learned sink logits, or NULL
    int     k_bits;
    int     v_bits;
} kvq_attn_args;

static float kvq_mask_value(const kvq_attn_args * a, int64_t t, int64_t j) {
    return kvq_mask_at(a->mask, a->t0 + t, a->mask_col0 + j);
}

// Codes 8g .. 8g+7 of a block as floats (layout in ggml-kvq.h: code u in byte u % nbytes at bit
// (u / nbytes)*bits). For 2 and 4 bits the eight codes are eight consecutive bytes under one shift; for
// 1 bit, four bytes twice under two shifts.
#if defined(__AVX2__)
static inline __attribute__((always_inline)) __m256 kvq_codes8(const uint8_t * qs, int bits, int g) {
    __m256i x;
    switch (bits) {
        case 1: {
            uint32_t w;
            memcpy(&w, qs, sizeof(w));
            x = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_set1_epi32((int) w)),
                                  _mm256_setr_epi32(2*g, 2*g, 2*g, 2*g, 2*g + 1, 2*g + 1, 2*g + 1, 2*g + 1));
        } break;
        case 2:
            x = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) qs)), _mm256_set1_epi32(2*g));
            break;
        default:
            x = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (qs + 8*(g % 2)))),
                                  _mm256_set1_epi32(4*(g / 2)));
            break;
    }
    return _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32((1 << bits) - 1)));
}
#endif

// scores of q against all QK_KIVI cells of a K tile, from the codes directly:
// score_u = sum_c (q_c d_c) code_{c,u} + sum_c q_c m_c
static inline __attribute__((always_inline)) void kvq_tile_scores_bits(
        const uint8_t * blocks, int bits, const float * q, int64_t head_dim, float * scores) {
    const size_t bb = ggml_kvq_block_bytes(bits);
    float offset = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[QK_KIVI/8] = { _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps() };
    for (int64_t c = 0; c < head_dim; ++c) {
        const uint8_t * block = blocks + c*bb;
        const __m256 qd = _mm256_set1_ps(q[c]*kvq_block_d(block));
        offset += q[c]*kvq_block_m(block);
        for (int g = 0; g < QK_KIVI/8; ++g) {
            acc[g] = _mm256_fmadd_ps(qd, kvq_codes8(block + 4, bits, g), acc[g]);
        }
    }
    for (int g = 0; g < QK_KIVI/8; ++g) {
        _mm256_storeu_ps(scores + 8*g, _mm256_add_ps(acc[g], _mm256_set1_ps(offset)));
    }
#else
    float acc[QK_KIVI] = { 0 };
    for (int64_t c = 0; c < head_dim; ++c) {
        const uint8_t * block = blocks + c*bb;
        float codes[QK_KIVI];
        kvq_block_codes(block, bits, codes);
        const float qd = q[c]*kvq_block_d(block);
        offset += q[c]*kvq_block_m(block);
        for (int u = 0; u < QK_KIVI; ++u) {
            acc[u] += qd*codes[u];
        }
    }
    for (int u = 0; u < QK_KIVI; ++u) {
        scores[u] = acc[u] + offset;
    }
#endif
}

static void kvq_tile_scores(const uint8_t * blocks, int bits, const float * q, int64_t head_dim, float * scores) {
    switch (bits) {
        case 1:  kvq_tile_scores_bits(blocks, 1, q, head_dim, scores); break;
        case 2:  kvq_tile_scores_bits(blocks, 2, q, head_dim, scores); break;
        default: kvq_tile_scores_bits(blocks, 4, q, head_dim, scores); break;
    }
}

static inline __attribute__((always_inline)) void kvq_accumulate_row_bits(
        const uint8_t * blocks, int bits, float weight, int64_t n, float * acc) {
    const size_t bb = ggml_kvq_block_bytes(bits);
    for (int64_t b = 0; b < n/QK_KIVI; ++b) {
        const uint8_t * block = blocks + b*bb;
        const float wd = weight*kvq_block_d(block);
        const float wm = weight*kvq_block_m(block);
        float * out = acc + b*QK_KIVI;
#if defined(__AVX2__) && defined(__FMA__)
        for (int g = 0; g < QK_KIVI/8; ++g) {
            const __m256 v = _mm256_fmadd_ps(_mm256_set1_ps(wd), kvq_codes8(block + 4, bits, g), _mm256_set1_ps(wm));
            _mm256_storeu_ps(out + 8*g, _mm256_add_ps(_mm256_loadu_ps(out + 8*g), v));
        }
#else
        float codes[QK_KIVI];
        kvq_block_codes(block, bits, codes);
        for (int u = 0; u < QK_KIVI; ++u) {
            out[u] += wd*codes[u] + wm;
        }
#endif
    }
}

// acc += weight * (quantized V row), n channels
static void kvq_accumulate_row(const uint8_t * blocks, int bits, float weight, int64_t n, float * acc) {
    switch (bits) {
        case 1:  kvq_accumulate_row_bits(blocks, 1, weight, n, acc); break;
        case 2:  kvq_accumulate_row_bits(blocks, 2, weight, n, acc); break;
        default: kvq_accumulate_row_bits(blocks, 4, weight, n, acc); break;
    }
}

typedef struct {
    float max;
    float sum;
} kvq_softmax;

// online softmax: fold value v (n channels) with score s into acc
static void kvq_softmax_add(kvq_softmax * sm, float s, float * acc, int64_t n, float * weight) {
    if (s > sm->max) {
        const float rescale = expf(sm->max - s);
        for (int64_t c = 0; c < n; ++c) {
            acc[c] *= rescale;
        }
        sm->sum = sm->sum*rescale + 1.0f;
        sm->max = s;
        *weight = 1.0f;
    } else {
        *weight = expf(s - sm->max);
        sm->sum += *weight;
    }
}

static void kvq_attn_row(const kvq_attn_args * a, int64_t t, int64_t h, float * out) {
    const int64_t head_dim   = a->k.head_dim;
    const int64_t head_dim_v = a->v.head_dim;
    const int64_t hk         = h / (a->q->ne[1] / a->n_head_kv);
    const int64_t n_kv       = a->n_kv;
    const int64_t i          = a->k.first + t;
    const int64_t lim_v      = ggml_kvq_lim_v(i, a->window);           // V below this is quantized
    const int64_t lim_k      = ggml_kvq_lim_k(i, a->window);           // K below this is quantized
    const int64_t n_sink     = a->k.n_sink;
    const size_t  k_bb       = ggml_kvq_block_bytes(a->k_bits);
    const size_t  v_bb       = ggml_kvq_block_bytes(a->v_bits);
    const float * q_row = (const float *) ((const char *) a->q->data + (a->t0 + t)*a->q->nb[2] + h*a->q->nb[1]);

    // Q in fp16, as upstream's flash attention takes it for f16 K: a window covering the whole context
    // then reproduces f16 KV, and ΔPPL against f16 measures the quantization alone
    float q[KVQ_MAX_HEAD];
    for (int64_t c = 0; c < head_dim; ++c) {
        q[c] = kvq_round_fp16(q_row[c]);
    }
    float acc[KVQ_MAX_HEAD] = { 0 };
    float kbuf[KVQ_MAX_HEAD];
    float vbuf[KVQ_MAX_HEAD];
    float tile_scores[QK_KIVI];
    kvq_softmax sm = { -INFINITY, 0.0f };

    for (int64_t j0 = 0; j0 < n_kv; j0 += QK_KIVI) {
        const int64_t j1 = j0 + QK_KIVI < n_kv ? j0 + QK_KIVI : n_kv;
        const int64_t q_lo = j0 > n_sink ? j0 : n_sink;
        const int64_t q_hi = j1 < lim_k ? j1 : lim_k;
        if (q_lo < q_hi) {
            const uint8_t * tile = (const uint8_t *) a->k_tiles + (j0/QK_KIVI)*a->k_tiles_nb1 + hk*head_dim*k_bb;
            kvq_tile_scores(tile, a->k_bits, q, head_dim, tile_scores);
        }
        for (int64_t j = j0; j < j1; ++j) {
            const float mv = kvq_mask_value(a, t, j);
            if (mv == -INFINITY) {
                continue;
            }
            float s;
            if (j >= n_sink && j < lim_k) {
                s = tile_scores[j - j0];
            } else {
                kvq_read_fp16(&a->k, j, hk, head_dim, kbuf);
                ggml_vec_dot_f32((int) head_dim, &s, 0, q, 0, kbuf, 0, 1);
            }
            s = ggml_kvq_capped(s*a->scale, a->softcap) + mv;

            float w;
            kvq_softmax_add(&sm, s, acc, head_dim_v, &w);
            if (j >= n_sink && j < lim_v) {
                const uint8_t * row = (const uint8_t *) a->v_rows + j*a->v_rows_nb1 + hk*head_dim_v/QK_KIVI*v_bb;
                kvq_accumulate_row(row, a->v_bits, w, head_dim_v, acc);
            } else {
                kvq_read_fp16(&a->v, j, hk, head_dim_v, vbuf);
                for (int64_t c = 0; c < head_dim_v; ++c) {
                    acc[c] += w*vbuf[c];
                }
            }
        }
    }
    if (a->sinks != NULL) {
        // one more logit in the softmax, whose value is zero
        float w;
        kvq_softmax_add(&sm, a->sinks[h], acc, head_dim_v, &w);
    }
    const float inv = sm.sum > 0.0f ? 1.0f/sm.sum : 0.0f;
    for (int64_t c = 0; c < head_dim_v; ++c) {
        out[c] = acc[c]*inv;
    }
}

static void kvq_attn(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const int32_t n_sink  = ggml_get_op_params_i32(dst, 2);
    const int32_t n_seq   = kvq_n_seq(dst);
    const int64_t kv_size = kvq_kv_size(dst);
    const struct ggml_tensor * k_tiles = dst->src[1];
    const struct ggml_tensor * v_rows  = dst->src[2];
    const struct ggml_tensor * mask    = dst->src[7];
    const int64_t n_tps  = kvq_seg_tokens(dst->src[5], n_seq);
    const int64_t n_head = dst->src[0]->ne[1];
    GGML_ASSERT(dst->src[5]->ne[0] <= KVQ_MAX_HEAD && dst->src[6]->ne[0] <= KVQ_MAX_HEAD);
    GGML_ASSERT(mask->ne[1]*mask->ne[3] == dst->src[5]->ne[2]);

    for (int64_t seg = 0; seg < n_seq; ++seg) {
        kvq_attn_args a = {
            /*.q           =*/ dst->src[0],
            /*.mask        =*/ mask,
            /*.k_tiles     =*/ NULL,
            /*.k_tiles_nb1 =*/ k_tiles->nb[1],
            /*.v_rows      =*/ NULL,
            /*.v_rows_nb1  =*/ v_rows->nb[1],
            /*.t0          =*/ seg*n_tps,
            /*.mask_col0   =*/ 0,
            /*.n_kv        =*/ 0,
            /*.n_head_kv   =*/ dst->src[5]->ne[1],
            /*.k           =*/ kvq_make_source(dst->src[3], dst->src[5], dst->src[8], n_sink, n_seq, kv_size, seg),
            /*.v           =*/ kvq_make_source(dst->src[4], dst->src[6], dst->src[8], n_sink, n_seq, kv_size, seg),
            /*.window      =*/ ggml_get_op_params_i32(dst, 1),
            /*.scale       =*/ ggml_get_op_params_f32(dst, 3),
            /*.softcap     =*/ ggml_get_op_params_f32(dst, GGML_KVQ_SOFTCAP_PARAM),
            /*.sinks       =*/ dst->src[9] != NULL ? (const float *) dst->src[9]->data : NULL,
            /*.k_bits      =*/ ggml_kvq_bits(k_tiles->type),
            /*.v_bits      =*/ ggml_kvq_bits(v_rows->type),
        };
        // tiles [n_embd*QK_KIVI, kv_size/QK_KIVI, n_stream]; V rows contiguous, kv_size per stream
        a.k_tiles = (const char *) k_tiles->data + a.k.stream*(kv_size/QK_KIVI)*k_tiles->nb[1];
        a.v_rows  = (const char *) v_rows->data + a.k.stream*kv_size*v_rows->nb[1];
        // a per-stream mask counts cells from the stream's first, a unified cache's from the cache's first
        a.mask_col0 = kvq_mask_all_streams(dst) ? a.k.stream*kv_size : 0;
        a.n_kv      = mask->ne[0] - a.mask_col0 < kv_size ? mask->ne[0] - a.mask_col0 : kv_size;
        GGML_ASSERT(a.n_kv >= a.k.first + n_tps);

        const int64_t r0 = seg*n_tps*n_head;
        const int64_t r1 = r0 + n_tps*n_head;
        // rows are dealt to threads over the whole batch, as with one segment
        for (int64_t r = r0 + ((params->ith - r0) % params->nth + params->nth) % params->nth; r < r1; r += params->nth) {
            const int64_t t = r / n_head - seg*n_tps;
            const int64_t h = r % n_head;
            kvq_attn_row(&a, t, h, (float *) dst->data + r*dst->ne[0]);
        }
    }
}

void ggml_compute_forward_kvq(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    switch ((enum ggml_kvq_op) ggml_get_op_params_i32(dst, 0)) {
        case GGML_KVQ_OP_SEAL_K:    kvq_seal_k(params, dst);    break;
        case GGML_KVQ_OP_ATTN:      kvq_attn(params, dst);      break;
        case GGML_KVQ_OP_RING_PUT:  kvq_ring_put(params, dst);  break;
        case GGML_KVQ_OP_WIDE:      kvq_wide(params, dst);      break;
        case GGML_KVQ_OP_WIDE_MASK: kvq_wide_mask(params, dst); break;
        case GGML_KVQ_OP_SCORE_LSE: kvq_score_lse(params, dst); break;
        case GGML_KVQ_OP_SCORE_ADD: kvq_score_add(params, dst); break;
        case GGML_KVQ_OP_STORE_V:   kvq_store_v(params, dst);   break;
        case GGML_KVQ_OP_STORE:     kvq_store(params, dst);     break;
        default:                    GGML_ABORT("unknown kvq op");
    }
}
