"""MiniKV's attention mass (GGML_KVQ_OP_SCORE_LSE / SCORE_ADD): what each cached cell receives over a prefill fed
in ubatches, against a numpy oracle that builds the whole probability matrix (tests/kvq_oracle.py). The kernels
judged: the CPU's, in host memory and behind the RPC backend (device memory the host cannot read), and the GPU's
when the build and the machine have one."""

from __future__ import annotations

import kvq_graph as g
import kvq_oracle as oracle
import numpy as np
import pytest
from kvq_layer import Case, feed_layer, random_qkv

from pykvq.bindings.ggml_types import GGML_TYPE_KIVI1, GGML_TYPE_KIVI4, KIVI_BITS

CASES = [
    Case(head_dim=64, n_head=9, n_head_kv=3, window=32, n_sink=0),
    Case(head_dim=128, n_head=8, n_head_kv=2, window=40, n_sink=5),
    Case(head_dim=32, n_head=2, n_head_kv=1, window=16, n_sink=3, k_type=GGML_TYPE_KIVI4, v_type=GGML_TYPE_KIVI1),
    Case(head_dim=64, n_head=4, n_head_kv=4, window=0, n_sink=0, k_type=GGML_TYPE_KIVI1),
    Case(head_dim=192, n_head=4, n_head_kv=2, window=32, n_sink=0, head_dim_v=128),
]
UBATCHES = [37, 1, 64, 20, 28]


def reference_mass(case: Case, q: np.ndarray, k: np.ndarray, n_swa: int = 0,
                   scoring: np.ndarray | None = None) -> np.ndarray:
    return oracle.attention_mass(q, k, np.arange(k.shape[0]), window=case.window, n_sink=case.n_sink,
                                 k_bits=KIVI_BITS[case.k_type], scale=1.0 / np.sqrt(case.head_dim), n_swa=n_swa,
                                 scoring=scoring)


def case_id(c: Case) -> str:
    return f"d{c.head_dim}-h{c.n_head}/{c.n_head_kv}-w{c.window}-s{c.n_sink}-k{KIVI_BITS[c.k_type]}"


@pytest.mark.parametrize("wide", [False, True], ids=["fused", "flash"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_attention_mass_matches_the_full_matrix(case: Case, wide: bool, kvq_backend: g.Backend | None) -> None:
    """Whichever path computes the attention, the mass is that of the contract, summed over ubatches."""
    q, k, v = random_qkv(case, sum(UBATCHES), seed=case.head_dim + case.n_head)
    got = feed_layer(case, q, k, v, UBATCHES, wide=wide, mass=True, backend=kvq_backend).mass
    want = reference_mass(case, q, k)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # each query hands out one unit per query head
    np.testing.assert_allclose(got.sum(), q.shape[0] * q.shape[1], rtol=1e-5)


@pytest.mark.parametrize("wide", [False, True], ids=["fused", "flash"])
@pytest.mark.parametrize("case", CASES[:3], ids=case_id)
def test_attention_mass_of_an_observation_window(case: Case, wide: bool, kvq_backend: g.Backend | None) -> None:
    """With n_observe, only each ubatch's last queries (all of a shorter one) give mass."""
    observe = 8
    q, k, v = random_qkv(case, sum(UBATCHES), seed=case.n_head)
    got = feed_layer(case, q, k, v, UBATCHES, wide=wide, mass=True, observe=observe, backend=kvq_backend).mass
    ends = np.cumsum(UBATCHES)
    scoring = np.zeros(ends[-1], dtype=bool)
    for end, n in zip(ends, UBATCHES, strict=True):
        scoring[end - min(n, observe):end] = True
    np.testing.assert_allclose(got, reference_mass(case, q, k, scoring=scoring), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got.sum(), scoring.sum() * q.shape[1], rtol=1e-5)


def test_attention_mass_follows_a_sliding_window(kvq_backend: g.Backend | None) -> None:
    case = Case(head_dim=64, n_head=8, n_head_kv=2, window=16, n_sink=4)
    q, k, v = random_qkv(case, 150, seed=3)
    got = feed_layer(case, q, k, v, UBATCHES, n_swa=40, mass=True, backend=kvq_backend).mass
    np.testing.assert_allclose(got, reference_mass(case, q, k, n_swa=40), rtol=1e-4, atol=1e-5)


def test_attention_mass_does_not_depend_on_batching() -> None:
    """Same sums up to the order of additions: ubatches only regroup the queries."""
    case = CASES[0]
    q, k, v = random_qkv(case, 100, seed=11)
    whole = feed_layer(case, q, k, v, [100], mass=True).mass
    for ubatches in ([1] * 100, [31, 33, 2, 34]):
        np.testing.assert_allclose(feed_layer(case, q, k, v, ubatches, mass=True).mass, whole, rtol=1e-5, atol=1e-6)


def test_attention_mass_tells_heavy_hitters_apart() -> None:
    """The oracle comparison is not vacuous: keys along a direction every query shares draw the most mass per
    query that sees them (early cells gather mass from more queries)."""
    case = CASES[0]
    q, k, v = random_qkv(case, 150, seed=7)
    shared = np.random.default_rng(8).standard_normal(case.head_dim).astype(np.float32)
    q += shared
    heavy = np.array([45, 80, 110])
    k[heavy] = 2 * shared
    mass = feed_layer(case, q, k, v, UBATCHES, mass=True).mass
    order = np.argsort(-mass / (150 - np.arange(150))[:, None], axis=0)
    for hk in range(case.n_head_kv):
        assert set(order[:3, hk]) == set(heavy)
