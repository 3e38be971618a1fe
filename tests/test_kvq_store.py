"""GGML_KVQ_OP_STORE, a decode step's K and V written in one op (what llama.cpp's graph runs for one token per
sequence): the cache's bytes after every step against what the separate ops (SEAL_K, STORE_V, both RING_PUTs) write,
on the CPU, and the CUDA kernel's (emulated on the CPU, tests/kvq_emulation.py) against the CPU's. Streams at
different depths, tiles completed mid-run, sinks, K and V of other widths, clip ratios, V's dithered rounding, heads
narrower than a V block, a latent layer's K alone (no V: ggml_kvq_attn_latent reads it from K), and the values
quantization must get right: ±0, NaN, ±65504, values beyond fp16, constant (zero-range) blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import kvq_emulation
import kvq_graph as g
import numpy as np
import pytest
from kvq_layer import Case

from pykvq.bindings.ggml_types import GGML_TYPE_KIVI1, GGML_TYPE_KIVI4
from pykvq.kv_types import CLIP_MSE

CASES = {
    "d64-h2-w16-3-streams": (Case(64, 2, 2, 16, 0), [29, 3, 64]),
    "d64-h3-w40-s5-k4v1-clip": (Case(64, 3, 3, 40, 5, GGML_TYPE_KIVI4, GGML_TYPE_KIVI1, clip_k=0.85, clip_v=0.7),
                                [2, 33]),
    "d128/64-h1-w0-s3-k1v4": (Case(128, 1, 1, 0, 3, GGML_TYPE_KIVI1, GGML_TYPE_KIVI4, head_dim_v=64), [0]),
    "d16-h4-w32-2-streams": (Case(16, 4, 4, 32, 0), [31, 7]),
    "d64-h2-w16-2-streams-v1-dither": (Case(64, 2, 2, 16, 0, v_type=GGML_TYPE_KIVI1, v_spread=1.0), [29, 3]),
    "d32-h2-w32-s2-v2-half-dither": (Case(32, 2, 2, 32, 2, clip_v=0.9, v_spread=0.5), [40]),
    "d64-h2-w16-s2-mse-half-dither": (Case(64, 2, 2, 16, 2, clip_k=CLIP_MSE, clip_v=CLIP_MSE, v_spread=0.5), [29, 3]),
    "d576-latent-w32-s2-k4-clip-2-streams": (Case(576, 16, 1, 32, 2, GGML_TYPE_KIVI4, clip_k=0.9, head_dim_v=512,
                                                  latent=True), [30, 5]),
}
DITHER_LAYER = 3
N_STEPS = 40


def cache_values(case: Case, prefill: list[int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """K [stream, cell, head, channel] with per-channel offsets and scales, V, and the values that quantization
    must get right where each stream's decode steps store them."""
    rng = np.random.default_rng(seed)
    shape = (len(prefill), max(prefill) + N_STEPS, case.n_head_kv)
    k = (rng.standard_normal((*shape, case.head_dim)) * rng.uniform(0.2, 3, case.head_dim)
         + rng.standard_normal(case.head_dim) * 2).astype(np.float32)
    v = rng.standard_normal((*shape, case.dv)).astype(np.float32)
    special = np.array([np.nan, 0.0, -0.0, 65504, -65504, 65519, 7e4, -1e6], dtype=np.float32)
    for s, n in enumerate(prefill):
        cells = rng.choice(np.arange(n, n + N_STEPS), size=len(special), replace=False)
        for x, cell in zip(special, cells, strict=True):
            k[s, cell, rng.integers(case.n_head_kv), rng.integers(case.head_dim)] = x
            v[s, cell, rng.integers(case.n_head_kv), rng.integers(case.dv)] = x
        # a V block of one value
        v[s, n + 5, 0, :min(32, case.dv)] = -2.0
    # a K channel constant in every tile
    k[:, :, 0, 1] = 1.5
    return k, v


