"""llama-cpp-python's server (python -m pykvq.llama_cpp.server) in a process of its own, for the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import device
from pykvq.devtools.rpc_server import free_port


@dataclass(frozen=True)
class Server:
    proc: subprocess.Popen
    url: str

    def post(self, path: str, body: dict, timeout: float = 120) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no VmRSS for the server (pid {self.proc.pid})")


def wait_for(url: str, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"server did not answer {url} within {seconds} s")


@contextmanager
def served(model: Path, args: list[str], log: Path, startup_s: float = 60,
           env: dict[str, str] | None = None) -> Iterator[Server]:
    """The server on ``model`` with ``args`` (its log in ``log``, ``env`` added to its environment), answering on
    a free local port."""
    port = free_port()
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "pykvq.llama_cpp.server", "--model", str(model), *args,
                                 "--host", "127.0.0.1", "--port", str(port),
                                 "--n_gpu_layers", str(device.NGL)],
                                stdout=sink, stderr=subprocess.STDOUT, cwd=log.parent,
                                env={**os.environ, **(env or {})})
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(url + "/v1/models", proc, startup_s)
            yield Server(proc, url)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
