"""Several sequences in one kivi context, in per-sequence streams and in a unified cache (per-sequence regions):
each sequence decodes exactly as it would alone, never disturbs the others, and survives per-sequence edits
(suffix removal, copy, clear, keep, state)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from pykvq import KvConfig, LlamaError, Model, llama_tools, paths
from pykvq.bindings.log import sink

import device
from raw_batch import Item, decode

N_CTX_SEQ = 256  # cells per sequence

F16 = KvConfig()
KIVI2 = KvConfig.preset("kivi2", window=32, sinks=4)
ASYMKV = KvConfig("kivi2", "kivi1", window=16, layers="asymkv:20/10")
KVS = [KIVI2, ASYMKV]
KV_IDS = ["kivi2-w32-s4", "asymkv-w16"]
# an upstream type on layer 0 (per-layer types), plain rows next to the kivi layers' parts
Q8_FIRST = KvConfig("kivi2", "kivi2", window=32, layers="k:0=q8_0,1-=kivi2;v:0=q8_0,1-=kivi2")

# The kivi kernels compute a query's row from its own sequence's data alone, in the same order whatever else
# is in the batch, and the CPU's other ops are row-wise: there a sequence decoded next to others gives the bits
# it gives alone (measured: max |difference| 0.0 for all of the cases below); device.assert_same_logits.


@pytest.fixture(scope="module")
def texts(model: Model, hamlet: Path) -> list[list[int]]:
    """Four different token streams of 200 tokens."""
    text = hamlet.read_text()
    return [model.tokenize(text[start:start + 3000], add_special=False)[:200]
            for start in (20000, 40000, 60000, 80000)]


# llama.cpp's two layouts of a multi-sequence cache: per-sequence streams (its default) and one unified cell
# range (--kv-unified), where a kivi cache gives each sequence a region of n_ctx / n_seq_max cells
LAYOUTS = pytest.mark.parametrize("unified", [False, True], ids=["streams", "unified"])


def multi(model: Model, kv: KvConfig, n_seq: int, unified: bool = False, n_ctx_seq: int = N_CTX_SEQ):
    return model.context(device.context_config(n_ctx=n_ctx_seq * n_seq, n_threads=2, kv=kv, n_seq_max=n_seq,
                                       kv_unified=unified))


def alone(model: Model, kv: KvConfig, tokens: list[int], steps: int = 0) -> list[np.ndarray]:
    """Logits of the last prompt token, then of each of the next `steps` tokens fed one by one, in a
    one-sequence context; tokens[:len(tokens) - steps] is the prompt."""
    prompt, rest = tokens[:len(tokens) - steps], tokens[len(tokens) - steps:]
    with model.context(device.context_config(n_ctx=N_CTX_SEQ, n_threads=2, kv=kv)) as ctx:
        out = [ctx.eval(prompt)]
        out += [ctx.eval([t]) for t in rest]
    return out


def assert_as_alone(model: Model, kv: KvConfig, cases: list[tuple[list[np.ndarray], list[int], int]]) -> None:
    """Each case's logits (what alone(model, kv, tokens, steps) gives) equal a one-sequence context's; on a GPU all
    cases' rows are judged at once, within the bar set by the quantization's own effect (device.assert_same_logits),
    from f16 twins computed only there."""
    got = np.stack([row for rows, _, _ in cases for row in rows])
    want = np.stack([row for _, tokens, steps in cases for row in alone(model, kv, tokens, steps)])
    device.assert_same_logits(got, want, lambda: np.stack(
        [row for _, tokens, steps in cases for row in alone(model, F16, tokens, steps)]))


def assert_alone(model: Model, kv: KvConfig, *cases: tuple[np.ndarray, list[int]]) -> None:
    """Each (logits, tokens): the last logits of a one-sequence context fed `tokens`."""
    assert_as_alone(model, kv, [([got], tokens, 0) for got, tokens in cases])


@LAYOUTS
@pytest.mark.parametrize("n_seq", [2, 3, 4])
@pytest.mark.parametrize("kv", KVS, ids=KV_IDS)
def test_sequences_decoded_together_equal_each_alone(model: Model, texts: list[list[int]], kv: KvConfig,
                                                     n_seq: int, unified: bool) -> None:
    # prompts of different lengths (so that ubatches hold changing subsets of the streams), then 40 steps of
    # decoding all sequences in one batch: past the window, sealing tiles on the way
    prompts = [70, 45, 101, 33][:n_seq]
    steps = 40
    with multi(model, kv, n_seq, unified) as ctx:
        got = [[v] for v in ctx.eval_seqs({s: texts[s][:prompts[s]] for s in range(n_seq)}).values()]
        for i in range(steps):
            step = ctx.eval_seqs({s: [texts[s][prompts[s] + i]] for s in range(n_seq)})
            for s in range(n_seq):
                got[s].append(step[s])
        assert [ctx.seq_len(s) for s in range(n_seq)] == [p + steps for p in prompts]
    assert_as_alone(model, kv, [(got[s], texts[s][:prompts[s] + steps], steps) for s in range(n_seq)])


@LAYOUTS
@pytest.mark.parametrize("kv", KVS, ids=KV_IDS)
def test_decoding_b_never_changes_a(model: Model, texts: list[list[int]], kv: KvConfig, unified: bool) -> None:
    a, b = texts[0], texts[1]
    with multi(model, kv, 2, unified) as ctx:
        got = [ctx.eval_seqs({0: a[:50]})[0]]
        for i in range(3):
            ctx.eval_seqs({1: b[i * 60:(i + 1) * 60]})  # B alone: prefill, seals its own tiles
            got.append(ctx.eval_seqs({0: [a[50 + i]]})[0])
    assert_as_alone(model, kv, [(got, a[:53], 3)])


def removable_suffix(kv: KvConfig, n: int, r: int) -> bool:
    """Whether the last r of n tokens can be removed (llama-kvq-cache's rule): the ring (32 cells for these
    windows) must still hold every cell the next query reads in fp16, its window and its own tile."""
    p0 = n - r
    oldest = max(min(p0 - kv.window + 1, p0 // 32 * 32), kv.sinks or 0)
    return oldest >= n - 32


@LAYOUTS
@pytest.mark.parametrize("kv", KVS, ids=KV_IDS)
def test_suffix_removal_of_one_sequence_equals_a_fresh_context(model: Model, texts: list[list[int]],
                                                               kv: KvConfig, unified: bool) -> None:
    a, b = texts[0], texts[1]
    removable = max(r for r in range(1, 100) if removable_suffix(kv, 100, r))
    with multi(model, kv, 2, unified) as ctx:
        ctx.eval_seqs({0: a[:100], 1: b[:90]})
        ctx.seq_rm(0, 100 - removable)
        assert (ctx.seq_len(0), ctx.seq_len(1)) == (100 - removable, 90)
        # re-fed with other tokens (a regenerated reply), together with B
        new = texts[2][:10]
        got = ctx.eval_seqs({0: new, 1: b[90:95]})
        with pytest.raises(LlamaError, match="cannot remove"):
            ctx.seq_rm(1, 50)  # deeper than the slack: refused, B untouched
        got_b = ctx.eval_seqs({1: b[95:97]})[1]
    assert_alone(model, kv, (got[0], a[:100 - removable] + new), (got[1], b[:95]), (got_b, b[:97]))


@LAYOUTS
@pytest.mark.parametrize("kv", [*KVS, Q8_FIRST], ids=[*KV_IDS, "q8_0-layer0"])
def test_copied_sequences_diverge_as_fresh_runs(model: Model, texts: list[list[int]], kv: KvConfig,
                                                unified: bool) -> None:
    prompt = texts[0][:77]  # inside a tile: the copy carries the unsealed tile's fp16 cells
    conts = [texts[1][:40], texts[2][:40], texts[3][:40]]
    with multi(model, kv, 3, unified) as ctx:
        ctx.eval_seqs({0: prompt})
        ctx.seq_cp(0, 1)
        ctx.seq_cp(0, 2)
        assert [ctx.seq_len(s) for s in range(3)] == [77, 77, 77]
        got = ctx.eval_seqs({s: conts[s] for s in range(3)})
    assert_alone(model, kv, *[(got[s], prompt + conts[s]) for s in range(3)])


@LAYOUTS
@pytest.mark.parametrize("kv", [KIVI2, Q8_FIRST], ids=["kivi2-w32-s4", "q8_0-layer0"])
def test_a_copy_saved_before_the_next_decode_carries_its_data(model: Model, texts: list[list[int]], kv: KvConfig,
                                                              unified: bool) -> None:
    """seq_cp's data follows at the next decode, once the graph is done (as upstream's stream copies): a state
    saved in between must hold it all the same, and a state loaded in between must not be overwritten by it."""
    prompt, cont = texts[0][:77], texts[1][:20]
    with multi(model, kv, 2, unified) as ctx:
        ctx.eval_seqs({0: prompt})
        ctx.seq_cp(0, 1)
        copied = ctx.save_seq_state(1)
    with multi(model, kv, 2, unified) as ctx:
        ctx.eval_seqs({0: texts[2][:50]})
        ctx.seq_cp(0, 1)
        ctx.load_seq_state(copied, 1)
        got = ctx.eval_seqs({1: cont})[1]
    assert_alone(model, kv, (got, prompt + cont))


@LAYOUTS
@pytest.mark.parametrize("kv", KVS, ids=KV_IDS)
def test_a_cleared_sequence_reuses_its_stream(model: Model, texts: list[list[int]], kv: KvConfig,
                                              unified: bool) -> None:
    a, b, c = texts[0], texts[1], texts[2]
    with multi(model, kv, 2, unified) as ctx:
        ctx.eval_seqs({0: a[:80], 1: b[:150]})
        ctx.seq_rm(1)  # the whole of B
        assert ctx.seq_len(1) == 0
        got = ctx.eval_seqs({0: a[80:90], 1: c[:60]})
        ctx.seq_keep(1)  # keeps C (per-sequence streams: the other streams are untouched)
        got_c = ctx.eval_seqs({1: c[60:64]})[1]
    assert_alone(model, kv, (got[0], a[:90]), (got[1], c[:60]), (got_c, c[:64]))


@LAYOUTS
@pytest.mark.parametrize("kv", [*KVS, Q8_FIRST], ids=[*KV_IDS, "q8_0-layer0"])
def test_one_sequence_state_round_trip(model: Model, texts: list[list[int]], kv: KvConfig, unified: bool) -> None:
    a, b = texts[0], texts[1]
    with multi(model, kv, 2, unified) as ctx:
        ctx.eval_seqs({0: a[:60], 1: b[:111]})
        state = ctx.save_seq_state(1)
    with multi(model, kv, 2, unified) as ctx:
        ctx.eval_seqs({1: a[:30]})
        ctx.load_seq_state(state, 0)  # B's state into the other stream, next to another sequence
        assert (ctx.seq_len(0), ctx.seq_len(1)) == (111, 30)
        got = ctx.eval_seqs({0: b[111:120], 1: a[30:40]})
    assert_alone(model, kv, (got[0], b[:120]), (got[1], a[:40]))


@LAYOUTS
@pytest.mark.parametrize("seed", [1, 2])
def test_random_edits_of_three_sequences_equal_fresh_runs(model: Model, texts: list[list[int]], seed: int,
                                                          unified: bool) -> None:
    """Random feeds (to random subsets of the sequences, in the same batches), suffix removals within the
    slack, clears and copies; after each feed every fed sequence's logits equal a fresh run of its history."""
    kv = ASYMKV
    rng = np.random.default_rng(seed)
    history: list[list[int]] = [[], [], []]
    checks = []  # (history, logits)
    with multi(model, kv, 3, unified) as ctx:
        for _ in range(14):
            op = rng.choice(["feed", "feed", "feed", "remove", "clear", "copy"])
            if op == "feed":
                fed = [s for s in range(3) if rng.random() < 0.7] or [0]
                feeds = {}
                for s in fed:
                    n = int(rng.choice([1, 3, 17, 40]))
                    if len(history[s]) + n > 180:
                        continue
                    start = int(rng.integers(0, len(texts[s]) - n))
                    feeds[s] = texts[(s + start) % 4][start:start + n]
                for s, logits in ctx.eval_seqs(feeds).items():
                    history[s] += feeds[s]
                    checks.append((list(history[s]), logits))
            elif op == "remove":
                s = int(rng.integers(0, 3))
                n = len(history[s])
                ok = [r for r in range(1, n) if removable_suffix(kv, n, r)]
                if ok:
                    r = int(rng.choice(ok))
                    ctx.seq_rm(s, n - r)
                    history[s] = history[s][:n - r]
            elif op == "clear":
                s = int(rng.integers(0, 3))
                ctx.seq_rm(s)
                history[s] = []
            else:
                src, dst = (int(x) for x in rng.choice(3, 2, replace=False))
                if history[src]:
                    ctx.seq_cp(src, dst)
                    history[dst] = list(history[src])
            assert [ctx.seq_len(s) for s in range(3)] == [len(h) for h in history]
    assert len(checks) >= 5
    assert_alone(model, kv, *[(logits, tokens) for tokens, logits in checks])


