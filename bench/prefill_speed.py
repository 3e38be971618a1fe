"""Prefill speed per KV cache type, kivi types through the fused kernel and through flash attention over wide
cells (LLAMA_KVQ_FA_PREFILL), measured with the real llama-batched-bench.

    python bench/prefill_speed.py [--depth 2048] [--kv-types f16,q8_0,q4_0,kivi4,kivi2]      # CPU, SmolLM2-135M
    python bench/prefill_speed.py --model random:llama3-8b --ngl 99 --depth 4096 32768

Writes bench/results/prefill-speed-<device>-<depth>.json and prints a table: prefill tokens/s (S_PP of a prompt
of `depth` tokens, ubatch 512) and its ratio to f16.
"""

from __future__ import annotations

import argparse
import json
import os

from decode_speed import RESULTS, add_machine_args, machine, measure, resolve_model

from pykvq import kv_types

# LLAMA_KVQ_FA_PREFILL per prefill path of the kivi types: the fused kernel for every batch, or flash
# attention over wide cells from 128 tokens per sequence
PATHS = {"fused": "1000000000", "flash": "128"}
ENV = "LLAMA_KVQ_FA_PREFILL"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_machine_args(parser)
    parser.add_argument("--depth", type=int, nargs="+", default=[2048])
    parser.add_argument("--kv-types", default="f16,q8_0,q4_0,kivi4,kivi2")
    parser.add_argument("--repeat", type=int, default=2, help="runs per row; the best rate is kept")
    args = parser.parse_args()
    model, model_label = resolve_model(args.model, args.workdir)
    rows = []
    for depth in args.depth:
        for spec in kv_types.parse_list(args.kv_types):
            paths = PATHS if spec.is_kivi else {"-": None}
            for path, env in paths.items():
                if env is None:
                    os.environ.pop(ENV, None)
                else:
                    os.environ[ENV] = env
                row = measure(model, spec, depth, 1, 1, args.threads, args.ngl, args.repeat)
                rows.append({**row, "prefill_path": path})
                print(f"depth {depth:>7} {spec.label:<12} {path:<6} prefill {row['prefill_tps']} t/s", flush=True)
    for r in rows:
        base = next(b for b in rows if (b["depth"], b["kv_type"]) == (r["depth"], "f16"))
        both = r["prefill_tps"] and base["prefill_tps"]
        r["prefill_vs_f16"] = r["prefill_tps"] / base["prefill_tps"] if both else None
    where = machine(args.ngl, args.threads)
    print(f"\n{where.device}\n{'depth':>7} {'KV type':<12} {'path':<6} {'prefill t/s':>11} {'vs f16':>7}")
    for r in rows:
        rate = f"{r['prefill_tps']:>11.1f} {r['prefill_vs_f16']:>7.2f}" if r["prefill_tps"] else r.get("note", "-")
        print(f"{r['depth']:>7} {r['kv_type']:<12} {r['prefill_path']:<6} {rate}")
    record = {"machine": where.label, "model": model_label, "ngl": args.ngl, "repeat": args.repeat, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"prefill-speed-{where.tag}-{'-'.join(str(d) for d in args.depth)}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
