// Graph constructors of GGML_OP_KVQ (see ggml-kvq.h); the CPU kernels are in kvq-cpu*.c.

#include "ggml-kvq.h"
#include "ggml-impl.h"

int32_t ggml_kvq_ring_size(int32_t window) {
    const int32_t cells = window > QK_KIVI ? window : QK_KIVI;
    return (cells + QK_KIVI - 1)/QK_KIVI*QK_KIVI;
}

static int32_t kvq_n_embd(const struct ggml_tensor * cur) {
    return (int32_t) (cur->ne[0]*cur->ne[1]);
}

static void kvq_check_batch(const struct ggml_tensor * fp16, const struct ggml_tensor * cur,
                            const struct ggml_tensor * k_idxs, int32_t n_sink, int32_t n_seq) {
    GGML_ASSERT(fp16->type == GGML_TYPE_F16 && ggml_is_contiguous(fp16) && fp16->ne[3] == 1);
    GGML_ASSERT(n_seq >= 1 && n_seq <= fp16->ne[2] && cur->ne[2] % n_seq == 0);
    GGML_ASSERT(cur->type == GGML_TYPE_F32 && cur->nb[0] == sizeof(float));
    GGML_ASSERT(k_idxs->type == GGML_TYPE_I64 && k_idxs->ne[0] == cur->ne[2]);
    GGML_ASSERT(fp16->ne[0] == kvq_n_embd(cur));
    GGML_ASSERT(n_sink >= 0 && fp16->ne[1] > n_sink && (fp16->ne[1] - n_sink) % QK_KIVI == 0);
}

static void kvq_check_seal(const struct ggml_tensor * k_tiles, const struct ggml_tensor * k_fp16,
                           const struct ggml_tensor * k_cur, const struct ggml_tensor * k_idxs, int32_t n_sink,
                           int32_t n_seq, float clip) {
    GGML_ASSERT(ggml_kvq_is_kivi(k_tiles->type) && ggml_is_contiguous(k_tiles));
    GGML_ASSERT(clip >= GGML_KVQ_CLIP_MSE && clip <= 1.0f);
    GGML_ASSERT(k_tiles->ne[0] == (int64_t) kvq_n_embd(k_cur)*QK_KIVI);
    GGML_ASSERT(k_tiles->ne[2] == k_fp16->ne[2] && k_tiles->ne[3] == 1);
    kvq_check_batch(k_fp16, k_cur, k_idxs, n_sink, n_seq);
}

// n_rows rows of n_embd channels into rows idxs of v_rows
static void kvq_check_v_rows(const struct ggml_tensor * v_rows, int64_t n_embd, const struct ggml_tensor * idxs,
                             int64_t n_rows, float clip) {
    GGML_ASSERT(ggml_kvq_is_kivi(v_rows->type) && ggml_is_contiguous(v_rows) && ggml_n_dims(v_rows) <= 2);
    GGML_ASSERT(n_embd == v_rows->ne[0] && n_embd % QK_KIVI == 0);
    GGML_ASSERT(idxs->type == GGML_TYPE_I64 && ggml_is_contiguous(idxs) && idxs->ne[0] == n_rows);
    GGML_ASSERT(clip >= GGML_KVQ_CLIP_MSE && clip <= 1.0f);
}

// op params: { op, window, n_sink, scale, n_seq, kv_size, mask_all_streams }; SEAL_K's and STORE_V's clip at
// GGML_KVQ_CLIP_PARAM
static void kvq_set_params(struct ggml_tensor * t, enum ggml_kvq_op op, int32_t window, int32_t n_sink, float scale,
                           int32_t n_seq, int64_t kv_size, bool mask_all_streams) {
    GGML_ASSERT(kv_size > 0 && kv_size <= INT32_MAX && kv_size % QK_KIVI == 0);
    int32_t params[7] = { op, window, n_sink, 0, n_seq, (int32_t) kv_size, mask_all_streams };
    memcpy(&params[3], &scale, sizeof(float));
    ggml_set_op_params(t, params, sizeof(params));
    t->op = GGML_OP_KVQ;
}

struct ggml_tensor * ggml_kvq_seal_k(
        struct ggml_context * ctx,
        struct ggml_tensor  * k_tiles,
        struct ggml_tensor  * k_fp16,
        struct ggml_tensor  * k_cur,
        struct ggml_tensor  * k_idxs,
        int32_t               n_sink,
        int32_t               n_seq,
        float                 clip) {
    kvq_check_seal(k_tiles, k_fp16, k_cur, k_idxs, n_sink, n_seq, clip);

    struct ggml_tensor * result = ggml_view_tensor(ctx, k_tiles);
    kvq_set_params(result, GGML_KVQ_OP_SEAL_K, 0, n_sink, 0.0f, n_seq, k_tiles->ne[1]*QK_KIVI, false);
    ggml_set_op_params_f32(result, GGML_KVQ_CLIP_PARAM, clip);
    result->src[0] = k_tiles;
    result->src[1] = k_fp16;
    result->src[2] = k_cur;
    result->src[3] = k_idxs;
    return result;
}

