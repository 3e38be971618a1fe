"""pykvq: low-bit KV-cache quantization for llama.cpp / GGUF.

    from pykvq import Model, KvConfig
    with Model("model.gguf") as model:
        print("".join(model.generate("Once upon a time", kv=KvConfig.preset("kivi2"))))
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pykvq")
except PackageNotFoundError:  # running from a source checkout that was never installed
    __version__ = "0.0.0"

# Imported on first use: the build imports pykvq.upstream in an environment without numpy or cffi.
_PUBLIC = {
    "Model": "pykvq.llama", "Context": "pykvq.llama", "ContextConfig": "pykvq.llama", "KvConfig": "pykvq.llama",
    "KvMemory": "pykvq.llama", "ChatMessage": "pykvq.llama", "LlamaError": "pykvq.llama",
    "Sampler": "pykvq.sampling", "SamplerSettings": "pykvq.sampling",
    "GGML_TYPE_KIVI2": "pykvq.ggml_types", "GGML_TYPE_KIVI4": "pykvq.ggml_types",
    "GGML_TYPE_KIVI1": "pykvq.ggml_types",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'pykvq' has no attribute {name!r}")
