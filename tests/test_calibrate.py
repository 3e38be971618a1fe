"""`pykvq calibrate`: sensitivities (from the f16 run's attention, or measured) to a per-layer mix in a GGUF copy that
run then uses."""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pykvq import gguf_metadata, kv_types, width_clips
from pykvq.bindings import native
from pykvq.calibration import attention_sensitivity, clip_ratios, held_out, window_choice
from pykvq.calibration.allocation import BITS, PARTS, budget_argument
from pykvq.commands import calibrate as calibrate_command
from pykvq.devtools import random_model

import device

N_LAYER = 30


def calibrate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["pykvq", "calibrate", "-t", "2", *device.TOOL_ARGS, *args], capture_output=True, text=True,
                          cwd=cwd, timeout=900)


def assert_the_held_out_check_decided(meta: dict, stdout: str, n_tokens: int, n_layer: int = N_LAYER) -> None:
    """The refined mix was checked on n_tokens of held-out text unless it was kivi2 everywhere, and the copy holds
    the one of the two that measured lower there."""
    types_k, types_v = kv_types.layer_types(meta[gguf_metadata.KEY_LAYERS], n_layer, "kivi2", "kivi2")
    uniform = set(types_k + types_v) == {"kivi2"}
    if meta["kvq.calibration.held_out"] == 0:
        assert uniform and "the refined mix on" not in stdout
        return
    assert meta["kvq.calibration.held_out"] == n_tokens and f"the refined mix on {n_tokens} held-out tokens" in stdout
    mix, everywhere = meta["kvq.calibration.held_out_kld"]
    assert (mix > everywhere) == uniform == ("kivi2 everywhere taken instead" in stdout)


