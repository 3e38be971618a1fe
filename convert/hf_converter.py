"""llama.cpp's own HF -> GGUF converter, installed with pykvq from the pinned upstream and run as it is.

The model folder is checked here first (a Hugging Face model, an architecture upstream converts) so that the
common mistakes get one clear message instead of a traceback from deep inside the converter.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pykvq import paths

log = logging.getLogger("pykvq.convert")

OUTTYPES = ("f16", "bf16", "q8_0", "f32")


class ConversionError(RuntimeError):
    """The HF model cannot be converted; the message says why."""


@dataclass(frozen=True)
class HfModel:
    path: Path
    architecture: str
    config: dict


def supported_architectures() -> list[str]:
    """Every text-model architecture the pinned converter knows, by its HF class name: the keys of its
    ``conversion.TEXT_MODEL_MAP``, read from the source (importing it would import torch and a `gguf`)."""
    source = paths.vendor_dir() / "conversion" / "__init__.py"
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "TEXT_MODEL_MAP" for t in targets) and node.value:
                return sorted(ast.literal_eval(node.value))
    raise ConversionError(f"{source} defines no TEXT_MODEL_MAP: the installed converter is not the pinned one")


def _architecture(config: dict, config_file: Path) -> str | None:
    # where upstream's get_model_architecture looks for a text model; it takes the first entry of whatever is there,
    # "L" of a bare string
    text_config = config.get("text_config") or {}
    for arches in (text_config.get("architectures"), config.get("architectures")):
        if not arches:
            continue
        if not (isinstance(arches, list) and isinstance(arches[0], str)):
            raise ConversionError(f"{config_file}: \"architectures\" must be a list of class names such as "
                                  f"[\"LlamaForCausalLM\"], not {json.dumps(arches)}")
        return arches[0]
    return None


def inspect_folder(path: Path) -> HfModel:
    """The model in an HF folder, or ConversionError saying what is wrong with it."""
    if not path.is_dir():
        raise ConversionError(f"{path} is not a folder: give the folder of a Hugging Face model "
                              "(config.json, weights, tokenizer)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"{path} is not a Hugging Face model folder: it has no config.json")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{config_file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ConversionError(f"{config_file} does not hold a model configuration (a JSON object)")
    arch = _architecture(config, config_file)
    if arch is None:
        raise ConversionError(f"{config_file} names no architecture (\"architectures\": [...])")
    supported = supported_architectures()
    if arch not in supported:
        raise ConversionError(f"architecture {arch} is not supported by llama.cpp's converter (the pinned upstream "
                              f"converts {len(supported)}: {', '.join(supported)})")
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth")]
    if not weights:
        raise ConversionError(f"{path} holds no weights (*.safetensors or pytorch_model*.bin)")
    return HfModel(path, arch, config)


TRACEBACK = b"Traceback (most recent call last):"


def exception_line(traceback: str) -> str | None:
    """The exception a Python traceback reports (the last one's, when one was raised handling another): the first
    unindented line after its frames. Not the text's last line: the converter's progress bar redraws itself after
    the traceback, behind carriage returns."""
    last = traceback.rfind(TRACEBACK.decode())
    if last < 0:
        return None
    lines = re.split(r"\r\n|\r|\n", traceback[last:])
    return next((line.strip() for line in lines[1:] if line.strip() and not line[0].isspace()), None)


def relay_until_traceback(stream: BinaryIO, out: BinaryIO) -> str:
    """Copy ``stream`` to ``out`` as it comes (progress bars stay live) until a Python traceback starts; return
    the traceback, kept back from the user's terminal."""
    pending = b""
    ended = True    # whether what was relayed ends its line

    def relay(data: bytes) -> None:
        nonlocal ended
        out.write(data)
        out.flush()
        ended = data.endswith(b"\n") if data else ended

    while chunk := os.read(stream.fileno(), 1 << 16):
        pending += chunk
        start = pending.find(TRACEBACK)
        if start >= 0:
            relay(pending[:start])
            if not ended:
                # a progress bar cut short by the failure: the error that follows starts a line of its own
                relay(b"\n")
            held = pending[start:]
            while chunk := os.read(stream.fileno(), 1 << 16):
                held += chunk
            return held.decode(errors="replace")
        # the marker may straddle two reads: keep its length back
        cut = max(0, len(pending) - len(TRACEBACK))
        relay(pending[:cut])
        pending = pending[cut:]
    relay(pending)
    return ""


def convert(model: HfModel, out: Path, outtype: str) -> None:
    """Run upstream's converter into ``out``; its own log and progress bar go to the terminal, a traceback of
    its becomes one error line (-v shows it whole)."""
    cmd = [sys.executable, str(paths.hf_converter()), str(model.path), "--outfile", str(out), "--outtype", outtype]
    log.debug("running %s", " ".join(cmd))
    # without NO_LOCAL_GGUF the converter imports the pinned `gguf-py/` beside it, whatever `gguf` is installed
    env = {name: value for name, value in os.environ.items() if name != "NO_LOCAL_GGUF"}
    with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        assert proc.stderr is not None
        traceback = relay_until_traceback(proc.stderr, sys.stderr.buffer)
    if traceback:
        log.debug("%s", traceback)
    if proc.returncode != 0:
        exception = exception_line(traceback)
        why = f": {exception}" if exception else "; its messages are above"
        raise ConversionError(f"llama.cpp's converter failed on {model.path} ({model.architecture}), exit code "
                              f"{proc.returncode}{why}")
    if not out.is_file():
        raise ConversionError(f"llama.cpp's converter wrote no {out}")
