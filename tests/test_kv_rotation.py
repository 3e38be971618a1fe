"""Upstream's Hadamard rotation per kivi layer (--kv-rotate SPEC, KvConfig.rotate, the model's kvq.kv_rotate).

Judged on the suite's device, comparing contexts whose graphs differ only in what rotates: where two settings must
rotate the same layers the logits agree bit for bit, on every backend.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from pykvq import KvConfig, LlamaError, Model, gguf_metadata

import device
import state_format

N_CTX = 512
N_TOKENS = 300
# layer 0 kivi2, every other f16: the spec's layer 0 is the only kivi layer it can turn
FIRST_KIVI = "k:0=kivi2,1-=f16;v:0=kivi2,1-=f16"


@pytest.fixture(scope="module")
def tokens(model: Model, hamlet: Path) -> list[int]:
    return model.tokenize(hamlet.read_text())[:N_TOKENS]


def logits(model: Model, tokens: list[int], rotate: bool | str | None, layers: str | None = None) -> np.ndarray:
    kv = KvConfig.preset("kivi2", window=64, rotate=rotate, layers=layers)
    return device.all_logits(model, kv, tokens, N_CTX)


def test_a_spec_for_every_layer_rotates_as_the_switch(model: Model, tokens: list[int]) -> None:
    on = logits(model, tokens, True)
    off = logits(model, tokens, False)
    assert not np.array_equal(on, off)
    assert np.array_equal(logits(model, tokens, "on"), on)
    assert np.array_equal(logits(model, tokens, "k:*=on;v:*=on"), on)
    assert np.array_equal(logits(model, tokens, "k:*=off"), off)


@pytest.mark.parametrize(("spec", "same_as"), [("k:0=on,1-=off;v:0=on,1-=off", True),
                                               ("k:0=off,1-=on;v:0=off,1-=on", False)],
                         ids=["layer-0-on", "layer-0-off"])
def test_each_layer_rotates_as_its_own_entry_says(model: Model, tokens: list[int], spec: str, same_as: bool) -> None:
    """Only layer 0 is kivi: what the spec says of the f16 layers changes nothing, what it says of layer 0 is the
    switch's effect."""
    got = logits(model, tokens, spec, FIRST_KIVI)
    assert np.array_equal(got, logits(model, tokens, same_as, FIRST_KIVI))
    assert not np.array_equal(got, logits(model, tokens, not same_as, FIRST_KIVI))


def test_k_and_v_rotate_apart(model: Model, tokens: list[int]) -> None:
    runs = [logits(model, tokens, spec) for spec in ("off", "k:*=on", "v:*=on", "on")]
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            assert not np.array_equal(a, b)


def test_the_models_rotation_applies_and_the_caller_wins(model: Model, smollm2: Path, tokens: list[int],
                                                         tmp_path: Path) -> None:
    spec = "k:0-14=on,15-=off;v:*=on"
    copy = tmp_path / "rotated.gguf"
    gguf_metadata.write_copy(smollm2, copy, {gguf_metadata.KEY_ROTATE: spec})
    with device.load_model(copy) as rotated:
        assert np.array_equal(logits(rotated, tokens, None), logits(model, tokens, spec))
        assert np.array_equal(logits(rotated, tokens, False), logits(model, tokens, False))


def save_after(model: Model, tokens: list[int], rotate: str) -> bytes:
    kv = KvConfig.preset("kivi2", window=64, rotate=rotate)
    with model.context(device.context_config(n_ctx=N_CTX, n_threads=2, kv=kv, flash_attn="on")) as ctx:
        ctx.eval(tokens[:100])
        return ctx.save_state()


def load_and_continue(model: Model, tokens: list[int], rotate: str, state: bytes) -> np.ndarray:
    kv = KvConfig.preset("kivi2", window=64, rotate=rotate)
    with model.context(device.context_config(n_ctx=N_CTX, n_threads=2, kv=kv, flash_attn="on")) as ctx:
        ctx.load_state(state)
        return ctx.eval(tokens[100:110], all_logits=True)


def test_a_state_records_each_layers_rotation(model: Model, tokens: list[int]) -> None:
    spec = "k:0=off,1-=on;v:*=on"
    state = save_after(model, tokens, spec)
    with pytest.raises(LlamaError, match="layer 0 was saved with rotation on for V, this cache's is on for K and V"):
        load_and_continue(model, tokens, "on", state)
    device.assert_same_logits(load_and_continue(model, tokens, spec, state),
                              load_and_continue(model, tokens, spec, save_after(model, tokens, spec)))


def as_kvq3(state: bytes, model: Model) -> bytes:
    """The state as the format before per-layer rotation wrote it: no rotation (or dead-cell) field per layer."""
    layout = state_format.parse(state, state_format.Geometry.of(model, kivi=True))
    return state_format.without_layer_fields(state, layout, (".rotate", ".dead")).replace(b"KVQ5", b"KVQ3")


@pytest.mark.parametrize("rotate", ["on", "off"])
def test_a_state_of_the_format_before_is_read_as_one_rotation_for_all(model: Model, tokens: list[int],
                                                                     rotate: str) -> None:
    state = save_after(model, tokens, rotate)
    want = load_and_continue(model, tokens, rotate, state)
    device.assert_same_logits(load_and_continue(model, tokens, rotate, as_kvq3(state, model)), want)


@pytest.mark.parametrize(("value", "message"), [
    ("maybe", "expected on, off or a per-layer spec"),
    ("k:0-99=on", "the model has 30 layers"),
    ("k:*=sometimes", "'sometimes' is not on or off"),
])
def test_a_bad_rotation_is_refused_before_any_work(smollm2: Path, value: str, message: str) -> None:
    proc = subprocess.run(["pykvq", "run", "-m", str(smollm2), "-p", "hi", "-n", "1",
                           "--kv-type", "kivi2", "--kv-rotate", value, *device.TOOL_ARGS],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
