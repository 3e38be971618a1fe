"""`pykvq run`: generate text with a GGUF model on pykvq's KV cache types, with llama.cpp's flag names."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from pykvq import assets, gguf_metadata, kv_types, width_clips
from pykvq.api.llama import (
    FLASH_ATTN,
    ChatMessage,
    Context,
    ContextConfig,
    KvConfig,
    KvMemory,
    LlamaError,
    Model,
    Timings,
)
from pykvq.api.sampling import LLAMA_DEFAULT_SEED, Sampler, SamplerSettings
from pykvq.bindings import native
from pykvq.commands import arguments
from pykvq.commands import inspect as model_info
from pykvq.input_files import check_readable_file
from pykvq.kv_types import KvSpec

log = logging.getLogger("pykvq.run")

MIB = 1024 * 1024


def add_run_command(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "run", help="generate text (or chat) with a GGUF model on a chosen KV cache type",
        description="Generate text with a GGUF model. Without -m, SmolLM2-135M-Instruct is fetched on first "
                    "use and reused from the cache.")
    p.add_argument("-m", "--model", type=Path, help="GGUF model file (default: SmolLM2-135M-Instruct)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("-p", "--prompt", help="prompt to start generation with")
    prompt.add_argument("-f", "--file", type=Path, help="a file holding the prompt")
    p.add_argument("-n", "--n-predict", type=int, default=256,
                   help="tokens to generate (-1: until end of generation or a full context; default 256)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096,
                   help="context size in tokens; 0: the model's training context, reduced to fit memory under -fit "
                        "(default 4096)")
    p.add_argument("-b", "--batch-size", type=int, default=2048, help="logical batch size (default 2048)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="physical batch size (default 512)")
    p.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)), help="CPU threads")
    arguments.add_device_arguments(p)
    arguments.add_fit_arguments(p)
    p.add_argument("--swa-full", action="store_true",
                   help="a full-size cache for sliding-window layers (Gemma 2/3, gpt-oss), as llama.cpp's --swa-full")
    p.add_argument("-fa", "--flash-attn", choices=list(FLASH_ATTN), default="auto",
                   help="flash attention (kivi types always use it)")
    p.add_argument("--kv-type", metavar="TYPE",
                   help="K and V cache type, e.g. kivi2, kivi4, kivi1, q8_0, q4_0, f16, or AsymKV's asymkv:L_K/L_V "
                        "(default: the model's kvq.kv_layers, else f16)")
    p.add_argument("--kv-layers", type=arguments.spec, metavar="SPEC",
                   help="per-layer K and V types, e.g. 'k:0-15=kivi2,16-=kivi1;v:*=kivi1'; 'none' ignores a model's "
                        "kvq.kv_layers")
    p.add_argument("--kv-clip", type=arguments.spec, metavar="SPEC",
                   help="kivi: SKVQ's clipping, per-layer ratios in (0, 1] that narrow each quantization group's "
                        "range, or mse (each group's range of least squared error), e.g. 'k:*=0.9;v:*=mse'; 'none' "
                        "ignores a model's kvq.kv_clip (default: the model's kvq.kv_clip, else none)")
    p.add_argument("--kv-dither", type=arguments.spec, metavar="SPREAD|SPEC",
                   help="kivi: V's dithered rounding, a spread in [0, 1] (0: nearest, 1: stochastic rounding) for "
                        "every layer or per layer, e.g. 0.5 or 'v:0-9=1,10-=0': repeated tokens' V errors then "
                        "average out instead of adding up; 'none' ignores a model's kvq.kv_dither (default: the "
                        "model's kvq.kv_dither, else nearest)")
    p.add_argument("--kv-type-swa", type=arguments.spec, metavar="TYPE",
                   help="K and V type of the sliding-window cache of a model with sliding-window layers (Gemma 2/3, "
                        "gpt-oss), e.g. f16 beside a kivi2 global cache (default: as the global layers)")
    p.add_argument("-ctk", "--cache-type-k", metavar="TYPE", help="K cache type (overrides --kv-type)")
    p.add_argument("-ctv", "--cache-type-v", metavar="TYPE", help="V cache type (overrides --kv-type)")
    p.add_argument("--kv-window", type=int,
                   help="kivi: recent tokens kept in fp16 (default: the model's kvq.window, else 128)")
    p.add_argument("--kv-sinks", type=int,
                   help="kivi: first tokens kept in fp16 (default: the model's kvq.sinks, else 0)")
    p.add_argument("--kv-rollback", type=int,
                   help="kivi: the last N tokens can be removed exactly, e.g. on regeneration (default 0)")
    p.add_argument("--kv-select", metavar="HH,RW[,N[,D]]", type=arguments.selection,
                   help="kivi: MiniKV's prompt selection: the prompt keeps its heaviest hitters (by the attention "
                        "they drew from its last N tokens; 0: from all of it) and its most recent tokens, as shares "
                        "of its length, e.g. 0.25,0.25 or 0.25,0.25,32; off: none (default: the model's kvq.select, "
                        "else off)")
    p.add_argument("--kv-rotate", metavar="on|off|SPEC", type=arguments.rotation,
                   help="kivi: Hadamard rotation of K/V, on or off for every kivi layer or per layer, e.g. "
                        "'k:*=on;v:0-3=off,4-=on' (default: the model's kvq.kv_rotate, else off)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 or less is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k sampling (default 40, 0 = off)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p sampling (default 0.95, 1.0 = off)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p sampling (default 0.05, 0.0 = off)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="never end at the model's end-of-generation tokens: generate -n tokens or up to a full context")
    p.add_argument("-s", "--seed", type=int, default=LLAMA_DEFAULT_SEED, help="RNG seed (default: random)")
    p.add_argument("-cnv", "--conversation", action="store_true",
                   help="chat with the model through its chat template (reads turns from stdin)")
    p.add_argument("-sys", "--system-prompt", help="system message for chat mode")
    p.add_argument("--no-display-prompt", action="store_true", help="do not echo the prompt")
    p.set_defaults(handler=run_command)


def kv_config(args: argparse.Namespace) -> KvConfig:
    """The cache the flags ask for; types given (--kv-type, -ctk, -ctv) win over a model's kvq.kv_layers, as
    --kv-layers does: its mix is what runs where no type is given."""
    preset = KvSpec.parse("f16" if args.kv_type is None else args.kv_type)
    if preset.layers is not None and (args.cache_type_k or args.cache_type_v):
        raise ValueError(f"--kv-type {args.kv_type} gives every layer its K and V type, which -ctk/-ctv would not "
                         "change: give the types per layer with --kv-layers instead")
    type_k = KvSpec.parse(args.cache_type_k).name if args.cache_type_k else preset.name
    type_v = KvSpec.parse(args.cache_type_v).name if args.cache_type_v else preset.name
    rotate = args.kv_rotate if args.kv_rotate is not None else (True if preset.rotate else None)
    layers = args.kv_layers if args.kv_layers is not None else preset.layers
    if layers is None and (args.kv_type or args.cache_type_k or args.cache_type_v):
        layers = "none"
    if layers is not None:
        native.check_layer_spec(layers)
    if args.kv_type_swa is not None:
        kv_types.type_id(args.kv_type_swa)  # an unknown name is refused here, with the valid ones
    return KvConfig(type_k, type_v, args.kv_window, args.kv_sinks, rotate, layers, args.kv_rollback,
                    args.kv_type_swa, args.kv_select, args.kv_clip, args.kv_dither)


def _prompt_text(args: argparse.Namespace) -> str:
    if args.file is None:
        return args.prompt if args.prompt is not None else ""
    try:
        return args.file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"-f {args.file} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _model_path(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return args.model
    log.info("no -m given: using SmolLM2-135M-Instruct")
    return assets.default_model()


def _stream(pieces: Iterator[str], out: TextIO) -> str:
    text = []
    for piece in pieces:
        out.write(piece)
        out.flush()
        text.append(piece)
    return "".join(text)


def run_command(args: argparse.Namespace) -> int:
    kv = kv_config(args)
    if args.n_predict < -1:
        raise ValueError(f"-n must be -1 or more, got {args.n_predict}")
    if args.ctx_size < 0:
        raise ValueError(f"-c must be 0 (the model's training context) or a positive number of tokens, "
                         f"got {args.ctx_size}")
    if not args.conversation and args.prompt is None and args.file is None:
        raise ValueError("give a prompt with -p or -f, or chat with -cnv")
    if args.system_prompt is not None and not args.conversation:
        raise ValueError("-sys is the system message of a chat: give it with -cnv")
    if args.conversation and sys.stdin is None and args.prompt is None and args.file is None:
        raise ValueError("-cnv reads its turns from standard input, which is closed: give the first turn with -p")
    if args.file is not None:
        check_readable_file(args.file, "prompt")
    path = _model_path(args)
    n_gpu_layers = arguments.gpu_layers(args, unset=None if args.fit else 999)
    # the settings are checked, and the batch sizes chosen, before the weights are placed and loaded
    with Model(path, metadata_only=True) as shape:
        kv = with_model_metadata(kv, path, shape.n_layer)
        check_layers(kv, shape)
        if not kv.is_kivi:
            arguments.warn_unused_kivi_flags(args, f"the K {kv.type_k} / V {kv.type_v} cache")
        if kv.type_swa is not None and not shape.n_swa:
            arguments.warn_unused_swa_type(kv.type_swa, path)
        select = kv.select if kv.select is not None else model_selection(path)
        n_batch, n_ubatch = _batch_sizes(args, shape, kv, select)
    config = ContextConfig(args.ctx_size, n_batch, n_ubatch, args.threads, args.flash_attn, kv,
                           op_offload=args.op_offload, kv_offload=args.kv_offload, swa_full=args.swa_full)
    layers, config = arguments.fit_to_memory(args, path, config, n_gpu_layers)
    with Model(path, n_gpu_layers=layers) as model, model.context(config) as ctx:
        _generate(model, ctx, args, kv, select)
    return 0


def model_selection(model_path: Path) -> kv_types.Selection | None:
    """The model's kvq.select, which the KV cache itself takes where --kv-select gives none (keeping a prompt
    whole rather than refusing it where it cannot select)."""
    text = model_info.checked_kvq(model_path).get(gguf_metadata.KEY_SELECT)
    if text is None:
        return None
    log.info("prompt selection from the model's kvq.* metadata: %s", text)
    return kv_types.parse_select(str(text))


def _batch_sizes(args: argparse.Namespace, model: Model, kv: KvConfig,
                 select: kv_types.Selection | None) -> tuple[int, int]:
    """-b and -ub; with prompt selection raised to the prompt's length (selection reads the whole prompt in one
    ubatch), after checking that a prompt --kv-select asks to select is longer than the window it would select
    from (one the model's kvq.select would select is kept whole)."""
    if not kv_types.selects(select) or (args.kv_select is None and not kv.is_kivi):
        return args.batch_size, args.ubatch_size
    if not kv.is_kivi:
        raise ValueError(f"--kv-select keeps the selected tokens in kivi layers: K {kv.type_k} / V {kv.type_v} "
                         "cannot hold them (use --kv-type kivi2, kivi4 or kivi1)")
    if args.conversation:
        return args.batch_size, args.ubatch_size
    n_prompt = len(model.tokenize(_prompt_text(args), parse_special=True))
    window = native.kvq_default_params().window if kv.window is None else kv.window
    if n_prompt <= window and args.kv_select is None:
        return args.batch_size, args.ubatch_size
    if n_prompt <= window:
        raise ValueError(f"--kv-select: the prompt is {n_prompt} tokens, no longer than the fp16 window of {window} "
                         "that holds it whole anyway: nothing to select (drop --kv-select or give a longer prompt)")
    if n_prompt > args.ubatch_size:
        log.info("prompt selection: batch and ubatch sizes raised to the prompt's %d tokens (-b, -ub)", n_prompt)
    return max(args.batch_size, n_prompt), max(args.ubatch_size, n_prompt)


_METADATA_FIELDS = (("layers", gguf_metadata.KEY_LAYERS), ("window", gguf_metadata.KEY_WINDOW),
                    ("sinks", gguf_metadata.KEY_SINKS), ("clip", gguf_metadata.KEY_CLIP),
                    ("rotate", gguf_metadata.KEY_ROTATE), ("dither", gguf_metadata.KEY_DITHER))


def with_model_metadata(kv: KvConfig, model_path: Path, n_layer: int) -> KvConfig:
    """The model's kvq.* defaults (per-layer types, window, sinks, clip ratios, rotation, V dither) where the command
    line gives none: it wins. Where it gives the types but no clip, the model's ratios at each tensor's width
    (pykvq.width_clips) where it has them. The rest of its kvq.* metadata is checked as `pykvq inspect` checks it."""
    given = [key for field, key in _METADATA_FIELDS if getattr(kv, field) is not None]
    kvq = model_info.checked_kvq(model_path, ignored=given)
    # an empty spec names nothing, as the KV cache reads it
    from_model = {field: kvq[key] for field, key in _METADATA_FIELDS if key in kvq and kvq[key] != ""}
    # as the cache does (kvq_clips_by_width): where the types are not the model's kvq.kv_layers
    if kv.clip is None and (kv.layers is not None or not kvq.get(gguf_metadata.KEY_LAYERS)):
        types = kv_types.layer_types(kv.layers or "none", n_layer, kv.type_k, kv.type_v)
        by_width = width_clips.clip_by_width(kvq, *types)
        if by_width is not None:
            log.info("the model's kvq.kv_clip is its kvq.kv_layers' ratios: each tensor takes its width's instead "
                     "(kvq.calibration.kivi*_clip)")
            from_model["clip"] = by_width
    for field, value in from_model.items():
        log.info("KV %s from the model's kvq.* metadata: %s", field, value)
    return replace(kv, **from_model)


def check_layers(kv: KvConfig, model: Model) -> None:
    """Per-layer types, clip ratios, rotation and V dither checked against the model's layers before the context: the
    message names the part."""
    if kv.layers not in (None, "none"):
        kv_types.layer_types(kv.layers, model.n_layer, kv.type_k, kv.type_v)
    if kv.clip not in (None, "none"):
        native.resolve_clip(kv.clip, model.n_layer)
    native.resolve_rotation(kv.rotation_spec, model.n_layer)
    native.resolve_dither(kv.dither or "", model.n_layer)


def _generate(model: Model, ctx: Context, args: argparse.Namespace, kv: KvConfig,
              select: kv_types.Selection | None) -> None:
    sampler = model.sampler(SamplerSettings(args.temp, args.top_k, args.top_p, args.min_p, args.seed,
                                            args.ignore_eos))
    if args.conversation:
        _chat(model, ctx, sampler, args)
    else:
        prompt = _prompt_text(args)
        tokens = model.tokenize(prompt, parse_special=True)
        ctx.check_fits(tokens)
        if not args.no_display_prompt:
            sys.stdout.write(prompt)
        _stream(ctx.generate_text(tokens, args.n_predict, sampler), sys.stdout)
        sys.stdout.write("\n")
    memory = ctx.memory()
    _report(ctx.generation, memory, kv)
    if kv_types.selects(select) and kv.is_kivi and memory.n_elements:
        _report_selection(ctx, kv, select)
    if ctx.context_full:
        # -n -1 asks for "until the end", and a full context is one; a count that did not fit is an error
        if args.n_predict >= 0:
            raise LlamaError(f"context full after {ctx.n_past} tokens, before -n {args.n_predict} tokens "
                             "were generated (raise -c)")
        log.warning("context full after %d tokens: generation stopped (raise -c)", ctx.n_past)


def _report_selection(ctx: Context, kv: KvConfig, select: kv_types.Selection) -> None:
    """The memory the sequence holds after prompt selection, next to what plain kivi would hold for it."""
    memory = ctx.memory()
    params = native.kvq_default_params()
    window = params.window if kv.window is None else kv.window
    sinks = params.n_sink if kv.sinks is None else kv.sinks
    fp16 = kv_types.fp16_cells(window, sinks, kv.rollback or 0)
    held, n_tokens = ctx.seq_cells(0), ctx.seq_len(0)
    elements_per_cell = memory.n_elements / memory.n_cells

    def describe(n_cells: int) -> str:
        size = memory.held_bytes(n_cells, fp16)
        return f"{size / MIB:.2f} MiB, {8 * size / (n_cells * elements_per_cell):.2f} bits per element"

    print(f"pykvq: prompt selection {kv_types.selection_spec(select)}: the sequence holds {held} cells for its "
          f"{n_tokens} tokens, {describe(held)}; without selection {n_tokens} cells, {describe(n_tokens)}",
          file=sys.stderr)


def _chat_turns(args: argparse.Namespace, ctx: Context) -> Iterator[str]:
    """The user's turns until the context is full: -p or -f first, as llama.cpp's conversation mode takes it, then
    a line of stdin each."""
    first = _prompt_text(args)
    if first.strip():
        yield first
    if sys.stdin is None:
        return
    interactive = sys.stdin.isatty()
    while not ctx.context_full:
        if interactive:
            sys.stdout.write("\n> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def _chat(model: Model, ctx: Context, sampler: Sampler, args: argparse.Namespace) -> None:
    """Each new turn feeds only the text the cache has not seen yet."""
    messages = [ChatMessage("system", args.system_prompt)] if args.system_prompt else []
    evaluated = ""
    for turn in _chat_turns(args, ctx):
        messages.append(ChatMessage("user", turn))
        formatted = model.apply_chat_template(messages)
        if not formatted.startswith(evaluated):
            raise LlamaError("the chat template rewrote earlier turns; this conversation cannot continue in "
                             "the same cache")
        new_tokens = model.tokenize(formatted[len(evaluated):], add_special=not evaluated, parse_special=True)
        reply = _stream(ctx.generate_text(new_tokens, args.n_predict, sampler), sys.stdout)
        sys.stdout.write("\n")
        messages.append(ChatMessage("assistant", reply))
        evaluated = formatted + reply


def _report(timings: Timings, memory: KvMemory, kv: KvConfig) -> None:
    print(f"pykvq: prompt {timings.n_prompt} tokens, {timings.prompt_tokens_per_s:.1f} t/s | "
          f"generated {timings.n_decode} tokens, {timings.decode_tokens_per_s:.1f} t/s", file=sys.stderr)
    if not memory.n_elements:
        # a model without attention (Mamba, RWKV) keeps a recurrent state per sequence, which no KV type changes
        print(f"pykvq: no KV cache: the model keeps a recurrent state ({memory.bytes / MIB:.2f} MiB), which the KV "
              "type does not change", file=sys.stderr)
        return
    settings = ""
    if kv.is_kivi:
        params = kv.kvq_params()
        # with_model_metadata filled in the model's kvq.* values: what is still unset is the default
        defaults = native.kvq_default_params()
        window = defaults.window if kv.window is None else kv.window
        sinks = defaults.n_sink if kv.sinks is None else kv.sinks
        rollback = f", rollback {params.n_rollback}" if params.n_rollback else ""
        clip = f", clip {kv.clip}" if kv.clip not in (None, "none") else ""
        rotation = kv.rotation_spec or ("on" if params.rotate else "off")
        rotated = "" if rotation == "off" else ", rotated" if rotation == "on" else f", rotation {rotation}"
        dither = f", V dither {kv.dither}" if kv.dither not in (None, "none") else ""
        settings = f" (window {window}, sinks {sinks}{rollback}{clip}{rotated}{dither})"
    types = f"layers {kv.layers}" if kv.layers not in (None, "none") else f"K {kv.type_k}, V {kv.type_v}"
    if memory.swa_n_cells and kv.type_swa and kv.layers in (None, "none"):
        # most of such a cache may be the sliding-window layers': the headline names their type too
        types += f", sliding-window layers {kv.type_swa}"
    print(f"pykvq: KV cache {types}{settings}: {memory.bytes / MIB:.2f} MiB for "
          f"{memory.n_cells} cells, {memory.bits_per_element:.2f} bits per element; f16 KV would use "
          f"{memory.f16_bytes / MIB:.2f} MiB ({memory.ratio_to_f16:.2f}x)", file=sys.stderr)
    if memory.swa_n_cells:
        # per-layer types (--kv-layers, a model's kvq.kv_layers) address the layers of both caches
        if kv.layers not in (None, "none"):
            swa_type = "per-layer types"
        else:
            swa_type = kv.type_swa or (kv.type_k if kv.type_k == kv.type_v else f"{kv.type_k}/{kv.type_v}")
        global_mib = (memory.bytes - memory.swa_bytes) / MIB
        global_part = (f"the global layers' {global_mib:.2f} MiB, {memory.global_bits_per_element:.2f} bits per element"
                       if memory.n_elements > memory.swa_n_elements else "no global layers")
        print(f"pykvq: of which the sliding-window layers' cache ({swa_type}): {memory.swa_bytes / MIB:.2f} MiB for "
              f"{memory.swa_n_cells} cells, {memory.swa_bits_per_element:.2f} bits per element; {global_part}",
              file=sys.stderr)
