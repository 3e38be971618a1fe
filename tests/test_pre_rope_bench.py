"""bench/pre_rope_k.py: the study's settings are what they say, on SmolLM2's HF form (transformers loads the GGUF)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import pre_rope_k  # noqa: E402


def test_a_window_over_every_token_reads_no_quantized_k(hamlet: Path) -> None:
    record = pre_rope_k.study_model("smollm2", hamlet, 128, [2], window=256, sinks=0)
    assert len({row["ppl"] for row in record["rows"]}) == 1


def test_quantized_k_costs_and_the_record_is_written(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(pre_rope_k, "RESULTS", tmp_path)
    pre_rope_k.main(["--models", "smollm2", "--tokens", "256", "--bits", "1", "--window", "32"])
    rows = {row["setting"]: row for row in json.loads((tmp_path / "pre-rope-k.json").read_text())["models"][0]["rows"]}
    assert rows["f16"]["delta_pct"] == 0
    assert rows["kivi1 K post-RoPE"]["ppl"] > rows["f16"]["ppl"]
    # the two quantizations differ: RoPE turns the tiles of one, not of the other
    assert rows["kivi1 K pre-RoPE"]["ppl"] != rows["kivi1 K post-RoPE"]["ppl"]
    assert (tmp_path / "pre-rope-k.png").stat().st_size > 0
