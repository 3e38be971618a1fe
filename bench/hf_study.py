"""The HF form of a dev model (transformers loads the GGUF) with its attention replaced, for the studies that
measure a quantization outside the kernels before it is built into them (pre_rope_k.py, skvq_clip.py)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pykvq import assets

MODELS = {"smollm2": assets.default_model, "qwen2.5-coder-1.5b": assets.qwen_model}


@contextmanager
def studied_model(gguf: Path, name: str, attention: Callable, rope: Callable | None = None) -> Iterator:
    """The HF model of a GGUF whose attention is `attention` (registered under `name`) while the block runs; with
    `rope`, its RoPE is rope(the model's own) too."""
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(name, attention)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation=name)
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = modeling.apply_rotary_pos_emb
    if rope is not None:
        modeling.apply_rotary_pos_emb = rope(original)
    try:
        yield model.eval()
    finally:
        modeling.apply_rotary_pos_emb = original


def perplexity(model, tokens: list[int]) -> float:
    """PPL of the second half of the tokens, each given all before it."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([tokens]), use_cache=False).logits[0].float()
    first = len(tokens) // 2
    nll = torch.nn.functional.cross_entropy(logits[first - 1:-1], torch.tensor(tokens[first:]))
    return math.exp(float(nll))


def study_arguments(description: str) -> argparse.ArgumentParser:
    """The options every study takes: the models, the tokens judged, the fp16 window."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS, reverse=True))
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the judged text (default 1024)")
    parser.add_argument("--window", type=int, help="the fp16 window (default: the library's)")
    return parser


def record_study(results: Path, name: str, record: dict, plot: Callable[[Path, dict], None],
                 table: Callable[[dict], str]) -> None:
    """results/NAME.json and .png, and the table printed."""
    results.mkdir(exist_ok=True)
    out = results / name
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    plot(out.with_suffix(".png"), record)
    print(table(record))


def measure_settings(model, study, settings: list, tokens: list[int], desc: str) -> list[tuple[object, float, float]]:
    """(setting, PPL, ΔPPL % against the first setting's) for each setting the study's attention takes in turn."""
    from tqdm import tqdm

    measured: list[tuple[object, float, float]] = []
    for setting in tqdm(settings, desc=desc, unit="setting"):
        study.setting = setting
        ppl = perplexity(model, tokens)
        measured.append((setting, ppl, 100 * (ppl / measured[0][1] - 1) if measured else 0.0))
    return measured


def ppl_table(record: dict) -> list[str]:
    """The markdown rows of every model's settings, PPL and ΔPPL."""
    lines = ["| model | setting | PPL | ΔPPL vs f16 |", "| --- | --- | ---: | ---: |"]
    for m in record["models"]:
        for r in m["rows"]:
            lines.append(f"| {m['model']} | {r['setting']} | {r['ppl']:.3f} | {r['delta_pct']:+.2f}% |")
    return lines
