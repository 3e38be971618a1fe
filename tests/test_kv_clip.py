"""SKVQ's clipping end to end (--kv-clip, KvConfig.clip, the model's kvq.kv_clip): the real kernels in llama.cpp's
graph, on the backend tests/device.py names. Exact comparisons run the same kernels on the same batch shapes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from pykvq import gguf_metadata, llama_tools
from pykvq.api.llama import KvConfig, LlamaError, Model
from pykvq.bindings import native
from pykvq.kv_types import CLIP_MSE

import device

N_LAYER = 30  # SmolLM2-135M
N_TOKENS = 160


@pytest.fixture(scope="module")
def tokens(model: Model, hamlet: Path) -> list[int]:
    return model.tokenize(hamlet.read_text(encoding="utf-8"))[1000:1000 + N_TOKENS]


def logits(model: Model, tokens: list[int], **kv: object) -> np.ndarray:
    kv = {"window": 16, "sinks": 0, **kv}
    config = device.context_config(n_ctx=256, n_batch=256, n_threads=2, kv=KvConfig("kivi2", "kivi2", **kv))
    with model.context(config) as ctx:
        return ctx.eval(tokens, all_logits=True)


def test_a_ratio_of_one_is_the_plain_format(model: Model, tokens: list[int]) -> None:
    plain = logits(model, tokens)
    np.testing.assert_array_equal(logits(model, tokens, clip="k:*=1;v:*=1"), plain)
    np.testing.assert_array_equal(logits(model, tokens, clip="none"), plain)


def test_clipping_changes_what_the_quantized_cells_say(model: Model, tokens: list[int]) -> None:
    plain = logits(model, tokens)
    k_only = logits(model, tokens, clip="k:*=0.8")
    v_only = logits(model, tokens, clip="v:*=0.8")
    both = logits(model, tokens, clip="k:*=0.8;v:*=0.8")
    # the window (16) and the first tile hold fp16 values: the first tokens read nothing quantized
    for clipped in (k_only, v_only, both):
        np.testing.assert_array_equal(clipped[:16], plain[:16])
        assert np.abs(clipped[-32:] - plain[-32:]).max() > 1e-2
    assert np.abs(both - k_only).max() > 1e-2 and np.abs(both - v_only).max() > 1e-2


def test_mse_searches_each_v_group_in_the_real_cache(model: Model, tokens: list[int]) -> None:
    """v:*=mse reaches the kernels: the first tokens, which read no quantized V, are untouched, later ones move; it
    resolves to GGML_KVQ_CLIP_MSE per layer and mixes with ratios (another spec, other logits)."""
    plain = logits(model, tokens)
    searched = logits(model, tokens, clip="v:*=mse")
    np.testing.assert_array_equal(searched[:16], plain[:16])
    assert np.abs(searched[-32:] - plain[-32:]).max() > 1e-2
    mixed = logits(model, tokens, clip="k:*=0.9;v:0-14=mse,15-=0.8")
    assert np.abs(mixed - searched).max() > 1e-2
    k, v = native.resolve_clip("k:*=0.9;v:0-1=mse,2-=0.8", 4)
    assert k == pytest.approx([0.9] * 4) and v == pytest.approx([CLIP_MSE, CLIP_MSE, 0.8, 0.8])


def test_per_layer_ratios_apply_to_their_layers(model: Model, tokens: list[int]) -> None:
    """A ratio given to some layers only: layers left at 1 are untouched, so clipping only the last layer differs
    less from plain than clipping every layer, and a split spec equals the same ratios written per layer."""
    plain = logits(model, tokens)
    last = logits(model, tokens, clip=f"k:0-{N_LAYER - 2}=1,{N_LAYER - 1}=0.7")
    every = logits(model, tokens, clip="k:*=0.7")
    assert 0 < np.abs(last - plain).max() < np.abs(every - plain).max()
    split = logits(model, tokens, clip="k:0-9=0.9,10-=0.8;v:0-14=1,15-=0.75")
    spelled = ",".join(f"{il}={0.9 if il < 10 else 0.8}" for il in range(N_LAYER))
    spelled_v = ",".join(f"{il}={1 if il < 15 else 0.75}" for il in range(N_LAYER))
    np.testing.assert_array_equal(logits(model, tokens, clip=f"k:{spelled};v:{spelled_v}"), split)


def assert_model_setting_applies_and_the_call_wins(smollm2: Path, tagged: Path, model: Model, key: str, field: str,
                                                   value: str, override: str,
                                                   logits_of: Callable[..., np.ndarray]) -> None:
    """A copy of the model whose ``key`` holds ``value`` gives what KvConfig's ``field`` = value gives on the model;
    ``override`` given on the copy wins, and "none" ignores the copy's value."""
    gguf_metadata.write_copy(smollm2, tagged, {key: value})
    with device.load_model(tagged) as m:
        got = [logits_of(m, **{field: given}) for given in (None, override, "none")]
    want = [logits_of(model, **{field: given}) for given in (value, override, None)]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_model_s_ratios_apply_and_the_command_line_wins(smollm2: Path, tmp_path: Path, model: Model,
                                                            tokens: list[int]) -> None:
    assert_model_setting_applies_and_the_call_wins(smollm2, tmp_path / "clipped.gguf", model, gguf_metadata.KEY_CLIP,
                                                   "clip", "k:*=0.85;v:*=0.8", "v:*=0.9",
                                                   lambda m, **kv: logits(m, tokens, **kv))


