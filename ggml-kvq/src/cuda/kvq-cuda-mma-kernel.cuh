// ATTN on tensor cores, the kernel (kvq-cuda-mma.cu launches it): the decode attention of kvq-cuda-attn-kernel.cuh
// (same splits and merge, same contract: kvq-cpu-attn.c) with its two products on mma.m16n8k16 (fp16 operands,
// fp32 accumulators), the shape of BitDecoding (arXiv 2503.18773).
//
// KIVI's factorisation keeps the codes raw. A quantized K tile is codes[c][u]*d_c + m_c per channel c, so
//   S^T[u][g] = sum_c codes^T[u][c] * (q_g,c d_c) + sum_c m_c q_g,c
// with A = the tile's codes (16 cells x 16 channels per step) and B = Q scaled by the tile's d (16 channels x
// the 8 query heads of the KV head), and the offset as one more product whose A repeats m in every row;
// quantized V rows are codes[u][c]*d_u,b + m_u,b per 32-channel block b, so
//   O^T[c][g] += sum_u codes^T[c][u] * (p_g,u d_u,b) + sum_u m_u,b p_g,u
// with A = the codes (16 channels x 16 cells) and B = the softmax weights scaled per cell and block. Codes
// become fp16 exactly (0x6400 | code is 1024 + code); Q is scaled before it is rounded to fp16, as upstream's
// flash attention does, so that q*d stays far from fp16's range. Tiles that hold fp16 cells (sinks, the window,
// the query's own tile, the batch) run the same products on the values themselves.
//
// A latent layer (multi-head latent attention, ggml_kvq_attn_latent: V is the first DV channels of K, so V^T's rows
// are K's per-channel blocks) weighs its V as K's factorisation reads it:
//   O^T[c][g] += d_c sum_u codes[c][u] p_g,u + m_c sum_u p_g,u
// the codes times P^T on tensor cores per 16 channels, then the channel's scale and minimum in fp32; its Q, too
// wide for registers (576 channels), is read from shared memory.
//
// The N columns hold a KV head's query heads, and beside them as many consecutive tokens of one sequence as fit
// (column = token*heads + head: kvq_attn_mma_tokens), so that a prefill chunk or a speculative draft reads each tile
// once for its tokens. Every token reads a tile as it would alone, for the same bits whatever the batch: those whose
// attended cells are all quantized in one pass on the staged codes, the others in a pass per view of the tile (the
// cells of it they read quantized), each pass leaving the other tokens' columns out: their Q^T and P^T columns
// zero, so that it adds exact zeros to them (the cells it reads are finite; a cell no token of the pass attends is
// dropped). A token that attends nothing of a tile keeps its state.
//
// A warp owns whole 32-cell tiles; each streams the K blocks and V rows of its tiles into shared memory through
// a KVQ_MMA_STAGES-deep cp.async ring, and never waits for another warp inside the loop. A KV head with more than
// KVQ_MMA_COLS query heads takes blocks of KVQ_MMA_COLS of them (n_groups), each reading its tiles.
//
// Fragments (PTX ISA, mma.m16n8k16): lane = 4*gid + tq; A holds rows gid and gid+8, columns 2tq, 2tq+1 and
// the same + 8; B holds rows 2tq, 2tq+1 and + 8, column gid; C holds rows gid and gid+8, columns 2tq, 2tq+1.
// In a kivi block, element e sits in byte e % nb (nb code bytes) at bit (e / nb)*bits: the elements gid,
// gid+8, gid+16 and gid+24 that a lane needs as the rows of both 16-row halves share one or two 32-bit words.

#pragma once

#include "kvq-cuda-mma.cuh"
#include "kvq-cuda-ptx.cuh"

// ATTN's cells per tile, as the rows of two m16 halves
static_assert(QK_KIVI == 32, "a tile is two 16-row halves");

// the elements gid + 8r (r = 0..3) of a kivi block, which a lane reads as rows of A
struct kvq_lane_codes {
    int      w_lo;   // 32-bit word (of the codes) holding elements gid and gid+16
    int      w_hi;   // ... gid+8 and gid+24
    int      shift[4];
    uint32_t mask;
};

static __device__ __forceinline__ kvq_lane_codes kvq_lane_codes_at(const int gid, const int bits) {
    const int nb = QK_KIVI*bits/8;
    kvq_lane_codes r;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int e    = gid + 8*k;
        const int byte = e % nb;
        r.shift[k] = 8*(byte % 4) + e/nb*bits;
    }
    r.w_lo = gid % nb/4;
    r.w_hi = (gid + 8) % nb/4;
    r.mask = (1u << bits) - 1;
    return r;
}

// codes of elements gid, gid+8, gid+16, gid+24 of a block (4-byte aligned, in shared memory)
static __device__ __forceinline__ void kvq_block_codes(const char * block, const kvq_lane_codes & lc, uint32_t (&c)[4]) {
    const uint32_t * qs = (const uint32_t *) (block + 2*sizeof(half));
    const uint32_t   lo = qs[lc.w_lo];
    const uint32_t   hi = qs[lc.w_hi];
    c[0] = lo >> lc.shift[0] & lc.mask;
    c[1] = hi >> lc.shift[1] & lc.mask;
    c[2] = lo >> lc.shift[2] & lc.mask;
    c[3] = hi >> lc.shift[3] & lc.mask;
}

