"""The largest context each KV cache type fits into one GPU, for a model fully offloaded (-ngl 99).

    python bench/max_context.py --model random:llama3-8b [--kv-types f16,q8_0,q4_0,kivi4,kivi2,kivi1]

A context fits when llama.cpp can create it: weights, KV cache and compute buffers allocated on the card.
The search halves the gap between a size that fits and one that does not, down to --step tokens. Writes
bench/results/max-context-<device>.json and prints a table. Meant for the GPU machine: on the CPU the cache's
buffers are cleared page by page, so probing tens of GiB is slow.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

from decode_speed import RESULTS, device_name, resolve_model

from pykvq import kv_types
from pykvq.api.llama import ContextConfig, KvConfig, LlamaError, Model
from pykvq.kv_types import KvSpec

log = logging.getLogger("max_context")


def fits(model: Model, spec: KvSpec, n_ctx: int) -> tuple[bool, int]:
    kv = KvConfig(spec.name, spec.name, rotate=spec.rotate or None, layers=spec.layers or "none")
    try:
        with model.context(ContextConfig(n_ctx=n_ctx, n_batch=512, n_ubatch=512, flash_attn="on", kv=kv)) as ctx:
            return True, ctx.memory().bytes
    except LlamaError:
        return False, 0


def largest(model: Model, spec: KvSpec, low: int, high: int, step: int) -> tuple[int, int]:
    ok, size = fits(model, spec, low)
    if not ok:
        return 0, 0
    best = (low, size)
    while high - low > step:
        mid = (low + high) // 2 // step * step
        ok, size = fits(model, spec, mid)
        log.info("%-12s n_ctx %9d: %s", spec.label, mid, "fits" if ok else "does not fit")
        if ok:
            low, best = mid, (mid, size)
        else:
            high = mid
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--kv-types", default="f16,q8_0,q4_0,kivi4,kivi2,kivi1")
    parser.add_argument("--ngl", type=int, default=99)
    parser.add_argument("--low", type=int, default=4096)
    parser.add_argument("--high", type=int, default=1 << 23)
    parser.add_argument("--step", type=int, default=16384)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path, label = resolve_model(args.model, args.workdir)
    rows = []
    with Model(path, n_gpu_layers=args.ngl) as model:
        for spec in kv_types.parse_list(args.kv_types):
            n_ctx, kv_bytes = largest(model, spec, args.low, args.high, args.step)
            rows.append({"kv_type": spec.label, "max_n_ctx": n_ctx, "kv_gib": kv_bytes / 2**30})
            print(f"{spec.label:<12} {n_ctx:>9} tokens  KV {kv_bytes / 2**30:7.2f} GiB", flush=True)
    device = device_name()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"max-context-{device.replace('NVIDIA ', '').replace(' ', '-').lower()}.json"
    out.write_text(json.dumps({"machine": device, "model": label, "ngl": args.ngl, "step": args.step, "rows": rows},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
