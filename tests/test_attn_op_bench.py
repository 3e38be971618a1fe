"""bench/gpu/attn_op.py, the decode attention op's benchmark, on the CPU at a tiny size: every setting of the sweep
gets a row whose bytes follow the formats, for the kivi kernel and upstream's flash attention alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import attn_op


def test_a_tiny_sweep_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "attn-op"
    assert attn_op.main(["--cpu", "--depth", "512", "--seqs", "1", "2", "--kv-types", "kivi2,f16",
                         "--window", "32", "--sinks", "0", "4", "--min-cache-mb", "2", "--repeat", "1",
                         "--out", str(out)]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").is_file()
    rows = record["rows"]
    assert [(r["seqs"], r["kv_type"], r["sinks"]) for r in rows] == [
        (1, "kivi2", 0), (1, "kivi2", 4), (1, "f16", 0), (2, "kivi2", 0), (2, "kivi2", 4), (2, "f16", 0)]
    assert all(r["us"] > 0 and r["gbs"] > 0 for r in rows)
    # kivi2: 3 bits per K and V value plus 36 fp16 cells per head; f16: 16 bits per value
    kivi2 = next(r for r in rows if r["kv_type"] == "kivi2" and r["sinks"] == 4 and r["seqs"] == 1)
    assert kivi2["mb"] * 2**20 == pytest.approx(8 * (512 * 2 * 128 * 12 / 32 + 36 * 2 * 128 * 2))
    f16 = next(r for r in rows if r["kv_type"] == "f16" and r["seqs"] == 2)
    assert f16["mb"] * 2**20 == pytest.approx(2 * 512 * 2 * 1024 * 2)


def test_a_latent_layer_reads_k_alone(tmp_path: Path) -> None:
    """DeepSeek-V2-Lite's latent attention: the kivi cache holds K alone (V is its first 512 channels), and upstream's
    flash attention takes V as a view of K: neither reads a V of its own."""
    out = tmp_path / "attn-op"
    assert attn_op.main(["--cpu", "--shape", "deepseek2-lite", "--depth", "256", "--seqs", "1", "--kv-types",
                         "kivi2,f16", "--window", "32", "--sinks", "4", "--min-cache-mb", "1", "--repeat", "1",
                         "--out", str(out)]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["shape"] == {"n_head": 16, "n_head_kv": 1, "head_dim": 576, "head_dim_v": 512}
    kivi2, f16 = record["rows"]
    assert kivi2["mb"] * 2**20 == pytest.approx(256 * 576 * 12 / 32 + 36 * 576 * 2)
    assert f16["mb"] * 2**20 == pytest.approx(256 * 576 * 2)
