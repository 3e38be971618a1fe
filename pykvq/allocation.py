"""Per-layer K/V bit widths for a memory budget, from measured sensitivities (AsymKV's open question).

Each layer's K and V can be kivi4, kivi2 or kivi1. A measured sensitivity says how much the model's output
distribution (KL divergence against f16 KV) changes when that one tensor moves from the reference width to
another (pykvq calibrate: from kivi2 everywhere, one tensor up to 4 or down to 1 bit; a gain is a negative
cost); the allocation treats these costs as additive and picks, exactly (a knapsack over whole bits), the
widths with the least total cost whose mean code bits per element stay within the budget. Every kivi type
carries the same per-block scale and minimum (one extra bit per element), so equal code bits mean equal memory.
"""

from __future__ import annotations

from dataclasses import dataclass

BITS = {"kivi4": 4, "kivi2": 2, "kivi1": 1}
PARTS = ("k", "v")


class BudgetError(ValueError):
    """A budget no mix of kivi4/kivi2/kivi1 can meet."""


@dataclass(frozen=True)
class Sensitivity:
    """KL divergence one layer's K or V adds at each width, relative to the reference width (which costs 0)."""

    part: str
    layer: int
    cost: dict[str, float]


@dataclass(frozen=True)
class Allocation:
    types: dict[tuple[str, int], str]   # (part, layer) -> kivi type
    n_layer: int
    predicted_cost: float

    @property
    def mean_bits(self) -> float:
        return sum(BITS[t] for t in self.types.values()) / len(self.types)

    def spec(self) -> str:
        """The --kv-layers form, consecutive layers of one type joined into ranges."""
        return ";".join(f"{part}:" + ",".join(self._ranges(part)) for part in PARTS)

    def _ranges(self, part: str) -> list[str]:
        out, start = [], 0
        for il in range(1, self.n_layer + 1):
            if il == self.n_layer or self.types[part, il] != self.types[part, start]:
                span = str(start) if il - 1 == start else f"{start}-{il - 1}"
                out.append(f"{span}={self.types[part, start]}")
                start = il
        return out


def allocate(sensitivities: list[Sensitivity], n_layer: int, budget_bits: float) -> Allocation:
    """The least-cost widths with mean code bits per element <= ``budget_bits`` (K and V weigh alike)."""
    items = sorted(sensitivities, key=lambda s: (s.part, s.layer))
    if sorted((s.part, s.layer) for s in items) != [(p, il) for p in PARTS for il in range(n_layer)]:
        raise ValueError(f"need one sensitivity per layer and part for {n_layer} layers")
    lowest, highest = min(BITS.values()), max(BITS.values())
    if budget_bits < lowest:
        raise BudgetError(f"a budget of {budget_bits:g} bits per element is below what any mix reaches "
                          f"({lowest} bit: kivi1 everywhere)")
    capacity = min(int(budget_bits * len(items) + 1e-9), highest * len(items))
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


def format_allocation(allocation: Allocation) -> str:
    lines = [f"{'layer':>5}  K      V"]
    for il in range(allocation.n_layer):
        lines.append(f"{il:>5}  {allocation.types['k', il]:<6} {allocation.types['v', il]}")
    return "\n".join(lines)
