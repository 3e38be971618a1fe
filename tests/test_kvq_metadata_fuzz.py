"""kvq.* metadata fuzzed: every key of the schema (pykvq/gguf_metadata.py) × every GGUF value type × extreme values,
written into a tiny random model and read through every entry point that takes a model.

The property: a value the schema allows is used as the schema says (the model's per-layer types reach the cache,
its window reaches `pykvq run`); any other value is one clear error line and a non-zero exit (no traceback, no
signal), never silently ignored. pykvq's readers (inspect, run, perplexity) check the whole schema and agree with
each other; llama.cpp itself reads kvq.version and kvq.kv_layers as the text its metadata map holds, so the paths
through it (the Python API, llama-cpp-python, the patched tools, the server) are held to that view.

In-process entry points take every variant; the subprocess ones a seeded sample, so that the file stays quick.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import pytest

import pykvq
from pykvq import KvConfig, gguf_metadata
from pykvq.bindings import gguf_py, native
from pykvq.commands import inspect as model_info
from pykvq.commands.run import with_model_metadata
from pykvq.devtools import random_model
from pykvq.paths import tool

import device
from server_process import free_port

gguf = gguf_py.gguf()
T = gguf.GGUFValueType

SHAPE = random_model.SHAPES["tiny"]
N_LAYER = SHAPE.n_layer
N_EMBD_K_TOTAL = N_LAYER * SHAPE.n_head_kv * (SHAPE.n_embd // SHAPE.n_head)
WHOLE = {T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64}
FLOAT = {T.FLOAT32, T.FLOAT64}
INT32_MAX = 2**31 - 1
# past the default window (128) and a tile: the last query reads sealed tiles, so the model's sinks, clip ratios
# and kivi widths change its logits (with fewer tokens every cell it reads is fp16 whatever they say)
TOKENS = [1 + (37 * i + 11) % 1000 for i in range(200)]


@dataclass(frozen=True)
class Value:
    """One GGUF metadata value: its type, the Python value the writer takes, the element type of an array."""

    vtype: object
    value: object
    sub_type: object = None

    def __str__(self) -> str:
        shown = repr(self.value)
        shown = shown if len(shown) <= 24 else f"{shown[:20]}...({len(self.value)})"  # type: ignore[arg-type]
        return f"{self.vtype.name}{f'[{self.sub_type.name}]' if self.sub_type is not None else ''}={shown}"


GENERIC = [
    Value(T.UINT8, 0), Value(T.UINT8, 255), Value(T.INT8, -1), Value(T.INT8, 127), Value(T.UINT16, 65535),
    Value(T.INT16, -32768), Value(T.UINT32, 1), Value(T.UINT32, 2**32 - 1), Value(T.INT32, -1),
    Value(T.INT32, INT32_MAX), Value(T.UINT64, 2**64 - 1), Value(T.INT64, -(2**63)), Value(T.INT64, 1),
    Value(T.FLOAT32, 1.0), Value(T.FLOAT32, math.nan), Value(T.FLOAT32, math.inf), Value(T.FLOAT64, -math.inf),
    Value(T.FLOAT64, 1e308), Value(T.BOOL, True), Value(T.BOOL, False),
    Value(T.STRING, ""), Value(T.STRING, "1"), Value(T.STRING, "x" * 100_000), Value(T.STRING, b"\xff\xfe\x80"),
    Value(T.STRING, "1\x00junk"),
    Value(T.ARRAY, [0.5, -1.5], T.FLOAT32), Value(T.ARRAY, [1, 2], T.UINT32), Value(T.ARRAY, [-1, 2**63 - 1], T.INT64),
    Value(T.ARRAY, [math.nan, math.inf], T.FLOAT64), Value(T.ARRAY, [True, False], T.BOOL),
    Value(T.ARRAY, ["asymkv:1/0", "b"], T.STRING), Value(T.ARRAY, ["1"], T.STRING), Value(T.ARRAY, [], T.UINT8),
    Value(T.ARRAY, [1], T.UINT8), Value(T.ARRAY, [[1, 2], [3]], T.ARRAY),
]

PER_LAYER_KEYS = ("kvq.calibration.kld_k_kivi4", "kvq.calibration.error_v_kivi1", "kvq.calibration.v_rms")
# clip ratios the cache reads: kvq.kv_clip, and each width's (pykvq.width_clips)
CLIP_KEYS = (gguf_metadata.KEY_CLIP, *gguf_metadata.WIDTH_CLIP_KEYS.values())
# what each key takes besides the generic values: the valid ones, and the edges of valid
EXTRA = {
    gguf_metadata.KEY_VERSION: [Value(T.UINT32, 2), Value(T.UINT32, 3), Value(T.UINT8, 1), Value(T.INT16, 2)],
    gguf_metadata.KEY_LAYERS: [Value(T.STRING, s) for s in (
        "asymkv:1/0", "k:*=kivi4;v:0=kivi1,1-=kivi2", "k:0=f16,1-=kivi2;v:0=f16,1-=kivi2", "k:0-5=kivi2;v:*=kivi2",
        "k:*=kivi3", "asymkv:1/0\x00junk", "none", "k:*=kivi2;v:*=q8_0")],
    **{key: [Value(T.STRING, s) for s in (
        "k:*=0.9;v:*=0.8", "v:0=1,1-=0.5", "k:*=0.85\x00junk", "none", "k:*=1.5", "k:*=0", "k:0=0.9", "asymkv:1/0",
        "k:*=kivi2")] for key in CLIP_KEYS},
    gguf_metadata.KEY_WINDOW: [Value(T.UINT32, 7), Value(T.INT64, 64), Value(T.UINT32, INT32_MAX + 1)],
    gguf_metadata.KEY_SINKS: [Value(T.UINT32, 4), Value(T.INT8, 0)],
    gguf_metadata.KEY_BUDGET: [Value(T.FLOAT32, 2.5)],
    "kvq.calibration.text": [Value(T.STRING, "wiki.test.raw")],
    "kvq.calibration.n_tokens": [Value(T.UINT32, 384)],
    **{key: [Value(T.ARRAY, [0.1, 0.2, 0.3], T.FLOAT32)] for key in PER_LAYER_KEYS},
    gguf_metadata.PER_CHANNEL: [Value(T.ARRAY, [0.25] * N_EMBD_K_TOTAL, T.FLOAT32)],
}
KEYS = [gguf_metadata.KEY_VERSION, gguf_metadata.KEY_LAYERS, *CLIP_KEYS, gguf_metadata.KEY_WINDOW,
        gguf_metadata.KEY_SINKS,
        gguf_metadata.KEY_BUDGET, "kvq.calibration.text", "kvq.calibration.n_tokens", "kvq.calibration.window",
        "kvq.calibration.sinks", *PER_LAYER_KEYS, gguf_metadata.PER_CHANNEL]
VARIANTS = [(key, value) for key in KEYS for value in GENERIC + EXTRA.get(key, [])]
# the keys llama.cpp reads (the value types through its GGUF loader)
NATIVE_KEYS = (gguf_metadata.KEY_VERSION, gguf_metadata.KEY_LAYERS, gguf_metadata.KEY_WINDOW,
               gguf_metadata.KEY_SINKS, *CLIP_KEYS)


# --- the oracles: the schema (gguf_metadata's docstring) and llama.cpp's text view of it


def _strings(v: Value) -> list[object]:
    if v.vtype == T.STRING:
        return [v.value]
    return list(v.value) if v.vtype == T.ARRAY and v.sub_type == T.STRING else []  # type: ignore[call-overload]


def loadable(v: Value) -> bool:
    """Whether llama.cpp loads a file holding it: it refuses arrays of arrays."""
    return v.sub_type != T.ARRAY


def readable(v: Value) -> bool:
    """Whether gguf-py reads it: strings are UTF-8 (a byte string here is not)."""
    return loadable(v) and not any(isinstance(s, bytes) for s in _strings(v))


KIVI_IDS = {pykvq.GGML_TYPE_KIVI1, pykvq.GGML_TYPE_KIVI2, pykvq.GGML_TYPE_KIVI4}


@cache
def spec_parses(spec: str) -> bool:
    """Whether a context takes these per-layer types: the spec parses, and no layer pairs kivi with another type."""
    try:
        types_k, types_v = native.resolve_layer_types(spec, N_LAYER, pykvq.GGML_TYPE_KIVI2, pykvq.GGML_TYPE_KIVI2)
    except ValueError:
        return False
    return all((k in KIVI_IDS) == (v in KIVI_IDS) for k, v in zip(types_k, types_v, strict=True))


def clip_parses(spec: str) -> bool:
    """Whether a context takes these clip ratios."""
    try:
        native.resolve_clip(spec, N_LAYER)
    except ValueError:
        return False
    return True


def schema_accepts(key: str, v: Value) -> bool:
    """Whether a model whose kvq.* metadata is version 1 plus ``key`` = ``v`` is valid under the schema."""
    if not readable(v):
        return False
    whole = v.vtype in WHOLE
    if key == gguf_metadata.KEY_VERSION:
        return whole and v.value in gguf_metadata.READ_VERSIONS
    if key == gguf_metadata.KEY_LAYERS:
        return v.vtype == T.STRING and spec_parses(v.value.split("\x00")[0])  # type: ignore[union-attr]
    if key in CLIP_KEYS:
        return v.vtype == T.STRING and clip_parses(v.value.split("\x00")[0])  # type: ignore[union-attr]
    if key in gguf_metadata.WHOLE_NUMBERS:
        return whole and 0 <= v.value <= gguf_metadata.WHOLE_NUMBERS[key]  # type: ignore[operator]
    if key == gguf_metadata.KEY_BUDGET:
        return whole or (v.vtype in FLOAT and math.isfinite(v.value))  # type: ignore[arg-type]
    if key == "kvq.calibration.text":
        return v.vtype == T.STRING
    wanted = N_EMBD_K_TOTAL if key == gguf_metadata.PER_CHANNEL else N_LAYER
    return (v.vtype == T.ARRAY and v.sub_type in WHOLE | FLOAT and len(v.value) == wanted  # type: ignore[arg-type]
            and all(math.isfinite(x) for x in v.value))  # type: ignore[union-attr]


def native_text(v: Value) -> str:
    """The text llama.cpp's metadata map holds for a value (gguf_kv_to_str), as far as the checks need it."""
    if v.vtype == T.STRING:
        raw = v.value if isinstance(v.value, bytes) else v.value.encode()  # type: ignore[union-attr]
        return raw.split(b"\x00")[0].decode(errors="replace")
    if v.vtype == T.BOOL:
        return "true" if v.value else "false"
    if v.vtype in FLOAT:
        return f"{v.value:f}"
    if v.vtype == T.ARRAY:
        return f"[{len(v.value)} values]"  # type: ignore[arg-type]
    return str(v.value)


