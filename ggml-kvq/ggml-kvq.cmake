# ggml-kvq: our sources compiled into upstream's ggml-base (formats, graph constructors) and ggml-cpu
# (CPU kernels) and, when built, ggml-cuda (CUDA kernels); the ggml patches hook them into ggml's type and op
# tables and backends.
set(PYKVQ_GGML_KVQ_DIR ${CMAKE_CURRENT_LIST_DIR})
target_include_directories(ggml-base PUBLIC ${PYKVQ_GGML_KVQ_DIR}/include)
target_sources(ggml-base PRIVATE
    ${PYKVQ_GGML_KVQ_DIR}/src/kvq-quants.c
    ${PYKVQ_GGML_KVQ_DIR}/src/kvq-ops.c
)
# the quantizers' arithmetic is the oracle's, product and sum rounded each on its own (GCC fuses them by default
# where FMA is in the target, as on ARM; clang within an expression)
if (CMAKE_C_COMPILER_ID MATCHES "GNU|Clang")
    set_source_files_properties(${PYKVQ_GGML_KVQ_DIR}/src/kvq-quants.c TARGET_DIRECTORY ggml-base
        PROPERTIES COMPILE_OPTIONS -ffp-contract=off)
endif()
target_include_directories(ggml-cpu PRIVATE ${PYKVQ_GGML_KVQ_DIR}/src)
target_sources(ggml-cpu PRIVATE
    ${PYKVQ_GGML_KVQ_DIR}/src/kvq-cpu.c
    ${PYKVQ_GGML_KVQ_DIR}/src/kvq-cpu-attn.c
    ${PYKVQ_GGML_KVQ_DIR}/src/kvq-cpu-source.c
    ${PYKVQ_GGML_KVQ_DIR}/src/kvq-cpu-wide.c
    ${PYKVQ_GGML_KVQ_DIR}/src/kvq-cpu-score.c
)
if (TARGET ggml-cuda)
    # our kernels include ggml-cuda's common.cuh, as upstream's own .cu files do
    target_include_directories(ggml-cuda PRIVATE ${PYKVQ_GGML_KVQ_DIR}/src/cuda ${PYKVQ_UPSTREAM_TREE}/ggml/src/ggml-cuda)
    if (PYKVQ_CUBLAS_INCLUDE_DIR)
        target_include_directories(ggml-cuda SYSTEM PRIVATE ${PYKVQ_CUBLAS_INCLUDE_DIR})
    endif()
    # Should a static archive (libstdc++.a, cudart_static) still end up in libggml-cuda.so, its symbols stay
    # local: exported, a copy of libstdc++'s would capture libllama's iostream calls (cmake/pykvq-libstdcxx.cmake).
    target_link_options(ggml-cuda PRIVATE "LINKER:--exclude-libs,ALL")
    # Ahead of upstream's sources, the tensor-core attention first: it is the build's longest compile (3.6 min on 2
    # cores), and ninja, with no build log yet (a fresh CI machine), starts equal jobs in the order they are listed:
    # last, it ran alone for the final two minutes of a cold build.
    set(sources
        ${PYKVQ_GGML_KVQ_DIR}/src/cuda/kvq-cuda-mma.cu
        ${PYKVQ_GGML_KVQ_DIR}/src/cuda/kvq-cuda.cu
        ${PYKVQ_GGML_KVQ_DIR}/src/cuda/kvq-cuda-wide.cu
        ${PYKVQ_GGML_KVQ_DIR}/src/cuda/kvq-cuda-score.cu
    )
    get_target_property(upstream_sources ggml-cuda SOURCES)
    get_target_property(upstream_dir ggml-cuda SOURCE_DIR)
    foreach (source ${upstream_sources})
        cmake_path(ABSOLUTE_PATH source BASE_DIRECTORY ${upstream_dir})
        list(APPEND sources ${source})
    endforeach()
    set_property(TARGET ggml-cuda PROPERTY SOURCES ${sources})
endif()
