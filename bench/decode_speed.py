"""Decode speed per KV cache type at long context, measured with the real llama-batched-bench.

    python bench/decode_speed.py [--depth 4096 16384] [--tg 32]                       # CPU, SmolLM2-135M
    python bench/decode_speed.py --model random:llama3-8b --ngl 99 --depth 4096 32768 131072 --npl 1 16

For each depth the prompt of `depth` tokens is prefilled, then `tg` tokens are generated one at a time per
sequence (`--npl` sequences at once); the decode tokens/s (S_TG) of each type is reported with its ratio to
f16 KV. `random:SHAPE` generates a random-weight model of that shape (pykvq.devtools.random_model) first. With two or
more depths, the growth of the per-token time between the smallest and the largest depth, against the KV
bytes those extra cells hold, estimates the attention's achieved memory bandwidth. Writes
bench/results/decode-speed-<device>-<depths>.json and .png and prints a table. With several --npl (batched
decoding: the sequences sit in per-sequence streams, kivi types included) the record is
bench/results/batched-speed-<device>-<depths>-npl<npl...>.json, and decode_tps is the throughput of all
sequences together (llama-batched-bench's S_TG):

    python bench/decode_speed.py --depth 512 --tg 32 --npl 1 4 8 --kv-types f16,q8_0,q4_0,kivi4,kivi2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from pykvq import assets, kv_types, llama_tools
from pykvq.api.llama import Model
from pykvq.bindings import native
from pykvq.devtools import random_model
from pykvq.kv_types import KvSpec

RESULTS = Path(__file__).resolve().parent / "results"
_ROW = re.compile(r"^\|\s*(\d+) \|\s*(\d+) \|\s*(\d+) \|\s*(\d+) \|"
                  r"\s*([0-9.]+) \|\s*([0-9.]+) \|\s*([0-9.]+) \|\s*([0-9.]+) \|",
                  re.M)
# peak memory bandwidth, GB/s, of the cards the project measures on
PEAK_GBS = {"H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "H200": 4800.0}
RATES = ("prefill_tps", "decode_tps")

Setting = TypeVar("Setting")


def best_of_rounds(settings: Sequence[Setting], repeat: int, once: Callable[[Setting], dict]) -> list[dict]:
    """Each setting's best rates over `repeat` rounds, a round running every setting once (a shared machine only ever
    slows a run down; in rounds a slow spell falls on every setting alike, not on all the runs of one)."""
    runs: list[list[dict]] = [[] for _ in settings]
    for _ in range(repeat):
        for i, setting in enumerate(settings):
            runs[i].append(once(setting))
    return [best_rates(r) for r in runs]


def best_rates(runs: list[dict]) -> dict:
    best = dict(runs[0])
    for key in RATES:
        rates = [r[key] for r in runs if r.get(key) is not None]
        best[key] = max(rates) if rates else None
    return best


def measure_once(model: Path, spec: KvSpec, depth: int, tg: int, npl: int, threads: int, ngl: int,
                 ubatch: int = 512) -> dict:
    row = {"kv_type": spec.label, "depth": depth, "tg": tg, "npl": npl}
    # several sequences (npl > 1) sit in per-sequence streams (llama.cpp's default, which kivi caches need);
    # decode_tps is then the throughput of all of them together
    n_ctx = npl * (depth + tg) + 256
    args = ["-m", str(model), "-c", str(n_ctx), "-b", "2048", "-ub", str(ubatch), "-npp", str(depth), "-ntg", str(tg),
            "-npl", str(npl), "-t", str(threads), "-fa", "on", "-ngl", str(ngl), "-ctk", spec.name, "-ctv", spec.name,
            "--kv-layers", spec.layers or "none"]
    try:
        output = llama_tools.run_tool("llama-batched-bench", args)
    except llama_tools.ToolError as exc:
        return {**row, "prefill_tps": None, "decode_tps": None, "note": str(exc).splitlines()[-1][:200]}
    found = _ROW.search(output)
    if found is None:
        raise llama_tools.ToolError("llama-batched-bench printed no result row:\n" + output[-2000:])
    return {**row, "prefill_tps": float(found.group(6)), "decode_tps": float(found.group(8))}


def bandwidth(rows: list[dict], specs: list[KvSpec], model: Path, n_ctx: int) -> list[dict]:
    """Per type (batch 1): extra KV bytes of the deepest run over the shallowest, over the extra per-token time."""
    n_layer, elements_per_cell = _kv_shape(model)
    defaults = native.kvq_default_params()  # what measure_once() runs with
    out = []
    for spec in specs:
        mine = sorted((r for r in rows if r["kv_type"] == spec.label and r["npl"] == 1 and r["decode_tps"]),
                      key=lambda r: r["depth"])
        if len(mine) < 2:
            continue
        bpe_k, bpe_v = kv_types.layer_bits_per_element(spec, n_layer, n_ctx, defaults.window, defaults.n_sink)
        bytes_per_cell = elements_per_cell * (bpe_k + bpe_v) / 2 / 8
        lo, hi = mine[0], mine[-1]
        dt = 1.0 / hi["decode_tps"] - 1.0 / lo["decode_tps"]
        extra = bytes_per_cell * (hi["depth"] - lo["depth"])
        out.append({"kv_type": spec.label, "from_depth": lo["depth"], "to_depth": hi["depth"],
                    "extra_ms_per_token": 1e3 * dt, "extra_kv_mb": extra / 1e6,
                    "attention_gbs": extra / dt / 1e9 if dt > 0 else None})
    return out


def _kv_shape(model: Path) -> tuple[int, int]:
    """Layers, and K plus V elements one cell holds over all layers."""
    with Model(model) as m, m.context() as ctx:
        memory = ctx.memory()
        return m.n_layer, memory.n_elements // memory.n_cells


def device_name() -> str:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
    except FileNotFoundError:
        return f"cpu-{platform.machine()}"
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else "cpu"


def resolve_model(text: str, workdir: Path) -> tuple[Path, str]:
    if text == "smollm2":
        return assets.default_model(), assets.SMOLLM2_135M_INSTRUCT.member
    if text == "qwen2.5-coder-1.5b":
        return assets.qwen_model(), assets.QWEN25_CODER_15B_INSTRUCT.name
    if text == "gemma3-270m":
        return assets.gemma3_model(), assets.GEMMA3_270M.name
    if text.startswith("random:"):
        shape = text.split(":", 1)[1]
        if shape not in random_model.SHAPES:
            raise SystemExit(f"unknown random shape {shape!r}; one of: {', '.join(sorted(random_model.SHAPES))}")
        path = workdir / f"{shape}-random.gguf"
        if not path.exists():
            workdir.mkdir(parents=True, exist_ok=True)
            random_model.write(random_model.SHAPES[shape], path)
        return path, f"random weights, {shape} shape"
    if not Path(text).is_file():
        raise SystemExit(f"no model file {text!r} (or smollm2, qwen2.5-coder-1.5b, gemma3-270m, random:SHAPE)")
    return Path(text), Path(text).name


def model_tag(name: str) -> str:
    """A model's name as result files carry it."""
    return re.sub(r"[^a-z0-9]+", "-", Path(name).stem.lower()).strip("-")


