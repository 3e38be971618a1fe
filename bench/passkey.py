"""Long-context retrieval per KV cache type: a pass key hidden at depths 0-100% of filler text, several lengths.

    python bench/passkey.py [--lengths 1024 2048 4096] [--depths 0 25 50 75 100] [--trials 3]
    python bench/passkey.py --model path/to/model.gguf --kv-types f16,q4_0,kivi2,asymkv:16/8 --ngl 99
    python bench/passkey.py --kv-types f16,kivi2 --kv-select 0.25,0.25 0.125,0.125
    python bench/passkey.py --model model.kvq.gguf --kv-types f16 --kv-layers 'k:0-9=kivi4,10-=kivi2;v:*=kivi2'
    python bench/passkey.py --model model.kvq.gguf --kv-types f16,kivi2 --kv-rotate off --kv-clip none
    python bench/passkey.py --model model.kvq.gguf --kv-types f16 --kv-layers 'asymkv:16/8' --kv-dither 1

Each prompt is filler text of about `length` tokens with "The pass key is NNNNN. Remember it." at `depth`
percent of it, then "What is the pass key? The pass key is"; the answer is decoded greedily and counts when
its first number is the key; each answer also records the probability of the key's first token where the answer
starts and its margin over the likeliest other token (a near-tie in f16 itself makes that prompt a coin toss for any
perturbation of the cache). --kv-select adds, for each kivi type, a run per MiniKV selection (heavy-hitter and
recent shares of the prompt; the prompt then goes in as one ubatch). --kv-rotate, --kv-clip and --kv-dither set the
kivi runs' rotation, clip ratios and V dither over the model's kvq.kv_rotate / kvq.kv_clip / kvq.kv_dither (e.g. to
take a calibrated recipe apart).
--filler hides the key in a text's lines instead of the repeated ones (prose: each prompt a stretch of it from a line
its key picks). Every type sees the same prompts (the same keys, from --seed). A type is judged against f16 at the
depths and lengths the model itself gets right there. Writes bench/results/passkey-<model>-<lengths>.json and .png
(accuracy heat maps, one per type) and prints a table.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from decode_speed import RESULTS, model_tag, resolve_model, save_results
import options
from tqdm import tqdm

from pykvq import assets, kv_types
from pykvq.api.llama import ContextConfig, KvConfig, Model
from pykvq.commands import arguments
from pykvq.kv_types import KvSpec


INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about it.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
N_ANSWER = 8  # tokens decoded: a five-digit key and some slack
DEPTHS = [0, 25, 50, 75, 100]  # percent of the filler before the key
_NUMBER = re.compile(r"\d+")
TITLE_WIDTH = 40  # characters of a heat map's title per line


@dataclass(frozen=True)
class Prompt:
    length: int   # the context length it was built for
    depth: int    # percent of the filler before the key
    key: str
    tokens: list[int]


@dataclass(frozen=True)
class Filler:
    """What hides the key: ``lines`` in order, from a start line, wrapping round (one line: the classic repeated
    filler; a text's lines: prose)."""

    name: str
    lines: tuple[str, ...]

    @classmethod
    def of_text(cls, name: str) -> Filler:
        """The non-empty lines of one of the test data's Shakespeare texts."""
        text = assets.shakespeare_text(name).read_text(encoding="utf-8")
        return cls(name, tuple(line.strip() + "\n" for line in text.splitlines() if line.strip()))

    @property
    def repeated(self) -> bool:
        """One line over and over: counted by its mean token count, so the prompts stay those of earlier records."""
        return len(self.lines) == 1

    def stretch(self, model: Model, n_tokens: int, key: str) -> list[str]:
        """Whole lines of about ``n_tokens`` tokens, from a line the key picks (every prompt its own stretch)."""
        if self.repeated:
            per_line = len(model.tokenize(self.lines[0] * 10, add_special=False)) / 10
            return list(self.lines) * max(0, int(n_tokens / per_line))
        out: list[str] = []
        used = 0
        start = int(key) % len(self.lines)
        while True:
            line = self.lines[(start + len(out)) % len(self.lines)]
            used += len(model.tokenize(line, add_special=False))
            if used > n_tokens:
                return out
            out.append(line)


REPEATED = Filler("repeated", (FILLER,))


def build_prompt(model: Model, length: int, depth: int, key: str, filler: Filler = REPEATED) -> Prompt:
    """Whole filler lines around the key, as many as fit `length` tokens with the question and answer."""
    fixed = len(model.tokenize(INTRO + NEEDLE.format(key=key) + QUESTION)) + N_ANSWER
    lines = filler.stretch(model, length - fixed, key)
    while True:
        before = round(len(lines) * depth / 100)
        text = INTRO + "".join(lines[:before]) + NEEDLE.format(key=key) + "".join(lines[before:]) + QUESTION
        tokens = model.tokenize(text)
        # lines tokenized alone can merge into fewer tokens than together, never many more: a line less fits
        if len(tokens) + N_ANSWER <= length or not lines or filler.repeated:
            break
        lines = lines[:-1]
    if len(tokens) + N_ANSWER > length:
        raise ValueError(f"the prompt for length {length} came out at {len(tokens)} tokens")
    return Prompt(length, depth, key, tokens)


@dataclass(frozen=True)
class Setting:
    spec: KvSpec
    select: kv_types.Selection | None = None
    sinks: int | None = None  # kivi types only
    rotate: str | None = None  # kivi types only: the --kv-rotate spec, None: +rot, else the model's
    clip: str | None = None    # kivi types only: the --kv-clip spec, None: the model's
    dither: str | None = None  # kivi types only: the --kv-dither spec, None: the model's

    @property
    def label(self) -> str:
        label = self.spec.label + (f" +{self.sinks} sinks" if self.sinks else "")
        label += "".join(f" {what} {value}" for what, value in (("rot", self.rotate), ("clip", self.clip),
                                                                ("dither", self.dither)) if value is not None)
        if self.select is None:
            return label
        return f"{label} sel {kv_types.selection_label(self.select)}"


def kv_config(setting: Setting) -> KvConfig:
    spec = setting.spec
    rotate = setting.rotate if setting.rotate is not None else (True if spec.rotate else None)
    return KvConfig(spec.name, spec.name, rotate=rotate, layers=spec.layers or "none", select=setting.select,
                    sinks=setting.sinks, clip=setting.clip, dither=setting.dither)


def settings_of(specs: list[KvSpec], selects: list[kv_types.Selection], sinks: int | None = None,
                rotate: str | None = None, clip: str | None = None, dither: str | None = None) -> list[Setting]:
    """Each type as given, then each kivi type under each selection; kivi types with `sinks` sinks, rotated, clipped
    and V-dithered as given."""
    def setting(spec: KvSpec, select: kv_types.Selection | None = None) -> Setting:
        if not spec.is_kivi:
            return Setting(spec, select)
        return Setting(spec, select, sinks, rotate, clip, dither)

    plain = [setting(spec) for spec in specs]
    return plain + [setting(spec, select) for select in selects for spec in specs if spec.is_kivi]


@dataclass(frozen=True)
class Answer:
    text: str       # the greedy continuation
    p_key: float    # probability of the key's first token where the answer starts
    p_other: float  # the highest probability of any other token there

    @property
    def margin(self) -> float:
        """How far the key's first token leads (negative: another token is decoded instead)."""
        return self.p_key - self.p_other


def first_token_odds(model: Model, logits: np.ndarray, key: str) -> tuple[float, float]:
    """The probability of the key's first token (as f16 writes the answer: a space, then the key) and the highest
    of every other token's."""
    logits = np.asarray(logits, np.float64)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    first = model.tokenize(f" {key}", add_special=False)[0]
    return float(probs[first]), float(np.delete(probs, first).max())


def answer(model: Model, config: ContextConfig, prompt: Prompt) -> Answer:
    """The greedy continuation of the prompt, and the odds of its first token."""
    out: list[int] = []
    with model.context(config) as ctx:
        logits = ctx.eval(prompt.tokens)
        odds = first_token_odds(model, logits, prompt.key)
        for _ in range(N_ANSWER):
            token = int(np.argmax(logits))
            if model.is_eog(token):
                break
            out.append(token)
            logits = ctx.eval([token])
    return Answer(model.detokenize(out), *odds)


def found(text: str, key: str) -> bool:
    number = _NUMBER.search(text)
    return number is not None and number.group() == key


def run(model: Model, settings: list[Setting], prompts: list[Prompt], threads: int) -> list[dict]:
    rows = []
    with tqdm(total=len(settings) * len(prompts), desc="passkey", unit="prompt") as bar:
        for setting in settings:
            for prompt in prompts:
                # a selecting prompt goes in as one ubatch
                n_batch = prompt.length if setting.select else 512
                config = ContextConfig(n_ctx=prompt.length, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                                       flash_attn="on", kv=kv_config(setting))
                got = answer(model, config, prompt)
                rows.append({"kv_type": setting.label, "length": prompt.length, "depth": prompt.depth,
                             "key": prompt.key, "answer": got.text, "correct": found(got.text, prompt.key),
                             "p_key": got.p_key, "margin": got.margin})
                bar.update()
    return rows


def accuracy(rows: list[dict], kv_type: str, length: int, depth: int) -> float:
    mine = [r["correct"] for r in rows if r["kv_type"] == kv_type and r["length"] == length and r["depth"] == depth]
    return sum(mine) / len(mine)


def summary(record: dict) -> list[dict]:
    """Per type: mean accuracy, and the cells where f16 is always right but the type is not."""
    rows, lengths, depths = record["rows"], record["lengths"], record["depths"]
    out = []
    for kv_type in record["kv_types"]:
        cells = [(n, d) for n in lengths for d in depths]
        misses = [f"{n}@{d}%" for n, d in cells
                  if accuracy(rows, "f16", n, d) == 1.0 and accuracy(rows, kv_type, n, d) < 1.0]
        mean = sum(accuracy(rows, kv_type, n, d) for n, d in cells) / len(cells)
        entry = {"kv_type": kv_type, "accuracy": mean, "below_f16": misses}
        margins = [r["margin"] for r in rows if r["kv_type"] == kv_type and "margin" in r]
        if margins:  # records before the margin was kept have none
            entry["mean_margin"] = float(np.mean(margins))
        out.append(entry)
    return out


def table(record: dict) -> str:
    lengths, depths = record["lengths"], record["depths"]
    head = f"{'KV type':<16} {'length':>6} " + " ".join(f"{d:>5}%" for d in depths)
    lines = [head, "-" * len(head)]
    for kv_type in record["kv_types"]:
        for n in lengths:
            cells = " ".join(f"{accuracy(record['rows'], kv_type, n, d):>6.2f}" for d in depths)
            lines.append(f"{kv_type:<16} {n:>6} {cells}")
    lines.append("")
    for s in record["summary"]:
        missed = ", ".join(s["below_f16"]) or "none"
        margin = f", mean margin of the key's first token {s['mean_margin']:+.3f}" if "mean_margin" in s else ""
        lines.append(f"{s['kv_type']:<16} mean accuracy {s['accuracy']:.2f}{margin}; below f16 where f16 is right: "
                     f"{missed}")
    return "\n".join(lines)


def plot(path: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kv_types, lengths, depths = record["kv_types"], record["lengths"], record["depths"]
    fig, axes = plt.subplots(1, len(kv_types), figsize=(2.6 * len(kv_types) + 1, 3.2), squeeze=False,
                             layout="constrained")
    for ax, kv_type in zip(axes[0], kv_types, strict=True):
        grid = np.array([[accuracy(record["rows"], kv_type, n, d) for n in lengths] for d in depths])
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        # a per-layer mix's spec is hundreds of characters: wrapped, it stays over its own map
        title = textwrap.fill(kv_type, TITLE_WIDTH, break_on_hyphens=False)
        ax.set_title(title, fontsize=9 if len(kv_type) <= TITLE_WIDTH else 6)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths], fontsize=7)
        ax.set_xlabel("context length", fontsize=8)
    axes[0][0].set_ylabel("key depth", fontsize=8)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    fig.suptitle(f"pass key retrieval, {record['model']}", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, qwen2.5-coder-1.5b, random:SHAPE or a GGUF path")
    p.add_argument("--kv-types", default="f16,q8_0,q4_0,kivi4,kivi2",
                   help="comma-separated, as pykvq perplexity takes them (f16 first: the reference)")
    p.add_argument("--kv-layers", action="append", default=[], metavar="SPEC",
                   help="also run per-layer types, e.g. a calibrated model's kvq.kv_layers (its rotation, clip "
                        "ratios and sinks apply as the model says); repeatable")
    p.add_argument("--kv-select", metavar="HH,RW[,N[,D]]", nargs="*", default=[], type=kv_types.parse_select,
                   help="MiniKV selections to run each kivi type under, e.g. 0.25,0.25 0.125,0.125")
    p.add_argument("--kv-sinks", type=options.sink_count,
                   help="sinks of the kivi types (default: the model's kvq.sinks, else 0)")
    p.add_argument("--kv-rotate", type=arguments.rotation, metavar="on|off|SPEC",
                   help="rotation of the kivi types (default: +rot, else the model's kvq.kv_rotate, else off)")
    p.add_argument("--kv-clip", metavar="none|SPEC",
                   help="SKVQ's clip ratios of the kivi types (default: the model's kvq.kv_clip, else none)")
    p.add_argument("--kv-dither", metavar="none|SPREAD|SPEC",
                   help="V's dithered rounding of the kivi types (default: the model's kvq.kv_dither, else none)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--depths", type=int, nargs="+", default=DEPTHS)
    p.add_argument("--trials", type=int, default=3, help="keys per length and depth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--filler", metavar="TEXT",
                   help="hide the key in the lines of this Shakespeare text of the test data (e.g. hamlet_gut) "
                        "instead of the repeated ones")
    p.add_argument("--ngl", type=int, default=0, help="layers on the GPU (99: all)")
    p.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--study", metavar="NAME", type=options.study_name,
                   help="what this run takes apart, e.g. v-halves: its record is kept apart under that name and its "
                        "table is captioned with it")
    args = p.parse_args(argv)
    specs = [KvSpec.parse(t) for t in args.kv_types.split(",") if t.strip()]
    specs += [KvSpec.per_layer(spec) for spec in args.kv_layers]
    if not specs or specs[0].label != "f16":
        p.error("--kv-types must start with f16, the reference the others are judged against")
    if any(not 0 <= d <= 100 for d in args.depths) or args.trials < 1 or any(n < 128 for n in args.lengths):
        p.error("depths are percentages 0..100, trials at least 1, lengths at least 128 tokens")
    args.settings = settings_of(specs, args.kv_select, args.kv_sinks, args.kv_rotate, args.kv_clip, args.kv_dither)
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    path, name = resolve_model(args.model, args.workdir)
    rng = np.random.default_rng(args.seed)
    with Model(path, n_gpu_layers=args.ngl) as model:
        too_long = [n for n in args.lengths if n > model.n_ctx_train]
        if too_long:
            raise SystemExit(f"error: lengths {too_long} exceed the model's training context {model.n_ctx_train}")
        try:
            filler = REPEATED if args.filler is None else Filler.of_text(args.filler)
        except assets.AssetError as e:
            raise SystemExit(f"error: --filler {args.filler}: {e}") from e
        prompts = [build_prompt(model, n, d, str(rng.integers(10000, 100000)), filler)
                   for n in args.lengths for d in args.depths for _ in range(args.trials)]
        rows = run(model, args.settings, prompts, args.threads)
    record = {"model": name, "lengths": args.lengths, "depths": args.depths, "trials": args.trials,
              "seed": args.seed, "ngl": args.ngl, "kv_sinks": args.kv_sinks, "kv_rotate": args.kv_rotate,
              "kv_clip": args.kv_clip, "kv_dither": args.kv_dither, "study": args.study, "filler": args.filler,
              "kv_types": [s.label for s in args.settings], "rows": rows}
    record["summary"] = summary(record)
    # a run at some depths only must not overwrite the record of every depth
    variant = "" if args.depths == DEPTHS else "-at-" + "-".join(map(str, args.depths))
    variant += ("-select" if args.kv_select else "") + (f"-sinks{args.kv_sinks}" if args.kv_sinks else "")
    variant += "".join(f"-{what}-{value if value in ('on', 'off', 'none') else 'spec'}"
                       for what, value in (("rot", args.kv_rotate), ("clip", args.kv_clip), ("dither", args.kv_dither))
                       if value is not None)
    variant += f"-in-{args.filler.replace('_', '-')}" if args.filler else ""
    variant += f"-{args.study}" if args.study else ""
    save_results(RESULTS / f"passkey-{model_tag(name)}-{'-'.join(map(str, args.lengths))}{variant}", record, plot,
                 table)


if __name__ == "__main__":
    main()
