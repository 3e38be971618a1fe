"""The calibration's torch model of the kivi cache against the independent numpy oracle of DESIGN.md §5."""

from __future__ import annotations

import kvq_oracle
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pykvq.convert.kv_calibration import Calibration, CalibrationSettings, LayerProbe, fake_quantize, kivi_attention  # noqa: E402


def random_qkv(n_tokens: int, n_head: int = 4, n_head_kv: int = 2, dim: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_head, n_tokens, dim)).astype(np.float32)
    k = rng.standard_normal((n_head_kv, n_tokens, dim)).astype(np.float32)
    # outlier channels in K, as real models have (SKVQ §3.1): per-channel quantization must handle them
    k[:, :, 3] *= 8
    v = rng.standard_normal((n_head_kv, n_tokens, dim)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("bits", [4, 2, 1])
def test_fake_quantize_is_the_format(bits: int) -> None:
    rows = np.random.default_rng(bits).standard_normal((5, 96)).astype(np.float32)
    ours = fake_quantize(torch.from_numpy(rows), bits, dim=1).numpy()
    oracle = kvq_oracle.dequantize_rows(kvq_oracle.quantize_rows(rows, bits), bits, 96)
    # codes agree except where a value sits on a rounding boundary (x/d here, x*(1/d) in ggml)
    assert np.mean(np.isclose(ours, oracle, rtol=0, atol=1e-6)) > 0.995


@pytest.mark.parametrize("k_bits, v_bits, window, sinks", [(2, 2, 40, 0), (1, 4, 32, 4), (4, 1, 0, 3), (2, 1, 0, 0)])
def test_attention_follows_the_cache_semantics(k_bits: int, v_bits: int, window: int, sinks: int) -> None:
    n = 150
    q, k, v = random_qkv(n)
    scale = 64 ** -0.5
    ours = kivi_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), scale, window, sinks,
                          k_bits, v_bits).numpy()

    def oracle(window: int) -> np.ndarray:
        # the oracle takes [tokens, heads, dim]
        return kvq_oracle.kivi_attention(q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2),
                                         np.arange(n), window=window, n_sink=sinks, k_bits=k_bits, v_bits=v_bits,
                                         scale=scale).transpose(1, 0, 2)

    expected = oracle(window)
    quantization_error = np.abs(expected - oracle(n)).max()    # a window of n: nothing quantized
    assert quantization_error > 1e-2
    assert np.abs(ours - expected).max() < 0.02 * quantization_error


def test_errors_grow_as_bits_shrink_and_k_outliers_are_recorded() -> None:
    q, k, v = random_qkv(200)
    calibration = Calibration(1, 200, CalibrationSettings(window=32, sinks=0, device="cpu"))
    probe = LayerProbe(calibration)
    probe.measure(0, torch.from_numpy(q)[None], torch.from_numpy(k)[None], torch.from_numpy(v)[None], 64 ** -0.5)
    for part in ("k", "v"):
        e = {name: calibration.errors[part, name][0] for name in ("kivi4", "kivi2", "kivi1")}
        assert 0 < e["kivi4"] < e["kivi2"] < e["kivi1"]
    stats = calibration.stats[0]
    channels = np.asarray(stats.k_channel_absmax).reshape(2, 64)
    assert (channels[:, 3] > 4 * np.delete(channels, 3, axis=1).max(axis=1)).all()
    costs = {s.part: s.cost for s in calibration.sensitivities()}
    assert costs["k"]["kivi2"] == 0 and costs["k"]["kivi4"] < 0 < costs["k"]["kivi1"]


def test_given_quantized_keys_are_read_exactly_where_the_cache_reads_k_quantized() -> None:
    """k_quantized (another quantization's keys, e.g. made before RoPE) replaces K's own tiles and nothing else."""
    q, k, v = (torch.from_numpy(a) for a in random_qkv(100))
    scale = 64 ** -0.5
    own = kivi_attention(q, k, v, scale, 32, 0, 2, None)
    given = kivi_attention(q, k, v, scale, 32, 0, 2, None, k_quantized=fake_quantize(k.half().float(), 2, dim=1))
    torch.testing.assert_close(given, own, rtol=0, atol=0)
    zeros = kivi_attention(q, k, v, scale, 32, 0, 2, None, k_quantized=torch.zeros_like(k))
    first_sealed = 32    # query i reads cell j quantized from i - j >= the window (32) in a tile before i's on
    torch.testing.assert_close(zeros[:, :first_sealed], own[:, :first_sealed], rtol=0, atol=0)
    assert (zeros[:, first_sealed:] - own[:, first_sealed:]).abs().max() > 1e-2


def test_given_quantized_values_are_read_exactly_where_the_cache_reads_v_quantized() -> None:
    q, k, v = (torch.from_numpy(a) for a in random_qkv(100))
    scale = 64 ** -0.5
    own = kivi_attention(q, k, v, scale, 32, 0, None, 2)
    given = kivi_attention(q, k, v, scale, 32, 0, None, 2, v_quantized=fake_quantize(v, 2, dim=2))
    torch.testing.assert_close(given, own, rtol=0, atol=0)
    zeros = kivi_attention(q, k, v, scale, 32, 0, None, 2, v_quantized=torch.zeros_like(v))
    window = 32     # query i reads V row j quantized from i - j >= the window
    torch.testing.assert_close(zeros[:, :window], own[:, :window], rtol=0, atol=0)
    assert (zeros[:, window:] - own[:, window:]).abs().max() > 1e-2


@pytest.mark.parametrize("about_midpoint", [False, True])
def test_a_clip_narrows_each_group_to_its_ratio(about_midpoint: bool) -> None:
    rows = torch.from_numpy(np.random.default_rng(7).standard_normal((6, 64)).astype(np.float32))
    torch.testing.assert_close(fake_quantize(rows, 2, dim=1, clip=1.0, about_midpoint=about_midpoint),
                               fake_quantize(rows, 2, dim=1), rtol=0, atol=0)
    ratio = torch.tensor([1.0, 0.5]).view(1, 2, 1)      # group 0 as is, group 1 narrowed to half its range
    clipped = fake_quantize(rows, 2, dim=1, clip=ratio, about_midpoint=about_midpoint).reshape(6, 2, 32)
    groups = rows.reshape(6, 2, 32)
    lo, hi = groups.amin(-1), groups.amax(-1)
    if about_midpoint:
        middle, half = (hi + lo) / 2, (hi - lo) / 2
        lo, hi = middle - ratio[..., 0] * half, middle + ratio[..., 0] * half
    else:
        lo, hi = lo * ratio[..., 0], hi * ratio[..., 0]
    # the end codes give the narrowed range's ends (within fp16's rounding of the minimum and the step)
    torch.testing.assert_close(clipped.amin(-1), lo, rtol=0, atol=1e-2)
    torch.testing.assert_close(clipped.amax(-1), hi, rtol=0, atol=1e-2)
