"""pykvq.calibration.clip_choice: each part's clip ratios kept by a measured divergence, on scripted divergences."""

from __future__ import annotations

import pytest

from pykvq.calibration.clip_choice import MAX_TURNS, PER_LAYER, ClipChoice, check_held_out, choose_clip
from pykvq.kv_types import CLIP_MSE, CLIP_MSE_NAME
from pykvq.calibration.clip_ratios import RATIOS

N_LAYER = 3
# per-layer ratios of least attention-output error, as clip_ratios would give them
PER_LAYER_RATIOS = {"k": [1.0, 0.85, 0.9], "v": [0.8, 0.75, 0.8]}


def scripted(kld_of, calls: list | None = None, mse_gain: float = -1.0):  # noqa: ANN001, ANN201
    """Measures by ``kld_of``; V searched per group (mse) measures as unclipped V less ``mse_gain`` (by default
    worse than anything)."""
    def measure(ratios: dict[str, list[float]]) -> float:
        if calls is not None:
            calls.append({part: list(values) for part, values in ratios.items()})
        if ratios["v"] == [CLIP_MSE] * N_LAYER:
            return kld_of({**ratios, "v": [1.0] * N_LAYER}) - mse_gain
        return kld_of(ratios)
    return measure


def first_turn(choice: ClipChoice, part: str) -> dict[str, float]:
    return next(klds for p, klds in choice.turns if p == part)


def test_each_part_keeps_its_own_best_candidate() -> None:
    """The Qwen case: K's per-layer ratios help, V's hurt, one ratio for V helps a little. Choosing between "both
    per layer" and "one ratio per part" would lose one of the two; per part, both gains are kept."""
    def kld(ratios: dict[str, list[float]]) -> float:
        k_gain = 0.004 if ratios["k"] == PER_LAYER_RATIOS["k"] else 0.0
        v = ratios["v"]
        v_cost = 0.005 if v == PER_LAYER_RATIOS["v"] else 0.01 * (v[0] - 0.9) ** 2 if len(set(v)) == 1 else 0.0
        return 0.010 - k_gain + v_cost

    choice = choose_clip(scripted(kld), PER_LAYER_RATIOS)
    assert choice.chosen == {"k": PER_LAYER_RATIOS["k"], "v": [0.9] * N_LAYER}
    assert choice.spec == "k:0=1,1=0.85,2=0.9;v:0-2=0.9"
    k_klds, v_klds = first_turn(choice, "k"), first_turn(choice, "v")
    assert min(k_klds, key=k_klds.__getitem__) == PER_LAYER
    assert v_klds[PER_LAYER] > v_klds["1"]


def test_v_is_chosen_first_with_k_unclipped_then_k_with_v_in_place() -> None:
    calls: list[dict[str, list[float]]] = []
    choice = choose_clip(scripted(lambda r: abs(r["v"][0] - 0.9) + abs(r["k"][0] - 0.95), calls), PER_LAYER_RATIOS)
    v_calls = [c for c in calls if c["k"] == [1.0] * N_LAYER]
    assert calls[:len(v_calls)] == v_calls
    k_calls = calls[len(v_calls):len(v_calls) + len(choice.turns[1][1]) - 1]  # its unclipped candidate: V's choice
    assert all(c["v"] == [0.9] * N_LAYER for c in k_calls)
    # V again with K's choice in place changes nothing: done
    assert [part for part, _ in choice.turns] == ["v", "k", "v"]
    assert all(c["k"] == [0.95] * N_LAYER for c in calls[len(v_calls) + len(k_calls):])
    assert choice.chosen == {"k": [0.95] * N_LAYER, "v": [0.9] * N_LAYER}


def test_a_part_is_chosen_again_with_the_other_s_choice_in_place() -> None:
    """SmolLM2's case: V at 0.95 measures worse than unclipped while K is unclipped, better once K is at 0.95; one
    turn per part kept V unclipped."""
    def kld(ratios: dict[str, list[float]]) -> float:
        k, v = ratios["k"][0], ratios["v"][0]
        clipped_v_cost = 0.004 if k == 1.0 else -0.008
        return 0.0955 - (0.002 if k == 0.95 else 0.0) + (clipped_v_cost if v == 0.95 else 0.0) + \
            (0.05 if min(k, v) < 0.95 or ratios["v"] == PER_LAYER_RATIOS["v"] else 0.0)

    choice = choose_clip(scripted(kld), PER_LAYER_RATIOS)
    assert choice.chosen == {"k": [0.95] * N_LAYER, "v": [0.95] * N_LAYER}
    assert choice.spec == "k:0-2=0.95;v:0-2=0.95"
    assert [part for part, _ in choice.turns] == ["v", "k", "v", "k"]


