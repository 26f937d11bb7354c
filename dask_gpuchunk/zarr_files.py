"""Zarr stores in and out, as the ``.npy`` files are: ``from_zarr`` and ``to_zarr``.

Reading is as Dask's own :func:`dask.array.from_zarr` (each task reads its region, on whichever
worker runs it; that function is missing under Dask's array query planning), after the store is
checked here; on the GPU path the NumPy chunks go through
the package's pinned staging like any other. Writing goes into a temporary store beside the
target (``.<name>.dgc-<writer>.partial``, :mod:`dask_gpuchunk.partials`) whose chunks are the
Dask array's blocks, so that each task writes whole Zarr chunks and no two tasks share one; the
store is renamed onto the target only when every chunk is written (an existing store replaced
only with ``overwrite``, and only a Zarr store: never another directory). Compression is off by
default: the jobs' outputs are dense numbers that compress little, and writing them raw runs
at the disk's rate: each whole chunk of such a store is written from the block's memory (from
a pinned buffer for CuPy blocks) straight into its file, with none of zarr's encoding copies;
edge chunks (zarr stores them padded) and compressed stores go through zarr. Zarr format 3 by default, 2 on request; both are read. Needs the ``zarr``
package (``pip install 'dask-gpuchunk[zarr]'``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import dask.array as da
import numpy as np
from dask.base import tokenize

from ._kernels.gram import c_ordered
from .arrays import asarray
from .backend import ChunkWork, run_chunk
from .config import map_blocks_prefix
from .files import exchange, rename_noreplace
from .io import check_output_directory, check_space, checked_chunks, in_flight, run_writes
from .partials import remove_stale, temporary_name

__all__ = ["COMPRESSIONS", "ZarrFormatError", "ZarrInfo", "check_compression",
           "check_zarr_target", "from_zarr", "is_zarr_path", "read_zarr_info", "region_writer",
           "to_zarr", "write_zarr_region", "zarr_in_place"]

#: The compressions ``to_zarr`` and the jobs' ``--compression`` take (``NAME`` or
#: ``NAME:LEVEL``).
COMPRESSIONS = ("none", "zstd", "gzip", "blosc")


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
        Not a Zarr array (a plain directory, a group, unreadable metadata) or of an object or
        string dtype.

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
    except Exception as exc:  # noqa: BLE001 - whatever zarr raises, the store is not readable
        raise ZarrFormatError(f"{path} is not a readable Zarr array ({exc})".splitlines()[0]
                              ) from None
    if dtype.hasobject or dtype.kind in "OUSTV":
        raise ZarrFormatError(f"{path} holds {dtype} values; the jobs take numbers")
    if dtype.isnative:  # zarr may spell native little-endian "<": one dtype here
        dtype = dtype.newbyteorder("=")
    return ZarrInfo(tuple(int(n) for n in array.shape), dtype,
                    tuple(int(c) for c in array.chunks))


def from_zarr(path: str | os.PathLike, chunks: Any = None) -> da.Array:
    """A Dask array of the Zarr array at ``path``, checked first (:func:`read_zarr_info`);
    ``chunks`` as for :func:`dask_gpuchunk.from_npy` (``None``: the store's own chunks).

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
    array = _zarr().open_array(os.fspath(path), mode="r")
    # dask.array.from_zarr's work, which dask's array query planning does not have: each task
    # reads its own region of the store.
    metadata = Path(path) / ("zarr.json" if (Path(path) / "zarr.json").exists() else ".zarray")
    token = tokenize(os.path.abspath(path), os.stat(metadata).st_mtime_ns, chunks)
    return da.from_array(array, chunks=chunks, name=f"from-zarr-{token}", asarray=True,
                         meta=np.empty((0,) * len(info.shape), info.dtype))


def check_compression(compression: str, zarr_format: int) -> tuple[str, int | None]:
    """``(name, level)`` of ``NAME[:LEVEL]`` (:data:`COMPRESSIONS`); ``ValueError`` for an
    unknown name, a level that is not a whole number or a format other than 2 and 3.

    Examples
    --------
    >>> check_compression("zstd:7", 3), check_compression("none", 2)
    (('zstd', 7), ('none', None))
    """
    if zarr_format not in (2, 3):
        raise ValueError(f"zarr_format must be 2 or 3, got {zarr_format!r}")
    name, _, level = compression.partition(":")
    if name not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)} (NAME or "
                         f"NAME:LEVEL); got {compression!r}")
    try:
        return name, int(level) if level else None
    except ValueError:
        raise ValueError(f"compression level {level!r} is not a whole number") from None


