"""A local ggml-rpc-server for tests and benchmarks: a device whose memory the host cannot read, as a GPU's."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pykvq import paths

START_TIMEOUT_S = 30


class RpcServerError(RuntimeError):
    """The server did not start; the message holds the end of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(log: Path, threads: int = 2, device: str = "CPU") -> Iterator[str]:
    """A ggml-rpc-server on 127.0.0.1 lending ``device`` (CPU: the host's kernels, even on a CUDA build, whose server
    would otherwise lend its GPU), its output in ``log``; yields its HOST:PORT for --rpc."""
    port = free_port()
    with log.open("w") as out:
        server = subprocess.Popen([str(paths.tool("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port), "-t",
                                   str(threads), "-d", device], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RpcServerError(f"ggml-rpc-server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)
