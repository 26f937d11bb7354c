""".npy files larger than memory, in and out, chunk by chunk: ``from_npy`` and ``to_npy``.

``from_npy`` reads the header once, on the client, and checks the file (magic string, header,
dtype, size); each task then reads only its own region, on whichever worker runs it (workers
must see the same path), with large sequential ``preadv`` calls straight into a new array. Where
the worker sees a GPU, that array is page-locked (CuPy's pinned pool): the file is read straight
into the buffer that goes to the device, and the GPU path sends it with no staging copy.

``to_npy`` first checks that the target's file system has room for it, then writes the header
of the whole array into a temporary file next to the target (``.<name>.dgc-<writer>.partial``,
:mod:`dask_gpuchunk.partials`), then every chunk into its region of that file from the worker
that computed it (``pwrite`` of its contiguous runs; CuPy chunks land in a pinned buffer and are
written from there), and renames the file onto the target only when every chunk is written.
Writes go through the page cache like ``np.save``'s; the file is not synced to disk. A failure
removes the temporary file; a killed job leaves at most that hidden temporary file, never a
half-written target, and the next job writing the same target removes it once its writer is
gone.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import logging
import math
import mmap
import os
import stat
import struct
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import dask
import dask.array as da
import numpy as np
from dask.array.core import normalize_chunks
from dask.base import tokenize
from dask.utils import format_bytes

from . import config
from ._kernels.gram import c_ordered
from .arrays import asarray
from .backend import ChunkWork, run_chunk
from .c_library import advise, map_memory, unmap
from .config import map_blocks_prefix
from .devices import distributed_client_active, gpu_available
from .files import (
    FileIdentity,
    check_unchanged,
    create_exclusive,
    file_key,
    identity,
    open_pinned,
    open_same,
    publish,
    refuse_unless_regular,
)
from .partials import remove_stale, temporary_name
from .staging import copy_to_host, pinned_pool

__all__ = ["NoSpaceError", "NoWorkersError", "NpyFormatError", "NpyHeader",
           "NpyTrailingDataWarning", "check_output_directory", "check_space", "check_target",
           "checked_chunks", "from_npy", "in_flight", "inputs_of", "no_workers_timeout",
           "npy_bytes",
           "npy_in_place", "npy_reader_of", "read_header", "run_writes", "temporary_output",
           "with_row_chunks",
           "to_npy", "write_region"]


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
    0.33 s (``tools/staging_path_probe.py``). Opt-in (``register-reads`` of ``config.INTERNAL``): the
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
    (:class:`dask_gpuchunk.resident.ResidentSource`, or a region a task) instead of through
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
    reader was made (``pinned_file``: :class:`~dask_gpuchunk.files.InputChangedError` where it
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
        """:class:`~dask_gpuchunk.files.InputChangedError` where the file is no longer the
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
    readers (:class:`NpyReader`, :class:`dask_gpuchunk.zarr_files.ZarrReader`) found among
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


# ---- writing ---------------------------------------------------------------------------------


class NoSpaceError(OSError):
    """The output's file system has too little room for it (checked before any work)."""

    def __str__(self) -> str:
        return str(self.strerror)


#: Room asked for beyond an output's bytes: the file system's own metadata, and what other
#: writers take meanwhile.
SPACE_MARGIN_BYTES = 64 << 20
SPACE_MARGIN_SHARE = 0.01


