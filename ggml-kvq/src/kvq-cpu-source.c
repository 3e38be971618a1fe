// The batch segment and fp16 rows every CPU kernel of GGML_OP_KVQ reads (kvq-cpu-impl.h).

#include "kvq-cpu-impl.h"
#include "ggml-cpu.h"

kvq_source kvq_make_source(const struct ggml_tensor * fp16, const struct ggml_tensor * cur,
                           const struct ggml_tensor * k_idxs, int32_t n_sink, int32_t n_seq, int64_t kv_size, int64_t seg) {
    const int64_t   n_tps = kvq_seg_tokens(cur, n_seq);
    const int64_t * cells = (const int64_t *) k_idxs->data + seg*n_tps;
    const int64_t   strm  = cells[0] / kv_size;
    GGML_ASSERT(strm < fp16->ne[2]);
    kvq_source src = {
        /*.fp16     =*/ (char *) fp16->data + strm*fp16->nb[2],
        /*.fp16_nb1 =*/ fp16->nb[1],
        /*.cur      =*/ (const char *) cur->data + seg*n_tps*cur->nb[2],
        /*.cur_nb1  =*/ cur->nb[1],
        /*.cur_nb2  =*/ cur->nb[2],
        /*.head_dim =*/ cur->ne[0],
        /*.stream   =*/ strm,
        /*.first    =*/ cells[0] % kv_size,
        /*.n_tokens =*/ n_tps,
        /*.n_sink   =*/ n_sink,
        /*.n_ring   =*/ (int32_t) (fp16->ne[1] - n_sink),
    };
    for (int64_t t = 1; t < n_tps; ++t) {
        // the kivi cache places a sequence's tokens in consecutive cells of its stream (llama-kvq-cache);
        // anything else is a bug
        GGML_ASSERT(cells[t] == cells[0] + t);
    }
    GGML_ASSERT(src.first + n_tps <= kv_size);
    return src;
}

// F16C rounds eight at a time, with the same round-to-nearest-even as the scalar macros: the same bits either way
void kvq_round_fp16_row(const float * x, int64_t n, float * out) {
    int64_t c = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; c + 8 <= n; c += 8) {
        _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + c), 0)));
    }
#endif
    for (; c < n; ++c) {
        out[c] = kvq_round_fp16(x[c]);
    }
}

void kvq_read_fp16(const kvq_source * src, int64_t cell, int64_t head, int64_t n, float * out) {
    if (cell >= src->first) {
        kvq_round_fp16_row(kvq_cur_row(src, cell, head), n, out);
        return;
    }
    const int64_t slot = cell < src->n_sink ? cell : src->n_sink + cell % src->n_ring;
    ggml_cpu_fp16_to_fp32(kvq_fp16_slot(src, slot, head*n), out, n);
}
