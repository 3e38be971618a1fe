"""KV memory of a model with sliding-window layers (Gemma 3: 5 sliding-window layers to 1 global), per cache.

    python bench/iswa_memory.py [--model random:gemma3-1b] [--n-ctx 32768]

Upstream's iSWA cache keeps the sliding-window layers' window and a ubatch, the global layers' whole context. A
kivi sliding-window cache keeps the window, a ubatch and two rings of cells (whole rings of cells that left the
window leave its front); --kv-type-swa gives the sliding-window cache its own type beside a kivi global one.
Writes bench/results/iswa-memory-<model>-<n_ctx>.json and .png, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from decode_speed import RESULTS, resolve_model

from pykvq.api.llama import ContextConfig, KvConfig, Model

log = logging.getLogger("iswa_memory")
MIB = 1024 * 1024


@dataclass(frozen=True)
class Row:
    label: str
    kv: KvConfig


ROWS = [
    Row("f16", KvConfig()),
    Row("q8_0", KvConfig.preset("q8_0")),
    Row("q4_0", KvConfig.preset("q4_0")),
    Row("kivi4", KvConfig.preset("kivi4")),
    Row("kivi2", KvConfig.preset("kivi2")),
    Row("kivi2, SWA f16", KvConfig("kivi2", "kivi2", type_swa="f16")),
    Row("kivi2, SWA q8_0", KvConfig("kivi2", "kivi2", type_swa="q8_0")),
    Row("kivi2, SWA kivi4", KvConfig("kivi2", "kivi2", type_swa="kivi4")),
]


def measure(model: Model, row: Row, n_ctx: int) -> dict:
    config = ContextConfig(n_ctx=n_ctx, n_batch=512, n_ubatch=512, flash_attn="on", kv=row.kv)
    with model.context(config) as ctx:
        memory = ctx.memory()
    return {"kv_type": row.label, "total_mib": memory.bytes / MIB, "swa_mib": memory.swa_bytes / MIB,
            "global_mib": (memory.bytes - memory.swa_bytes) / MIB, "swa_cells": memory.swa_n_cells}


def table(record: dict) -> str:
    f16 = record["rows"][0]["total_mib"]
    lines = [f"{'KV type':<16} {'total MiB':>10} {'global MiB':>11} {'SWA MiB':>9} {'SWA cells':>10} {'vs f16':>7}"]
    lines.append("-" * len(lines[0]))
    for r in record["rows"]:
        lines.append(f"{r['kv_type']:<16} {r['total_mib']:>10.1f} {r['global_mib']:>11.1f} {r['swa_mib']:>9.1f} "
                     f"{r['swa_cells']:>10} {r['total_mib'] / f16:>7.2f}")
    return "\n".join(lines)


def plot(path: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    labels = [r["kv_type"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(labels, [r["global_mib"] for r in rows], label="global layers")
    ax.bar(labels, [r["swa_mib"] for r in rows], bottom=[r["global_mib"] for r in rows], label="sliding-window layers")
    ax.set_ylabel("KV cache, MiB")
    ax.set_title(f"{record['model']}, n_ctx {record['n_ctx']}")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:gemma3-1b", help="random:SHAPE or a GGUF path")
    parser.add_argument("--n-ctx", type=int, default=32768)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as workdir:
        path, name = resolve_model(args.model, Path(workdir))
        with Model(path) as model:
            rows = [measure(model, row, args.n_ctx) for row in ROWS]
    record = {"model": name, "n_ctx": args.n_ctx, "rows": rows}
    stem = f"iswa-memory-{args.model.removeprefix('random:')}-{args.n_ctx}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(RESULTS / f"{stem}.png", record)
    print(table(record))
    print(f"wrote {RESULTS / stem}.json and .png")


if __name__ == "__main__":
    main()
