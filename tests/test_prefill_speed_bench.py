"""bench/prefill_speed.py: the batch-size sweep that places LLAMA_KVQ_FA_PREFILL's threshold. Each kivi row runs with
the path it names forced for every batch, each batch size reaches llama-batched-bench, ratios are to f16 at the same
depth and batch size, and the crossover is the smallest batch from which flash attention stays ahead; the README's
table renders sweeps and older records alike. One tiny sweep runs the real tool on the dev model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import readme_tables

import decode_speed
import prefill_speed

FUSED, FLASH = prefill_speed.PATHS["fused"], prefill_speed.PATHS["flash"]


def row(kv_type: str, ubatch: int, path: str, tps: float | None, depth: int = 4096) -> dict:
    return {"kv_type": kv_type, "depth": depth, "ubatch": ubatch, "prefill_path": path, "prefill_tps": tps}


def sweep(kv_type: str, fused: list[float | None], flash: list[float | None]) -> list[dict]:
    ubatches = (8, 16, 32, 64)
    return ([row("f16", u, "-", 100.0) for u in ubatches]
            + [row(kv_type, u, "fused", t) for u, t in zip(ubatches, fused, strict=True)]
            + [row(kv_type, u, "flash", t) for u, t in zip(ubatches, flash, strict=True)])


@pytest.mark.parametrize(("fused", "flash", "want"), [
    ([50, 60, 70, 80], [10, 40, 75, 120], 32),     # crosses once
    ([50, 60, 70, 80], [60, 70, 80, 90], 8),       # ahead everywhere
    ([50, 60, 70, 80], [10, 20, 30, 40], None),    # never
    ([50, 60, 70, 80], [60, 50, 80, 90], 32),      # ahead at 8, behind at 16: from where it stays ahead
    ([50, 60, 70, 80], [10, 70, 80, None], None),  # the largest batch failed: nothing to stand on
    ([50, 60, 70, 80], [10, 60, 71, 81], 16),      # a tie counts as ahead
])
def test_the_crossover_is_where_flash_stays_ahead(fused, flash, want) -> None:
    assert prefill_speed.flash_from(sweep("kivi2", fused, flash)) == [
        {"kv_type": "kivi2", "depth": 4096, "flash_from_ubatch": want}]


def test_each_row_forces_its_path_and_batch_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def fake_measure(model, spec, depth, tg, npl, threads, ngl, ubatch):
        seen.append((spec.label, depth, ubatch, os.environ.get(prefill_speed.ENV)))
        # flash pays off from 64 tokens per batch in this made-up machine
        flash = os.environ.get(prefill_speed.ENV) == FLASH
        rate = (10.0 if ubatch >= 64 else 4.0) * ubatch if flash else 5.0 * ubatch
        return {"kv_type": spec.label, "depth": depth, "tg": tg, "npl": npl, "prefill_tps": rate, "decode_tps": 1.0}

    monkeypatch.setattr(prefill_speed, "measure_once", fake_measure)
    monkeypatch.setattr(prefill_speed, "resolve_model", lambda model, workdir: (tmp_path / "m.gguf", "m.gguf"))
    monkeypatch.setattr(prefill_speed, "RESULTS", tmp_path)
    monkeypatch.setenv(prefill_speed.ENV, "7")
    prefill_speed.main(["--depth", "256", "--ubatch", "32", "64", "--kv-types", "f16,kivi2", "-t", "2",
                        "--repeat", "2"])
    one_round = [("f16", 256, 32, None), ("kivi2", 256, 32, FUSED), ("kivi2", 256, 32, FLASH),
                 ("f16", 256, 64, None), ("kivi2", 256, 64, FUSED), ("kivi2", 256, 64, FLASH)]
    assert seen == one_round * 2
    assert prefill_speed.ENV not in os.environ  # the user's setting does not leak into the rows or what follows
    record = json.loads((tmp_path / "prefill-speed-cpu-256-ub32-64.json").read_text())
    assert [(r["ubatch"], r["prefill_path"], r["prefill_vs_f16"]) for r in record["rows"]] == [
        (32, "-", 1.0), (32, "fused", 1.0), (32, "flash", 0.8), (64, "-", 1.0), (64, "fused", 1.0), (64, "flash", 2.0)]
    assert record["flash_from"] == [{"kv_type": "kivi2", "depth": 256, "flash_from_ubatch": 64}]
    table = readme_tables.prefill_table(tmp_path / "prefill-speed-cpu-256-ub32-64.json")
    assert "| 256 | 64 | kivi2 | flash | 640.0 | 2.00 |" in table
    assert "from ubatch: kivi2 at 256: 64." in table


def test_a_record_from_before_the_sweep_reads_as_ubatch_512(tmp_path: Path) -> None:
    f16 = {"kv_type": "f16", "depth": 2048, "prefill_path": "-", "prefill_tps": 150.0, "prefill_vs_f16": 1.0}
    old = {"machine": "x", "model": "m", "ngl": 0, "repeat": 1, "rows": [f16]}
    path = tmp_path / "prefill-speed-cpu-2048.json"
    path.write_text(json.dumps(old))
    table = readme_tables.prefill_table(path)
    assert "| 2048 | 512 | f16 | - | 150.0 | 1.00 |" in table and "from ubatch" not in table


def test_bad_sizes_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        prefill_speed.main(["--ubatch", "0"])
    assert exc.value.code == 2 and "token counts of 1 or more" in capsys.readouterr().err


@pytest.mark.parametrize("bench", [prefill_speed, decode_speed], ids=["prefill", "decode"])
def test_no_rounds_are_refused(bench, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--repeat", "0"])
    assert exc.value.code == 2 and "rounds of 1 or more" in capsys.readouterr().err


def test_a_tiny_real_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-batched-bench itself on the dev model: every batch size and path gives a rate."""
    monkeypatch.setattr(prefill_speed, "RESULTS", tmp_path)
    prefill_speed.main(["--depth", "128", "--ubatch", "32", "128", "--kv-types", "f16,kivi2", "--repeat", "1",
                        "-t", "2"])
    record = json.loads(next(tmp_path.glob("prefill-speed-cpu-128-ub32-128.json")).read_text())
    assert len(record["rows"]) == 6 and all(r["prefill_tps"] > 0 for r in record["rows"])
    assert {f["kv_type"] for f in record["flash_from"]} == {"kivi2"}


def test_rows_are_measured_in_rounds_and_keep_their_best_rates() -> None:
    """A slow spell (here the second round) falls on every row alike, and each row keeps its fastest run."""
    calls = []

    def once(setting: str) -> dict:
        calls.append(setting)
        slow = 2 < len(calls) <= 4
        return {"kv_type": setting, "prefill_tps": 50.0 if slow else 100.0 + len(calls),
                "decode_tps": None if setting == "b" else 10.0 * len(calls)}

    rows = decode_speed.best_of_rounds(["a", "b"], 3, once)
    assert calls == ["a", "b"] * 3
    assert rows == [{"kv_type": "a", "prefill_tps": 105.0, "decode_tps": 50.0},
                    {"kv_type": "b", "prefill_tps": 106.0, "decode_tps": None}]
