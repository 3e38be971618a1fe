// CUDA kernels of GGML_OP_KVQ and of ggml_set_rows into the kivi types. The CPU kernels (kvq-cpu*.c) are the
// specification: every cell is read through the same value (fp16 or quantized) as there, and quantized blocks
// are bit-identical to kvq-quants.c's.

#include "kvq-cuda-attn-kernel.cuh"
#include "kvq-cuda-mma.cuh"
#include "kvq-cuda-store.cuh"

//
// host side
//



static void kvq_seal_k(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * k_tiles = dst->src[0];
    const kvq_source    src     = kvq_make_source(dst, dst->src[1], dst->src[2]);
    const int64_t     * cells   = kvq_cells(dst->src[3], dst->src[2]);
    const int           n_embd  = src.head_dim*(int) dst->src[2]->ne[1];
    GGML_ASSERT(ggml_kvq_is_kivi(k_tiles->type) && ggml_is_contiguous(k_tiles));
    GGML_ASSERT(k_tiles->ne[0] == (int64_t) n_embd*QK_KIVI);
    kvq_assert_words(k_tiles);

    // the tiles ending inside a segment are among the first ceil(n_tps/32) from its first/32 on
    const dim3 grid((n_embd + KVQ_BLOCK_SIZE - 1)/KVQ_BLOCK_SIZE, (src.n_tps + QK_KIVI - 1)/QK_KIVI, src.n_tokens/src.n_tps);
    char * data = (char *) k_tiles->data;
    const float clip = ggml_get_op_params_f32(dst, GGML_KVQ_CLIP_PARAM);
    cudaStream_t stream = ctx.stream();
    switch (ggml_kvq_bits(k_tiles->type)) {
        case 1:  kvq_seal_k_kernel<1><<<grid, KVQ_BLOCK_SIZE, 0, stream>>>(data, k_tiles->nb[1], src, cells, n_embd, clip); break;
        case 2:  kvq_seal_k_kernel<2><<<grid, KVQ_BLOCK_SIZE, 0, stream>>>(data, k_tiles->nb[1], src, cells, n_embd, clip); break;
        default: kvq_seal_k_kernel<4><<<grid, KVQ_BLOCK_SIZE, 0, stream>>>(data, k_tiles->nb[1], src, cells, n_embd, clip); break;
    }
    CUDA_CHECK(cudaGetLastError());
}

static void kvq_ring_put(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const kvq_source src    = kvq_make_source(dst, dst->src[0], dst->src[1]);
    const int64_t  * cells  = kvq_cells(dst->src[2], dst->src[1]);
    const int        n_embd = src.head_dim*(int) dst->src[1]->ne[1];

    const dim3 grid((n_embd + KVQ_BLOCK_SIZE - 1)/KVQ_BLOCK_SIZE, src.n_tokens);
    kvq_ring_put_kernel<<<grid, KVQ_BLOCK_SIZE, 0, ctx.stream()>>>(src, cells, n_embd);
    CUDA_CHECK(cudaGetLastError());
}

// STORE: a decode step's SEAL_K, STORE_V and both RING_PUTs in one launch (kvq_store_kernel)
static void kvq_store(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const kvq_store_params p = kvq_store_make_params(dst);
    ggml_cuda_kernel_launch(kvq_store_kernel, ggml_cuda_kernel_launch_params(dim3(kvq_store_grid_x(p), p.k.n_tokens),
                            KVQ_BLOCK_SIZE, 0, ctx.stream()), p);
}

template <int ncols, int nvq>
static void kvq_attn_launch(const kvq_attn_params & p, const dim3 grid, cudaStream_t stream) {
    ggml_cuda_kernel_launch(kvq_attn_kernel<ncols, nvq>, ggml_cuda_kernel_launch_params(grid, KVQ_NWARPS*WARP_SIZE,
                            kvq_attn_smem(ncols, p), stream), p);
}

template <int nvq>
static void kvq_attn_launch_cols(const kvq_attn_params & p, const int ncols, const dim3 grid, cudaStream_t stream) {
    switch (ncols) {
        case 1: kvq_attn_launch<1, nvq>(p, grid, stream); break;
        case 2: kvq_attn_launch<2, nvq>(p, grid, stream); break;
        case 4: kvq_attn_launch<4, nvq>(p, grid, stream); break;
        default:
            // kvq_attn_ncols gives 8 only for head sizes up to KVQ_COLS_X_DIM/8 = 256
            if constexpr (nvq <= 2) {
                kvq_attn_launch<8, nvq>(p, grid, stream);
            } else {
                GGML_ABORT("fatal error");
            }
            break;
    }
}

