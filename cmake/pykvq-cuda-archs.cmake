# The CUDA architectures of a build that names none (-DCMAKE_CUDA_ARCHITECTURES=..., or CMake's CUDAARCHS): the
# build machine's GPUs when it has any, as upstream's GGML_NATIVE would pick them (pykvq turns GGML_NATIVE off for
# the CPU's sake: the sandbox faults on the AMX the CPU reports), else upstream's list for a machine without one, with
# Hopper as machine code (the GPUs pykvq is measured on) where upstream leaves it to the driver's JIT.
#
#   cmake -DCUDA_VERSION=13.0 [-DGPU_CAPS="8.9;9.0" | -DGPU_CAPS=] -P cmake/pykvq-cuda-archs.cmake
# prints the list such a build takes on this machine (or with those GPUs, or none: tests/test_cuda_build.py compiles
# pykvq's kernels for each of that list).

# `archs` for CUDA `cuda_version` and the machine's GPUs' compute capabilities `gpu_caps` ("8.9;9.0", or empty)
function(pykvq_cuda_archs out cuda_version gpu_caps)
    set(archs "")
    foreach (cap ${gpu_caps})
        # (upstream's ggml-cuda turns a Blackwell 12X into 12Xa)
        string(REPLACE "." "" cc ${cap})
        list(APPEND archs ${cc}-real)
    endforeach()
    if (archs)
        list(REMOVE_DUPLICATES archs)
    else()
        # Turing and Ampere as PTX for the driver to compile, RTX 3000/4000, H100/H200 and Blackwell as machine code
        set(archs 75-virtual 80-virtual 86-real 89-real 90-real)
        if (cuda_version VERSION_GREATER_EQUAL 12.8)
            list(APPEND archs 120a-real)
        endif()
        if (cuda_version VERSION_GREATER_EQUAL 12.9)
            list(APPEND archs 121a-real)
        endif()
    endif()
    set(${out} ${archs} PARENT_SCOPE)
endfunction()

# the compute capabilities of the machine's GPUs as the driver reports them, empty without a GPU or a driver
# (-DPYKVQ_NVIDIA_SMI=PATH names the tool)
function(pykvq_gpu_caps out)
    set(caps "")
    find_program(PYKVQ_NVIDIA_SMI nvidia-smi)
    if (PYKVQ_NVIDIA_SMI)
        execute_process(COMMAND ${PYKVQ_NVIDIA_SMI} --query-gpu=compute_cap --format=csv,noheader
                        RESULT_VARIABLE rc OUTPUT_VARIABLE text ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
        if (rc EQUAL 0 AND text MATCHES "^[0-9]+\\.[0-9]+(\n[0-9]+\\.[0-9]+)*$")
            string(REPLACE "\n" ";" caps "${text}")
        endif()
    endif()
    set(${out} ${caps} PARENT_SCOPE)
endfunction()

if (CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
    if (NOT DEFINED GPU_CAPS)
        pykvq_gpu_caps(GPU_CAPS)
    endif()
    pykvq_cuda_archs(archs "${CUDA_VERSION}" "${GPU_CAPS}")
    string(REPLACE ";" " " archs "${archs}")
    message("${archs}")
endif()
