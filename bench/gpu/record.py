"""File a GPU run's results (bench/gpu/session.sh's $OUT, as the device tool brings it back) under bench/results.

    python bench/gpu/record.py FOLDER            # then: python bench/update_readme.py

The benchmarks' records go where the benchmarks write them on a machine of their own: the bundles (mma-bench.json,
threshold.json, bench.json) are unpacked under their own file names, attn_op.py's and attn_profile.py's records
(op.json, op-deepseek2-lite.json, profile.json) are named for the GPU as those tools name them. The steps' own
summaries (build, smoke, the pytest runs, sanitize, diagnose) become one record, gpu-run-<gpu>-<date>.json, with
the commit the run judged and the image's Python packages. Prints what it wrote and the tests that failed, for
bench/gpu/recheck.txt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import attn_op
from decode_speed import device_tag

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
BUNDLES = ("mma-bench.json", "threshold.json", "bench.json")
# session.sh's names for attn_op.py's and attn_profile.py's records: (kind, shape) of the tools' own names
RENAMED = {"op.json": ("attn-op", "llama3-8b"), "op-deepseek2-lite.json": ("attn-op", "deepseek2-lite"),
           "profile.json": ("attn-profile", "llama3-8b")}
STEPS = ("build", "smoke", "recheck", "suite", "control", "mma", "sanitize", "diagnose")
PYTEST_STEPS = ("recheck", "suite", "control", "mma")
RECORD_NAME = re.compile(r"[a-z0-9][a-z0-9.-]*\.json")


class RecordError(Exception):
    """The folder is not a session's output, or a file in it cannot be filed."""


def load(path: Path, kind: type = dict) -> Any:
    """A JSON file's value, which must be a `kind` (an object, or pip's list of packages)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RecordError(f"{path.name}: not readable JSON ({exc})") from exc
    if not isinstance(data, kind):
        raise RecordError(f"{path.name}: not a JSON {'object' if kind is dict else kind.__name__}")
    return data


def gpu_of(steps: dict[str, dict]) -> str:
    names = {s["gpu"] for s in steps.values() if isinstance(s.get("gpu"), str) and s["gpu"]}
    if len(names) != 1:
        raise RecordError(f"the steps name {'no GPU' if not names else 'several GPUs: ' + ', '.join(sorted(names))}")
    return names.pop()


def unbundle(bundle: Path) -> dict[str, dict]:
    records = load(bundle)
    for name, record in records.items():
        if not RECORD_NAME.fullmatch(name) or not isinstance(record, dict):
            raise RecordError(f"{bundle.name}: {name!r} is not a benchmark record")
    return records


def head_commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


@dataclass(frozen=True)
class Filing:
    records: dict[str, dict]  # what goes under bench/results, by file name
    steps: dict[str, dict]    # the steps' summaries
    failing: list[str]        # node ids of the tests still failing at full offload


def collect(folder: Path, date: str, commit: str) -> Filing:
    steps = {name: load(folder / f"{name}.json") for name in STEPS if (folder / f"{name}.json").is_file()}
    if not steps:
        raise RecordError(f"{folder}: none of {', '.join(f'{s}.json' for s in STEPS)}: not bench/gpu/session.sh's "
                          "output")
    gpu = gpu_of(steps)
    out: dict[str, dict] = {}
    for bundle in BUNDLES:
        if (folder / bundle).is_file():
            out.update(unbundle(folder / bundle))
    for name, (kind, shape) in RENAMED.items():
        if (folder / name).is_file():
            out[attn_op.default_record(kind, gpu, shape).with_suffix(".json").name] = load(folder / name)
    run = {"gpu": gpu, "date": date, "commit": commit, "exits": step_exits(folder / "chain.log"), "steps": steps}
    if (folder / "packages.json").is_file():
        # the image's Python packages (transformers, torch, ...): what the converter tests met there
        run["packages"] = {p["name"]: p["version"] for p in load(folder / "packages.json", list)}
    out[f"gpu-run-{device_tag(gpu)}-{date}.json"] = run
    return Filing(out, steps, still_failing(steps))


def step_exits(chain_log: Path) -> dict[str, int]:
    """Each finished step's exit code, from the chain's log ("[hh:mm:ss] step suite: exit 1"); a step the lease
    cut short has none."""
    text = chain_log.read_text(errors="replace") if chain_log.is_file() else ""
    return {m[1]: int(m[2]) for m in re.finditer(r"step (\w+): exit (\d+)", text)}


def node_id(junit_name: str) -> str:
    """pytest's node id of a test the session's summaries name as JUnit does: tests.test_x::test_y[p] ->
    tests/test_x.py::test_y[p] (tests.test_x.TestZ::test_y -> tests/test_x.py::TestZ::test_y)."""
    classname, _, name = junit_name.partition("::")
    parts = classname.split(".")
    if not (REPO / Path(*parts)).with_suffix(".py").is_file() and len(parts) > 1:
        return f"{Path(*parts[:-1]).as_posix()}.py::{parts[-1]}::{name}"
    return f"{Path(*parts).as_posix()}.py::{name}"


def still_failing(steps: dict[str, dict]) -> list[str]:
    """The tests at full offload that failed where they last ran, as node ids: the whole suite runs after the
    recheck, so a recheck failure counts only when the suite (cut short by a lease) did not reach its file."""
    suite = steps.get("suite", {})
    reached = set(suite.get("per_file", {}))
    failing = set(suite.get("failures", {}))
    failing |= {t for t in steps.get("recheck", {}).get("failures", {}) if t.split("::")[0] not in reached}
    return sorted(node_id(t) for t in failing)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="what bench/gpu/session.sh's polls left in $OUT")
    parser.add_argument("--date", default=datetime.date.today().isoformat(), help="the run's day (default: today)")
    parser.add_argument("--commit", default=None, help="the commit the run judged (default: HEAD)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the records go")
    args = parser.parse_args(argv)
    try:
        filing = collect(args.folder, args.date, args.commit or head_commit())
    except RecordError as exc:
        print(f"record: {exc}", file=sys.stderr)
        return 1
    args.results.mkdir(parents=True, exist_ok=True)
    for name, record in filing.records.items():
        (args.results / name).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.results / name}")
    for name in PYTEST_STEPS:
        if name in filing.steps:
            s = filing.steps[name]
            print(f"{name}: {s.get('passed')} passed, {s.get('failed')} failed, {s.get('skipped')} skipped of "
                  f"{s.get('tests')}")
    if filing.failing:
        print("still failing at full offload (for bench/gpu/recheck.txt):", *filing.failing, sep="\n")
    print("next: python bench/update_readme.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
