"""The kivi cache on a device whose memory the host cannot read: ggml's RPC backend with a ggml-rpc-server on
127.0.0.1 (CPU kernels behind it, as on the host). Every cache operation there (tests/rpc_scenario.py) must give
the CPU's logits bit for bit; code that touched tensor->data of a device buffer would crash or differ. Also
`pykvq run --rpc`, llama.cpp's flag for the same engine across machines."""

from __future__ import annotations

import json
import re
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pykvq import gguf_metadata
from pykvq.bindings import devices
from pykvq.devtools import random_model, upstream

# the reference is the host's CPU, and the RPC server serves CPU kernels: no GPU in either run
pytestmark = pytest.mark.usefixtures("cpu_only")

SCENARIO = Path(__file__).resolve().parent / "rpc_scenario.py"
LAYERS = {"kivi2": "", "f16-layer0": "k:0=f16,1-=kivi2;v:0=f16,1-=kivi2"}


def run_scenario(tmp_path: Path, model: Path, hamlet: Path, layers: str, layout: str, rpc: str | None = None,
                 recurrent: bool = False) -> np.ndarray:
    out = tmp_path / f"{'rpc' if rpc else 'cpu'}.npy"
    options = (["--rpc", rpc] if rpc else []) + (["--recurrent"] if recurrent else [])
    proc = subprocess.run([sys.executable, str(SCENARIO), str(model), str(hamlet), str(out), layers, layout, *options],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out)


# The default prefill path depends on where the cache is (flash attention over wide cells for device memory, the
# fused kernel for host memory): each case pins one for both runs, so that both run the same kernels
PREFILL = {"fused": "1000000000", "flash": "16"}


@pytest.mark.parametrize(("layers", "layout", "prefill"), [
    ("kivi2", "streams", "fused"), ("kivi2", "unified", "flash"),
    ("f16-layer0", "streams", "flash"), ("f16-layer0", "unified", "fused"),
])
def test_every_cache_operation_on_an_rpc_device_equals_the_cpu(rpc_server: str, smollm2: Path, hamlet: Path,
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              layers: str, layout: str, prefill: str) -> None:
    monkeypatch.setenv("LLAMA_KVQ_FA_PREFILL", PREFILL[prefill])
    on_cpu = run_scenario(tmp_path, smollm2, hamlet, LAYERS[layers], layout)
    on_rpc = run_scenario(tmp_path, smollm2, hamlet, LAYERS[layers], layout, rpc_server)
    np.testing.assert_array_equal(on_rpc, on_cpu)


@pytest.mark.parametrize(("layout", "prefill"), [("streams", "fused"), ("unified", "flash")])
def test_an_iswa_cache_on_an_rpc_device_equals_the_cpu(rpc_server: str, hamlet: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, layout: str,
                                                       prefill: str) -> None:
    """Gemma 3's shape: kivi in both caches of upstream's iSWA cache, the sliding-window one masked to its window."""
    model = tmp_path / "gemma3-small.gguf"
    random_model.write(random_model.SHAPES["gemma3-small"], model, q4_1=True)  # the same matmul kernels on both
    monkeypatch.setenv("LLAMA_KVQ_FA_PREFILL", PREFILL[prefill])
    on_cpu = run_scenario(tmp_path, model, hamlet, "", layout)
    on_rpc = run_scenario(tmp_path, model, hamlet, "", layout, rpc_server)
    np.testing.assert_array_equal(on_rpc, on_cpu)


@pytest.mark.parametrize("n_swa", [0, 64], ids=["hybrid", "hybrid-iswa"])
def test_a_hybrid_model_on_an_rpc_device_equals_the_cpu(rpc_server: str, hamlet: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch, n_swa: int) -> None:
    """LFM2's shape: a kivi cache beside a recurrent state in upstream's hybrid memory (its sliding-window variant
    dropping cells between ubatches)."""
    model = tmp_path / "lfm2-small.gguf"
    random_model.write(replace(random_model.SHAPES["lfm2-small"], n_swa=n_swa), model, q4_1=True)
    monkeypatch.setenv("LLAMA_KVQ_FA_PREFILL", PREFILL["fused"])
    on_cpu = run_scenario(tmp_path, model, hamlet, "", "streams", recurrent=True)
    on_rpc = run_scenario(tmp_path, model, hamlet, "", "streams", rpc_server, recurrent=True)
    np.testing.assert_array_equal(on_rpc, on_cpu)


