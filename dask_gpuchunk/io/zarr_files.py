"""Zarr stores in and out, as the ``.npy`` files are: ``from_zarr`` and ``to_zarr``.

Reading is as Dask's own :func:`dask.array.from_zarr` (each task reads its region, on whichever
worker runs it; that function is missing under Dask's array query planning), after the store is
checked here and pinned as a ``.npy`` input is (:class:`ZarrReader`: a store changed during the
job is an error, never a wrong output; a damaged one is named with its chunk); on the GPU path
the NumPy chunks go through the package's pinned staging like any other. Writing goes into a
private temporary store beside the target (:mod:`dask_gpuchunk.io.zarr_store`) whose chunks are
the Dask array's blocks, so that each task writes whole Zarr chunks and no two tasks share one;
the store is renamed onto the target only when every chunk is written (an existing store
replaced only with ``overwrite``, and only a Zarr array of zarr's own entries). Compression is
off by default: the jobs' outputs are dense numbers that compress little, and writing them raw
runs at the disk's rate: each whole chunk of such a store is written from the block's memory
(from a pinned buffer for CuPy blocks) straight into its file. Zarr format 3 by default, 2 on
request; both are read. Needs the ``zarr`` package (``pip install 'dask-gpuchunk[zarr]'``).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import logging
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import dask.array as da
import numpy as np
from dask.base import tokenize

from ..arrays import asarray
from ..runtime.backend import ChunkWork, run_chunk
from ..config import map_blocks_prefix
from .partials import remove_stale, temporary_name
from .files import InputChangedError
from .npy_reading import checked_chunks, in_flight, inputs_of
from .npy_writing import check_output_directory, check_space, run_writes
from .zarr_store import (
    COMPRESSIONS,
    WRITER_ATTRIBUTE,
    StoreTarget,
    check_compression,
    check_replaceable,
    create_store,
    open_store,
    publish_store,
    remove_store,
    write_chunks,
)

__all__ = ["COMPRESSIONS", "ZarrFormatError", "ZarrInfo", "ZarrReader", "check_compression",
           "check_zarr_target", "from_zarr", "is_zarr_path", "read_zarr_info", "region_writer",
           "to_zarr", "write_zarr_region", "zarr_in_place"]



class ZarrFormatError(ValueError):
    """A path that is not a readable Zarr array (a group, no metadata, an object dtype)."""


class ZarrInfo(NamedTuple):
    """What a Zarr array's metadata says: shape, dtype and its chunks."""

    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def is_zarr_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a Zarr store (its name ends in ``.zarr``).

    Examples
    --------
    >>> is_zarr_path("out/G.zarr"), is_zarr_path("G.zarr/"), is_zarr_path("G.npy")
    (True, True, False)
    """
    return os.fspath(path).rstrip("/").endswith(".zarr")


def _zarr() -> Any:
    try:
        import zarr
    except ImportError:
        raise ImportError("Zarr stores need the zarr package: pip install "
                          "'dask-gpuchunk[zarr]' (or zarr>=3)") from None
    return zarr


def _is_store(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file()
                                 for name in ("zarr.json", ".zarray", ".zgroup"))


def read_zarr_info(path: str | os.PathLike) -> ZarrInfo:
    """Open the Zarr array at ``path`` (format 2 or 3) and check it can be read chunk by chunk.

    Raises
    ------
    FileNotFoundError
        Nothing at ``path``.
    ZarrFormatError
        Not a Zarr array (a plain directory, a group, unreadable metadata), of an object or
        string dtype, or of chunks of no size.

    Examples
    --------
    >>> import tempfile, os, zarr
    >>> path = os.path.join(tempfile.mkdtemp(), "a.zarr")
    >>> _ = zarr.create_array(path, shape=(5, 3), chunks=(2, 3), dtype="f4")
    >>> info = read_zarr_info(path)
    >>> info.shape, str(info.dtype), info.chunks
    ((5, 3), 'float32', (2, 3))
    """
    zarr = _zarr()
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such Zarr store")
    if not _is_store(path):
        raise ZarrFormatError(f"{path} is not a Zarr store (no zarr.json or .zarray in it)")
    try:
        array = zarr.open_array(str(path), mode="r")
        dtype = np.dtype(array.dtype)
        chunks = tuple(int(c) for c in array.chunks)
        shape = tuple(int(n) for n in array.shape)
    except Exception as exc:  # noqa: BLE001 - whatever zarr raises, the store is not readable
        raise ZarrFormatError(f"{path} is not a readable Zarr array ({exc})".splitlines()[0]
                              ) from None
    if dtype.hasobject or dtype.kind in "OUSTV":
        raise ZarrFormatError(f"{path} holds {dtype} values; the jobs take numbers")
    if len(chunks) != len(shape) or any(c < 1 for c in chunks):
        raise ZarrFormatError(f"{path}: its metadata gives chunks {list(chunks)} for shape "
                              f"{list(shape)}; every chunk size must be 1 or more")
    # The values as they are read (ZarrReader gives native byte order, as from_npy does):
    # zarr may spell native little-endian "<", and a big-endian store is converted.
    dtype = dtype.newbyteorder("=")
    return ZarrInfo(shape, dtype, chunks)


# ---- reading, the store pinned --------------------------------------------------------------


_METADATA = ("zarr.json", ".zarray", ".zattrs")


def _store_files(path: str) -> dict[str, tuple[int, int, int]]:
    """Every file below the store ``path``, by its key (``"c/0/1"``): ``(inode, size,
    modification time)``, as the store stands now."""
    found: dict[str, tuple[int, int, int]] = {}
    for folder, _, names in os.walk(path):
        for name in names:
            full = os.path.join(folder, name)
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(full)
                found[os.path.relpath(full, path).replace(os.sep, "/")] = (
                    st.st_ino, st.st_size, st.st_mtime_ns)
    return found


def _grid_keys(array: Any) -> Iterator[tuple[tuple[int, ...], str]]:
    """Every chunk (shard, where the array has them) of ``array``: its grid position and key."""
    grid = getattr(array, "shards", None) or array.chunks
    counts = [-(-int(n) // int(c)) for n, c in zip(array.shape, grid)]
    for coords in np.ndindex(*counts):
        yield coords, array.metadata.encode_chunk_key(coords)


class ZarrReader:
    """A Zarr array as :func:`dask.array.from_array` reads it, pinned as a ``.npy`` input is:
    the store's files when it was opened (``files``: each one's inode, size and modification
    time) are checked before and after each region is read, and once more before a job
    publishes its output (:meth:`check_unchanged`): a chunk modified, removed or added, or the
    metadata edited, is :class:`~dask_gpuchunk.io.files.InputChangedError`. A chunk that cannot
    be decoded (a failed checksum, a truncated file) is a :class:`ZarrFormatError` naming the
    store and the chunk."""

    __slots__ = ("path", "shape", "dtype", "ndim", "files", "grid")

    def __init__(self, path: str, info: ZarrInfo, files: dict[str, tuple[int, int, int]],
                 grid: tuple[int, ...]) -> None:
        self.path, self.files, self.grid = path, files, grid
        self.shape, self.dtype, self.ndim = info.shape, info.dtype, len(info.shape)

    def __getitem__(self, region: tuple[slice, ...]) -> np.ndarray:
        array = _opened_array(self.path, self.files.get("zarr.json") or self.files.get(".zarray"))
        keys = self._keys(array, region)
        self._check(keys)
        try:
            data = np.asarray(array[region])
        except Exception as exc:  # noqa: BLE001 - zarr's errors for a chunk it cannot decode
            raise self._damaged(array, region, exc) from None
        self._check(keys)
        if not data.dtype.isnative:
            data = data.astype(data.dtype.newbyteorder("="))
        return data

    def _chunks(self, array: Any, region: tuple[slice, ...]
                ) -> Iterator[tuple[str, tuple[slice, ...]]]:
        """The key and the whole region of each chunk (shard) ``region`` reads from."""
        first = [(r.start or 0) // g for r, g in zip(region, self.grid)]
        last = [-(-(r.stop if r.stop is not None else n) // g)
                for r, g, n in zip(region, self.grid, self.shape)]
        for offset in np.ndindex(*(b - a for a, b in zip(first, last))):
            coords = tuple(a + i for a, i in zip(first, offset))
            lo = [c * g for c, g in zip(coords, self.grid)]
            yield (array.metadata.encode_chunk_key(coords),
                   tuple(slice(a, min(a + g, n)) for a, g, n in zip(lo, self.grid, self.shape)))

    def _keys(self, array: Any, region: tuple[slice, ...]) -> list[str]:
        return [key for key, _ in self._chunks(array, region)]

    def _check(self, keys: list[str]) -> None:
        for key in [*_METADATA, *keys]:
            try:
                st = os.lstat(os.path.join(self.path, *key.split("/")))
                now: tuple[int, int, int] | None = (st.st_ino, st.st_size, st.st_mtime_ns)
            except FileNotFoundError:
                now = None
            if now != self.files.get(key):
                raise _changed(self.path, key, self.files.get(key), now)

    def _damaged(self, array: Any, region: tuple[slice, ...], exc: Exception) -> Exception:
        """The error of a region that zarr could not read: the first of its chunks that fails
        alone, named with the store (``exc`` where none does)."""
        for key, whole in self._chunks(array, region):
            try:
                array[whole]
            except Exception as chunk_exc:  # noqa: BLE001 - as above
                return ZarrFormatError(f"{self.path}: chunk {key} cannot be read "
                                       f"({type(chunk_exc).__name__}: {chunk_exc}); the store is "
                                       "damaged".splitlines()[0])
        return ZarrFormatError(f"{self.path} cannot be read ({type(exc).__name__}: {exc})"
                               .splitlines()[0])

    def check_unchanged(self) -> None:
        """:class:`~dask_gpuchunk.io.files.InputChangedError` where any file of the store differs
        from when it was opened."""
        now = _store_files(self.path)
        for key in sorted(set(now) | set(self.files)):
            if now.get(key) != self.files.get(key):
                raise _changed(self.path, key, self.files.get(key), now.get(key))

    def __dask_tokenize__(self) -> tuple:
        return ("dask-gpuchunk-zarr", self.path, sorted(self.files.items()))


def _changed(path: str, key: str, before: Any, now: Any) -> InputChangedError:
    what = ("was removed" if now is None else "appeared" if before is None else "was modified")
    return InputChangedError(errno.ESTALE, f"input {path} changed during the job ({key} {what}); "
                             "nothing was written from it")


_arrays: dict[tuple[str, Any], Any] = {}
_arrays_lock = threading.Lock()


def _opened_array(path: str, metadata: Any) -> Any:
    """The zarr array at ``path`` opened for reading, once per process and metadata file."""
    with _arrays_lock:
        found = _arrays.get((path, metadata))
        if found is None:
            found = _arrays[(path, metadata)] = _zarr().open_array(path, mode="r")
        return found


_warned_missing: set[str] = set()


def _pin(path: str, info: ZarrInfo) -> ZarrReader:
    """The reader of the store at ``path``, its files pinned as they are now; a store this
    package wrote whole (:data:`~dask_gpuchunk.io.zarr_store.WRITER_ATTRIBUTE`) with a chunk
    missing or a shape other than it wrote is damaged (:class:`ZarrFormatError`); another
    store's missing chunks are said once: zarr reads them as the fill value."""
    files = _store_files(path)
    array = _opened_array(path, files.get("zarr.json") or files.get(".zarray"))
    grid = tuple(int(g) for g in (getattr(array, "shards", None) or array.chunks))
    missing = [key for _, key in _grid_keys(array) if key not in files]
    ours = array.attrs.get(WRITER_ATTRIBUTE)
    if isinstance(ours, dict) and ours.get("all_chunks"):
        if list(ours.get("shape", info.shape)) != list(info.shape):
            raise ZarrFormatError(f"{path} was written as shape {tuple(ours['shape'])}, but its "
                                  f"metadata now says {info.shape}: the store is damaged")
        if missing:
            raise ZarrFormatError(f"{path}: chunk {missing[0]} is missing ({len(missing)} of "
                                  "its chunks in all); it was written with every chunk, so the "
                                  "store is damaged")
    elif missing and path not in _warned_missing:
        _warned_missing.add(path)
        warnings.warn(f"{path}: {len(missing)} of its chunks do not exist (the first: "
                      f"{missing[0]}); they are read as the fill value "
                      f"{array.metadata.fill_value!r}", stacklevel=3)
    return ZarrReader(os.path.abspath(path), info, files, grid)