def _compressors(compression: str, zarr_format: int) -> Any:
    """Zarr's compressors for ``NAME[:LEVEL]`` (:func:`check_compression`)."""
    name, level_value = check_compression(compression, zarr_format)
    if name == "none":
        return None
    if zarr_format == 2:
        import numcodecs

        return {"zstd": lambda: numcodecs.Zstd(level=level_value or 3),
                "gzip": lambda: numcodecs.GZip(level=level_value or 5),
                "blosc": lambda: numcodecs.Blosc(cname="zstd", clevel=level_value or 5)}[name]()
    from zarr import codecs

    return {"zstd": lambda: codecs.ZstdCodec(level=level_value or 3),
            "gzip": lambda: codecs.GzipCodec(level=level_value or 5),
            "blosc": lambda: codecs.BloscCodec(cname="zstd", clevel=level_value or 5)}[name]()


def _refuse_unless_store(path: Path) -> None:
    """``FileExistsError`` where the existing ``path`` is not a Zarr store (a symlink, a file,
    another directory): overwrite replaces stores, nothing else."""
    if path.is_symlink() or not _is_store(path):
        raise FileExistsError(f"{path} is not a Zarr store; only a Zarr store is replaced")


def check_zarr_target(path: Path, overwrite: bool, nbytes: int = 0) -> None:
    """Refuse, before any work, a Zarr output ``path`` that cannot be written: a missing or
    read-only directory, an existing store without ``overwrite``, anything but a Zarr store
    at ``path`` (never replaced), or a file system without room for ``nbytes``."""
    check_output_directory(path.parent)
    if os.path.lexists(path):
        if not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace "
                                  "it")
        _refuse_unless_store(path)
    if nbytes:
        check_space(path.parent, nbytes)


def _publish_store(tmp: Path, target: Path, overwrite: bool) -> None:
    """Rename the finished store ``tmp`` onto ``target``: never over anything without
    ``overwrite``; with it, swapped with an existing Zarr store in one step (``renameat2``
    ``RENAME_EXCHANGE`` where the file system has it), the old store then removed."""
    if not overwrite or not os.path.lexists(target):
        rename_noreplace(tmp, target)
        return
    _refuse_unless_store(target)
    exchange(tmp, target)
    shutil.rmtree(tmp)  # the old store, now under the temporary name


@contextlib.contextmanager
def zarr_in_place(target: Path, dtype: np.dtype, shape: tuple[int, ...], chunks: tuple[int, ...],
                  overwrite: bool, compression: str = "none", zarr_format: int = 3
                  ) -> Iterator[Any]:
    """A Zarr array written in pieces and published whole: the array of a temporary store
    beside ``target``, for :func:`write_zarr_region`'s tasks; checked first. When the block
    ends, the store is renamed onto ``target``; removed if anything raises."""
    zarr = _zarr()
    compressors = _compressors(compression, zarr_format)
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize if compressors is None else 0
    check_zarr_target(target, overwrite, nbytes)
    remove_stale(target, log=logging.getLogger("dask_gpuchunk").warning)
    tmp = temporary_name(target)
    try:
        array = zarr.create_array(str(tmp), shape=shape, chunks=chunks, dtype=dtype,
                                  compressors=compressors, zarr_format=zarr_format,
                                  fill_value=0)
        yield array
        _publish_store(tmp, target, overwrite)
    except BaseException:
        _remove_store(tmp)
        raise


