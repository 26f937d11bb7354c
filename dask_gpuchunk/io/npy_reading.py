""".npy files larger than memory, in: the header read and checked once on the client, then
each task reading only its own region where it runs (``from_npy``, :class:`NpyReader`).

``from_npy`` reads the header once, on the client, and checks the file (magic string, header,
dtype, size); each task then reads only its own region, on whichever worker runs it (workers
must see the same path), with large sequential ``preadv`` calls straight into a new array. Where
the worker sees a GPU, that array is page-locked (CuPy's pinned pool): the file is read straight
into the buffer that goes to the device, and the GPU path sends it with no staging copy.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import math
import mmap
import os
import stat
import struct
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import dask.array as da
import numpy as np
from dask.array.core import normalize_chunks
from dask.base import tokenize

from .. import config
from ..c_library import advise, map_memory, unmap
from ..devices import gpu_available
from ..runtime.staging import pinned_pool
from .files import FileIdentity, check_unchanged, identity, open_pinned

__all__ = ["NpyFormatError", "NpyHeader", "NpyReader", "NpyTrailingDataWarning", "checked_chunks", "from_npy", "in_flight", "inputs_of", "npy_reader_of", "read_header", "with_row_chunks"]

_log = logging.getLogger("dask_gpuchunk")


class NpyFormatError(ValueError):
    """A file that is not a readable ``.npy`` file (bad magic, header or size, object dtype)."""


class NpyHeader(NamedTuple):
    """What a ``.npy`` header says, and where the data starts."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    offset: int

    @property
    def nbytes(self) -> int:
        # Python's integers: a lying header's (2**32, 2**32) must not wrap around to 0.
        return math.prod(self.shape) * self.dtype.itemsize


class NpyTrailingDataWarning(UserWarning):
    """A ``.npy`` file longer than its header says: the bytes after the data are not read
    (``np.load`` ignores them too), but the header may not describe the data."""


#: Each format version's header-length field and text encoding (NumPy writes 3.0 for headers
#: that need UTF-8, such as non-ASCII field names).
_HEADER_FORMATS = {(1, 0): ("<H", "latin1"), (2, 0): ("<I", "latin1"), (3, 0): ("<I", "utf8")}

#: Longest header read: NumPy's own reader stops at 10,000 bytes by default; this admits the
#: long headers that structured dtypes of many fields make, and refuses gigabytes of text.
MAX_HEADER_BYTES = 1 << 20


