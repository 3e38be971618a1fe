// ggml-kvq: the block formats of pykvq's KV-cache types (KIVI, AsymKV).
//
// Every kivi block holds 32 values x = m + d*q with an fp16 scale d, an fp16 minimum m and b-bit codes q
// (asymmetric, q in 0 .. 2^b-1). Codes are stored strided, the same way for every width: the code of
// value i sits in byte (i % nbytes) at bit (i / nbytes) * b, nbytes = 32*b/8. For b = 4 this is exactly
// ggml's q4_1 block, so kivi4 shares q4_1's bytes.
//
// What a block's 32 values are is the KV cache's business: for K, one channel over 32 consecutive tokens
// (a per-channel tile); for V, 32 channels of one token.
#pragma once

#include "ggml.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#define QK_KIVI 32

typedef struct {
    uint16_t d;                 // fp16 scale
    uint16_t m;                 // fp16 minimum
    uint8_t  qs[QK_KIVI * 2 / 8];
} block_kivi2;

typedef struct {
    uint16_t d;
    uint16_t m;
    uint8_t  qs[QK_KIVI * 4 / 8];
} block_kivi4;

typedef struct {
    uint16_t d;
    uint16_t m;
    uint8_t  qs[QK_KIVI * 1 / 8];
} block_kivi1;

