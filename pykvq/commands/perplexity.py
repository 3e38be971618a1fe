"""`pykvq perplexity`: every KV cache type on the same chunks of the same text, with the real llama-perplexity."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

from tqdm import tqdm

from pykvq import gguf_metadata, kv_types, llama_tools, paths
from pykvq.api.fit import DEFAULT_MARGIN_MIB
from pykvq.api.llama import Model
from pykvq.bindings import native
from pykvq.commands import arguments
from pykvq.commands import inspect as model_info
from pykvq.input_files import check_readable_file
from pykvq.kv_types import KvSpec

log = logging.getLogger("pykvq.perplexity")

# a chunk's line: "[3]21.4402," or, with --kl-divergence, "   3    21.4402 ±     1.2345    ..."
_CHUNK_DONE = re.compile(rb"\[\d+\][0-9.]+,|^ *\d+ +[0-9.]+ \xc2\xb1 ", re.MULTILINE)


@dataclass(frozen=True)
class Settings:
    model: Path
    text: Path
    n_ctx: int
    chunks: int
    threads: int
    window: int
    n_sink: int
    type_swa: str | None = None
    # SKVQ's per-layer clip ratios of every kivi run (the --kv-clip form); None: the model's, each run's own (its
    # ratios at the run's widths where it has them, pykvq.width_clips, else its kvq.kv_clip), as the cache takes them
    clip: str | None = None
    rotate: str = "off"     # the Hadamard rotation of every kivi run but the +rot ones (the --kv-rotate form)
    dither: str = "none"    # V's dithered rounding of every kivi run (the --kv-dither form)
    n_gpu_layers: int | None = None  # None: llama-perplexity's default, as many layers as fit
    rpc: str | None = None
    op_offload: bool = True
    fit: bool = True  # llama-perplexity's -fit: the layers -ngl leaves unset fitted to free memory
    fit_target: tuple[int, ...] = (DEFAULT_MARGIN_MIB,)  # -fitt: MiB each device keeps free
    kl_divergence: bool = False  # every run's KL divergence from the f16 run's next-token distributions too
    kv_offload: bool = True  # -nkvo turns it off: the KV cache in host memory


@dataclass
class Run:
    """One row of the comparison; a type that could not be run (refused, out of memory, a bad spec) keeps its row,
    with ``failure`` saying why and no figures."""

    kv_type: str
    ppl: float | None
    error: float | None
    bpe_k: float | None
    bpe_v: float | None
    seconds: float
    running_ppl: list[float] = field(default_factory=list)
    delta_pct: float | None = None
    failure: str | None = None
    kld: float | None = None  # mean KL divergence from f16 (--kl-divergence), ± kld_error
    kld_error: float | None = None
    kld_p99: float | None = None
    same_top_pct: float | None = None  # tokens whose most likely next token is f16's

    @classmethod
    def failed(cls, kv_type: str, why: str, seconds: float = 0.0) -> Run:
        return cls(kv_type, None, None, None, None, seconds, failure=why)


def tool_args(settings: Settings, spec: KvSpec, kld_args: tuple[str, ...] = ()) -> list[str]:
    # -b = -c: one sequence per pass, so that every type sees the same chunks the same way
    args = ["-m", str(settings.model), "-f", str(settings.text), "-c", str(settings.n_ctx), "-b", str(settings.n_ctx),
            "--chunks", str(settings.chunks), "-t", str(settings.threads), "-fa", "on",
            "-ctk", spec.name, "-ctv", spec.name, "--op-offload" if settings.op_offload else "--no-op-offload"]
    if not settings.kv_offload:
        args.append("-nkvo")
    args += ["-fit", "on" if settings.fit else "off", "-fitt", arguments.fit_target(settings.fit_target)]
    if settings.n_gpu_layers is not None:
        args += ["-ngl", str(settings.n_gpu_layers)]
    if settings.rpc:
        args += ["--rpc", settings.rpc]
    if spec.is_kivi:
        args += ["--kv-window", str(settings.window), "--kv-sinks", str(settings.n_sink),
                 "--kv-rotate", "on" if spec.rotate else settings.rotate, "--kv-dither", settings.dither]
        if settings.clip is not None:
            args += ["--kv-clip", settings.clip]
    if settings.type_swa is not None:
        args += ["--kv-type-swa", settings.type_swa]
    # "none": the runs compare the named types, whatever per-layer types the model's metadata suggests
    return [*args, "--kv-layers", spec.layers or "none", *kld_args]


def run_one(settings: Settings, spec: KvSpec, progress: tqdm, kld_args: tuple[str, ...] = ()) -> Run:
    """One llama-perplexity run, advancing `progress` as its chunks complete; ``kld_args``: llama-perplexity's
    options that write the f16 base's log-probabilities or score against them."""
    cmd = [str(paths.tool("llama-perplexity")), *tool_args(settings, spec, kld_args)]
    if log.isEnabledFor(logging.DEBUG):
        # -v shows llama.cpp's whole log, as for `pykvq -v run`: the tool's too (where the layers went, ...)
        cmd += ["-lv", "4"]
    log.debug("running %s", " ".join(cmd))
    start = time.monotonic()
    output = bytearray()
    done = 0
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        try:
            while chunk := os.read(proc.stdout.fileno(), 1 << 16):
                output += chunk
                finished = len(_CHUNK_DONE.findall(output))
                progress.update(finished - done)
                done = finished
        except BaseException:
            # a SIGTERM reaches pykvq alone, and Popen's exit would wait for the tool to finish its chunks
            proc.kill()
            raise
    text = output.decode(errors="replace")
    log.debug("llama-perplexity's output:\n%s", text)
    if proc.returncode != 0:
        raise llama_tools.tool_failure("llama-perplexity", proc.returncode, text)
    result = llama_tools.parse_perplexity(text)
    progress.update(settings.chunks - done)
    bpe_k, bpe_v = kv_types.layer_bits_per_element(spec, model_layers(settings.model), settings.n_ctx,
                                                   settings.window, settings.n_sink)
    row = Run(spec.label, result.ppl, result.error, bpe_k, bpe_v, time.monotonic() - start, result.running_ppl)
    if result.kld is not None:
        row.kld, row.kld_error = result.kld.mean, result.kld.error
        row.kld_p99, row.same_top_pct = result.kld.p99, result.kld.same_top_pct
    return row