def save_results(stem: Path, record: dict, plot: Callable[[Path, dict], None], table: Callable[[dict], str]) -> None:
    """<stem>.json and <stem>.png, and the table on stdout."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.parent.joinpath(f"{stem.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(stem.parent / f"{stem.name}.png", record)
    print(table(record))
    print(f"wrote {stem}.json and .png")


def add_machine_args(parser: argparse.ArgumentParser) -> None:
    """The model and machine options of the llama-batched-bench benchmarks (this one, prefill_speed.py)."""
    parser.add_argument("--model", default="smollm2",
                        help="smollm2, qwen2.5-coder-1.5b, random:SHAPE (llama3-8b, tiny) or a GGUF path")
    parser.add_argument("--ngl", type=int, default=0, help="layers on the GPU (99: all)")
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))


def cuda_attention(ngl: int) -> str | None:
    """Which kernel attends the kivi cache on a GPU: GGML_KVQ_CUDA_MMA=1 picks the tensor-core one."""
    if not ngl:
        return None
    return "tensor cores" if os.environ.get("GGML_KVQ_CUDA_MMA") == "1" else "cuda cores"


def device_tag(device: str) -> str:
    """A device's name as result files carry it: NVIDIA H100 80GB HBM3 -> h100-80gb-hbm3."""
    return device.replace("NVIDIA ", "").replace(" ", "-").lower()


@dataclass(frozen=True)
class Machine:
    device: str   # the GPU's name, or cpu-<arch>
    label: str    # for the record: the GPU, or the CPU and its threads
    tag: str      # for file names: h100-80gb-hbm3, cpu


