"""The shipped libraries leave the C++ runtime to the system's libstdc++.so.6 (pykvq.devtools.shared_libraries),
and the check itself is seen to fail on a library that carries its own libstdc++."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pykvq import paths
from pykvq.devtools import shared_libraries

IOSTREAM_SOURCE = """\
#include <iostream>
#include <sstream>
extern "C" int pykvq_print(long x) { std::ostringstream s; s << x; std::cout << s.str() << std::endl; return 0; }
"""


def test_installed_libraries_define_none_of_libstdcxx_and_need_it() -> None:
    libraries = shared_libraries.shipped_libraries(paths.lib_dir())
    assert shared_libraries.check_libraries(libraries) == []


@pytest.fixture(scope="module")
def cxx_library_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build the check's own test libraries")
    directory = tmp_path_factory.mktemp("cxx")
    (directory / "print.cpp").write_text(IOSTREAM_SOURCE)
    return directory


def build(directory: Path, name: str, *flags: str) -> Path:
    library = directory / f"lib{name}.so"
    subprocess.run(["g++", "-shared", "-fPIC", *flags, "-o", str(library), str(directory / "print.cpp")], check=True)
    return library


def test_check_catches_a_library_linked_with_static_libstdcxx(cxx_library_dir: Path) -> None:
    library = build(cxx_library_dir, "static", "-static-libstdc++")
    problems = [finding.problem for finding in shared_libraries.check_library(library)]
    assert len(problems) == 2, problems
    assert "of libstdc++.so.6's symbols" in problems[0]
    assert "does not name libstdc++.so.6 as NEEDED" in problems[1]


def test_check_passes_the_same_library_linked_normally(cxx_library_dir: Path) -> None:
    assert shared_libraries.check_library(build(cxx_library_dir, "shared")) == []


def test_the_command_reports_and_fails(cxx_library_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = cxx_library_dir / "bad"
    bad.mkdir()
    build(cxx_library_dir, "static", "-static-libstdc++").rename(bad / "libstatic.so")
    assert shared_libraries.main([str(bad)]) == 1
    assert shared_libraries.main([str(cxx_library_dir / "missing")]) == 2