class Cache:
    """One kivi cache layer of n_stream streams of n_alloc cells, zeroed, in a ggml context on the CPU or on
    `backend`."""

    def __init__(self, case: Case, n_stream: int, n_alloc: int, backend: g.Backend | None) -> None:
        self.case, self.n_alloc = case, n_alloc
        n_embd, n_embd_v = case.n_head_kv * case.head_dim, case.n_head_kv * case.dv
        n_fp16 = case.n_sink + g.ring_size(case.window)
        self.ctx = g.Context(backend=backend)
        self.k_tiles = self.ctx.new(case.k_type, n_embd * 32, n_alloc // 32, n_stream)
        self.k_fp16 = self.ctx.new(g.GGML_TYPE_F16, n_embd, n_fp16, n_stream)
        # a latent layer keeps K alone
        self.v_rows = g.libs().ffi.NULL if case.latent else self.ctx.new(case.v_type, n_embd_v, n_alloc * n_stream)
        self.v_fp16 = g.libs().ffi.NULL if case.latent else self.ctx.new(g.GGML_TYPE_F16, n_embd_v, n_fp16, n_stream)
        for t in self.storage():
            zeros = bytes(g.libs().base.ggml_nbytes(t))
            if backend is None:
                g.write(t, np.frombuffer(zeros, dtype=np.uint8))
            else:
                self.ctx.pending_write(t, zeros)

    def storage(self) -> list:
        return [self.k_tiles, self.k_fp16] + ([] if self.case.latent else [self.v_rows, self.v_fp16])

    def snapshot(self) -> list[bytes]:
        return [self.ctx.read(t, np.uint8, (-1,)).tobytes() for t in self.storage()]

    def batch(self, cells: np.ndarray, k: np.ndarray, v: np.ndarray):
        return self.ctx.tensor(k), self.ctx.tensor(v), self.ctx.tensor(cells)

    def write_ops(self, cells: np.ndarray, k: np.ndarray, v: np.ndarray, n_seq: int) -> None:
        """The separate ops, in the order llama.cpp's graph runs them: the ring changes after the seal read it."""
        lib, c = g.libs().base, self.case
        k_cur, v_cur, idxs = self.batch(cells, k, v)
        sealed = lib.ggml_kvq_seal_k(self.ctx.ctx, self.k_tiles, self.k_fp16, k_cur, idxs, c.n_sink, n_seq, c.clip_k)
        if c.latent:
            self.ctx.compute(sealed, lib.ggml_kvq_ring_put(self.ctx.ctx, self.k_fp16, k_cur, idxs, sealed, c.n_sink,
                                                           n_seq, self.n_alloc))
            return
        stored = self.dithered(lib.ggml_kvq_store_v(self.ctx.ctx, self.v_rows, lib.ggml_reshape_2d(
            self.ctx.ctx, v_cur, c.n_head_kv * c.dv, len(cells)), idxs, c.clip_v))
        rings = [lib.ggml_kvq_ring_put(self.ctx.ctx, fp16, cur, idxs, stored, c.n_sink, n_seq, self.n_alloc)
                 for fp16, cur in ((self.k_fp16, k_cur), (self.v_fp16, v_cur))]
        self.ctx.compute(sealed, stored, *rings)

    def store_node(self, cells: np.ndarray, k: np.ndarray, v: np.ndarray):
        lib, c = g.libs().base, self.case
        k_cur, v_cur, idxs = self.batch(cells, k, v)
        if c.latent:
            v_cur = v_idxs = g.libs().ffi.NULL
        else:
            v_idxs = idxs
        return self.dithered(lib.ggml_kvq_store(self.ctx.ctx, self.k_tiles, self.v_rows, self.k_fp16, self.v_fp16,
                                                k_cur, v_cur, idxs, v_idxs, c.n_sink, len(cells), c.clip_k, c.clip_v))

    def dithered(self, store):
        """A store node with the case's V dither, a stream being a sequence's part."""
        if self.case.v_spread:
            g.libs().base.ggml_kvq_store_set_v_dither(store, self.case.v_spread, DITHER_LAYER, self.n_alloc,
                                                      self.n_alloc)
        return store


def decode(case: Case, prefill: list[int], step: str, emulation: Path | None = None,
           backend: g.Backend | None = None) -> list[list[bytes]]:
    """Each stream s gets its first prefill[s] tokens through the separate ops, then N_STEPS decode steps store one
    token of every stream together, the `step` way: "ops" (the separate ops), "store" (the STORE op) or "emulated"
    (the STORE node through the emulated CUDA kernel, on the CPU); on the CPU or on `backend`. The cache's bytes
    after every step."""
    n_stream = len(prefill)
    n_alloc = (max(prefill) + N_STEPS + 31) // 32 * 32
    k, v = cache_values(case, prefill, seed=len(prefill) + case.head_dim)
    cache = Cache(case, n_stream, n_alloc, backend)
    try:
        for s, n in enumerate(prefill):
            if n:
                cache.write_ops(s * n_alloc + np.arange(n, dtype=np.int64), k[s, :n], v[s, :n], 1)
        steps: dict[str, Callable] = {
            "ops": lambda *batch: cache.write_ops(*batch, n_stream),
            "store": lambda *batch: cache.ctx.compute(cache.store_node(*batch)),
            "emulated": lambda *batch: kvq_emulation.run_store(emulation, cache.store_node(*batch)),
        }
        snapshots = []
        for i in range(N_STEPS):
            depth = np.array(prefill) + i
            cells = np.arange(n_stream, dtype=np.int64) * n_alloc + depth
            streams = np.arange(n_stream)
            steps[step](cells, k[streams, depth], v[streams, depth])
            snapshots.append(cache.snapshot())
        return snapshots
    finally:
        cache.ctx.close()


def assert_same_bytes(got: list[list[bytes]], want: list[list[bytes]]) -> None:
    names = ("K tiles", "K sinks and ring", "V rows", "V sinks and ring")
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        for name, x, y in zip(names[:len(a)], a, b, strict=True):
            if x != y:
                diff = np.flatnonzero(np.frombuffer(x, np.uint8) != np.frombuffer(y, np.uint8))
                pytest.fail(f"after decode step {i}: {name} differ in {len(diff)} bytes, first at {diff[0]}")


@pytest.mark.parametrize("case, prefill", CASES.values(), ids=CASES.keys())
def test_the_store_op_writes_what_the_separate_ops_write(case: Case, prefill: list[int],
                                                        kvq_backend: g.Backend | None) -> None:
    """The STORE op on each backend against the separate ops on the CPU."""
    assert_same_bytes(decode(case, prefill, "store", backend=kvq_backend), decode(case, prefill, "ops"))


@pytest.mark.parametrize("case, prefill", CASES.values(), ids=CASES.keys())
def test_the_emulated_cuda_store_writes_what_the_cpu_writes(cuda_emulation: Path, case: Case,
                                                            prefill: list[int]) -> None:
    assert_same_bytes(decode(case, prefill, "emulated", cuda_emulation), decode(case, prefill, "store"))


def test_the_steps_do_change_the_cache() -> None:
    """The comparisons above judge something: each step writes its ring slot, and the 32nd token seals a tile."""
    case, prefill = CASES["d64-h2-w16-3-streams"]
    snapshots = decode(case, prefill, "store")
    assert all(a[1] != b[1] and a[3] != b[3] for a, b in zip(snapshots, snapshots[1:], strict=False))
    # stream 0 completes tile 0 at its 3rd step (cell 31)
    assert snapshots[1][0] != snapshots[2][0] and snapshots[0][0] == snapshots[1][0]
