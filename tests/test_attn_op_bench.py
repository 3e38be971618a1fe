"""bench/gpu/attn_op.py, the decode attention op's benchmark, on the CPU at a tiny size: every setting of the sweep
gets a row whose bytes follow the formats, for the kivi kernel and upstream's flash attention alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import attn_op
import readme_tables


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


def test_the_readme_table_shows_the_first_window_and_sinks_against_f16(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "attn-op"
    assert attn_op.main(["--cpu", "--depth", "256", "512", "--seqs", "1", "--kv-types", "kivi2,f16", "--window", "32",
                         "128", "--sinks", "4", "0", "--min-cache-mb", "1", "--repeat", "1", "--out", str(out)]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    table = readme_tables.attn_op_table(out.with_suffix(".json"))
    assert table in capsys.readouterr().out
    assert "kivi at window 32, sinks 4" in table and "a streaming read" in table
    body = [line.split(" | ") for line in table.splitlines() if line.startswith("| 1 |")]
    # the kivi row of each depth at window 32, sinks 4 (the other three of its four settings left to the JSON), f16's
    assert [(c[1], c[2]) for c in body] == [("256", "kivi2"), ("256", "f16"), ("512", "kivi2"), ("512", "f16")]
    for depth in (256, 512):
        kivi2, f16 = (next(r for r in record["rows"] if r["depth"] == depth and r["kv_type"] == t and
                           r["sinks"] in (4, 0) and r["window"] in (32, 0)) for t in ("kivi2", "f16"))
        row = next(c for c in body if c[1] == str(depth) and c[2] == "kivi2")
        assert row[-1] == f"{f16['us'] / kivi2['us']:.2f}x |"
        assert row[-2] == ""  # no peak on the CPU
    assert all(c[-1] == "1.00x |" for c in body if c[2] == "f16")


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
