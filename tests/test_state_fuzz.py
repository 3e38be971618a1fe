"""State files fuzzed (issue 23): every field of a whole state and of each sequence's state set to extremes, and
random byte flips, truncations and extensions, loaded into a context holding another history, for each cache
configuration of tests/state_fuzz_worker.py (which says what a load must do). The worker runs in a process of its
own, so that a crash fails one configuration and names the case that caused it.

A new seed each run, so that CI keeps looking: PYKVQ_FUZZ_SEED=N replays one (the failure message says which)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pykvq.devtools import random_model

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
