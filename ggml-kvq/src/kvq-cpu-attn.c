// CPU kernel of GGML_KVQ_OP_ATTN (the attention contract is in ggml-kvq.h). The queries that share a KV head (its
// query heads, over a run of the batch's tokens) are attended together, one K tile of QK_KIVI cells at a time: a
// tile's codes, its V rows' codes and its fp16 cells are decoded once for the group, then each query runs its own
// arithmetic over them. That arithmetic does not depend on the group, so a query's result has the same bits in a
// batch of any shape and on any number of threads.

#include "kvq-cpu-attn.h"
#include "kvq-cpu-impl.h"
#include "ggml-cpu.h"
#include "vec.h"

#include <math.h>
#include <string.h>

#define KVQ_MAX_HEAD          KVQ_CPU_MAX_HEAD
#define KVQ_MAX_GROUP         32    // queries attended together: they share each tile's decoding and bookkeeping
#define KVQ_K_CHUNK           128   // K channels whose codes are decoded at a time
#define KVQ_GROUPS_PER_THREAD 4     // fewer groups than this per thread leave the threads unevenly loaded
#define KVQ_FP16_ROWS         8     // fp16 V cells read before the queries take them, each with its output in registers

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
    bool    latent;                    // V is the first v.head_dim channels of K (ggml_kvq_attn_latent)
} kvq_attn_args;

// one query of a group
typedef struct {
    int64_t t;                         // token of the segment
    int64_t h;                         // query head
    int64_t lim_k;                     // K below this is quantized (sinks aside)
    int64_t lim_v;                     // V below this is quantized (sinks aside)
    const char * mask_row;
    bool    live;                      // the current tile has a cell it attends
    float   max;                       // running softmax
    float   sum;
    float   q[KVQ_MAX_HEAD];           // in fp16 precision
    float   acc[KVQ_MAX_HEAD];
    float   mask[QK_KIVI];             // the current tile's mask
    float   raw[QK_KIVI];              // its scores q.k
    float   w[QK_KIVI];                // its softmax weights
} kvq_query;

// what a group decodes once for all its queries
typedef struct {
    float codes[KVQ_K_CHUNK*QK_KIVI];  // K: [channel][cell]; V: [cell][channel of a block]
    float d[KVQ_K_CHUNK];              // K: per channel; V: per cell
    float m[KVQ_K_CHUNK];
    float rows[KVQ_FP16_ROWS][KVQ_MAX_HEAD];  // fp16 cells
    float qd[KVQ_MAX_GROUP][KVQ_K_CHUNK];  // each query's q_c d_c over the chunk's channels
    float wd[KVQ_MAX_GROUP][QK_KIVI];      // each query's w_u d_u over the block's cells
    float cells[QK_KIVI*QK_KIVI];          // a latent V block: 32 channels' codes as [cell][channel]
    float cw[KVQ_MAX_GROUP][QK_KIVI];      // each query's sum_u w_u q_uc over the block's channels
} kvq_scratch;

//
// codes
//

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

// the QK_KIVI codes of each of n blocks (bb bytes apart) as floats, n*QK_KIVI of them, with each block's scale and
// minimum
static inline __attribute__((always_inline)) void kvq_decode_blocks_bits(
        const uint8_t * blocks, size_t stride, int bits, int64_t n, float * codes, float * d, float * m) {
    for (int64_t i = 0; i < n; ++i) {
        const uint8_t * block = blocks + i*stride;
        d[i] = kvq_block_d(block);
        m[i] = kvq_block_m(block);
#if defined(__AVX2__)
        for (int g = 0; g < QK_KIVI/8; ++g) {
            _mm256_storeu_ps(codes + i*QK_KIVI + 8*g, kvq_codes8(block + 4, bits, g));
        }
#else
        kvq_block_codes(block, bits, codes + i*QK_KIVI);
#endif
    }
}

static void kvq_decode_blocks(const uint8_t * blocks, size_t stride, int bits, int64_t n, float * codes, float * d, float * m) {
    switch (bits) {
        case 1:  kvq_decode_blocks_bits(blocks, stride, 1, n, codes, d, m); break;
        case 2:  kvq_decode_blocks_bits(blocks, stride, 2, n, codes, d, m); break;
        default: kvq_decode_blocks_bits(blocks, stride, 4, n, codes, d, m); break;
    }
}

//
// one query's arithmetic
//

#if defined(__AVX2__) && defined(__FMA__)
// the eight lanes of x summed, always in the same order
static inline float kvq_hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

// q.row over n channels (a multiple of QK_KIVI), summed as ggml_vec_dot_f32 sums on AVX2 (four sums of eight lanes,
// then its reduction): the scores of fp16 cells keep their bits, without a call per query and cell
static inline float kvq_dot_row(const float * q, const float * row, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 s[4] = { _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps() };
    for (int64_t c = 0; c < n; c += 32) {
        for (int j = 0; j < 4; ++j) {
            s[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8*j), _mm256_loadu_ps(row + c + 8*j), s[j]);
        }
    }
    s[0] = _mm256_add_ps(s[0], s[2]);
    s[1] = _mm256_add_ps(s[1], s[3]);
    s[0] = _mm256_add_ps(s[0], s[1]);
    const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(s[0]), _mm256_extractf128_ps(s[0], 1));
    const __m128 t1 = _mm_hadd_ps(t0, t0);
    return _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