@pytest.mark.parametrize(("layout", "prefill"), [("streams", "fused"), ("unified", "flash")])
def test_a_latent_attention_model_on_an_rpc_device_equals_the_cpu(rpc_server: str, hamlet: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch, layout: str,
                                                                  prefill: str) -> None:
    """DeepSeek-V2's shape: a cache of K tiles and fp16 cells alone, V read from them (no V tensors to save, copy or
    keep); the flash prefill reads V as a view of the wide K cells."""
    model = tmp_path / "deepseek2-mla-small.gguf"
    random_model.write(random_model.SHAPES["deepseek2-mla-small"], model, q4_1=True)
    monkeypatch.setenv("LLAMA_KVQ_FA_PREFILL", PREFILL[prefill])
    on_cpu = run_scenario(tmp_path, model, hamlet, "", layout)
    on_rpc = run_scenario(tmp_path, model, hamlet, "", layout, rpc_server)
    np.testing.assert_array_equal(on_rpc, on_cpu)


def test_pykvq_run_offloads_to_an_rpc_server(rpc_server: str, smollm2: Path) -> None:
    args = ["-m", str(smollm2), "--kv-type", "kivi2", "-p", "The capital of France is", "-n", "12", "--temp", "0",
            "-c", "512", "-t", "2"]
    on_rpc = subprocess.run(["pykvq", "run", "--rpc", rpc_server, "-ngl", "99", *args], capture_output=True,
                            text=True, timeout=300)
    assert on_rpc.returncode == 0, on_rpc.stderr[-3000:]
    assert "RPC" in on_rpc.stderr
    on_cpu = subprocess.run(["pykvq", "run", "-ngl", "0", *args], capture_output=True, text=True, timeout=300)
    assert on_rpc.stdout == on_cpu.stdout


