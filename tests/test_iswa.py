"""kivi in upstream's iSWA cache (Gemma 2/3, gpt-oss, Cohere 2: sliding-window layers beside global ones), on
random-weight GGUFs of the families' real shapes (pykvq/devtools/random_model.py). Judged on the CPU build:
every comparison runs the same kernels with the same batch shapes, or checks against upstream's f16 cache."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pykvq import KvConfig, KvMemory, LlamaError, Model, gguf_metadata, llama_tools, paths
from pykvq.devtools import random_model
from pykvq.kv_types import bits_per_element

import device

N_CTX = 512
GEMMA3 = random_model.SHAPES["gemma3-small"]  # 6 layers: 0-4 sliding-window (96 tokens), 5 global


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("iswa") / "gemma3-small.gguf"
    random_model.write(GEMMA3, path)
    return path


@pytest.fixture(scope="module")
def gemma3(gemma3_path: Path):
    with device.load_model(gemma3_path) as model:
        yield model


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return [int(t) for t in np.random.default_rng(3).integers(300, GEMMA3.n_vocab, size=400)]


logits = functools.partial(device.all_logits, n_ctx=N_CTX)


@pytest.fixture(scope="module")
def f16_logits(gemma3: Model, tokens: list[int]) -> np.ndarray:
    return logits(gemma3, KvConfig(), tokens)


def test_a_window_covering_the_context_is_upstream_f16(gemma3: Model, tokens: list[int], f16_logits) -> None:
    """Everything in fp16: the sliding-window layers of a kivi cache see what upstream's f16 SWA cache shows them
    (a kivi SWA cache hides the tokens that left the window by the mask)."""
    kivi = logits(gemma3, KvConfig.preset("kivi2", window=N_CTX), tokens)
    # as close as upstream's own two attention paths over the same f16 cache are (logits' std here: ~10)
    upstream_noise = np.abs(logits(gemma3, KvConfig(), tokens, flash_attn="off") - f16_logits).max()
    assert np.abs(kivi - f16_logits).max() < 2 * upstream_noise < 0.5


def test_kivi_on_both_caches_is_close_to_f16(gemma3: Model, tokens: list[int], f16_logits) -> None:
    errors = {name: np.abs(logits(gemma3, kv, tokens) - f16_logits).mean() for name, kv in {
        "kivi4": KvConfig.preset("kivi4", window=32), "kivi2": KvConfig.preset("kivi2", window=32),
        "kivi2 + f16 SWA": KvConfig("kivi2", "kivi2", window=32, type_swa="f16"),
        "q4_0": KvConfig.preset("q4_0")}.items()}
    assert errors["kivi4"] < errors["kivi2"]
    # the global layer alone in 2 bits costs less than every layer in 2 bits
    assert errors["kivi2 + f16 SWA"] < errors["kivi2"]
    assert errors["kivi2"] < 5 * errors["q4_0"]


def test_batching_does_not_change_logits(gemma3: Model, tokens: list[int]) -> None:
    kv = KvConfig.preset("kivi2", window=32, sinks=4)
    device.assert_same_logits(logits(gemma3, kv, tokens), logits(gemma3, kv, tokens, n_ubatch=37))


def test_the_sliding_window_cache_takes_its_own_type(gemma3: Model) -> None:
    def memory(kv: KvConfig, swa_full: bool = False) -> KvMemory:
        config = device.context_config(n_ctx=2048, n_threads=2, kv=kv, flash_attn="on", swa_full=swa_full)
        with gemma3.context(config) as ctx:
            return ctx.memory()

    f16, f16_full = memory(KvConfig()), memory(KvConfig(), swa_full=True)
    kivi_all = memory(KvConfig.preset("kivi2", window=32))
    kivi_full = memory(KvConfig.preset("kivi2", window=32), swa_full=True)
    kivi_global = memory(KvConfig("kivi2", "kivi2", window=32, type_swa="f16"))
    # upstream's SWA cache holds the window and a ubatch (96 + 512, padded to 256 cells); a kivi one the window, a
    # ubatch and two rings of 32 cells (what a removal may need again, and what one drop frees at least)
    assert (f16.swa_n_cells, f16_full.swa_n_cells, kivi_all.swa_n_cells, kivi_full.swa_n_cells,
            kivi_global.swa_n_cells) == (768, 2048, 672, 2048, 768)
    assert kivi_all.bytes < f16.bytes / 3
    assert kivi_full.bytes < f16_full.bytes / 3
    # each layer counted at its own cache's cells: f16 is 16 bits per element, in either cache
    assert (f16.bits_per_element, f16.swa_bits_per_element, f16.global_bits_per_element) == (16.0, 16.0, 16.0)
    assert f16.ratio_to_f16 == 1.0
    # the f16 a kivi cache is compared with is upstream's, whose sliding-window cache holds other cells (it said
    # 0.28x on gemma-3-270m where the f16 cache allocated gave 0.33x)
    assert kivi_all.f16_bytes == kivi_global.f16_bytes == f16.bytes == f16.f16_bytes
    assert kivi_full.f16_bytes == f16_full.bytes
    assert kivi_all.global_bits_per_element == pytest.approx(bits_per_element("kivi2", 2048, 32, 0), rel=1e-3)
    assert kivi_all.swa_bits_per_element == pytest.approx(bits_per_element("kivi2", 672, 32, 0), rel=1e-3)
    # 5 sliding-window layers in f16 beside one kivi2 global layer
    assert kivi_global.swa_bytes == f16.swa_bytes
    assert kivi_global.bytes - kivi_global.swa_bytes == kivi_all.bytes - kivi_all.swa_bytes
    assert kivi_full.swa_bytes == pytest.approx(kivi_full.bytes * 5 / 6, rel=0.01)


@pytest.mark.parametrize(("args", "label", "cells", "bpe"), [
    (["--kv-type", "kivi2", "--kv-type-swa", "f16"], "f16", "768", "16.00"),
    # per-layer types apply to the layers of both caches (a model's kvq.kv_layers too): the label said "f16"
    (["--kv-layers", "k:*=kivi2;v:*=kivi1"], "per-layer types", "[0-9]+", "[0-9.]+"),
], ids=["swa-f16", "per-layer"])
def test_run_reports_each_cache(gemma3_path: Path, args: list[str], label: str, cells: str, bpe: str) -> None:
    proc = subprocess.run([sys.executable, "-P", "-m", "pykvq", "run", "-m", str(gemma3_path), "-p", "a b c d",
                           "-n", "4", "--temp", "0", "-t", "2", "-c", "1024", *args, *device.TOOL_ARGS],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reported = re.search(rf"of which the sliding-window layers' cache \({label}\): [0-9.]+ MiB for {cells} cells, "
                         rf"{bpe} bits per element; the global layers' [0-9.]+ MiB, [0-9.]+ bits per element",
                         proc.stderr)
    assert reported, proc.stderr[-2000:]
    # the headline named the global layers' types alone, for a cache mostly of the sliding-window layers'
    assert ("KV cache K kivi2, V kivi2, sliding-window layers f16 (" in proc.stderr) == ("--kv-type-swa" in args)


def test_state_round_trip_continues_exactly(gemma3: Model, tokens: list[int]) -> None:
    kv = KvConfig.preset("kivi2", window=32, sinks=4)
    config = device.context_config(n_ctx=N_CTX, n_batch=N_CTX, n_threads=2, kv=kv, flash_attn="on")
    device.assert_state_continues(gemma3, config, tokens[:250], tokens[250:300])


@pytest.mark.parametrize("type_swa", [None, "f16"], ids=["kivi-swa", "f16-swa"])
@pytest.mark.parametrize("part", [0.25, 0.5, 0.99])
def test_a_refused_state_leaves_neither_cache_half_restored(gemma3: Model, tokens: list[int], type_swa, part) -> None:
    """A state that ends inside the sliding-window cache's part: the global cache had restored its own, and the
    next evaluation read half the old context (silently other logits) while n_past said 0."""
    config = device.context_config(n_ctx=N_CTX, n_batch=N_CTX, n_threads=2, flash_attn="on",
                                   kv=KvConfig("kivi2", "kivi2", window=32, type_swa=type_swa))
    with gemma3.context(config) as first:
        first.eval(tokens[:250])
        state = first.save_state()
    with gemma3.context(config) as ctx, gemma3.context(config) as fresh:
        ctx.eval(tokens[:100])
        with pytest.raises(LlamaError, match="cannot load the state"):
            ctx.load_state(state[:int(len(state) * part)])
        assert ctx.n_past == 0
        device.assert_same_logits(ctx.eval(tokens[:60], all_logits=True), fresh.eval(tokens[:60], all_logits=True))


def test_an_unknown_sliding_window_type_is_refused(gemma3: Model) -> None:
    config = device.context_config(n_ctx=N_CTX, n_threads=2, kv=KvConfig(type_swa="kivi3"), flash_attn="on")
    with pytest.raises(ValueError, match="unknown KV cache type 'kivi3' for the sliding-window cache"):
        gemma3.context(config)


def test_the_tools_take_kv_type_swa(gemma3_path: Path, hamlet: Path, tmp_path: Path) -> None:
    # the tool tokenizes its whole file before its one chunk: the start of Hamlet is enough, and keeps the run
    # under the sanitizers (.ci/sanitizers) to seconds rather than minutes
    text = tmp_path / "hamlet-start.txt"
    text.write_text(hamlet.read_text()[:6000])
    args = ["-m", str(gemma3_path), "-f", str(text), "-c", "256", "--chunks", "1", "-t", "2", "-fa", "on",
            "-ctk", "kivi2", "-ctv", "kivi2", *device.TOOL_ARGS]
    whole = llama_tools.run_tool("llama-perplexity", [*args, "-lv", "4"])
    swa_f16 = llama_tools.run_tool("llama-perplexity", [*args, "-lv", "4", "--kv-type-swa", "f16"])
    assert "kivi sliding-window KV cache" in whole and "kivi sliding-window KV cache" not in swa_f16
    assert "kivi KV cache" in swa_f16  # the global layer's
    assert llama_tools.parse_perplexity(whole).ppl != llama_tools.parse_perplexity(swa_f16).ppl


# the attention options a family adds to the softmax, each at a value that bends this random model's attention
# and at one that leaves it alone: Gemma 2's logit soft-cap, gpt-oss's learned sink logit in every head (with every
# expert used: a router choosing 2 of 4 turns rounding into other experts, and upstream's own two attention paths
# apart)
OPTIONS = pytest.mark.parametrize(("shape", "option", "bending", "idle", "extra"),
                                  [("gemma2-small", "attn_softcap", 1.0, 1000.0, {}),
                                   ("gpt-oss-small", "attn_sink", 20.0, -30.0, {"n_expert_used": 4})],
                                  ids=["soft-cap", "learned-sinks"])


@OPTIONS
def test_the_family_s_attention_option_is_applied(shape: str, option: str, bending: float, idle: float, extra: dict,
                                                  tmp_path: Path, tokens: list[int]) -> None:
    """The kivi kernels soft-cap (cap*tanh(score/cap)) and add the sink logit as upstream's flash attention does:
    a kivi cache whose window covers the context gives upstream f16's logits, and the option is seen to matter."""
    def model(value: float) -> Model:
        path = tmp_path / f"{shape}-{value:g}.gguf"
        random_model.write(replace(random_model.SHAPES[shape], **{option: value}, **extra), path)
        return device.load_model(path)

    with model(bending) as bent, model(idle) as plain:
        f16 = logits(bent, KvConfig(), tokens)
        kivi = logits(bent, KvConfig.preset("kivi2", window=N_CTX), tokens)
        # how far upstream's own two attention paths over the same f16 cache are apart (on average: a few logits
        # of gpt-oss's random model move far)
        noise = np.abs(logits(bent, KvConfig(), tokens, flash_attn="off") - f16).mean()
        effect = np.abs(logits(plain, KvConfig(), tokens) - f16).mean()
        assert effect > 2.5 * noise
        # the option applied: as close to f16 as upstream's other path, where ignoring it would be `effect` away
        assert np.abs(kivi - f16).mean() < 1.5 * noise


