"""Per-layer K/V bit widths for a memory budget, from measured sensitivities (AsymKV's open question).

Each layer's K and V can be kivi4, kivi2 or kivi1. A measured sensitivity says how much the model's output
distribution (KL divergence against f16 KV) changes when that one tensor moves from the reference width to
another (pykvq calibrate: from kivi2 everywhere, one tensor up to 4 or down to 1 bit; a gain is a negative
cost); the allocation treats these costs as additive and picks, exactly (a knapsack over whole bits), the
widths with the least total cost whose mean code bits per element stay within the budget. Every kivi type
carries the same per-block scale and minimum (one extra bit per element), so equal code bits mean equal memory.

Far from the reference the costs stop adding up (layers interact), so ``refine`` then walks from that mix by
measured steps: it tries the moves the additive costs rank best (one tensor a width up or down, or one up and
another down within the budget), measures each candidate mix as a whole, and takes the first that measures
better, until none of the ranked candidates does or the measurements run out. Some losses are collective (on
SmolLM2, 1-bit V in the lower layers loses a pass key that 1-bit V in as many upper layers keeps, while no single
layer's 1-bit V does), which no one-tensor step sees: each round first tries the block moves, a part's tensors of
one depth block a width up and as many of another block's a width down.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

BITS = {"kivi4": 4, "kivi2": 2, "kivi1": 1}
PARTS = ("k", "v")
# the width every calibration starts from; also the spec's type for a layer the cache does not hold (a hybrid's
# recurrent layer, a layer reading an earlier layer's cache), where any type reads alike
REFERENCE = "kivi2"


class BudgetError(ValueError):
    """A budget no mix of kivi4/kivi2/kivi1 can meet."""


def budget_argument(text: str) -> float:
    """The argparse type of --kv-budget (calibrate and convert): a finite number of bits, refused as the arguments
    are read; inf and nan would otherwise fail only after the measurements, the one in the allocation's arithmetic,
    the other at the metadata's check."""
    try:
        bits = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of bits (such as 2 or 2.5)") from None
    if not math.isfinite(bits):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of bits: give one such as 2 or 2.5")
    return bits


@dataclass(frozen=True)
class Sensitivity:
    """KL divergence one layer's K or V adds at each width, relative to the reference width (which costs 0)."""

    part: str
    layer: int
    cost: dict[str, float]


@dataclass(frozen=True)
class Allocation:
    types: dict[tuple[str, int], str]   # (part, layer) -> kivi type, for the layers that keep K and V
    n_layer: int                        # the model's, which the spec covers
    predicted_cost: float

    @property
    def layers(self) -> list[int]:
        return sorted({il for _, il in self.types})

    @property
    def mean_bits(self) -> float:
        return sum(BITS[t] for t in self.types.values()) / len(self.types)

    def spec(self) -> str:
        """The --kv-layers form, consecutive layers of one type joined into ranges."""
        return ";".join(f"{part}:" + ",".join(self._ranges(part)) for part in PARTS)

    def _ranges(self, part: str) -> list[str]:
        def type_of(il: int) -> str:
            return self.types.get((part, il), REFERENCE)

        out, start = [], 0
        for il in range(1, self.n_layer + 1):
            if il == self.n_layer or type_of(il) != type_of(start):
                span = str(start) if il - 1 == start else f"{start}-{il - 1}"
                out.append(f"{span}={type_of(start)}")
                start = il
        return out


def _capacity(budget_bits: float, n_items: int) -> int:
    """The code bits a budget allows ``n_items`` tensors, at most all of them at the widest width."""
    return min(int(budget_bits * n_items + 1e-9), max(BITS.values()) * n_items)