// one element of a block, any width (the tiles that also hold fp16 cells read their quantized cells this way)
static __device__ __forceinline__ float kvq_block_value(const char * block, const int e, const int bits) {
    const int      nb   = QK_KIVI*bits/8;
    const int      byte = e % nb;
    const uint32_t word = ((const uint32_t *) (block + 2*sizeof(half)))[byte/4];
    const float2   dm   = __half22float2(*(const half2 *) block);
    return dm.x*(float) (word >> (8*(byte % 4) + e/nb*bits) & ((1u << bits) - 1)) + dm.y;
}

// two codes (x low, y high) as an fp16 pair, exactly
static __device__ __forceinline__ uint32_t kvq_pack_codes(const uint32_t x, const uint32_t y) {
    const uint32_t biased = x | y << 16 | 0x64006400u;
    const half2    v      = __hsub2(*(const half2 *) &biased, __halves2half2(__ushort_as_half(0x6400), __ushort_as_half(0x6400)));
    return *(const uint32_t *) &v;
}

static __device__ __forceinline__ uint32_t kvq_pack_halves(const float x, const float y) {
    const half2 v = __floats2half2_rn(x, y);
    return *(const uint32_t *) &v;
}

// the elements 2tq + {0, 1} + 8r (r = 0..3) of a kivi block, which a lane reads as columns of A where a latent
// layer's V^T has K's channels for rows and the tile's cells for columns. Since nb = 4*bits divides 16, elements
// e and e+16 share a byte (e+16 sits 4 bits higher) and e+1 is the next byte of the word: two words, two shifts.
struct kvq_lane_cells {
    int      w_lo;     // word holding elements 2tq, 2tq+1, 2tq+16, 2tq+17
    int      w_hi;     // ... 2tq+8, 2tq+9, 2tq+24, 2tq+25
    int      s_lo;     // bit of element 2tq in w_lo
    int      s_hi;     // ... 2tq+8 in w_hi
    uint32_t mask;
};

static __device__ __forceinline__ kvq_lane_cells kvq_lane_cells_at(const int tq, const int bits) {
    const int nb = QK_KIVI*bits/8;
    const int lo = 2*tq, hi = 2*tq + 8;
    kvq_lane_cells r;
    r.w_lo = lo % nb/4;
    r.w_hi = hi % nb/4;
    r.s_lo = 8*(lo % nb % 4) + lo/nb*bits;
    r.s_hi = 8*(hi % nb % 4) + hi/nb*bits;
    r.mask = (1u << bits) - 1;
    return r;
}

// A of V^T's k-step ks over two channels' blocks (rows gid and gid+8), fp16 codes, exactly
static __device__ __forceinline__ void kvq_latent_codes(const char * row_lo, const char * row_hi, const kvq_lane_cells & lc,
                                                        const int ks, uint32_t (&a)[4]) {
    const uint32_t * lo_qs = (const uint32_t *) (row_lo + 2*sizeof(half));
    const uint32_t * hi_qs = (const uint32_t *) (row_hi + 2*sizeof(half));
    const int s_lo = lc.s_lo + 4*ks;  // cells 16ks + 2tq + {0, 1}
    const int s_hi = lc.s_hi + 4*ks;  // ... + 8
    const uint32_t a_lo = lo_qs[lc.w_lo], a_hi = lo_qs[lc.w_hi];
    const uint32_t b_lo = hi_qs[lc.w_lo], b_hi = hi_qs[lc.w_hi];
    a[0] = kvq_pack_codes(a_lo >> s_lo & lc.mask, a_lo >> (s_lo + 8) & lc.mask);
    a[1] = kvq_pack_codes(b_lo >> s_lo & lc.mask, b_lo >> (s_lo + 8) & lc.mask);
    a[2] = kvq_pack_codes(a_hi >> s_hi & lc.mask, a_hi >> (s_hi + 8) & lc.mask);
    a[3] = kvq_pack_codes(b_hi >> s_hi & lc.mask, b_hi >> (s_hi + 8) & lc.mask);
}

// d += A*b, A's k-columns 2tq, 2tq+1, 2tq+8, 2tq+9 being the codes of four blocks (kvq_block_codes) and its rows
// gid, gid+8 their elements of 16-row half h
static __device__ __forceinline__ void kvq_mma_codes(float (&d)[4], const uint32_t (&codes)[4][4], const int h,
                                                     const uint32_t (&b)[2]) {
    const uint32_t a[4] = {
        kvq_pack_codes(codes[0][2*h + 0], codes[1][2*h + 0]),
        kvq_pack_codes(codes[0][2*h + 1], codes[1][2*h + 1]),
        kvq_pack_codes(codes[2][2*h + 0], codes[3][2*h + 0]),
        kvq_pack_codes(codes[2][2*h + 1], codes[3][2*h + 1]),
    };
    kvq_mma(d, a, b);
}

