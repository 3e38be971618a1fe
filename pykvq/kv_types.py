"""The KV cache type vocabulary: which names exist, which are kivi types, and what they cost in memory."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from pykvq.bindings import native

KIVI_BITS = {"kivi4": 4, "kivi2": 2, "kivi1": 1}
# the KV cache types llama.cpp reads without flash attention (V transposed); the others are quantized
UNQUANTIZED_TYPES = frozenset({"f32", "f16", "bf16"})
FP16_BITS = 16


class KvTypeError(ValueError):
    """An unknown or malformed KV type; the message lists the valid choices."""


def names() -> list[str]:
    return [t.name for t in native.kv_cache_types()]


ASYMKV_PREFIX = "asymkv:"


@dataclass(frozen=True)
class KvSpec:
    """One entry of --kv-types: a type name (for kivi types with +rot, the Hadamard rotation), or per-layer
    types: AsymKV's asymkv:L_K/L_V or the general --kv-layers form, on a kivi2 context."""

    name: str
    rotate: bool = False
    layers: str | None = None

    @property
    def is_kivi(self) -> bool:
        return self.name in KIVI_BITS

    @property
    def label(self) -> str:
        return self.layers or self.name + ("+rot" if self.rotate else "")

    @classmethod
    def per_layer(cls, spec: str) -> KvSpec:
        """Per-layer types; ValueError naming the offending part when ``spec`` does not parse, or when it names no
        layer at all (empty or "none": that run would be the plain type under another name)."""
        if spec.strip() in ("", "none"):
            raise KvTypeError(f"per-layer types {spec!r}: give each layer's K and V type, e.g. k:0-15=kivi2,16-=kivi1;"
                              "v:*=kivi1")
        native.check_layer_spec(spec)
        return cls("kivi2", layers=spec)

    @classmethod
    def parse(cls, text: str) -> KvSpec:
        text = text.strip()
        if text.startswith(ASYMKV_PREFIX):
            return cls.per_layer(text)
        name, _, suffix = text.partition("+")
        valid = names()
        if name not in valid:
            raise KvTypeError(f"unknown KV cache type {name!r}; valid: {', '.join(valid)} (kivi types may add +rot; "
                              f"per-layer: asymkv:L_K/L_V)")
        if suffix not in ("", "rot") or (suffix and name not in KIVI_BITS):
            raise KvTypeError(f"bad KV type {text!r}: only kivi types take a suffix, and it is +rot")
        return cls(name, suffix == "rot")


def parse_list(text: str) -> list[KvSpec]:
    specs = [KvSpec.parse(part) for part in text.split(",") if part.strip()]
    if not specs:
        raise KvTypeError("no KV cache type given")
    return specs


# MiniKV's prompt selection: (heavy-hitter share, recent share) of a prompt, optionally the number of the prompt's
# last tokens whose attention picks the heavy hitters (0: all of them), and optionally the pyramid depth (1: every
# layer keeps the same share; D: the share falls linearly from HH*(2 - 1/D) in the bottom layer to HH/D in the top)
Selection = tuple[float, float] | tuple[float, float, int] | tuple[float, float, int, float]
SELECT_OFF: Selection = (0.0, 0.0)  # none, whatever the model's kvq.select says

_SELECT_FORM = "HH,RW[,N[,D]]"


def selects(select: Selection | None) -> bool:
    """Whether a selection keeps part of a prompt (None: none given, off: none wanted)."""
    return select is not None and select[0] + select[1] > 0


def parse_select(text: str) -> Selection:
    """``HH,RW[,N[,D]]`` of --kv-select: the heavy-hitter and recent shares of a prompt, each in (0, 1], at most 1
    together, the observation window N (a count of tokens, 0: the whole prompt) and the pyramid depth D (1 or
    more); ``off``: none (over a model's kvq.select)."""
    if text == "off":
        return SELECT_OFF
    parts = text.split(",")
    try:
        if len(parts) not in (2, 3, 4):
            raise ValueError
        hh, recent = float(parts[0]), float(parts[1])
        observe = int(parts[2]) if len(parts) >= 3 else None
        depth = float(parts[3]) if len(parts) == 4 else None
    except ValueError:
        raise KvTypeError(f"--kv-select takes {_SELECT_FORM}, two shares of the prompt, optionally how many of its "
                          f"last tokens pick the heavy hitters and the pyramid depth, such as 0.25,0.25 or "
                          f"0.25,0.25,32 or 0.25,0.25,0,3; got {text!r}") from None
    if not (0.0 < hh <= 1.0 and 0.0 < recent <= 1.0):
        raise KvTypeError(f"--kv-select shares must each be in (0, 1]; got {text!r}")
    if hh + recent > 1.0 + 1e-6:
        raise KvTypeError(f"--kv-select shares add up to {hh + recent:g}, more than the whole prompt; got {text!r}")
    if observe is None:
        return hh, recent
    if observe < 0:
        raise KvTypeError(f"--kv-select's observation window N must be 0 (the whole prompt) or more tokens; "
                          f"got {text!r}")
    if depth is None:
        return hh, recent, observe
    if not (math.isfinite(depth) and depth >= 1.0):
        raise KvTypeError(f"--kv-select's pyramid depth D must be 1 (every layer alike) or more; got {text!r}")
    return hh, recent, observe, depth


def selection_depth(select: Selection) -> float:
    """The pyramid depth of a selection (1: every layer alike)."""
    return float(select[3]) if len(select) == 4 else 1.0