@pytest.mark.parametrize(("spec", "needle"), [
    ("k:*=1.2", "'1.2' is not a clip ratio in (0, 1] or mse"),
    ("v:*=MSE", "'MSE' is not a clip ratio in (0, 1] or mse"),
    ("k:*=0", "'0' is not a clip ratio in (0, 1]"),
    ("k:*=nan", "'nan' is not a clip ratio in (0, 1]"),
    ("k:*=kivi2", "'kivi2' is not a clip ratio"),
    ("asymkv:16/0", "a part starts with k: or v:"),
    ("k:*", "expected LAYERS=RATIO, e.g. 0-15=0.9"),
])
def test_a_bad_spec_is_refused_naming_its_part(spec: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        native.set_kvq_clip(spec)
    assert native.kvq_clip() == ""


def test_ratios_for_layers_the_model_lacks_are_refused_at_context_creation(model: Model, tokens: list[int]) -> None:
    with pytest.raises(LlamaError, match="--kv-clip: clip ratios 'k:0-40=0.9' .* the model has 30 layers"):
        logits(model, tokens, clip="k:0-40=0.9")
    with pytest.raises(LlamaError, match="layers 10-29 have no ratio"):
        logits(model, tokens, clip="k:0-9=0.9")


def assert_tool_takes_flag_and_metadata(smollm2: Path, hamlet: Path, tagged: Path, flag: str, key: str, value: str,
                                        type_v: str = "kivi2") -> None:
    """llama-perplexity (kivi2 K, ``type_v`` V) with ``flag value`` differs from without it, equals a copy of the model
    whose ``key`` holds the value, and ``flag none`` on that copy equals the plain model."""
    base = [*device.TOOL_ARGS, "-f", str(hamlet), "-c", "256", "-b", "256", "--chunks", "1", "-t", "2", "-fa", "on",
            "-ctk", "kivi2", "-ctv", type_v, "--kv-window", "16"]

    def ppl(model: Path, *args: str) -> float:
        return llama_tools.parse_perplexity(llama_tools.run_tool("llama-perplexity",
                                                                 [*base, "-m", str(model), *args])).ppl

    gguf_metadata.write_copy(smollm2, tagged, {key: value})
    flagged = ppl(smollm2, flag, value)
    assert flagged != ppl(smollm2)
    assert ppl(tagged) == flagged
    assert ppl(tagged, flag, "none") == ppl(smollm2)


def test_llama_perplexity_takes_the_flag_and_the_model_s_ratios(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    assert_tool_takes_flag_and_metadata(smollm2, hamlet, tmp_path / "clipped.gguf", "--kv-clip", gguf_metadata.KEY_CLIP,
                                        "k:*=0.85;v:*=0.8")


def test_a_version_1_file_is_still_read(smollm2: Path, tmp_path: Path, model: Model, tokens: list[int]) -> None:
    """Version 2 added kvq.kv_clip; a file written before it keeps its meaning, for pykvq and for llama.cpp."""
    old = tmp_path / "v1.gguf"
    gguf_metadata.write_copy(smollm2, old, {gguf_metadata.KEY_VERSION: 1, gguf_metadata.KEY_LAYERS: "asymkv:30/20",
                                            gguf_metadata.KEY_SINKS: 2})
    assert gguf_metadata.read_kvq(old)[gguf_metadata.KEY_VERSION] == 1
    with device.load_model(old) as m:
        from_model = logits(m, tokens, sinks=None)
    np.testing.assert_array_equal(from_model, logits(model, tokens, sinks=2, layers="asymkv:30/20"))
