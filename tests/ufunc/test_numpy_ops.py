"""The helpers of translated functions compute what NumPy's C loops compute, on each target.

"cpu" compiles them with numba; "sim" is plain Python on NumPy scalars (numba's CUDA
simulator). The CUDA target is checked on a real GPU by the conformance matrix
(test_numpy_rules.py).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from dask_gpuchunk.ufunc.numpy_ops import CAST_DTYPES, cast_name, namespace

TARGETS = ["sim", "cpu"]


def _pairs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = np.repeat(values, len(values))
    b = np.tile(values, len(values))
    return a, b


def _apply(func, *columns):
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return [func(*row) for row in zip(*columns)]


def _wrapped(values: list, dtype: np.dtype) -> np.ndarray:
    """64-bit results (as the helpers return them) wrapped to ``dtype``, as the translated
    code's conversion does (numba's casts cannot be called from Python)."""
    return np.array([int(v) % 2**64 for v in values], dtype=np.uint64).astype(dtype)


FLOATS = [0.0, -0.0, 1.0, -1.0, 2.5, -7.25, 1e-310, 3e38, np.inf, -np.inf, np.nan, 0.1, 7.0]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name, ufunc", [("floor_divide", np.floor_divide),
                                         ("remainder", np.remainder),
                                         ("maximum", np.maximum), ("minimum", np.minimum),
                                         ("fmax", np.fmax), ("fmin", np.fmin)])
def test_float_helpers_match_numpy(target, dtype, name, ufunc):
    a, b = _pairs(np.array(FLOATS, dtype))
    helper = namespace(target)[f"_nr_{name}_{'f4' if dtype == 'float32' else 'f8'}"]
    ours = np.array(_apply(helper, a, b), dtype=dtype)
    with np.errstate(all="ignore"):
        expected = ufunc(a, b)
    np.testing.assert_array_equal(ours, expected)
    if name in ("floor_divide", "remainder"):
        # Signed zeros too. (Of +0 and -0, NumPy's maximum and minimum give whichever its SIMD
        # instructions give on this CPU, not the first as documented.)
        np.testing.assert_array_equal(np.signbit(ours), np.signbit(expected))


INTS = {
    "int8": [-128, -127, -7, -1, 0, 1, 3, 7, 100, 127],
    "int64": [-(2**63), -(2**63) + 1, -7, -1, 0, 1, 3, 2**62, 2**63 - 1],
    "uint8": [0, 1, 2, 7, 128, 255],
    "uint64": [0, 1, 7, 2**63, 2**64 - 1],
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", sorted(INTS))
@pytest.mark.parametrize("name, ufunc", [("floor_divide", np.floor_divide),
                                         ("remainder", np.remainder),
                                         ("left_shift", np.left_shift),
                                         ("right_shift", np.right_shift)])
def test_integer_helpers_match_numpy(target, dtype, name, ufunc):
    dt = np.dtype(dtype)
    a, b = _pairs(np.array(INTS[dtype], dt))
    if name.endswith("shift"):  # counts past the width, and negative ones
        values = np.array(INTS[dtype], dt)
        counts = np.array([0, 1, 3, 7, 8, 9, 63, 64, 79, *([-3] if dt.kind == "i" else [])], dt)
        a, b = np.repeat(values, len(counts)), np.tile(counts, len(values))
    sign = "signed" if dt.kind == "i" else "unsigned"
    helper = namespace(target)[f"_nr_{name}_{sign}"]
    args = (a, b, [8 * dt.itemsize] * len(a)) if name.endswith("shift") else (a, b)
    ours = _wrapped(_apply(helper, *args), dt)
    with np.errstate(all="ignore"):
        expected = ufunc(a, b)
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["int8", "int64", "uint8", "uint64"])
def test_integer_power_wraps_like_numpy(target, dtype):
    dt = np.dtype(dtype)
    a, b = _pairs(np.array(INTS[dtype], dt))
    b = np.abs(b.astype(np.int64) % 70).astype(dt)  # NumPy refuses negative exponents
    power = namespace(target)["_nr_power_integer"]
    ours = _wrapped(_apply(lambda x, y: power(np.uint64(x % 2**64), np.uint64(y)), a.tolist(),
                           b.tolist()), dt)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(ours, np.power(a, b))


@pytest.mark.parametrize("target", TARGETS)
def test_exact_signed_unsigned_comparison(target):
    a = np.array([-(2**63), -1, 0, 1, 2**62 + 1, 2**63 - 1], np.int64)
    b = np.array([0, 1, 2**62, 2**62 + 1, 2**63, 2**64 - 1], np.uint64)
    a, b = np.repeat(a, len(b)), np.tile(b, len(a))
    cmp = namespace(target)["_nr_compare_signed_unsigned"]
    ours = np.array(_apply(cmp, a, b))
    np.testing.assert_array_equal(ours < 0, np.less(a, b))
    np.testing.assert_array_equal(ours == 0, np.equal(a, b))
    np.testing.assert_array_equal(ours > 0, np.greater(a, b))


COMPLEX = [0, 1, -2.5 + 1j, 1e-300 + 3j, 3e300 - 2e300j, np.inf + 1j, complex(np.nan, 1),
           complex(1, np.nan), -0.0 - 0.0j, 0.5 + 0.25j]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_complex_helpers_match_numpy_scalars(target, dtype):
    dt = np.dtype(dtype)
    a, b = _pairs(np.array(COMPLEX, dt))
    ops = namespace(target)
    s = "c8" if dtype == "complex64" else "c16"
    for name, op in [("multiply", lambda x, y: x * y), ("divide", lambda x, y: x / y)]:
        ours = np.array(_apply(ops[f"_nr_{name}_{s}"], a, b), dtype=dt)
        expected = np.array(_apply(op, a, b), dtype=dt)  # NumPy scalars: no fused multiply-add
        np.testing.assert_array_equal(ours, expected, err_msg=name)
    for name, op in [("less", np.less), ("less_equal", np.less_equal)]:
        ours = np.array(_apply(ops[f"_nr_{name}_{s}"], a, b))
        with np.errstate(all="ignore"):
            np.testing.assert_array_equal(ours, op(a, b), err_msg=name)


@pytest.mark.parametrize("target", TARGETS)
def test_python_complex_division_matches_python(target):
    values = [complex(v) for v in COMPLEX if np.isfinite(v) and v != 0]
    a, b = _pairs(np.array(values))
    ours = _apply(namespace(target)["_nr_divide_python_c16"], a, b)
    assert ours == [complex(x) / complex(y) for x, y in zip(a, b)]


@pytest.mark.parametrize("target", TARGETS)
def test_casts_convert_as_astype(target):
    ops = namespace(target)
    source = np.array([-3, 0, 5, 200, -100], np.int64)
    for suffix, dt in CAST_DTYPES.items():
        if dt.kind == "b":
            continue
        ours = np.array(_apply(ops[f"_nr_{suffix}"], source), dtype=dt)
        np.testing.assert_array_equal(ours, source.astype(dt), err_msg=suffix)


def test_cast_name():
    assert cast_name(np.dtype("bool")) == "_nr_b1"
    with pytest.raises(ValueError, match="unknown target"):
        namespace("opencl")
