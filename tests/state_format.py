"""The layout of a llama.cpp context state as pykvq's patched build writes it, field by field.

A whole state (llama_state_get_data, llama_context::state_write_data): the model's architecture string, then
the KV cache (llama_kv_cache::state_write): the stream count, and per stream its cell count, each cell's
position and sequence ids, then the cells' data. A cache with kivi layers writes its data as one block per
sequence part (kvq_state_write_part): the KVQ5 header (magic, n_layer, window, n_sink, n_fp16, n_cells, rotate)
and per layer the saved K/V type ids, what the layer rotates (not in KVQ3), the cells a pyramid selection left
dead after the sinks (not in KVQ3 or KVQ4) and the layer's bytes (a kivi layer:
sealed K tiles, V rows, fp16 sinks and ring; another type: the part's K and V rows). A cache without kivi layers
writes upstream's v_trans, n_layer, and per layer K then V: type, row size, rows.

A sequence state (llama_state_seq_get_data) starts with a magic and the saved sequence id; a session file
(llama_state_save_file) with its magic, version and token list. Upstream's state of this llama.cpp carries no
logits or embeddings.

``parse`` lists every field (offset, size, name, struct format) and every data region, and fails unless they
cover the bytes exactly: the fuzzer mutates the fields by name, the data by region.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from pykvq import Model
from pykvq.bindings import native

SEQ_STATE_MAGIC = 0xAF143CD8  # llama-context.cpp's io_magic
SESSION_MAGIC, SESSION_VERSION = 0x6767736E, 10  # 'ggsn', LLAMA_SESSION_VERSION
KVQ_MAGIC = 0x3551564B  # "KVQ5"
KVQ4_MAGIC = 0x3451564B  # "KVQ4": no dead cells per layer
KVQ3_MAGIC = 0x3351564B  # "KVQ3": no per-layer rotation either
QK_KIVI = 32  # cells per sealed K tile
KIVI_TYPE_IDS = {43, 44, 45}


class StateFormatError(ValueError):
    """The bytes do not follow the layout (a parser bug, or a layout change)."""


@dataclass(frozen=True)
class Field:
    offset: int
    fmt: str  # struct format, little endian: "<I", "<i", "<q", "<Q"
    name: str

    @property
    def size(self) -> int:
        return struct.calcsize(self.fmt)

    @property
    def signed(self) -> bool:
        return self.fmt[-1].islower()

    def read(self, blob: bytes | bytearray) -> int:
        return struct.unpack_from(self.fmt, blob, self.offset)[0]


@dataclass(frozen=True)
class Region:
    offset: int
    size: int
    name: str


@dataclass
class Layout:
    fields: list[Field] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)  # data bytes (tensor contents, strings, tokens)

    def check_covers(self, size: int) -> None:
        spans = sorted([(f.offset, f.size, f.name) for f in self.fields] +
                       [(r.offset, r.size, r.name) for r in self.regions])
        at = 0
        for offset, n, name in spans:
            if offset != at:
                raise StateFormatError(f"{name} at {offset}, expected {at}")
            at += n
        if at != size:
            raise StateFormatError(f"the layout ends at {at}, the state at {size}")


class _Reader:
    def __init__(self, blob: bytes, layout: Layout, offset: int = 0) -> None:
        self.blob, self.layout, self.at = blob, layout, offset

    def field(self, fmt: str, name: str) -> int:
        f = Field(self.at, fmt, name)
        if self.at + f.size > len(self.blob):
            raise StateFormatError(f"{name} at {self.at} runs past the end ({len(self.blob)})")
        self.layout.fields.append(f)
        self.at += f.size
        return f.read(self.blob)

    def region(self, size: int, name: str) -> None:
        if size < 0 or self.at + size > len(self.blob):
            raise StateFormatError(f"{name} of {size} bytes at {self.at} runs past the end ({len(self.blob)})")
        if size:
            self.layout.regions.append(Region(self.at, size, name))
        self.at += size


def row_size(type_id: int, n: int) -> int:
    t = native.ggml_type(type_id)
    return n // t.block_size * t.type_size


def _kvq_part(r: _Reader, n_embd_k: Sequence[int], n_embd_v: Sequence[int], tag: str) -> int:
    magic = r.field("<I", f"{tag}.kvq.magic")
    n_layer = r.field("<I", f"{tag}.kvq.n_layer")
    r.field("<i", f"{tag}.kvq.window")
    r.field("<i", f"{tag}.kvq.n_sink")
    n_fp16 = r.field("<q", f"{tag}.kvq.n_fp16")
    n_cells = r.field("<I", f"{tag}.kvq.n_cells")
    r.field("<i", f"{tag}.kvq.rotate")
    for il in range(n_layer):
        lt = f"{tag}.l{il}"
        type_k = r.field("<i", f"{lt}.type_k")
        type_v = r.field("<i", f"{lt}.type_v")
        if magic != KVQ3_MAGIC:
            r.field("<i", f"{lt}.rotate")
        if magic not in (KVQ3_MAGIC, KVQ4_MAGIC):
            r.field("<i", f"{lt}.dead")
        if type_k in KIVI_TYPE_IDS:
            r.region(n_cells // QK_KIVI * row_size(type_k, n_embd_k[il] * QK_KIVI), f"{lt}.k_tiles")
            r.region(n_cells * row_size(type_v, n_embd_v[il]), f"{lt}.v_rows")
            r.region(n_fp16 * n_embd_k[il] * 2, f"{lt}.k_fp16")
            r.region(n_fp16 * n_embd_v[il] * 2, f"{lt}.v_fp16")
        else:
            r.region(n_cells * row_size(type_k, n_embd_k[il]), f"{lt}.k_rows")
            r.region(n_cells * row_size(type_v, n_embd_v[il]), f"{lt}.v_rows")
    return n_cells


def _upstream_data(r: _Reader, cell_count: int, n_embd_k: Sequence[int], n_embd_v: Sequence[int], tag: str) -> None:
    if r.field("<I", f"{tag}.v_trans"):
        raise StateFormatError("v_trans states are not parsed (every pykvq cache here uses flash attention)")
    n_layer = r.field("<I", f"{tag}.n_layer")
    for part, n_embd in (("k", n_embd_k), ("v", n_embd_v)):
        for il in range(n_layer):
            type_id = r.field("<i", f"{tag}.l{il}.type_{part}")
            r.field("<Q", f"{tag}.l{il}.{part}_row_size")
            r.region(cell_count * row_size(type_id, n_embd[il]), f"{tag}.l{il}.{part}_rows")


def _memory(r: _Reader, n_embd_k: Sequence[int], n_embd_v: Sequence[int], kivi: bool) -> None:
    n_stream = r.field("<I", "n_stream")
    for s in range(n_stream):
        tag = f"s{s}"
        cell_count = r.field("<I", f"{tag}.cell_count")
        for i in range(cell_count):
            r.field("<i", f"{tag}.c{i}.pos")
            n_seq_id = r.field("<I", f"{tag}.c{i}.n_seq_id")
            for j in range(n_seq_id):
                r.field("<i", f"{tag}.c{i}.seq{j}")
        if cell_count == 0:
            continue
        if not kivi:
            _upstream_data(r, cell_count, n_embd_k, n_embd_v, tag)
            continue
        done, block = 0, 0
        while done < cell_count:
            done += _kvq_part(r, n_embd_k, n_embd_v, f"{tag}.b{block}")
            block += 1


@dataclass(frozen=True)
class Geometry:
    """What the bytes' sizes depend on beyond the state itself: K and V values per cell of each layer, and
    whether the cache writes the kivi block layout (any kivi layer)."""

    n_embd_k: tuple[int, ...]
    n_embd_v: tuple[int, ...]
    kivi: bool
    recurrent: bool = False  # a hybrid model's recurrent state follows the KV cache: one region, not parsed

    @classmethod
    def of(cls, model: Model, kivi: bool) -> Geometry:
        """A model whose layers all have the same K/V heads (the Llama family, the tiny random model)."""
        llama = model._lib.llama
        n_head_kv = llama.llama_model_n_head_kv(model._ptr)
        n_embd_kv = llama.llama_model_n_embd(model._ptr) // llama.llama_model_n_head(model._ptr) * n_head_kv
        return cls((n_embd_kv,) * model.n_layer, (n_embd_kv,) * model.n_layer, kivi)


def parse(blob: bytes, geometry: Geometry, kind: str = "state") -> Layout:
    """The fields and data regions of ``blob``: a whole state ("state"), a sequence state ("seq") or a session
    file ("session")."""
    layout = Layout()
    r = _Reader(blob, layout)
    if kind == "session":
        r.field("<I", "session.magic")
        r.field("<I", "session.version")
        n_tokens = r.field("<I", "session.n_tokens")
        r.region(4 * n_tokens, "session.tokens")
    if kind == "seq":
        r.field("<I", "seq.magic")
        r.field("<i", "seq.seq_id")
    else:
        n_arch = r.field("<I", "arch.length")
        r.region(n_arch, "arch.name")
    _memory(r, geometry.n_embd_k, geometry.n_embd_v, geometry.kivi)
    if geometry.recurrent:
        r.region(len(blob) - r.at, "recurrent")
    layout.check_covers(len(blob))
    return layout


def without_layer_fields(state: bytes, layout: Layout, suffixes: Sequence[str]) -> bytes:
    """The state with the per-layer fields whose names end in ``suffixes`` cut out (what an older format lacks)."""
    dropped = [f for f in layout.fields if f.name.endswith(tuple(suffixes)) and ".l" in f.name]
    if not dropped:
        raise StateFormatError(f"no per-layer field ends in {suffixes}")
    out, at = bytearray(), 0
    for f in dropped:
        out += state[at:f.offset]
        at = f.offset + f.size
    out += state[at:]
    return bytes(out)
