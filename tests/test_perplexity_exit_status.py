"""llama-perplexity's exit status says whether it scored.

Upstream's scorers (HellaSwag, Winogrande, multiple choice, KL divergence) log an error and return, and the tool
then exited 0 without a score, as did a perplexity that stopped; scripts that compare KV types run for run took
that for a result. A kivi cache adds a way to stop (a multiple-choice task's prompt and ending fill a sequence's
region, where upstream's cache holds the prompt once), so native/patches makes every such stop exit 1.
"""

from __future__ import annotations

import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from pykvq import paths

import device
from test_shared_prompt import _garbled, _lines

Case = Callable[[Path, Path], list[str]]


def _run(smollm2: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(paths.tool("llama-perplexity")), "-m", str(smollm2), "-t", "2", *args,
                           *device.TOOL_ARGS], capture_output=True, text=True, timeout=600)


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _short_text(tmp: Path, hamlet: Path) -> list[str]:
    return ["-f", str(_write(tmp / "short.txt", "Too short to score.\n")), "-c", "128"]


def _hellaswag_five_lines(tmp: Path, hamlet: Path) -> list[str]:
    return ["--hellaswag", "-f", str(_write(tmp / "tasks.txt", "a\n0\nb\nc\nd\n")), "-c", "128"]


def _winogrande_no_tasks(tmp: Path, hamlet: Path) -> list[str]:
    return ["--winogrande", "-f", str(_write(tmp / "tasks.csv", "")), "-c", "128"]


def _multiple_choice_no_tasks(tmp: Path, hamlet: Path) -> list[str]:
    data = tmp / "tasks.bin"
    data.write_bytes(struct.pack("<I", 0))
    return ["--multiple-choice", "-bf", str(data), "-c", "128"]


def _kl_divergence_without_base(tmp: Path, hamlet: Path) -> list[str]:
    return ["--kl-divergence", "--kl-divergence-base", str(tmp / "missing.kld"), "-f", str(hamlet), "-c", "128"]


STOPS: dict[str, tuple[Case, str]] = {
    "perplexity": (_short_text, "you need at least 256 tokens to evaluate perplexity with a context of 128"),
    "hellaswag": (_hellaswag_five_lines, "number of lines in prompt not a multiple of 6"),
    "winogrande": (_winogrande_no_tasks, "no tasks"),
    "multiple-choice": (_multiple_choice_no_tasks, "no tasks"),
    "kl-divergence": (_kl_divergence_without_base, "failed to open"),
}


@pytest.mark.parametrize("stop", list(STOPS), ids=list(STOPS))
def test_a_score_that_stops_on_an_error_exits_1(smollm2: Path, hamlet: Path, tmp_path: Path, stop: str) -> None:
    case, reason = STOPS[stop]
    proc = _run(smollm2, *case(tmp_path, hamlet))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert reason in proc.stderr


def _long_task(hamlet: Path, path: Path) -> Path:
    """One HellaSwag task whose shared prompt (~400 tokens) and an ending pass -c 256 but fit 4 x 256."""
    lines = _lines(hamlet)
    endings = [lines[31], *map(_garbled, lines[32:35])]
    return _write(path, "\n".join([" ".join(lines[:30]), "0", *endings]) + "\n")


def test_a_task_past_a_kivi_sequence_s_region_stops_the_score_with_exit_1(smollm2: Path, hamlet: Path,
                                                                         tmp_path: Path) -> None:
    """llama-perplexity's HellaSwag context holds 4 sequences of -c cells; upstream's cache keeps a task's prompt
    once for its 4 endings, a kivi cache once per sequence (the README's limit)."""
    task = ["--hellaswag", "-f", str(_long_task(hamlet, tmp_path / "tasks.txt")), "-c", "256", "-fa", "on"]
    f16 = _run(smollm2, *task, "-ctk", "f16", "-ctv", "f16")
    assert f16.returncode == 0 and "\n1\t100.00000000%" in f16.stdout, f16.stderr[-3000:]
    kivi = _run(smollm2, *task, "-ctk", "kivi2", "-ctv", "kivi2")
    assert kivi.returncode == 1, kivi.stderr[-3000:]
    assert "sequence 0 is full" in kivi.stderr and "hellaswag_score: llama_decode() failed" in kivi.stderr


def test_a_kl_divergence_that_scores_exits_0(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    base = tmp_path / "f16.kld"
    text = ["-f", str(hamlet), "-c", "128", "--chunks", "2", "-fa", "on"]
    saved = _run(smollm2, *text, "-ctk", "f16", "-ctv", "f16", "--kl-divergence-base", str(base))
    assert saved.returncode == 0 and base.stat().st_size > 0, saved.stderr[-3000:]
    kld = _run(smollm2, *text, "-ctk", "kivi2", "-ctv", "kivi2", "--kv-window", "32", "--kl-divergence",
               "--kl-divergence-base", str(base))
    assert kld.returncode == 0 and "Mean    KLD:" in kld.stdout, kld.stderr[-3000:]
