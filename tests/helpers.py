"""Shared test helpers (importable as ``helpers`` from any test module)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["DTYPES", "assert_assembles_for_sm90a", "assert_same", "bit_products", "random_array",
           "random_bits"]

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float32", "float64", "complex64", "complex128"]


def assert_same(actual: np.ndarray, expected: np.ndarray, exact: bool = True) -> None:
    """Same shape, dtype and values (NaN equal to NaN).

    Integers and booleans always compare exactly; floats exactly unless ``exact=False``.
    Complex products compare to a few ulps: NumPy's SIMD loops and numba's code may contract
    ``ar*br - ai*bi`` into a fused multiply-add differently.
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    if actual.dtype.kind in "biu" or (exact and actual.dtype.kind == "f"):
        np.testing.assert_array_equal(actual, expected)
    else:
        single = actual.dtype in (np.float32, np.complex64)
        rtol = (1e-6 if single else 1e-14) if exact else (1e-5 if single else 1e-12)
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=0, equal_nan=True)


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: object) -> np.ndarray:
    """Random data of any supported dtype, mostly non-zero (never all zeros)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.6
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        lo, hi = max(int(info.min), -1000), min(int(info.max), 1000)
        return rng.integers(lo, hi, size=shape, endpoint=True).astype(dtype)
    if dtype.kind == "f":
        return (rng.standard_normal(shape) * 10).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) * 10 + 1j * rng.standard_normal(shape) * 10).astype(dtype)
    raise TypeError(dtype)


def random_bits(rng: np.random.Generator, shape: tuple[int, ...], density: float = 0.5,
                dtype: object = np.uint8) -> np.ndarray:
    """Random 0/1 data with about ``density`` ones; at least one 1 where there is room."""
    bits = rng.random(shape) < density
    if bits.size and not bits.any():
        bits.flat[rng.integers(bits.size)] = True
    return bits.astype(dtype)


def bit_products(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``x @ y.T`` of 0/1 (or small integer) data, exact, as int64: a float64 matmul (BLAS;
    NumPy's int64 matmul has none: 2,400 x 4,096 bits took 25 s), every count a whole number
    below 2**53."""
    return (np.asarray(x, np.float64) @ np.asarray(y, np.float64).T).astype(np.int64)


def assert_assembles_for_sm90a(tmp_path: Any, name: str, source: str,
                               spills_at_most: int = 0) -> None:
    """``source`` through ``nvcc`` / ``ptxas`` for ``sm_90a``: valid, at most
    ``spills_at_most`` bytes spilled, and the asynchronous ``wgmma`` instructions kept
    asynchronous (ptxas says "Potential Performance Loss: wgmma.mma_async instructions are
    serialized" where it cannot), no warning."""
    import re

    import subprocess

    path = tmp_path / f"{name}.cu"
    path.write_text(source)
    done = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", "-cubin", "-Xptxas", "-v",
                           "-o", str(tmp_path / f"{name}.cubin"), str(path)],
                          capture_output=True, text=True, timeout=180)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    spilled = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spilled and max(spilled) <= spills_at_most, report
    assert "serialized" not in report and "warning" not in report.lower(), report
