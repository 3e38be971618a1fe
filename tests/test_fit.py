"""-fit (on by default, as in llama.cpp's tools): `pykvq run`'s layers that -ngl leaves unset and a context of -c 0
fitted to the memory a device keeps free, through upstream's own fit (common_fit_params), kivi caches measured as
they are; `pykvq calibrate`'s layers the same way, and `pykvq perplexity`'s -fit and -fitt passed to
llama-perplexity's own fit. An RPC server's device is ggml's CPU device, which reports its machine's whole memory
as free: a margin (-fitt) of that total less a budget leaves the device the budget (and the sub-MiB remainder of the
machine's memory, which -fitt's whole MiB cannot take away), the same on every run."""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from pykvq import ContextConfig, KvConfig, LlamaError, fit_placement

# the RPC device serves CPU kernels, and the host-memory cases fit the CPU: no GPU in any run
pytestmark = pytest.mark.usefixtures("cpu_only")

MIB = 1024 * 1024
PROMPT = ["-p", "The capital of France is", "-n", "4", "--temp", "0", "-t", "2"]
SMOLLM2_N_CTX_TRAIN = 8192

FITTED = re.compile(r"fitted to free memory, keeping \S+ MiB free \(-fitt\): (every layer|-ngl (\d+)), -c (\d+)")
DEVICE_BUFFER = re.compile(r"RPC0\[[^\]]+\] (model|KV|compute) buffer size = +([\d.]+) MiB")
OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers")


def total_bytes() -> int:
    """What ggml's CPU device reports as its memory, all of it free (ggml-cpu.cpp, Linux)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def total_mib() -> int:
    return total_bytes() // MIB


@dataclass(frozen=True)
class Fitted:
    n_gpu_layers: int | None  # None: every layer
    n_ctx: int
    device_mib: float  # what the loaded model and context hold on the RPC device (weights, KV, compute)
    offloaded: int
    stderr: str


def run(model: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["pykvq", "-v", "run", "-m", str(model), *PROMPT, *args], capture_output=True, text=True,
                          timeout=300)


def device_mib(log: str) -> float:
    """What the first model and context a log loads hold on the RPC device: the weights, the KV caches (two in an
    iSWA cache), then the compute buffer, which ends the context's creation."""
    total = 0.0
    for kind, size in DEVICE_BUFFER.findall(log):
        total += float(size)
        if kind == "compute":
            break
    return total


