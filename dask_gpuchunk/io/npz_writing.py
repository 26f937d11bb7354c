""".npz files larger than memory, out: ``to_npz``.

A ``.npz`` is a zip archive of ``.npy`` members, stored uncompressed (what ``np.savez``
writes). Every member's size is known before any chunk is computed, so the archive is laid out
first: each member's zip header, its ``.npy`` header, then its rows. Each chunk is written into
its place in a temporary file beside the target by the worker that computed it, which returns
the CRC-32 of the bytes it wrote; the writing process combines a member's CRCs
(:func:`crc32_combine`), writes the zip headers and the central directory, and renames the file
onto the target once it is whole. Nothing is gathered into the writing process: the top-10 of
10**8 rows is 12 GB of results, which ``np.savez`` needed in memory twice (the concatenated
chunks, then the archive's copy). Arrays whose chunk sizes are not known (a threshold's pairs)
are computed and kept where they are (``persist``) to learn them, then written.

Members are zip64 entries (``np.savez``'s local headers are too; its central directory uses
zip64 records only where sizes need them), in native byte order, C order.
"""

from __future__ import annotations

import functools
import math
import os
import struct
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import dask
import numpy as np

from ..arrays import asarray
from ..config import map_blocks_prefix
from ..runtime.backend import to_host
from .files import open_same, publish
from .npy_reading import _each_run, _native, in_flight, inputs_of
from .npy_writing import check_target, npy_header_bytes, run_writes, temporary_output

__all__ = ["crc32_combine", "npz_bytes", "to_npz", "write_npz"]

# The zip format's records (APPNOTE.TXT 4.3), little-endian, with zip64's extra fields.
_LOCAL = b"PK\x03\x04"
_CENTRAL = b"PK\x01\x02"
_END64 = b"PK\x06\x06"
_LOCATOR64 = b"PK\x06\x07"
_END = b"PK\x05\x06"
_LOCAL_FMT = "<4s5H3I2H"  # 30 bytes
_CENTRAL_FMT = "<4s6H3I5H2I"  # 46 bytes
_END64_FMT = "<4sQ2H2I4Q"  # 56 bytes
_LOCATOR64_FMT = "<4sIQI"  # 20 bytes
_END_FMT = "<4s4H2IH"  # 22 bytes
_LOCAL_EXTRA = "<2H2Q"  # zip64: the sizes (20 bytes)
_CENTRAL_EXTRA = "<2H3Q"  # zip64: the sizes and the local header's offset (28 bytes)
_ZIP64_VERSION = 45
_UNIX = 3 << 8
_UNKNOWN32 = 0xFFFFFFFF
_UTF8_NAMES = 1 << 11
_REGULAR_FILE = 0o100644 << 16

# CRC-32's polynomial, bit-reversed (zlib's).
_CRC32_POLY = 0xEDB88320


def _times(matrix: tuple[int, ...], vector: int) -> int:
    """``matrix`` (32 columns of bits over GF(2)) times ``vector``."""
    total = 0
    for column in matrix:
        if not vector:
            break
        if vector & 1:
            total ^= column
        vector >>= 1
    return total


def _composed(outer: tuple[int, ...], inner: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(outer, column) for column in inner)


@functools.lru_cache(maxsize=64)
def _zero_bytes_operator(nbytes: int) -> tuple[int, ...]:
    """What ``nbytes`` zero bytes do to a CRC-32 register, a 32 x 32 matrix over GF(2) (by
    squaring one byte's: ``log2(nbytes)`` products). A member's chunks mostly share a size,
    so a few of these serve every chunk of an archive."""
    step = (_CRC32_POLY, *(1 << n for n in range(31)))  # one zero bit
    for _ in range(3):
        step = _composed(step, step)  # 2, 4, 8 bits: a byte
    result = tuple(1 << n for n in range(32))
    while nbytes:
        if nbytes & 1:
            result = _composed(step, result)
        nbytes >>= 1
        if nbytes:
            step = _composed(step, step)
    return result


def crc32_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """The CRC-32 of bytes ``a + b`` from ``zlib.crc32(a)``, ``zlib.crc32(b)`` and
    ``len(b)``, as zlib's ``crc32_combine`` (which Python's ``zlib`` does not offer).

    Examples
    --------
    >>> a, b = b"bit-packed ", b"fingerprints"
    >>> crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    True
    """
    if length_b == 0:
        return crc_a
    return _times(_zero_bytes_operator(length_b), crc_a) ^ crc_b


