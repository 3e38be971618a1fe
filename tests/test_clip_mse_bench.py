"""bench/clip_mse.py: the record holds upstream's rows and kivi2 under each clip, scored by the real llama-perplexity,
and its table says each run's change and time."""

from __future__ import annotations

import json
from pathlib import Path

import clip_mse
import pytest
from readme_tables import clip_mse_record_table

import device
from pykvq import assets
from pykvq.commands import perplexity
from pykvq.kv_types import KvSpec, layer_bits_per_element


def test_each_clip_is_a_run_of_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(clip_mse, "RESULTS", tmp_path)
    clip_mse.main(["--models", "smollm2", "--ctx", "256", "--chunks", "1", "-t", "2", "--sinks", "2",
                   "--ngl", str(device.NGL)])
    record = json.loads((tmp_path / "clip-mse-c256-sinks2.json").read_text())
    assert record["sinks"] == 2
    rows = record["models"][0]["rows"]
    assert [(r["kv_type"], r["clip"]) for r in rows] == [("f16", "none"), ("q4_0", "none"),
                                                          *(("kivi2", c) for c in clip_mse.CLIPS)]
    assert all(r["failure"] is None and r["ppl"] > 1 for r in rows)
    ppl = {r["clip"]: r["ppl"] for r in rows[2:]}
    assert len(set(ppl.values())) == len(clip_mse.CLIPS), "a clip that changes nothing was not applied"
    assert rows[2]["delta_pct"] == pytest.approx(100 * (rows[2]["ppl"] / rows[0]["ppl"] - 1), abs=1e-6)
    n_layer = perplexity.model_layers(assets.default_model())
    kivi2_bits = layer_bits_per_element(KvSpec.parse("kivi2"), n_layer, 256, record["window"], 2)
    assert all((r["bpe_k"], r["bpe_v"]) == pytest.approx(kivi2_bits) for r in rows[2:]), "the sinks were not priced"
    assert (tmp_path / "clip-mse-c256-sinks2.png").stat().st_size > 0


def test_the_table_shows_changes_times_collapses_and_failures() -> None:
    def run(kv_type: str, clip: str, delta: float | None, failure: str | None = None) -> dict:
        return {"kv_type": kv_type, "clip": clip, "ppl": 10.0, "delta_pct": delta, "seconds": 12.34,
                "failure": failure}

    rows = [run("f16", "none", 0.0), run("q4_0", "none", 16250.0), run("kivi2", "none", 7.571),
            run("kivi2", "v:*=mse", None, "oom\nx")]
    record = {"text": "hamlet_gut.txt", "n_ctx": 2048, "chunks": 4, "window": 128, "threads": 2,
              "models": [{"model": "m", "rows": rows}]}
    table = clip_mse_record_table(record)
    assert "| model | f16 PPL | q4_0 | kivi2 | `v:*=mse` |" in table
    assert "| m | 10.0000 | +16250% (collapsed) (12.3 s) | +7.57% (12.3 s) | failed: oom |" in table
    # a record from before --sinks had none
    assert "window 128, no sinks," in table
    assert "window 128, 4 sinks," in clip_mse_record_table({**record, "sinks": 4})
