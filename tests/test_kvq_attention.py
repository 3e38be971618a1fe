"""GGML_OP_KVQ on the CPU: quantize-on-write, tile sealing, fp16 ring and sinks, and attention that reads
the quantized tiles directly, against the numpy reference of DESIGN.md §5 (tests/kvq_oracle.py)."""

from __future__ import annotations

from dataclasses import replace

import kvq_graph as g
import kvq_oracle as oracle
import numpy as np
import pytest
from kvq_layer import Case, random_qkv, run_layer

from pykvq.bindings.ggml_types import GGML_TYPE_KIVI1, GGML_TYPE_KIVI4, KIVI_BITS


def reference(case: Case, q, k, v, n_swa: int = 0) -> np.ndarray:
    return oracle.kivi_attention(q, k, v, np.arange(k.shape[0]), window=case.window, n_sink=case.n_sink,
                                 k_bits=KIVI_BITS[case.k_type], v_bits=KIVI_BITS[case.v_type],
                                 scale=1.0 / np.sqrt(case.head_dim), n_swa=n_swa, clip_k=case.clip_k,
                                 clip_v=case.clip_v, softcap=case.softcap, sinks=case.sinks)


def case_id(c: Case) -> str:
    bits = f"k{KIVI_BITS[c.k_type]}v{KIVI_BITS[c.v_type]}"
    clip = f"-clip{c.clip_k:g}/{c.clip_v:g}" if (c.clip_k, c.clip_v) != (1.0, 1.0) else ""
    softcap = f"-cap{c.softcap:g}" if c.softcap else ""
    sinks = "-learned-sinks" if c.sinks else ""
    return f"d{c.head_dim}/{c.dv}-h{c.n_head}/{c.n_head_kv}-w{c.window}-s{c.n_sink}-{bits}{clip}{softcap}{sinks}"


CASES = [
    Case(head_dim=64, n_head=9, n_head_kv=3, window=32, n_sink=0),
    Case(head_dim=64, n_head=4, n_head_kv=4, window=0, n_sink=0),
    Case(head_dim=128, n_head=8, n_head_kv=2, window=40, n_sink=5),
    Case(head_dim=32, n_head=2, n_head_kv=1, window=16, n_sink=3, k_type=GGML_TYPE_KIVI4, v_type=GGML_TYPE_KIVI1),
    Case(head_dim=64, n_head=6, n_head_kv=2, window=64, n_sink=0, k_type=GGML_TYPE_KIVI1, v_type=GGML_TYPE_KIVI4),
    Case(head_dim=64, n_head=16, n_head_kv=1, window=32, n_sink=2),                 # GQA 16
    Case(head_dim=192, n_head=4, n_head_kv=2, window=32, n_sink=0, head_dim_v=128),  # K head size != V's
    Case(head_dim=96, n_head=6, n_head_kv=3, window=24, n_sink=0),
    # SKVQ's clipping: the K tiles and V rows each with their own ratio, and 1-bit K (two codes: the clip decides
    # both ends)
    Case(head_dim=64, n_head=6, n_head_kv=2, window=32, n_sink=2, clip_k=0.85, clip_v=0.7),
    Case(head_dim=64, n_head=4, n_head_kv=2, window=16, n_sink=0, k_type=GGML_TYPE_KIVI1, clip_k=0.6, clip_v=0.95),
    # Gemma 2's logit soft-capping, low enough to bend these scores (std about 1)
    Case(head_dim=128, n_head=8, n_head_kv=4, window=24, n_sink=2, softcap=1.5),
    # gpt-oss's learned sink logits, one per query head, large enough to take a visible share
    Case(head_dim=64, n_head=4, n_head_kv=2, window=16, n_sink=0, sinks=(4.0, -2.0, 5.5, 3.0)),
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_attention_matches_reference(case: Case, kvq_backend: g.Backend | None) -> None:
    n_cells = 150
    q, k, v = random_qkv(case, n_cells, seed=case.head_dim + case.window)
    got = run_layer(case, q, k, v, [37, 1, 64, 20, 28], backend=kvq_backend)
    np.testing.assert_allclose(got, reference(case, q, k, v), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("option", ["softcap", "sinks"])
def test_the_attention_options_change_their_cases(option: str) -> None:
    """The soft-capped and the sink cases above would fail if a kernel ignored the option: without it the
    attention is far from theirs."""
    case = next(c for c in CASES if getattr(c, option))
    q, k, v = random_qkv(case, 150, seed=case.head_dim + case.window)
    without = replace(case, **{option: type(getattr(case, option))()})
    assert np.abs(reference(case, q, k, v) - reference(without, q, k, v)).max() > 0.05


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_flash_attention_prefill_matches_reference(case: Case, kvq_backend: g.Backend | None) -> None:
    """The same contract through upstream's flash attention over wide cells; its K and V are fp16 values (the
    quantized ones dequantized and rounded) and it accumulates in fp16 as with an f16 cache: a tolerance of fp16."""
    n_cells = 150
    q, k, v = random_qkv(case, n_cells, seed=case.head_dim + case.window)
    got = run_layer(case, q, k, v, [37, 1, 64, 20, 28], wide=True, backend=kvq_backend)
    fused = run_layer(case, q, k, v, [37, 1, 64, 20, 28], backend=kvq_backend)
    want = reference(case, q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=4e-3)
    # the rounding is far below the quantization's own effect
    assert np.abs(got - fused).max() < 0.1 * np.abs(fused - run_layer(replace(case, window=4096), q, k, v, [150])).max()


SWA_CASES = [
    (Case(head_dim=256, n_head=4, n_head_kv=2, window=32, n_sink=0), 96),   # Gemma-3's head size
    (Case(head_dim=64, n_head=8, n_head_kv=2, window=16, n_sink=4), 40),    # the window cuts through tiles
    (Case(head_dim=128, n_head=4, n_head_kv=4, window=0, n_sink=0), 33),    # every tile sealed, one cell past
    (Case(head_dim=64, n_head=2, n_head_kv=1, window=100, n_sink=0), 64),   # kivi window wider than the SWA
]


@pytest.mark.parametrize(("case", "n_swa"), SWA_CASES, ids=lambda c: str(c.head_dim) if isinstance(c, Case) else str(c))
@pytest.mark.parametrize("wide", [False, True], ids=["fused", "flash"])
def test_sliding_window_layers_attend_only_their_window(case: Case, n_swa: int, wide: bool) -> None:
    """A kivi sliding-window cache keeps every token (llama-kvq-cache.h): cells that left the window, sealed
    tiles cut by it included, are hidden by llama.cpp's mask alone, exactly as the oracle's sliding window."""
    q, k, v = random_qkv(case, 170, seed=n_swa)
    ubatches = [37, 1, 64, 20, 48]
    got = run_layer(case, q, k, v, ubatches, wide=wide, n_swa=n_swa)
    want = reference(case, q, k, v, n_swa=n_swa)
    if wide:
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=4e-3)
    else:
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    # the window matters: the causal result differs
    assert np.abs(got - reference(case, q, k, v)).max() > 1e-2


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"d{c.head_dim}-w{c.window}-s{c.n_sink}")
def test_batching_does_not_change_results(case: Case, kvq_backend: g.Backend | None) -> None:
    """Bit for bit on every backend: 200 cells are two of the GPU kernel's splits, which sit at fixed cells
    whatever the batch (a split count chosen from the batch made one query's sums differ with it)."""
    q, k, v = random_qkv(case, 200, seed=11)
    whole = run_layer(case, q, k, v, [200], backend=kvq_backend)
    one_by_one = run_layer(case, q, k, v, [1] * 200, backend=kvq_backend)
    mixed = run_layer(case, q, k, v, [31, 33, 2, 34, 100], backend=kvq_backend)
    np.testing.assert_array_equal(whole, one_by_one)
    np.testing.assert_array_equal(whole, mixed)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=case_id)
