"""pykvq.calibration.rotation: the per-layer rotation pykvq calibrate measures, against numpy facts and built cases."""

from __future__ import annotations

import numpy as np
import pytest

from pykvq import kv_types
from pykvq.calibration import rotation
from pykvq.bindings import native

TOKENS, HEADS, KV_HEADS, DIM = 96, 4, 2, 64


@pytest.mark.parametrize("n", [64, 128, 256])
def test_the_hadamard_matrix_is_orthonormal_and_of_signs(n: int) -> None:
    h = rotation.hadamard(n)
    np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-5)
    assert set(np.unique(np.abs(h) * np.sqrt(n)).round(5)) == {1.0}


@pytest.mark.parametrize(("head_dim", "order"), [(64, 64), (128, 128), (256, 256), (192, 64), (320, 64)])
def test_k_turns_in_the_largest_power_of_two_block_as_the_cache_does(head_dim: int, order: int) -> None:
    assert rotation.k_block(head_dim) == order
    assert rotation.rotatable(head_dim)
    assert not rotation.rotatable(80)


def test_turning_q_and_k_alike_keeps_every_score() -> None:
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(8, 128)).astype(np.float32), rng.normal(size=(8, 128)).astype(np.float32)
    np.testing.assert_allclose(rotation.rotate(q, 128) @ rotation.rotate(k, 128).T, q @ k.T, rtol=1e-4, atol=1e-4)


def layers(n_layer: int) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """K whose every channel takes two values (what per-channel groups hold exactly at their end codes, and a
    rotation turns into sums of many), V with one huge channel per token (what per-token groups lose to, and a
    rotation spreads)."""
    rng = np.random.default_rng(1)
    out = {}
    for il in range(n_layer):
        q = rng.normal(size=(TOKENS, HEADS, DIM)).astype(np.float32)
        scales = np.geomspace(0.25, 4, DIM, dtype=np.float32)
        k = scales * rng.choice([-1.0, 1.0], size=(TOKENS, KV_HEADS, DIM)).astype(np.float32)
        v = rng.normal(size=(TOKENS, KV_HEADS, DIM)).astype(np.float32)
        v[:, :, 5] = 200.0 * rng.choice([-1.0, 1.0], size=(TOKENS, KV_HEADS))
        out[il] = (q, k, v)
    return out


def test_each_part_is_rotated_where_that_lowers_its_error() -> None:
    data = layers(3)
    spec = rotation.per_layer_rotation(data.__getitem__, 3, window=16, sinks=0)
    assert spec == "v:0-2=on"
    rotate_k, rotate_v = native.resolve_rotation(spec, 3)
    assert rotate_k == [False] * 3 and rotate_v == [True] * 3


def test_the_rotated_view_turns_only_the_layers_and_parts_it_names() -> None:
    data = layers(2)
    view = rotation.rotated_layer(data.__getitem__, {"k": [True, False], "v": [False, False]})
    q0, k0, v0 = view(0)
    assert not np.array_equal(k0, data[0][1]) and np.array_equal(v0, data[0][2])
    assert all(np.array_equal(a, b) for a, b in zip(view(1), data[1], strict=True))


@pytest.mark.parametrize(("values", "neutral", "spec"), [
    ({"k": ["on", "on", "off"], "v": ["off"] * 3}, "off", "k:0-1=on,2=off"),
    ({"k": ["off"] * 3, "v": ["off"] * 3}, "off", "none"),
    ({"k": ["0.9", "1", "1"], "v": ["1", "0.8", "0.8"]}, "1", "k:0=0.9,1-2=1;v:0=1,1-2=0.8"),
])
def test_per_layer_values_become_the_spec_form(values: dict[str, list[str]], neutral: str, spec: str) -> None:
    assert kv_types.per_layer_spec(values, neutral) == spec
