"""kivi in upstream's hybrid memories, where recurrent layers sit beside attention ones (Qwen3.5, Qwen3-Next,
Nemotron-H, Granite 4, Falcon-H1, LFM2): the attention layers' cache is a kivi cache inside llama_memory_hybrid, or
inside llama_memory_hybrid_iswa's sliding-window cache (LFM2 with a window: every attention layer slides). On
random-weight LFM2 models and Qwen 3.5's shape (gated delta nets, gated attention rotating a quarter of each head by
M-RoPE) from pykvq/devtools/random_model.py; and a model without attention at all (Mamba). Judged on the suite's
device: every comparison runs the same kernels with the same batch shapes, or checks against upstream's f16
cache."""

from __future__ import annotations

import functools
import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pykvq import KvConfig, LlamaError, Model
from pykvq.commands import inspect as model_info
from pykvq.devtools import random_model
from pykvq.kv_types import SELECT_OFF

import device
import state_format

N_CTX = 512
HYBRID = random_model.SHAPES["lfm2-small"]  # convolution, attention, convolution, attention
# Qwen 3.5's gated delta nets beside its gated attention, whose heads rotate a quarter of their channels by M-RoPE
MEMORIES = {"hybrid": HYBRID, "hybrid-iswa": replace(HYBRID, n_swa=64), "qwen35": random_model.SHAPES["qwen35-small"]}
PYRAMID = (0.25, 0.25, 0, 3.0)  # the heavy-hitter share falls from 5/12 in the lower attention layer to 1/12


@pytest.fixture(scope="module", params=MEMORIES)
def shape(request: pytest.FixtureRequest) -> random_model.Shape:
    return MEMORIES[request.param]


