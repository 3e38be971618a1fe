"""ATTN on tensor cores (ggml-kvq/src/cuda/kvq-cuda-mma-kernel.cuh, GGML_KVQ_CUDA_MMA=1) against the CPU op, which
tests/test_kvq_attention.py holds to the numpy oracle. On every machine through the emulated CUDA of
tests/kvq_emulation.py (the kernel's own source on the CPU: fragment layouts, staging, masks, split merges); on a
GPU through the CUDA build itself. On the GPU the bar is the issue's, upstream's flash-attention bar: NMSE <= 5e-4
(the kernel's products take fp16 operands: Q scaled, Q times the tiles' scales, the softmax weights); the emulation,
whose products and sums are exact fp32 ones, is held far tighter (measured: up to 2.4e-7 over these cases), so that
a lost cell or block, which costs more than 1e-4, fails it."""

from __future__ import annotations

from pathlib import Path

import kvq_emulation as emulation
import kvq_graph as g
import numpy as np
import pytest
import test_kvq_latent as latent
from kvq_layer import Case, random_qkv, run_layer
from kvq_random_cache import RandomCache, attention
from test_kvq_attention import CASES, case_id

from pykvq.bindings.ggml_types import GGML_TYPE_KIVI1, GGML_TYPE_KIVI2, GGML_TYPE_KIVI4

NMSE_BAR = 5e-4
EMULATED_NMSE_BAR = 1e-5
MMA_COLS = 8  # query heads per block (KVQ_MMA_COLS): a KV head with more takes several blocks


def takes(case: Case) -> bool:
    """Whether kvq_attn_mma_wanted lets the tensor-core kernel run this case."""
    if case.latent:
        return (case.head_dim, case.dv) == (576, 512)  # DeepSeek's multi-head latent attention
    return case.dv == case.head_dim and case.head_dim in (64, 96, 128, 256)


MMA_CASES = [c for c in CASES + latent.CASES if takes(c)] + [
    Case(head_dim=256, n_head=8, n_head_kv=1, window=32, n_sink=4),                       # Gemma 3's head size, GQA 8
    Case(head_dim=128, n_head=6, n_head_kv=2, window=16, n_sink=0, k_type=GGML_TYPE_KIVI4, v_type=GGML_TYPE_KIVI4),
    Case(head_dim=128, n_head=24, n_head_kv=2, window=24, n_sink=3),                      # GQA 12: blocks of 8 and 4
    # latent layers: kivi4 with sinks over blocks of 8 and 4 heads; clipped 1-bit tiles, every tile sealed
    Case(head_dim=576, head_dim_v=512, n_head=12, n_head_kv=1, window=40, n_sink=3, latent=True,
         k_type=GGML_TYPE_KIVI4),
    Case(head_dim=576, head_dim_v=512, n_head=16, n_head_kv=1, window=0, n_sink=2, latent=True,
         k_type=GGML_TYPE_KIVI1, clip_k=0.8),
]
UBATCHES = [37, 1, 64, 20, 28]


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sum((got - want) ** 2) / np.sum(want**2))


@pytest.fixture(scope="module")
def emulated(cuda_emulation: Path):
    return emulation.attention_op(cuda_emulation, "tensor cores")