def _remove_store(tmp: Path, patience: float = 60.0) -> None:
    """Remove a failed job's store once this process's writes to it have ended (each of them
    checks, after writing, that the store is still there, and removes what it made if not)."""
    deadline = time.monotonic() + patience
    while True:
        shutil.rmtree(tmp, ignore_errors=True)
        with _writing_lock:
            busy = _writing[str(tmp)] > 0
        if (not busy and not os.path.lexists(tmp)) or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _check_still_there(root: str) -> None:
    """A chunk of a store its job gave up (and removed) is not to be written: writing would
    create its directories again, leaving a half store behind. Checked before and after each
    write (a removal during the write is undone by the writer)."""
    if not _is_store(Path(root)):
        shutil.rmtree(root, ignore_errors=True)
        raise FileNotFoundError(f"the job's temporary store {root} was removed (the job failed "
                                "or was stopped); this chunk is not written")


#: Writes in flight in this process, per store root: a failed job removes its store only once
#: its own threads' writes have ended (a write after the removal would make its directories
#: again).
_writing: collections.Counter[str] = collections.Counter()
_writing_lock = threading.Lock()


def write_zarr_region(block: Any, region: tuple[slice, ...], array: Any, root: str
                      ) -> np.ndarray:
    """Write one computed block into its region of the Zarr array stored at ``root`` (whole
    chunks of it): the bytes written, as a one-element array per block. A CuPy block comes to
    the host through a pinned buffer; chunks stored raw (:func:`_raw_chunks`) are written
    straight from the block into their files."""
    with _writing_lock:
        _writing[root] += 1
    try:
        _check_still_there(root)
        run_chunk(ChunkWork(
            "a chunk written to a Zarr store", stage=False,
            on_cpu=lambda: _host_block_to_store(np.asarray(block, dtype=array.dtype), region,
                                                array, root),
            on_device=lambda: _device_block_to_store(block, region, array, root)), [block])
        _check_still_there(root)
    finally:
        with _writing_lock:
            _writing[root] -= 1
    return np.full((1,) * len(region), block.size * array.dtype.itemsize, dtype=np.int64)


def _device_block_to_store(block: Any, region: tuple[slice, ...], array: Any, root: str) -> None:
    """D2H into a pinned buffer, then written from there: no other host copy."""
    import cupy

    from .staging import copy_to_host, pinned_pool

    block = cupy.ascontiguousarray(block.astype(array.dtype, copy=False))
    stream = cupy.cuda.get_current_stream()
    with pinned_pool.borrow(block.dtype, block.shape) as buf:
        copy_to_host(buf, block, stream)
        stream.synchronize()
        _host_block_to_store(buf, region, array, root)


def _raw_chunks(array: Any) -> bool:
    """Whether ``array``'s chunks are stored as their bytes, C order, native little-endian, no
    filter or compressor (what ``to_zarr`` writes uncompressed): then a chunk's file is its
    values' bytes, and a whole chunk can be written without zarr's encoding copy."""
    metadata = array.metadata
    dtype = np.dtype(array.dtype)
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and not np.little_endian):
        return False
    if metadata.zarr_format == 2:
        return (metadata.compressor is None and not metadata.filters
                and metadata.order == "C")
    codecs = getattr(metadata, "codecs", ())
    return (len(codecs) == 1 and type(codecs[0]).__name__ == "BytesCodec"
            and str(getattr(codecs[0].endian, "value", "little") or "little") == "little")