@cache
def model_layers(model: Path) -> int:
    with Model(model, metadata_only=True) as m:
        return m.n_layer


def f16_run(runs: list[Run]) -> Run | None:
    """The f16 row that the others' ΔPPL is measured against, if it ran."""
    return next((r for r in runs if r.kv_type == "f16" and r.ppl is not None), None)


def is_f16(spec: KvSpec) -> bool:
    return spec.label == "f16"


def kld_options(settings: Settings, spec: KvSpec, base_file: str) -> tuple[str, ...]:
    """llama-perplexity's options for --kl-divergence: the f16 run writes its log-probabilities, the others are
    scored against them."""
    if not settings.kl_divergence:
        return ()
    return ("--kl-divergence-base", base_file, *(() if is_f16(spec) else ("--kl-divergence",)))


def compare(settings: Settings, specs: list[KvSpec], base: Run | None = None) -> list[Run]:
    """Runs every spec in turn; one that fails is a row saying why. ΔPPL is against ``base``, else the f16 run
    among these. With settings.kl_divergence the f16 run goes first (added if
    not given) and writes its log-probabilities to a temporary file, which the others are scored against."""
    if settings.kl_divergence:
        specs = [next((s for s in specs if is_f16(s)), None) or KvSpec.parse("f16"),
                 *(s for s in specs if not is_f16(s))]
    runs: list[Run] = []
    with (tqdm(total=settings.chunks * len(specs), unit="chunk", desc="perplexity") as progress,
          tempfile.TemporaryDirectory(prefix="pykvq-kld-") as folder):
        kld_base = str(Path(folder) / "f16.kld")
        for spec in specs:
            if settings.kl_divergence and runs and runs[0].failure is not None:
                runs.append(Run.failed(spec.label, f"no f16 run to score against: {runs[0].failure}"))
                progress.update(settings.chunks)
                continue
            progress.set_postfix_str(spec.label)
            runs.append(run_or_failure(settings, spec, progress, kld_options(settings, spec, kld_base)))
    if settings.kl_divergence and runs[0].failure is None:
        runs[0].kld, runs[0].kld_error, runs[0].kld_p99, runs[0].same_top_pct = 0.0, 0.0, 0.0, 100.0
    base = base or f16_run(runs)
    for r in runs:
        if base is not None and r.ppl is not None:
            r.delta_pct = 100.0 * (r.ppl - base.ppl) / base.ppl
    return runs


