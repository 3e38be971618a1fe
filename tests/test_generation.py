"""Generation through pykvq's cffi bindings (pykvq.Model), against upstream's own llama-completion."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pykvq import KvConfig, Model, Sampler, SamplerSettings
from pykvq.kv_types import bits_per_element
from pykvq.llama_tools import run_tool

import device

PROMPT = "Once upon a time"
N_PREDICT = 40


@pytest.fixture(scope="module")
def hamlet_tokens(model: Model, hamlet: Path) -> list[int]:
    return model.tokenize(hamlet.read_text()[20000:26000])[:600]


def generate(model: Model, prompt: str, sampling: SamplerSettings, kv: KvConfig | None = None) -> str:
    kv = kv or KvConfig()
    with model.context(device.context_config(n_ctx=1024, n_threads=2, kv=kv)) as ctx:
        return "".join(ctx.generate_text(model.tokenize(prompt, parse_special=True), N_PREDICT, Sampler(sampling)))


def llama_completion(model_path: Path, prompt: str, extra: list[str]) -> str:
    out = run_tool("llama-completion", [*device.TOOL_ARGS,
                                        "-m", str(model_path), "-p", prompt, "-n", str(N_PREDICT), "-no-cnv",
                                        "-t", "2", "-c", "1024", "--no-warmup", *extra])
    # stdout (first in the combined output) is the prompt and the generated text, then the log
    assert out.startswith(prompt)
    return out


@pytest.mark.parametrize("sampling, flags", [
    (SamplerSettings(temp=0), ["--temp", "0"]),
    (SamplerSettings(seed=42), ["--seed", "42"]),
], ids=["greedy", "seed42"])
def test_f16_generation_equals_llama_completion(model: Model, smollm2: Path, sampling, flags) -> None:
    ours = generate(model, PROMPT, sampling)
    assert len(ours) > 40
    upstream = llama_completion(smollm2, PROMPT, flags)
    assert upstream[len(PROMPT):].startswith(ours)


def test_kivi_settings_reach_the_cache(model: Model, smollm2: Path, hamlet: Path) -> None:
    """A prompt longer than the window: with window 32 every cached token past 32 is 2-bit, and the output must
    equal upstream's tool given the same settings (and differ from window 512, where nothing is quantized)."""
    prompt = model.detokenize(model.tokenize(hamlet.read_text()[30000:31200], add_special=False))
    greedy = SamplerSettings(temp=0)
    ours = generate(model, prompt, greedy, KvConfig.preset("kivi2", window=32))
    upstream = llama_completion(smollm2, prompt, ["--temp", "0", "-fa", "on", "-ctk", "kivi2", "-ctv", "kivi2",
                                                  "--kv-window", "32"])
    assert upstream[len(prompt):].startswith(ours)
    assert ours != generate(model, prompt, greedy, KvConfig.preset("kivi2", window=512))


def test_greedy_generation_is_deterministic(model: Model) -> None:
    greedy = SamplerSettings(temp=0)
    kv = KvConfig.preset("kivi2", window=16)
    assert generate(model, PROMPT, greedy, kv) == generate(model, PROMPT, greedy, kv)


def test_seeded_sampling_is_reproducible_and_seed_dependent(model: Model) -> None:
    runs = [generate(model, PROMPT, SamplerSettings(seed=s)) for s in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]


def next_token_predictions(model: Model, tokens: list[int], kv: KvConfig) -> np.ndarray:
    with model.context(device.context_config(n_ctx=1024, n_threads=2, kv=kv)) as ctx:
        return ctx.eval(tokens, all_logits=True).argmax(axis=1)


def test_kivi_top1_agreement_with_f16(model: Model, hamlet_tokens: list[int]) -> None:
    """Teacher-forced next-token predictions over 600 Hamlet tokens; scored where the cache is quantized (past
    the 128-token window and its 32-token tile). Measured on this model: kivi4 0.92, q4_0 0.85, kivi2 0.73,
    kivi1 0.11 (kivi2's PPL is +20% here, bench/results/perplexity-c2048.json). The thresholds leave a margin
    under those figures; kivi1 shows the measure does see quantization."""
    scored = slice(160, None)
    f16 = next_token_predictions(model, hamlet_tokens, KvConfig())[scored]

    def agreement(name: str) -> float:
        return float(np.mean(next_token_predictions(model, hamlet_tokens, KvConfig.preset(name))[scored] == f16))

    assert agreement("kivi4") >= 0.85
    assert agreement("kivi2") >= 0.65
    assert agreement("kivi1") < 0.5


@pytest.mark.parametrize("name, window, sinks", [("f16", 128, 0), ("q8_0", 128, 0), ("kivi2", 128, 0),
                                                 ("kivi4", 64, 4), ("kivi1", 0, 0)])
def test_reported_kv_memory_matches_the_formula(model: Model, name: str, window: int, sinks: int) -> None:
    with model.context(device.context_config(n_ctx=1024, kv=KvConfig.preset(name, window=window, sinks=sinks))) as ctx:
        memory = ctx.memory()
    assert memory.n_cells == 1024 and memory.n_layers == model.n_layer
    assert memory.f16_bytes == 2 * memory.n_elements
    expected = bits_per_element(name, memory.n_cells, window, sinks) * memory.n_elements / 8
    # buffers round each tensor up to the backend's alignment: at most a few hundred bytes a tensor
    assert expected <= memory.bytes <= expected + 4 * memory.n_layers * 512
