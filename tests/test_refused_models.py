"""Model families refused with their reason rather than crashed on or answered wrongly, on random-weight models of
their shapes (pykvq/devtools/random_model.py):

- multi-head latent attention (DeepSeek-V2/V3, Kimi, GLM-5: one compressed row per token, V read from K's cache)
  does not go through the kivi kernels: kivi types are refused when the context is made (they aborted the process
  in the first decode); upstream's types run, their memory reported as the cache really holds it;
- T5's relative position biases are not computed by the kivi kernels: refused in llama.cpp's tools, which run
  encoder-decoder models; pykvq's own contexts decode without encoding, so they refuse such a model whatever the
  KV type (llama.cpp aborted the process at the first decode), as does pykvq.llama_cpp.Llama (llama-cpp-python
  never encodes either)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from pykvq import KvConfig, LlamaError, Model, llama_tools
from pykvq.devtools import random_model

import device

MLA = random_model.SHAPES["deepseek2-mla-small"]


def written(tmp_path_factory: pytest.TempPathFactory, shape: str) -> Path:
    path = tmp_path_factory.mktemp("refused") / f"{shape}.gguf"
    random_model.write(random_model.SHAPES[shape], path)
    return path


@pytest.fixture(scope="module")
def mla_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return written(tmp_path_factory, "deepseek2-mla-small")


@pytest.fixture(scope="module")
def mla(mla_path: Path):
    with device.load_model(mla_path) as model:
        yield model


@pytest.fixture(scope="module")
def t5_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return written(tmp_path_factory, "t5-small")


def context(model: Model, kv: KvConfig):
    return model.context(device.context_config(n_ctx=256, n_threads=2, kv=kv, flash_attn="on"))


def pykvq_run(model: Path, kv_type: str) -> subprocess.CompletedProcess:
    return subprocess.run(["pykvq", "run", *device.TOOL_ARGS, "-t", "2", "-m", str(model), "--kv-type", kv_type,
                           "-p", "<t7>", "-n", "4"], capture_output=True, text=True)


@pytest.mark.parametrize("kv_type", ["kivi4", "kivi2", "kivi1"])
def test_kivi_types_are_refused_on_latent_attention(mla: Model, kv_type: str) -> None:
    """(Different K and V types upstream refuses itself for this model.)"""
    with pytest.raises(LlamaError, match=r"multi-head latent attention .* which kivi types do not support yet; "
                                         r"use an upstream type"):
        context(mla, KvConfig.preset(kv_type))


def test_pykvq_run_refuses_kivi_on_latent_attention_with_the_reason(mla_path: Path) -> None:
    proc = pykvq_run(mla_path, "kivi2")
    assert proc.returncode == 1
    assert "multi-head latent attention" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("kv_type", "bits"), [("f16", 16.0), ("q8_0", 8.5)])
def test_upstream_types_run_latent_attention_and_count_one_row_per_token(mla: Model, kv_type: str,
                                                                        bits: float) -> None:
    """The cache holds K's rows alone (the latent and its RoPE part): f16 against f16 is 1.00x (it said 0.56x,
    counting V rows that do not exist)."""
    with context(mla, KvConfig.preset(kv_type)) as ctx:
        assert ctx.eval(mla.tokenize("<t7> <t8> <t9>")).shape == (MLA.n_vocab,)
        memory = ctx.memory()
    assert memory.n_elements == 256 * MLA.n_layer * (MLA.kv_lora_rank + MLA.rope_dim)
    assert memory.bits_per_element == pytest.approx(bits)


def test_inspect_counts_one_row_per_token_and_no_kivi_type(mla: Model) -> None:
    proc = subprocess.run(["pykvq", "inspect", "--json", str(mla.path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    costs = {c["kv_type"]: c["bytes_per_token"] for c in json.loads(proc.stdout)["kv_bytes"]}
    assert not set(costs) & {"kivi4", "kivi2", "kivi1"}
    with context(mla, KvConfig()) as ctx:
        assert costs["f16"] * 256 == ctx.memory().bytes


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