def test_the_cases_reach_the_kernel() -> None:
    """Every CASES entry the kernel takes is here, and the extra cases are ones it takes: among them KV heads of more
    than one block of query heads and latent layers."""
    assert len(MMA_CASES) >= 10 and all(takes(c) for c in MMA_CASES)
    assert any(c.n_head // c.n_head_kv > MMA_COLS for c in MMA_CASES if not c.latent)
    assert sum(c.latent for c in MMA_CASES) >= 3


@pytest.mark.parametrize("case", MMA_CASES, ids=case_id)
def test_emulated_tensor_cores_match_the_cpu(case: Case, emulated) -> None:
    q, k, v = random_qkv(case, 150, seed=case.head_dim + case.window)
    want = run_layer(case, q, k, v, UBATCHES)
    got = run_layer(case, q, k, v, UBATCHES, attention_op=emulated)
    assert nmse(got, want) <= EMULATED_NMSE_BAR
    # the kernel's own result, not the CPU's: its fp16 operands round
    assert not np.array_equal(got, want)


def test_emulated_splits_merge_as_the_cpu(emulated) -> None:
    """600 cells are two splits of 16 tiles: the last block of each (token, KV head) merges them."""
    case = Case(head_dim=128, n_head=4, n_head_kv=1, window=32, n_sink=5)
    q, k, v = random_qkv(case, 600, seed=3)
    ubatches = [560, 1, 7, 32]
    got = run_layer(case, q, k, v, ubatches, attention_op=emulated)
    want = run_layer(case, q, k, v, ubatches)
    assert nmse(got, want) <= EMULATED_NMSE_BAR


def test_emulated_sliding_window_masks_quantized_tiles(emulated) -> None:
    """A sliding window hides cells inside fully quantized tiles: their weights are dropped, whatever the rows hold."""
    case = Case(head_dim=64, n_head=8, n_head_kv=2, window=16, n_sink=4)
    q, k, v = random_qkv(case, 170, seed=40)
    ubatches = [37, 1, 64, 20, 48]
    got = run_layer(case, q, k, v, ubatches, n_swa=40, attention_op=emulated)
    want = run_layer(case, q, k, v, ubatches, n_swa=40)
    assert nmse(got, want) <= EMULATED_NMSE_BAR


@pytest.mark.parametrize("case", [CASES[2], latent.CASES[0]], ids=case_id)
def test_emulated_batching_does_not_change_results(case: Case, emulated) -> None:
    """Splits sit at fixed cells: a query's result is the same bits however its tokens were batched (a latent layer's
    16 heads in two blocks too)."""
    q, k, v = random_qkv(case, 100, seed=11)
    whole = run_layer(case, q, k, v, [100], attention_op=emulated)
    mixed = run_layer(case, q, k, v, [31, 33, 2, 34], attention_op=emulated)
    np.testing.assert_array_equal(whole, mixed)


# Tokens of a sequence share a block beside their heads (kvq_attn_mma_tokens: 8 over the heads of a KV head): 8 a
# block without GQA, 4 at GQA 2, 2 at GQA 3 (with 2 padding columns). Windows that do not end on a tile's edge give
# neighbouring tokens other views of one tile; a sliding window hides tiles from some tokens of a block and not from
# others (the last case: Gemma 2's head size, soft-capping and sliding-window layers).
PACKED_CASES = [
    (Case(head_dim=64, n_head=4, n_head_kv=4, window=40, n_sink=3), 0),
    (Case(head_dim=128, n_head=4, n_head_kv=2, window=16, n_sink=0, k_type=GGML_TYPE_KIVI4, v_type=GGML_TYPE_KIVI1),
     0),
    (Case(head_dim=96, n_head=6, n_head_kv=2, window=33, n_sink=2), 0),
    (Case(head_dim=64, n_head=2, n_head_kv=2, window=20, n_sink=0), 45),
    (Case(head_dim=256, n_head=4, n_head_kv=2, window=40, n_sink=0, softcap=30.0), 60),
]


def packed_id(x: Case | int) -> str:
    return case_id(x) if isinstance(x, Case) else f"swa{x}"


def packed_as_alone(case: Case, n_swa: int, **where) -> float:
    """A prefill's tokens packed into blocks get the bits each gets decoded alone, one token a step; returns that
    result's NMSE against the CPU op's."""
    n = 90
    q, k, v = random_qkv(case, n, seed=5)
    alone = run_layer(case, q, k, v, [1] * n, n_swa=n_swa, **where)
    for ubatches in ([n], [37, 3, 50]):
        np.testing.assert_array_equal(run_layer(case, q, k, v, ubatches, n_swa=n_swa, **where), alone)
    return nmse(alone, run_layer(case, q, k, v, [n], n_swa=n_swa))


@pytest.mark.parametrize(("case", "n_swa"), PACKED_CASES, ids=packed_id)
def test_emulated_packed_tokens_read_as_they_would_alone(case: Case, n_swa: int, emulated) -> None:
    assert packed_as_alone(case, n_swa, attention_op=emulated) <= EMULATED_NMSE_BAR


def kivi2(**fields) -> RandomCache:
    base = {"n_head": 32, "n_head_kv": 8, "head_dim": 128, "k_type": GGML_TYPE_KIVI2, "v_type": GGML_TYPE_KIVI2,
            "window": 128, "sinks": 5, "depth": 1000}
    return RandomCache(**(base | fields))


# the list: splits at 31/32/33 and 1032 tiles, 16 sequences at different depths, small prefill chunks,
# masked holes, a fully masked split, window < 32, mixed widths, head sizes 64/256, GQA 1 and 8
RANDOM_CACHES = {
    "31-tiles": kivi2(depth=31 * 32 - 1, sinks=3),
    "32-tiles": kivi2(depth=32 * 32 - 1),
    "33-tiles": kivi2(depth=33 * 32 - 1, window=32, sinks=0),
    "1032-tiles": kivi2(depth=1032 * 32 - 1, n_head=8, n_head_kv=2),
    "16-sequences-staggered": kivi2(depth=1500, seqs=16, stagger=90, n_head=8, n_head_kv=2),
    "chunks-of-8": kivi2(depth=700, seqs=4, n_tps=8, stagger=33, n_head=8, n_head_kv=2),
    "holes": kivi2(depth=900, holes=0.3, head_dim=64, n_head=8, n_head_kv=1, k_type=GGML_TYPE_KIVI1,
                   v_type=GGML_TYPE_KIVI4, window=20),
    "masked-split": kivi2(depth=1100, hidden=(0, 512), sinks=0, n_head=4, n_head_kv=4),
    "head-256": kivi2(depth=600, head_dim=256, n_head=8, n_head_kv=1, seqs=2, window=16),
    # DeepSeek's latent layer: 3 sequences at different depths, 2-token chunks, blocks of 8 and 4 query heads
    "latent-3-sequences": kivi2(depth=700, seqs=3, stagger=150, n_tps=2, head_dim=576, head_dim_v=512, n_head=12,
                                n_head_kv=1, window=32, sinks=4),
}


@pytest.mark.parametrize("name", RANDOM_CACHES)
def test_emulated_tensor_cores_read_random_caches_as_the_cpu(name: str, emulated) -> None:
    """The op alone over random valid caches, the CPU op and the emulated kernel on the same bytes."""
    cache = RANDOM_CACHES[name]
    assert takes(Case(cache.head_dim, cache.n_head, cache.n_head_kv, cache.window, cache.sinks,
                      head_dim_v=cache.head_dim_v, latent=cache.latent))
    ctx = g.Context(mem_size=(64 << 20) + cache.data_bytes())
    try:
        node = attention(ctx, cache, np.random.default_rng(7))
        emu = g.libs().base.ggml_map_custom1(ctx.ctx, node, emulated, 1, g.libs().ffi.NULL)
        ctx.compute(emu)
        shape = (cache.seqs * cache.n_tps, cache.n_head, cache.head_dim_v or cache.head_dim)
        want, got = ctx.read(node, np.float32, shape), ctx.read(emu, np.float32, shape)
    finally:
        ctx.close()
    assert np.isfinite(want).all()
    assert nmse(got, want) <= EMULATED_NMSE_BAR


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    backend = g.Backend.gpu()
    if backend is None:
        pytest.skip("no GPU backend (a CUDA build on a machine with a GPU runs these)")
    monkeypatch.setenv("GGML_KVQ_CUDA_MMA", "1")
    try:
        yield backend
    finally:
        backend.close()


@pytest.mark.parametrize("case", MMA_CASES, ids=case_id)
def test_gpu_tensor_cores_match_the_cpu(case: Case, gpu: g.Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = random_qkv(case, 150, seed=case.head_dim + case.window)
    want = run_layer(case, q, k, v, UBATCHES)
    got = run_layer(case, q, k, v, UBATCHES, backend=gpu)
    assert nmse(got, want) <= NMSE_BAR
    monkeypatch.setenv("GGML_KVQ_CUDA_MMA", "0")
    cuda_cores = run_layer(case, q, k, v, UBATCHES, backend=gpu)
    # the tensor-core kernel ran: the CUDA-core kernel's fp32 products give other bits
    assert not np.array_equal(got, cuda_cores)


def test_gpu_tensor_core_splits_and_batching(gpu: g.Backend) -> None:
    """Three splits merged by their last block, whichever finishes last: the same bits on a repeated run and
    whatever the batching."""
    case = Case(head_dim=128, n_head=4, n_head_kv=1, window=32, n_sink=5)
    q, k, v = random_qkv(case, 1100, seed=3)
    want = run_layer(case, q, k, v, [1100])
    whole = run_layer(case, q, k, v, [1100], backend=gpu)
    again = run_layer(case, q, k, v, [1100], backend=gpu)
    mixed = run_layer(case, q, k, v, [1030, 1, 37, 32], backend=gpu)
    assert nmse(whole, want) <= NMSE_BAR
    np.testing.assert_array_equal(whole, again)
    np.testing.assert_array_equal(whole, mixed)


@pytest.mark.parametrize(("case", "n_swa"), PACKED_CASES, ids=packed_id)
def test_gpu_packed_tokens_read_as_they_would_alone(case: Case, n_swa: int, gpu: g.Backend) -> None:
    """On the GPU too: one kernel for the layer whatever the batch, each token's passes its own."""
    assert packed_as_alone(case, n_swa, backend=gpu) <= NMSE_BAR
