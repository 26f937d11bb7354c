"""``to_npz``: .npz files written chunk by chunk from where the chunks are, never gathered."""

from __future__ import annotations

import os
import zipfile
import zlib

import dask.array as da
import numpy as np
import pytest
from helpers import DTYPES, random_array

import dask_gpuchunk as dg
from dask_gpuchunk.io.npz_writing import crc32_combine, npz_bytes, to_npz, write_npz


def files(folder):
    return sorted(p.name for p in folder.iterdir())


def test_crc32_combine_matches_zlib_on_random_pieces(rng):
    for _ in range(300):
        a = rng.bytes(int(rng.integers(0, 200)))
        b = rng.bytes(int(rng.integers(0, 5000)))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    big = bytes(rng.integers(0, 256, 3 << 20, dtype=np.uint8))  # lengths of many bits
    assert crc32_combine(zlib.crc32(b"x"), zlib.crc32(big), len(big)) == zlib.crc32(b"x" + big)
    assert crc32_combine(1234, 0, 0) == 1234


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_reads_back_as_written_in_uneven_chunks(rng, tmp_path, dtype):
    a = random_array(rng, (101, 7), dtype)
    x = da.from_array(a, chunks=((40, 1, 60), (3, 4)))  # column chunks: rows made whole
    path = tmp_path / "a.npz"
    assert to_npz(path, values=x, doubled=x + x) == path
    with np.load(path) as f:
        assert f.files == ["values", "doubled"]
        np.testing.assert_array_equal(f["values"], a)
        np.testing.assert_array_equal(f["doubled"], a + a)
        assert f["values"].dtype == a.dtype
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every member's CRC-32 right
    assert os.path.getsize(path) == npz_bytes({"values": a, "doubled": a})


def test_shapes_byte_orders_and_in_memory_arrays(rng, tmp_path):
    ids = np.array(["CHEMBL1", "mol-é", ""])
    arrays = {"scalar": np.float64(2.5), "empty": np.zeros((0, 4)), "no_columns": np.zeros((5, 0)),
              "big_endian": np.arange(9, dtype=">i4").reshape(3, 3), "ids": ids,
              "cube": da.from_array(random_array(rng, (9, 2, 3), "float32"), chunks=(4, 1, 2))}
    path = tmp_path / "a.npz"
    to_npz(path, **arrays)
    with np.load(path) as f:
        for name, value in arrays.items():
            expected = value.compute() if hasattr(value, "compute") else np.asarray(value)
            np.testing.assert_array_equal(f[name], expected)
            assert f[name].shape == expected.shape
        assert f["big_endian"].dtype == np.dtype("=i4")  # native byte order, as to_npy
    assert os.path.getsize(path) == npz_bytes({k: np.asarray(v) if np.isscalar(v) else v
                                               for k, v in arrays.items()})


def _kept(block):
    return block[block[:, 0] > 0.5]


def _first_doubled(block):
    return block[:, :1] * 2


def test_unknown_chunk_sizes_are_learned_first(rng, tmp_path):
    a = rng.random((500, 2))
    x = da.from_array(a, chunks=(70, 2))
    # A threshold's pairs: how many rows a chunk keeps is known only once it is computed.
    kept = x.map_blocks(_kept, chunks=((np.nan,) * x.numblocks[0], (2,)), dtype=a.dtype,
                        meta=np.empty((0, 2), a.dtype))
    assert np.isnan(kept.shape[0])
    first = kept.map_blocks(_first_doubled, chunks=(kept.chunks[0], (1,)), dtype=a.dtype,
                            meta=np.empty((0, 1), a.dtype))
    shapes = write_npz(tmp_path / "pairs.npz", {"rows": kept, "first": first})
    want = a[a[:, 0] > 0.5]
    assert shapes == {"rows": want.shape, "first": (len(want), 1)}
    with np.load(tmp_path / "pairs.npz") as f:
        np.testing.assert_array_equal(f["rows"], want)
        np.testing.assert_array_equal(f["first"], want[:, :1] * 2)
    with pytest.raises(ValueError, match="only the number of rows may be unknown"):
        to_npz(tmp_path / "bad.npz", x=x.map_blocks(_kept, chunks=((np.nan,) * 8, (np.nan,)),
                                                    dtype=a.dtype, meta=np.empty((0, 0))))


def _fail_on_third(block, block_info=None):
    if block_info[0]["chunk-location"][0] == 3:
        raise RuntimeError("chunk 3 failed")
    return block