def selection_spec(select: Selection) -> str:
    """``HH,RW[,N[,D]]``, as --kv-select spells it."""
    return ",".join(f"{x:g}" for x in select) if selects(select) else "off"


def selection_label(select: Selection) -> str:
    """``0.25/0.25``, ``0.25/0.25 obs 32`` with an observation window (``obs all`` for 0), ``... pyramid 3`` with a
    pyramid depth over 1."""
    label = f"{select[0]:g}/{select[1]:g}"
    if len(select) >= 3:
        label += f" obs {select[2] or 'all'}"
    depth = selection_depth(select)
    return label + (f" pyramid {depth:g}" if depth != 1.0 else "")


def _f32(x: float) -> float:
    """x rounded to a C float, as the C API holds shares."""
    return struct.unpack("f", struct.pack("f", x))[0]


def kept_cells(select: Selection, n_prompt: int, window: int, n_sink: int) -> int:
    """Cells a prompt of n_prompt tokens keeps under a selection (llama_kvq_select_for): its sinks, the heavy hitters
    of the bottom layer (the most of any layer under a pyramid) and its recent tokens; all of it when it is no
    longer than the window."""
    if n_prompt <= max(window, n_sink):
        return n_prompt

    def count(share: float) -> int:
        # as the C API counts: the share as a float, rounded half away from zero
        return math.floor(share * n_prompt + 0.5)

    n_recent = min(max(count(_f32(select[1])), 1), n_prompt - n_sink)
    depth = _f32(selection_depth(select))
    bottom = _f32(_f32(select[0]) * _f32(2.0 - _f32(1.0 / depth)))
    n_hh = min(count(bottom), n_prompt - n_sink - n_recent)
    return n_sink + n_hh + n_recent


def fp16_cells(window: int, n_sink: int, rollback: int = 0) -> int:
    """Cells a kivi layer keeps in fp16 whatever the context: the sinks and the ring (window + rollback)."""
    return n_sink + native.kvq_ring_size(window + rollback)


def bits_per_element(name: str, n_ctx: int, window: int, n_sink: int, rollback: int = 0) -> float:
    """Bits per cached element of K or V for a context of n_ctx cells, scales, fp16 window (its ring widened by
    ``rollback`` cells) and sinks included: what the cache allocates, divided by what it holds."""
    if name in KIVI_BITS:
        return (n_ctx * (KIVI_BITS[name] + 1) + fp16_cells(window, n_sink, rollback) * FP16_BITS) / n_ctx
    for t in native.kv_cache_types():
        if t.name == name:
            return t.bits_per_element
    raise KvTypeError(f"unknown KV cache type {name!r}")


# the clip "ratio" mse of --kv-clip, as the cache resolves it (ggml-kvq.h's GGML_KVQ_CLIP_MSE): each quantization
# group's range searched for least squared error
CLIP_MSE = 0.0
CLIP_MSE_NAME = "mse"


def clip_text(ratio: float) -> str:
    """A clip ratio as --kv-clip writes it."""
    return CLIP_MSE_NAME if ratio == CLIP_MSE else f"{ratio:g}"


def per_layer_spec(values: dict[str, list[str]], neutral: str) -> str:
    """The per-layer spec form (--kv-layers, --kv-clip, --kv-rotate) of one value per layer for each part (k, v),
    runs of equal values as ranges, a part that is ``neutral`` everywhere left out; "none" when every part is."""
    parts = []
    for part, per_layer in sorted(values.items()):
        if all(v == neutral for v in per_layer):
            continue
        rules, start = [], 0
        for il in range(1, len(per_layer) + 1):
            if il == len(per_layer) or per_layer[il] != per_layer[start]:
                span = str(start) if il - 1 == start else f"{start}-{il - 1}"
                rules.append(f"{span}={per_layer[start]}")
                start = il
        parts.append(f"{part}:{','.join(rules)}")
    return ";".join(parts) or "none"


def type_id(name: str) -> int:
    for t in native.kv_cache_types():
        if t.name == name:
            return t.id
    raise KvTypeError(f"unknown KV cache type {name!r}; valid: {', '.join(names())}")


def type_name(type_id: int) -> str:
    return native.ggml_type(type_id).name


def layer_types(layers: str, n_layer: int, type_k: str, type_v: str) -> tuple[list[str], list[str]]:
    """The K and V type of each layer under a per-layer spec (type_k / type_v where it leaves a part out);
    ValueError naming the offending part."""
    types_k, types_v = native.resolve_layer_types(layers, n_layer, type_id(type_k), type_id(type_v))
    return [type_name(t) for t in types_k], [type_name(t) for t in types_v]


def layer_bits_per_element(spec: KvSpec, n_layer: int, n_ctx: int, window: int, n_sink: int) -> tuple[float, float]:
    """Mean bits per element of K and of V over the layers (every layer holds the same number of elements in
    the models pykvq targets), for per-layer specs as well as single types."""
    if spec.layers is None:
        bpe = bits_per_element(spec.name, n_ctx, window, n_sink)
        return bpe, bpe
    types_k, types_v = layer_types(spec.layers, n_layer, spec.name, spec.name)

    def mean(types: list[str]) -> float:
        return sum(bits_per_element(t, n_ctx, window, n_sink) for t in types) / n_layer

    return mean(types_k), mean(types_v)
