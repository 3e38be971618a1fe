"""The state-file fuzz campaign of one cache configuration, run in a process of its own (a crash must not take
pytest with it): python tests/state_fuzz_worker.py MODEL CONFIG [--seed N] [--random N] [--only REGEX].

Every field of a whole state and of each sequence's state (tests/state_format.py) gets extreme values, and
random byte flips, truncations and extensions hit anywhere; each goes through Context.load_state or
load_seq_state of a context holding another history. A refused load must name its reason and leave the
context as it was or visibly empty (the whole cache, or the loaded sequence), with Context.n_past what the cache
holds; a continuation then gives exactly the logits of a twin in that state. An accepted load must survive the
continuation (upstream's cache alone may refuse it, with a reason: Config.continuation_may_refuse). One JSON line
per case on stdout: {"case": ..} before the load (the last one names a crash), {"done": .., "outcome": ..} after
it, {"fail": .., "why": ..} for a broken property.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import device  # noqa: E402
import state_format  # noqa: E402
from pykvq import Context, KvConfig, LlamaError, Model  # noqa: E402
from pykvq.bindings.log import sink  # noqa: E402

N_CTX = 128
WINDOW = 16  # the ring wraps within the saved tokens, and a tile seals
HISTORY = {0: list(range(10, 50)), 1: list(range(60, 97))}  # what the saved context holds: 40 and 37 tokens
OTHER = {0: list(range(200, 220)), 1: list(range(300, 311))}  # what the loading context holds before
CONTINUATION = [7, 8, 9]


@dataclass(frozen=True)
class Config:
    kv: KvConfig
    n_seq: int = 1
    unified: bool = False
    # upstream's own cache checks no cell's position against the context when it loads (positions outgrow n_ctx
    # after a context shift): it takes a cell at 2^31 - 1, and the continuation is then refused as not fitting.
    # Every cache with a kivi layer refuses such a load, so there an accepted load must continue.
    continuation_may_refuse: bool = False


CONFIGS = {
    "kivi2": Config(KvConfig.preset("kivi2", window=WINDOW, sinks=4)),
    "kivi4-kivi1": Config(KvConfig("kivi4", "kivi1", window=WINDOW, sinks=2)),
    "kivi2-rot": Config(KvConfig.preset("kivi2", window=WINDOW, rotate=True, rollback=8)),
    "f16-layer0": Config(KvConfig("kivi2", "kivi2", window=WINDOW, layers="k:0=f16,1-=kivi2;v:0=f16,1-=kivi2")),
    "q8_0-layer1": Config(KvConfig("kivi2", "kivi2", window=WINDOW, layers="k:0=kivi4,1-=q8_0;v:0=kivi1,1-=q8_0")),
    "streams": Config(KvConfig.preset("kivi2", window=WINDOW, sinks=2), n_seq=2),
    "unified": Config(KvConfig.preset("kivi2", window=WINDOW, sinks=2), n_seq=2, unified=True),
    "f16": Config(KvConfig(), n_seq=2, continuation_may_refuse=True),
}


class Campaign:
    def __init__(self, model: Model, config: Config) -> None:
        self.model, self.config = model, config
        self.seqs = list(range(config.n_seq))
        self.context_config = device.context_config(n_ctx=N_CTX, n_threads=1, kv=config.kv, flash_attn="on",
                                                    n_seq_max=config.n_seq, kv_unified=config.unified)
        self.saved = self._filled(HISTORY)
        self.before = self._filled(OTHER)
        self.before_state = self.before.save_state()
        self.before_lens = self._lens(self.before)
        self.target = self._context()
        self.references: dict[tuple[int, ...], np.ndarray] = {}
        self.geometry = state_format.Geometry.of(model, config.kv.is_kivi)

    def _context(self) -> Context:
        return self.model.context(self.context_config)

    def _filled(self, feeds: dict[int, list[int]]) -> Context:
        ctx = self._context()
        ctx.eval_seqs({s: feeds[s] for s in self.seqs})
        return ctx

    def _lens(self, ctx: Context) -> tuple[int, ...]:
        return tuple(ctx.seq_len(s) for s in self.seqs)

    def _continue(self, ctx: Context) -> np.ndarray:
        out = ctx.eval_seqs({s: CONTINUATION for s in self.seqs})
        return np.stack([out[s] for s in self.seqs])

    def reference(self, emptied: tuple[int, ...]) -> np.ndarray:
        """The continuation's logits in a twin that never saw the load, its sequences `emptied` cleared."""
        if emptied not in self.references:
            with self._context() as twin:
                twin.load_state(self.before_state)
                for s in emptied:
                    twin.seq_rm(s)
                self.references[emptied] = self._continue(twin)
        return self.references[emptied]

    def bases(self) -> Iterator[tuple[str, bytes, int | None]]:
        """The states the mutations start from: the whole state and each sequence's."""
        yield "state", self.saved.save_state(), None
        for s in self.seqs:
            yield "seq", self.saved.save_seq_state(s), s

    def run(self, case: str, blob: bytes, seq: int | None, emit: Callable[[dict], None]) -> None:
        ctx = self.target
        ctx.load_state(self.before_state)
        sink().take_problems()
        emit({"case": case})
        try:
            if seq is None:
                ctx.load_state(blob)
            else:
                ctx.load_seq_state(blob, seq)
        except LlamaError as err:
            self._check_refused(case, str(err), seq, emit)
            return
        # accepted (a mutation of data bytes may be): whatever it holds, the context must keep working
        try:
            self._continue(ctx)
            emit({"done": case, "outcome": "accepted"})
        except LlamaError as err:
            if not self.config.continuation_may_refuse or not str(err).strip():
                emit({"fail": case, "why": "an accepted load cannot continue", "message": str(err)[:300]})
            emit({"done": case, "outcome": "accepted, continuation refused", "why": str(err)[:200]})

    def _check_refused(self, case: str, message: str, seq: int | None, emit: Callable[[dict], None]) -> None:
        ctx = self.target
        lens = self._lens(ctx)
        problems = []
        if ": " not in message:  # only pykvq's "cannot load the state", without llama.cpp's reason
            problems.append(f"the refusal does not say why: {message!r}")
        touched = self.seqs if seq is None else [seq]
        emptied = tuple(s for s in touched if lens[s] == 0 and self.before_lens[s] != 0)
        for s in self.seqs:
            if lens[s] != self.before_lens[s] and s not in emptied:
                problems.append(f"sequence {s} holds {lens[s]} tokens, neither its {self.before_lens[s]} nor none")
        if ctx.n_past != lens[0]:
            problems.append(f"n_past {ctx.n_past}, the cache holds {lens[0]}")
        if seq is None and emptied and len(emptied) != len([s for s in self.seqs if self.before_lens[s]]):
            problems.append(f"a whole-state load emptied only sequences {emptied}")
        if not problems:
            got = self._continue(ctx)
            want = self.reference(emptied)
            if not np.array_equal(got, want):
                problems.append(f"the continuation differs from its twin's (emptied {emptied}) by up to "
                                f"{float(np.nanmax(np.abs(got - want)))}")
        for problem in problems:
            emit({"fail": case, "why": problem, "message": message[:300]})
        emit({"done": case, "outcome": "refused, " + ("emptied" if emptied else "unchanged"), "why": message[:200]})


