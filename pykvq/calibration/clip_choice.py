"""kivi2's clip ratios as pykvq calibrate keeps them: each part's candidates measured by the real cache.

The per-layer ratios of least attention-output error (clip_ratios) are judged per layer with the other part in
fp16; as a whole, one part's ratios can help the model while the other's hurt it. On Qwen2.5-Coder-1.5B, K's
per-layer ratios lower the probe's KL divergence on both the text and the recall span, V's raise it on the span
(0.0130 against 0.0083 unclipped), and a choice between "both parts per layer" and "one ratio per part" kept the
one that costs two points of perplexity on another text (README, the Qwen recipe). So each part chooses on its
own: V first with K unclipped, then K with V's choice in place, among unclipped, one ratio for every layer (tried
from 1 down until one measures worse than the best ratio so far: the divergence falls as clipping spares the
groups' bulk a coarser step, then rises as it cuts their extremes) and the per-layer ratios. The lowest measured
wins; a tie keeps the earlier candidate, unclipped first. V also tries mse in every layer: each group's range of least
squared error, searched as each block is quantized (on plain kivi2 it lowered Hamlet's PPL on all three dev models;
on SmolLM2 more than any one V ratio from 0.95 to 0.75). The two interact: on SmolLM2, V at 0.95 measured worse
than unclipped V with K unclipped, better with K at 0.95 (and Hamlet's PPL agreed: +3.32% for K alone, +2.66% for
both), so the parts take turns, each with the other's latest choice in place, until a turn changes nothing (a later
turn changes a part only for a strictly lower divergence), at most MAX_TURNS.

The probe is short, and its close calls can go either way: on Gemma 3 270M, with V searched, K at 0.95 in every layer
measured 0.0425 against 0.0433 for K's per-layer ratios, while Hamlet's perplexity put them at +5.11% and +3.33%, and
2048 held-out tokens of the calibration text at 0.0443 and 0.0395. So each part's choice is then held against its
runner-up (the best other candidate of its last turn) on held-out text (check_held_out): V's first, with K's choice
in place, then K's with V's final one; the runner-up takes over only where it measures strictly lower there.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pykvq import kv_types
from pykvq.calibration.clip_ratios import RATIOS, clip_spec_per_layer

PER_LAYER = "per-layer"
ORDER = ("v", "k")
# the parts that also try each group's range of least squared error (mse) in every layer: V's per-token groups,
# whose squared error is what the attention output sees; K's per-channel tiles lost by it on two of the three dev
# models (SmolLM2 +21% -> +30%, Qwen2.5-Coder +8% -> +28% on Hamlet)
SEARCHED = ("v",)
# V, K, V again, K again: each turn after the first two costs a few runs, most of them measured already
MAX_TURNS = 4

Ratios = dict[str, list[float]]


@dataclass(frozen=True)
class ClipChoice:
    """Each part's ratios per layer, the per-layer candidate, and every turn's divergences in the order measured:
    (part, candidate -> KL divergence), where a candidate is one ratio for every layer ("1": unclipped, "mse":
    searched per group) or PER_LAYER."""

    chosen: Ratios
    per_layer: Ratios
    turns: list[tuple[str, dict[str, float]]]
    # per part, the best candidate of its last turn other than its choice (none where it had no other)
    runners_up: Ratios = field(default_factory=dict)

    @property
    def spec(self) -> str:
        return clip_spec_per_layer(self.chosen)

    @property
    def per_layer_spec(self) -> str:
        return clip_spec_per_layer(self.per_layer)

    @staticmethod
    def label(values: list[float]) -> str:
        """A candidate as the turns name it (per-layer ratios that are all one are measured as that one)."""
        return kv_types.clip_text(values[0]) if len(set(values)) == 1 else PER_LAYER


@dataclass(frozen=True)
class HeldOutClip:
    """The clip choice after its held-out check: each part's ratios, and per part checked its choice's and its
    runner-up's KL divergence on the held-out text (choice first)."""

    chosen: Ratios
    klds: list[tuple[str, dict[str, float]]]

    @property
    def spec(self) -> str:
        return clip_spec_per_layer(self.chosen)


