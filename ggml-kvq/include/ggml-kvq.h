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

#include <stdint.h>

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

// ggml_validate_row_data for the kivi types: d and m must be finite
GGML_API bool ggml_kvq_validate_row_data(enum ggml_type type, const void * data, size_t nbytes);

// true for the kivi types
GGML_API bool ggml_kvq_is_kivi(enum ggml_type type);

#ifdef __cplusplus
}
#endif
