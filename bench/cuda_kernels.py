"""Registers, spills and stack of pykvq's CUDA kernels as ptxas builds them in the real CUDA build (.ci/cuda-build,
no GPU needed): each of our .cu files is compiled once more with its own command from the build's
compile_commands.json, plus -Xptxas=-v, into a scratch object. Writes bench/results/cuda-kernels-<arch>.json and
prints a table.

    python bench/cuda_kernels.py [--build build/cuda]
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
OUR_SOURCES = "ggml-kvq/src/cuda/"

log = logging.getLogger("cuda_kernels")

_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+a?)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


@dataclass(frozen=True)
class KernelResources:
    source: str
    kernel: str        # demangled, without its parameter list
    arch: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int


def demangle(names: list[str]) -> list[str]:
    proc = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    return proc.stdout.splitlines()


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
    names = [name.split("(")[0].removeprefix("void ") for name in demangle([f[0] for f in found])] if found else []
    return [KernelResources(source, name, arch, regs, stack, stores, loads)
            for name, (_, arch, regs, stack, stores, loads) in zip(names, found, strict=True)]


def compile_report(build: Path, only: str | None = None) -> list[KernelResources]:
    """Every kernel of our CUDA sources (or of the one named `only`) in the build at `build` (its
    compile_commands.json)."""
    commands = json.loads((build / "compile_commands.json").read_text())
    ours = [c for c in commands if OUR_SOURCES in c["file"] and c["file"].endswith(".cu")
            and (only is None or Path(c["file"]).name == only)]
    if not ours:
        raise SystemExit(f"cuda_kernels: {build} holds no compile command of {OUR_SOURCES}*.cu: not a CUDA build")
    report = []
    with tempfile.TemporaryDirectory() as scratch:
        for c in ours:
            args = shlex.split(c["command"])
            out = args.index("-o")
            args[out + 1] = str(Path(scratch) / "kernel.o")
            source = Path(c["file"]).name
            log.info("compiling %s with -Xptxas=-v", source)
            proc = subprocess.run([*args, "-Xptxas=-v"], cwd=c["directory"], capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"cuda_kernels: {source} does not compile:\n{proc.stderr[-4000:]}")
            report += parse_ptxas(source, proc.stdout + proc.stderr)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=REPO / "build" / "cuda", help="the CUDA build folder")
    parser.add_argument("--out", type=Path, help="JSON to write (default bench/results/cuda-kernels-<arch>.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    report = compile_report(args.build)
    archs = sorted({k.arch for k in report})
    out = args.out or RESULTS / f"cuda-kernels-{'-'.join(archs)}.json"
    out.write_text(json.dumps({"archs": archs, "kernels": [asdict(k) for k in report]}, indent=1) + "\n")
    print("| kernel | arch | registers | stack B | spill stores B | spill loads B |\n|---|---|---:|---:|---:|---:|")
    for k in report:
        print(f"| {k.kernel} | {k.arch} | {k.registers} | {k.stack_bytes} | {k.spill_stores} | {k.spill_loads} |")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
