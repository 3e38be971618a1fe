"""MiniKV's prompt selection (KvConfig.select, --kv-select): a prompt decoded into an empty sequence keeps its sinks,
its heaviest hitters per KV head (by the attention mass the kernels measure) and its recent tokens, resealed into
the sequence's first cells. Judged against plain kivi2 runs with the same batch shapes on the suite's device (exact
on the CPU; on a GPU within the quantization's own bar, device.assert_same_logits), and behind the RPC backend
against the CPU."""

from __future__ import annotations

import functools
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from pykvq import ContextConfig, KvConfig, LlamaError, Model, Sampler, SamplerSettings, gguf_metadata
from pykvq.llama_tools import run_tool
from pykvq.kv_types import SELECT_OFF, Selection

import device
import state_format

import passkey

N_PROMPT = 600
N_CONT = 40


@pytest.fixture(scope="module")
def tokens(model: Model, hamlet: Path) -> list[int]:
    return model.tokenize(hamlet.read_text()[20000:40000])[:N_PROMPT + N_CONT]


def context(model: Model, select: Selection | None, n_ubatch: int = 1024, kv_type: str = "kivi2", **kv) -> object:
    config = KvConfig(kv_type, kv_type, select=select, **kv)
    return model.context(ContextConfig(n_ctx=1024, n_batch=1024, n_ubatch=n_ubatch, n_threads=2, flash_attn="on",
                                       kv=config))


def prompt_then_continuation(model: Model, tokens: list[int], select, **kv) -> tuple[np.ndarray, np.ndarray, int]:
    """The prompt's last logits, the continuation's logits (one call), and the cells the sequence held after the
    prompt."""
    with context(model, select, **kv) as ctx:
        last = ctx.eval(tokens[:N_PROMPT])
        held = ctx.seq_cells(0)
        assert ctx.seq_len(0) == N_PROMPT
        return last, ctx.eval(tokens[N_PROMPT:], all_logits=True), held


@pytest.fixture(scope="module")
def f16(model: Model, tokens: list[int]) -> Callable[[], tuple[np.ndarray, np.ndarray, int]]:
    """The f16 twin of prompt_then_continuation, computed once and only when asked (on a GPU: its bar)."""
    return functools.cache(lambda: prompt_then_continuation(model, tokens, None, kv_type="f16"))


def nll(logits: np.ndarray, targets: list[int]) -> float:
    x = logits - logits.max(axis=1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(targets)), targets].mean())


def test_keeping_every_token_is_plain_kivi2(model: Model, tokens: list[int], f16) -> None:
    # the heavy hitters are every candidate, sorted back into prompt order: the reseal must rebuild the very
    # tiles, V rows and ring of a plain prompt, so the continuation reads the same cache bit for bit
    plain = prompt_then_continuation(model, tokens, None)
    kept = prompt_then_continuation(model, tokens, (0.5, 0.5))
    assert kept[2] == plain[2] == N_PROMPT
    device.assert_same_logits(kept[0], plain[0], lambda: f16()[0])
    device.assert_same_logits(kept[1], plain[1], lambda: f16()[1])


@pytest.mark.parametrize("select, sinks", [((0.25, 0.25), 0), ((0.125, 0.125), 4)])
def test_selection_keeps_its_share_and_continues(model: Model, tokens: list[int], select, sinks: int, f16) -> None:
    plain = prompt_then_continuation(model, tokens, None, sinks=sinks)
    last, cont, held = prompt_then_continuation(model, tokens, select, sinks=sinks)
    assert held == sinks + round(select[0] * N_PROMPT) + round(select[1] * N_PROMPT)
    # the prompt's own attention reads the whole prompt: its last logits are plain kivi2's
    device.assert_same_logits(last, plain[0], lambda: f16()[0])
    # the continuation reads only the kept tokens: different, and still the model's text
    assert not np.array_equal(cont, plain[1])
    targets = tokens[N_PROMPT + 1:]
    assert nll(cont[:-1], targets) < nll(plain[1][:-1], targets) + 0.5


