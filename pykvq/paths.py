"""Where the built libraries and tools live: inside the installed package, never a build tree."""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

CACHE_ENV = "PYKVQ_CACHE_DIR"


class NotBuiltError(RuntimeError):
    """The native part of pykvq is missing: the package was not installed with `pip install .`."""


def package_dir() -> Path:
    return Path(str(files("pykvq")))


def _built(path: Path, what: str) -> Path:
    if not path.exists():
        raise NotBuiltError(
            f"{what} not found at {path}: pykvq's native build is missing. "
            "Install the package with `pip install .` from the source checkout."
        )
    return path


def lib_dir() -> Path:
    return _built(package_dir() / "lib", "the pykvq library folder")


def library(name: str) -> Path:
    """A shared library by its short name, e.g. ``library("llama")`` -> .../pykvq/lib/libllama.so."""
    return _built(lib_dir() / f"lib{name}.so", f"lib{name}.so")


def tool(name: str) -> Path:
    """A built upstream tool, e.g. ``tool("llama-perplexity")``."""
    return _built(package_dir() / "bin" / name, name)


def vendor_dir() -> Path:
    """The pinned llama.cpp's Python tools, as upstream lays them out: convert_hf_to_gguf.py, its `conversion`
    package and `gguf-py/`, which the converter puts on its own path (never site-packages)."""
    return _built(package_dir() / "vendor", "the pinned llama.cpp's Python tools")


def hf_converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py."""
    return _built(vendor_dir() / "convert_hf_to_gguf.py", "llama.cpp's HF converter")


def gguf_py() -> Path:
    """The pinned llama.cpp's `gguf` package folder."""
    return _built(vendor_dir() / "gguf-py" / "gguf", "llama.cpp's gguf package")


def cache_dir() -> Path:
    """Downloads kept between runs and builds: the upstream sdist, dev models and texts."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pykvq"


def build_info_file() -> Path:
    return _built(package_dir() / "_build_info.json", "the build info")
