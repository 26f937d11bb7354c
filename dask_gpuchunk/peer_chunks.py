"""Chunks read from the host once per node: the GPU processes of a node hand each other what
one of them read, through CUDA IPC.

Every worker of a multi-GPU Gram reads all the words, since its blocks touch every row chunk:
on 4 x H200, 65,536 x 262,144 bits, each of the four workers moved all 2.1 GB from the page
cache to its GPU, 8.4 GB through the host in the first quarter-second of a one-second run,
while its blocks waited (docs/perf-notes.md). Here a chunk that a process wants on its GPU is
read from the host by the first process of the node that asks for it; the others copy it from
that GPU to theirs over NVLink (``tools/peer_copy_probe.py``, 4 x H200, all four at once:
128 MiB chunks at ~250 GB/s each once open; opening a handle and closing it ~5 ms a chunk,
against ~3 ms to move it from pinned host memory and more to read it from the page cache).

The processes meet in a directory of the node (:func:`node_directory`: ``/dev/shm``, one per
user and boot), each chunk by its name (the source's content token and its rows):

- ``NAME.claim``, made exclusively (``O_EXCL``) by the process that reads the chunk, holding its
  pid: the others wait for its ticket instead of reading it too (and read it themselves if
  that process is gone, or after :data:`WAIT_SECONDS`);
- ``NAME.ticket``, published (written whole, then renamed) once read: JSON naming the IPC
  handle of the allocation that holds it, the chunk's offset in it, its shape and dtype, and a
  checksum (:func:`chunk_checksum`).

The directory is this user's alone (:func:`private_directory`): one that another user made
first, or that others may write in, is not used, and each process then reads its own chunks.

A process that takes a ticket copies the chunk to its own GPU and checks the checksum: a ticket
whose chunk the owner has dropped since (its memory freed, or reused for something else) fails
the check or the opening, is removed, and the chunk is claimed and read again. So a ticket is a
hint, never trusted: a result can be slower for it, not wrong. Opening and copying take
milliseconds, while the owner keeps what it read as long as its source lives
(:class:`~dask_gpuchunk.resident.ResidentSource`: until the compute's last block is done).

Host memory, a process that refuses IPC (a device or build without it, another process's memory
it cannot map) and ``gpuchunk.share-reads`` off read as before: each process for itself.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import os
import json
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from dask.utils import parse_bytes

from . import config
from .backend import is_cupy, staging_totals
from .budget import run_reserved

__all__ = ["WAIT_SECONDS", "ClaimedElsewhere", "CudaIpc", "Transport", "chunk_checksum",
           "node_directory", "note_step", "peer_events", "peer_stats", "private_directory",
           "read_once_per_node", "sharing_on", "unpublish"]

#: Seconds a process waits for the process that claimed a chunk to publish it before it reads
#: the chunk itself (a claimer that died is noticed at once: its pid is gone).
WAIT_SECONDS = 60.0
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
_STATS_LOCK = threading.Lock()
_STATS = {"read": 0, "published": 0, "received": 0, "received_bytes": 0, "stale": 0,
          "waited_seconds": 0.0, "unshared": 0, "read_seconds": 0.0, "fetch_seconds": 0.0,
          "open_seconds": 0.0}


# The last steps of chunks on their way to this process's GPU (note_step), for peer_events().
_EVENTS: collections.deque = collections.deque(maxlen=4096)


def note_step(kind: str, name: str, started: float, **seconds: float) -> None:
    """Log one step of a chunk's way to this process's GPU: its ``kind``, the chunk's
    ``name``, when it ``started`` (``time.time()``) and how long it and its parts took
    (``seconds``), for :func:`peer_events`. The last 4,096 are kept."""
    _EVENTS.append({"kind": kind, "name": name, "at": started,
                    **{part: round(value, 6) for part, value in seconds.items()}})


def peer_events(since: float = 0.0) -> list[dict[str, Any]]:
    """The steps :func:`note_step` logged from ``since`` (``time.time()``) on, oldest first:
    where the time of a node's words went, chunk by chunk (``tools/gram_scaling.py``).

    Examples
    --------
    >>> note_step("example", "rows 0:4", time.time(), seconds=0.001)
    >>> peer_events(time.time() - 60)[-1]["kind"]
    'example'
    """
    return [event for event in list(_EVENTS) if event["at"] >= since]


class ClaimedElsewhere(Exception):
    """The chunk is being read by another process of the node (:func:`read_once_per_node`
    asked not to wait for it)."""


def peer_stats() -> dict[str, float]:
    """What this process's chunks did (:func:`read_once_per_node`): ``read`` from the host,
    ``published`` for the node, ``received`` (and ``received_bytes``) from another process,
    ``stale`` tickets found, ``waited_seconds`` for another's read, ``unshared`` reads (no
    sharing, or a wait given up); ``read_seconds`` spent reading chunks for the node,
    ``fetch_seconds`` taking them from others (``open_seconds`` of it opening their handles).

    Examples
    --------
    >>> sorted(peer_stats())[:4]
    ['fetch_seconds', 'open_seconds', 'published', 'read']
    """
    with _STATS_LOCK:
        return dict(_STATS)


def _count(**amounts: float) -> None:
    with _STATS_LOCK:
        for name, amount in amounts.items():
            _STATS[name] += amount


def chunk_checksum(chunk: Any) -> int:
    """A checksum of ``chunk``'s bytes (a NumPy or CuPy array, computed where it lies): the
    sum of its 64-bit words, and of its last bytes, modulo 2**64. It tells a chunk from what
    its memory held before or after, not from a chunk made to collide.

    Examples
    --------
    >>> chunk_checksum(np.arange(3, dtype=np.uint64))
    3
    >>> chunk_checksum(np.ones(9, np.uint8)) == 0x0101010101010101 + 1
    True
    """
    if is_cupy(chunk):
        import cupy as xp
    else:
        xp = np
    flat = xp.ascontiguousarray(chunk).reshape(-1).view(xp.uint8)
    whole = flat.size // 8 * 8
    total = (flat[:whole].view(xp.uint64).sum(dtype=xp.uint64)
             + flat[whole:].sum(dtype=xp.uint64))
    return int(total)


def node_directory() -> Path:
    """The directory where this node's processes meet (``/dev/shm`` where it can be written,
    else the temporary directory), one per user and boot of the node, made private to this
    user (:func:`private_directory`).

    Raises
    ------
    PermissionError
        Where that directory exists but another user owns it or others may write in it: its
        tickets could then be anyone's, and nothing is shared.

    Examples
    --------
    >>> node_directory().is_dir()
    True
    """
    return private_directory(_node_directory_path())


@functools.cache
def _node_directory_path() -> Path:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "node"
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"dask-gpuchunk-peers-{os.getuid()}-{boot}"


def private_directory(directory: Path) -> Path:
    """``directory``, made (mode 0700) where it is missing, after checking that it is a
    directory (not a link) that this user owns and no one else may read or write in; else
    ``PermissionError``. ``/dev/shm`` is writable by every user: another could make the
    directory first (its name is known) and leave tickets in it, or read ours; then nothing is
    shared, never anyone else's ticket taken.

    Examples
    --------
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()) / "peers"
    >>> private_directory(d) == d, oct(d.stat().st_mode & 0o777)
    (True, '0o700')
    >>> d.chmod(0o777)
    >>> private_directory(d)
    Traceback (most recent call last):
    ...
    PermissionError: ... others may read or write in it: nothing is shared through it
    """
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700, parents=True)
    status = os.lstat(directory)
    if not stat.S_ISDIR(status.st_mode):
        raise PermissionError(f"{directory} is not a directory: nothing is shared through it")
    if status.st_uid != os.getuid():
        raise PermissionError(f"{directory} belongs to user {status.st_uid}, not this one: "
                              "nothing is shared through it")
    if status.st_mode & 0o077:  # tickets name GPU memory: readable by this user alone
        raise PermissionError(f"{directory} is mode {oct(status.st_mode & 0o777)}: others may "
                              "read or write in it: nothing is shared through it")
    return directory


class Transport(Protocol):
    """How a chunk goes from the process that read it to another: ``export`` gives what the
    ticket carries (``None``: this process cannot share it), ``fetch`` a copy here from a
    ticket (``None``: the ticket is stale or cannot be opened here)."""

    def export(self, chunk: Any) -> dict[str, Any] | None: ...

    def fetch(self, ticket: dict[str, Any]) -> Any | None: ...


class CudaIpc:
    """A :class:`Transport` of CuPy chunks through CUDA IPC: the allocation that holds the chunk
    exported (``cudaIpcGetMemHandle``), opened by the other process, copied into a chunk of its
    own on its current device (admitted by the budget), closed, and the copy checked."""

    def export(self, chunk: Any) -> dict[str, Any] | None:
        import cupy

        runtime = cupy.cuda.runtime
        if not chunk.flags.c_contiguous:  # a copy made here would be freed once exported
            return None
        try:
            base = _allocation_base(chunk.data.ptr)
            handle = runtime.ipcGetMemHandle(base)
        except (OSError, RuntimeError, runtime.CUDARuntimeError):
            return None
        return {"handle": handle.hex(), "offset": chunk.data.ptr - base,
                "shape": list(chunk.shape), "dtype": chunk.dtype.str,
                "checksum": chunk_checksum(chunk)}

    def fetch(self, ticket: dict[str, Any]) -> Any | None:
        import cupy

        runtime = cupy.cuda.runtime
        try:
            shape, dtype = tuple(int(n) for n in ticket["shape"]), np.dtype(ticket["dtype"])
            handle, offset = bytes.fromhex(ticket["handle"]), int(ticket["offset"])
        except (KeyError, TypeError, ValueError):
            return None  # not a ticket this transport wrote
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

        parts: dict[str, float] = {}

        def copied() -> Any:
            t = time.perf_counter()
            out = cupy.empty(shape, dtype)
            parts["allocate"] = time.perf_counter() - t
            if not nbytes:
                return out
            t = time.perf_counter()
            pointer = runtime.ipcOpenMemHandle(handle)
            parts["open"] = time.perf_counter() - t
            try:
                t = time.perf_counter()
                stream = cupy.cuda.get_current_stream()
                runtime.memcpyAsync(out.data.ptr, pointer + offset, nbytes,
                                    _MEMCPY_DEFAULT, stream.ptr)
                stream.synchronize()
                parts["copy"] = time.perf_counter() - t
            finally:
                t = time.perf_counter()
                runtime.ipcCloseMemHandle(pointer)
                parts["close"] = time.perf_counter() - t
            return out

        started, t0 = time.time(), time.perf_counter()
        try:
            out = run_reserved(copied, nbytes, "a chunk of words kept on the GPU")
        except runtime.CUDARuntimeError:
            return None  # freed since, or memory this process cannot map
        t = time.perf_counter()
        matches = chunk_checksum(out) == ticket["checksum"]
        parts["check"] = time.perf_counter() - t
        seconds = time.perf_counter() - t0
        note_step("fetch", f"from pid {ticket.get('pid')}", started, seconds=seconds, **parts)
        if not matches:
            return None
        staging_totals.add(peer_bytes=nbytes, device_seconds=seconds)
        _count(fetch_seconds=seconds, open_seconds=parts.get("open", 0.0))
        return out


@functools.cache
def _get_address_range() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    function = lib.cuMemGetAddressRange_v2
    function.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                         ctypes.c_uint64]
    function.restype = ctypes.c_int
    return function


def _allocation_base(pointer: int) -> int:
    """The start of the device allocation that holds ``pointer`` (CuPy's pool hands out pieces
    of larger allocations; an IPC handle names a whole one)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = _get_address_range()(ctypes.byref(base), ctypes.byref(size), pointer)
    if status:
        raise RuntimeError(f"cuMemGetAddressRange failed ({status})")
    return int(base.value)


