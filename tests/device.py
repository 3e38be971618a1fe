"""Where the suite runs its models: one setting puts every model a test loads, and its KV cache, on the GPU.

PYKVQ_TEST_NGL         layers offloaded (-ngl) for every model: 0 (the default, CI's) keeps them on the CPU, 99
                       puts the model and its KV cache in GPU memory (bench/gpu/session.sh runs the suite so)
PYKVQ_TEST_OP_OFFLOAD  off: upstream's op offload off too (--no-op-offload); with NGL 0, a CUDA build's control
                       run, which must pass exactly as the CPU build does
"""

from __future__ import annotations

import os
from typing import Any

from pykvq import ContextConfig, Model

_OP_OFFLOAD = {"on": True, "off": False}


def _ngl() -> int:
    value = os.environ.get("PYKVQ_TEST_NGL", "0")
    if not value.isdigit():
        raise ValueError(f"PYKVQ_TEST_NGL must be a number of layers (0, 99, ...), got {value!r}")
    return int(value)


def _op_offload() -> bool:
    value = os.environ.get("PYKVQ_TEST_OP_OFFLOAD", "on")
    if value not in _OP_OFFLOAD:
        raise ValueError(f"PYKVQ_TEST_OP_OFFLOAD must be on or off, got {value!r}")
    return _OP_OFFLOAD[value]


NGL = _ngl()
OP_OFFLOAD = _op_offload()
ON_GPU = NGL > 0
# for llama.cpp's tools and `pykvq run`
TOOL_ARGS = ("-ngl", str(NGL), "--op-offload" if OP_OFFLOAD else "--no-op-offload")
# for llama-cpp-python's Llama
LLAMA_KWARGS: dict[str, Any] = {"n_gpu_layers": NGL, "op_offload": OP_OFFLOAD}


def load_model(path: str | os.PathLike) -> Model:
    return Model(path, n_gpu_layers=NGL)


def context_config(**fields: Any) -> ContextConfig:
    return ContextConfig(op_offload=OP_OFFLOAD, **fields)
