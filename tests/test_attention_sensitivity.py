"""pykvq.calibration.attention_sensitivity: each layer's K and V cost per width from captured Q, K and V (numpy), on
data built to need more bits in one layer than in another."""

from __future__ import annotations

import numpy as np
import pytest

from pykvq.calibration import attention_sensitivity as sens
from pykvq.calibration.allocation import allocate
from pykvq.calibration.clip_ratios import RATIOS


def qkv(n: int, seed: int, spread: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q and K of ``spread``: the larger, the more peaked the attention and the more a quantized K moves it."""
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((n, 4, 32)) * spread).astype(np.float32)
    k = (rng.standard_normal((n, 2, 32)) * spread).astype(np.float32)
    v = rng.standard_normal((n, 2, 32)).astype(np.float32)
    return q, k, v


def errors_of(layers: list[tuple[np.ndarray, ...]], window: int = 16, ratios=RATIOS) -> list[sens.WidthErrors]:
    n_layer = len(layers)
    return sens.width_errors(lambda il: layers[il], n_layer, window, 0, {"k": [1.0] * n_layer, "v": [0.9] * n_layer},
                             ratios)


def test_fewer_bits_move_the_output_more() -> None:
    for e in errors_of([qkv(128, 1), qkv(128, 2)]):
        assert 0 < e.error["kivi4"] < e.error["kivi2"] < e.error["kivi1"]


def test_kivi2_keeps_its_calibrated_ratio_and_other_widths_take_their_least_error() -> None:
    layers = [qkv(128, 3)]
    errors = errors_of(layers)
    assert [e.clip["kivi2"] for e in errors] == [1.0, 0.9]
    given = errors_of(layers, ratios=None)
    for e, plain in zip(errors, given, strict=True):
        assert e.error["kivi1"] <= plain.error["kivi1"] and e.error["kivi4"] <= plain.error["kivi4"]
        # ratios given by the user hold at every width
        assert plain.clip["kivi4"] == plain.clip["kivi1"] == plain.clip["kivi2"]


def test_a_window_over_every_token_costs_nothing_at_any_width() -> None:
    errors = errors_of([qkv(64, 4)], window=64)
    assert all(x == 0.0 for e in errors for x in e.error.values())
    assert sens.kld_scale(errors, "k", 0.3) == 0.0
    assert all(c == 0.0 for s in sens.sensitivities(errors, {"k": 0.0, "v": 0.0}) for c in s.cost.values())


def test_each_parts_measured_divergence_is_shared_by_its_kivi2_errors() -> None:
    errors = errors_of([qkv(128, 5), qkv(128, 6, spread=2.0)])
    scale = {part: sens.kld_scale(errors, part, kld) for part, kld in (("k", 0.2), ("v", 0.05))}
    costs = sens.sensitivities(errors, scale)
    for part, kld in (("k", 0.2), ("v", 0.05)):
        # kivi2 everywhere predicts the measured divergence, and costs are relative to it
        assert sum(scale[part] * e.error["kivi2"] for e in errors if e.part == part) == pytest.approx(kld)
    assert all(s.cost["kivi2"] == 0.0 and s.cost["kivi4"] < 0 < s.cost["kivi1"] for s in costs)


def test_the_layer_whose_attention_a_coarse_k_moves_most_gets_the_bits() -> None:
    # layer 1's sharper attention turns a K error into a larger output error: at 2.0 bits with V fixed cheap,
    # the allocation gives its K 4 bits and pays with layer 0's
    errors = errors_of([qkv(256, 7), qkv(256, 8, spread=2.5)])
    costs = sens.sensitivities(errors, {"k": 1.0, "v": 1e-6})
    by = {(e.part, e.layer): e.error for e in errors}
    assert by["k", 1]["kivi2"] > by["k", 0]["kivi2"]
    types = allocate(costs, 2, 2.0).types
    assert types["k", 1] == "kivi4" and types["k", 0] != "kivi4"


def test_a_mixs_clip_spec_takes_each_tensors_ratio_at_its_width() -> None:
    errors = [sens.WidthErrors("k", 0, {}, {"kivi4": 1.0, "kivi2": 0.8, "kivi1": 0.7}),
              sens.WidthErrors("k", 1, {}, {"kivi4": 0.95, "kivi2": 0.8, "kivi1": 0.7}),
              sens.WidthErrors("v", 0, {}, {"kivi4": 1.0, "kivi2": 0.9, "kivi1": 0.7}),
              sens.WidthErrors("v", 1, {}, {"kivi4": 1.0, "kivi2": 1.0, "kivi1": 1.0})]
    types = {("k", 0): "kivi4", ("k", 1): "kivi2", ("v", 0): "kivi1", ("v", 1): "kivi2"}
    assert sens.clip_spec(errors, types, 2) == "k:0=1,1=0.8;v:0=0.7,1=1"
    everywhere2 = dict.fromkeys(types, "kivi2")
    assert sens.clip_spec(errors, everywhere2, 2) == "k:0-1=0.8;v:0=0.9,1=1"
