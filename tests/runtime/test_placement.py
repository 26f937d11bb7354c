"""device="auto": the measured rule and its records."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import assert_same

import dask_gpuchunk as dg
from dask_gpuchunk.runtime import placement


def test_host_copy_bandwidth_is_measured_once():
    bw = placement.host_copy_bandwidth()
    assert bw > 1e8  # over 100 MB/s on any machine
    assert placement.host_copy_bandwidth() == bw


def test_forget_and_decisions_are_lists():
    placement.forget()
    assert placement.decisions() == []


@dg.elementwise
def heavy(y, k):
    # Many transcendental operations per element: the GPU's case.
    for _ in range(8):
        y = y + 0.01 * (-k * y + math.sin(y) * math.cos(k * y))
    return y


@pytest.mark.gpu
def test_auto_measures_once_then_follows_the_rule(rng):
    import dask.array as da

    placement.forget()
    a = rng.random((4000, 500))
    x = da.from_array(a, chunks=(1000, 500))
    out = heavy(x, 0.5, device="auto").compute()
    reference = heavy(x, 0.5, device="cpu").compute()
    np.testing.assert_allclose(out, reference, rtol=1e-12)
    records = placement.decisions()
    assert len(records) == 1  # four chunks, one measurement
    (r,) = records
    assert r["function"] == "heavy" and r["chunk_shape"] == (1000, 500)
    assert r["t_gpu_estimate"] == max(r["t_h2d"], r["t_d2h"], r["gpu_kernel"], r["t_stage"],
                                      r["t_host_memory"])
    assert r["choice"] == ("gpu" if r["t_gpu_estimate"] < r["t_cpu"] else "cpu")
    assert r["choice"] == "gpu"  # 8 sin + 8 cos per element: far faster on the GPU


@pytest.mark.gpu
def test_auto_decision_is_per_dtype_signature(rng):
    placement.forget()
    a = rng.random((2000, 100))
    dg.multiply(a, a, device="auto")  # NumPy in: one chunk, computed at once
    dg.multiply(a.astype(np.float32), a.astype(np.float32), device="auto")
    assert len(placement.decisions()) == 2
    assert_same(dg.multiply(a, a, device="auto"), a * a)