def run_or_failure(settings: Settings, spec: KvSpec, progress: tqdm, kld_args: tuple[str, ...] = ()) -> Run:
    """One row: the run, or why it failed, so that the other types of a long comparison still report."""
    start = time.monotonic()
    done = progress.n
    try:
        return run_one(settings, spec, progress, kld_args)
    except (llama_tools.ToolError, OSError, ValueError) as exc:
        log.error("KV type %s: %s", spec.label, str(exc).splitlines()[0])
        progress.update(done + settings.chunks - progress.n)
        return Run.failed(spec.label, str(exc), time.monotonic() - start)


def parse_specs(kv_types_text: str, layer_specs: list[str]) -> list[KvSpec]:
    """The --kv-types and --kv-layers entries; KvTypeError naming every one that does not parse, before any run
    (a typo in the last type cost the runs of all the others)."""
    given = [(KvSpec.parse, part.strip()) for part in kv_types_text.split(",") if part.strip()]
    given += [(KvSpec.per_layer, text) for text in layer_specs]
    entries, refused = [], []
    for parse, text in given:
        try:
            entries.append(parse(text))
        except ValueError as exc:
            refused.append(f"{text}: {exc}")
    if refused:
        raise kv_types.KvTypeError("; ".join(refused))
    if not entries:
        raise kv_types.KvTypeError("no KV cache type given")
    return entries


@cache
def sliding_window_model(model: Path) -> bool:
    """Whether the model has sliding-window layers, whose cache --kv-type-swa types (from its hyperparameters)."""
    with Model(model, metadata_only=True) as shape:
        return shape.n_swa > 0


def check_swa_type(type_swa: str, specs: list[KvSpec], model: Path) -> None:
    """KvTypeError, before any run, for --kv-type-swa beside per-layer rows on a model with sliding-window layers
    (those rows name the sliding-window layers' types; the cache refuses both); a warning where it changes
    nothing."""
    if not sliding_window_model(model):
        arguments.warn_unused_swa_type(type_swa, model)
        return
    per_layer = [spec.label for spec in specs if spec.layers]
    if per_layer:
        raise kv_types.KvTypeError(f"--kv-type-swa {type_swa} beside per-layer types ({', '.join(per_layer)}): "
                                   "those give the sliding-window layers their types; compare them in a run "
                                   "without --kv-type-swa")


def format_table(runs: list[Run]) -> str:
    with_kld = any(r.kld is not None for r in runs)
    # as wide as the longest label: a per-layer spec's runs past 12 characters
    w = max(12, *(len(r.kv_type) for r in runs))
    header = f"{'KV type':<{w}} {'K bpe':>6} {'V bpe':>6} {'PPL':>9} {'± err':>8} {'Δ% vs f16':>10}"
    if with_kld:
        header += f" {'KLD vs f16':>11} {'KLD p99':>8} {'same top %':>10}"
    lines = [header, "-" * len(header)]
    for r in runs:
        if r.failure is not None:
            lines.append(f"{r.kv_type:<{w}} failed: {r.failure.splitlines()[0]}")
            continue
        delta = "" if r.delta_pct is None else f"{r.delta_pct:+.2f}"
        line = f"{r.kv_type:<{w}} {r.bpe_k:>6.2f} {r.bpe_v:>6.2f} {r.ppl:>9.4f} {r.error:>8.4f} {delta:>10}"
        if with_kld and r.kld is not None:
            p99 = "" if r.kld_p99 is None else f"{r.kld_p99:.4f}"
            line += f" {r.kld:>11.5f} {p99:>8} {r.same_top_pct:>10.2f}"
        lines.append(line)
    return "\n".join(lines)


