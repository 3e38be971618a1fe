"""Checks that the shipped shared libraries leave the C++ runtime to the system's libstdc++.so.6.

A library that carries its own copy of libstdc++ (the static archive pulled in by one object) and exports it
captures the C++ runtime calls of every library loaded after it, into an uninitialised copy: the CUDA build's
crash in model load. So no shipped library may define libstdc++'s symbols strongly, and each one that uses C++
must name libstdc++.so.6 as NEEDED.

    python -m pykvq.devtools.shared_libraries [LIB_DIR ...]   (default: the installed package's pykvq/lib)
"""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pykvq import paths

log = logging.getLogger("pykvq.shared_libraries")

LIBSTDCXX = "libstdc++.so.6"
# nm's letters for strong definitions in text, data, bss and read-only data; weak ones (W, V, u) are the
# template instances every C++ object may legally carry
STRONG_DEFINED = frozenset("TDBR")
CXX_RUNTIME_NAME = re.compile(r"^(_ZNSt|_ZSt|_ZNKSt|__cxa_|__gxx_personality|_ZTVN10__cxxabiv)")


@dataclass(frozen=True)
class Symbol:
    name: str
    kind: str
    defined: bool


@dataclass(frozen=True)
class Finding:
    library: Path
    problem: str


def dynamic_symbols(library: Path) -> list[Symbol]:
    out = subprocess.run(["nm", "-D", str(library)], capture_output=True, text=True, check=True).stdout
    symbols = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        kind, name = fields[-2], fields[-1]
        # versioned names: foo@@GLIBCXX_3.4 (the default version) and foo@GLIBCXX_3.4
        symbols.append(Symbol(name.split("@", 1)[0], kind, defined=len(fields) == 3 and kind not in "Uw"))
    return symbols


def needed(library: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


@cache
def system_libstdcxx() -> Path:
    out = subprocess.run(["g++", "-print-file-name=" + LIBSTDCXX], capture_output=True, text=True, check=True)
    path = Path(out.stdout.strip())
    if not path.is_absolute() or not path.is_file():
        raise FileNotFoundError(f"g++ does not know where {LIBSTDCXX} is (it answered {out.stdout.strip()!r})")
    return path.resolve()


@cache
def libstdcxx_exports() -> frozenset[str]:
    return frozenset(s.name for s in dynamic_symbols(system_libstdcxx()) if s.defined)


def check_library(library: Path) -> list[Finding]:
    symbols = dynamic_symbols(library)
    findings = []
    copied = sorted(s.name for s in symbols
                    if s.defined and s.kind in STRONG_DEFINED and s.name in libstdcxx_exports())
    if copied:
        findings.append(Finding(library, f"defines {len(copied)} of {LIBSTDCXX}'s symbols "
                                         f"(e.g. {', '.join(copied[:3])})"))
    uses_cxx = any(CXX_RUNTIME_NAME.match(s.name) for s in symbols)
    if uses_cxx and LIBSTDCXX not in needed(library):
        findings.append(Finding(library, f"uses the C++ runtime but does not name {LIBSTDCXX} as NEEDED"))
    return findings


def check_libraries(libraries: Iterable[Path]) -> list[Finding]:
    return [finding for library in libraries for finding in check_library(library)]


def shipped_libraries(lib_dir: Path) -> list[Path]:
    libraries = sorted(lib_dir.glob("*.so"))
    if not libraries:
        raise FileNotFoundError(f"no shared libraries in {lib_dir}")
    return libraries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pykvq.devtools.shared_libraries", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lib_dirs", nargs="*", type=Path, help="folders of .so files (default: pykvq/lib)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        libraries = [lib for d in (args.lib_dirs or [paths.lib_dir()]) for lib in shipped_libraries(d)]
        findings = check_libraries(libraries)
    except (OSError, subprocess.CalledProcessError, paths.NotBuiltError) as e:
        log.error("error: %s", e)
        return 2
    for finding in findings:
        log.error("%s: %s", finding.library, finding.problem)
    log.info("%d libraries checked, %d problems", len(libraries), len(findings))
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
