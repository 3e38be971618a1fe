"""SKVQ's clip ratios per layer, chosen from the Q, K and V a layer really attends with (pykvq.api.capture).

SKVQ (§3.1) takes for each quantization group the clip ratio that minimizes the error of the attention output on
calibration data. Here one ratio per layer for K and one for V (finer ratios did worse on held-out text in
bench/skvq_clip.py), each judged with the other part in fp16, under the cache's contract (DESIGN.md §5): the
window, the sinks and each query's own K tile read fp16; older K tiles per channel over 32 tokens, older V rows per
32 channels, both at the kivi2 width the ratios are written for. The quantization is a numpy model of the format,
used only to choose.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from pykvq import kv_types

GROUP = 32
BITS = 2
# 1-bit widths are tried at these too, although their least squared error lies near 0.4 (two levels at the means of
# a group's halves): tried down to 0.3, SmolLM2's 1-bit tensors took 0.35-0.6 and the probe's divergence fell by a
# third, but the pass key lost its lead at 1024 tokens (-0.035 to -0.118) and Hamlet's PPL did not improve
RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
NO_CLIP = 1.0
# ggml-kvq.h's GGML_KVQ_MSE_STEP and GGML_KVQ_MSE_STEPS
MSE_STEP = np.float32(0.04)
MSE_STEPS = 8
# the attention is computed whole ([heads, tokens, tokens] per layer): longer calibration texts are judged on their
# first tokens, which are a sequence of their own under the contract
MAX_TOKENS = 1024

# a layer's captured Q [tokens, heads, dim], K and V [tokens, KV heads, dim]; None for a layer that attends with no K
# and V of its own (a hybrid's recurrent layer, a layer reading an earlier layer's cache): nothing to calibrate there
LayerQkv = Callable[[int], "tuple[np.ndarray, np.ndarray, np.ndarray] | None"]


def each_layer(layer_qkv: LayerQkv, n_layer: int, progress: Callable[[], None] | None = None
               ) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray] | None]]:
    """Every layer's captured Q, K and V on their first MAX_TOKENS tokens (None where the layer keeps no K and V),
    ``progress`` called after each."""
    for il in range(n_layer):
        captured = layer_qkv(il)
        yield il, None if captured is None else tuple(x[:MAX_TOKENS] for x in captured)
        if progress is not None:
            progress()


def _dequantized(groups: np.ndarray, bits: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    qmax = (1 << bits) - 1
    step = np.minimum((hi - lo) / np.float32(qmax), 65504.0).astype(np.float16).astype(np.float32)
    low = lo.astype(np.float16).astype(np.float32)
    codes = np.clip(np.rint((groups - low) / np.where(step > 0, step, 1.0)), 0, qmax)
    return low + step * np.where(step > 0, codes, 0.0)


def _searched_range(groups: np.ndarray, bits: int, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """kv_types.CLIP_MSE: each group's candidate range of least squared error, its ends moved in by multiples of
    MSE_STEP of its width (ggml-kvq.h's GGML_KVQ_CLIP_MSE); the first least wins."""
    width = hi - lo
    best = np.full(lo.shape, np.inf, dtype=np.float32)
    best_lo, best_hi = lo, hi
    for a in range(MSE_STEPS + 1):
        low = lo + width * np.float32(np.float32(a) * MSE_STEP)
        for b in range(MSE_STEPS + 1):
            high = hi - width * np.float32(np.float32(b) * MSE_STEP)
            sse = np.square(_dequantized(groups, bits, low, high) - groups).sum(-1, keepdims=True, dtype=np.float32)
            better = sse < best
            best = np.where(better, sse, best)
            best_lo, best_hi = np.where(better, low, best_lo), np.where(better, high, best_hi)
    return best_lo, best_hi


def fake_quantize(x: np.ndarray, bits: int, clip: float) -> np.ndarray:
    """``x`` with each group of 32 consecutive values along the last axis replaced by its kivi dequantization, the
    group's range first narrowed by ``clip`` (kv_types.CLIP_MSE: searched per group)."""
    groups = x.reshape(*x.shape[:-1], -1, GROUP).astype(np.float32, copy=False)
    lo, hi = groups.min(-1, keepdims=True), groups.max(-1, keepdims=True)
    if clip == kv_types.CLIP_MSE:
        lo, hi = _searched_range(groups, bits, lo, hi)
    else:
        lo, hi = lo * np.float32(clip), hi * np.float32(clip)
    return _dequantized(groups, bits, lo, hi).reshape(x.shape)


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


@dataclass(frozen=True)
class Contract:
    """Which cells a query reads in fp16: [query, key] masks for n tokens of one sequence from its start."""

    causal: np.ndarray
    near_k: np.ndarray
    near_v: np.ndarray

    @classmethod
    def of(cls, n: int, window: int, sinks: int) -> Contract:
        i = np.arange(n)[:, None]
        j = np.arange(n)[None, :]
        near_v = (i - j < window) | (j < sinks)
        # a K tile is sealed once the query is past it: its own tile is fp16 to it
        return cls(j <= i, near_v | (j // GROUP >= i // GROUP), near_v)


def fewest_quantized_tokens(window: int, sinks: int) -> int:
    """The fewest tokens from a sequence's start for any K (hence V) to be read quantized under the Contract: the
    last query must lie a window past a token after the sinks, in a later tile than that token's."""
    return max(sinks + window + 1, GROUP * -(-(sinks + 1) // GROUP) + 1)


def masked_softmax(scores: np.ndarray, causal: np.ndarray) -> np.ndarray:
    scores = np.where(causal, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def is_latent(k: np.ndarray, v: np.ndarray) -> bool:
    """Whether a layer's V is its K's first channels, K having more (the RoPE part): multi-head latent attention,
    whose kivi cache reads V from K's tiles (ggml_kvq_attn_latent), so that quantizing K quantizes V and V has no
    width or clip ratio of its own. (A V as wide as K, even equal to it, as Gemma 4's without a V projection could
    be, is a V of its own.)"""
    return v.shape[1] == k.shape[1] and v.shape[-1] < k.shape[-1] and np.array_equal(v, k[..., :v.shape[-1]])


class LayerAttention:
    """One layer's attention over its captured tokens in fp16, and how far its output moves when K or V alone is
    quantized under the contract. q [tokens, heads, dim], k and v [tokens, KV heads, dim] (post-RoPE, as the cache
    stores them). A latent layer's (is_latent) K error counts its V's, read from the same quantized cells, and its V
    has none of its own."""

    def __init__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, contract: Contract) -> None:
        self.group = q.shape[1] // k.shape[1]
        self.latent = is_latent(k, v)
        self.contract = contract
        self.qh = _fp16(q.transpose(1, 0, 2))                                  # [heads, tokens, dim]
        self.kh = _fp16(k.transpose(1, 0, 2))                                  # [KV heads, tokens, dim]
        self.v = v.transpose(1, 0, 2)
        self.vh = np.repeat(_fp16(self.v), self.group, 0)
        self.scale = np.float32(q.shape[-1] ** -0.5)
        self.scores = self.qh @ np.repeat(self.kh, self.group, 0).transpose(0, 2, 1) * self.scale
        p = masked_softmax(self.scores, contract.causal)
        self.output = p @ self.vh
        # with K in fp16 a quantized V moves the output by the far probabilities times its error
        self.far_v = p * ~contract.near_v

    @property
    def energy(self) -> float:
        """The output's squared norm, summed over tokens and heads."""
        return float((self.output ** 2).sum())

    def k_error(self, bits: int, clip: float) -> float:
        """Squared error of the output with K quantized (per channel over tokens: groups run along the token axis);
        a latent layer's V, K's first channels, read from the same cells."""
        kq = np.repeat(fake_quantize(self.kh.transpose(0, 2, 1), bits, clip).transpose(0, 2, 1), self.group, 0)
        scores = np.where(self.contract.near_k, self.scores, self.qh @ kq.transpose(0, 2, 1) * self.scale)
        p = masked_softmax(scores, self.contract.causal)
        output = p @ self.vh
        if self.latent:
            # V's window is K's (its query's own tile included)
            output += (p * ~self.contract.near_k) @ (kq[..., :self.vh.shape[-1]] - self.vh)
        return float(((output - self.output) ** 2).sum())

    def v_error(self, bits: int, clip: float) -> float:
        """Squared error of the output with V quantized (per token, groups of 32 channels); 0 in a latent layer,
        whose V is quantized with its K."""
        if self.latent:
            return 0.0
        vq = np.repeat(fake_quantize(self.v, bits, clip), self.group, 0)
        return float(((self.far_v @ (vq - self.vh)) ** 2).sum())


@dataclass(frozen=True)
class LayerErrors:
    """Squared error of a layer's attention output, summed over its tokens and heads, per candidate ratio."""

    k: tuple[float, ...]
    v: tuple[float, ...]


def layer_errors(q: np.ndarray, k: np.ndarray, v: np.ndarray, contract: Contract,
                 ratios: Sequence[float] = RATIOS) -> LayerErrors:
    """Each ratio's error at the kivi2 width the ratios are chosen for (LayerAttention's shapes)."""
    attention = LayerAttention(q, k, v, contract)
    return LayerErrors(tuple(attention.k_error(BITS, r) for r in ratios),
                       tuple(attention.v_error(BITS, r) for r in ratios))


def per_layer_ratios(layer_qkv: LayerQkv, n_layer: int, window: int, sinks: int, ratios: Sequence[float] = RATIOS,
                     progress: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Each layer's least-error K and V ratio, per part (none where the layer keeps no K and V)."""
    contract = None
    chosen: dict[str, list[float]] = {"k": [], "v": []}
    for _, captured in each_layer(layer_qkv, n_layer, progress):
        if captured is None:
            chosen["k"].append(NO_CLIP)
            chosen["v"].append(NO_CLIP)
            continue
        q, k, v = captured
        if contract is None:
            contract = Contract.of(q.shape[0], window, sinks)
        errors = layer_errors(q, k, v, contract, ratios)
        chosen["k"].append(ratios[int(np.argmin(errors.k))])
        chosen["v"].append(ratios[int(np.argmin(errors.v))])
    return chosen


def clip_spec_per_layer(ratios: dict[str, list[float]]) -> str:
    """The --kv-clip form of per-layer ratios (k, v: one per layer), runs of equal ratios as ranges; "none" when
    nothing clips."""
    return kv_types.per_layer_spec({part: [kv_types.clip_text(r) for r in values] for part, values in ratios.items()},
                                   "1")
