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
