// CPU kernels of GGML_KVQ_OP_SCORE_LSE and SCORE_ADD (kvq-cpu-score.c), dispatched by ggml_compute_forward_kvq
// (kvq-cpu.c).
#pragma once

struct ggml_compute_params;
struct ggml_tensor;

void kvq_score_lse(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void kvq_score_add(const struct ggml_compute_params * params, struct ggml_tensor * dst);
