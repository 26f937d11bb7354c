"""``dg.from_zarr`` / ``dg.to_zarr`` and the jobs' Zarr inputs and outputs: round trips of every
dtype and uneven chunks, formats 2 and 3, compressions, never a half-written store."""

from __future__ import annotations

import os

import dask.array as da
import numpy as np
import pytest
from helpers import DTYPES, bit_products, random_array, random_bits

import dask_gpuchunk as dg
from dask_gpuchunk.jobs import gram_files, multiply_files
from dask_gpuchunk.io.partials import Writer, partials_in
from dask_gpuchunk.io.zarr_files import ZarrFormatError

zarr = pytest.importorskip("zarr")


def _listing(directory) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype_with_uneven_chunks(rng, tmp_path, dtype):
    values = random_array(rng, (37, 11), dtype)
    x = da.from_array(values, chunks=((10, 7, 20), (5, 6)))  # not a regular grid: rechunked
    dg.to_zarr(x, tmp_path / "x.zarr")
    stored = zarr.open_array(str(tmp_path / "x.zarr"), mode="r")
    assert stored.dtype == np.dtype(dtype) and stored.chunks == (20, 6)
    np.testing.assert_array_equal(stored[:], values)
    back = dg.from_zarr(tmp_path / "x.zarr", chunks=(9, -1))
    assert back.chunks == ((9, 9, 9, 9, 1), (11,))
    np.testing.assert_array_equal(back.compute(), values)


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("compression", ["none", "zstd", "gzip:1", "blosc"])
def test_formats_and_compressions(rng, tmp_path, zarr_format, compression):
    values = rng.integers(0, 5, (50, 20)).astype(np.int32)  # compressible
    dg.to_zarr(da.from_array(values, chunks=(16, 20)), tmp_path / "c.zarr",
               compression=compression, zarr_format=zarr_format)
    stored = zarr.open_array(str(tmp_path / "c.zarr"), mode="r")
    assert stored.metadata.zarr_format == zarr_format
    np.testing.assert_array_equal(dg.from_zarr(tmp_path / "c.zarr").compute(), values)
    chunk_files = [os.path.join(root, f) for root, _, files in os.walk(tmp_path / "c.zarr")
                   for f in files if not f.startswith((".z", "zarr.json"))]
    raw = sum(os.path.getsize(f) for f in chunk_files)
    assert (raw < values.nbytes) == (compression != "none"), (raw, values.nbytes)
    if compression == "none":  # a whole chunk, written straight from the block: its bytes
        key = stored.metadata.encode_chunk_key((1, 0))
        written = (tmp_path / "c.zarr" / key).read_bytes()
        assert written == values[16:32].astype("<i4").tobytes()


def test_existing_store_refused_unless_overwrite_and_only_a_store_replaced(rng, tmp_path):
    target = tmp_path / "c.zarr"
    dg.to_zarr(np.arange(4), target)
    with pytest.raises(FileExistsError, match="overwrite"):
        dg.to_zarr(np.ones(3), target)
    dg.to_zarr(np.ones(3), target, overwrite=True)
    np.testing.assert_array_equal(zarr.open_array(str(target), mode="r")[:], np.ones(3))
    assert _listing(tmp_path) == ["c.zarr"]
    plain = tmp_path / "mine.zarr"
    plain.mkdir()
    (plain / "notes.txt").write_text("not a store")
    with pytest.raises(FileExistsError, match="not a Zarr array store"):
        dg.to_zarr(np.ones(3), plain, overwrite=True)
    assert (plain / "notes.txt").read_text() == "not a store"
    with pytest.raises(ValueError, match="compression must be one of"):
        dg.to_zarr(np.ones(3), tmp_path / "d.zarr", compression="lz5")


def _fail_on_second(block, block_info=None):
    if block_info[0]["chunk-location"][0] == 1:
        raise RuntimeError("chunk 1 failed")
    return block


@pytest.mark.parametrize("existing", [False, True])
def test_a_failing_chunk_leaves_no_store(tmp_path, existing):
    target = tmp_path / "c.zarr"
    if existing:
        dg.to_zarr(np.arange(4), target)
    x = da.ones((40, 3), chunks=(10, 3)).map_blocks(_fail_on_second, dtype=float,
                                                   meta=np.empty((0, 0)))
    with pytest.raises(RuntimeError, match="chunk 1 failed"):
        dg.to_zarr(x, target, overwrite=True)
    assert _listing(tmp_path) == (["c.zarr"] if existing else [])
    if existing:
        np.testing.assert_array_equal(zarr.open_array(str(target), mode="r")[:], np.arange(4))


def test_a_stale_partial_store_is_removed_by_the_next_write(tmp_path):
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = Writer.this_process()
    stale = tmp_path / f".c.zarr.dgc-{me.host}-{dead.pid:08x}-{1:012x}-abcdef.partial"
    zarr.create_array(str(stale), shape=(3,), chunks=(3,), dtype="f8")[:] = 1.0
    (found,) = partials_in(tmp_path, tmp_path / "c.zarr")
    assert found.state() == "gone" and found.nbytes > 0
    dg.to_zarr(np.arange(3), tmp_path / "c.zarr")
    assert _listing(tmp_path) == ["c.zarr"]