def test_the_turns_end_at_their_cap_and_a_later_tie_keeps_the_current_choice() -> None:
    # the lower the better, within 0.05 of each other: each turn takes its part a step below the other's
    choice = choose_clip(scripted(lambda r: r["k"][0] + r["v"][0] + (abs(r["k"][0] - r["v"][0]) > 0.051)),
                         PER_LAYER_RATIOS)
    assert len(choice.turns) == MAX_TURNS
    assert choice.chosen == {"k": [0.8] * N_LAYER, "v": [0.85] * N_LAYER}
    calls: list[dict[str, list[float]]] = []
    # V at 0.95 ties unclipped once K is clipped: V keeps its unclipped choice
    tie = choose_clip(scripted(lambda r: 0.1 - (0.01 if r["k"][0] == 0.95 else 0.0)
                               + (0.01 if r["v"][0] < 1.0 and r["k"][0] == 1.0 else 0.0)
                               + (0.05 if min(r["k"][0], r["v"][0]) < 0.95 else 0.0), calls), PER_LAYER_RATIOS)
    assert tie.chosen == {"k": [0.95] * N_LAYER, "v": [1.0] * N_LAYER}
    assert [part for part, _ in tie.turns] == ["v", "k", "v"]


def test_the_ratio_search_stops_past_the_best_and_ties_stay_unclipped() -> None:
    choice = choose_clip(scripted(lambda r: (r["k"][-1] - 0.8) ** 2 + (r["v"][-1] - 0.85) ** 2), PER_LAYER_RATIOS)
    # each part stops at the first ratio that measures worse than the best so far; per-layer measured last
    assert list(first_turn(choice, "v")) == ["1", "0.95", "0.9", "0.85", "0.8", CLIP_MSE_NAME, PER_LAYER]
    assert list(first_turn(choice, "k")) == ["1", "0.95", "0.9", "0.85", "0.8", "0.75", PER_LAYER]
    assert choice.chosen == {"k": [0.8] * N_LAYER, "v": [0.85] * N_LAYER}
    flat = choose_clip(scripted(lambda r: 0.5), PER_LAYER_RATIOS)
    # nothing measures worse, so every ratio is measured, and unclipped stays
    assert flat.spec == "none" and list(first_turn(flat, "v")) == [f"{r:g}" for r in RATIOS] + [CLIP_MSE_NAME,
                                                                                                 PER_LAYER]


def test_v_also_tries_each_group_s_range_of_least_squared_error_and_k_does_not() -> None:
    """mse in every layer is one more candidate of V's, kept where it measures lowest; K's tiles never try it."""
    calls: list[dict[str, list[float]]] = []
    choice = choose_clip(scripted(lambda r: 0.01 + (r["k"][0] - 0.9) ** 2 + (r["v"][0] - 0.9) ** 2, calls, 0.02),
                         PER_LAYER_RATIOS)
    assert choice.chosen == {"k": [0.9] * N_LAYER, "v": [CLIP_MSE] * N_LAYER}
    assert choice.spec == "k:0-2=0.9;v:0-2=mse"
    assert all(CLIP_MSE_NAME in klds for part, klds in choice.turns if part == "v")
    assert all(CLIP_MSE_NAME not in klds for part, klds in choice.turns if part == "k")
    assert not any(CLIP_MSE in c["k"] for c in calls)


def test_per_layer_ratios_already_measured_as_one_ratio_are_not_measured_again() -> None:
    calls: list[dict[str, list[float]]] = []
    uniform = {"k": [1.0] * N_LAYER, "v": [0.95] * N_LAYER}
    choice = choose_clip(scripted(lambda r: r["v"][0], calls), uniform)
    assert all(PER_LAYER not in klds for _, klds in choice.turns)
    assert len(calls) == len({str(c) for c in calls})


def test_the_specs_spell_the_chosen_and_the_per_layer_ratios() -> None:
    choice = ClipChoice({"k": [1.0, 1.0], "v": [0.9, 0.9]}, {"k": [0.9, 1.0], "v": [1.0, 1.0]}, [])
    assert choice.spec == "v:0-1=0.9"
    assert choice.per_layer_spec == "k:0=0.9,1=1"