def test_pykvq_perplexity_offloads_to_an_rpc_server(rpc_server: str, smollm2: Path, hamlet: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_KVQ_FA_PREFILL", PREFILL["fused"])
    # llama-perplexity's own default without -ngl is the case judged (no GPU is visible all the same: cpu_only)
    monkeypatch.delenv("LLAMA_ARG_N_GPU_LAYERS")

    def perplexity(name: str, *device: str) -> tuple[str, dict]:
        out = tmp_path / name
        proc = subprocess.run(["pykvq", "-v", "perplexity", "-m", str(smollm2), "-f", str(hamlet), "-c", "128",
                               "--chunks", "1", "-t", "2", "--kv-types", "kivi2", *device, "-o", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stderr, json.loads(out.with_suffix(".json").read_text())

    log, on_rpc = perplexity("rpc", "--rpc", rpc_server)
    # llama-perplexity's own log (-v): the model's layers went to the server
    assert "offloaded 31/31 layers to GPU" in log and f"RPC0[{rpc_server}] model buffer size" in log
    # llama-perplexity's own default where a device takes layers: as many as fit (all of this model)
    assert (on_rpc["settings"]["rpc"], on_rpc["settings"]["n_gpu_layers"]) == (rpc_server, None)
    _, on_cpu = perplexity("cpu", "-ngl", "0")
    assert on_cpu["settings"]["n_gpu_layers"] == 0
    assert on_rpc["runs"][0]["ppl"] == on_cpu["runs"][0]["ppl"]


def test_pykvq_calibrate_measures_on_an_rpc_server(rpc_server: str, smollm2: Path, hamlet: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_KVQ_FA_PREFILL", PREFILL["fused"])

    def calibrate(name: str, *device: str) -> tuple[str, dict]:
        out = tmp_path / f"{name}.gguf"
        proc = subprocess.run(["pykvq", "-v", "calibrate", "-m", str(smollm2), "-f", str(hamlet), "-o", str(out),
                               "-c", "64", "--recall", "8", "--kv-window", "16", "--kv-sinks", "0", "--kv-clip", "none",
                               "--kv-rotate", "off", "--kv-dither", "none", "--refine", "0", "-t", "2", *device],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stderr, gguf_metadata.read_kvq(out)

    log, on_rpc = calibrate("rpc", "--rpc", rpc_server)
    assert f"RPC0[{rpc_server}] model buffer size" in log
    _, on_cpu = calibrate("cpu", "-ngl", "0")
    # the same kernels, batches and divergences: the same choice, to the bit
    assert on_rpc == on_cpu


@pytest.mark.parametrize("command", ["run", "perplexity", "calibrate"])
@pytest.mark.parametrize(("servers", "message"), [
    ("127.0.0.1", "--rpc takes HOST:PORT"),
    ("127.0.0.1:1", "RPC server 127.0.0.1:1 did not answer"),
])
def test_a_bad_rpc_server_is_one_clear_error(smollm2: Path, hamlet: Path, tmp_path: Path, command: str, servers: str,
                                             message: str) -> None:
    args = {"run": ["-p", "hi", "-n", "2"], "perplexity": ["-f", str(hamlet), "-c", "128", "--chunks", "1"],
            "calibrate": ["-f", str(hamlet), "-o", str(tmp_path / "out.gguf"), "-c", "64", "--recall", "8",
                          "--kv-window", "16"]}[command]
    proc = subprocess.run(["pykvq", command, "--rpc", servers, "-m", str(smollm2), *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1
    assert message in proc.stderr and "Traceback" not in proc.stderr


@contextmanager
def fake_server(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """A listener on 127.0.0.1 that answers every connection with ``answer`` (then closes it): something that is no
    ggml-rpc-server of this build."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(30)

        def serve() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    answer(conn)

        threading.Thread(target=serve, daemon=True).start()
        yield f"127.0.0.1:{listener.getsockname()[1]}"


def hello_response(major: int, minor: int) -> bytes:
    return struct.pack("<Q", 4 + devices.RPC_CONN_CAPS_SIZE) + bytes([major, minor, 0, 0]) + \
        bytes(devices.RPC_CONN_CAPS_SIZE)


@pytest.mark.parametrize(("answer", "message"), [
    # an SSH server, say: ggml's client aborted the process on its banner
    (lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n" * 4), "answered, but not as ggml-rpc-server does"),
    # accepts and says nothing: ggml's client waited forever
    (lambda conn: conn.recv(64) and threading.Event().wait(20), "did not answer ggml-rpc's handshake within"),
    (lambda conn: conn.recv(64) and conn.sendall(hello_response(devices.RPC_PROTO_MAJOR_VERSION + 1, 0)),
     "speaks RPC protocol 8.0.0"),
    (lambda conn: conn.recv(64) and None, "closed the connection during ggml-rpc's handshake"),
], ids=["banner", "silent", "version", "closes"])
def test_a_listener_that_is_no_rpc_server_of_this_build_is_one_clear_error(smollm2: Path, answer, message: str) -> None:
    with fake_server(answer) as endpoint:
        proc = subprocess.run(["pykvq", "run", "--rpc", endpoint, "-m", str(smollm2), "-p", "hi", "-n", "2"],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"RPC server {endpoint}" in proc.stderr and message in proc.stderr and "Traceback" not in proc.stderr


def test_the_handshake_speaks_the_pinned_protocol(upstream_source: upstream.Source) -> None:
    """The HELLO that pykvq sends before ggml's client connects (devices.py) is the pinned ggml-rpc's."""
    rpc = upstream_source.root / "ggml"
    header = (rpc / "include" / "ggml-rpc.h").read_text()
    for name in ("RPC_PROTO_MAJOR_VERSION", "RPC_PROTO_MINOR_VERSION"):
        assert int(re.search(rf"#define {name}\s+(\d+)", header).group(1)) == getattr(devices, name)
    transport = (rpc / "src" / "ggml-rpc" / "transport.h").read_text()
    assert int(re.search(r"RPC_CONN_CAPS_SIZE = (\d+);", transport).group(1)) == devices.RPC_CONN_CAPS_SIZE
    source = (rpc / "src" / "ggml-rpc" / "ggml-rpc.cpp").read_text()
    assert re.search(rf"static_assert\(RPC_CMD_HELLO == {devices.RPC_CMD_HELLO},", source)
