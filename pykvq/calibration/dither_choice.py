"""V's dithered rounding as a calibrated choice (the cache's --kv-dither).

Rounded to nearest, identical tokens get identical V codes and so identical errors, which add up where attention
spreads over repeated content; dithered rounding decorrelates them at the price of a larger error per value (twice
nearest's mean squared error at spread 1). Which wins depends on the model and on how much its attention reads
repeated content, so the finished mix is measured, by the calibration's own KL divergence (its recall span repeats
the text), with its 1- and 2-bit V layers at each candidate spread; the lowest wins, the smaller spread on a tie.
4-bit V keeps nearest rounding: its step is small enough that the errors barely add up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic

from pykvq import kv_types
from pykvq.calibration.allocation import BITS, CostT

SPREADS = (0.0, 0.5, 1.0)
# the widest V code that is dithered
DITHERED_BITS = 2


def dither_spec(types_v: list[str], spread: float) -> str:
    """The --kv-dither spec of `spread` on the layers whose V is at most DITHERED_BITS wide ("none" for 0)."""
    per_layer = [f"{spread:g}" if BITS.get(t, 16) <= DITHERED_BITS else "0" for t in types_v]
    return kv_types.per_layer_spec({"v": per_layer}, "0")


@dataclass(frozen=True)
class DitherChoice(Generic[CostT]):
    """Each candidate spec's measured cost, and the one chosen."""

    costs: dict[str, CostT]
    chosen: str


def choose_dither(types_v: list[str], measure: Callable[[str], CostT],
                  progress: Callable[[], object] | None = None) -> DitherChoice[CostT]:
    """The candidate spreads' specs for a mix's V types, each measured; ties keep the earlier (smaller) spread."""
    costs: dict[str, CostT] = {}
    for spread in SPREADS:
        spec = dither_spec(types_v, spread)
        if spec not in costs:
            costs[spec] = measure(spec)
        if progress is not None:
            progress()
    return DitherChoice(costs, min(costs, key=costs.__getitem__))
