"""bench/gpu/record.py, which files a GPU run's output under bench/results, on a session output made here: the
benchmarks' records under the names their tools give them, one record of the steps with their exit codes, the
tests still failing as pytest node ids, the README's tables of it all; a folder that is no session's output, or a
bundle naming a path, is refused with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import attn_op
import readme_tables
import record

GPU = "NVIDIA H100 80GB HBM3"
DECODE = "decode-speed-h100-80gb-hbm3-mma-random-llama3-8b-4096.json"


def write(folder: Path, name: str, data: dict) -> None:
    (folder / name).write_text(json.dumps(data))


def pytest_summary(settings: str, failures: dict[str, str], files: list[str]) -> dict:
    per_file = {f: {"passed": 3, "failed": sum(t.startswith(f + "::") for t in failures), "skipped": 1} for f in files}
    return {"gpu": GPU, "settings": settings, "tests": 40, "passed": 37, "failed": len(failures), "skipped": 1,
            "seconds": 150.0, "failures": failures, "skips": {}, "per_file": per_file}


@pytest.fixture
def session_output(tmp_path: Path) -> Path:
    """What session.sh's polls bring back from a lease that ended during the suite."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "packages.json").write_text(json.dumps([{"name": "torch", "version": "2.9.0"},
                                                   {"name": "transformers", "version": "5.17.0"}]))
    write(out, "build.json", {"gpu": GPU, "build": "prebuilt by CI (.ci/cuda-build), carried", "build_seconds": 21})
    write(out, "smoke.json", {"gpu": GPU, "run": "Paris.\npykvq: prompt 6 tokens, 900.0 t/s | generated 24 tokens, "
                              "448.1 t/s\n", "fit": [], "api": "Paris", "server": '{"choices": []}'})
    write(out, "recheck.json", pytest_summary("PYKVQ_TEST_NGL=99", {
        "tests.test_cuda::test_one[kivi1]": "assert 98.2 > 99.0",
        "tests.test_kvq_store::test_two": "AssertionError"}, ["tests.test_cuda", "tests.test_kvq_store"]))
    # the suite reached test_cuda only: test_kvq_store's recheck failure still stands
    write(out, "suite.json", pytest_summary("PYKVQ_TEST_NGL=99", {
        "tests.test_cuda::test_three": "assert False"}, ["tests.test_cuda"]))
    write(out, "sanitize.json", {"gpu": GPU, "tools": {"memcheck": {"exit": 0, "errors": 0, "tests": {"passed": 9},
                                                                    "reports": []}}})
    write(out, "mma-bench.json", {DECODE: {"machine": f"{GPU}, tensor-core attention", "rows": []}})
    assert attn_op.main(["--cpu", "--depth", "256", "--seqs", "1", "--kv-types", "kivi2,f16", "--window", "32",
                         "--sinks", "0", "--min-cache-mb", "1", "--repeat", "1", "--out", str(out / "op")]) == 0
    (out / "op.png").unlink()
    (out / "chain.log").write_text("[10:00:01] step build\n[10:00:22] step build: exit 0\n[10:00:22] step smoke\n"
                                   "[10:00:40] step smoke: exit 0\n[10:00:40] step recheck\n"
                                   "[10:02:50] step recheck: exit 1\n[10:02:50] step suite\n")
    return out


def test_a_run_is_filed_under_its_gpu(session_output: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results"
    assert record.main([str(session_output), "--date", "2026-12-06", "--commit", "abc1234",
                        "--results", str(results)]) == 0
    assert sorted(p.name for p in results.iterdir()) == sorted(
        [DECODE, "attn-op-h100-80gb-hbm3.json", "gpu-run-h100-80gb-hbm3-2026-12-06.json"])
    assert json.loads((results / DECODE).read_text())["machine"] == f"{GPU}, tensor-core attention"
    run = json.loads((results / "gpu-run-h100-80gb-hbm3-2026-12-06.json").read_text())
    assert (run["gpu"], run["date"], run["commit"]) == (GPU, "2026-12-06", "abc1234")
    assert run["exits"] == {"build": 0, "smoke": 0, "recheck": 1}
    assert run["packages"] == {"torch": "2.9.0", "transformers": "5.17.0"}
    assert sorted(run["steps"]) == ["build", "recheck", "sanitize", "smoke", "suite"]
    printed = capsys.readouterr()
    assert "still failing at full offload (for bench/gpu/recheck.txt):\n" \
           "tests/test_cuda.py::test_three\ntests/test_kvq_store.py::test_two" in printed.out
    assert "suite: 37 passed, 1 failed, 1 skipped of 40" in printed.out

    table = readme_tables.gpu_run_table(results / "gpu-run-h100-80gb-hbm3-2026-12-06.json")
    assert f"GPU run on {GPU}, 2026-12-06, commit abc1234" in table
    assert "| build | 0 | prebuilt by CI (.ci/cuda-build), carried, 21 s |" in table
    assert "| smoke | 0 | `pykvq run -ngl 99 --kv-type kivi2` 448.1 t/s; the llama-cpp-python server answered |" \
        in table
    assert "| recheck | 1 | 37 passed, 2 failed, 1 skipped of 40 in 2.5 min (PYKVQ_TEST_NGL=99) |" in table
    assert "| suite | cut short | 37 passed, 1 failed" in table
    assert "| sanitize | cut short | memcheck: 0 errors, exit 0 |" in table
    assert "| 1 | 256 | kivi2 | cpu |" in readme_tables.attn_op_table(results / "attn-op-h100-80gb-hbm3.json")


def test_junit_names_become_node_ids() -> None:
    assert record.node_id("tests.test_cuda::test_x[a-b]") == "tests/test_cuda.py::test_x[a-b]"
    assert record.node_id("tests.test_cuda.TestZ::test_y") == "tests/test_cuda.py::TestZ::test_y"


@pytest.mark.parametrize(("change", "message"), [
    (lambda out: [p.unlink() for p in out.glob("*.json") if p.name in {f"{s}.json" for s in record.STEPS}],
     "not bench/gpu/session.sh's output"),
    (lambda out: write(out, "bench.json", {"../../README.md.json": {}}), "is not a benchmark record"),
    (lambda out: write(out, "control.json", {**json.loads((out / "suite.json").read_text()), "gpu": "NVIDIA H200"}),
     "several GPUs"),
    (lambda out: (out / "threshold.json").write_text("{"), "threshold.json: not readable JSON"),
])
def test_what_it_cannot_file_is_refused_with_nothing_written(session_output: Path, tmp_path: Path, change,
                                                             message: str, capsys: pytest.CaptureFixture[str]) -> None:
    change(session_output)
    results = tmp_path / "results"
    assert record.main([str(session_output), "--results", str(results)]) == 1
    assert message in capsys.readouterr().err
    assert not results.exists()