class _Member(NamedTuple):
    """One ``.npy`` in the archive: where its zip header starts, its ``.npy`` header's bytes,
    its rows' offset in the file, and its size there (``.npy`` header and rows)."""
    name: bytes
    header_offset: int
    npy_header: bytes
    data_offset: int
    size: int


def _layout(names: list[str], arrays: list[Any]) -> tuple[list[_Member], int]:
    """Each member's place in the archive, and where the central directory starts."""
    members, offset = [], 0
    for name, x in zip(names, arrays):
        encoded = f"{name}.npy".encode()
        npy_header = npy_header_bytes(x.dtype, x.shape)
        start = offset + struct.calcsize(_LOCAL_FMT) + len(encoded) + struct.calcsize(_LOCAL_EXTRA)
        size = len(npy_header) + math.prod(x.shape) * x.dtype.itemsize
        members.append(_Member(encoded, offset, npy_header, start + len(npy_header), size))
        offset = start + size
    return members, offset


def npz_bytes(arrays: dict[str, Any]) -> int:
    """Bytes of the ``.npz`` that :func:`to_npz` writes of ``arrays`` (shapes known).

    Examples
    --------
    >>> arrays = {"indices": np.zeros((5, 3), np.int64), "scores": np.ones((5, 3), np.float32)}
    >>> npz_bytes(arrays)  # 120 + 60 bytes of rows, two .npy headers, the zip's records
    824
    """
    return _archive_bytes(*_layout(list(arrays), [_native_array_info(a) for a in arrays.values()]))


def _archive_bytes(members: list[_Member], directory: int) -> int:
    """The archive's size: its members, then the central directory from ``directory``."""
    entries = sum(struct.calcsize(_CENTRAL_FMT) + len(m.name) + struct.calcsize(_CENTRAL_EXTRA)
                  for m in members)
    return (directory + entries + struct.calcsize(_END64_FMT) + struct.calcsize(_LOCATOR64_FMT)
            + struct.calcsize(_END_FMT))


class _ArrayInfo(NamedTuple):
    shape: tuple[int, ...]
    dtype: np.dtype


def _native_array_info(x: Any) -> _ArrayInfo:
    return _ArrayInfo(tuple(int(n) for n in x.shape), _native(np.dtype(x.dtype)))


def _dos_time(seconds: float) -> tuple[int, int]:
    """A zip entry's modification time and date (MS-DOS format, local time, from 1980)."""
    t = time.localtime(seconds)
    year = min(max(t.tm_year, 1980), 2107)
    return (t.tm_hour << 11 | t.tm_min << 5 | t.tm_sec // 2,
            (year - 1980) << 9 | t.tm_mon << 5 | t.tm_mday)


def _zip_records(members: list[_Member], crcs: list[int], directory: int) -> tuple[
        list[tuple[int, bytes]], bytes]:
    """Each member's local header ``(offset, bytes)``, and the central directory with the
    archive's end records (written at ``directory``)."""
    mtime, mdate = _dos_time(time.time())
    headers, entries = [], []
    for m, crc in zip(members, crcs):
        flags = 0 if m.name.isascii() else _UTF8_NAMES
        local = struct.pack(_LOCAL_FMT, _LOCAL, _ZIP64_VERSION, flags, 0, mtime, mdate, crc,
                            _UNKNOWN32, _UNKNOWN32, len(m.name), struct.calcsize(_LOCAL_EXTRA))
        extra = struct.pack(_LOCAL_EXTRA, 1, 16, m.size, m.size)
        headers.append((m.header_offset, local + m.name + extra))
        entry = struct.pack(_CENTRAL_FMT, _CENTRAL, _UNIX | _ZIP64_VERSION, _ZIP64_VERSION, flags,
                            0, mtime, mdate, crc, _UNKNOWN32, _UNKNOWN32, len(m.name),
                            struct.calcsize(_CENTRAL_EXTRA), 0, 0, 0, _REGULAR_FILE, _UNKNOWN32)
        entries.append(entry + m.name + struct.pack(_CENTRAL_EXTRA, 1, 24, m.size, m.size,
                                                     m.header_offset))
    central = b"".join(entries)
    count = len(members)
    end64_at = directory + len(central)
    end = (struct.pack(_END64_FMT, _END64, struct.calcsize(_END64_FMT) - 12, _UNIX | _ZIP64_VERSION,
                       _ZIP64_VERSION, 0, 0, count, count, len(central), directory)
           + struct.pack(_LOCATOR64_FMT, _LOCATOR64, 0, end64_at, 1)
           + struct.pack(_END_FMT, _END, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                         min(len(central), _UNKNOWN32), _UNKNOWN32, 0))
    return headers, central + end


