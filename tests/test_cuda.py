"""The kivi types on the GPU (CUDA builds only): nothing falls back to the CPU, results equal the CPU's, and
batching changes the logits there only as much as f16's own rounding does; for prefill through the fused kernel
and through flash attention over wide cells (LLAMA_KVQ_FA_PREFILL). Skipped on builds without the CUDA backend.

Runs on random-weight models generated here (pykvq.devtools.random_model), so that it needs nothing fetched: the
GPU machine has no network and a real model does not travel there."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from pykvq import llama_tools
from pykvq.bindings import native
from pykvq.devtools import random_model

import device

if "CUDA" not in native.backends():
    pytest.skip("this pykvq build has no CUDA backend (PYKVQ_CUDA=ON)", allow_module_level=True)

CTX = 512
KIVI = ["kivi4", "kivi2", "kivi1"]
# LLAMA_KVQ_FA_PREFILL: the fused kernel for every batch, or flash attention over wide cells from 128 tokens per
# sequence (the GPU's default)
PREFILL = {"fused": "1000000000", "flash": "128"}
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


@pytest.fixture(params=list(PREFILL))
def prefill(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("LLAMA_KVQ_FA_PREFILL", PREFILL[request.param])
    return request.param


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
def test_nothing_falls_back_to_the_cpu(kv_type: str, model: Path, text: Path, prefill: str) -> None:
    """A KV or attention node on the CPU would split the graph at every layer; f16 KV (upstream's fused
    attention, fully on the GPU) sets the bar."""
    # -lv 4: the split count is logged at info level
    f16 = splits(perplexity(model, text, "f16", "-ngl", "99", "-lv", "4"))
    assert splits(perplexity(model, text, kv_type, "-ngl", "99", "-lv", "4")) <= f16


@dataclass(frozen=True)
class Change:
    """How far a run's token distributions are from a base run's (llama-perplexity --kl-divergence)."""

    kld: float  # mean KL divergence
    flipped: float  # percent of tokens whose top token differs

    @property
    def within_rounding(self) -> bool:
        return self.flipped < 1.0


def measure(model: Path, text: Path, kv_type: str, base: Path, args: list[str]) -> Change:
    out = perplexity(model, text, kv_type, "--kl-divergence-base", str(base), "--kl-divergence", *args)
    same_top = float(re.search(r"Same top p:\s+([0-9.]+)", out).group(1))
    return Change(float(re.search(r"Mean\s+KLD:\s+([-0-9.e]+)", out).group(1)), 100.0 - same_top)


def kl_divergence(model: Path, text: Path, kv_type: str, base: Path, base_args: list[str], args: list[str]) -> Change:
    """A run's change from a base run of the same type (base_args), written to `base` first."""
    perplexity(model, text, kv_type, "--kl-divergence-base", str(base), *base_args)
    return measure(model, text, kv_type, base, args)


@pytest.mark.parametrize("kv_type", KIVI)
def test_gpu_logits_match_the_cpu(kv_type: str, model: Path, text: Path, tmp_path: Path, prefill: str) -> None:
    """Same model, same chunks, same prefill path, CPU against GPU: KL divergence of the GPU's token
    distributions from the CPU's must be at the level of float summation order (fp16 for flash attention),
    far below what quantization itself costs."""
    change = kl_divergence(model, text, kv_type, tmp_path / "cpu.bin", ["-ngl", "0"], ["-ngl", "99"])
    assert change.within_rounding and change.kld < (1e-4 if prefill == "fused" else 1e-3), change


def within_f16s_own_change(model: Path, text: Path, kv_type: str, tmp_path: Path, base_args: list[str],
                           args: list[str]) -> None:
    """cuBLAS picks its matmul kernels by shape, so on a GPU no KV type, f16 included, keeps bit-equal logits when
    the batches change shape; a kivi type may add the codes that those roundings flip, and nothing of its own:
    its KL divergence between the two shapes stays at rounding level (1e-3, the flash prefill's bar), within 10x
    f16's between the same two shapes, or within device.QUANTIZATION_SHARE times the quantization's own (the kivi
    run against the f16 base): one flipped 1-bit code moves a value by its group's whole range, and the flips
    compound layer by layer, so two shapes of kivi1 are two draws of its quantization error (the H200 measured
    KL 0.216 between them against 0.136 from f16, 5.8e-4 for f16's own). A flipped code moves a near-tie's top
    token, more often the fewer the bits: the tokens whose top changes stay under 1%, 10x f16's share, or
    device.QUANTIZATION_SHARE times the share the quantization itself changes (kivi1 on the H200: 1.8%)."""
    tmp_path.mkdir(exist_ok=True)
    f16_base = tmp_path / "f16.bin"
    f16 = kl_divergence(model, text, "f16", f16_base, base_args, args)
    kivi = kl_divergence(model, text, kv_type, tmp_path / f"{kv_type}.bin", base_args, args)
    quantization = measure(model, text, kv_type, f16_base, base_args)
    detail = f"{kv_type} between the shapes {kivi}, f16's {f16}, the quantization's own {quantization}"
    assert f16.within_rounding, detail
    assert kivi.kld < max(1e-3, 10 * f16.kld, device.QUANTIZATION_SHARE * quantization.kld), detail
    assert kivi.flipped < max(1.0, 10 * f16.flipped, device.QUANTIZATION_SHARE * quantization.flipped), detail


@pytest.mark.parametrize("kv_type", KIVI)
def test_batching_changes_gpu_logits_as_f16s_rounding_does(kv_type: str, model: Path, text: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_KVQ_FA_PREFILL", PREFILL["fused"])
    for ubatch in ("37", "1"):
        within_f16s_own_change(model, text, kv_type, tmp_path / f"ub{ubatch}", ["-ngl", "99", "-ub", str(CTX)],
                               ["-ngl", "99", "-ub", ubatch])


@pytest.mark.parametrize("kv_type", KIVI)
def test_flash_prefill_batching_changes_gpu_logits_by_rounding_only(kv_type: str, model: Path, text: Path,
                                                                     tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Flash attention's fp16 values depend on the batch layout only through rounding: -ub 512 against -ub 128
    (both flash attention), and two sequences per batch against one."""
    monkeypatch.setenv("LLAMA_KVQ_FA_PREFILL", PREFILL["flash"])
    for name, args in (("ub", ["-ub", "128"]), ("seq", ["-b", str(2 * CTX)])):
        change = kl_divergence(model, text, kv_type, tmp_path / f"{name}.bin", ["-ngl", "99"], ["-ngl", "99", *args])
        assert change.within_rounding and change.kld < 1e-3, (name, change)


@pytest.mark.parametrize("kv_type", KIVI)
def test_sequences_in_one_batch_change_gpu_logits_as_f16s_rounding_does(kv_type: str, model: Path, text: Path,
                                                                       tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """-b 2*c: llama-perplexity decodes two chunks as two sequences (per-sequence streams) in the same batches,
    through the fused kernel."""
    monkeypatch.setenv("LLAMA_KVQ_FA_PREFILL", PREFILL["fused"])
    within_f16s_own_change(model, text, kv_type, tmp_path, ["-ngl", "99"], ["-ngl", "99", "-b", str(2 * CTX)])
