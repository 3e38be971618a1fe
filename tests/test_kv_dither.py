"""V's dithered rounding end to end (--kv-dither, KvConfig.dither, the model's kvq.kv_dither): the real kernels in
llama.cpp's graph, on the backend tests/device.py names. Exact comparisons run the same kernels on the same batch
shapes. The kernels' bytes are judged against the numpy oracle in tests/test_kvq_v_dither.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_kv_clip import assert_model_setting_applies_and_the_call_wins, assert_tool_takes_flag_and_metadata
from test_kvq_sequences import LAYOUTS, assert_as_alone, multi

from pykvq import gguf_metadata, llama_tools
from pykvq.api.llama import KvConfig, LlamaError, Model
from pykvq.bindings import native

import device

N_LAYER = 30  # SmolLM2-135M
N_TOKENS = 160
WINDOW = 16


@pytest.fixture(scope="module")
def tokens(model: Model, hamlet: Path) -> list[int]:
    return model.tokenize(hamlet.read_text(encoding="utf-8"))[1000:1000 + N_TOKENS]


def logits(model: Model, tokens: list[int], **kv: object) -> np.ndarray:
    kv = {"window": WINDOW, "sinks": 0, **kv}
    config = device.context_config(n_ctx=256, n_batch=256, n_threads=2, kv=KvConfig("kivi2", "kivi1", **kv))
    with model.context(config) as ctx:
        return ctx.eval(tokens, all_logits=True)


def test_no_spread_is_nearest_rounding(model: Model, tokens: list[int]) -> None:
    plain = logits(model, tokens)
    np.testing.assert_array_equal(logits(model, tokens, dither="0"), plain)
    np.testing.assert_array_equal(logits(model, tokens, dither="none"), plain)
    np.testing.assert_array_equal(logits(model, tokens, dither="v:*=0"), plain)


def test_dithering_changes_only_what_reads_quantized_v(model: Model, tokens: list[int]) -> None:
    """The window's tokens read V in fp16: their logits stay; later ones read dithered codes."""
    plain = logits(model, tokens)
    dithered = logits(model, tokens, dither="1")
    np.testing.assert_array_equal(dithered[:WINDOW], plain[:WINDOW])
    assert np.abs(dithered[-32:] - plain[-32:]).max() > 1e-2
    half = logits(model, tokens, dither="0.5")
    assert np.abs(half - dithered).max() > 1e-2


def test_per_layer_spreads_apply_to_their_layers(model: Model, tokens: list[int]) -> None:
    plain = logits(model, tokens)
    last = logits(model, tokens, dither=f"v:0-{N_LAYER - 2}=0,{N_LAYER - 1}=1")
    every = logits(model, tokens, dither="1")
    assert 0 < np.abs(last - plain).max() < np.abs(every - plain).max()
    spelled = ",".join(f"{il}={1 if il < 10 else 0.5}" for il in range(N_LAYER))
    np.testing.assert_array_equal(logits(model, tokens, dither=f"v:{spelled}"),
                                  logits(model, tokens, dither="v:0-9=1,10-=0.5"))


@LAYOUTS
def test_a_sequence_draws_the_same_codes_in_any_part(model: Model, hamlet: Path, unified: bool) -> None:
    """The draw follows a token's cell in its own sequence's part: sequences decoded together, in streams or in a
    unified cache's regions, give the logits each gives alone."""
    text = hamlet.read_text()
    seqs = [model.tokenize(text[start:start + 3000], add_special=False)[:140] for start in (30000, 50000)]
    kv = KvConfig("kivi2", "kivi1", window=16, dither="1")
    prompts, steps = [90, 61], 30
    with multi(model, kv, 2, unified) as ctx:
        got = [[v] for v in ctx.eval_seqs({s: seqs[s][:prompts[s]] for s in range(2)}).values()]
        for i in range(steps):
            step = ctx.eval_seqs({s: [seqs[s][prompts[s] + i]] for s in range(2)})
            for s in range(2):
                got[s].append(step[s])
    assert_as_alone(model, kv, [(got[s], seqs[s][:prompts[s] + steps], steps) for s in range(2)])


def test_the_model_s_spreads_apply_and_the_command_line_wins(smollm2: Path, tmp_path: Path, model: Model,
                                                             tokens: list[int]) -> None:
    tagged = tmp_path / "dithered.gguf"
    assert_model_setting_applies_and_the_call_wins(smollm2, tagged, model, gguf_metadata.KEY_DITHER, "dither",
                                                   "v:0-14=1,15-=0.5", "0.25", lambda m, **kv: logits(m, tokens, **kv))
    assert gguf_metadata.read_kvq(tagged)[gguf_metadata.KEY_VERSION] == gguf_metadata.KVQ_VERSION


@pytest.mark.parametrize(("spec", "needle"), [
    ("1.5", "'1.5' is neither a spread in [0, 1] nor a per-layer spec"),
    ("-0.1", "is neither a spread in [0, 1]"),
    ("v:*=nan", "'nan' is not a spread in [0, 1]"),
    ("k:*=0.5", "has a k: part: K's codes are always rounded to nearest"),
    ("v:*", "expected LAYERS=SPREAD, e.g. 0-15=0.5"),
])
def test_a_bad_spec_is_refused_naming_its_part(spec: str, needle: str) -> None:
    escaped = needle.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*").replace("[", r"\[")
    with pytest.raises(ValueError, match=escaped):
        native.set_kvq_dither(spec)
    assert native.kvq_dither() == ""


def test_spreads_for_layers_the_model_lacks_are_refused_at_context_creation(model: Model,
                                                                            tokens: list[int]) -> None:
    with pytest.raises(LlamaError, match="--kv-dither: V dither 'v:0-40=1' .* the model has 30 layers"):
        logits(model, tokens, dither="v:0-40=1")
    with pytest.raises(LlamaError, match="layers 10-29 have no spread"):
        logits(model, tokens, dither="v:0-9=1")


def test_a_bad_model_spread_is_refused_by_every_reader(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    tagged = tmp_path / "bad.gguf"
    gguf_metadata.write_copy(smollm2, tagged, {gguf_metadata.KEY_DITHER: "k:*=1"})
    with pytest.raises(gguf_metadata.GgufError, match="kvq.kv_dither does not fit its 30 layers: .*k: part"):
        gguf_metadata.validate_settings(gguf_metadata.read_kvq(tagged), N_LAYER)
    with pytest.raises(llama_tools.ToolError, match=r"the model's kvq.kv_dither: V dither 'k:\*=1' has a k: part"):
        llama_tools.run_tool("llama-perplexity", [*device.TOOL_ARGS, "-m", str(tagged), "-f", str(hamlet), "-c", "128",
                                                  "-ctk", "kivi2", "-ctv", "kivi2", "-fa", "on"])


def test_llama_perplexity_takes_the_flag_and_the_model_s_spreads(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    assert_tool_takes_flag_and_metadata(smollm2, hamlet, tmp_path / "dithered.gguf", "--kv-dither",
                                        gguf_metadata.KEY_DITHER, "1", type_v="kivi1")