@pytest.fixture(scope="module")
def model_path(shape: random_model.Shape, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hybrid") / f"{shape.arch}{'-iswa' if shape.n_swa else ''}.gguf"
    random_model.write(shape, path)
    return path


@pytest.fixture(scope="module")
def model(model_path: Path):
    with device.load_model(model_path) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def sliding(shape: random_model.Shape) -> bool:
    """Whether the model's attention layers all slide (LFM2 with a window: the iSWA hybrid)."""
    return shape.n_swa > 0


@pytest.fixture(scope="module")
def plain_hybrid(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("hybrid") / "lfm2.gguf"
    random_model.write(HYBRID, path)
    with device.load_model(path) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return [int(t) for t in np.random.default_rng(3).integers(300, HYBRID.n_vocab, size=400)]


logits = functools.partial(device.all_logits, n_ctx=N_CTX)


def config(kv: KvConfig, n_ctx: int = N_CTX, **fields) -> object:
    return device.context_config(n_ctx=n_ctx, n_batch=N_CTX, n_threads=2, kv=kv, flash_attn="on", **fields)


def test_kivi_is_close_to_f16(model: Model, tokens: list[int]) -> None:
    f16 = logits(model, KvConfig(), tokens)
    # a window over the whole context reads every token in fp16: as close as upstream's own two attention paths
    upstream_noise = np.abs(logits(model, KvConfig(), tokens, flash_attn="off") - f16).mean()
    covering = logits(model, KvConfig.preset("kivi2", window=N_CTX), tokens)
    assert np.abs(covering - f16).mean() < 2 * upstream_noise
    errors = {name: np.abs(logits(model, kv, tokens) - f16).mean() for name, kv in {
        "kivi4": KvConfig.preset("kivi4", window=32), "kivi2": KvConfig.preset("kivi2", window=32),
        "q4_0": KvConfig.preset("q4_0")}.items()}
    assert 0 < errors["kivi4"] < errors["kivi2"] < 5 * errors["q4_0"]


def test_batching_does_not_change_logits(model: Model, tokens: list[int]) -> None:
    """With 37-token ubatches the sliding-window kivi cache drops cells between them (the iSWA hybrid's graph did
    not move them: logits 22 apart)."""
    kv = KvConfig.preset("kivi2", window=32, sinks=4)
    device.assert_same_logits(logits(model, kv, tokens, n_ubatch=37), logits(model, kv, tokens))


def test_a_state_continues(model: Model, tokens: list[int]) -> None:
    """The state holds the kivi cache and the recurrent state together."""
    device.assert_state_continues(model, config(KvConfig.preset("kivi2", window=32, sinks=4)), tokens[:300],
                                  tokens[300:340])


@pytest.mark.parametrize("unified", [False, True], ids=["streams", "unified"])
def test_sequences_of_one_context_attend_as_alone(model: Model, tokens: list[int], unified: bool) -> None:
    kv = KvConfig.preset("kivi2", window=32)
    a, b = tokens[:200], tokens[200:330]
    with model.context(config(kv, 2 * N_CTX, n_seq_max=2, kv_unified=unified)) as ctx:
        got = ctx.eval_seqs({0: a, 1: b})
    for seq, feed in ((0, a), (1, b)):
        device.assert_same_logits(got[seq], logits(model, kv, feed)[-1])


def test_a_copied_sequence_continues_as_its_source(model: Model, tokens: list[int]) -> None:
    kv = KvConfig.preset("kivi2", window=32)
    with model.context(config(kv, 2 * N_CTX, n_seq_max=2)) as ctx:
        ctx.eval_seqs({0: tokens[:200]})
        ctx.seq_cp(0, 1)
        got = ctx.eval_seqs({1: tokens[200:210]})
    device.assert_same_logits(got[1], logits(model, kv, tokens[:210])[-1])


def test_a_removal_is_refused_as_upstream_f16_refuses_it(model: Model, tokens: list[int]) -> None:
    """The recurrent state cannot go back a token: upstream refuses, and the kivi cache is left as it was."""
    for kv in (KvConfig(), KvConfig.preset("kivi2", window=32, rollback=8)):
        with model.context(config(kv)) as ctx, model.context(config(kv)) as twin:
            ctx.eval(tokens[:300])
            twin.eval(tokens[:300])
            with pytest.raises(LlamaError, match="cannot remove"):
                ctx.truncate(299)
            device.assert_same_logits(ctx.eval(tokens[300:340], all_logits=True),
                                      twin.eval(tokens[300:340], all_logits=True))


def selecting(model: Model, select, tokens: list[int]) -> tuple[np.ndarray, int]:
    """The continuation's logits after a prompt decoded under ``select``, and the cells the prompt left."""
    with model.context(config(KvConfig.preset("kivi2", select=select))) as ctx:
        ctx.eval(tokens[:300])
        held = ctx.seq_cells(0)
        return ctx.eval(tokens[300:340], all_logits=True), held


def test_keeping_every_token_selects_as_plain_kivi2(plain_hybrid: Model, tokens: list[int]) -> None:
    """MiniKV's selection in a hybrid (it aborted the process: the graph's mask was left unallocated): keeping every
    token rebuilds the plain cache bit for bit, and a quarter and a quarter keep half the cells."""
    plain, n_plain = selecting(plain_hybrid, None, tokens)
    kept, n_kept = selecting(plain_hybrid, (0.5, 0.5), tokens)
    assert n_kept == n_plain == 300
    device.assert_same_logits(kept, plain)
    assert selecting(plain_hybrid, (0.25, 0.25), tokens)[1] == 150


def test_a_pyramid_s_dead_cells_are_masked(plain_hybrid: Model, tokens: list[int]) -> None:
    """A pyramid leaves cells dead in the upper layer, which the graph's mask input hides (the hybrid's inputs left
    it unset): a state loaded into a context that selects nothing continues as the selecting one did, and the same
    state without its record of dead cells (the KVQ4 layout) continues otherwise."""
    rest = tokens[300:340]
    with plain_hybrid.context(config(KvConfig.preset("kivi2", select=PYRAMID))) as ctx:
        ctx.eval(tokens[:300])
        state = ctx.save_state()
        expected = ctx.eval(rest, all_logits=True)
    n_embd_kv = (HYBRID.n_embd_head * HYBRID.n_head_kv,) * 2  # the two attention layers'
    layout = state_format.parse(state, state_format.Geometry(n_embd_kv, n_embd_kv, kivi=True, recurrent=True))
    unmasked = state_format.without_layer_fields(state, layout, (".dead",)).replace(b"KVQ5", b"KVQ4")
    for blob, same in ((state, True), (unmasked, False)):
        with plain_hybrid.context(config(KvConfig.preset("kivi2", select=SELECT_OFF))) as ctx:
            ctx.load_state(blob)
            got = ctx.eval(rest, all_logits=True)
        if same:
            device.assert_same_logits(got, expected)
        else:
            assert np.abs(got - expected).max() > 1.0


def test_selection_leaves_a_cache_of_sliding_layers_alone(model: Model, sliding: bool, tokens: list[int]) -> None:
    """With every attention layer sliding (the iSWA hybrid) no cache selects: the prompt is held as without
    selection, and said so (its empty global cache reported half the cells held)."""
    if not sliding:
        pytest.skip("the plain hybrid selects (test_keeping_every_token_selects_as_plain_kivi2)")
    plain, n_plain = selecting(model, None, tokens)
    got, n_held = selecting(model, (0.25, 0.25), tokens)
    assert n_held == n_plain == 300
    device.assert_same_logits(got, plain)


def test_memory_is_the_kv_cache_s(model: Model, shape: random_model.Shape, sliding: bool) -> None:
    """What the context reports is its KV cache: the recurrent state (the same for every KV type) is not counted,
    and only the attention layers' elements are."""
    with model.context(config(KvConfig())) as ctx:
        f16 = ctx.memory()
    with model.context(config(KvConfig.preset("kivi2", window=32))) as ctx:
        kivi = ctx.memory()
    assert f16.n_layers == kivi.n_layers == sum(not shape.is_recurrent(il) for il in range(shape.n_layer))
    assert f16.bits_per_element == 16.0 and f16.bytes == f16.f16_bytes
    assert kivi.bits_per_element < 6.0
    assert (f16.swa_bytes == f16.bytes) if sliding else (f16.swa_bytes == 0)


def pykvq_run(model: Path, kv_type: str) -> subprocess.CompletedProcess:
    return subprocess.run(["pykvq", "run", *device.TOOL_ARGS, "-t", "2", "-m", str(model), "--kv-type", kv_type,
                           "-p", "<t7> <t8>", "-n", "8", "--temp", "0", "-c", str(N_CTX)],
                          capture_output=True, text=True)


def test_pykvq_run_reports_a_hybrid_s_cache(model_path: Path, sliding: bool) -> None:
    """`pykvq run` generates and reports the cache (on the iSWA hybrid it failed dividing by the global layers'
    elements, which it has none of)."""
    proc = pykvq_run(model_path, "kivi2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"KV cache K kivi2, V kivi2 .*: [0-9.]+ MiB for 512 cells", proc.stderr)
    assert ("no global layers" in proc.stderr) == sliding


def test_inspect_counts_what_the_context_holds(plain_hybrid: Model) -> None:
    """`pykvq inspect`, from the header: the attention layers alone, as the context's f16 cache holds them."""
    proc = subprocess.run(["pykvq", "inspect", "--json", str(plain_hybrid.path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    f16 = {c["kv_type"]: c["bytes_per_token"] for c in json.loads(proc.stdout)["kv_bytes"]}["f16"]
    with plain_hybrid.context(config(KvConfig())) as ctx:
        assert f16 * N_CTX == ctx.memory().bytes
    text = subprocess.run(["pykvq", "inspect", str(plain_hybrid.path)], capture_output=True, text=True).stdout
    assert "2 of the 4 layers have no attention" in text


@pytest.mark.parametrize(("fields", "n_head_kv"), [
    ({}, [0, 0, 0, 2, 0, 0, 0, 2]),  # llama.cpp's default interval for Qwen3.5: every 4th layer attends
    ({"qwen35.full_attention_interval": 2}, [0, 2] * 4),
    ({"qwen35.attention.recurrent_layers": [True] * 7 + [False]}, [0] * 7 + [2]),
], ids=["default", "interval", "flags"])
def test_inspect_reads_the_recurrent_layers_of_the_interval_families(fields: dict, n_head_kv: list[int]) -> None:
    """Qwen3-Next/3.5 declare KV heads in every layer and say which are recurrent by an interval or flags."""
    header = {"general.architecture": "qwen35", "qwen35.block_count": 8, "qwen35.embedding_length": 256,
              "qwen35.attention.head_count": 4, "qwen35.attention.head_count_kv": 2, **fields}
    shape = model_info.read_shape(header)
    assert shape.n_head_kv == n_head_kv and shape.n_recurrent == n_head_kv.count(0)


@pytest.mark.parametrize("kv_type", ["f16", "kivi2"])
def test_pykvq_run_says_a_model_without_attention_keeps_no_kv_cache(tmp_path: Path, kv_type: str) -> None:
    """Mamba's blocks keep a recurrent state and no KV cache: `pykvq run` generates and says so (it failed dividing
    by the cache's elements once the text was out)."""
    path = tmp_path / "mamba-small.gguf"
    random_model.write(random_model.SHAPES["mamba-small"], path)
    proc = pykvq_run(path, kv_type)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "generated 8 tokens" in proc.stderr
    assert "no KV cache: the model keeps a recurrent state" in proc.stderr
