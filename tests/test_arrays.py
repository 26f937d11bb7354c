"""dg.asarray: Dask arrays over in-memory arrays, without copies."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest

import dask_gpuchunk as dg


def test_chunks_are_views_of_the_source(rng):
    a = rng.random((10, 7))
    x = dg.asarray(a, chunks=(4, 3))
    assert x.chunks == ((4, 4, 2), (3, 3, 1))
    shared = x.map_blocks(lambda b: np.full(b.shape, np.shares_memory(b, a)), dtype=bool)
    assert shared.all().compute()
    np.testing.assert_array_equal(x.compute(), a)


def test_zero_d_list_and_dask_inputs():
    assert dg.asarray(np.array(3.5), chunks=()).compute() == 3.5
    np.testing.assert_array_equal(dg.asarray([1, 2, 3], chunks=2).compute(), [1, 2, 3])
    x = da.ones(4, chunks=2)
    assert dg.asarray(x) is x


def test_names_are_unique_unless_given(rng):
    a = rng.random(4)
    assert dg.asarray(a).name != dg.asarray(a).name
    assert dg.asarray(a, name="mine").name == "mine"


@pytest.mark.gpu
def test_cupy_source_gives_cupy_chunks(rng):
    import cupy

    a = cupy.asarray(rng.random((6, 4)))
    x = dg.asarray(a, chunks=3)
    assert isinstance(x._meta, cupy.ndarray)
    assert isinstance(x.blocks[1].compute(), cupy.ndarray)
