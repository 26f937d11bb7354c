"""dg.elementwise over CuPy chunks, which stay on the device: every dtype, mixed with NumPy
and scalars, device-resident loops with reductions on the device, pinned and pageable host
arrays, eager device calls and many streams at once."""

from __future__ import annotations

import math

import dask.array as da
import numpy as np
import pytest
from helpers import DTYPES, assert_same, random_array

import dask_gpuchunk as dg


@dg.elementwise
def damped(x, k):  # as tests/elementwise_ops/test_operations.py has it
    return math.exp(-k * x) * math.cos(x)


# ---- GPU: CuPy chunks stay on the device ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cupy_chunks_every_dtype(rng, dtype):
    import cupy

    a = random_array(rng, (33, 10), dtype)
    b = random_array(rng, (10,), dtype)
    x = da.from_array(cupy.asarray(a), chunks=(8, 6))
    r = dg.multiply(x, cupy.asarray(b))
    assert isinstance(r._meta, cupy.ndarray)
    computed = r.compute()
    assert isinstance(computed, cupy.ndarray)
    with np.errstate(all="ignore"):
        assert_same(cupy.asnumpy(computed), a * b)


@pytest.mark.gpu
def test_cupy_mixed_with_numpy_and_scalars(rng, graph_form):
    import cupy

    a = rng.random((12, 7))
    x = dg.asarray(cupy.asarray(a), chunks=5)
    r = damped(x, np.float64(0.5))
    assert isinstance(r.compute(), cupy.ndarray)
    np.testing.assert_allclose(cupy.asnumpy(r.compute()), np.exp(-0.5 * a) * np.cos(a), rtol=1e-14)
    r = dg.multiply(x, a[0])  # NumPy row broadcast against CuPy chunks: result on the device
    assert_same(cupy.asnumpy(r.compute()), a * a[0])


@pytest.mark.gpu
def test_cpu_device_refuses_cupy():
    import cupy

    with pytest.raises(ValueError, match="CuPy"):
        dg.multiply(cupy.ones(3), 2.0, device="cpu")


@pytest.mark.gpu
def test_device_resident_loop_with_on_device_reduction(rng, monkeypatch):
    # Seed 002's pattern: persisted CuPy chunks stepped in a loop, a device reduction each
    # step; no staging copy to the host happens inside the loop.
    import cupy

    from dask_gpuchunk.runtime import staging

    def no_host_copy(*args, **kwargs):
        raise AssertionError("host copy inside a device-resident loop")

    monkeypatch.setattr(staging, "copy_to_host", no_host_copy)
    f0 = rng.random((64, 64))
    f = dg.asarray(cupy.asarray(f0), chunks=16).persist()
    expected = f0.copy()
    for _ in range(3):
        total = f.sum()                       # a CuPy 0-d chunk, on the device
        f = damped(f, total / 4096.0).persist()
        expected = np.exp(-(expected.sum() / 4096.0) * expected) * np.cos(expected)
    np.testing.assert_allclose(cupy.asnumpy(f.compute()), expected, rtol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("pinned_inputs", [False, True])
@pytest.mark.parametrize("pinned_out", [False, True])
def test_gpu_from_host_pinned_and_pageable(rng, pinned_inputs, pinned_out):
    from dask_gpuchunk.runtime.staging import empty_pinned

    a = rng.random((300, 40))
    b = rng.random((300, 40))
    if pinned_inputs:
        pa, pb = empty_pinned(a.shape), empty_pinned(b.shape)
        pa[...], pb[...] = a, b
        a, b = pa, pb
    out = empty_pinned(a.shape) if pinned_out else np.empty(a.shape)
    out[...] = np.nan
    dg.multiply(dg.asarray(a, chunks=(70, 40)), dg.asarray(b, chunks=(70, 40)), device="gpu",
                out=out)
    assert_same(out, np.asarray(a) * np.asarray(b))


@pytest.mark.gpu
def test_eager_device_calls_are_prepared_once_per_kind_and_stay_exact(rng):
    import cupy

    @dg.elementwise
    def scale_and_compare(p, q):
        return p * q, p > q

    a = rng.standard_normal((300, 257)).astype(np.float32)
    b = rng.standard_normal(257).astype(np.float32)
    x, y = cupy.asarray(a), cupy.asarray(b)
    reduce = (("sum", "max"), "sum")  # sum and max of the product, sum of the comparison
    for _ in range(3):
        prod, above, total, most, count = scale_and_compare(x, y, reduce=reduce)
    assert len(scale_and_compare._eager_calls) == 1  # the same kind of call: one preparation
    assert_same(prod.get(), a * b) and assert_same(above.get(), a > b)
    assert total.shape == () and total.dtype == np.float32
    np.testing.assert_allclose(total.get(), (a * b).astype(np.float64).sum(), rtol=1e-5)
    assert most.get() == (a * b).max() and count.get() == (a > b).sum()
    assert count.dtype == np.int64
    scale_and_compare(x[:7], y, reduce=reduce)  # another shape: another kind
    scale_and_compare(x, 2.0, reduce=reduce)
    assert len(scale_and_compare._eager_calls) == 3
    with pytest.raises(OverflowError):  # a Python number's value is checked on every call
        scale_and_compare(cupy.asarray(a.astype(np.int8)), 300)
    with pytest.raises(OverflowError):
        scale_and_compare(cupy.asarray(a.astype(np.int8)), 300)


@pytest.mark.gpu
def test_device_reductions_on_many_streams_at_once_are_each_right(rng):
    # Each stream's passes take their tickets from that stream's counter: passes running at
    # once on other streams, in other threads, never mix them.
    import concurrent.futures

    import cupy

    values = [rng.standard_normal(3_000_001) for _ in range(4)]

    def run(v):
        with cupy.cuda.Stream(non_blocking=True) as stream:
            x = cupy.asarray(v)
            totals = [dg.multiply(x, float(k), reduce="sum")[1] for k in range(1, 9)]
            stream.synchronize()
            return [float(t.get()) for t in totals]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, values))
    for v, got in zip(values, results):
        np.testing.assert_allclose(got, [v.sum() * k for k in range(1, 9)], rtol=1e-9)
