"""llama-cpp-python's OpenAI-compatible server on pykvq's libllama and KV types.

    python -m pykvq.llama_cpp.server --model model.gguf --kv-type kivi2 [--kv-window 64] [llama_cpp.server options]

takes every option of ``python -m llama_cpp.server`` plus pykvq's: ``--kv-type`` (any form `pykvq run` takes:
kivi2, kivi2+rot, asymkv:16/0) sets --type_k, --type_v and --flash_attn true (a type given, here or as --type_k
/--type_v, wins over a model's kvq.kv_layers, as in `pykvq run`); ``--kv-window``, ``--kv-sinks``,
``--kv-rollback``, ``--kv-rotate``, ``--kv-layers``, ``--kv-clip``, ``--kv-dither`` and ``--kv-type-swa`` set the kivi
layers of every model the server loads. Its models are pykvq.llama_cpp.Llama objects (``--rpc_servers`` included).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import logging
import sys
from collections.abc import Awaitable, Callable

from pykvq import kv_types
from pykvq.commands.arguments import rotation, spec
from pykvq.kv_types import KvSpec, KvTypeError
from pykvq.llama_cpp import LlamaCppError, flash_attn_reason, kv_config, load, model_layer_spec

# what llama_cpp.server reads as false for a boolean option (its cli._parse_bool_arg)
FALSE_VALUES = {"0", "off", "f", "false", "n", "no"}


def _parser() -> argparse.ArgumentParser:
    """pykvq's options; the rest are llama_cpp.server's."""
    parser = argparse.ArgumentParser(prog="python -m pykvq.llama_cpp.server", add_help=False,
                                     usage="%(prog)s [pykvq's options] [llama_cpp.server's options]",
                                     description="llama-cpp-python's OpenAI-compatible server on pykvq's KV cache "
                                                 "types: pykvq's options below, then llama_cpp.server's.")
    parser.add_argument("--kv-type", help="K and V cache type by name, e.g. kivi2")
    parser.add_argument("--kv-window", type=int, help="kivi: recent tokens kept in fp16 (default: the model's "
                                                      "kvq.window, else 128)")
    parser.add_argument("--kv-sinks", type=int, help="kivi: first tokens kept in fp16 (default: the model's "
                                                     "kvq.sinks, else 0)")
    parser.add_argument("--kv-rollback", type=int, help="kivi: last tokens removable exactly (default: "
                                                        "--draft_model_num_pred_tokens with a --draft_model, else 0)")
    parser.add_argument("--kv-rotate", type=rotation,
                        help="kivi: Hadamard rotation, on, off or per layer, e.g. k:*=on;v:0-3=off,4-=on (default: the "
                             "model's kvq.kv_rotate, else off)")
    parser.add_argument("--kv-layers", type=spec,
                        help="per-layer K/V types, e.g. asymkv:16/0 or k:0-15=kivi2,16-=kivi1;v:*=kivi1")
    parser.add_argument("--kv-clip", type=spec,
                        help="kivi: SKVQ's per-layer clip ratios, or mse (each group's range of least squared error), "
                             "e.g. k:*=0.9;v:*=mse")
    parser.add_argument("--kv-dither", type=spec,
                        help="kivi: V's dithered rounding, a spread in [0, 1] or per layer, e.g. 0.5 or v:0-9=1,10-=0 "
                             "(default: the model's kvq.kv_dither, else nearest)")
    parser.add_argument("--kv-type-swa", type=spec,
                        help="K and V type of a Gemma-2/3 or gpt-oss model's sliding-window cache")
    return parser


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = _parser()
    if "-h" in argv or "--help" in argv:
        # llama_cpp.server's help follows, and exits
        print(parser.format_help())
    return parser.parse_known_args(argv)


def _option(rest: list[str], name: str) -> str | None:
    """The value given to ``name`` (``--type_k 43`` or ``--type_k=43``) in llama_cpp.server's arguments: the last
    one, as its parser takes it."""
    value = None
    for i, arg in enumerate(rest):
        if arg.startswith(f"{name}="):
            value = arg.split("=", 1)[1]
        elif arg == name and i + 1 < len(rest):
            value = rest[i + 1]
    return value


def _type_option(rest: list[str], name: str) -> int | None:
    """The ggml type number given to ``name``."""
    value = _option(rest, name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise KvTypeError(f"{name} takes a ggml type number, got {value!r}") from None


def server_argv(argv: list[str]) -> tuple[list[str], dict[str, object]]:
    """llama_cpp.server's command line for ours, and the kivi settings (checked) that every Llama it creates takes."""
    ours, rest = _parse(argv)
    spec = KvSpec.parse(ours.kv_type) if ours.kv_type is not None else None
    if spec is not None:
        type_id = kv_types.type_id(spec.name)
        rest += ["--type_k", str(type_id), "--type_v", str(type_id)]
    # every part of the spec, as `pykvq run` takes it: kivi2+rot rotates, asymkv:16/0 sets per-layer types
    rotate = ours.kv_rotate if ours.kv_rotate is not None else (True if spec and spec.rotate else None)
    layers = ours.kv_layers if ours.kv_layers is not None else (spec.layers if spec else None)
    if layers is None and (spec or _option(rest, "--type_k") or _option(rest, "--type_v")):
        # types given win over a model's kvq.kv_layers, as in `pykvq run`: --kv-type f16 ran a calibrated copy's mix
        layers = "none"
    settings = {"kv_window": ours.kv_window, "kv_sinks": ours.kv_sinks, "kv_rotate": rotate, "kv_layers": layers,
                "kv_rollback": ours.kv_rollback, "kv_type_swa": ours.kv_type_swa, "kv_clip": ours.kv_clip,
                "kv_dither": ours.kv_dither}
    # refused here, with the reason, before any model loads
    kv = kv_config({"type_k": _type_option(rest, "--type_k"), "type_v": _type_option(rest, "--type_v"), **settings})
    reason = flash_attn_reason(kv, model_layer_spec((), {"model_path": _option(rest, "--model")}))
    if reason:
        flash_attn = _option(rest, "--flash_attn")
        if flash_attn is not None and flash_attn.strip().lower() in FALSE_VALUES:
            raise KvTypeError(f"{reason}: drop --flash_attn {flash_attn} (the server turns it on)")
        rest += ["--flash_attn", "true"]
    return rest, settings


