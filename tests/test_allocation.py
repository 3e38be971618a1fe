"""The budget allocator (pykvq.allocation) against brute force, and its spec against the C parser."""

from __future__ import annotations

import itertools
import random

import pytest

from pykvq import kv_types
from pykvq.allocation import BITS, PARTS, BudgetError, Sensitivity, allocate


def random_sensitivities(n_layer: int, rng: random.Random) -> list[Sensitivity]:
    out = []
    for part in PARTS:
        for layer in range(n_layer):
            two = rng.uniform(0, 1)
            out.append(Sensitivity(part, layer, {"kivi4": 0.0, "kivi2": two, "kivi1": two + rng.uniform(0, 5)}))
    return out


def brute_force(sens: list[Sensitivity], budget: float) -> float:
    best = float("inf")
    for combo in itertools.product(BITS, repeat=len(sens)):
        if sum(BITS[c] for c in combo) <= budget * len(sens) + 1e-9:
            best = min(best, sum(s.cost[c] for s, c in zip(sens, combo, strict=True)))
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1.0, 1.5, 2.0, 2.75, 4.0])
def test_allocation_is_optimal_and_within_budget(seed: int, budget: float) -> None:
    sens = random_sensitivities(3, random.Random(seed))
    allocation = allocate(sens, 3, budget)
    assert allocation.mean_bits <= budget + 1e-9
    assert allocation.predicted_cost == pytest.approx(brute_force(sens, budget))
    assert allocation.predicted_cost == pytest.approx(sum(s.cost[allocation.types[s.part, s.layer]] for s in sens))


def test_the_spec_is_what_the_cache_would_resolve() -> None:
    sens = random_sensitivities(12, random.Random(7))
    allocation = allocate(sens, 12, 2.0)
    types_k, types_v = kv_types.layer_types(allocation.spec(), 12, "kivi2", "kivi2")
    names = {"k": types_k, "v": types_v}
    assert all(names[part][layer] == name for (part, layer), name in allocation.types.items())


def test_sensitive_tensors_get_the_bits() -> None:
    # K of layer 0 breaks the model below 4 bits; everything else is cheap at 1 bit
    sens = [Sensitivity(p, il, {"kivi4": 0.0, "kivi2": 10.0 if (p, il) == ("k", 0) else 0.01,
                                "kivi1": 100.0 if (p, il) == ("k", 0) else 0.02}) for p in PARTS for il in range(4)]
    allocation = allocate(sens, 4, 1.5)
    assert allocation.types["k", 0] == "kivi4"
    # 12 bits for 8 tensors: 4 for K0, and the one left over lifts one cheap tensor to 2 bits
    assert allocation.mean_bits == 1.5
    assert allocation.predicted_cost == pytest.approx(6 * 0.02 + 0.01)


def test_impossible_budget_is_refused() -> None:
    with pytest.raises(BudgetError, match="below what any mix reaches"):
        allocate(random_sensitivities(2, random.Random(0)), 2, 0.9)


def test_missing_sensitivities_are_refused() -> None:
    with pytest.raises(ValueError, match="one sensitivity per layer and part"):
        allocate(random_sensitivities(2, random.Random(0))[:-1], 2, 2.0)
