"""The developer workflow: patched upstream as a git work tree, re-exported patches, pruned source."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pykvq.devtools import dev, upstream


@pytest.fixture
def checkout(tmp_path: Path, repo: Path, upstream_source: upstream.Source) -> Path:
    """A copy of this checkout's patch series, so that exporting never touches the real one."""
    copy = tmp_path / "checkout"
    for d in (*upstream.PATCH_DIRS, "pykvq"):
        (copy / d).mkdir(parents=True)
    for d in upstream.PATCH_DIRS:
        if (repo / d).is_dir():
            shutil.copytree(repo / d, copy / d, dirs_exist_ok=True)
    (copy / "pyproject.toml").write_text("")
    return copy


def commit(tree: Path, rel: str, text: str, message: str) -> None:
    (tree / rel).write_text((tree / rel).read_text() + text)
    dev.git(tree, "commit", "-q", "-am", message)


def test_tree_then_export_round_trips_and_routes_by_path(checkout: Path, tmp_path: Path) -> None:
    original = {p.name: p.read_bytes() for p in upstream.patch_series(checkout)}
    tree = tmp_path / "tree"
    assert dev.main(["--repo", str(checkout), "tree", str(tree)]) == 0
    assert dev.main(["--repo", str(checkout), "export", str(tree)]) == 0
    assert {p.name: p.read_bytes() for p in upstream.patch_series(checkout)} == original

    commit(tree, "ggml/include/ggml.h", "// kvq\n", "ggml: a ggml-only change")
    commit(tree, "src/llama.cpp", "// kvq\n", "llama: a llama change")
    assert dev.main(["--repo", str(checkout), "export", str(tree)]) == 0
    def names(folder: str) -> list[str]:
        return sorted(p.name for p in (checkout / folder / "patches").glob("*.patch"))

    ggml, native = names("ggml-kvq"), names("native")
    assert ggml[:-1] == sorted(n for n in original if "-ggml-" in n)
    assert ggml[-1] == f"{len(ggml):04d}-ggml-a-ggml-only-change.patch"
    assert native[:-1] == sorted(n for n in original if "-ggml-" not in n)
    assert native[-1] == f"{len(native):04d}-llama-a-llama-change.patch"


def test_export_refuses_a_commit_spanning_ggml_and_llama(checkout: Path, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    assert dev.main(["--repo", str(checkout), "tree", str(tree)]) == 0
    (tree / "ggml/include/ggml.h").write_text("// x\n")
    (tree / "src/llama.cpp").write_text("// y\n")
    dev.git(tree, "commit", "-q", "-am", "mixed")
    assert dev.main(["--repo", str(checkout), "export", str(tree)]) == 1


def test_pruned_prepatched_tree_fits_the_gpu_machine(repo: Path, tmp_path: Path,
                                                     upstream_source: upstream.Source) -> None:
    dest = tmp_path / "prepatched"
    assert dev.main(["--repo", str(repo), "prune", str(dest)]) == 0
    marker = json.loads((dest / upstream.PATCHED_MARKER).read_text())
    assert marker["patches"] == [p.name for p in upstream.patch_series(repo)]
    assert dev.tree_size(dest) < dev.DEVICE_LIMIT_BYTES // 2
    assert (dest / "ggml" / "src" / "ggml-cuda").is_dir() and not (dest / "models").exists()
    # a build from it takes it as is, unpatched again by nobody
    info = upstream.prepare_tree(upstream.resolve_source(str(dest)), repo, tmp_path / "unused")
    assert info.tree == str(dest) and not (tmp_path / "unused").exists()


def test_not_a_checkout(tmp_path: Path) -> None:
    assert dev.main(["--repo", str(tmp_path), "prune"]) == 1
