"""Prefill speed per KV cache type, kivi types through the fused kernel and through flash attention over wide
cells (LLAMA_KVQ_FA_PREFILL), measured with the real llama-batched-bench.

    python bench/prefill_speed.py [--depth 2048] [--kv-types f16,q8_0,q4_0,kivi4,kivi2]      # CPU, SmolLM2-135M
    python bench/prefill_speed.py --model random:llama3-8b --ngl 99 --depth 4096 32768

Writes bench/results/prefill-speed-<device>-<depth>.json and prints a table: prefill tokens/s (S_PP of a prompt
of `depth` tokens, in batches of --ubatch tokens) and its ratio to f16. With several --ubatch sizes it sweeps the
batch size, as a chunked prefill or a long context's small batches see it, and reports per kivi type and depth the
smallest batch from which flash attention over wide cells outruns the fused kernel (and stays ahead): where
LLAMA_KVQ_FA_PREFILL's threshold (KVQ_WIDE_MIN_TOKENS in native/src/llama-kvq-cache.cpp) belongs on that device.

    python bench/prefill_speed.py --model random:llama3-8b --ngl 99 --depth 4096 16384 --ubatch 8 16 32 64 128 256 \\
        --kv-types f16,kivi2
"""

from __future__ import annotations

import argparse
import json
import os

from decode_speed import RESULTS, add_machine_args, best_of_rounds, machine, measure_once, resolve_model

from pykvq import kv_types
from pykvq.kv_types import KvSpec

# LLAMA_KVQ_FA_PREFILL per prefill path of the kivi types: the fused kernel for every batch, or flash attention over
# wide cells for every batch
PATHS = {"fused": "1000000000", "flash": "1"}
ENV = "LLAMA_KVQ_FA_PREFILL"
DEFAULT_UBATCH = 512


def flash_from(rows: list[dict]) -> list[dict]:
    """Per kivi type and depth: the smallest swept batch size from which the flash path is at least as fast as the
    fused kernel at that size and every larger one (None where it never is)."""
    out = []
    for kv_type, depth in dict.fromkeys((r["kv_type"], r["depth"]) for r in rows if r["prefill_path"] != "-"):
        rate = {(r["ubatch"], r["prefill_path"]): r["prefill_tps"] for r in rows
                if (r["kv_type"], r["depth"]) == (kv_type, depth)}
        ubatches = sorted({u for u, _ in rate})
        ahead = [bool(rate[(u, "flash")] and rate[(u, "fused")] and rate[(u, "flash")] >= rate[(u, "fused")])
                 for u in ubatches]
        first = next((u for i, u in enumerate(ubatches) if all(ahead[i:])), None)
        out.append({"kv_type": kv_type, "depth": depth, "flash_from_ubatch": first})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_machine_args(parser)
    parser.add_argument("--depth", type=int, nargs="+", default=[2048])
    parser.add_argument("--ubatch", type=int, nargs="+", default=[DEFAULT_UBATCH],
                        help="tokens per prefill batch (llama.cpp's -ub); several sweep it")
    parser.add_argument("--kv-types", default="f16,q8_0,q4_0,kivi4,kivi2")
    parser.add_argument("--repeat", type=int, default=2, help="rounds over all rows; each row keeps its best rate")
    args = parser.parse_args(argv)
    if min(args.ubatch) < 1 or min(args.depth) < 1:
        parser.error("--depth and --ubatch take token counts of 1 or more")
    if args.repeat < 1:
        parser.error("--repeat takes a number of rounds of 1 or more")
    model, model_label = resolve_model(args.model, args.workdir)
    settings = [(depth, ubatch, spec, path) for depth in args.depth for ubatch in args.ubatch
                for spec in kv_types.parse_list(args.kv_types) for path in (PATHS if spec.is_kivi else ["-"])]

    def once(setting: tuple[int, int, KvSpec, str]) -> dict:
        depth, ubatch, spec, path = setting
        if path in PATHS:
            os.environ[ENV] = PATHS[path]
        else:
            os.environ.pop(ENV, None)
        row = measure_once(model, spec, depth, 1, 1, args.threads, args.ngl, ubatch)
        print(f"depth {depth:>7} ubatch {ubatch:>5} {spec.label:<12} {path:<6} prefill {row['prefill_tps']} t/s",
              flush=True)
        return {**row, "ubatch": ubatch, "prefill_path": path}

    rows = best_of_rounds(settings, args.repeat, once)
    os.environ.pop(ENV, None)
    for r in rows:
        base = next(b for b in rows if (b["depth"], b["ubatch"], b["kv_type"]) == (r["depth"], r["ubatch"], "f16"))
        both = r["prefill_tps"] and base["prefill_tps"]
        r["prefill_vs_f16"] = r["prefill_tps"] / base["prefill_tps"] if both else None
    where = machine(args.ngl, args.threads)
    print(f"\n{where.device}\n{'depth':>7} {'ubatch':>6} {'KV type':<12} {'path':<6} {'prefill t/s':>11} {'vs f16':>7}")
    for r in rows:
        rate = f"{r['prefill_tps']:>11.1f} {r['prefill_vs_f16']:>7.2f}" if r["prefill_tps"] else r.get("note", "-")
        print(f"{r['depth']:>7} {r['ubatch']:>6} {r['kv_type']:<12} {r['prefill_path']:<6} {rate}")
    record = {"machine": where.label, "model": model_label, "ngl": args.ngl, "repeat": args.repeat, "rows": rows}
    if len(args.ubatch) > 1:
        record["flash_from"] = flash_from(rows)
        print("\nflash attention over wide cells at least as fast as the fused kernel from ubatch:")
        for f in record["flash_from"]:
            print(f"  {f['kv_type']:<12} depth {f['depth']:>7}: {f['flash_from_ubatch'] or 'never'}")
    RESULTS.mkdir(exist_ok=True)
    name = f"prefill-speed-{where.tag}-{'-'.join(str(d) for d in args.depth)}"
    if args.ubatch != [DEFAULT_UBATCH]:
        name += "-ub" + "-".join(str(u) for u in args.ubatch)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
