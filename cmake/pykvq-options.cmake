# Upstream options: only what pykvq uses, no -march=native (the build machine may fault on AMX).
set(BUILD_SHARED_LIBS ON)

set(GGML_NATIVE OFF CACHE BOOL "" FORCE)
foreach (feature AVX AVX2 FMA F16C BMI2)
    set(GGML_${feature} ON CACHE BOOL "" FORCE)
endforeach()

foreach (option LLAMA_BUILD_TESTS LLAMA_BUILD_TOOLS LLAMA_BUILD_EXAMPLES LLAMA_BUILD_SERVER LLAMA_BUILD_APP
                LLAMA_BUILD_UI LLAMA_OPENSSL LLAMA_CURL LLAMA_TOOLS_INSTALL LLAMA_TESTS_INSTALL)
    set(${option} OFF CACHE BOOL "" FORCE)
endforeach()
set(LLAMA_BUILD_COMMON ON CACHE BOOL "" FORCE)
# libmtmd: llama-cpp-python's multimodal chat handlers (images into the KV cache) load it beside libllama; 51 of
# the build's 196 objects, which a build for text alone (CI's sanitizer job) leaves out
option(PYKVQ_MTMD "pykvq: build libmtmd, for llama-cpp-python's multimodal chat handlers" ON)
set(LLAMA_BUILD_MTMD ${PYKVQ_MTMD} CACHE BOOL "" FORCE)
# ggml's RPC backend: remote devices (`--rpc`), and the tests' device whose memory the host cannot read
set(GGML_RPC ON CACHE BOOL "" FORCE)

# the sdist carries no git history: tell upstream which commit it is
set(LLAMA_BUILD_COMMIT ${PYKVQ_LLAMA_CPP_COMMIT})
