"""The files a command reads (a model, a text): one check and one wording for each way a path can fail to be one."""

from __future__ import annotations

import os
from pathlib import Path


def check_readable_file(path: Path, what: str) -> None:
    """OSError naming ``what`` (model, text, ...) unless ``path`` is a file this process can read."""
    if path.is_dir():
        raise IsADirectoryError(f"{what} path is a folder, not a file: {path}")
    if not path.is_file():
        raise FileNotFoundError(f"{what} file not found: {path}")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"{what} file is not readable: {path}")
