"""pykvq: low-bit KV-cache quantization for llama.cpp / GGUF.

    from pykvq import Model, KvConfig
    with Model("model.gguf") as model:
        print("".join(model.generate("Once upon a time", kv=KvConfig.preset("kivi2"))))

Where things are: ``api`` (Model, Context, Sampler), ``bindings`` (cffi bindings to the built libraries),
``calibration`` (what ``pykvq calibrate`` chooses: widths, clip ratios, rotation, window), ``commands`` (the
``pykvq`` command line), ``convert`` (HF -> GGUF with calibrated metadata), ``llama_cpp``
(llama-cpp-python on pykvq's libllama), ``devtools`` (the upstream build and developer scripts); at the top,
the core every part shares: ``paths``, ``build_info``, ``kv_types`` (the KV-spec vocabulary),
``gguf_metadata`` (the ``kvq.*`` schema), ``assets``, ``llama_tools``.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pykvq")
except PackageNotFoundError:  # running from a source checkout that was never installed
    __version__ = "0.0.0"

# Imported on first use: the build imports pykvq.devtools.upstream in an environment without numpy or cffi.
_API, _TYPES = "pykvq.api.llama", "pykvq.bindings.ggml_types"
_PUBLIC = {
    "Model": _API, "Context": _API, "ContextConfig": _API, "KvConfig": _API, "KvMemory": _API,
    "ChatMessage": _API, "LlamaError": _API,
    "Placement": "pykvq.api.fit", "fit_placement": "pykvq.api.fit",
    "Sampler": "pykvq.api.sampling", "SamplerSettings": "pykvq.api.sampling",
    "GGML_TYPE_KIVI2": _TYPES, "GGML_TYPE_KIVI4": _TYPES, "GGML_TYPE_KIVI1": _TYPES,
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'pykvq' has no attribute {name!r}")
