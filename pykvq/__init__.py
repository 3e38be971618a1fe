"""pykvq: low-bit KV-cache quantization for llama.cpp / GGUF."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pykvq")
except PackageNotFoundError:  # running from a source checkout that was never installed
    __version__ = "0.0.0"

__all__ = ["__version__"]