def extremes(f: state_format.Field, original: int, rng: random.Random) -> list[int]:
    """0, 1, -1, the type's extremes, the original ±1 and a random value, as the field's bit pattern."""
    bits = 8 * f.size
    mask = (1 << bits) - 1
    values = [0, 1, -1, (1 << (bits - 1)) - 1, 1 << (bits - 1), 2**31 - 1, original + 1, original - 1,
              rng.getrandbits(bits)]
    out = []
    for v in values:
        v &= mask
        if f.signed and v >> (bits - 1):
            v -= 1 << bits
        if v != original and v not in out:
            out.append(v)
    return out


def field_mutations(blob: bytes, layout: state_format.Layout, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    for f in layout.fields:
        original = f.read(blob)
        for value in extremes(f, original, rng):
            mutated = bytearray(blob)
            mutated[f.offset:f.offset + f.size] = value.to_bytes(f.size, "little", signed=f.signed)
            yield f"{f.name}={value}", bytes(mutated)


def random_mutations(blob: bytes, layout: state_format.Layout, n: int,
                     rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """Byte flips anywhere (in the fields more often than their share), truncations and extensions."""
    for i in range(n):
        kind = rng.choice(["flip", "flip-fields", "truncate", "extend"])
        mutated = bytearray(blob)
        if kind == "truncate":
            at = rng.choice([rng.randrange(len(blob)), rng.choice(layout.fields).offset])
            yield f"random{i}:truncate@{at}", bytes(mutated[:at])
        elif kind == "extend":
            extra = rng.randbytes(rng.choice([1, 4, 8, rng.randrange(1, 4096)]))
            yield f"random{i}:extend+{len(extra)}", bytes(mutated + extra)
        else:
            spots = []
            for _ in range(rng.randint(1, 8)):
                f = rng.choice(layout.fields) if kind == "flip-fields" else None
                at = f.offset + rng.randrange(f.size) if f else rng.randrange(len(blob))
                mutated[at] ^= 1 << rng.randrange(8)
                spots.append(at)
            yield f"random{i}:{kind}@{','.join(map(str, spots))}", bytes(mutated)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("config", choices=CONFIGS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--random", type=int, default=300, help="random mutations of each base state")
    parser.add_argument("--only", help="run the cases whose name matches this regular expression")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    only = re.compile(args.only) if args.only else None

    def emit(record: dict) -> None:
        print(json.dumps(record), flush=True)

    with device.load_model(args.model) as model:
        campaign = Campaign(model, CONFIGS[args.config])
        for kind, base, seq in campaign.bases():
            layout = state_format.parse(base, campaign.geometry, kind)
            tag = kind if seq is None else f"seq{seq}"
            mutations = [*field_mutations(base, layout, rng), *random_mutations(base, layout, args.random, rng)]
            for name, blob in mutations:
                case = f"{args.config}/{tag}/{name}"
                if only is None or only.search(case):
                    campaign.run(case, blob, seq, emit)
    emit({"finished": args.config})


if __name__ == "__main__":
    main()
