"""pykvq.api.capture: the Q, K and V llama.cpp's graph attends with, taken through its eval callback, on the backend
tests/device.py names."""

from __future__ import annotations

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
    with pytest.raises(ValueError, match="named no Qcur tensor in layer 30"):
        capture.layer(N_LAYER)


def test_a_capture_sees_one_ubatch_only(model: Model) -> None:
    tokens = model.tokenize("To be, or not to be, that is the question")
    capture = AttentionCapture(len(tokens) + 1)
    config = device.context_config(n_ctx=64, n_batch=64, n_threads=2, kv=KvConfig(), observer=capture)
    with model.context(config) as ctx:
        ctx.eval(tokens)
    with pytest.raises(ValueError, match="is not float32 over the"):
        capture.layer(0)
