"""pykvq.calibration.clip_ratios: SKVQ's per-layer clip ratios from captured Q, K and V (numpy), against the kernels'
format (tests/kvq_oracle.py) and on data built to need or not need clipping."""

from __future__ import annotations

import kvq_oracle as oracle
import numpy as np
import pytest

from pykvq.calibration import clip_ratios as cc


@pytest.mark.parametrize("clip", [1.0, 0.85, 0.6, oracle.CLIP_MSE], ids=["1", "0.85", "0.6", "mse"])
def test_fake_quantization_is_the_format(clip: float) -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 96)) * rng.uniform(0.1, 5, (5, 1))).astype(np.float32)
    want = oracle.dequantize_rows(oracle.quantize_rows(x, 2, clip), 2, 96)
    # the kernels multiply by the step's reciprocal, the model divides: a code may differ where a value sits on a
    # rounding boundary
    got = cc.fake_quantize(x, 2, clip)
    assert np.mean(got == want) > 0.99
    np.testing.assert_allclose(got, want, atol=float(np.abs(x).max()) * 0.7)


def qkv(n: int, outliers: bool, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, 4, 32)).astype(np.float32)
    k = rng.standard_normal((n, 2, 32)).astype(np.float32)
    v = rng.standard_normal((n, 2, 32)).astype(np.float32)
    if outliers:
        # a rare large value per V group: clipping it buys the other 31 a finer step
        v[::7, :, 3] *= 12
    return q, k, v


def test_rare_outliers_are_clipped_and_uniform_data_is_not() -> None:
    contract = cc.Contract.of(256, window=32, sinks=0)
    with_outliers = cc.layer_errors(*qkv(256, True, 1), contract)
    assert cc.RATIOS[int(np.argmin(with_outliers.v))] < 1.0
    assert min(with_outliers.v) < with_outliers.v[0]
    # a window over every token reads nothing quantized: nothing to gain or lose
    nothing = cc.layer_errors(*qkv(64, True, 2), cc.Contract.of(64, window=64, sinks=0))
    assert max(nothing.v) == 0.0 and max(nothing.k) == 0.0


def test_the_spec_spells_runs_as_ranges() -> None:
    assert cc.clip_spec_per_layer({"k": [1.0, 1.0, 1.0], "v": [0.8, 0.8, 0.9]}) == "v:0-1=0.8,2=0.9"
    assert cc.clip_spec_per_layer({"k": [0.9, 1.0], "v": [1.0, 1.0]}) == "k:0=0.9,1=1"
    assert cc.clip_spec_per_layer({"k": [1.0], "v": [1.0]}) == "none"


def test_per_layer_ratios_cover_every_layer() -> None:
    layers = [qkv(128, il % 2 == 0, il) for il in range(4)]
    spec = cc.clip_spec_per_layer(cc.per_layer_ratios(lambda il: layers[il], 4, window=16, sinks=0))
    assert spec.startswith("k:0") or spec.startswith("v:0")
    for part in spec.split(";"):
        covered = []
        for rule in part.split(":", 1)[1].split(","):
            span = rule.split("=")[0]
            first, _, last = span.partition("-")
            covered += list(range(int(first), int(last or first) + 1))
        assert covered == [0, 1, 2, 3]


def test_a_long_text_is_judged_on_its_first_tokens() -> None:
    long = qkv(cc.MAX_TOKENS + 64, True, 5)
    head = tuple(x[:cc.MAX_TOKENS] for x in long)
    assert cc.per_layer_ratios(lambda il: long, 1, window=16, sinks=0) == \
        cc.per_layer_ratios(lambda il: head, 1, window=16, sinks=0)


def test_a_latent_layer_s_k_error_counts_its_v_read_from_the_same_cells() -> None:
    """Multi-head latent attention: V is K's first channels, read from K's quantized tiles (ggml_kvq_attn_latent), so
    the K error is the whole contract's, against the kernels' oracle, and V has none of its own."""
    n, window, dv = 160, 32, 64
    rng = np.random.default_rng(7)
    q = rng.standard_normal((n, 4, 96)).astype(np.float32)
    k = (rng.standard_normal((n, 1, 96)) * rng.uniform(0.3, 3, 96)).astype(np.float32)
    attention = cc.LayerAttention(q, k, k[..., :dv].copy(), cc.Contract.of(n, window, sinks=0))
    assert attention.latent and attention.v_error(2, 1.0) == 0.0
    read = {w: oracle.latent_attention(q, k, np.arange(n), head_dim_v=dv, window=w, n_sink=0, k_bits=2,
                                       scale=96 ** -0.5) for w in (window, n)}
    assert attention.k_error(2, 1.0) == pytest.approx(float(((read[window] - read[n]) ** 2).sum()), rel=0.05)
    # the same K with a V of its own: the error of the scores alone (0.59 of the whole here)
    apart = cc.LayerAttention(q, k, k[..., :dv] + np.float32(1e-3), cc.Contract.of(n, window, sinks=0))
    assert not apart.latent and apart.k_error(2, 1.0) < 0.8 * attention.k_error(2, 1.0)
    # a V equal to a K as wide is a V of its own
    assert not cc.is_latent(k, k.copy())
