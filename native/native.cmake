# native: pykvq's llama-level sources, compiled into upstream's libllama.
set(PYKVQ_NATIVE_DIR ${CMAKE_CURRENT_LIST_DIR})
target_sources(llama PRIVATE
    ${PYKVQ_NATIVE_DIR}/src/llama-kvq.cpp
    ${PYKVQ_NATIVE_DIR}/src/llama-kvq-batch.cpp
    ${PYKVQ_NATIVE_DIR}/src/llama-kvq-cache.cpp
    ${PYKVQ_NATIVE_DIR}/src/llama-kvq-file.cpp
    ${PYKVQ_NATIVE_DIR}/src/llama-kvq-layers.cpp
    ${PYKVQ_NATIVE_DIR}/src/llama-kvq-memory.cpp
    ${PYKVQ_NATIVE_DIR}/src/llama-kvq-select.cpp
    ${PYKVQ_NATIVE_DIR}/src/llama-kvq-types.cpp
)
target_include_directories(llama PUBLIC ${PYKVQ_NATIVE_DIR}/include)
# llama_kvq_atomic_file (llama-kvq-file.h), which the llama patches use
target_include_directories(llama PRIVATE ${PYKVQ_NATIVE_DIR}/src)
target_compile_definitions(llama PRIVATE PYKVQ_VERSION="${PYKVQ_VERSION}")

# llama_kvq_fit_params (llama-kvq-fit.h): upstream's C++ parameter fit, reached from Python through a C ABI
target_sources(llama-common PRIVATE ${PYKVQ_NATIVE_DIR}/src/llama-kvq-fit.cpp)
