"""Multi-head latent attention (DeepSeek V2/V3-style models, llama.cpp's deepseek2 architecture; Mistral 4's, which
runs deepseek2's graph with an attention temperature; Kimi Linear's hybrid, latent attention in 1 layer of 4 and delta
attention, a recurrent state, in the others; Ling 3's bailingmoe3, the same hybrid with a gate per head on the latent
attention's output) on kivi caches, on random-weight GGUFs of their shapes
(pykvq/devtools/random_model.py): the cache keeps one row per token, the latent and
its RoPE part, as upstream's does; the kivi attention reads V, the latent, from K's tiles and fp16 cells
(ggml_kvq_attn_latent: tests/test_kvq_latent.py holds the op, CPU and emulated CUDA kernels, against its oracle), so
nothing is stored twice. Judged on the suite's device: every comparison runs the same kernels with the same batch
shapes, or checks against upstream's f16 cache. Every cache operation on an RPC device: tests/test_rpc.py."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

import pykvq
from pykvq import KvConfig, LlamaError, Model, Sampler, SamplerSettings, gguf_metadata
from pykvq.api.capture import AttentionCapture
from pykvq.bindings import native
from pykvq.calibration import attention_scale, clip_ratios
from pykvq.devtools import random_model

import device

# deepseek2: a 128-wide latent and 32 RoPE channels; mistral4: 256 and 64, Q scaled with the position; kimi-linear: 128
# and 32 unrotated, in its one attention layer of 4; bailingmoe3: 128 and 32 rotated, in its one gated attention layer
# of 4; 4 query heads
SHAPES = ["deepseek2-mla-small", "mistral4-mla-small", "kimi-linear-small", "bailingmoe3-small"]
N_CTX = 512
N_VOCAB = 2048


@pytest.fixture(scope="module", params=SHAPES)
def shape(request: pytest.FixtureRequest) -> random_model.Shape:
    return random_model.SHAPES[request.param]


@pytest.fixture(scope="module")
def mla_path(tmp_path_factory: pytest.TempPathFactory, shape: random_model.Shape) -> Path:
    path = tmp_path_factory.mktemp("latent") / f"{shape.arch}-mla-small.gguf"
    random_model.write(shape, path)
    return path


def row(shape: random_model.Shape) -> int:
    """What the cache keeps of a token in each attention layer: the latent and its RoPE part."""
    return shape.kv_lora_rank + shape.rope_dim


def n_cached_layers(shape: random_model.Shape) -> int:
    """The layers the cache holds (a hybrid's recurrent ones keep a state instead)."""
    return sum(not shape.is_recurrent(il) for il in range(shape.n_layer))


@pytest.fixture(scope="module")
def mla(mla_path: Path):
    with device.load_model(mla_path) as model:
        yield model


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return [int(t) for t in np.random.default_rng(3).integers(300, N_VOCAB, size=400)]


config = functools.partial(device.context_config, n_threads=2, flash_attn="on")


def logits(model: Model, kv: KvConfig, tokens: list[int], n_ubatch: int = N_CTX, flash_attn: str = "on") -> np.ndarray:
    with model.context(config(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=n_ubatch, kv=kv, flash_attn=flash_attn)) as ctx:
        return ctx.eval(tokens, all_logits=True)


@pytest.fixture(scope="module")
def f16_logits(mla: Model, tokens: list[int]) -> np.ndarray:
    return logits(mla, KvConfig(), tokens)


def test_a_window_covering_the_context_is_upstream_f16(mla: Model, tokens: list[int], f16_logits) -> None:
    """Everything in fp16: V read from K's fp16 cells is upstream's V, a view of its K cache."""
    kivi = logits(mla, KvConfig.preset("kivi2", window=N_CTX), tokens)
    # as close as upstream's own two attention paths over the same f16 cache are (1.4 here, where logits' std is 12)
    upstream_noise = np.abs(logits(mla, KvConfig(), tokens, flash_attn="off") - f16_logits).max()
    assert np.abs(kivi - f16_logits).max() < 2 * upstream_noise < 0.5 * f16_logits.std()


def test_kivi_is_close_to_f16_by_its_width(mla: Model, tokens: list[int], f16_logits) -> None:
    """More bits, closer to f16; kivi4 closer than q4_0. Measured, mean |Δlogit| (random weights, logits' std 12-14):
    deepseek2 kivi4 3.1, q4_0 4.2, kivi2 8.6, kivi1 11.3; bailingmoe3, whose one latent layer's output its gate halves,
    kivi4 0.009, kivi2 0.017, q4_0 0.025, kivi1 0.037 (where q4_0 and kivi2 fall is the model's, not the cache's)."""
    errors = {name: np.abs(logits(mla, KvConfig.preset(name, window=32), tokens) - f16_logits).mean()
              for name in ("kivi4", "kivi2", "kivi1", "q4_0")}
    assert errors["kivi4"] < min(errors["q4_0"], errors["kivi2"])
    assert errors["kivi2"] < errors["kivi1"] < 3 * errors["kivi2"]


def test_batching_does_not_change_logits(mla: Model, tokens: list[int]) -> None:
    kv = KvConfig.preset("kivi2", window=32, sinks=4)
    device.assert_same_logits(logits(mla, kv, tokens), logits(mla, kv, tokens, n_ubatch=37))


def test_the_cache_holds_k_alone(mla: Model, shape: random_model.Shape) -> None:
    """kivi2 keeps the row once: 2-bit codes and a scale and minimum per 32 (3 bits), plus the fp16 window of 128 of
    2048 cells (1 bit): 4 bits per element, where q4_0 takes 4.5 and a second, per-token copy of the latent as V
    would take 3 more."""
    def memory(kv: KvConfig):
        with mla.context(config(n_ctx=2048, kv=kv)) as ctx:
            return ctx.memory()
    kivi2, q4_0 = memory(KvConfig.preset("kivi2")), memory(KvConfig.preset("q4_0"))
    assert kivi2.n_elements == q4_0.n_elements == 2048 * n_cached_layers(shape) * row(shape)
    assert kivi2.bits_per_element == pytest.approx(4.0)
    assert kivi2.bytes < q4_0.bytes


def test_state_round_trip_continues_exactly(mla: Model, tokens: list[int]) -> None:
    kv = KvConfig.preset("kivi2", window=32, sinks=4)
    device.assert_state_continues(mla, config(n_ctx=N_CTX, n_batch=N_CTX, kv=kv), tokens[:300], tokens[300:340])


def test_a_removed_suffix_continues_as_if_never_fed(mla: Model, shape: random_model.Shape, tokens: list[int]) -> None:
    """Five draft tokens fed and removed (--kv-rollback keeps them removable), then the accepted one: the logits of
    a context that never saw the drafts."""
    if any(shape.is_recurrent(il) for il in range(shape.n_layer)):
        pytest.skip("a hybrid's recurrent state cannot drop tokens (upstream's memory refuses the removal)")
    kv = KvConfig.preset("kivi2", window=32, rollback=8)
    with mla.context(config(n_ctx=N_CTX, n_batch=N_CTX, kv=kv)) as plain, \
            mla.context(config(n_ctx=N_CTX, n_batch=N_CTX, kv=kv)) as drafted:
        plain.eval(tokens[:200])
        want = plain.eval(tokens[200:201])
        drafted.eval(tokens[:200])
        drafted.eval(tokens[300:305])
        drafted.truncate(200)
        device.assert_same_logits(drafted.eval(tokens[200:201]), want)


@pytest.mark.parametrize("unified", [False, True], ids=["streams", "unified"])
def test_sequences_of_one_context_attend_as_alone(mla: Model, tokens: list[int], unified: bool) -> None:
    kv = KvConfig.preset("kivi2", window=32)
    a, b = tokens[:200], tokens[200:330]
    both = config(n_ctx=2 * N_CTX, n_batch=N_CTX, kv=kv, n_seq_max=2, kv_unified=unified)
    with mla.context(both) as ctx:
        got = ctx.eval_seqs({0: a, 1: b})
    for seq, feed in ((0, a), (1, b)):
        device.assert_same_logits(got[seq], logits(mla, kv, feed)[-1])


@pytest.mark.parametrize(("settings", "what"), [
    ({"rotate": "on"}, "Hadamard rotation"),
    ({"dither": "0.5"}, "dithered rounding"),
    ({"clip": "v:*=0.9"}, "V clip ratio"),
    ({"select": (0.25, 0.25)}, "prompt selection"),
])
def test_what_a_latent_layer_cannot_take_is_refused(mla: Model, settings: dict, what: str) -> None:
    """Each would be ignored: the latent path has no rotation, and no V rows to round, clip or select."""
    with pytest.raises(LlamaError, match=rf"{what}.* a multi-head latent attention layer holds no V of its own"), \
            mla.context(config(n_ctx=N_CTX, kv=KvConfig.preset("kivi2", **settings))):
        pass


@pytest.mark.parametrize("command", ["run", "perplexity"])
@pytest.mark.parametrize(("flags", "buffer"), [([], r"RPC\S*"), (["-nkvo"], "CPU")], ids=["offloaded", "nkvo"])
def test_no_kv_offload_keeps_the_cache_in_host_memory(rpc_server: str, mla_path: Path, hamlet: Path, cpu_only: None,
                                                      tmp_path: Path, command: str, flags: list[str],
                                                      buffer: str) -> None:
    """llama.cpp's -nkvo, in pykvq's commands: the layers on the device, the KV cache (and its attention) on the
    host."""
    task = {"run": ["--kv-type", "kivi2", "-c", "256", "-p", "<t7>", "-n", "4"],
            "perplexity": ["--kv-types", "kivi2", "-f", str(hamlet), "-c", "128", "--chunks", "1", "-o",
                           str(tmp_path / "ppl")]}[command]
    proc = subprocess.run(["pykvq", "-v", command, "--rpc", rpc_server, "-ngl", "99", *flags, "-t", "2", "-m",
                           str(mla_path), *task], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(rf"llama_kv_cache: +{buffer} KV buffer size", proc.stderr), proc.stderr[-3000:]


def test_pykvq_run_reports_the_row_it_keeps(mla_path: Path) -> None:
    proc = subprocess.run(["pykvq", "run", *device.TOOL_ARGS, "-t", "2", "-m", str(mla_path), "--kv-type",
                           "kivi2", "-c", "2048", "-p", "<t7>", "-n", "4"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "4.00 bits per element" in proc.stderr


def test_llama_cpp_python_generates_what_pykvq_does(mla: Model, mla_path: Path, tokens: list[int]) -> None:
    """llama-cpp-python on pykvq's libllama (pykvq.llama_cpp): the same greedy tokens over a kivi2 latent cache."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (.ci/run installs it)")
    from pykvq.llama_cpp import Llama
    llm = Llama(model_path=str(mla_path), n_ctx=N_CTX, n_threads=2, verbose=False, type_k=pykvq.GGML_TYPE_KIVI2,
                type_v=pykvq.GGML_TYPE_KIVI2, kv_window=32, **device.LLAMA_KWARGS)
    try:
        theirs = list(itertools.islice(llm.generate(tokens[:100], temp=0), 24))
    finally:
        llm.close()
    kv = KvConfig.preset("kivi2", window=32)
    with mla.context(config(n_ctx=N_CTX, kv=kv)) as ctx:
        assert theirs == list(ctx.generate_tokens(tokens[:100], 24, Sampler(SamplerSettings(temp=0))))


@pytest.mark.parametrize(("kv_type", "bits"), [("f16", 16.0), ("q8_0", 8.5)])
def test_upstream_types_count_one_row_per_token(mla: Model, shape: random_model.Shape, kv_type: str,
                                                bits: float) -> None:
    """The cache holds K's rows alone (the latent and its RoPE part): f16 against f16 is 1.00x (it said 0.56x,
    counting V rows that do not exist)."""
    with mla.context(config(n_ctx=256, kv=KvConfig.preset(kv_type))) as ctx:
        assert ctx.eval(mla.tokenize("<t7> <t8> <t9>")).shape == (N_VOCAB,)
        memory = ctx.memory()
    assert memory.n_elements == 256 * n_cached_layers(shape) * row(shape)
    assert memory.bits_per_element == pytest.approx(bits)


def test_inspect_counts_one_row_per_token(mla: Model) -> None:
    proc = subprocess.run(["pykvq", "inspect", "--json", str(mla.path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    costs = {c["kv_type"]: c for c in info["kv_bytes"]}
    with mla.context(config(n_ctx=256, kv=KvConfig())) as ctx:
        assert costs["f16"]["bytes_per_token"] * 256 == ctx.memory().bytes
    with mla.context(config(n_ctx=2048, kv=KvConfig.preset("kivi2"))) as ctx:
        kivi2 = costs["kivi2"]
        assert kivi2["bytes_per_token"] * 2048 + kivi2["fixed_bytes"] == ctx.memory().bytes


def test_the_capture_reads_the_latent_attention(mla: Model, shape: random_model.Shape, tokens: list[int]) -> None:
    """What pykvq calibrate weighs (patch 0028 names it): Q, the row the cache keeps as K, V its first channels, and
    the attention's output before the per-head V projection, whose fitted scale is the model's (its query/key head
    size's, not the absorbed Q's)."""
    capture = AttentionCapture(200)
    with mla.context(config(n_ctx=256, n_batch=256, n_ubatch=256, kv=KvConfig(layers="none"), observer=capture)) as ctx:
        ctx.eval(tokens[:200])
    assert capture.kv_layers() == [il for il in range(shape.n_layer) if not shape.is_recurrent(il)]
    for il in capture.kv_layers():
        q, k, v = capture.layer(il)
        assert k.shape == (200, 1, row(shape)) and clip_ratios.is_latent(k, v) and v.shape[-1] == shape.kv_lora_rank
        assert capture.output(il).shape == (200, shape.n_head, shape.kv_lora_rank)
        fitted = attention_scale.layer_scale(q, k, v, capture.output(il), mla.n_swa)
        assert fitted == pytest.approx(shape.n_embd_head ** -0.5, rel=0.02)


def calibrate(mla_path: Path, hamlet: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(["pykvq", "calibrate", "-t", "2", *device.TOOL_ARGS, "-m", str(mla_path), "-f", str(hamlet),
                           "-c", "256", "--refine", "3", "-o", str(out), *flags], capture_output=True, text=True)


def test_calibrate_chooses_k_widths_and_clip_ratios(mla_path: Path, shape: random_model.Shape, hamlet: Path,
                                                    tmp_path: Path) -> None:
    """K alone: V is K's first channels, read from K's tiles, so the budget is K's code bits, V has no width or clip
    ratio of its own, and nothing acts on V rows (no rotation, no dither); the copy runs with what it wrote."""
    out = tmp_path / "out.gguf"
    proc = calibrate(mla_path, hamlet, out, "--kv-budget", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no rotation" in proc.stdout and "V dither" not in proc.stdout
    fields = gguf_metadata.read_fields(out)
    layers = [il for il in range(shape.n_layer) if not shape.is_recurrent(il)]
    allocation = re.search(r"^--kv-layers '(k:[^;]+);(v:[^']+)'$", proc.stdout, re.M)
    assert allocation is not None and fields[gguf_metadata.KEY_LAYERS] == f"{allocation[1]};{allocation[2]}"
    bits = {pykvq.GGML_TYPE_KIVI4: 4, pykvq.GGML_TYPE_KIVI2: 2, pykvq.GGML_TYPE_KIVI1: 1}
    k_types, _ = native.resolve_layer_types(allocation[1], shape.n_layer, pykvq.GGML_TYPE_KIVI2,
                                            pykvq.GGML_TYPE_KIVI2)
    assert sum(bits[k_types[il]] for il in layers) <= 3 * len(layers)
    assert allocation[2] == f"v:0-{shape.n_layer - 1}=kivi2"
    assert "v:" not in str(fields.get(gguf_metadata.KEY_CLIP, "")) and gguf_metadata.KEY_ROTATE not in fields
    run = subprocess.run(["pykvq", "run", *device.TOOL_ARGS, "-t", "2", "-m", str(out), "-c", "512", "-p", "<t7>",
                          "-n", "4"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("flags", [["--kv-rotate", "on"], ["--kv-dither", "0.5"], ["--kv-clip", "v:*=0.9"],
                                   ["--kv-select", "0.25,0.25"]])
def test_calibrate_refuses_what_acts_on_v_rows(mla_path: Path, hamlet: Path, tmp_path: Path, flags: list[str]) -> None:
    out = tmp_path / "out.gguf"
    proc = calibrate(mla_path, hamlet, out, *flags)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "would act on V rows, which a multi-head latent attention layer does not have" in proc.stderr
    assert not out.exists()