@OPTIONS
def test_prompt_selection_with_the_option_is_refused(shape: str, option: str, bending: float, idle: float, extra: dict,
                                                     tmp_path: Path) -> None:
    """MiniKV's scores are not soft-capped and take no sink: selection is refused rather than scored wrongly."""
    path = tmp_path / f"{shape}.gguf"
    random_model.write(random_model.SHAPES[shape], path)
    with device.load_model(path) as model:
        config = device.context_config(n_ctx=256, n_threads=2, kv=KvConfig.preset("kivi2", select=(0.25, 0.25)),
                                       flash_attn="on")
        with pytest.raises(LlamaError, match=r"selection \(--kv-select\) scores .* without the model's"):
            model.context(config)


@pytest.mark.parametrize("type_swa", [None, "f16"], ids=["kivi-swa", "f16-swa"])
def test_a_refused_removal_leaves_both_caches_as_they_were(gemma3: Model, tokens: list[int], type_swa) -> None:
    """The global kivi cache refuses a removal past its window's slack; the sliding-window cache must not make it
    alone (it did: the two then held different tokens). An accepted one continues as a fresh context would."""
    kv = KvConfig("kivi2", "kivi2", window=32, type_swa=type_swa)
    config = device.context_config(n_ctx=N_CTX, n_batch=N_CTX, n_threads=2, kv=kv, flash_attn="on")
    with gemma3.context(config) as ctx, gemma3.context(config) as twin:
        ctx.eval(tokens[:300])
        twin.eval(tokens[:299])
        with pytest.raises(LlamaError, match="cannot remove"):
            ctx.truncate(100)
        ctx.truncate(299)
        device.assert_same_logits(ctx.eval(tokens[299:340], all_logits=True),
                                      twin.eval(tokens[299:340], all_logits=True))


