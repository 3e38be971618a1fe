"""A calibrated copy's clip ratios at each width (pykvq.width_clips): a cache whose types are not the copy's
kvq.kv_layers clips each tensor at its width's ratio, through the API and llama.cpp's tools (the cache's own rule,
kvq_clips_by_width) and through `pykvq run` and `pykvq perplexity`. The real kernels on the backend tests/device.py
names; exact comparisons run the same kernels on the same batch shapes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pykvq import gguf_metadata, llama_tools, width_clips
from pykvq.api.llama import KvConfig, Model
from pykvq.commands import perplexity

import device

N_LAYER = 30  # SmolLM2-135M
N_TOKENS = 160
WIDTHS = {"kivi4": "k:*=0.97;v:*=0.99", "kivi2": "k:*=0.9;v:*=0.85", "kivi1": "k:*=0.75;v:*=0.7"}
# the copy's mix and its kvq.kv_clip, as pykvq calibrate writes them: each tensor at its width's ratio
MIX = "k:0-9=kivi4,10-29=kivi2;v:0-9=kivi1,10-29=kivi2"
MIX_CLIP = "k:0-9=0.97,10-29=0.9;v:0-9=0.7,10-29=0.85"


@pytest.fixture(scope="module")
def tokens(model: Model, hamlet: Path) -> list[int]:
    return model.tokenize(hamlet.read_text(encoding="utf-8"))[1000:1000 + N_TOKENS]


def calibrated_copy(smollm2: Path, path: Path, widths: dict[str, str] = WIDTHS) -> Path:
    gguf_metadata.write_copy(smollm2, path, {gguf_metadata.KEY_LAYERS: MIX, gguf_metadata.KEY_CLIP: MIX_CLIP,
                                             **{gguf_metadata.WIDTH_CLIP_KEYS[w]: s for w, s in widths.items()}})
    return path


def logits(model: Model, tokens: list[int], **kv: object) -> np.ndarray:
    config = device.context_config(n_ctx=256, n_batch=256, n_threads=2,
                                   kv=KvConfig("kivi2", "kivi2", window=16, sinks=0, **kv))
    with model.context(config) as ctx:
        return ctx.eval(tokens, all_logits=True)


def test_each_tensor_takes_its_width_s_ratio() -> None:
    kvq = {gguf_metadata.WIDTH_CLIP_KEYS[w]: s for w, s in WIDTHS.items()}
    types_k = ["kivi4"] * 2 + ["kivi1"]
    types_v = ["kivi2", "f16", "kivi1"]
    assert width_clips.clip_by_width(kvq, types_k, types_v) == "k:0-1=0.97,2=0.75;v:0=0.85,1=1,2=0.7"
    # a width in use without its ratios, or no kivi layer: nothing to say
    del kvq[gguf_metadata.WIDTH_CLIP_KEYS["kivi1"]]
    assert width_clips.clip_by_width(kvq, types_k, types_v) is None
    assert width_clips.clip_by_width(kvq, ["f16"] * 3, ["f16"] * 3) is None


def test_types_other_than_the_copy_s_clip_at_their_widths(smollm2: Path, tmp_path: Path, model: Model,
                                                         tokens: list[int]) -> None:
    with device.load_model(calibrated_copy(smollm2, tmp_path / "calibrated.gguf")) as copy:
        own = logits(copy, tokens)
        kivi2 = logits(copy, tokens, layers="none")
        other = logits(copy, tokens, layers="k:0-14=kivi4,15-29=kivi1")
        given = logits(copy, tokens, layers="none", clip="none")
    # the copy's own mix runs with its kvq.kv_clip
    np.testing.assert_array_equal(own, logits(model, tokens, layers=MIX, clip=MIX_CLIP))
    np.testing.assert_array_equal(kivi2, logits(model, tokens, layers="none", clip=WIDTHS["kivi2"]))
    # what kvq.kv_clip would have given it (1-bit V's 0.7 in layers 0-9) differs
    assert not np.array_equal(kivi2, logits(model, tokens, layers="none", clip=MIX_CLIP))
    np.testing.assert_array_equal(other, logits(model, tokens, layers="k:0-14=kivi4,15-29=kivi1",
                                                clip="k:0-14=0.97,15-29=0.75;v:*=0.85"))
    # a clip given wins
    np.testing.assert_array_equal(given, logits(model, tokens, layers="none"))


def test_a_copy_without_a_width_s_ratios_keeps_its_kvq_kv_clip(smollm2: Path, tmp_path: Path, model: Model,
                                                               tokens: list[int]) -> None:
    """Copies from before the per-width ratios (kvq.calibration.kivi2_clip alone) read as they did."""
    older = calibrated_copy(smollm2, tmp_path / "older.gguf", {"kivi2": WIDTHS["kivi2"]})
    with device.load_model(older) as copy:
        kivi1 = logits(copy, tokens, layers="k:*=kivi1;v:*=kivi1")
    np.testing.assert_array_equal(kivi1, logits(model, tokens, layers="k:*=kivi1;v:*=kivi1", clip=MIX_CLIP))


def test_pykvq_run_says_which_ratios_it_runs_with(smollm2: Path, tmp_path: Path) -> None:
    copy = calibrated_copy(smollm2, tmp_path / "calibrated.gguf")
    proc = subprocess.run([sys.executable, "-P", "-m", "pykvq", "run", *device.TOOL_ARGS, "-m", str(copy), "-p",
                           "Hello", "-n", "2", "-c", "256", "-t", "2", "--kv-type", "kivi2"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "clip k:0-29=0.9;v:0-29=0.85" in proc.stderr and "kvq.calibration.kivi*_clip" in proc.stderr


def test_perplexity_runs_each_type_at_its_widths_ratios(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    """`pykvq perplexity` on the copy (kivi2 everywhere and the copy's mix), against llama-perplexity on the model
    given each run's ratios."""
    copy = calibrated_copy(smollm2, tmp_path / "calibrated.gguf")
    common = ["-f", str(hamlet), "-c", "256", "--chunks", "1", "-t", "2"]
    proc = subprocess.run([sys.executable, "-P", "-m", "pykvq", "perplexity", *device.TOOL_ARGS, "-m", str(copy),
                           *common, "--kv-types", "kivi2", "-o", str(tmp_path / "runs")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    _, runs = perplexity.load_json(tmp_path / "runs.json")
    got = {r.kv_type: r.ppl for r in runs}

    def ppl(layers: str, clip: str) -> float:
        args = [*device.TOOL_ARGS, "-m", str(smollm2), *common, "-b", "256", "-fa", "on", "-ctk", "kivi2", "-ctv",
                "kivi2", "--kv-layers", layers, "--kv-clip", clip]
        return llama_tools.parse_perplexity(llama_tools.run_tool("llama-perplexity", args)).ppl

    assert got["kivi2"] == ppl("none", WIDTHS["kivi2"])
    assert got[MIX] == ppl(MIX, MIX_CLIP)


@pytest.mark.parametrize(("kvq", "words"), [
    ({}, None),
    ({gguf_metadata.KEY_CLIP: "none", **{key: "none" for key in gguf_metadata.WIDTH_CLIP_KEYS.values()}}, None),
    ({gguf_metadata.KEY_CLIP: MIX_CLIP}, f"the model's kvq.kv_clip {MIX_CLIP}"),
    ({gguf_metadata.KEY_CLIP: MIX_CLIP, gguf_metadata.WIDTH_CLIP_KEYS["kivi2"]: WIDTHS["kivi2"]},
     "each tensor's ratio at its width"),
])
def test_perplexity_says_which_of_the_model_s_ratios_its_runs_take(kvq: dict[str, object], words: str | None) -> None:
    """A copy calibrated with --kv-clip none was said to clip each tensor at its width's ratio."""
    said = perplexity.model_clip_words(kvq)
    assert (said is None) == (words is None)
    assert words is None or said.startswith(words)
