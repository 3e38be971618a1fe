# PYKVQ_SANITIZE=address,undefined (CI's sanitizer job): the libraries that hold pykvq's C and C++ code and parse
# what a user hands over, ggml (formats, kernels, GGUF files) and libllama (the cache, state files, type specs), built
# with those sanitizers, at -O1 as ASan's documentation builds. libllama-common and the tools, which parse command
# lines and drive libllama, keep the plain build's flags, and with them its ccache entries: from an empty cache (a new
# CI machine, 2 cores) the sanitizer build compiles about half as much.
set(PYKVQ_SANITIZE "" CACHE STRING "pykvq: sanitizers to build ggml and libllama with (address,undefined)")
if (PYKVQ_SANITIZE)
    foreach (target ggml-base ggml-cpu ggml ggml-rpc llama)
        # after the build type's -O3, so -O1 is the one that counts
        target_compile_options(${target} PRIVATE -fsanitize=${PYKVQ_SANITIZE} -fno-sanitize-recover=undefined
                                                 -fno-omit-frame-pointer -O1)
        target_link_options(${target} PRIVATE -fsanitize=${PYKVQ_SANITIZE})
    endforeach()
    message(STATUS "pykvq: ggml and libllama built with -fsanitize=${PYKVQ_SANITIZE}")
endif()
