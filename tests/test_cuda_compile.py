"""The CUDA kernels (ggml-kvq/src/cuda) compile against the patched ggml-cuda headers with ggml-cuda's flags.

Runs wherever nvcc is on PATH, no GPU needed; a CUDA build on a GPU machine is what runs them."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pykvq import paths

KERNELS = sorted((Path(__file__).resolve().parents[1] / "ggml-kvq" / "src" / "cuda").glob("*.cu"))

# ggml-cuda's flags (ggml/src/ggml-cuda/CMakeLists.txt and ggml's warning set), for one architecture
NVCC_FLAGS = [
    "-std=c++17", "-arch=sm_90", "-use_fast_math", "-extended-lambda",
    "-Xcompiler", "-Wall,-Wextra,-Wcast-qual,-Wno-unused-function,-Wno-array-bounds,-Wextra-semi,-Wno-pedantic",
]

# What ggml-cuda's common.cuh takes from cuBLAS, for toolkits installed without it: the kernels never call
# cuBLAS, they only include common.cuh.
CUBLAS_STUB = """\
#pragma once
#include <cuda_runtime.h>
#define CUBLAS_VER_MAJOR 13
#define CUBLAS_VER_MINOR 0
typedef enum {
    CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_NOT_INITIALIZED = 1, CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7, CUBLAS_STATUS_ARCH_MISMATCH = 8, CUBLAS_STATUS_MAPPING_ERROR = 11,
    CUBLAS_STATUS_EXECUTION_FAILED = 13, CUBLAS_STATUS_INTERNAL_ERROR = 14, CUBLAS_STATUS_NOT_SUPPORTED = 15
} cublasStatus_t;
typedef enum { CUBLAS_DEFAULT_MATH = 0, CUBLAS_TF32_TENSOR_OP_MATH = 3 } cublasMath_t;
typedef struct cublasContext * cublasHandle_t;
const char * cublasGetStatusString(cublasStatus_t status);
cublasStatus_t cublasCreate(cublasHandle_t * handle);
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode);
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream);
cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void * workspace, size_t size);
"""


def is_patched_cuda_tree(tree: Path) -> bool:
    ggml_h = tree / "ggml" / "include" / "ggml.h"
    return (tree / "ggml" / "src" / "ggml-cuda" / "common.cuh").is_file() and ggml_h.is_file() \
        and "GGML_OP_KVQ" in ggml_h.read_text()


def patched_tree(repo: Path) -> Path:
    """The patched llama.cpp tree: the developer tree, else the one the installed package was built from.

    The unpatched upstream (pykvq.devtools.upstream.resolve_source) will not do: its ggml.h has no kivi types."""
    candidates = [repo / "build" / "dev-tree"]
    try:
        info = json.loads(paths.build_info_file().read_text())
        candidates.append(Path(info["upstream"]["tree"]))
    except (paths.NotBuiltError, KeyError, ValueError):
        pass
    for tree in candidates:
        if is_patched_cuda_tree(tree):
            return tree
    pytest.skip(f"no patched llama.cpp tree with ggml-cuda found (looked at {', '.join(map(str, candidates))}); "
                "make one with `python -m pykvq.devtools.dev tree` or install the package with `pip install .`")


def cublas_includes(nvcc: str, tmp_path: Path) -> list[str]:
    probe = tmp_path / "probe.cu"
    probe.write_text("#include <cublas_v2.h>\n")
    proc = subprocess.run([nvcc, "-E", str(probe), "-o", str(tmp_path / "probe.ii")], capture_output=True, text=True)
    if proc.returncode == 0:
        return []
    stub = tmp_path / "cublas-stub"
    stub.mkdir()
    (stub / "cublas_v2.h").write_text(CUBLAS_STUB)
    return ["-I", str(stub)]


@pytest.mark.parametrize("source", KERNELS, ids=lambda p: p.name)
def test_cuda_kernels_compile(repo: Path, tmp_path: Path, source: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    tree = patched_tree(repo)
    includes = cublas_includes(nvcc, tmp_path)
    for folder in (tree / "ggml" / "include", tree / "ggml" / "src", tree / "ggml" / "src" / "ggml-cuda",
                   repo / "ggml-kvq" / "include"):
        includes += ["-I", str(folder)]
    obj = tmp_path / source.with_suffix(".o").name
    cmd = [nvcc, "-c", *NVCC_FLAGS, *includes, str(source), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr}"
    # warnings from the toolkit's own headers are not ours to fix; warnings from our files are
    ours = [line for line in proc.stderr.splitlines() if "kvq-cuda" in line]
    assert not ours, "\n".join(ours)
    assert obj.stat().st_size > 0
