"""Which layers' K and V upstream's Hadamard rotation helps, judged from the Q, K and V a layer really attends with.

A rotation spreads each head's outlier channels over the others before quantization (QuaRot; llama.cpp rotates its
quantized KV so by default). For kivi's per-channel K groups that mixes apart what the groups keep apart, so whether
it pays depends on the layer: on SmolLM2 it lowers the attention-output error of K in 24 of 30 layers and of V in
all of them, on a qwen2 model with bias outlier channels in K it hurts (bench/recipe.py). Each layer's K and V are
judged like the clip ratios (clip_ratios): the output error at kivi2 with and without the rotation, each
at its best clip ratio, the other part in fp16. The rotations match the cache's (llama_kv_cache::build_input_k_rot):
K by the largest power-of-two block of at least 64 that divides the head, V by blocks of 64; a head size that 64
does not divide is never rotated.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pykvq import kv_types
from pykvq.calibration.clip_ratios import BITS, RATIOS, Contract, LayerAttention, LayerQkv, each_layer

SMALLEST = 64


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix of order n (a power of two), Sylvester's construction."""
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(np.sqrt(n))


def k_block(head_dim: int) -> int:
    """The order of K's rotation for a head size: the largest power of two of at least 64 dividing it."""
    n = SMALLEST
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def rotatable(head_dim: int) -> bool:
    return head_dim % SMALLEST == 0


def rotate(x: np.ndarray, order: int) -> np.ndarray:
    """``x`` [..., head_dim] with each block of ``order`` channels turned by the Hadamard matrix."""
    blocks = x.reshape(*x.shape[:-1], -1, order)
    return (blocks @ hadamard(order)).reshape(x.shape)


def rotated_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, rotate_k: bool,
                rotate_v: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer's Q, K and V as the cache sees them: Q and K turned alike (their dot products stay), V turned (the
    output turned back is exact, so its error is the turned one's)."""
    if rotate_k and rotatable(q.shape[-1]):
        order = k_block(q.shape[-1])
        q, k = rotate(q, order), rotate(k, order)
    if rotate_v and rotatable(v.shape[-1]):
        v = rotate(v, SMALLEST)
    return q, k, v


def rotated_layer(layer_qkv: LayerQkv, rotation: dict[str, list[bool]]) -> LayerQkv:
    """``layer_qkv`` under ``rotation`` (per part, per layer)."""
    def rotated(il: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        captured = layer_qkv(il)
        return None if captured is None else rotated_qkv(*captured, rotation["k"][il], rotation["v"][il])

    return rotated


def per_layer_rotation(layer_qkv: LayerQkv, n_layer: int, window: int, sinks: int,
                       progress: Callable[[], None] | None = None) -> str:
    """The --kv-rotate spec that rotates each layer's K and V where that lowers its attention-output error (off where
    the layer keeps no K and V)."""
    contract: Contract | None = None
    chosen: dict[str, list[str]] = {"k": [], "v": []}
    for _, captured in each_layer(layer_qkv, n_layer, progress):
        if captured is None:
            chosen["k"].append("off")
            chosen["v"].append("off")
            continue
        q, k, v = captured
        if contract is None:
            contract = Contract.of(q.shape[0], window, sinks)
        plain = LayerAttention(q, k, v, contract)
        turned = LayerAttention(*rotated_qkv(q, k, v, True, True), contract)
        for part, error in (("k", LayerAttention.k_error), ("v", LayerAttention.v_error)):
            better = min(error(turned, BITS, r) for r in RATIOS) < min(error(plain, BITS, r) for r in RATIOS)
            chosen[part].append("on" if better else "off")
    spec = kv_types.per_layer_spec(chosen, "off")
    return "off" if spec == "none" else spec
