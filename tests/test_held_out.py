"""The refined mix checked against kivi2 everywhere on held-out text (pykvq.calibration.held_out,
pykvq.commands.calibrate.checked_mix), and the clip choice against each part's runner-up on the same text
(checked_clip), with scripted divergences: no model runs. tests/test_calibrate.py runs it on
a real model."""

from __future__ import annotations

import argparse

import pytest

from pykvq.calibration import held_out
from pykvq.calibration.allocation import Allocation, Refinement
from pykvq.calibration.clip_choice import ClipChoice
from pykvq.calibration.held_out import HeldOutCheck
from pykvq.calibration.mix_cost import MixCost
from pykvq import KvConfig
from pykvq.commands import calibrate as calibrate_command

N_LAYER = 2
PROBE = calibrate_command.Probe(128, 16, 0, 1, recall=16)   # its text: the first 112 tokens
EVERYWHERE = {(p, il): "kivi2" for p in "kv" for il in range(N_LAYER)}
MIX = {**EVERYWHERE, ("k", 0): "kivi4", ("v", 1): "kivi1"}


class ScriptedHeldOut(calibrate_command.Calibrator):
    """A Calibrator whose held-out divergences are given: the mix's and kivi2 everywhere's."""

    def __init__(self, mix: float, everywhere: float) -> None:
        self.model = argparse.Namespace(n_layer=N_LAYER)
        self.probe = PROBE
        self.klds = {Allocation(MIX, N_LAYER, 0.0).spec(): mix, Allocation(EVERYWHERE, N_LAYER, 0.0).spec(): everywhere}
        self.stretches: list[list[int]] = []

    def held_out_mix_klds(self, stretches: list[list[int]], mixes: list[dict[tuple[str, int], str]],
                          widths: object) -> list[float]:
        self.stretches = stretches
        return [self.klds[Allocation(types, N_LAYER, 0.0).spec()] for types in mixes]


def refinement(types: dict[tuple[str, int], str], prose_limit: float | None = 0.01) -> Refinement[MixCost]:
    cost = MixCost(0.008, 0.01, None, prose_limit)
    return Refinement(Allocation(types, N_LAYER, 0.0), cost, cost, 25)


TEXT = list(range(10_000))


def test_stretches_are_whole_consecutive_and_at_most_the_chunks() -> None:
    text = list(range(100))
    assert held_out.stretches(text, 10, 20) == [text[10:30], text[30:50], text[50:70], text[70:90]]
    assert held_out.stretches(text, 10, 30) == [text[10:40], text[40:70], text[70:100]]
    assert held_out.stretches(text, 10, 20, chunks=2) == [text[10:30], text[30:50]]
    assert held_out.stretches(text, 80, 30) == []


def test_kivi2_everywhere_is_taken_where_the_mix_is_higher_on_the_held_out_text(
        capsys: pytest.CaptureFixture[str]) -> None:
    calibrator = ScriptedHeldOut(mix=0.0125, everywhere=0.0115)
    allocation, check = calibrate_command.checked_mix(calibrator, TEXT, refinement(MIX), [])
    assert allocation.types == EVERYWHERE
    assert check == HeldOutCheck(4 * 128, 0.0125, 0.0115) and not check.keeps_mix
    assert "kivi2 everywhere taken instead" in capsys.readouterr().out
    # the stretches follow the probe's text, never the tokens the choices were made on
    assert calibrator.stretches == [TEXT[112 + i * 128:112 + (i + 1) * 128] for i in range(held_out.CHUNKS)]


@pytest.mark.parametrize("mix", [0.0100, 0.0115])
def test_the_mix_is_kept_where_it_is_within_kivi2_everywhere(mix: float, capsys: pytest.CaptureFixture[str]) -> None:
    allocation, check = calibrate_command.checked_mix(ScriptedHeldOut(mix, 0.0115), TEXT, refinement(MIX), [])
    assert allocation.types == MIX and check is not None and check.keeps_mix
    assert "-> the mix kept" in capsys.readouterr().out


def test_a_text_ending_before_a_stretch_leaves_the_mix_unchecked(capsys: pytest.CaptureFixture[str]) -> None:
    calibrator = ScriptedHeldOut(0.0125, 0.0115)
    allocation, check = calibrate_command.checked_mix(calibrator, TEXT[:200], refinement(MIX), [])
    assert allocation.types == MIX and check is None and calibrator.stretches == []
    assert "not checked on held-out text" in capsys.readouterr().out


@pytest.mark.parametrize("types, prose_limit", [(MIX, None), (EVERYWHERE, 0.01)])
def test_no_check_runs_without_kivi2_everywhere_to_fall_back_on_or_when_it_is_the_mix(
        types: dict[tuple[str, int], str], prose_limit: float | None) -> None:
    calibrator = ScriptedHeldOut(0.0125, 0.0115)
    allocation, check = calibrate_command.checked_mix(calibrator, TEXT, refinement(types, prose_limit), [])
    assert allocation.types == types and check is None and calibrator.stretches == []


class ScriptedClip(ScriptedHeldOut):
    """A Calibrator whose held-out divergence of kivi2 everywhere under a clip spec is given."""

    def __init__(self, klds: dict[str, float]) -> None:
        super().__init__(0.0, 0.0)
        self.clip_klds = klds

    def held_out_klds(self, stretches: list[list[int]], kvs: list[KvConfig], desc: str) -> list[float]:
        self.stretches = stretches
        assert all(kv.layers == "none" for kv in kvs)
        return [self.clip_klds[kv.clip] for kv in kvs]


CLIP = ClipChoice({"k": [0.95] * N_LAYER, "v": [1.0] * N_LAYER}, {"k": [0.9, 0.8], "v": [1.0, 0.9]}, [],
                  {"k": [0.9, 0.8]})


def test_the_clip_choice_is_held_out_on_the_mix_s_stretches(capsys: pytest.CaptureFixture[str]) -> None:
    calibrator = ScriptedClip({"k:0-1=0.95": 0.0443, "k:0=0.9,1=0.8": 0.0395})
    assert calibrate_command.checked_clip(calibrator, TEXT, CLIP) == {"k": [0.9, 0.8], "v": [1.0] * N_LAYER}
    assert calibrator.stretches == [TEXT[112 + i * 128:112 + (i + 1) * 128] for i in range(held_out.CHUNKS)]
    assert capsys.readouterr().out == (
        "each part's clip choice against its runner-up on 512 held-out tokens of the text (after the probe's), KL "
        "divergence against f16 KV: K 0.95: 0.0443, per-layer: 0.0395 -> --kv-clip 'k:0=0.9,1=0.8'\n")


def test_a_text_ending_before_a_stretch_leaves_the_clip_choice_as_the_probe_made_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    calibrator = ScriptedClip({})
    assert calibrate_command.checked_clip(calibrator, TEXT[:200], CLIP) == CLIP.chosen
    assert "the clip choice is not checked on held-out text" in capsys.readouterr().out