def check_prompt_fits(llama, prompt: str | list[int]) -> None:
    """llama-cpp-python's own check of a completion's prompt against the context (Llama._create_completion), in its
    words, which its server answers with a 400 context_length_exceeded; the prompt counted as it counts one without
    a suffix: BOS (or CLS) and EOS where the model adds them."""
    n_tokens = len(prompt) if isinstance(prompt, list) else len(llama.tokenize(prompt.encode(), add_bos=True,
                                                                              special=True))
    if n_tokens >= llama.n_ctx():
        raise ValueError(f"Requested tokens ({n_tokens}) exceed context window of {llama.n_ctx()}")


class _Prompt(Exception):  # noqa: N818 (it stops a call where it has what it needs: no error)
    """What a chat format handed Llama.create_completion."""

    def __init__(self, prompt: str | list[int]) -> None:
        super().__init__("the chat's prompt")
        self.prompt = prompt


def chat_prompt(llama, body) -> str | list[int] | None:
    """The prompt the model's chat format makes of a chat request: Llama.create_chat_completion run up to where its
    format hands the prompt to create_completion, which stops it there. None where a chat handler builds it (a
    multimodal one evaluates the images first)."""
    if llama.chat_handler is not None:
        return None

    def stop(*args, **kwargs):
        raise _Prompt(kwargs["prompt"] if "prompt" in kwargs else args[0])

    llama.create_completion = stop
    try:
        llama.create_chat_completion(messages=body.messages, functions=body.functions,
                                     function_call=body.function_call, tools=body.tools, tool_choice=body.tool_choice)
    except _Prompt as given:
        return given.prompt
    finally:
        del llama.create_completion
    return None


def completion_prompt(llama, body) -> str | None:
    """A completion request's prompt (the endpoint has made body.prompt one prompt); None with a suffix, which
    llama-cpp-python counts otherwise."""
    return body.prompt if body.suffix is None else None


def _checking_streamed_prompts(endpoint: Callable[..., Awaitable[object]], app,
                               prompt_of: Callable[..., str | list[int] | None]) -> Callable[..., Awaitable[object]]:
    def check(llama, body) -> None:
        prompt = prompt_of(llama, body)
        if prompt is not None:
            check_prompt_fits(llama, prompt)

    @functools.wraps(endpoint)
    async def checked(request, body):
        response = await endpoint(request=request, body=body)
        # a streamed answer's Llama runs only once its 200 has gone out: a prompt too long for the context
        # ended it empty, the error in the server's log
        if body.stream:
            async with contextlib.asynccontextmanager(app.get_llama_proxy)() as proxy:
                await app.run_in_threadpool(check, proxy(body.model), body)
        return response

    # FastAPI reads the parameters' types from the signature: the endpoint's module has postponed annotations
    checked.__signature__ = inspect.signature(endpoint, eval_str=True)
    return checked


def check_streamed_prompts() -> None:
    """Make llama_cpp.server refuse a streamed completion or chat completion whose prompt does not fit the context
    as it refuses one that is not streamed (a 400 rather than a 200 with an empty body); before it creates its
    app."""
    from llama_cpp.server import app

    prompts = {app.create_completion: completion_prompt, app.create_chat_completion: chat_prompt}
    for route in app.router.routes:
        prompt_of = prompts.get(getattr(route, "endpoint", None))
        if prompt_of is not None:
            route.endpoint = _checking_streamed_prompts(route.endpoint, app, prompt_of)


def serving_llama(settings: dict[str, object]) -> type:
    """pykvq's Llama with the server's kivi settings, for llama_cpp.server to create: upstream's Llama would
    ignore --rpc_servers (llama.cpp now registers them as devices) and skip pykvq's checks; a draft model's length
    sets the rollback unless --kv-rollback is given."""
    from pykvq.llama_cpp import Llama

    class ServingLlama(Llama):
        # the settings reach __new__ too, which checks them before an instance exists
        def __new__(cls, *args, **kwargs) -> ServingLlama:
            return super().__new__(cls, *args, **{**settings, **kwargs})

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **{**settings, **kwargs})

    return ServingLlama


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="pykvq: %(message)s")
    # llama-cpp-python prints llama.cpp's log (by the server's --verbose): pykvq's copy of it would double each line
    logging.getLogger("pykvq.llama").setLevel(logging.CRITICAL)
    try:
        rest, settings = server_argv(sys.argv[1:] if argv is None else argv)
        llama_cpp = load()
        # llama_cpp.server creates its models as llama_cpp.Llama
        llama_cpp.Llama = serving_llama(settings)
        check_streamed_prompts()
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
