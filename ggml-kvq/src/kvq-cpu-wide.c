// CPU kernels of the flash-attention prefill (ggml-kvq.h): WIDE lays a segment's K or V out as F16 wide cells,
// WIDE_MASK shows each query each cell once, the way the attention contract reads it.

#include "kvq-cpu-wide.h"
#include "kvq-cpu-impl.h"

#include <math.h>
#include <string.h>

// op params 7 and 8 of WIDE / WIDE_MASK
static int64_t kvq_wide_n_kv(const struct ggml_tensor * dst) {
    return ggml_get_op_params_i32(dst, 7);
}

static bool kvq_wide_is_k(const struct ggml_tensor * dst) {
    return ggml_get_op_params_i32(dst, 8) != 0;
}

// the quantized K of cell j of a stream (one code of each channel's block in j's tile), all n_embd channels
static void kvq_wide_put_k_tile(const struct ggml_tensor * tiles, int64_t stream, int64_t kv_size, int64_t j,
                                int64_t n_embd, ggml_fp16_t * y) {
    const int     bits   = ggml_kvq_bits(tiles->type);
    const int     nbytes = QK_KIVI*bits/8;
    const int     u      = (int) (j % QK_KIVI);
    const size_t  bb     = ggml_kvq_block_bytes(bits);
    const uint8_t * tile = (const uint8_t *) tiles->data + (stream*(kv_size/QK_KIVI) + j/QK_KIVI)*tiles->nb[1];
    for (int64_t c = 0; c < n_embd; ++c) {
        const uint8_t * block = tile + c*bb;
        const int code = (block[4 + u % nbytes] >> ((u / nbytes)*bits)) & ((1 << bits) - 1);
        y[c] = GGML_CPU_FP32_TO_FP16(kvq_block_m(block) + kvq_block_d(block)*(float) code);
    }
}

// the quantized V row of cell j of a stream
static void kvq_wide_put_v_row(const struct ggml_tensor * rows, int64_t stream, int64_t kv_size, int64_t j,
                               int64_t n_embd, ggml_fp16_t * y) {
    const ggml_to_float_t to_float = ggml_get_type_traits(rows->type)->to_float;
    const size_t bb  = ggml_kvq_block_bytes(ggml_kvq_bits(rows->type));
    const char * row = (const char *) rows->data + (stream*kv_size + j)*rows->nb[1];
    float x[QK_KIVI];
    for (int64_t b = 0; b < n_embd/QK_KIVI; ++b) {
        to_float(row + b*bb, x, QK_KIVI);
        for (int u = 0; u < QK_KIVI; ++u) {
            y[b*QK_KIVI + u] = GGML_CPU_FP32_TO_FP16(x[u]);
        }
    }
}

static void kvq_wide_put_fp16(const kvq_source * src, int64_t j, int64_t n_embd, ggml_fp16_t * y) {
    float x[KVQ_CPU_MAX_HEAD];
    GGML_ASSERT(src->head_dim <= KVQ_CPU_MAX_HEAD);
    for (int64_t h = 0; h < n_embd/src->head_dim; ++h) {
        kvq_read_fp16(src, j, h, src->head_dim, x);
        for (int64_t c = 0; c < src->head_dim; ++c) {
            y[h*src->head_dim + c] = GGML_CPU_FP32_TO_FP16(x[c]);
        }
    }
}

