"""CPU decode speed per KV cache type at long context, measured in one run with the real llama-batched-bench.

    python bench/decode_speed.py [--depth 4096 16384] [--tg 32]

For each depth the prompt of `depth` tokens is prefilled, then `tg` tokens are generated one at a time
(batch 1); the decode tokens/s (S_TG) of each type is reported with its ratio to f16 KV. Writes
bench/results/decode-speed-cpu-<depths>.json and .png and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
from dataclasses import asdict
from pathlib import Path

from pykvq import assets, llama_tools, native

RESULTS = Path(__file__).resolve().parent / "results"
_ROW = re.compile(r"^\|\s*(\d+) \|\s*(\d+) \|\s*(\d+) \|\s*(\d+) \|"
                  r"\s*([0-9.]+) \|\s*([0-9.]+) \|\s*([0-9.]+) \|\s*([0-9.]+) \|",
                  re.M)


def measure(kv_type: str, depth: int, tg: int, threads: int) -> dict:
    n_ctx = depth + tg + 256
    args = ["-m", str(assets.default_model()), "-c", str(n_ctx), "-b", "2048", "-ub", "512", "-npp", str(depth),
            "-ntg", str(tg), "-npl", "1", "-t", str(threads), "-fa", "on", "-ctk", kv_type, "-ctv", kv_type]
    output = llama_tools.run_tool("llama-batched-bench", args)
    row = _ROW.search(output)
    if row is None:
        raise llama_tools.ToolError("llama-batched-bench printed no result row:\n" + output[-2000:])
    return {"kv_type": kv_type, "depth": depth, "tg": tg, "prefill_tps": float(row.group(6)),
            "decode_tps": float(row.group(8))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--tg", type=int, default=32)
    parser.add_argument("--kv-types", default="f16,q8_0,q4_0,kivi4,kivi2,kivi1")
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    rows = []
    for depth in args.depth:
        for kv_type in args.kv_types.split(","):
            rows.append(measure(kv_type, depth, args.tg, args.threads))
            print(f"depth {depth:>6} {kv_type:<6} decode {rows[-1]['decode_tps']:8.2f} t/s", flush=True)
    for r in rows:
        base = next(b for b in rows if b["depth"] == r["depth"] and b["kv_type"] == "f16")
        r["decode_vs_f16"] = r["decode_tps"] / base["decode_tps"]
    print(f"\n{'depth':>6} {'KV type':<7} {'prefill t/s':>11} {'decode t/s':>10} {'decode vs f16':>13}")
    for r in rows:
        print(f"{r['depth']:>6} {r['kv_type']:<7} {r['prefill_tps']:>11.1f} {r['decode_tps']:>10.2f} "
              f"{r['decode_vs_f16']:>13.2f}")
    RESULTS.mkdir(exist_ok=True)
    record = {"machine": f"{platform.processor() or platform.machine()}, {args.threads} threads",
              "model": assets.SMOLLM2_135M_INSTRUCT.member, "kvq_defaults": asdict(native.kvq_default_params()),
              "rows": rows}
    out = RESULTS / f"decode-speed-cpu-{'-'.join(str(d) for d in args.depth)}"
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted({r["depth"] for r in rows})
    types = list(dict.fromkeys(r["kv_type"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(types)
    for i, t in enumerate(types):
        values = [next(r["decode_vs_f16"] for r in rows if r["depth"] == d and r["kv_type"] == t) for d in depths]
        ax.bar([k + i * width for k in range(len(depths))], values, width, label=t)
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(depths))], [f"{d} tokens" for d in depths])
    ax.set_ylabel("decode tokens/s relative to f16 KV")
    ax.set_title("CPU decode speed, SmolLM2-135M, batch 1")
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