static void kvq_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    kvq_attn_params p = kvq_attn_make_params(dst);

    const bool mma   = kvq_attn_mma_wanted(ctx.device, p);
    const int  ncols = mma ? KVQ_MMA_COLS : kvq_attn_ncols(p.n_gqa, p.k.head_dim, p.v.head_dim);
    const int  nvq   = p.v.head_dim <= 128 ? 1 : (p.v.head_dim <= 256 ? 2 : 4);
    kvq_attn_plan(p, ncols, mma ? KVQ_MMA_TILES_PER_SPLIT : KVQ_TILES_PER_SPLIT, mma ? kvq_attn_mma_tokens(p) : 1);

    const int n_blocks = kvq_attn_n_blocks(p);
    const int chunk    = kvq_attn_launch_blocks(p, KVQ_MAX_PARTIALS);
    const int n_rows   = kvq_attn_n_rows(p);

    ggml_cuda_pool_alloc<float> part(ctx.pool());
    ggml_cuda_pool_alloc<int>   arrived(ctx.pool());
    if (p.n_splits > 1) {
        part.alloc(chunk*kvq_attn_block_partials(p));
        arrived.alloc((int64_t) chunk*n_rows);
        kvq_attn_use_partials(p, part.get(), arrived.get(), chunk);
    }

    cudaStream_t stream = ctx.stream();
    for (p.z0 = 0; p.z0 < n_blocks; p.z0 += chunk) {
        const int n = std::min(chunk, n_blocks - p.z0);
        if (p.n_splits > 1) {
            CUDA_CHECK(cudaMemsetAsync(p.arrived, 0, sizeof(int)*n*n_rows, stream));
        }
        const dim3 grid(p.n_splits, n_rows, n);
        if (mma) {
            kvq_attn_mma_launch(p, grid, stream);
        } else {
            switch (nvq) {
                case 1:  kvq_attn_launch_cols<1>(p, ncols, grid, stream); break;
                case 2:  kvq_attn_launch_cols<2>(p, ncols, grid, stream); break;
                default: kvq_attn_launch_cols<4>(p, ncols, grid, stream); break;
            }
        }
        CUDA_CHECK(cudaGetLastError());
    }
}

// rows src0 F32 into the rows src1 (I64 or I32) of the kivi tensor dst, ranges clipped by `clip`, codes dithered as
// `dither` says (kvq_set_rows_kernel)
static void kvq_set_rows(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                         ggml_tensor * dst, float clip, const ggml_kvq_v_dither & dither) {
    const kvq_set_rows_params p = kvq_set_rows_make_params(src0, src1, dst, clip, dither);
    if (p.n_blocks == 0) {
        return;
    }
    cudaStream_t stream = ctx.stream();
    kvq_set_rows_dispatch(src1, ggml_kvq_bits(dst->type), [&](auto kernel) {
        kernel<<<kvq_set_rows_grid(p), KVQ_BLOCK_SIZE, 0, stream>>>(p);
    });
    CUDA_CHECK(cudaGetLastError());
}

void ggml_cuda_kvq_set_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    kvq_set_rows(ctx, dst->src[0], dst->src[1], dst, 1.0f, ggml_kvq_v_dither {});
}

// STORE_V: upstream's set_rows with a clip ratio and V's dither; dst is a view of the V rows (src[0])
static void kvq_store_v(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    kvq_set_rows(ctx, dst->src[1], dst->src[2], dst, ggml_get_op_params_f32(dst, GGML_KVQ_CLIP_PARAM), ggml_kvq_store_v_dither(dst));
}

void ggml_cuda_op_kvq(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    switch ((ggml_kvq_op) ggml_get_op_params_i32(dst, 0)) {
        case GGML_KVQ_OP_SEAL_K:    kvq_seal_k(ctx, dst);         break;
        case GGML_KVQ_OP_ATTN:      kvq_attn(ctx, dst);           break;
        case GGML_KVQ_OP_RING_PUT:  kvq_ring_put(ctx, dst);       break;
        case GGML_KVQ_OP_WIDE:      kvq_cuda_wide(ctx, dst);      break;
        case GGML_KVQ_OP_WIDE_MASK: kvq_cuda_wide_mask(ctx, dst); break;
        case GGML_KVQ_OP_SCORE_LSE: kvq_cuda_score_lse(ctx, dst); break;
        case GGML_KVQ_OP_SCORE_ADD: kvq_cuda_score_add(ctx, dst); break;
        case GGML_KVQ_OP_STORE_V:   kvq_store_v(ctx, dst);        break;
        case GGML_KVQ_OP_STORE:     kvq_store(ctx, dst);          break;
        default:                    GGML_ABORT("unknown kvq op");
    }
}

