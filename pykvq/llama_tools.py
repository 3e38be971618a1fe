"""Running the upstream tools that pykvq builds (llama-perplexity, llama-completion, llama-batched-bench)."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pykvq import paths


class ToolError(RuntimeError):
    """A tool exited non-zero; the message's first line says why (the tool's first error line), then its tail."""


# an error line of llama.cpp's common log ("0.00.167.930 E llama_init_from_model: ..."), or of its argument parser,
# which prints before any log ("error while handling argument "--kv-window": invalid value ...")
_ERROR_LINE = re.compile(r"^(?:[0-9.]+ E (?:cmn  )?|(?=error while handling argument ))(.+)$", re.MULTILINE)


def tool_failure(name: str, returncode: int, output: str) -> ToolError:
    """The error of a tool that exited with ``returncode``: its first logged error (usually the cause) first."""
    status = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with status {returncode}"
    first = _ERROR_LINE.search(output)
    tail = "\n".join(output.strip().splitlines()[-10:])
    return ToolError(f"{name} {status}" + (f": {first.group(1).strip()}" if first else "") + f"\n{tail}")


def run_tool(name: str, args: list[str], timeout: float | None = None) -> str:
    """Run a built tool and return its combined output; raise ToolError with its last lines on failure."""
    proc = subprocess.run([str(paths.tool(name)), *args], capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise tool_failure(name, proc.returncode, output)
    return output


_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_CHUNK = re.compile(r"\[(\d+)\]([0-9.]+),")
# --kl-divergence's statistics against the base run's log-probabilities (printed from 100 scored tokens on), and
# its line per chunk, with the running means: PPL, ln(PPL(Q)/PPL(base)), KLD, Δp RMS, same top p, each "± error"
_KLD_HEADER = "ln(PPL(Q)/PPL(base))"
_KLD_PPL = re.compile(r"Mean PPL\(Q\) *: *([0-9.]+) ± *([0-9.]+)")
_KLD_MEAN = re.compile(r"Mean +KLD: *([0-9.]+) ± *([0-9.]+)")
_KLD_P99 = re.compile(r"99\.0% +KLD: *([0-9.]+)")
_SAME_TOP = re.compile(r"Same top p: *([0-9.]+) ± *[0-9.]+ %")
_KLD_CHUNK = re.compile(r"^ *(\d+) +([0-9.]+) ± +([0-9.]+) +-?[0-9.]+ ± +[0-9.]+ +([0-9.]+) ± +([0-9.]+) "
                        r"+[0-9.]+ ± +[0-9.]+ % +([0-9.]+) ± +[0-9.]+ %", re.MULTILINE)


@dataclass(frozen=True)
class KlDivergence:
    """How far a run's next-token distributions are from the base run's: llama-perplexity --kl-divergence."""
    mean: float
    error: float
    p99: float | None  # the 99th percentile over the scored tokens (None: too few for llama-perplexity's statistics)
    same_top_pct: float  # tokens whose most likely next token is the base's


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    error: float
    running_ppl: list[float]
    kld: KlDivergence | None = None


def _no_estimate(output: str) -> ToolError:
    # its logged errors say why (a text too short for the context, ...); they lead, as in tool_failure
    errors = "; ".join(line.strip() for line in _ERROR_LINE.findall(output))
    return ToolError("llama-perplexity printed no final estimate" + (f": {errors}" if errors else "") + "\n"
                     + "\n".join(output.splitlines()[-10:]))


def _parse_kl_divergence(output: str) -> PerplexityResult:
    chunks = list(_KLD_CHUNK.finditer(output))
    if not chunks:
        raise _no_estimate(output)
    last = chunks[-1]
    ppl, mean, p99, same_top = (pattern.search(output) for pattern in (_KLD_PPL, _KLD_MEAN, _KLD_P99, _SAME_TOP))
    if ppl and mean and p99 and same_top:
        kld = KlDivergence(float(mean.group(1)), float(mean.group(2)), float(p99.group(1)), float(same_top.group(1)))
        ppl_error = (float(ppl.group(1)), float(ppl.group(2)))
    else:
        # under 100 scored tokens llama-perplexity prints no statistics: the last chunk's running means are theirs
        kld = KlDivergence(float(last.group(4)), float(last.group(5)), None, float(last.group(6)))
        ppl_error = (float(last.group(2)), float(last.group(3)))
    return PerplexityResult(*ppl_error, [float(m.group(2)) for m in chunks], kld)


def parse_perplexity(output: str) -> PerplexityResult:
    """A perplexity run's result, or a --kl-divergence run's (its perplexity and its divergence)."""
    if _KLD_HEADER in output:
        return _parse_kl_divergence(output)
    final = _FINAL.search(output)
    if final is None:
        raise _no_estimate(output)
    return PerplexityResult(float(final.group(1)), float(final.group(2)),
                            [float(m.group(2)) for m in _CHUNK.finditer(output)])


def perplexity(model: Path, text: Path, extra_args: list[str]) -> PerplexityResult:
    return parse_perplexity(run_tool("llama-perplexity", ["-m", str(model), "-f", str(text), *extra_args]))
