"""Model families refused with their reason rather than crashed on or answered wrongly, on random-weight models of
their shapes (pykvq/devtools/random_model.py): T5's relative position biases are not computed by the kivi kernels:
refused in llama.cpp's tools, which run encoder-decoder models; pykvq's own contexts decode without encoding, so they
refuse such a model whatever the KV type (llama.cpp aborted the process at the first decode), as does
pykvq.llama_cpp.Llama (llama-cpp-python never encodes either). (Multi-head latent attention, refused here before,
runs on kivi caches: tests/test_latent_attention.py.)"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

from pykvq import llama_tools
from pykvq.devtools import random_model

import device


def written(tmp_path_factory: pytest.TempPathFactory, shape: str) -> Path:
    path = tmp_path_factory.mktemp("refused") / f"{shape}.gguf"
    random_model.write(random_model.SHAPES[shape], path)
    return path


@pytest.fixture(scope="module")
def t5_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return written(tmp_path_factory, "t5-small")


def pykvq_run(model: Path, kv_type: str) -> subprocess.CompletedProcess:
    return subprocess.run(["pykvq", "run", *device.TOOL_ARGS, "-t", "2", "-m", str(model), "--kv-type", kv_type,
                           "-p", "<t7>", "-n", "4"], capture_output=True, text=True)


def completion(model: Path, kv_type: str) -> str:
    """llama.cpp's llama-completion, which encodes the prompt of an encoder-decoder model before decoding."""
    return llama_tools.run_tool("llama-completion", ["-m", str(model), "-p", "<t7> <t8>", "-n", "4", "-no-cnv",
                                                     "--temp", "0", "-t", "2", "-fa", "on", "-ctk", kv_type,
                                                     "-ctv", kv_type, *device.TOOL_ARGS], timeout=120)


def test_llama_completion_refuses_kivi_on_relative_position_biases(t5_path: Path) -> None:
    completion(t5_path, "f16")
    with pytest.raises(llama_tools.ToolError, match=r"exited with status 1: .*relative position biases \(T5\), "
                                                    r"which kivi types do not support yet"):
        completion(t5_path, "kivi2")


@pytest.mark.parametrize("kv_type", ["f16", "kivi2"])
def test_pykvq_refuses_an_encoder_decoder_model(t5_path: Path, kv_type: str) -> None:
    proc = pykvq_run(t5_path, kv_type)
    assert proc.returncode == 1
    assert "is an encoder-decoder model (T5), and pykvq runs decoder-only models" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_llama_cpp_python_refuses_an_encoder_decoder_model(t5_path: Path) -> None:
    """llama-cpp-python never calls llama_encode: its first eval aborted the process."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (.ci/run installs it)")
    from pykvq.llama_cpp import Llama
    with pytest.raises(ValueError, match=r"is an encoder-decoder model \(T5\): llama-cpp-python decodes it without "
                                         r"encoding"):
        Llama(model_path=str(t5_path), n_ctx=256, n_threads=2, verbose=False, **device.LLAMA_KWARGS)
