"""llama.cpp's log, routed into Python's logging; its error lines become the text of Python exceptions."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from functools import cache

from pykvq.bindings import native

log = logging.getLogger("pykvq.llama")

# ggml_log_level
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
_CONT = 5


class LogSink:
    """Collects llama.cpp's log lines: everything goes to the ``pykvq.llama`` logger (INFO lines at DEBUG,
    since llama.cpp is chatty), errors are also kept for the next exception."""

    def __init__(self, keep: int = 8) -> None:
        self._lock = threading.Lock()
        self._pending = ""
        self._pending_level = logging.DEBUG
        self._problems: deque[str] = deque(maxlen=keep)
        self.callback: object = None  # the cffi callback, alive as long as the sink
        # llama.cpp has one log callback per process: a library sharing it (llama-cpp-python) gets its lines here
        self.forward: Callable[[int, bytes], None] | None = None

    def install(self) -> None:
        """Make this sink llama.cpp's log callback again (after another library set its own)."""
        native.libs().llama.llama_log_set(self.callback, native.libs().ffi.NULL)

    def write(self, level: int, text: str) -> None:
        with self._lock:
            if level != _CONT:
                self._pending_level = _LEVELS.get(level, logging.DEBUG)
            self._pending += text
            while "\n" in self._pending:
                line, self._pending = self._pending.split("\n", 1)
                self._emit(self._pending_level, line)

    def _emit(self, level: int, line: str) -> None:
        if not line.strip():
            return
        log.log(level, "%s", line)
        if level >= logging.ERROR:
            self._problems.append(line.strip())

    def take_problems(self) -> list[str]:
        """The error lines logged since the last call, oldest (usually the cause) first."""
        with self._lock:
            problems = list(self._problems)
            self._problems.clear()
            return problems


@cache
def sink() -> LogSink:
    """The process's sink, installed as llama.cpp's (and ggml's) log callback on first use."""
    lib = native.libs()
    installed = LogSink()

    @lib.ffi.callback("void(int, const char *, void *)")
    def callback(level: int, text, _user_data) -> None:
        raw = lib.ffi.string(text)
        installed.write(level, raw.decode(errors="replace"))
        if installed.forward is not None:
            installed.forward(level, raw)

    installed.callback = callback
    installed.install()
    return installed
