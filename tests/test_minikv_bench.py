"""bench/minikv.py: each setting's record says what the sequence holds and how its continuation scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import minikv

import device


def test_selected_runs_hold_their_share_and_the_record_is_written(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    monkeypatch.setattr(minikv, "RESULTS", tmp_path)
    minikv.main(["--prompt", "384", "--continuation", "8", "--kv-types", "kivi2", "--kv-select", "0.25,0.25", "-t",
                 "2", "--ngl", str(device.NGL)])
    record = json.loads((tmp_path / "minikv-smollm2-135m-instruct-q4-1-p384.json").read_text())
    plain, selected = record["rows"]
    assert plain["cells"] == 384 and selected["cells"] == 192
    assert selected["mib"] < plain["mib"] == plain["mib_without_selection"]
    assert plain["ppl_vs_unselected_pct"] == 0 and selected["ppl"] > 1
    assert (tmp_path / "minikv-smollm2-135m-instruct-q4-1-p384.png").stat().st_size > 0


def test_selection_needs_a_kivi_type_to_add_runs() -> None:
    args = minikv.parse_args(["--kv-types", "f16,q8_0", "--kv-select", "0.25,0.25"])
    assert [s.label for s in args.settings] == ["f16", "q8_0"]
