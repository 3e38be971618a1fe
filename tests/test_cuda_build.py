"""The CUDA variant as a user builds it, judged on the build machine, which may have no GPU: `.ci/cuda-build`
runs `PYKVQ_CUDA=ON pip install .` into BUILD/venv (BUILD = $PYKVQ_TEST_CUDA_BUILD). Without a driver, ggml-cuda
finds no device and everything runs on the CPU, so its answers must equal the CPU build's exactly.

Skipped unless PYKVQ_TEST_CUDA_BUILD names that build folder (CI sets it)."""

from __future__ import annotations

import ctypes.util
import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from pykvq.devtools import shared_libraries

import cuda_kernels

_BUILD = os.environ.get("PYKVQ_TEST_CUDA_BUILD")
if not _BUILD:
    pytest.skip("PYKVQ_TEST_CUDA_BUILD does not name a CUDA build (.ci/cuda-build makes one)", allow_module_level=True)

BUILD = Path(_BUILD).resolve()
VENV = BUILD / "venv"
# the link-only libcuda made from cuda.h (cmake/pykvq-cuda.cmake): cudart then reports no device
DRIVER_STUB = BUILD / "cuda-driver" / "stubs"
RUN = ["run", "-t", "2", "-c", "512", "--temp", "0", "-n", "12", "-p", "The capital of France is"]


def cuda_env() -> dict[str, str]:
    env = dict(os.environ)
    if ctypes.util.find_library("cuda") is None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(DRIVER_STUB), env.get("LD_LIBRARY_PATH")]))
    return env


def pykvq(executable: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(executable), *args], capture_output=True, text=True, timeout=300, env=cuda_env(),
                          cwd=BUILD)


def cuda_lib_dir() -> Path:
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", "from pykvq import paths; print(paths.lib_dir())"],
                         capture_output=True, text=True, check=True, env=cuda_env(), cwd=BUILD)
    return Path(out.stdout.strip())


def test_the_cuda_build_is_installed_with_its_cuda_library() -> None:
    lib_dir = cuda_lib_dir()
    assert lib_dir.is_relative_to(VENV), lib_dir
    assert (lib_dir / "libggml-cuda.so").is_file()


def test_its_wheel_is_what_was_installed_and_serves_any_python_3() -> None:
    # bench/gpu/prepare.sh carries this wheel to a GPU machine, whose Python is not this one
    wheels = list((BUILD / "dist").glob("pykvq-*.whl"))
    assert len(wheels) == 1, wheels
    assert wheels[0].name.endswith("-py3-none-linux_x86_64.whl"), wheels[0].name
    with zipfile.ZipFile(wheels[0]) as wheel:
        packed = hashlib.sha256(wheel.read("pykvq/lib/libggml-cuda.so")).hexdigest()
        assert not [name for name in wheel.namelist() if ".cpython-" in name or ".abi3." in name]
    assert hashlib.sha256((cuda_lib_dir() / "libggml-cuda.so").read_bytes()).hexdigest() == packed


def test_its_libraries_define_none_of_libstdcxx_and_need_it() -> None:
    libraries = shared_libraries.shipped_libraries(cuda_lib_dir())
    assert shared_libraries.check_libraries(libraries) == []


def test_its_libraries_resolve_every_dependency() -> None:
    ldd = subprocess.run(["ldd", str(cuda_lib_dir() / "libggml-cuda.so")], capture_output=True, text=True,
                         env=cuda_env(), check=True).stdout
    assert "not found" not in ldd, ldd
    assert "libcublas.so" in ldd


def test_info_names_the_cuda_backend() -> None:
    proc = pykvq(VENV / "bin" / "pykvq", "info")
    assert proc.returncode == 0, proc.stderr
    assert "CUDA" in next(line for line in proc.stdout.splitlines() if line.startswith("backends"))


