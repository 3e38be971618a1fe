"""bench/scale_format.py: e4m3 rounding goes the asked way, a group's stored range still covers it, and the study
runs on SmolLM2's HF form (transformers loads the GGUF)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import scale_format

from pykvq.convert.kv_calibration import fake_quantize


def test_e4m3_rounding_goes_the_asked_way_to_representable_values() -> None:
    x = torch.linspace(-440.0, 440.0, 10001)
    table = scale_format.e4m3_values()
    for up in (True, False):
        rounded = scale_format.e4m3_round(x, up=up)
        assert torch.isin(rounded, table).all()
        assert ((rounded >= x) if up else (rounded <= x)).all()
    assert torch.equal(scale_format.e4m3_round(table, up=True), table)
    assert torch.equal(scale_format.e4m3_round(table, up=False), table)


@pytest.mark.parametrize("zero", [True, False], ids=["e4m3", "e4m3-step"])
def test_a_group_stored_in_e4m3_still_covers_its_range(zero: bool) -> None:
    # groups far from zero with small spreads (K's outlier channels) and around it
    low = torch.cat([torch.randn(500) * 100, torch.randn(500)])
    step = torch.rand(1000) * 2 + 1e-3
    unit = 2.0  # a power of two, as large as a tensor of these would have (its largest |value| / 448)
    stored_low, stored_step = scale_format.E4m3Scales(unit, 2, zero=zero)(low, step)
    if zero:
        assert torch.isin(stored_low / unit, scale_format.e4m3_values()).all() and (stored_low <= low).all()
    else:
        assert torch.equal(stored_low, low.half().float())
    assert torch.isin(stored_step / unit, scale_format.e4m3_values()).all()
    # the stored range reaches the group's top: nothing is clamped beyond half a stored step
    assert (stored_low + 3 * stored_step >= low + 3 * step - 1e-4).all()


def test_e4m3_scales_change_the_dequantized_values() -> None:
    x = torch.randn(2, 96, 64) * 3 + torch.randn(64) * 40
    part = scale_format.Part(2, "e4m3")
    assert not torch.equal(part.quantize(x, dim=1), fake_quantize(x, 2, dim=1))
    assert torch.equal(scale_format.Part(2).quantize(x, dim=1), fake_quantize(x, 2, dim=1))


def test_the_study_runs_and_writes_its_record(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(scale_format, "RESULTS", tmp_path)
    scale_format.main(["--models", "smollm2", "--tokens", "160", "--window", "16"])
    record = json.loads((tmp_path / "scale-format.json").read_text())
    rows = {r["setting"]: r for r in record["models"][0]["rows"]}
    assert set(rows) == {s.label for s in scale_format.SETTINGS}
    assert rows["K kivi2 e4m3, V kivi2 e4m3"]["bpe"] == 2.5 == rows["K kivi2, V kivi1"]["bpe"]
    assert rows["K kivi2, V kivi2"]["ppl"] > rows["f16"]["ppl"]
    assert (tmp_path / "scale-format.png").stat().st_size > 0
