"""Token sampling: llama.cpp's sampler chain, in the order and with the defaults of its own tools."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from pykvq.bindings import native

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's "pick a random seed"


@dataclass(frozen=True)
class SamplerSettings:
    """--temp, --top-k, --top-p, --min-p, --seed, --ignore-eos with llama.cpp's defaults; temp <= 0 is greedy."""

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = LLAMA_DEFAULT_SEED
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # the ranges refuse NaN (it passes no comparison); temp has none, and a NaN one would not even count as
        # greedy (temp <= 0) but divide every logit into NaN
        if (not math.isfinite(self.temp) or self.top_k < 0 or not 0.0 <= self.top_p <= 1.0
                or not 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"bad sampling settings: {self} (temp finite, top-k >= 0, top-p and min-p in [0, 1])")

    @property
    def greedy(self) -> bool:
        return self.temp <= 0

    def resolved_seed(self) -> int:
        return random.getrandbits(32) if self.seed == LLAMA_DEFAULT_SEED else self.seed & 0xFFFFFFFF


class Sampler:
    """A llama_sampler chain: top-k, top-p, min-p, temperature, then a seeded draw (upstream's default
    order, leaving out its stages that are off by default); greedy when temp <= 0. With ignore_eos, a logit bias
    of -inf on the vocabulary's end-of-generation tokens (``eog``, out of ``n_vocab``) comes first, as
    llama.cpp's --ignore-eos does: generation then runs to -n or a full context."""

    def __init__(self, settings: SamplerSettings = SamplerSettings(), eog: Sequence[int] = (),
                 n_vocab: int = 0) -> None:
        if settings.ignore_eos and not (eog and n_vocab > max(eog)):
            raise ValueError("ignore_eos needs the vocabulary's end-of-generation tokens and its size")
        self.settings = settings
        self.seed = settings.resolved_seed()
        self._lib = native.libs()
        llama = self._lib.llama
        self._ptr = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        stages = [self._eog_ban(eog, n_vocab)] if settings.ignore_eos else []
        if settings.greedy:
            stages += [llama.llama_sampler_init_greedy()]
        else:
            stages += [llama.llama_sampler_init_top_k(settings.top_k),
                      llama.llama_sampler_init_top_p(settings.top_p, 0),
                      llama.llama_sampler_init_min_p(settings.min_p, 0),
                      llama.llama_sampler_init_temp(settings.temp),
                      llama.llama_sampler_init_dist(self.seed)]
        for stage in stages:
            llama.llama_sampler_chain_add(self._ptr, stage)

    def _eog_ban(self, eog: Sequence[int], n_vocab: int):
        biases = self._lib.ffi.new("llama_logit_bias[]", [(token, -math.inf) for token in eog])
        return self._lib.llama.llama_sampler_init_logit_bias(n_vocab, len(eog), biases)

    def sample(self, llama_context) -> int:
        """The next token from the last logits of a ``llama_context *`` (the chain also records it); a Context
        passes its own, so that sampling needs nothing of the Python API above the bindings."""
        return int(self._lib.llama.llama_sampler_sample(self._ptr, llama_context, -1))

    def __del__(self) -> None:
        if getattr(self, "_ptr", None) is not None:
            self._lib.llama.llama_sampler_free(self._ptr)
            self._ptr = None