// A tile's K blocks of the KV head (k_bytes) and its cells' V blocks (32 rows of v_bytes, nb1 apart) into a
// stage, in `bytes`-sized pieces spread over the warp
template <int bytes>
static __device__ void kvq_stage_tile(char * stage_s, const char * k_src, const int k_bytes, const bool k,
                                      const char * v_src, const size_t v_nb1, const int v_bytes, const bool v) {
    const int lane = threadIdx.x % WARP_SIZE;
    if (k) {
        for (int o = lane*bytes; o < k_bytes; o += WARP_SIZE*bytes) {
            kvq_cp_async<bytes>(stage_s + o, k_src + o);
        }
    }
    if (v) {
        const int per_row = v_bytes/bytes;
        for (int idx = lane; idx < QK_KIVI*per_row; idx += WARP_SIZE) {
            const int u = idx / per_row;
            const int o = idx % per_row*bytes;
            kvq_cp_async<bytes>(stage_s + k_bytes + u*v_bytes + o, v_src + u*v_nb1 + o);
        }
    }
}

// Where a cell of a tile that holds fp16 cells is read from: its quantized blocks of the head (kind QUANT),
// its fp16 row (HALF) or its row of the batch (FLOAT, rounded to fp16); null for a cell the query does not attend.
enum kvq_cell_kind { KVQ_CELL_QUANT, KVQ_CELL_HALF, KVQ_CELL_FLOAT };

struct kvq_cell {
    const char  * ptr;
    kvq_cell_kind kind;
};

static __device__ __forceinline__ kvq_cell kvq_cell_at(const kvq_source & src, const int64_t first, const int64_t cell,
                                                       const int head, const bool attended, const bool quantized,
                                                       const char * blocks) {
    if (!attended) {
        return { nullptr, KVQ_CELL_QUANT };
    }
    if (quantized) {
        return { blocks, KVQ_CELL_QUANT };
    }
    if (cell >= first) {
        return { (const char *) kvq_cur_row(src, cell - first, head), KVQ_CELL_FLOAT };
    }
    return { (const char *) (kvq_fp16_row(src, cell) + head*src.head_dim), KVQ_CELL_HALF };
}

// value of channel c of an fp16 or batch row
static __device__ __forceinline__ float kvq_row_value(const kvq_cell & cell, const int c) {
    return cell.kind == KVQ_CELL_HALF ? __half2float(((const half *) cell.ptr)[c]) : kvq_round_fp16(((const float *) cell.ptr)[c]);
}

// K of (cell u of the tile, channel c): a quantized cell's value is element u of channel c's block
static __device__ __forceinline__ float kvq_k_value(const kvq_cell & cell, const int u, const int c, const int bits) {
    if (cell.ptr == nullptr) {
        return 0.0f;
    }
    return cell.kind == KVQ_CELL_QUANT ? kvq_block_value(cell.ptr + c*kvq_block_bytes(bits), u, bits) : kvq_row_value(cell, c);
}

// V of (a cell, channel c): a quantized cell's value is element c % 32 of its block c / 32
static __device__ __forceinline__ float kvq_v_value(const kvq_cell & cell, const int c, const int bits) {
    if (cell.ptr == nullptr) {
        return 0.0f;
    }
    return cell.kind == KVQ_CELL_QUANT ? kvq_block_value(cell.ptr + c/QK_KIVI*kvq_block_bytes(bits), c % QK_KIVI, bits)
                                       : kvq_row_value(cell, c);
}

// what a warp knows of one of its tiles before reading it
struct kvq_mma_tile {
    uint32_t bits;  // bytes: the block's tokens that attend the lane's cell, that attend some cell of the tile, whose
                    // every attended cell reads K quantized, ... V quantized

    __device__ uint32_t mine()    const { return bits & 0xFF; }
    __device__ uint32_t tokens()  const { return bits >> 8 & 0xFF; }
    __device__ uint32_t quant_k() const { return bits >> 16 & 0xFF; }
    __device__ uint32_t quant_v() const { return bits >> 24; }
};

// rows of the S^T fragments a lane holds: r = 0..3 -> cell 16*(r/2) + gid + 8*(r%2) of the tile
static __device__ __forceinline__ int kvq_s_row_cell(const int gid, const int r) {
    return 16*(r/2) + gid + 8*(r % 2);
}

// k indices of the P.V fragments a lane holds: e = 0..3 of k-step ks -> cell 16*ks + 2*tq + (e%2) + 8*(e/2)
static __device__ __forceinline__ int kvq_v_col_cell(const int tq, const int ks, const int e) {
    return 16*ks + 2*tq + e % 2 + 8*(e/2);
}

// Q^T's B fragment of k-step kk for a lane: Q of its head (zero past the block's real heads) at channels
// 16*kk + 2*tq + {0, 1} and {8, 9}, scaled, in fp16 pairs
static __device__ __forceinline__ void kvq_q_fragment(const float * q_row, const bool real, const float scale,
                                                      const int kk, const int tq, uint32_t (&b)[2]) {
    const auto q_at = [&](const int c) { return real ? kvq_round_fp16(q_row[c])*scale : 0.0f; };
    const int  c    = 16*kk + 2*tq;
    b[0] = kvq_pack_halves(q_at(c + 0), q_at(c + 1));
    b[1] = kvq_pack_halves(q_at(c + 8), q_at(c + 9));
}