def test_an_existing_file_stays_until_the_new_one_is_whole(tmp_path):
    target = tmp_path / "a.npz"
    np.savez(target, old=np.arange(3))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        to_npz(target, new=da.ones(4, chunks=2))
    bad = da.ones((100, 3), chunks=(10, 3)).map_blocks(_fail_on_third, dtype=float)
    with pytest.raises(RuntimeError, match="chunk 3 failed"):
        to_npz(target, overwrite=True, new=bad)
    assert files(tmp_path) == ["a.npz"]  # no temporary file left
    with np.load(target) as f:
        assert f.files == ["old"]
    to_npz(target, overwrite=True, new=da.ones(4, chunks=2))
    with np.load(target) as f:
        assert f.files == ["new"]


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    with pytest.raises(TypeError, match="Python objects"):
        to_npz(tmp_path / "a.npz", ids=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="at least one array"):
        to_npz(tmp_path / "a.npz")
    with pytest.raises(IsADirectoryError):
        to_npz(f"{tmp_path}/", a=np.ones(2))
    with pytest.raises(FileNotFoundError):
        to_npz(tmp_path / "missing" / "a.npz", a=np.ones(2))
    assert files(tmp_path) == []


def test_on_a_distributed_cluster_each_worker_writes_its_chunks(rng, tmp_path):
    from distributed import get_task_stream

    from dask_gpuchunk.jobs import sent_by_workers

    a = random_array(rng, (3000, 100), "int64")  # 2.4 MB
    np.save(tmp_path / "a.npy", a)
    seen = []
    with dg.local_cluster(n_workers=2, processes=False, dashboard_address=None,
                          threads_per_gpu=1) as client, get_task_stream() as stream:
        before = sent_by_workers(client)
        x = dg.from_npy(tmp_path / "a.npy", chunks=(320, 100))
        to_npz(tmp_path / "a.npz", indices=x, scores=(x * 0.5).astype(np.float32),
               progress=lambda done, total: seen.append((done, total)))
        sent = sent_by_workers(client, before)
    # Each chunk is read, computed and written where it runs: the workers send CRCs, not rows
    # (np.savez after a compute would have sent all 3.6 MB of them here). Under dask's array
    # query planning a chunk read for one member's writes may go to the worker of the other's.
    if not type(da.ones(1)).__module__.startswith("dask.array._array_expr"):
        assert sum(sent.values()) < a.nbytes // 20, sent
    # Under dask's array query planning the writes fuse with the tasks before them.
    writers = {task["worker"] for task in stream.data}
    with np.load(tmp_path / "a.npz") as f:
        np.testing.assert_array_equal(f["indices"], a)
        np.testing.assert_array_equal(f["scores"], (a * 0.5).astype(np.float32))
    assert seen[-1] == (20, 20)
    assert len(writers) == 2  # each wrote what it computed; nothing came to this process


def test_device_or_host_chunks(xp, rng, tmp_path):
    a = random_array(rng, (300, 40), "float32")
    x = dg.asarray(xp.asarray(a), chunks=(64, 40))
    to_npz(tmp_path / "a.npz", tripled=dg.multiply(x, 3.0))
    with np.load(tmp_path / "a.npz") as f:
        np.testing.assert_array_equal(f["tripled"], a * np.float32(3.0))


def test_on_a_distributed_cluster_every_shape_gets_its_crcs(rng, tmp_path):
    # The blocks' CRCs come back from their futures (no second compute): each member's right
    # in its blocks' order, whatever their layout.
    arrays = {"scalar": np.float64(2.5), "empty": np.zeros((0, 4)),
              "cube": da.from_array(random_array(rng, (9, 2, 3), "float32"), chunks=(4, 1, 2)),
              "rows": da.from_array(random_array(rng, (50, 7), "int64"), chunks=(6, 3))}
    with dg.local_cluster(n_workers=2, processes=False, dashboard_address=None,
                          threads_per_gpu=1):
        to_npz(tmp_path / "a.npz", **arrays)
    with zipfile.ZipFile(tmp_path / "a.npz") as z:
        assert z.testzip() is None  # every member's CRC-32 right
    with np.load(tmp_path / "a.npz") as f:
        for name, value in arrays.items():
            expected = value.compute() if hasattr(value, "compute") else np.asarray(value)
            np.testing.assert_array_equal(f[name], expected)