#else
    float r;
    ggml_vec_dot_f32((int) n, &r, 0, q, 0, row, 0, 1);
    return r;
#endif
}

// sum_c q_c m_c over n channels
static float kvq_dot_offset(const float * q, const float * m, int64_t n) {
    int64_t c = 0;
    float o = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; c + 8 <= n; c += 8) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(m + c), acc);
    }
    o = kvq_hsum8(acc);
#endif
    for (; c < n; ++c) {
        o += q[c]*m[c];
    }
    return o;
}

// acc_g[k] += sum_i a_g[i] rows[i][k] over n rows of QK_KIVI lanes, for n_q queries g. Two queries at a time share
// each row's loads, and their eight sums keep the FMA units busy. A query's terms are summed in row order whatever
// runs beside it, so its bits do not depend on the group.
static void kvq_rows_fma(int n_q, const float * const * a, const float * rows, int64_t n, float * const * acc) {
#if defined(__AVX2__) && defined(__FMA__)
    int g = 0;
    for (; g + 2 <= n_q; g += 2) {
        __m256 s0[QK_KIVI/8];
        __m256 s1[QK_KIVI/8];
        for (int v = 0; v < QK_KIVI/8; ++v) {
            s0[v] = _mm256_loadu_ps(acc[g] + 8*v);
            s1[v] = _mm256_loadu_ps(acc[g + 1] + 8*v);
        }
        for (int64_t i = 0; i < n; ++i) {
            const __m256 a0 = _mm256_set1_ps(a[g][i]);
            const __m256 a1 = _mm256_set1_ps(a[g + 1][i]);
            for (int v = 0; v < QK_KIVI/8; ++v) {
                const __m256 r = _mm256_loadu_ps(rows + i*QK_KIVI + 8*v);
                s0[v] = _mm256_fmadd_ps(a0, r, s0[v]);
                s1[v] = _mm256_fmadd_ps(a1, r, s1[v]);
            }
        }
        for (int v = 0; v < QK_KIVI/8; ++v) {
            _mm256_storeu_ps(acc[g] + 8*v, s0[v]);
            _mm256_storeu_ps(acc[g + 1] + 8*v, s1[v]);
        }
    }
    if (g < n_q) {
        __m256 s0[QK_KIVI/8];
        for (int v = 0; v < QK_KIVI/8; ++v) {
            s0[v] = _mm256_loadu_ps(acc[g] + 8*v);
        }
        for (int64_t i = 0; i < n; ++i) {
            const __m256 a0 = _mm256_set1_ps(a[g][i]);
            for (int v = 0; v < QK_KIVI/8; ++v) {
                s0[v] = _mm256_fmadd_ps(a0, _mm256_loadu_ps(rows + i*QK_KIVI + 8*v), s0[v]);
            }
        }
        for (int v = 0; v < QK_KIVI/8; ++v) {
            _mm256_storeu_ps(acc[g] + 8*v, s0[v]);
        }
    }
#else
    for (int g = 0; g < n_q; ++g) {
        for (int k = 0; k < QK_KIVI; ++k) {
            float r = acc[g][k];
            for (int64_t i = 0; i < n; ++i) {
                r += a[g][i]*rows[i*QK_KIVI + k];
            }
            acc[g][k] = r;
        }
    }
#endif
}

// wd[u] = w_u d_u over the QK_KIVI rows of a V block (zero past the query's n rows), and sum_u w_u m_u returned: the
// query's weights of the block's codes and its constant part (KIVI's factorisation: the per-token scale goes to the
// weight). A cell of no weight counts nothing whatever its block holds (a masked cell may hold anything).
static float kvq_query_v_weights(const float * d, const float * m, const float * w, int64_t n, float * wd) {
    float wn[QK_KIVI];
    for (int u = 0; u < QK_KIVI; ++u) {
        wn[u] = u < n ? w[u] : 0.0f;
    }
#if defined(__AVX2__) && defined(__FMA__)
    __m256 bias8 = _mm256_setzero_ps();
    for (int u = 0; u < QK_KIVI; u += 8) {
        const __m256 wu   = _mm256_loadu_ps(wn + u);
        const __m256 some = _mm256_cmp_ps(wu, _mm256_setzero_ps(), _CMP_NEQ_OQ);
        _mm256_storeu_ps(wd + u, _mm256_and_ps(some, _mm256_mul_ps(wu, _mm256_loadu_ps(d + u))));
        bias8 = _mm256_add_ps(bias8, _mm256_and_ps(some, _mm256_mul_ps(wu, _mm256_loadu_ps(m + u))));
    }
    return kvq_hsum8(bias8);
#else
    float bias = 0.0f;
    for (int u = 0; u < QK_KIVI; ++u) {
        wd[u] = wn[u] != 0.0f ? wn[u]*d[u] : 0.0f;
        bias += wn[u] != 0.0f ? wn[u]*m[u] : 0.0f;
    }
    return bias;
#endif
}

