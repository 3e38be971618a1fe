"""llama-cpp-python's OpenAI-compatible server on pykvq's libllama and KV types.

    python -m pykvq.llama_cpp.server --model model.gguf --kv-type kivi2 [--kv-window 64] [llama_cpp.server options]

takes every option of ``python -m llama_cpp.server`` plus pykvq's: ``--kv-type`` (any form `pykvq run` takes:
kivi2, kivi2+rot, asymkv:16/0) sets --type_k, --type_v and --flash_attn true; ``--kv-window``, ``--kv-sinks``,
``--kv-rollback``, ``--kv-rotate``, ``--kv-layers``, ``--kv-clip``, ``--kv-dither`` and ``--kv-type-swa`` set the kivi
layers of every model the server loads.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pykvq import kv_types
from pykvq.api.llama import KvConfig
from pykvq.bindings import native
from pykvq.commands.arguments import rotation
from pykvq.kv_types import KvSpec, KvTypeError
from pykvq.llama_cpp import LlamaCppError, check_kv_type, load

DRAFT_TOKENS_DEFAULT = 10  # llama_cpp.server's --draft_model_num_pred_tokens


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m pykvq.llama_cpp.server", add_help=False)
    parser.add_argument("--kv-type", help="K and V cache type by name, e.g. kivi2")
    parser.add_argument("--kv-window", type=int, help="kivi: recent tokens kept in fp16 (default 128)")
    parser.add_argument("--kv-sinks", type=int, help="kivi: first tokens kept in fp16 (default 0)")
    parser.add_argument("--kv-rollback", type=int, help="kivi: last tokens removable exactly (default: "
                                                        "--draft_model_num_pred_tokens with a --draft_model, else 0)")
    parser.add_argument("--kv-rotate", type=rotation,
                        help="kivi: Hadamard rotation, on, off or per layer, e.g. k:*=on;v:0-3=off,4-=on (default: the "
                             "model's kvq.kv_rotate, else off)")
    parser.add_argument("--kv-layers", help="per-layer K/V types, e.g. asymkv:16/0 or k:0-15=kivi2,16-=kivi1;v:*=kivi1")
    parser.add_argument("--kv-clip", help="kivi: SKVQ's per-layer clip ratios, e.g. k:*=0.9;v:*=0.85")
    parser.add_argument("--kv-dither", help="kivi: V's dithered rounding, a spread in [0, 1] or per layer, e.g. 0.5 or "
                                            "v:0-9=1,10-=0 (default: the model's kvq.kv_dither, else nearest)")
    parser.add_argument("--kv-type-swa", help="K and V type of a Gemma-2/3 or gpt-oss model's sliding-window cache")
    return parser.parse_known_args(argv)


def _option(rest: list[str], name: str) -> str | None:
    """The value given to ``name`` (``--type_k 43`` or ``--type_k=43``) in llama_cpp.server's arguments."""
    for i, arg in enumerate(rest):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(rest):
            return rest[i + 1]
    return None


def _int_option(rest: list[str], name: str, meaning: str, error: type[ValueError] = ValueError) -> int | None:
    """The int given to ``name``, ``meaning`` saying what it counts when it is not one."""
    value = _option(rest, name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise error(f"{name} takes {meaning}, got {value!r}") from None


def _type_option(rest: list[str], name: str) -> int | None:
    """The ggml type number given to ``name``."""
    return _int_option(rest, name, "a ggml type number", KvTypeError)


def _draft_rollback(rest: list[str]) -> int | None:
    """The tokens a --draft_model proposes at a time (llama_cpp.server's --draft_model_num_pred_tokens, default
    10): its rejected ones are removed again, so the kivi ring keeps them removable."""
    if _option(rest, "--draft_model") is None:
        return None
    count = _int_option(rest, "--draft_model_num_pred_tokens", "a token count")
    return DRAFT_TOKENS_DEFAULT if count is None else count


def server_argv(argv: list[str]) -> list[str]:
    """llama_cpp.server's command line for ours; applies the kivi settings to the process as a side effect."""
    ours, rest = _parse(argv)
    for option in ("--type_k", "--type_v"):
        check_kv_type(_type_option(rest, option))
    spec = KvSpec.parse(ours.kv_type) if ours.kv_type is not None else None
    if spec is not None:
        type_id = kv_types.type_id(spec.name)
        rest += ["--type_k", str(type_id), "--type_v", str(type_id)]
    # every part of the spec, as `pykvq run` takes it: kivi2+rot rotates, asymkv:16/0 sets per-layer types
    rotate = ours.kv_rotate if ours.kv_rotate is not None else (True if spec and spec.rotate else None)
    layers = ours.kv_layers if ours.kv_layers is not None else (spec.layers if spec else None)
    rollback = ours.kv_rollback if ours.kv_rollback is not None else _draft_rollback(rest)
    kv = KvConfig(window=ours.kv_window, sinks=ours.kv_sinks, rotate=rotate, rollback=rollback)
    native.set_kvq_params(kv.kvq_params())
    native.set_kvq_rotation(kv.rotation_spec)
    if layers is not None:
        native.set_kvq_layer_types(layers)
    if ours.kv_clip is not None:
        native.set_kvq_clip(ours.kv_clip)
    if ours.kv_dither is not None:
        native.set_kvq_dither(ours.kv_dither)
    native.set_swa_type_name(ours.kv_type_swa)
    if (spec is not None and spec.is_kivi) or layers is not None or ours.kv_type_swa in kv_types.KIVI_BITS:
        rest += ["--flash_attn", "true"]
    return rest


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="pykvq: %(message)s")
    try:
        rest = server_argv(sys.argv[1:] if argv is None else argv)
        load()
        from llama_cpp.server.__main__ import main as server_main
    except (LlamaCppError, ValueError) as exc:
        print(f"pykvq: error: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        print(f"pykvq: error: llama-cpp-python's server extras are missing ({exc.name}): install "
              f"llama-cpp-python[server]", file=sys.stderr)
        return 1
    sys.argv = ["python -m llama_cpp.server", *rest]
    try:
        server_main()
    except ValueError as exc:
        # the model loads before the server starts: a model or KV setting llama.cpp refused
        print(f"pykvq: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