void kvq_wide(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * quantized = dst->src[0];
    const int32_t window  = ggml_get_op_params_i32(dst, 1);
    const int32_t n_sink  = ggml_get_op_params_i32(dst, 2);
    const int32_t n_seq   = kvq_n_seq(dst);
    const int64_t kv_size = kvq_kv_size(dst);
    const bool    is_k    = kvq_wide_is_k(dst);
    const int64_t n_embd  = dst->ne[0];
    const struct ggml_kvq_wide_layout l = ggml_kvq_wide_layout_for(kvq_wide_n_kv(dst), kvq_seg_tokens(dst->src[2], n_seq), window);

    for (int64_t seg = 0; seg < n_seq; ++seg) {
        const kvq_source src = kvq_make_source(dst->src[1], dst->src[2], dst->src[3], n_sink, n_seq, kv_size, seg);
        const int64_t end    = src.first + src.n_tokens;      // no cell from here on holds anything yet
        const int64_t sealed = end/QK_KIVI*QK_KIVI;            // K tiles below are sealed
        const int64_t b0     = ggml_kvq_wide_b0(src.first, window, n_sink);
        const int64_t c0     = ggml_kvq_wide_c0(src.first, window, n_sink);
        // the ring holds the cells the B and C blocks read before the batch (ggml_kvq_ring_size)
        GGML_ASSERT(b0 >= src.first - src.n_ring && c0 >= b0);
        for (int64_t w = params->ith; w < l.n_wide; w += params->nth) {
            ggml_fp16_t * y = (ggml_fp16_t *) ((char *) dst->data + seg*dst->nb[2] + w*dst->nb[1]);
            int64_t j;
            bool    fp16;
            if (w < l.n_a) {
                j    = w;
                fp16 = j < n_sink;
            } else if (w < l.n_a + l.n_b) {
                j    = b0 + w - l.n_a;
                fp16 = is_k;
            } else {
                j    = c0 + w - l.n_a - l.n_b;
                fp16 = true;
            }
            // zeros where nothing is read (the mask hides those cells; stale values must not be inf or nan)
            const bool valid = w < l.n_a + l.n_b + l.n_c && j < end && (fp16 || !is_k || j < sealed);
            if (!valid) {
                memset(y, 0, n_embd*sizeof(ggml_fp16_t));
            } else if (fp16) {
                kvq_wide_put_fp16(&src, j, n_embd, y);
            } else if (is_k) {
                kvq_wide_put_k_tile(quantized, src.stream, kv_size, j, n_embd, y);
            } else {
                kvq_wide_put_v_row(quantized, src.stream, kv_size, j, n_embd, y);
            }
        }
    }
}

void kvq_wide_mask(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * mask   = dst->src[0];
    const int64_t            * cells  = (const int64_t *) dst->src[1]->data;
    const int32_t window  = ggml_get_op_params_i32(dst, 1);
    const int32_t n_sink  = ggml_get_op_params_i32(dst, 2);
    const int32_t n_seq   = kvq_n_seq(dst);
    const int64_t kv_size = kvq_kv_size(dst);
    const int64_t n_tps   = dst->src[1]->ne[0]/n_seq;
    const struct ggml_kvq_wide_layout l = ggml_kvq_wide_layout_for(kvq_wide_n_kv(dst), n_tps, window);
    const ggml_fp16_t hidden = GGML_CPU_FP32_TO_FP16(-INFINITY);

    for (int64_t r = params->ith; r < n_tps*n_seq; r += params->nth) {
        const int64_t seg   = r / n_tps;
        const int64_t first = cells[seg*n_tps] % kv_size;
        const int64_t i     = first + r % n_tps;
        const int64_t col0  = kvq_mask_all_streams(dst) ? cells[seg*n_tps] / kv_size * kv_size : 0;
        const int64_t n_j   = mask->ne[0] - col0 < l.n_a ? mask->ne[0] - col0 : l.n_a;
        ggml_fp16_t * y = (ggml_fp16_t *) ((char *) dst->data + seg*dst->nb[3] + (r % n_tps)*dst->nb[1]);
        for (int64_t w = 0; w < l.n_wide; ++w) {
            y[w] = hidden;
        }
        for (int64_t j = 0; j < n_j; ++j) {
            const float m = kvq_mask_at(mask, r, col0 + j);
            if (m == -INFINITY) {
                continue;
            }
            const int64_t w = ggml_kvq_wide_col(&l, first, i, j, window, n_sink);
            // a query sees only cells up to its own (causal attention, which kivi caches assume)
            GGML_ASSERT(j <= i && w < l.n_a + l.n_b + l.n_c);
            y[w] = GGML_CPU_FP32_TO_FP16(m);
        }
    }
}
