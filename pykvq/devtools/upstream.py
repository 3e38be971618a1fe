"""The pinned upstream llama.cpp: obtain it, verify it, unpack it, and patch it.

Used at build time by CMakeLists.txt (``python -m pykvq.devtools.upstream prepare ...``) and by the developer
workflow (``python -m pykvq.devtools.dev``), so both see exactly the same source tree. Standard library only:
this module runs inside the isolated build environment before pykvq is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pykvq import paths

log = logging.getLogger("pykvq.upstream")

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_FILE = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
LLAMA_CPP_COMMIT = "0c1e570"
VENDOR_PREFIX = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"

SOURCE_ENV = "PYKVQ_UPSTREAM_SOURCE"
PATCHED_MARKER = ".pykvq-patched.json"

# Parts of upstream that pykvq never builds; leaving them out keeps the patched tree small enough to
# travel to the GPU machine (64 MiB) and the copy quick.
PRUNED_PATHS = (
    ".devops", ".github", "app", "benches", "ci", "docs", "examples", "media", "models", "pocs",
    "scripts", "skills", "tests",
    "tools/cli", "tools/cvector-generator", "tools/export-lora", "tools/fit-params", "tools/gguf-split",
    "tools/imatrix", "tools/llama-bench", "tools/quantize", "tools/results",
    "tools/mtmd/legacy-models", "tools/mtmd/tests", "tools/mtmd/test-1.jpeg", "tools/mtmd/test-2.mp3",
    "tools/mtmd/test-3.mp4",
    "tools/server", "tools/tokenize", "tools/tts", "tools/tuning", "tools/ui",
    "ggml/src/ggml-cann", "ggml/src/ggml-et", "ggml/src/ggml-hexagon", "ggml/src/ggml-hip",
    "ggml/src/ggml-metal", "ggml/src/ggml-musa", "ggml/src/ggml-opencl", "ggml/src/ggml-openvino",
    "ggml/src/ggml-sycl", "ggml/src/ggml-virtgpu", "ggml/src/ggml-vulkan", "ggml/src/ggml-webgpu",
    "ggml/src/ggml-zdnn", "ggml/src/ggml-zendnn",
)

PATCH_DIRS = ("ggml-kvq/patches", "native/patches")


class UpstreamError(RuntimeError):
    """A problem with the upstream source that the user can act on; the message says how."""


@dataclass(frozen=True)
class UpstreamInfo:
    """What was built from: recorded in the build info that ``pykvq info`` prints."""

    package: str
    version: str
    llama_cpp_commit: str
    ggml_version: str
    source: str
    sha256: str | None
    tree: str
    patches: list[str] = field(default_factory=list)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sdist(path: Path) -> None:
    actual = sha256_of(path)
    if actual != SDIST_SHA256:
        raise UpstreamError(
            f"checksum mismatch for {path}: sha256 {actual}, expected {SDIST_SHA256} "
            f"({SDIST_NAME} {SDIST_VERSION}). The file is corrupt or not the pinned release: "
            f"delete it and build again, or point {SOURCE_ENV} at the right file."
        )


def download_sdist(dest_dir: Path) -> Path:
    """Fetch the pinned sdist with pip, which knows the user's index configuration."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
            "--no-binary", SDIST_NAME, "-d", tmp, f"{SDIST_NAME}=={SDIST_VERSION}",
        ]
        log.info("downloading %s %s with pip", SDIST_NAME, SDIST_VERSION)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        fetched = Path(tmp) / SDIST_FILE
        if proc.returncode != 0 or not fetched.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
            raise UpstreamError(
                f"could not download {SDIST_NAME}=={SDIST_VERSION} with pip (no network?).\n{tail}\n"
                f"To build offline, download it elsewhere with\n"
                f"  pip download --no-deps --no-binary :all: {SDIST_NAME}=={SDIST_VERSION}\n"
                f"and set {SOURCE_ENV}=/path/to/{SDIST_FILE} (or to an unpacked source tree)."
            )
        verify_sdist(fetched)
        target = dest_dir / SDIST_FILE
        fetched.replace(target)
    return target


def cached_sdist() -> Path:
    """The verified sdist from the cache, downloading it on first use."""
    slot = paths.cache_dir() / "upstream" / SDIST_SHA256
    sdist = slot / SDIST_FILE
    if sdist.is_file():
        verify_sdist(sdist)
        return sdist
    return download_sdist(slot)


