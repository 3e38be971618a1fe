"""`pykvq perplexity`: one type that cannot run must not cost the comparison of the others; --kl-divergence
scores every type against the f16 run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pykvq import KvConfig, Model, gguf_metadata
from pykvq.commands import perplexity
from pykvq.api.llama import gpu_offload_supported

import device

REFUSED = "k:*=kivi2;v:*=f16"  # parses, but llama.cpp refuses a kivi K beside a plain V at context creation


def pykvq_perplexity(model: Path, text: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "pykvq", "perplexity", "-m", str(model), "-f", str(text),
                           "-c", "128", "--chunks", "1", *args], capture_output=True, text=True, timeout=600)


def test_a_failing_type_keeps_its_row_and_the_others_report(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    out = tmp_path / "compare"
    proc = pykvq_perplexity(smollm2, hamlet, "-t", "2", "--kv-types", "f16,kivi2", "--kv-layers", REFUSED,
                            "-o", str(out), *device.TOOL_ARGS)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    rows = {r["kv_type"]: r for r in json.loads(out.with_suffix(".json").read_text())["runs"]}
    assert list(rows) == ["f16", "kivi2", REFUSED]
    assert rows["f16"]["failure"] is None and rows["f16"]["delta_pct"] == 0.0
    assert rows["kivi2"]["failure"] is None and rows["kivi2"]["ppl"] > rows["f16"]["ppl"] > 1.0
    assert "a kivi K type needs a kivi V type" in rows[REFUSED]["failure"]
    assert rows[REFUSED]["ppl"] is None
    assert out.with_suffix(".png").stat().st_size > 0
    table = proc.stdout.splitlines()
    assert any(line.startswith(REFUSED) and "failed: " in line for line in table)
    assert "1 of 3 KV types failed: k:*=kivi2;v:*=f16" in proc.stderr


def test_a_type_that_does_not_parse_is_refused_before_any_run(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    """A typo in the last of seven types cost the runs of the six before it."""
    proc = subprocess.run([sys.executable, "-P", "-m", "pykvq", "perplexity", "-m", str(smollm2), "-f", str(hamlet),
                           "--kv-types", "f16,kivi7", "--kv-layers", "k:0-3=kivi9"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "perplexity:" not in proc.stderr
    assert "pykvq: error: kivi7: unknown KV cache type 'kivi7'" in proc.stderr, proc.stderr
    assert "; k:0-3=kivi9: " in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_gpu_layers_without_a_gpu_are_one_clear_error(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    if gpu_offload_supported():
        pytest.skip("this build has a GPU backend")
    out = tmp_path / "compare"
    proc = pykvq_perplexity(smollm2, hamlet, "-ngl", "99", "-o", str(out))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "pykvq: error: -ngl 99 asks for GPU layers, but this pykvq build has no GPU backend" in proc.stderr
    assert not out.with_suffix(".json").exists()


def test_a_text_too_short_says_so(smollm2: Path, tmp_path: Path) -> None:
    text = tmp_path / "short.txt"
    text.write_text("Too short to score.\n")
    proc = pykvq_perplexity(smollm2, text, "--kv-types", "f16", "-o", str(tmp_path / "out"), *device.TOOL_ARGS)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    # llama-perplexity's own reason, in the table's row, not only in the JSON
    row = next(line for line in proc.stdout.splitlines() if line.startswith("f16"))
    assert "you need at least 256 tokens to evaluate perplexity with a context of 128" in row, proc.stdout


def test_without_an_f16_run_the_divergences_say_why(smollm2: Path, tmp_path: Path) -> None:
    text = tmp_path / "short.txt"
    text.write_text("Too short to score.\n")
    proc = pykvq_perplexity(smollm2, text, "--kv-types", "q8_0", "--kl-divergence", "-o", str(tmp_path / "out"),
                            *device.TOOL_ARGS)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[2:] if line.startswith(("f16", "q8_0"))}
    assert "failed: llama-perplexity exited with status 1: perplexity: you need at least" in rows["f16"]
    assert "failed: no f16 run to score against: llama-perplexity exited" in rows["q8_0"]


def test_a_divergence_over_few_tokens_is_read_from_its_chunk_lines(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    """Under 100 scored tokens llama-perplexity prints no statistics: its last chunk line holds the means (and no
    percentile); the run failed with "printed no final estimate"."""
    out = tmp_path / "few"
    proc = pykvq_perplexity(smollm2, hamlet, "-t", "2", "--kv-types", "q8_0", "--kl-divergence", "-o", str(out),
                            *device.TOOL_ARGS)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    q8_0 = json.loads(out.with_suffix(".json").read_text())["runs"][1]
    assert q8_0["kv_type"] == "q8_0" and q8_0["kld"] > 0 and q8_0["kld_p99"] is None
    assert 50 < q8_0["same_top_pct"] < 100 and q8_0["ppl"] > 1


def _divergence_from_f16(model: Model, text: Path, kv: KvConfig, n_ctx: int, chunks: int) -> device.Divergence:
    """What llama-perplexity's --kl-divergence measures, from the API's logits: per chunk of n_ctx tokens, one
    batch, the tokens of its second half scored by the distributions before them."""
    tokens = model.tokenize(text.read_text())
    rows = {config: [] for config in (KvConfig(), kv)}
    for chunk in range(chunks):
        batch = tokens[chunk * n_ctx:(chunk + 1) * n_ctx]
        for config, scored in rows.items():
            scored.append(device.all_logits(model, config, batch, n_ctx)[n_ctx // 2:n_ctx - 1])
    return device.Divergence.of(np.concatenate(rows[kv]), np.concatenate(rows[KvConfig()]))


def test_kl_divergence_scores_every_type_against_the_f16_run(smollm2: Path, hamlet: Path, model: Model,
                                                             tmp_path: Path) -> None:
    """--kl-divergence: the f16 run goes first (it was not asked for) and writes its log-probabilities, which the
    others are scored against by llama-perplexity; each type's divergence is the one computed from the API's
    logits (llama-perplexity keeps the base's log-probabilities in 16 bits), and its perplexity the plain run's."""
    out, plain = tmp_path / "kld", tmp_path / "plain"
    args = ("-c", "128", "--chunks", "2", "-t", "2", "--kv-window", "32", *device.TOOL_ARGS)
    proc = pykvq_perplexity(smollm2, hamlet, *args, "--kv-types", "q8_0,kivi2", "--kl-divergence", "-o", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["kv_type"]: r for r in json.loads(out.with_suffix(".json").read_text())["runs"]}
    assert list(rows) == ["f16", "q8_0", "kivi2"]
    assert (rows["f16"]["kld"], rows["f16"]["same_top_pct"]) == (0.0, 100.0)
    assert 0 < rows["q8_0"]["kld"] < rows["kivi2"]["kld"]
    assert 100 > rows["q8_0"]["same_top_pct"] > rows["kivi2"]["same_top_pct"]
    for name, kv in (("q8_0", KvConfig("q8_0", "q8_0")), ("kivi2", KvConfig.preset("kivi2", window=32))):
        divergence = _divergence_from_f16(model, hamlet, kv, 128, 2)
        assert rows[name]["kld"] == pytest.approx(divergence.mean_kl, rel=0.01)
        assert rows[name]["same_top_pct"] == pytest.approx(100 * divergence.top1_agreement, abs=1.0)
    assert "KLD vs f16" in proc.stdout
    proc = pykvq_perplexity(smollm2, hamlet, *args, "--kv-types", "f16,q8_0,kivi2", "-o", str(plain))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in json.loads(plain.with_suffix(".json").read_text())["runs"]:
        assert rows[r["kv_type"]]["ppl"] == pytest.approx(r["ppl"], abs=1e-4)
        assert r["kld"] is None


@pytest.mark.parametrize(("given", "rows"), [(["f16,kivi2"], ["f16", "kivi2"]),
                                              (["f16,kivi4"], ["f16", "kivi4", "k:*=kivi2;v:*=kivi2"]),
                                              (["f16,kivi4", "--kv-layers", "none"], ["f16", "kivi4"])])
def test_a_copy_s_one_type_everywhere_runs_once(smollm2: Path, hamlet: Path, tmp_path: Path, given: list[str],
                                                rows: list[str]) -> None:
    """A calibrated copy whose mix is kivi2 everywhere (calibrate's held-out fallback) ran the same cache twice
    beside --kv-types kivi2; it still joins where no run compares its type, and not under --kv-layers none (which
    was refused as a per-layer spec that names no layer)."""
    copy = tmp_path / "copy.gguf"
    gguf_metadata.write_copy(smollm2, copy, {gguf_metadata.KEY_LAYERS: "k:*=kivi2;v:*=kivi2"})
    out = tmp_path / "compare"
    proc = pykvq_perplexity(copy, hamlet, "-t", "2", "--kv-types", *given, "-o", str(out), *device.TOOL_ARGS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["kv_type"] for r in json.loads(out.with_suffix(".json").read_text())["runs"]] == rows
    already = "the model's kvq.kv_layers (k:*=kivi2;v:*=kivi2) is kivi2 everywhere, already in the comparison"
    assert (already in proc.stderr) == (given == ["f16,kivi2"])


def test_the_table_s_columns_stay_aligned_past_a_long_label() -> None:
    runs = [perplexity.Run(label, 30.0, 1.5, 4.0, 4.0, 1.0, [], 1.0) for label in
            ("f16", "kivi2", "k:0-9=kivi4,10-29=kivi2;v:*=kivi2")]
    assert len({len(line) for line in perplexity.format_table(runs).splitlines()}) == 1


def test_a_dotted_output_prefix_is_kept_whole(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    """-o run.kivi2 and -o run.q4_0 wrote run.json and run.png both: the second comparison replaced the first."""
    proc = pykvq_perplexity(smollm2, hamlet, "-t", "2", "--kv-types", "f16", "-o", str(tmp_path / "run.f16"),
                            *device.TOOL_ARGS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.f16.json", "run.f16.png"]


@pytest.mark.parametrize(("given", "json_name", "png_name"), [
    ("run.json", "run.json", "run.png"),
    ("run.png", "run.json", "run.png"),
    ("run.kivi2", "run.kivi2.json", "run.kivi2.png"),
])
def test_an_output_named_with_its_suffix_is_not_doubled(tmp_path: Path, given: str, json_name: str,
                                                         png_name: str) -> None:
    """-o run.json wrote run.json.json and run.json.png."""
    outputs = perplexity.output_files(str(tmp_path / given))
    assert (outputs.json, outputs.png) == (tmp_path / json_name, tmp_path / png_name)


@pytest.mark.parametrize(("args", "message"), [
    (["-o", "missing-folder/run"], "-o missing-folder/run: the folder missing-folder does not exist"),
    (["-o", "."], "-o .: give a file prefix"),
    (["--kv-window", "2147483648"], "the kivi window must be at most 2147483647 tokens"),
    (["--kv-sinks", "99999999999"], "the kivi sink count must be at most 2147483647 tokens"),
    (["-f", "."], "text path is a folder, not a file: ."),
])
def test_settings_that_cannot_run_are_refused_before_any_run(smollm2: Path, hamlet: Path, tmp_path: Path,
                                                             args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-P", "-m", "pykvq", "perplexity", "-m", str(smollm2), "-f", str(hamlet),
                           "-c", "128", "--chunks", "1", *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"pykvq: error: {message}" in proc.stderr, proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_kivi_settings_for_runs_without_kivi_are_named(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    proc = pykvq_perplexity(smollm2, hamlet, "-t", "2", "--kv-types", "q8_0", "--kv-sinks", "4", "-o",
                            str(tmp_path / "run"), *device.TOOL_ARGS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--kv-sinks changes nothing: no layer of the runs' caches is kivi" in proc.stderr


def test_sigterm_ends_the_comparison_its_tool_and_its_temporary_files(smollm2: Path, hamlet: Path,
                                                                      tmp_path: Path) -> None:
    """`timeout` signals pykvq alone: llama-perplexity ran on to its last chunk, the f16 log-probabilities stayed."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, "-P", "-m", "pykvq", "perplexity", "-m", str(smollm2), "-f", str(hamlet), "-c", "512",
           "--chunks", "40", "-t", "2", "--kv-types", "f16,kivi2", "--kl-divergence", "-o", str(tmp_path / "out"),
           *device.TOOL_ARGS]
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "TMPDIR": str(tmp)}) as proc:
        deadline = time.monotonic() + 120
        while not (tools := tool_children(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tools, "llama-perplexity never started"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "Traceback" not in stderr, stderr[-2000:]
    assert stderr.rstrip().endswith("pykvq: terminated")
    assert not any(Path(f"/proc/{pid}").exists() for pid in tools)
    assert list(tmp.iterdir()) == [] and not (tmp_path / "out.json").exists()


def tool_children(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in children.read_text().split()] if children.exists() else []
