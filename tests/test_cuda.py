"""The kivi types on the GPU (CUDA builds only): nothing falls back to the CPU, results equal the CPU's, and
batching does not change the logits there either. Skipped on builds without the CUDA backend.

Runs on random-weight models generated here (pykvq.random_model), so that it needs nothing fetched: the
GPU machine has no network and a real model does not travel there."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest

from pykvq import llama_tools, native, random_model

if "CUDA" not in native.backends():
    pytest.skip("this pykvq build has no CUDA backend (PYKVQ_CUDA=ON)", allow_module_level=True)

CTX = 512
KIVI = ["kivi4", "kivi2", "kivi1"]
_SPLITS = re.compile(r"graph(?: \(pp bs=\d+, tg bs=\d+\))?: nodes = [\d /]+, splits = (\d+)(?: / (\d+))?")


@pytest.fixture(scope="module", params=["small-h64", "small-h128"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / f"{request.param}.gguf"
    random_model.write(random_model.SHAPES[request.param], path)
    return path


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("text") / "words.txt"
    path.write_text(" ".join(f"<t{rng.randrange(1500)}>" for _ in range(3 * CTX)))
    return path


def perplexity(model: Path, text: Path, kv_type: str, *args: str) -> str:
    base = ["-c", str(CTX), "-b", str(CTX), "--chunks", "2", "-t", "4", "-fa", "on", "--kv-window", "64",
            "--kv-sinks", "3"]
    return llama_tools.run_tool("llama-perplexity", ["-m", str(model), "-f", str(text), *base, "-ctk", kv_type,
                                                     "-ctv", kv_type, *args])


def splits(output: str) -> int:
    found = _SPLITS.search(output)
    assert found is not None, "llama.cpp printed no graph split count"
    return max(int(g) for g in found.groups() if g is not None)


@pytest.mark.parametrize("kv_type", KIVI)
def test_nothing_falls_back_to_the_cpu(kv_type: str, model: Path, text: Path) -> None:
    """A KV or attention node on the CPU would split the graph at every layer; f16 KV (upstream's fused
    attention, fully on the GPU) sets the bar."""
    # -lv 4: the split count is logged at info level
    f16 = splits(perplexity(model, text, "f16", "-ngl", "99", "-lv", "4"))
    assert splits(perplexity(model, text, kv_type, "-ngl", "99", "-lv", "4")) <= f16


@pytest.mark.parametrize("kv_type", KIVI)
def test_gpu_logits_match_the_cpu(kv_type: str, model: Path, text: Path, tmp_path: Path) -> None:
    """Same model, same chunks, CPU against GPU: KL divergence of the GPU's token distributions from the CPU's
    must be at the level of float summation order, far below what quantization itself costs."""
    base = tmp_path / "cpu.bin"
    perplexity(model, text, kv_type, "-ngl", "0", "--kl-divergence-base", str(base))
    out = perplexity(model, text, kv_type, "-ngl", "99", "--kl-divergence-base", str(base), "--kl-divergence")
    mean_kld = float(re.search(r"Mean\s+KLD:\s+([-0-9.e]+)", out).group(1))
    same_top = float(re.search(r"Same top p:\s+([0-9.]+)", out).group(1))
    assert mean_kld < 1e-4
    assert same_top > 99.0


def _log_probs(model: Path, text: Path, kv_type: str, path: Path, *args: str) -> np.ndarray:
    perplexity(model, text, kv_type, "--kl-divergence-base", str(path), *args)
    return np.frombuffer(path.read_bytes(), dtype=np.uint8)


@pytest.mark.parametrize("kv_type", KIVI)
def test_batching_does_not_change_gpu_logits(kv_type: str, model: Path, text: Path, tmp_path: Path) -> None:
    whole = _log_probs(model, text, kv_type, tmp_path / "ub512.bin", "-ngl", "99", "-ub", str(CTX))
    for ubatch in ("37", "1"):
        other = _log_probs(model, text, kv_type, tmp_path / f"ub{ubatch}.bin", "-ngl", "99", "-ub", ubatch)
        assert np.array_equal(other, whole), f"-ub {ubatch} changed the logits"


@pytest.mark.parametrize("kv_type", KIVI)
def test_sequences_in_one_batch_give_the_logits_of_one_on_gpu(kv_type: str, model: Path, text: Path,
                                                               tmp_path: Path) -> None:
    """-b 2*c: llama-perplexity decodes two chunks as two sequences (per-sequence streams) in the same batches;
    each chunk's logits must equal those of the chunk decoded alone."""
    one = _log_probs(model, text, kv_type, tmp_path / "seq1.bin", "-ngl", "99")
    two = _log_probs(model, text, kv_type, tmp_path / "seq2.bin", "-ngl", "99", "-b", str(2 * CTX))
    assert np.array_equal(two, one), "two sequences per batch changed the logits"
