"""Images through llama-cpp-python's multimodal chat handler (MTMDChatHandler), on pykvq's libmtmd and into its KV
caches: a random Gemma 3 language model with the projector of a tiny random Gemma 3 (written by llama.cpp's
converter), and a generated image. Before, every multimodal handler failed at its first use: pykvq shipped no
libmtmd ("Shared library with base name 'mtmd' not found")."""

from __future__ import annotations

import base64
import importlib.util
import struct
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hf_models import tiny_gemma3_projector

import device
import pykvq
from pykvq.devtools import random_model

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python is not installed (.ci/run installs it)", allow_module_level=True)

GEMMA3 = replace(random_model.SHAPES["gemma3-small"], n_embd=256)  # the projector's width
N_CTX = 512
TEXT_BEFORE = " ".join(f"<t{i}>" for i in range(40, 48))
TEXT_AFTER = list(range(300, 340))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    pytest.importorskip("transformers", reason="the projector is made by transformers (pykvq[convert])")
    folder = tmp_path_factory.mktemp("gemma3-vision")
    random_model.write(GEMMA3, folder / "text.gguf")
    return folder / "text.gguf", tiny_gemma3_projector(folder / "mmproj.gguf", GEMMA3.n_embd)


def _png(pixels: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of ``pixels`` [height, width, 3]."""
    height, width, _ = pixels.shape
    rows = b"".join(b"\0" + row.astype(np.uint8).tobytes() for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def _message(seed: int) -> list[dict]:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(48, 80, 3))
    url = "data:image/png;base64," + base64.b64encode(_png(pixels)).decode()
    return [{"role": "user", "content": [{"type": "text", "text": TEXT_BEFORE},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def _logits(models: tuple[Path, Path], kv: str = "f16", window: int | None = None, seed: int = 0,
            flash_attn: bool = True, after: list[int] = TEXT_AFTER) -> np.ndarray:
    """The logits of a chat turn's last token (text, then an image), or of the last of tokens ``after`` it."""
    from pykvq.llama_cpp import Llama, load

    load()
    from llama_cpp.llama_chat_format import MTMDChatHandler

    class Handler(MTMDChatHandler):
        def _get_chat_template(self, llama_model) -> str:  # the random model has none
            return "{% for m in messages %}{% for p in m.content %}{{ p.text or '' }}{% endfor %}{% endfor %}"

    text, projector = models
    types = {} if kv == "f16" else {"type_k": pykvq.kv_types.type_id(kv), "type_v": pykvq.kv_types.type_id(kv),
                                    "kv_window": window}
    llm = Llama(model_path=str(text), chat_handler=Handler(clip_model_path=str(projector), verbose=False),
                n_ctx=N_CTX, n_threads=2, verbose=False, logits_all=True, flash_attn=flash_attn, **types,
                **device.LLAMA_KWARGS)
    try:
        llm.create_chat_completion(_message(seed), max_tokens=1, temperature=0)
        if after:
            llm.eval(after)
        return llm.scores[llm.n_tokens - 1].copy()
    finally:
        llm.close()


def test_an_image_in_a_covering_kivi_window_is_upstream_f16(models: tuple[Path, Path]) -> None:
    """Everything in fp16 (the image's tokens too, which Gemma 3 attends both ways within the image), read right
    after the image: as close to upstream's f16 cache as upstream's own two attention paths are to each other, and
    far closer than another image is."""
    f16 = _logits(models, after=[])
    upstream_noise = device.moved(_logits(models, flash_attn=False, after=[]), f16)
    assert device.moved(_logits(models, seed=1, after=[]), f16) > 3 * upstream_noise
    assert device.moved(_logits(models, "kivi2", window=N_CTX, after=[]), f16) < 1.5 * upstream_noise


def test_an_image_in_kivi_tiles_costs_what_its_width_says(models: tuple[Path, Path]) -> None:
    """A window of 16 and 40 tokens after the image: its tokens are in sealed 4- and 2-bit tiles. 4 bits move the
    logits less than another image does."""
    f16 = _logits(models)
    errors = {kv: device.moved(_logits(models, kv, window=16), f16) for kv in ("kivi4", "kivi2")}
    assert 0 < errors["kivi4"] < errors["kivi2"]
    assert errors["kivi4"] < device.moved(_logits(models, seed=1), f16)
