"""ggml's devices as llama.cpp uses them: the GPUs of this build, and RPC servers added as devices (`--rpc`)."""

from __future__ import annotations

import re
import socket
import struct
import threading
from dataclasses import dataclass

from pykvq.bindings import native

# enum ggml_backend_dev_type: the kinds that take model layers (-ngl); an RPC server is a GPU to llama.cpp
_OFFLOAD_TYPES = {1: "GPU", 2: "iGPU"}
_ENDPOINT = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):\d{1,5}$")

# ggml-rpc's HELLO, as its client sends it first on every connection (ggml-rpc.cpp, transport.h; checked against the
# pinned source by tests/test_rpc.py): | command 14 | u64 request size | the client's connection capabilities |,
# answered by | u64 response size | major, minor, patch, padding | the server's capabilities |
RPC_CMD_HELLO = 14
RPC_PROTO_MAJOR_VERSION = 7
RPC_PROTO_MINOR_VERSION = 0
RPC_CONN_CAPS_SIZE = 24
_HELLO_RESPONSE_SIZE = 4 + RPC_CONN_CAPS_SIZE

_added: set[str] = set()
_lock = threading.Lock()


class DeviceError(RuntimeError):
    """An RPC server that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    kind: str
    free: int  # bytes of memory free when the device was listed (an RPC server's CPU: its machine's whole memory)
    total: int


def offload_devices() -> list[Device]:
    """The devices that take layers with -ngl: GPUs of this build and RPC servers added so far."""
    lib = native.libs()
    ggml = lib.ggml
    found = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        kind = _OFFLOAD_TYPES.get(ggml.ggml_backend_dev_type(dev))
        if kind is not None:
            free, total = lib.ffi.new("size_t *"), lib.ffi.new("size_t *")
            ggml.ggml_backend_dev_memory(dev, free, total)
            found.append(Device(lib.ffi.string(ggml.ggml_backend_dev_name(dev)).decode(),
                                lib.ffi.string(ggml.ggml_backend_dev_description(dev)).decode(), kind, free[0],
                                total[0]))
    return found


def parse_rpc_servers(servers: str) -> list[str]:
    """llama.cpp's --rpc value: HOST:PORT[,HOST:PORT...]."""
    endpoints = [s.strip() for s in servers.split(",")]
    bad = [e for e in endpoints if not _ENDPOINT.match(e) or not 0 < int(e.rsplit(":", 1)[1]) < 65536]
    if not endpoints or bad:
        raise DeviceError(f"--rpc takes HOST:PORT[,HOST:PORT...], got {servers!r}")
    return endpoints


def add_rpc_servers(servers: str) -> list[str]:
    """Register each RPC server's devices with ggml, as llama.cpp's --rpc does; a server added before is kept."""
    endpoints = parse_rpc_servers(servers)
    lib = native.libs()
    ggml = lib.ggml
    reg = ggml.ggml_backend_reg_by_name(b"RPC")
    address = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else lib.ffi.NULL
    if address == lib.ffi.NULL:
        raise DeviceError("this pykvq build has no RPC backend (GGML_RPC)")
    add_server = lib.ffi.cast("ggml_backend_reg_t (*)(const char *)", address)
    with _lock:
        for endpoint in endpoints:
            if endpoint in _added:
                continue
            _check_reachable(endpoint)
            server_reg = add_server(endpoint.encode())
            if server_reg == lib.ffi.NULL:
                raise DeviceError(f"RPC server {endpoint} has no devices to lend (is it ggml-rpc-server, built "
                                  "from the same pykvq?)")
            ggml.ggml_backend_register(server_reg)
            _added.add(endpoint)
    return endpoints


def _check_reachable(endpoint: str, timeout_s: float = 5.0) -> None:
    """DeviceError unless ``endpoint`` answers ggml-rpc's handshake, in a version this build speaks, within
    ``timeout_s``: ggml's RPC client aborts the process on a refused connection, a malformed answer or another
    protocol version, and waits forever on a server that accepts and stays silent."""
    host, port = endpoint.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            # no capabilities offered: the server keeps the plain transport for this probe
            sock.sendall(struct.pack("<BQ", RPC_CMD_HELLO, RPC_CONN_CAPS_SIZE) + bytes(RPC_CONN_CAPS_SIZE))
            (size,) = struct.unpack("<Q", _receive(sock, 8, endpoint))
            if size != _HELLO_RESPONSE_SIZE:
                raise DeviceError(f"RPC server {endpoint} answered, but not as ggml-rpc-server does (is it one?)")
            major, minor, patch = _receive(sock, size, endpoint)[:3]
    except TimeoutError:
        raise DeviceError(f"RPC server {endpoint} did not answer ggml-rpc's handshake within {timeout_s:g} s: is "
                          "ggml-rpc-server running there?") from None
    except OSError as e:
        raise DeviceError(f"RPC server {endpoint} did not answer ({e.strerror or e}): is ggml-rpc-server running "
                          "there?") from None
    if major != RPC_PROTO_MAJOR_VERSION or minor > RPC_PROTO_MINOR_VERSION:
        raise DeviceError(f"RPC server {endpoint} speaks RPC protocol {major}.{minor}.{patch}, this build "
                          f"{RPC_PROTO_MAJOR_VERSION}.{RPC_PROTO_MINOR_VERSION}: run the ggml-rpc-server of this "
                          "pykvq (or of the same llama.cpp release) there")


def _receive(sock: socket.socket, n: int, endpoint: str) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise DeviceError(f"RPC server {endpoint} closed the connection "
                              "during ggml-rpc's handshake (is it ggml-rpc-server?)")
        data += chunk
    return data
