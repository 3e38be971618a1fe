# Install the shared libraries into pykvq/lib and the tools into pykvq/bin, found at run time from
# the package itself. Only the "pykvq" component goes into the wheel (pyproject.toml), which keeps
# upstream's own install rules (headers, pkg-config, CMake packages) out of site-packages.
set(PYKVQ_LIBRARIES ggml ggml-base ggml-cpu ggml-cuda ggml-rpc llama llama-common mtmd
    llama-perplexity-impl llama-completion-impl llama-batched-bench-impl)
# upstream's tree is EXCLUDE_FROM_ALL: a library no tool links (mtmd) is built only when asked for
add_custom_target(pykvq-libraries ALL)

foreach (target ${PYKVQ_LIBRARIES})
    if (NOT TARGET ${target})
        continue()
    endif()
    # a plain libX.so: wheels cannot hold the libX.so.0 -> libX.so.0.0.N symlink chain
    set_property(TARGET ${target} PROPERTY VERSION)
    set_property(TARGET ${target} PROPERTY SOVERSION)
    set_target_properties(${target} PROPERTIES INSTALL_RPATH "$ORIGIN")
    install(TARGETS ${target} LIBRARY DESTINATION pykvq/lib COMPONENT pykvq)
    add_dependencies(pykvq-libraries ${target})
endforeach()

if (TARGET ggml-cuda AND PYKVQ_CUDA_INSTALL_RPATH)
    set_property(TARGET ggml-cuda APPEND PROPERTY INSTALL_RPATH "${PYKVQ_CUDA_INSTALL_RPATH}")
endif()

foreach (tool ${PYKVQ_TOOLS})
    set_target_properties(${tool} PROPERTIES INSTALL_RPATH "$ORIGIN/../lib")
    install(TARGETS ${tool} RUNTIME DESTINATION pykvq/bin COMPONENT pykvq)
endforeach()

# llama.cpp's own HF -> GGUF converter (the script and its per-architecture `conversion` package), run by
# `pykvq convert`: every architecture upstream converts, pykvq converts. Its `gguf` package goes beside it as
# `gguf-py/`, where the converter looks first; pykvq reads and writes GGUF with the same copy under a private
# name (pykvq/bindings/gguf_py.py). Nothing lands in site-packages but `pykvq`, so PyPI's `gguf` (which
# transformers reads GGUF with) and this pinned one never replace each other.
install(FILES ${PYKVQ_UPSTREAM_TREE}/convert_hf_to_gguf.py DESTINATION pykvq/vendor COMPONENT pykvq)
install(DIRECTORY ${PYKVQ_UPSTREAM_TREE}/conversion DESTINATION pykvq/vendor COMPONENT pykvq
        PATTERN "__pycache__" EXCLUDE)
install(DIRECTORY ${PYKVQ_UPSTREAM_TREE}/gguf-py/gguf DESTINATION pykvq/vendor/gguf-py COMPONENT pykvq
        PATTERN "__pycache__" EXCLUDE PATTERN "scripts" EXCLUDE)

# what `pykvq info` reports about the build
set(PYKVQ_BACKENDS CPU)
if (GGML_CUDA)
    list(APPEND PYKVQ_BACKENDS CUDA)
endif()
if (GGML_RPC)
    list(APPEND PYKVQ_BACKENDS RPC)
endif()
file(READ ${PYKVQ_UPSTREAM_INFO} upstream_json)
string(JOIN "\", \"" backends_json ${PYKVQ_BACKENDS})
set(cpu_features "")
foreach (feature AVX AVX2 FMA F16C BMI2 AVX512)
    if (GGML_${feature})
        list(APPEND cpu_features ${feature})
    endif()
endforeach()
string(JOIN "\", \"" cpu_features_json ${cpu_features})
string(JOIN "\", \"" cuda_archs_json ${CMAKE_CUDA_ARCHITECTURES})
if (cuda_archs_json)
    set(cuda_archs_json "\"${cuda_archs_json}\"")
endif()
file(WRITE ${CMAKE_BINARY_DIR}/_build_info.json "{
 \"pykvq_version\": \"${PYKVQ_VERSION}\",
 \"build_type\": \"${CMAKE_BUILD_TYPE}\",
 \"backends\": [\"${backends_json}\"],
 \"cpu_features\": [\"${cpu_features_json}\"],
 \"cuda_architectures\": [${cuda_archs_json}],
 \"upstream\": ${upstream_json}}
")
install(FILES ${CMAKE_BINARY_DIR}/_build_info.json DESTINATION pykvq COMPONENT pykvq)

# llama.cpp and ggml are MIT: their notice travels with the libraries built from them
install(FILES ${PYKVQ_UPSTREAM_TREE}/LICENSE DESTINATION pykvq/licenses RENAME llama.cpp-LICENSE COMPONENT pykvq)
