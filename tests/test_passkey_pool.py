"""bench/passkey_pool.py: pooled pass-key runs count every run's keys, pair each type's answers with f16's on the
same prompts, and refuse runs that cannot pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scipy.stats import binomtest

import device
import passkey
import passkey_pool
import readme_tables

MIX = "kivi2"


def answers(seed: int, f16: list[bool], mix: list[bool], model: str = "m.gguf") -> dict:
    """A record as bench/passkey.py writes it: one length, one depth, a key per answer pair."""
    keys = [str(10000 * (seed + 1) + i) for i in range(len(f16))]
    rows = [{"kv_type": kv_type, "length": 256, "depth": 50, "key": key, "answer": "", "correct": ok, "p_key": 0.5,
             "margin": 0.1}
            for kv_type, found in (("f16", f16), (MIX, mix)) for key, ok in zip(keys, found, strict=True)]
    return {"model": model, "lengths": [256], "depths": [50], "trials": len(f16), "seed": seed, "ngl": 0,
            "kv_sinks": None, "kv_rotate": None, "kv_clip": None, "kv_dither": None, "filler": None,
            "kv_types": ["f16", MIX], "rows": rows}


@pytest.mark.parametrize(("only_reference", "only_other"), [(1, 0), (0, 3), (5, 0), (2, 7), (10, 1), (6, 6)])
def test_the_p_value_is_the_exact_binomial_test_of_the_discordant_keys(only_reference: int, only_other: int) -> None:
    expected = binomtest(only_reference, only_reference + only_other, 0.5).pvalue
    assert passkey_pool.mcnemar_p(only_reference, only_other) == pytest.approx(expected, rel=1e-12)


def test_no_discordant_key_is_no_evidence_either_way() -> None:
    assert passkey_pool.mcnemar_p(0, 0) == 1.0


def test_the_pool_counts_every_run_s_keys_and_pairs_them_within_a_run() -> None:
    first = answers(0, [True, True], [True, False])
    second = answers(1, [True, False, True, True], [True, True, True, True])
    record = passkey_pool.pool([first, second], ["a.json", "b.json"])
    assert record["trials"] == 6 and record["seeds"] == [0, 1]
    f16, mix = record["summary"]
    assert f16["accuracy"] == pytest.approx(5 / 6) and mix["accuracy"] == pytest.approx(5 / 6)
    # f16 misses a key at this cell, so no cell is one the model always gets right
    assert mix["below_f16"] == []
    assert mix["paired"] == {"only_f16": 1, "only_type": 1, "p_value": 1.0}


def test_a_cell_f16_always_gets_right_is_judged_over_the_pool() -> None:
    record = passkey_pool.pool([answers(0, [True] * 3, [True] * 3), answers(1, [True] * 5, [False] * 5)],
                               ["a.json", "b.json"])
    mix = record["summary"][1]
    assert mix["accuracy"] == pytest.approx(3 / 8) and mix["below_f16"] == ["256@50%"]
    assert mix["paired"] == {"only_f16": 5, "only_type": 0, "p_value": pytest.approx(2 / 32)}


@pytest.mark.parametrize(("second", "message"), [
    (answers(1, [True], [True], model="other.gguf"), "b.json: its model 'other.gguf' differs from a.json's 'm.gguf'"),
    (answers(0, [True], [True]), "b.json and a.json are both seed 0"),
    ({**answers(1, [True], [True]), "kv_dither": "0.5"}, "b.json: its kv_dither '0.5' differs"),
    ({"rows": []}, "b.json: not a record of bench/passkey.py"),
    ([1, 2], "b.json: not a record of bench/passkey.py"),
])
def test_runs_that_cannot_pool_are_refused_and_nothing_is_written(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                  second: object, message: str) -> None:
    monkeypatch.setattr(passkey_pool, "RESULTS", tmp_path / "results")
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    paths[0].write_text(json.dumps(answers(0, [True], [True])))
    paths[1].write_text(json.dumps(second))
    with pytest.raises(SystemExit, match=message):
        passkey_pool.main([str(p) for p in paths])
    assert not (tmp_path / "results").exists()


def test_a_file_that_is_not_json_is_a_clear_error(tmp_path: Path) -> None:
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    paths[0].write_text(json.dumps(answers(0, [True], [True])))
    paths[1].write_text("not json")
    with pytest.raises(SystemExit, match="error: Expecting value"):
        passkey_pool.main([str(p) for p in paths])


def test_one_record_is_not_a_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        passkey_pool.parse_args([str(tmp_path / "a.json")])
    assert "pooling needs two records or more" in capsys.readouterr().err


def test_two_real_runs_pool_into_a_record_with_its_table(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    sources = []
    for seed in (0, 1):
        monkeypatch.setattr(passkey, "RESULTS", tmp_path / f"seed{seed}")
        passkey.main(["--lengths", "256", "--depths", "100", "--trials", "1", "--kv-types", "f16,q8_0", "-t", "2",
                      "--seed", str(seed), "--ngl", str(device.NGL)])
        sources += list((tmp_path / f"seed{seed}").glob("passkey-*.json"))
    monkeypatch.setattr(passkey_pool, "RESULTS", tmp_path)
    passkey_pool.main([str(p) for p in sources] + ["--study", "q8"])
    path = tmp_path / "passkey-smollm2-135m-instruct-q4-1-256-pooled-seeds-0-1-q8.json"
    record = json.loads(path.read_text())
    assert record["trials"] == 2 and len(record["rows"]) == 4 and path.with_suffix(".png").stat().st_size > 0
    f16_keys = [r["key"] for r in record["rows"] if r["kv_type"] == "f16"]
    assert f16_keys == [r["key"] for r in record["rows"] if r["kv_type"] == "q8_0"] and len(set(f16_keys)) == 2
    table = readme_tables.passkey_table(path)
    assert "2 keys each, bench/passkey_pool.py --study q8 over seeds 0, 1)" in table
    only_f16, only_q8 = record["summary"][1]["paired"]["only_f16"], record["summary"][1]["paired"]["only_type"]
    assert "| q8_0 | " in table and f" {only_f16} / {only_q8} (" in table
