"""One kivi cache layer fed through the GGML_OP_KVQ ops in ubatches, as llama.cpp's graph does (tests/kvq_graph.py
runs it): the attention of every query, through the fused kernel or the flash-attention prefill, and MiniKV's
attention mass."""

from __future__ import annotations

from dataclasses import dataclass

import kvq_graph as g
import numpy as np

from pykvq.bindings.ggml_types import GGML_TYPE_KIVI2


@dataclass(frozen=True)
class Case:
    head_dim: int
    n_head: int
    n_head_kv: int
    window: int
    n_sink: int
    k_type: int = GGML_TYPE_KIVI2
    v_type: int = GGML_TYPE_KIVI2
    head_dim_v: int | None = None  # None: head_dim
    clip_k: float = 1.0            # SKVQ's clip ratios of the quantized blocks
    clip_v: float = 1.0
    v_spread: float = 0.0          # V's dithered rounding (ggml_kvq_store_set_v_dither); 0: nearest
    softcap: float = 0.0           # attention logit soft-capping (Gemma 2); 0: none
    sinks: tuple[float, ...] = ()  # learned sink logits per query head (gpt-oss); (): none
    latent: bool = False           # MLA (ggml_kvq_attn_latent): no V of its own, V the first dv channels of K

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim


def wide_attention(ctx: g.Context, case: Case, q, k_wide, v_wide, wide_mask, n_wide: int):
    """The flash-attention prefill: upstream's ggml_flash_attn_ext over K and V as wide cells."""
    lib = g.libs().base
    n = q.shape[0]

    def heads(t, d: int, n_head: int, n_rows: int):
        return lib.ggml_permute(ctx.ctx, lib.ggml_reshape_4d(ctx.ctx, t, d, n_head, n_rows, 1), 0, 2, 1, 3)

    if case.latent:
        # as llama.cpp's MLA graph takes V: a view of K's first dv channels
        row = case.head_dim * 2  # F16 wide cells of the one KV head
        v_heads = lib.ggml_view_4d(ctx.ctx, k_wide, case.dv, n_wide, 1, 1, row, row * n_wide, row * n_wide, 0)
    else:
        v_heads = heads(v_wide, case.dv, case.n_head_kv, n_wide)
    out = lib.ggml_flash_attn_ext(ctx.ctx, heads(ctx.tensor(q), case.head_dim, case.n_head, n),
                                  heads(k_wide, case.head_dim, case.n_head_kv, n_wide), v_heads,
                                  wide_mask, 1.0 / np.sqrt(case.head_dim), 0.0, case.softcap)
    lib.ggml_flash_attn_ext_add_sinks(out, sinks_tensor(ctx, case))
    return out


def sinks_tensor(ctx: g.Context, case: Case):
    """The case's sink logits as an F32 tensor, or NULL."""
    return ctx.tensor(np.array(case.sinks, dtype=np.float32)) if case.sinks else g.libs().ffi.NULL


def causal_mask(cells: np.ndarray, n_kv: int, n_swa: int = 0) -> np.ndarray:
    """llama.cpp's mask for queries at ``cells``: causal, and with n_swa > 0 the standard sliding window."""
    j = np.arange(n_kv)[None, :]
    visible = (j <= cells[:, None]) & ((cells[:, None] - j < n_swa) if n_swa else True)
    return np.where(visible, 0.0, -np.inf).astype(np.float32)


@dataclass(frozen=True)
class LayerRun:
    out: np.ndarray                 # every query's attention [n_cells, n_head, dv]
    mass: np.ndarray | None = None  # MiniKV's attention mass of every cell [n_cells, n_head_kv]


