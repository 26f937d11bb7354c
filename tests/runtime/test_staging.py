"""Pinned staging buffers and streams."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from dask_gpuchunk.runtime.staging import _size_class
from dask_gpuchunk import config


@pytest.mark.parametrize("n", [1, 1000, 65536, 65537, 10**6, 200_000_000, 2**31 + 5])
def test_size_classes_waste_at_most_an_eighth(n):
    size = _size_class(n)
    assert size >= n
    assert size <= max(65536, n * 1.125)


def test_similar_sizes_share_a_class():
    assert _size_class(200_000_000) == _size_class(199_000_000)


@pytest.mark.gpu
def test_pool_reuses_buffers_and_they_are_pinned():
    from dask_gpuchunk.runtime.staging import PinnedPool, is_pinned

    pool = PinnedPool()
    with pool.borrow(np.float64, (1000, 10)) as buf:
        first = buf.ctypes.data
        assert is_pinned(buf) and buf.shape == (1000, 10) and buf.flags.c_contiguous
    with pool.borrow(np.float32, (2000, 10)) as buf:  # same byte size: same buffer
        assert buf.ctypes.data == first
    allocated = pool.allocated_bytes
    pool.clear()
    assert pool.allocated_bytes == 0 and allocated > 0


@pytest.mark.gpu
@pytest.mark.parametrize("allocation", ["host-alloc", "register"])
def test_pool_buffers_of_each_allocation_are_pinned_and_copy_exactly(allocation):
    import cupy
    import dask

    from dask_gpuchunk.runtime import staging

    with config.internal_values({"pinned-allocation": allocation}):
        owner, _ = staging._page_locked(1 << 16)
    made_by = staging.RegisteredMemory if allocation == "register" else cupy.cuda.PinnedMemory
    assert isinstance(owner, made_by)
    del owner
    rng = np.random.default_rng(7)
    expected = rng.integers(1, 2**31, size=(3001, 17), dtype=np.int64)
    pool = staging.PinnedPool()
    with config.internal_values({"pinned-allocation": allocation}):
        loaned = pool.lend(expected.shape, expected.dtype)
    assert staging.is_pinned(loaned) and staging.is_pinned(loaned[1500:])
    loaned[...] = expected
    stream = cupy.cuda.Stream(non_blocking=True)
    on_device = cupy.empty(expected.shape, expected.dtype)
    staging.copy_to_device(on_device, loaned, stream)
    stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(on_device), expected)
    del loaned
    pool.clear()
    assert pool.allocated_bytes == 0


@pytest.mark.gpu
def test_registered_memory_is_zeroed_and_unlocked_when_dropped():
    import ctypes

    import cupy

    from dask_gpuchunk.runtime.staging import RegisteredMemory

    mem = RegisteredMemory(3 << 20)
    address = mem.address
    view = np.frombuffer((ctypes.c_ubyte * mem.size).from_address(address), np.uint8)
    assert not view.any()  # anonymous memory: zeroed
    assert cupy.cuda.pinned_memory.is_memory_pinned(address + (2 << 20))
    del view, mem
    assert not cupy.cuda.pinned_memory.is_memory_pinned(address + (2 << 20))


@pytest.mark.gpu
def test_a_refused_registration_falls_back_to_cuda_host_alloc_once(monkeypatch):
    import cupy
    import dask

    from dask_gpuchunk.runtime import staging

    asked = []

    def refuse(*args):
        asked.append(args)
        raise cupy.cuda.runtime.CUDARuntimeError(801)  # cudaErrorNotSupported

    monkeypatch.setattr(cupy.cuda.runtime, "hostRegister", refuse)
    monkeypatch.setattr(staging, "_registration_refused", [])
    pool = staging.PinnedPool()
    with config.internal_values({"pinned-allocation": "register"}):
        with pytest.warns(RuntimeWarning, match="cudaHostAlloc instead"):
            first = pool.lend((5000,), np.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second warning, and no second try
            second = pool.lend((5000,), np.float64)
    assert len(asked) == 1
    assert staging.is_pinned(first) and staging.is_pinned(second)
    first[...] = np.arange(5000)
    np.testing.assert_array_equal(first, np.arange(5000))


@pytest.mark.gpu
def test_empty_pinned_and_is_pinned():
    from dask_gpuchunk.runtime.staging import empty_pinned, is_pinned

    a = empty_pinned((10, 3), np.int16)
    assert a.shape == (10, 3) and a.dtype == np.int16 and is_pinned(a)
    assert is_pinned(a[5:])  # a view inside a pinned allocation
    assert not is_pinned(np.ones(1000))


def _plain_bytes(size):
    import ctypes

    raw = ctypes.create_string_buffer(size)
    return raw, ctypes.addressof(raw)


def test_lent_buffers_come_back_when_their_arrays_are_gone():
    import gc

    from dask_gpuchunk.runtime.staging import PinnedPool

    pool = PinnedPool(_plain_bytes, limit=lambda: 1 << 30)
    a = pool.lend((300, 7), np.int32)
    a[...] = np.arange(2100).reshape(300, 7)
    view = a[10:]
    address = a.ctypes.data
    del a
    gc.collect()
    assert view[0, 0] == 70 and not pool._free  # a view keeps the buffer on loan
    del view
    gc.collect()
    b = pool.lend(2100, np.float32)  # the same size class: the same buffer again
    assert b.ctypes.data == address and b.shape == (2100,)
    assert pool.allocated_bytes == _size_class(2100 * 4)


def test_the_pool_frees_idle_buffers_at_its_limit_then_lends_pageable_memory():
    from dask_gpuchunk.runtime.staging import PinnedPool

    pool = PinnedPool(_plain_bytes, limit=lambda: 3 << 20)
    with pool.borrow(np.uint8, (1 << 20,)):
        pass
    held = pool.lend(2 << 20, np.uint8)  # 1 MiB idle + 2 MiB: at the limit
    assert pool.allocated_bytes == 3 << 20
    other = pool.lend(1536 << 10, np.uint8)  # the idle MiB is freed, still over: pageable
    assert pool.allocated_bytes == 2 << 20 and other.flags.owndata  # np.empty's own
    with pool.borrow(np.float64, (100,)) as buf:  # a small one fits beside the loan
        assert pool.allocated_bytes == (2 << 20) + _size_class(800)
    pool.clear()
    assert pool.allocated_bytes == 2 << 20  # the buffer on loan stays
    del held
    pool.clear()
    assert pool.allocated_bytes == 0
    assert buf.shape == (100,)
