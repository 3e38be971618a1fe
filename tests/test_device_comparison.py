"""device.assert_same_logits, the comparison the suite's cross-batch tests use: exact on the CPU, and on a GPU
tolerant of rounding but not of a wrong cache."""

from __future__ import annotations

import numpy as np
import pytest

import device

ROWS, VOCAB = 64, 4096


@pytest.fixture
def logits() -> np.ndarray:
    return np.random.default_rng(0).normal(0.0, 3.0, (ROWS, VOCAB)).astype(np.float32)


def test_on_the_cpu_any_difference_fails(logits: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "ON_GPU", False)
    device.assert_same_logits(logits.copy(), logits)
    with pytest.raises(AssertionError):
        device.assert_same_logits(np.nextafter(logits, np.inf), logits)


def test_on_a_gpu_rounding_and_a_flipped_code_pass(logits: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "ON_GPU", True)
    moved = logits + np.random.default_rng(1).normal(0.0, 1e-3, logits.shape).astype(np.float32)
    moved[3] += np.random.default_rng(2).normal(0.0, 0.3, VOCAB).astype(np.float32)
    device.assert_same_logits(moved, logits)


def test_on_a_gpu_another_sequence_s_logits_fail(logits: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "ON_GPU", True)
    with pytest.raises(AssertionError, match="top-1 agreement"):
        device.assert_same_logits(np.roll(logits, 1, axis=0), logits)


def flip_rows(logits: np.ndarray, rows: int) -> np.ndarray:
    """The first `rows` rows with their top token pushed below the runner-up: a small move that flips top-1."""
    moved = logits.copy()
    for row in moved[:rows]:
        first, second = np.argsort(row)[-2:][::-1]
        row[first], row[second] = row[second], row[first]
    return moved


def test_on_a_gpu_the_f16_twin_sets_how_many_rows_may_flip(logits: np.ndarray,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The quantization itself flips 10 of 64 rows' top tokens: the batching may flip up to twice as many."""
    monkeypatch.setattr(device, "ON_GPU", True)
    twin = flip_rows(logits, 10)
    device.assert_same_logits(flip_rows(logits, 19), logits, lambda: twin)
    with pytest.raises(AssertionError, match="top-1 agreement"):
        device.assert_same_logits(flip_rows(logits, 24), logits, lambda: twin)
