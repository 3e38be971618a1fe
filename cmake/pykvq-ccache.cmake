# ccache, with paths made relative to the project so that a fresh clone in another folder still hits
# the cache (CI builds a clean clone every time).
if (PYKVQ_CCACHE AND NOT CMAKE_C_COMPILER_LAUNCHER)
    find_program(PYKVQ_CCACHE_PROGRAM ccache)
    if (PYKVQ_CCACHE_PROGRAM)
        set(launcher ${CMAKE_COMMAND} -E env
            CCACHE_BASEDIR=${CMAKE_SOURCE_DIR} CCACHE_NOHASHDIR=1 CCACHE_SLOPPINESS=include_file_mtime,include_file_ctime
            ${PYKVQ_CCACHE_PROGRAM})
        set(CMAKE_C_COMPILER_LAUNCHER   ${launcher})
        set(CMAKE_CXX_COMPILER_LAUNCHER ${launcher})
        set(CMAKE_CUDA_COMPILER_LAUNCHER ${launcher})
        message(STATUS "pykvq: compiling through ${PYKVQ_CCACHE_PROGRAM}")
    else()
        message(STATUS "pykvq: ccache not found, compiling without it")
    endif()
endif()
# upstream would install its own launcher otherwise
set(GGML_CCACHE OFF CACHE BOOL "" FORCE)
