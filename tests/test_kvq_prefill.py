"""The flash-attention prefill (wide cells, ggml-kvq.h) end to end through llama-perplexity on the CPU, where
LLAMA_KVQ_FA_PREFILL switches it on (GPU caches take it by default). Its arithmetic against the DESIGN.md §5
oracle is checked op by op in test_kvq_attention.py; here it runs inside the real graph, one sequence and
several, next to the fused kernel and to f16."""

from __future__ import annotations

from pathlib import Path

import pytest

import device
from pykvq import llama_tools

KIVI2 = ["-fa", "on", "-ctk", "kivi2", "-ctv", "kivi2", "--kv-window", "32", "--kv-sinks", "4"]


def perplexity(smollm2: Path, hamlet: Path, *args: str) -> llama_tools.PerplexityResult:
    return llama_tools.perplexity(smollm2, hamlet, ["-t", "2", "--chunks", "4", *args])


@pytest.fixture
def flash_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of 64 tokens or more per sequence prefill through flash attention."""
    monkeypatch.setenv("LLAMA_KVQ_FA_PREFILL", "64")


def test_without_quantized_cells_the_flash_prefill_is_f16_attention(smollm2: Path, hamlet: Path,
                                                                    flash_prefill: None) -> None:
    # a window as long as the context: every cell is read in fp16, only the C block of the wide cells is used
    f16 = perplexity(smollm2, hamlet, "-c", "512", "-fa", "on")
    kivi = perplexity(smollm2, hamlet, "-c", "512", "-fa", "on", "-ctk", "kivi2", "-ctv", "kivi2",
                      "--kv-window", "512")
    # on a GPU, f16 is upstream's own flash kernel (fp16 partial sums): 2.6e-3 apart on an H200
    assert kivi.ppl == pytest.approx(f16.ppl, rel=5e-3 if device.ON_GPU else 2e-3)


def test_the_flash_prefill_agrees_with_the_fused_kernel(smollm2: Path, hamlet: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # named, not left to the default: a cache in GPU memory prefills through flash attention by default
    monkeypatch.setenv("LLAMA_KVQ_FA_PREFILL", str(2**31 - 1))
    fused = perplexity(smollm2, hamlet, "-c", "512", *KIVI2)
    monkeypatch.setenv("LLAMA_KVQ_FA_PREFILL", "64")
    flash = perplexity(smollm2, hamlet, "-c", "512", *KIVI2)
    # the same contract; fp16 rounding of the dequantized values flips a few codes downstream, which moves
    # the perplexity of this small model by about 1% (as a change of window by a few tokens does)
    assert flash.ppl == pytest.approx(fused.ppl, rel=0.05)
    assert abs(flash.ppl - fused.ppl) < 2 * fused.error
    # and not the same run twice: the variable did switch the path
    assert flash.ppl != fused.ppl


@pytest.mark.parametrize("layout", [[], ["--kv-unified"]], ids=["streams", "unified"])
def test_the_flash_prefill_of_four_sequences_per_batch(smollm2: Path, hamlet: Path, flash_prefill: None,
                                                       layout: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    one = perplexity(smollm2, hamlet, "-c", "256", "-b", "256", *KIVI2)
    four = perplexity(smollm2, hamlet, "-c", "256", "-b", "1024", *layout, *KIVI2)
    monkeypatch.setenv("LLAMA_KVQ_FA_PREFILL", str(2**31 - 1))
    # the batches of four sequences did go through flash attention, not the fused kernel
    assert four.ppl != perplexity(smollm2, hamlet, "-c", "256", "-b", "1024", *layout, *KIVI2).ppl
    # four sequences per batch change the matmuls' shapes, hence a few 2-bit codes; on a GPU (cuBLAS picks its
    # kernels by shape) the running perplexities moved by up to 3.5% on an H200
    assert four.running_ppl == pytest.approx(one.running_ppl, rel=0.05 if device.ON_GPU else 0.03)