def _header_fields(f: Any, version: tuple[int, int]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Shape, Fortran order and dtype from the header that follows the magic string, for every
    format version NumPy writes; ``ValueError`` saying what is wrong otherwise."""
    if version not in _HEADER_FORMATS:
        raise ValueError(f"format version {version[0]}.{version[1]} is not one NumPy writes "
                         "(1.0, 2.0, 3.0)")
    length_format, encoding = _HEADER_FORMATS[version]
    raw = f.read(struct.calcsize(length_format))
    if len(raw) < struct.calcsize(length_format):
        raise ValueError("the file ends inside its header")
    (length,) = struct.unpack(length_format, raw)
    if length > MAX_HEADER_BYTES:
        raise ValueError(f"its header claims {length:,} bytes (at most {MAX_HEADER_BYTES:,} "
                         "are read)")
    text = f.read(length)
    if len(text) < length:
        raise ValueError("the file ends inside its header")
    fields = ast.literal_eval(text.decode(encoding))
    if not isinstance(fields, dict) or set(fields) != {"descr", "fortran_order", "shape"}:
        raise ValueError("its header is not a dict of descr, fortran_order and shape")
    shape, fortran = fields["shape"], fields["fortran_order"]
    if not isinstance(shape, tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ValueError(f"shape {shape!r} is not a tuple of sizes")
    if not isinstance(fortran, bool):
        raise ValueError(f"fortran_order {fortran!r} is not True or False")
    return shape, fortran, np.lib.format.descr_to_dtype(fields["descr"])


_seen: set[tuple[str, int, int, int]] = set()


def _first_look(path: Path, st: os.stat_result) -> bool:
    """Whether this process reads this very file (path, inode, size, time) for the first time:
    a job reads a header more than once, and one warning about a file is enough."""
    key = (os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    first = key not in _seen
    _seen.add(key)
    return first


def read_header(path: str | os.PathLike) -> NpyHeader:
    """Read and check the header of a ``.npy`` file (format versions 1.0, 2.0 and 3.0) against
    the file's size.

    A file longer than its header says is read as ``np.load`` reads it (the data the header
    describes), with an :class:`NpyTrailingDataWarning`.

    Raises
    ------
    FileNotFoundError, IsADirectoryError, PermissionError
        The path cannot be read, or is not a regular file (a FIFO, a device: reading one could
        wait forever).
    NpyFormatError
        Not a ``.npy`` file, an unreadable header, an object dtype (cannot be memory-mapped) or
        a file shorter than its header says.

    Examples
    --------
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "a.npy")
    >>> np.save(path, np.zeros((3, 4), dtype=np.float32))
    >>> h = read_header(path)
    >>> h.shape, h.dtype, h.fortran_order, h.offset
    ((3, 4), dtype('float32'), False, 128)
    """
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(f"{path} is a directory, not a .npy file")
    if not stat.S_ISREG(st.st_mode):
        raise PermissionError(f"{path} is not a regular file (a FIFO, socket or device); only "
                              "files are read")
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
        except ValueError as exc:
            raise NpyFormatError(f"{path} is not a .npy file (no NumPy magic string at its start)") from exc
        try:
            shape, fortran, dtype = _header_fields(f, version)
        except Exception as exc:  # noqa: BLE001 - whatever the parser raises, the header is bad
            raise NpyFormatError(f"{path} has a corrupt .npy header ({exc})".splitlines()[0]) from exc
        offset = f.tell()
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise NpyFormatError(f"{path} holds Python objects ({dtype}), which cannot be memory-mapped")
    header = NpyHeader(tuple(int(s) for s in shape), dtype, bool(fortran), offset)
    size = os.stat(path).st_size
    if size < offset + header.nbytes:
        raise NpyFormatError(
            f"{path} is truncated: its header says {header.shape} {dtype} "
            f"({offset + header.nbytes:,} bytes with the header), the file has {size:,} bytes"
        )
    if size > offset + header.nbytes and _first_look(path, st):
        warnings.warn(f"{path} has {size - offset - header.nbytes:,} bytes after the data its "
                      f"header describes ({header.shape} {dtype}); they are not read",
                      NpyTrailingDataWarning, stacklevel=2)
    return header


def _native(dtype: np.dtype) -> np.dtype:
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def _region_runs(header: NpyHeader, region: tuple[slice, ...]) -> tuple[int, list[int]]:
    """Bytes per contiguous run of ``region`` in a C-order file, and each run's file offset.

    The trailing axes that the region covers whole make its runs contiguous: one run for a
    chunk of whole rows, one per row for a block of a matrix. Runs come in C order, so run
    ``r`` is bytes ``[r * run, (r + 1) * run)`` of the C-contiguous chunk.
    """
    shape = header.shape
    starts = [s.indices(n)[0] for s, n in zip(region, shape)]
    lens = [len(range(*s.indices(n))) for s, n in zip(region, shape)]
    k = len(shape) - 1  # the runs span axes k.. (k covered partly, later axes whole)
    while k >= 0 and lens[k] == shape[k] and starts[k] == 0:
        k -= 1
    k = max(k, 0)
    strides = [int(np.prod(shape[a + 1:], dtype=np.int64)) for a in range(len(shape))]
    run = int(np.prod(lens[k:], dtype=np.int64)) * header.dtype.itemsize
    first = sum(st * sd for st, sd in zip(starts, strides))
    if k == 0 or not shape:
        return run, [header.offset + first * header.dtype.itemsize]
    grid = np.indices(lens[:k], dtype=np.int64).reshape(k, -1)
    elements = first + (grid * np.array(strides[:k], dtype=np.int64)[:, None]).sum(axis=0)
    return run, (header.offset + elements * header.dtype.itemsize).tolist()


def _each_run(transfer: Callable[[memoryview, int], int], raw: memoryview, run: int,
              offsets: list[int], threads: int = 1) -> bool:
    """``transfer(view, file_offset)`` (a ``preadv`` or ``pwrite``) over run ``r`` of ``raw``
    at ``offsets[r]``, again for the rest while it moves fewer bytes than asked. False if it
    moved nothing (end of file, full disk). ``threads`` above 1: runs of at least two
    :data:`READ_PIECE_BYTES` are cut into pieces of that size, moved by that many threads of a
    pool at once (:func:`_piece_pool`)."""
    if threads > 1 and run >= 2 * READ_PIECE_BYTES:
        pieces = [(raw[r * run + start:r * run + min(start + READ_PIECE_BYTES, run)],
                   offset + start)
                  for r, offset in enumerate(offsets) for start in range(0, run, READ_PIECE_BYTES)]
        return all(_piece_pool(threads).map(lambda piece: _move(transfer, *piece), pieces))
    return all(_move(transfer, raw[r * run:(r + 1) * run], offset)
               for r, offset in enumerate(offsets))


def _move(transfer: Callable[[memoryview, int], int], view: memoryview, offset: int) -> bool:
    while view:
        moved = transfer(view, offset)
        if moved == 0:
            return False
        view, offset = view[moved:], offset + moved
    return True


#: The size of the pieces that several threads read of one large region
#: (``gpuchunk.file-read-threads``).
READ_PIECE_BYTES = 16 << 20


_piece_pools: dict[tuple[int, int], Any] = {}


def _piece_pool(threads: int) -> Any:
    """The process's pool of ``threads`` threads for the pieces of large reads (made once per
    size and process: a forked child has none of its parent's threads, so it makes its own;
    the threads only copy, never wait on the tasks that use them)."""
    from concurrent.futures import ThreadPoolExecutor

    key = (os.getpid(), threads)
    with _slots_lock:
        pool = _piece_pools.get(key)
        if pool is None:
            pool = _piece_pools[key] = ThreadPoolExecutor(
                threads, thread_name_prefix="gpuchunk-read")
    return pool


def _host_array(shape: tuple[int, ...], dtype: np.dtype, pinned: bool | None = None) -> np.ndarray:
    """A new host array; page-locked (lent by the pinned pool) if ``pinned``, or, for ``None``,
    where a GPU is visible, so that the GPU path sends it with no staging copy."""
    if pinned or (pinned is None and gpu_available()):
        return pinned_pool.lend(shape, dtype)
    return np.empty(shape, dtype)


_slots: dict[tuple[str, int], threading.Semaphore] = {}


_slots_lock = threading.Lock()


def in_flight(setting: str) -> contextlib.AbstractContextManager:
    """Hold one of the ``gpuchunk.<setting>`` slots of this process (``file-reads``: region
    reads at once, ``file-writes``: chunk writes at once; 0: no limit), read when used."""
    limit = int(config.get(setting) or 0)
    if limit <= 0:
        return contextlib.nullcontext()
    with _slots_lock:
        slots = _slots.get((setting, limit))
        if slots is None:
            slots = _slots[(setting, limit)] = threading.Semaphore(limit)
    return slots


def _open_to_read(path: str, pinned_file: FileIdentity | None) -> int:
    """A descriptor to read ``path``, checked against ``pinned_file`` where given
    (:class:`InputChangedError` where the file changed since)."""
    return open_pinned(path, pinned_file) if pinned_file is not None else os.open(path, os.O_RDONLY)


def _read_region(path: str, header: NpyHeader, region: tuple[slice, ...],
                 pinned: bool | None = None, pinned_file: FileIdentity | None = None) -> np.ndarray:
    """Read one region of the file into a new (pinned where a GPU is visible) array.

    ``preadv`` of each contiguous run, straight into the array: large sequential reads, no
    page faults, no other copy. Fortran-order or big-endian files are read through a memory
    map instead (a strided region, or a conversion, needs a copy anyway). ``pinned_file``: the
    file's identity when the graph was built (:class:`InputChangedError` where it changed).
    """
    shape = tuple(len(range(*s.indices(n))) for s, n in zip(region, header.shape))
    if header.nbytes == 0 or 0 in shape:
        return np.empty(shape, dtype=_native(header.dtype))
    fd = _open_to_read(path, pinned_file)
    if header.fortran_order or not header.dtype.isnative:
        with open(fd, "rb") as f:  # the map outlives the descriptor
            mm = np.memmap(f, dtype=header.dtype, mode="r", offset=header.offset,
                           shape=header.shape, order="F" if header.fortran_order else "C")
        view = mm[region] if region else mm  # a 0-d memmap indexed by () would be a scalar
        out = _host_array(shape, _native(header.dtype), pinned)
        out[...] = view
        return out
    out = _host_array(shape, header.dtype, pinned)
    raw = memoryview(out.reshape(-1).view(np.uint8))
    run, offsets = _region_runs(header, region)
    try:
        with in_flight("file-reads"):
            if not _each_run(lambda view, offset: os.preadv(fd, [view], offset), raw, run, offsets,
                             int(config.checked("file-read-threads"))):
                raise NpyFormatError(f"{path} ended before its data (truncated?)")
    finally:
        os.close(fd)
    return out


#: cudaHostRegisterReadOnly, and the device attribute that says a device takes it.
_REGISTER_READ_ONLY = 8

_READ_ONLY_REGISTER_SUPPORTED = 113

_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


# Devices of this process that refused a read-only registration: they read into pinned buffers.
_register_refused: set[int] = set()


def _rows_on_device(path: str, header: NpyHeader, row_bytes: int, start: int, stop: int,
                    pinned_file: FileIdentity | None) -> Any:
    """Rows ``start:stop`` of a C-order, native-endian ``.npy`` as a CuPy array on the current
    device, copied by the GPU straight out of the page cache: the rows' bytes mapped read-only,
    page-locked where they lie (``cudaHostRegister``, read-only), one H2D copy, then unlocked.
    ``None`` where the device refuses such a registration (the caller reads them instead).

    No CPU copy into a pinned buffer: on an H200, 2.1 GB of words in 128 MiB chunks moved in
    0.10 s this way against 0.23 s read; four processes at once on 4 x H200, 0.26 s against
    0.33 s (``tools/staging_path_probe.py`` at 93972b0). Opt-in (``register-reads`` of ``config.INTERNAL``): the
    4-GPU Gram was no faster end to end, and a cold file is not measured.
    """
    import cupy

    device = cupy.cuda.runtime.getDevice()
    if device in _register_refused:
        return None
    if not cupy.cuda.runtime.deviceGetAttribute(_READ_ONLY_REGISTER_SUPPORTED, device):
        _register_refused.add(device)
        return None
    offset, nbytes = header.offset + start * row_bytes, max(stop - start, 0) * row_bytes
    out = cupy.empty((max(stop - start, 0), *header.shape[1:]), header.dtype)
    if nbytes == 0:
        return out
    fd = _open_to_read(path, pinned_file)
    try:
        if os.fstat(fd).st_size < offset + nbytes:  # a map past the end faults (SIGBUS)
            raise NpyFormatError(f"{path} ended before its data (truncated?)")
        with in_flight("file-reads"), _mapped_read_only(fd, offset, nbytes) as address:
            if not _copy_registered(address, nbytes, out, device):
                return None
    finally:
        os.close(fd)
    return out


@contextlib.contextmanager
def _mapped_read_only(fd: int, offset: int, nbytes: int) -> Iterator[int]:
    """The address of bytes ``offset:offset + nbytes`` of ``fd`` mapped read-only (through the
    C library: a Python ``mmap`` refuses to close while another thread's sampled frame still
    holds an array over it, as distributed's profiler does), read ahead by the kernel."""
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    length = offset + nbytes - base
    address = map_memory(length, mmap.PROT_READ, mmap.MAP_SHARED, fd, base)
    try:
        # Read ahead by the kernel, not page by page as the registration faults them in.
        advise(address, length, mmap.MADV_WILLNEED)
        yield address + offset - base
    finally:
        unmap(address, length)


def _copy_registered(address: int, nbytes: int, out: Any, device: int) -> bool:
    """Copy ``nbytes`` of host memory at ``address`` into the CuPy array ``out`` with them
    page-locked for the copy (read-only); ``False``, and ``device`` noted, where the
    registration is refused."""
    import cupy

    runtime = cupy.cuda.runtime
    try:
        runtime.hostRegister(address, nbytes, _REGISTER_READ_ONLY)
    except runtime.CUDARuntimeError:
        _register_refused.add(device)
        return False
    try:
        stream = cupy.cuda.get_current_stream()
        runtime.memcpyAsync(out.data.ptr, address, nbytes, _HOST_TO_DEVICE, stream.ptr)
        stream.synchronize()
    finally:
        runtime.hostUnregister(address)
    return True


def from_npy(path: str | os.PathLike, chunks: Any = "auto", *, pinned: bool | None = None) -> da.Array:
    """A Dask array over a ``.npy`` file, read chunk by chunk: each task reads its own region
    with large sequential reads into a new array (Fortran-order and big-endian files through a
    memory map), so that the whole file is never in memory.

    Parameters
    ----------
    path
        The file. Workers of a cluster read it themselves, so they must see it at this path.
    chunks
        As for :func:`dask.array.from_array` (``"auto"``, a block shape, a byte size such as
        ``"200 MiB"``). Row chunks (whole rows) suit C-order files; Fortran-order files are
        read too, each chunk a strided region.
    pinned
        Read chunks into page-locked memory (``True``), pageable memory (``False``), or, by
        default, page-locked where the worker sees a GPU. Page-locked chunks go to the device
        with no staging copy, but locking pages costs time when the memory is first allocated:
        chunks that will run on the CPU (a memory-bound product, which ``device="auto"`` puts
        there) are better read into pageable memory.

    Returns
    -------
    dask.array.Array
        NumPy chunks in native byte order (big-endian files are converted chunk by chunk).

    Raises
    ------
    FileNotFoundError, IsADirectoryError, NpyFormatError
        See :func:`read_header`.

    Examples
    --------
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "a.npy")
    >>> np.save(path, np.arange(12.0).reshape(4, 3))
    >>> x = from_npy(path, chunks=(2, 3))
    >>> x.chunks, float(x.sum().compute())
    (((2, 2), (3,)), 66.0)
    """
    path = os.path.abspath(os.fspath(path))
    header = read_header(path)
    dtype = _native(header.dtype)
    chunks = checked_chunks(chunks, header.shape, dtype)
    reader = NpyReader(path, header, pinned, identity(path))
    return _reader_array(reader, chunks, np.empty((0,) * len(chunks), dtype))


def _reader_array(reader: NpyReader, chunks: tuple[tuple[int, ...], ...], meta: Any
                  ) -> da.Array:
    """The Dask array of :func:`from_npy` over ``reader`` in ``chunks`` (named by both, so
    that :func:`npy_reader_of` finds the reader)."""
    kwargs = {} if da.array_expr_enabled() else {"name": f"from-npy-{tokenize(reader, chunks)}"}
    return da.from_array(reader, chunks=chunks, asarray=False, fancy=False, meta=meta, **kwargs)


def with_row_chunks(x: da.Array, row_chunks: tuple[int, ...]) -> da.Array:
    """``x`` in row chunks ``row_chunks`` (whole rows): a :func:`from_npy` array as it was made
    stays one (its reader, the same checks of the file), so that an operator still reads its
    chunks itself (:func:`npy_reader_of`); any other array through ``rechunk``.

    Examples
    --------
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "w.npy")
    >>> np.save(path, np.arange(12, dtype=np.uint8).reshape(6, 2))
    >>> y = with_row_chunks(from_npy(path, chunks=(2, -1)), (4, 2))
    >>> y.chunks, int(y.sum().compute())
    (((4, 2), (2,)), 66)
    """
    if tuple(row_chunks) == tuple(x.chunks[0]):
        return x
    reader = npy_reader_of(x)
    if reader is None:
        return x.rechunk({0: tuple(row_chunks)})
    return _reader_array(reader, (tuple(row_chunks), *x.chunks[1:]), x._meta)


def npy_reader_of(x: Any, whole_rows: bool = True) -> NpyReader | None:
    """The reader of ``x`` where ``x`` is a :func:`from_npy` array as it was made (no operation
    since; ``whole_rows``: 2-D, whole rows in each chunk; outside dask's array query planning),
    else ``None``: an operator may then read its chunks itself
    (:class:`dask_gpuchunk.runtime.resident.ResidentSource`, or a region a task) instead of through
    ``x``'s tasks.

    Examples
    --------
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "w.npy")
    >>> np.save(path, np.zeros((4, 3), np.uint8))
    >>> reader = npy_reader_of(from_npy(path, chunks=(2, -1)))
    >>> reader is None or reader.shape == (4, 3)  # None under dask's array query planning
    True
    >>> npy_reader_of(from_npy(path, chunks=(2, -1)) + 1) is None
    True
    """
    if not isinstance(x, da.Array) or da.array_expr_enabled():
        return None
    if whole_rows and (x.ndim != 2 or len(x.chunks[1]) != 1):
        return None
    layers = getattr(x.__dask_graph__(), "layers", None)
    original = "original-" + x.name
    if layers is None or set(layers) != {x.name, original}:
        return None
    values = [getattr(v, "value", v) for v in layers[original].values()]
    reader = values[0] if len(values) == 1 else None
    return reader if isinstance(reader, NpyReader) else None


class NpyReader:
    """A ``.npy`` file as :func:`dask.array.from_array` reads it: each chunk a region read
    when its task runs (:func:`_read_region`), checked against the file's identity when the
    reader was made (``pinned_file``: :class:`~dask_gpuchunk.io.files.InputChangedError` where it
    changed). What :func:`to_npy` finds in a graph to check its inputs once more at the end.
    """

    __slots__ = ("path", "header", "pinned", "pinned_file", "shape", "dtype", "ndim")

    def __init__(self, path: str, header: NpyHeader, pinned: bool | None,
                 pinned_file: FileIdentity) -> None:
        self.path, self.header, self.pinned, self.pinned_file = path, header, pinned, pinned_file
        self.shape, self.dtype, self.ndim = header.shape, _native(header.dtype), len(header.shape)

    def __getitem__(self, region: tuple[slice, ...]) -> np.ndarray:
        return _read_region(self.path, self.header, region, self.pinned, self.pinned_file)

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row (of the first axis)."""
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def rows_on_device(self, start: int, stop: int) -> Any:
        """Rows ``start:stop`` as a CuPy array on the current device, copied by the GPU out of
        the page cache with no host copy (:func:`_rows_on_device`), or ``None`` where that
        cannot be: a Fortran-order or byte-swapped file, ``register-reads`` off, or a
        device that refuses read-only registrations (read them with ``self[...]`` instead)."""
        if (self.header.fortran_order or not self.header.dtype.isnative or not self.ndim
                or not config.flag("register-reads")):
            return None
        return _rows_on_device(self.path, self.header, self.row_nbytes, start, stop,
                               self.pinned_file)

    def check_unchanged(self) -> None:
        """:class:`~dask_gpuchunk.io.files.InputChangedError` where the file is no longer the
        one pinned."""
        check_unchanged(self.path, self.pinned_file)

    def __dask_tokenize__(self) -> tuple:
        return ("dask-gpuchunk-npy", self.path, self.pinned_file, self.pinned)


def checked_chunks(chunks: Any, shape: tuple[int, ...], dtype: np.dtype) -> tuple[tuple[int, ...], ...]:
    """``normalize_chunks``, refusing what does not tile ``shape`` (negative sizes other than
    -1, blocks that do not add up)."""
    if isinstance(chunks, (tuple, list)) and any(
            isinstance(c, (int, np.integer)) and (c < -1 or c == 0) for c in chunks):
        raise ValueError(f"chunks={chunks!r}: a block size must be positive, or -1 for the whole "
                         "axis")
    normalized = normalize_chunks(chunks, shape, dtype=dtype)
    for axis, (blocks, n) in enumerate(zip(normalized, shape)):
        if any(b < 0 for b in blocks) or sum(blocks) != n or (n and 0 in blocks):
            raise ValueError(f"chunks={chunks!r} do not tile axis {axis} of length {n}")
    return normalized


def inputs_of(x: Any) -> list[Any]:
    """The file inputs that Dask collection ``x`` reads, pinned when they were opened: the
    readers (:class:`NpyReader`, :class:`dask_gpuchunk.io.zarr_files.ZarrReader`) found among
    the graph's values (each reader is one value, which the chunks' tasks refer to), each with
    a ``check_unchanged()`` that a job calls before it publishes its output."""
    found: dict[int, Any] = {}
    if not hasattr(x, "__dask_graph__"):
        return []
    graph = x.__dask_graph__()
    # A reader is a value of a materialized layer (from_array's); the layers not yet listed
    # (Blockwise) hold tasks only, and listing them here would list them twice.
    layers = getattr(graph, "layers", None)
    values = (v for layer in layers.values() if layer.is_materialized() for v in layer.values()
              ) if layers is not None else dict(graph).values()
    for value in values:
        value = getattr(value, "value", value)  # a DataNode holds the object as its value
        if callable(getattr(value, "check_unchanged", None)) and hasattr(value, "path"):
            found.setdefault(id(value), value)
    return list(found.values())
