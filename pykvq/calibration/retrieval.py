"""Pass-key prompts built over the calibration text, for the refinement of a mix (pykvq calibrate --retrieval).

The probe's KL divergence (prose, and a recall span that copies distant tokens) cannot tell apart mixes that
keep a pass key from mixes that lose it: on SmolLM2, 1-bit V in the lower layers loses the key at 1024 tokens
while 1-bit V in as many upper layers keeps it, at nearly the same probe divergence (0.0235 against 0.0219).
The divergence at the first token of the answer to a question about a number stated in a long context can
(0.025 against 0.014 in a first measurement), so the refinement may add it to what it measures. At 4 prompts it
proved too noisy to steer (the README, under Results): a study option, off by default. The wording is our own,
not bench/passkey.py's, and the filler is the calibration text, so the bench stays a held-out test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

NEEDLE = " Remember this number: {key}. The number is {key}."
QUESTION = "\nWhat was the number to remember? The number was"


@dataclass(frozen=True)
class RetrievalProbe:
    """n_keys prompts of n_tokens each: calibration text, then a number to remember right before the question
    about it (where the lower layers' coarse V loses it: the context before it is what is quantized)."""

    n_tokens: int
    n_keys: int
    seed: int = 0

    def keys(self) -> list[str]:
        rng = np.random.default_rng(self.seed)
        return [str(k) for k in rng.integers(10000, 100000, size=self.n_keys)]

    def prompts(self, text: list[int], tokenize: Callable[[str, bool], list[int]], window: int) -> list[list[int]]:
        """Each prompt: the model's leading special tokens, a stretch of the text (the stretches spread over it),
        the needle and the question; its last logits predict the answer's first token. ValueError when the text
        or n_tokens is too short for a stretch longer than the fp16 window."""
        prefix = tokenize("", True)
        body = text[len(prefix):] if text[:len(prefix)] == prefix else text
        out = []
        for i, key in enumerate(self.keys()):
            tail = tokenize(NEEDLE.format(key=key) + QUESTION, False)
            n_filler = self.n_tokens - len(prefix) - len(tail)
            if n_filler <= window:
                raise ValueError(f"--retrieval-ctx {self.n_tokens}: the pass-key prompts need more than the "
                                 f"{window}-token fp16 window of text before the number ({len(prefix) + len(tail)} "
                                 f"tokens are the question); raise --retrieval-ctx")
            if len(body) < n_filler:
                raise ValueError(f"the calibration text has {len(text)} tokens; the pass-key prompts "
                                 f"(--retrieval-ctx {self.n_tokens}) need {n_filler + len(prefix)}")
            start = (len(body) - n_filler) * i // max(1, self.n_keys - 1)
            out.append(prefix + body[start:start + n_filler] + tail)
        return out