@dataclass(frozen=True)
class Native:
    """What llama.cpp's cache takes from the model: per-layer types (None: its own), window and sinks (None: the
    defaults), clip ratios (None: none)."""

    layers: str | None = None
    window: int | None = None
    sinks: int | None = None
    clip: str | None = None


def native_count(key: str, text: str) -> int:
    """kvq.window / kvq.sinks as llama.cpp reads their text: a whole count from 0 to INT32_MAX, else ValueError."""
    if len(text) >= 64 or not re.fullmatch(r"\s*[+-]?\d+", text) or not 0 <= int(text) <= INT32_MAX:
        raise ValueError(key)
    return int(text)


def native_settings(key: str, v: Value) -> Native:
    """What llama.cpp's cache takes from a model holding ``key`` = ``v``; ValueError when it must refuse the model."""
    if not loadable(v):
        raise ValueError("llama.cpp cannot load an array of arrays")
    if key == gguf_metadata.KEY_VERSION and native_text(v) not in {str(n) for n in gguf_metadata.READ_VERSIONS}:
        raise ValueError("version")
    if key == gguf_metadata.KEY_WINDOW:
        return Native(window=native_count(key, native_text(v)))
    if key == gguf_metadata.KEY_SINKS:
        return Native(sinks=native_count(key, native_text(v)))
    # a kivi2 cache of no per-layer types from the model reads kvq.kv_clip, or its width's ratios where the model
    # has them; the other widths' it never reads
    if key in (gguf_metadata.KEY_CLIP, gguf_metadata.KEY_KIVI2_CLIP) and native_text(v) not in ("", "none"):
        if not clip_parses(native_text(v)):
            raise ValueError(key)
        return Native(clip=native_text(v))
    if key != gguf_metadata.KEY_LAYERS or native_text(v) in ("", "none"):
        return Native()
    if not spec_parses(native_text(v)):
        raise ValueError("kv_layers")
    return Native(layers=native_text(v))


