// CPU kernels of the flash-attention prefill's GGML_KVQ_OP_WIDE and WIDE_MASK (kvq-cpu-wide.c), dispatched by
// ggml_compute_forward_kvq (kvq-cpu.c).
#pragma once

struct ggml_compute_params;
struct ggml_tensor;

void kvq_wide(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void kvq_wide_mask(const struct ggml_compute_params * params, struct ggml_tensor * dst);