def read_once_per_node(name: str, read: Callable[[], Any], transport: Transport,
                       published: set[str] | None = None, directory: Path | None = None,
                       wait_seconds: float | None = None, wait: bool = True) -> Any:
    """The chunk ``name`` (unique to its content on the node), read by ``read()`` in one
    process of the node and handed to the others by ``transport``, or read here where it
    cannot be (the module's docstring). ``published``: where the names this process publishes
    are added (for :func:`unpublish`). A chunk that another live process is reading is waited
    for, up to ``wait_seconds`` (:data:`WAIT_SECONDS`), then read here; with ``wait`` false,
    :class:`ClaimedElsewhere` is raised instead (a read-ahead takes another chunk meanwhile).

    Examples
    --------
    >>> kept = {}
    >>> class Kept:  # a transport within one process, for the example
    ...     def export(self, chunk): kept[id(chunk)] = chunk; return {"id": id(chunk)}
    ...     def fetch(self, ticket): return kept.get(ticket["id"])
    >>> chunk = read_once_per_node("example-0-4", lambda: np.arange(4), Kept(), published := set())
    >>> chunk, published
    (array([0, 1, 2, 3]), {'example-0-4'})
    >>> unpublish(published)
    """
    if directory is None:
        try:
            directory = node_directory()
        except OSError:  # no directory to meet in: each process reads its own
            _count(unshared=1)
            return read()
    patience = WAIT_SECONDS if wait_seconds is None else wait_seconds
    ticket_path, claim_path = directory / f"{name}.ticket", directory / f"{name}.claim"
    waited_since: float | None = None
    pause = 2e-4
    while True:
        ticket = _load(ticket_path)
        if ticket is not None:
            if ticket.get("pid") != os.getpid():
                chunk = transport.fetch(ticket)
                if chunk is not None:
                    waited = _since(waited_since)
                    _count(received=1, received_bytes=int(chunk.nbytes), waited_seconds=waited)
                    if waited_since is not None:
                        note_step("waited", name, time.time() - waited, seconds=waited)
                    return chunk
                _count(stale=1)
            # Stale, or this process's own that it no longer keeps: claimed and read again.
            _remove_if(ticket_path, lambda: _load(ticket_path) == ticket)
            _remove_if(claim_path, lambda: True)
        claimed = _claim(claim_path)
        if claimed is None:  # the directory cannot be written: each process reads its own
            _count(unshared=1, waited_seconds=_since(waited_since))
            return read()
        if claimed:
            _count(waited_seconds=_since(waited_since))
            return _read_and_publish(name, read, transport, ticket_path, claim_path, published)
        claimer = _claimer(claim_path)
        if claimer is not None and not _alive(claimer):
            _remove_if(claim_path, lambda: _claimer(claim_path) == claimer)
            continue
        if not wait:
            raise ClaimedElsewhere(name)
        if waited_since is None:
            waited_since = time.perf_counter()
        elif time.perf_counter() - waited_since > patience:
            _count(unshared=1, waited_seconds=_since(waited_since))
            return read()
        time.sleep(pause)
        pause = min(2 * pause, 2e-3)


