// CPU kernels of GGML_OP_KVQ (see ggml-kvq.h for the storage layout and the attention contract).

#include "kvq-cpu.h"
#include "kvq-cpu-impl.h"
#include "kvq-cpu-wide.h"
#include "kvq-cpu-score.h"
#include "kvq-cpu-attn.h"

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
// STORE: a decode step's SEAL_K, STORE_V and RING_PUTs (a latent layer's SEAL_K and K's RING_PUT). One token per
// segment: the ring slot it takes is none that the tile it may complete reads (n_ring >= QK_KIVI), so the parts need
// no barrier between them.
//

static void kvq_store(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * v_cur = dst->src[6];
    kvq_seal_tiles(params, dst, dst->src[0], dst->src[1], dst->src[2], dst->src[3]);
    kvq_put_fp16(params, dst, dst->src[1], dst->src[2], dst->src[3]);
    if (v_cur == NULL) {
        return; // a latent layer's: K alone
    }
    kvq_store_rows(params, dst, dst->src[4], v_cur->data, v_cur->nb[2], v_cur->ne[2], dst->src[7],
                   ggml_get_op_params_f32(dst, GGML_KVQ_CLIP_V_PARAM));
    kvq_put_fp16(params, dst, dst->src[5], v_cur, dst->src[3]);
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
