"""Registers, spills and stack of pykvq's CUDA kernels as ptxas builds them in the real CUDA build (.ci/cuda-build,
no GPU needed): each of our .cu files is compiled once more with its own command from the build's
compile_commands.json, plus -Xptxas=-v, into a scratch object; for the build's architecture, or for those named
(`--arch 86 120a`, `--arch default`: every architecture of a user's build, cmake/pykvq-cuda-archs.cmake, where CI
builds sm_90 alone). Writes bench/results/cuda-kernels-<archs>.json (cuda-kernels-default-archs.json) and prints
a table. `shipped_resources` reads the registers and stack of the kernels in a built library instead (cuobjdump).

    python bench/cuda_kernels.py [--build build/cuda] [--arch default | 86 120a ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
OUR_SOURCES = "ggml-kvq/src/cuda/"

log = logging.getLogger("cuda_kernels")

_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+[af]?)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_FATBIN_ARCH = re.compile(r"^arch = (sm_\w+)")
_FUNCTION = re.compile(r"^ Function (\S+):")
_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)")
_GENCODE = re.compile(r"^--generate-code=|^-gencode|^-arch=|^--gpu-architecture")
# architectures for which ptxas generates the code of another (Ada: Ampere's sm_86 plus FP8, which pykvq does not
# use; GB10: the RTX 50's sm_120a): bench/results/cuda-kernels-default-archs.json shows the same registers, stack
# and spills for each of our kernels, so compiling one judges both
SAME_CODE_AS = {"89": "86", "121a": "120a"}


@dataclass(frozen=True)
class KernelResources:
    source: str
    kernel: str        # demangled, without its parameter list
    arch: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int


@dataclass(frozen=True)
class ShippedKernel:
    """A kernel as a built library holds it: cuobjdump reports no spills as such, but a spill lives in the stack
    frame, so a kernel with no stack and no local memory spills nothing."""

    kernel: str        # demangled, without its parameter list
    arch: str
    registers: int
    stack_bytes: int
    local_bytes: int


def kernel_names(mangled: list[str]) -> list[str]:
    """Kernels' names demangled, without their parameter lists."""
    if not mangled:
        return []
    proc = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True, check=True)
    return [name.split("(")[0].removeprefix("void ") for name in proc.stdout.splitlines()]


def parse_ptxas(source: str, text: str) -> list[KernelResources]:
    """ptxas -v's report of one compilation: per entry function, its frame line then its register line."""
    found = []
    entry = arch = frame = None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            entry, arch, frame = m.group(1), m.group(2), None
        elif (m := _FRAME.search(line)) and entry:
            frame = tuple(int(x) for x in m.groups())
        elif (m := _USED.search(line)) and entry and frame:
            found.append((entry, arch, int(m.group(1)), *frame))
            entry = None
    names = kernel_names([f[0] for f in found])
    return [KernelResources(source, name, arch, regs, stack, stores, loads)
            for name, (_, arch, regs, stack, stores, loads) in zip(names, found, strict=True)]


def for_archs(args: list[str], archs: list[str]) -> list[str]:
    """A compile command's arguments with its target architectures replaced by machine code for `archs`."""
    kept = [a for a in args if not _GENCODE.match(a)]
    if len(kept) == len(args):
        raise SystemExit(f"cuda_kernels: no architecture flag in the compile command: {shlex.join(args)[:400]}")
    i = kept.index("-c")
    return kept[:i] + [f"--generate-code=arch=compute_{a},code=[sm_{a}]" for a in archs] + kept[i:]


def default_archs() -> list[str]:
    """The architectures a CUDA build that names none takes on a machine without a GPU
    (cmake/pykvq-cuda-archs.cmake, for this machine's nvcc), as compute capabilities: 75, 86, 120a, ..."""
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=True).stdout
    version = re.search(r"release (\d+\.\d+)", nvcc)
    if version is None:
        raise SystemExit(f"cuda_kernels: no release in nvcc --version:\n{nvcc}")
    proc = subprocess.run(["cmake", f"-DCUDA_VERSION={version.group(1)}", "-DGPU_CAPS=", "-P",
                           str(REPO / "cmake" / "pykvq-cuda-archs.cmake")], capture_output=True, text=True, check=True)
    return [arch.split("-")[0] for arch in proc.stderr.split()]


