"""bench/skvq_clip.py: the calibrated ratios and orders are chosen where they belong, and the study runs on
SmolLM2's HF form (transformers loads the GGUF)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import skvq_clip  # noqa: E402


def layer_qkv(n_tokens: int = 160, seed: int = 0):
    """Two KV heads of 64 channels; in head 1's first V group two channels carry rare spikes of opposite sign (a
    group that clipping pays for), the other groups hold only -1 and 1, which kivi2's end codes hold exactly (groups
    that any clipping hurts)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((4, n_tokens, 64)).astype(np.float32)
    k = rng.standard_normal((2, n_tokens, 64)).astype(np.float32)
    v = rng.choice([-1.0, 1.0], (2, n_tokens, 64)).astype(np.float32)
    v[1, :, :32] = rng.standard_normal((n_tokens, 32))
    v[1, ::7, 5], v[1, ::7, 6] = 12.0, -12.0
    return (torch.from_numpy(a) for a in (q, k, v))


def test_each_v_group_gets_its_own_ratio() -> None:
    q, k, v = layer_qkv()
    study = skvq_clip.StudyAttention(window=16, sinks=0)
    ratios = study.calibrate(q, k, v, 64 ** -0.5, study.attention(q, k, v, 64 ** -0.5))
    for form in skvq_clip.FORMS:
        chosen = ratios.v[form]
        assert chosen.shape == (2, 2)
        assert chosen[1, 0] < 1.0, form
        assert chosen[0, 0] == chosen[0, 1] == chosen[1, 1] == 1.0, form


def test_reordering_groups_channels_of_like_magnitude_and_is_undone() -> None:
    rng = np.random.default_rng(3)
    scales = np.tile([0.05, 4.0], 32).astype(np.float32)          # large and small channels interleaved
    v = torch.from_numpy((rng.standard_normal((1, 96, 64)) * scales).astype(np.float32))
    order = skvq_clip.channel_order(v)
    assert set(order[0, :32].tolist()) == set(range(0, 64, 2))      # the small channels share a group
    ones = torch.ones(1, 2)
    as_is = skvq_clip.quantized_v(v, ones, None, False)
    reordered = skvq_clip.quantized_v(v, ones, order, False)
    small = slice(0, 64, 2)
    # back in the channels' own places, and the small channels no longer rounded on the large ones' step
    assert (reordered[..., small] - v[..., small]).abs().max() < 0.1 * (as_is[..., small] - v[..., small]).abs().max()
    identity = torch.arange(64)[None]
    torch.testing.assert_close(skvq_clip.quantized_v(v, ones, identity, False), as_is, rtol=0, atol=0)


def test_the_study_runs_and_writes_its_record(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(skvq_clip, "RESULTS", tmp_path)
    skvq_clip.main(["--models", "smollm2", "--tokens", "128", "--calibration-tokens", "96", "--window", "16"])
    record = json.loads((tmp_path / "skvq-clip.json").read_text())["models"][0]
    rows = {row["recipe"]: row for row in record["rows"]}
    assert set(rows) == {recipe.label for recipe in skvq_clip.RECIPES}
    assert rows["f16"]["delta_pct"] == 0
    assert rows["kivi2"]["ppl"] > rows["f16"]["ppl"]
    # calibration found groups worth clipping, and the recipes that use them read other values
    assert record["calibrated"]["v skvq"]["clipped_share"] > 0
    assert rows["kivi2 clip per group"]["ppl"] != rows["kivi2"]["ppl"]
    assert rows["kivi2 V reordered"]["ppl"] != rows["kivi2"]["ppl"]
    assert (tmp_path / "skvq-clip.png").stat().st_size > 0
