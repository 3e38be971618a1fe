# Obtain, verify, unpack and patch the pinned upstream (pykvq/devtools/upstream.py does the work, so that the
# developer workflow shares it). Sets PYKVQ_UPSTREAM_TREE and PYKVQ_UPSTREAM_INFO (a JSON file).
set(PYKVQ_UPSTREAM_INFO ${CMAKE_BINARY_DIR}/pykvq-upstream.json)
set(unpatched "")
if (PYKVQ_REFERENCE_BUILD)
    set(unpatched --unpatched)
endif()
execute_process(
    COMMAND ${CMAKE_COMMAND} -E env PYTHONPATH=${CMAKE_SOURCE_DIR}
        ${Python_EXECUTABLE} -m pykvq.devtools.upstream prepare
            --repo ${CMAKE_SOURCE_DIR}
            --dest ${CMAKE_BINARY_DIR}/upstream
            --info-json ${PYKVQ_UPSTREAM_INFO}
            --source "${PYKVQ_UPSTREAM_SOURCE}"
            ${unpatched}
    RESULT_VARIABLE result
)
if (NOT result EQUAL 0)
    message(FATAL_ERROR "pykvq: could not prepare the upstream llama.cpp source (see the message above)")
endif()

file(READ ${PYKVQ_UPSTREAM_INFO} info)
string(JSON PYKVQ_UPSTREAM_TREE GET "${info}" tree)
string(JSON PYKVQ_LLAMA_CPP_COMMIT GET "${info}" llama_cpp_commit)
message(STATUS "pykvq: upstream tree ${PYKVQ_UPSTREAM_TREE}")

# a changed patch re-runs the configure step
file(GLOB PYKVQ_PATCHES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/ggml-kvq/patches/*.patch ${CMAKE_SOURCE_DIR}/native/patches/*.patch)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${PYKVQ_PATCHES} ${CMAKE_SOURCE_DIR}/pykvq/devtools/upstream.py)
