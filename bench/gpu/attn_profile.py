"""Nsight Compute's view of the decode attention op (issue 18): the DRAM bytes each kernel launch of
bench/gpu/attn_op.py reads and the warp instructions it executes, against the bytes the op must read.

    python bench/gpu/attn_profile.py                       # kivi2 (both kernels) and f16 at 32k cells, 1 sequence
    python bench/gpu/attn_profile.py --depth 131072 --kv-types kivi1,q4_0 --sinks 5
    python bench/gpu/attn_profile.py --shape deepseek2-lite   # DeepSeek-V2-Lite's latent attention

ncu profiles attn_op.py's run of the same setting, every launch of a kivi or flash-attention kernel, with caches
flushed between replays (ncu's default), so that a launch reads its layer's cache from DRAM as a decode step does.
Per kernel: the median launch's DRAM bytes and their ratio to the bytes attn_op.py computes for the op (the issue
asks for 5%), warp instructions per cell and KV head, and the launch's duration under the profiler. Writes
bench/results/attn-profile-<device>.json and prints a table. Needs a GPU and ncu (Nsight Compute).
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import attn_op
import readme_tables

METRICS = {"dram__bytes_read.sum": "byte", "smsp__inst_executed.sum": "inst", "gpu__time_duration.sum": "second"}
# the kernels of the op: pykvq's two attention kernels and upstream's flash attention (its vector kernel and the
# combine of its splits)
KERNEL_REGEX = "kvq_attn|flash_attn"
PREFIXES = {"": 1.0, "K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3, "u": 1e-6, "n": 1e-9}
BYTES_TOLERANCE = 0.05


class ProfileError(Exception):
    """ncu is missing, failed, or printed nothing this tool can read."""


@dataclass(frozen=True)
class Launch:
    kernel: str
    dram_bytes: float
    instructions: float
    seconds: float


def find_ncu() -> Path | None:
    """ncu on PATH, else in the CUDA toolkit or a standalone Nsight Compute install."""
    found = shutil.which("ncu")
    if found:
        return Path(found)
    for pattern in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu",
                    "/usr/local/cuda/nsight-compute*/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return Path(hits[-1])
    return None


def to_base(value: str, unit: str, base: str) -> float:
    """A metric's value in its base unit: ncu scales units (Kbyte, usecond) unless told not to."""
    number = float(value.replace(",", ""))
    if not unit.endswith(base) or unit[: -len(base)] not in PREFIXES:
        raise ProfileError(f"ncu reported a {base} metric in '{unit}'")
    return number * PREFIXES[unit[: -len(base)]]


def parse(report: str) -> list[Launch]:
    """The launches of ncu's CSV report (--csv, one row per launch and metric), in launch order."""
    lines = [line for line in report.splitlines() if not line.startswith("==")]
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ProfileError("ncu's report has no CSV table: no kernel matched, or ncu could not profile")
    by_id: dict[str, dict] = {}
    for row in csv.DictReader(lines[start:]):
        name = row.get("Metric Name")
        if name not in METRICS:
            continue
        launch = by_id.setdefault(row["ID"], {"kernel": row["Kernel Name"]})
        launch[name] = to_base(row["Metric Value"], row["Metric Unit"], METRICS[name])
    launches = []
    for launch in by_id.values():
        missing = [m for m in METRICS if m not in launch]
        if missing:
            raise ProfileError(f"ncu's report lacks {', '.join(missing)} for a launch of {launch['kernel']}")
        launches.append(Launch(launch["kernel"], launch["dram__bytes_read.sum"], launch["smsp__inst_executed.sum"],
                               launch["gpu__time_duration.sum"]))
    return launches


def kernel_role(name: str) -> str:
    """Which of attn_op.py's kernels a launch is, by the function ncu names (with or without its template
    arguments and signature)."""
    for part, role in (("kvq_attn_mma_kernel", "tensor cores"), ("kvq_attn_kernel", "cuda cores"),
                       ("flash_attn", "flash attention")):
        if part in name:
            return role
    raise ProfileError(f"a launch of an unexpected kernel: {name}")


def summarize(launches: list[Launch], settings: list[attn_op.Setting], shape: attn_op.Shape) -> list[dict]:
    """One row per setting: each of its kernels' median launch, summed (flash attention's vector kernel and its
    combine make one op), against the bytes the op must read."""
    rows = []
    for s in settings:
        mine = [x for x in launches if kernel_role(x.kernel) == s.kernel]
        if not mine:
            raise ProfileError(f"ncu profiled no launch of {s.kv_type} on {s.kernel}")
        names = list(dict.fromkeys(x.kernel for x in mine))
        med = {n: {f: statistics.median(getattr(x, f) for x in mine if x.kernel == n)
                   for f in ("dram_bytes", "instructions", "seconds")} for n in names}
        total = {f: sum(m[f] for m in med.values()) for f in ("dram_bytes", "instructions", "seconds")}
        moved = attn_op.op_bytes(shape, s)
        rows.append({**asdict(s), "kernels": names, "launches": len(mine), "computed_bytes": moved,
                     "dram_bytes": total["dram_bytes"], "dram_vs_computed": total["dram_bytes"] / moved,
                     "instructions": total["instructions"],
                     "instructions_per_cell_head": total["instructions"] / (s.depth * shape.n_head_kv * s.seqs),
                     "us": total["seconds"] * 1e6})
    return rows


