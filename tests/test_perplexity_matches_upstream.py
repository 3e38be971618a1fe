"""The patch series must not change upstream behaviour: the patched llama-perplexity reproduces the
perplexity of an unpatched build of the same commit exactly, digit for digit as printed. The reference was
recorded with the CPU's kernels, so the patched tool runs on the CPU too (on a CUDA build with the GPU hidden)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pykvq import llama_tools

# recorded from an unpatched build; the file holds the commands that produced it
REFERENCE = json.loads((Path(__file__).parent / "data" / "unpatched_upstream_perplexity.json").read_text())


@pytest.mark.usefixtures("cpu_only")
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_patched_perplexity_equals_unpatched(kv_type: str, smollm2: Path, hamlet: Path) -> None:
    result = llama_tools.perplexity(smollm2, hamlet, [*REFERENCE["args"], "-ctk", kv_type, "-ctv", kv_type])
    expected = REFERENCE["results"][kv_type]
    assert (result.ppl, result.error, result.running_ppl) == (expected["ppl"], expected["error"],
                                                              expected["running_ppl"])
