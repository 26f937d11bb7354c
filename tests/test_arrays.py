"""dg.asarray: Dask arrays over in-memory arrays, without copies."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq

import dask_gpuchunk as dg
from dask_gpuchunk import config


@pytest.mark.parametrize("listed", [True, False], ids=["listed", "from_array"])
def test_chunks_are_views_of_the_source(rng, listed):
    # Listed views (the default) or dask's from_array over a reader: never a copy.
    a = rng.random((10, 7))
    with config.internal_values({"listed-graphs": listed}):
        x = dg.asarray(a, chunks=(4, 3))
    assert x.chunks == ((4, 4, 2), (3, 3, 1))
    shared = x.map_blocks(lambda b: np.full(b.shape, np.shares_memory(b, a)), dtype=bool)
    assert shared.all().compute()
    assert_eq(x, a)


def test_zero_d_list_and_dask_inputs():
    assert dg.asarray(np.array(3.5), chunks=()).compute() == 3.5
    np.testing.assert_array_equal(dg.asarray([1, 2, 3], chunks=2).compute(), [1, 2, 3])
    x = da.ones(4, chunks=2)
    assert dg.asarray(x) is x


def test_names_follow_the_array(rng, monkeypatch):
    from dask_gpuchunk import arrays

    a = rng.random(4)
    assert dg.asarray(a).name == dg.asarray(a).name          # the same array: the same name
    assert dg.asarray(a.copy()).name == dg.asarray(a).name   # small arrays: by their data
    assert dg.asarray(a + 1).name != dg.asarray(a).name
    assert dg.asarray(a, chunks=2).name != dg.asarray(a).name
    if da.array_expr_enabled():  # dask names the array: the same name, the same keys
        assert dg.asarray(a, name="mine").name == dg.asarray(a.copy(), name="mine").name
        assert dg.asarray(a, name="mine").name != dg.asarray(a, name="yours").name
    else:
        assert dg.asarray(a, name="mine").name == "mine"
    # Large arrays are named by the object (hashing gigabytes would read them all): the same
    # object keeps its name; another object, even with equal data, gets another.
    monkeypatch.setattr(arrays, "CONTENT_TOKEN_BYTES", 0)
    b = rng.random(4)
    assert dg.asarray(b).name == dg.asarray(b).name
    assert dg.asarray(b.copy()).name != dg.asarray(b).name


def test_elementwise_names_are_deterministic(rng):
    x, b = dg.asarray(rng.random((6, 3)), chunks=2), rng.random(3)
    assert dg.multiply(x, b).name == dg.multiply(x, b).name
    assert dg.multiply(x, b).name != dg.multiply(x, b + 1).name
    assert dg.multiply(x, 2).name != dg.multiply(x, 2.0).name  # a Python int, a Python float


class CountingDataset:
    """An array not in memory (as an h5py or Zarr dataset): counts the elements it reads."""

    def __init__(self, data: np.ndarray) -> None:
        self._data = data
        self.shape, self.dtype, self.ndim = data.shape, data.dtype, data.ndim
        self.read = 0

    def __getitem__(self, key):
        out = np.asarray(self._data[key])
        self.read += out.size
        return out


def test_array_likes_are_read_chunk_by_chunk_at_compute_time(rng):
    data = rng.random((40, 6))
    ds = CountingDataset(data)
    x = dg.asarray(ds, chunks=(10, 6))
    r = dg.multiply(ds, 2.0)
    assert ds.read == 0  # building graphs read nothing
    np.testing.assert_array_equal(x[10:20].compute(), data[10:20])
    assert ds.read == 60  # one chunk
    np.testing.assert_array_equal(r.compute(), data * 2.0)


def test_zarr_datasets_are_read_through_dask(rng, tmp_path):
    data = rng.random((30, 4))
    zarr = pytest.importorskip("zarr")
    z = zarr.open(str(tmp_path / "a.zarr"), mode="w", shape=data.shape, chunks=(10, 4),
                  dtype=data.dtype)
    z[...] = data
    r = dg.multiply(z, 3.0)
    np.testing.assert_array_equal(r.compute(), data * 3.0)


@pytest.mark.parametrize("kind", ["numpy", "dask"])
def test_masked_arrays_are_refused(kind):
    if kind == "numpy":
        masked = np.ma.masked_array([1.0, 2.0, 3.0], mask=[0, 1, 0])
    elif da.array_expr_enabled():
        pytest.skip("dask's array query planning has no masked arrays (dask.array.ma)")
    else:
        masked = da.ma.masked_equal(da.from_array(np.array([1.0, 2.0, 3.0]), chunks=2), 2.0)
    with pytest.raises(TypeError, match="masked array: its mask would be lost"):
        dg.multiply(masked, 2.0)
    with pytest.raises(TypeError, match="masked array"):
        dg.asarray(masked)


def test_chunks_are_of_their_source_s_kind(xp, rng):
    a = xp.asarray(rng.random((6, 4)))
    x = dg.asarray(a, chunks=3)
    assert type(x._meta) is type(a)
    assert_eq(x, a)  # the computed chunks' kind too
