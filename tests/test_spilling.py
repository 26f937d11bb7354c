"""Spilling that holds the device budget (dask_gpuchunk.spilling): stored results moved to the
host when an allocation fails, spilled CuPy arrays brought back through CuPy's pool."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import zict

import dask_gpuchunk as dg
from dask_gpuchunk import budget, spilling

MiB = 2**20


def _buffer(n: float) -> zict.Buffer:
    """A device buffer as dask-cuda builds one (weights: the values' byte sizes)."""
    return zict.Buffer({}, {}, n, weight=lambda k, v: v.nbytes)


def test_evict_one_moves_the_least_recently_used_result_and_counts_it(monkeypatch):
    monkeypatch.setattr(budget, "spilled_on_failure", {"bytes": 0, "results": 0})
    buffer = _buffer(1e9)
    buffer["a"], buffer["b"] = np.ones(10), np.ones(20)
    buffer["a"]  # noqa: B018 - touched: "b" is now the least recently used
    assert spilling._evict_one(buffer.fast)
    assert set(buffer.fast) == {"a"} and set(buffer.slow) == {"b"}
    assert spilling._evict_one(buffer.fast)
    assert not spilling._evict_one(buffer.fast)  # nothing left on the "device"
    assert budget.spilled_on_failure == {"bytes": 240, "results": 2}
    np.testing.assert_array_equal(buffer["b"], np.ones(20))


def test_hold_budget_needs_a_dask_cuda_device_buffer():
    assert not spilling.hold_budget(SimpleNamespace(data={}))
    assert not spilling.hold_budget(SimpleNamespace(data=SimpleNamespace(device_buffer={})))


@pytest.mark.gpu
def test_unspilled_cupy_arrays_come_back_through_the_pool():
    import cupy
    from distributed.protocol.serialize import deserialize, serialize

    x = cupy.arange(3 * 5 * 7, dtype=cupy.float32).reshape(3, 5, 7)[:, ::2]
    for original in (x, cupy.asfortranarray(x), cupy.arange(10, dtype=cupy.int16)):
        header, frames = serialize(original, serializers=("dask",), on_error="raise")
        back = spilling.unspill_through_pool(header["sub-header"], frames)
        assert isinstance(back.data.mem, cupy.cuda.memory.PooledMemory)  # not numba's
        assert back.dtype == original.dtype and back.shape == original.shape
        np.testing.assert_array_equal(cupy.asnumpy(back), cupy.asnumpy(original))
        assert isinstance(deserialize(header, frames), cupy.ndarray)


@pytest.mark.gpu
def test_stored_results_yield_to_an_allocation_that_would_fail(device_cap):
    import cupy

    cap = 512 * MiB
    device_cap(cap)
    chunk = 64 * MiB // 8
    # Stored results may fill 90 % of the card: a 192 MiB allocation beside them only fits
    # once some of them have moved to the host.
    with dg.local_cluster(dashboard_address=None, device_memory_limit=0.9) as client:
        x = dg.asarray(np.arange(7 * chunk, dtype=np.float64), chunks=chunk)
        x = x.map_blocks(cupy.asarray, dtype=x.dtype,
                         meta=cupy.empty((0,), np.float64)).persist()
        wide = x.blocks[0].map_blocks(lambda b: cupy.tile(b, 3), chunks=(3 * chunk,),
                                      dtype=x.dtype, meta=x._meta)
        got = cupy.asnumpy(wide.compute())
        reports = list(client.run(budget.budget_report).values())
    np.testing.assert_array_equal(got, np.tile(np.arange(chunk, dtype=np.float64), 3))
    assert reports[0]["spilled_on_failure_bytes"] > 0
    assert reports[0]["peak_pool"] <= cap




@pytest.mark.gpu
def test_workers_of_a_local_cluster_hold_the_budget(device_cap):
    device_cap(512 * MiB)
    with dg.local_cluster(dashboard_address=None) as client:
        held = client.run(lambda: budget.stored_results_yield)
    assert set(held.values()) == {True}
