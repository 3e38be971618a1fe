"""The kivi cache under edits and state round-trips: removing a suffix, saving and loading, refusals."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pykvq import KvConfig, LlamaError, Model, llama_tools
from pykvq.bindings.log import sink

import device

N_CTX = 1024


@pytest.fixture(scope="module")
def tokens(model: Model, hamlet: Path) -> list[int]:
    return model.tokenize(hamlet.read_text()[40000:46000])[:700]


def context(model: Model, kv: KvConfig):
    return model.context(device.context_config(n_ctx=N_CTX, n_threads=2, kv=kv))


def fresh_logits(model: Model, kv: KvConfig, tokens: list[int], splits: tuple[int, ...] = ()) -> np.ndarray:
    """All logits of a fresh context fed `tokens`, in batches cut at `splits`: the twin of a run with the same
    batch shapes is exact on any backend (a GPU's matmuls round differently for other shapes)."""
    bounds = [0, *splits, len(tokens)]
    with context(model, kv) as ctx:
        return np.concatenate([ctx.eval(tokens[a:b], all_logits=True) for a, b in itertools.pairwise(bounds)])


def assert_fresh(got: np.ndarray, model: Model, kv: KvConfig, tokens: list[int], splits: tuple[int, ...] = (),
                 rows: slice | int = slice(None)) -> None:
    """`got` equals those rows of fresh_logits(model, kv, tokens, splits); on a GPU within the bar the quantization's
    own effect sets (device.assert_same_logits), from the f16 twin computed only there."""
    device.assert_same_logits(got, fresh_logits(model, kv, tokens, splits)[rows],
                              lambda: fresh_logits(model, F16, tokens, splits)[rows])


# per-layer types may put any type on any layer, layer 0 included
MIXED_F16_FIRST = KvConfig("kivi2", "kivi2", window=64, layers="k:0=f16,1-=kivi2;v:0=f16,1-=kivi2")
F16 = KvConfig()
MIXED_Q8_MIDDLE = KvConfig("kivi2", "kivi2", window=48, sinks=2,
                           layers="k:0-9=kivi2,10=q8_0,11-=kivi4;v:0-9=kivi2,10=q8_0,11-=kivi2")
KIVI = [KvConfig.preset("kivi2", window=64, sinks=4), KvConfig.preset("kivi4", window=100),
        KvConfig("kivi2", "kivi1", window=16, layers="asymkv:20/10"), MIXED_F16_FIRST, MIXED_Q8_MIDDLE]


@pytest.mark.parametrize("kv", KIVI, ids=["kivi2-w64-s4", "kivi4-w100", "asymkv-w16", "f16-layer0", "q8_0-layer10"])
def test_state_round_trip_continues_as_if_never_saved(model: Model, tokens: list[int], kv: KvConfig) -> None:
    split = 333  # inside a tile: the unsealed tile's fp16 cells travel in the state too
    with context(model, kv) as first:
        first.eval(tokens[:split])
        state = first.save_state()
    with context(model, kv) as second:
        second.load_state(state)
        assert second.n_past == split
        resumed = second.eval(tokens[split:], all_logits=True)
    assert_fresh(resumed, model, kv, tokens, (split,), slice(split, None))


@pytest.mark.parametrize("other", [KvConfig.preset("kivi2", window=32, sinks=4),
                                   KvConfig.preset("kivi4", window=64, sinks=4),
                                   KvConfig.preset("kivi2", window=64, sinks=0),
                                   KvConfig.preset("kivi2", window=64, sinks=4, rotate=True)],
                         ids=["window", "type", "sinks", "rotation"])
def test_a_state_of_other_settings_is_refused(model: Model, tokens: list[int], other: KvConfig) -> None:
    with context(model, KvConfig.preset("kivi2", window=64, sinks=4)) as first:
        first.eval(tokens[:100])
        state = first.save_state()
    with context(model, other) as second, pytest.raises(LlamaError, match="kivi KV cache: cannot load this state"):
        second.load_state(state)


def test_a_window_or_sink_count_past_the_context_is_bounded_by_it(model: Model, tokens: list[int]) -> None:
    """Both keep every cell in fp16 either way: a huge value (which overflowed the ring's size into an abort)
    costs what the context's own size does, and attends the same."""
    huge, whole = (KvConfig.preset("kivi2", window=n, sinks=n) for n in (2**31 - 1, N_CTX))
    with context(model, huge) as ctx:
        got, memory = ctx.eval(tokens[:300], all_logits=True), ctx.memory()
    with context(model, whole) as ctx:
        want, whole_memory = ctx.eval(tokens[:300], all_logits=True), ctx.memory()
    assert memory.bytes == whole_memory.bytes
    device.assert_same_logits(got, want)


def save_session_file(ctx, path: Path, tokens: list[int]) -> bool:
    """llama_state_save_file, as llama.cpp's tools save --prompt-cache."""
    lib = ctx._lib
    return bool(lib.llama.llama_state_save_file(ctx._ptr, str(path).encode(), lib.ffi.new("llama_token[]", tokens),
                                                len(tokens)))


def test_a_session_file_of_a_mixed_cache_is_saved_and_leaves_nothing_beside_it(model: Model, tokens: list[int],
                                                                              tmp_path: Path) -> None:
    """Session files go through a temporary name (llama_kvq_atomic_file): a kivi + f16 mix saves (it aborted,
    leaving a truncated file), and a destination the finished file cannot replace is refused untouched."""
    with context(model, MIXED_F16_FIRST) as ctx:
        ctx.eval(tokens[:100])
        saved = tmp_path / "session.bin"
        assert save_session_file(ctx, saved, tokens[:100])
        # a destination the finished file cannot replace (a folder): refused, left as it was, nothing beside it
        taken = tmp_path / "taken"
        (taken / "inside").mkdir(parents=True)
        assert not save_session_file(ctx, taken, tokens[:100])
        assert any("cannot rename" in problem for problem in sink().take_problems())
    assert saved.stat().st_size > 0 and (taken / "inside").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session.bin", "taken"]


def test_after_a_refused_load_the_positions_follow_the_cache(model: Model, tokens: list[int]) -> None:
    """A refused load may leave the cache cleared: the next eval must continue from what the cache holds, not
    from the context's old position (which decoded at the wrong positions)."""
    with context(model, KvConfig.preset("kivi2", window=64, sinks=4)) as first:
        first.eval(tokens[:100])
        state = first.save_state()
    other = KvConfig.preset("kivi2", window=32, sinks=4)
    with context(model, other) as second:
        second.eval(tokens[:50])
        with pytest.raises(LlamaError, match="cannot load this state"):
            second.load_state(state)
        held = second.seq_len(0)
        assert second.n_past == held
        got = second.eval(tokens[held:held + 10], all_logits=True)
    assert_fresh(got, model, other, tokens[:held + 10], (held,) if held else (), slice(held, None))


# where the first layer's saved K/V type ids sit: after the kivi block header ("KVQ5", n_layer, window, sinks,
# n_fp16 as int64, n_cells, what is rotated: 32 bytes)
KVQ_HEADER_BYTES = 32


@pytest.mark.parametrize("older", [b"KVQ1", b"KVQ2"])
def test_a_state_of_a_format_before_rotation_was_recorded_is_refused(model: Model, tokens: list[int],
                                                                     older: bytes) -> None:
    kv = KvConfig.preset("kivi2", window=64)
    with context(model, kv) as first:
        first.eval(tokens[:100])
        state = first.save_state().replace(b"KVQ5", older)
    with context(model, kv) as second, pytest.raises(LlamaError, match="saved by an older pykvq"):
        second.load_state(state)


# the same layers under two context types: what is rotated follows the layers, not the context's type (a q8_0
# context type rotated its kivi layers, and an f16 one with q8_0 layers did not rotate them, states unaware)
MIX_LAYERS = "k:0-9=kivi2,10-=q8_0;v:0-9=kivi2,10-=q8_0"
ALL_F16_LAYERS = "k:*=f16;v:*=f16"


@pytest.mark.parametrize(("type_a", "type_b", "layers"), [("q8_0", "kivi2", MIX_LAYERS),
                                                          ("q8_0", "f16", ALL_F16_LAYERS)], ids=["mix", "all-f16"])
def test_the_rotation_follows_the_layer_types_not_the_context_type(model: Model, tokens: list[int], type_a: str,
                                                                    type_b: str, layers: str) -> None:
    a, b = (KvConfig(t, t, window=64, layers=layers) for t in (type_a, type_b))
    with context(model, a) as first:
        first.eval(tokens[:100])
        state = first.save_state()
        want = first.eval(tokens[100:110], all_logits=True)
    with context(model, b) as second:
        second.load_state(state)
        got = second.eval(tokens[100:110], all_logits=True)
    device.assert_same_logits(got, want)


@pytest.mark.parametrize("bad_id", [999, -5, 4], ids=["past-the-end", "negative", "removed-type"])
def test_a_corrupt_type_id_in_a_state_is_named_not_looked_up(model: Model, tokens: list[int], bad_id: int) -> None:
    kv = KvConfig.preset("kivi2", window=64)
    with context(model, kv) as first:
        first.eval(tokens[:100])
        state = bytearray(first.save_state())
    at = state.index(b"KVQ5") + KVQ_HEADER_BYTES
    state[at:at + 4] = bad_id.to_bytes(4, "little", signed=True)
    with context(model, kv) as second, pytest.raises(LlamaError) as refused:
        second.load_state(bytes(state))
    assert "layer 0's record names no KV types: the state is truncated or corrupt" in str(refused.value)


def test_a_kivi_state_in_a_cache_of_upstream_types_says_so(model: Model, tokens: list[int]) -> None:
    """Upstream's reader took the kivi state's magic for its V-transposition flag: "incompatible V transposition"."""
    with context(model, KvConfig.preset("kivi2")) as first:
        first.eval(tokens[:100])
        state = first.save_state()
    with context(model, KvConfig("q8_0", "q8_0")) as second, pytest.raises(LlamaError) as refused:
        second.load_state(state)
    assert "it was saved from a kivi KV cache, this cache holds q8_0/q8_0 in layer 0" in str(refused.value)


def test_a_truncated_session_file_is_called_truncated(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    """llama_file reads nothing past a file's end and says nothing: the unread layer types were taken as f32
    ("layer 3 was saved as f32/f32")."""
    session, text = tmp_path / "session.bin", tmp_path / "prompt.txt"
    text.write_text(hamlet.read_text(encoding="utf-8")[:1000], encoding="utf-8")
    args = [*device.TOOL_ARGS, "-m", str(smollm2), "-f", str(text), "-n", "4", "-c", "512", "-b", "512", "-no-cnv",
            "-t", "2", "-fa", "on", "-ctk", "kivi2", "-ctv", "kivi2", "--prompt-cache", str(session)]
    llama_tools.run_tool("llama-completion", args)
    session.write_bytes(session.read_bytes()[:session.stat().st_size // 2])
    with pytest.raises(llama_tools.ToolError) as refused:
        llama_tools.run_tool("llama-completion", args)
    assert "layer" in str(refused.value) and "the state is truncated or corrupt" in str(refused.value)


def test_self_extend_is_refused_on_a_kivi_cache(smollm2: Path) -> None:
    """llama-completion's -gan divides cached positions, which a kivi cache leaves as they are: the run went on
    silently as without it."""
    args = [*device.TOOL_ARGS, "-m", str(smollm2), "-p", "Hello", "-n", "8", "-c", "256", "-no-cnv", "-t", "2",
            "-fa", "on", "-gan", "2", "-gaw", "32"]
    with pytest.raises(llama_tools.ToolError, match=r"self-extend \(-gan\) moves cached positions"):
        llama_tools.run_tool("llama-completion", [*args, "-ctk", "kivi2", "-ctv", "kivi2"])
    upstream_type = llama_tools.run_tool("llama-completion", [*args, "-ctk", "q8_0", "-ctv", "q8_0"])
    assert "self-extend: n_ctx_train" in upstream_type


@pytest.mark.parametrize("kv, removed", [(KvConfig.preset("kivi2", window=100), 20),
                                         (KvConfig.preset("kivi2", window=128), 1),
                                         (KvConfig.preset("kivi4", window=16, sinks=3), 10),
                                         (KvConfig.preset("kivi2", window=128, rollback=16), 16),
                                         (MIXED_F16_FIRST, 1), (MIXED_Q8_MIDDLE, 8)],
                         ids=["w100-20", "w128-1", "w16-10", "w128-rollback16-16", "f16-layer0-1", "q8_0-layer10-8"])
def test_removing_a_suffix_equals_a_fresh_context(model: Model, tokens: list[int], kv: KvConfig, removed: int) -> None:
    """Rollback inside the ring's slack: afterwards the cache is what a context fed only the kept tokens has, so
    continuing gives the same logits bit for bit (the cut tile goes back to fp16 and is sealed again)."""
    keep = 333
    with context(model, kv) as ctx:
        ctx.eval(tokens[:keep + removed])
        ctx.truncate(keep)
        continued = ctx.eval(tokens[keep:600], all_logits=True)
    assert_fresh(continued, model, kv, tokens[:600], (keep,), slice(keep, None))


def test_a_removal_deeper_than_the_window_slack_is_refused(model: Model, tokens: list[int]) -> None:
    with context(model, KvConfig.preset("kivi2", window=128)) as ctx:
        ctx.eval(tokens[:400])
        with pytest.raises(LlamaError, match=r"with window 128 only the last 1 or fewer tokens"):
            ctx.truncate(390)
        ctx.truncate(0)  # everything: always possible
        assert_fresh(ctx.eval(tokens[:200], all_logits=True), model, KvConfig.preset("kivi2", window=128),
                     tokens[:200])


def test_rollback_widens_what_can_be_removed(model: Model, tokens: list[int]) -> None:
    """--kv-rollback 16 at window 128: the ring grows from 128 to 160 cells, so 33 tokens can go, 34 cannot."""
    kv = KvConfig.preset("kivi2", window=128, rollback=16)
    with context(model, kv) as ctx:
        ctx.eval(tokens[:400])
        with pytest.raises(LlamaError, match=r"with window 128 only the last 33 or fewer tokens"):
            ctx.truncate(400 - 34)
        ctx.truncate(400 - 33)
        continued = ctx.eval(tokens[367:450], all_logits=True)
    assert_fresh(continued, model, kv, tokens[:450], (367,), slice(367, None))


def test_rollback_costs_its_fp16_cells(model: Model) -> None:
    def cache_bytes(rollback: int) -> int:
        with context(model, KvConfig.preset("kivi2", window=128, rollback=rollback)) as ctx:
            return ctx.memory().bytes

    # 32 more ring cells (160 instead of 128), in K and V (192 channels each) of 30 layers, 2 bytes each
    assert cache_bytes(16) - cache_bytes(0) == 32 * 30 * 2 * 192 * 2


def test_speculative_decoding_pattern_is_exact(model: Model, tokens: list[int], hamlet: Path) -> None:
    """Draft 8 tokens, keep a few, drop the rest, again and again (what a draft model or prompt-lookup decoding
    does): the cache ends up exactly as a context fed only the accepted tokens."""
    drafts = model.tokenize(hamlet.read_text()[90000:93000])
    kv = KvConfig.preset("kivi2", window=64, sinks=4, rollback=8)
    rng = np.random.default_rng(0)
    accepted, used = 150, 0
    with context(model, kv) as ctx:
        ctx.eval(tokens[:accepted])
        while accepted < 500:
            ctx.eval(drafts[used:used + 8])
            used += 8
            ctx.truncate(accepted)
            step = int(rng.integers(1, 8))
            last = ctx.eval(tokens[accepted:accepted + step])
            accepted += step
    assert_fresh(last, model, kv, tokens[:accepted], rows=-1)


def test_context_shift_is_off_for_kivi_caches(model: Model, smollm2: Path) -> None:
    """Shifting would re-rotate K, whose sealed tiles hold per-channel codes of the rotated values: not
    supported, and llama.cpp's tools switch it off with a warning and stop at a full context instead."""
    with context(model, KvConfig.preset("kivi2")) as kivi, context(model, KvConfig()) as f16:
        assert not kivi.can_shift and f16.can_shift
    out = llama_tools.run_tool("llama-completion", [*device.TOOL_ARGS,
                                                    "-m", str(smollm2), "-p", "Hello", "-n", "400", "-c", "256",
                                                    "--temp", "0", "-no-cnv", "-t", "2", "-fa", "on", "-ctk", "kivi2",
                                                    "-ctv", "kivi2", "--context-shift", "--ignore-eos"])
    assert "KV cache shifting is not supported for this context, disabling KV cache shifting" in out
    assert "context full and context shift is disabled => stopping" in out


SHIFT_THEN_DECODE = """
import sys
import numpy as np
from pykvq import ContextConfig, KvConfig, Model
model_path, op, ngl, op_offload = sys.argv[1:]
tokens = list(range(1000, 1300))
with Model(model_path, n_gpu_layers=int(ngl)) as model:
    config = ContextConfig(n_ctx=512, n_threads=2, kv=KvConfig.preset("kivi2", window=64),
                           op_offload=op_offload == "on")
    with model.context(config) as ctx:
        ctx.eval(tokens[:200])
        llama = ctx._lib.llama
        if op == "add":
            llama.llama_memory_seq_add(ctx._mem, 0, 100, -1, -50)
        else:
            llama.llama_memory_seq_div(ctx._mem, 0, 100, -1, 2)
        shifted = ctx.eval(tokens[200:210])
    with model.context(config) as ctx:
        ctx.eval(tokens[:200])
        assert np.array_equal(shifted, ctx.eval(tokens[200:210])), "the refused edit changed the cache"
print("unchanged")
"""


@pytest.mark.parametrize("op", ["add", "div"])
def test_position_shifts_are_refused_not_a_crash(smollm2: Path, tmp_path: Path, op: str) -> None:
    """llama_memory_seq_add / seq_div (context shift, self-extend) on a kivi cache: upstream aborted at the next
    decode (a cache that cannot re-rotate K with shifted cells); now an error in the log and no change. In a
    subprocess, so that a regression fails this test instead of taking pytest down."""
    proc = subprocess.run([sys.executable, "-c", SHIFT_THEN_DECODE, str(smollm2), op, str(device.NGL),
                           "on" if device.OP_OFFLOAD else "off"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "unchanged"


@pytest.mark.parametrize("kv", [KvConfig(), KvConfig.preset("kivi2", window=32)], ids=["f16", "kivi2"])
def test_a_state_saved_right_after_a_copy_holds_the_copied_sequence(model: Model, tokens: list[int],
                                                                    kv: KvConfig) -> None:
    """seq_cp between per-sequence streams copies the data at the next decode: a state saved before it held the
    destination's old bytes, and the loaded context continued it with other logits (upstream's caches too)."""
    config = device.context_config(n_ctx=512, n_batch=256, n_threads=2, kv=kv, n_seq_max=2, flash_attn="on")
    with model.context(config) as ctx, model.context(config) as loaded:
        ctx.eval_seqs({0: tokens[:100]})
        ctx.seq_cp(0, 1)
        loaded.load_state(ctx.save_state())
        device.assert_same_logits(loaded.eval_seqs({1: tokens[100:120]})[1],
                                      ctx.eval_seqs({1: tokens[100:120]})[1])


def test_truncate_after_a_removed_range_follows_the_cache(model: Model) -> None:
    """A removal of an earlier range leaves a hole: truncating past it then leaves less than asked, and n_past says
    what the cache holds (it said the kept count, found by tests/test_config_space.py)."""
    with model.context(device.context_config(n_ctx=64, n_threads=2, kv=KvConfig())) as ctx:
        ctx.eval([5, 6, 7])
        ctx.seq_rm(0, 0, 1)
        ctx.truncate(1)
        assert ctx.n_past == ctx.seq_len(0) == 0
