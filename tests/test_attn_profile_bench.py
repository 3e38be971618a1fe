"""bench/gpu/attn_profile.py, Nsight Compute's view of the decode attention op, without a GPU: a stand-in ncu (a
script that records its command line and writes a report in ncu's CSV layout, units scaled and numbers grouped as
ncu prints them) checks the command the tool builds, the parsing, the per-setting sums and ratios, and the clear
failures (no ncu, ncu failing, no table, a second kivi type)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

import attn_op
import attn_profile
import readme_tables

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
S = attn_op.Setting
SHAPE = attn_op.Shape()
KIVI2 = attn_op.kivi_bytes(SHAPE, S("kivi2", "cuda cores", 32768, 1, 128, 0))
F16 = attn_op.upstream_bytes(SHAPE, S("f16", "flash attention", 32768, 1))


def launch(i: int, kernel: str, dram: str, unit: str, inst: str, ns: str) -> list[str]:
    head = f'"{i}","4242","python3","127.0.0.1","{kernel}","1","7","(128, 1, 1)","(65, 8, 1)","0","9.0",' \
           '"Command line profiler metrics"'
    return [f'{head},"dram__bytes_read.sum","{unit}","{dram}"',
            f'{head},"smsp__inst_executed.sum","inst","{inst}"',
            f'{head},"gpu__time_duration.sum","nsecond","{ns}"']


def report() -> str:
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3)", HEADER]
    # cuda cores: three launches at 1.10x the computed bytes (median), 1000 instructions per cell and head
    inst = f"{int(1000 * 32768 * 8):,}"
    for i, f in enumerate((1.2, 1.1, 1.0)):
        lines += launch(i, "kvq_attn_kernel<1, 1>", f"{KIVI2 * f:,.0f}", "byte", inst, "98,000")
    # tensor cores: in Mbyte, as ncu scales it unless told not to
    for i in range(3, 5):
        lines += launch(i, "void kvq_attn_mma_kernel<128, 4>(kvq_attn_params)", f"{KIVI2 * 1.02 / 1e6:.6f}", "Mbyte",
                        "40,000,000", "12,500")
    # f16: the vector kernel and its combine make one op
    for i in range(5, 7):
        lines += launch(i, "flash_attn_ext_vec", f"{F16 * 0.99:,.0f}", "byte", "5,000,000", "66,000")
        lines += launch(i + 10, "flash_attn_combine_results", f"{F16 * 0.01:,.0f}", "byte", "10,000", "4,000")
    lines.append("==PROF== Disconnected from process 4242")
    return "\n".join(lines) + "\n"


def fake_ncu(tmp_path: Path, body: str) -> Path:
    """An executable `ncu` in its own folder that runs `body` (Python) with argv."""
    folder = tmp_path / "bin"
    folder.mkdir()
    ncu = folder / "ncu"
    ncu.write_text(f"#!{sys.executable}\nimport json, sys\nargv = sys.argv[1:]\n{body}\n")
    ncu.chmod(ncu.stat().st_mode | stat.S_IEXEC)
    return folder


WRITES_REPORT = """
json.dump(argv, open(sys.argv[0] + ".argv", "w"))
open(argv[argv.index("--log-file") + 1], "w").write(open(sys.argv[0] + ".report").read())
json.dump({"device": "NVIDIA H200"}, open(argv[argv.index("--out") + 1] + ".json", "w"))
"""


def test_a_profile_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    folder = fake_ncu(tmp_path, WRITES_REPORT)
    (folder / "ncu.report").write_text(report())
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "profile"
    assert attn_profile.main(["--out", str(out)]) == 0
    argv = json.loads((folder / "ncu.argv").read_text())
    assert argv[argv.index("--metrics") + 1] == "dram__bytes_read.sum,smsp__inst_executed.sum,gpu__time_duration.sum"
    assert argv[argv.index("--kernel-name") + 1] == "regex:kvq_attn|flash_attn"
    assert argv[argv.index("--clock-control") + 1] == "none" and "--csv" in argv
    assert argv[argv.index("--depth") + 1] == "32768" and argv[argv.index("--kv-types") + 1] == "kivi2,f16"
    assert argv[argv.index("--shape") + 1] == "llama3-8b"
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["device"] == "NVIDIA H200"
    rows = {r["kernel"]: r for r in record["rows"]}
    assert list(rows) == ["cuda cores", "tensor cores", "flash attention"]
    assert rows["cuda cores"]["launches"] == 3
    assert rows["cuda cores"]["dram_vs_computed"] == pytest.approx(1.1)
    assert rows["cuda cores"]["instructions_per_cell_head"] == pytest.approx(1000)
    assert rows["cuda cores"]["us"] == pytest.approx(98.0)
    assert rows["tensor cores"]["dram_vs_computed"] == pytest.approx(1.02, rel=1e-6)
    assert rows["flash attention"]["kernels"] == ["flash_attn_ext_vec", "flash_attn_combine_results"]
    assert rows["flash attention"]["dram_vs_computed"] == pytest.approx(1.0)
    assert rows["flash attention"]["us"] == pytest.approx(70.0)
    table = readme_tables.attn_profile_table(out.with_suffix(".json"))
    assert table in capsys.readouterr().out
    assert "NVIDIA H200, 32768 cells, 1 sequence(s), kivi at window 128, sinks 0" in table
    assert "| kivi2 | cuda cores | 3 |" in table and "| 1.100 | 1000.0 | 98.0 |" in table
    assert "| f16 | flash attention | 4 |" in table and "| 70.0 |" in table


@pytest.mark.parametrize(("body", "message"), [
    ("sys.exit(3)", "ncu exited with 3"),
    ('open(argv[argv.index("--log-file") + 1], "w").write("==PROF== No kernels were profiled.\\n")',
     "no CSV table"),
])
def test_ncu_failures_are_reported(body: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", f"{fake_ncu(tmp_path, body)}{os.pathsep}{os.environ['PATH']}")
    assert attn_profile.main(["--out", str(tmp_path / "profile")]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "profile.json").exists()


def test_without_ncu_it_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(attn_profile, "find_ncu", lambda: None)
    assert attn_profile.main([]) == 1
    assert "ncu (Nsight Compute) not found" in capsys.readouterr().err


@pytest.mark.parametrize(("types", "message"), [("kivi2,kivi1", "one kivi type"), ("kivi3", "unknown KV type")])
def test_settings_it_cannot_tell_apart_are_refused(types: str, message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert attn_profile.main(["--kv-types", types]) == 1
    assert message in capsys.readouterr().err


def test_units_and_a_missing_metric() -> None:
    assert attn_profile.to_base("1,536", "Kbyte", "byte") == 1536e3
    assert attn_profile.to_base("12.5", "usecond", "second") == pytest.approx(12.5e-6)
    with pytest.raises(attn_profile.ProfileError, match="in 'percent'"):
        attn_profile.to_base("3", "percent", "byte")
    partial = "\n".join([HEADER, launch(0, "kvq_attn_kernel", "10", "byte", "5", "7")[0]])
    with pytest.raises(attn_profile.ProfileError, match="lacks smsp__inst_executed.sum"):
        attn_profile.parse(partial)
