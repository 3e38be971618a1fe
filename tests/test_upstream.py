"""Obtaining and patching upstream: each failure stops with a message that says what to do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pykvq import paths
from pykvq.devtools import upstream
from pykvq.devtools.upstream import UpstreamError


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv(paths.CACHE_ENV, str(cache))
    monkeypatch.delenv(upstream.SOURCE_ENV, raising=False)
    return cache


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip with no index at all: what a machine without network sees, but immediately."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)


def fake_tree(root: Path) -> Path:
    (root / "ggml").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "ggml" / "CMakeLists.txt").write_text(
        "set(GGML_VERSION_MAJOR 0)\nset(GGML_VERSION_MINOR 25)\nset(GGML_VERSION_PATCH 3)\n")
    (root / "include" / "llama.h").write_text("int llama(void);\n")
    return root


def fake_repo(root: Path, patches: dict[str, str]) -> Path:
    for rel, text in patches.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


GOOD_PATCH = """\
--- a/include/llama.h
+++ b/include/llama.h
@@ -1 +1,2 @@
 int llama(void);
+int llama_kvq(void);
"""

SECOND_PATCH = """\
--- a/include/llama.h
+++ b/include/llama.h
@@ -2 +2,2 @@
 int llama_kvq(void);
+int llama_kvq_native(void);
"""

BAD_PATCH = """\
--- a/include/llama.h
+++ b/include/llama.h
@@ -1 +1,2 @@
 int something_else(void);
+int llama_kvq(void);
"""


def test_checksum_mismatch_names_the_file_and_the_fix(tmp_path: Path, empty_cache: Path) -> None:
    bogus = tmp_path / upstream.SDIST_FILE
    bogus.write_bytes(b"not the sdist")
    with pytest.raises(UpstreamError, match="checksum mismatch") as err:
        upstream.resolve_source(str(bogus))
    assert str(bogus) in str(err.value) and upstream.SDIST_SHA256 in str(err.value)


def test_corrupt_cached_sdist_is_refused(empty_cache: Path) -> None:
    slot = empty_cache / "upstream" / upstream.SDIST_SHA256
    slot.mkdir(parents=True)
    (slot / upstream.SDIST_FILE).write_bytes(b"truncated")
    with pytest.raises(UpstreamError, match="checksum mismatch"):
        upstream.resolve_source(None)


def test_no_network_and_no_source_says_how_to_build_offline(empty_cache: Path, offline: None) -> None:
    with pytest.raises(UpstreamError, match="could not download") as err:
        upstream.resolve_source(None)
    assert upstream.SOURCE_ENV in str(err.value)


def test_missing_source_path(tmp_path: Path, empty_cache: Path) -> None:
    with pytest.raises(UpstreamError, match="does not exist"):
        upstream.resolve_source(str(tmp_path / "nowhere"))


def test_folder_that_is_not_llama_cpp(tmp_path: Path, empty_cache: Path) -> None:
    with pytest.raises(UpstreamError, match="neither a llama.cpp source tree"):
        upstream.resolve_source(str(tmp_path))


def test_patches_apply_in_series_order_and_tree_is_reused(tmp_path: Path) -> None:
    src = fake_tree(tmp_path / "src")
    repo = fake_repo(tmp_path / "repo", {
        "native/patches/0001-second.patch": SECOND_PATCH,
        "ggml-kvq/patches/0001-first.patch": GOOD_PATCH,
    })
    source = upstream.resolve_source(str(src))
    dest = tmp_path / "build" / "upstream"
    info = upstream.prepare_tree(source, repo, dest)
    assert info.patches == ["ggml-kvq/0001-first.patch", "native/0001-second.patch"]
    assert info.ggml_version == "0.25.3" and info.sha256 is None
    header = dest / "include" / "llama.h"
    assert header.read_text().splitlines() == ["int llama(void);", "int llama_kvq(void);",
                                               "int llama_kvq_native(void);"]
    mtime = header.stat().st_mtime_ns
    upstream.prepare_tree(source, repo, dest)
    assert header.stat().st_mtime_ns == mtime


def test_failed_patch_stops_with_its_name(tmp_path: Path) -> None:
    src = fake_tree(tmp_path / "src")
    repo = fake_repo(tmp_path / "repo", {"native/patches/0001-broken.patch": BAD_PATCH})
    with pytest.raises(UpstreamError, match="0001-broken.patch does not apply"):
        upstream.prepare_tree(upstream.resolve_source(str(src)), repo, tmp_path / "dest")


def test_prepatched_tree_from_another_series_is_refused(tmp_path: Path) -> None:
    src = fake_tree(tmp_path / "src")
    repo = fake_repo(tmp_path / "repo", {"native/patches/0001-a.patch": GOOD_PATCH})
    prepatched = tmp_path / "prepatched"
    upstream.prepare_tree(upstream.resolve_source(str(src)), repo, prepatched)
    (repo / "native/patches/0001-a.patch").write_text(GOOD_PATCH.replace("llama_kvq", "llama_kvq2"))
    with pytest.raises(UpstreamError, match="different patch series"):
        upstream.prepare_tree(upstream.resolve_source(str(prepatched)), repo, tmp_path / "dest")


def test_prepare_command_reports_errors_without_traceback(tmp_path: Path, empty_cache: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pykvq.devtools.upstream", "prepare", "--repo", str(tmp_path), "--dest",
         str(tmp_path / "d"), "--info-json", str(tmp_path / "i.json"), "--source", str(tmp_path / "nowhere")],
        capture_output=True, text=True, cwd=Path(upstream.__file__).parent.parent)
    assert proc.returncode == 1
    assert proc.stderr.startswith("pykvq: error:") and "Traceback" not in proc.stderr


def test_prepare_command_writes_info(tmp_path: Path) -> None:
    src = fake_tree(tmp_path / "src")
    repo = fake_repo(tmp_path / "repo", {"native/patches/0001-a.patch": GOOD_PATCH})
    info_json = tmp_path / "info.json"
    assert upstream.main(["prepare", "--repo", str(repo), "--dest", str(tmp_path / "d"),
                          "--info-json", str(info_json), "--source", str(src)]) == 0
    info = json.loads(info_json.read_text())
    assert info["tree"] == str(tmp_path / "d") and info["patches"] == ["native/0001-a.patch"]
