# ggml-kvq: our sources compiled into upstream's ggml-base (formats) and ggml-cpu (CPU kernels); the
# ggml patches hook them into ggml's type and op tables.
set(PYKVQ_GGML_KVQ_DIR ${CMAKE_CURRENT_LIST_DIR})
target_include_directories(ggml-base PUBLIC ${PYKVQ_GGML_KVQ_DIR}/include)
target_sources(ggml-base PRIVATE
    ${PYKVQ_GGML_KVQ_DIR}/src/kvq-quants.c
)
