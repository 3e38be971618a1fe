"""bench/fit_context.py: the context llama.cpp's fit gives each KV type in a device budget. A real run on the dev
model through the bench's own RPC device, the table's ratios, and a budget the device cannot keep."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import readme_tables

BENCH = Path(__file__).resolve().parent.parent / "bench" / "fit_context.py"

# the bench's RPC server lends the CPU: no GPU in its runs
pytestmark = pytest.mark.usefixtures("cpu_only")


def bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The bench, its record written under tmp_path/results."""
    return subprocess.run([sys.executable, str(BENCH), "--model", "smollm2", "--workdir", str(tmp_path), "--results",
                           str(tmp_path / "results"), *args], capture_output=True, text=True, timeout=600)


def test_kivi2_fits_more_context_than_f16_in_every_budget(tmp_path: Path) -> None:
    """SmolLM2: 0.2 GiB holds only some layers at the least context (4096) in either type, 0.25 GiB every layer
    and more context in kivi2 (the training context, 8192) than in f16."""
    proc = bench(tmp_path, "--kv-types", "f16,kivi2", "--budget-gib", "0.2", "0.25")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [record_path] = (tmp_path / "results").glob("fit-context-rpc-cpu-*.json")
    assert record_path.with_suffix(".png").is_file()
    record = json.loads(record_path.read_text())
    rows = {(r["budget_gib"], r["kv_type"]): r for r in record["rows"]}
    assert all(r["fitted"] for r in rows.values())
    tight_f16, tight_kivi2 = rows[0.2, "f16"], rows[0.2, "kivi2"]
    assert 0 < tight_f16["n_gpu_layers"] < tight_kivi2["n_gpu_layers"] <= record["n_layer"]
    assert rows[0.25, "kivi2"]["n_gpu_layers"] == -1 and rows[0.25, "kivi2"]["n_ctx"] == 8192
    assert rows[0.25, "f16"]["n_ctx"] < 8192
    assert readme_tables.fit_context_record_table(record) in proc.stdout


def test_the_ratio_to_f16_is_shown_only_where_both_hold_every_layer() -> None:
    rows = [{"kv_type": "f16", "budget_gib": 8, "fitted": True, "n_ctx": 1000, "n_gpu_layers": -1},
            {"kv_type": "kivi2", "budget_gib": 8, "fitted": True, "n_ctx": 4300, "n_gpu_layers": 33},
            {"kv_type": "f16", "budget_gib": 4, "fitted": True, "n_ctx": 4096, "n_gpu_layers": 20},
            {"kv_type": "kivi2", "budget_gib": 4, "fitted": True, "n_ctx": 4096, "n_gpu_layers": -1},
            {"kv_type": "f16", "budget_gib": 1, "fitted": False, "n_ctx": None, "n_gpu_layers": None},
            {"kv_type": "kivi2", "budget_gib": 1, "fitted": False, "n_ctx": None, "n_gpu_layers": None}]
    table = readme_tables.fit_context_record_table({"model": "m", "device": "d", "n_layer": 32, "rows": rows})
    assert "| 8 GiB | 1000 | 4300 (4.3x) |" in table
    assert "| 4 GiB | 4096 (-ngl 20) | 4096 |" in table
    assert "| 1 GiB | does not fit | does not fit |" in table


def test_a_budget_above_the_free_memory_is_one_clear_error(tmp_path: Path) -> None:
    proc = bench(tmp_path, "--kv-types", "f16", "--budget-gib", "100000")
    assert proc.returncode == 1
    assert "fit_context: RPC0" in proc.stderr and "cannot be kept" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "results").exists()