def test_bad_stores_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such Zarr store"):
        dg.from_zarr(tmp_path / "missing.zarr")
    (tmp_path / "plain.zarr").mkdir()
    with pytest.raises(ZarrFormatError, match="not a Zarr store"):
        dg.from_zarr(tmp_path / "plain.zarr")
    zarr.create_group(str(tmp_path / "group.zarr"))
    with pytest.raises(ZarrFormatError, match="not a readable Zarr array"):
        dg.from_zarr(tmp_path / "group.zarr")
    zarr.create_array(str(tmp_path / "s.zarr"), shape=(2,), dtype=str)
    with pytest.raises(ZarrFormatError, match="numbers"):
        dg.from_zarr(tmp_path / "s.zarr")
    with pytest.raises(ValueError, match="do not tile|must be positive"):
        zarr.create_array(str(tmp_path / "a.zarr"), shape=(4,), chunks=(2,), dtype="f4")
        dg.from_zarr(tmp_path / "a.zarr", chunks=(-3,))


def test_the_jobs_take_and_write_zarr(rng, tmp_path):
    # gram bits.zarr -o G.zarr (each layout), multiply a.zarr b.npy -o c.zarr: exact.
    bits = random_bits(rng, (301, 1043), 0.4)
    zarr.create_array(str(tmp_path / "bits.zarr"), shape=bits.shape, chunks=(64, 300),
                      dtype=bits.dtype)[:] = bits
    expected = bit_products(bits, bits)
    for layout in ("rows", "upper", "blocks"):
        summary = gram_files(tmp_path / "bits.zarr", tmp_path / f"G-{layout}.zarr",
                             chunk_rows=70, layout=layout, device="cpu")
        stored = zarr.open_array(str(tmp_path / f"G-{layout}.zarr"), mode="r")
        assert summary["layout"] == layout and stored.chunks == (70, 70)
        np.testing.assert_array_equal(stored[:], expected)
    a = rng.random((500, 30))
    b = rng.random((1, 30)).astype(np.float32)
    zarr.create_array(str(tmp_path / "a.zarr"), shape=a.shape, chunks=(64, 30),
                      dtype=a.dtype, zarr_format=2)[:] = a
    np.save(tmp_path / "b.npy", b)
    multiply_files(tmp_path / "a.zarr", tmp_path / "b.npy", tmp_path / "c.zarr",
                   chunk_size="20kB", device="cpu", compression="zstd")
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "c.zarr"), mode="r")[:], a * b)
    with pytest.raises(ValueError, match="apply to Zarr outputs"):
        multiply_files(tmp_path / "a.zarr", tmp_path / "b.npy", tmp_path / "c.npy",
                       compression="zstd")


def test_the_gram_job_cuts_equal_slabs_for_a_store(rng, tmp_path, monkeypatch):
    # Zarr pads every edge chunk to the full chunk shape: slabs of 101, 101, 99 rows (not 128,
    # 128, 45) where 128 would be the slab's rows for a .npy.
    import dask_gpuchunk.jobs as jobs

    monkeypatch.setattr(jobs.gram, "CHUNK_ROWS", 128)
    bits = random_bits(rng, (301, 200), 0.5)
    np.save(tmp_path / "bits.npy", bits)
    to_npy = gram_files(tmp_path / "bits.npy", tmp_path / "G.npy", device="cpu")
    to_store = gram_files(tmp_path / "bits.npy", tmp_path / "G.zarr", device="cpu")
    assert (to_npy["chunk_rows"], to_store["chunk_rows"]) == (128, 101)
    stored = zarr.open_array(str(tmp_path / "G.zarr"), mode="r")
    assert stored.chunks == (101, 101)
    np.testing.assert_array_equal(stored[:], np.load(tmp_path / "G.npy"))
    np.testing.assert_array_equal(stored[:], bit_products(bits, bits))


def test_to_zarr_of_device_or_host_chunks(xp, rng, tmp_path):
    a = random_array(rng, (300, 40), "float32")
    x = dg.asarray(xp.asarray(a), chunks=(64, 40))
    dg.to_zarr(dg.multiply(x, 3.0), tmp_path / "c.zarr")
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "c.zarr"), mode="r")[:],
                                  a * np.float32(3.0))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["auto", "blocks"])
def test_the_gram_job_to_zarr_on_the_gpu(rng, tmp_path, layout):
    bits = random_bits(rng, (1501, 3000), 0.3)
    np.save(tmp_path / "packed.npy", np.packbits(bits, axis=1))
    summary = gram_files(tmp_path / "packed.npy", tmp_path / "G.zarr", packed=True,
                         chunk_rows=512, layout=layout, device="gpu")
    assert summary["layout"] == ("rows" if layout == "auto" else "blocks")
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "G.zarr"), mode="r")[:],
                                  bit_products(bits, bits))
