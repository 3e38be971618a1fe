"""bench/v_reorder_rotation.py: the channel orders group what they say, and the study runs on SmolLM2 with the real
capture."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import v_reorder_rotation as study


def test_the_orders_group_channels_of_one_magnitude() -> None:
    rng = np.random.default_rng(0)
    v = rng.normal(size=(40, 2, 64)).astype(np.float32) * 0.01
    v[..., ::2] += 100.0
    perms = study.orders(v)
    assert (perms["natural"] == np.arange(64)).all()
    for order in ("mean", "rms"):
        grouped = np.take_along_axis(v, perms[order][None], axis=2)
        assert (grouped[..., :32] < 50).all() and (grouped[..., 32:] > 50).all()


def test_the_study_runs_and_writes_its_record(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(study, "RESULTS", tmp_path)
    study.main(["--models", "smollm2", "--tokens", "192", "-t", "2"])
    record = json.loads((tmp_path / "v-reorder-rotation.json").read_text())["models"][0]
    errors = record["v_error"]
    assert set(errors) == {f"{o}, {how}" for o in study.ORDERS for how in ("unrotated", "rotated")}
    assert all(0.0 < e < record["n_layer"] for e in errors.values())
    # SmolLM2's heads are one rotation block: the rotation, not the order, decides V's error
    assert errors["natural, rotated"] < errors["natural, unrotated"]
    assert (tmp_path / "v-reorder-rotation.png").stat().st_size > 0