# --- writing the variants


class _Writer(gguf.GGUFWriter):
    """gguf-py's value encoding, which refuses empty arrays; the format (and llama.cpp) allows them."""

    def _pack_val(self, val, vtype, add_vtype: bool, sub_type=None) -> bytes:
        if vtype == T.ARRAY and len(val) == 0:
            return (self._pack("I", vtype) if add_vtype else b"") + self._pack("I", sub_type) + self._pack("Q", 0)
        return super()._pack_val(val, vtype, add_vtype, sub_type)


@dataclass(frozen=True)
class Base:
    """A GGUF file cut where metadata can be appended: a variant is a splice, not a rewrite of every tensor."""

    head: bytes      # magic, version, tensor count
    n_kv: int
    kv: bytes
    tensor_infos: bytes
    data: bytes
    alignment: int

    @classmethod
    def of(cls, path: Path) -> Base:
        reader = gguf.GGUFReader(path)
        blob = path.read_bytes()
        infos = [t.field for t in reader.tensors]
        kv_end = infos[0].offset
        infos_end = infos[-1].offset + sum(int(part.nbytes) for part in infos[-1].parts)
        return cls(blob[:16], len(reader.fields) - 3, blob[24:kv_end], blob[kv_end:infos_end],
                   blob[reader.data_offset:], reader.alignment)

    def write(self, dst: Path, entries: dict[str, Value]) -> Path:
        packer = _Writer(None, arch="llama")
        kv = bytearray(self.kv)
        for key, v in entries.items():
            kv += packer._pack_val(key, T.STRING, add_vtype=False)
            kv += packer._pack_val(v.value, v.vtype, add_vtype=True, sub_type=v.sub_type)
        out = bytearray(self.head) + (self.n_kv + len(entries)).to_bytes(8, "little") + kv + self.tensor_infos
        out += bytes(-len(out) % self.alignment)
        dst.write_bytes(bytes(out + self.data))
        return dst


