"""SKVQ's clipped quantization in the kernels: GGML_KVQ_OP_STORE_V's blocks bit for bit against the numpy model of
the format (tests/kvq_oracle.py), on every backend the op-level harness reaches. The K tiles' clip (SEAL_K) is judged
through the attention, against the same oracle, in tests/test_kvq_attention.py."""

from __future__ import annotations

import kvq_graph as g
import kvq_oracle as oracle
import numpy as np
import pytest

from pykvq.bindings.ggml_types import GGML_TYPE_KIVI1, GGML_TYPE_KIVI2, GGML_TYPE_KIVI4, KIVI_BITS

N_EMBD = 128


def hostile_rows(n_rows: int, seed: int) -> np.ndarray:
    """Rows of 4 blocks each: ordinary values, one sign only, a zero range, and the fp16 extremes with NaN."""
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((n_rows, N_EMBD)) * rng.uniform(0.1, 4, (n_rows, 1))).astype(np.float32)
    rows[:, 32:64] = np.abs(rows[:, 32:64]) + 0.5
    rows[:, 64:96] = np.float32(-1.25)
    rows[0, 96:128] = np.float32(65504.0)
    rows[1, 96:100] = [np.nan, -65504.0, 70000.0, -0.0]
    return rows


def stored_rows(type_id: int, rows: np.ndarray, clip: float, backend: g.Backend | None) -> np.ndarray:
    """The bytes of a kivi tensor after ggml_kvq_store_v wrote ``rows`` into it in reverse order."""
    lib = g.libs().base
    n_rows = rows.shape[0]
    ctx = g.Context(backend=backend)
    try:
        v_rows = ctx.new(type_id, N_EMBD, n_rows)
        idxs = ctx.tensor(np.arange(n_rows, dtype=np.int64)[::-1].copy())
        stored = lib.ggml_kvq_store_v(ctx.ctx, v_rows, ctx.tensor(rows[::-1].copy()), idxs, clip)
        ctx.compute(stored)
        return ctx.read(v_rows, np.uint8, (n_rows, -1))
    finally:
        ctx.close()


@pytest.mark.parametrize("type_id", [GGML_TYPE_KIVI2, GGML_TYPE_KIVI4, GGML_TYPE_KIVI1],
                         ids=["kivi2", "kivi4", "kivi1"])
@pytest.mark.parametrize("clip", [1.0, 0.9, 0.55, oracle.CLIP_MSE], ids=["1", "0.9", "0.55", "mse"])
def test_stored_rows_match_the_format(type_id: int, clip: float, kvq_backend: g.Backend | None) -> None:
    rows = hostile_rows(9, seed=int(clip * 100) + type_id)
    got = stored_rows(type_id, rows, clip, kvq_backend)
    np.testing.assert_array_equal(got, oracle.quantize_rows(rows, KIVI_BITS[type_id], clip))


def search_prone_rows(n_rows: int, seed: int) -> np.ndarray:
    """Blocks where the search's arithmetic shows: codes on ties (half steps of small integer ranges), steps near
    fp16's subnormals and near its largest values, signed zeros, infinities and outliers beyond fp16."""
    rng = np.random.default_rng(seed)
    scales = np.float32(10.0) ** rng.integers(-8, 5, (n_rows, N_EMBD // 32, 1)).astype(np.float32)
    blocks = (rng.standard_normal((n_rows, N_EMBD // 32, 32)) * scales).astype(np.float32)
    blocks[0::4, 0] = rng.integers(0, 7, (len(blocks[0::4]), 32)) * np.float32(0.5)
    blocks[1::4, 1] = rng.choice(np.array([0.0, -0.0, 1e-7, -3e-8], dtype=np.float32), (len(blocks[1::4]), 32))
    blocks[2::4, 2] = rng.uniform(-65504, 65504, (len(blocks[2::4]), 32))
    blocks[3::4, 3, :5] = [np.inf, -np.inf, 70000.0, -1e30, np.nan]
    return blocks.reshape(n_rows, N_EMBD)


@pytest.mark.parametrize("type_id", [GGML_TYPE_KIVI2, GGML_TYPE_KIVI4, GGML_TYPE_KIVI1],
                         ids=["kivi2", "kivi4", "kivi1"])
def test_the_search_matches_the_format_on_ties_and_extreme_scales(type_id: int) -> None:
    """The CPU search runs every candidate at once in vector lanes (kvq-quants.c): each candidate's sum must still be
    the oracle's, in value order, with no product fused into a sum."""
    rows = search_prone_rows(64, seed=type_id)
    got = stored_rows(type_id, rows, oracle.CLIP_MSE, None)
    np.testing.assert_array_equal(got, oracle.quantize_rows(rows, KIVI_BITS[type_id], oracle.CLIP_MSE))


def test_a_clip_narrows_the_range_and_saturates_the_outliers() -> None:
    """Not vacuous: a clipped block's step shrinks by the ratio, and its extreme values take the end codes."""
    x = np.linspace(-2.0, 3.0, 32, dtype=np.float32)
    plain = oracle.dequantize_block(oracle.quantize_block(x, 2), 2)
    clipped = oracle.dequantize_block(oracle.quantize_block(x, 2, 0.8), 2)
    assert clipped.min() == pytest.approx(-1.6, abs=1e-3) and clipped.max() == pytest.approx(2.4, abs=1e-2)
    assert plain.min() == pytest.approx(-2.0, abs=1e-3) and plain.max() == pytest.approx(3.0, abs=1e-2)
    stored = stored_rows(GGML_TYPE_KIVI2, np.tile(x, (1, N_EMBD // 32)), 0.8, None)
    assert stored[0, :12].tobytes() == oracle.quantize_block(x, 2, 0.8)


def test_mse_searches_each_block_for_its_least_squared_error() -> None:
    """Not vacuous: on Gaussian blocks the searched range is narrower than the block's and its squared error lower
    than the plain format's and any one ratio's; a block whose extremes are its only values keeps its range."""
    rows = np.random.default_rng(7).standard_normal((16, N_EMBD)).astype(np.float32)
    blocks = rows.reshape(-1, 32)

    def squared_error(clip: float) -> float:
        return sum(float(np.square(oracle.dequantize_block(oracle.quantize_block(b, 2, clip), 2) - b).sum())
                   for b in blocks)

    searched = squared_error(oracle.CLIP_MSE)
    assert searched < 0.8 * squared_error(1.0)
    assert all(searched < squared_error(r) for r in (0.95, 0.9, 0.85, 0.8, 0.75, 0.7))
    stored = stored_rows(GGML_TYPE_KIVI2, rows, oracle.CLIP_MSE, None)
    assert stored.tobytes() == b"".join(oracle.quantize_block(b, 2, oracle.CLIP_MSE) for b in blocks)
    two_valued = np.where(np.arange(32) % 2 == 0, -1.0, 2.0).astype(np.float32)
    assert oracle.quantize_block(two_valued, 2, oracle.CLIP_MSE) == oracle.quantize_block(two_valued, 2)
