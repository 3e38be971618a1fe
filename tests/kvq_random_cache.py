"""A GGML_OP_KVQ attention node over a random but valid kivi cache (tests/kvq_graph.py): any depth and number of
streams at once, without feeding the tokens through a layer. Blocks hold finite fp16 scales and minimums and random
codes, the fp16 ring and sinks random values; every reader of the same node reads the same cache, which is what
comparing two kernels needs (tests/test_kvq_mma.py, bench/gpu/attn_op.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import kvq_graph as g
import numpy as np

from pykvq.bindings.ggml_types import KIVI_BITS


@dataclass(frozen=True)
class RandomCache:
    n_head: int
    n_head_kv: int
    head_dim: int
    k_type: int
    v_type: int
    window: int
    sinks: int
    depth: int                  # cells before the batch of stream 0
    seqs: int = 1               # streams, one sequence each
    stagger: int = 0            # stream s's batch sits stagger*s cells earlier than stream 0's
    n_tps: int = 1              # batch tokens per stream, at cells depth .. depth + n_tps - 1
    holes: float = 0.0          # share of the earlier cells the mask hides (another sequence's, in llama.cpp)
    hidden: tuple[int, int] = (0, 0)  # cells [a, b) hidden from every query
    head_dim_v: int | None = None     # a latent layer (ggml_kvq_attn_latent): V is K's first head_dim_v channels

    @property
    def latent(self) -> bool:
        return self.head_dim_v is not None

    @property
    def n_embd(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def kv_size(self) -> int:
        return (self.depth + self.n_tps + 31) // 32 * 32

    def depth_of(self, stream: int) -> int:
        return self.depth - self.stagger * stream

    def data_bytes(self) -> int:
        """Roughly what the node's tensors hold (for a CPU context's memory)."""
        parts = 1 if self.latent else 2
        per_cell = self.n_embd * (KIVI_BITS[self.k_type] + (0 if self.latent else KIVI_BITS[self.v_type]) + 4) / 8
        return int(self.kv_size * self.seqs * per_cell + (self.sinks + g.ring_size(self.window)) * self.seqs
                   * self.n_embd * 2 * parts) + (1 << 20)


def random_blocks(rng: np.random.Generator, n_blocks: int, bits: int) -> np.ndarray:
    """Valid kivi blocks [n_blocks, bytes]: a finite fp16 scale and minimum, random codes."""
    raw = rng.integers(0, 256, size=(n_blocks, 4 + 4 * bits), dtype=np.uint8)
    dm = np.stack([rng.uniform(0.01, 0.1, n_blocks), rng.uniform(-1, 0, n_blocks)], axis=1).astype(np.float16)
    raw[:, :4] = dm.view(np.uint8).reshape(n_blocks, 4)
    return raw


def fill(ctx: g.Context, t, raw: np.ndarray) -> None:
    """A tensor's bytes, now on the CPU or at the context's next compute on its backend."""
    data = raw.tobytes()
    assert len(data) == g.libs().base.ggml_nbytes(t)
    if ctx.backend is None:
        g.write(t, raw)
    else:
        ctx.pending_write(t, data)


def mask(c: RandomCache, rng: np.random.Generator) -> np.ndarray:
    """[seqs, n_tps, kv_size]: token t of a stream sees cells up to its own, less the holes and the hidden range."""
    cells = np.arange(c.kv_size)
    depths = np.array([c.depth_of(s) for s in range(c.seqs)])
    own = depths[:, None] + np.arange(c.n_tps)[None, :]
    visible = cells[None, None, :] <= own[:, :, None]
    visible = visible & ~((cells >= c.hidden[0]) & (cells < c.hidden[1]))[None, None, :]
    holes = (rng.random((c.seqs, 1, c.kv_size)) < c.holes) & (cells[None, None, :] < depths[:, None, None])
    visible = visible & ~holes
    return np.where(visible, 0.0, -np.inf).astype(np.float16)


def attention(ctx: g.Context, c: RandomCache, rng: np.random.Generator):
    """The attention node of every stream's batch tokens over its random cache."""
    lib = g.libs().base
    n_tokens = c.seqs * c.n_tps
    n_fp16 = c.sinks + g.ring_size(c.window)

    def fp16_cells():
        return ctx.tensor(rng.standard_normal((c.seqs, n_fp16, c.n_embd)).astype(np.float16))

    def batch_rows():
        return ctx.tensor(rng.standard_normal((n_tokens, c.n_head_kv, c.head_dim)).astype(np.float32))

    k_tiles = ctx.new(c.k_type, c.n_embd * 32, c.kv_size // 32, c.seqs)
    fill(ctx, k_tiles, random_blocks(rng, c.n_embd * c.kv_size // 32 * c.seqs, KIVI_BITS[c.k_type]))
    k_fp16, k_cur = fp16_cells(), batch_rows()
    q = ctx.tensor(rng.standard_normal((n_tokens, c.n_head, c.head_dim)).astype(np.float32))
    m = lib.ggml_reshape_4d(ctx.ctx, ctx.tensor(mask(c, rng).reshape(c.seqs * c.n_tps, c.kv_size)), c.kv_size,
                            c.n_tps, 1, c.seqs)
    cells = ctx.tensor(np.array([s * c.kv_size + c.depth_of(s) + t for s in range(c.seqs) for t in range(c.n_tps)],
                                dtype=np.int64))
    scale = 1 / math.sqrt(c.head_dim)
    if c.latent:
        return lib.ggml_kvq_attn_latent(ctx.ctx, q, k_tiles, k_fp16, k_cur, m, cells, c.head_dim_v, c.window, c.sinks,
                                        scale, c.seqs, False)
    v_rows = ctx.new(c.v_type, c.n_embd, c.kv_size * c.seqs)
    fill(ctx, v_rows, random_blocks(rng, c.n_embd // 32 * c.kv_size * c.seqs, KIVI_BITS[c.v_type]))
    return lib.ggml_kvq_attn(ctx.ctx, q, k_tiles, v_rows, k_fp16, fp16_cells(), k_cur, batch_rows(), m, cells,
                             c.window, c.sinks, scale, c.seqs, False)
