"""Pass-key records pooled: runs of bench/passkey.py on one model with the same KV types and settings, different
seeds (so different keys), judged together, each type against f16 key by key.

    python bench/passkey_pool.py bench/results/passkey-A-seed2.json bench/results/passkey-A-seed3.json [--study NAME]

One run of a few keys per length and depth tells little apart: a single key that a type misses and f16 finds marks
the cell "below f16", and a single key the other way hides a real loss. Pooled, each cell's accuracy rests on every
run's keys, and each type's answers are paired with f16's on the same prompts: the keys only f16 finds, the keys only
the type finds, and McNemar's exact two-sided p-value (how likely a split at least that uneven is if both find keys
equally often). Writes bench/results/passkey-<model>-<lengths>-pooled-seeds-<seeds>[-<study>].json and .png and
prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from decode_speed import RESULTS, model_tag, save_results
import options
import passkey

# what must be equal in every pooled record: the same model, prompts of the same kind, the same caches
SHARED = ("model", "lengths", "depths", "kv_types", "ngl", "kv_sinks", "kv_rotate", "kv_clip", "kv_dither", "filler")


def mcnemar_p(only_reference: int, only_other: int) -> float:
    """Exact two-sided McNemar p-value of the discordant pairs: the binomial tail at one half, doubled."""
    n = only_reference + only_other
    tail = sum(math.comb(n, i) for i in range(min(only_reference, only_other) + 1)) / 2 ** n
    return min(1.0, 2.0 * tail)


def paired(record: dict, kv_type: str) -> dict:
    """The keys f16 finds and kv_type does not, the reverse, and their p-value, over each seed's prompts."""
    only_f16 = only_type = 0
    for seed in record["seeds"]:
        reference = [r for r in record["rows"] if r["seed"] == seed and r["kv_type"] == "f16"]
        other = [r for r in record["rows"] if r["seed"] == seed and r["kv_type"] == kv_type]
        for a, b in zip(reference, other, strict=True):
            only_f16 += a["correct"] and not b["correct"]
            only_type += b["correct"] and not a["correct"]
    return {"only_f16": only_f16, "only_type": only_type, "p_value": mcnemar_p(only_f16, only_type)}


def check(record: object, source: str) -> None:
    """ValueError unless record is what bench/passkey.py writes."""
    needed = ("model", "lengths", "depths", "kv_types", "trials", "seed", "rows")
    if not isinstance(record, dict) or any(field not in record for field in needed):
        raise ValueError(f"{source}: not a record of bench/passkey.py (it has {', '.join(needed)})")


def pool(records: list[dict], sources: list[str], study: str | None = None) -> dict:
    """One record of every run's rows, each row with its run's seed (the pairs are made within a seed's prompts).
    ValueError naming what differs when the records cannot be pooled."""
    for source, record in zip(sources, records, strict=True):
        check(record, source)
    first = records[0]
    for source, record in zip(sources[1:], records[1:], strict=True):
        for field in SHARED:
            if record.get(field) != first.get(field):
                raise ValueError(f"{source}: its {field} {record.get(field)!r} differs from {sources[0]}'s "
                                 f"{first.get(field)!r}; only runs of the same model, KV types and settings pool")
    seeds: dict[int, str] = {}
    for source, record in zip(sources, records, strict=True):
        if seeds.setdefault(record["seed"], source) != source:
            raise ValueError(f"{source} and {seeds[record['seed']]} are both seed {record['seed']}: the same keys "
                             "would count twice")
    pooled = {field: first.get(field) for field in SHARED}
    pooled.update({"trials": sum(r["trials"] for r in records), "seeds": list(seeds), "pooled_from": sources,
                   "study": study, "rows": [{**row, "seed": r["seed"]} for r in records for row in r["rows"]]})
    pooled["summary"] = passkey.summary(pooled)
    for entry in pooled["summary"][1:]:
        entry["paired"] = paired(pooled, entry["kv_type"])
    return pooled


def table(record: dict) -> str:
    n_prompts = len(record["rows"]) // len(record["kv_types"])
    lines = [passkey.table(record), "",
             f"paired with f16 on the same {n_prompts} prompts (seeds {', '.join(map(str, record['seeds']))}):"]
    for s in record["summary"][1:]:
        p = s["paired"]
        lines.append(f"{s['kv_type']:<16} keys only f16 finds {p['only_f16']}, only this type {p['only_type']}, "
                     f"McNemar p = {p['p_value']:.2f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", type=Path, nargs="+", help="records that bench/passkey.py wrote (two or more)")
    p.add_argument("--study", metavar="NAME", type=options.study_name,
                   help="what the pooled runs measure: names the record and captions its table")
    args = p.parse_args(argv)
    if len(args.records) < 2:
        p.error("pooling needs two records or more")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        records = [json.loads(path.read_text()) for path in args.records]
        record = pool(records, [path.name for path in args.records], args.study)
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as e:
        raise SystemExit(f"error: {e}") from e
    seeds = "-".join(map(str, record["seeds"]))
    study = f"-{args.study}" if args.study else ""
    lengths = "-".join(map(str, record["lengths"]))
    save_results(RESULTS / f"passkey-{model_tag(record['model'])}-{lengths}-pooled-seeds-{seeds}{study}", record,
                 passkey.plot, table)


if __name__ == "__main__":
    main()
