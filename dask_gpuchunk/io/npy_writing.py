""".npy files larger than memory, out: ``to_npy`` and the checks before a job writes.

``to_npy`` first checks that the target's file system has room for it, then writes the header
of the whole array into a temporary file next to the target (``.<name>.dgc-<writer>.partial``,
:mod:`dask_gpuchunk.io.partials`), then every chunk into its region of that file from the worker
that computed it (``pwrite`` of its contiguous runs; CuPy chunks land in a pinned buffer and are
written from there), and renames the file onto the target only when every chunk is written.
Writes go through the page cache like ``np.save``'s; the file is not synced to disk. A failure
removes the temporary file; a killed job leaves at most that hidden temporary file, never a
half-written target, and the next job writing the same target removes it once its writer is
gone.
"""

from __future__ import annotations

import contextlib
import errno
import io
import math
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask.utils import format_bytes

from .. import config
from .._kernels.gram import c_ordered
from ..arrays import asarray
from ..runtime.backend import ChunkWork, run_chunk
from ..config import map_blocks_prefix
from ..devices import distributed_client_active
from .partials import remove_stale, temporary_name
from ..runtime.staging import copy_to_host, pinned_pool
from .files import (
    create_exclusive,
    file_key,
    open_same,
    publish,
    refuse_unless_regular,
)
from .npy_reading import NpyHeader, _each_run, _log, _native, _region_runs, in_flight, inputs_of

__all__ = ["NoSpaceError", "NoWorkersError", "SchedulerLostError", "check_output_directory", "check_space", "check_target", "no_workers_timeout", "npy_bytes", "npy_header_bytes", "npy_in_place", "run_writes", "temporary_output", "to_npy", "write_region"]

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


