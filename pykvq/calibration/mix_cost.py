"""What the calibration weighs a per-layer mix by, and the order it ranks mixes in.

A mix's cost is its KL divergence against f16 KV over the probe (the text and the recall span, weighed alike),
plus at the pass-key answers when the calibration has pass-key prompts. The recall span rewards mixes that read
distant tokens exactly, and a mix can buy that with the prose: on Qwen2.5-Coder-1.5B the allocator put 4-bit K and V
in the layers that copy and paid with 1-bit V in eleven others, which lowered the recall span's divergence 0.0063 ->
0.0022 and raised the prose's 0.0096 -> 0.0103 against kivi2 everywhere; perplexity on other prose rose with it
(+1.5% -> +3.4% against f16 on Hamlet). So where kivi2 everywhere fits the budget, its prose divergence is a limit:
a mix over it ranks below every mix within it (by how far over, then by cost), and kivi2 everywhere itself is a
candidate. A mix may trade the recall span's divergence for memory, not the prose's for the recall span's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MixCost:
    probe: float                       # KL divergence on the probe (text and recall span)
    prose: float                       # on the probe's text alone
    retrieval: float | None            # at the pass-key prompts' first answer token (None without them)
    prose_limit: float | None = None   # the prose divergence a mix may reach (None: no limit)

    @property
    def total(self) -> float:
        """The probe's and the pass-key answers' divergence, weighed alike."""
        return self.probe + (self.retrieval or 0.0)

    @property
    def prose_excess(self) -> float:
        """How far the prose divergence is over the limit (0 within it or without one)."""
        return 0.0 if self.prose_limit is None else max(0.0, self.prose - self.prose_limit)

    def __lt__(self, other: MixCost) -> bool:
        return (self.prose_excess, self.total) < (other.prose_excess, other.total)

    def __str__(self) -> str:
        text = f"{self.total:.4f} (prose {self.prose:.4f}"
        if self.retrieval is not None:
            text += f", probe {self.probe:.4f} + pass-key answers {self.retrieval:.4f}"
        if self.prose_excess:
            text += f", over the limit {self.prose_limit:.4f}"
        return text + ")"
