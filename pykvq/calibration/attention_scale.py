"""Each layer's attention scale, read off the f16 run: the factor its scores take before the softmax.

The calibration's attention model (clip_ratios.LayerAttention) scales the scores by head_dim^-0.5, which is what
most families use; others do not (Gemma 4 normalizes Q and K and scales by 1, Gemma 2/3 by their query pre-attention
scalar, Granite by its attention multiplier, Llama 4's chunked layers by a temperature), and a scale off by 11x
turns a sharp attention into a flat one, whose error under a quantized K is another. The graph's attention output
(llama.cpp's "kqv_out") over the captured Q, K and V fixes it: the scale whose causal softmax attention reproduces
it, found by golden-section search on the logarithm, over tokens within the model's sliding window (where a window's
mask is the causal one). Where even the best scale leaves the output more than FIT_TOLERANCE off (soft-capping,
learned sinks, which the model leaves out, bending the scores), the layer keeps head_dim^-0.5.
"""

from __future__ import annotations

import math

import numpy as np

from pykvq.calibration.clip_ratios import masked_softmax

FIT_TOKENS = 256  # the first tokens are a causal sequence of their own: enough to pin one number
SPAN = math.log(64.0)  # searched within 64x either way of head_dim^-0.5
STEPS = 40  # golden-section steps: the interval shrinks by 0.618 each, to 1e-7 of the span
# squared error relative to the output's, past which the fit does not explain the layer: SmolLM2's layers fit to
# ~1e-6 (fp16's rounding)
FIT_TOLERANCE = 1e-3


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal softmax attention of q [tokens, heads, dim] over k and v [tokens, KV heads, dim], GQA groups of
    consecutive query heads per KV head: [tokens, heads, dim_v]."""
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = q.transpose(1, 0, 2), np.repeat(k.transpose(1, 0, 2), group, 0), np.repeat(v.transpose(1, 0, 2),
                                                                                          group, 0)
    scores = qh @ kh.transpose(0, 2, 1) * np.float32(scale)
    return (masked_softmax(scores, np.tri(q.shape[0], dtype=bool)) @ vh).transpose(1, 0, 2)


def layer_scale(q: np.ndarray, k: np.ndarray, v: np.ndarray, output: np.ndarray, n_swa: int = 0) -> float:
    """The layer's scale: the one whose attention over q, k, v gives ``output`` [tokens, heads, dim_v] (the graph's)
    on the tokens within ``n_swa`` (0: no window), else head_dim^-0.5."""
    n = min(FIT_TOKENS, q.shape[0], n_swa or FIT_TOKENS)
    q, k, v, output = (x[:n].astype(np.float32) for x in (q, k, v, output))
    scale = fitted_scale(q, k, v, output)
    energy = max(float((output ** 2).sum()), np.finfo(np.float32).tiny)
    if float(((attention(q, k, v, scale) - output) ** 2).sum()) > FIT_TOLERANCE * energy:
        return q.shape[-1] ** -0.5
    return scale


def fitted_scale(q: np.ndarray, k: np.ndarray, v: np.ndarray, output: np.ndarray) -> float:
    """The scale whose attention over q, k, v is closest to ``output`` [tokens, heads, dim_v]."""
    def error(log_scale: float) -> float:
        return float(((attention(q, k, v, math.exp(log_scale)) - output) ** 2).sum())

    centre = -0.5 * math.log(q.shape[-1])
    lo, hi = centre - SPAN, centre + SPAN
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = error(a), error(b)
    for _ in range(STEPS):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = error(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = error(b)
    return math.exp((lo + hi) / 2.0)
