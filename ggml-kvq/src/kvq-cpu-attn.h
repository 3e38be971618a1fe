// CPU kernel of GGML_KVQ_OP_ATTN, the fused attention over a kivi cache (kvq-cpu-attn.c), dispatched by
// ggml_compute_forward_kvq (kvq-cpu.c).
#pragma once

struct ggml_compute_params;
struct ggml_tensor;

void kvq_attn(const struct ggml_compute_params * params, struct ggml_tensor * dst);