@LAYOUTS
def test_whole_state_of_several_sequences_round_trips(model: Model, texts: list[list[int]], unified: bool) -> None:
    a, b = texts[0], texts[1]
    with multi(model, ASYMKV, 2, unified) as ctx:
        ctx.eval_seqs({0: a[:60], 1: b[:111]})
        state = ctx.save_state()
    with multi(model, ASYMKV, 2, unified) as ctx:
        ctx.load_state(state)
        assert (ctx.seq_len(0), ctx.seq_len(1)) == (60, 111)
        got = ctx.eval_seqs({0: a[60:70], 1: b[111:120]})
    assert_alone(model, ASYMKV, (got[0], a[:70]), (got[1], b[:120]))


def test_a_unified_cache_refuses_what_it_cannot_keep_apart(model: Model, texts: list[list[int]]) -> None:
    """A sequence id past n_seq_max, a sequence past its region and a copy that does not start at the first token:
    each refused with its reason, the cache still serving its sequences (a token of several sequences goes in once
    per sequence: tests/test_shared_prompt.py)."""
    a = texts[0]
    n_region = 128
    with multi(model, KIVI2, 2, unified=True, n_ctx_seq=n_region) as ctx:
        with pytest.raises(ValueError, match=r"sequence 2 is not one of this context's sequences \(0..1"):
            ctx.eval_seqs({2: a[:5]})
        ctx.eval_seqs({0: a[:n_region - 8]})
        assert ctx.n_seq_cells == n_region
        with pytest.raises(LlamaError, match=rf"sequence 0: 16 more tokens do not fit its {n_region - 8} used cells"):
            ctx.eval_seqs({0: a[n_region - 8:n_region + 8]})
        with pytest.raises(LlamaError, match="from its first token"):
            ctx.seq_cp(0, 1, 10, -1)
        assert (ctx.seq_len(0), ctx.seq_len(1)) == (n_region - 8, 0)
        got = ctx.eval_seqs({0: a[n_region - 8:n_region - 2], 1: a[:30]})
    assert_alone(model, KIVI2, (got[0], a[:n_region - 2]), (got[1], a[:30]))


