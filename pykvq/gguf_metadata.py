"""pykvq's ``kvq.*`` metadata in GGUF files: written into a copy of a model, read back.

Schema, version 1 (what the KV cache reads is ``kvq.kv_layers``; the rest documents how it was chosen):

    kvq.version                    uint32   1
    kvq.kv_layers                  string   per-layer K/V types, the --kv-layers form
    kvq.kv_budget                  float32  mean code bits per element the mix was chosen for
    kvq.calibration.text           string   file name of the calibration text
    kvq.calibration.n_tokens       uint32   tokens it measured over
    kvq.calibration.window         uint32   kivi window during the measurement
    kvq.calibration.kld_{k,v}_{kivi4,kivi1}  float32[n_layer]  KL divergence that layer's K or V at that
                                                               width adds to kivi2 everywhere (< 0: a gain)

The copy is written next to the output under a temporary name and renamed into place only when complete.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import numpy as np

log = logging.getLogger("pykvq.gguf")

KVQ_VERSION = 1
KEY_VERSION = "kvq.version"
KEY_LAYERS = "kvq.kv_layers"


class GgufError(ValueError):
    """Not a GGUF file pykvq can read, or kvq.* metadata it cannot use."""


def _gguf():
    import gguf  # installed with pykvq from the pinned llama.cpp

    return gguf


def _reader(path: Path):
    gguf = _gguf()
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, OSError, IndexError) as exc:
        raise GgufError(f"{path} is not a readable GGUF file: {exc}") from exc


def read_kvq(path: Path) -> dict[str, object]:
    """The kvq.* metadata of a GGUF file (empty when it has none); GgufError for an unknown version."""
    fields = {name: f.contents() for name, f in _reader(path).fields.items() if name.startswith("kvq.")}
    version = fields.get(KEY_VERSION)
    if fields and version != KVQ_VERSION:
        raise GgufError(f"{path}: kvq.* metadata version {version!r}; this pykvq reads version {KVQ_VERSION}")
    return fields


def write_copy(src: Path, dst: Path, metadata: dict[str, object]) -> None:
    """Copy ``src`` to ``dst`` with ``metadata`` (kvq.* keys: str, int, float, or 1-D float arrays) replacing any
    kvq.* it had."""
    gguf = _gguf()
    reader = _reader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".part", dir=dst.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith(("GGUF.", "kvq.")):
                continue
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
        for key, value in {KEY_VERSION: KVQ_VERSION, **metadata}.items():
            _add(writer, gguf, key, value)
        for tensor in reader.tensors:
            writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                                   tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in reader.tensors:
            writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
        writer.close()
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)


def _add(writer, gguf, key: str, value: object) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_array(key, [float(x) for x in np.asarray(value, dtype=np.float32)])
