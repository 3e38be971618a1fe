"""The calibrated V dither (pykvq.calibration.dither_choice): which layers a spread reaches, and the choice by cost.
The measurement itself (the real cache's KL divergence) runs in tests/test_calibrate.py."""

from __future__ import annotations

from pykvq.calibration.dither_choice import SPREADS, choose_dither, dither_spec


def test_a_spread_reaches_the_one_and_two_bit_v_layers_only() -> None:
    types_v = ["kivi1", "kivi1", "kivi4", "kivi2", "q8_0", "kivi2"]
    assert dither_spec(types_v, 1.0) == "v:0-1=1,2=0,3=1,4=0,5=1"
    assert dither_spec(types_v, 0.5) == "v:0-1=0.5,2=0,3=0.5,4=0,5=0.5"
    assert dither_spec(types_v, 0.0) == "none"
    assert dither_spec(["kivi4", "f16"], 1.0) == "none"


def test_the_lowest_cost_wins_and_a_tie_keeps_the_smaller_spread() -> None:
    types_v = ["kivi1", "kivi2"]
    costs = {"none": 0.30, "v:0-1=0.5": 0.20, "v:0-1=1": 0.25}
    measured: list[str] = []

    def measure(spec: str) -> float:
        measured.append(spec)
        return costs[spec]

    choice = choose_dither(types_v, measure)
    assert choice.chosen == "v:0-1=0.5" and choice.costs == costs and len(measured) == len(SPREADS)
    assert choose_dither(types_v, lambda spec: 0.1).chosen == "none"


def test_a_mix_without_low_bit_v_is_measured_once() -> None:
    measured: list[str] = []
    choice = choose_dither(["kivi4", "kivi4"], lambda spec: measured.append(spec) or 0.0)
    assert choice.chosen == "none" and measured == ["none"]