def npy_header_bytes(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The header of a C-order ``.npy`` of ``dtype`` and ``shape``: version 1.0, or 2.0 where
    it would be longer than 64 KiB (a very long shape or dtype), as ``np.save`` writes it.

    Examples
    --------
    >>> len(npy_header_bytes(np.dtype(np.float32), (3, 4)))
    128
    """
    fmt = np.lib.format
    header = {"descr": fmt.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
              "shape": tuple(int(n) for n in shape)}
    buffer = io.BytesIO()
    try:
        fmt.write_array_header_1_0(buffer, header)
    except ValueError:
        buffer = io.BytesIO()
        fmt.write_array_header_2_0(buffer, header)
    return buffer.getvalue()


def _write_header(fd: int, dtype: np.dtype, shape: tuple[int, ...]) -> NpyHeader:
    """Write a C-order ``.npy`` header into the new, empty file ``fd`` and extend the file to
    its full size (sparse, unwritten): the header. ``fd`` stays open."""
    header = npy_header_bytes(dtype, shape)
    with open(fd, "wb", closefd=False) as f:
        f.write(header)
        f.truncate(len(header) + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    return NpyHeader(tuple(shape), dtype, False, len(header))


def write_region(block: Any, path: str, header: NpyHeader, region: tuple[slice, ...],
                 key: tuple[int, int, int]) -> np.ndarray:
    """Write one computed chunk into its region of the temporary file, opened only where the
    path still names the file the job created (``key``, :func:`dask_gpuchunk.io.files.file_key`).

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


class SchedulerLostError(ConnectionError):
    """A job's client lost its scheduler (stopped, or out of reach) while the writes ran."""


def no_workers_timeout() -> float:
    """Seconds a job waits for a cluster without workers to get one again before giving up
    (``gpuchunk.no-workers-timeout``, default 300; the CLI's ``--worker-timeout``)."""
    return float(config.get("no-workers-timeout"))


def run_writes(written: da.Array | list[Any],
               progress: Callable[[int, int], None] | None, results: bool = False) -> Any:
    """Compute every write task of ``written``: an array with one element per write, or a list
    of such arrays or of ``dask.delayed`` writes; on a distributed client, report
    ``progress(done, total)`` as each write finishes (``distributed.as_completed``), and give
    up with :class:`NoWorkersError` once the cluster has had no workers for
    :func:`no_workers_timeout` seconds. With ``results``, returns what the writes returned,
    as ``dask.compute(written)[0]`` would (else ``None``)."""
    if not distributed_client_active():
        total = sum(math.prod(w.numblocks) if isinstance(w, da.Array) else 1
                    for w in (written if isinstance(written, list) else [written]))
        (result,) = dask.compute(written)
        if progress is not None:
            progress(total, total)
        return result if results else None
    from distributed import as_completed, default_client, futures_of

    client = default_client()
    persisted = client.persist(written)
    futures = futures_of(persisted)
    total, done = len(futures), 0
    completed = as_completed(futures)
    deserted, lost = threading.Event(), threading.Event()
    finished = threading.Event()

    def watch() -> None:
        # as_completed waits without a timeout: this thread ends the wait (by emptying it)
        # when the cluster stays without workers, or at once when the client's connection to
        # its scheduler closed: distributed cancels every future of a client that reconnects,
        # so no write can finish; a job whose scheduler was killed waited 15 s in as_completed
        # (the client "connecting", its futures neither done nor cancelled) before this.
        alone_since: float | None = None
        while not finished.wait(1.0):
            if client.status != "running":
                lost.set()
                completed.clear()
                return
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
        if lost.is_set():
            raise SchedulerLostError(
                f"the job's client lost its scheduler (stopped, or out of reach) with "
                f"{total - done} of {total} chunks to go; nothing was written")
        if deserted.is_set():
            raise NoWorkersError(
                f"the cluster has had no workers for {no_workers_timeout():g} s (the last one "
                f"left or died) with {total - done} of {total} chunks to go; nothing was written")
        values = client.gather(futures)  # raises what a failed chunk raised
        # The writes' small results, from their futures: computing the persisted collections
        # again sent a task to gather them on a worker, 0.2-0.3 s after the last write of a
        # 10**7-row top-k's .npz on two GPUs.
        result = _block_results(persisted, dict(zip((f.key for f in futures), values))) \
            if results else None
        if results and result is None:  # dask's array query planning names the persisted anew
            result = dask.compute(persisted)[0]
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
    return result


def _block_results(persisted: Any, values: dict) -> Any:
    """What ``dask.compute(persisted)[0]`` gives, from the values of its blocks' keys: an array
    of one element per write (as its blocks laid out), or a list of such, or of single
    values; ``None`` where a key is not among ``values`` (under dask's array query planning
    the persisted collections have names of their own)."""
    def of(x: Any) -> Any:
        if isinstance(x, da.Array) and x.ndim:
            return np.block(_nested(x.__dask_keys__(), values))
        (key,) = x.__dask_keys__()  # a 0-d array's one block, or a delayed write
        return values[key]

    try:
        return [of(x) for x in persisted] if isinstance(persisted, list) else of(persisted)
    except KeyError:
        return None


def _nested(keys: Any, values: dict) -> Any:
    return [_nested(k, values) for k in keys] if isinstance(keys, list) else values[keys]


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
    its key)`` (:func:`dask_gpuchunk.io.files.file_key`). When the block ends, each of ``inputs``
    (pinned readers, :func:`inputs_of`) is checked unchanged, then the file is published onto
    ``target``
    (:func:`dask_gpuchunk.io.files.publish`: never over a file that appeared meanwhile unless
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
    (:func:`dask_gpuchunk.io.partials.temporary_name`; earlier ones whose writer is gone
    removed first), made exclusively and not through a symlink: ``(its path, a descriptor open
    for writing, its key)`` (:func:`dask_gpuchunk.io.files.file_key`). The descriptor is closed
    when the block ends; the file is removed if anything raises, a Ctrl-C too, unless another
    file was swapped in under its name. Publishing it is the caller's
    (:func:`dask_gpuchunk.io.files.publish`)."""
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
