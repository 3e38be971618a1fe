// Emulated PTX of the tensor-core attention (stands in for ggml-kvq/src/cuda/kvq-cuda-ptx.cuh): mma.m16n8k16
// as the PTX ISA lays its fragments out, computed from the whole warp's registers; cp.async with the latitude the
// PTX ISA leaves it (emulator.cpp: a copy's destination is undefined from its issue until the wait that retires its
// group), checking the instruction's alignment.
#pragma once

#include "kvq-cuda.cuh"

void kvq_emu_mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
void kvq_emu_cp_async(char * dst_s, const char * src, int bytes);
void kvq_emu_cp_async_commit();
void kvq_emu_cp_async_wait(int n);

static inline void kvq_mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    kvq_emu_mma(d, a, b);
}

template <int bytes>
static inline void kvq_cp_async(char * dst_s, const char * src) {
    if ((uintptr_t) dst_s % bytes != 0 || (uintptr_t) src % bytes != 0) {
        std::abort();
    }
    kvq_emu_cp_async(dst_s, src, bytes);
}

static inline void kvq_cp_async_commit() {
    kvq_emu_cp_async_commit();
}

template <int n>
static inline void kvq_cp_async_wait() {
    kvq_emu_cp_async_wait(n);
}
