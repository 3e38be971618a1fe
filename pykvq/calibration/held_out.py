"""The refined mix checked against kivi2 everywhere on stretches of the text that no choice was made on.

The refinement keeps the best of some 25 mixes measured on one short probe, and the best of many close measurements
is partly the one whose sampling noise was kindest. On Qwen2.5-Coder-1.5B the mix kept under the prose limit
(pykvq.calibration.mix_cost) sat exactly at kivi2 everywhere's prose divergence on the probe, yet scored +2.8%
perplexity on Hamlet against kivi2 everywhere's +1.5%. Single stretches of the probe's length disagree among
themselves (on Gemma 3 270M one of four 512-token stretches put the mix behind kivi2 everywhere, which the three
others and Hamlet put well ahead), so the check pools up to CHUNKS of them: the mix is kept where its divergence over
them is within kivi2 everywhere's, and kivi2 everywhere is taken otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

# stretches pooled: four of 512 tokens told the mixes of SmolLM2, Gemma 3 270M and Qwen2.5-Coder-1.5B apart as
# Hamlet's perplexity did
CHUNKS = 4


def stretches(tokens: list[int], start: int, n_tokens: int, chunks: int = CHUNKS) -> list[list[int]]:
    """Up to ``chunks`` whole consecutive stretches of ``n_tokens`` from ``start`` (none where the text ends before
    the first is whole)."""
    out = []
    for at in range(start, start + chunks * n_tokens, n_tokens):
        stretch = tokens[at:at + n_tokens]
        if len(stretch) < n_tokens:
            break
        out.append(stretch)
    return out


@dataclass(frozen=True)
class HeldOutCheck:
    n_tokens: int       # the held-out tokens both were measured over
    mix: float          # the refined mix's mean KL divergence against f16 KV over them
    everywhere: float   # kivi2 everywhere's

    @property
    def keeps_mix(self) -> bool:
        return self.mix <= self.everywhere

    def __str__(self) -> str:
        verdict = "the mix kept" if self.keeps_mix else "kivi2 everywhere taken instead"
        return (f"the refined mix on {self.n_tokens} held-out tokens of the text (after the probe's): KL divergence "
                f"against f16 KV {self.mix:.4f}, kivi2 everywhere's {self.everywhere:.4f} -> {verdict}")