@pytest.mark.slow
def test_calibrate_writes_a_mix_within_budget_that_run_uses(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    out = tmp_path / "calibrated.gguf"
    proc = calibrate("-m", str(smollm2), "-f", str(hamlet), "-o", str(out), "--kv-budget", "2.0", "-c", "64",
                     "--recall", "8", "--kv-window", "16", "--kv-select", "0.25,0.25,32", "--retrieval", "1",
                     "--retrieval-ctx", "160", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    meta = gguf_metadata.read_kvq(out)
    # recorded for every entry point; a prompt shorter than the window (below) is kept whole, not refused
    assert meta[gguf_metadata.KEY_SELECT] == "0.25,0.25,32"
    assert meta["kvq.kv_budget"] == pytest.approx(2.0) and meta["kvq.calibration.n_tokens"] == 64
    assert meta[gguf_metadata.KEY_RECALL] == 8
    # the refined mixes are judged on the probe and a pass-key prompt too
    assert meta["kvq.calibration.retrieval"] == 1 and meta["kvq.calibration.retrieval_ctx"] == 160
    assert "+ pass-key answers" in proc.stdout
    # the mixes kept within kivi2 everywhere's divergence on the text (the budget affords it)
    assert "a mix's prose divergence kept within kivi2 everywhere's" in proc.stdout
    assert_the_held_out_check_decided(meta, proc.stdout, 64 * held_out.CHUNKS)
    # the clip choice held against each part's runner-up on the same held-out text, and the copy's kivi2 ratios
    # the checked choice
    checked = next(line for line in proc.stdout.splitlines() if line.startswith("each part's clip choice against"))
    assert f"its runner-up on {64 * held_out.CHUNKS} held-out tokens" in checked and "; K " in checked
    assert checked.endswith(f"-> --kv-clip '{meta[gguf_metadata.KEY_KIVI2_CLIP]}'")
    assert all(len(meta[f"kvq.calibration.kld_{p}_{w}"]) == N_LAYER for p in "kv" for w in ("kivi4", "kivi1"))
    assert meta["kvq.calibration.sensitivity"] == "attention"
    # the window given is the one measured at, and the copy's
    assert meta[gguf_metadata.KEY_WINDOW] == 16 and gguf_metadata.KEY_WINDOW_CTX not in meta
    sinks = meta[gguf_metadata.KEY_SINKS]
    assert sinks in calibrate_command.SINK_CANDIDATES and meta["kvq.calibration.sinks"] == sinks
    assert f"-> {sinks} sinks" in proc.stdout
    # the clip ratios chosen for kivi2 everywhere; the mix takes each tensor's at its width
    assert f"-> --kv-clip '{meta['kvq.calibration.kivi2_clip']}'" in proc.stdout
    clip = meta.get(gguf_metadata.KEY_CLIP, "none")
    assert f"--kv-clip '{clip}' (each tensor at its width's ratio)" in proc.stdout
    # each width's ratios, from which a cache of other types takes its tensors' (and the mix's give its kvq.kv_clip)
    types = kv_types.layer_types(meta[gguf_metadata.KEY_LAYERS], N_LAYER, "kivi2", "kivi2")
    assert native.resolve_clip(width_clips.clip_by_width(meta, *types), N_LAYER) == native.resolve_clip(clip, N_LAYER)
    # the rotation measured lowest among none, all and per layer (left out when none)
    rotate = meta.get(gguf_metadata.KEY_ROTATE, "off")
    assert f"-> --kv-rotate '{rotate}'" in proc.stdout and "off: " in proc.stdout and "on: " in proc.stdout
    # V's dither measured on the finished mix, nearest among the candidates (left out when chosen)
    dither = meta.get(gguf_metadata.KEY_DITHER, "none")
    assert f"-> --kv-dither '{dither}'" in proc.stdout and "V dither: none: " in proc.stdout
    types_k, types_v = kv_types.layer_types(meta[gguf_metadata.KEY_LAYERS], N_LAYER, "kivi2", "kivi2")
    bits = [BITS[t] for t in types_k + types_v]
    assert sum(bits) / len(bits) <= 2.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibrated.gguf"]  # no temporary file left
    run = subprocess.run(["pykvq", "run", *device.TOOL_ARGS,
                          "-m", str(out), "-p", "Hello", "-n", "4", "-c", "256", "-t", "2"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0 and f"KV cache layers {meta[gguf_metadata.KEY_LAYERS]}" in run.stderr
    assert f"(window 16, sinks {sinks}" in run.stderr
    assert clip == "none" or f"clip {clip}" in run.stderr
    assert rotate == "off" or ("rotated" if rotate == "on" else f"rotation {rotate}") in run.stderr
    assert dither == "none" or f"V dither {dither}" in run.stderr
    # a type given wins over the mix, as --kv-layers does
    run = subprocess.run(["pykvq", "run", *device.TOOL_ARGS, "-m", str(out), "-p", "Hello", "-n", "4", "-c", "256",
                          "-t", "2", "--kv-type", "q8_0"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0 and "KV cache K q8_0, V q8_0" in run.stderr, run.stderr
    assert "the model's kvq.kv_layers is not used: the command line gives the setting" in run.stderr


@pytest.mark.parametrize(("shape", "kv_layers"), [
    ("lfm2-small", [1, 3]),        # a hybrid: convolutions in layers 0 and 2
    ("gemma4-small", [0, 1, 2, 3]),  # layers 4-7 read layers 2's and 3's caches; head sizes 64 and 128
], ids=["hybrid", "shared-kv"])
def test_calibrate_takes_the_layers_the_cache_holds(shape: str, kv_layers: list[int], hamlet: Path,
                                                    tmp_path: Path) -> None:
    """Models whose layers do not all keep K and V: pykvq calibrate stopped at the first ("no Qcur tensor in layer
    0"), or on Gemma 4 with numpy's shape error. Only the layers the cache holds are weighed, the budget is theirs,
    and the others take kivi2, which reads alike there, in the written spec."""
    model, out = tmp_path / f"{shape}.gguf", tmp_path / "calibrated.gguf"
    random_model.write(random_model.SHAPES[shape], model)
    n_layer = random_model.SHAPES[shape].n_layer
    proc = calibrate("-m", str(model), "-f", str(hamlet), "-o", str(out), "--kv-budget", "2.5", "-c", "128",
                     "--recall", "16", "--kv-window", "16", "--kv-sinks", "0", "--refine", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "measured for the additive choice" in proc.stdout and "pass-key" not in proc.stdout  # none measured
    meta = gguf_metadata.read_kvq(out)
    types_k, types_v = kv_types.layer_types(meta[gguf_metadata.KEY_LAYERS], n_layer, "kivi2", "kivi2")
    held = [BITS[types[il]] for types in (types_k, types_v) for il in kv_layers]
    assert sum(held) / len(held) <= 2.5 and max(held) == 4
    assert_the_held_out_check_decided(meta, proc.stdout, 128 * held_out.CHUNKS, n_layer)
    assert all(types_k[il] == types_v[il] == "kivi2" for il in range(n_layer) if il not in kv_layers)
    for name in (f"kvq.calibration.kld_{p}_{w}" for p in "kv" for w in ("kivi4", "kivi1")):
        assert len(meta[name]) == n_layer and all(meta[name][il] == 0.0 for il in range(n_layer) if il not in kv_layers)
    run = subprocess.run(["pykvq", "run", *device.TOOL_ARGS, "-m", str(out), "-p", "<t7> <t8>", "-n", "4", "-c", "256",
                          "-t", "2"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0 and f"KV cache layers {meta[gguf_metadata.KEY_LAYERS]}" in run.stderr, run.stderr


@pytest.mark.parametrize("case, message", [
    ("budget", "--kv-budget 0.5 is below what any mix reaches"),
    ("budget-above-kivi4", "--kv-budget 5 is above what any mix spends (4 bits: kivi4 everywhere"),
    ("same-file", "-o must name a new file"),
    ("no-text", "calibration text file not found"),
    ("short-text", "the calibration text has"),
    ("not-gguf", "notes.gguf is not a readable GGUF file"),
    ("bad-clip", "'1.5' is not a clip ratio in (0, 1]"),
    ("clip-layers", "the model has 30 layers"),
    ("bad-rotate", "'sometimes' is not on or off"),
    ("rotate-layers", "the model has 30 layers"),
    ("bad-dither", "has a k: part: K's codes are always rounded to nearest"),
    ("recall-near", "--recall 400 with -c 512: the recalled tokens would lie 104 tokens back"),
    ("recall-all", "--recall 512: give 0 (none) up to fewer than the -c 512 tokens"),
    ("window-ctx", "--kv-window-ctx 0: give the context length the model will run at"),
    ("window-short", "-c 64 is too short to choose a window among 32, 64, 128, 256"),
    ("window-ctx-fixed", "--kv-window-ctx prices the windows --kv-window auto weighs"),
    ("retrieval-negative", "--retrieval -1: the number of pass-key prompts is 0 or more"),
    ("retrieval-short", "--retrieval-ctx 100: the pass-key prompts need more than the 128-token fp16 window"),
    ("retrieval-long", "--retrieval-ctx 100000 is longer than the model's training context"),
    ("retrieval-ctx-alone", "--retrieval-ctx sizes the pass-key prompts of --retrieval N"),
    # each of these was taken, and failed (or measured nothing) only after the whole run
    ("output-is-text", "is the calibration text"),
    ("output-is-folder", "is a folder: name the GGUF file to write"),
    ("output-unwritable", "a new file cannot be written in /proc"),
    ("sinks-past-probe", "--kv-sinks 99999 with a 128-token window leaves no token of the -c 512 probe quantized"),
    ("no-tokens", "-c 0: give the number of calibration tokens"),
    ("no-threads", "-t 0: give 1 thread or more"),
    ("retrieval-unrefined", "--retrieval judges the refined mixes: give --refine 1 or more"),
    ("kvq-version", "kvq.* metadata version 99; this pykvq reads versions 1 to 4"),
])
def test_bad_input_is_one_clear_error(case: str, message: str, smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be.")
    notes = tmp_path / "notes.gguf"
    notes.write_text("not a model\n" * 20)
    out = str(tmp_path / "out.gguf")
    mine = tmp_path / "mine.txt"
    shutil.copy(hamlet, mine)
    if case == "kvq-version":
        gguf_metadata.write_copy(smollm2, tmp_path / "future.gguf", {gguf_metadata.KEY_VERSION: 99})
    args = {
        "budget": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--kv-budget", "0.5"],
        "budget-above-kivi4": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--kv-budget", "5"],
        "same-file": ["-m", str(smollm2), "-f", str(hamlet), "-o", str(smollm2)],
        "no-text": ["-m", str(smollm2), "-f", str(tmp_path / "missing.txt"), "-o", out],
        "short-text": ["-m", str(smollm2), "-f", str(short), "-o", out],
        "not-gguf": ["-m", str(notes), "-f", str(hamlet), "-o", out],
        "bad-clip": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--kv-clip", "k:*=1.5"],
        "clip-layers": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--kv-clip", "v:0-31=0.9"],
        "bad-rotate": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--kv-rotate", "k:*=sometimes"],
        "rotate-layers": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--kv-rotate", "v:0-31=on"],
        "bad-dither": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--kv-dither", "k:*=1"],
        "recall-near": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--recall", "400"],
        "recall-all": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--recall", "512"],
        "window-ctx": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--kv-window-ctx", "0"],
        "window-short": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "-c", "64", "--recall", "0",
                         "--kv-window", "auto"],
        "window-ctx-fixed": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--kv-window-ctx", "4096"],
        "retrieval-negative": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--retrieval", "-1"],
        "retrieval-short": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--retrieval", "2",
                            "--retrieval-ctx", "100"],
        "retrieval-long": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--retrieval", "2",
                           "--retrieval-ctx", "100000"],
        "retrieval-ctx-alone": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--retrieval-ctx", "2048"],
        "output-is-text": ["-m", str(smollm2), "-f", str(mine), "-o", str(tmp_path / "sub" / ".." / mine.name)],
        "output-is-folder": ["-m", str(smollm2), "-f", str(hamlet), "-o", str(tmp_path)],
        "output-unwritable": ["-m", str(smollm2), "-f", str(hamlet), "-o", "/proc/out.gguf"],
        "sinks-past-probe": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--kv-sinks", "99999"],
        "no-tokens": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "-c", "0"],
        "no-threads": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "-t", "0"],
        "retrieval-unrefined": ["-m", str(smollm2), "-f", str(hamlet), "-o", out, "--refine", "0", "--retrieval", "2",
                                "--retrieval-ctx", "100000"],
        "kvq-version": ["-m", str(tmp_path / "future.gguf"), "-f", str(hamlet), "-o", out, "--kv-clip", "none"],
    }[case]
    proc = calibrate(*args, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pykvq: error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert not (tmp_path / "out.gguf").exists()
    assert mine.read_bytes() == hamlet.read_bytes()


CHEAP = ("-c", "128", "--refine", "0", "--kv-window", "16", "--kv-sinks", "0", "--kv-clip", "none", "--kv-rotate",
         "off", "--kv-dither", "none")


def test_a_failed_calibration_removes_the_folders_it_made(smollm2: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be.")
    proc = calibrate("-m", str(smollm2), "-f", str(short), "-o", str(tmp_path / "new" / "sub" / "out.gguf"), *CHEAP,
                     cwd=tmp_path)
    assert proc.returncode == 1 and "the calibration text has" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]


# the model work runs as it is; SIGTERM arrives while the copy is half written (its first tensor), as from a
# scheduler's kill: cli.main turns it into an exception, and every cleanup on the way out runs
SIGTERM_WHILE_WRITING = """
import os, signal, sys
from pykvq.bindings import gguf_py
from pykvq.commands import cli
writer = gguf_py.gguf().GGUFWriter
write = writer.write_tensor_data
def interrupted(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return write(self, *args, **kwargs)
writer.write_tensor_data = interrupted
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigterm_while_writing_leaves_nothing_behind(hamlet: Path, tmp_path: Path) -> None:
    model = tmp_path / "tiny.gguf"
    random_model.write(random_model.SHAPES["tiny"], model)
    proc = subprocess.run([sys.executable, "-c", SIGTERM_WHILE_WRITING, "calibrate", "-t", "2", *device.TOOL_ARGS,
                           "-m", str(model), "-f", str(hamlet), "-o", str(tmp_path / "new" / "out.gguf"), *CHEAP],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    # without --retrieval no empty pass-key bar; the temporary copy's name is never shown
    assert "pass-key reference" not in proc.stderr and ".part" not in proc.stderr, proc.stderr[-2000:]
    # neither the half-written .part copy nor the folder made for it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


@pytest.mark.parametrize("command", ["calibrate", "convert"])
@pytest.mark.parametrize("budget", ["inf", "nan"])
def test_a_budget_that_is_no_finite_number_is_refused_as_the_arguments_are_read(command: str, budget: str,
                                                                                tmp_path: Path) -> None:
    """inf failed with an OverflowError's traceback minutes later, nan with a cryptic error after the whole run."""
    inputs = ["-m", "model.gguf", "-f", "text.txt"] if command == "calibrate" else ["hf", "--calibrate", "text.txt"]
    proc = subprocess.run(["pykvq", command, *inputs, "-o", "out.gguf", "--kv-budget", budget], capture_output=True,
                          text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and f"argument --kv-budget: '{budget}' is not a finite number" in proc.stderr
    assert budget_argument("2.5") == 2.5


@pytest.mark.parametrize("window", [0, 1, 16, 31, 32, 33, 128])
@pytest.mark.parametrize("sinks", [0, 1, 8, 31, 32, 40])
def test_the_fewest_tokens_for_a_quantized_key_follow_the_cache_contract(window: int, sinks: int) -> None:
    fewest = clip_ratios.fewest_quantized_tokens(window, sinks)

    def quantizes(n: int) -> bool:
        contract = clip_ratios.Contract.of(n, window, sinks)
        return bool((contract.causal & ~contract.near_k).any())

    assert quantizes(fewest) and not quantizes(fewest - 1)


def test_the_probe_repeats_the_text_past_the_sinks_and_weighs_both_halves_alike() -> None:
    probe = calibrate_command.Probe(n_tokens=200, window=16, sinks=0, threads=1, recall=40)
    text = list(range(1000, 1300))
    tokens = probe.tokens(text)
    start = calibrate_command.RECALL_START
    assert tokens == text[:160] + text[start:start + 40] and len(tokens) == 200
    weights = probe.weights()
    assert weights.sum() == pytest.approx(1.0)
    assert weights[:160].sum() == pytest.approx(0.5) and weights[160:].sum() == pytest.approx(0.5)
    # without a recall span the text is the probe and every token weighs alike
    plain = calibrate_command.Probe(200, 16, 0, 1)
    assert plain.tokens(text) == text[:200] and np.allclose(plain.weights(), 1 / 200)


def test_the_divergence_is_the_weighted_mean_over_tokens() -> None:
    reference = np.log(np.array([[0.5, 0.5], [0.9, 0.1]]))
    other = np.log(np.array([[0.5, 0.5], [0.5, 0.5]]))
    second = 0.9 * np.log(0.9 / 0.5) + 0.1 * np.log(0.1 / 0.5)
    assert calibrate_command.mean_kld(reference, other, np.array([0.5, 0.5])) == pytest.approx(second / 2)
    assert calibrate_command.mean_kld(reference, other, np.array([0.0, 1.0])) == pytest.approx(second)


def test_the_fewest_sinks_within_the_tolerance_of_the_best_are_chosen() -> None:
    klds = {0: 1.0, 1: 0.6, 2: 0.495, 4: 0.49, 8: 0.489}
    assert calibrate_command.choose_sinks(klds) == 2
    assert calibrate_command.choose_sinks({0: 0.3, 4: 0.3}) == 0
    assert calibrate_command.choose_sinks({0: 0.0, 1: 0.0}) == 0


@pytest.mark.parametrize("text, wanted", [("auto", "auto"), ("0", 0), ("4", 4)])
def test_sinks_and_window_take_a_count_or_auto(text: str, wanted: int | str) -> None:
    assert calibrate_command.count_or_auto(text) == wanted


@pytest.mark.parametrize("text", ["-1", "four", ""])
def test_other_counts_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="neither a count"):
        calibrate_command.count_or_auto(text)


class ScriptedCalibrator(calibrate_command.Calibrator):
    """A Calibrator whose KL divergence is a given function of the mix and clip spec: no model runs."""

    def __init__(self, n_layer: int, kld, probe: calibrate_command.Probe | None = None) -> None:  # noqa: ANN001
        self.model = argparse.Namespace(n_layer=n_layer)
        self.layers = list(range(n_layer))
        self.parts = PARTS
        self.probe = probe or calibrate_command.Probe(64, 16, 0, 1)
        self.weights = self.probe.weights()
        self.calls: list[tuple[str, str | None]] = []
        self.windows: list[tuple[int | None, np.ndarray | None]] = []
        self._kld = kld

    def kld(self, layers: str, sinks: int | None = None, clip: str | None = None, rotate: str | None = None,
            window: int | None = None, weights: np.ndarray | None = None) -> float:
        self.calls.append((layers, clip))
        self.windows.append((window, weights))
        return self._kld(layers, clip) if window is None else self._kld(layers, clip, window)


def test_measured_sensitivities_move_one_tensor_at_a_time_at_its_widths_ratio() -> None:
    n_layer = 3
    price = {"kivi4": -0.01, "kivi2": 0.0, "kivi1": 0.1}

    def kld(layers: str, clip: str | None) -> float:
        types_k, types_v = kv_types.layer_types(layers, n_layer, "kivi2", "kivi2")
        # V of layer 2 is twice as sensitive as the rest
        return 0.5 + sum(price[t] for t in types_k + types_v) + price[types_v[2]]

    widths = [attention_sensitivity.WidthErrors(part, il, {}, {"kivi4": 1.0, "kivi2": 0.9, "kivi1": 0.7})
              for part in "kv" for il in range(n_layer)]
    calibrator = ScriptedCalibrator(n_layer, kld)
    costs = {(s.part, s.layer): s.cost for s in calibrator.measured_sensitivities(widths)}
    assert costs["k", 0] == pytest.approx({"kivi2": 0.0, "kivi4": -0.01, "kivi1": 0.1})
    assert costs["v", 2] == pytest.approx({"kivi2": 0.0, "kivi4": -0.02, "kivi1": 0.2})
    assert len(calibrator.calls) == 1 + 2 * 2 * n_layer
    assert ("k:0-2=kivi2;v:0=kivi1,1-2=kivi2", "k:0-2=0.9;v:0=0.7,1-2=0.9") in calibrator.calls


def test_the_window_is_judged_past_every_candidate_and_priced_by_what_bits_buy() -> None:
    n_layer = 2
    # kivi2's divergence falls with the window; kivi4 everywhere saves 0.02 at the probe's window
    by_window = {32: 0.050, 64: 0.040, 128: 0.030, 256: 0.025}

    def kld(layers: str, clip: str | None, window: int | None = None) -> float:
        return 0.010 if "kivi4" in layers else by_window[window or 128]

    probe = calibrate_command.Probe(512, 128, 4, 1, recall=128)
    calibrator = ScriptedCalibrator(n_layer, kld, probe)
    choice = calibrator.window_choice(target_ctx=2048)
    assert list(choice.klds) == [32, 64, 128, 256]
    # the divergences are taken over the tokens past the longest candidate and its tile, the recall span included
    weights = calibrator.windows[0][1]
    assert weights[:288].sum() == 0.0 and weights.sum() == pytest.approx(1.0)
    # the recall span keeps its weight against the text's 96 tokens left: 0.5 against 96 * 0.5 / 384
    assert weights[384:].sum() == pytest.approx(0.8)
    # kivi4 everywhere is measured unclipped: its own best ratio, not kivi2's
    assert calibrator.calls[-1] == ("k:0-1=kivi4;v:0-1=kivi4", "none")
    bits = {w: kv_types.bits_per_element("kivi2", 2048, w, 4) for w in by_window}
    assert choice.bits == pytest.approx(bits)
    per_bit = 0.020 / (kv_types.bits_per_element("kivi4", 2048, 128, 4) - bits[128])
    assert choice.kld_per_bit == pytest.approx(per_bit)
    # 256 measures lowest, but its extra fp16 cells would buy more as code bits at 2048 tokens
    assert choice.chosen == 128
    # at a long context the same cells cost little
    assert calibrator.window_choice(target_ctx=32768).chosen == 256


def test_a_window_that_buys_nothing_is_not_taken_and_ties_go_to_the_shorter() -> None:
    free = window_choice.WindowChoice(4096, {32: 0.01, 64: 0.01}, {32: 3.2, 64: 3.4}, 0.0)
    assert free.chosen == 32
    assert window_choice.kld_per_bit(0.01, 0.02, 128, 0, 4096) == 0.0


def test_the_probe_judges_only_windows_its_recall_span_reads_past() -> None:
    assert calibrate_command.Probe(512, 128, 0, 1, recall=128).window_candidates() == [32, 64, 128, 256]
    # the recall span reads 256 - 64 - 8 = 184 tokens back: 256 and its tile would cover it
    assert calibrate_command.Probe(256, 128, 0, 1, recall=64).window_candidates() == [32, 64, 128]
    with pytest.raises(ValueError, match="-c 64 is too short to choose a window"):
        calibrate_command.Probe(64, 16, 0, 1).window_candidates()
    with pytest.raises(ValueError, match="raise -c"):
        window_choice.scored_from(np.full(8, 1 / 8), 8)
