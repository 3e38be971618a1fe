"""The pinned gguf-py's GGUFReader, bounded by the file it reads.

gguf-py reads a value that starts past the end of the file as an empty array and steps on by its size, zero; an
array whose length a corrupt byte made large (it accepts up to 2**30 elements) is then walked element by element
on the spot, one Python object per step: one flipped byte cost hours and tens of GiB. This reader refuses any read
that runs past the end, and reads an array of numbers in one piece (the same fields as gguf-py's, without a call
per element).
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
    array = gguf.GGUFValueType.ARRAY

    class BoundedReader(gguf.GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            values = super()._get(offset, dtype, count, override_order)
            if len(values) < int(count):
                raise ValueError(f"{int(count)} values of {np.dtype(dtype).name} at byte {offset} run past the end "
                                 f"of the file ({self.data.nbytes} bytes)")
            return values

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
            if raw_type != array:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_item_type = self._get(orig_offs, np.uint32)
            item_type = gguf.GGUFValueType(raw_item_type[0])
            np_type = self.gguf_scalar_to_np.get(item_type)
            if np_type is None:     # strings and arrays: element by element, each read bounded above
                return super()._get_field_parts(orig_offs, raw_type)
            length = self._get(orig_offs + 4, np.uint64)
            values = self._get(orig_offs + ARRAY_HEADER_BYTES, np_type, int(length[0]))
            # one part per element, as gguf-py's fields hold them (a view each, no copy)
            parts = [raw_item_type, length, *values.reshape(-1, 1)]
            return (ARRAY_HEADER_BYTES + int(values.nbytes), parts, list(range(2, len(parts))),
                    [gguf.GGUFValueType(raw_type), item_type])

    return BoundedReader


def open_reader(path: Path) -> Any:
    """A GGUFReader of ``path`` (read-only); ValueError, OSError, IndexError or KeyError (a name twice) for a file
    it cannot read, as gguf-py's."""
    return _reader_type()(path, "r")