// shared memory a warp's loop uses: its stages (a tile's K blocks, and V rows unless latent), its tile's weights and
// per stage the tokens' mask rows over the tile
static __host__ __device__ constexpr int kvq_mma_warp_bytes(const int D, const int DV, const int k_bits, const int v_bits) {
    return KVQ_MMA_STAGES*(D*kvq_block_bytes(k_bits) + (DV < D ? 0 : QK_KIVI*(DV/QK_KIVI)*kvq_block_bytes(v_bits))) +
           (1 + KVQ_MMA_STAGES)*QK_KIVI*KVQ_MMA_COLS*(int) sizeof(float);
}

// Whether Q's fragments sit in shared memory rather than registers: a latent layer's (576 channels: 72 registers), and
// a packed kernel's of head size 256 (32 registers), whose passes per token would spill them
static __host__ __device__ constexpr bool kvq_mma_q_shared(const int D, const int DV, const bool packed) {
    return DV < D || (packed && D > 128);
}

// TPW tiles per warp and split: the product's is KVQ_MMA_TILES_PER_SPLIT's share; the emulation's tests force others
// to hold the merge to any number of splits. DV < D: a latent layer, whose V is K's first DV channels. packed: blocks
// of p.n_tok tokens (kvq_attn_mma_packed); a layer whose heads leave no room for a second token compiles without the
// passes per token, in the registers it needs alone.
template <int D, int DV, bool packed, int TPW = KVQ_MMA_TILES_PER_SPLIT/KVQ_NWARPS>
static __global__ void __launch_bounds__(KVQ_NWARPS*WARP_SIZE, 1) kvq_attn_mma_kernel(const kvq_attn_params p) {
#ifdef AMPERE_MMA_AVAILABLE
    constexpr bool latent = DV < D;
    constexpr int  NK     = D/16;        // k-steps of Q.K^T
    constexpr int  NB     = DV/QK_KIVI;  // V blocks of a head
    static_assert(latent || DV == D, "an ordinary layer's K and V heads are of one size");
    static_assert(KVQ_MMA_TILES_PER_SPLIT % KVQ_NWARPS == 0, "whole tiles per warp");
    extern __shared__ __align__(16) char kvq_mma_smem[];
    // launched with programmatic dependent launch: the kernel after it may start, as after upstream's flash
    // attention, and waits for it in its own ggml_cuda_pdl_sync; nothing is read before the store has finished
    ggml_cuda_pdl_lc();
    ggml_cuda_pdl_sync();

    const int warp  = threadIdx.x / WARP_SIZE;
    const int lane  = threadIdx.x % WARP_SIZE;
    const int gid   = lane / 4;
    const int tq    = lane % 4;
    const int split = blockIdx.x;
    const kvq_block_heads bh = kvq_block_heads_at(p, KVQ_MMA_COLS);
    const int hk    = bh.hk;
    const int h0    = bh.h0;
    const int nh    = bh.nh;
    const kvq_block_tokens bt = packed ? kvq_block_tokens_at(p) : kvq_block_token_at(p);
    const int n_col = bt.n*nh;  // real columns: token col/nh, head h0 + col%nh

    const kvq_query qr = kvq_query_at(p, bt.first);  // the segment's, the first token's limits
    const int       i0 = (int) (qr.first + bt.first % p.k.n_tps);
    // token tt's view of the tile from cell j0 on: the tile's cells below its limit, which it reads quantized (sinks
    // aside)
    const auto view = [&](const bool v, const int tt, const int j0) {
        const int lim = (int) (v && !latent ? ggml_kvq_lim_v(i0 + tt, p.window) : ggml_kvq_lim_k(i0 + tt, p.window));
        return min(max(lim - j0, 0), QK_KIVI);
    };
    // the token of a column (a padding column's: the last token's, its Q zeros), and a column's Q row
    const auto token_of = [&](const int col) { return min(col / nh, bt.n - 1); };
    const auto q_row_at  = [&](const int col) {
        const int c = min(col, n_col - 1);
        return (const float *) (p.q + (bt.first + c / nh)*p.q_nb2 + (h0 + c % nh)*p.q_nb1);
    };

    const int k_bb    = kvq_block_bytes(p.k_bits);
    const int v_bb    = kvq_block_bytes(p.v_bits);
    const int k_bytes = D*k_bb;    // a tile's K blocks of the head
    const int v_bytes = NB*v_bb;   // a cell's V blocks of the head (a latent layer's are in K's)
    const int stage_bytes = k_bytes + (latent ? 0 : QK_KIVI*v_bytes);
    const int warp_bytes  = kvq_mma_warp_bytes(D, DV, p.k_bits, p.v_bits);
    char  * stages_s = kvq_mma_smem + warp*warp_bytes;
    float * p_s      = (float *) (stages_s + KVQ_MMA_STAGES*stage_bytes);  // the tile's weights [cell][column]
    float * mask_s   = p_s + QK_KIVI*KVQ_MMA_COLS;                          // per stage [token][cell]

    const kvq_lane_codes k_codes = kvq_lane_codes_at(gid, p.k_bits);
    const kvq_lane_codes v_codes = kvq_lane_codes_at(gid, p.v_bits);
    const kvq_lane_cells v_cells = kvq_lane_cells_at(tq, p.k_bits);  // a latent V's codes, from K's blocks

    // B of Q^T per k-step (kvq_q_fragment): in registers, or in shared memory after the warps' loops, lane by lane
    // [kk][lane] (kvq_mma_q_shared)
    constexpr bool q_shared = kvq_mma_q_shared(D, DV, packed);
    uint32_t q2[q_shared ? 1 : NK][2];
    uint2  * q_s = (uint2 *) (kvq_mma_smem + KVQ_NWARPS*warp_bytes);
    if constexpr (q_shared) {
        for (int idx = threadIdx.x; idx < NK*WARP_SIZE; idx += blockDim.x) {
            const int g = idx % WARP_SIZE / 4;
            uint32_t b[2];
            kvq_q_fragment(q_row_at(g), g < n_col, p.scale, idx / WARP_SIZE, idx % 4, b);
            q_s[idx] = make_uint2(b[0], b[1]);
        }
        __syncthreads();
    } else {
        const float * q_row = q_row_at(gid);
#pragma unroll
        for (int kk = 0; kk < NK; ++kk) {
            kvq_q_fragment(q_row, gid < n_col, p.scale, kk, tq, q2[kk]);
        }
    }
    const int      c_tok[2] = { token_of(2*tq + 0), token_of(2*tq + 1) };  // C's columns' tokens
    const uint32_t b_token  = 1u << token_of(gid);                         // B's column's, as a bit
    // Q^T's k-step kk for the tokens of a group, zero in the other columns
    const auto q_at = [&](const int kk, const uint32_t group, uint32_t (&b)[2]) {
        if constexpr (q_shared) {
            const uint2 v = q_s[kk*WARP_SIZE + lane];
            b[0] = v.x;
            b[1] = v.y;
        } else {
            b[0] = q2[kk][0];
            b[1] = q2[kk][1];
        }
        if (!(b_token & group)) {
            b[0] = b[1] = 0;
        }
    };

    // online softmax of columns 2tq and 2tq+1 (sums: this lane's cells only), O^T [block][half][C fragment] and
    // its V offsets [block][C fragment] (all rows alike; a latent layer adds its own per tile)
    float run_max[2] = { -INFINITY, -INFINITY };
    float run_sum[2] = { 0.0f, 0.0f };
    float acc[NB][2][4] = {};
    float voff[NB][4] = {};

    const int n_tiles = (p.n_kv + QK_KIVI - 1)/QK_KIVI;

    // the warp's k-th tile of the split, and its mask rows (in stage k % KVQ_MMA_STAGES)
    const auto warp_tile = [&](const int k) { return split*(TPW*KVQ_NWARPS) + warp + k*KVQ_NWARPS; };
    const auto masks_of  = [&](const int k) { return mask_s + k % KVQ_MMA_STAGES*(KVQ_MMA_COLS*QK_KIVI); };
    // what the warp knows of its k-th tile, its mask rows and copies to stage k % KVQ_MMA_STAGES
    const auto prefetch = [&](const int k) {
        const int     tile = warp_tile(k);
        const int     j0   = tile*QK_KIVI;
        const int64_t j    = j0 + lane;
        const bool    in   = tile < n_tiles && j < qr.end;
        float * m_s = masks_of(k);
        uint32_t mine = 0, tokens = 0, quant_k = 0, quant_v = 0;
        for (int tt = 0; tt < bt.n; ++tt) {
            const float mv  = in ? kvq_mask_value(p, bt.first + tt, qr.col0 + j) : -INFINITY;
            const bool  att = mv != -INFINITY;
            m_s[tt*QK_KIVI + lane] = mv;
            mine    |= (uint32_t) att << tt;
            tokens  |= (uint32_t) (__ballot_sync(0xFFFFFFFF, att) != 0) << tt;
            quant_k |= (uint32_t) __all_sync(0xFFFFFFFF, !att || (j >= qr.k.n_sink && lane < view(false, tt, j0))) << tt;
            quant_v |= (uint32_t) __all_sync(0xFFFFFFFF, !att || (j >= qr.k.n_sink && lane < view(true, tt, j0))) << tt;
        }
        quant_k &= tokens;
        quant_v &= tokens;
        const kvq_mma_tile ti = { mine | tokens << 8 | quant_k << 16 | quant_v << 24 };
        if (tokens != 0) {
            char       * stage_s = stages_s + k % KVQ_MMA_STAGES*stage_bytes;
            const char * k_src   = qr.k_tiles + tile*p.k_tiles_nb1 + (size_t) hk*k_bytes;
            const char * v_src   = latent ? nullptr : qr.v_rows + j0*p.v_rows_nb1 + (size_t) hk*v_bytes;
            const bool   v       = !latent && quant_v != 0;
            if (p.copy16) {
                kvq_stage_tile<16>(stage_s, k_src, k_bytes, quant_k != 0, v_src, p.v_rows_nb1, v_bytes, v);
            } else {
                kvq_stage_tile<4>(stage_s, k_src, k_bytes, quant_k != 0, v_src, p.v_rows_nb1, v_bytes, v);
            }
        }
        kvq_cp_async_commit();
        return ti;
    };

    // the tokens' passes over a tile that holds fp16 cells for them: one a view, the tokens that share it (the
    // kernel's comment above)
    const auto for_each_view = [&](uint32_t tokens, const int j0, const bool v, auto pass) {
        for (int tt = 0; tt < bt.n; ++tt) {
            if (!(tokens >> tt & 1)) {
                continue;
            }
            const int lim   = view(v, tt, j0);
            uint32_t  group = 0;
            for (int u = tt; u < bt.n; ++u) {
                group |= (uint32_t) ((tokens >> u & 1) && view(v, u, j0) == lim) << u;
            }
            tokens &= ~group;
            pass(group, lim);
        }
    };

    kvq_mma_tile next = prefetch(0);
#pragma unroll
    for (int k = 0; k < TPW; ++k) {
        const kvq_mma_tile ti = next;
        if (k + 1 < TPW) {
            next = prefetch(k + 1);
            kvq_cp_async_wait<1>();
        } else {
            kvq_cp_async_wait<0>();
        }
        __syncwarp();
        if (ti.tokens() == 0) {
            continue;
        }
        const char *  stage_s = stages_s + k % KVQ_MMA_STAGES*stage_bytes;
        const float * m_s     = masks_of(k);
        const int     tile    = warp_tile(k);
        const int     j0      = tile*QK_KIVI;
        // the tokens of the group that attend a cell of the tile
        const auto attended_by = [&](const uint32_t group, const int u) {
            return (__shfl_sync(0xFFFFFFFF, ti.mine(), u) & group) != 0;
        };

        // S^T = K Q^T over the tile: [half][C fragment], rows cells, columns 2tq and 2tq+1; each pass adds zeros to
        // the columns it leaves out
        float s[2][4] = {};
        if (ti.quant_k() != 0) {
            float koff[4] = {};  // sum_c m_c q_c, all rows alike
#pragma unroll
            for (int kk = 0; kk < NK; ++kk) {
                uint32_t qb[2];
                q_at(kk, ti.quant_k(), qb);
                uint32_t codes[4][4];
                half2    dm[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const char * block = stage_s + (16*kk + 2*tq + i % 2 + 8*(i/2))*k_bb;
                    dm[i] = *(const half2 *) block;
                    kvq_block_codes(block, k_codes, codes[i]);
                }
                // fp16 products of fp16 values: the fp32 product rounded once
                const half2    d01  = __lows2half2(dm[0], dm[1]);
                const half2    d23  = __lows2half2(dm[2], dm[3]);
                const half2    qd01 = __hmul2(*(const half2 *) &qb[0], d01);
                const half2    qd23 = __hmul2(*(const half2 *) &qb[1], d23);
                const uint32_t b[2] = { *(const uint32_t *) &qd01, *(const uint32_t *) &qd23 };
                const half2    m01  = __highs2half2(dm[0], dm[1]);
                const half2    m23  = __highs2half2(dm[2], dm[3]);
                const uint32_t am[4] = { *(const uint32_t *) &m01, *(const uint32_t *) &m01, *(const uint32_t *) &m23,
                                         *(const uint32_t *) &m23 };
                kvq_mma(koff, am, qb);
                kvq_mma_codes(s[0], codes, 0, b);
                kvq_mma_codes(s[1], codes, 1, b);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    s[h][i] += koff[i];
                }
            }
        }
        for_each_view(ti.tokens() & ~ti.quant_k(), j0, false, [&](const uint32_t group, const int lim) {
            kvq_cell cells[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int     u = kvq_s_row_cell(gid, r);
                const int64_t j = j0 + u;
                cells[r] = kvq_cell_at(qr.k, qr.first, j, hk, attended_by(group, u), j >= qr.k.n_sink && u < lim,
                                       qr.k_tiles + tile*p.k_tiles_nb1 + (size_t) hk*k_bytes);
            }
#pragma unroll
            for (int kk = 0; kk < NK; ++kk) {
                uint32_t qb[2];
                q_at(kk, group, qb);
                const int c = 16*kk + 2*tq;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const kvq_cell & lo = cells[2*h + 0];
                    const kvq_cell & hi = cells[2*h + 1];
                    const int u_lo = kvq_s_row_cell(gid, 2*h + 0);
                    const int u_hi = kvq_s_row_cell(gid, 2*h + 1);
                    const uint32_t a[4] = {
                        kvq_pack_halves(kvq_k_value(lo, u_lo, c + 0, p.k_bits), kvq_k_value(lo, u_lo, c + 1, p.k_bits)),
                        kvq_pack_halves(kvq_k_value(hi, u_hi, c + 0, p.k_bits), kvq_k_value(hi, u_hi, c + 1, p.k_bits)),
                        kvq_pack_halves(kvq_k_value(lo, u_lo, c + 8, p.k_bits), kvq_k_value(lo, u_lo, c + 9, p.k_bits)),
                        kvq_pack_halves(kvq_k_value(hi, u_hi, c + 8, p.k_bits), kvq_k_value(hi, u_hi, c + 9, p.k_bits)),
                    };
                    kvq_mma(s[h], a, qb);
                }
            }
        });

        // online softmax per column over the tile; the weights to p_s [cell][column], their sums per column. A
        // column whose token attends nothing here so far keeps its state (a token alone skips such a tile).
        float tile_max[2] = { -INFINITY, -INFINITY };
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float m = m_s[c_tok[i % 2]*QK_KIVI + kvq_s_row_cell(gid, 2*h + i/2)];
                s[h][i] = m != -INFINITY ? ggml_kvq_capped(s[h][i], p.softcap) + m : -INFINITY;
                tile_max[i % 2] = fmaxf(tile_max[i % 2], s[h][i]);
            }
        }
        float rescale[2];