def test_an_infinite_fp16_cell_stays_out_of_the_queries_it_is_masked_from(case: Case,
                                                                          kvq_backend: g.Backend | None) -> None:
    """A K and a V beyond fp16's range are inf in the window. The earlier tokens of the same batch, which the causal
    mask keeps from that cell, must skip it rather than multiply it by a weight of 0 (inf times 0 is NaN)."""
    q, k, v = random_qkv(case, 64, seed=5)
    k[50, 0, 3] = 1e6
    v[50, 0, 7] = -1e6
    got = run_layer(case, q, k, v, [64], backend=kvq_backend)
    np.testing.assert_allclose(got[:50], reference(case, q[:50], k[:50], v[:50]), rtol=2e-4, atol=2e-5)
    assert not np.isfinite(got[50:]).all()


@pytest.mark.parametrize("case", [CASES[0], CASES[5]], ids=lambda c: f"h{c.n_head}/{c.n_head_kv}")
def test_the_cpu_result_depends_on_neither_threads_nor_batches(case: Case) -> None:
    """The CPU kernel attends a KV head's queries in groups sized by the batch and the thread count (GQA 16: in
    chunks of heads, split further when one token leaves threads idle); a query's arithmetic is the group's
    business in nothing: bit for bit on 1, 3 and 4 threads, whole, token by token or in uneven batches."""
    q, k, v = random_qkv(case, 120, seed=13)
    alone = run_layer(case, q, k, v, [120], n_threads=1)
    for n_threads in (3, 4):
        for ubatches in ([120], [1] * 120, [7, 50, 63]):
            np.testing.assert_array_equal(run_layer(case, q, k, v, ubatches, n_threads=n_threads), alone)


def test_quantized_cells_are_really_quantized() -> None:
    """Sanity of the oracle comparison itself: with a window covering everything, the result is plain
    fp16 attention, and with a short window it measurably differs from it."""
    wide = Case(head_dim=64, n_head=2, n_head_kv=1, window=4096, n_sink=0)
    short = Case(head_dim=64, n_head=2, n_head_kv=1, window=0, n_sink=0)
    q, k, v = random_qkv(wide, 96, seed=5)
    full = run_layer(wide, q, k, v, [96])
    fp16 = oracle.kivi_attention(q, k, v, np.arange(96), window=10**9, n_sink=0, k_bits=2, v_bits=2,
                                 scale=1 / 8)
    np.testing.assert_allclose(full, fp16, rtol=2e-4, atol=2e-5)
    assert np.abs(run_layer(short, q, k, v, [96]) - full).max() > 1e-2
