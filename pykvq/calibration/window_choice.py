"""The kivi window (recent tokens kept in fp16) as a calibrated choice, weighed against the memory it takes.

A longer window always measures better, so the choice needs a price: at the context the model will run (the
target context), a window of W tokens takes fp16 cells that the same memory could spend on code bits everywhere
instead. The exchange rate is measured: the KL divergence that kivi4 everywhere saves against kivi2 everywhere,
per bit per element that it costs. Each candidate window scores its own KL divergence (kivi2 everywhere) plus
that rate times its bits per element at the target context; the lowest score wins, the shorter window on a tie.

A short calibration text would overstate what a window gains: with W near the text's length most of its tokens
read their whole context in fp16. So the divergences that choose a window are taken over the tokens that lie past
every candidate window (and a tile): each of those reads, beyond the window, the same band of quantized tokens it
would read in a long context, and what a longer window spares is that band's error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pykvq import kv_types
from pykvq.calibration.attention_sensitivity import REFERENCE

CANDIDATES = (32, 64, 128, 256)
# the calibration's reference width everywhere is priced against two bits per element more of code
CHEAPER = REFERENCE
DEARER = "kivi4"


@dataclass(frozen=True)
class WindowChoice:
    """Each candidate window's KL divergence (kivi2 everywhere, over the tokens past every candidate), its bits per
    element at the target context, and the measured KL divergence a bit per element buys."""

    target_ctx: int
    klds: dict[int, float]
    bits: dict[int, float]
    kld_per_bit: float

    def score(self, window: int) -> float:
        return self.klds[window] + self.kld_per_bit * self.bits[window]

    @property
    def chosen(self) -> int:
        return min(self.klds, key=lambda w: (self.score(w), w))


def scored_from(weights: np.ndarray, first: int) -> np.ndarray:
    """The probe's token weights with the tokens before ``first`` left out, renormalised (ValueError when none
    remain)."""
    out = np.where(np.arange(len(weights)) >= first, weights, 0.0)
    total = out.sum()
    if total <= 0.0:
        raise ValueError(f"no calibration token lies past the longest window candidate ({first} tokens): raise -c")
    return out / total


def kld_per_bit(kld_cheaper: float, kld_dearer: float, window: int, sinks: int, target_ctx: int) -> float:
    """What a bit per element of code is worth: the divergence kivi4 everywhere saves against kivi2 everywhere,
    per the bits per element it costs at the target context; 0 when the wider codes measured no better."""
    bits = (kv_types.bits_per_element(DEARER, target_ctx, window, sinks)
            - kv_types.bits_per_element(CHEAPER, target_ctx, window, sinks))
    return max(kld_cheaper - kld_dearer, 0.0) / bits


def window_bits(candidates: Sequence[int], sinks: int, target_ctx: int) -> dict[int, float]:
    """Bits per element of kivi2 at the target context with each window, sinks and scales included."""
    return {w: kv_types.bits_per_element(CHEAPER, target_ctx, w, sinks) for w in candidates}
