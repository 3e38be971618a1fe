// Runs pykvq's attention kernels (ggml-kvq/src/cuda: kvq-cuda-attn-kernel.cuh on CUDA cores,
// kvq-cuda-mma-kernel.cuh on tensor cores) and its store kernels (kvq-cuda-store.cuh) on the CPU: one OS thread per CUDA thread of a block, blocks one after
// another, warp collectives and mma.m16n8k16 computed from what every lane of the warp published.
// kvq_emu_attn_cuda_cores and kvq_emu_attn_mma are ggml custom ops (ggml_map_custom1) over a GGML_OP_KVQ attention
// node: each plans and launches its kernel as kvq-cuda.cu does, on the node's host tensors; kvq_emu_store runs a
// GGML_OP_KVQ store node in place of its CPU kernel, kvq_emu_store_v a STORE_V node.

#include "kvq-cuda-attn-kernel.cuh"
#include "kvq-cuda-mma-kernel.cuh"
#include "kvq-cuda-store.cuh"

#include <barrier>
#include <cstring>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

thread_local dim3 threadIdx;
thread_local dim3 blockIdx;
dim3 blockDim;
dim3 gridDim;

// the kernels' dynamic shared memory
alignas(16) char kvq_mma_smem[1 << 18];
alignas(16) float kvq_smem[1 << 16];

namespace {

struct emu_warp {
    std::barrier<> bar{WARP_SIZE};
    uint32_t       words[WARP_SIZE][6];
};

struct emu_block {
    explicit emu_block(int n_threads) : bar(n_threads), flags(n_threads), warps(n_threads/WARP_SIZE) {}
    std::barrier<>        bar;
    std::vector<char>     flags;
    std::vector<emu_warp> warps;
};

emu_block * g_block = nullptr;

// a cp.async in flight
struct emu_copy {
    char *       dst;
    const char * src;
    int          bytes;
};

// the calling thread's cp.async copies: those not yet committed, and its committed groups, oldest first
struct emu_copies {
    std::vector<emu_copy>              open;
    std::deque<std::vector<emu_copy>> groups;

    bool idle() const { return open.empty() && groups.empty(); }
};

thread_local emu_copies t_copies;

emu_warp & my_warp() {
    return g_block->warps[threadIdx.x/WARP_SIZE];
}

int my_lane() {
    return (int) (threadIdx.x % WARP_SIZE);
}

float half_at(uint32_t word, int k) {
    return __half2float(__ushort_as_half((unsigned short) (word >> 16*k)));
}

// runs body() as the kernel of a grid of blocks of n_threads threads; smem_bytes of its shared memory at smem
// (capacity bytes), filled with a NaN pattern before each block so that a read of memory the block never wrote shows
template <typename F>
void emu_launch(const dim3 grid, const int n_threads, void * smem, const size_t capacity, const size_t smem_bytes,
                F body) {
    if (smem_bytes > capacity || n_threads % WARP_SIZE != 0) {
        std::abort();
    }
    gridDim  = grid;
    blockDim = dim3(n_threads);
    emu_block block(n_threads);
    g_block = &block;
    std::vector<std::thread> threads;
    for (int tid = 0; tid < n_threads; ++tid) {
        threads.emplace_back([&, tid]() {
            threadIdx = dim3(tid);
            for (unsigned z = 0; z < grid.z; ++z) {
                for (unsigned y = 0; y < grid.y; ++y) {
                    for (unsigned x = 0; x < grid.x; ++x) {
                        blockIdx = dim3(x, y, z);
                        if (tid == 0) {
                            memset(smem, 0xFF, smem_bytes);
                        }
                        block.bar.arrive_and_wait();
                        body();
                        if (!t_copies.idle()) {
                            // a block that ends with copies in flight into its shared memory: a kernel bug
                            std::abort();
                        }
                        block.bar.arrive_and_wait();
                    }
                }
            }
        });
    }
    for (std::thread & t : threads) {
        t.join();
    }
    g_block = nullptr;
}

} // namespace

uint32_t kvq_emu_exchange(uint32_t word, int src_lane) {
    emu_warp & w = my_warp();
    w.words[my_lane()][0] = word;
    w.bar.arrive_and_wait();
    const uint32_t r = w.words[src_lane][0];
    w.bar.arrive_and_wait();
    return r;
}

