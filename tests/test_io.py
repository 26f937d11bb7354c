"""``dg.from_npy`` / ``dg.to_npy``: round trips, regions read lazily, never a half-written file."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq
from helpers import DTYPES, random_array

import dask_gpuchunk as dg
from dask_gpuchunk.io import NpyFormatError, read_header
from dask_gpuchunk import config


def files(directory) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype(rng, tmp_path, dtype):
    a = random_array(rng, (37, 11), dtype)
    np.save(tmp_path / "a.npy", a)
    x = dg.from_npy(tmp_path / "a.npy", chunks=(10, 4))
    assert x.dtype == a.dtype and x.chunks == ((10, 10, 10, 7), (4, 4, 3))
    dg.to_npy(x, tmp_path / "b.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "b.npy"), a)
    assert files(tmp_path) == ["a.npy", "b.npy"]


@pytest.mark.parametrize("shape, chunks", [((), ()), ((7,), 3), ((0, 4), (2, 2)), ((5, 0), 2),
                                           ((6, 5, 4), (4, 2, 3)), ((1, 1), 1)])
def test_round_trip_shapes(rng, tmp_path, shape, chunks):
    a = random_array(rng, shape, "float32")
    np.save(tmp_path / "a.npy", a)
    x = dg.from_npy(tmp_path / "a.npy", chunks=chunks)
    assert_eq(x, a)
    dg.to_npy(x * 2, tmp_path / "c.npy")
    out = np.load(tmp_path / "c.npy")
    assert out.shape == a.shape
    np.testing.assert_array_equal(out, a * 2)


def test_fortran_order_and_big_endian_inputs(rng, tmp_path):
    a = random_array(rng, (30, 17), "float64")
    np.save(tmp_path / "f.npy", np.asfortranarray(a))
    np.save(tmp_path / "be.npy", a.astype(">f8"))
    assert read_header(tmp_path / "f.npy").fortran_order
    f = dg.from_npy(tmp_path / "f.npy", chunks=(8, 5))
    be = dg.from_npy(tmp_path / "be.npy", chunks=(8, 5))
    assert be.dtype == np.dtype("float64") and be.dtype.isnative
    np.testing.assert_array_equal(f.compute(), a)
    np.testing.assert_array_equal(dg.multiply(f, be).compute(), a * a)
    dg.to_npy(be, tmp_path / "out.npy")  # written in native order
    assert np.load(tmp_path / "out.npy").dtype.isnative


@pytest.mark.parametrize("chunks, runs", [((25, 10), 1), ((25, 4), 25)])
def test_a_chunk_reads_only_its_region(rng, tmp_path, monkeypatch, chunks, runs):
    a = random_array(rng, (100, 10), "int32")
    np.save(tmp_path / "a.npy", a)
    x = dg.from_npy(tmp_path / "a.npy", chunks=chunks)
    reads = []
    real_preadv = os.preadv

    def recording_preadv(fd, buffers, offset):
        reads.append((offset, sum(len(b) for b in buffers)))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", recording_preadv)
    col = 0 if chunks[1] == 10 else 1
    block = x[50:75, col * chunks[1]:(col + 1) * chunks[1]].compute(scheduler="sync")
    np.testing.assert_array_equal(block, a[50:75, col * chunks[1]:(col + 1) * chunks[1]])
    assert sum(n for _, n in reads) == block.nbytes and len(reads) == runs
    header = read_header(tmp_path / "a.npy")
    assert min(o for o, _ in reads) == header.offset + (50 * 10 + col * chunks[1]) * 4


@pytest.mark.parametrize("threads", [1, 3])
def test_a_large_region_is_read_in_pieces_by_several_threads(rng, tmp_path, monkeypatch,
                                                              threads):
    import dask_gpuchunk.io.npy_reading as io

    a = random_array(rng, (100, 10), "int32")
    np.save(tmp_path / "a.npy", a)
    monkeypatch.setattr(io, "READ_PIECE_BYTES", 256)  # a 25-row chunk (1,000 bytes): 4 pieces
    reads = []
    real_preadv = os.preadv

    def recording_preadv(fd, buffers, offset):
        reads.append((offset, sum(len(b) for b in buffers), threading.current_thread().name))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", recording_preadv)
    with dask.config.set({"gpuchunk.file-read-threads": threads}):
        block = dg.from_npy(tmp_path / "a.npy", chunks=(25, 10))[25:50].compute(scheduler="sync")
    np.testing.assert_array_equal(block, a[25:50])
    start = read_header(tmp_path / "a.npy").offset + 25 * 10 * 4
    if threads == 1:
        assert [(o, n) for o, n, _ in reads] == [(start, 1000)]
    else:
        assert sorted((o, n) for o, n, _ in reads) == [(start + 256 * k, min(256, 1000 - 256 * k))
                                                       for k in range(4)]
        assert all(name.startswith("gpuchunk-read") for _, _, name in reads)


def test_pieces_that_reach_the_end_of_the_file_report_it(monkeypatch):
    import dask_gpuchunk.io.npy_reading as io

    monkeypatch.setattr(io, "READ_PIECE_BYTES", 256)
    raw = memoryview(bytearray(1000))

    def transfer(view, offset):  # a file of 700 bytes: nothing past it
        return max(0, min(len(view), 700 - offset))

    assert not io._each_run(transfer, raw, 1000, [0], threads=3)
    assert io._each_run(transfer, raw[:600], 600, [0], threads=3)


def test_from_npy_sees_no_whole_array_in_the_graph(rng, tmp_path):
    a = random_array(rng, (1000, 100), "float64")
    np.save(tmp_path / "a.npy", a)
    graph = dict(dg.from_npy(tmp_path / "a.npy", chunks=(100, 100)).__dask_graph__())
    assert not any(isinstance(v, np.ndarray) for v in graph.values())


def _header_only(fields: dict) -> bytes:
    """A version 1.0 header of ``fields``, padded as NumPy pads it, and no data."""
    text = repr(fields).encode("latin1")
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda p: None, FileNotFoundError, "no such file"),
        (lambda p: p.mkdir(), IsADirectoryError, "is a directory"),
        (lambda p: p.write_text("hello, not numpy"), NpyFormatError, "not a .npy file"),
        (lambda p: p.write_bytes(b""), NpyFormatError, "not a .npy file"),
        (lambda p: p.write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': nonsense"), NpyFormatError,
         "corrupt .npy header"),
        (lambda p: (np.save(p, np.zeros((100, 10))), os.truncate(p, 1000)), NpyFormatError,
         "truncated"),
        (lambda p: np.save(p, np.array([{}, 1], dtype=object)), NpyFormatError, "Python objects"),
        # A header that lies: (2**32, 2**32) bytes is 2**64, which wraps to 0 in int64.
        (lambda p: p.write_bytes(_header_only({"descr": "|u1", "fortran_order": False,
                                              "shape": (2**32, 2**32)})), NpyFormatError,
         "truncated"),
        (lambda p: p.write_bytes(_header_only({"descr": "<f8", "fortran_order": False,
                                              "shape": (3,), "extra": 1})), NpyFormatError,
         "corrupt .npy header"),
        (lambda p: p.write_bytes(b"\x93NUMPY\x04\x00\x10\x00\x00\x00"), NpyFormatError,
         "version 4.0"),
        (lambda p: os.mkfifo(p), PermissionError, "not a regular file"),
    ],
)
def test_from_npy_rejects_bad_files(tmp_path, make, error, match):
    path = tmp_path / "bad.npy"
    make(path)
    with pytest.raises(error, match=match):
        dg.from_npy(path)


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_every_npy_format_version_reads(rng, tmp_path, version):
    from numpy.lib import format as npy_format

    # Version 3.0 is what NumPy writes where the header needs UTF-8 (non-ASCII field names).
    values = np.zeros(7, dtype=[("größe", "<i4"), ("b", "<f8")])
    values["größe"], values["b"] = rng.integers(1, 99, 7), rng.random(7)
    path = tmp_path / "v.npy"
    with open(path, "wb") as f:
        write = getattr(npy_format, "_write_array_header", None)
        if write is None:  # NumPy 2 keeps it in the implementation module
            from numpy.lib._format_impl import _write_array_header as write
        write(f, npy_format.header_data_from_array_1_0(values), version)
        values.tofile(f)
    assert open(path, "rb").read(8)[6:] == bytes(version)
    np.testing.assert_array_equal(dg.from_npy(path, chunks=3).compute(), values)


def test_a_file_longer_than_its_header_warns_once_and_reads_what_it_says(rng, tmp_path):
    values = rng.random((5, 3))
    path = tmp_path / "long.npy"
    np.save(path, values)
    with open(path, "ab") as f:
        f.write(b"\0" * 1000)
    with pytest.warns(dg.io.NpyTrailingDataWarning, match="1,000 bytes after the data"):
        x = dg.from_npy(path)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per file: a job reads a header more than once
        read_header(path)
    np.testing.assert_array_equal(x.compute(), values)


def test_to_npy_refuses_an_output_without_room_before_any_work(tmp_path, monkeypatch):
    from dask_gpuchunk.io import npy_writing as io

    computed = []
    x = da.ones((1000, 100), chunks=(100, 100)).map_blocks(
        lambda b: computed.append(1) or b, dtype=float, meta=np.empty((0, 0)))
    free = io.npy_bytes(np.float64, (1000, 100)) + io.SPACE_MARGIN_BYTES - 1

    class Small:  # a file system with one byte too few (its margin included)
        f_bavail, f_frsize, f_blocks = free, 1, 10**12

    monkeypatch.setattr(io.os, "statvfs", lambda d: Small)
    with pytest.raises(io.NoSpaceError, match="800,128 bytes") as raised:
        dg.to_npy(x, tmp_path / "c.npy")
    assert raised.value.errno == 28 and "nothing was computed" in str(raised.value)
    assert computed == [] and files(tmp_path) == []
    Small.f_bavail += 1
    dg.to_npy(x, tmp_path / "c.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), np.ones((1000, 100)))


def test_an_output_name_as_long_as_the_file_system_allows(rng, tmp_path):
    # Its temporary name is longer; the target's own name is cut in it, never the target's.
    name = "g" * (255 - len(".npy")) + ".npy"
    values = rng.random(10)
    dg.to_npy(da.from_array(values, chunks=3), tmp_path / name)
    np.testing.assert_array_equal(np.load(tmp_path / name), values)
    assert files(tmp_path) == [name]


def test_to_npy_refuses_existing_output_unless_overwrite(rng, tmp_path):
    target = tmp_path / "c.npy"
    np.save(target, np.arange(3))
    with pytest.raises(FileExistsError, match="overwrite"):
        dg.to_npy(da.ones(5, chunks=2), target)
    np.testing.assert_array_equal(np.load(target), np.arange(3))
    dg.to_npy(da.ones(5, chunks=2), target, overwrite=True)
    np.testing.assert_array_equal(np.load(target), np.ones(5))


def test_to_npy_bad_targets(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        dg.to_npy(np.ones(3), tmp_path / "missing" / "c.npy")
    with pytest.raises(IsADirectoryError):
        dg.to_npy(np.ones(3), tmp_path)
    with pytest.raises(TypeError, match="Python objects"):
        dg.to_npy(np.array([None, 1], dtype=object), tmp_path / "o.npy")
    assert files(tmp_path) == []


def _fail_on_third(block, block_info=None):
    if block_info[0]["chunk-location"][0] == 3:
        raise RuntimeError("chunk 3 failed")
    return block


@pytest.mark.parametrize("existing", [False, True])
def test_failing_chunk_leaves_no_file(rng, tmp_path, existing):
    target = tmp_path / "c.npy"
    if existing:
        np.save(target, np.arange(4))
    x = da.ones((100, 3), chunks=(10, 3)).map_blocks(_fail_on_third, dtype=float)
    with pytest.raises(RuntimeError, match="chunk 3 failed"):
        dg.to_npy(x, target, overwrite=True)
    assert files(tmp_path) == (["c.npy"] if existing else [])
    if existing:  # the old file is untouched
        np.testing.assert_array_equal(np.load(target), np.arange(4))


@pytest.mark.parametrize("where", ["create_exclusive", "_write_header"])
def test_ctrl_c_as_the_output_is_made_leaves_no_file(tmp_path, monkeypatch, where):
    # A signal lands between any two steps: here just after the file exists (before its key
    # is read) or while its header is written; either way the file is this job's to remove.
    import dask_gpuchunk.io.npy_writing as io

    real = getattr(io, where)

    def interrupted(*args, **kwargs):
        result = real(*args, **kwargs)
        if where == "create_exclusive":
            os.close(result)
        raise KeyboardInterrupt

    monkeypatch.setattr(io, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        dg.to_npy(da.ones((100, 3), chunks=(10, 3)), tmp_path / "c.npy")
    assert files(tmp_path) == []


def test_creating_the_output_failing_removes_nothing(tmp_path, monkeypatch):
    # A name already taken (never by chance: it holds a random part) is not this job's file.
    import dask_gpuchunk.io.npy_writing as io

    def taken(path, *args):
        Path(path).write_bytes(b"someone else's")
        raise FileExistsError(17, "File exists", str(path))

    monkeypatch.setattr(io, "create_exclusive", taken)
    with pytest.raises(FileExistsError):
        dg.to_npy(da.ones((100, 3), chunks=(10, 3)), tmp_path / "c.npy")
    assert len(files(tmp_path)) == 1


def test_to_npy_on_a_distributed_cluster_reports_progress(rng, tmp_path):
    a = random_array(rng, (500, 20), "float64")
    np.save(tmp_path / "a.npy", a)
    seen = []
    with dg.local_cluster(processes=False, dashboard_address=None, threads_per_gpu=2):
        x = dg.from_npy(tmp_path / "a.npy", chunks=(50, 20))
        dg.to_npy(dg.multiply(x, x), tmp_path / "c.npy", progress=lambda d, t: seen.append((d, t)))
        with pytest.raises(RuntimeError, match="chunk 3 failed"):
            dg.to_npy(x.map_blocks(_fail_on_third, dtype=float), tmp_path / "bad.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), a * a)
    assert seen[-1] == (10, 10)
    assert files(tmp_path) == ["a.npy", "c.npy"]


def test_to_npy_of_device_or_host_chunks(xp, rng, tmp_path):
    a = random_array(rng, (300, 40), "float32")
    x = dg.asarray(xp.asarray(a), chunks=(64, 40))
    dg.to_npy(dg.multiply(x, 3.0), tmp_path / "c.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), a * np.float32(3.0))


def _fails_after_a_while(block: np.ndarray) -> np.ndarray:
    import time

    time.sleep(0.3)
    raise MemoryError("out of device memory, on purpose")


def test_a_failed_write_on_a_cluster_releases_its_tasks_without_cancel(tmp_path, monkeypatch):
    # Client.cancel trips distributed's scheduler ("assert ts.who_wants") for wanted keys whose
    # dependents nobody wants; the writes are released instead, and the failure propagates.
    import time

    from distributed import Client, LocalCluster

    monkeypatch.setattr(Client, "cancel", lambda *a, **k: pytest.fail("Client.cancel called"))
    x = da.ones((64, 8), chunks=(4, 8)).map_blocks(_fails_after_a_while, dtype=float)
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        with pytest.raises(MemoryError, match="on purpose"):
            dg.to_npy(x, tmp_path / "c.npy")
        deadline = time.monotonic() + 10
        while client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)) == 0
    assert list(tmp_path.iterdir()) == []  # nothing written, no partial file left


def _slow(block: np.ndarray) -> np.ndarray:
    import time

    time.sleep(0.5)
    return block


def test_a_cluster_that_loses_its_last_worker_fails_the_write_after_the_timeout(tmp_path,
                                                                                monkeypatch):
    import threading
    import time

    from distributed import Client, LocalCluster

    from dask_gpuchunk.io import NoWorkersError

    x = da.ones((40, 8), chunks=(2, 8)).map_blocks(_slow, dtype=float)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster), \
            dask.config.set({"gpuchunk.no-workers-timeout": 1}):
        threading.Timer(1.0, lambda: cluster.scale(0)).start()  # the only worker leaves
        t0 = time.monotonic()
        with pytest.raises(NoWorkersError, match="no workers for 1 s"):
            dg.to_npy(x, tmp_path / "c.npy")
        assert time.monotonic() - t0 < 30
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("blocks", [10, 2000], ids=["listed", "blockwise"])
def test_to_npy_finds_the_npy_inputs_behind_its_operand(rng, tmp_path, blocks):
    # What to_npy checks once more before publishing: each .npy read, once, however deep.
    from dask_gpuchunk.io import inputs_of

    for name in ("a", "b", "unused"):
        np.save(tmp_path / f"{name}.npy", random_array(rng, (blocks, 3), "float64"))
    a = dg.from_npy(tmp_path / "a.npy", chunks=(1, 3))
    b = dg.from_npy(tmp_path / "b.npy", chunks=(1, 3))
    x = dg.multiply(dg.multiply(a, b), a)
    found = sorted(os.path.basename(reader.path) for reader in inputs_of(x))
    assert found == ["a.npy", "b.npy"]
    assert inputs_of(np.ones(3)) == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_process_reads_in_pieces_with_threads_of_its_own(rng, tmp_path):
    # The parent's piece pool has no threads in a forked child: the child must not wait on it.
    import multiprocessing

    import dask_gpuchunk.io.npy_reading as io

    a = random_array(rng, (100, 10), "int32")
    np.save(tmp_path / "a.npy", a)
    x = dg.from_npy(tmp_path / "a.npy", chunks=(50, 10))
    old, io.READ_PIECE_BYTES = io.READ_PIECE_BYTES, 256
    try:
        for _ in range(3):  # the parent's pool: threads made, then idle (8 pieces a chunk)
            np.testing.assert_array_equal(x.compute(scheduler="sync"), a)
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(1) as pool:  # 4 pieces a chunk: fewer than the parent's idle threads
            got = pool.apply_async(_read_in_child, (str(tmp_path / "a.npy"),)).get(timeout=30)
        np.testing.assert_array_equal(got, a)
    finally:
        io.READ_PIECE_BYTES = old


def _read_in_child(path: str) -> np.ndarray:
    return dg.from_npy(path, chunks=(25, 10)).compute(scheduler="sync")


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:page-locking host memory with cudaHostRegister was refused")
def test_rows_reach_the_gpu_straight_from_the_file_where_they_can(tmp_path, monkeypatch):
    import cupy

    from dask_gpuchunk.runtime import staging
    from dask_gpuchunk.io import npy_reading as io
    from dask_gpuchunk.io import npy_reader_of

    rng = np.random.default_rng(11)
    words = rng.integers(0, 2**63, (1000, 37), dtype=np.uint64)  # 296-byte rows: unaligned
    np.save(tmp_path / "w.npy", words)
    reader = npy_reader_of(dg.from_npy(tmp_path / "w.npy", chunks=(300, -1)))
    assert reader.row_nbytes == 296
    assert reader.rows_on_device(0, 10) is None  # off by default
    monkeypatch.setitem(dask.config.config["gpuchunk"], "register-reads", True)
    for start, stop in [(0, 300), (300, 600), (901, 1000), (5, 5), (999, 1000)]:
        got = reader.rows_on_device(start, stop)
        assert isinstance(got, cupy.ndarray) and got.dtype == words.dtype
        np.testing.assert_array_equal(got.get(), words[start:stop])
    with config.internal_values({"register-reads": False}):
        assert reader.rows_on_device(0, 10) is None
    np.save(tmp_path / "f.npy", np.asfortranarray(words))
    fortran = npy_reader_of(dg.from_npy(tmp_path / "f.npy", chunks=(300, -1)))
    assert fortran is None or fortran.rows_on_device(0, 10) is None

    # A device that refuses the registration: None, noted, and the chunk read as before.
    from dask_gpuchunk.runtime.resident import ResidentSource

    def refuse(*args):
        raise cupy.cuda.runtime.CUDARuntimeError(801)  # cudaErrorNotSupported

    monkeypatch.setattr(cupy.cuda.runtime, "hostRegister", refuse)
    monkeypatch.setattr(io, "_register_refused", set())
    # The pinned pool, refused too, falls back for the process: for this test only.
    monkeypatch.setattr(staging, "_registration_refused", [])
    assert reader.rows_on_device(0, 10) is None
    assert io._register_refused == {cupy.cuda.runtime.getDevice()}
    source = ResidentSource(reader, "refused")
    np.testing.assert_array_equal(source.rows(300, 600, on_gpu=True).get(), words[300:600])


def test_the_bytes_a_gpu_copies_from_are_the_files(tmp_path):
    # What the GPU copies straight from the page cache: the file's bytes, at any offset.
    import ctypes

    from dask_gpuchunk.io.npy_reading import _mapped_read_only

    data = np.random.default_rng(3).integers(0, 256, 3 * 4096 + 77, dtype=np.uint8).tobytes()
    (tmp_path / "b").write_bytes(data)
    fd = os.open(tmp_path / "b", os.O_RDONLY)
    try:
        for offset, nbytes in [(0, 4096), (128, 5000), (4095, 2), (8192 + 5, 4096 + 72)]:
            with _mapped_read_only(fd, offset, nbytes) as address:
                assert ctypes.string_at(address, nbytes) == data[offset:offset + nbytes]
    finally:
        os.close(fd)


@pytest.mark.parametrize("name", ["npy_reading", "npy_writing", "zarr_files", "zarr_store",
                                  "files", "fingerprint_files"])
def test_the_modules_moved_into_io_keep_their_old_names_for_a_release(name):
    import importlib
    import sys

    sys.modules.pop(f"dask_gpuchunk.{name}", None)
    with pytest.warns(DeprecationWarning, match=f"dask_gpuchunk.io.{name}"):
        old = importlib.import_module(f"dask_gpuchunk.{name}")
    new = importlib.import_module(f"dask_gpuchunk.io.{name}")
    assert old.__all__ == new.__all__
    assert all(getattr(old, n) is getattr(new, n) for n in new.__all__)
