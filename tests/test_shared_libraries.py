"""The shipped libraries leave the C++ runtime to the system's libstdc++.so.6 (pykvq.devtools.shared_libraries),
and the check itself is seen to fail on a library that carries its own libstdc++; the build links the runtime
shared even with a toolchain whose own library folder has only libstdc++.a (cmake/pykvq-libstdcxx.cmake)."""

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


PROJECT = """\
cmake_minimum_required(VERSION 3.21)
project(print LANGUAGES CXX)
if (WITH_PYKVQ_LIBSTDCXX)
    include({module})
endif()
add_library(print SHARED print.cpp)
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


@pytest.fixture(scope="module")
def relocated_gcc(cxx_library_dir: Path) -> Path:
    """A g++ like the GPU image's /opt/gcc: its first library folder (-B) holds libstdc++.a and no libstdc++.so,
    so a plain link takes the archive."""

    archive = Path(subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True,
                                  check=True).stdout.strip())
    if not archive.is_absolute():
        pytest.skip("this g++ has no static libstdc++.a to reproduce the relocated toolchain with")
    folder = cxx_library_dir / "relocated"
    (folder / "lib").mkdir(parents=True)
    (folder / "lib" / "libstdc++.a").symlink_to(archive)
    wrapper = folder / "g++"
    wrapper.write_text(f'#!/bin/sh\nexec g++ -B{folder / "lib"}/ "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def cmake_build(directory: Path, compiler: Path, repo: Path, *, with_module: bool) -> Path:
    if shutil.which("cmake") is None:
        pytest.skip("no cmake to build the test project with")
    source = directory / f"project-{with_module}"
    source.mkdir()
    (source / "print.cpp").write_text(IOSTREAM_SOURCE)
    (source / "CMakeLists.txt").write_text(PROJECT.format(module=repo / "cmake" / "pykvq-libstdcxx.cmake"))
    build_dir = source / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), f"-DCMAKE_CXX_COMPILER={compiler}",
                    f"-DWITH_PYKVQ_LIBSTDCXX={'ON' if with_module else 'OFF'}"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build_dir)], check=True, capture_output=True)
    return build_dir / "libprint.so"


def test_a_relocated_gcc_links_the_archive_without_the_module(cxx_library_dir: Path, relocated_gcc: Path,
                                                               repo: Path) -> None:
    library = cmake_build(cxx_library_dir, relocated_gcc, repo, with_module=False)
    assert shared_libraries.check_library(library) != []


def test_the_module_makes_a_relocated_gcc_link_libstdcxx_shared(cxx_library_dir: Path, relocated_gcc: Path,
                                                                 repo: Path) -> None:
    library = cmake_build(cxx_library_dir, relocated_gcc, repo, with_module=True)
    assert shared_libraries.check_library(library) == []
