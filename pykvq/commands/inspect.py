"""`pykvq inspect`: a GGUF model's architecture, KV shape, kvq.* metadata and KV memory per token per type.

Read from the GGUF header alone (no weights are loaded), so it works on any size of model.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Collection
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from pykvq import gguf_metadata, kv_types
from pykvq.bindings import native
from pykvq.commands import arguments
from pykvq.input_files import check_readable_file

log = logging.getLogger("pykvq")

FP16_BYTES = 2
# the architectures whose multi-head latent attention kivi types take (V read from K's tiles); others refuse them
KIVI_LATENT_ARCHITECTURES = frozenset({"deepseek2", "mistral4", "kimi-linear", "bailingmoe3"})


@dataclass(frozen=True)
class KvShape:
    """What one token costs in each layer's KV cache: K and V elements per layer (head sizes per layer: Gemma 4's
    sliding-window layers have their own; 0 KV heads in a hybrid's recurrent layers, and V's head size 0 under
    multi-head latent attention, which reads V from K's rows), and how many layers from the first keep KV of their
    own (the rest of a Gemma 3n/4 read an earlier layer's)."""

    architecture: str
    name: str
    n_layer: int
    n_ctx_train: int
    n_head: list[int]
    n_head_kv: list[int]
    head_dim_k: list[int]
    head_dim_v: list[int]
    n_layer_kv: int
    n_recurrent: int = 0  # a hybrid's layers without attention (a recurrent state, or an FFN alone): no KV heads
    latent: bool = False  # multi-head latent attention (DeepSeek): one row per token, V read from K's

    @property
    def refuses_kivi(self) -> bool:
        """Latent attention outside the architectures whose graph kivi types attend."""
        return self.latent and self.architecture not in KIVI_LATENT_ARCHITECTURES

    # cached: the cost tables read them per layer, and a list rebuilt per read made those quadratic (stop 46)
    @cached_property
    def n_embd_k(self) -> list[int]:
        return [h * d for h, d in zip(self.n_head_kv, self.head_dim_k, strict=True)]

    @cached_property
    def n_embd_v(self) -> list[int]:
        return [h * d for h, d in zip(self.n_head_kv, self.head_dim_v, strict=True)]


# llama.cpp's LLAMA_MAX_LAYERS: a model with more does not load (patch 0018), and per-layer lists stay short
MAX_LAYERS = 512
# the families whose recurrent layers llama.cpp reads from attention.recurrent_layers, or else every layer but each
# full_attention_interval-th, with these defaults (their load_arch_hparams); the others give such layers 0 KV heads
FULL_ATTENTION_INTERVAL = {"qwen3next": 4, "qwen35": 4, "qwen35moe": 4, "qwen4exp": 4, "minimax-01": 8}


def _per_layer(value: object, n_layer: int, what: str) -> list[int]:
    values = np.atleast_1d(np.asarray(value, dtype=np.int64)).tolist()
    if len(values) == 1:
        return values * n_layer
    if len(values) != n_layer:
        raise gguf_metadata.GgufError(f"{what} has {len(values)} values for {n_layer} layers")
    return values


def read_shape(fields: dict[str, object]) -> KvShape:
    """The KV shape from a GGUF's metadata (``fields``: name -> contents)."""
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise gguf_metadata.GgufError("no general.architecture: not a llama.cpp model")

    def get(key: str, default: object = None) -> object:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise gguf_metadata.GgufError(f"{arch} model without {arch}.{key}")
        return value

    try:
        n_layer = int(get("block_count"))  # type: ignore[arg-type]
        if not 0 < n_layer <= MAX_LAYERS:
            # before any per-layer list is made: a corrupt count would ask for billions of entries
            raise gguf_metadata.GgufError(f"{arch} model with impossible sizes: {n_layer} layers")
        n_embd = int(get("embedding_length"))  # type: ignore[arg-type]
        n_head = _per_layer(get("attention.head_count"), n_layer, "attention.head_count")
        n_head_kv = _per_layer(get("attention.head_count_kv", n_head), n_layer, "attention.head_count_kv")
        head = n_embd // max(n_head[0], 1)
        swa = _sliding_window_layers(get("attention.sliding_window_pattern", 0), n_layer)

        def head_dims(part: str) -> list[int]:
            full = int(get(f"attention.{part}_length", head))  # type: ignore[arg-type]
            own = int(get(f"attention.{part}_length_swa", full))  # type: ignore[arg-type]
            return [own if s else full for s in swa]

        recurrent = _recurrent_layers(fields, arch, n_layer)
        n_head_kv = [0 if r else h for r, h in zip(recurrent, n_head_kv, strict=True)]
        latent = f"{arch}.attention.key_length_mla" in fields and f"{arch}.attention.value_length_mla" in fields
        n_shared = int(get("attention.shared_kv_layers", 0))  # type: ignore[arg-type]
        shape = KvShape(arch, str(fields.get("general.name", "")), n_layer, int(get("context_length", 0)),  # type: ignore[arg-type]
                        n_head, n_head_kv, head_dims("key"), [0] * n_layer if latent else head_dims("value"),
                        n_layer - n_shared, n_head_kv.count(0), latent)
    except (TypeError, ValueError, OverflowError) as exc:
        raise gguf_metadata.GgufError(f"{arch} model with unusable hyperparameters: {exc}") from exc
    if min(n_head_kv) < 0 or min(shape.head_dim_k + shape.head_dim_v) < 0 or not 0 < shape.n_layer_kv <= n_layer:
        raise gguf_metadata.GgufError(f"{arch} model with impossible sizes: {shape.n_layer} layers ({shape.n_layer_kv} "
                                      f"with KV of their own), KV heads {sorted(set(n_head_kv))}, head size "
                                      f"{_sizes(shape.head_dim_k)}/{_sizes(shape.head_dim_v)}")
    return shape


def _recurrent_layers(fields: dict[str, object], arch: str, n_layer: int) -> list[bool]:
    """Which layers keep a recurrent state, for the families that say so other than by 0 KV heads."""
    if arch not in FULL_ATTENTION_INTERVAL:
        return [False] * n_layer
    flags = fields.get(f"{arch}.attention.recurrent_layers")
    if flags is not None:
        return [bool(f) for f in _per_layer(flags, n_layer, "attention.recurrent_layers")]
    interval = int(fields.get(f"{arch}.full_attention_interval", FULL_ATTENTION_INTERVAL[arch]))  # type: ignore[call-overload]
    if interval <= 0:
        raise gguf_metadata.GgufError(f"{arch} model with full_attention_interval {interval}")
    return [(il + 1) % interval != 0 for il in range(n_layer)]


def _sliding_window_layers(pattern: object, n_layer: int) -> list[bool]:
    """Which layers are sliding-window, as llama.cpp reads attention.sliding_window_pattern: a flag per layer, or
    every n-th layer global (0: none, or the family's own rule, which only matters here where the head sizes
    differ, and the families whose do write the flags)."""
    flags = np.atleast_1d(np.asarray(pattern)).tolist()
    if len(flags) == n_layer and n_layer > 1:
        return [bool(f) for f in flags]
    n = int(flags[0]) if len(flags) == 1 else 0
    return [n > 0 and il % n < n - 1 for il in range(n_layer)]


def _sizes(values: list[int]) -> str:
    return "/".join(map(str, sorted(set(values))))


@dataclass(frozen=True)
class KvCost:
    """KV cache bytes per token for one choice of types; kivi types also keep a fixed fp16 window and sinks."""

    kv_type: str
    bytes_per_token: float
    fixed_bytes: int


def kv_cost(shape: KvShape, label: str, types_k: list[str], types_v: list[str], window: int, sinks: int) -> KvCost:
    per_token = 0.0
    fixed = 0
    bpe = {t.name: t.bits_per_element for t in native.kv_cache_types()}
    for il in range(shape.n_layer_kv):
        for name, n_embd in ((types_k[il], shape.n_embd_k[il]), (types_v[il], shape.n_embd_v[il])):
            per_token += n_embd * bpe[name] / 8
            if name in kv_types.KIVI_BITS:
                fixed += kv_types.fp16_cells(window, sinks) * n_embd * FP16_BYTES
    return KvCost(label, per_token, fixed)


MODEL_MIX = "kvq.kv_layers"  # the row of the model's own per-layer types


def costs(shape: KvShape, kvq: dict[str, object], window: int, sinks: int) -> list[KvCost]:
    """Every type's (not kivi's where the model refuses them), and the model's own per-layer mix."""
    names = [t for t in kv_types.names() if not (shape.refuses_kivi and t in kv_types.KIVI_BITS)]
    out = [kv_cost(shape, t, [t] * shape.n_layer, [t] * shape.n_layer, window, sinks) for t in names]
    layers = kvq.get(gguf_metadata.KEY_LAYERS)
    if isinstance(layers, str):
        types_k, types_v = kv_types.layer_types(layers, shape.n_layer, "kivi2", "kivi2")
        out.append(kv_cost(shape, MODEL_MIX, types_k, types_v, window, sinks))
    return out


def checked_kvq(path: Path, ignored: Collection[str] = ()) -> dict[str, object]:
    """A model's kvq.* metadata, checked against its shape: the one check of `pykvq inspect`, `run` and
    `perplexity`. Keys in ``ignored`` (settings the command line gives instead) are left out, unchecked."""
    fields = gguf_metadata.read_fields(path)
    kvq = gguf_metadata.kvq_fields(fields, path)
    for key in sorted(kvq.keys() & set(ignored)):
        log.info("the model's %s is not used: the command line gives the setting", key)
    kvq = {k: v for k, v in kvq.items() if k not in ignored}
    if kvq:
        _validate(kvq, read_shape(fields))
    return kvq


def _validate(kvq: dict[str, object], shape: KvShape) -> None:
    gguf_metadata.validate(kvq, shape.n_layer, sum(shape.n_embd_k))


def collect(path: Path) -> dict:
    fields = gguf_metadata.read_fields(path)
    shape = read_shape(fields)
    kvq = gguf_metadata.kvq_fields(fields, path)
    _validate(kvq, shape)
    defaults = native.kvq_default_params()
    window = int(kvq.get(gguf_metadata.KEY_WINDOW, defaults.window))  # type: ignore[call-overload]
    sinks = int(kvq.get(gguf_metadata.KEY_SINKS, defaults.n_sink))  # type: ignore[call-overload]
    sliding_window = fields.get(f"{shape.architecture}.attention.sliding_window")
    return {"model": str(path), "shape": asdict(shape), "kvq": {k: _plain(v) for k, v in kvq.items()},
            "kivi_window": window, "kivi_sinks": sinks,
            "sliding_window": int(sliding_window) if isinstance(sliding_window, (int, np.integer)) else None,
            "kv_bytes": [asdict(c) for c in costs(shape, kvq, window, sinks)]}


def _plain(value: object) -> object:
    return value if isinstance(value, (str, int, float, bool)) else [float(x) for x in value]  # type: ignore[union-attr]


def _short(value: object) -> str:
    if isinstance(value, list):
        head = ", ".join(f"{x:.4g}" for x in value[:4])
        return f"[{head}{', ...' if len(value) > 4 else ''}] ({len(value)} values)"
    return str(value)


def selects_with(info: dict, kv_type: str) -> bool:
    """Whether a cache of this row's types takes prompt selection: a kivi type, or the model's own mix where every
    layer of it is kivi (selection needs every layer kivi)."""
    if kv_type != MODEL_MIX:
        return kv_type in kv_types.KIVI_BITS
    types_k, types_v = kv_types.layer_types(str(info["kvq"][gguf_metadata.KEY_LAYERS]), info["shape"]["n_layer"],
                                            "kivi2", "kivi2")
    return all(t in kv_types.KIVI_BITS for t in types_k + types_v)


def selection(info: dict, select: kv_types.Selection, n_prompt: int) -> dict:
    """What a prompt of n_prompt tokens holds after prompt selection: its cells, and the bytes of each row whose
    types take selection."""
    cells = kv_types.kept_cells(select, n_prompt, info["kivi_window"], info["kivi_sinks"])
    held = {c["kv_type"]: c["bytes_per_token"] * cells + c["fixed_bytes"] for c in info["kv_bytes"]
            if selects_with(info, c["kv_type"])}
    return {"select": list(select), "n_prompt": n_prompt, "cells": cells, "bytes_held": held}


def format_text(info: dict, n_ctx: int, select: dict | None = None) -> str:
    s = info["shape"]
    kv_heads = sorted(set(s["n_head_kv"]))
    lines = [
        f"model         {info['model']}" + (f" ({s['name']})" if s["name"] else ""),
        f"architecture  {s['architecture']}, {s['n_layer']} layers, trained context {s['n_ctx_train']}",
        f"attention     {'/'.join(map(str, sorted(set(s['n_head']))))} query heads, "
        f"{'/'.join(map(str, kv_heads))} KV heads, head size K {_sizes(s['head_dim_k'])} "
        + ("(V read from K's rows)" if s["latent"] else f"V {_sizes(s['head_dim_v'])}")
        + (f", layers {s['n_layer_kv']}-{s['n_layer'] - 1} read earlier layers' KV (shared KV layers)"
           if s["n_layer_kv"] < s["n_layer"] else ""),
        "kvq metadata" + ("  none" if not info["kvq"] else ":"),
        *[f"  {k} = {_short(v)}" for k, v in sorted(info["kvq"].items())],
        f"KV memory     per token, and for {n_ctx} tokens (kivi: window {info['kivi_window']} and sinks "
        f"{info['kivi_sinks']} in fp16 included)",
        f"  {'KV type':<14} {'bytes/token':>12} {f'MiB @ {n_ctx}':>14}" + (f" {'MiB selected':>14}" if select else ""),
    ]
    for c in info["kv_bytes"]:
        total = c["bytes_per_token"] * n_ctx + c["fixed_bytes"]
        line = f"  {c['kv_type']:<14} {c['bytes_per_token']:>12.1f} {total / 2**20:>14.2f}"
        if select and c["kv_type"] in select["bytes_held"]:
            line += f" {select['bytes_held'][c['kv_type']] / 2**20:>14.2f}"
        lines.append(line)
    if select:
        lines.append(f"  selected: --kv-select {kv_types.selection_spec(select['select'])} keeps "
                     f"{select['cells']} of a {n_ctx}-token prompt's cells (kivi types, and the model's mix where "
                     "all kivi)")
    if s["n_recurrent"]:
        lines.append(f"  {s['n_recurrent']} of the {s['n_layer']} layers have no attention, hence no KV (a hybrid's "
                     "recurrent layers: their state is the same whatever the KV type)")
    if s["latent"]:
        lines.append("  multi-head latent attention keeps one row per token; "
                     + ("kivi types are refused on it" if s["architecture"] not in KIVI_LATENT_ARCHITECTURES else
                        "kivi types keep it once too, its V read from K's tiles"))
    if info.get("sliding_window"):
        lines += [f"  every layer counted at the full context; this model has sliding-window layers (window "
                  f"{info['sliding_window']}),",
                  "  whose cache keeps the window and a ubatch (kivi types two rings more): --kv-type-swa sets "
                  "their type, `pykvq run` reports both caches"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    check_readable_file(args.model, "model")
    if args.ctx_size is not None and args.ctx_size < 0:
        raise ValueError(f"-c {args.ctx_size}: give a context of 1 token or more (0: the trained context)")
    info = collect(args.model)
    n_ctx = args.ctx_size or info["shape"]["n_ctx_train"] or 4096
    model_select = info["kvq"].get(gguf_metadata.KEY_SELECT)
    select = args.kv_select or (kv_types.parse_select(model_select) if model_select else None)
    if kv_types.selects(select):
        info["selection"] = selection(info, select, n_ctx)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(format_text(info, n_ctx, info.get("selection")))
    return 0


def add_inspect_command(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("inspect", help="a GGUF model's KV shape, kvq.* metadata and KV memory per type",
                            description="Reads the GGUF header (no weights): architecture, KV heads and sizes, "
                                        "pykvq's kvq.* metadata, and the KV cache memory per token for every KV "
                                        "type (and the model's own per-layer mix).")
    p.add_argument("model", type=Path, metavar="MODEL", help="GGUF model")
    p.add_argument("-c", "--ctx-size", type=int, help="context for the totals (default, or 0: the trained context)")
    p.add_argument("--kv-select", metavar="HH,RW[,N[,D]]", type=arguments.selection,
                   help="also the memory a prompt of -c tokens holds after MiniKV's prompt selection (kivi types; "
                        "default: the model's kvq.select, if any; off: none)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=run)