static bool kvq_attn_supported(const ggml_tensor * op) {
    const ggml_tensor * q      = op->src[0];
    const ggml_tensor * k_cur  = op->src[5];
    const ggml_tensor * mask   = op->src[7];
    const bool          latent = ggml_kvq_attn_is_latent(op);
    // a latent layer reads V from its K tiles (ggml_kvq_attn_latent)
    const ggml_tensor * v_rows = latent ? op->src[1] : op->src[2];
    return q->type == GGML_TYPE_F32 && kvq_head_dim_ok(k_cur->ne[0], latent ? KVQ_MAX_HEAD_LATENT : KVQ_MAX_HEAD) &&
           kvq_head_dim_ok(op->ne[0]) && ggml_kvq_is_kivi(op->src[1]->type) && ggml_kvq_is_kivi(v_rows->type) &&
           (mask->type == GGML_TYPE_F16 || mask->type == GGML_TYPE_F32) &&
           q->ne[1] % k_cur->ne[1] == 0 && q->ne[2] <= KVQ_MAX_GRID_YZ;
}

static bool kvq_set_rows_supported(const ggml_tensor * dst, const ggml_tensor * src0, const ggml_tensor * src1) {
    return ggml_kvq_is_kivi(dst->type) && src0->type == GGML_TYPE_F32 &&
           (src1->type == GGML_TYPE_I64 || src1->type == GGML_TYPE_I32) &&
           src0->ne[0] % QK_KIVI == 0 && ggml_nelements(src0)/QK_KIVI <= INT32_MAX;
}

bool ggml_cuda_kvq_supports_op(const ggml_tensor * op) {
    switch (op->op) {
        case GGML_OP_SET_ROWS:
            return kvq_set_rows_supported(op, op->src[0], op->src[1]);
        case GGML_OP_KVQ:
            switch ((ggml_kvq_op) ggml_get_op_params_i32(op, 0)) {
                case GGML_KVQ_OP_SEAL_K:   return ggml_kvq_is_kivi(op->src[0]->type) && op->src[2]->ne[2] <= KVQ_MAX_GRID_YZ;
                case GGML_KVQ_OP_ATTN:     return kvq_attn_supported(op);
                case GGML_KVQ_OP_RING_PUT: return op->src[1]->ne[2] <= KVQ_MAX_GRID_YZ;
                case GGML_KVQ_OP_WIDE:
                    return ggml_kvq_is_kivi(op->src[0]->type) && op->ne[1] <= INT32_MAX && op->ne[2] <= KVQ_MAX_GRID_YZ &&
                           (op->ne[0] + KVQ_BLOCK_SIZE - 1)/KVQ_BLOCK_SIZE <= KVQ_MAX_GRID_YZ;
                case GGML_KVQ_OP_WIDE_MASK:
                    return (op->src[0]->type == GGML_TYPE_F16 || op->src[0]->type == GGML_TYPE_F32) &&
                           op->src[1]->ne[0] <= INT32_MAX;
                case GGML_KVQ_OP_SCORE_LSE:
                    return op->src[0]->ne[0] <= KVQ_MAX_HEAD && op->ne[0] <= KVQ_MAX_GRID_YZ && op->ne[1] <= INT32_MAX;
                case GGML_KVQ_OP_SCORE_ADD:
                    return op->src[1]->ne[0] <= KVQ_MAX_HEAD && op->ne[1] <= KVQ_MAX_GRID_YZ &&
                           ggml_get_op_params_i32(op, 4) <= KVQ_MAX_GRID_YZ;
                case GGML_KVQ_OP_STORE_V:  return kvq_set_rows_supported(op, op->src[1], op->src[2]);
                case GGML_KVQ_OP_STORE:    return ggml_kvq_is_kivi(op->src[0]->type) &&
                                                  (op->src[4] == nullptr || ggml_kvq_is_kivi(op->src[4]->type)) &&
                                                  op->src[2]->ne[2] <= KVQ_MAX_GRID_YZ;
                default:                   return false;
            }
        default:
            return false;
    }
}