def _compile(command: dict, archs: list[str] | None, scratch: Path) -> list[KernelResources]:
    args = shlex.split(command["command"])
    if archs:
        args = for_archs(args, archs)
    source = Path(command["file"]).name
    args[args.index("-o") + 1] = str(scratch / f"{source}.o")
    # ccache keeps the compiler's report with the object: a rerun of unchanged sources takes seconds, in any clone
    # (paths relative to the project, as cmake/pykvq-ccache.cmake makes the build's; CI compiles a fresh clone)
    launcher = ["ccache"] if shutil.which("ccache") else []
    env = os.environ | {"CCACHE_BASEDIR": str(REPO), "CCACHE_NOHASHDIR": "1",
                        "CCACHE_SLOPPINESS": "include_file_mtime,include_file_ctime"}
    log.info("compiling %s with -Xptxas=-v%s", source, f" for {', '.join(archs)}" if archs else "")
    proc = subprocess.run([*launcher, *args, "-Xptxas=-v"], cwd=command["directory"], env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"cuda_kernels: {source} does not compile:\n{proc.stderr[-4000:]}")
    return parse_ptxas(source, proc.stdout + proc.stderr)


def cuobjdump() -> Path:
    """cuobjdump: on PATH, beside nvcc, or from the nvidia-cuda-cuobjdump wheel (.ci/cuda-build installs it: the
    toolkit of a build machine may lack it)."""
    found = [shutil.which("cuobjdump")]
    if nvcc := shutil.which("nvcc"):
        found.append(str(Path(nvcc).resolve().with_name("cuobjdump")))
    found += [str(p) for entry in sys.path if entry for p in sorted(Path(entry).glob("nvidia/cu*/bin/cuobjdump"))]
    for candidate in filter(None, found):
        if os.access(candidate, os.X_OK):
            return Path(candidate)
    raise SystemExit("cuda_kernels: cuobjdump not found (pip install nvidia-cuda-cuobjdump)")


def shipped_resources(library: Path) -> list[ShippedKernel]:
    """Every kernel of the built CUDA library at `library`, per architecture, as cuobjdump -res-usage reports it."""
    proc = subprocess.run([str(cuobjdump()), "-res-usage", str(library)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"cuda_kernels: cuobjdump cannot read {library}:\n{proc.stderr[-2000:]}")
    found = []
    arch = function = None
    for line in proc.stdout.splitlines():
        if m := _FATBIN_ARCH.match(line):
            arch = m.group(1)
        elif m := _FUNCTION.match(line):
            function = m.group(1)
        elif (m := _USAGE.search(line)) and function and arch:
            found.append((function, arch, *(int(x) for x in m.groups())))
            function = None
    names = kernel_names([f[0] for f in found])
    return [ShippedKernel(name, arch, regs, stack, local)
            for name, (_, arch, regs, stack, local) in zip(names, found, strict=True)]


def compile_report(build: Path, archs: list[str] | None = None) -> list[KernelResources]:
    """Every kernel of our CUDA sources in the build at `build` (its compile_commands.json), for the build's
    architectures or `archs`; the sources in parallel."""
    commands = json.loads((build / "compile_commands.json").read_text())
    ours = [c for c in commands if OUR_SOURCES in c["file"] and c["file"].endswith(".cu")]
    if not ours:
        raise SystemExit(f"cuda_kernels: {build} holds no compile command of {OUR_SOURCES}*.cu: not a CUDA build")
    with tempfile.TemporaryDirectory() as scratch, ThreadPoolExecutor(os.cpu_count()) as pool:
        reports = pool.map(lambda c: _compile(c, archs, Path(scratch)), ours)
        return [k for report in reports for k in report]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=REPO / "build" / "cuda", help="the CUDA build folder")
    parser.add_argument("--arch", nargs="+", metavar="CC",
                        help="compute capabilities to compile for instead of the build's (86 = sm_86, 120a = sm_120a; "
                             "`default`: those of a build that names none, on a machine without a GPU)")
    parser.add_argument("--out", type=Path, help="JSON to write (default bench/results/cuda-kernels-<arch>.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    default = args.arch == ["default"]
    report = compile_report(args.build, archs=default_archs() if default else args.arch)
    archs = sorted({k.arch for k in report})
    out = args.out or RESULTS / f"cuda-kernels-{'default-archs' if default else '-'.join(archs)}.json"
    out.write_text(json.dumps({"archs": archs, "kernels": [asdict(k) for k in report]}, indent=1) + "\n")
    print("| kernel | arch | registers | stack B | spill stores B | spill loads B |\n|---|---|---:|---:|---:|---:|")
    for k in report:
        print(f"| {k.kernel} | {k.arch} | {k.registers} | {k.stack_bytes} | {k.spill_stores} | {k.spill_loads} |")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