def test_each_part_s_runner_up_is_the_best_other_candidate_of_its_last_turn() -> None:
    """Gemma 3's case: with V searched, K at 0.95 beats K's per-layer ratios on the probe by a hair."""
    def kld(ratios: dict[str, list[float]]) -> float:
        k = 0.0433 if ratios["k"] == PER_LAYER_RATIOS["k"] else {1.0: 0.0532, 0.95: 0.0425}.get(ratios["k"][0], 0.0466)
        return k + (0.0 if ratios["v"] == [CLIP_MSE] * N_LAYER else 0.01 + 0.001 * (1 - ratios["v"][0]))

    choice = choose_clip(kld, PER_LAYER_RATIOS)
    assert choice.chosen == {"k": [0.95] * N_LAYER, "v": [CLIP_MSE] * N_LAYER}
    assert choice.runners_up["k"] == PER_LAYER_RATIOS["k"]
    # V's last turn: unclipped (0.0425 + 0.01) is the best of what is not mse
    assert choice.runners_up["v"] == [1.0] * N_LAYER


def held_out(kld_of, calls: list):  # noqa: ANN001, ANN201
    def measure_all(candidates: list[dict[str, list[float]]]) -> list[float]:
        calls.append(candidates)
        return [kld_of(c) for c in candidates]
    return measure_all


def test_the_held_out_text_turns_a_close_call_and_keeps_the_rest() -> None:
    per_layer_k = PER_LAYER_RATIOS["k"]
    choice = ClipChoice({"k": [0.95] * N_LAYER, "v": [CLIP_MSE] * N_LAYER}, PER_LAYER_RATIOS, [],
                        {"k": per_layer_k, "v": [1.0] * N_LAYER})
    calls: list = []
    # K's per-layer ratios win on held-out text, V's unclipped runner-up loses there
    checked = check_held_out(choice, held_out(lambda r: 0.0443 - 0.0048 * (r["k"] == per_layer_k)
                                              + 0.01 * (r["v"] == [1.0] * N_LAYER), calls))
    assert checked.chosen == {"k": per_layer_k, "v": [CLIP_MSE] * N_LAYER}
    assert checked.spec == "k:0=1,1=0.85,2=0.9;v:0-2=mse"
    assert checked.klds == [("v", {CLIP_MSE_NAME: 0.0443, "1": 0.0543}),
                            ("k", {"0.95": 0.0443, PER_LAYER: pytest.approx(0.0395)})]
    # one pass over the held-out text: every combination of choice and runner-up measured at once
    assert len(calls) == 1 and len(calls[0]) == 4


def test_k_is_held_out_with_v_s_final_choice_in_place_and_a_tie_keeps_the_probe_s() -> None:
    choice = ClipChoice({"k": [0.95] * N_LAYER, "v": [0.9] * N_LAYER}, PER_LAYER_RATIOS, [],
                        {"k": [1.0] * N_LAYER, "v": [0.95] * N_LAYER})
    # V's runner-up wins; with it, K unclipped ties K at 0.95 (and would win with V's choice)
    checked = check_held_out(choice, held_out(lambda r: 0.01 - 0.002 * (r["v"][0] == 0.95)
                                              - 0.001 * (r["k"][0] == 1.0 and r["v"][0] == 0.9), []))
    assert checked.chosen == {"k": [0.95] * N_LAYER, "v": [0.95] * N_LAYER}
    assert [part for part, _ in checked.klds] == ["v", "k"]
    assert checked.klds[1][1] == {"0.95": 0.008, "1": 0.008}


def test_a_part_without_a_runner_up_is_not_held_out() -> None:
    """Multi-head latent attention chooses K alone; V has no candidates."""
    choice = ClipChoice({"k": [0.9] * N_LAYER, "v": [1.0] * N_LAYER}, PER_LAYER_RATIOS, [], {"k": [1.0] * N_LAYER})
    calls: list = []
    checked = check_held_out(choice, held_out(lambda r: r["k"][0], calls))
    assert checked.chosen == choice.chosen and [part for part, _ in checked.klds] == ["k"]
    assert calls == [[choice.chosen, {**choice.chosen, "k": [1.0] * N_LAYER}]]
