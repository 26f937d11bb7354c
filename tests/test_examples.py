"""Each example runs, at a small size, and checks its own result."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import dask.array as da
import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_product_larger_than_gpu():
    seconds = load("product_larger_than_gpu").main(["--rows", "3000", "--cols", "50", "--chunk-mb", "0.3"])
    assert seconds > 0


def test_broadcast_product():
    times = load("broadcast_product").main(["--dates", "8", "--ids", "300", "--repeat", "1"])
    assert {"cpu", "auto"} <= set(times)


@pytest.mark.parametrize("fma", [[], ["--fma"]])
def test_seed002_rk4_loop_agrees_eager_and_on_dask(fma):
    result = load("seed002_rk4_loop").main(["--n", "1001", "--steps", "6", "--chunks", "3", *fma])
    assert result["delta_error"] < 1e-5 and result["f_error"] < 1e-5


@pytest.mark.gpu
def test_product_pinned_on_gpu():
    assert load("product_larger_than_gpu").main(["--rows", "5000", "--cols", "64", "--chunk-mb", "0.5",
                                         "--pinned", "--device", "gpu"]) > 0


def test_gram_of_bits_streams_exact_rows(tmp_path):
    out = tmp_path / "c.npy"
    result = load("gram_of_bits").main(["--rows", "700", "--cols", "1043", "--chunk-rows", "256",
                                         "--out", str(out), "--samples", "700"])
    assert result["gram_seconds"] > 0
    c = np.load(out)
    assert c.shape == (700, 700) and c.dtype == np.int32
    np.testing.assert_array_equal(c, c.T)


@pytest.mark.gpu
def test_gram_of_bits_on_gpu(tmp_path):
    result = load("gram_of_bits").main(["--rows", "5000", "--cols", "20000", "--chunk-rows",
                                         "2048", "--out", str(tmp_path / "c.npy")])
    assert result["bit_macs_per_s"] > 0


def test_own_numba_kernels_agree_with_numpy():
    result = load("own_numba_kernels").main(["--rows", "3000", "--cols", "50", "--chunk-rows",
                                              "700", "--bit-rows", "300", "--bit-cols", "1000",
                                              "--slab", "128", "--n", "1001"])
    assert result["product_error"] < 1e-12 and result["rk4_error"] < 1e-5


@pytest.mark.gpu
def test_own_numba_kernels_on_gpu():
    result = load("own_numba_kernels").main(["--rows", "400000", "--cols", "100",
                                              "--bit-rows", "3000", "--bit-cols", "20000"])
    assert result["product_error"] < 1e-12 and result["rk4_error"] < 1e-5


@pytest.mark.skipif(type(da.ones(1)).__module__.startswith("dask.array._array_expr"),
                    reason="threshold= needs dask's classic arrays")
def test_fingerprint_neighbours_checks_its_rows():
    result = load("fingerprint_neighbours").main(["--rows", "1500", "--chunk-rows", "400",
                                                  "--samples", "4"])
    assert result["pairs_found"] >= 2 * (1500 // 100) - 2  # the planted near-duplicates