uint32_t kvq_emu_ballot(bool pred) {
    emu_warp & w = my_warp();
    w.words[my_lane()][0] = pred;
    w.bar.arrive_and_wait();
    uint32_t r = 0;
    for (int l = 0; l < WARP_SIZE; ++l) {
        r |= (w.words[l][0] != 0) << l;
    }
    w.bar.arrive_and_wait();
    return r;
}

void kvq_emu_syncwarp() {
    my_warp().bar.arrive_and_wait();
}

void kvq_emu_syncthreads() {
    g_block->bar.arrive_and_wait();
}

bool kvq_emu_syncthreads_or(bool pred) {
    g_block->flags[threadIdx.x] = pred;
    g_block->bar.arrive_and_wait();
    bool r = false;
    for (char f : g_block->flags) {
        r = r || f;
    }
    g_block->bar.arrive_and_wait();
    return r;
}

// PTX ISA, cp.async: the copy may land at any time until the thread's cp.async.wait_group retires its group, and
// only then is it visible to the thread (to the warp's other lanes after a __syncwarp). The emulation takes both
// extremes: at the issue the destination holds the NaN pattern of unwritten shared memory (a lane that still reads
// what the stage held, or reads it before the wait, sees it), and the data lands when the wait retires the group.
void kvq_emu_cp_async(char * dst_s, const char * src, int bytes) {
    memset(dst_s, 0xFF, bytes);
    t_copies.open.push_back({ dst_s, src, bytes });
}

void kvq_emu_cp_async_commit() {
    t_copies.groups.push_back(std::move(t_copies.open));
    t_copies.open.clear();
}

void kvq_emu_cp_async_wait(int n) {
    while ((int) t_copies.groups.size() > n) {
        for (const emu_copy & c : t_copies.groups.front()) {
            memcpy(c.dst, c.src, c.bytes);
        }
        t_copies.groups.pop_front();
    }
}

// PTX ISA, mma.m16n8k16 with .f16 A and B: lane 4*g + t holds A (row g, columns 2t, 2t+1), (row g+8, the
// same), (row g, columns 2t+8, 2t+9), (row g+8, the same); B (rows 2t, 2t+1, column g), (rows 2t+8, 2t+9,
// column g); C (row g, columns 2t, 2t+1), (row g+8, the same). The low half of a register is the lower column
// (A) or row (B).
void kvq_emu_mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    emu_warp & w = my_warp();
    const int  lane = my_lane();
    memcpy(w.words[lane], a, sizeof(a));
    memcpy(w.words[lane] + 4, b, sizeof(b));
    w.bar.arrive_and_wait();
    float A[16][16];
    float B[16][8];
    for (int l = 0; l < WARP_SIZE; ++l) {
        const int g = l/4;
        const int t = l%4;
        for (int k = 0; k < 2; ++k) {
            A[g + 0][2*t + k + 0] = half_at(w.words[l][0], k);
            A[g + 8][2*t + k + 0] = half_at(w.words[l][1], k);
            A[g + 0][2*t + k + 8] = half_at(w.words[l][2], k);
            A[g + 8][2*t + k + 8] = half_at(w.words[l][3], k);
            B[2*t + k + 0][g]     = half_at(w.words[l][4], k);
            B[2*t + k + 8][g]     = half_at(w.words[l][5], k);
        }
    }
    w.bar.arrive_and_wait();
    const int g = lane/4;
    const int t = lane%4;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8*(i/2);
        const int col = 2*t + i%2;
        for (int k = 0; k < 16; ++k) {
            d[i] += A[row][k]*B[k][col];
        }
    }
}

// floats of split partials per launch: KVQ_MAX_PARTIALS, or fewer where a test sets KVQ_EMU_MAX_PARTIALS, so that
// a small batch takes several launches as a long context's large batch does on a GPU
static int64_t emu_max_partials() {
    const char * forced = getenv("KVQ_EMU_MAX_PARTIALS");
    return forced != nullptr ? atoll(forced) : KVQ_MAX_PARTIALS;
}

