// CUDA kernels of pykvq's kivi KV cache: GGML_OP_KVQ and ggml_set_rows into the kivi types (ggml-kvq.h).
#pragma once

#include "common.cuh"
#include "ggml-kvq.h"

// the op of the kind in op_params[0] (enum ggml_kvq_op)
void ggml_cuda_op_kvq(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// GGML_OP_KVQ and GGML_OP_SET_ROWS (F32 rows into a kivi tensor) as far as these kernels handle them
bool ggml_cuda_kvq_supports_op(const ggml_tensor * op);

// ggml_set_rows with a kivi dst: quantizes each 32-value block of the F32 rows like the reference quantizer
void ggml_cuda_kvq_set_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
