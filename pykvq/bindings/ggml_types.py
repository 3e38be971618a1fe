"""ggml type ids of pykvq's KV-cache types, as the patched ggml.h numbers them (usable as the plain ints
that llama.cpp's C API and llama-cpp-python take for type_k / type_v)."""

GGML_TYPE_F16 = 1
GGML_TYPE_Q4_0 = 2
GGML_TYPE_Q4_1 = 3
GGML_TYPE_Q8_0 = 8
GGML_TYPE_KIVI2 = 43
GGML_TYPE_KIVI4 = 44
GGML_TYPE_KIVI1 = 45

KIVI_BITS = {GGML_TYPE_KIVI2: 2, GGML_TYPE_KIVI4: 4, GGML_TYPE_KIVI1: 1}