struct ggml_tensor * ggml_kvq_store_v(
        struct ggml_context * ctx,
        struct ggml_tensor  * v_rows,
        struct ggml_tensor  * v,
        struct ggml_tensor  * idxs,
        float                 clip) {
    GGML_ASSERT(v->type == GGML_TYPE_F32 && v->nb[0] == sizeof(float) && ggml_n_dims(v) <= 2);
    kvq_check_v_rows(v_rows, v->ne[0], idxs, v->ne[1], clip);

    struct ggml_tensor * result = ggml_view_tensor(ctx, v_rows);
    int32_t params[GGML_KVQ_CLIP_PARAM + 1] = { GGML_KVQ_OP_STORE_V };
    ggml_set_op_params(result, params, sizeof(params));
    ggml_set_op_params_f32(result, GGML_KVQ_CLIP_PARAM, clip);
    result->op     = GGML_OP_KVQ;
    result->src[0] = v_rows;
    result->src[1] = v;
    result->src[2] = idxs;
    return result;
}

struct ggml_tensor * ggml_kvq_store(
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
        float                 clip_v) {
    kvq_check_seal(k_tiles, k_fp16, k_cur, k_idxs, n_sink, n_seq, clip_k);
    // one token per segment
    GGML_ASSERT(k_cur->ne[2] == n_seq);
    const bool has_v = v_rows != NULL;
    GGML_ASSERT((v_fp16 != NULL) == has_v && (v_cur != NULL) == has_v && (v_idxs != NULL) == has_v);
    if (has_v) {
        kvq_check_batch(v_fp16, v_cur, k_idxs, n_sink, n_seq);
        // V's rows are its heads side by side
        GGML_ASSERT(v_cur->ne[2] == n_seq && v_cur->nb[1] == v_cur->ne[0]*sizeof(float));
        kvq_check_v_rows(v_rows, kvq_n_embd(v_cur), v_idxs, n_seq, clip_v);
        GGML_ASSERT(v_fp16->ne[1] == k_fp16->ne[1] && v_fp16->ne[2] == k_fp16->ne[2]);
    }

    struct ggml_tensor * result = ggml_view_tensor(ctx, k_tiles);
    kvq_set_params(result, GGML_KVQ_OP_STORE, 0, n_sink, 0.0f, n_seq, k_tiles->ne[1]*QK_KIVI, false);
    ggml_set_op_params_f32(result, GGML_KVQ_CLIP_PARAM, clip_k);
    ggml_set_op_params_f32(result, GGML_KVQ_CLIP_V_PARAM, clip_v);
    result->src[0] = k_tiles;
    result->src[1] = k_fp16;
    result->src[2] = k_cur;
    result->src[3] = k_idxs;
    result->src[4] = v_rows;
    result->src[5] = v_fp16;
    result->src[6] = v_cur;
    result->src[7] = v_idxs;
    return result;
}

void ggml_kvq_store_set_v_dither(struct ggml_tensor * store, float spread, int32_t layer, int64_t part_cells,
        int64_t period) {
    GGML_ASSERT(store->op == GGML_OP_KVQ);
    const int32_t op = ggml_get_op_params_i32(store, 0);
    GGML_ASSERT(op == GGML_KVQ_OP_STORE_V || (op == GGML_KVQ_OP_STORE && store->src[4] != NULL));
    GGML_ASSERT(spread >= 0.0f && spread <= 1.0f);
    // the key's fields (ggml_kvq_dither_key): 16 bits of layer, 28 of cell, 20 of channel
    GGML_ASSERT(layer >= 0 && layer < (1 << 16) && part_cells > 0 && part_cells <= (1 << 28));
    GGML_ASSERT(period > 0 && period <= part_cells);
    GGML_ASSERT(store->src[op == GGML_KVQ_OP_STORE ? 4 : 0]->ne[0] <= (1 << 20));
    ggml_set_op_params_f32(store, GGML_KVQ_V_SPREAD_PARAM, spread);
    ggml_set_op_params_i32(store, GGML_KVQ_V_LAYER_PARAM, layer);
    ggml_set_op_params_i32(store, GGML_KVQ_V_PART_PARAM, (int32_t) part_cells);
    ggml_set_op_params_i32(store, GGML_KVQ_V_PERIOD_PARAM, (int32_t) period);
}