def feed_layer(case: Case, q: np.ndarray, k: np.ndarray, v: np.ndarray, ubatches: list[int], *,
               wide: bool = False, n_swa: int = 0, mass: bool = False, observe: int = 0,
               backend: g.Backend | None = None, attention_op=None, n_threads: int = 2) -> LayerRun:
    """Feed the tokens through one cache layer in the given ubatch sizes: every query's output (through the fused
    kernel, or with `wide` through flash attention over wide cells; n_swa: a sliding-window mask) and, with
    `mass`, the attention mass the SCORE ops accumulate over the ubatches (from each ubatch's last `observe`
    queries, 0: all); on the CPU (n_threads), or on `backend`. attention_op: a ggml_custom1_op_t whose output over
    the fused attention node replaces the node's (tests/kvq_emulation.py's emulated GPU kernel), on the CPU."""
    n_cells = k.shape[0]
    n_embd = case.n_head_kv * case.head_dim
    n_embd_v = case.n_head_kv * case.dv
    n_alloc = (n_cells + 31) // 32 * 32
    n_fp16 = case.n_sink + g.ring_size(case.window)
    scale = 1.0 / np.sqrt(case.head_dim)
    window, n_sink = case.window, case.n_sink
    lib = g.libs().base
    ctx = g.Context(backend=backend)
    try:
        k_tiles = ctx.new(case.k_type, n_embd * 32, n_alloc // 32)
        v_rows = None if case.latent else ctx.new(case.v_type, n_embd_v, n_alloc)
        k_fp16 = ctx.new(g.GGML_TYPE_F16, n_embd, n_fp16)
        v_fp16 = None if case.latent else ctx.new(g.GGML_TYPE_F16, n_embd_v, n_fp16)
        scores = ctx.tensor(np.zeros((case.n_head_kv, n_alloc), dtype=np.float32))
        outputs = []
        first = 0
        for n in ubatches:
            cells = np.arange(first, first + n, dtype=np.int64)
            n_kv = (first + n + 31) // 32 * 32
            n_wide = (n_kv + 2 * n + 32 + window + 255) // 256 * 256
            mask = ctx.tensor(causal_mask(cells, n_kv, n_swa))
            q_cur = ctx.tensor(q[first:first + n].astype(np.float32))
            k_cur = ctx.tensor(k[first:first + n].astype(np.float32))
            v_cur = ctx.tensor(v[first:first + n].astype(np.float32))
            idxs = ctx.tensor(cells)
            v_store = None if case.latent else lib.ggml_kvq_store_v(
                ctx.ctx, v_rows, lib.ggml_reshape_2d(ctx.ctx, v_cur, n_embd_v, n), idxs, case.clip_v)
            sealed = lib.ggml_kvq_seal_k(ctx.ctx, k_tiles, k_fp16, k_cur, idxs, n_sink, 1, case.clip_k)
            k_wide = lib.ggml_kvq_wide(ctx.ctx, sealed, k_fp16, k_cur, idxs, window, n_sink, 1, n_alloc, n_kv)
            wide_mask = lib.ggml_kvq_wide_mask(ctx.ctx, mask, idxs, window, n_sink, 1, n_alloc, False, n_kv)
            if wide:
                v_wide = None if case.latent else lib.ggml_kvq_wide(ctx.ctx, v_store, v_fp16, v_cur, idxs, window,
                                                                    n_sink, 1, n_alloc, n_kv)
                attn = wide_attention(ctx, case, q[first:first + n].astype(np.float32), k_wide, v_wide, wide_mask,
                                      n_wide)
            elif case.latent:
                attn = lib.ggml_kvq_attn_latent(ctx.ctx, q_cur, sealed, k_fp16, k_cur, mask, idxs, case.dv, window,
                                                n_sink, scale, 1, False)
            else:
                attn = lib.ggml_kvq_attn(ctx.ctx, q_cur, sealed, v_store, k_fp16, v_fp16, k_cur, v_cur, mask, idxs,
                                         window, n_sink, scale, 1, False)
            if not wide:
                lib.ggml_kvq_attn_set_softcap(attn, case.softcap)
                lib.ggml_kvq_attn_set_sinks(attn, sinks_tensor(ctx, case))
                if attention_op is not None:
                    attn = lib.ggml_map_custom1(ctx.ctx, attn, attention_op, 1, g.libs().ffi.NULL)
            # nodes run in the order they are expanded: the ring changes after everything read it
            nodes = [attn]
            if mass:
                lse = lib.ggml_kvq_score_lse(ctx.ctx, q_cur, k_wide, wide_mask, observe, scale)
                nodes.append(lib.ggml_kvq_score_add(ctx.ctx, scores, q_cur, k_wide, wide_mask, lse, idxs, window,
                                                    n_sink, n_kv, observe, scale))
            nodes += [lib.ggml_kvq_ring_put(ctx.ctx, fp16, cur, idxs, nodes[-1], n_sink, 1, n_alloc)
                      for fp16, cur in ((k_fp16, k_cur), (v_fp16, v_cur)) if fp16 is not None]
            ctx.compute(*nodes, n_threads=n_threads)
            outputs.append(ctx.read(attn, np.float32, (n, case.n_head, case.dv)))
            first += n
        got_mass = ctx.read(scores, np.float32, (case.n_head_kv, n_alloc)).T[:n_cells] if mass else None
        return LayerRun(np.concatenate(outputs), got_mass)
    finally:
        ctx.close()


def run_layer(case: Case, q: np.ndarray, k: np.ndarray, v: np.ndarray, ubatches: list[int],
              wide: bool = False, n_swa: int = 0, backend: g.Backend | None = None, attention_op=None,
              n_threads: int = 2) -> np.ndarray:
    """Every query's output after feeding the tokens in the given ubatch sizes (feed_layer)."""
    return feed_layer(case, q, k, v, ubatches, wide=wide, n_swa=n_swa, backend=backend,
                      attention_op=attention_op, n_threads=n_threads).out


def random_qkv(case: Case, n_cells: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_cells, case.n_head, case.head_dim)).astype(np.float32)
    # per-channel offsets and scales, as real keys have (the reason K is quantized per channel)
    k = (rng.standard_normal((n_cells, case.n_head_kv, case.head_dim)) * rng.uniform(0.2, 3, case.head_dim)
         + rng.standard_normal(case.head_dim) * 2).astype(np.float32)
    v = rng.standard_normal((n_cells, case.n_head_kv, case.dv)).astype(np.float32)
    return q, k, v