def run_fitted(model: Path, *args: str) -> Fitted:
    proc = run(model, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fitted = FITTED.search(proc.stderr)
    assert fitted, proc.stderr[-3000:]
    # the lines after the fit's are the real model and context's (the fit's own probes allocate nothing)
    loaded = proc.stderr[fitted.end():]
    offloaded = OFFLOADED.findall(loaded)
    return Fitted(None if fitted[2] is None else int(fitted[2]), int(fitted[3]), device_mib(loaded),
                  int(offloaded[0][0]) if offloaded else 0, proc.stderr)


def budget_args(budget_mib: int) -> list[str]:
    return ["-fitt", str(total_mib() - budget_mib)]


def device_budget(budget_mib: int) -> float:
    """What budget_args(budget_mib) leaves the device, in MiB: upstream's fit compares bytes, and the machine's
    memory is no whole number of MiB (on a machine of 24105.07 MiB it filled a budget of 100 to 100.07)."""
    return total_bytes() / MIB - (total_mib() - budget_mib)


# device_mib adds buffer sizes the log prints to 0.01 MiB: up to four of them in a context
LOGGED_ROUNDING_MIB = 0.02


def within(device_mib: float, budget_mib: int) -> bool:
    return 0 < device_mib <= device_budget(budget_mib) + LOGGED_ROUNDING_MIB


def test_with_room_every_layer_goes_to_the_device_and_c_0_is_the_training_context(rpc_server: str,
                                                                                  smollm2: Path) -> None:
    got = run_fitted(smollm2, "--rpc", rpc_server, "--kv-type", "kivi2", "-c", "0", "-fitt", "0")
    assert (got.n_gpu_layers, got.n_ctx, got.offloaded) == (None, SMOLLM2_N_CTX_TRAIN, 31)
    assert f"for {SMOLLM2_N_CTX_TRAIN} cells" in got.stderr


def test_a_small_budget_keeps_some_layers_on_the_cpu_and_the_device_within_it(rpc_server: str,
                                                                              smollm2: Path) -> None:
    """155 MiB: the compute buffer (97 MiB) and the kivi2 cache leave room for about a third of the weights."""
    budget = 155
    got = run_fitted(smollm2, "--rpc", rpc_server, "--kv-type", "kivi2", "-c", "2048", *budget_args(budget))
    assert got.n_gpu_layers is not None and 0 < got.n_gpu_layers < 31
    assert got.offloaded == got.n_gpu_layers
    assert within(got.device_mib, budget)
    # one layer more would not have fitted: the fit fills the device
    more = run(smollm2, "--rpc", rpc_server, "--kv-type", "kivi2", "-c", "2048", "-fit", "off",
               "-ngl", str(got.n_gpu_layers + 1))
    assert more.returncode == 0, more.stderr[-3000:]
    assert device_mib(more.stderr) > device_budget(budget)


def test_kivi2_fits_a_context_four_times_f16s_in_the_same_device_memory(rpc_server: str, smollm2: Path) -> None:
    """The point of a 2-bit cache: with -c 0, the same 230 MiB of device memory hold SmolLM2's whole training
    context in kivi2 (weights 92 MiB, compute 97, cache 37) and less than a quarter of it in f16. -fitc 512 keeps
    the least context the fit measures at least a ubatch, whose compute buffer is the full one: upstream's fit
    interpolates the context between its two measurements, and would overshoot a smaller one's."""
    budget = 230
    fitted = {kv: run_fitted(smollm2, "--rpc", rpc_server, "--kv-type", kv, "-c", "0", "-fitc", "512",
                             *budget_args(budget)) for kv in ("f16", "kivi2")}
    for got in fitted.values():
        assert (got.n_gpu_layers, got.offloaded) == (None, 31)
        assert within(got.device_mib, budget)
    assert fitted["kivi2"].n_ctx == SMOLLM2_N_CTX_TRAIN
    assert 512 <= fitted["f16"].n_ctx <= SMOLLM2_N_CTX_TRAIN // 4


def test_on_gemma3_kivi2_fits_the_training_context_where_f16_fits_less_than_half(rpc_server: str,
                                                                                 gemma3_270m: Path) -> None:
    """Upstream's iSWA cache, kivi in both of its caches: the global layers' cache grows with the context, the
    sliding-window one stays a window; the 800 MiB budget holds 513 MiB of compute (a 262k-token vocabulary's
    logits) and 240 of weights, leaving f16 13.8k of the 32k tokens. Upstream's fit interpolates a reduced context
    between two measurements, which f16's sliding-window cache (capped at the window) bends: f16 overshoots by 4 MiB
    (0.5%); kivi2's whole context is measured, not interpolated."""
    budget = 800
    fitted = {kv: run_fitted(gemma3_270m, "--rpc", rpc_server, "--kv-type", kv, "-c", "0", "-fitc", "512",
                             *budget_args(budget)) for kv in ("f16", "kivi2")}
    n_ctx_train = 32768
    for got in fitted.values():
        assert got.n_gpu_layers is None
    assert within(fitted["kivi2"].device_mib, budget)
    assert 0 < fitted["f16"].device_mib <= budget * 1.01
    assert fitted["kivi2"].n_ctx == n_ctx_train
    assert 512 <= fitted["f16"].n_ctx <= n_ctx_train // 2


def test_an_unset_context_is_fitted_to_host_memory_without_a_device(smollm2: Path) -> None:
    """No GPU and no --rpc: -c 0 is reduced to what the machine's memory keeps free, as llama.cpp's tools do."""
    got = run_fitted(smollm2, "--kv-type", "kivi2", "-c", "0", "-fitc", "512", *budget_args(200))
    assert got.n_gpu_layers == 0
    assert 512 <= got.n_ctx < SMOLLM2_N_CTX_TRAIN
    assert f"for {got.n_ctx} cells" in got.stderr


def test_fit_off_loads_what_was_asked(rpc_server: str, smollm2: Path) -> None:
    proc = run(smollm2, "--rpc", rpc_server, "--kv-type", "kivi2", "-c", "0", "-fit", "off", *budget_args(155))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fitted to free memory" not in proc.stderr
    assert OFFLOADED.findall(proc.stderr)[-1] == ("31", "31")  # the weights' load, after the settings' check
    assert f"for {SMOLLM2_N_CTX_TRAIN} cells" in proc.stderr


def test_given_layers_and_context_are_not_fitted(rpc_server: str, smollm2: Path) -> None:
    proc = run(smollm2, "--rpc", rpc_server, "-ngl", "5", "-c", "512", *budget_args(100))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fitted to free memory" not in proc.stderr
    assert OFFLOADED.findall(proc.stderr)[-1] == ("5", "31")


def test_a_budget_nothing_fits_is_a_warning_and_the_run_goes_on(smollm2: Path) -> None:
    """llama.cpp's behaviour: what was asked is loaded all the same (host memory, here, is really there)."""
    proc = run(smollm2, "-c", "0", "-fitc", str(SMOLLM2_N_CTX_TRAIN), "-fitt", str(total_mib()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"nothing keeps {total_mib()} MiB free (-fitt): loading -ngl 0, -c {SMOLLM2_N_CTX_TRAIN}" in proc.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["-fitt", "-5"], "a margin cannot be negative"),
    (["-fitt", "1G"], "expected MiB or MiB0,MiB1,..."),
    (["-fit", "maybe"], "expected on or off"),
    (["-fitc", "0", "-c", "0"], "--fit-ctx must be a positive number of tokens"),
    (["-c", "-1"], "-c must be 0 (the model's training context) or a positive number of tokens"),
])
def test_bad_fit_settings_are_one_clear_error(smollm2: Path, args: list[str], message: str) -> None:
    proc = subprocess.run(["pykvq", "run", "-m", str(smollm2), *PROMPT, *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_fit_placement_refuses_more_margins_than_devices(smollm2: Path) -> None:
    with pytest.raises(LlamaError, match="one per device"):
        fit_placement(smollm2, ContextConfig(n_ctx=512, kv=KvConfig()), margin_mib=[0] * 1000)


def test_calibrate_fits_its_layers_to_the_budget(rpc_server: str, smollm2: Path, hamlet: Path,
                                                 tmp_path: Path) -> None:
    """calibrate's widest context (here the 64-token f16 reference, in one ubatch) and as many layers as fit."""
    budget = 80
    proc = subprocess.run(["pykvq", "-v", "calibrate", "-m", str(smollm2), "-f", str(hamlet), "-o",
                           str(tmp_path / "out.gguf"), "-c", "64", "--recall", "8", "--kv-window", "16", "--kv-sinks",
                           "0", "--kv-clip", "none", "--kv-rotate", "off", "--kv-dither", "none", "--refine", "0",
                           "-t", "2", "--rpc", rpc_server, *budget_args(budget)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fitted = FITTED.search(proc.stderr)
    assert fitted and fitted[2] is not None and 0 < int(fitted[2]) < 31, proc.stderr[-3000:]
    loaded = proc.stderr[fitted.end():]
    assert OFFLOADED.findall(loaded)[0] == (fitted[2], "31")
    # the first context is the f16 reference, the widest
    assert within(device_mib(loaded), budget)


@pytest.mark.parametrize("fit", ["on", "off"])
def test_perplexity_passes_fit_and_its_target_to_llama_perplexity(rpc_server: str, smollm2: Path, hamlet: Path,
                                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  fit: str) -> None:
    monkeypatch.delenv("LLAMA_ARG_N_GPU_LAYERS")  # llama-perplexity's own default is the case judged
    out = tmp_path / "ppl"
    proc = subprocess.run(["pykvq", "-v", "perplexity", "-m", str(smollm2), "-f", str(hamlet), "-c", "128",
                           "--chunks", "1", "-t", "2", "--kv-types", "kivi2", "--rpc", rpc_server, "-fit", fit,
                           *budget_args(100), "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tool_log = proc.stderr[proc.stderr.index("llama-perplexity's output:"):]
    offloaded = int(OFFLOADED.findall(tool_log)[0][0])
    settings = json.loads(out.with_suffix(".json").read_text())["settings"]
    assert (settings["fit"], settings["fit_target"]) == (fit == "on", [total_mib() - 100])
    if fit == "on":
        assert 0 < offloaded < 31
        assert within(device_mib(tool_log), 100)
    else:
        assert offloaded == 31
