"""A llama_batch written field by field, past Python's checks: tokens of several sequences at once, positions and
sequence ids the API would refuse."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pykvq import Context


@dataclass(frozen=True)
class Item:
    token: int
    pos: int
    seqs: tuple[int, ...]
    output: bool


def decode(ctx: Context, items: list[Item]) -> tuple[int, dict[int, np.ndarray]]:
    """llama_decode's status for one batch of ``items``, and the logits of each output, by the item's index."""
    lib = ctx._lib
    n_vocab = ctx.model.n_vocab
    batch = lib.llama.llama_batch_init(len(items), 0, max(len(item.seqs) for item in items))
    try:
        batch.n_tokens = len(items)
        for i, item in enumerate(items):
            batch.token[i] = item.token
            batch.pos[i] = item.pos
            batch.n_seq_id[i] = len(item.seqs)
            for k, seq in enumerate(item.seqs):
                batch.seq_id[i][k] = seq
            batch.logits[i] = item.output
        status = lib.llama.llama_decode(ctx._ptr, batch)
    finally:
        lib.llama.llama_batch_free(batch)
    if status != 0:
        return status, {}
    logits = {}
    for i, item in enumerate(items):
        if item.output:
            row = lib.llama.llama_get_logits_ith(ctx._ptr, i)
            logits[i] = np.frombuffer(lib.ffi.buffer(row, 4 * n_vocab), dtype=np.float32).copy()
    return status, logits


def decode_embeddings(ctx: Context, rows: np.ndarray, positions: np.ndarray, seq: int = 0) -> int:
    """llama_decode's status for embeddings ``rows`` [n, n_embd] (an image's, as a multimodal projector gives them)
    of one sequence at ``positions`` [n_pos, n] (M-RoPE's time, height, width, extra), no output."""
    lib = ctx._lib
    n = len(rows)
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    pos = lib.ffi.new("llama_pos[]", np.ascontiguousarray(positions, dtype=np.int32).ravel().tolist())
    batch = lib.llama.llama_batch_init(n, rows.shape[1], 1)
    own_pos = batch.pos  # llama_batch_free frees it: put back before then
    try:
        batch.n_tokens = n
        lib.ffi.memmove(batch.embd, rows.tobytes(), rows.nbytes)
        batch.pos = pos
        for i in range(n):
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = False
        return lib.llama.llama_decode(ctx._ptr, batch)
    finally:
        batch.pos = own_pos
        lib.llama.llama_batch_free(batch)
