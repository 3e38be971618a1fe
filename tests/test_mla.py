"""Multi-head latent attention (DeepSeek-V2/V3, Kimi, GLM-5: one compressed row per token, V read from K's cache),
on a random-weight DeepSeek-V2 model (pykvq/devtools/random_model.py): its attention does not go through the kivi
kernels, so kivi types are refused when the context is made (they aborted the process in the first decode), and
upstream's types run with their memory reported as the cache really holds it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pykvq import KvConfig, LlamaError, Model
from pykvq.devtools import random_model

import device

SHAPE = random_model.SHAPES["deepseek2-mla-small"]


@pytest.fixture(scope="module")
def mla_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mla") / "deepseek2-mla-small.gguf"
    random_model.write(SHAPE, path)
    return path


@pytest.fixture(scope="module")
def mla(mla_path: Path):
    with device.load_model(mla_path) as model:
        yield model


def context(model: Model, kv: KvConfig):
    return model.context(device.context_config(n_ctx=256, n_threads=2, kv=kv, flash_attn="on"))


@pytest.mark.parametrize("kv_type", ["kivi4", "kivi2", "kivi1"])
def test_kivi_types_are_refused(mla: Model, kv_type: str) -> None:
    """(Different K and V types upstream refuses itself for this model.)"""
    with pytest.raises(LlamaError, match=r"multi-head latent attention .* which kivi types do not support yet; "
                                         r"use an upstream type"):
        context(mla, KvConfig.preset(kv_type))


def test_pykvq_run_refuses_kivi_with_the_reason(mla_path: Path) -> None:
    proc = subprocess.run(["pykvq", "run", *device.TOOL_ARGS, "-t", "2", "-m", str(mla_path), "--kv-type", "kivi2",
                           "-p", "<t7>", "-n", "4"], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "multi-head latent attention" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("kv_type", "bits"), [("f16", 16.0), ("q8_0", 8.5)])
def test_upstream_types_run_and_count_the_one_row_per_token(mla: Model, kv_type: str, bits: float) -> None:
    """The cache holds K's rows alone (the latent and its RoPE part): f16 against f16 is 1.00x (it said 0.56x,
    counting V rows that do not exist)."""
    with context(mla, KvConfig.preset(kv_type)) as ctx:
        assert ctx.eval(mla.tokenize("<t7> <t8> <t9>")).shape == (SHAPE.n_vocab,)
        memory = ctx.memory()
    assert memory.n_elements == 256 * SHAPE.n_layer * (SHAPE.kv_lora_rank + SHAPE.rope_dim)
    assert memory.bits_per_element == pytest.approx(bits)
