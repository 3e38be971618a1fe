"""Models with several positions per token (M-RoPE: Qwen2-VL, Qwen2.5-VL; llama.cpp's qwen2vl), on a random
model of the family: their text goes through a kivi cache as any model's does; input whose positions do not run on
one by one (an image's embeddings share a position, the text after an image jumps ahead), which upstream accepts
from these models only, is refused by a kivi cache before anything goes in, where it used to overwrite the cells of
the tokens before it and wreck the sequence."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from raw_batch import decode_embeddings

import device
from pykvq import KvConfig, Model
from pykvq.bindings.log import sink
from pykvq.devtools import random_model

QWEN2VL = random_model.SHAPES["qwen2vl-small"]
N_CTX = 512
KIVI2 = KvConfig.preset("kivi2", window=32)
IMAGE = (6, 5)  # patches across, down

logits = functools.partial(device.all_logits, n_ctx=N_CTX)


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory: pytest.TempPathFactory) -> Model:
    path: Path = tmp_path_factory.mktemp("qwen2vl") / "qwen2vl.gguf"
    random_model.write(QWEN2VL, path)
    return device.load_model(path)


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return [int(t) for t in np.random.default_rng(5).integers(300, QWEN2VL.n_vocab, size=300)]


def test_text_goes_through_a_kivi_cache_as_any_model_s(qwen2vl: Model, tokens: list[int]) -> None:
    f16 = logits(qwen2vl, KvConfig(), tokens)
    errors = {name: np.abs(logits(qwen2vl, kv, tokens) - f16).mean() for name, kv in {
        "kivi4": KvConfig.preset("kivi4", window=32), "kivi2": KIVI2, "q4_0": KvConfig.preset("q4_0")}.items()}
    assert 0 < errors["kivi4"] < errors["kivi2"] < 5 * errors["q4_0"]
    device.assert_same_logits(logits(qwen2vl, KIVI2, tokens, n_ubatch=37), logits(qwen2vl, KIVI2, tokens),
                              f16=lambda: f16)


def _image_positions(t: int) -> np.ndarray:
    """An image's patches as Qwen2-VL's projector places them: one time, each patch's row and column."""
    nx, ny = IMAGE
    y, x = np.divmod(np.arange(nx * ny), nx)
    return np.stack([np.full(nx * ny, t), t + y, t + x, np.zeros(nx * ny, int)])


def _text_positions(start: int, n: int) -> np.ndarray:
    return np.tile(np.arange(start, start + n), (4, 1))


@pytest.mark.parametrize("case", ["image", "jump"])
def test_input_off_the_positions_is_refused_and_leaves_the_sequence_as_it_was(qwen2vl: Model, tokens: list[int],
                                                                            case: str) -> None:
    """f16 takes both batches (upstream's M-RoPE rules); kivi2 refuses them with its reason, and the sequence goes
    on exactly as one that never saw them."""
    rng = np.random.default_rng(1)
    n_embd = qwen2vl._lib.llama.llama_model_n_embd(qwen2vl._ptr)
    first, then = tokens[:100], tokens[100:140]
    positions = _image_positions(len(first)) if case == "image" else _text_positions(len(first) + 3, 8)
    rows = rng.standard_normal((positions.shape[1], n_embd)).astype(np.float32) * 0.5
    config = functools.partial(device.context_config, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=2)
    with qwen2vl.context(config(kv=KvConfig())) as ctx:
        ctx.eval(first)
        assert decode_embeddings(ctx, rows, positions) == 0
    with qwen2vl.context(config(kv=KIVI2)) as ctx:
        ctx.eval(first)
        sink().take_problems()
        assert decode_embeddings(ctx, rows, positions) != 0
        reason = "\n".join(sink().take_problems())
        assert "kivi types hold a sequence's tokens one per position, in order" in reason
        assert ctx.seq_cells(0) == len(first)
        went_on = ctx.eval(then, all_logits=True)
    with qwen2vl.context(config(kv=KIVI2)) as ctx:
        ctx.eval(first)
        device.assert_same_logits(went_on, ctx.eval(then, all_logits=True))
