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


def test_samples_and_sinks_name_their_record(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(minikv, "RESULTS", tmp_path)
    minikv.main(["--prompt", "384", "--continuation", "8", "--kv-types", "kivi2", "--kv-select", "0.25,0.25",
                 "--kv-sinks", "4", "--samples", "2", "--study", "two", "-t", "2", "--ngl", str(device.NGL)])
    record = json.loads((tmp_path / "minikv-smollm2-135m-instruct-q4-1-p384-sinks4-x2-two.json").read_text())
    assert (record["samples"], record["kv_sinks"], record["study"]) == (2, 4, "two")
    plain, selected = record["rows"]
    assert plain["cells"] == 384 and selected["cells"] == 4 + 192
    sinkless = minikv.held_bytes(_Memory(), "kivi2", 100, 0)
    assert minikv.held_bytes(_Memory(), "kivi2", 100, 4) == sinkless + 4
    assert minikv.held_bytes(_Memory(), "f16", 100, 4) == 100


class _Memory:
    """held_bytes' memory: one byte per cell, whatever its kind."""

    def held_bytes(self, n_cells: int, n_fp16: int) -> int:
        return n_cells + n_fp16


def test_passages_spread_over_the_text_after_the_special_tokens() -> None:
    tokens = [1] + list(range(100, 200))
    first, middle, last = minikv.passages(tokens, [1], 11, 3)
    assert first == [1] + list(range(100, 110))
    assert middle == [1] + list(range(145, 155))
    assert last == [1] + list(range(190, 200))
    assert minikv.passages(tokens, [1], 11, 1) == [first]


def test_a_text_too_short_for_a_passage_is_refused() -> None:
    with pytest.raises(ValueError, match="fewer than 200"):
        minikv.passages(list(range(50)), [], 200, 2)


@pytest.mark.parametrize(("args", "message"), [
    (["--samples", "0"], "--continuation and --samples at least 1"),
    (["--kv-sinks", "-1"], "-1: a count of 0 or more"),
    (["--study", "Bad Name"], "lower-case letters, digits and single hyphens"),
])
def test_bad_arguments_are_refused(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        minikv.parse_args(args)
    assert message in capsys.readouterr().err
