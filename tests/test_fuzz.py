"""Hostile input, fuzzed: the per-layer spec parser (C) and the kvq.* metadata reader never crash; they accept
or raise the one documented error."""

from __future__ import annotations

import contextlib
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pykvq import gguf_metadata
from pykvq.bindings import native
from pykvq.commands import inspect as model_info
from pykvq.devtools import random_model

import device

KIVI2 = 43
SPEC_ALPHABET = "kv:;,=-*0123456789 asymkvi/fq_"


@settings(max_examples=400, deadline=None)
@given(spec=st.one_of(st.text(alphabet=SPEC_ALPHABET, max_size=40), st.text(max_size=40)),
       n_layer=st.integers(min_value=1, max_value=64))
def test_layer_spec_parser_accepts_or_explains(spec: str, n_layer: int) -> None:
    if "\x00" in spec:
        return  # a C string ends there: not something a command line can carry
    try:
        types_k, types_v = native.resolve_layer_types(spec, n_layer, KIVI2, KIVI2)
    except ValueError as err:
        assert str(err).startswith("layer types '")
        return
    assert len(types_k) == len(types_v) == n_layer


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A whole (tiny, random-weight) model with kvq.* metadata: header, metadata, tensor infos and data."""
    folder = tmp_path_factory.mktemp("fuzz")
    random_model.write(random_model.SHAPES["tiny"], folder / "tiny.gguf")
    gguf_metadata.write_copy(folder / "tiny.gguf", folder / "tagged.gguf", {gguf_metadata.KEY_LAYERS: "asymkv:1/0"})
    return (folder / "tagged.gguf").read_bytes()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_metadata_reader_refuses_corrupt_files_cleanly(small_gguf: bytes, tmp_path: Path, data: st.DataObject) -> None:
    blob = bytearray(small_gguf)
    # mutations land in the header and metadata (the first few KiB) more often than in the weights
    head = min(len(blob), 32768)
    for _ in range(data.draw(st.integers(min_value=0, max_value=8))):
        at = data.draw(st.one_of(st.integers(0, head - 1), st.integers(0, len(blob) - 1)))
        blob[at] = data.draw(st.integers(min_value=0, max_value=255))
    if data.draw(st.booleans()):
        blob = blob[:data.draw(st.integers(min_value=0, max_value=len(blob)))]
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(bytes(blob))
    try:
        meta = gguf_metadata.read_kvq(path)
    except gguf_metadata.GgufError:
        return
    assert not meta or meta["kvq.version"] == gguf_metadata.KVQ_VERSION
    # pykvq inspect reads the rest of the header: a corrupt value is a GgufError (or a ValueError of the
    # kv_layers check), never another exception
    with contextlib.suppress(ValueError):
        model_info.collect(path)


def test_a_key_given_twice_is_refused_cleanly(small_gguf: bytes, tmp_path: Path) -> None:
    """Found by the fuzz above: a corrupted name that repeats another made gguf-py raise KeyError."""
    assert small_gguf.count(b"llama.context_length") == 1
    path = tmp_path / "twice.gguf"
    path.write_bytes(small_gguf.replace(b"llama.context_length", b"general.architecture"))
    with pytest.raises(gguf_metadata.GgufError, match="not a readable GGUF file: Duplicate general.architecture"):
        gguf_metadata.read_kvq(path)


@pytest.mark.parametrize("n_layer", [4278190082, 65536, 513, 0, -3])
def test_an_impossible_layer_count_is_refused_before_per_layer_values(n_layer: int) -> None:
    """Found by the fuzz above: block_count corrupted to 4278190082 made inspect build a list of that many head
    counts (MemoryError) before its size check; at 65536 (the old bound) its cost table ran for hours in CI
    (stop 46). llama.cpp loads at most 512 layers."""
    fields = {"general.architecture": "llama", "llama.block_count": n_layer, "llama.embedding_length": 256,
              "llama.attention.head_count": 4}
    with pytest.raises(gguf_metadata.GgufError, match=f"impossible sizes: {n_layer} layers"):
        model_info.read_shape(fields)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupt_models_are_an_error_not_a_crash(small_gguf: bytes, tmp_path: Path, data: st.DataObject) -> None:
    """llama.cpp's own loader on corrupted files, through `pykvq run` (a crash would take pytest down with it)."""
    blob = bytearray(small_gguf)
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        blob[data.draw(st.integers(0, 4095))] = data.draw(st.integers(min_value=0, max_value=255))
    if data.draw(st.booleans()):
        blob = blob[:data.draw(st.integers(min_value=0, max_value=len(blob)))]
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(bytes(blob))
    proc = subprocess.run(["pykvq", "run", *device.TOOL_ARGS,
                           "-m", str(path), "-p", "hello", "-n", "4", "-c", "256", "-t", "1"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("n_layer", [600, 0])
def test_an_impossible_block_count_is_an_error_not_a_crash(n_layer: int, tmp_path: Path) -> None:
    """Found by the fuzz above (a byte of block_count: 6146 layers): llama.cpp's loader aborted the process on a
    count past its 512 layers (GGML_ASSERT); patch 0018 makes it a load error."""
    path = tmp_path / "layers.gguf"
    random_model.write(replace(random_model.SHAPES["tiny"], n_layer=2), path)
    blob = bytearray(path.read_bytes())
    key = b"llama.block_count"
    at = blob.index(key) + len(key) + 4  # after the key: the value's type (uint32), then the value
    blob[at:at + 4] = n_layer.to_bytes(4, "little")
    path.write_bytes(bytes(blob))
    proc = subprocess.run(["pykvq", "run", *device.TOOL_ARGS, "-m", str(path), "-p", "hello", "-n", "2", "-c", "256",
                           "-t", "1"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"impossible block count {n_layer} (1 to 512 layers)" in proc.stderr


def test_two_equal_token_strings_are_an_error_not_a_crash(tmp_path: Path) -> None:
    """Found by the fuzz above (a byte of a token string made it another's): llama.cpp's vocabulary loader aborted
    the process (GGML_ASSERT); patch 0018 makes it a load error."""
    path = tmp_path / "tokens.gguf"
    random_model.write(replace(random_model.SHAPES["tiny"], n_layer=2), path)
    blob = path.read_bytes()
    assert blob.count(b"<t1>") == 1
    path.write_bytes(blob.replace(b"<t1>", b"<t0>"))
    proc = subprocess.run(["pykvq", "run", *device.TOOL_ARGS, "-m", str(path), "-p", "hello", "-n", "2", "-c", "256",
                           "-t", "1"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "corrupt vocabulary: " in proc.stderr and " distinct token strings" in proc.stderr


def test_a_vocabulary_that_throws_is_an_error_not_a_crash(tmp_path: Path) -> None:
    """SentencePiece without byte tokens: llama.cpp's tokenizer throws on text it cannot map; the C API must
    report it (patch: llama_tokenize), not terminate the program."""
    path = tmp_path / "no-bytes.gguf"
    random_model.write(random_model.SHAPES["tiny"], path, byte_tokens=False)
    proc = subprocess.run(["pykvq", "run", *device.TOOL_ARGS,
                           "-m", str(path), "-p", "héllo wörld", "-n", "2", "-c", "256", "-t", "1"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "cannot tokenize the text: llama_tokenize: the model's vocabulary cannot tokenize this text" in proc.stderr


def test_a_string_that_is_not_utf8_is_corrupt_metadata(small_gguf: bytes, tmp_path: Path) -> None:
    """Found by the fuzz test above: one byte of general.name made the reader raise UnicodeDecodeError."""
    blob = bytearray(small_gguf)
    blob[blob.index(b"random tiny")] = 0x80
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(bytes(blob))
    with pytest.raises(gguf_metadata.GgufError, match="corrupt metadata"):
        gguf_metadata.read_kvq(path)


def test_an_array_length_past_the_end_is_refused_at_once(small_gguf: bytes, tmp_path: Path) -> None:
    """Found by the fuzz test above (it ran 48 minutes in CI): gguf-py reads past the end of the file as empty
    arrays and does not advance, so a numeric array whose length a corrupt byte raised (up to gguf-py's 2**30)
    in a file that ends on an element boundary was walked element by element on the spot (byte 2 = 64:
    36 s and 4 GiB; byte 3: hours)."""
    blob = bytearray(small_gguf)
    key = b"tokenizer.ggml.token_type"
    at = blob.index(key) + len(key) + 8  # after the key: the value's type and the element type (uint32 each)
    blob[at + 2] = 0x3F
    path = tmp_path / "long-array.gguf"
    path.write_bytes(bytes(blob[:at + 8 + 4 * 30000]))
    with pytest.raises(gguf_metadata.GgufError, match=r"int32 values at byte \d+ run past the end of the file"):
        gguf_metadata.read_kvq(path)


@pytest.mark.parametrize("size", [4, 24, 100])
def test_a_header_cut_short_is_called_so(small_gguf: bytes, tmp_path: Path, size: int) -> None:
    """A file cut inside its header read a short slice as a wider type: numpy's "When changing to a larger dtype,
    its size must be a divisor..." was the message."""
    path = tmp_path / "cut.gguf"
    path.write_bytes(small_gguf[:size])
    with pytest.raises(gguf_metadata.GgufError, match="run past the end of the file .*: truncated or corrupt$"):
        gguf_metadata.read_kvq(path)


def test_tensor_data_cut_short_is_refused(small_gguf: bytes, tmp_path: Path) -> None:
    """A file cut inside its weights is corrupt (llama.cpp refuses it too), not a model with shorter tensors."""
    path = tmp_path / "cut.gguf"
    path.write_bytes(small_gguf[:-1000])
    with pytest.raises(gguf_metadata.GgufError, match="run past the end of the file"):
        gguf_metadata.read_kvq(path)