def machine(ngl: int, threads: int) -> Machine:
    if ngl:
        device = device_name()
        tag = device_tag(device)
        # the tensor-core attention (GGML_KVQ_CUDA_MMA=1) gets records of its own beside the CUDA-core kernel's
        if cuda_attention(ngl) == "tensor cores":
            return Machine(device, f"{device}, tensor-core attention", f"{tag}-mma")
        return Machine(device, device, tag)
    return Machine(f"cpu-{platform.machine()}", f"{platform.processor() or platform.machine()}, {threads} threads",
                   "cpu")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_machine_args(parser)
    parser.add_argument("--depth", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--tg", type=int, default=32)
    parser.add_argument("--npl", type=int, nargs="+", default=[1], help="sequences decoded at once")
    parser.add_argument("--kv-types", default="f16,q8_0,q4_0,kivi4,kivi2,kivi1",
                        help="comma-separated KV cache types (f16 is always measured: the ratios are to it)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds over all rows; each row keeps its best rates")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat takes a number of rounds of 1 or more")
    model, model_label = resolve_model(args.model, args.workdir)
    specs = kv_types.parse_list(args.kv_types)
    if not any(spec.label == "f16" for spec in specs):
        # every rate is reported against f16's at the same depth and batch
        print("decode_speed: f16 added: the table compares every type with it", flush=True)
        specs = kv_types.parse_list("f16") + specs
    settings = [(npl, depth, spec) for npl in args.npl for depth in args.depth for spec in specs]

    def once(setting: tuple[int, int, KvSpec]) -> dict:
        npl, depth, spec = setting
        row = measure_once(model, spec, depth, args.tg, npl, args.threads, args.ngl)
        print(f"npl {npl:>3} depth {depth:>7} {spec.label:<12} decode {row['decode_tps']} t/s", flush=True)
        return row

    rows = best_of_rounds(settings, args.repeat, once)
    for r in rows:
        base = next(b for b in rows if (b["depth"], b["npl"], b["kv_type"]) == (r["depth"], r["npl"], "f16"))
        both = r["decode_tps"] and base["decode_tps"]
        r["decode_vs_f16"] = r["decode_tps"] / base["decode_tps"] if both else None
    where = machine(args.ngl, args.threads)
    device = where.device
    print(f"\n{device}\n{'npl':>3} {'depth':>7} {'KV type':<12} {'prefill t/s':>11} {'decode t/s':>10} {'vs f16':>7}")
    for r in rows:
        cells = [f"{r[k]:>{w}.2f}" if r[k] is not None else f"{r.get('note', '-'):>{w}}"
                 for k, w in (("prefill_tps", 11), ("decode_tps", 10), ("decode_vs_f16", 7))]
        print(f"{r['npl']:>3} {r['depth']:>7} {r['kv_type']:<12} {' '.join(cells)}")
    attention = bandwidth(rows, specs, model, max(args.depth) + args.tg + 256) if len(args.depth) > 1 else []
    peak = PEAK_GBS.get(device.replace("NVIDIA ", ""))
    for a in attention:
        a["fraction_of_peak"] = a["attention_gbs"] / peak if peak and a["attention_gbs"] else None
        print(f"attention {a['kv_type']:<12} +{a['extra_ms_per_token']:.3f} ms/token for {a['extra_kv_mb']:.0f} MB: "
              f"{a['attention_gbs'] or 0:.0f} GB/s" + (f" ({a['fraction_of_peak']:.0%} of peak)" if peak else ""))
    RESULTS.mkdir(exist_ok=True)
    record = {"machine": where.label,
              "model": model_label, "ngl": args.ngl, "cuda_attention": cuda_attention(args.ngl),
              "kvq_defaults": asdict(native.kvq_default_params()),
              "rows": rows, "attention": attention, "peak_gbs": peak}
    tag = where.tag
    depths = '-'.join(str(d) for d in args.depth)
    if args.npl != [1]:
        record["tg"] = args.tg
        record["repeat"] = args.repeat
        out = RESULTS / f"batched-speed-{tag}-{depths}-npl{'-'.join(str(n) for n in args.npl)}"
        out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        return
    # SmolLM2's records keep their names; another model's name its own
    model_part = "" if args.model == "smollm2" else f"-{model_tag(args.model.replace(':', '-'))}"
    out = RESULTS / f"decode-speed-{tag}{model_part}-{depths}"
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"), f"{device}, {model_label}")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["npl"] == 1]
    depths = sorted({r["depth"] for r in rows})
    types = list(dict.fromkeys(r["kv_type"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(types)
    for i, t in enumerate(types):
        values = [next(r["decode_vs_f16"] or 0.0 for r in rows if r["depth"] == d and r["kv_type"] == t)
                  for d in depths]
        ax.bar([k + i * width for k in range(len(depths))], values, width, label=t)
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(depths))], [f"{d} tokens" for d in depths])
    ax.set_ylabel("decode tokens/s relative to f16 KV")
    ax.set_title(f"decode speed, batch 1: {title}", fontsize=9)
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