def allocate(sensitivities: list[Sensitivity], n_layer: int, budget_bits: float) -> Allocation:
    """The least-cost widths with mean code bits per element <= ``budget_bits`` (K and V weigh alike), for the
    layers of an ``n_layer`` model that the sensitivities cover (those that keep K and V) and the parts they name
    (K alone under multi-head latent attention, where the cache holds no V)."""
    items = sorted(sensitivities, key=lambda s: (s.part, s.layer))
    layers = sorted({s.layer for s in items})
    parts = sorted({s.part for s in items})
    if [(s.part, s.layer) for s in items] != [(p, il) for p in parts for il in layers] or layers[-1:] >= [n_layer]:
        raise ValueError(f"need one sensitivity per part for each layer that keeps K and V, of {n_layer} layers")
    lowest = min(BITS.values())
    if budget_bits < lowest:
        raise BudgetError(f"a budget of {budget_bits:g} bits per element is below what any mix reaches "
                          f"({lowest} bit: kivi1 everywhere)")
    capacity = _capacity(budget_bits, len(items))
    # best[b]: least cost with b bits spent so far; choice[i][b]: the type item i took on that path
    inf = float("inf")
    best = [0.0] + [inf] * capacity
    choices: list[list[str | None]] = []
    for item in items:
        nxt = [inf] * (capacity + 1)
        took: list[str | None] = [None] * (capacity + 1)
        for spent, cost in enumerate(best):
            if cost == inf:
                continue
            for name, bits in BITS.items():
                total = spent + bits
                if total <= capacity and cost + item.cost[name] < nxt[total]:
                    nxt[total] = cost + item.cost[name]
                    took[total] = name
        best = nxt
        choices.append(took)
    spent = min(range(capacity + 1), key=lambda b: best[b])
    predicted = best[spent]
    types: dict[tuple[str, int], str] = {}
    for item, took in zip(reversed(items), reversed(choices), strict=True):
        name = took[spent]
        assert name is not None
        types[item.part, item.layer] = name
        spent -= BITS[name]
    return Allocation(types, n_layer, predicted)


class Cost(Protocol):
    """A measured cost: lower is better (a float, or calibrate's MixCost)."""

    def __lt__(self, other: Any, /) -> bool: ...


CostT = TypeVar("CostT", bound=Cost)


@dataclass(frozen=True)
class Refinement(Generic[CostT]):
    allocation: Allocation
    measured: CostT         # the refined mix's measured cost
    start_measured: CostT   # the start's
    evaluations: int        # mixes measured, the start included


Move = dict[tuple[str, int], str]  # (part, layer) -> its new type
PAIRED_DOWNS = 12  # the cheapest tensors to lower that pairs of downs are drawn from


def _neighbour(name: str, by: int) -> str | None:
    """The width ``by`` steps up (down when negative) from ``name``, None past the ends."""
    order = sorted(BITS, key=BITS.get)
    at = order.index(name) + by
    return order[at] if 0 <= at < len(order) else None


def _moves(types: dict[tuple[str, int], str], capacity: int,
           cheapest_downs: list[tuple[tuple[str, int], str]]) -> list[Move]:
    """One tensor a width up or down, or one up and one or two others down, keeping the code bits within capacity
    (kivi2 -> kivi4 takes two bits: two tensors down a bit each pay for it). Pairs of downs come from
    ``cheapest_downs`` only: (tensor, its next width down), those whose step down costs least."""
    spent = sum(BITS[t] for t in types.values())

    def step(key: tuple[str, int], by: int) -> tuple[tuple[str, int], str] | None:
        name = _neighbour(types[key], by)
        return None if name is None else (key, name)

    def extra(move: Move) -> int:
        return sum(BITS[t] - BITS[types[key]] for key, t in move.items())

    ups = [s for s in (step(key, 1) for key in types) if s is not None]
    downs = [s for s in (step(key, -1) for key in types) if s is not None]
    moves: list[Move] = [dict([d]) for d in downs] + [dict([u]) for u in ups if spent + extra(dict([u])) <= capacity]
    for up in ups:
        moves += [m for m in (dict([up, down]) for down in downs if down[0] != up[0]) if spent + extra(m) <= capacity]
        for i, first in enumerate(cheapest_downs):
            for second in cheapest_downs[i + 1:]:
                move = dict([up, first, second])
                if len(move) == 3 and spent + extra(move) <= capacity:
                    moves.append(move)
    return moves


