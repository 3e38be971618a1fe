"""The attention kernels (ggml-kvq/src/cuda: kvq-cuda-attn-kernel.cuh on CUDA cores, kvq-cuda-mma-kernel.cuh on
tensor cores) and the store kernel (kvq-cuda-store.cuh) compiled as host C++ against an emulated CUDA
(tests/cuda_emulation), so that a machine without a GPU runs their indexing, staging, fragment layouts and merges:
the kernels' own source, their headers beside the emulation's stand-ins for kvq-cuda.cuh (CUDA's common.cuh) and
kvq-cuda-ptx.cuh (mma.sync, cp.async). Needs g++ and the CUDA toolkit's cuda_fp16.h."""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path

import kvq_graph as g
import pytest

from pykvq import paths
from pykvq.devtools import upstream

REPO = Path(__file__).resolve().parent.parent
KERNEL_DIR = REPO / "ggml-kvq" / "src" / "cuda"
EMULATION_DIR = Path(__file__).resolve().parent / "cuda_emulation"


def cuda_include() -> Path | None:
    """The CUDA toolkit's headers (cuda_fp16.h), found next to nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    for root in (Path(nvcc).resolve().parent.parent, Path("/usr/local/cuda")):
        if (root / "include" / "cuda_fp16.h").is_file():
            return root / "include"
    return None


def build(dest: Path, source: upstream.Source) -> Path:
    """Compile the emulated kernels into dest/libkvq_emu.so against upstream's headers from `source`, patched; skips
    the test without g++ or the CUDA headers."""
    include = cuda_include()
    if shutil.which("g++") is None or include is None:
        pytest.skip("the emulated CUDA kernel needs g++ and the CUDA toolkit's headers")
    tree = dest / "upstream"
    upstream.prepare_tree(source, REPO, tree)
    src = dest / "src"
    src.mkdir(parents=True, exist_ok=True)
    for header in KERNEL_DIR.glob("*.cuh"):
        shutil.copy(header, src)
    # the stand-ins replace their namesakes: quoted includes find the kernel's neighbours first
    for part in EMULATION_DIR.iterdir():
        shutil.copy(part, src)
    lib = dest / "libkvq_emu.so"
    proc = subprocess.run(
        ["g++", "-std=c++20", "-O2", "-fPIC", "-shared", "-pthread", f"-I{src}", f"-I{tree / 'ggml' / 'include'}",
         f"-I{tree / 'ggml' / 'src'}", f"-I{REPO / 'ggml-kvq' / 'include'}", f"-I{include}", str(src / "emulator.cpp"),
         "-o", str(lib), f"-L{paths.lib_dir()}", "-lggml-base", f"-Wl,-rpath,{paths.lib_dir()}"],
        capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"the emulated kernel does not compile:\n{proc.stderr}")
    return lib


KERNELS = {"tensor cores": "kvq_emu_attn_mma", "cuda cores": "kvq_emu_attn_cuda_cores"}


@cache
def _loaded(lib: Path):
    ffi = g.libs().ffi
    for name in KERNELS.values():
        ffi.cdef(f"void {name}(struct ggml_tensor * dst, const struct ggml_tensor * a, int ith, int nth,"
                 " void * userdata);")
    ffi.cdef("void kvq_emu_store(const struct ggml_tensor * store);")
    ffi.cdef("void kvq_emu_store_v(const struct ggml_tensor * store_v);")
    return ffi.dlopen(str(lib))


def attention_op(lib: Path, kernel: str = "tensor cores"):
    """The built library's emulated attention on `kernel` (KERNELS), as a ggml_custom1_op_t for
    tests/kvq_layer.py's attention_op."""
    ffi = g.libs().ffi
    return ffi.cast("void *", ffi.addressof(_loaded(lib), KERNELS[kernel]))


def forced_tiles_per_split(tiles: int):
    """The userdata that makes an emulated attention op (attention_op) split the context every `tiles` tiles instead
    of at its kernel's own size; the tensor cores take 4, 8, 28 and 56 (tiles per warp: emulator.cpp's
    emu_mma_kernel) at head size 128, the CUDA cores any number. Keep it alive while the op runs."""
    return g.libs().ffi.new("int *", tiles)


def run_store(lib: Path, store) -> None:
    """A ggml_kvq_store node's writes through the emulated CUDA kernel, instead of computing the node."""
    _loaded(lib).kvq_emu_store(store)


def run_store_v(lib: Path, store_v) -> None:
    """A ggml_kvq_store_v node's writes through the emulated CUDA set_rows kernel, instead of computing the node."""
    _loaded(lib).kvq_emu_store_v(store_v)
