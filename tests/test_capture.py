"""pykvq.api.capture: the Q, K and V llama.cpp's graph attends with, taken through its eval callback, on the backend
tests/device.py names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pykvq.api.capture import AttentionCapture
from pykvq.api.llama import KvConfig, Model

import device

N_LAYER, N_HEAD, N_HEAD_KV, HEAD_DIM = 30, 9, 3, 64  # SmolLM2-135M


def captured(model: Model, tokens: list[int]) -> AttentionCapture:
    capture = AttentionCapture(len(tokens))
    config = device.context_config(n_ctx=64, n_batch=64, n_ubatch=64, n_threads=2, kv=KvConfig(), observer=capture)
    with model.context(config) as ctx:
        ctx.eval(tokens)
    return capture


def test_every_layer_s_q_k_v_after_rope(model: Model) -> None:
    """The same token at several positions: layer 0's K and Q (embedding, norm and projection alike) differ only by
    RoPE's rotation, which keeps each head's norm; V, which RoPE leaves alone, is the same vector."""
    repeated = model.tokenize("hello")[-1]
    tokens = [repeated] * 8
    capture = captured(model, tokens)
    for il in range(N_LAYER):
        q, k, v = capture.layer(il)
        assert q.shape == (8, N_HEAD, HEAD_DIM) and k.shape == v.shape == (8, N_HEAD_KV, HEAD_DIM)
    q, k, v = capture.layer(0)
    for x in (q, k):
        assert np.abs(x[3] - x[1]).max() > 1e-2
        np.testing.assert_allclose(np.linalg.norm(x[3], axis=-1), np.linalg.norm(x[1], axis=-1), rtol=1e-4)
    np.testing.assert_allclose(v[3], v[1], rtol=1e-5, atol=1e-6)


def test_a_layer_the_graph_never_named_is_a_clear_error(model: Model) -> None:
    capture = captured(model, model.tokenize("To be, or not to be"))
    with pytest.raises(ValueError, match="named no attn_q tensor in layer 30"):
        capture.layer(N_LAYER)


def test_a_capture_sees_one_ubatch_only(model: Model) -> None:
    tokens = model.tokenize("To be, or not to be, that is the question")
    capture = AttentionCapture(len(tokens) + 1)
    config = device.context_config(n_ctx=64, n_batch=64, n_threads=2, kv=KvConfig(), observer=capture)
    with model.context(config) as ctx:
        ctx.eval(tokens)
    with pytest.raises(ValueError, match="is not float32 over the"):
        capture.layer(0)


@pytest.mark.parametrize(("shape", "kv_layers", "head_dims"), [
    ("gemma4-small", [0, 1, 2, 3], [64, 64, 64, 128]),  # its last 4 layers read layers 2's and 3's caches
    ("qwen35-small", [3], [64]),                         # delta nets in 0-2
    ("lfm2-small", [1, 3], [64, 64]),                    # convolutions in 0 and 2
])
def test_the_layers_that_keep_k_and_v_as_the_cache_takes_them(shape: str, kv_layers: list[int], head_dims: list[int],
                                                              tmp_path: Path) -> None:
    """Only the layers with K and V of their own are captured, each at its head size, K and Q after their norms and
    RoPE: one token repeated gives rows of equal norm that differ (Gemma 4 names its rotated Q and K "Qcur_pos",
    after a 2-D "Qcur" before its norms; LFM2 names nothing after its projections; Qwen 3.5 rotates a quarter of each
    head)."""
    with device.load_random_model(tmp_path, shape) as model:
        capture = captured(model, [300] * 8)
    assert capture.kv_layers() == kv_layers
    for il, dim in zip(kv_layers, head_dims, strict=True):
        q, k, v = capture.layer(il)
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] == dim
        for x in (q, k):
            assert np.abs(x[3] - x[1]).max() > 1e-3
            np.testing.assert_allclose(np.linalg.norm(x[3], axis=-1), np.linalg.norm(x[1], axis=-1), rtol=1e-3)


def test_llama4_s_q_and_k_after_their_norm(tmp_path: Path) -> None:
    """Llama 4 RMS-normalizes Q and K after RoPE in its rotating layers ("Qcur_normed", after a "Qcur"): what the
    cache stores has a norm of sqrt(head size) per head; its global layer has no such norm."""
    with device.load_random_model(tmp_path, "llama4-small") as model:
        capture = captured(model, list(range(300, 308)))
    for il in range(3):
        for x in capture.layer(il)[:2]:
            np.testing.assert_allclose(np.linalg.norm(x, axis=-1), 8.0, rtol=1e-3)
    assert np.abs(np.linalg.norm(capture.layer(3)[1], axis=-1) - 8.0).max() > 0.1
