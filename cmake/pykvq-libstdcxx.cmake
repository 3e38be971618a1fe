# The C++ runtime as a shared library, whatever the toolchain. A relocated GCC whose own library folder holds
# libstdc++.a but no libstdc++.so (the GPU image's /opt/gcc does) makes `-lstdc++` take the archive: every
# library then carries a private copy of libstdc++ that is never initialised for iostreams (a segfault in model
# load) and names no libstdc++.so.6. A folder searched first, with a libstdc++.so link to the runtime the
# compiler names, makes the linker take the shared one; with a usual toolchain that is the file it takes anyway.
# Must come before the targets are defined: add_link_options reaches only targets made after it.
if (NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU" OR NOT CMAKE_SYSTEM_NAME STREQUAL "Linux")
    return()
endif()

execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so.6
                OUTPUT_VARIABLE pykvq_libstdcxx_runtime OUTPUT_STRIP_TRAILING_WHITESPACE)
if (NOT IS_ABSOLUTE "${pykvq_libstdcxx_runtime}")
    find_library(PYKVQ_LIBSTDCXX_RUNTIME NAMES libstdc++.so.6)
    set(pykvq_libstdcxx_runtime "${PYKVQ_LIBSTDCXX_RUNTIME}")
endif()
if (NOT EXISTS "${pykvq_libstdcxx_runtime}")
    message(FATAL_ERROR "pykvq: ${CMAKE_CXX_COMPILER} names no libstdc++.so.6 and none was found: install the C++ "
                        "runtime (libstdc++6) so that the libraries link it shared")
endif()

set(PYKVQ_LIBSTDCXX_LINK_DIR ${CMAKE_BINARY_DIR}/pykvq-libstdcxx)
file(MAKE_DIRECTORY ${PYKVQ_LIBSTDCXX_LINK_DIR})
file(CREATE_LINK ${pykvq_libstdcxx_runtime} ${PYKVQ_LIBSTDCXX_LINK_DIR}/libstdc++.so SYMBOLIC)
add_link_options(-L${PYKVQ_LIBSTDCXX_LINK_DIR})
message(STATUS "pykvq: libstdc++ linked shared: ${pykvq_libstdcxx_runtime}")