def from_zarr(path: str | os.PathLike, chunks: Any = None) -> da.Array:
    """A Dask array of the Zarr array at ``path``, checked first (:func:`read_zarr_info`) and
    pinned (:class:`ZarrReader`: a store changed while the array is read raises; a damaged one
    is named); ``chunks`` as for :func:`dask_gpuchunk.from_npy` (``None``: the store's own
    chunks).

    Examples
    --------
    >>> import tempfile, os, zarr
    >>> path = os.path.join(tempfile.mkdtemp(), "a.zarr")
    >>> z = zarr.create_array(path, shape=(5,), chunks=(2,), dtype="i8")
    >>> z[:] = np.arange(5)
    >>> from_zarr(path, chunks=3).compute()
    array([0, 1, 2, 3, 4])
    """
    info = read_zarr_info(path)
    chunks = checked_chunks(info.chunks if chunks is None else chunks, info.shape, info.dtype)
    reader = _pin(os.fspath(path), info)
    # dask.array.from_zarr's work, which dask's array query planning does not have: each task
    # reads its own region of the store.
    token = tokenize(reader, chunks)
    return da.from_array(reader, chunks=chunks, name=f"from-zarr-{token}", asarray=False,
                         fancy=False, meta=np.empty((0,) * len(info.shape), info.dtype))