def test_heavy_hitters_beat_the_recent_window_alone(model: Model, tokens: list[int]) -> None:
    # the same number of cells, chosen by attention mass or by recency only (a tiny heavy-hitter share): the
    # mass-chosen set must lose less. A selection that ignored the scores would not tell the two apart.
    by_mass = prompt_then_continuation(model, tokens, (0.15, 0.05))
    recent = prompt_then_continuation(model, tokens, (0.0017, 0.1983))
    assert by_mass[2] == recent[2]
    targets = tokens[N_PROMPT + 1:]
    assert nll(by_mass[1][:-1], targets) < nll(recent[1][:-1], targets)


def test_an_observation_window_scores_with_the_prompts_last_queries(model: Model, tokens: list[int], f16) -> None:
    # the kernels' sums over the last queries are judged in test_kvq_score.py; here the selection they feed: keeping
    # every token is still plain kivi2, and a short window picks other heavy hitters, keeping as many cells
    plain = prompt_then_continuation(model, tokens, None)
    device.assert_same_logits(prompt_then_continuation(model, tokens, (0.5, 0.5, 16))[1], plain[1], lambda: f16()[1])
    every = prompt_then_continuation(model, tokens, (0.25, 0.25, 0))
    last = prompt_then_continuation(model, tokens, (0.25, 0.25, 16))
    assert last[2] == every[2] == N_PROMPT // 2
    device.assert_same_logits(last[0], every[0], lambda: f16()[0])
    assert not np.array_equal(last[1], every[1])
    # a window of every query differs from 0 by the window's pooling alone
    assert not np.array_equal(prompt_then_continuation(model, tokens, (0.25, 0.25, N_PROMPT))[1], every[1])


@pytest.mark.parametrize("key", ["36864", "52586"])
def test_an_observation_window_keeps_what_follows_the_tokens_it_looks_at(model: Model, key: str) -> None:
    # the question at the end looks at the words before the key, and the answer copies the digits after them: with
    # SnapKV's pool centred on a token (3 before, 3 after) the selection dropped the key's last digits (their
    # probability 0.02 and 0.03 where the answer needs them); kivi4, so that 2-bit codes play no part
    prompt = passkey.build_prompt(model, 1024, 0, key)
    config = ContextConfig(n_ctx=1024, n_batch=1024, n_ubatch=1024, n_threads=2, flash_attn="on",
                           kv=KvConfig("kivi4", "kivi4", sinks=4, select=(0.4, 0.1, 32)))
    got = passkey.answer(model, config, prompt)
    assert passkey.found(got.text, key), got.text


def test_state_after_selection_continues_exactly(model: Model, tokens: list[int]) -> None:
    with context(model, (0.25, 0.25)) as ctx:
        ctx.eval(tokens[:N_PROMPT])
        state = ctx.save_state()
        expected = ctx.eval(tokens[N_PROMPT:], all_logits=True)
    with context(model, (0.25, 0.25)) as ctx:
        ctx.load_state(state)
        assert ctx.seq_cells(0) == 300 and ctx.seq_len(0) == N_PROMPT
        device.assert_same_logits(ctx.eval(tokens[N_PROMPT:], all_logits=True), expected)


def test_a_refused_removal_after_selection_names_its_positions(model: Model, tokens: list[int]) -> None:
    # 150 heavy hitters then the 150 recent tokens (positions 450-599) in cells 150-299: position 500 is cell 200
    with context(model, (0.25, 0.25)) as ctx:
        ctx.eval(tokens[:N_PROMPT])
        with pytest.raises(LlamaError, match=r"cannot remove tokens \[200, -1\) \(positions \[500, -1\)\) of 300 "):
            ctx.seq_rm(0, 500)
        assert ctx.seq_cells(0) == 300


# MiniKV's pyramid at depth 3: the bottom layer keeps 0.25*(2 - 1/3) of the prompt as heavy hitters (250 of 600
# tokens), the top one 0.25/3 (50), every layer the same 150 recent tokens
PYRAMID = (0.25, 0.25, 0, 3.0)
PYRAMID_CELLS = 400


