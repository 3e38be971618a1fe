"""pykvq's ``kvq.*`` metadata in GGUF files: written into a copy of a model, read back.

Schema, version 4 (version 1 files, which cannot hold kvq.kv_clip, version 2 ones, which cannot hold kvq.kv_rotate,
and version 3 ones, which cannot hold kvq.kv_dither, are read as they are). What the KV cache uses: ``kvq.kv_layers``,
``kvq.kv_clip``, ``kvq.kv_rotate``, ``kvq.kv_dither``, ``kvq.window`` and ``kvq.sinks``, read by the patched llama.cpp
itself wherever the caller gives no per-layer types, clip ratios, rotation, V dither, window or sinks (and checked by
pykvq run / perplexity first). The
rest records how they were chosen, for later methods.

    kvq.version                    uint32   4
    kvq.kv_layers                  string   per-layer K/V types, the --kv-layers form
    kvq.kv_clip                    string   SKVQ's per-layer K/V clip ratios, the --kv-clip form
    kvq.kv_rotate                  string   Hadamard rotation of the kivi layers' K/V: on, off, or per layer (the
                                            --kv-rotate form)
    kvq.kv_dither                  string   spread of V's dithered rounding: one for every layer, or per layer (the
                                            --kv-dither form)
    kvq.window                     uint32   default kivi window (recent tokens kept in fp16), at most 2^31-1
    kvq.sinks                      uint32   default kivi sinks (first tokens kept in fp16), at most 2^31-1
    kvq.kv_budget                  float32  mean code bits per element the mix was chosen for
    kvq.calibration.text           string   file name of the calibration text
    kvq.calibration.n_tokens       uint32   tokens it measured over
    kvq.calibration.window         uint32   kivi window during the measurement
    kvq.calibration.sinks          uint32   kivi sinks during the measurement (pykvq convert)

  written by pykvq calibrate (llama.cpp's logits, KL divergence against f16 KV):
    kvq.calibration.recall                   uint32            of those tokens, the last that repeated the
                                                               text from its 9th (the recall span)
    kvq.calibration.window_ctx               uint32            the context length kvq.window was chosen for
                                                               (its fp16 cells priced in code bits there)
    kvq.calibration.retrieval                uint32            pass-key prompts the refined mixes were also
                                                               judged on (--retrieval N; 0: none)
    kvq.calibration.retrieval_ctx            uint32            their length in tokens (0 without them)
    kvq.calibration.sensitivity              string            how the next were found: "attention" (the f16
                                                               run's attention error, scaled by measured mixes)
                                                               or "measured" (each one measured with the cache)
    kvq.calibration.kld_{k,v}_{kivi4,kivi1}  float32[n_layer]  KL divergence that layer's K or V at that
                                                               width adds to kivi2 everywhere (< 0: a gain)
    kvq.calibration.kivi2_clip               string            the clip ratios chosen for kivi2 everywhere (the
                                                               --kv-clip form): kvq.kv_clip takes each tensor's
                                                               ratio at its width in kvq.kv_layers
    kvq.calibration.kivi4_clip, kivi1_clip   string            each tensor's ratio at 4 and at 1 bits; with
                                                               kivi2_clip read by the cache where its types are
                                                               not kvq.kv_layers (pykvq.width_clips)
    kvq.calibration.held_out                 uint32            held-out tokens the refined mix was checked on
                                                               against kivi2 everywhere (0: none)
    kvq.calibration.held_out_kld             float32[2]        the mix's and kivi2 everywhere's KL divergence
                                                               there (pykvq.calibration.held_out)
  written by pykvq convert --calibrate (the HF model in torch, one layer quantized at a time):
    kvq.calibration.error_{k,v}_{kivi4,kivi2,kivi1}  float32[n_layer]  relative squared error of the layer's
                                                     attention output with its K or V at that width
    kvq.calibration.{k,v}_absmax, {k,v}_rms          float32[n_layer]  K/V value ranges per layer
    kvq.calibration.k_channel_absmax                 float32[n_layer * n_embd_k_gqa]  per-channel K range,
                                                     layer-major, channels in the HF model's order

Whole numbers may be stored in any GGUF integer type, numbers in any integer or float type, finite (no measurement
is nan or inf); a value of another kind (a bool, a string for a number, an array for a scalar, an array of arrays)
is refused, by every reader: pykvq's (validate) and the patched llama.cpp's, which sees kvq.version and
kvq.kv_layers as text.

The copy is written next to the output under a temporary name and renamed into place only when complete.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pykvq.bindings import gguf_py, gguf_reader
from pykvq.bindings.native import INT32_MAX

log = logging.getLogger("pykvq.gguf")

KVQ_VERSION = 4
# what this pykvq reads: version 1 lacks kvq.kv_clip, 2 kvq.kv_rotate, 3 kvq.kv_dither, and they mean the same otherwise
READ_VERSIONS = (1, 2, 3, 4)
KEY_VERSION = "kvq.version"
KEY_LAYERS = "kvq.kv_layers"
KEY_CLIP = "kvq.kv_clip"
KEY_ROTATE = "kvq.kv_rotate"
KEY_DITHER = "kvq.kv_dither"
KEY_SELECT = "kvq.select"  # MiniKV's prompt selection, "HH,RW[,N[,D]]" as --kv-select takes it
KEY_WINDOW = "kvq.window"
KEY_SINKS = "kvq.sinks"
KEY_BUDGET = "kvq.kv_budget"
KEY_CALIBRATION_TEXT = "kvq.calibration.text"
KEY_SENSITIVITY = "kvq.calibration.sensitivity"
KEY_KIVI2_CLIP = "kvq.calibration.kivi2_clip"
# each width's clip ratios in every tensor (pykvq.width_clips)
WIDTH_CLIP_KEYS = {"kivi4": "kvq.calibration.kivi4_clip", "kivi2": KEY_KIVI2_CLIP,
                   "kivi1": "kvq.calibration.kivi1_clip"}
KEY_RECALL = "kvq.calibration.recall"
KEY_WINDOW_CTX = "kvq.calibration.window_ctx"

# whole-number keys and their largest value: the settings reach llama.cpp's int32 fields
WHOLE_NUMBERS = {KEY_WINDOW: INT32_MAX, KEY_SINKS: INT32_MAX, "kvq.calibration.window": INT32_MAX,
                 "kvq.calibration.sinks": INT32_MAX, "kvq.calibration.n_tokens": 2**32 - 1,
                 KEY_RECALL: 2**32 - 1, KEY_WINDOW_CTX: 2**32 - 1, "kvq.calibration.held_out": 2**32 - 1}


# copies smaller than this are quick enough not to need a progress bar
PROGRESS_BYTES = 256 << 20


class GgufError(ValueError):
    """Not a GGUF file pykvq can read, or kvq.* metadata it cannot use."""


def _reader(path: Path):
    try:
        return gguf_reader.open_reader(path)
    except (ValueError, OSError, IndexError) as exc:
        raise GgufError(f"{path} is not a readable GGUF file: {exc}") from exc
    except KeyError as exc:     # a key or tensor name twice, which llama.cpp refuses too
        raise GgufError(f"{path} is not a readable GGUF file: {exc.args[0]}") from exc


def read_fields(path: Path) -> dict[str, object]:
    """All metadata of a GGUF file, name -> value."""
    gguf = gguf_py.gguf()
    fields = _reader(path).fields
    for name, f in fields.items():
        # gguf-py reads them flattened; llama.cpp refuses the whole file
        if f.types.count(gguf.GGUFValueType.ARRAY) > 1:
            raise GgufError(f"{path}: {name} is an array of arrays, which llama.cpp cannot load")
    try:
        return {name: f.contents() for name, f in fields.items()}
    except (ValueError, IndexError) as exc:     # UnicodeDecodeError included: a corrupt string
        raise GgufError(f"{path} has corrupt metadata: {exc}") from exc


def kvq_fields(fields: dict[str, object], path: Path) -> dict[str, object]:
    """The kvq.* entries of a GGUF file's metadata (``fields``, from ``path``); GgufError for a version other
    than this pykvq's, or one that is not a whole number."""
    kvq = {name: value for name, value in fields.items() if name.startswith("kvq.")}
    version = kvq.get(KEY_VERSION)
    if kvq and not (_is_whole(version) and version in READ_VERSIONS):
        readable = f"{READ_VERSIONS[0]} to {READ_VERSIONS[-1]}"
        raise GgufError(f"{path}: kvq.* metadata version {version!r}; this pykvq reads versions {readable} "
                        "(later ones come from a newer pykvq)")
    return kvq