def check_zarr_target(path: Path, overwrite: bool, nbytes: int = 0) -> None:
    """Refuse, before any work, a Zarr output ``path`` that cannot be written: a missing or
    read-only directory, an existing store without ``overwrite``, with it anything but a Zarr
    array of zarr's own entries (:func:`~dask_gpuchunk.io.zarr_store.check_replaceable`: never
    replaced), or a file system without room for ``nbytes``."""
    check_output_directory(path.parent)
    if os.path.lexists(path):
        if not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
        check_replaceable(path)
    if nbytes:
        check_space(path.parent, nbytes)


@contextlib.contextmanager
def zarr_in_place(target: Path, dtype: np.dtype, shape: tuple[int, ...], chunks: tuple[int, ...],
                  overwrite: bool, compression: str = "none", zarr_format: int = 3,
                  reads: Any = None) -> Iterator[StoreTarget]:
    """A Zarr array written in pieces and published whole: its temporary store beside
    ``target`` (:func:`~dask_gpuchunk.io.zarr_store.create_store`), for
    :func:`write_zarr_region`'s tasks; checked first (room for the uncompressed bytes: our
    outputs are dense numbers that compress little). When the block ends, the inputs the Dask
    collection ``reads`` reads are checked unchanged, and the store is published onto
    ``target`` if it is still the one the job made; removed if anything raises."""
    _zarr()
    check_compression(compression, zarr_format)
    check_zarr_target(target, overwrite, math.prod(shape) * np.dtype(dtype).itemsize)
    remove_stale(target, log=logging.getLogger("dask_gpuchunk").warning)
    store, fd = None, None
    try:
        store = create_store(temporary_name(target), shape, chunks, dtype, compression,
                             zarr_format)
        fd = open_store(store)
        yield store
        for reader in inputs_of(reads):
            reader.check_unchanged()
        publish_store(store, target, overwrite)
    except BaseException:
        if fd is not None:
            _removed_when_quiet(store, fd)
        raise
    finally:
        if fd is not None:
            os.close(fd)


