"""Pinned staging buffers and streams."""

from __future__ import annotations

import numpy as np
import pytest

from dask_gpuchunk.staging import _size_class


@pytest.mark.parametrize("n", [1, 1000, 65536, 65537, 10**6, 200_000_000, 2**31 + 5])
def test_size_classes_waste_at_most_an_eighth(n):
    size = _size_class(n)
    assert size >= n
    assert size <= max(65536, n * 1.125)


def test_similar_sizes_share_a_class():
    assert _size_class(200_000_000) == _size_class(199_000_000)


@pytest.mark.gpu
def test_pool_reuses_buffers_and_they_are_pinned():
    from dask_gpuchunk.staging import PinnedPool, is_pinned

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
def test_empty_pinned_and_is_pinned():
    from dask_gpuchunk.staging import empty_pinned, is_pinned

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

    from dask_gpuchunk.staging import PinnedPool

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
    from dask_gpuchunk.staging import PinnedPool

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
