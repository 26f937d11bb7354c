"""Spilling that holds the device budget (dask_gpuchunk.distributed.spilling): stored results moved to the
host when an allocation fails, spilled CuPy arrays brought back through CuPy's pool."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import zict

import dask_gpuchunk as dg
from dask_gpuchunk.runtime import budget
from dask_gpuchunk.distributed import spilling

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



class _CappedPool:
    """CuPy's pool under a cap, as its source has it: freed blocks stay cached and count
    against the cap; an allocation over the cap fails before any of them is freed."""

    def __init__(self, cap: int, cached: int) -> None:
        self.cap, self.in_use, self.cached, self.frees = cap, 0, cached, 0

    def malloc(self, nbytes: int) -> int:
        if self.in_use + self.cached + nbytes > self.cap:
            raise MemoryError(f"over the cap: {self.in_use + self.cached} + {nbytes}")
        self.in_use += nbytes
        return nbytes

    def free_all_blocks(self) -> None:
        self.frees += 1
        self.cached = 0


def test_an_allocation_over_the_cap_frees_cached_blocks_before_any_result_moves(monkeypatch):
    monkeypatch.setattr(budget, "spilled_on_failure", {"bytes": 0, "results": 0})
    buffer = _buffer(1e9)
    buffer["a"] = np.ones(100)
    pool = _CappedPool(cap=1000, cached=700)  # 700 bytes cached for other threads' streams
    pool.in_use = 200
    assert spilling.allocate_or_yield(pool, 500, buffer.fast, MemoryError) == 500
    assert pool.frees == 1 and set(buffer.fast) == {"a"}  # nothing stored had to move
    assert budget.spilled_on_failure["results"] == 0

    class Stored(SimpleNamespace):  # each evicted result's bytes go back to the pool's cache
        def evict(self):
            if not self.results:
                raise KeyError("empty")
            nbytes = self.results.pop(0)
            pool.in_use -= nbytes
            pool.cached += nbytes
            return None, None, nbytes

    pool = _CappedPool(cap=1000, cached=100)
    pool.in_use = 900  # three stored results and a running chunk's 300
    stored = Stored(results=[200, 200, 200])
    assert spilling.allocate_or_yield(pool, 500, stored, MemoryError) == 500
    assert stored.results == [200] and budget.spilled_on_failure["results"] == 2
    assert pool.frees == 3  # once before any move, once after each
    pool = _CappedPool(cap=1000, cached=0)
    pool.in_use = 900
    with pytest.raises(MemoryError):
        spilling.allocate_or_yield(pool, 500, Stored(results=[]), MemoryError)

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
    # once some of them have moved to the host. One worker: on a machine of several GPUs the
    # chunks spread over them and none fills up.
    with dg.local_cluster(gpus=1, dashboard_address=None, device_memory_limit=0.9) as client:
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


def test_received_chunks_go_through_cupys_allocator_only_on_a_ucx_worker_with_a_gpu(
        monkeypatch):
    ucxx_module = SimpleNamespace(ucxx=object(), device_array=lambda n: ("rmm", n))
    monkeypatch.setitem(__import__("sys").modules, "distributed_ucxx.ucxx", ucxx_module)
    monkeypatch.setattr(spilling, "ucx_own_allocator", None)
    monkeypatch.setattr(spilling, "gpu_available", lambda: True)
    assert not spilling.receive_through_pool(SimpleNamespace(address="tls://127.0.0.1:1"))
    assert ucxx_module.device_array(3) == ("rmm", 3)  # other protocols: left as it was
    assert spilling.receive_through_pool(SimpleNamespace(address="ucx://127.0.0.1:1"))
    assert ucxx_module.device_array is spilling._receive_buffer
    assert spilling.ucx_own_allocator(5) == ("rmm", 5)  # kept, for measuring against
    assert spilling.receive_through_pool(SimpleNamespace(address="ucx://127.0.0.1:1"))
    assert spilling.ucx_own_allocator(5) == ("rmm", 5)  # a second setup keeps the first's
    monkeypatch.setattr(spilling, "gpu_available", lambda: False)
    ucxx_module.device_array = "untouched"
    assert not spilling.receive_through_pool(SimpleNamespace(address="ucx://127.0.0.1:1"))
    assert ucxx_module.device_array == "untouched"


@pytest.mark.gpu
def test_chunks_sent_over_ucx_arrive_in_cupys_pool_under_the_cap(device_cap):
    pytest.importorskip("distributed_ucxx")
    import cupy

    if dg.gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    device_cap(1024 * MiB)
    with dg.local_cluster(gpus=2, protocol="ucx", dashboard_address=None) as client:
        workers = sorted(client.scheduler_info()["workers"])
        x = client.submit(lambda: cupy.arange(16 * MiB // 4, dtype=cupy.int32),
                          workers=workers[:1], pure=False)

        def pooled(block):
            return (isinstance(block.data.mem, cupy.cuda.memory.PooledMemory),
                    int(block.sum(dtype=cupy.int64)))

        got = client.submit(pooled, x, workers=workers[1:], pure=False).result()
    n = 16 * MiB // 4
    assert got == (True, n * (n - 1) // 2)
