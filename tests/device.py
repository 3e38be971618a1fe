"""Where the suite runs its models: one setting puts every model a test loads, and its KV cache, on the GPU.

PYKVQ_TEST_NGL         layers offloaded (-ngl) for every model: 0 (the default, CI's) keeps them on the CPU, 99
                       puts the model and its KV cache in GPU memory (bench/gpu/session.sh runs the suite so)
PYKVQ_TEST_OP_OFFLOAD  off: upstream's op offload off too (--no-op-offload); with NGL 0, a CUDA build's control
                       run, which must pass exactly as the CPU build does
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

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


# On a GPU the matmul kernels (cuBLAS, ggml's MMQ with its stream-k split) and upstream's flash attention are
# chosen and split by batch shape, so the same tokens decoded in other batches (a fresh reference context, a
# sequence next to others) give logits that differ by rounding, and a 2-bit code flips wherever that rounding
# crosses a step. Provisional bar until measured on a GPU: a wrong cache (another sequence's data, a stale
# tile) moves whole distributions, far past it.
GPU_MEAN_KL = 1e-2
GPU_TOP1_AGREEMENT = 0.9


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    rows = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    shifted = rows - rows.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def assert_same_logits(got: np.ndarray, want: np.ndarray) -> None:
    """The logits of the same tokens decoded in other batches: bit for bit on the CPU, whose results do not
    depend on the batching; on a GPU, the same distributions up to rounding (see GPU_MEAN_KL)."""
    if not ON_GPU:
        np.testing.assert_array_equal(got, want)
        return
    assert np.shape(got) == np.shape(want)
    log_p, log_q = _log_softmax(want), _log_softmax(got)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(axis=1)
    agreement = float(np.mean(log_p.argmax(axis=1) == log_q.argmax(axis=1)))
    detail = (f"mean KL {kl.mean():.2e}, max KL {kl.max():.2e}, top-1 agreement {agreement:.3f}, "
              f"max |Δlogit| {np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max():.3g}")
    assert kl.mean() < GPU_MEAN_KL and agreement >= GPU_TOP1_AGREEMENT, detail
