"""Running the upstream tools that pykvq builds (llama-perplexity, llama-completion, llama-batched-bench)."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pykvq import paths


class ToolError(RuntimeError):
    """A tool exited non-zero; the message carries the tail of its output."""


def run_tool(name: str, args: list[str], timeout: float | None = None) -> str:
    """Run a built tool and return its combined output; raise ToolError with its last lines on failure."""
    proc = subprocess.run([str(paths.tool(name)), *args], capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-10:])
        raise ToolError(f"{name} exited with status {proc.returncode}:\n{tail}")
    return output


_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_CHUNK = re.compile(r"\[(\d+)\]([0-9.]+),")


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    error: float
    running_ppl: list[float]


def parse_perplexity(output: str) -> PerplexityResult:
    final = _FINAL.search(output)
    if final is None:
        raise ToolError("llama-perplexity printed no final estimate:\n" + "\n".join(output.splitlines()[-10:]))
    return PerplexityResult(float(final.group(1)), float(final.group(2)),
                            [float(m.group(2)) for m in _CHUNK.finditer(output)])


def perplexity(model: Path, text: Path, extra_args: list[str]) -> PerplexityResult:
    return parse_perplexity(run_tool("llama-perplexity", ["-m", str(model), "-f", str(text), *extra_args]))