@pytest.mark.parametrize("dither", [None, "1"], ids=["nearest", "dithered"])
@pytest.mark.parametrize("n_ubatch", [512, 32], ids=["whole", "dropping"])
@pytest.mark.parametrize("unified", [False, True], ids=["streams", "unified"])
def test_sequences_of_one_context_attend_as_alone(gemma3: Model, tokens: list[int], unified: bool,
                                                  n_ubatch: int, dither: str | None) -> None:
    """Two sequences in the same batches (a unified kivi iSWA cache aborted on them: its batches were not split
    per sequence); with small ubatches each sequence's part drops cells on its own. Dithered, a token's V draw
    follows its cell in its part modulo the ring, whatever the part's size and however it dropped."""
    kv = KvConfig("kivi2", "kivi2", window=32, dither=dither)
    a, b = tokens[:200], tokens[200:330]
    both = device.context_config(n_ctx=2 * N_CTX, n_batch=N_CTX, n_ubatch=n_ubatch, n_threads=2, kv=kv,
                                 flash_attn="on", n_seq_max=2, kv_unified=unified)
    with gemma3.context(both) as ctx:
        got = ctx.eval_seqs({0: a, 1: b})
        assert ctx.memory().swa_n_cells == 2 * (512 if n_ubatch == 512 else 192)
    for seq, feed in ((0, a), (1, b)):
        device.assert_same_logits(got[seq], logits(gemma3, kv, feed, n_ubatch=n_ubatch)[-1])