def _since(t0: float | None) -> float:
    return 0.0 if t0 is None else time.perf_counter() - t0


def _read_and_publish(name: str, read: Callable[[], Any], transport: Transport,
                      ticket_path: Path, claim_path: Path, published: set[str] | None) -> Any:
    started, t0 = time.time(), time.perf_counter()
    try:
        chunk = read()
        t_read = time.perf_counter() - t0
        ticket = transport.export(chunk)
    except BaseException:
        _remove_if(claim_path, lambda: True)
        raise
    seconds = time.perf_counter() - t0
    _count(read=1, read_seconds=seconds)
    note_step("read for the node", name, started, seconds=seconds, read=t_read,
              export=seconds - t_read)
    if ticket is None:  # this process cannot share it: the others read it themselves
        _remove_if(claim_path, lambda: True)
        return chunk
    ticket["pid"] = os.getpid()
    partial = ticket_path.with_name(f"{ticket_path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        partial.write_text(json.dumps(ticket))
        os.replace(partial, ticket_path)
    except (OSError, TypeError, ValueError):  # /dev/shm full, or not JSON: read by each
        _remove_if(partial, lambda: True)
        _remove_if(claim_path, lambda: True)
        return chunk
    _count(published=1)
    if published is not None:
        published.add(name)
    return chunk


def _claim(path: Path) -> bool | None:
    """Whether this process claimed ``path`` (``False``: another did); ``None`` where no claim
    can be made (the directory gone and not made again, or not writable)."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            break
        except FileExistsError:
            return False
        except FileNotFoundError:  # the directory was removed (a tmp cleaner): made again
            with contextlib.suppress(OSError):
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            return None
    else:
        return None
    try:
        os.write(fd, str(os.getpid()).encode())
    finally:
        os.close(fd)
    return True


def _claimer(path: Path) -> int | None:
    """The pid in a claim; ``None`` where it is gone or still being written."""
    try:
        return int(path.read_text() or "x")
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _load(path: Path) -> dict[str, Any] | None:
    try:
        ticket = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return ticket if isinstance(ticket, dict) else None


def _remove_if(path: Path, still: Callable[[], bool]) -> None:
    """Remove ``path`` if ``still()`` (what was found there is still what it holds)."""
    with contextlib.suppress(OSError):
        if still():
            path.unlink()


def unpublish(names: Iterable[str], directory: Path | None = None) -> None:
    """Remove the tickets and claims of ``names`` that this process published (its chunks are
    going: their memory may be reused)."""
    names = list(names)
    if not names:
        return
    if directory is None:
        try:
            directory = node_directory()
        except OSError:
            return
    pid = os.getpid()
    for name in names:
        ticket_path, claim_path = directory / f"{name}.ticket", directory / f"{name}.claim"
        _remove_if(ticket_path, lambda p=ticket_path: (_load(p) or {}).get("pid") == pid)
        _remove_if(claim_path, lambda p=claim_path: _claimer(p) == pid)


def sharing_on(nbytes: int | None, setting: str = "share-reads") -> bool:
    """Whether a chunk of ``nbytes`` (``None``: not known before it is read) read to a GPU is
    shared with the node's other processes: the ``gpuchunk.`` flag ``setting`` on
    (``share-reads``; ``share-device-chunks`` for chunks already on a GPU), and the chunk at
    least ``gpuchunk.share-min-bytes`` (smaller ones cost more to open from another process than
    to read from the host).

    Examples
    --------
    >>> sharing_on(128 << 20), sharing_on(8 << 20), sharing_on(None)
    (True, False, False)
    >>> sharing_on(128 << 20, "share-device-chunks")
    True
    """
    return (nbytes is not None and config.flag(setting)
            and nbytes >= parse_bytes(config.checked("share-min-bytes")))