#pragma unroll
        for (int x = 0; x < 2; ++x) {
#pragma unroll
            for (int o = 4; o < WARP_SIZE; o *= 2) {
                tile_max[x] = fmaxf(tile_max[x], __shfl_xor_sync(0xFFFFFFFF, tile_max[x], o));
            }
            const float new_max = fmaxf(run_max[x], tile_max[x]);
            rescale[x] = new_max == -INFINITY ? 1.0f : expf(run_max[x] - new_max);
            run_max[x] = new_max;
            run_sum[x] *= rescale[x];
        }
        float tile_sum[2] = { 0.0f, 0.0f };  // this lane's cells
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float w = s[h][i] == -INFINITY ? 0.0f : expf(s[h][i] - run_max[i % 2]);
                run_sum[i % 2]  += w;
                tile_sum[i % 2] += w;
                p_s[kvq_s_row_cell(gid, 2*h + i/2)*KVQ_MMA_COLS + 2*tq + i % 2] = w;
            }
        }
#pragma unroll
        for (int b = 0; b < NB; ++b) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                acc[b][0][i] *= rescale[i % 2];
                acc[b][1][i] *= rescale[i % 2];
                if constexpr (!latent) {
                    voff[b][i] *= rescale[i % 2];
                }
            }
        }
        __syncwarp();

        // B of P^T for k-step ks: the weights of cells 16ks + 2tq + {0, 1} and {8, 9}, column gid, zero unless its
        // token is in the group
        const auto weights = [&](const int ks, const uint32_t group, float (&w)[4]) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                w[e] = b_token & group ? p_s[kvq_v_col_cell(tq, ks, e)*KVQ_MMA_COLS + gid] : 0.0f;
            }
        };

        if (ti.quant_v() != 0) {
            if constexpr (latent) {
                // V^T's rows are the stage's K blocks: per 16 channels the codes times P^T, then each channel's scale
                // and minimum (the tile's weights of a column summed over the warp) in fp32. The weights of
                // unattended cells are zeros, their codes some of the block's.
#pragma unroll
                for (int x = 0; x < 2; ++x) {
#pragma unroll
                    for (int o = 4; o < WARP_SIZE; o *= 2) {
                        tile_sum[x] += __shfl_xor_sync(0xFFFFFFFF, tile_sum[x], o);
                    }
                    tile_sum[x] = ti.quant_v() >> c_tok[x] & 1 ? tile_sum[x] : 0.0f;
                }
                uint32_t bw[2][2];
#pragma unroll
                for (int ks = 0; ks < 2; ++ks) {
                    float w[4];
                    weights(ks, ti.quant_v(), w);
                    bw[ks][0] = kvq_pack_halves(w[0], w[1]);
                    bw[ks][1] = kvq_pack_halves(w[2], w[3]);
                }
#pragma unroll
                for (int b = 0; b < NB; ++b) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const char * row_lo = stage_s + (QK_KIVI*b + 16*h + gid)*k_bb;
                        const char * row_hi = row_lo + 8*k_bb;
                        float pv[4] = {};
#pragma unroll
                        for (int ks = 0; ks < 2; ++ks) {
                            uint32_t a[4];
                            kvq_latent_codes(row_lo, row_hi, v_cells, ks, a);
                            kvq_mma(pv, a, bw[ks]);
                        }
                        const float2 dm_lo = __half22float2(*(const half2 *) row_lo);
                        const float2 dm_hi = __half22float2(*(const half2 *) row_hi);
                        acc[b][h][0] += dm_lo.x*pv[0] + dm_lo.y*tile_sum[0];
                        acc[b][h][1] += dm_lo.x*pv[1] + dm_lo.y*tile_sum[1];
                        acc[b][h][2] += dm_hi.x*pv[2] + dm_hi.y*tile_sum[0];
                        acc[b][h][3] += dm_hi.x*pv[3] + dm_hi.y*tile_sum[1];
                    }
                }
            } else {
                // O^T += V^T P^T: [block][half][C fragment], rows channels 32b + 16h + gid (+8), columns heads; the
                // cells the tokens of the pass attend
                const uint32_t cells_v = __ballot_sync(0xFFFFFFFF, (ti.mine() & ti.quant_v()) != 0);
#pragma unroll
                for (int ks = 0; ks < 2; ++ks) {
                    float w[4];
                    bool  att[4];
                    weights(ks, ti.quant_v(), w);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        att[e] = cells_v >> kvq_v_col_cell(tq, ks, e) & 1;
                    }
                    const uint32_t bw[2] = { kvq_pack_halves(w[0], w[1]), kvq_pack_halves(w[2], w[3]) };
#pragma unroll
                    for (int b = 0; b < NB; ++b) {
                        uint32_t codes[4][4];
                        float    wd[4];
                        float    m[4];
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const char * block = stage_s + k_bytes + kvq_v_col_cell(tq, ks, e)*v_bytes + b*v_bb;
                            const float2 dm    = __half22float2(*(const half2 *) block);
                            kvq_block_codes(block, v_codes, codes[e]);
                            // a row no token of the pass attends may hold anything: it is dropped, never multiplied
                            // by zero
                            wd[e] = att[e] ? w[e]*dm.x : 0.0f;
                            m[e]  = att[e] ? dm.y : 0.0f;
                        }
                        const uint32_t m01   = kvq_pack_halves(m[0], m[1]);
                        const uint32_t m23   = kvq_pack_halves(m[2], m[3]);
                        const uint32_t am[4] = { m01, m01, m23, m23 };
                        kvq_mma(voff[b], am, bw);
                        const uint32_t bf[2] = { kvq_pack_halves(wd[0], wd[1]), kvq_pack_halves(wd[2], wd[3]) };
                        kvq_mma_codes(acc[b][0], codes, 0, bf);
                        kvq_mma_codes(acc[b][1], codes, 1, bf);
                    }
                }
            }
        }
        // V of the tiles that hold fp16 cells, per view: a latent layer's V cell is its K cell, channels below DV
        for_each_view(ti.tokens() & ~ti.quant_v(), j0, true, [&](const uint32_t group, const int lim) {
#pragma unroll
            for (int ks = 0; ks < 2; ++ks) {
                float w[4];
                weights(ks, group, w);
                const uint32_t bw[2] = { kvq_pack_halves(w[0], w[1]), kvq_pack_halves(w[2], w[3]) };
                kvq_cell cells[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int     u   = kvq_v_col_cell(tq, ks, e);
                    const int64_t j   = j0 + u;
                    const bool    att = attended_by(group, u);
                    cells[e] = latent
                        ? kvq_cell_at(qr.k, qr.first, j, hk, att, j >= qr.k.n_sink && u < lim,
                                      qr.k_tiles + tile*p.k_tiles_nb1 + (size_t) hk*k_bytes)
                        : kvq_cell_at(qr.v, qr.first, j, hk, att, j >= qr.k.n_sink && u < lim,
                                      qr.v_rows + j*p.v_rows_nb1 + (size_t) hk*v_bytes);
                }
                const auto v_at = [&](const int e, const int c) {
                    return latent ? kvq_k_value(cells[e], kvq_v_col_cell(tq, ks, e), c, p.k_bits)
                                  : kvq_v_value(cells[e], c, p.v_bits);
                };
#pragma unroll
                for (int b = 0; b < NB; ++b) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int c = QK_KIVI*b + 16*h + gid;
                        const uint32_t a[4] = {
                            kvq_pack_halves(v_at(0, c + 0), v_at(1, c + 0)),
                            kvq_pack_halves(v_at(0, c + 8), v_at(1, c + 8)),
                            kvq_pack_halves(v_at(2, c + 0), v_at(3, c + 0)),
                            kvq_pack_halves(v_at(2, c + 8), v_at(3, c + 8)),
                        };
                        kvq_mma(acc[b][h], a, bw);
                    }
                }
            }
        });
        __syncwarp(); // p_s, the masks and the stage belong to the next tiles
    }

    // the warp's state per head: sums over its lanes, the V offsets added to the outputs