def _write_file(path: str, data: np.ndarray) -> None:
    """``data``'s bytes, C order, into a new file at ``path``: rows gathered by ``writev`` where
    only the leading axes are strided (no copy), else one contiguous write."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if data.ndim >= 2 and not data.flags.c_contiguous and data[0].flags.c_contiguous:
        pieces = [memoryview(np.ascontiguousarray(row)).cast("B") for row in data]
    else:
        pieces = [memoryview(c_ordered(data)).cast("B")]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        batch = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
        for start in range(0, len(pieces), batch):
            group = pieces[start:start + batch]
            written = os.writev(fd, group)
            for piece in group:  # a short write: the rest piece by piece
                if written >= piece.nbytes:
                    written -= piece.nbytes
                    continue
                rest = piece[written:]
                while rest.nbytes:
                    rest = rest[os.write(fd, rest):]
                written = 0
    finally:
        os.close(fd)


def _host_block_to_store(block: np.ndarray, region: tuple[slice, ...], array: Any, root: str
                         ) -> None:
    """Each chunk of ``region`` (aligned to chunk boundaries, as ``to_zarr`` and the slab
    writers cut them): a whole chunk of a raw store straight into its file, the rest (edge
    chunks, which zarr stores padded, and other encodings) through zarr."""
    if block.size == 0:  # the upper layout's last strip has nothing under the diagonal
        return
    raw = _raw_chunks(array)
    with in_flight("file-writes"):  # as .npy chunks: one sequential stream per process
        if not raw:
            array[region] = block
            return
        chunks, shape = array.chunks, array.shape
        first = [r.start // c for r, c in zip(region, chunks)]
        last = [-(-r.stop // c) for r, c in zip(region, chunks)]
        for coords in np.ndindex(*(b - a for a, b in zip(first, last))):
            coords = tuple(a + i for a, i in zip(first, coords))
            lo = [c * size for c, size in zip(coords, chunks)]
            hi = [min(a + size, n) for a, size, n in zip(lo, chunks, shape)]
            local = tuple(slice(a - r.start, b - r.start) for a, b, r in zip(lo, hi, region))
            if any(b - a != size for a, b, size in zip(lo, hi, chunks)):  # an edge chunk
                array[tuple(slice(a, b) for a, b in zip(lo, hi))] = block[local]
                continue
            key = array.metadata.encode_chunk_key(coords)
            _write_file(os.path.join(root, *key.split("/")), block[local])


def _write_block(block: Any, array: Any, root: str, block_info: dict) -> np.ndarray:
    region = tuple(slice(start, stop) for start, stop in block_info[0]["array-location"])
    return write_zarr_region(block, region, array, root)


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
    not), so each task writes whole chunks, by the worker that computed them; the store is
    renamed onto ``path`` only once every chunk is written.

    Parameters
    ----------
    x
        Dask, NumPy or CuPy array of numbers.
    path
        The store to write (its directory must exist; a name ending in ``.zarr``).
    overwrite
        Replace the Zarr store at ``path`` (only once the new one is complete; anything other
        than a Zarr store is never replaced).
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
    target = Path(os.path.abspath(os.fspath(path)))
    x = asarray(x)
    dtype = np.dtype(x.dtype)
    if dtype.hasobject or dtype.kind in "OUSTV":
        raise TypeError(f"cannot write {dtype} values to a Zarr store here; numbers only")
    chunks = _regular(x.chunks)
    if chunks is None:
        chunks = tuple(max(max(blocks, default=1), 1) for blocks in x.chunks)
        x = x.rechunk(chunks)
    with zarr_in_place(target, dtype, x.shape, chunks, overwrite, compression,
                       zarr_format) as array:
        written = x.map_blocks(
            _write_block, dtype=np.int64, meta=np.empty((0,) * x.ndim, np.int64),
            chunks=tuple((1,) * n for n in x.numblocks), **map_blocks_prefix("to-zarr"),
            array=array, root=str(array.store_path.store.root))
        run_writes(written, progress)
    return target


def region_writer(array: Any) -> Callable[..., np.ndarray]:
    """``writer(block, region=)`` into ``array`` (a picklable partial of
    :func:`write_zarr_region`)."""
    return functools.partial(write_zarr_region, array=array,
                             root=str(array.store_path.store.root))
