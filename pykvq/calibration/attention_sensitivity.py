"""Each layer's K and V sensitivity to its width, from the attention the f16 run computed (pykvq calibrate's default).

Measuring every tensor at two other widths with the real cache takes 4 x n_layer model runs: most of a calibration
(42 of 43 minutes on SmolLM2 on 2 cores, about an hour on a 1.5B model). The f16 run's captured Q, K and V give the
same ranking in one numpy pass: how far each layer's attention output moves, relative to its size, with its K or
its V alone at kivi4, kivi2 or kivi1 under the cache's contract (clip_ratios.LayerAttention). On SmolLM2 these
relative errors rank the measured costs of the 1-bit tensors with a Spearman correlation of 0.62 (K) and 0.82 (V);
the 4-bit gains they predict are smaller than what one measurement can resolve, as the measured ones are.

A unit of K error does not weigh like a unit of V error (on SmolLM2 the measured 1-bit costs say about twice), so
each part's errors are turned into KL divergence by one measured run: that part at kivi2 everywhere and the other at
kivi4 (a kivi K needs a kivi V; kivi4's errors are a few percent of kivi2's), whose divergence is divided among the
layers in proportion to their kivi2 errors. What the additive costs miss, the
measured refinement (pykvq.calibration.allocation.refine) corrects.

Each width gets its own clip ratio, the one of least error at that width: a ratio chosen for 2 bits over-clips at 4
(SmolLM2's K ratios down to 0.7 made some layers worse at kivi4 than at kivi2). kivi2 keeps the ratio calibrated
for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pykvq.calibration.allocation import BITS, PARTS, REFERENCE, Sensitivity
from pykvq.calibration.clip_ratios import (NO_CLIP, RATIOS, Contract, LayerAttention, LayerQkv, clip_spec_per_layer,
                                           each_layer)


@dataclass(frozen=True)
class WidthErrors:
    """One layer's K or V at each width: the attention output's relative squared error and the clip ratio taken."""

    part: str
    layer: int
    error: dict[str, float]
    clip: dict[str, float]


def width_errors(layer_qkv: LayerQkv, n_layer: int, window: int, sinks: int, kivi2_clip: dict[str, list[float]],
                 ratios: Sequence[float] | None = RATIOS,
                 progress: Callable[[], None] | None = None) -> list[WidthErrors]:
    """The K and V errors per width of every layer that keeps them (K alone in a latent layer, whose V is quantized
    with it); ``kivi2_clip`` gives each part's per-layer ratio at kivi2, the other widths take their best among
    ``ratios`` (None: kivi2's too, for clip ratios the user gave)."""
    contract = None
    out = []
    for il, captured in each_layer(layer_qkv, n_layer, progress):
        if captured is None:
            continue
        q, k, v = captured
        if contract is None:
            contract = Contract.of(q.shape[0], window, sinks)
        attention = LayerAttention(q, k, v, contract)
        # a layer whose output is all zeros moves by nothing: any width is free there
        energy = max(attention.energy, np.finfo(np.float32).tiny)
        errors = {"k": attention.k_error, "v": attention.v_error}
        for part in ("k",) if attention.latent else PARTS:
            error, clip = {}, {}
            for name, bits in BITS.items():
                candidates = (kivi2_clip[part][il],) if name == REFERENCE or ratios is None else ratios
                found = {r: errors[part](bits, r) / energy for r in candidates}
                clip[name] = min(found, key=found.__getitem__)
                error[name] = found[clip[name]]
            out.append(WidthErrors(part, il, error, clip))
    return out


def kld_scale(errors: list[WidthErrors], part: str, kld: float) -> float:
    """KL divergence per unit of ``part``'s error: ``kld`` measured with that part at kivi2 everywhere, over the
    layers' kivi2 errors; 0 where no layer reads a quantized cell (nothing to weigh)."""
    total = sum(e.error[REFERENCE] for e in errors if e.part == part)
    return kld / total if total > 0 else 0.0


def sensitivities(errors: list[WidthErrors], scale: dict[str, float]) -> list[Sensitivity]:
    """The errors as costs relative to kivi2 (what pykvq.calibration.allocation takes), each part's in KL divergence."""
    return [Sensitivity(e.part, e.layer, {name: scale[e.part] * (x - e.error[REFERENCE])
                                          for name, x in e.error.items()})
            for e in errors]


def clip_spec(errors: list[WidthErrors], types: dict[tuple[str, int], str], n_layer: int) -> str:
    """The --kv-clip spec of a mix over an ``n_layer`` model: each layer's K and V at the ratio of its width (none in
    the layers that keep no K and V)."""
    ratios: dict[str, list[float]] = {part: [NO_CLIP] * n_layer for part in PARTS}
    for e in errors:
        ratios[e.part][e.layer] = e.clip[types[e.part, e.layer]]
    return clip_spec_per_layer(ratios)
