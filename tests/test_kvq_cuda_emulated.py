"""ATTN's CUDA-core kernel (ggml-kvq/src/cuda/kvq-cuda-attn-kernel.cuh), the default on a GPU, run on the CPU through
the emulated CUDA of tests/kvq_emulation.py: every case of tests/test_kvq_attention.py against the numpy oracle at
that file's tolerance, the latent (MLA) cases of tests/test_kvq_latent.py against theirs, and batching that leaves a
query's bits alone. On a GPU, those files' gpu backend runs the same kernel for real."""

from __future__ import annotations

from pathlib import Path

import kvq_emulation as emulation
import numpy as np
import pytest
import test_kvq_latent as latent
from kvq_layer import Case, random_qkv, run_layer
from test_kvq_attention import CASES, case_id, reference


@pytest.fixture(scope="module")
def emulated(cuda_emulation: Path):
    return emulation.attention_op(cuda_emulation, "cuda cores")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_emulated_cuda_cores_match_the_reference(case: Case, emulated) -> None:
    q, k, v = random_qkv(case, 150, seed=case.head_dim + case.window)
    got = run_layer(case, q, k, v, [37, 1, 64, 20, 28], attention_op=emulated)
    np.testing.assert_allclose(got, reference(case, q, k, v), rtol=2e-4, atol=2e-5)


def test_emulated_cuda_cores_batching_does_not_change_results(emulated) -> None:
    """200 cells are two of the kernel's splits: the same bits whatever the batch."""
    case = CASES[2]
    q, k, v = random_qkv(case, 200, seed=11)
    whole = run_layer(case, q, k, v, [200], attention_op=emulated)
    mixed = run_layer(case, q, k, v, [31, 33, 2, 34, 100], attention_op=emulated)
    np.testing.assert_array_equal(whole, mixed)


@pytest.mark.parametrize("case", latent.CASES, ids=latent.case_id)
def test_emulated_cuda_cores_read_a_latent_v_from_the_k_tiles(case: Case, emulated) -> None:
    """Each lane decodes its channels' codes of the cell from K's tile, the channel's scale and minimum with them."""
    q, k, v = random_qkv(case, 150, seed=case.head_dim + case.window)
    got = run_layer(case, q, k, v, latent.UBATCHES, attention_op=emulated)
    np.testing.assert_allclose(got, latent.reference(case, q, k), rtol=2e-4, atol=2e-5)
