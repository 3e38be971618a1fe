"""bench/pre_rope_k.py: the study's settings are what they say, on SmolLM2's HF form (transformers loads the GGUF)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pykvq import gguf_metadata

import pre_rope_k


def test_a_window_over_every_token_reads_no_quantized_k(hamlet: Path) -> None:
    record = pre_rope_k.study_model("smollm2", hamlet, 128, [2], window=256, sinks=0)
    assert len({row["ppl"] for row in record["rows"]}) == 1


def test_quantized_k_costs_and_the_record_is_written(smollm2: Path, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    copy = tmp_path / "calibrated.gguf"
    gguf_metadata.write_copy(smollm2, copy, {gguf_metadata.KEY_WINDOW: 32, gguf_metadata.KEY_SINKS: 4,
                                             gguf_metadata.KEY_KIVI2_CLIP: "k:*=0.9", gguf_metadata.KEY_ROTATE: "on"})
    monkeypatch.setattr(pre_rope_k, "RESULTS", tmp_path)
    pre_rope_k.main(["--models", "smollm2", "--tokens", "256", "--bits", "1", "--window", "32",
                     "--recipe", f"smollm2={copy}"])
    model = json.loads((tmp_path / "pre-rope-k.json").read_text())["models"][0]
    rows = {row["setting"]: row for row in model["rows"]}
    assert rows["f16"]["delta_pct"] == 0
    assert rows["kivi1 K post-RoPE"]["ppl"] > rows["f16"]["ppl"]
    # the two quantizations differ: RoPE turns the tiles of one, not of the other
    assert rows["kivi1 K pre-RoPE"]["ppl"] != rows["kivi1 K post-RoPE"]["ppl"]
    assert (tmp_path / "pre-rope-k.png").stat().st_size > 0
    # the recipe's K: kivi2 in the copy's form (sinks, window, rotation, clip ratios), before RoPE with and without
    # the clip ratios
    assert model["recipe"] == {"gguf": "calibrated.gguf", "window": 32, "sinks": 4, "k_rotated_layers": 30,
                               "k_clip": "k:*=0.9"}
    recipe = [rows[f"kivi2 K {form}"]["ppl"] for form in ("post-RoPE, recipe", "pre-RoPE, recipe",
                                                          "pre-RoPE, recipe unclipped")]
    assert len(set(recipe)) == 3 and min(recipe) > rows["f16"]["ppl"]
    assert set(model["share_of_loss_removed"]) == {"kivi1 K pre-RoPE", "kivi2 K pre-RoPE, recipe",
                                                   "kivi2 K pre-RoPE, recipe unclipped"}


def test_the_rotation_keeps_every_score() -> None:
    import torch

    q, k = torch.randn(4, 8, 64), torch.randn(4, 8, 64)
    q_turned, k_turned = pre_rope_k.rotated(q, k)
    assert not torch.allclose(k_turned, k)
    assert torch.allclose(q_turned @ k_turned.transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-4)
