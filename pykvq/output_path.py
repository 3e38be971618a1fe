"""The file a command writes (-o): checked before any work, so that a wrong -o costs seconds, not a whole run, and
never destroys what the command reads.

Both `pykvq calibrate` and `pykvq convert` write a new GGUF through a temporary file renamed into place; what this
module refuses would otherwise surface only at that rename (a folder, a read-only place) or silently replace an
input (the rename follows no symlink, but an -o naming the input itself replaces it).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


def check_not_an_input(output: Path, inputs: Iterable[tuple[str, Path]]) -> None:
    """ValueError when ``output`` is, through symlinks, ``..`` or hard links, one of the ``inputs`` (what each is,
    and its path)."""
    # resolved first: "new/../text.txt" names text.txt once the writer has created new/
    target = output.resolve()
    if not target.exists():
        return
    for what, path in inputs:
        if path.exists() and os.path.samefile(target, path):
            raise ValueError(f"-o {output} is {what} ({path}): -o must name a new file, as the command writes a copy "
                             "and never touches its inputs")


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and those above it that do not exist yet, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove(folders: list[Path]) -> None:
    # rmdir, not rmtree: a folder someone else put a file into meanwhile stays, with that file
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


@contextmanager
def new_output(output: Path, inputs: Iterable[tuple[str, Path]]) -> Iterator[None]:
    """Check that ``output`` can be written (a file, not one of ``inputs``, in a folder that takes a new file: one
    is created and removed there), creating its missing folders; those folders are removed again when the body
    fails or is interrupted, so that a failure leaves nothing behind."""
    if output.resolve().is_dir():
        raise ValueError(f"-o {output} is a folder: name the GGUF file to write")
    check_not_an_input(output, inputs)
    created = _missing_folders(output.parent.absolute())
    try:
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".probe", dir=output.parent)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise ValueError(f"-o {output}: a new file cannot be written in {output.parent} ({exc.strerror}): "
                             "choose a folder you can write to") from exc
        yield
    except BaseException:
        _remove(created)
        raise
