"""What bench/gpu/session.sh decides without a GPU: whether a carried CUDA wheel is of the tree's sources (the hash
it compares; a stale wheel on the GPU machine would judge other code than the tree it reports on), and that the tests
its listings name by node id still exist (a renamed test would cost a lease's step)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SESSION = Path("bench") / "gpu" / "session.sh"


def fingerprint(root: Path) -> str:
    out = subprocess.run(["bash", str(root / SESSION), "fingerprint"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tree as the device tool sends it: the files git tracks, and the untracked ones it does not ignore."""
    root = tmp_path_factory.mktemp("tree")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout
    subprocess.run(f"tar --null -T - -cf - | tar -x -C '{root}'", shell=True, cwd=REPO, input=files, check=True)
    return root


def test_a_copy_of_the_tree_has_its_hash(tree_copy: Path) -> None:
    assert len(fingerprint(REPO)) == 64
    assert fingerprint(tree_copy) == fingerprint(REPO)


def test_the_hash_follows_the_sources_and_nothing_else(tree_copy: Path) -> None:
    before = fingerprint(tree_copy)
    cache = tree_copy / "pykvq" / "__pycache__"
    cache.mkdir(exist_ok=True)
    (cache / "paths.cpython-312.pyc").write_bytes(b"\0")
    (tree_copy / "tests" / "test_gpu_session.py").write_text("changed")
    assert fingerprint(tree_copy) == before
    kernel = tree_copy / "ggml-kvq" / "src" / "cuda" / "kvq-cuda.cu"
    kernel.write_text(kernel.read_text() + "\n")
    assert fingerprint(tree_copy) != before


@pytest.mark.parametrize("listing", ["recheck.txt", "mma.txt", "sanitize.txt"])
def test_the_tests_a_listing_names_exist(listing: str) -> None:
    ids = [line for line in (REPO / "bench" / "gpu" / listing).read_text().splitlines() if line.strip()]
    assert ids
    # from the tree's root, as the session runs them; safe path: the installed pykvq, not the source folder there
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