// reference (scalar) quantization and dequantization; k must be a multiple of QK_KIVI
GGML_API void quantize_row_kivi2_ref(const float * GGML_RESTRICT x, block_kivi2 * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_kivi4_ref(const float * GGML_RESTRICT x, block_kivi4 * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_kivi1_ref(const float * GGML_RESTRICT x, block_kivi1 * GGML_RESTRICT y, int64_t k);

GGML_API void dequantize_row_kivi2(const block_kivi2 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_kivi4(const block_kivi4 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_kivi1(const block_kivi1 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);

// ggml_quantize_chunk's per-type entry points (no importance matrix: KV data is quantized on the fly)
GGML_API size_t quantize_kivi2(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_kivi4(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_kivi1(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);

// The clip "ratio" that gives each block the range of least squared error instead of a fixed ratio (SKVQ's clipping
// per group): each end of the range moves in by 0, 1, ..., GGML_KVQ_MSE_STEPS times GGML_KVQ_MSE_STEP of its width,
// and the first candidate of least sum of squared errors wins (a tie keeps the wider range). It pays for V's
// per-token groups, whose squared error is what the attention output sees; K's per-channel tiles lose by it (their
// outlier tokens matter more than their bulk).
#define GGML_KVQ_CLIP_MSE  0.0f
#define GGML_KVQ_MSE_STEP  0.04f
#define GGML_KVQ_MSE_STEPS 8

// One block of 32 values with `bits`-bit codes, its range [min, max] first narrowed to [clip*min, clip*max]
// (SKVQ's clipped dynamic quantization, clip in (0, 1]; 1: the plain format; GGML_KVQ_CLIP_MSE: searched), values
// beyond it given the end codes
GGML_API void ggml_kvq_quantize_block(const float * GGML_RESTRICT x, void * GGML_RESTRICT block, int bits, float clip);

// The same with V's dithered rounding: value i's code is floor(t) + 1 when the fraction of t = (x - m)/d reaches a
// threshold drawn from (key + i) (ggml_kvq_dither_threshold) rather than one half; spread16 = 0 rounds to nearest,
// exactly as ggml_kvq_quantize_block
GGML_API void ggml_kvq_quantize_block_dithered(const float * GGML_RESTRICT x, void * GGML_RESTRICT block, int bits,
                                               float clip, int32_t spread16, uint64_t key);

// ggml_validate_row_data for the kivi types: d and m must be finite
GGML_API bool ggml_kvq_validate_row_data(enum ggml_type type, const void * data, size_t nbytes);

// code width of a kivi type, 0 for any other type
static inline int ggml_kvq_bits(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_KIVI2: return 2;
        case GGML_TYPE_KIVI4: return 4;
        case GGML_TYPE_KIVI1: return 1;
        default:              return 0;
    }
}

// bytes of one block of a kivi type with `bits`-bit codes: fp16 d and m, then the codes
static inline size_t ggml_kvq_block_bytes(int bits) {
    return 2*sizeof(uint16_t) + QK_KIVI*bits/8;
}

static inline bool ggml_kvq_is_kivi(enum ggml_type type) {
    return ggml_kvq_bits(type) != 0;
}

//
// GGML_OP_KVQ: the ops of a kivi KV cache layer. The cache holds n_stream streams of kv_size cells, one
// sequence per stream, whose token at position p sits in cell p of its stream.
//
// Storage of one layer, n_embd = n_head_kv*head_dim channels:
//   k_tiles  kivi type, [n_embd*QK_KIVI, kv_size/QK_KIVI, n_stream]: row T of a stream is its tile T (cells
//            T*32 .. T*32+31), one block per channel, channel-major; a tile is written ("sealed") once all
//            of its cells exist
//   v_rows   kivi type, [n_embd, kv_size*n_stream] (or [n_embd, kv_size, n_stream]), contiguous: one row per
//            cell, quantized on write (ggml_kvq_store_v)
//   k_fp16,  F16, [n_embd, n_sink + n_ring, n_stream]: rows 0 .. n_sink-1 hold a stream's sink cells for good;
//   v_fp16   cell c also sits in ring slot n_sink + c % n_ring while it is among the n_ring most recent cells
// The current batch: k_cur, v_cur F32 [head_dim, n_head_kv, n_tokens]; k_idxs I64 [n_tokens], its global
// cells stream*kv_size + cell. The batch is n_seq equal segments (upstream's split_equal), one per stream,
// each in consecutive cells of its stream. The attention's mask is either per stream, [n_kv, n_tokens/n_seq,
// 1, n_seq] over the cells of each segment's stream, or (mask_all_streams: llama.cpp's unified cache, whose
// "streams" are per-sequence regions of one cell range) one plane [n_kv, n_tokens, 1, 1] over the global
// cells. K from the batch is rounded to fp16 wherever it is read, so that results do not depend on how
// tokens were batched.
//

enum ggml_kvq_op {
    GGML_KVQ_OP_SEAL_K    = 0,
    GGML_KVQ_OP_ATTN      = 1,
    GGML_KVQ_OP_RING_PUT  = 2,
    GGML_KVQ_OP_WIDE      = 3,
    GGML_KVQ_OP_WIDE_MASK = 4,
    GGML_KVQ_OP_SCORE_LSE = 5,
    GGML_KVQ_OP_SCORE_ADD = 6,
    GGML_KVQ_OP_STORE_V   = 7,
    GGML_KVQ_OP_STORE     = 8,
};

// the op param (F32) that holds SEAL_K's and STORE_V's clip ratio, and STORE's for K
#define GGML_KVQ_CLIP_PARAM 7
// the op param (F32) that holds ATTN's logit soft-cap (0: none)
#define GGML_KVQ_SOFTCAP_PARAM 8
// the op param (F32) that holds STORE's clip ratio for V (its K's at GGML_KVQ_CLIP_PARAM)
#define GGML_KVQ_CLIP_V_PARAM 9
// the op params of STORE_V's and STORE's V rounding (ggml_kvq_store_set_v_dither): its spread (F32, 0: nearest),
// the layer, the cells of a sequence's part and the period of the draws in it (I32)
#define GGML_KVQ_V_SPREAD_PARAM 10
#define GGML_KVQ_V_LAYER_PARAM  11
#define GGML_KVQ_V_PART_PARAM   12
#define GGML_KVQ_V_PERIOD_PARAM 13

// the contract's arithmetic below is shared by the CPU and the CUDA kernels
#ifdef __CUDACC__
#define GGML_KVQ_HOST_DEVICE __host__ __device__
#else
#define GGML_KVQ_HOST_DEVICE
#endif

//
// V's dithered rounding. Rounded to nearest, identical tokens get identical V codes, hence identical errors, which
// add up rather than average out where attention spreads over repeated content. Dithered, a value's code is
// floor(t) + 1 when the fraction of t reaches a threshold drawn uniformly from [1/2 - spread/2, 1/2 + spread/2]
// (spread 1: stochastic rounding, unbiased; 0: nearest), the draw a hash of (layer, the cell's index in its
// sequence's part modulo a period, channel): deterministic, the same whatever the cache's layout and on every
// backend. The period is the part's size, except in a sliding-window cache: its parts drop whole rings of cells from
// the front, so the draws repeat every ring there, and a token keeps its draw whenever and however often its part
// dropped before it came. The arithmetic is integer so that every backend draws the same codes; spread16 is the
// spread in 1/65536ths.
//

static inline GGML_KVQ_HOST_DEVICE int32_t ggml_kvq_spread16(float spread) {
    return (int32_t) (spread*65536.0f + 0.5f);
}

// value `channel` of the V row of the cell `pos` cells into its sequence's part, in `layer`
static inline GGML_KVQ_HOST_DEVICE uint64_t ggml_kvq_dither_key(int32_t layer, int64_t pos, int64_t channel) {
    return (uint64_t) layer << 48 | (uint64_t) pos << 20 | (uint64_t) channel;
}

// the threshold, in 1/2^24ths, that a key's fraction must reach to round up
static inline GGML_KVQ_HOST_DEVICE int64_t ggml_kvq_dither_threshold(int32_t spread16, uint64_t key) {
    uint64_t h = key;
    h ^= h >> 33; h *= 0xff51afd7ed558ccdULL; h ^= h >> 33; h *= 0xc4ceb9fe1a85ec53ULL; h ^= h >> 33;
    const int64_t offset = (int64_t) (h >> 40) - (1 << 23);
    return (1 << 23) - offset*spread16/65536;
}

// V's dither as a STORE_V or STORE node holds it (ggml_kvq_store_set_v_dither; all 0 when not set: nearest)
struct ggml_kvq_v_dither {
    int32_t spread16;
    int32_t layer;
    int32_t part_cells;
    int32_t period;
};

static inline struct ggml_kvq_v_dither ggml_kvq_store_v_dither(const struct ggml_tensor * store) {
    float spread;
    memcpy(&spread, &store->op_params[GGML_KVQ_V_SPREAD_PARAM], sizeof(spread));
    const struct ggml_kvq_v_dither dither = { ggml_kvq_spread16(spread), store->op_params[GGML_KVQ_V_LAYER_PARAM],
                                              store->op_params[GGML_KVQ_V_PART_PARAM],
                                              store->op_params[GGML_KVQ_V_PERIOD_PARAM] };
    return dither;
}

// the key of the block that starts at `channel` of V row `row` (0 when not dithered)
static inline GGML_KVQ_HOST_DEVICE uint64_t ggml_kvq_v_dither_key(struct ggml_kvq_v_dither dither, int64_t row,
                                                                  int64_t channel) {
    return dither.spread16 == 0 ? 0
                                : ggml_kvq_dither_key(dither.layer, row % dither.part_cells % dither.period, channel);
}

// the code of t (already clamped to [0, qmax]) under that threshold; t's fraction taken exactly
static inline GGML_KVQ_HOST_DEVICE int ggml_kvq_dithered_code(float t, int qmax, int32_t spread16, uint64_t key) {
    const float   whole = floorf(t);
    const int64_t frac  = (int64_t) ((t - whole)*16777216.0f);
    const int     q     = (int) whole + (frac >= ggml_kvq_dither_threshold(spread16, key) ? 1 : 0);
    return q < qmax ? q : qmax;
}

// The attention contract per query at cell i: K below ggml_kvq_lim_k and V below ggml_kvq_lim_v are read
// quantized, unless sinks (cells below n_sink)
static inline GGML_KVQ_HOST_DEVICE int64_t ggml_kvq_lim_v(int64_t i, int32_t window) {
    return i - window + 1;
}

static inline GGML_KVQ_HOST_DEVICE int64_t ggml_kvq_lim_k(int64_t i, int32_t window) {
    const int64_t own_tile = i/QK_KIVI*QK_KIVI;
    return ggml_kvq_lim_v(i, window) < own_tile ? ggml_kvq_lim_v(i, window) : own_tile;
}

//
// Prefill through flash attention. Queries of one segment read a cell j in one of three ways (K/V): A
// quantized/quantized (j below the query's lim_k, or a sink, in fp16), B fp16/quantized (j between lim_k and
// lim_v), C fp16/fp16. The "wide" cells of a segment lay these out side by side, each cell once per way
// some query of the segment reads it: A = cells 0 .. n_kv-1, B = n_tps + QK_KIVI cells from the first
// query's lim_k, C = n_tps + window cells from its lim_v (bounds: a query's lim_k and lim_v grow with it),
// padded with zeros to a multiple of 256. K and V expanded to F16 wide cells (ggml_kvq_wide) and a mask
// that shows each query each cell once, the way it reads it (ggml_kvq_wide_mask), make upstream's flash
// attention compute exactly the contract with its tensor-core kernels, up to rounding the dequantized
// values to fp16.
//
struct ggml_kvq_wide_layout {
    int64_t n_a;
    int64_t n_b;
    int64_t n_c;
    int64_t n_wide;
};

static inline GGML_KVQ_HOST_DEVICE struct ggml_kvq_wide_layout ggml_kvq_wide_layout_for(int64_t n_kv, int64_t n_tps, int32_t window) {
    struct ggml_kvq_wide_layout l = { n_kv, n_tps + QK_KIVI, n_tps + window, 0 };
    l.n_wide = (l.n_a + l.n_b + l.n_c + 255)/256*256;
    return l;
}

// the first cell of the B and the C block of a segment whose first query sits at cell `first`
static inline GGML_KVQ_HOST_DEVICE int64_t ggml_kvq_wide_b0(int64_t first, int32_t window, int32_t n_sink) {
    return ggml_kvq_lim_k(first, window) > n_sink ? ggml_kvq_lim_k(first, window) : n_sink;
}

static inline GGML_KVQ_HOST_DEVICE int64_t ggml_kvq_wide_c0(int64_t first, int32_t window, int32_t n_sink) {
    return ggml_kvq_lim_v(first, window) > n_sink ? ggml_kvq_lim_v(first, window) : n_sink;
}

// the wide column through which query i reads cell j (0 <= j <= i, j < n_kv)
static inline GGML_KVQ_HOST_DEVICE int64_t ggml_kvq_wide_col(const struct ggml_kvq_wide_layout * l, int64_t first,
        int64_t i, int64_t j, int32_t window, int32_t n_sink) {
    if (j < n_sink || j < ggml_kvq_lim_k(i, window)) {
        return j;
    }
    if (j < ggml_kvq_lim_v(i, window)) {
        return l->n_a + j - ggml_kvq_wide_b0(first, window, n_sink);
    }
    return l->n_a + l->n_b + j - ggml_kvq_wide_c0(first, window, n_sink);
}

// n_ring must cover max(window, QK_KIVI) cells; this is the smallest multiple of QK_KIVI that does
GGML_API int32_t ggml_kvq_ring_size(int32_t window);

// quantize every K tile that the batch completes, each channel's range clipped by `clip` (ggml_kvq_quantize_block);
// returns k_tiles (as a view, for ordering)
GGML_API struct ggml_tensor * ggml_kvq_seal_k(
        struct ggml_context * ctx,
        struct ggml_tensor  * k_tiles,
        struct ggml_tensor  * k_fp16,
        struct ggml_tensor  * k_cur,
        struct ggml_tensor  * k_idxs,
        int32_t               n_sink,
        int32_t               n_seq,
        float                 clip);

// quantize the rows of v F32 [n_embd, n] into rows idxs I64 [n] of v_rows (a kivi type, [n_embd, rows]), each
// 32-channel group's range clipped by `clip`: ggml_set_rows with SKVQ's clipping; returns v_rows (as a view)
GGML_API struct ggml_tensor * ggml_kvq_store_v(
        struct ggml_context * ctx,
        struct ggml_tensor  * v_rows,
        struct ggml_tensor  * v,
        struct ggml_tensor  * idxs,
        float                 clip);

// a decode step's K and V into the cache in one op, one token per segment (k_cur->ne[2] == n_seq): SEAL_K, STORE_V
// (v_cur's rows into rows v_idxs of v_rows) and both RING_PUTs, byte for byte. Its ring writes need not wait for the
// attention: the slot a token takes held the cell n_ring back, which the token's query reads quantized (n_ring
// covers the window and a whole tile). v_rows, v_fp16, v_cur and v_idxs all NULL: K alone (SEAL_K and its RING_PUT),
// for a latent layer (ggml_kvq_attn_latent). Returns k_tiles (as a view, for ordering).
GGML_API struct ggml_tensor * ggml_kvq_store(
        struct ggml_context * ctx,
        struct ggml_tensor  * k_tiles,
        struct ggml_tensor  * v_rows,
        struct ggml_tensor  * k_fp16,
        struct ggml_tensor  * v_fp16,
        struct ggml_tensor  * k_cur,
        struct ggml_tensor  * v_cur,
        struct ggml_tensor  * k_idxs,
        struct ggml_tensor  * v_idxs,
        int32_t               n_sink,
        int32_t               n_seq,
        float                 clip_k,
        float                 clip_v);

// V's dithered rounding for a STORE_V or STORE node of `layer` (see ggml_kvq_dithered_code): spread in [0, 1] (0, the
// default: nearest); the cell a row lands in is its index modulo part_cells (a stream, or a unified cache's region),
// and its draw repeats every `period` cells of it (part_cells, or a sliding-window cache's ring)
GGML_API void ggml_kvq_store_set_v_dither(struct ggml_tensor * store, float spread, int32_t layer, int64_t part_cells,
                                          int64_t period);

// attention of q [head_dim, n_head, n_tokens] over cells 0 .. n_kv-1 of its stream (n_kv = mask->ne[0]), reading the
// quantized tiles and rows directly. Query at cell i attends cell j through its fp16 value when
// i - j < window, j < n_sink, or (K only) j lies in i's own tile; through the quantized value otherwise.
// Returns F32 [head_dim_v, n_head, n_tokens].
GGML_API struct ggml_tensor * ggml_kvq_attn(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k_tiles,
        struct ggml_tensor  * v_rows,
        struct ggml_tensor  * k_fp16,
        struct ggml_tensor  * v_fp16,
        struct ggml_tensor  * k_cur,
        struct ggml_tensor  * v_cur,
        struct ggml_tensor  * mask,
        struct ggml_tensor  * k_idxs,
        int32_t               window,
        int32_t               n_sink,
        float                 scale,
        int32_t               n_seq,
        bool                  mask_all_streams);

// Multi-head latent attention (DeepSeek's MLA as llama.cpp runs it, absorbed: one KV head whose V is the first
// head_dim_v channels of its K): ggml_kvq_attn over a cache that holds no V, each cell's V read exactly as its K is
// read, from the K tiles (quantized) or the fp16 cells; V's window is K's (lim_v = lim_k). A tile's V part is
// weighed through its per-channel scales and minimums (sum_u w_u (m_c + d_c q_uc) = m_c sum_u w_u + d_c sum_u w_u
// q_uc), so the cache keeps one copy of the latent. Returns F32 [head_dim_v, n_head, n_tokens]; src[2], src[4] and
// src[6] (V's rows, fp16 cells and batch) are NULL.
GGML_API struct ggml_tensor * ggml_kvq_attn_latent(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k_tiles,
        struct ggml_tensor  * k_fp16,
        struct ggml_tensor  * k_cur,
        struct ggml_tensor  * mask,
        struct ggml_tensor  * k_idxs,
        int64_t               head_dim_v,
        int32_t               window,
        int32_t               n_sink,
        float                 scale,
        int32_t               n_seq,
        bool                  mask_all_streams);

static inline bool ggml_kvq_attn_is_latent(const struct ggml_tensor * attn) {
    return attn->src[2] == NULL;
}

// logit soft-capping (Gemma 2) for an ATTN node, as upstream's flash attention takes it: each score, once scaled,
// becomes softcap*tanh(score/softcap) before the mask is added; 0 turns it off
GGML_API void ggml_kvq_attn_set_softcap(struct ggml_tensor * attn, float softcap);

// learned attention sinks (gpt-oss) for an ATTN node, as upstream's flash attention takes them: sinks F32
// [n_head], one more logit in each head's softmax, whose value is zero; NULL: none
GGML_API void ggml_kvq_attn_set_sinks(struct ggml_tensor * attn, struct ggml_tensor * sinks);

// the score of one query and cell as the kernels take it into the softmax
static inline GGML_KVQ_HOST_DEVICE float ggml_kvq_capped(float scaled, float softcap) {
    return softcap != 0.0f ? softcap*tanhf(scaled/softcap) : scaled;
}

// store the batch's fp16 values (sinks and ring); `after` is only an ordering dependency (the attention
// that must read the ring before it changes)
GGML_API struct ggml_tensor * ggml_kvq_ring_put(
        struct ggml_context * ctx,
        struct ggml_tensor  * fp16,
        struct ggml_tensor  * cur,
        struct ggml_tensor  * k_idxs,
        struct ggml_tensor  * after,
        int32_t               n_sink,
        int32_t               n_seq,
        int64_t               kv_size);

// K (k_sealed from ggml_kvq_seal_k) or V (v_stored, the V rows after ggml_kvq_store_v) of each segment as F16 wide
// cells [n_embd, n_wide, n_seq]; n_kv: the cells of a stream block A covers
GGML_API struct ggml_tensor * ggml_kvq_wide(
        struct ggml_context * ctx,
        struct ggml_tensor  * quantized,
        struct ggml_tensor  * fp16,
        struct ggml_tensor  * cur,
        struct ggml_tensor  * k_idxs,
        int32_t               window,
        int32_t               n_sink,
        int32_t               n_seq,
        int64_t               kv_size,
        int64_t               n_kv);

// the mask over the wide cells, F16 [n_wide, n_tokens/n_seq, 1, n_seq], from llama.cpp's mask (per stream or
// over all cells, as for ggml_kvq_attn)
GGML_API struct ggml_tensor * ggml_kvq_wide_mask(
        struct ggml_context * ctx,
        struct ggml_tensor  * mask,
        struct ggml_tensor  * k_idxs,
        int32_t               window,
        int32_t               n_sink,
        int32_t               n_seq,
        int64_t               kv_size,
        bool                  mask_all_streams,
        int64_t               n_kv);

//
// Attention mass for MiniKV's selection: how much attention each cached cell receives during prefill, summed
// over the queries and the query heads that share its KV head. The two ops read what the flash-attention
// prefill reads (K as wide cells and the wide mask: each query sees each cell once, the way the contract reads
// it), whichever path computes the attention itself, and never hold more than one query row of scores: first
// each row's log-sum-exp, then each cell's probabilities, recomputed, summed by the cell's owner.
// n_observe > 0 restricts the scoring queries to each segment's last n_observe (SnapKV's observation window: the
// prompt's end, where a question is, rather than the whole prompt); 0 takes every query.
//

// the first query row of a segment of n_tps tokens that scores
static inline GGML_KVQ_HOST_DEVICE int64_t ggml_kvq_score_first_row(int64_t n_tps, int32_t n_observe) {
    return n_observe > 0 && n_observe < n_tps ? n_tps - n_observe : 0;
}

// log-sum-exp of each query row over its visible wide cells: F32 [n_head, n_tokens], -INFINITY for a row that
// sees nothing or does not score (n_observe). q F32 [head_dim, n_head, n_tokens]; k_wide F16 [n_head_kv*head_dim,
// n_wide, n_seq] (ggml_kvq_wide of K); wide_mask F16 [n_wide, n_tokens/n_seq, 1, n_seq] (ggml_kvq_wide_mask). Q is
// taken in fp16, as by the attention.
GGML_API struct ggml_tensor * ggml_kvq_score_lse(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k_wide,
        struct ggml_tensor  * wide_mask,
        int32_t               n_observe,
        float                 scale);

// scores F32 [kv_size, n_head_kv, n_stream] += the attention probabilities cells 0 .. n_kv-1 of each segment's
// stream receive from the segment's scoring queries (lse from ggml_kvq_score_lse of the same inputs and n_observe);
// returns scores (as a view, for ordering). window, n_sink, n_kv: those of the wide cells.
GGML_API struct ggml_tensor * ggml_kvq_score_add(
        struct ggml_context * ctx,
        struct ggml_tensor  * scores,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k_wide,
        struct ggml_tensor  * wide_mask,
        struct ggml_tensor  * lse,
        struct ggml_tensor  * k_idxs,
        int32_t               window,
        int32_t               n_sink,
        int64_t               n_kv,
        int32_t               n_observe,
        float                 scale);

// the wide column through which the queries of a segment starting at `first` may read cell j by way `way`
// (0: A, 1: B, 2: C), or -1 when no query of the segment reads it that way
static inline GGML_KVQ_HOST_DEVICE int64_t ggml_kvq_wide_col_of_way(const struct ggml_kvq_wide_layout * l, int64_t first,
        int64_t j, int way, int32_t window, int32_t n_sink) {
    int64_t off;
    switch (way) {
        case 0:  return j < l->n_a ? j : -1;
        case 1:  off = j - ggml_kvq_wide_b0(first, window, n_sink); return off >= 0 && off < l->n_b ? l->n_a + off : -1;
        default: off = j - ggml_kvq_wide_c0(first, window, n_sink); return off >= 0 && off < l->n_c ? l->n_a + l->n_b + off : -1;
    }
}

#ifdef __cplusplus
}
#endif