DEPTH_BLOCKS = 4  # the depth ranges block moves trade between


def _depth_blocks(layers: list[int]) -> list[list[int]]:
    """The layers cut into DEPTH_BLOCKS runs in depth order (fewer when there are fewer layers)."""
    n = min(DEPTH_BLOCKS, len(layers))
    edges = [round(i * len(layers) / n) for i in range(n + 1)]
    return [layers[edges[i]:edges[i + 1]] for i in range(n)]


def _block_moves(types: dict[tuple[str, int], str], layers: list[int],
                 predicted: Callable[[Move], float]) -> list[Move]:
    """Per part and pair of adjacent widths, every tensor of one depth block at the lower width up to the higher,
    and as many tensors of another block at the higher width (those whose step down costs least) down: the same
    code bits, spent at another depth."""
    moves: list[Move] = []
    blocks = _depth_blocks(layers)
    for part in sorted({part for part, _ in types}):
        for lower, higher in ((name, _neighbour(name, 1)) for name in BITS):
            if higher is None:
                continue
            for raised in blocks:
                ups = [((part, il), higher) for il in raised if types[part, il] == lower]
                if not ups:
                    continue
                for lowered in blocks:
                    if lowered == raised:
                        continue
                    downs = sorted((((part, il), lower) for il in lowered if types[part, il] == higher),
                                   key=lambda down: predicted(dict([down])))
                    if len(downs) >= len(ups):
                        moves.append(dict(ups + downs[:len(ups)]))
    return moves


def refine(start: Allocation, sensitivities: list[Sensitivity], budget_bits: float,
           measure: Callable[[Allocation], CostT], max_evaluations: int,
           on_measure: Callable[[], None] = lambda: None) -> Refinement[CostT]:
    """Measured steps from ``start`` (see the module's docstring); ``measure`` gives a mix's cost as a whole."""
    cost = {(s.part, s.layer): s.cost for s in sensitivities}
    capacity = _capacity(budget_bits, len(start.types))

    def predicted(types: dict[tuple[str, int], str], move: Move) -> float:
        return sum(cost[key][t] - cost[key][types[key]] for key, t in move.items())

    current, best = start, measure(start)
    start_measured, evaluations = best, 1
    on_measure()
    seen = {tuple(sorted(start.types.items()))}
    improved = True
    while improved and evaluations < max_evaluations:
        improved = False
        types = current.types
        downs = [(key, name) for key, name in ((key, _neighbour(t, -1)) for key, t in types.items()) if name]
        cheapest = sorted(downs, key=lambda down: predicted(types, dict([down])))[:PAIRED_DOWNS]
        ranked = partial(predicted, types)
        blocks = sorted(_block_moves(types, start.layers, ranked), key=ranked)
        for move in blocks + sorted(_moves(types, capacity, cheapest), key=ranked):
            mix = {**types, **move}
            key = tuple(sorted(mix.items()))
            if key in seen:
                continue
            if evaluations >= max_evaluations:
                break
            seen.add(key)
            candidate = Allocation(mix, start.n_layer, current.predicted_cost + predicted(types, move))
            measured = measure(candidate)
            evaluations += 1
            on_measure()
            if measured < best:
                current, best, improved = candidate, measured, True
                break
    return Refinement(current, best, start_measured, evaluations)


def format_allocation(allocation: Allocation) -> str:
    """A table of the layers' K and V types ("-" where the cache holds no V: multi-head latent attention)."""
    lines = [f"{'layer':>5}  K      V"]
    for il in allocation.layers:
        lines.append(f"{il:>5}  {allocation.types['k', il]:<6} {allocation.types.get(('v', il), '-')}")
    return "\n".join(lines)