def test_a_pyramid_holds_its_bottom_layers_cells_and_continues(model: Model, tokens: list[int], f16) -> None:
    uniform = prompt_then_continuation(model, tokens, (0.25, 0.25))
    # depth 1 is the uniform selection
    device.assert_same_logits(prompt_then_continuation(model, tokens, (0.25, 0.25, 0, 1.0))[1], uniform[1])
    last, cont, held = prompt_then_continuation(model, tokens, PYRAMID)
    assert held == PYRAMID_CELLS
    device.assert_same_logits(last, uniform[0], lambda: f16()[0])
    assert not np.array_equal(cont, uniform[1])
    plain = prompt_then_continuation(model, tokens, None)
    targets = tokens[N_PROMPT + 1:]
    assert nll(cont[:-1], targets) < nll(plain[1][:-1], targets) + 0.5


def test_a_pyramid_state_carries_its_dead_cells(model: Model, tokens: list[int]) -> None:
    rest = tokens[N_PROMPT:]
    with context(model, PYRAMID) as ctx:
        ctx.eval(tokens[:N_PROMPT])
        state = ctx.save_state()
        expected = ctx.eval(rest, all_logits=True)
    # a context that selects nothing itself: which cells each layer left dead comes with the state
    with context(model, SELECT_OFF) as ctx:
        ctx.load_state(state)
        assert ctx.seq_cells(0) == PYRAMID_CELLS
        device.assert_same_logits(ctx.eval(rest, all_logits=True), expected)
    # the same bytes without that record (the KVQ4 layout): the upper layers read the copies their dead cells hold,
    # which the mask kept out
    layout = state_format.parse(state, state_format.Geometry.of(model, kivi=True))
    unmasked = state_format.without_layer_fields(state, layout, (".dead",)).replace(b"KVQ5", b"KVQ4")
    with context(model, SELECT_OFF) as ctx:
        ctx.load_state(unmasked)
        assert not np.array_equal(ctx.eval(rest, all_logits=True), expected)


@pytest.mark.parametrize("unified", [False, True], ids=["streams", "unified"])
def test_a_copied_pyramid_sequence_continues_as_its_source(model: Model, tokens: list[int], unified: bool) -> None:
    config = KvConfig("kivi2", "kivi2", select=PYRAMID)
    with model.context(ContextConfig(n_ctx=2048, n_batch=1024, n_ubatch=1024, n_threads=2, flash_attn="on",
                                     n_seq_max=2, kv_unified=unified, kv=config)) as ctx:
        ctx.eval_seqs({0: tokens[:N_PROMPT]})
        ctx.seq_cp(0, 1)
        assert ctx.seq_cells(1) == PYRAMID_CELLS
        got = ctx.eval_seqs({0: tokens[N_PROMPT:N_PROMPT + 8], 1: tokens[N_PROMPT:N_PROMPT + 8]})
    device.assert_same_logits(got[1], got[0])


def test_a_later_batch_of_the_same_sequence_is_not_selected(model: Model, tokens: list[int]) -> None:
    with context(model, (0.25, 0.25)) as ctx:
        ctx.eval(tokens[:N_PROMPT])
        ctx.eval(tokens[N_PROMPT:])
        assert ctx.seq_cells(0) == 300 + N_CONT


def test_a_prompt_that_spans_ubatches_is_refused_whole(model: Model, tokens: list[int]) -> None:
    with context(model, (0.25, 0.25), n_ubatch=256) as ctx:
        with pytest.raises(LlamaError, match=r"600-token prompt of sequence 0 spans several: raise the batch and "
                                             r"ubatch sizes to at least 600 \(-b, -ub\)"):
            ctx.eval(tokens[:N_PROMPT])
        assert ctx.seq_cells(0) == 0


def test_prompts_of_two_sequences_in_one_ubatch_are_refused(model: Model, tokens: list[int]) -> None:
    config = ContextConfig(n_ctx=2048, n_batch=1024, n_ubatch=1024, n_threads=2, flash_attn="on", n_seq_max=2,
                           kv_unified=True, kv=KvConfig("kivi2", "kivi2", select=(0.25, 0.25)))
    with model.context(config) as ctx:
        with pytest.raises(LlamaError, match="takes one prompt per ubatch"):
            ctx.eval_seqs({0: tokens[:300], 1: tokens[300:N_PROMPT]})
        # one call per sequence: each selects its own
        ctx.eval_seqs({0: tokens[:300]})
        ctx.eval_seqs({1: tokens[300:N_PROMPT]})
        assert ctx.seq_cells(0) == ctx.seq_cells(1) == 150


