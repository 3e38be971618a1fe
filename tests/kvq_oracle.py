"""Independent numpy model of the kivi block formats (ggml-kvq/include/ggml-kvq.h), written from the
format's definition, not from the C code. The C reference must agree with it bit for bit."""

from __future__ import annotations

import numpy as np

QK = 32
FP16_MAX = np.float32(65504.0)


def block_bytes(bits: int) -> int:
    return 4 + QK * bits // 8


MASK64 = (1 << 64) - 1


def dither_key(layer: int, position: int, channel: int) -> int:
    """The draw of V's dithered rounding for one value: its layer, its cell's index in its sequence's part, its
    channel, as fields of one 64-bit key (16, 28 and 20 bits)."""
    return layer << 48 | position << 20 | channel


def dither_threshold(spread: float, key: int) -> int:
    """The fraction, in 1/2^24ths, that a value's code must reach to round up: 1/2 moved by up to +-spread/2, a
    uniform draw from the splitmix64 finalizer of ``key`` (its top 24 bits), spread taken in 1/65536ths and the
    product truncated toward zero."""
    h = key & MASK64
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & MASK64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & MASK64
    h ^= h >> 33
    offset = (h >> 40) - (1 << 23)
    spread16 = int(np.float32(spread) * np.float32(65536.0) + np.float32(0.5))
    moved = abs(offset * spread16) // 65536
    return (1 << 23) - (moved if offset >= 0 else -moved)


def _dithered_codes(t: np.ndarray, qmax: int, spread: float, key: int) -> np.ndarray:
    codes = np.zeros(QK, dtype=np.int64)
    for i, ti in enumerate(np.clip(np.nan_to_num(t), 0, qmax).astype(np.float32)):
        whole = np.floor(ti)
        fraction = int((ti - whole) * np.float32(1 << 24))
        codes[i] = min(int(whole) + (fraction >= dither_threshold(spread, key + i)), qmax)
    return codes


# the clip "ratio" mse: each block's range searched for least squared error (ggml-kvq.h's GGML_KVQ_CLIP_MSE)
CLIP_MSE = 0.0
MSE_STEP = np.float32(0.04)
MSE_STEPS = 8


def _fp16_range(lo: np.float32, hi: np.float32, qmax: int) -> tuple[np.float16, np.float16]:
    d_wanted = np.float32(np.float32(hi - lo) / np.float32(qmax))
    return np.float16(min(d_wanted, FP16_MAX)), np.float16(lo)


def _squared_error(v: np.ndarray, lo: np.float32, hi: np.float32, qmax: int) -> np.float32:
    """Sum over the block's values, in order, of (m + d*code - value)^2, each step rounded to float32."""
    d16, m16 = _fp16_range(lo, hi, qmax)
    d, m = np.float32(d16), np.float32(m16)
    inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
    codes = np.rint(np.clip((v - m) * inv, 0, qmax)).astype(np.float32)
    errors = (m + d * codes) - v
    return np.add.accumulate(errors * errors, dtype=np.float32)[-1]


def _searched_range(v: np.ndarray, lo: np.float32, hi: np.float32, qmax: int) -> tuple[np.float32, np.float32]:
    """Candidates [lo + w*a*STEP, hi - w*b*STEP] for a, b in 0..STEPS (a outer), w = hi - lo; the first of least
    squared error."""
    width = np.float32(hi - lo)
    if not width > 0:
        return lo, hi
    best, chosen = np.float32(np.inf), (lo, hi)
    for a in range(MSE_STEPS + 1):
        low = np.float32(lo + np.float32(width * np.float32(np.float32(a) * MSE_STEP)))
        for b in range(MSE_STEPS + 1):
            high = np.float32(hi - np.float32(width * np.float32(np.float32(b) * MSE_STEP)))
            error = _squared_error(v, low, high, qmax)
            if error < best:
                best, chosen = error, (low, high)
    return chosen