#pragma unroll
    for (int x = 0; x < 2; ++x) {
#pragma unroll
        for (int o = 4; o < WARP_SIZE; o *= 2) {
            run_sum[x] += __shfl_xor_sync(0xFFFFFFFF, run_sum[x], o);
        }
    }
    if constexpr (!latent) {
#pragma unroll
        for (int b = 0; b < NB; ++b) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                acc[b][0][i] += voff[b][i];
                acc[b][1][i] += voff[b][i];
            }
        }
    }

    // the warps' states into shared memory (over the stages, once every warp is done with them), then the block's
    // result as the CUDA-core kernel writes it
    constexpr int slice = KVQ_MMA_COLS*DV;
    float * slice_s = (float *) kvq_mma_smem;
    float * w_s     = slice_s + KVQ_NWARPS*slice;
    __syncthreads();
#pragma unroll
    for (int b = 0; b < NB; ++b) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int c = QK_KIVI*b + 16*h + gid + 8*(i/2);
                slice_s[warp*slice + (2*tq + i % 2)*DV + c] = acc[b][h][i];
            }
        }
    }
    if (gid == 0) {
#pragma unroll
        for (int x = 0; x < 2; ++x) {
            w_s[warp*2*KVQ_MMA_COLS + 2*(2*tq + x) + 0] = run_max[x];
            w_s[warp*2*KVQ_MMA_COLS + 2*(2*tq + x) + 1] = run_sum[x];
        }
    }
    __syncthreads();
    kvq_attn_write_block(p, w_s, 2*KVQ_MMA_COLS, slice_s, slice, nh, h0, bt, split);
#else
    GGML_UNUSED(p);
    NO_DEVICE_CODE;
#endif // AMPERE_MMA_AVAILABLE
}

// shared memory of a block: per warp its stages and its tile's weights (and Q where kvq_mma_q_shared); at the end
// the warps' states
static __host__ size_t kvq_attn_mma_smem(const int D, const int DV, const int k_bits, const int v_bits, const bool packed) {
    const size_t q      = kvq_mma_q_shared(D, DV, packed) ? (size_t) D/16*WARP_SIZE*sizeof(uint2) : 0;
    const size_t warps  = KVQ_NWARPS*(size_t) kvq_mma_warp_bytes(D, DV, k_bits, v_bits) + q;
    const size_t states = KVQ_NWARPS*(KVQ_MMA_COLS*DV + 2*KVQ_MMA_COLS)*sizeof(float);
    return std::max(warps, states);
}
