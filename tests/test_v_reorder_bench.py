"""bench/v_reorder.py: a channel order groups what it says and leaves the values where they were, and the study
runs on SmolLM2's HF form (transformers loads the GGUF)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import v_reorder

from pykvq.convert.kv_calibration import fake_quantize


def test_an_order_quantizes_its_groups_and_returns_the_natural_order() -> None:
    # two KV heads, channels of two magnitudes interleaved: sorted by mean, each group of 32 holds one magnitude
    v = torch.randn(2, 40, 64) * 0.01
    v[..., ::2] += 100.0
    stats = v_reorder.ChannelStats()
    stats.add(0, v)
    perm = stats.permutations(40, "mean")[0]
    assert (v[0, 0, perm[0, :32]] < 50).all() and (v[0, 0, perm[0, 32:]] > 50).all()
    reordered = v_reorder.quantize_in_order(v, 2, perm)
    assert torch.equal(v_reorder.quantize_in_order(v, 2, None), fake_quantize(v, 2, dim=2))
    # grouped by magnitude the small channels keep their own fine step
    assert (reordered - v).abs().max() < 0.05 < (fake_quantize(v, 2, dim=2) - v).abs().max()


def test_the_study_runs_and_writes_its_record(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(v_reorder, "RESULTS", tmp_path)
    v_reorder.main(["--models", "smollm2", "--tokens", "160", "--bits", "1", "--window", "16"])
    rows = {r["setting"]: r for r in json.loads((tmp_path / "v-reorder.json").read_text())["models"][0]["rows"]}
    assert set(rows) == {"f16", *(f"kivi1 V, {order} order" for order in v_reorder.ORDERS)}
    assert rows["kivi1 V, natural order"]["ppl"] > rows["f16"]["ppl"]
    assert (tmp_path / "v-reorder.png").stat().st_size > 0