def test_a_prompt_within_the_window_is_kept_whole(model: Model, tokens: list[int]) -> None:
    with context(model, (0.25, 0.25)) as ctx:
        ctx.eval(tokens[:100])
        assert ctx.seq_cells(0) == 100


@pytest.mark.parametrize("select, message", [
    ((0.0, 0.5), "must each be in (0, 1]"),
    ((0.75, 0.5), "add up to 1.25"),
    ((float("nan"), 0.5), "must each be in (0, 1]"),
    ((0.25, 0.25, -1), "observation window must be 0"),
    ((0.25, 0.25, 0, 0.5), "pyramid depth must be 1"),
])
def test_bad_shares_are_refused_before_the_context(model: Model, select, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        context(model, select)


def test_selection_needs_kivi_layers(model: Model) -> None:
    with pytest.raises(LlamaError, match=r"layer 0 f16/f16: prompt selection \(--kv-select\) keeps the selected tokens "
                                         r"in kivi layers only"):
        model.context(ContextConfig(n_ctx=1024, flash_attn="on",
                                    kv=KvConfig("f16", "f16", select=(0.25, 0.25))))
    with pytest.raises(LlamaError, match="layer 29 q8_0/q8_0: prompt selection"):
        context(model, (0.25, 0.25), layers="k:0-28=kivi2,29=q8_0;v:0-28=kivi2,29=q8_0")


RUN_ARGS = ["--kv-type", "kivi2", "--kv-select", "0.25,0.25", "-n", "8", "--temp", "0", "-c", "1024", "-t", "2",
            "--no-display-prompt"]


def test_pykvq_run_reports_what_selection_holds(smollm2: Path, tmp_path: Path, hamlet: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(hamlet.read_text()[20000:22500])
    out = subprocess.run(["pykvq", "run", "-m", str(smollm2), "-f", str(prompt), *RUN_ARGS], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pykvq: prompt selection: batch and ubatch sizes raised to the prompt's" in out.stderr
    line = next(line for line in out.stderr.splitlines() if line.startswith("pykvq: prompt selection 0.25,0.25"))
    assert "without selection" in line and "MiB" in line


@pytest.mark.usefixtures("cpu_only")
@pytest.mark.parametrize("select", ["0.25,0.25", "0.25,0.25,0,3"], ids=["uniform", "pyramid"])
def test_pykvq_run_on_an_rpc_device_selects_as_the_cpu(rpc_server: str, smollm2: Path, tmp_path: Path,
                                                         hamlet: Path, select: str) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(hamlet.read_text()[20000:22500])
    args = ["-m", str(smollm2), "-f", str(prompt), *RUN_ARGS, "--kv-select", select]
    # a prompt on a device attends through flash attention over wide cells: the same kernels on the CPU
    env = {**os.environ, "LLAMA_KVQ_FA_PREFILL": "1"}
    on_rpc = subprocess.run(["pykvq", "run", "--rpc", rpc_server, "-ngl", "99", *args], capture_output=True,
                            text=True, timeout=300, env=env)
    assert on_rpc.returncode == 0, on_rpc.stderr[-3000:]
    on_cpu = subprocess.run(["pykvq", "run", "-ngl", "0", *args], capture_output=True, text=True, timeout=300,
                            env=env)
    assert on_rpc.stdout == on_cpu.stdout


@pytest.mark.parametrize("args, message", [
    (["-p", "a short prompt"], "no longer than the fp16 window of 128"),
    (["-p", "x", "--kv-select", "0.8,0.3"], "add up to 1.1"),
    (["-p", "x", "--kv-select", "half"], "takes HH,RW"),
    (["-p", "x", "--kv-select", "0.25,0.25,-4"], "observation window N must be 0"),
    (["-p", "x", "--kv-select", "0.25,0.25,4,0.5"], "pyramid depth D must be 1"),
    (["-p", "x", "--kv-select", "0.25,0.25,4,2,1"], "takes HH,RW[,N[,D]]"),
])
def test_pykvq_run_refuses_bad_selection_before_any_work(smollm2: Path, args: list[str], message: str) -> None:
    out = subprocess.run(["pykvq", "run", "-m", str(smollm2), "--kv-type", "kivi2", "--kv-select", "0.25,0.25",
                          *args], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and message in out.stderr


@pytest.mark.parametrize("select, sinks", [((0.25, 0.25), 0), ((0.3, 0.1, 32), 4), ((0.3, 0.2, 0, 2.5), 4)])
def test_pykvq_inspect_counts_the_cells_a_context_keeps(model: Model, smollm2: Path, tokens: list[int], select,
                                                        sinks: int) -> None:
    with context(model, select, sinks=sinks) as ctx:
        ctx.eval(tokens[:N_PROMPT])
        held = ctx.seq_cells(0)
    args = ["pykvq", "inspect", str(smollm2), "-c", str(N_PROMPT), "--kv-select", ",".join(map(str, select))]
    out = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # inspect reads the model's window and sinks (none here): the sinks are the context's own setting
    chosen = json.loads(out.stdout)["selection"]
    assert chosen["cells"] + sinks == held
    text = subprocess.run(args, capture_output=True, text=True, timeout=120).stdout
    assert f"keeps {chosen['cells']} of a {N_PROMPT}-token prompt's cells" in text
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("kivi2 "))
    assert float(row[3]) < float(row[2])


def test_llama_completion_takes_the_observation_window(model: Model, smollm2: Path, hamlet: Path) -> None:
    prompt = model.detokenize(model.tokenize(hamlet.read_text()[30000:32000], add_special=False))
    greedy = Sampler(SamplerSettings(temp=0))

    def ours(select) -> str:
        with context(model, select) as ctx:
            return "".join(ctx.generate_text(model.tokenize(prompt, parse_special=True), 24, greedy))

    selected = ours((0.25, 0.25, 32))
    assert selected != ours(None)
    out = run_tool("llama-completion", ["-m", str(smollm2), "-p", prompt, "-n", "24", "-no-cnv", "-t", "2",
                                        "-c", "1024", "-b", "1024", "-ub", "1024", "--no-warmup", "--temp", "0",
                                        "-fa", "on", "-ctk", "kivi2", "-ctv", "kivi2", "--kv-select", "0.25,0.25,32"])
    assert out[len(prompt):].startswith(selected)


def test_llama_cpp_python_selects_the_prompt(smollm2: Path, tokens: list[int]) -> None:
    import pykvq
    from pykvq.bindings import native
    from pykvq.llama_cpp import Llama
    # n_batch / n_ubatch left out: kv_select makes them n_ctx, as the prompt must reach the cache in one ubatch
    llm = Llama(model_path=str(smollm2), n_ctx=1024, verbose=False, type_k=pykvq.GGML_TYPE_KIVI2,
                type_v=pykvq.GGML_TYPE_KIVI2, kv_select=(0.25, 0.25), n_threads=2)
    llm.eval(tokens[:N_PROMPT])
    lib = native.libs()
    memory = lib.llama.llama_get_memory(lib.ffi.cast("struct llama_context *", llm._ctx.ctx))
    held = lib.llama.llama_memory_seq_pos_max(memory, 0) - lib.llama.llama_memory_seq_pos_min(memory, 0) + 1
    assert held == 300


@pytest.fixture(scope="module")
def selecting_copy(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 with kvq.select "0.25,0.25" in its metadata, as `pykvq calibrate --kv-select 0.25,0.25` writes it."""
    copy = tmp_path_factory.mktemp("select") / "smollm2-select.gguf"
    gguf_metadata.write_copy(smollm2, copy, {gguf_metadata.KEY_SELECT: "0.25,0.25"})
    return copy


def test_the_model_s_kvq_select_applies_where_none_is_given(model: Model, selecting_copy: Path,
                                                            tokens: list[int]) -> None:
    given = prompt_then_continuation(model, tokens, (0.25, 0.25))
    with device.load_model(selecting_copy) as copy:
        from_model = prompt_then_continuation(copy, tokens, None)
        assert from_model[2] == given[2] == 300
        np.testing.assert_array_equal(from_model[1], given[1])
        # off wins over the model's
        assert prompt_then_continuation(copy, tokens, SELECT_OFF)[2] == N_PROMPT


def test_a_prompt_the_model_s_selection_cannot_take_is_kept_whole(model: Model, selecting_copy: Path,
                                                                  tokens: list[int]) -> None:
    """Where --kv-select refuses (a prompt over several ubatches), a tool that batches as usual on a model with
    kvq.select is not broken: the prompt is kept whole, exactly plain kivi2's."""
    with context(model, None, n_ubatch=256) as ctx:
        plain = ctx.eval(tokens[:N_PROMPT], all_logits=True)
    with device.load_model(selecting_copy) as copy, context(copy, None, n_ubatch=256) as ctx:
        np.testing.assert_array_equal(ctx.eval(tokens[:N_PROMPT], all_logits=True), plain)
        assert ctx.seq_cells(0) == N_PROMPT


@pytest.mark.parametrize("value, message", [("0.9,0.9", "add up to 1.8"), ("most", "does not read as HH,RW")])
def test_a_bad_kvq_select_is_refused_with_its_key(smollm2: Path, tmp_path: Path, value: str, message: str) -> None:
    copy = tmp_path / "bad-select.gguf"
    gguf_metadata.write_copy(smollm2, copy, {gguf_metadata.KEY_SELECT: value})
    refusal = rf"the model's kvq.select metadata '{value}' is not a prompt selection: .*{message}.*--kv-select off"
    with device.load_model(copy) as bad, pytest.raises(LlamaError, match=refusal):
        context(bad, None)
    out = subprocess.run(["pykvq", "inspect", str(copy)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "kvq.select is not a prompt selection" in out.stderr


def test_pykvq_run_takes_the_model_s_selection(selecting_copy: Path, tmp_path: Path, hamlet: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(hamlet.read_text()[20000:22500])
    args = ["pykvq", "run", "-m", str(selecting_copy), "-f", str(prompt), *RUN_ARGS[:2], *RUN_ARGS[4:]]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "prompt selection from the model's kvq.* metadata: 0.25,0.25" in out.stderr
    assert "pykvq: prompt selection 0.25,0.25: the sequence holds" in out.stderr
    off = subprocess.run([*args, "--kv-select", "off"], capture_output=True, text=True, timeout=300)
    assert off.returncode == 0, off.stderr[-3000:]
    assert "pykvq: prompt selection" not in off.stderr


def test_pykvq_inspect_shows_what_the_model_s_selection_holds(selecting_copy: Path) -> None:
    base = ["pykvq", "inspect", str(selecting_copy), "-c", str(N_PROMPT)]
    text = subprocess.run(base, capture_output=True, text=True, timeout=120).stdout
    assert f"selected: --kv-select 0.25,0.25 keeps 300 of a {N_PROMPT}-token prompt's cells" in text
    off = subprocess.run([*base, "--kv-select", "off"], capture_output=True, text=True, timeout=120).stdout
    assert "selected:" not in off and "kvq.select = 0.25,0.25" in off


def test_pykvq_inspect_shows_what_the_model_s_mix_holds_under_its_selection(smollm2: Path, tmp_path: Path) -> None:
    """The model's own kvq.kv_layers row had no selected bytes, though a selecting copy's mix is kivi everywhere."""
    copy = tmp_path / "mix-select.gguf"
    gguf_metadata.write_copy(smollm2, copy, {gguf_metadata.KEY_SELECT: "0.25,0.25",
                                             gguf_metadata.KEY_LAYERS: "k:*=kivi4;v:*=kivi2"})
    out = subprocess.run(["pykvq", "inspect", str(copy), "-c", str(N_PROMPT), "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    held = json.loads(out.stdout)["selection"]["bytes_held"]
    # SmolLM2's K and V rows are alike: kivi4 K beside kivi2 V holds half of each type's bytes
    assert held["kvq.kv_layers"] == (held["kivi4"] + held["kivi2"]) / 2
    text = subprocess.run(["pykvq", "inspect", str(copy), "-c", str(N_PROMPT)], capture_output=True, text=True,
                          timeout=120).stdout
    row = [line.split() for line in text.splitlines() if line.strip().startswith("kvq.kv_layers ")][-1]
    assert len(row) == 4 and float(row[3]) < float(row[2])
