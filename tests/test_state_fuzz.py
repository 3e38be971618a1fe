"""State files fuzzed (issue 23): every field of a whole state and of each sequence's state set to extremes, and
random byte flips, truncations and extensions, loaded into a context holding another history, for each cache
configuration of tests/state_fuzz_worker.py (which says what a load must do). The worker runs in a process of its
own, so that a crash fails one configuration and names the case that caused it. Session files the same way
through the patched llama-completion (--prompt-cache): loaded, or refused with the file left as it was.

A new seed each run, so that CI keeps looking: PYKVQ_FUZZ_SEED=N replays one (the failure message says which)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pykvq import paths
from pykvq.devtools import random_model

import device
import state_format
import state_fuzz_worker

WORKER = Path(__file__).with_name("state_fuzz_worker.py")
SHAPE = random_model.Shape(3, 256, 512, 4, 2, 1024, 65536, 10000.0)  # a first, a middle and a last layer
N_RANDOM = 400  # random mutations of each base state, on top of the field extremes
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def fuzz_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("state-fuzz") / "three-layers.gguf"
    random_model.write(SHAPE, path)
    return path


@pytest.fixture(scope="module")
def seed() -> int:
    return int(os.environ.get("PYKVQ_FUZZ_SEED", random.randrange(2**31)))


@pytest.mark.parametrize("config", sorted(state_fuzz_worker.CONFIGS))
def test_a_corrupt_state_is_refused_with_its_reason_and_leaves_no_trace(fuzz_model: Path, seed: int,
                                                                          config: str) -> None:
    proc = subprocess.run([sys.executable, "-P", str(WORKER), str(fuzz_model), config, "--seed", str(seed),
                           "--random", str(N_RANDOM)], capture_output=True, text=True, timeout=TIMEOUT_S)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    replay = f"PYKVQ_FUZZ_SEED={seed}"
    cases = [r["case"] for r in records if "case" in r]
    assert proc.returncode == 0 and records and records[-1] == {"finished": config}, (
        f"{replay}: the worker ended with status {proc.returncode} in case {cases[-1] if cases else None}:\n"
        f"{proc.stderr[-3000:]}")
    failures = [f"{r['fail']}: {r['why']} ({r.get('message', '')})" for r in records if "fail" in r]
    assert not failures, f"{replay}: {len(failures)} of {len(cases)} cases:\n" + "\n".join(failures[:20])
    outcomes = [r["outcome"] for r in records if "done" in r]
    assert len(outcomes) == len(cases) > 1000
    # the mutations reach the checks behind the header: some are refused, some pass as data
    assert any(o.startswith("refused") for o in outcomes) and any(o.startswith("accepted") for o in outcomes)


N_TOOL_CASES = 40
TOOL_KV = ["-fa", "on", "-ctk", "kivi2", "-ctv", "kivi2", "--kv-window", "16", "-t", "1"]


def completion(model: Path, session: Path) -> subprocess.CompletedProcess:
    """llama-completion continuing from a session file (--prompt-cache): it loads the file, and saves it again
    when it took it."""
    return subprocess.run([str(paths.tool("llama-completion")), *device.TOOL_ARGS, "-m", str(model), "-p",
                           "the prompt that the session holds, and a little more", "-n", "2", "-c", "128",
                           "--temp", "0", "-no-cnv", "--no-warmup", "--prompt-cache", str(session), *TOOL_KV],
                          capture_output=True, text=True, errors="replace", timeout=120, stdin=subprocess.DEVNULL)


def test_a_corrupt_session_file_is_refused_by_the_patched_tool_and_left_as_it_was(fuzz_model: Path, seed: int,
                                                                                     tmp_path: Path) -> None:
    session = tmp_path / "session.bin"
    first = completion(fuzz_model, session)
    assert first.returncode == 0 and session.is_file(), first.stderr[-2000:]
    saved = session.read_bytes()
    with device.load_model(fuzz_model) as model:
        layout = state_format.parse(saved, state_format.Geometry.of(model, kivi=True), "session")
    rng = random.Random(seed)
    fields = rng.sample(list(state_fuzz_worker.field_mutations(saved, layout, rng)), N_TOOL_CASES // 2)
    cases = [*fields, *state_fuzz_worker.random_mutations(saved, layout, N_TOOL_CASES // 2, rng)]
    replay = f"PYKVQ_FUZZ_SEED={seed}"
    outcomes = []
    for name, blob in cases:
        session.write_bytes(blob)
        proc = completion(fuzz_model, session)
        output = proc.stdout + proc.stderr
        assert proc.returncode in (0, 1), f"{replay} {name}: exit {proc.returncode}\n{output[-2000:]}"
        if proc.returncode == 1:
            assert "failed to load session file" in output, f"{replay} {name}:\n{output[-2000:]}"
            assert session.read_bytes() == blob, f"{replay} {name}: the refused file was changed"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["session.bin"], f"{replay} {name}: left files behind"
        outcomes.append(proc.returncode)
    assert 1 in outcomes, outcomes
    # the refusals are the mutations': the file as saved still loads (random cases may all be refused, as when no
    # flip lands in the cells' data, which a load cannot tell from real data)
    session.write_bytes(saved)
    control = completion(fuzz_model, session)
    assert control.returncode == 0, control.stderr[-2000:]
