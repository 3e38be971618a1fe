// CPU kernels of GGML_OP_KVQ, dispatched from ggml-cpu.c
#pragma once

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

void ggml_compute_forward_kvq(const struct ggml_compute_params * params, struct ggml_tensor * dst);

#ifdef __cplusplus
}
#endif