// A GGML_OP_KVQ attention node's parameters, planned with ncols query heads and n_tok tokens per block and splits of
// tiles_per_split tiles, launched as kvq-cuda.cu launches it: in chunks of blocks along z (kvq_attn_launch_blocks),
// the split partials of one chunk in host memory
struct emu_attn {
    emu_attn(ggml_tensor * dst, const ggml_tensor * attn, const int ncols, const int tiles_per_split, const bool mma) {
        p = kvq_attn_make_params(attn);
        GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_are_same_shape(dst, attn) && ggml_is_contiguous(dst));
        p.dst     = (char *) dst->data;
        p.dst_nb1 = dst->nb[1];
        p.dst_nb2 = dst->nb[2];
        kvq_attn_plan(p, ncols, tiles_per_split, mma ? kvq_attn_mma_tokens(p) : 1);
        chunk = kvq_attn_launch_blocks(p, emu_max_partials());
        part.resize((size_t) chunk*kvq_attn_block_partials(p));
        arrived.resize((size_t) chunk*kvq_attn_n_rows(p));
        kvq_attn_use_partials(p, part.data(), arrived.data(), chunk);
    }

    // launch(grid) per chunk, p.z0 its first block
    template <typename F>
    void launches(F launch) {
        const int n_blocks = kvq_attn_n_blocks(p);
        for (p.z0 = 0; p.z0 < n_blocks; p.z0 += chunk) {
            std::fill(arrived.begin(), arrived.end(), 0);
            launch(dim3(p.n_splits, kvq_attn_n_rows(p), std::min(chunk, n_blocks - p.z0)));
        }
    }

    kvq_attn_params    p;
    int                chunk;
    std::vector<float> part;
    std::vector<int>   arrived;
};

template <int ncols, int nvq>
void emu_cuda_cores(emu_attn & a) {
    a.launches([&](const dim3 grid) {
        emu_launch(grid, KVQ_NWARPS*WARP_SIZE, kvq_smem, sizeof(kvq_smem), kvq_attn_smem(ncols, a.p),
                   [&]() { kvq_attn_kernel<ncols, nvq>(a.p); });
    });
}

template <int nvq>
void emu_cuda_cores_cols(emu_attn & a, const int ncols) {
    switch (ncols) {
        case 1: emu_cuda_cores<1, nvq>(a); break;
        case 2: emu_cuda_cores<2, nvq>(a); break;
        case 4: emu_cuda_cores<4, nvq>(a); break;
        default:
            // kvq_attn_ncols gives 8 only for head sizes up to 256
            if constexpr (nvq <= 2) {
                emu_cuda_cores<8, nvq>(a);
            } else {
                GGML_ABORT("8 query heads per block with head size %d", a.p.v.head_dim);
            }
            break;
    }
}

// The tiles per split a launch takes: the kernel's own unless `userdata` points to a number a test forces
static int emu_tiles_per_split(const void * userdata, const int own) {
    return userdata != nullptr ? *(const int *) userdata : own;
}

// ggml_custom1_op_t: the attention node's output through the CUDA-core kernel
extern "C" void kvq_emu_attn_cuda_cores(ggml_tensor * dst, const ggml_tensor * attn, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    const kvq_attn_params p0 = kvq_attn_make_params(attn);
    const int ncols = kvq_attn_ncols(p0.n_gqa, p0.k.head_dim, p0.v.head_dim);
    emu_attn a(dst, attn, ncols, emu_tiles_per_split(userdata, KVQ_TILES_PER_SPLIT), false);
    switch (a.p.v.head_dim <= 128 ? 1 : (a.p.v.head_dim <= 256 ? 2 : 4)) {
        case 1:  emu_cuda_cores_cols<1>(a, ncols); break;
        case 2:  emu_cuda_cores_cols<2>(a, ncols); break;
        default: emu_cuda_cores_cols<4>(a, ncols); break;
    }
}