def write_variant(base: Base, dst: Path, key: str, v: Value) -> Path:
    """``base`` with kvq.version 1 (unless ``key`` is the version) and ``key`` = ``v``."""
    version = {} if key == gguf_metadata.KEY_VERSION else {gguf_metadata.KEY_VERSION: Value(T.UINT32, 1)}
    return base.write(dst, {**version, key: v})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kvq-fuzz") / "tiny.gguf"
    random_model.write(SHAPE, path)
    return path


@pytest.fixture(scope="module")
def base(tiny: Path) -> Base:
    return Base.of(tiny)


def sample(n: int, seed: int, keys: tuple[str, ...] | None = None) -> list[tuple[str, Value]]:
    """``n`` variants, half the schema accepts and half it does not, the same every run."""
    pool = [(k, v) for k, v in VARIANTS if keys is None or k in keys]
    rng = random.Random(seed)
    good = [kv for kv in pool if schema_accepts(*kv)]
    bad = [kv for kv in pool if not schema_accepts(*kv)]
    return rng.sample(good, n // 2) + rng.sample(bad, n - n // 2)


def _ids(variants: list[tuple[str, Value]]) -> list[str]:
    return [f"{key}:{v}" for key, v in variants]


# --- in-process: every variant


@pytest.mark.parametrize("key", KEYS)
def test_inspect_and_run_apply_the_schema(base: Base, tmp_path: Path, key: str) -> None:
    """pykvq's readers on every value of one key: inspect refuses exactly what the schema refuses, with a
    GgufError, and `run` takes the model's settings on the same terms."""
    path = tmp_path / "variant.gguf"
    for v in GENERIC + EXTRA.get(key, []):
        write_variant(base, path, key, v)
        expected = schema_accepts(key, v)
        try:
            info = model_info.collect(path)
        except gguf_metadata.GgufError as exc:
            assert not expected, f"{key} = {v}: inspect refused a valid value: {exc}"
            assert "\n" not in str(exc)
            with pytest.raises(gguf_metadata.GgufError):
                with_model_metadata(KvConfig.preset("kivi2"), path, N_LAYER)
            continue
        assert expected, f"{key} = {v}: inspect accepted {info['kvq'].get(key)!r}"
        kv = with_model_metadata(KvConfig.preset("kivi2"), path, N_LAYER)
        if key == gguf_metadata.KEY_WINDOW:
            assert kv.window == v.value == info["kivi_window"]
        if key == gguf_metadata.KEY_SINKS:
            assert kv.sinks == v.value == info["kivi_sinks"]
        # an empty spec names nothing: the setting stays unset
        if key == gguf_metadata.KEY_LAYERS:
            assert kv.layers == (v.value or None)
        if key == gguf_metadata.KEY_CLIP:
            assert kv.clip == (v.value or None)
        # what the command line gives is not taken from the model, nor held against it
        given = KvConfig("kivi2", "kivi2", 16, 0, layers="none", clip="none")
        if key in (gguf_metadata.KEY_WINDOW, gguf_metadata.KEY_SINKS, gguf_metadata.KEY_LAYERS, *CLIP_KEYS):
            assert with_model_metadata(given, path, N_LAYER) == given


@cache
def reference_logits(tiny: Path, native: Native) -> np.ndarray:
    """The logits of the model without metadata, given explicitly what llama.cpp takes from the variant."""
    with device.load_model(tiny) as model, model.context(_config(native.layers or "none", native.window,
                                                                 native.sinks, native.clip or "none")) as ctx:
        return ctx.eval(TOKENS)


def _config(layers: str | None, window: int | None = None, sinks: int | None = None, clip: str | None = None):
    return device.context_config(n_ctx=256, n_threads=1,
                                 kv=KvConfig("kivi2", "kivi2", window, sinks, layers=layers, clip=clip))


@pytest.mark.parametrize("key", NATIVE_KEYS)
def test_python_api_reads_the_model_as_llama_cpp_does(tiny: Path, base: Base, tmp_path: Path, key: str) -> None:
    """Model + a kivi2 context + eval on every value: the model's per-layer types, window and sinks give exactly
    the logits of the same settings given explicitly, a value llama.cpp cannot use is a LlamaError naming it."""
    path = tmp_path / "variant.gguf"
    for v in GENERIC + EXTRA.get(key, []):
        write_variant(base, path, key, v)
        try:
            native = native_settings(key, v)
        except ValueError:
            with pytest.raises(pykvq.LlamaError) as refused, device.load_model(path) as model, \
                    model.context(_config(None)) as ctx:
                ctx.eval(TOKENS)
            message = str(refused.value)
            assert "\n" not in message and ("kvq" in message or "invalid GGUF type" in message), message
            continue
        with device.load_model(path) as model, model.context(_config(None)) as ctx:
            np.testing.assert_array_equal(ctx.eval(TOKENS), reference_logits(tiny, native), err_msg=f"{key} = {v}")


@pytest.mark.parametrize("key", NATIVE_KEYS)
def test_llama_cpp_python_reads_the_model_as_llama_cpp_does(tiny: Path, base: Base, tmp_path: Path,
                                                            key: str) -> None:
    """pykvq.llama_cpp.Llama on every value: the same logits as our API on the same types, or a ValueError that
    says why (llama-cpp-python's own says only "Failed to create llama_context")."""
    if importlib.util.find_spec("llama_cpp") is None:  # not imported: pykvq.llama_cpp points it at our library
        pytest.skip("llama-cpp-python is not installed")
    from pykvq.llama_cpp import Llama

    path = tmp_path / "variant.gguf"
    for v in GENERIC + EXTRA.get(key, []):
        write_variant(base, path, key, v)
        kwargs = {"model_path": str(path), "n_ctx": 256, "n_threads": 1, "verbose": False, "logits_all": True,
                  "type_k": pykvq.GGML_TYPE_KIVI2, "type_v": pykvq.GGML_TYPE_KIVI2, **device.LLAMA_KWARGS}
        try:
            native = native_settings(key, v)
        except ValueError:
            with pytest.raises(ValueError, match="kvq|invalid GGUF type") as refused:
                Llama(**kwargs)
            assert "\n" not in str(refused.value)
            continue
        llm = Llama(**kwargs)
        try:
            llm.eval(TOKENS)
            np.testing.assert_array_equal(llm.scores[len(TOKENS) - 1], reference_logits(tiny, native),
                                          err_msg=f"{key} = {v}")
        finally:
            llm.close()


# --- subprocesses: a sample


def _clean_error(proc: subprocess.CompletedProcess, what: str) -> None:
    """A refusal: a non-zero exit (not a signal), one `pykvq: error:` line, no traceback."""
    assert proc.returncode == 1, f"{what}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, f"{what}:\n{proc.stderr[-2000:]}"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pykvq: error:")]
    assert len(errors) == 1, f"{what}:\n{proc.stderr[-2000:]}"