def _part_candidates(measure: Callable[[list[float]], float], n_layer: int, per_layer: list[float],
                     ratios: Sequence[float], searched: bool) -> dict[str, tuple[list[float], float]]:
    """One part's candidates, each with its ratios and measured divergence, in the order they were measured."""
    out: dict[str, tuple[list[float], float]] = {}
    for r in ratios:
        values = [r] * n_layer
        label = kv_types.clip_text(r)
        out[label] = (values, measure(values))
        if out[label][1] > min(kld for _, kld in out.values()):
            break
    if searched:
        values = [kv_types.CLIP_MSE] * n_layer
        out[kv_types.CLIP_MSE_NAME] = (values, measure(values))
    if all(values != per_layer for values, _ in out.values()):
        out[PER_LAYER] = (per_layer, measure(per_layer))
    return out


def choose_clip(measure: Callable[[Ratios], float], per_layer: Ratios, ratios: Sequence[float] = RATIOS,
                progress: Callable[[], None] | None = None, parts: Sequence[str] = ORDER) -> ClipChoice:
    """The ratios per part of least measured divergence, the parts taking turns (see the module); ``measure`` takes
    both parts' ratios, ``ratios`` start at 1 (unclipped) and fall; only ``parts`` are chosen, the others stay
    unclipped (V under multi-head latent attention, which has no V rows of its own)."""
    n_layer = len(per_layer["k"])
    chosen: Ratios = {part: [1.0] * n_layer for part in per_layer}
    turns: list[tuple[str, dict[str, float]]] = []
    runners_up: dict[str, list[float] | None] = {}
    # a turn's first candidate (unclipped) or the part's current choice is often measured already
    memo: dict[tuple[tuple[float, ...], ...], float] = {}

    def measured(part: str, values: list[float]) -> float:
        ratios = {**chosen, part: values}
        key = tuple(tuple(ratios[p]) for p in ORDER)
        if key not in memo:
            memo[key] = measure(ratios)
            if progress is not None:
                progress()
        return memo[key]

    order = [p for p in ORDER if p in parts]
    unchanged = 0  # turns in a row that kept their part's choice
    while len(turns) < MAX_TURNS and (len(turns) < len(order) or unchanged < len(order) - 1):
        part = order[len(turns) % len(order)]
        candidates = _part_candidates(lambda values, p=part: measured(p, values), n_layer, per_layer[part], ratios,
                                      part in SEARCHED)
        best = min(candidates, key=lambda label: candidates[label][1])
        if candidates[best][1] < measured(part, chosen[part]):
            chosen[part] = candidates[best][0]
            unchanged = 0
        else:
            unchanged += 1
        turns.append((part, {label: kld for label, (_, kld) in candidates.items()}))
        others = [(kld, values) for values, kld in candidates.values() if values != chosen[part]]
        runners_up[part] = min(others, key=lambda other: other[0])[1] if others else None
    return ClipChoice(chosen, per_layer, turns, {p: v for p, v in runners_up.items() if v is not None})


def check_held_out(choice: ClipChoice, measure_all: Callable[[list[Ratios]], list[float]]) -> HeldOutClip:
    """Each part's choice against its runner-up on held-out text, in the turns' order, each with the earlier parts'
    final choice in place; ``measure_all`` takes every combination of choices and runners-up at once (one pass over
    the held-out text, its f16 reference computed once)."""
    parts = [p for p in ORDER if p in choice.runners_up]
    picks = list(itertools.product((False, True), repeat=len(parts)))
    klds = dict(zip(picks, measure_all([{**choice.chosen, **{p: choice.runners_up[p] for p, take in
                                                            zip(parts, pick, strict=True) if take}}
                                        for pick in picks]), strict=True))
    taken = [False] * len(parts)
    out: list[tuple[str, dict[str, float]]] = []
    for i, part in enumerate(parts):
        mine, theirs = klds[tuple(taken)], klds[(*taken[:i], True, *taken[i + 1:])]
        out.append((part, {ClipChoice.label(choice.chosen[part]): mine,
                           ClipChoice.label(choice.runners_up[part]): theirs}))
        taken[i] = theirs < mine
    chosen = {**choice.chosen, **{p: choice.runners_up[p] for p, take in zip(parts, taken, strict=True) if take}}
    return HeldOutClip(chosen, out)