def unpack_vendor(sdist: Path, dest: Path) -> Path:
    """Unpack the sdist's vendor/llama.cpp into ``dest``; a stamp makes it happen once."""
    stamp = dest / ".pykvq-unpacked"
    if stamp.is_file():
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".unpack-"))
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(VENDOR_PREFIX)]
            if not members:
                raise UpstreamError(f"{sdist} holds no vendor/llama.cpp: it is not the {SDIST_NAME} sdist")
            for member in members:
                member.name = member.name[len(VENDOR_PREFIX):]
            tar.extractall(tmp, members=[m for m in members if m.name], filter="data")
        (tmp / stamp.name).write_text(SDIST_SHA256 + "\n")
        tmp.replace(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest


def llama_cpp_root(path: Path) -> Path:
    """Accept an unpacked sdist root or a llama.cpp root."""
    for candidate in (path, path / "vendor" / "llama.cpp"):
        if (candidate / "ggml" / "CMakeLists.txt").is_file() and (candidate / "include" / "llama.h").is_file():
            return candidate
    raise UpstreamError(
        f"{path} is neither a llama.cpp source tree nor an unpacked {SDIST_NAME} sdist "
        f"(no ggml/CMakeLists.txt and include/llama.h found)"
    )


@dataclass(frozen=True)
class Source:
    root: Path
    sha256: str | None
    label: str


def resolve_source(spec: str | None) -> Source:
    """Where the upstream tree comes from: ``spec`` (a file or folder), else the cache / pip."""
    if spec:
        path = Path(spec).expanduser().resolve()
        if not path.exists():
            raise UpstreamError(f"{SOURCE_ENV} points at {path}, which does not exist")
        if path.is_file():
            verify_sdist(path)
            root = unpack_vendor(path, paths.cache_dir() / "upstream" / SDIST_SHA256 / "llama.cpp")
            return Source(root, SDIST_SHA256, str(path))
        return Source(llama_cpp_root(path), None, str(path))
    sdist = cached_sdist()
    return Source(unpack_vendor(sdist, sdist.parent / "llama.cpp"), SDIST_SHA256, f"pip: {SDIST_FILE}")


def patch_series(repo: Path) -> list[Path]:
    """Our patches in the order they apply: ggml-kvq's, then native's, each sorted by name."""
    return [p for d in PATCH_DIRS for p in sorted((repo / d).glob("*.patch"))]


def series_digest(patches: list[Path]) -> str:
    digest = hashlib.sha256()
    for p in patches:
        digest.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return digest.hexdigest()


def read_marker(tree: Path) -> dict | None:
    marker = tree / PATCHED_MARKER
    if not marker.is_file():
        return None
    return json.loads(marker.read_text())


def ggml_version(tree: Path) -> str:
    text = (tree / "ggml" / "CMakeLists.txt").read_text()
    parts = []
    for key in ("MAJOR", "MINOR", "PATCH"):
        token = f"set(GGML_VERSION_{key} "
        start = text.find(token)
        if start < 0:
            return "unknown"
        parts.append(text[start + len(token): text.index(")", start)].strip())
    return ".".join(parts)


def apply_patch(tree: Path, patch: Path) -> None:
    # The ceiling keeps git from finding an enclosing repository (the build folder often sits inside
    # one), which would make `git apply` skip every file silently.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)}
    cmd = ["git", "apply", "--whitespace=nowarn", str(patch)]
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise UpstreamError("git is needed to apply pykvq's patch series and was not found") from exc
    if proc.returncode != 0:
        raise UpstreamError(
            f"patch {patch.name} does not apply to llama.cpp {LLAMA_CPP_COMMIT}:\n{proc.stderr.strip()}\n"
            f"Refresh it against the pinned upstream with `python -m pykvq.devtools.dev tree` and "
            f"`python -m pykvq.devtools.dev export`."
        )


def copy_pruned(src: Path, dest: Path) -> None:
    pruned = {src / p for p in PRUNED_PATHS}

    def ignore(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if Path(folder) / n in pruned or n in (".git", PATCHED_MARKER)]

    shutil.copytree(src, dest, ignore=ignore, symlinks=True)


def prepare_tree(source: Source, repo: Path, dest: Path, patched: bool = True) -> UpstreamInfo:
    """Make ``dest`` a pruned copy of upstream with our patch series applied.

    Reuses ``dest`` untouched when it already holds the same source and series, so that an
    incremental build does not see every upstream file as modified.
    """
    patches = patch_series(repo) if patched else []
    digest = series_digest(patches)
    source_marker = read_marker(source.root)
    if source_marker is not None:
        if source_marker["series"] != digest:
            raise UpstreamError(
                f"{source.root} was patched with a different patch series than this checkout's; "
                f"make it again with `python -m pykvq.devtools.dev prune`"
            )
        return _info(source.root, source, patches)
    wanted = {"source": source.label, "sha256": source.sha256, "series": digest,
              "patches": [p.name for p in patches], "pruned": list(PRUNED_PATHS)}
    if read_marker(dest) == wanted:
        return _info(dest, source, patches)
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    copy_pruned(source.root, dest)
    for patch in patches:
        log.info("applying %s", patch.name)
        apply_patch(dest, patch)
    (dest / PATCHED_MARKER).write_text(json.dumps(wanted, indent=1) + "\n")
    return _info(dest, source, patches)


def _info(tree: Path, source: Source, patches: list[Path]) -> UpstreamInfo:
    return UpstreamInfo(
        package=SDIST_NAME, version=SDIST_VERSION, llama_cpp_commit=LLAMA_CPP_COMMIT,
        ggml_version=ggml_version(tree), source=source.label, sha256=source.sha256, tree=str(tree),
        patches=[f"{p.parent.parent.name}/{p.name}" for p in patches],
    )


def _prepare_command(args: argparse.Namespace) -> None:
    source = resolve_source(args.source or os.environ.get(SOURCE_ENV))
    info = prepare_tree(source, args.repo, args.dest, patched=not args.unpatched)
    args.info_json.write_text(json.dumps(asdict(info), indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pykvq.devtools.upstream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="produce the patched upstream tree the build compiles")
    prep.add_argument("--repo", type=Path, required=True, help="the pykvq checkout (holds the patches)")
    prep.add_argument("--dest", type=Path, required=True, help="where the patched tree goes")
    prep.add_argument("--info-json", type=Path, required=True, help="where to write what was prepared")
    prep.add_argument("--unpatched", action="store_true", help="leave the patch series out (reference builds)")
    prep.add_argument("--source", help=f"sdist file or source folder (default: ${SOURCE_ENV}, else pip)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="pykvq: %(message)s")
    try:
        _prepare_command(args)
    except UpstreamError as exc:
        print(f"pykvq: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