def _pykvq(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pykvq", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


CLI_SAMPLE = sample(12, seed=23)


@pytest.mark.parametrize("key, v", CLI_SAMPLE, ids=_ids(CLI_SAMPLE))
def test_inspect_and_run_commands(base: Base, tmp_path: Path, key: str, v: Value) -> None:
    """`pykvq inspect` and `pykvq run` agree: both accept or both refuse, cleanly; run uses the model's window
    and per-layer types."""
    path = write_variant(base, tmp_path / "variant.gguf", key, v)
    inspect = _pykvq("inspect", str(path), "--json", cwd=tmp_path)
    # a type given would win over the model's per-layer types
    kv_type = [] if key == gguf_metadata.KEY_LAYERS else ["--kv-type", "kivi2"]
    run = _pykvq("run", *device.TOOL_ARGS, "-m", str(path), "-p", "hello", "-n", "2", "-c", "64", "-t", "1",
                 *kv_type, "--temp", "0", cwd=tmp_path)
    if not schema_accepts(key, v):
        _clean_error(inspect, f"inspect {key} = {v}")
        _clean_error(run, f"run {key} = {v}")
        return
    assert inspect.returncode == 0, inspect.stderr
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(inspect.stdout)["kvq"][key] is not None
    if key == gguf_metadata.KEY_WINDOW:
        assert f"window {v.value}," in run.stderr
    if key == gguf_metadata.KEY_LAYERS and native_settings(key, v).layers is not None:
        assert f"KV cache layers {v.value}" in run.stderr


PPL_SAMPLE = sample(4, seed=5)


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(" ".join(f"word{i % 97} and more" for i in range(400)))
    return path


@pytest.mark.parametrize("key, v", PPL_SAMPLE, ids=_ids(PPL_SAMPLE))
def test_perplexity_command(base: Base, text: Path, tmp_path: Path, key: str, v: Value) -> None:
    path = write_variant(base, tmp_path / "variant.gguf", key, v)
    proc = _pykvq("perplexity", *device.TOOL_ARGS, "-m", str(path), "-f", str(text), "-c", "64", "--chunks", "1",
                  "-t", "1", "--kv-types", "kivi2", "-o", str(tmp_path / "ppl"), cwd=tmp_path)
    if not schema_accepts(key, v):
        _clean_error(proc, f"perplexity {key} = {v}")
        return
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads((tmp_path / "ppl.json").read_text())
    if key == gguf_metadata.KEY_WINDOW:
        assert runs["settings"]["window"] == v.value


TOOL_SAMPLE = sample(8, seed=7, keys=NATIVE_KEYS[:2])


@pytest.mark.parametrize("key, v", TOOL_SAMPLE, ids=_ids(TOOL_SAMPLE))
def test_patched_tools(base: Base, text: Path, tmp_path: Path, key: str, v: Value) -> None:
    """llama-completion and llama-perplexity read kvq.version and kvq.kv_layers in C++ (and kvq.window and kvq.sinks:
    test_kv_layers.py): the per-layer types are used, or the tool exits with its error (no signal, no abort)."""
    path = write_variant(base, tmp_path / "variant.gguf", key, v)
    kivi = ["-fa", "on", "-ctk", "kivi2", "-ctv", "kivi2", "-t", "1", "-v"]
    completion = subprocess.run([str(tool("llama-completion")), *device.TOOL_ARGS, "-m", str(path), "-p", "hello",
                                 "-n", "2", "-c", "64", "-no-cnv", "--no-warmup", *kivi],
                                capture_output=True, text=True, errors="replace", timeout=120,
                                stdin=subprocess.DEVNULL)
    perplexity = subprocess.run([str(tool("llama-perplexity")), *device.TOOL_ARGS, "-m", str(path), "-f", str(text),
                                 "-c", "64", "-b", "64", "--chunks", "1", *kivi],
                                capture_output=True, text=True, errors="replace", timeout=120)
    for name, proc in (("llama-completion", completion), ("llama-perplexity", perplexity)):
        output = proc.stdout + proc.stderr
        try:
            layers = native_settings(key, v).layers
        except ValueError:
            assert proc.returncode == 1, f"{name} {key} = {v}: exit {proc.returncode}\n{output[-2000:]}"
            assert "kvq" in output or "invalid GGUF type" in output, output[-2000:]
            continue
        assert proc.returncode == 0, f"{name} {key} = {v}: exit {proc.returncode}\n{output[-2000:]}"
        assert ("layer types = " in output) == (layers is not None), output[-3000:]
        if layers is not None:
            assert f"layer types = {layers}" in output


def _serve(path: Path, log: Path) -> tuple[int | None, dict | None]:
    """Start the server on ``path`` and send one completion: (exit status if it stopped, the answer if any)."""
    port = free_port()
    with log.open("w") as sink:
        # no --kv-type: a type given would win over the model's kvq.kv_layers, as in `pykvq run`
        proc = subprocess.Popen([sys.executable, "-m", "pykvq.llama_cpp.server", "--model", str(path),
                                 "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "256",
                                 "--n_threads", "1", "--n_gpu_layers", str(device.NGL)],
                                stdout=subprocess.DEVNULL, stderr=sink, cwd=log.parent)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    body = json.dumps({"prompt": "hello", "max_tokens": 2, "temperature": 0}).encode()
                    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                                     headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(request, timeout=30) as response:
                        return None, json.load(response)
                except OSError:
                    time.sleep(0.3)
            return proc.poll(), None
        finally:
            proc.terminate()
            proc.wait(timeout=30)


SERVER_SAMPLE = [(gguf_metadata.KEY_LAYERS, Value(T.STRING, "asymkv:1/0")),
                 (gguf_metadata.KEY_LAYERS, Value(T.ARRAY, ["asymkv:1/0", "b"], T.STRING)),
                 (gguf_metadata.KEY_VERSION, Value(T.FLOAT32, 1.0))]


@pytest.mark.parametrize("key, v", SERVER_SAMPLE, ids=_ids(SERVER_SAMPLE))
def test_server(base: Base, tmp_path: Path, key: str, v: Value) -> None:
    """python -m pykvq.llama_cpp.server: serves with the model's per-layer types, or exits with one error line."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    path = write_variant(base, tmp_path / "variant.gguf", key, v)
    status, answer = _serve(path, tmp_path / "server.log")
    log = (tmp_path / "server.log").read_text()
    try:
        layers = native_settings(key, v).layers
    except ValueError:
        assert status == 1 and answer is None, log[-2000:]
        assert "Traceback" not in log, log[-3000:]
        assert [line for line in log.splitlines() if line.startswith("pykvq: error:")], log[-2000:]
        return
    assert answer is not None and answer["choices"], log[-2000:]
    assert layers is None or f"layer types = {layers}" in log
