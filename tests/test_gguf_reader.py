"""pykvq's bounded GGUF reader against gguf-py's own: the same fields, parts, values and tensors, on files of
either byte order and every value kind; what it adds (reads past the end refused) is in test_fuzz.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pykvq.bindings import gguf_py, gguf_reader
from pykvq.devtools import random_model


def write_every_kind(path: Path, big_endian: bool) -> Path:
    gguf = gguf_py.gguf()
    writer = gguf.GGUFWriter(path, arch="llama",
                             endianess=gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE)
    writer.add_array("test.strings", ["x", "", "héllo", "z" * 300])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [1.5, -2.0])
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_uint64("test.count", 7)
    writer.add_string("test.name", "str")
    writer.add_tensor("t", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(params=["little-endian", "big-endian", "tiny-model"])
def gguf_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if request.param == "tiny-model":
        path = tmp_path / "tiny.gguf"
        random_model.write(random_model.SHAPES["tiny"], path)
        return path
    return write_every_kind(tmp_path / "every-kind.gguf", request.param == "big-endian")


def test_the_bounded_reader_reads_as_gguf_py_does(gguf_file: Path) -> None:
    theirs = gguf_py.gguf().GGUFReader(gguf_file, "r")
    ours = gguf_reader.open_reader(gguf_file)
    assert list(ours.fields) == list(theirs.fields)
    for name, mine in ours.fields.items():
        field = theirs.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert [(p.dtype, p.shape, p.tobytes()) for p in mine.parts] == \
               [(p.dtype, p.shape, p.tobytes()) for p in field.parts], name
        assert mine.contents() == field.contents(), name
        if len(field.data) > 1:
            assert mine.contents(len(field.data) - 1) == field.contents(len(field.data) - 1), name
    assert [(t.name, t.tensor_type, t.data.tobytes()) for t in ours.tensors] == \
           [(t.name, t.tensor_type, t.data.tobytes()) for t in theirs.tensors]