def test_an_evaluation_past_a_sequence_s_region_is_refused_before_any_batch(model: Model,
                                                                           texts: list[list[int]]) -> None:
    """Python checks the region up front: a kivi cache cannot take back every batch of a call that fails halfway
    (a removal past the window's slack)."""
    a = texts[0]
    kivi1 = KvConfig.preset("kivi1")

    def region(kv: KvConfig):
        return model.context(device.context_config(n_ctx=2 * 128, n_batch=4, n_threads=2, kv=kv, n_seq_max=2,
                                                   kv_unified=True))

    def twin(kv: KvConfig) -> np.ndarray:
        """The same batches without the refused call: the same shapes, so exact on any backend."""
        with region(kv) as ctx:
            ctx.eval_seqs({0: a[:86]})
            return ctx.eval_seqs({0: a[86:100]})[0]

    with region(kivi1) as ctx:
        ctx.eval_seqs({0: a[:86]})
        with pytest.raises(LlamaError, match="do not fit"):
            ctx.eval_seqs({0: a[86:86 + 171]})
        assert (ctx.seq_len(0), ctx.n_past) == (86, 86)
        got = ctx.eval_seqs({0: a[86:100]})[0]
        ctx.eval_seqs({0: a[100:128]})
        sink().take_problems()
        assert decode(ctx, [Item(a[128], 128, (0,), True)])[0] != 0  # llama.cpp's own check, behind Python's
        assert any("sequence 0 is full: a unified kivi cache gives each of its 2 sequences 128 cells" in p
                   for p in sink().take_problems())
        assert ctx.seq_len(0) == 128
    device.assert_same_logits(got, twin(kivi1), lambda: twin(F16))