def write_json(path: Path, settings: Settings, runs: list[Run]) -> None:
    record = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
              "runs": [asdict(r) for r in runs]}
    path.write_text(json.dumps(record, indent=1) + "\n")


def plot(path: Path, settings: Settings, runs: list[Run]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    # the KL divergence from f16 where it was measured (more telling than a few chunks' perplexity), else ΔPPL
    by_kld = any(r.kld for r in runs)
    for r in runs:
        y = r.kld if by_kld else r.delta_pct
        if y is None or (by_kld and y <= 0):
            continue
        color = "tab:blue" if r.kv_type.startswith("kivi") else "tab:gray"
        ax.scatter((r.bpe_k + r.bpe_v) / 2, y, color=color)
        ax.annotate(r.kv_type, ((r.bpe_k + r.bpe_v) / 2, y), textcoords="offset points", xytext=(4, 4))
    if by_kld:
        ax.set_yscale("log")
        ax.set_ylabel("mean KL divergence from f16 KV (nats per token), log")
    else:
        ax.axhline(0, color="black", linewidth=0.5)
        # symlog: a broken type (+10000%) and the near-lossless ones (+0.1%) both stay readable
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylim(bottom=min([-1.0] + [r.delta_pct * 1.5 for r in runs if r.delta_pct is not None]))
        ax.set_ylabel("ΔPPL vs f16 KV (%), symlog")
    ax.set_xlabel("bits per element (K and V mean, scales, window and sinks included)")
    ax.set_title(f"{settings.model.stem}, {settings.text.stem}, n_ctx {settings.n_ctx}, {settings.chunks} chunks")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass(frozen=True)
class OutputFiles:
    json: Path
    png: Path


def output_files(prefix: str) -> OutputFiles:
    """PREFIX.json and PREFIX.png, the prefix kept whole (a dot in it is no suffix to replace: `-o run.kivi2` and
    `-o run.q4_0` must not both write run.json) but for a .json or .png the user gave as one of the two names
    (`-o run.json` writes run.json, not run.json.json), checked before any run so that hours of runs are not lost
    to a folder that is not there."""
    base = Path(prefix)
    if base.suffix.lower() in (".json", ".png"):
        base = base.with_suffix("")
    if not base.name or base.is_dir():
        raise ValueError(f"-o {prefix}: give a file prefix (PREFIX.json and PREFIX.png are written), not a folder")
    if not base.parent.is_dir():
        raise ValueError(f"-o {prefix}: the folder {base.parent} does not exist")
    return OutputFiles(base.with_name(base.name + ".json"), base.with_name(base.name + ".png"))


def join_model_layers(specs: list[KvSpec], model_layers_spec: str, n_layer: int) -> None:
    """The model's kvq.kv_layers as one more run, unless it is one type everywhere that a run already compares (a
    calibrated copy whose mix fell back to kivi2 everywhere: the same cache, so the same figures, at a run's cost)."""
    types_k, types_v = kv_types.layer_types(model_layers_spec, n_layer, "kivi2", "kivi2")
    if len(set(types_k + types_v)) == 1 and any(
            spec.name == types_k[0] and not spec.rotate and not spec.layers for spec in specs):
        log.info("the model's kvq.kv_layers (%s) is %s everywhere, already in the comparison", model_layers_spec,
                 types_k[0])
        return
    log.info("the model's kvq.kv_layers joins the comparison: %s", model_layers_spec)
    specs.extend(parse_specs("", [model_layers_spec]))


def model_clip_words(kvq: dict[str, object]) -> str | None:
    """Which of the model's clip ratios the kivi runs take where no --kv-clip is given; None where every one it has
    is none (a copy calibrated with --kv-clip none)."""
    width_keys = gguf_metadata.WIDTH_CLIP_KEYS.values()
    if all(kvq.get(key, "none") == "none" for key in (gguf_metadata.KEY_CLIP, *width_keys)):
        return None
    if any(key in kvq for key in width_keys):
        return ("each tensor's ratio at its width from the model's kvq.calibration.kivi*_clip where it has that "
                "width's, else its kvq.kv_clip")
    return f"the model's kvq.kv_clip {kvq[gguf_metadata.KEY_CLIP]}"


def load_json(path: Path) -> tuple[Settings, list[Run]]:
    record = json.loads(path.read_text())
    raw = record["settings"]
    settings = Settings(**{**raw, "model": Path(raw["model"]), "text": Path(raw["text"])})
    return settings, [Run(**r) for r in record["runs"]]


def run(args: argparse.Namespace) -> int:
    # --kv-layers none: no per-layer run, and none from the model's kvq.kv_layers
    specs = parse_specs(args.kv_types, [spec for spec in args.kv_layers if spec.strip() != "none"])
    for f, what in ((args.model, "model"), (args.file, "text")):
        check_readable_file(f, what)
    # the model's kvq.* metadata: its window and sinks are the defaults, its per-layer types one more run
    overrides = ((gguf_metadata.KEY_LAYERS, args.kv_layers or None), (gguf_metadata.KEY_WINDOW, args.kv_window),
                 (gguf_metadata.KEY_SINKS, args.kv_sinks), (gguf_metadata.KEY_CLIP, args.kv_clip),
                 (gguf_metadata.KEY_ROTATE, args.kv_rotate), (gguf_metadata.KEY_DITHER, args.kv_dither))
    given = [key for key, value in overrides if value is not None]
    kvq = model_info.checked_kvq(args.model, ignored=given)
    n_layer = model_info.read_shape(gguf_metadata.read_fields(args.model)).n_layer
    model_layers_spec = kvq.get(gguf_metadata.KEY_LAYERS)
    if model_layers_spec and args.kv_type_swa is not None and sliding_window_model(args.model):
        log.info("the model's kvq.kv_layers is left out of the comparison: its per-layer types name the "
                 "sliding-window layers' types, which --kv-type-swa %s would not change", args.kv_type_swa)
    elif model_layers_spec:
        join_model_layers(specs, model_layers_spec, n_layer)
    if args.kv_type_swa not in kv_types.KIVI_BITS and not any(
            spec.is_kivi or spec.layers for spec in specs):
        arguments.warn_unused_kivi_flags(args, "the runs' caches")
    defaults = native.kvq_default_params()
    window = int(kvq.get(gguf_metadata.KEY_WINDOW, defaults.window) if args.kv_window is None else args.kv_window)
    n_sink = int(kvq.get(gguf_metadata.KEY_SINKS, defaults.n_sink) if args.kv_sinks is None else args.kv_sinks)
    if args.ctx_size < 64 or args.chunks < 1 or args.threads < 1 or window < 0 or n_sink < 0:
        raise ValueError("need -c >= 64, --chunks >= 1, -t >= 1, --kv-window >= 0 and --kv-sinks >= 0")
    native.check_token_count("window", window)
    native.check_token_count("sink count", n_sink)
    outputs = output_files(args.output)
    if args.kv_type_swa is not None:
        kv_types.type_id(args.kv_type_swa)  # an unknown name is refused before any run, with the valid ones
        check_swa_type(args.kv_type_swa, specs, args.model)
    clip = args.kv_clip
    if clip not in (None, "none"):
        # refused before any run, naming the part
        native.resolve_clip(clip, n_layer)
        log.info("kivi runs clip with %s", clip)
    elif clip is None and (ratios := model_clip_words(kvq)):
        log.info("kivi runs clip with %s", ratios)
    rotate = str(kvq.get(gguf_metadata.KEY_ROTATE, "off")) if args.kv_rotate is None else args.kv_rotate
    native.resolve_rotation(rotate, n_layer)
    if rotate != "off":
        log.info("kivi runs rotate with %s", rotate)
    dither = str(kvq.get(gguf_metadata.KEY_DITHER, "none") if args.kv_dither is None else args.kv_dither)
    native.resolve_dither(dither, n_layer)
    if dither != "none":
        log.info("kivi runs dither V with %s", dither)
    settings = Settings(args.model, args.file, args.ctx_size, args.chunks, args.threads, window, n_sink,
                        args.kv_type_swa, clip, rotate, dither, arguments.gpu_layers(args, unset=None), args.rpc,
                        args.op_offload, args.fit, tuple(args.fit_target), args.kl_divergence, args.kv_offload)
    runs = compare(settings, specs)
    print(format_table(runs))
    write_json(outputs.json, settings, runs)
    plot(outputs.png, settings, runs)
    print(f"wrote {outputs.json} and {outputs.png}")
    failed = [r.kv_type for r in runs if r.failure is not None]
    if failed:
        log.error("%d of %d KV types failed: %s", len(failed), len(runs), ", ".join(failed))
        return 1
    return 0


def add_perplexity_command(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("perplexity", help="compare KV cache types by perplexity on the same chunks")
    p.add_argument("-m", "--model", type=Path, required=True, help="GGUF model")
    p.add_argument("-f", "--file", type=Path, required=True, help="text to evaluate")
    p.add_argument("--kv-types", default="f16,q8_0,q4_0,q4_1,kivi4,kivi2,kivi1",
                   help="comma-separated KV cache types, same for K and V; kivi types may add +rot "
                        "(default: %(default)s)")
    p.add_argument("--kv-layers", type=arguments.spec, action="append", default=[], metavar="SPEC",
                   help="also run per-layer types, e.g. 'k:0-15=kivi2,16-=kivi1;v:*=kivi1' (repeatable); none: "
                        "not the model's kvq.kv_layers")
    p.add_argument("-c", "--ctx-size", type=int, default=2048, help="context size (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=4, help="chunks of the text to evaluate (default: %(default)s)")
    p.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1, help="threads (default: all cores)")
    arguments.add_device_arguments(p)
    arguments.add_fit_arguments(p, context=False)
    p.add_argument("--kv-window", type=int,
                   help="kivi: recent tokens kept in fp16 (default: the model's kvq.window, else 128)")
    p.add_argument("--kv-sinks", type=int,
                   help="kivi: first tokens kept in fp16 for good (default: the model's kvq.sinks, else 0)")
    p.add_argument("--kv-clip", type=arguments.spec, metavar="SPEC",
                   help="kivi runs: SKVQ's per-layer clip ratios, or mse (each group's range of least squared error), "
                        "e.g. 'k:*=0.9;v:*=mse'; 'none' ignores a model's "
                        "kvq.kv_clip (default: the model's kvq.kv_clip, else none)")
    p.add_argument("--kv-rotate", metavar="on|off|SPEC", type=arguments.rotation,
                   help="kivi runs without +rot: Hadamard rotation, on, off or per layer, e.g. 'k:*=on;v:0-3=off' "
                        "(default: the model's kvq.kv_rotate, else off)")
    p.add_argument("--kv-dither", type=arguments.spec, metavar="SPREAD|SPEC",
                   help="kivi runs: V's dithered rounding, a spread in [0, 1] or per layer, e.g. 0.5 or "
                        "'v:0-9=1,10-=0'; 'none' ignores a model's kvq.kv_dither (default: the model's kvq.kv_dither, "
                        "else none)")
    p.add_argument("--kv-type-swa", type=arguments.spec, metavar="TYPE",
                   help="every run: K and V type of the sliding-window cache of a model with sliding-window layers "
                        "(Gemma 2/3, gpt-oss), e.g. f16 (default: each run's type)")
    p.add_argument("--kl-divergence", action="store_true",
                   help="also score every type by its KL divergence from the f16 run's next-token distributions, as "
                        "llama-perplexity --kl-divergence does (the f16 run goes first; its log-probabilities, "
                        "n_ctx/2 x vocabulary x 2 bytes a chunk, wait in a temporary file)")
    p.add_argument("-o", "--output", default="pykvq-perplexity",
                   help="output prefix: writes PREFIX.json and PREFIX.png (a .json or .png given names one of "
                        "them; default: %(default)s)")
    p.set_defaults(handler=run)
