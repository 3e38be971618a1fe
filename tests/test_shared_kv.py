"""kivi caches read by layers that keep no KV of their own (Gemma 3n/4's shared KV layers: the last layers attend
the cache of the last earlier layer of their kind), on random-weight GGUFs of both families' shapes
(pykvq/devtools/random_model.py "gemma4-small": 8 layers, 3 sliding-window of head size 64 to 1 global of 128,
layers 4-7 reading layer 2's or layer 3's cache; "gemma3n-small": 25 layers with AltUp, Laurel and per-layer inputs,
layers 20-24 reading layer 18's or 19's). Judged on the CPU build: every comparison runs the same kernels with the
same batch shapes, or checks against upstream's f16 cache."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pykvq import KvConfig, Model
from pykvq.devtools import random_model

import device

N_CTX = 512
GEMMA4 = random_model.SHAPES["gemma4-small"]


def model_file(tmp_path_factory: pytest.TempPathFactory, name: str, shape: random_model.Shape) -> Path:
    path = tmp_path_factory.mktemp("shared-kv") / f"{name}.gguf"
    random_model.write(shape, path)
    return path


@pytest.fixture(scope="module")
def gemma4_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_file(tmp_path_factory, "gemma4-small", GEMMA4)


@pytest.fixture(scope="module", params=["gemma4-small", "gemma3n-small"])
def gemma4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, gemma4_path: Path):
    """A model with shared KV layers: Gemma 4's shape, and Gemma 3n's."""
    path = gemma4_path if request.param == "gemma4-small" else model_file(
        tmp_path_factory, request.param, random_model.SHAPES[request.param])
    with device.load_model(path) as model:
        yield model


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    assert random_model.SHAPES["gemma3n-small"].n_vocab == GEMMA4.n_vocab
    return [int(t) for t in np.random.default_rng(5).integers(300, GEMMA4.n_vocab, size=400)]


logits = functools.partial(device.all_logits, n_ctx=N_CTX)


@pytest.fixture(scope="module")
def f16_logits(gemma4: Model, tokens: list[int]) -> np.ndarray:
    return logits(gemma4, KvConfig(), tokens)


@pytest.mark.parametrize("type_swa", [None, "f16"], ids=["kivi-swa", "f16-swa"])
def test_a_window_covering_the_context_is_upstream_f16(gemma4: Model, tokens: list[int], f16_logits,
                                                       type_swa) -> None:
    """Everything in fp16: the reading layers see the batch and the cells their source layer stored, as upstream's
    f16 cache shows them (before, they read the source's batch after the graph allocator had reused its memory:
    mean |Δ| 2.6 logits)."""
    kivi = logits(gemma4, KvConfig("kivi2", "kivi2", window=N_CTX, type_swa=type_swa), tokens)
    upstream_noise = np.abs(logits(gemma4, KvConfig(), tokens, flash_attn="off") - f16_logits).mean()
    assert np.abs(kivi - f16_logits).mean() < 1.5 * upstream_noise < 0.1


def test_kivi_is_close_to_f16_where_the_sharing_reads_quantized_cells(gemma4: Model, tokens: list[int],
                                                                      f16_logits) -> None:
    errors = {name: np.abs(logits(gemma4, kv, tokens) - f16_logits).mean() for name, kv in {
        "kivi4": KvConfig.preset("kivi4", window=32), "kivi2": KvConfig.preset("kivi2", window=32),
        "q4_0": KvConfig.preset("q4_0")}.items()}
    assert errors["kivi4"] < errors["kivi2"] < 5 * errors["q4_0"]


@pytest.mark.parametrize("n_ubatch", [37, 1], ids=["ubatches", "token-by-token"])
def test_batching_does_not_change_logits(gemma4: Model, tokens: list[int], n_ubatch: int) -> None:
    """Over several ubatches the readers attend the source's fp16 ring before it takes the new batch: the source
    layer's ring write waits for the last reader (were it read after, the cells a window back would be the batch's)."""
    if n_ubatch == 1 and gemma4.path.name.startswith("gemma3n"):
        # not the cache: Gemma 3n's AltUp predictions (f32 matmuls) round differently for one token than for
        # several (2e-6 at layer 0, upstream's graph, seen with an eval callback); 2 tokens and more agree exactly
        pytest.skip("Gemma 3n's own graph is not batch-invariant at one token per ubatch")
    kv = KvConfig.preset("kivi2", window=32, sinks=4)
    feed = tokens if n_ubatch > 1 else tokens[:120]
    device.assert_same_logits(logits(gemma4, kv, feed, n_ubatch=n_ubatch), logits(gemma4, kv, feed))


def test_a_state_round_trip_continues_exactly(gemma4: Model, tokens: list[int]) -> None:
    config = device.context_config(n_ctx=N_CTX, n_batch=N_CTX, n_threads=2, flash_attn="on",
                                   kv=KvConfig.preset("kivi2", window=32, sinks=4))
    device.assert_state_continues(gemma4, config, tokens[:250], tokens[250:300])


@pytest.mark.parametrize("unified", [False, True], ids=["streams", "unified"])
def test_sequences_of_one_context_attend_as_alone(gemma4: Model, tokens: list[int], unified: bool) -> None:
    kv = KvConfig.preset("kivi2", window=32)
    a, b = tokens[:200], tokens[200:330]
    both = device.context_config(n_ctx=2 * N_CTX, n_batch=N_CTX, n_ubatch=64, n_threads=2, kv=kv, flash_attn="on",
                                 n_seq_max=2, kv_unified=unified)
    with gemma4.context(both) as ctx:
        got = ctx.eval_seqs({0: a, 1: b})
    for seq, feed in ((0, a), (1, b)):
        device.assert_same_logits(got[seq], logits(gemma4, kv, feed, n_ubatch=64)[-1])


def test_prompt_selection_reads_the_whole_prompt_in_every_reader(gemma4: Model, tokens: list[int]) -> None:
    """The global cache selects after its last reader has attended the whole prompt: keeping everything is plain
    kivi2 bit for bit, keeping half changes what follows."""
    def prompt_then_continuation(select) -> tuple[int, np.ndarray]:
        config = device.context_config(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=2,
                                       kv=KvConfig.preset("kivi2", select=select))
        with gemma4.context(config) as ctx:
            prompt = ctx.eval(tokens[:300], all_logits=True)
            return ctx.seq_cells(0), prompt, ctx.eval(tokens[300:], all_logits=True)

    plain, every, half = (prompt_then_continuation(select) for select in (None, (0.5, 0.5), (0.25, 0.25)))
    assert plain[0] == every[0] == 300 and half[0] == 150
    device.assert_same_logits(every[1], plain[1])
    device.assert_same_logits(every[2], plain[2])
    device.assert_same_logits(half[1], plain[1])
    assert not np.array_equal(half[2], plain[2])



def test_inspect_counts_the_layers_that_keep_kv_at_their_head_size(gemma4_path: Path) -> None:
    """From the header alone: the 3 sliding-window layers with KV of their own at head size 64, the global one at
    128, none for the 4 reading layers."""
    proc = subprocess.run([sys.executable, "-P", "-m", "pykvq", "inspect", "--json", str(gemma4_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    f16 = {c["kv_type"]: c["bytes_per_token"] for c in json.loads(proc.stdout)["kv_bytes"]}["f16"]
    assert f16 == 2 * 2 * GEMMA4.n_head_kv * (3 * 64 + 128)
    text = subprocess.run([sys.executable, "-P", "-m", "pykvq", "inspect", str(gemma4_path)], capture_output=True,
                          text=True, timeout=120).stdout
    assert "head size K 64/128 V 64/128, layers 4-7 read earlier layers' KV" in text
