"""Where the suite runs its models: one setting puts every model a test loads, and its KV cache, on the GPU.

PYKVQ_TEST_NGL         layers offloaded (-ngl) for every model: 0 (the default, CI's) keeps them on the CPU, 99
                       puts the model and its KV cache in GPU memory (bench/gpu/session.sh runs the suite so)
PYKVQ_TEST_OP_OFFLOAD  off: upstream's op offload off too (--no-op-offload); with NGL 0, a CUDA build's control
                       run, which must pass exactly as the CPU build does
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pykvq import ContextConfig, KvConfig, Model
from pykvq.devtools import random_model

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
# for llama.cpp's tools, `pykvq run` and `pykvq perplexity`
TOOL_ARGS = ("-ngl", str(NGL), "--op-offload" if OP_OFFLOAD else "--no-op-offload")
# for llama-cpp-python's Llama
LLAMA_KWARGS: dict[str, Any] = {"n_gpu_layers": NGL, "op_offload": OP_OFFLOAD}


def load_model(path: str | os.PathLike, on_cpu: bool = False) -> Model:
    """The model on the suite's device; on_cpu: for a test that judges the CPU whatever the setting (with
    context_config(on_cpu=True), so that no op is offloaded either)."""
    return Model(path, n_gpu_layers=0 if on_cpu else NGL)


def load_random_model(folder: Path, shape: str) -> Model:
    """A random-weight model of the named shape (pykvq.devtools.random_model), written in ``folder``, on the suite's
    device."""
    path = folder / f"{shape}.gguf"
    random_model.write(random_model.SHAPES[shape], path)
    return load_model(path)


def context_config(on_cpu: bool = False, **fields: Any) -> ContextConfig:
    return ContextConfig(op_offload=OP_OFFLOAD and not on_cpu, **fields)


def assert_state_continues(model: Model, config: ContextConfig, first: list[int], then: list[int]) -> None:
    """A state saved after ``first`` loads into a fresh context, which continues with ``then`` as the saving one
    did."""
    with model.context(config) as saving:
        saving.eval(first)
        state = saving.save_state()
        expected = saving.eval(then, all_logits=True)
    with model.context(config) as loading:
        loading.load_state(state)
        assert loading.n_past == len(first)
        assert_same_logits(loading.eval(then, all_logits=True), expected)


def all_logits(model: Model, kv: KvConfig, tokens: list[int], n_ctx: int, n_ubatch: int | None = None,
               flash_attn: str = "on") -> np.ndarray:
    """Every token's logits of ``tokens`` decoded into a fresh context of n_ctx cells on the suite's device, in
    one batch of ubatches of n_ubatch (default: all of it)."""
    config = context_config(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ubatch or n_ctx, n_threads=2, kv=kv,
                            flash_attn=flash_attn)
    with model.context(config) as ctx:
        return ctx.eval(tokens, all_logits=True)


# On a GPU the matmul kernels (cuBLAS, ggml's MMQ with its stream-k split) and upstream's flash attention are
# chosen and split by batch shape, so the same tokens decoded in other batches (a fresh reference context, a
# sequence next to others) give logits that differ by rounding, and a 2- or 1-bit code flips wherever that rounding
# crosses a step, which moves the next layers' K and V further. The bar there: the batching moves the distributions
# by no more than GPU_MEAN_KL, or, given the f16 twin of the reference (the same tokens and batches on an f16
# cache), by no more than QUANTIZATION_SHARE times what the quantization itself moves them; top-1 agreement at
# least GPU_TOP1_AGREEMENT, or, with the twin, disagreeing on no more than QUANTIZATION_SHARE times the rows the
# quantization itself flips (the H200 measured SmolLM2's kivi caches moved by a change of batch shape as much as by
# the quantization: KL 2.5e-2 and 13% of rows against 2.5e-2 and 11%). One row says little: a flip between two
# near-equal tokens is all or nothing there, so tests compare many rows at once. A wrong cache (another sequence's
# data, a stale tile) moves whole distributions, far past it; the CPU and RPC runs of the same tests stay exact.
GPU_MEAN_KL = 1e-2
GPU_TOP1_AGREEMENT = 0.9
QUANTIZATION_SHARE = 2.0


def moved(got: np.ndarray, want: np.ndarray) -> float:
    """The mean absolute change of the logits ``got`` against ``want``."""
    return float(np.abs(got - want).mean())


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    rows = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    shifted = rows - rows.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


@dataclass(frozen=True)
class Divergence:
    """How far the distributions of `got` are from `want`'s, row by row."""

    mean_kl: float
    max_kl: float
    top1_agreement: float
    max_abs: float

    @classmethod
    def of(cls, got: np.ndarray, want: np.ndarray) -> Divergence:
        assert np.shape(got) == np.shape(want)
        log_p, log_q = _log_softmax(want), _log_softmax(got)
        kl = (np.exp(log_p) * (log_p - log_q)).sum(axis=1)
        agreement = float(np.mean(log_p.argmax(axis=1) == log_q.argmax(axis=1)))
        max_abs = float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max())
        return cls(float(kl.mean()), float(kl.max()), agreement, max_abs)

    def __str__(self) -> str:
        return (f"mean KL {self.mean_kl:.2e}, max KL {self.max_kl:.2e}, top-1 agreement {self.top1_agreement:.3f}, "
                f"max |Δlogit| {self.max_abs:.3g}")


def assert_same_logits(got: np.ndarray, want: np.ndarray, f16: Callable[[], np.ndarray] | None = None) -> None:
    """The logits of the same tokens decoded in other batches: bit for bit on the CPU, whose results do not
    depend on the batching; on a GPU, the same distributions up to rounding (see GPU_MEAN_KL). `f16` gives the
    f16 twin of `want` (called on a GPU only)."""
    if not ON_GPU:
        np.testing.assert_array_equal(got, want)
        return
    moved = Divergence.of(got, want)
    kl_bound, agreement_bound, detail = GPU_MEAN_KL, GPU_TOP1_AGREEMENT, str(moved)
    if f16 is not None:
        quantization = Divergence.of(want, f16())
        kl_bound = max(kl_bound, QUANTIZATION_SHARE * quantization.mean_kl)
        agreement_bound = min(agreement_bound, 1.0 - QUANTIZATION_SHARE * (1.0 - quantization.top1_agreement))
        detail += f"; the quantization itself (f16 twin): {quantization}"
    assert moved.mean_kl < kl_bound and moved.top1_agreement >= agreement_bound, detail
