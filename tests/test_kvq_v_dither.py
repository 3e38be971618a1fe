"""V's dithered rounding in the kernels (ggml_kvq_store_set_v_dither): GGML_KVQ_OP_STORE_V's blocks bit for bit
against the numpy model of the format (tests/kvq_oracle.py) on every backend the op-level harness reaches, each row
drawn by its cell's index in its part modulo the period (so a sequence's codes do not depend on the cache's layout,
nor, in a sliding-window cache, on its drops), and what the
dither is for: identical rows at different cells get different codes whose errors average out. STORE's decode path
and its CUDA kernel are compared with these in tests/test_kvq_store.py; STORE_V's CUDA kernel (upstream's set_rows into
a kivi type as well) runs emulated on the CPU here."""

from __future__ import annotations

from pathlib import Path

import kvq_emulation
import kvq_graph as g
import kvq_oracle as oracle
import numpy as np
import pytest
from test_kvq_clip import N_EMBD, hostile_rows

from pykvq.bindings.ggml_types import GGML_TYPE_KIVI1, GGML_TYPE_KIVI2, GGML_TYPE_KIVI4, KIVI_BITS

PART_CELLS = 48
RING = 16  # a sliding-window cache's period
LAYER = 5


def dithered_rows(type_id: int, rows: np.ndarray, cells: np.ndarray, spread: float, clip: float,
                  backend: g.Backend | None, n_cells: int = 2 * PART_CELLS,
                  emulation: Path | None = None, period: int = PART_CELLS) -> np.ndarray:
    """The bytes of a kivi tensor of n_cells rows after a dithered ggml_kvq_store_v wrote ``rows`` into ``cells``
    (through the emulated CUDA kernel with ``emulation``)."""
    lib = g.libs().base
    ctx = g.Context(backend=backend)
    try:
        v_rows = ctx.new(type_id, N_EMBD, n_cells)
        stored = lib.ggml_kvq_store_v(ctx.ctx, v_rows, ctx.tensor(rows), ctx.tensor(cells.astype(np.int64)), clip)
        lib.ggml_kvq_store_set_v_dither(stored, spread, LAYER, PART_CELLS, period)
        if emulation is None:
            ctx.compute(stored)
        else:
            kvq_emulation.run_store_v(emulation, stored)
        return ctx.read(v_rows, np.uint8, (n_cells, -1))[cells]
    finally:
        ctx.close()


@pytest.mark.parametrize("type_id", [GGML_TYPE_KIVI2, GGML_TYPE_KIVI4, GGML_TYPE_KIVI1],
                         ids=["kivi2", "kivi4", "kivi1"])
@pytest.mark.parametrize("spread, clip, period", [(1.0, 1.0, PART_CELLS), (0.5, 0.85, RING), (0.25, 1.0, PART_CELLS)])
def test_dithered_rows_match_the_format(type_id: int, spread: float, clip: float, period: int,
                                        kvq_backend: g.Backend | None) -> None:
    rows = hostile_rows(9, seed=type_id + int(spread * 8))
    cells = np.array([0, 3, 47, 48, 50, 95, 20, 68, 31])
    got = dithered_rows(type_id, rows, cells, spread, clip, kvq_backend, period=period)
    want = oracle.quantize_rows(rows, KIVI_BITS[type_id], clip, spread, LAYER, cells % PART_CELLS % period)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("type_id", [GGML_TYPE_KIVI2, GGML_TYPE_KIVI4, GGML_TYPE_KIVI1],
                         ids=["kivi2", "kivi4", "kivi1"])
@pytest.mark.parametrize("spread, period", [(0.0, PART_CELLS), (0.5, RING), (1.0, PART_CELLS)])
def test_the_emulated_cuda_kernel_writes_what_the_cpu_writes(cuda_emulation: Path, type_id: int, spread: float,
                                                             period: int) -> None:
    rows = hostile_rows(9, seed=type_id + 7)
    cells = np.array([95, 3, 47, 48, 50, 0, 20, 68, 31])
    np.testing.assert_array_equal(
        dithered_rows(type_id, rows, cells, spread, 0.9, None, emulation=cuda_emulation, period=period),
        dithered_rows(type_id, rows, cells, spread, 0.9, None, period=period))


def test_no_spread_is_nearest_rounding() -> None:
    rows = hostile_rows(4, seed=3)
    cells = np.array([1, 2, 60, 70])
    np.testing.assert_array_equal(dithered_rows(GGML_TYPE_KIVI2, rows, cells, 0.0, 1.0, None),
                                  oracle.quantize_rows(rows, 2))


def test_a_row_is_drawn_by_its_cell_in_its_part() -> None:
    """Cell p of the second part takes the codes cell p of the first takes, and another cell other codes."""
    row = np.random.default_rng(0).standard_normal((1, N_EMBD)).astype(np.float32)
    rows = np.repeat(row, 3, axis=0)
    got = dithered_rows(GGML_TYPE_KIVI2, rows, np.array([7, 7 + PART_CELLS, 8]), 1.0, 1.0, None)
    assert got[0].tobytes() == got[1].tobytes() != got[2].tobytes()


def test_a_row_s_draw_repeats_every_period_of_its_part() -> None:
    """A sliding-window part drops whole rings from its front: cells a ring apart take the same codes, so a token
    keeps its draw when it lands a ring earlier."""
    row = np.random.default_rng(0).standard_normal((1, N_EMBD)).astype(np.float32)
    rows = np.repeat(row, 4, axis=0)
    got = dithered_rows(GGML_TYPE_KIVI2, rows, np.array([7, 7 + RING, 7 + 2 * RING + PART_CELLS, 8]), 1.0, 1.0,
                        None, period=RING)
    assert got[0].tobytes() == got[1].tobytes() == got[2].tobytes() != got[3].tobytes()


def test_identical_rows_get_errors_that_average_out() -> None:
    """What the dither is for: nearest rounding gives every copy of a row the same error, so their mean keeps it;
    dithered copies' mean error is several times smaller (stochastic rounding is unbiased)."""
    n = 2 * PART_CELLS
    row = np.random.default_rng(1).standard_normal((1, N_EMBD)).astype(np.float32)
    rows, cells = np.repeat(row, PART_CELLS, axis=0), np.arange(PART_CELLS)
    errors = {}
    for spread in (0.0, 1.0):
        data = dithered_rows(GGML_TYPE_KIVI1, rows, cells, spread, 1.0, None, n)
        mean = oracle.dequantize_rows(data, 1, N_EMBD).mean(axis=0)
        errors[spread] = float(np.abs(mean - row[0]).mean())
    assert errors[1.0] < errors[0.0] / 3
