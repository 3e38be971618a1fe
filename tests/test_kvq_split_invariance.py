"""Split invariance of both CUDA attention kernels (ggml-kvq/src/cuda), through the emulated CUDA of
tests/kvq_emulation.py: the same cache read with the context forced into 1, 2, 7 and the most splits the kernel can
make (one tile per split on CUDA cores, one per warp on tensor cores) gives the kernel's own result within the
reassociation of its sums (and, on tensor cores, the fp16 rounding of its softmax weights), so that the last block's
merge of the partials is judged apart from the split size the product happens to use. Each result is also held to
the CPU op, so that a merge that drops or repeats a split fails whichever split counts agree. A batch taken in
several launches (chunks of blocks, as a long context's large batch is on a GPU) gives the bits of one launch."""

from __future__ import annotations

from pathlib import Path

import kvq_emulation as emulation
import kvq_graph as g
import numpy as np
import pytest
from kvq_random_cache import RandomCache, attention

from pykvq.bindings.ggml_types import GGML_TYPE_KIVI2

TILES = 56
# two streams at different depths, two batch tokens each, holes: the deeper splits are fully masked for stream 1
CACHE = RandomCache(n_head=8, n_head_kv=2, head_dim=128, k_type=GGML_TYPE_KIVI2, v_type=GGML_TYPE_KIVI2, window=32,
                    sinks=5, depth=TILES * 32 - 2, seqs=2, stagger=700, n_tps=2, holes=0.2)
# tiles per split forced on each kernel: 1, 2, 7 splits and the kernel's most
FORCED = {"cuda cores": [56, 28, 8, 1], "tensor cores": [56, 28, 8, 4]}
OWN_TILES = {"cuda cores": 4, "tensor cores": 16}  # KVQ_TILES_PER_SPLIT, KVQ_MMA_TILES_PER_SPLIT
CPU_NMSE_BAR = 1e-5  # tests/test_kvq_mma.py's bar for the emulated kernels against the CPU op
# between split counts, measured: CUDA cores up to 2.6e-14 (fp32 sums in another order); tensor cores up to 5.6e-11,
# a third of their distance from the CPU op (1.5e-10): their softmax weights are rounded to fp16 against another
# running maximum. A dropped or repeated split costs more than 1e-4.
REASSOCIATION_NMSE_BAR = {"cuda cores": 1e-12, "tensor cores": 5e-10}


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sum((got - want) ** 2) / np.sum(want**2))


def splits(tiles_per_split: int) -> int:
    return -(-TILES // tiles_per_split)


@pytest.fixture(scope="module")
def results(cuda_emulation: Path) -> dict[str, dict[int | None, np.ndarray]]:
    """The CPU op's output (key "cpu", None) and each kernel's at its own and at every forced split size."""
    # the setup itself: the forced sizes make the split counts, apart from each kernel's own
    assert CACHE.kv_size == TILES * 32
    for kernel, forced in FORCED.items():
        assert [splits(t) for t in forced[:3]] == [1, 2, 7]
        assert splits(forced[3]) == TILES // (1 if kernel == "cuda cores" else 4)
        assert splits(OWN_TILES[kernel]) not in (1, 2, 7)
    ctx = g.Context(mem_size=(64 << 20) + CACHE.data_bytes())
    try:
        node = attention(ctx, CACHE, np.random.default_rng(5))
        runs = [("cpu", None, node)]
        keep = []
        for kernel, forced in FORCED.items():
            op = emulation.attention_op(cuda_emulation, kernel)
            for tiles in [None, *forced]:
                userdata = g.libs().ffi.NULL if tiles is None else emulation.forced_tiles_per_split(tiles)
                keep.append(userdata)
                runs.append((kernel, tiles, g.libs().base.ggml_map_custom1(ctx.ctx, node, op, 1, userdata)))
        for _, _, t in runs[1:]:
            ctx.compute(t)
        shape = (CACHE.seqs * CACHE.n_tps, CACHE.n_head, CACHE.head_dim)
        out: dict[str, dict[int | None, np.ndarray]] = {}
        for kernel, tiles, t in runs:
            out.setdefault(kernel, {})[tiles] = ctx.read(t, np.float32, shape)
        return out
    finally:
        ctx.close()


@pytest.mark.parametrize("kernel", FORCED)
def test_forced_splits_agree_with_the_kernels_own(kernel: str, results) -> None:
    cpu = results["cpu"][None]
    own = results[kernel][None]
    assert np.isfinite(cpu).all()
    assert nmse(own, cpu) <= CPU_NMSE_BAR
    for tiles in FORCED[kernel]:
        forced = results[kernel][tiles]
        assert nmse(forced, cpu) <= CPU_NMSE_BAR, f"{splits(tiles)} splits"
        assert nmse(forced, own) <= REASSOCIATION_NMSE_BAR[kernel], f"{splits(tiles)} splits"
    # the forcing reached the kernel: one split sums in another order than the kernel's own splits
    assert not np.array_equal(results[kernel][FORCED[kernel][0]], own)


# three streams of five batch tokens at different depths, several splits on both kernels: 9 blocks of 2 tokens on
# tensor cores (GQA 4), 15 of one token on CUDA cores
CHUNKED = RandomCache(n_head=8, n_head_kv=2, head_dim=128, k_type=GGML_TYPE_KIVI2, v_type=GGML_TYPE_KIVI2, window=32,
                      sinks=5, depth=40 * 32 - 9, seqs=3, stagger=300, n_tps=5)
TOKENS_PER_BLOCK = {"cuda cores": 1, "tensor cores": 2}


@pytest.mark.parametrize("kernel", FORCED)
def test_launches_in_chunks_of_blocks_change_no_bit(kernel: str, cuda_emulation: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A long context over a large batch takes several launches, each a chunk of blocks (kvq_attn_launch_blocks):
    the batch in chunks of one block and of two gives the bits of one launch."""
    n_splits = -(-CHUNKED.kv_size // 32 // OWN_TILES[kernel])
    block_partials = TOKENS_PER_BLOCK[kernel] * CHUNKED.n_head * n_splits * (CHUNKED.head_dim + 2)
    assert n_splits > 1
    op = emulation.attention_op(cuda_emulation, kernel)
    shape = (CHUNKED.seqs * CHUNKED.n_tps, CHUNKED.n_head, CHUNKED.head_dim)
    ctx = g.Context(mem_size=(64 << 20) + CHUNKED.data_bytes())
    try:
        node = attention(ctx, CHUNKED, np.random.default_rng(9))
        out = {}
        for max_partials in (None, 1, 2 * block_partials):
            if max_partials is not None:
                monkeypatch.setenv("KVQ_EMU_MAX_PARTIALS", str(max_partials))
            t = g.libs().base.ggml_map_custom1(ctx.ctx, node, op, 1, g.libs().ffi.NULL)
            ctx.compute(t)
            out[max_partials] = ctx.read(t, np.float32, shape)
        ctx.compute(node)
        cpu = ctx.read(node, np.float32, shape)
    finally:
        ctx.close()
    assert nmse(out[None], cpu) <= CPU_NMSE_BAR
    np.testing.assert_array_equal(out[1], out[None])
    np.testing.assert_array_equal(out[2 * block_partials], out[None])