def test_a_unified_cache_wider_than_its_regions_decodes_each_sequence_as_alone(model: Model,
                                                                                texts: list[list[int]]) -> None:
    """n_ctx 128 for 3 sequences: llama.cpp pads the cache to 256 cells, the regions take 3 x 64 of them, and the
    attention's mask spans all 256 (this aborted at context creation)."""
    config = device.context_config(n_ctx=128, n_threads=2, kv=KIVI2, n_seq_max=3, kv_unified=True)
    with model.context(config) as ctx:
        assert ctx.n_seq_cells == 64
        got = ctx.eval_seqs({s: texts[s][:40] for s in range(3)})
    assert_alone(model, KIVI2, *[(got[s], texts[s][:40]) for s in range(3)])


def test_a_unified_cache_too_small_for_its_sequences_is_refused(model: Model) -> None:
    config = device.context_config(n_ctx=256, n_threads=2, kv=KIVI2, n_seq_max=16, kv_unified=True)
    with pytest.raises(LlamaError, match="256 cells for 16 sequences: kivi types need a multiple of 32 cells for each"):
        model.context(config)


def test_a_prefix_copy_in_a_unified_cache_equals_a_fresh_run(model: Model, texts: list[list[int]]) -> None:
    prompt, cont = texts[0][:77], texts[1][:20]
    keep = 77 - max(r for r in range(1, 77) if removable_suffix(KIVI2, 77, r))
    with multi(model, KIVI2, 2, unified=True) as ctx:
        ctx.eval_seqs({0: prompt})
        ctx.seq_cp(0, 1, 0, keep)
        assert (ctx.seq_len(0), ctx.seq_len(1)) == (77, keep)
        got = ctx.eval_seqs({1: cont})[1]
    assert_alone(model, KIVI2, (got, prompt[:keep] + cont))