def _removed_when_quiet(store: StoreTarget, fd: int, patience: float = 60.0) -> None:
    """Remove a failed job's store once this process's writes to it have ended (a write then
    finds the store gone and writes nothing)."""
    deadline = time.monotonic() + patience
    while True:
        gone = remove_store(store, fd)
        with _writing_lock:
            busy = _writing[store.root] > 0
        if (gone and not busy) or time.monotonic() > deadline:
            return
        time.sleep(0.01)


#: Writes in flight in this process, per store: a failed job removes its store only once its
#: own threads' writes have ended.
_writing: collections.Counter[str] = collections.Counter()
_writing_lock = threading.Lock()


def write_zarr_region(block: Any, region: tuple[slice, ...], target: StoreTarget) -> np.ndarray:
    """Write one computed block into its region of the store ``target`` names (whole chunks of
    it; :func:`~dask_gpuchunk.io.zarr_store.write_chunks`): the bytes written, as a one-element
    array per block. A CuPy block comes to the host through a pinned buffer."""
    dtype = np.dtype(target.dtype)
    with _writing_lock:
        _writing[target.root] += 1
    try:
        run_chunk(ChunkWork(
            "a chunk written to a Zarr store", stage=False,
            on_cpu=lambda: _host_block_to_store(np.asarray(block, dtype=dtype), region, target),
            on_device=lambda: _device_block_to_store(block, region, target)), [block])
    finally:
        with _writing_lock:
            _writing[target.root] -= 1
    return np.full((1,) * len(region), block.size * dtype.itemsize, dtype=np.int64)


def _host_block_to_store(block: np.ndarray, region: tuple[slice, ...], target: StoreTarget
                         ) -> None:
    with in_flight("file-writes"):  # as .npy chunks: one sequential stream per process
        write_chunks(target, block, region)


