"""The KV cache type vocabulary: which names exist, which are kivi types, and what they cost in memory."""

from __future__ import annotations

from dataclasses import dataclass

from pykvq import native

KIVI_BITS = {"kivi4": 4, "kivi2": 2, "kivi1": 1}
FP16_BITS = 16


class KvTypeError(ValueError):
    """An unknown or malformed KV type; the message lists the valid choices."""


def names() -> list[str]:
    return [t.name for t in native.kv_cache_types()]


@dataclass(frozen=True)
class KvSpec:
    """One entry of --kv-types: a type name, and for kivi types the Hadamard rotation switch (NAME+rot)."""

    name: str
    rotate: bool = False

    @property
    def is_kivi(self) -> bool:
        return self.name in KIVI_BITS

    @property
    def label(self) -> str:
        return self.name + ("+rot" if self.rotate else "")

    @classmethod
    def parse(cls, text: str) -> KvSpec:
        name, _, suffix = text.strip().partition("+")
        valid = names()
        if name not in valid:
            raise KvTypeError(f"unknown KV cache type {name!r}; valid: {', '.join(valid)} (kivi types may add +rot)")
        if suffix not in ("", "rot") or (suffix and name not in KIVI_BITS):
            raise KvTypeError(f"bad KV type {text!r}: only kivi types take a suffix, and it is +rot")
        return cls(name, suffix == "rot")


def parse_list(text: str) -> list[KvSpec]:
    specs = [KvSpec.parse(part) for part in text.split(",") if part.strip()]
    if not specs:
        raise KvTypeError("no KV cache type given")
    return specs


def bits_per_element(name: str, n_ctx: int, window: int, n_sink: int) -> float:
    """Bits per cached element of K or V for a context of n_ctx cells, scales, fp16 window and sinks included:
    what the cache allocates, divided by what it holds."""
    if name in KIVI_BITS:
        fp16_cells = n_sink + native.kvq_ring_size(window)
        return (n_ctx * (KIVI_BITS[name] + 1) + fp16_cells * FP16_BITS) / n_ctx
    for t in native.kv_cache_types():
        if t.name == name:
            return t.bits_per_element
    raise KvTypeError(f"unknown KV cache type {name!r}")