def _pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    raw = memoryview(data).cast("B")
    if raw and not _each_run(lambda view, at: os.pwrite(fd, view, at), raw, len(raw), [offset]):
        raise OSError(f"the disk took no more bytes at offset {offset}")


def _write_rows(block: Any, path: str, key: tuple[int, int, int], data_offset: int,
                row_bytes: int, row_starts: np.ndarray, member_dtype: np.dtype,
                block_id: tuple[int, ...] = ()) -> np.ndarray:
    """Write one chunk (whole rows, from the host or a GPU) at its rows' place in the archive
    ``path`` (opened only where it is still the file ``key`` names; ``row_starts``: each
    chunk's first row, an array, which the scheduler passes whole where it walks a tuple's
    items for every task; ``block_id``: the chunk's place, which dask gives cheaply where its
    ``block_info`` is a dictionary a task); return its CRC-32 as a one-element array of the
    block's rank (the writes then form an array)."""
    start = int(row_starts[block_id[0]]) if block_id else 0
    host = np.ascontiguousarray(to_host(block), dtype=member_dtype)
    raw = host.reshape(-1).view(np.uint8) if host.size and member_dtype.itemsize else b""
    crc = zlib.crc32(raw)
    if len(raw):
        fd = open_same(path, key)
        try:
            with in_flight("file-writes"):
                _pwrite_all(fd, raw, data_offset + start * row_bytes)
        finally:
            os.close(fd)
    return np.full((1,) * host.ndim, crc, dtype=np.int64)


def _whole_rows(name: str, x: Any) -> Any:
    """``x`` as a Dask array whose chunks hold whole rows (each a contiguous run of bytes in
    C order), in native byte order."""
    x = asarray(x)
    if any(math.isnan(n) for n in x.shape[1:]):
        raise ValueError(f"{name!r} has rows of unknown length ({x.shape}); only the number "
                         "of rows may be unknown")
    dtype = _native(np.dtype(x.dtype))
    if x.dtype != dtype:
        x = x.astype(dtype)
    if x.ndim > 1 and any(len(c) > 1 for c in x.chunks[1:]):
        x = x.rechunk({axis: -1 for axis in range(1, x.ndim)})
    return x


def _rows_of(block: Any) -> np.ndarray:
    return np.array([len(block)], dtype=np.int64)


def _rows_per_chunk(xs: list[Any]) -> list[tuple[int, ...]]:
    """Each array's rows per chunk (``(1,)`` for a 0-d one). Arrays whose counts are not known
    (a threshold's pairs) are computed and kept where they are first (``persist``, in the list
    in place), then their chunks' lengths computed where they are: none of their rows moves.
    ``compute_chunk_sizes`` would do the same, but dask's array query planning lacks it."""
    unknown = [i for i, x in enumerate(xs) if x.ndim and any(math.isnan(n) for n in x.chunks[0])]
    if unknown:
        persisted = dask.persist(*(xs[i] for i in unknown))
        for i, x in zip(unknown, persisted):
            xs[i] = x
        counts = dask.compute(*(
            x.map_blocks(_rows_of, dtype=np.int64, chunks=((1,) * x.numblocks[0],),
                         drop_axis=list(range(1, x.ndim)), meta=np.empty((0,), np.int64))
            for x in persisted))
    found = dict(zip(unknown, counts)) if unknown else {}
    return [tuple(int(n) for n in found[i]) if i in found
            else tuple(int(n) for n in x.chunks[0]) if x.ndim else (1,)
            for i, x in enumerate(xs)]