@pytest.mark.parametrize("layout", [[], ["--kv-unified"]], ids=["streams", "unified"])
def test_perplexity_of_four_sequences_per_batch_equals_one(smollm2: Path, hamlet: Path, layout: list[str]) -> None:
    common = ["-m", str(smollm2), "-f", str(hamlet), "-c", "256", "-t", "2", "--chunks", "4", "-fa", "on"]
    kivi2 = [*common, "-ctk", "kivi2", "-ctv", "kivi2", "--kv-window", "32", "--kv-sinks", "4"]

    def perplexity(*args: str) -> llama_tools.PerplexityResult:
        return llama_tools.parse_perplexity(llama_tools.run_tool("llama-perplexity", [*device.TOOL_ARGS, *args]))

    one = perplexity(*kivi2, "-b", "256")
    four = perplexity(*kivi2, *layout, "-b", "1024")
    if not device.ON_GPU:
        assert four.running_ppl == one.running_ppl
        return
    # other batch shapes round differently on a GPU (device.assert_same_logits): the perplexity may move by less
    # than the quantization's own share of it
    f16 = perplexity(*common, "-b", "256")
    moved, quantization = abs(math.log(four.ppl / one.ppl)), abs(math.log(one.ppl / f16.ppl))
    assert moved <= max(1e-3, device.QUANTIZATION_SHARE * quantization), (four.ppl, one.ppl, f16.ppl)


@pytest.mark.parametrize(("kv_type", "layout"), [("kivi2", []), ("kivi4", []), ("kivi2", ["-kvu"])])
def test_batched_bench_runs_several_sequences(smollm2: Path, kv_type: str, layout: list[str]) -> None:
    assert paths.tool("llama-batched-bench").exists()
    output = llama_tools.run_tool("llama-batched-bench", [*device.TOOL_ARGS,
        "-m", str(smollm2), "-c", "2048", "-b", "512", "-ub", "256", "-npp", "64", "-ntg", "8", "-npl", "1,4",
        "-t", "2", "-fa", "on", "-ctk", kv_type, "-ctv", kv_type, "--kv-window", "32", "--kv-sinks", "4", *layout],
        timeout=300)
    rows = re.findall(r"^\|\s*64 \|\s*8 \|\s*(\d+) \|", output, re.M)
    assert rows == ["1", "4"], output[-2000:]
