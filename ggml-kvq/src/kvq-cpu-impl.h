// Internals shared by the CPU kernels of GGML_OP_KVQ (kvq-cpu.c: seal, store, ring; kvq-cpu-attn.c:
// attention; kvq-cpu-wide.c: the wide cells of the flash-attention prefill); kvq-cpu-source.c defines the segment
// access they use.
#pragma once

#include "ggml-kvq.h"
#include "ggml-cpu-impl.h"
#include "simd-mappings.h"

#include <stdbool.h>

struct ggml_compute_params;

// the widest head the CPU kernels take: DeepSeek's MLA keys, a 512-wide latent and 64 RoPE channels
#define KVQ_CPU_MAX_HEAD 576

// One segment of the batch: the tokens of one stream (sequence), in consecutive cells of that stream. A batch
// holds n_seq segments of equal length, one per stream (upstream's split_equal); its cell indices are global,
// stream*kv_size + cell.
typedef struct {
    char       * fp16;                 // this stream's sinks + ring
    size_t       fp16_nb1;
    const char * cur;                  // F32 [head_dim, n_head_kv, n_tokens] from the segment's first token
    size_t       cur_nb1;
    size_t       cur_nb2;
    int64_t      head_dim;
    int64_t      stream;
    int64_t      first;                // cell (within the stream) of the segment's first token
    int64_t      n_tokens;             // of the segment
    int32_t      n_sink;
    int32_t      n_ring;
} kvq_source;

static inline int64_t kvq_seg_tokens(const struct ggml_tensor * cur, int32_t n_seq) {
    GGML_ASSERT(n_seq >= 1 && cur->ne[2] % n_seq == 0);
    return cur->ne[2] / n_seq;
}

kvq_source kvq_make_source(const struct ggml_tensor * fp16, const struct ggml_tensor * cur,
                           const struct ggml_tensor * k_idxs, int32_t n_sink, int32_t n_seq, int64_t kv_size, int64_t seg);

// x rounded to fp16 precision
void kvq_round_fp16_row(const float * x, int64_t n, float * out);

// fp16 value of `cell`, channels [head*n, head*n + n): from the batch when it is in it (rounded to fp16),
// else from its sink row or its ring slot
void kvq_read_fp16(const kvq_source * src, int64_t cell, int64_t head, int64_t n, float * out);

static inline float kvq_round_fp16(float x) {
    return GGML_CPU_FP16_TO_FP32(GGML_CPU_FP32_TO_FP16(x));
}

static inline const float * kvq_cur_row(const kvq_source * src, int64_t cell, int64_t head) {
    return (const float *) (src->cur + (cell - src->first)*src->cur_nb2 + head*src->cur_nb1);
}

static inline ggml_fp16_t * kvq_fp16_slot(const kvq_source * src, int64_t slot, int64_t offset) {
    return (ggml_fp16_t *) (src->fp16 + slot*src->fp16_nb1) + offset;
}

//
// block access (layout in ggml-kvq.h)
//

static inline __attribute__((always_inline)) void kvq_block_codes(const uint8_t * block, int bits, float * codes) {
    const int nbytes = QK_KIVI*bits/8;
    const int mask   = (1 << bits) - 1;
    const uint8_t * qs = block + 4;
    for (int u = 0; u < QK_KIVI; ++u) {
        codes[u] = (float) ((qs[u % nbytes] >> ((u / nbytes)*bits)) & mask);
    }
}

static inline float kvq_block_d(const uint8_t * block) {
    return GGML_CPU_FP16_TO_FP32(((const ggml_fp16_t *) block)[0]);
}

static inline float kvq_block_m(const uint8_t * block) {
    return GGML_CPU_FP16_TO_FP32(((const ggml_fp16_t *) block)[1]);
}

// op params: { op, window, n_sink, scale, n_seq (streams in the batch), kv_size (cells per stream),
// mask_all_streams (attention: the mask's columns are the global cells) }
static inline int32_t kvq_n_seq(const struct ggml_tensor * dst) {
    return ggml_get_op_params_i32(dst, 4);
}

static inline int64_t kvq_kv_size(const struct ggml_tensor * dst) {
    return ggml_get_op_params_i32(dst, 5);
}

static inline bool kvq_mask_all_streams(const struct ggml_tensor * dst) {
    return ggml_get_op_params_i32(dst, 6) != 0;
}

// one row of llama.cpp's mask per batch token, in planes of mask->ne[1] rows (one plane per stream, or one for all)
static inline float kvq_mask_at(const struct ggml_tensor * mask, int64_t row, int64_t col) {
    const char * p = (const char *) mask->data + (row / mask->ne[1])*mask->nb[3] + (row % mask->ne[1])*mask->nb[1];
    return mask->type == GGML_TYPE_F16 ? GGML_CPU_FP16_TO_FP32(((const ggml_fp16_t *) p)[col]) : ((const float *) p)[col];
}