def _device_block_to_store(block: Any, region: tuple[slice, ...], target: StoreTarget) -> None:
    """D2H into a pinned buffer, then written from there: no other host copy."""
    import cupy

    from ..runtime.staging import copy_to_host, pinned_pool

    block = cupy.ascontiguousarray(block.astype(np.dtype(target.dtype), copy=False))
    stream = cupy.cuda.get_current_stream()
    with pinned_pool.borrow(block.dtype, block.shape) as buf:
        copy_to_host(buf, block, stream)
        stream.synchronize()
        _host_block_to_store(buf, region, target)


def _write_block(block: Any, target: StoreTarget, block_info: dict) -> np.ndarray:
    region = tuple(slice(start, stop) for start, stop in block_info[0]["array-location"])
    return write_zarr_region(block, region, target)


def _regular(chunks: tuple[tuple[int, ...], ...]) -> tuple[int, ...] | None:
    """The Zarr chunk shape of Dask ``chunks`` where every block but each axis' last has one
    size and the last is no larger; ``None`` otherwise."""
    shape = []
    for blocks in chunks:
        first = blocks[0] if blocks else 1
        if any(b != first for b in blocks[:-1]) or (blocks and blocks[-1] > first):
            return None
        shape.append(max(first, 1))
    return tuple(shape)


def to_zarr(x: Any, path: str | os.PathLike, *, overwrite: bool = False,
            compression: str = "none", zarr_format: int = 3,
            progress: Callable[[int, int], None] | None = None) -> Path:
    """Compute ``x`` and write it into a Zarr store, chunk by chunk, never half-written.

    The store's chunks are ``x``'s blocks (rechunked to a regular grid first where they are
    not), so each task writes whole chunks, by the worker that computed them, into a private
    temporary store beside ``path`` (:mod:`dask_gpuchunk.io.zarr_store`); it is renamed onto
    ``path`` only once every chunk is written, the ``.npy`` and Zarr inputs ``x`` reads are
    unchanged, and the temporary store is still the one the job made. Every chunk is written
    (those of zeros too), and the store says so in its attributes: a reader tells a missing
    chunk for damage. Compressed stores carry a CRC32C checksum of each chunk.

    Parameters
    ----------
    x
        Dask, NumPy or CuPy array of numbers.
    path
        The store to write (its directory must exist; a name ending in ``.zarr``).
    overwrite
        Replace the Zarr array store at ``path`` (only once the new one is complete, and only
        a store whose every entry is zarr's own: anything else in it is named and kept).
    compression
        ``"none"`` (default), ``"zstd"``, ``"gzip"`` or ``"blosc"``, optionally
        ``"NAME:LEVEL"``.
    zarr_format
        3 (default) or 2.
    progress
        As for :func:`dask_gpuchunk.to_npy`.

    Examples
    --------
    >>> import tempfile, os, zarr
    >>> path = os.path.join(tempfile.mkdtemp(), "c.zarr")
    >>> _ = to_zarr(da.arange(10, chunks=4) * 2, path)
    >>> zarr.open_array(path, mode="r")[:]
    array([ 0,  2,  4,  6,  8, 10, 12, 14, 16, 18])
    """
    target = Path(os.path.abspath(os.fspath(path)))  # a trailing / of a store's name dropped
    x = asarray(x)
    dtype = np.dtype(x.dtype)
    if dtype.hasobject or dtype.kind in "OUSTV":
        raise TypeError(f"cannot write {dtype} values to a Zarr store here; numbers only")
    chunks = _regular(x.chunks)
    if chunks is None:
        chunks = tuple(max(max(blocks, default=1), 1) for blocks in x.chunks)
        x = x.rechunk(chunks)
    with zarr_in_place(target, dtype, x.shape, chunks, overwrite, compression,
                       zarr_format, reads=x) as store:
        written = x.map_blocks(
            _write_block, dtype=np.int64, meta=np.empty((0,) * x.ndim, np.int64),
            chunks=tuple((1,) * n for n in x.numblocks), **map_blocks_prefix("to-zarr"),
            target=store)
        run_writes(written, progress)
    return target


def region_writer(store: StoreTarget) -> Callable[..., np.ndarray]:
    """``writer(block, region=)`` into ``store`` (a picklable partial of
    :func:`write_zarr_region`)."""
    return functools.partial(write_zarr_region, target=store)
