"""`pykvq convert`: an HF model to GGUF through llama.cpp's own converter, with calibrated kvq.* metadata.

Conversion, calibration and the metadata happen in a temporary folder beside the output; the output appears
(renamed into place) only once all of it succeeded, so a failure never leaves a half-written model (nor the folders
made for -o) behind and never touches a file the user already had there; an -o naming one of the inputs is refused
before any work (pykvq.output_path).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from pathlib import Path

from pykvq.convert import hf_converter
from pykvq.convert.kv_calibration import Calibration, CalibrationSettings

from pykvq import gguf_metadata, output_path
from pykvq.calibration.allocation import BITS, PARTS, allocate, budget_argument, format_allocation
from pykvq.calibration.clip_ratios import fewest_quantized_tokens

log = logging.getLogger("pykvq.convert")


def check_args(args: argparse.Namespace) -> None:
    if args.kv_budget is not None:
        if args.calibrate is None:
            raise ValueError("--kv-budget needs --calibrate TEXT: the per-layer types are chosen from measurements")
        if args.kv_budget < min(BITS.values()):
            raise ValueError(f"--kv-budget {args.kv_budget:g} is below what any mix reaches "
                             f"({min(BITS.values())} bit: kivi1 everywhere)")
    if args.calibrate is not None and not args.calibrate.is_file():
        raise FileNotFoundError(f"calibration text not found: {args.calibrate}")
    if args.kv_window < 0 or args.kv_sinks < 0 or args.calibrate_tokens < 1:
        raise ValueError("need --kv-window >= 0, --kv-sinks >= 0 and --calibrate-tokens >= 1")
    fewest = fewest_quantized_tokens(args.kv_window, args.kv_sinks)
    if args.calibrate is not None and args.calibrate_tokens < fewest:
        raise ValueError(f"--calibrate-tokens {args.calibrate_tokens} with window {args.kv_window} and sinks "
                         f"{args.kv_sinks} leaves no K or V quantized (it takes {fewest} tokens or more): raise "
                         "--calibrate-tokens or lower --kv-sinks")


# plain English and digits: text any model's vocabulary must tokenize
VOCABULARY_PROBE = "The quick brown fox jumps over the lazy dog, 0123456789 times."


def check_vocabulary(gguf: Path) -> None:
    """llama.cpp's converter can write a vocabulary llama.cpp cannot tokenize with (a byte-level BPE whose
    tokenizer.json says byte_fallback is taken for SentencePiece's and written without its byte tokens): a
    ConversionError now instead of a model that fails at its first prompt."""
    from pykvq.api.llama import LlamaError, Model

    with Model(gguf, vocab_only=True) as model:
        try:
            model.tokenize(VOCABULARY_PROBE, add_special=False)
        except LlamaError as err:
            raise hf_converter.ConversionError(f"llama.cpp's converter wrote a vocabulary that llama.cpp cannot "
                                               f"tokenize {VOCABULARY_PROBE!r} with ({err}): check the folder's "
                                               "tokenizer files") from err


def calibration_tokens(gguf: Path, text: Path, n_tokens: int, window: int, sinks: int) -> tuple[list[int], int]:
    """The first ``n_tokens`` of the text, tokenized as llama.cpp will tokenize for this model, and its layers."""
    from pykvq.api.llama import Model

    with Model(gguf) as model:
        tokens = model.tokenize(text.read_text(encoding="utf-8", errors="replace"))[:n_tokens]
        n_layer = model.n_layer
    needed = fewest_quantized_tokens(window, sinks)
    if len(tokens) < needed:
        raise ValueError(f"the calibration text {text} has {len(tokens)} tokens; with window {window} and sinks "
                         f"{sinks} at least {needed} are needed for any K or V to be quantized")
    return tokens, n_layer


def calibration_metadata(calibration: Calibration, text: Path) -> dict[str, object]:
    settings = calibration.settings
    record: dict[str, object] = {
        "kvq.calibration.text": text.name,
        "kvq.calibration.n_tokens": calibration.n_tokens,
        "kvq.calibration.window": settings.window,
        "kvq.calibration.sinks": settings.sinks,
    }
    for part in PARTS:
        for name in BITS:
            record[f"kvq.calibration.error_{part}_{name}"] = calibration.errors[part, name]
    layers = [calibration.stats[il] for il in range(calibration.n_layer)]
    record["kvq.calibration.k_absmax"] = [s.k_absmax for s in layers]
    record["kvq.calibration.v_absmax"] = [s.v_absmax for s in layers]
    record["kvq.calibration.k_rms"] = [s.k_rms for s in layers]
    record["kvq.calibration.v_rms"] = [s.v_rms for s in layers]
    record["kvq.calibration.k_channel_absmax"] = [x for s in layers for x in s.k_channel_absmax]
    return record


def run(args: argparse.Namespace) -> int:
    check_args(args)
    model = hf_converter.inspect_folder(args.hf_dir)
    out: Path = args.output
    inputs = [(f"a file of {model.path}", f) for f in model.path.rglob("*")]
    if args.calibrate is not None:
        inputs.append(("the calibration text", args.calibrate))
    with output_path.new_output(out, inputs):
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".pykvq-convert", dir=out.parent))
        try:
            raw = work / "converted.gguf"
            hf_converter.convert(model, raw, args.outtype)
            check_vocabulary(raw)
            metadata: dict[str, object] = {gguf_metadata.KEY_WINDOW: args.kv_window,
                                           gguf_metadata.KEY_SINKS: args.kv_sinks}
            if args.calibrate is not None:
                metadata |= calibrate_into(args, model, raw)
            gguf_metadata.write_copy(raw, out, metadata)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out}")
    return 0


def calibrate_into(args: argparse.Namespace, model: hf_converter.HfModel, raw: Path) -> dict[str, object]:
    from pykvq.convert.kv_calibration import calibrate, default_device

    tokens, n_layer = calibration_tokens(raw, args.calibrate, args.calibrate_tokens, args.kv_window, args.kv_sinks)
    settings = CalibrationSettings(args.kv_window, args.kv_sinks, args.device or default_device())
    log.info("calibrating on %d tokens of %s (%s)", len(tokens), args.calibrate, settings.device)
    calibration = calibrate(model.path, tokens, n_layer, settings)
    record = calibration_metadata(calibration, args.calibrate)
    if args.kv_budget is not None:
        allocation = allocate(calibration.sensitivities(), calibration.n_layer, args.kv_budget)
        print(format_allocation(allocation))
        print(f"mean code bits {allocation.mean_bits:.3f} (budget {args.kv_budget:g}); attention-output error "
              f"{allocation.predicted_cost:+.4g} against kivi2 everywhere (sum over layers)")
        print(f"--kv-layers '{allocation.spec()}'")
        record |= gguf_metadata.allocation_fields(allocation.spec(), args.kv_budget)
    return record


def add_convert_command(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "convert", help="convert a Hugging Face model to GGUF, with calibrated per-layer KV types",
        description="Converts with llama.cpp's own convert_hf_to_gguf.py (every architecture it supports), "
                    "optionally measures on a text how much quantizing each layer's K and V at 4, 2 and 1 bits "
                    "costs (the HF model through torch), picks per-layer types for --kv-budget and writes them "
                    "with the statistics as kvq.* metadata, which pykvq run and perplexity read.")
    p.add_argument("hf_dir", type=Path, metavar="HF_DIR", help="the Hugging Face model folder")
    p.add_argument("-o", "--outfile", "--output", dest="output", type=Path, required=True, help="the GGUF to write")
    p.add_argument("--outtype", choices=hf_converter.OUTTYPES, default="f16",
                   help="weight type of the GGUF (default %(default)s)")
    p.add_argument("--calibrate", type=Path, metavar="TEXT", help="calibration text: measure every layer's K and V")
    p.add_argument("--kv-budget", type=budget_argument, metavar="BITS",
                   help="mean code bits per K/V element for the per-layer types (kivi4 = 4, kivi2 = 2, kivi1 = 1); "
                        "needs --calibrate")
    p.add_argument("--calibrate-tokens", type=int, default=512,
                   help="calibration tokens from the start of the text (default %(default)s)")
    p.add_argument("--kv-window", type=int, default=128,
                   help="kivi window: measured with, and written as the model's default (default %(default)s)")
    p.add_argument("--kv-sinks", type=int, default=0,
                   help="kivi sinks: measured with, and written as the model's default (default %(default)s)")
    p.add_argument("--device", help="torch device for the calibration (default: cuda when there is one, else cpu)")
    p.set_defaults(handler=run)