// the ATTN node over K's tiles, fp16 cells and batch, with an output of head_dim_v channels a head; V's sources are
// the caller's (none for a latent layer)
static struct ggml_tensor * kvq_attn_node(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k_tiles,
        struct ggml_tensor * k_fp16, struct ggml_tensor * k_cur, struct ggml_tensor * mask, struct ggml_tensor * k_idxs,
        int64_t head_dim_v, int32_t window, int32_t n_sink, float scale, int32_t n_seq, bool mask_all_streams) {
    GGML_ASSERT(q->type == GGML_TYPE_F32 && q->nb[0] == sizeof(float));
    GGML_ASSERT(q->ne[0] == k_cur->ne[0] && q->ne[2] == k_cur->ne[2] && q->ne[1] % k_cur->ne[1] == 0);
    GGML_ASSERT(ggml_kvq_is_kivi(k_tiles->type) && ggml_is_contiguous(k_tiles));
    GGML_ASSERT(k_tiles->ne[0] == (int64_t) kvq_n_embd(k_cur)*QK_KIVI && k_tiles->ne[2] == k_fp16->ne[2]);
    GGML_ASSERT(mask->type == GGML_TYPE_F16 || mask->type == GGML_TYPE_F32);
    const int64_t kv_size = k_tiles->ne[1]*QK_KIVI;
    // one mask plane per segment over its stream's cells, or one plane for the whole batch over all cells; a
    // unified cache's cells may outnumber its regions' (n_ctx not a multiple of n_seq_max*32): the kernels read
    // a region's columns only
    GGML_ASSERT(mask->ne[2] == 1 && mask->ne[1]*mask->ne[3] == q->ne[2]);
    GGML_ASSERT(mask_all_streams ? mask->ne[3] == 1 : mask->ne[3] == n_seq && mask->ne[0] <= kv_size);
    GGML_ASSERT(window >= 0);
    kvq_check_batch(k_fp16, k_cur, k_idxs, n_sink, n_seq);
    GGML_ASSERT(k_fp16->ne[1] - n_sink >= ggml_kvq_ring_size(window));

    struct ggml_tensor * result = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, head_dim_v, q->ne[1], q->ne[2]);
    kvq_set_params(result, GGML_KVQ_OP_ATTN, window, n_sink, scale, n_seq, kv_size, mask_all_streams);
    result->src[0] = q;
    result->src[1] = k_tiles;
    result->src[3] = k_fp16;
    result->src[5] = k_cur;
    result->src[7] = mask;
    result->src[8] = k_idxs;
    return result;
}

struct ggml_tensor * ggml_kvq_attn(
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
        bool                  mask_all_streams) {
    GGML_ASSERT(v_cur->ne[1] == k_cur->ne[1] && v_cur->ne[2] == k_cur->ne[2]);
    GGML_ASSERT(ggml_kvq_is_kivi(v_rows->type) && ggml_is_contiguous(v_rows) && v_rows->ne[0] == kvq_n_embd(v_cur));
    GGML_ASSERT(ggml_nrows(v_rows) == k_tiles->ne[1]*QK_KIVI*k_fp16->ne[2]);
    kvq_check_batch(v_fp16, v_cur, k_idxs, n_sink, n_seq);
    GGML_ASSERT(v_fp16->ne[1] == k_fp16->ne[1] && v_fp16->ne[2] == k_fp16->ne[2]);

    struct ggml_tensor * result = kvq_attn_node(ctx, q, k_tiles, k_fp16, k_cur, mask, k_idxs, v_cur->ne[0], window,
                                                n_sink, scale, n_seq, mask_all_streams);
    result->src[2] = v_rows;
    result->src[4] = v_fp16;
    result->src[6] = v_cur;
    return result;
}

struct ggml_tensor * ggml_kvq_attn_latent(
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
        bool                  mask_all_streams) {
    GGML_ASSERT(k_cur->ne[1] == 1);
    GGML_ASSERT(head_dim_v > 0 && head_dim_v % QK_KIVI == 0 && head_dim_v <= k_cur->ne[0]);
    return kvq_attn_node(ctx, q, k_tiles, k_fp16, k_cur, mask, k_idxs, head_dim_v, window, n_sink, scale, n_seq,
                         mask_all_streams);
}