def write_npz(target: Path, arrays: dict[str, Any], overwrite: bool = False,
              progress: Callable[[int, int], None] | None = None) -> dict[str, tuple[int, ...]]:
    """:func:`to_npz` into the absolute path ``target``; returns each member's shape (a
    threshold's pairs are counted only as they are computed)."""
    if not arrays:
        raise ValueError("to_npz needs at least one array to write")
    for name, x in arrays.items():
        dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
        if dtype.hasobject:
            raise TypeError(f"cannot write {name!r}, an array of Python objects ({dtype}), to a "
                            ".npz file")
        if not name or "/" in name or "\\" in name:
            raise ValueError(f"member name {name!r}: give a file name without a folder")
    check_target(target, overwrite)  # before anything is computed; the room once sizes are known
    names = list(arrays)
    xs = [_whole_rows(name, arrays[name]) for name in names]
    rows = _rows_per_chunk(xs)
    infos = [_ArrayInfo((sum(r), *x.shape[1:]) if x.ndim else (), np.dtype(x.dtype))
             for x, r in zip(xs, rows)]
    members, directory = _layout(names, infos)
    check_target(target, overwrite, _archive_bytes(members, directory))
    readers = [reader for x in xs for reader in inputs_of(x)]
    with temporary_output(target) as (tmp, fd, key):
        writes = []
        row_bytes = [math.prod(info.shape[1:]) * info.dtype.itemsize for info in infos]
        for x, info, member, counts, size in zip(xs, infos, members, rows, row_bytes):
            _pwrite_all(fd, member.npy_header, member.data_offset - len(member.npy_header))
            writes.append(x.map_blocks(
                _write_rows, dtype=np.int64, meta=np.empty((0,) * x.ndim, np.int64),
                chunks=tuple((1,) * n for n in x.numblocks), **map_blocks_prefix("to-npz"),
                path=str(tmp), key=key, data_offset=member.data_offset, row_bytes=size,
                row_starts=np.cumsum((0, *counts[:-1]), dtype=np.int64),
                member_dtype=info.dtype))
        written = run_writes(writes, progress, results=True)
        crcs = []
        for member, counts, size, block_crcs in zip(members, rows, row_bytes, written):
            crc = zlib.crc32(member.npy_header)
            for rows_in_block, block_crc in zip(counts, np.ravel(block_crcs)):
                crc = crc32_combine(crc, int(block_crc), rows_in_block * size)
            crcs.append(crc)
        headers, central = _zip_records(members, crcs, directory)
        for offset, header in headers:
            _pwrite_all(fd, header, offset)
        _pwrite_all(fd, central, directory)
        for reader in readers:
            reader.check_unchanged()
        publish(tmp, target, key, overwrite)
    return {name: info.shape for name, info in zip(names, infos)}


def to_npz(path: str | os.PathLike, *, overwrite: bool = False,
           progress: Callable[[int, int], None] | None = None, **arrays: Any) -> Path:
    """Compute ``arrays`` and write them into a ``.npz`` file, chunk by chunk, never
    half-written: ``np.savez(path, **arrays)`` for arrays larger than memory.

    Each chunk is written into its place in a temporary file in the target's directory by the
    worker that computed it, and the file is renamed onto ``path`` once every chunk and the
    archive's index are there: no chunk passes through this process. The file is a zip of
    uncompressed ``.npy`` members, as ``np.savez`` writes, which ``np.load`` reads (each member
    whole); members are in native byte order. Runs on the current Dask scheduler (a
    ``distributed`` client's workers when one is active: they must see the target's
    directory). An array with unknown chunk sizes (as a threshold's pairs) is computed and
    kept where it is first, to learn them.

    Parameters
    ----------
    path
        The file to write (its directory must exist); named as given (``np.savez`` adds
        ``.npz`` where it is missing, this does not).
    overwrite
        Replace ``path`` if it exists (only once the new file is complete).
    progress
        Called as ``progress(chunks_written, chunks)`` while a distributed client's workers
        write (and once at the end otherwise).
    **arrays
        Dask, NumPy or CuPy arrays of any non-object dtype, each the member ``NAME.npy``.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    FileExistsError
        ``path`` exists and ``overwrite`` is false.
    FileNotFoundError, PermissionError, IsADirectoryError
        The directory is missing or not writable, or ``path`` is a directory.
    TypeError
        An array of Python objects (``np.savez`` would pickle it; this writes no pickles).
    Exception
        Whatever computing a chunk raised; the temporary file is removed first.

    Examples
    --------
    >>> import tempfile, os
    >>> import dask.array as da
    >>> path = os.path.join(tempfile.mkdtemp(), "nn.npz")
    >>> x = da.from_array(np.arange(12).reshape(4, 3), chunks=(3, 3))
    >>> _ = to_npz(path, indices=x, scores=(x / 2).astype(np.float32))
    >>> with np.load(path) as f:
    ...     f["indices"][1], f["scores"][3]
    (array([3, 4, 5]), array([4.5, 5. , 5.5], dtype=float32))
    """
    if os.fspath(path).endswith(("/", os.sep)):
        raise IsADirectoryError(f"{path} names a directory (it ends in /); give a file name for "
                                "the output")
    target = Path(os.path.abspath(os.fspath(path)))
    write_npz(target, arrays, overwrite, progress)
    return target

