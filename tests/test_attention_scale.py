"""pykvq.calibration.attention_scale: each layer's attention scale read off the f16 run, against scales known by
construction (numpy) and by the models' graphs (SmolLM2: head_dim^-0.5; Gemma 4: 1, after its Q/K norms)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pykvq import KvConfig, Model
from pykvq.api.capture import AttentionCapture
from pykvq.calibration import attention_scale

import device


def random_qkv(n: int = 96, heads: int = 4, kv_heads: int = 2, dim: int = 64) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((n, h, dim)).astype(np.float32) for h in (heads, kv_heads, kv_heads))


@pytest.mark.parametrize("scale", [0.02, 0.125, 0.37, 1.0])
def test_a_known_scale_is_found(scale: float) -> None:
    q, k, v = random_qkv()
    assert attention_scale.layer_scale(q, k, v, attention_scale.attention(q, k, v, scale)) == pytest.approx(scale,
                                                                                                          rel=1e-4)


def test_a_sliding_window_is_fitted_within_it() -> None:
    """Past the window the graph's mask is not causal: only the tokens within it are fitted."""
    q, k, v = random_qkv(n=96)
    windowed = attention_scale.attention(q, k, v, 0.37)
    # the graph's output past a 32-token window: another attention, which a causal fit cannot explain
    windowed[32:] = attention_scale.attention(q[32:], k[32:], v[32:], 0.37)[:64]
    assert attention_scale.layer_scale(q, k, v, windowed, n_swa=32) == pytest.approx(0.37, rel=1e-4)


def test_an_output_no_scale_explains_keeps_head_dim_s() -> None:
    """Soft-capped scores (Gemma 2) or learned sinks bend the output away from any plain softmax: the fit would
    take a wrong scale, so the layer keeps head_dim^-0.5."""
    q, k, v = random_qkv()
    capped = attention_scale.attention(np.tanh(q * 3.0) * 0.2, k, v, 1.0)
    assert attention_scale.layer_scale(q, k, v, capped) == 64 ** -0.5


def scales(model: Model, tokens: list[int]) -> list[float]:
    capture = AttentionCapture(len(tokens))
    config = device.context_config(n_ctx=256, n_batch=256, n_ubatch=256, n_threads=2, kv=KvConfig(), observer=capture)
    with model.context(config) as ctx:
        ctx.eval(tokens)
    return [attention_scale.layer_scale(*capture.layer(il), capture.output(il), model.n_swa)
            for il in capture.kv_layers()]


def test_smollm2_s_layers_scale_by_head_dim(model: Model, hamlet: Path) -> None:
    tokens = model.tokenize(hamlet.read_text()[:3000])[:200]
    np.testing.assert_allclose(scales(model, tokens), 64 ** -0.5, rtol=1e-3)


def test_gemma4_s_layers_scale_by_one(tmp_path: Path) -> None:
    """Gemma 4 normalizes Q and K and scales their product by 1, not by head_dim^-0.5 (0.125 and 0.088 in its
    sliding-window and global layers), which the calibration's attention model applied before."""
    with device.load_random_model(tmp_path, "gemma4-small") as gemma4:
        np.testing.assert_allclose(scales(gemma4, list(range(300, 500))), 1.0, rtol=1e-3)