// one more logit s in the online softmax, with a zero value: a learned sink
static void kvq_query_add_sink(kvq_query * qy, float s, int64_t n) {
    if (s > qy->max) {
        const float rescale = expf(qy->max - s);
        ggml_vec_scale_f32((int) n, qy->acc, rescale);
        qy->sum = qy->sum*rescale + 1.0f;
        qy->max = s;
    } else {
        qy->sum += expf(s - qy->max);
    }
}

static_assert(QK_KIVI == 32, "a tile is four vectors of eight");

static float kvq_tile_max(const float * s) {
#if defined(__AVX2__)
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_loadu_ps(s), _mm256_loadu_ps(s + 8)),
                             _mm256_max_ps(_mm256_loadu_ps(s + 16), _mm256_loadu_ps(s + 24)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
#else
    float m = -INFINITY;
    for (int u = 0; u < QK_KIVI; ++u) {
        m = s[u] > m ? s[u] : m;
    }
    return m;
#endif
}

// s += mask, and -INFINITY wherever the mask is, whatever s holds there (a masked cell's score may be anything)
static void kvq_tile_add_mask(float * s, const float * mask) {
#if defined(__AVX2__)
    for (int u = 0; u < QK_KIVI; u += 8) {
        const __m256 m      = _mm256_loadu_ps(mask + u);
        const __m256 hidden = _mm256_cmp_ps(m, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
        _mm256_storeu_ps(s + u, _mm256_blendv_ps(_mm256_add_ps(_mm256_loadu_ps(s + u), m), m, hidden));
    }
#else
    for (int u = 0; u < QK_KIVI; ++u) {
        s[u] = mask[u] == -INFINITY ? -INFINITY : s[u] + mask[u];
    }
#endif
}

// the tile's scores into softmax weights qy->w (zero where masked), the running softmax rescaled to the tile's
// maximum where it rises; false when the query attends no cell of the tile
static bool kvq_query_softmax(const kvq_attn_args * a, kvq_query * qy) {
    // in passes the compiler vectorises: softcap's tanhf in the loop kept it scalar
    float s[QK_KIVI];
    for (int u = 0; u < QK_KIVI; ++u) {
        s[u] = qy->raw[u]*a->scale;
    }
    if (a->softcap != 0.0f) {
        for (int u = 0; u < QK_KIVI; ++u) {
            s[u] = ggml_kvq_capped(s[u], a->softcap);
        }
    }
    kvq_tile_add_mask(s, qy->mask);
    const float tile_max = kvq_tile_max(s);
    if (tile_max == -INFINITY) {
        return false;
    }
    if (tile_max > qy->max) {
        if (qy->max != -INFINITY) {
            const float rescale = expf(qy->max - tile_max);
            ggml_vec_scale_f32((int) a->v.head_dim, qy->acc, rescale);
            qy->sum *= rescale;
        }
        qy->max = tile_max;
    }
    qy->sum += (float) ggml_vec_soft_max_f32(QK_KIVI, qy->w, s, qy->max);
    return true;
}

//
// a group's tile
//

// scores of the group's queries against the tile's quantized cells, its codes decoded a chunk of channels at a time
static void kvq_group_k_tiles(const kvq_attn_args * a, kvq_query ** group, int n_q, int64_t hk, int64_t j0,
                              kvq_scratch * scr) {
    const int64_t head_dim = a->k.head_dim;
    const size_t  bb       = ggml_kvq_block_bytes(a->k_bits);
    const uint8_t * tile = (const uint8_t *) a->k_tiles + (j0/QK_KIVI)*a->k_tiles_nb1 + hk*head_dim*bb;
    kvq_query * need[KVQ_MAX_GROUP];
    float offset[KVQ_MAX_GROUP];
    int n_need = 0;
    for (int g = 0; g < n_q; ++g) {
        const int64_t lo = j0 > a->k.n_sink ? j0 : a->k.n_sink;
        const int64_t hi = j0 + QK_KIVI < group[g]->lim_k ? j0 + QK_KIVI : group[g]->lim_k;
        if (group[g]->live && lo < hi) {
            memset(group[g]->raw, 0, sizeof(group[g]->raw));
            offset[n_need] = 0.0f;
            need[n_need++] = group[g];
        }
    }
    if (n_need == 0) {
        return;
    }
    const float * qd[KVQ_MAX_GROUP];
    float *       raw[KVQ_MAX_GROUP];
    for (int64_t c0 = 0; c0 < head_dim; c0 += KVQ_K_CHUNK) {
        const int64_t n = head_dim - c0 < KVQ_K_CHUNK ? head_dim - c0 : KVQ_K_CHUNK;
        kvq_decode_blocks(tile + c0*bb, bb, a->k_bits, n, scr->codes, scr->d, scr->m);
        for (int g = 0; g < n_need; ++g) {
            // KIVI's factorisation: the per-channel scale goes to the query
            const float * q = need[g]->q + c0;
            for (int64_t c = 0; c < n; ++c) {
                scr->qd[g][c] = q[c]*scr->d[c];
            }
            offset[g] += kvq_dot_offset(q, scr->m, n);
            qd[g]  = scr->qd[g];
            raw[g] = need[g]->raw;
        }
        kvq_rows_fma(n_need, qd, scr->codes, n, raw);
    }
    for (int g = 0; g < n_need; ++g) {
        for (int u = 0; u < QK_KIVI; ++u) {
            need[g]->raw[u] += offset[g];
        }
    }
}

// The tile's cells that live queries of the group may read in fp16 (sinks below sink_end, the window from
// window_begin), as offsets in the tile of n cells
typedef struct {
    int64_t sink_end;
    int64_t window_begin;
} kvq_fp16_cells;

static int64_t kvq_clamp(int64_t x, int64_t lo, int64_t hi) {
    return x < lo ? lo : (x > hi ? hi : x);
}

static kvq_fp16_cells kvq_group_fp16_cells(const kvq_attn_args * a, kvq_query ** group, int n_q, bool v, int64_t j0,
                                           int64_t n) {
    int64_t lim = j0 + n;
    for (int g = 0; g < n_q; ++g) {
        const int64_t lim_g = v ? group[g]->lim_v : group[g]->lim_k;
        if (group[g]->live && lim_g < lim) {
            lim = lim_g;
        }
    }
    const kvq_fp16_cells cells = { kvq_clamp(a->k.n_sink - j0, 0, n), kvq_clamp(lim - j0, 0, n) };
    return cells;
}

// the first of those cells from u on
static int64_t kvq_fp16_next(const kvq_fp16_cells * cells, int64_t u) {
    return u >= cells->sink_end && u < cells->window_begin ? cells->window_begin : u;
}

// whether the query reads the tile's cell u in fp16: it attends the cell (K) or weighs it (v), and the cell is a sink
// or in the query's window
static bool kvq_query_reads_fp16(const kvq_source * src, const kvq_query * qy, bool v, int64_t j0, int64_t u) {
    const int64_t lim     = v ? qy->lim_v : qy->lim_k;
    const bool    attends = v ? qy->w[u] != 0.0f : qy->mask[u] != -INFINITY;
    return qy->live && attends && (j0 + u < src->n_sink || j0 + u >= lim);
}

// the group's fp16 K cells of the tile, each read once, into the scores of the queries that attend it
static void kvq_group_fp16_k(const kvq_attn_args * a, kvq_query ** group, int n_q, int64_t hk, int64_t j0, int64_t n,
                             kvq_scratch * scr) {
    const kvq_fp16_cells cells = kvq_group_fp16_cells(a, group, n_q, false, j0, n);
    for (int64_t u = kvq_fp16_next(&cells, 0); u < n; u = kvq_fp16_next(&cells, u + 1)) {
        bool read = false;
        for (int g = 0; g < n_q; ++g) {
            kvq_query * qy = group[g];
            if (!kvq_query_reads_fp16(&a->k, qy, false, j0, u)) {
                continue;
            }
            if (!read) {
                kvq_read_fp16(&a->k, j0 + u, hk, a->k.head_dim, scr->rows[0]);
                read = true;
            }
            qy->raw[u] = kvq_dot_row(qy->q, scr->rows[0], a->k.head_dim);
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void kvq_rows_mad_lanes(int n_rows, const float * const * rows,
                                                                     const float * w, int64_t c, float * acc, int nv) {
    __m256 s[8];
    for (int v = 0; v < nv; ++v) {
        s[v] = _mm256_loadu_ps(acc + c + 8*v);
    }
    for (int i = 0; i < n_rows; ++i) {
        const __m256 wi = _mm256_set1_ps(w[i]);
        for (int v = 0; v < nv; ++v) {
            s[v] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(rows[i] + c + 8*v), s[v]);
        }
    }
    for (int v = 0; v < nv; ++v) {
        _mm256_storeu_ps(acc + c + 8*v, s[v]);
    }
}
#endif

// acc[c] += w_i rows_i[c] over n_rows rows in order, c < n (a multiple of QK_KIVI): per element and row the one fused
// multiply-add of ggml_vec_mad_f32, so the bits of a row at a time, with acc held in registers over the rows
static void kvq_rows_mad(int n_rows, const float * const * rows, const float * w, int64_t n, float * acc) {
#if defined(__AVX2__) && defined(__FMA__)
    int64_t c = 0;
    for (; c + 2*QK_KIVI <= n; c += 2*QK_KIVI) {
        kvq_rows_mad_lanes(n_rows, rows, w, c, acc, 2*QK_KIVI/8);
    }
    if (c < n) {
        kvq_rows_mad_lanes(n_rows, rows, w, c, acc, QK_KIVI/8);
    }
#else
    for (int i = 0; i < n_rows; ++i) {
        ggml_vec_mad_f32((int) n, acc, rows[i], w[i]);
    }
#endif
}

// The group's fp16 V cells of the tile, each read once, into the outputs of the queries that weigh it, KVQ_FP16_ROWS
// cells at a time. A cell of no weight is skipped, never multiplied: an fp16 row may hold inf, and inf times 0 is NaN.
static void kvq_group_fp16_v(const kvq_attn_args * a, kvq_query ** group, int n_q, int64_t hk, int64_t j0, int64_t n,
                             kvq_scratch * scr) {
    const kvq_fp16_cells cells = kvq_group_fp16_cells(a, group, n_q, true, j0, n);
    int64_t u = kvq_fp16_next(&cells, 0);
    while (u < n) {
        int64_t cell[KVQ_FP16_ROWS];
        int n_rows = 0;
        for (; u < n && n_rows < KVQ_FP16_ROWS; u = kvq_fp16_next(&cells, u + 1)) {
            for (int g = 0; g < n_q; ++g) {
                if (kvq_query_reads_fp16(&a->v, group[g], true, j0, u)) {
                    kvq_read_fp16(&a->v, j0 + u, hk, a->v.head_dim, scr->rows[n_rows]);
                    cell[n_rows++] = u;
                    break;
                }
            }
        }
        for (int g = 0; g < n_q; ++g) {
            const float * rows[KVQ_FP16_ROWS];
            float         w[KVQ_FP16_ROWS];
            int n_w = 0;
            for (int i = 0; i < n_rows; ++i) {
                if (kvq_query_reads_fp16(&a->v, group[g], true, j0, cell[i])) {
                    rows[n_w] = scr->rows[i];
                    w[n_w++]  = group[g]->w[cell[i]];
                }
            }
            if (n_w > 0) {
                kvq_rows_mad(n_w, rows, w, a->v.head_dim, group[g]->acc);
            }
        }
    }
}

// the end of the tile's cells (n from j0) whose V the query reads quantized
static int64_t kvq_v_rows_end(const kvq_query * qy, int64_t j0, int64_t n) {
    return j0 + n < qy->lim_v ? j0 + n : qy->lim_v;
}

// the group's quantized V rows of the tile into its queries' outputs, a block of channels at a time
static void kvq_group_v_rows(const kvq_attn_args * a, kvq_query ** group, int n_q, int64_t hk, int64_t j0, int64_t n,
                             kvq_scratch * scr) {
    const int64_t head_dim_v = a->v.head_dim;
    const size_t  bb         = ggml_kvq_block_bytes(a->v_bits);
    const int64_t lo = j0 > a->v.n_sink ? j0 : a->v.n_sink;
    int64_t hi = lo;
    for (int g = 0; g < n_q; ++g) {
        if (group[g]->live && kvq_v_rows_end(group[g], j0, n) > hi) {
            hi = kvq_v_rows_end(group[g], j0, n);
        }
    }
    if (lo >= hi) {
        return;
    }
    const uint8_t * rows = (const uint8_t *) a->v_rows + lo*a->v_rows_nb1 + hk*head_dim_v/QK_KIVI*bb;
    for (int64_t b = 0; b < head_dim_v/QK_KIVI; ++b) {
        kvq_decode_blocks(rows + b*bb, a->v_rows_nb1, a->v_bits, hi - lo, scr->codes, scr->d, scr->m);
        for (int64_t u = hi - lo; u < QK_KIVI; ++u) {
            scr->d[u] = 0.0f;
            scr->m[u] = 0.0f;
        }
        const float * wd[KVQ_MAX_GROUP];
        float *       acc[KVQ_MAX_GROUP];
        float         bias[KVQ_MAX_GROUP];
        int n_v = 0;
        for (int g = 0; g < n_q; ++g) {
            kvq_query * qy = group[g];
            const int64_t hi_g = kvq_v_rows_end(qy, j0, n);
            if (qy->live && lo < hi_g) {
                bias[n_v] = kvq_query_v_weights(scr->d, scr->m, qy->w + (lo - j0), hi_g - lo, scr->wd[n_v]);
                wd[n_v]   = scr->wd[n_v];
                acc[n_v]  = qy->acc + b*QK_KIVI;
                ++n_v;
            }
        }
        // a query's rows past its own hi_g weigh +0: its sums keep their bits
        kvq_rows_fma(n_v, wd, scr->codes, hi - lo, acc);
        for (int g = 0; g < n_v; ++g) {
            for (int k = 0; k < QK_KIVI; ++k) {
                acc[g][k] += bias[g];
            }
        }
    }
}

#if defined(__AVX2__)
// the 8 x 8 floats at src (rows src_stride apart) transposed to dst (rows dst_stride apart)
static inline void kvq_transpose8(const float * src, int src_stride, float * dst, int dst_stride) {
    __m256 r[8];
    __m256 t[8];
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm256_loadu_ps(src + i*src_stride);
    }
    for (int i = 0; i < 8; i += 2) {
        t[i]     = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i]     = _mm256_shuffle_ps(t[i],     t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm256_shuffle_ps(t[i],     t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(dst + i*dst_stride,       _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4)*dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}
#endif

// the QK_KIVI x QK_KIVI codes of QK_KIVI channel blocks ([channel][cell]) as [cell][channel]
static void kvq_transpose_block(const float * codes, float * cells) {
#if defined(__AVX2__)
    for (int c = 0; c < QK_KIVI; c += 8) {
        for (int u = 0; u < QK_KIVI; u += 8) {
            kvq_transpose8(codes + c*QK_KIVI + u, QK_KIVI, cells + u*QK_KIVI + c, QK_KIVI);
        }
    }
#else
    for (int c = 0; c < QK_KIVI; ++c) {
        for (int u = 0; u < QK_KIVI; ++u) {
            cells[u*QK_KIVI + c] = codes[c*QK_KIVI + u];
        }
    }
#endif
}

// A latent layer's quantized V (the first head_dim_v channels of its K tiles, ggml_kvq_attn_latent) into the group's
// outputs, 32 channels at a time. Per channel, KIVI's factorisation the other way round: the scale and the minimum
// multiply the query's weighted sums of the channel's codes and of its weights; the codes, decoded per channel,
// are turned to rows of cells so that the sums run over channels in vector lanes, as V rows' do.
static void kvq_group_v_tiles(const kvq_attn_args * a, kvq_query ** group, int n_q, int64_t j0, int64_t n,
                              kvq_scratch * scr) {
    const size_t  bb = ggml_kvq_block_bytes(a->k_bits);
    const uint8_t * tile = (const uint8_t *) a->k_tiles + (j0/QK_KIVI)*a->k_tiles_nb1;
    const int64_t lo = j0 > a->k.n_sink ? j0 : a->k.n_sink;
    kvq_query *   need[KVQ_MAX_GROUP];
    const float * w[KVQ_MAX_GROUP];
    float *       cw[KVQ_MAX_GROUP];
    float         w_sum[KVQ_MAX_GROUP];
    int n_need = 0;
    for (int g = 0; g < n_q; ++g) {
        kvq_query * qy = group[g];
        const int64_t hi = kvq_v_rows_end(qy, j0, n);
        if (!qy->live || lo >= hi) {
            continue;
        }
        // the weights of the cells the query reads quantized; a cell of no weight counts nothing
        float * wq = scr->wd[n_need];
        w_sum[n_need] = 0.0f;
        for (int64_t u = 0; u < QK_KIVI; ++u) {
            wq[u] = j0 + u >= lo && j0 + u < hi ? qy->w[u] : 0.0f;
            w_sum[n_need] += wq[u];
        }
        w[n_need]  = wq;
        cw[n_need] = scr->cw[n_need];
        need[n_need++] = qy;
    }
    for (int64_t c0 = 0; c0 < a->v.head_dim && n_need > 0; c0 += QK_KIVI) {
        kvq_decode_blocks(tile + c0*bb, bb, a->k_bits, QK_KIVI, scr->codes, scr->d, scr->m);
        kvq_transpose_block(scr->codes, scr->cells);
        for (int g = 0; g < n_need; ++g) {
            memset(cw[g], 0, QK_KIVI*sizeof(float));
        }
        kvq_rows_fma(n_need, w, scr->cells, QK_KIVI, cw);
        for (int g = 0; g < n_need; ++g) {
            float * acc = need[g]->acc + c0;
            for (int c = 0; c < QK_KIVI; ++c) {
                acc[c] += scr->d[c]*cw[g][c] + scr->m[c]*w_sum[g];
            }
        }
    }
}

// the mask of the tile's n cells for each query (-INFINITY past them); a query is live where it attends one
static bool kvq_group_mask(const kvq_attn_args * a, kvq_query ** group, int n_q, int64_t j0, int64_t n) {
    bool any = false;
    for (int g = 0; g < n_q; ++g) {
        kvq_query * qy = group[g];
        if (g > 0 && group[g - 1]->mask_row == qy->mask_row) {
            // a token's query heads, side by side in the group, share its mask row, padded, and whether it is live
            memcpy(qy->mask, group[g - 1]->mask, sizeof(qy->mask));
            qy->live = group[g - 1]->live;
            continue;
        }
        const int64_t col = a->mask_col0 + j0;
        if (a->mask->type == GGML_TYPE_F16) {
            ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) qy->mask_row + col, qy->mask, n);
        } else {
            memcpy(qy->mask, (const float *) qy->mask_row + col, n*sizeof(float));
        }
        for (int64_t u = n; u < QK_KIVI; ++u) {
            qy->mask[u] = -INFINITY;
        }
        qy->live = kvq_tile_max(qy->mask) != -INFINITY;
        any = any || qy->live;
    }
    return any;
}

static void kvq_group_tile(const kvq_attn_args * a, kvq_query ** group, int n_q, int64_t hk, int64_t j0,
                           kvq_scratch * scr) {
    const int64_t n = a->n_kv - j0 < QK_KIVI ? a->n_kv - j0 : QK_KIVI;
    if (!kvq_group_mask(a, group, n_q, j0, n)) {
        return;
    }
    kvq_group_k_tiles(a, group, n_q, hk, j0, scr);
    kvq_group_fp16_k(a, group, n_q, hk, j0, n, scr);
    for (int g = 0; g < n_q; ++g) {
        if (group[g]->live) {
            group[g]->live = kvq_query_softmax(a, group[g]);
        }
    }
    if (a->latent) {
        kvq_group_v_tiles(a, group, n_q, j0, n, scr);
    } else {
        kvq_group_v_rows(a, group, n_q, hk, j0, n, scr);
    }
    kvq_group_fp16_v(a, group, n_q, hk, j0, n, scr);
}

//
// the batch
//

static void kvq_query_init(const kvq_attn_args * a, kvq_query * qy, int64_t t, int64_t h) {
    const struct ggml_tensor * mask = a->mask;
    const int64_t i   = a->k.first + t;
    const int64_t row = a->t0 + t;
    const float * q_row = (const float *) ((const char *) a->q->data + row*a->q->nb[2] + h*a->q->nb[1]);
    qy->t        = t;
    qy->h        = h;
    qy->lim_k    = ggml_kvq_lim_k(i, a->window);
    qy->lim_v    = a->latent ? qy->lim_k : ggml_kvq_lim_v(i, a->window);
    qy->mask_row = (const char *) mask->data + (row / mask->ne[1])*mask->nb[3] + (row % mask->ne[1])*mask->nb[1];
    qy->max      = -INFINITY;
    qy->sum      = 0.0f;
    // Q in fp16, as upstream's flash attention takes it for f16 K: a window covering the whole context then
    // gives f16 KV's scores, to fp32 rounding (upstream accumulates V in fp16, this kernel in fp32), and ΔPPL
    // against f16 measures the quantization alone
    kvq_round_fp16_row(q_row, a->k.head_dim, qy->q);
    memset(qy->acc, 0, a->v.head_dim*sizeof(float));
}

static void kvq_query_finish(const kvq_attn_args * a, kvq_query * qy, float * out) {
    if (a->sinks != NULL) {
        kvq_query_add_sink(qy, a->sinks[qy->h], a->v.head_dim);
    }
    const float inv = qy->sum > 0.0f ? 1.0f/qy->sum : 0.0f;
    for (int64_t c = 0; c < a->v.head_dim; ++c) {
        out[c] = qy->acc[c]*inv;
    }
}

// a group: query heads [h0, h1) of one KV head, for tokens [t0, t1) of a segment
typedef struct {
    int64_t t0;
    int64_t t1;
    int64_t h0;
    int64_t h1;
} kvq_group_span;

static void kvq_attn_group(const kvq_attn_args * a, kvq_group_span span, float * out, int64_t out_ne0) {
    kvq_query   queries[KVQ_MAX_GROUP];
    kvq_query * group[KVQ_MAX_GROUP];
    kvq_scratch scr;
    const int64_t n_head = a->q->ne[1];
    const int64_t hk     = span.h0 / (n_head/a->n_head_kv);
    int n_q = 0;
    for (int64_t t = span.t0; t < span.t1; ++t) {
        for (int64_t h = span.h0; h < span.h1; ++h) {
            GGML_ASSERT(n_q < KVQ_MAX_GROUP);
            kvq_query_init(a, &queries[n_q], t, h);
            group[n_q] = &queries[n_q];
            ++n_q;
        }
    }
    for (int64_t j0 = 0; j0 < a->n_kv; j0 += QK_KIVI) {
        kvq_group_tile(a, group, n_q, hk, j0, &scr);
    }
    for (int g = 0; g < n_q; ++g) {
        kvq_query_finish(a, group[g], out + ((a->t0 + group[g]->t)*n_head + group[g]->h)*out_ne0);
    }
}

static kvq_attn_args kvq_attn_args_for(const struct ggml_tensor * dst, int64_t seg) {
    const int32_t n_sink  = ggml_get_op_params_i32(dst, 2);
    const int32_t n_seq   = kvq_n_seq(dst);
    const int64_t kv_size = kvq_kv_size(dst);
    const struct ggml_tensor * k_tiles = dst->src[1];
    const bool                 latent  = ggml_kvq_attn_is_latent(dst);
    // a latent layer's V is K's, read through K's tiles, fp16 cells and batch
    const struct ggml_tensor * v_rows  = latent ? k_tiles : dst->src[2];
    const struct ggml_tensor * v_fp16  = latent ? dst->src[3] : dst->src[4];
    const struct ggml_tensor * v_cur   = latent ? dst->src[5] : dst->src[6];
    const struct ggml_tensor * mask    = dst->src[7];
    const int64_t n_tps = kvq_seg_tokens(dst->src[5], n_seq);
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
        /*.v           =*/ kvq_make_source(v_fp16, v_cur, dst->src[8], n_sink, n_seq, kv_size, seg),
        /*.window      =*/ ggml_get_op_params_i32(dst, 1),
        /*.scale       =*/ ggml_get_op_params_f32(dst, 3),
        /*.softcap     =*/ ggml_get_op_params_f32(dst, GGML_KVQ_SOFTCAP_PARAM),
        /*.sinks       =*/ dst->src[9] != NULL ? (const float *) dst->src[9]->data : NULL,
        /*.k_bits      =*/ ggml_kvq_bits(k_tiles->type),
        /*.v_bits      =*/ ggml_kvq_bits(v_rows->type),
        /*.latent      =*/ latent,
    };
    // a latent query reads V's first head_dim_v channels of the one KV head's K rows
    a.v.head_dim = dst->ne[0];
    // tiles [n_embd*QK_KIVI, kv_size/QK_KIVI, n_stream]; V rows contiguous, kv_size per stream
    a.k_tiles = (const char *) k_tiles->data + a.k.stream*(kv_size/QK_KIVI)*k_tiles->nb[1];
    a.v_rows  = latent ? NULL : (const char *) v_rows->data + a.k.stream*kv_size*v_rows->nb[1];
    // a per-stream mask counts cells from the stream's first, a unified cache's from the cache's first
    a.mask_col0 = kvq_mask_all_streams(dst) ? a.k.stream*kv_size : 0;
    a.n_kv      = mask->ne[0] - a.mask_col0 < kv_size ? mask->ne[0] - a.mask_col0 : kv_size;
    GGML_ASSERT(a.n_kv >= a.k.first + n_tps);
    return a;
}

// Many (token, KV head) pairs: groups of a KV head's query heads (KVQ_MAX_GROUP at most) over a run of tokens, as
// long as each thread keeps KVQ_GROUPS_PER_THREAD groups. Threads take the next group as they finish one, as
// upstream's flash attention takes chunks: a thread that runs slower (a busy or an efficiency core) leaves the others
// no wait. The groups go from the last to the first, the costliest first under a causal mask, so those left at the
// end are the cheapest.
static void kvq_attn_dealt(const struct ggml_compute_params * params, struct ggml_tensor * dst, int64_t n_tps,
                           int64_t n_gqa) {
    const int32_t n_seq     = kvq_n_seq(dst);
    const int64_t n_head_kv = dst->src[5]->ne[1];
    const int64_t heads     = n_gqa < KVQ_MAX_GROUP ? n_gqa : KVQ_MAX_GROUP;
    const int64_t chunks    = (n_gqa + heads - 1)/heads;
    const int64_t even      = n_seq*n_tps*n_head_kv*chunks/((int64_t) KVQ_GROUPS_PER_THREAD*params->nth);
    const int64_t tokens    = even < 1 ? 1 : (even < KVQ_MAX_GROUP/heads ? even : KVQ_MAX_GROUP/heads);
    const int64_t per_seg   = (n_tps + tokens - 1)/tokens*n_head_kv*chunks;
    const int64_t n_groups  = n_seq*per_seg;

    if (params->ith == 0) {
        ggml_threadpool_chunk_set(params->threadpool, params->nth);
    }
    ggml_barrier(params->threadpool);

    int64_t seg = -1;
    kvq_attn_args a;
    for (int64_t i = params->ith; i < n_groups; i = ggml_threadpool_chunk_add(params->threadpool, 1)) {
        const int64_t k = n_groups - 1 - i;
        if (k / per_seg != seg) {
            seg = k / per_seg;
            a   = kvq_attn_args_for(dst, seg);
        }
        const int64_t run = k % per_seg / (n_head_kv*chunks);
        const int64_t hk  = k % per_seg / chunks % n_head_kv;
        const int64_t h0  = hk*n_gqa + k % chunks*heads;
        const kvq_group_span span = { run*tokens, run*tokens + tokens < n_tps ? run*tokens + tokens : n_tps,
                                      h0, h0 + heads < (hk + 1)*n_gqa ? h0 + heads : (hk + 1)*n_gqa };
        kvq_attn_group(&a, span, (float *) dst->data, dst->ne[0]);
    }
}

// Few (a decode step of few sequences): each thread takes an equal range of the batch's queries (by segment, token,
// head) and groups the ones of a KV head in it
static void kvq_attn_ranged(const struct ggml_compute_params * params, struct ggml_tensor * dst, int64_t n_tps,
                            int64_t n_gqa) {
    const int64_t n_head = dst->src[0]->ne[1];
    const int64_t total  = kvq_n_seq(dst)*n_tps*n_head;
    const int64_t r1     = total*(params->ith + 1)/params->nth;
    int64_t seg = -1;
    kvq_attn_args a;
    for (int64_t r = total*params->ith/params->nth; r < r1; ) {
        if (r / (n_tps*n_head) != seg) {
            seg = r / (n_tps*n_head);
            a   = kvq_attn_args_for(dst, seg);
        }
        const int64_t t   = r / n_head % n_tps;
        const int64_t h   = r % n_head;
        int64_t       end = (h / n_gqa + 1)*n_gqa;
        end = end < h + KVQ_MAX_GROUP ? end : h + KVQ_MAX_GROUP;
        end = end < h + (r1 - r) ? end : h + (r1 - r);
        const kvq_group_span span = { t, t + 1, h, end };
        kvq_attn_group(&a, span, (float *) dst->data, dst->ne[0]);
        r += end - h;
    }
}

void kvq_attn(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * mask = dst->src[7];
    const int64_t n_tps     = kvq_seg_tokens(dst->src[5], kvq_n_seq(dst));
    const int64_t n_head_kv = dst->src[5]->ne[1];
    GGML_ASSERT(dst->src[5]->ne[0] <= KVQ_MAX_HEAD && dst->ne[0] <= KVQ_MAX_HEAD);
    GGML_ASSERT(mask->ne[1]*mask->ne[3] == dst->src[5]->ne[2]);
    GGML_ASSERT(mask->type == GGML_TYPE_F16 || mask->type == GGML_TYPE_F32);

    const int64_t n_gqa = dst->src[0]->ne[1] / n_head_kv;
    if (kvq_n_seq(dst)*n_tps*n_head_kv < (int64_t) KVQ_GROUPS_PER_THREAD*params->nth) {
        kvq_attn_ranged(params, dst, n_tps, n_gqa);
    } else {
        kvq_attn_dealt(params, dst, n_tps, n_gqa);
    }
}