def settings_of(args: argparse.Namespace) -> list[attn_op.Setting]:
    """What attn_op.py runs for these options on a GPU; one kivi and one upstream type at most, since ncu names a
    kernel alike whatever the widths it reads."""
    types = args.kv_types.split(",")
    kivi = [t for t in types if t in attn_op.KV_TYPES]
    upstream = [t for t in types if t in attn_op.UPSTREAM_TYPES]
    unknown = sorted(set(types) - set(kivi) - set(upstream))
    if unknown:
        raise ProfileError(f"unknown KV type(s) {', '.join(unknown)}: take {', '.join(attn_op.KV_TYPES)} or "
                           f"{', '.join(attn_op.UPSTREAM_TYPES)}")
    if len(kivi) > 1 or len(upstream) > 1:
        raise ProfileError("profile one kivi type and one upstream type per run: ncu cannot tell their launches apart")
    out = [attn_op.Setting(t, k, args.depth, args.seqs, args.window, args.sinks) for t in kivi
           for k in ("cuda cores", "tensor cores")]
    return out + [attn_op.Setting(t, "flash attention", args.depth, args.seqs) for t in upstream]


def profile(ncu: Path, args: argparse.Namespace, workdir: Path) -> str:
    """ncu's CSV report of attn_op.py's run of the setting."""
    log = workdir / "ncu.csv"
    command = [str(ncu), "--csv", "--print-units", "base", "--clock-control", "none", "--metrics", ",".join(METRICS),
               "--kernel-name", f"regex:{KERNEL_REGEX}", "--log-file", str(log),
               sys.executable, str(Path(attn_op.__file__)), "--shape", args.shape, "--depth", str(args.depth),
               "--seqs", str(args.seqs),
               "--kv-types", args.kv_types, "--window", str(args.window), "--sinks", str(args.sinks),
               "--repeat", str(args.repeat), "--min-cache-mb", str(args.min_cache_mb), "--out", str(workdir / "op")]
    proc = subprocess.run(command, capture_output=True, text=True)
    report = log.read_text() if log.is_file() else ""
    if proc.returncode != 0:
        raise ProfileError(f"ncu exited with {proc.returncode}:\n{(proc.stderr or report)[-2000:]}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=attn_op.SHAPES, default="llama3-8b", help="attn_op.py's --shape")
    parser.add_argument("--depth", type=int, default=32768)
    parser.add_argument("--seqs", type=int, default=1)
    parser.add_argument("--kv-types", default="kivi2,f16")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--sinks", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=2, help="attn_op.py's timed runs (each launch is profiled)")
    parser.add_argument("--min-cache-mb", type=float, default=160)
    parser.add_argument("--out", type=Path, help="record path without suffix (default bench/results/attn-profile-"
                                                 "<device>)")
    args = parser.parse_args(argv)
    try:
        settings = settings_of(args)
        ncu = find_ncu()
        if ncu is None:
            raise ProfileError("ncu (Nsight Compute) not found on PATH, in /usr/local/cuda/bin or /opt/nvidia")
        with tempfile.TemporaryDirectory() as tmp:
            launches = parse(profile(ncu, args, Path(tmp)))
            device = json.loads((Path(tmp) / "op.json").read_text())["device"]
        shape = attn_op.SHAPES[args.shape]
        rows = summarize(launches, settings, shape)
    except ProfileError as exc:
        print(f"attn_profile: {exc}", file=sys.stderr)
        return 1
    out = args.out or attn_op.default_record("attn-profile", device, args.shape)
    record = {"device": device, "shape": asdict(shape), "metrics": list(METRICS),
              "bytes_tolerance": BYTES_TOLERANCE, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(readme_tables.attn_profile_record_table(record))
    off = [r for r in rows if abs(r["dram_vs_computed"] - 1) > BYTES_TOLERANCE]
    for r in off:
        print(f"{r['kv_type']} on {r['kernel']}: DRAM bytes {r['dram_vs_computed']:.3f}x the computed bytes "
              f"(outside {BYTES_TOLERANCE:.0%})", file=sys.stderr)
    print(f"wrote {out}.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
