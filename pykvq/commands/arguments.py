"""Argument types the pykvq commands share: their values as llama.cpp's tools spell them."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from pykvq import kv_types
from pykvq.api import fit
from pykvq.api.fit import Placement
from pykvq.api.llama import ContextConfig, add_rpc_servers, check_gpu_layers, gpu_offload_supported
from pykvq.bindings import devices

log = logging.getLogger("pykvq")


def switch(text: str) -> bool:
    """on/off, as llama.cpp's boolean flags take it."""
    if text in ("on", "1", "true", "yes"):
        return True
    if text in ("off", "0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def rotation(text: str) -> str:
    """--kv-rotate as the C API's rotation spec: on/off for every kivi layer (any of the switch's words), or a
    per-layer spec (checked where the cache takes it)."""
    try:
        return "on" if switch(text) else "off"
    except argparse.ArgumentTypeError:
        if ":" not in text:
            raise argparse.ArgumentTypeError(f"expected on, off or a per-layer spec such as 'k:*=on;v:0-3=off,4-=on', "
                                             f"got {text!r}") from None
        return text


def spec(text: str) -> str:
    """A per-layer spec or type name (--kv-layers, --kv-clip, --kv-dither, --kv-type-swa), checked where the cache
    takes it; an empty one is an unset shell variable, not the default (leaving the flag out is)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty value: leave the flag out for the default")
    return text


def selection(text: str) -> kv_types.Selection:
    """--kv-select's HH,RW[,N[,D]]."""
    try:
        return kv_types.parse_select(text)
    except kv_types.KvTypeError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# the flags that set only what a kivi layer does, by their argparse names
KIVI_FLAGS = {"kv_window": "--kv-window", "kv_sinks": "--kv-sinks", "kv_rollback": "--kv-rollback",
              "kv_rotate": "--kv-rotate", "kv_clip": "--kv-clip", "kv_dither": "--kv-dither"}


def warn_unused_kivi_flags(args: argparse.Namespace, types: str) -> None:
    """A warning naming the kivi flags given for caches of ``types`` that hold no kivi layer: they change nothing,
    as llama.cpp's tools would take them without a word."""
    given = [flag for dest, flag in KIVI_FLAGS.items() if getattr(args, dest, None) is not None]
    if given:
        log.warning("%s change%s nothing: no layer of %s is kivi", ", ".join(given), "" if len(given) > 1 else "s",
                    types)


def warn_unused_swa_type(type_swa: str, model: Path) -> None:
    """A warning for --kv-type-swa on a model without sliding-window layers: it changes nothing there."""
    log.warning("--kv-type-swa %s changes nothing: %s has no sliding-window layers", type_swa, model.name)


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """-ngl, --rpc, --op-offload and -nkvo, as llama.cpp's tools take them."""
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", type=int, default=None,
                   help="layers to offload to the GPU (default: as many as fit with -fit on, all with -fit off, with a "
                        "GPU build or --rpc, else 0)")
    p.add_argument("--rpc", metavar="SERVERS",
                   help="RPC servers as devices, HOST:PORT[,HOST:PORT...] (each running ggml-rpc-server)")
    p.add_argument("--op-offload", action=argparse.BooleanOptionalAction, default=True,
                   help="offload host tensor operations to the GPU (default: on)")
    p.add_argument("-nkvo", "--no-kv-offload", dest="kv_offload", action="store_false",
                   help="keep the KV cache in host memory, its attention on the CPU, with the layers on the GPU")


def margins(text: str) -> list[int]:
    """--fit-target's MiB0,MiB1,...: one margin for every device, or one per device."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MiB or MiB0,MiB1,... (whole numbers), got {text!r}") from None
    if min(values) < 0:
        raise argparse.ArgumentTypeError(f"a margin cannot be negative, got {text!r}")
    return values


def add_fit_arguments(p: argparse.ArgumentParser, context: bool = True) -> None:
    """-fit and -fitt, as llama.cpp's tools take them; -fitc too where the command takes -c 0 (``context``)."""
    unset = "the layers -ngl does not give, and -c 0" if context else "the layers -ngl does not give"
    p.add_argument("-fit", "--fit", type=switch, default=True, metavar="on|off",
                   help=f"fit what is left unset ({unset}) to the devices' free memory (default: on)")
    p.add_argument("-fitt", "--fit-target", type=margins, default=[fit.DEFAULT_MARGIN_MIB], metavar="MiB0,MiB1,...",
                   help=f"memory --fit leaves free on each device, one value for all or one per device (default: "
                        f"{fit.DEFAULT_MARGIN_MIB})")
    if context:
        p.add_argument("-fitc", "--fit-ctx", type=int, default=fit.DEFAULT_N_CTX_MIN, metavar="N",
                       help=f"the least context --fit reduces -c 0 to (default: {fit.DEFAULT_N_CTX_MIN})")
    else:
        p.set_defaults(fit_ctx=fit.DEFAULT_N_CTX_MIN)


def fit_target(margins_mib: Sequence[int]) -> str:
    """-fitt as llama.cpp's tools take it."""
    return ",".join(str(m) for m in margins_mib)


def fit_to_memory(args: argparse.Namespace, path: Path, config: ContextConfig,
                  n_gpu_layers: int | None) -> tuple[int | Placement, ContextConfig]:
    """The layers to load (Model's n_gpu_layers) and the context to create: under -fit on, what is unset (layers
    None, from gpu_layers with unset=None; n_ctx 0) fitted to the devices' free memory, otherwise as given (every
    layer where -ngl is unset)."""
    layers = fit.ALL_LAYERS if n_gpu_layers is None else n_gpu_layers
    if not args.fit or (n_gpu_layers is not None and config.n_ctx != 0):
        return layers, config
    placement = fit.fit_placement(path, config, layers, args.fit_target, args.fit_ctx)
    where = "every layer" if placement.n_gpu_layers == fit.ALL_LAYERS else f"-ngl {placement.n_gpu_layers}"
    if placement.fitted:
        log.info("fitted to free memory, keeping %s MiB free (-fitt): %s, -c %d", fit_target(args.fit_target), where,
                 placement.n_ctx)
    else:
        log.warning("nothing keeps %s MiB free (-fitt): loading %s, -c %d, which may not fit (lower -c or -fitt, "
                    "or set -ngl; -fit off to skip the fit)", fit_target(args.fit_target), where, placement.n_ctx)
    return placement, placement.context_config(config)


def gpu_layers(args: argparse.Namespace, unset: int | None = 999) -> int | None:
    """-ngl as given, else ``unset`` where a device takes layers (None: a tool's own default, as many as fit), else
    0; the --rpc servers are added (and checked reachable) first, as llama.cpp's tools do."""
    if args.rpc:
        add_rpc_servers(args.rpc)
    n_gpu_layers = args.n_gpu_layers
    if n_gpu_layers is None:
        n_gpu_layers = unset if gpu_offload_supported() else 0
    if n_gpu_layers is not None:
        check_gpu_layers(n_gpu_layers)
    if n_gpu_layers != 0:
        log.info("layers on the GPU (%s): %s", "as many as fit" if n_gpu_layers is None else f"-ngl {n_gpu_layers}",
                 ", ".join(f"{d.name} ({d.description})" for d in devices.offload_devices()))
    return n_gpu_layers
