"""The pinned gguf-py's GGUFReader, bounded by the file it reads.

gguf-py reads a value that starts past the end of the file as an empty array and steps on by its size, zero; an
array whose length a corrupt byte made large (it accepts up to 2**30 elements) is then walked element by element
on the spot, one Python object per step: one flipped byte cost hours and tens of GiB. This reader refuses any read
that runs past the end, and reads arrays of numbers (in one slice) and of strings without gguf-py's calls per
element, into the same fields as gguf-py's.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from pykvq.bindings import gguf_py

# an array value starts with its element type (uint32) and its length (uint64)
ARRAY_HEADER_BYTES = 12


@cache
def _reader_type() -> type:
    gguf = gguf_py.gguf()
    array, string = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING

    class BoundedReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._file

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            # a plain array over the mapping (which it keeps open): slicing a np.memmap costs ~10x more, and the
            # header of a 262k-token vocabulary is a million slices
            self._file = mapped.view(np.ndarray)

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            # checked before the read: a short slice viewed as a wider type is numpy's own error, not this one
            if offset + np.dtype(dtype).itemsize * int(count) > self.data.nbytes:
                values = f"{int(count)} {np.dtype(dtype).name} value" + ("" if int(count) == 1 else "s")
                raise ValueError(f"{values} at byte {offset} run past the end of the file ({self.data.nbytes} bytes): "
                                 "truncated or corrupt")
            return super()._get(offset, dtype, count, override_order)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
            if raw_type != array:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_item_type = self._get(orig_offs, np.uint32)
            item_type = gguf.GGUFValueType(raw_item_type[0])
            length = self._get(orig_offs + 4, np.uint64)
            np_type = self.gguf_scalar_to_np.get(item_type)
            if np_type is not None:
                parts = list(self._get(orig_offs + ARRAY_HEADER_BYTES, np_type, int(length[0])).reshape(-1, 1))
            elif item_type == string:
                parts = self._string_parts(orig_offs + ARRAY_HEADER_BYTES, int(length[0]))
            else:   # arrays of arrays: gguf-py's walk, each read bounded above
                return super()._get_field_parts(orig_offs, raw_type)
            size = ARRAY_HEADER_BYTES + sum(int(part.nbytes) for part in parts)
            # the fields as gguf-py's hold them: one part per element (a string's length, then its bytes), views
            # into the file, and the index of each element's value among the parts
            per_element = 2 if item_type == string else 1
            values = range(1 + per_element, len(parts) + 2, per_element)
            return size, [raw_item_type, length, *parts], list(values), [array, item_type]

        def _string_parts(self, offset: int, count: int) -> list[np.ndarray]:
            # gguf-py's _get_str per element, without its per-call overhead: a 262k-token vocabulary is read in
            # 0.5 s, not 10
            u64 = np.dtype(np.uint64).newbyteorder(self.byte_order)
            raw, end = self.data, self.data.nbytes
            parts: list[np.ndarray] = []
            for _ in range(count):
                if offset + 8 > end:
                    raise ValueError(f"a string at byte {offset} runs past the end of the file ({end} bytes)")
                length = raw[offset:offset + 8].view(u64)
                start, offset = offset + 8, offset + 8 + int(length[0])
                if offset > end:
                    raise ValueError(f"a string of {int(length[0])} bytes at byte {start} runs past the end of the "
                                     f"file ({end} bytes)")
                parts += (length, raw[start:offset])
            return parts

    return BoundedReader


def open_reader(path: Path) -> Any:
    """A GGUFReader of ``path`` (read-only); ValueError, OSError, IndexError or KeyError (a name twice) for a file
    it cannot read, as gguf-py's."""
    return _reader_type()(path, "r")
