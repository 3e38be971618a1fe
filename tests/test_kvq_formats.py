"""The kivi block formats in the built ggml agree bit for bit with the numpy oracle (tests/kvq_oracle.py),
on random and on hostile input."""

from __future__ import annotations

import kvq_oracle as oracle  # tests/ is on sys.path through conftest
import numpy as np
import pytest

from pykvq.bindings import native
from pykvq.bindings.ggml_types import GGML_TYPE_KIVI1, GGML_TYPE_KIVI2, GGML_TYPE_KIVI4, GGML_TYPE_Q4_1, KIVI_BITS

KIVI_TYPES = [GGML_TYPE_KIVI2, GGML_TYPE_KIVI4, GGML_TYPE_KIVI1]
F32_DENORMAL = np.float32(1e-40)


def adversarial_blocks() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    base = rng.standard_normal(32).astype(np.float32)
    blocks = {
        "constant": np.full(32, 0.3, dtype=np.float32),
        "zeros": np.zeros(32, dtype=np.float32),
        "negative zero": np.full(32, -0.0, dtype=np.float32),
        "huge": (base * 1e30).astype(np.float32),
        "beyond fp16": (base * 1e5).astype(np.float32),
        "fp16 subnormal spread": (base * 1e-6).astype(np.float32),
        "f32 denormals": np.full(32, F32_DENORMAL, dtype=np.float32) * np.sign(base),
        "large offset tiny spread": (1000 + base * 1e-5).astype(np.float32),
        "one outlier": np.where(np.arange(32) == 5, 300.0, base).astype(np.float32),
        "nan": np.where(np.arange(32) % 7 == 0, np.nan, base).astype(np.float32),
        "inf": np.where(np.arange(32) == 3, np.inf, np.where(np.arange(32) == 9, -np.inf, base)).astype(np.float32),
        "all nan": np.full(32, np.nan, dtype=np.float32),
        "all +inf": np.full(32, np.inf, dtype=np.float32),
    }
    return blocks


@pytest.mark.parametrize("type_id", KIVI_TYPES)
def test_type_registration(type_id: int) -> None:
    t = native.ggml_type(type_id)
    bits = KIVI_BITS[type_id]
    assert t.name == f"kivi{bits}" and t.block_size == 32
    assert t.type_size == 4 + 32 * bits // 8
    assert t.bits_per_element == bits + 1.0  # fp16 d + fp16 m over 32 values = 1 bit each


@pytest.mark.parametrize("type_id", KIVI_TYPES)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 40.0])
def test_random_rows_match_oracle(type_id: int, scale: float) -> None:
    bits = KIVI_BITS[type_id]
    rng = np.random.default_rng(bits * 100 + int(scale))
    rows = (rng.standard_normal((6, 256)) * scale + rng.standard_normal((6, 1))).astype(np.float32)
    data = native.quantize_rows(type_id, rows)
    np.testing.assert_array_equal(data, oracle.quantize_rows(rows, bits))
    restored = native.dequantize_rows(type_id, data, 256)
    np.testing.assert_array_equal(restored.view(np.uint32), oracle.dequantize_rows(data, bits, 256).view(np.uint32))
    # asymmetric rounding: error at most half a step, plus fp16 rounding of m
    step = (rows.reshape(6, -1, 32).max(-1) - rows.reshape(6, -1, 32).min(-1)) / ((1 << bits) - 1)
    err = np.abs(restored - rows).reshape(6, -1, 32).max(-1)
    assert np.all(err <= step * 0.5 * 1.01 + np.abs(rows).max() * 2e-3)


@pytest.mark.parametrize("type_id", KIVI_TYPES)
@pytest.mark.parametrize("name", list(adversarial_blocks()))
def test_adversarial_blocks_match_oracle_and_stay_finite(type_id: int, name: str) -> None:
    bits = KIVI_BITS[type_id]
    block = adversarial_blocks()[name][None, :]
    data = native.quantize_rows(type_id, block)
    np.testing.assert_array_equal(data, oracle.quantize_rows(block, bits))
    restored = native.dequantize_rows(type_id, data, 32)
    assert np.all(np.isfinite(restored))
    assert native.validate_row_data(type_id, data)


def test_defined_outcomes_for_non_finite_input() -> None:
    blocks = adversarial_blocks()
    nan_block = blocks["nan"][None, :]
    restored = native.dequantize_rows(GGML_TYPE_KIVI4, native.quantize_rows(GGML_TYPE_KIVI4, nan_block), 32)[0]
    finite = ~np.isnan(nan_block[0])
    assert np.all(restored[~finite] == restored.min())  # NaN -> code 0 -> the block minimum
    inf_block = blocks["inf"][None, :]
    restored = native.dequantize_rows(GGML_TYPE_KIVI2, native.quantize_rows(GGML_TYPE_KIVI2, inf_block), 32)[0]
    assert restored[3] == restored.max() and restored[9] == restored.min()  # saturated to the fp16 range
    assert restored[3] == pytest.approx(65504, rel=1e-3) and restored[9] == pytest.approx(-65504, rel=1e-3)
    all_nan = native.quantize_rows(GGML_TYPE_KIVI1, blocks["all nan"][None, :])
    assert np.all(native.dequantize_rows(GGML_TYPE_KIVI1, all_nan, 32) == 0)


def test_kivi4_shares_q4_1_byte_layout() -> None:
    rows = np.random.default_rng(3).standard_normal((4, 128)).astype(np.float32)
    data = native.quantize_rows(GGML_TYPE_KIVI4, rows)
    np.testing.assert_array_equal(native.dequantize_rows(GGML_TYPE_Q4_1, data, 128),
                                  native.dequantize_rows(GGML_TYPE_KIVI4, data, 128))


@pytest.mark.parametrize("type_id", KIVI_TYPES)
def test_validate_rejects_non_finite_scale(type_id: int) -> None:
    data = native.quantize_rows(type_id, np.ones((1, 64), dtype=np.float32)).copy()
    data[0, 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), dtype=np.uint8)
    assert not native.validate_row_data(type_id, data)