def test_llama_cpp_python_takes_kv_type_swa(gemma3_path: Path, gemma3: Model, tokens: list[int]) -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (.ci/run installs it)")
    import pykvq
    from pykvq.llama_cpp import Llama
    llm = Llama(model_path=str(gemma3_path), n_ctx=N_CTX, n_batch=N_CTX, n_threads=2, verbose=False,
                logits_all=True, type_k=pykvq.GGML_TYPE_KIVI2, type_v=pykvq.GGML_TYPE_KIVI2, kv_window=32,
                kv_type_swa="f16", **device.LLAMA_KWARGS)
    try:
        llm.eval(tokens[:100])
        ours = logits(gemma3, KvConfig("kivi2", "kivi2", window=32, type_swa="f16"), tokens[:100])
        device.assert_same_logits(np.asarray(llm.scores[:100]), ours)
    finally:
        llm.close()


def test_a_quantized_sliding_window_cache_is_read_through_flash_attention(gemma3_path: Path, gemma3: Model,
                                                                          tokens: list[int], hamlet: Path,
                                                                          tmp_path: Path) -> None:
    """A q8_0 sliding-window cache beside f16 global layers, flash attention off: llama.cpp checked the context's V
    type alone and read the q8_0 V transposed, as garbage (llama-cpp-python's default flash_attn=False got there
    without another argument)."""
    kv = KvConfig(type_swa="q8_0")
    on = logits(gemma3, kv, tokens[:100], flash_attn="on")
    device.assert_same_logits(logits(gemma3, kv, tokens[:100], flash_attn="auto"), on)
    with pytest.raises(LlamaError, match=r"the sliding-window cache's quantized V \(type_swa q8_0\) is read by flash "
                                         r"attention only: use -fa on"):
        logits(gemma3, kv, tokens[:100], flash_attn="off")
    text = tmp_path / "hamlet-start.txt"
    text.write_text(hamlet.read_text()[:6000])
    proc = subprocess.run([str(paths.tool("llama-perplexity")), "-m", str(gemma3_path), "-f", str(text), "-c", "256",
                           "--chunks", "1", "-t", "2", "-fa", "off", "--kv-type-swa", "q8_0", *device.TOOL_ARGS],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.returncode
    assert "KV cache layer 0 q8_0/q8_0: a quantized V cache needs flash attention (-fa on)" in proc.stderr
    if importlib.util.find_spec("llama_cpp") is not None:
        from pykvq.llama_cpp import Llama
        llm = Llama(model_path=str(gemma3_path), n_ctx=N_CTX, n_batch=N_CTX, n_threads=2, verbose=False,
                    logits_all=True, kv_type_swa="q8_0", **device.LLAMA_KWARGS)
        try:
            llm.eval(tokens[:100])
            device.assert_same_logits(np.asarray(llm.scores[:100]), on)
        finally:
            llm.close()


def test_kv_type_swa_beside_per_layer_types_is_refused(gemma3: Model) -> None:
    """The per-layer types name the sliding-window layers' types too: --kv-type-swa was dropped without a word,
    and llama.cpp's log named its type for a cache of the per-layer ones."""
    kv = KvConfig("kivi2", "kivi2", window=32, layers="k:*=kivi2;v:*=kivi2", type_swa="q8_0")
    with pytest.raises(LlamaError, match=r"--kv-layers gives the sliding-window layers their types, which "
                                         r"--kv-type-swa q8_0/q8_0 would not change"):
        gemma3.context(device.context_config(n_ctx=N_CTX, n_threads=2, kv=kv, flash_attn="on"))


def pykvq_perplexity(model: Path, text: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "pykvq", "perplexity", "-m", str(model), "-f", str(text),
                           "-c", "128", "--chunks", "1", "-t", "2", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_perplexity_refuses_kv_type_swa_beside_per_layer_rows_before_any_run(gemma3_path: Path, hamlet: Path,
                                                                              tmp_path: Path) -> None:
    """The per-layer row failed after the rows before it had run."""
    proc = pykvq_perplexity(gemma3_path, hamlet, tmp_path, "--kv-types", "f16,kivi2,asymkv:2/0",
                            "--kv-type-swa", "q8_0")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert ("pykvq: error: --kv-type-swa q8_0 beside per-layer types (asymkv:2/0): those give the sliding-window "
            "layers their types") in proc.stderr, proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_perplexity_leaves_the_model_s_mix_out_under_kv_type_swa(gemma3_path: Path, hamlet: Path,
                                                                 tmp_path: Path) -> None:
    calibrated = tmp_path / "calibrated.gguf"
    gguf_metadata.write_copy(gemma3_path, calibrated, {gguf_metadata.KEY_LAYERS: "k:*=kivi2;v:*=kivi1"})
    out = tmp_path / "run"
    proc = pykvq_perplexity(calibrated, hamlet, tmp_path, "--kv-types", "kivi2", "--kv-type-swa", "q8_0",
                            "-o", str(out), *device.TOOL_ARGS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the model's kvq.kv_layers is left out of the comparison" in proc.stderr
    runs = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert [r["kv_type"] for r in runs] == ["kivi2"] and runs[0]["failure"] is None


def test_perplexity_says_kv_type_swa_changes_nothing_without_sliding_window_layers(smollm2: Path, hamlet: Path,
                                                                                    tmp_path: Path) -> None:
    proc = pykvq_perplexity(smollm2, hamlet, tmp_path, "--kv-types", "q8_0", "--kv-type-swa", "q4_0",
                            "-o", str(tmp_path / "run"), *device.TOOL_ARGS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"--kv-type-swa q4_0 changes nothing: {smollm2.name} has no sliding-window layers" in proc.stderr


def test_per_layer_types_address_the_layers_of_both_caches(gemma3: Model, tokens: list[int]) -> None:
    """Layers 0-4 are the sliding-window ones, 5 the global one: a per-layer spec saying so is the same cache as
    --kv-type-swa, bit for bit and byte for byte."""
    by_layers = KvConfig("kivi2", "kivi2", window=32, layers="k:0-4=q8_0,5=kivi2;v:0-4=q8_0,5=kivi2")
    by_swa_type = KvConfig("kivi2", "kivi2", window=32, type_swa="q8_0")
    device.assert_same_logits(logits(gemma3, by_layers, tokens), logits(gemma3, by_swa_type, tokens))
    memory = {}
    for name, kv in (("layers", by_layers), ("swa type", by_swa_type)):
        with gemma3.context(device.context_config(n_ctx=2048, n_threads=2, kv=kv, flash_attn="on")) as ctx:
            memory[name] = ctx.memory()
    # an upstream type on every sliding-window layer: a window-sized cache
    assert memory["layers"] == memory["swa type"] and memory["layers"].swa_n_cells == 768


def test_a_refused_copy_is_made_in_neither_cache(gemma3: Model, tokens: list[int]) -> None:
    """A unified cache: the kivi global cache copies a sequence from its first token only; the f16 sliding-window
    cache made the partial copy alone, and sequence 1 then saw tokens the global layers did not."""
    kv = KvConfig("kivi2", "kivi2", window=32, type_swa="f16")
    config = device.context_config(n_ctx=2 * N_CTX, n_batch=N_CTX, n_threads=2, kv=kv, flash_attn="on",
                                   n_seq_max=2, kv_unified=True)
    with gemma3.context(config) as ctx:
        ctx.eval_seqs({0: tokens[:200]})
        with pytest.raises(LlamaError, match="kivi types copy a sequence from its first token"):
            ctx.seq_cp(0, 1, 50, -1)
        assert ctx.seq_len(1) == 0
        got = ctx.eval_seqs({1: tokens[200:260]})[1]
    device.assert_same_logits(got, logits(gemma3, kv, tokens[200:260])[-1])


@pytest.mark.parametrize("type_swa", [None, "f16"], ids=["kivi-swa", "f16-swa"])
def test_a_sequence_state_round_trip_continues_exactly(gemma3: Model, tokens: list[int], type_swa) -> None:
    """Upstream saves a sliding-window sequence without its out-of-window cells; a kivi cache keeps and saves every
    token (its per-sequence saves were refused as partial)."""
    kv = KvConfig("kivi2", "kivi2", window=32, type_swa=type_swa)
    config = device.context_config(n_ctx=2 * N_CTX, n_batch=N_CTX, n_threads=2, kv=kv, flash_attn="on", n_seq_max=2)
    with gemma3.context(config) as ctx, gemma3.context(config) as other:
        ctx.eval_seqs({0: tokens[:250]})
        state = ctx.save_seq_state(0)
        other.load_seq_state(state, 1)
        device.assert_same_logits(other.eval_seqs({1: tokens[250:280]})[1], ctx.eval_seqs({0: tokens[250:280]})[0])


def test_inspect_says_the_model_has_sliding_window_layers(gemma3_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-P", "-m", "pykvq", "inspect", str(gemma3_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "this model has sliding-window layers (window 96)" in proc.stdout


# ubatches of 32: the sliding-window cache's parts hold 96 + 32 + two rings of 32 = 192 cells of a 512-token context
DROPPING = dict(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=32, n_threads=2, flash_attn="on")


@pytest.mark.parametrize("rollback", [0, 40])
def test_cells_that_leave_the_window_are_dropped_exactly(gemma3: Model, tokens: list[int], rollback: int) -> None:
    """A kivi sliding-window cache holds the window, not the context: whole rings of cells that left it move out
    at the front of the part. Its logits are those of a full-size cache (--swa-full), prefill and decode alike."""
    kv = KvConfig.preset("kivi2", window=32, rollback=rollback)
    got = {}
    for swa_full in (False, True):
        with gemma3.context(device.context_config(kv=kv, swa_full=swa_full, **DROPPING)) as ctx:
            prefill = ctx.eval(tokens[:300], all_logits=True)
            decode = [ctx.eval([t]) for t in tokens[300:340]]
            got[swa_full] = (prefill, np.stack(decode), ctx.memory())
    device.assert_same_logits(got[False][0], got[True][0])
    device.assert_same_logits(got[False][1], got[True][1])
    assert (got[False][2].swa_n_cells, got[True][2].swa_n_cells) == (192 if rollback == 0 else 320, N_CTX)


def test_a_dithered_window_keeps_each_token_s_codes_through_its_drops(gemma3: Model, tokens: list[int]) -> None:
    """V's dither in a sliding-window cache draws by the cell modulo the ring, which a drop keeps: the cache that
    drops is --swa-full's, and the ubatch size that decides when cells drop changes nothing (keyed by the cell in
    the part, the tokens after the first drop took other codes)."""
    def run(dither: str | None, swa_full: bool, n_ubatch: int) -> np.ndarray:
        kv = KvConfig("kivi2", "kivi2", window=32, dither=dither)
        config = device.context_config(kv=kv, swa_full=swa_full, **{**DROPPING, "n_ubatch": n_ubatch})
        with gemma3.context(config) as ctx:
            prefill = ctx.eval(tokens[:300], all_logits=True)
            return np.concatenate([prefill, np.stack([ctx.eval([t]) for t in tokens[300:340]])])

    dropping = run("1", False, 32)
    device.assert_same_logits(dropping, run("1", True, 32))
    device.assert_same_logits(dropping, run("1", False, 48))
    assert not np.array_equal(dropping, run(None, False, 32))


@pytest.mark.parametrize(("rollback", "n_removed"), [(0, 1), (40, 38)])
def test_a_removal_after_drops_continues_exactly(gemma3: Model, tokens: list[int], rollback: int,
                                                 n_removed: int) -> None:
    """The deepest removal the window allows (one token with window 32 and no --kv-rollback; N more with
    --kv-rollback N): the cells the re-fed tokens attend again were not dropped."""
    kv = KvConfig.preset("kivi2", window=32, rollback=rollback)
    config = device.context_config(kv=kv, **DROPPING)
    kept = 300 - n_removed
    with gemma3.context(config) as ctx, gemma3.context(config) as twin:
        ctx.eval(tokens[:300])
        twin.eval(tokens[:kept])
        ctx.truncate(kept)
        device.assert_same_logits(ctx.eval(tokens[kept:300], all_logits=True),
                                      twin.eval(tokens[kept:300], all_logits=True))
        with pytest.raises(LlamaError, match="cannot remove"):
            ctx.truncate(200)
        assert ctx.n_past == 300


@pytest.mark.parametrize("unified", [False, True], ids=["streams", "unified"])
def test_a_state_saved_after_drops_continues_exactly(gemma3: Model, tokens: list[int], unified: bool) -> None:
    kv = KvConfig.preset("kivi2", window=32)
    config = device.context_config(kv=kv, n_seq_max=2, kv_unified=unified, **{**DROPPING, "n_ctx": 2 * N_CTX})
    with gemma3.context(config) as first, gemma3.context(config) as second, gemma3.context(config) as third:
        first.eval_seqs({0: tokens[:300], 1: tokens[100:250]})
        second.load_state(first.save_state())
        third.load_seq_state(first.save_seq_state(0), 1)
        want = first.eval_seqs({0: tokens[300:330]})[0]
        device.assert_same_logits(second.eval_seqs({0: tokens[300:330]})[0], want)
        device.assert_same_logits(third.eval_seqs({1: tokens[300:330]})[1], want)


def test_a_removal_reaching_past_the_dropped_cells_is_refused(gemma3: Model, tokens: list[int]) -> None:
    """The global layers in f16 (which remove anything) and the sliding-window ones in kivi2: removing positions
    100 and on emptied the kivi cache, whose cells all lay past 100 after drops, while the global one kept 0-99;
    the next token then attended a window of nothing. Refused in both caches now; a whole clear still works."""
    kv = KvConfig("f16", "f16", window=32, type_swa="kivi2")
    with gemma3.context(device.context_config(kv=kv, **DROPPING)) as ctx, \
            gemma3.context(device.context_config(kv=kv, **DROPPING)) as twin:
        ctx.eval(tokens[:300])
        twin.eval(tokens[:300])
        with pytest.raises(LlamaError, match="left the window and were dropped"):
            ctx.truncate(100)
        assert ctx.n_past == 300
        device.assert_same_logits(ctx.eval(tokens[300:310], all_logits=True),
                                      twin.eval(tokens[300:310], all_logits=True))
        ctx.truncate(0)
        assert ctx.n_past == 0


def test_prompt_selection_keeps_its_share_of_the_global_cache(gemma3: Model, tokens: list[int]) -> None:
    # the global layers select (the sliding-window ones forget on their own); the cells held are the global
    # cache's, not the positions the sliding-window cache still has
    def prompt_then_continuation(select) -> tuple[int, np.ndarray]:
        config = device.context_config(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=2,
                                       kv=KvConfig.preset("kivi2", select=select))
        with gemma3.context(config) as ctx:
            ctx.eval(tokens[:300])
            return ctx.seq_cells(0), ctx.eval(tokens[300:], all_logits=True)

    plain, every, half = (prompt_then_continuation(select) for select in (None, (0.5, 0.5), (0.25, 0.25)))
    assert plain[0] == every[0] == 300 and half[0] == 150
    device.assert_same_logits(every[1], plain[1])
    assert not np.array_equal(half[1], plain[1])


@pytest.mark.slow
def test_the_real_gemma3_answers_as_f16_does_while_its_prompt_is_in_the_window(gemma3_270m: Path) -> None:
    """Gemma 3 270M (15 of 18 layers sliding-window, head size 256: a real iSWA model, fetched once):
    `pykvq run` with kivi2 in both caches, and with q8_0 in the sliding-window one, greedy over a prompt and answer
    that stay within the fp16 window, writes f16's text, and reports each cache's memory."""
    model = gemma3_270m
    texts, reports = {}, {}
    for label, args in {"f16": [], "kivi2": ["--kv-type", "kivi2"],
                        "kivi2, SWA q8_0": ["--kv-type", "kivi2", "--kv-type-swa", "q8_0"]}.items():
        proc = subprocess.run(["pykvq", "run", *device.TOOL_ARGS, "-m", str(model), "-p", "The capital of France is",
                               "-n", "12", "--temp", "0", "--ignore-eos", "-t", "2", "-c", "2048", *args],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        texts[label], reports[label] = proc.stdout, proc.stderr
    assert texts["kivi2"] == texts["f16"] and texts["kivi2, SWA q8_0"] == texts["f16"]
    assert "the sliding-window layers' cache (kivi2)" in reports["kivi2"]
    assert "the sliding-window layers' cache (q8_0)" in reports["kivi2, SWA q8_0"]


# Llama 4's chunked attention: llama.cpp's chunks are 8192 tokens, fixed, so these contexts cross one
LLAMA4_CHUNK = 8192
LLAMA4_CTX = LLAMA4_CHUNK + 1024
LLAMA4_PROMPT = LLAMA4_CHUNK + 600
LLAMA4_TOKENS = LLAMA4_PROMPT + 40


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory):
    with device.load_random_model(tmp_path_factory.mktemp("llama4"), "llama4-small") as model:
        yield model


def llama4_run(model: Model, kv: KvConfig, swa_full: bool = False, flash_attn: str = "on") -> tuple[np.ndarray, int]:
    """The prompt's logits, then 40 decoded tokens': across the first chunk's end, in ubatches of 512; and the
    cells of the chunked layers' cache."""
    tokens = [int(t) for t in np.random.default_rng(4).integers(300, 2048, size=LLAMA4_TOKENS)]
    config = device.context_config(kv=kv, swa_full=swa_full, n_ctx=LLAMA4_CTX, n_batch=LLAMA4_CTX, n_ubatch=512,
                                   n_threads=2, flash_attn=flash_attn)
    with model.context(config) as ctx:
        prompt = ctx.eval(tokens[:LLAMA4_PROMPT], all_logits=True)
        decoded = np.stack([ctx.eval([t]) for t in tokens[LLAMA4_PROMPT:]])
        return np.concatenate([prompt, decoded]), ctx.memory().swa_n_cells


def llama4_logits(model: Model, kv: KvConfig, flash_attn: str = "on") -> np.ndarray:
    return llama4_run(model, kv, flash_attn=flash_attn)[0]


@pytest.mark.slow  # 9000-token contexts: 20 s, 3 minutes under the sanitizers
def test_llama4_s_chunks_are_read_as_upstream_f16_reads_them(llama4: Model) -> None:
    """A token past a chunk's end attends only its own chunk in the chunked layers: a kivi cache whose window
    covers the context gives upstream f16's logits there, as close as upstream's own two attention paths."""
    f16 = llama4_logits(llama4, KvConfig())
    upstream_noise = np.abs(llama4_logits(llama4, KvConfig(), flash_attn="off") - f16)[LLAMA4_CHUNK:].max()
    kivi = llama4_logits(llama4, KvConfig.preset("kivi2", window=LLAMA4_CTX))
    assert np.abs(kivi - f16)[LLAMA4_CHUNK:].max() < 1.5 * upstream_noise < 0.5


@pytest.mark.slow  # 9000-token contexts: 20 s, 3 minutes under the sanitizers
def test_llama4_s_chunked_cache_drops_exactly(llama4: Model) -> None:
    """The chunked layers' kivi cache holds a chunk, a ubatch and two rings, fewer cells than the tokens fed: the
    cells of the chunk that ended leave it, and its logits are those of a full-size cache (--swa-full), prompt and
    decode."""
    kv = KvConfig.preset("kivi2", window=32)
    (dropping, n_cells), (full, _) = llama4_run(llama4, kv), llama4_run(llama4, kv, swa_full=True)
    assert n_cells == LLAMA4_CHUNK + 512 + 2 * 32 < LLAMA4_TOKENS
    device.assert_same_logits(dropping, full)
