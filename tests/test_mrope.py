"""Models with several positions per token (M-RoPE: Qwen2-VL, Qwen2.5-VL; llama.cpp's qwen2vl), on a random
model of the family: their text goes through a kivi cache as any model's does, and so do their images, whose
embeddings share one position while the text after them jumps ahead (upstream accepts that from these models only;
an image's embeddings are fed as libmtmd feeds them, with random rows for the projector's)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from raw_batch import decode_embeddings

import device
from pykvq import KvConfig, LlamaError, Model
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


def _image(qwen2vl: Model, seed: int = 1) -> np.ndarray:
    n_embd = qwen2vl._lib.llama.llama_model_n_embd(qwen2vl._ptr)
    return np.random.default_rng(seed).standard_normal((IMAGE[0] * IMAGE[1], n_embd)).astype(np.float32)


def _config(kv: KvConfig, n_ubatch: int = N_CTX, flash_attn: str = "on"):
    return device.context_config(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=n_ubatch, n_threads=2, kv=kv,
                                 flash_attn=flash_attn)


def _show_image(ctx, image: np.ndarray) -> None:
    """The image after what the sequence holds, as libmtmd decodes it; the text after it goes on max(nx, ny)
    positions later."""
    assert decode_embeddings(ctx, image, _image_positions(ctx.n_past)) == 0
    ctx.n_past += max(IMAGE)


def _chat(qwen2vl: Model, tokens: list[int], kv: KvConfig, seed: int = 1, n_ubatch: int = N_CTX,
          flash_attn: str = "on") -> np.ndarray:
    """Every logit of 40 tokens that follow 100 tokens and an image."""
    with qwen2vl.context(_config(kv, n_ubatch, flash_attn)) as ctx:
        ctx.eval(tokens[:100])
        _show_image(ctx, _image(qwen2vl, seed))
        return ctx.eval(tokens[100:140], all_logits=True)


def test_an_image_in_a_covering_kivi_window_is_upstream_f16(qwen2vl: Model, tokens: list[int]) -> None:
    """An image's embeddings share a position and the text after it jumps ahead: a kivi cache refused them, and
    before that overwrote the cells of the tokens before the image with them. Everything in fp16: as close to
    upstream's f16 cache as upstream's own two attention paths are, far closer than another image is."""
    f16 = _chat(qwen2vl, tokens, KvConfig())
    noise = device.moved(_chat(qwen2vl, tokens, KvConfig(), flash_attn="off"), f16)
    assert device.moved(_chat(qwen2vl, tokens, KvConfig(), seed=2), f16) > 3 * noise
    assert device.moved(_chat(qwen2vl, tokens, KvConfig.preset("kivi2", window=N_CTX)), f16) < 1.5 * noise


def test_an_image_in_kivi_tiles_costs_what_its_width_says(qwen2vl: Model, tokens: list[int]) -> None:
    f16 = _chat(qwen2vl, tokens, KvConfig())
    errors = {kv.type_k: device.moved(_chat(qwen2vl, tokens, kv), f16) for kv in (KvConfig.preset("kivi4", window=32),
                                                                             KIVI2)}
    assert 0 < errors["kivi4"] < errors["kivi2"]
    assert errors["kivi4"] < device.moved(_chat(qwen2vl, tokens, KvConfig(), seed=2), f16)


def test_an_image_split_across_ubatches_changes_nothing(qwen2vl: Model, tokens: list[int]) -> None:
    whole = _chat(qwen2vl, tokens, KIVI2)
    device.assert_same_logits(_chat(qwen2vl, tokens, KIVI2, n_ubatch=16), whole,
                              f16=lambda: _chat(qwen2vl, tokens, KvConfig()))


def test_a_state_saved_after_an_image_continues_exactly(qwen2vl: Model, tokens: list[int]) -> None:
    with qwen2vl.context(_config(KIVI2)) as saving:
        saving.eval(tokens[:100])
        _show_image(saving, _image(qwen2vl))
        saving.eval(tokens[100:120])
        state = saving.save_state()
        expected = saving.eval(tokens[120:140], all_logits=True)
    with qwen2vl.context(_config(KIVI2)) as loading:
        loading.load_state(state)
        assert loading.n_past == 100 + max(IMAGE) + 20
        device.assert_same_logits(loading.eval(tokens[120:140], all_logits=True), expected)


def test_after_an_image_the_last_token_is_removed_exactly_and_deeper_is_refused(qwen2vl: Model,
                                                                              tokens: list[int]) -> None:
    """What llama-cpp-python asks after a multimodal prompt: its last token again. Removal is counted in cells, the
    image's 30 of them at one position."""
    with qwen2vl.context(_config(KIVI2)) as ctx:
        ctx.eval(tokens[:100])
        _show_image(ctx, _image(qwen2vl))
        assert ctx.seq_cells(0) == 100 + IMAGE[0] * IMAGE[1]  # the cells, not the 6 positions they span
        expected = ctx.eval(tokens[100:140], all_logits=True)
        ctx.truncate(ctx.n_past - 1)
        device.assert_same_logits(ctx.eval(tokens[139:140], all_logits=True), expected[-1:])
        with pytest.raises(LlamaError, match="cannot remove tokens"):
            ctx.truncate(100)


def test_an_image_after_a_selected_prompt_is_refused_and_leaves_the_sequence_as_it_was(qwen2vl: Model,
                                                                                    tokens: list[int]) -> None:
    """Prompt selection reads positions as cell distances: with it, an image's shared position is refused before
    anything goes in, and the sequence goes on as one that never saw it."""
    selecting = KvConfig.preset("kivi2", window=32, select=(0.25, 0.25))
    with qwen2vl.context(_config(selecting)) as ctx:
        ctx.eval(tokens[:100])
        sink().take_problems()
        assert decode_embeddings(ctx, _image(qwen2vl), _image_positions(100)) != 0
        assert "consecutive positions here (a sliding-window cache, prompt selection)" in "\n".join(
            sink().take_problems())
        went_on = ctx.eval(tokens[100:140], all_logits=True)
    with qwen2vl.context(_config(selecting)) as ctx:
        ctx.eval(tokens[:100])
        device.assert_same_logits(went_on, ctx.eval(tokens[100:140], all_logits=True))
