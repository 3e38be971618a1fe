"""The budget allocator (pykvq.calibration.allocation) against brute force, its spec against the C parser, and the
measured refinement against objectives where the costs do not add up."""

from __future__ import annotations

import itertools
import random

import pytest

from pykvq import kv_types
from pykvq.calibration.allocation import BITS, PARTS, Allocation, BudgetError, Sensitivity, allocate, refine


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
    with pytest.raises(ValueError, match="one sensitivity per part for each layer that keeps K and V"):
        allocate(random_sensitivities(2, random.Random(0))[:-1], 2, 2.0)


def additive(sens: list[Sensitivity]):
    def measure(allocation: Allocation) -> float:
        return sum(s.cost[allocation.types[s.part, s.layer]] for s in sens)
    return measure


@pytest.mark.parametrize("budget", [1.5, 2.0, 2.75])
def test_refinement_keeps_the_optimum_when_the_costs_add_up(budget: float) -> None:
    sens = random_sensitivities(4, random.Random(3))
    start = allocate(sens, 4, budget)
    calls = []
    result = refine(start, sens, budget, lambda a: calls.append(a) or additive(sens)(a), max_evaluations=10)
    assert result.allocation.types == start.types and result.measured == pytest.approx(start.predicted_cost)
    assert result.evaluations == len(calls) == 10  # kivi2 -> kivi4 paid by two downs: always a candidate left


@pytest.mark.parametrize("seed", range(4))
def test_refinement_finds_what_the_interactions_hide(seed: int) -> None:
    """K of layers 0 and 1 at 1 bit together cost far more than apart (an interaction the additive costs miss):
    the additive optimum takes both to 1 bit, the measured steps move one of them up within the budget."""
    rng = random.Random(seed)
    sens = [Sensitivity(p, il, {"kivi4": 0.0, "kivi2": 0.1 + rng.uniform(0, 0.05),
                                "kivi1": (0.2 if (p, il) in (("k", 0), ("k", 1)) else 1.0) + rng.uniform(0, 0.1)})
            for p in PARTS for il in range(4)]

    def measure(allocation: Allocation) -> float:
        both_low = allocation.types["k", 0] == allocation.types["k", 1] == "kivi1"
        return additive(sens)(allocation) + (5.0 if both_low else 0.0)

    start = allocate(sens, 4, 1.75)
    assert start.types["k", 0] == start.types["k", 1] == "kivi1"
    result = refine(start, sens, 1.75, measure, max_evaluations=40)
    assert result.start_measured == pytest.approx(measure(start))
    assert result.measured == pytest.approx(measure(result.allocation)) and result.measured < result.start_measured - 4
    assert result.allocation.mean_bits <= 1.75
    assert result.evaluations <= 40


def test_refinement_stops_at_its_measurement_count() -> None:
    sens = random_sensitivities(6, random.Random(1))
    calls = []
    refine(allocate(sens, 6, 2.0), sens, 2.0, lambda a: calls.append(a) or float(len(calls) % 3), max_evaluations=7)
    assert len(calls) == 7 and len({tuple(sorted(a.types.items())) for a in calls}) == 7


def test_refinement_moves_a_collective_loss_to_another_depth() -> None:
    """1-bit V costs a little less in the lower layers one at a time, but three or more of them at 1 bit cost far
    more together (SmolLM2's pass key): no one-tensor step undoes that, a block move does."""
    rng = random.Random(5)
    n_layer = 8
    sens = [Sensitivity(p, il, {"kivi4": -0.05, "kivi2": 0.0,
                                "kivi1": (1.0 if p == "k" else 0.1 if il < 4 else 0.2) + rng.uniform(0, 0.01)})
            for p in PARTS for il in range(n_layer)]

    def lower_v_low(allocation: Allocation) -> int:
        return sum(allocation.types["v", il] == "kivi1" for il in range(4))

    def measure(allocation: Allocation) -> float:
        return additive(sens)(allocation) + (5.0 if lower_v_low(allocation) >= 3 else 0.0)

    start = allocate(sens, n_layer, 1.75)
    assert lower_v_low(start) == 4
    result = refine(start, sens, 1.75, measure, max_evaluations=12)
    assert lower_v_low(result.allocation) <= 2 and result.measured < result.start_measured - 4
    assert result.allocation.mean_bits <= 1.75


@pytest.mark.parametrize("seed", range(3))
def test_k_alone_is_allocated_where_the_cache_holds_no_v(seed: int) -> None:
    """Multi-head latent attention: the cache keeps K's tiles alone (V is read from them), so the budget is K's
    code bits, V keeps the reference type in the spec, and the refinement moves K only."""
    sens = [s for s in random_sensitivities(4, random.Random(seed)) if s.part == "k"]
    allocation = allocate(sens, 4, 2.5)
    assert set(allocation.types) == {("k", il) for il in range(4)}
    assert allocation.mean_bits <= 2.5 and allocation.predicted_cost == pytest.approx(brute_force(sens, 2.5))
    assert allocation.spec().endswith(";v:0-3=kivi2")
    result = refine(allocation, sens, 2.5, additive(sens), max_evaluations=12)
    assert set(result.allocation.types) == set(allocation.types) and result.allocation.mean_bits <= 2.5
