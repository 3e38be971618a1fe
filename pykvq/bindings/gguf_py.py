"""The pinned llama.cpp's ``gguf`` package, imported under a private name.

pykvq installs that package only inside itself (``pykvq/vendor/gguf-py/gguf``, beside upstream's converter),
never as a top-level ``gguf``: PyPI's ``gguf``, which transformers reads GGUF files with, may be installed too,
in any version, and neither may replace the other. Here it becomes the module ``pykvq.bindings._pinned_gguf``.
Two of its modules say ``import gguf`` of themselves; while the package loads, that name is lent to it and then
given back to whatever held it (PyPI's package, or nothing), so both coexist in one process.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from functools import cache
from types import ModuleType

from pykvq import paths

PRIVATE_NAME = "pykvq.bindings._pinned_gguf"
PUBLIC_NAME = "gguf"

_lock = threading.Lock()


@cache
def gguf() -> ModuleType:
    """The pinned ``gguf`` module (GGUFReader, GGUFWriter, Keys, ...)."""
    folder = paths.gguf_py()
    spec = importlib.util.spec_from_file_location(PRIVATE_NAME, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the pinned gguf package from {folder}")
    module = importlib.util.module_from_spec(spec)
    with _lock:
        held = {name: mod for name, mod in sys.modules.items() if name == PUBLIC_NAME or name.startswith("gguf.")}
        for name in held:
            del sys.modules[name]
        sys.modules[PRIVATE_NAME] = module
        sys.modules[PUBLIC_NAME] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[PRIVATE_NAME]
            raise
        finally:
            for name in [n for n in sys.modules if n == PUBLIC_NAME or n.startswith("gguf.")]:
                del sys.modules[name]
            sys.modules.update(held)
    return module