def quantize_block(x: np.ndarray, bits: int, clip: float = 1.0, spread: float = 0.0, key: int = 0) -> bytes:
    """One block; clip (SKVQ): the range [min, max] narrowed to [clip*min, clip*max] in float32, or searched
    (CLIP_MSE), values beyond it given the end codes. spread > 0: V's dithered rounding, value i drawn with key + i
    (dither_threshold)."""
    x = np.asarray(x, dtype=np.float32)
    assert x.shape == (QK,)
    nbytes, qmax = QK * bits // 8, (1 << bits) - 1
    present = ~np.isnan(x)
    v = np.clip(x, -FP16_MAX, FP16_MAX)
    qs = np.zeros(nbytes, dtype=np.uint8)
    if not present.any():
        return np.float16(0).tobytes() + np.float16(0).tobytes() + qs.tobytes()
    if clip == CLIP_MSE:
        lo, hi = _searched_range(v[present], v[present].min(), v[present].max(), qmax)
    else:
        lo, hi = v[present].min() * np.float32(clip), v[present].max() * np.float32(clip)
    d16, m16 = _fp16_range(lo, hi, qmax)
    d, m = np.float32(d16), np.float32(m16)
    inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
    with np.errstate(invalid="ignore"):
        t = (v - m) * inv
    if spread > 0:
        codes = _dithered_codes(t, qmax, spread, key)
    else:
        codes = np.nan_to_num(np.rint(np.clip(t, 0, qmax))).astype(np.int64)
    codes[~present] = 0
    for i, q in enumerate(codes):
        qs[i % nbytes] |= np.uint8(q << ((i // nbytes) * bits))
    return d16.tobytes() + m16.tobytes() + qs.tobytes()


def dequantize_block(block: bytes, bits: int) -> np.ndarray:
    nbytes = QK * bits // 8
    d = np.float32(np.frombuffer(block[0:2], dtype=np.float16)[0])
    m = np.float32(np.frombuffer(block[2:4], dtype=np.float16)[0])
    qs = np.frombuffer(block[4:4 + nbytes], dtype=np.uint8)
    codes = np.array([(int(qs[i % nbytes]) >> ((i // nbytes) * bits)) & ((1 << bits) - 1) for i in range(QK)],
                     dtype=np.float32)
    return (m + d * codes).astype(np.float32)


def quantize_rows(rows: np.ndarray, bits: int, clip: float = 1.0, spread: float = 0.0, layer: int = 0,
                  positions: np.ndarray | None = None) -> np.ndarray:
    """Rows of blocks; spread > 0: dithered as V rows of ``layer`` at cells ``positions`` of their parts."""
    rows = np.asarray(rows, dtype=np.float32)
    where = np.zeros(len(rows), dtype=np.int64) if positions is None else positions
    out = [b"".join(quantize_block(r[i:i + QK], bits, clip, spread, dither_key(layer, int(pos), i))
                    for i in range(0, r.size, QK)) for r, pos in zip(rows, where, strict=True)]
    return np.frombuffer(b"".join(out), dtype=np.uint8).reshape(len(rows), -1)


def dequantize_rows(data: np.ndarray, bits: int, n_per_row: int) -> np.ndarray:
    bb = block_bytes(bits)
    data = np.asarray(data, dtype=np.uint8).reshape(-1, n_per_row // QK * bb)
    return np.stack([np.concatenate([dequantize_block(r[i:i + bb].tobytes(), bits)
                                     for i in range(0, r.size, bb)]) for r in data])


def fp16_round(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def dequantized_k_tiles(k: np.ndarray, bits: int, clip: float = 1.0) -> np.ndarray:
    """K [n_cells, n_embd] as the cache's sealed per-channel tiles give it back (complete tiles only;
    the cells of an incomplete last tile are NaN: the contract never reads them quantized)."""
    k16 = fp16_round(k)
    out = np.full_like(k16, np.nan)
    for t in range(k16.shape[0] // QK):
        for c in range(k16.shape[1]):
            cells = slice(t * QK, (t + 1) * QK)
            out[cells, c] = dequantize_block(quantize_block(k16[cells, c], bits, clip), bits)
    return out


def dequantized_v_rows(v: np.ndarray, bits: int, clip: float = 1.0) -> np.ndarray:
    """V [n_cells, n_embd] quantized per token (from the unrounded values, as ggml_kvq_store_v writes it)."""
    return dequantize_rows(quantize_rows(v, bits, clip), bits, v.shape[1])


def _contract_reads(k: np.ndarray, v: np.ndarray | None, query_cells: np.ndarray, *, window: int, n_sink: int,
                    k_bits: int, v_bits: int, n_swa: int, k_fp16: bool = False, clip_k: float = 1.0,
                    clip_v: float = 1.0):
    """For each query (index n at cell i): the cells j it attends and, per KV head, the keys and values (None
    without v) it reads there (DESIGN.md §5); with k_fp16 the quantized keys are rounded to fp16, as the
    flash-attention prefill's wide cells hold them."""
    n_cells = k.shape[0]
    kq = dequantized_k_tiles(k.reshape(n_cells, -1), k_bits, clip_k).reshape(k.shape)
    if k_fp16:
        kq = fp16_round(kq)
    vq = None if v is None else dequantized_v_rows(v.reshape(n_cells, -1), v_bits, clip_v).reshape(v.shape)
    k16, v16 = fp16_round(k), None if v is None else fp16_round(v)
    for n, i in enumerate(query_cells):
        j = np.arange(max(0, i - n_swa + 1) if n_swa else 0, i + 1)
        lim_v = i - window + 1
        lim_k = min(lim_v, i // QK * QK)
        k_quant = (j >= n_sink) & (j < lim_k)
        v_quant = (j >= n_sink) & (j < lim_v)
        keys = np.where(k_quant[:, None, None], kq[j], k16[j]).astype(np.float64)
        vals = None if v is None else np.where(v_quant[:, None, None], vq[j], v16[j]).astype(np.float64)
        yield n, j, keys, vals


def _probabilities(keys: np.ndarray, q: np.ndarray, scale: float, softcap: float = 0.0,
                   sink: float | None = None) -> np.ndarray:
    """The keys' softmax probabilities; a sink logit takes its share of the denominator (its value is zero)."""
    s = keys @ fp16_round(q).astype(np.float64) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    m = s.max() if sink is None else max(s.max(), sink)
    p = np.exp(s - m)
    return p / (p.sum() + (0.0 if sink is None else np.exp(sink - m)))


def kivi_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, query_cells: np.ndarray, *, window: int,
                   n_sink: int, k_bits: int, v_bits: int, scale: float, n_swa: int = 0, clip_k: float = 1.0,
                   clip_v: float = 1.0, softcap: float = 0.0, sinks: tuple[float, ...] = ()) -> np.ndarray:
    """DESIGN.md §5 in plain numpy (float64 softmax): q [n_q, n_head, d], k/v [n_cells, n_head_kv, d];
    the query at cell i attends cells 0..i, or with a sliding window (n_swa > 0, llama.cpp's standard SWA) the
    last n_swa of them. Q is taken in fp16, as upstream's flash attention does. clip_k / clip_v: the quantized
    blocks' clip ratios. softcap: Gemma 2's attention logit soft-capping of the scaled scores; sinks: gpt-oss's
    learned sink logit of each query head."""
    group = q.shape[1] // k.shape[1]
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    for n, _, keys, vals in _contract_reads(k, v, query_cells, window=window, n_sink=n_sink, k_bits=k_bits,
                                            v_bits=v_bits, n_swa=n_swa, clip_k=clip_k, clip_v=clip_v):
        for h in range(q.shape[1]):
            sink = sinks[h] if sinks else None
            out[n, h] = _probabilities(keys[:, h // group], q[n, h], scale, softcap, sink) @ vals[:, h // group]
    return out


def latent_attention(q: np.ndarray, k: np.ndarray, query_cells: np.ndarray, *, head_dim_v: int, window: int,
                     n_sink: int, k_bits: int, scale: float, clip_k: float = 1.0) -> np.ndarray:
    """MLA's contract (ggml_kvq_attn_latent): one KV head, each cell's value the first head_dim_v channels of its
    key as the query reads that key, quantized or fp16 (so V's window is K's)."""
    out = np.zeros((q.shape[0], q.shape[1], head_dim_v))
    for n, _, keys, _ in _contract_reads(k, None, query_cells, window=window, n_sink=n_sink, k_bits=k_bits,
                                         v_bits=0, n_swa=0, clip_k=clip_k):
        for h in range(q.shape[1]):
            out[n, h] = _probabilities(keys[:, 0], q[n, h], scale) @ keys[:, 0, :head_dim_v]
    return out


def attention_mass(q: np.ndarray, k: np.ndarray, query_cells: np.ndarray, *, window: int, n_sink: int,
                   k_bits: int, scale: float, n_swa: int = 0, scoring: np.ndarray | None = None) -> np.ndarray:
    """MiniKV's accumulated attention scores, from the full probability matrix of the wide prefill's contract
    (quantized keys rounded to fp16): [n_cells, n_head_kv], each cell's probabilities summed over the queries
    (those `scoring` marks, default all) and the query heads that share its KV head."""
    group = q.shape[1] // k.shape[1]
    mass = np.zeros(k.shape[:2])
    for n, j, keys, _ in _contract_reads(k, None, query_cells, window=window, n_sink=n_sink, k_bits=k_bits,
                                         v_bits=0, n_swa=n_swa, k_fp16=True):
        if scoring is not None and not scoring[n]:
            continue
        for h in range(q.shape[1]):
            mass[j, h // group] += _probabilities(keys[:, h // group], q[n, h], scale)
    return mass