@pytest.mark.parametrize("kv_type", ["kivi2", "q8_0"])
def test_run_answers_as_the_cpu_build_does(smollm2: Path, kv_type: str) -> None:
    args = [*RUN, "-m", str(smollm2), "--kv-type", kv_type]
    cuda = pykvq(VENV / "bin" / "pykvq", *args)
    assert cuda.returncode == 0, cuda.stderr
    cpu = subprocess.run(["pykvq", *args], capture_output=True, text=True, timeout=300)
    assert cpu.returncode == 0, cpu.stderr
    assert cuda.stdout == cpu.stdout
    assert cuda.stdout.startswith("The capital of France is Paris")


@pytest.mark.parametrize(("args", "message"), [
    (["--kv-type", "kivi3"], "kivi3"),
    (["-m", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
])
def test_bad_input_is_a_clear_error_there_too(smollm2: Path, args: list[str], message: str) -> None:
    proc = pykvq(VENV / "bin" / "pykvq", *RUN, *(["-m", str(smollm2)] if "-m" not in args else []), *args)
    assert proc.returncode == 1, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="this machine has an NVIDIA driver")
def test_without_a_driver_it_says_so(tmp_path: Path) -> None:
    proc = subprocess.run([str(VENV / "bin" / "pykvq"), "info"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 1
    assert "needs the NVIDIA driver (libcuda.so.1)" in proc.stderr and "Traceback" not in proc.stderr


def test_the_tensor_core_attention_is_shipped_without_spills() -> None:
    """The installed libggml-cuda.so holds the tensor-core attention for head sizes 64, 96, 128 and 256 and for
    DeepSeek's latent layers (K 576, V 512), and its packed twin (several tokens a block) for the four head sizes,
    none with a stack frame or local memory, where a spilled register would live (bench/cuda_kernels.py records
    every kernel's figures as ptxas reports them)."""
    shipped = cuda_kernels.shipped_resources(cuda_lib_dir() / "libggml-cuda.so")
    mma = [k for k in shipped if k.kernel.startswith("kvq_attn_mma")]
    shapes = [(64, 64), (96, 96), (128, 128), (256, 256), (576, 512)]
    want = [f"kvq_attn_mma_kernel<{d}, {dv}, false, 4>" for d, dv in shapes]
    want += [f"kvq_attn_mma_kernel<{d}, {d}, true, 4>" for d in (64, 96, 128, 256)]
    assert sorted(k.kernel for k in mma) == sorted(want)
    assert {k.arch for k in mma} == {"sm_90"}
    assert all(k.stack_bytes == 0 and k.local_bytes == 0 for k in mma), mma


def test_our_kernels_compile_for_every_architecture_of_a_user_s_build() -> None:
    """A user's build takes the GPUs of its machine, or without one upstream's list (cmake/pykvq-cuda-archs.cmake:
    Turing to Blackwell); CI builds sm_90 alone. Each of our .cu files, with its own command, compiles for every
    other architecture of that list (Ada and GB10 through the architecture whose code ptxas gives them,
    cuda_kernels.SAME_CODE_AS), and the tensor-core attention spills no register on Ampere and Ada (the RTX
    3000/4000 cards most users have; Turing runs the CUDA-core kernel; bench/results/cuda-kernels-default-archs.json
    records every figure, of all seven)."""
    archs = [a for a in cuda_kernels.default_archs() if a != "90" and a not in cuda_kernels.SAME_CODE_AS]
    assert {"75", "80", "86"} <= set(archs), archs
    report = cuda_kernels.compile_report(BUILD, archs=archs)
    for arch in archs:
        kernels = {k.kernel for k in report if k.arch == f"sm_{arch}"}
        assert {"kvq_attn_kernel<8, 1>", "kvq_attn_mma_kernel<128, 128, true, 4>", "kvq_store_kernel"} <= kernels, arch
    spilled = [k for k in report if k.kernel.startswith("kvq_attn_mma") and k.arch in ("sm_80", "sm_86")
               and (k.spill_stores or k.spill_loads or k.stack_bytes)]
    assert spilled == []