def check_space(directory: Path, nbytes: int) -> None:
    """:class:`NoSpaceError` (``ENOSPC``) where ``directory``'s file system has less room
    than ``nbytes`` plus a margin (:data:`SPACE_MARGIN_BYTES` or :data:`SPACE_MARGIN_SHARE` of
    ``nbytes``, the larger; on a file system smaller than 20 x :data:`SPACE_MARGIN_BYTES`, a
    twentieth of its size at most) for this user. Outputs are written sparse, into a file
    first extended to its size: the file system would only fail when the data arrive."""
    try:
        fs = os.statvfs(directory)
    except OSError:
        return  # no statvfs here (or none for this path): writes will say
    available = fs.f_bavail * fs.f_frsize
    # A small file system (a 5 MiB tmpfs) has no 64 MiB to spare for anything.
    margin = min(SPACE_MARGIN_BYTES, fs.f_blocks * fs.f_frsize // 20)
    need = nbytes + max(margin, int(SPACE_MARGIN_SHARE * nbytes))
    if available < need:
        raise NoSpaceError(errno.ENOSPC, f"{directory} has {format_bytes(available)} free "
                           f"({available:,} bytes); the output needs {nbytes:,} bytes "
                           f"({format_bytes(nbytes)}) plus a margin of "
                           f"{format_bytes(need - nbytes)}; nothing was computed")


def check_output_directory(directory: Path) -> None:
    """``FileNotFoundError`` / ``PermissionError`` where an output's ``directory`` is missing or
    cannot be written in (tried by making a file there: the only sure test, for root too)."""
    if not directory.is_dir():
        raise FileNotFoundError(f"output directory {directory} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".dask-gpuchunk-probe-"):
            pass
    except OSError:
        raise PermissionError(f"output directory {directory} is not writable") from None


def check_target(path: Path, overwrite: bool, nbytes: int = 0) -> None:
    """Refuse, before any work, an output ``path`` that cannot be written: a directory, a
    missing or read-only directory, an existing file without ``overwrite``, something other
    than a regular file, or a file system without room for ``nbytes`` (:func:`check_space`;
    ``OSError`` subclasses naming the path)."""
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; give a file name for the output")
    check_output_directory(path.parent)
    if os.path.lexists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    refuse_unless_regular(path)
    if nbytes:
        check_space(path.parent, nbytes)


def npy_bytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a ``.npy`` file of ``shape`` and ``dtype``, its header included."""
    return 128 + math.prod(shape) * np.dtype(dtype).itemsize


def _write_header(fd: int, dtype: np.dtype, shape: tuple[int, ...]) -> NpyHeader:
    """Write a C-order ``.npy`` header into the new, empty file ``fd`` and extend the file to
    its full size (sparse, unwritten): the header. ``fd`` stays open."""
    fmt = np.lib.format
    header = {"descr": fmt.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)}
    with open(fd, "wb", closefd=False) as f:
        try:
            fmt.write_array_header_1_0(f, header)
        except ValueError:  # a header longer than 64 KiB (a very long shape or dtype)
            f.seek(0)
            f.truncate()
            fmt.write_array_header_2_0(f, header)
        offset = f.tell()
        f.truncate(offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    return NpyHeader(tuple(shape), dtype, False, offset)


def write_region(block: Any, path: str, header: NpyHeader, region: tuple[slice, ...],
                 key: tuple[int, int, int]) -> np.ndarray:
    """Write one computed chunk into its region of the temporary file, opened only where the
    path still names the file the job created (``key``, :func:`dask_gpuchunk.files.file_key`).

    Returns the bytes written, as a one-element array per chunk (so the writes form an array).
    """
    done = np.zeros((1,) * len(region), dtype=np.int64)
    if header.nbytes == 0 or block.size == 0:
        return done
    fd = open_same(path, key)

    def from_host() -> None:
        with in_flight("file-writes"):
            _pwrite_region(fd, np.asarray(block, dtype=header.dtype), header, region)

    try:
        run_chunk(ChunkWork("a chunk written to a file", on_cpu=from_host,
                            on_device=lambda: _device_to_file(block, fd, header, region),
                            stage=False), [block])
    finally:
        os.close(fd)
    done[...] = block.size * header.dtype.itemsize
    return done


def _pwrite_region(fd: int, block: np.ndarray, header: NpyHeader, region: tuple[slice, ...]) -> None:
    """``pwrite`` a chunk into its region of a C-order file: one call per contiguous run
    (:func:`_region_runs`), through the page cache, without a page fault per 4 KiB as a memory
    map would take. A transposed view (a Gram's mirrored block) is copied tile by tile."""
    block = c_ordered(block)
    raw = memoryview(block.reshape(-1).view(np.uint8))
    run, offsets = _region_runs(header, region)
    if not _each_run(lambda view, offset: os.pwrite(fd, view, offset), raw, run, offsets):
        raise OSError(f"the disk took no more bytes of a chunk at offset {offsets[0]}")


def _device_to_file(block: Any, fd: int, header: NpyHeader, region: tuple[slice, ...]) -> None:
    """D2H into a pinned buffer, then written to the file from there: no other host copy."""
    import cupy


    block = cupy.ascontiguousarray(block.astype(header.dtype, copy=False))
    stream = cupy.cuda.get_current_stream()
    with pinned_pool.borrow(block.dtype, block.shape) as buf:
        copy_to_host(buf, block, stream)
        stream.synchronize()
        with in_flight("file-writes"):
            _pwrite_region(fd, buf, header, region)


class NoWorkersError(TimeoutError):
    """A job's cluster has had no workers for :func:`no_workers_timeout` seconds."""


def no_workers_timeout() -> float:
    """Seconds a job waits for a cluster without workers to get one again before giving up
    (``gpuchunk.no-workers-timeout``, default 300; the CLI's ``--worker-timeout``)."""
    return float(config.get("no-workers-timeout"))


def run_writes(written: da.Array | list[Any],
               progress: Callable[[int, int], None] | None) -> None:
    """Compute every write task of ``written``: an array with one element per write, or a list
    of ``dask.delayed`` writes; on a distributed client, report ``progress(done, total)`` as
    each write finishes (``distributed.as_completed``), and give up with
    :class:`NoWorkersError` once the cluster has had no workers for
    :func:`no_workers_timeout` seconds."""
    if not distributed_client_active():
        total = len(written) if isinstance(written, list) else math.prod(written.numblocks)
        dask.compute(written)
        if progress is not None:
            progress(total, total)
        return
    from distributed import as_completed, default_client, futures_of

    client = default_client()
    futures = futures_of(client.persist(written))
    total, done = len(futures), 0
    completed = as_completed(futures)
    deserted = threading.Event()
    finished = threading.Event()

    def watch() -> None:
        # as_completed waits without a timeout: this thread ends the wait (by emptying it)
        # when the cluster stays without workers.
        alone_since: float | None = None
        while not finished.wait(1.0):
            if client.scheduler_info().get("workers"):
                alone_since = None
                continue
            alone_since = alone_since or time.monotonic()
            if time.monotonic() - alone_since > no_workers_timeout():
                deserted.set()
                completed.clear()
                return

    watchdog = threading.Thread(target=watch, name="dask-gpuchunk-no-workers", daemon=True)
    try:
        watchdog.start()
        if progress is not None:
            progress(0, total)
        for future in completed:
            if future.status == "error":
                break
            done += 1
            if progress is not None:
                progress(done, total)
        if deserted.is_set():
            raise NoWorkersError(
                f"the cluster has had no workers for {no_workers_timeout():g} s (the last one "
                f"left or died) with {total - done} of {total} chunks to go; nothing was written")
        client.gather(futures)  # raises what a failed chunk raised
    except BaseException:
        # Released, not cancelled: Client.cancel trips an assertion in distributed's scheduler
        # (stimulus_cancel, "assert ts.who_wants") for wanted keys whose dependents nobody
        # wants, as the rows layout's slabs that wait for earlier writes: after a chunk ran out
        # of device memory, the CLI's one-line error came with that traceback. Nobody wants
        # the released keys, so the scheduler drops what has not run.
        for future in futures:
            future.release()
        raise
    finally:
        finished.set()


def to_npy(x: Any, path: str | os.PathLike, *, overwrite: bool = False,
           progress: Callable[[int, int], None] | None = None) -> Path:
    """Compute ``x`` and write it into a ``.npy`` file, chunk by chunk, never half-written.

    Each chunk is written into its region of a temporary file in the target directory by the
    worker that computed it; the file is renamed onto ``path`` only once every chunk is there.
    Runs on the current Dask scheduler (a ``distributed`` client's workers when one is active:
    they must see the target directory).

    Parameters
    ----------
    x
        Dask, NumPy or CuPy array of any non-object dtype (written in native byte order).
    path
        The file to write (its directory must exist).
    overwrite
        Replace ``path`` if it exists (only once the new file is complete).
    progress
        Called as ``progress(chunks_written, chunks)`` while a distributed client's workers
        write (and once at the end otherwise).

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
    Exception
        Whatever computing a chunk raised; the temporary file is removed first.

    Examples
    --------
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "c.npy")
    >>> _ = to_npy(da.arange(10, chunks=4) * 2, path)
    >>> np.load(path)
    array([ 0,  2,  4,  6,  8, 10, 12, 14, 16, 18])
    """
    if os.fspath(path).endswith(("/", os.sep)):
        raise IsADirectoryError(f"{path} names a directory (it ends in /); give a file name for "
                                "the output")
    target = Path(os.path.abspath(os.fspath(path)))
    dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
    if dtype.hasobject:
        raise TypeError(f"cannot write an array of Python objects ({x.dtype}) to a .npy file")
    x = asarray(x)
    with npy_in_place(target, _native(dtype), x.shape, overwrite, x) as (tmp, header, key):
        written = x.map_blocks(
            _write_block, dtype=np.int64, meta=np.empty((0,) * x.ndim, np.int64),
            chunks=tuple((1,) * n for n in x.numblocks), **map_blocks_prefix("to-npy"), path=tmp,
            header=header, key=key)
        run_writes(written, progress)
    return target


def _write_block(block: Any, path: str, header: NpyHeader, key: tuple[int, int, int],
                 block_info: dict) -> np.ndarray:
    """:func:`write_region` of a block where dask says it lies in the array it comes from."""
    region = tuple(slice(start, stop) for start, stop in block_info[0]["array-location"])
    return write_region(block, path, header, region, key)


@contextlib.contextmanager
def npy_in_place(target: Path, dtype: np.dtype, shape: tuple[int, ...], overwrite: bool,
                 reads: Any = None) -> Iterator[tuple[str, NpyHeader, tuple[int, int, int]]]:
    """A ``.npy`` file written in pieces and published whole: ``(temporary path, header,
    key)`` for :func:`write_region`'s tasks, checked (:func:`check_target`) first. When the
    block ends, the ``.npy`` inputs that the Dask collection ``reads`` reads are checked
    unchanged and the file is renamed onto ``target``; removed if anything raises (never
    half-written). :func:`to_npy` writes through it."""
    check_target(target, overwrite, npy_bytes(dtype, shape))
    with _file_in_place(target, dtype, shape, overwrite, inputs_of(reads)) as placed:
        yield placed


@contextlib.contextmanager
def _file_in_place(target: Path, dtype: np.dtype, shape: tuple[int, ...], overwrite: bool,
                   inputs: list[Any] = ()
                   ) -> Iterator[tuple[str, NpyHeader, tuple[int, int, int]]]:
    """A temporary ``.npy`` beside ``target``, header written and sized: ``(its path, header,
    its key)`` (:func:`dask_gpuchunk.files.file_key`). When the block ends, each of ``inputs``
    (pinned readers, :func:`inputs_of`) is checked unchanged, then the file is published onto
    ``target``
    (:func:`dask_gpuchunk.files.publish`: never over a file that appeared meanwhile unless
    ``overwrite``, and then only over a regular file). Removed if anything raises (never
    half-written)."""
    with temporary_output(target) as (tmp, fd, key):
        header = _write_header(fd, dtype, shape)
        yield str(tmp), header, key
        for reader in inputs:
            reader.check_unchanged()
        publish(tmp, target, key, overwrite)


@contextlib.contextmanager
def temporary_output(target: Path) -> Iterator[tuple[Path, int, tuple[int, int, int]]]:
    """A new, empty file beside ``target`` under a name recording this process
    (:func:`dask_gpuchunk.partials.temporary_name`; earlier ones whose writer is gone
    removed first), made exclusively and not through a symlink: ``(its path, a descriptor open
    for writing, its key)`` (:func:`dask_gpuchunk.files.file_key`). The descriptor is closed
    when the block ends; the file is removed if anything raises, a Ctrl-C too, unless another
    file was swapped in under its name. Publishing it is the caller's
    (:func:`dask_gpuchunk.files.publish`)."""
    remove_stale(target, log=_log.warning)
    tmp = temporary_name(target)
    key = None
    made = True  # unless creating it fails
    try:
        try:
            fd = create_exclusive(tmp)
        except OSError:
            made = False
            raise
        try:
            # Before anything else can raise: a Ctrl-C while the file is written still finds
            # it to be ours and removes it.
            key = file_key(os.fstat(fd))
            yield tmp, fd, key
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            st = os.lstat(tmp)
            # Ours; a file swapped in under its name is not ours to remove. Without a key (a
            # signal just as the file was made), a regular file of this user under the name
            # this process drew.
            if made and (file_key(st) == tuple(key) if key is not None
                         else stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()):
                tmp.unlink()
        raise