def read_kvq(path: Path) -> dict[str, object]:
    """The kvq.* metadata of a GGUF file (empty when it has none); GgufError for an unknown version."""
    return kvq_fields(read_fields(path), path)


def _is_whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or float, not a bool (a subclass of int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def allocation_fields(spec: str, budget: float) -> dict[str, object]:
    """The per-layer types a budget was allocated to, as kvq.* fields."""
    return {KEY_LAYERS: spec, KEY_BUDGET: float(budget)}


# per-layer arrays: one value per layer; the per-channel one: every layer's K channels
PER_CHANNEL = "kvq.calibration.k_channel_absmax"
PER_LAYER_PREFIXES = ("kvq.calibration.kld_", "kvq.calibration.error_", "kvq.calibration.k_absmax",
                      "kvq.calibration.v_absmax", "kvq.calibration.k_rms", "kvq.calibration.v_rms")


def validate(kvq: dict[str, object], n_layer: int, n_embd_k_total: int) -> None:
    """GgufError when kvq.* metadata does not fit a model of ``n_layer`` layers (``n_embd_k_total`` K channels
    over all layers) or has values of the wrong kind."""
    validate_settings(kvq, n_layer)
    for key, value in kvq.items():
        wanted = n_embd_k_total if key == PER_CHANNEL else n_layer if key.startswith(PER_LAYER_PREFIXES) else None
        if wanted is not None and (not isinstance(value, list) or len(value) != wanted):
            raise GgufError(f"{key} must hold {wanted} values for this model ({n_layer} layers)")
        if wanted is not None and not all(is_number(x) for x in value):  # type: ignore[union-attr]
            raise GgufError(f"{key} must hold numbers, not {_kind(value)}")
        # no measurement gives nan or inf, and JSON (pykvq inspect --json) cannot hold them
        if wanted is not None and not all(math.isfinite(x) for x in value):  # type: ignore[union-attr]
            raise GgufError(f"{key} holds nan or inf, not measurements: the metadata is corrupt; calibrate again")
        if key == KEY_BUDGET and not (is_number(value) and math.isfinite(value)):  # type: ignore[arg-type]
            raise GgufError(f"{key} must be a finite number, not {_kind(value)}: calibrate again")
        if key == KEY_CALIBRATION_TEXT and not isinstance(value, str):
            raise GgufError(f"{key} must be a string, not {_kind(value)}")


def _kind(value: object) -> str:
    if isinstance(value, list):
        return f"an array of {', '.join(sorted({type(x).__name__ for x in value})) or 'nothing'}"
    return f"{value!r}" if len(repr(value)) <= 40 else type(value).__name__


def validate_settings(kvq: dict[str, object], n_layer: int) -> None:
    """GgufError when the kvq.* settings a KV cache takes (per-layer types, clip ratios, rotation, V dither, window,
    sinks, prompt selection), or the whole numbers recorded with them, are of the wrong kind or do not fit a model of
    ``n_layer`` layers."""
    from pykvq import kv_types

    layers = kvq.get(KEY_LAYERS)
    if layers is not None:
        if not isinstance(layers, str):
            raise GgufError(f"{KEY_LAYERS} must be a string, not {type(layers).__name__}")
        try:
            types_k, types_v = kv_types.layer_types(layers, n_layer, "kivi2", "kivi2")
        except ValueError as exc:
            raise GgufError(f"the model's {KEY_LAYERS} does not fit its {n_layer} layers: {exc}") from exc
        for il, (type_k, type_v) in enumerate(zip(types_k, types_v, strict=True)):
            # the cache's own rule (llama_kv_cache::kvq_init), so that what inspect accepts a context takes
            if (type_k in kv_types.KIVI_BITS) != (type_v in kv_types.KIVI_BITS):
                raise GgufError(f"the model's {KEY_LAYERS} gives layer {il} K {type_k} and V {type_v}: a kivi K "
                                "type needs a kivi V type and the other way round")
    from pykvq.bindings import native

    for key, resolve in ((KEY_CLIP, native.resolve_clip), *((k, native.resolve_clip) for k in WIDTH_CLIP_KEYS.values()),
                         (KEY_ROTATE, native.resolve_rotation), (KEY_DITHER, native.resolve_dither)):
        spec = kvq.get(key)
        if spec is None:
            continue
        if not isinstance(spec, str):
            raise GgufError(f"{key} must be a string, not {type(spec).__name__}")
        try:
            resolve(spec, n_layer)
        except ValueError as exc:
            raise GgufError(f"the model's {key} does not fit its {n_layer} layers: {exc}") from exc
    select = kvq.get(KEY_SELECT)
    if select is not None:
        if not isinstance(select, str):
            raise GgufError(f"{KEY_SELECT} must be a string, not {type(select).__name__}")
        try:
            kv_types.parse_select(select)
        except kv_types.KvTypeError as exc:
            raise GgufError(f"the model's {KEY_SELECT} is not a prompt selection: {exc}") from exc
    for key, largest in WHOLE_NUMBERS.items():
        value = kvq.get(key)
        if value is not None and not (_is_whole(value) and 0 <= value <= largest):  # type: ignore[operator]
            raise GgufError(f"{key} must be a whole number from 0 to {largest}, not {_kind(value)}")


def write_copy(src: Path, dst: Path, metadata: dict[str, object]) -> None:
    """Copy ``src`` to ``dst`` with ``metadata`` (kvq.* keys: str, int, float, or 1-D float arrays) replacing any
    kvq.* it had."""
    gguf = gguf_py.gguf()
    reader = _reader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".part", dir=dst.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        # its one info line names the temporary file, which the user never sees: the command says what it wrote
        logging.getLogger(gguf.GGUFWriter.__module__).setLevel(logging.WARNING)
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
        total = sum(int(t.data.nbytes) for t in reader.tensors)
        with tqdm(total=total, unit="B", unit_scale=True, desc="write", disable=total < PROGRESS_BYTES) as bar:
            for tensor in reader.tensors:
                writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
                bar.update(int(tensor.data.nbytes))
        writer.close()
        # mkstemp made it private: give it the permissions a new file gets
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o666 & ~umask)
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
