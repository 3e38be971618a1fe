"""The longest context each KV cache type fits into a device's memory, as llama.cpp's own fit places it (-fit on:
`pykvq run -c 0`, llama-cli and llama-server alike): the model and a context of each type measured without
allocating them, the context reduced from the model's training length, then layers moved off the device, until
the device keeps all but the budget free.

    python bench/fit_context.py                                          # an RPC device here: 8, 12, 16 GiB
    python bench/fit_context.py --device gpu --budget-gib 8 12 16 24 80  # the first GPU

`--device rpc` starts a ggml-rpc-server on 127.0.0.1 lending its CPU, a device whose memory counts as a GPU's; its
compute buffers are the CPU backend's (CUDA's differ by a few MiB). The budget is what the device may hold:
weights, KV cache and compute buffers. Writes bench/results/fit-context-<device>-<model>.json and .png and prints
a table (the context in tokens, and -ngl where not every layer fits, per budget and type).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

from decode_speed import RESULTS, device_name, device_tag, model_tag, resolve_model, save_results
from readme_tables import fit_context_record_table

from pykvq import fit_placement, kv_types
from pykvq.api import fit
from pykvq.api.llama import ContextConfig, KvConfig, LlamaError, Model, add_rpc_servers
from pykvq.bindings import devices
from pykvq.devtools import rpc_server
from pykvq.kv_types import KvSpec

log = logging.getLogger("fit_context")

GIB_MIB = 1024


def fitted_row(path: Path, spec: KvSpec, budget_gib: float, free_mib: int, n_ctx_min: int) -> dict:
    """The fit of one type into ``budget_gib`` of a device with ``free_mib`` free."""
    kv = KvConfig(spec.name, spec.name, rotate=spec.rotate or None, layers=spec.layers or "none")
    # llama.cpp's tools' batch sizes: the compute buffer a user's run reserves
    config = ContextConfig(n_ctx=0, n_batch=2048, n_ubatch=512, flash_attn="on", kv=kv)
    placement = fit_placement(path, config, fit.ALL_LAYERS, free_mib - round(budget_gib * GIB_MIB), n_ctx_min)
    return {"kv_type": spec.label, "budget_gib": budget_gib, "fitted": placement.fitted,
            "n_ctx": placement.n_ctx if placement.fitted else None,
            "n_gpu_layers": placement.n_gpu_layers if placement.fitted else None}


def offload_device() -> devices.Device:
    """The one device that takes layers; the budget is its own."""
    found = devices.offload_devices()
    if len(found) != 1:
        raise LlamaError(f"need exactly one GPU or RPC device, found {len(found)} "
                         f"({', '.join(d.name for d in found) or 'none'}): choose one with CUDA_VISIBLE_DEVICES")
    return found[0]


def measure(path: Path, specs: list[KvSpec], budgets_gib: list[float], n_ctx_min: int) -> tuple[devices.Device,
                                                                                                 list[dict]]:
    device = offload_device()
    free_mib = device.free // 2**20
    too_large = [b for b in budgets_gib if b * GIB_MIB > free_mib]
    if too_large:
        raise LlamaError(f"{device.name} has {free_mib} MiB free: a budget of {too_large[0]:g} GiB cannot be kept")
    rows = []
    for budget in budgets_gib:
        for spec in specs:
            row = fitted_row(path, spec, budget, free_mib, n_ctx_min)
            log.info("%6g GiB %-12s %s", budget, spec.label,
                     f"-c {row['n_ctx']}, -ngl {row['n_gpu_layers']}" if row["fitted"] else "does not fit")
            rows.append(row)
    return device, rows


def plot(path: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    types = list(dict.fromkeys(r["kv_type"] for r in record["rows"]))
    budgets = list(dict.fromkeys(r["budget_gib"] for r in record["rows"]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(types)
    for i, t in enumerate(types):
        values = [next((r["n_ctx"] or 0 for r in record["rows"] if r["kv_type"] == t and r["budget_gib"] == b), 0)
                  for b in budgets]
        ax.bar([j + i * width for j in range(len(budgets))], values, width, label=t)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(budgets))], [f"{b:g} GiB" for b in budgets])
    ax.set_yscale("log", base=2)
    ax.set_ylabel("context that fits (tokens)")
    ax.set_title(f"{record['model']}, {record['device']}: llama.cpp's fit, -c 0", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def measure_on(where: str, path: Path, specs: list[KvSpec], budgets_gib: list[float], n_ctx_min: int,
               workdir: Path) -> tuple[str, dict]:
    """The device's name for file names, and the record's device and rows."""
    if where == "rpc":
        with rpc_server.serve(workdir / "fit-context-rpc.log") as endpoint:
            add_rpc_servers(endpoint)
            device, rows = measure(path, specs, budgets_gib, n_ctx_min)
        name, description = "rpc-cpu", "an RPC device lending this machine's CPU"
    else:
        device, rows = measure(path, specs, budgets_gib, n_ctx_min)
        name = description = device_name()
    return name, {"device": description, "device_free_mib": device.free // 2**20, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama3-8b",
                        help="smollm2, qwen2.5-coder-1.5b, gemma3-270m, random:SHAPE (llama3-8b, ...) or a GGUF path")
    parser.add_argument("--kv-types", default="f16,q8_0,q4_0,kivi4,kivi2,kivi1")
    parser.add_argument("--budget-gib", type=float, nargs="+", default=[8, 12, 16],
                        help="device memory the model may use, GiB (default: 8 12 16)")
    parser.add_argument("--device", choices=("rpc", "gpu"), default="rpc",
                        help="rpc: a local ggml-rpc-server lending the CPU (default); gpu: the GPU of a CUDA build")
    parser.add_argument("-fitc", "--fit-ctx", type=int, default=fit.DEFAULT_N_CTX_MIN,
                        help="the least context the fit reduces to before it moves layers off the device")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the record goes (default: %(default)s)")
    args = parser.parse_args(argv)
    if min(args.budget_gib) <= 0:
        parser.error("--budget-gib takes sizes above 0")
    try:
        specs = kv_types.parse_list(args.kv_types)
    except kv_types.KvTypeError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.device == "rpc":
        # before ggml loads its backends: the GPU of a CUDA build would be a second device, and the budget is the
        # RPC device's alone
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    path, label = resolve_model(args.model, args.workdir)
    with Model(path, metadata_only=True) as shape:
        n_layer = shape.n_layer
    try:
        name, record = measure_on(args.device, path, specs, args.budget_gib, args.fit_ctx, args.workdir)
    except (LlamaError, rpc_server.RpcServerError) as exc:
        sys.exit(f"fit_context: {exc}")
    record.update(model=label, n_layer=n_layer, fit_ctx=args.fit_ctx)
    save_results(args.results / f"fit-context-{device_tag(name)}-{model_tag(label)}", record, plot,
                 fit_context_record_table)


if __name__ == "__main__":
    main()
