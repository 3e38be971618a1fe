"""Multi-head latent attention (ggml_kvq_attn_latent): DeepSeek's MLA as llama.cpp runs it, one KV head whose V is
the first head_dim_v channels of its K, read from the K tiles and fp16 cells (no V of its own), against the numpy
contract of tests/kvq_oracle.py: the fused kernel and flash attention over wide cells on every backend (the CPU, an RPC
device, a GPU); tests/test_kvq_cuda_emulated.py runs these cases through the emulated CUDA-core kernel."""

from __future__ import annotations

from dataclasses import replace

import kvq_graph as g
import kvq_oracle as oracle
import numpy as np
import pytest
from kvq_layer import Case, random_qkv, run_layer

from pykvq.bindings.ggml_types import GGML_TYPE_KIVI1, GGML_TYPE_KIVI4, KIVI_BITS

CASES = [
    Case(head_dim=576, head_dim_v=512, n_head=16, n_head_kv=1, window=32, n_sink=0, latent=True),  # DeepSeek's
    Case(head_dim=160, head_dim_v=128, n_head=4, n_head_kv=1, window=40, n_sink=3, latent=True,
         k_type=GGML_TYPE_KIVI4),
    # more query heads than the CPU kernel groups at once, every tile sealed, clipped 1-bit tiles
    Case(head_dim=96, head_dim_v=64, n_head=40, n_head_kv=1, window=0, n_sink=2, latent=True,
         k_type=GGML_TYPE_KIVI1, clip_k=0.8),
]


def case_id(c: Case) -> str:
    return f"d{c.head_dim}/{c.dv}-h{c.n_head}-w{c.window}-s{c.n_sink}-k{KIVI_BITS[c.k_type]}"


def reference(case: Case, q: np.ndarray, k: np.ndarray) -> np.ndarray:
    return oracle.latent_attention(q, k, np.arange(k.shape[0]), head_dim_v=case.dv, window=case.window,
                                   n_sink=case.n_sink, k_bits=KIVI_BITS[case.k_type],
                                   scale=1.0 / np.sqrt(case.head_dim), clip_k=case.clip_k)


UBATCHES = [37, 1, 64, 20, 28]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_latent_attention_matches_reference(case: Case, kvq_backend: g.Backend | None) -> None:
    q, k, v = random_qkv(case, 150, seed=case.head_dim + case.window)
    got = run_layer(case, q, k, v, UBATCHES, backend=kvq_backend)
    np.testing.assert_allclose(got, reference(case, q, k), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_latent_flash_prefill_matches_reference(case: Case, kvq_backend: g.Backend | None) -> None:
    """V as a view of the wide K cells, as llama.cpp's MLA graph hands flash attention its V: fp16's tolerance,
    on values the size of these keys (per-channel offsets: up to 15, where a kivi V's rows are about 1)."""
    q, k, v = random_qkv(case, 150, seed=case.head_dim + case.window)
    got = run_layer(case, q, k, v, UBATCHES, wide=True, backend=kvq_backend)
    np.testing.assert_allclose(got, reference(case, q, k), rtol=1e-2, atol=1e-3 * np.abs(k[..., :case.dv]).max())


def test_v_is_read_from_the_k_tiles() -> None:
    """The reference would pass a kernel that quantized V per token as a kivi V: the latent contract differs from
    it measurably, and a window over every cell gives plain fp16 attention with V the keys' first channels."""
    case = CASES[0]
    q, k, v = random_qkv(case, 150, seed=3)
    got = run_layer(case, q, k, v, UBATCHES)
    per_token_v = oracle.kivi_attention(q, k, k[:, :, :case.dv], np.arange(150), window=case.window,
                                        n_sink=case.n_sink, k_bits=2, v_bits=2, scale=1.0 / np.sqrt(case.head_dim))
    assert np.abs(got - per_token_v).max() > 1e-2
    covering = replace(case, window=4096)
    fp16 = oracle.kivi_attention(q, k, k[:, :, :case.dv], np.arange(150), window=10**9, n_sink=0, k_bits=2,
                                 v_bits=2, scale=1.0 / np.sqrt(case.head_dim))
    np.testing.assert_allclose(run_layer(covering, q, k, v, UBATCHES), fp16, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=case_id)
def test_latent_results_depend_on_neither_threads_nor_batches(case: Case) -> None:
    q, k, v = random_qkv(case, 120, seed=13)
    alone = run_layer(case, q, k, v, [120], n_threads=1)
    for n_threads in (2, 3):
        for ubatches in ([120], [1] * 120, [7, 50, 63]):
            np.testing.assert_array_equal(run_layer(case, q, k, v, ubatches, n_threads=n_threads), alone)

