"""The CUDA architectures of a build that names none (cmake/pykvq-cuda-archs.cmake, run in CMake's script mode):
the GPUs nvidia-smi reports on the machine that builds, else upstream's list for a machine without one."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import cuda_kernels

SCRIPT = Path(__file__).resolve().parent.parent / "cmake" / "pykvq-cuda-archs.cmake"
# registers, stack and spills of each of our kernels for every architecture of NO_GPU_13
RECORD = cuda_kernels.RESULTS / "cuda-kernels-default-archs.json"
NO_GPU_13 = ["75-virtual", "80-virtual", "86-real", "89-real", "90-real", "120a-real", "121a-real"]

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")


def archs(tmp_path: Path, cuda_version: str, nvidia_smi: str | None) -> list[str]:
    """The list for `cuda_version` on a machine whose nvidia-smi is the shell script `nvidia_smi` (None: it has
    none)."""
    tool = tmp_path / "nvidia-smi"
    if nvidia_smi is not None:
        tool.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        tool.chmod(0o755)
    proc = subprocess.run(["cmake", f"-DCUDA_VERSION={cuda_version}", f"-DPYKVQ_NVIDIA_SMI={tool}", "-P", str(SCRIPT)],
                          capture_output=True, text=True, check=True)
    return proc.stderr.split()


def test_a_machine_s_gpus_are_what_it_builds_for(tmp_path: Path) -> None:
    assert archs(tmp_path, "13.0", "printf '8.9\\n12.0\\n8.9\\n'") == ["89-real", "120-real"]


@pytest.mark.parametrize("nvidia_smi", [
    None,
    "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"; exit 9",
    "echo 'Field \"compute_cap\" is not a valid field to query.'; exit 2",
])
def test_without_a_gpu_it_builds_upstream_s_list(tmp_path: Path, nvidia_smi: str | None) -> None:
    assert archs(tmp_path, "13.0", nvidia_smi) == NO_GPU_13


def test_blackwell_needs_cuda_12_8(tmp_path: Path) -> None:
    assert archs(tmp_path, "12.4", None) == NO_GPU_13[:5]
    assert archs(tmp_path, "12.8", None) == NO_GPU_13[:6]


def test_the_architectures_compiled_through_another_get_its_code() -> None:
    """The every-architecture compile (tests/test_cuda_build.py) judges Ada through sm_86 and GB10 through sm_120a
    (cuda_kernels.SAME_CODE_AS): in the record of all seven (`python bench/cuda_kernels.py --arch default`) each of
    our kernels has the same registers, stack and spills on both."""
    resources: dict[str, dict] = {}
    for k in json.loads(RECORD.read_text())["kernels"]:
        resources.setdefault(k["arch"], {})[k["source"], k["kernel"]] = (
            k["registers"], k["stack_bytes"], k["spill_stores"], k["spill_loads"])
    assert sorted(resources) == sorted(f"sm_{a.split('-')[0]}" for a in NO_GPU_13)
    for arch, through in cuda_kernels.SAME_CODE_AS.items():
        assert resources[f"sm_{arch}"] == resources[f"sm_{through}"], arch