void ggml_kvq_attn_set_softcap(struct ggml_tensor * attn, float softcap) {
    GGML_ASSERT(attn->op == GGML_OP_KVQ && ggml_get_op_params_i32(attn, 0) == GGML_KVQ_OP_ATTN);
    GGML_ASSERT(softcap >= 0.0f && isfinite(softcap));
    ggml_set_op_params_f32(attn, GGML_KVQ_SOFTCAP_PARAM, softcap);
}

void ggml_kvq_attn_set_sinks(struct ggml_tensor * attn, struct ggml_tensor * sinks) {
    GGML_ASSERT(attn->op == GGML_OP_KVQ && ggml_get_op_params_i32(attn, 0) == GGML_KVQ_OP_ATTN);
    GGML_ASSERT(sinks == NULL || (sinks->type == GGML_TYPE_F32 && ggml_is_contiguous(sinks) &&
                                  ggml_nelements(sinks) == attn->src[0]->ne[1]));
    attn->src[9] = sinks;
}

struct ggml_tensor * ggml_kvq_ring_put(
        struct ggml_context * ctx,
        struct ggml_tensor  * fp16,
        struct ggml_tensor  * cur,
        struct ggml_tensor  * k_idxs,
        struct ggml_tensor  * after,
        int32_t               n_sink,
        int32_t               n_seq,
        int64_t               kv_size) {
    kvq_check_batch(fp16, cur, k_idxs, n_sink, n_seq);

    struct ggml_tensor * result = ggml_view_tensor(ctx, fp16);
    kvq_set_params(result, GGML_KVQ_OP_RING_PUT, 0, n_sink, 0.0f, n_seq, kv_size, false);
    result->src[0] = fp16;
    result->src[1] = cur;
    result->src[2] = k_idxs;
    result->src[3] = after;
    return result;
}

// op params of WIDE and WIDE_MASK: { op, window, n_sink, 0, n_seq, kv_size, mask_all_streams, n_kv, is_k }
static void kvq_set_wide_params(struct ggml_tensor * t, enum ggml_kvq_op op, int32_t window, int32_t n_sink,
                                int32_t n_seq, int64_t kv_size, bool mask_all_streams, int64_t n_kv, bool is_k) {
    GGML_ASSERT(n_kv > 0 && n_kv <= kv_size);
    kvq_set_params(t, op, window, n_sink, 0.0f, n_seq, kv_size, mask_all_streams);
    ggml_set_op_params_i32(t, 7, (int32_t) n_kv);
    ggml_set_op_params_i32(t, 8, is_k);
}

struct ggml_tensor * ggml_kvq_wide(
        struct ggml_context * ctx,
        struct ggml_tensor  * quantized,
        struct ggml_tensor  * fp16,
        struct ggml_tensor  * cur,
        struct ggml_tensor  * k_idxs,
        int32_t               window,
        int32_t               n_sink,
        int32_t               n_seq,
        int64_t               kv_size,
        int64_t               n_kv) {
    GGML_ASSERT(ggml_kvq_is_kivi(quantized->type) && ggml_is_contiguous(quantized) && window >= 0);
    kvq_check_batch(fp16, cur, k_idxs, n_sink, n_seq);
    // K tiles [n_embd*QK_KIVI, kv_size/QK_KIVI, n_part] or V rows [n_embd, kv_size*n_part]
    const bool is_k = quantized->ne[0] == (int64_t) kvq_n_embd(cur)*QK_KIVI;
    GGML_ASSERT(is_k || quantized->ne[0] == kvq_n_embd(cur));
    GGML_ASSERT(ggml_nelements(quantized) == (int64_t) kvq_n_embd(cur)*kv_size*fp16->ne[2]);
    GGML_ASSERT(fp16->ne[1] - n_sink >= ggml_kvq_ring_size(window));

    const struct ggml_kvq_wide_layout l = ggml_kvq_wide_layout_for(n_kv, cur->ne[2]/n_seq, window);
    struct ggml_tensor * result = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, kvq_n_embd(cur), l.n_wide, n_seq);
    kvq_set_wide_params(result, GGML_KVQ_OP_WIDE, window, n_sink, n_seq, kv_size, false, n_kv, is_k);
    result->src[0] = quantized;
    result->src[1] = fp16;
    result->src[2] = cur;
    result->src[3] = k_idxs;
    return result;
}