// The tensor-core kernel for head sizes D (K) and DV (V) at tpw tiles per warp, packed (several tokens a block) or
// not: the product's for any size, the forced ones the split tests use (tests/test_kvq_split_invariance.py) for
// D = 128 only
template <int D, int DV, bool packed>
static auto emu_mma_kernel(const int tpw) {
    constexpr int own = KVQ_MMA_TILES_PER_SPLIT/KVQ_NWARPS;
    if (tpw == own) {
        return kvq_attn_mma_kernel<D, DV, packed, own>;
    }
    if constexpr (D == 128) {
        switch (tpw) {
            case 1:  return kvq_attn_mma_kernel<D, DV, packed, 1>;
            case 2:  return kvq_attn_mma_kernel<D, DV, packed, 2>;
            case 7:  return kvq_attn_mma_kernel<D, DV, packed, 7>;
            case 14: return kvq_attn_mma_kernel<D, DV, packed, 14>;
            default: break;
        }
    }
    GGML_ABORT("no emulated tensor-core kernel for head size %d at %d tiles per warp", D, tpw);
}

// the kernel the launch picks (kvq_attn_mma_dispatch)
template <int D, int DV>
static auto emu_mma_kernel_for(const kvq_attn_params & p, const int tpw) {
    return kvq_attn_mma_dispatch<D, DV>(p, [&](auto packed) { return emu_mma_kernel<D, DV, packed()>(tpw); });
}

// ggml_custom1_op_t: the attention node's output through the tensor-core kernel (the head sizes
// kvq_attn_mma_launch takes; KVQ_MMA_COLS query heads per block)
extern "C" void kvq_emu_attn_mma(ggml_tensor * dst, const ggml_tensor * attn, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    const int tiles_per_split = emu_tiles_per_split(userdata, KVQ_MMA_TILES_PER_SPLIT);
    GGML_ASSERT(tiles_per_split % KVQ_NWARPS == 0);
    emu_attn     a(dst, attn, KVQ_MMA_COLS, tiles_per_split, true);
    const size_t smem = kvq_attn_mma_smem(a.p.k.head_dim, a.p.v.head_dim, a.p.k_bits, a.p.v_bits,
                                         kvq_attn_mma_packed(a.p));
    const auto   run  = [&](auto kernel) {
        a.launches([&](const dim3 grid) {
            emu_launch(grid, KVQ_NWARPS*WARP_SIZE, kvq_mma_smem, sizeof(kvq_mma_smem), smem, [&]() { kernel(a.p); });
        });
    };
    const int tpw = tiles_per_split/KVQ_NWARPS;
    if (a.p.latent) {
        GGML_ASSERT(a.p.k.head_dim == 576 && a.p.v.head_dim == 512);
        run(emu_mma_kernel_for<576, 512>(a.p, tpw));
        return;
    }
    GGML_ASSERT(a.p.k.head_dim == a.p.v.head_dim);
    switch (a.p.k.head_dim) {
        case 64:  run(emu_mma_kernel_for<64, 64>(a.p, tpw));   break;
        case 96:  run(emu_mma_kernel_for<96, 96>(a.p, tpw));   break;
        case 128: run(emu_mma_kernel_for<128, 128>(a.p, tpw)); break;
        case 256: run(emu_mma_kernel_for<256, 256>(a.p, tpw)); break;
        default:  GGML_ABORT("no tensor-core kernel for head size %d", a.p.k.head_dim);
    }
}

// a STORE node's writes (ggml_kvq_store) through the CUDA kernel, on the node's host tensors
extern "C" void kvq_emu_store(const ggml_tensor * store) {
    const kvq_store_params p = kvq_store_make_params(store);
    emu_launch(dim3(kvq_store_grid_x(p), p.k.n_tokens), KVQ_BLOCK_SIZE, kvq_smem, sizeof(kvq_smem), 0,
               [&]() { kvq_store_kernel(p); });
}

// a STORE_V node's writes (ggml_kvq_store_v) through the CUDA set_rows kernel, on the node's host tensors
extern "C" void kvq_emu_store_v(const ggml_tensor * store_v) {
    const kvq_set_rows_params p = kvq_set_rows_make_params(store_v->src[1], store_v->src[2], store_v,
                                                           ggml_get_op_params_f32(store_v, GGML_KVQ_CLIP_PARAM),
                                                           ggml_kvq_store_v_dither(store_v));
    if (p.n_blocks == 0) {
        return;
    }
    kvq_set_rows_dispatch(store_v->src[2], ggml_kvq_bits(store_v->type), [&](auto kernel) {
        emu_launch(dim3(kvq_set_rows_grid(p)), KVQ_BLOCK_SIZE, kvq_smem, sizeof(kvq_smem), 0, [&]() { kernel(p); });
    });
}