struct ggml_tensor * ggml_kvq_wide_mask(
        struct ggml_context * ctx,
        struct ggml_tensor  * mask,
        struct ggml_tensor  * k_idxs,
        int32_t               window,
        int32_t               n_sink,
        int32_t               n_seq,
        int64_t               kv_size,
        bool                  mask_all_streams,
        int64_t               n_kv) {
    GGML_ASSERT(mask->type == GGML_TYPE_F16 || mask->type == GGML_TYPE_F32);
    GGML_ASSERT(k_idxs->type == GGML_TYPE_I64 && n_seq >= 1 && k_idxs->ne[0] % n_seq == 0);
    GGML_ASSERT(mask->ne[2] == 1 && mask->ne[1]*mask->ne[3] == k_idxs->ne[0]);
    GGML_ASSERT(mask_all_streams ? mask->ne[3] == 1 : mask->ne[3] == n_seq && mask->ne[0] <= kv_size);

    const int64_t n_tps = k_idxs->ne[0]/n_seq;
    const struct ggml_kvq_wide_layout l = ggml_kvq_wide_layout_for(n_kv, n_tps, window);
    struct ggml_tensor * result = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, l.n_wide, n_tps, 1, n_seq);
    kvq_set_wide_params(result, GGML_KVQ_OP_WIDE_MASK, window, n_sink, n_seq, kv_size, mask_all_streams, n_kv, false);
    result->src[0] = mask;
    result->src[1] = k_idxs;
    return result;
}

static void kvq_check_score_inputs(const struct ggml_tensor * q, const struct ggml_tensor * k_wide,
                                   const struct ggml_tensor * wide_mask) {
    GGML_ASSERT(q->type == GGML_TYPE_F32 && q->nb[0] == sizeof(float));
    GGML_ASSERT(k_wide->type == GGML_TYPE_F16 && ggml_is_contiguous(k_wide) && k_wide->ne[3] == 1);
    GGML_ASSERT(wide_mask->type == GGML_TYPE_F16 && ggml_is_contiguous(wide_mask) && wide_mask->ne[2] == 1);
    GGML_ASSERT(k_wide->ne[0] % q->ne[0] == 0 && q->ne[1] % (k_wide->ne[0]/q->ne[0]) == 0);
    GGML_ASSERT(wide_mask->ne[0] == k_wide->ne[1] && wide_mask->ne[3] == k_wide->ne[2]);
    GGML_ASSERT(wide_mask->ne[1]*wide_mask->ne[3] == q->ne[2]);
}

struct ggml_tensor * ggml_kvq_score_lse(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k_wide,
        struct ggml_tensor  * wide_mask,
        int32_t               n_observe,
        float                 scale) {
    kvq_check_score_inputs(q, k_wide, wide_mask);
    GGML_ASSERT(n_observe >= 0);

    struct ggml_tensor * result = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, q->ne[1], q->ne[2]);
    int32_t params[5] = { GGML_KVQ_OP_SCORE_LSE, n_observe, 0, 0, (int32_t) wide_mask->ne[3] };
    memcpy(&params[3], &scale, sizeof(float));
    ggml_set_op_params(result, params, sizeof(params));
    result->op     = GGML_OP_KVQ;
    result->src[0] = q;
    result->src[1] = k_wide;
    result->src[2] = wide_mask;
    return result;
}

struct ggml_tensor * ggml_kvq_score_add(
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
        float                 scale) {
    kvq_check_score_inputs(q, k_wide, wide_mask);
    const int64_t n_head_kv = k_wide->ne[0]/q->ne[0];
    const int32_t n_seq     = (int32_t) wide_mask->ne[3];
    GGML_ASSERT(scores->type == GGML_TYPE_F32 && ggml_is_contiguous(scores) && scores->ne[3] == 1);
    GGML_ASSERT(scores->ne[1] == n_head_kv && scores->ne[2] >= n_seq);
    GGML_ASSERT(lse->type == GGML_TYPE_F32 && ggml_is_contiguous(lse) && lse->ne[0] == q->ne[1] && lse->ne[1] == q->ne[2]);
    GGML_ASSERT(k_idxs->type == GGML_TYPE_I64 && ggml_is_contiguous(k_idxs) && k_idxs->ne[0] == q->ne[2]);
    GGML_ASSERT(window >= 0 && n_sink >= 0 && n_observe >= 0);
    GGML_ASSERT(ggml_kvq_wide_layout_for(n_kv, q->ne[2]/n_seq, window).n_wide == k_wide->ne[1]);

    struct ggml_tensor * result = ggml_view_tensor(ctx, scores);
    kvq_set_wide_params(result, GGML_KVQ_OP_SCORE_ADD, window, n_sink, n_seq, scores->ne[0], false, n_kv, false);
    ggml_set_op_params_f32(result, 3, scale);
    ggml_set_op_params_i32(result, 9, n_observe);
    result->src[0] = scores;
    result->src[1] = q;
    result->src[2] = k_wide;
    result->src[3] = wide_mask;
    result->src[4] = lse;
    result->src[5] = k_idxs;
    return result;
}
