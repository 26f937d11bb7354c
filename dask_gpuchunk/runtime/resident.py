"""Input chunks kept where the blocks that read them run: one cache per process and device.

A Gram of ``n`` row chunks runs ``n (n + 1) / 2`` blocks, each reading two chunks of words.
Read through Dask, a chunk is one task's result: blocks on other workers receive it over the
cluster's comm (TLS on a local cluster: 0.5-1.5 GB/s between two workers), it arrives in pageable
memory and is copied into pinned buffers again, and every block stages both of its chunks to the
GPU again (on two H100s, 65,536 × 262,144 bits in 4,096-row chunks: 2.3 GB sent between the
workers, 34 GB of H2D for 2.1 GB of words; the perf notes (git show 85dc246:docs/perf-notes.md), item 29). Blocks that read their
chunks themselves through a :class:`ResidentSource` get each chunk once per process: read (from
a file, into pinned memory), moved to this process's GPU (or kept in host memory for the CPU),
and kept while it fits, the least recently used dropped first. The source is a value of the
graph: the chunks it keeps go with it when the last block that needs it is done (in each
worker, when the worker lets it go).

A source made with ``read_ahead`` (the row chunks its blocks will ask for, in order) reads the
rest of them on a thread of its own once a block has asked for the first, for as long as they fit
without dropping any: the blocks then find their chunks kept instead of waiting on the file in
their own threads. On 4 x H200, 65,536 x 262,144 bits in 4,096-row chunks, every worker reads all
2.1 GB of words, 27 % of its task threads' busy time; with the read-ahead the four workers' task
threads were busy 4.58 s instead of 5.37, and ``C.sum()`` took 0.92 s instead of 1.03 (one A/B;
with 16 read threads, 0.93 s either way).

What a device keeps is allocated from CuPy's pool, so the budget's admission
(:func:`dask_gpuchunk.runtime.budget.reserve`) counts it as held outside the running chunks: blocks
wait for room rather than run out of memory; a chunk that runs out all the same runs again alone
after the kept chunks are dropped (:data:`dask_gpuchunk.runtime.budget.out_of_memory_hooks`).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from dask.base import tokenize

from .. import config
from .backend import staging_totals
from .budget import out_of_memory_hooks, run_reserved, working_budget
from ..devices import gpu_available

__all__ = ["DEVICE_FRACTION", "HOST_BYTES", "SOURCE_KEY_PREFIX", "ResidentChunks",
           "ResidentSource", "on_gpu_here", "resident_stats", "row_bounds", "rows_where_it_runs",
           "source_tasks"]

#: Share of the working budget (:func:`dask_gpuchunk.runtime.budget.working_budget`) that a device's
#: cache may keep: half, the other half for the blocks running beside it (a 4,096² block of
#: counts and its scratch is well under 100 MB).
DEVICE_FRACTION = 0.5
#: Bytes of host memory that the chunks kept for the CPU may take, at most an eighth of the
#: machine's memory.
HOST_BYTES = 2 << 30
_STAT_NAMES = ("reads", "read_ahead", "hits", "bytes_read", "dropped")


class ResidentChunks:
    """A least-recently-used cache of chunks by key, holding at most ``limit(cache)`` bytes; a
    chunk being read by one thread is waited for by the others that need it (read once).

    Examples
    --------
    >>> import numpy as np
    >>> cache = ResidentChunks(lambda cache: 16)
    >>> a = cache.get("a", lambda: np.zeros(8, np.uint8))
    >>> cache.get("a", lambda: np.ones(8, np.uint8)) is a  # kept: not read again
    True
    >>> _ = cache.get("b", lambda: np.zeros(8, np.uint8))
    >>> _ = cache.get("c", lambda: np.zeros(8, np.uint8))  # 24 bytes > 16: "a" dropped
    >>> sorted(cache.keys()), cache.stats["reads"], cache.stats["dropped"]
    (['b', 'c'], 3, 1)
    """

    def __init__(self, limit: Callable[[ResidentChunks], int],
                 stats: dict[str, int] | None = None) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._chunks: OrderedDict[Hashable, Any] = OrderedDict()
        self._reading: dict[Hashable, threading.Event] = {}
        self.nbytes = 0
        #: How many times :meth:`clear` ran (a read-ahead stops when it changes).
        self.clears = 0
        self.stats = stats if stats is not None else dict.fromkeys(_STAT_NAMES, 0)

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._chunks)

    def get(self, key: Hashable, read: Callable[[], Any], ahead: bool = False) -> Any:
        """The chunk ``key``: kept, or ``read()`` now (once, whichever thread asks first);
        ``ahead``: read by a read-ahead, not for a block (counted as ``read_ahead`` too)."""
        while True:
            with self._lock:
                if key in self._chunks:
                    self._chunks.move_to_end(key)
                    self.stats["hits"] += 1
                    return self._chunks[key]
                reading = self._reading.get(key)
                if reading is None:
                    reading = self._reading[key] = threading.Event()
                    break
            reading.wait()  # another thread reads it; then it is kept (or failed: try again)
        try:
            chunk = read()
        except BaseException:
            with self._lock:
                self._reading.pop(key).set()
            raise
        with self._lock:
            self.stats["reads"] += 1
            self.stats["read_ahead"] += int(ahead)
            self.stats["bytes_read"] += int(chunk.nbytes)
            limit = self.limit(self)
            if chunk.nbytes <= limit:
                self._chunks[key] = chunk
                self.nbytes += int(chunk.nbytes)
                while self.nbytes > limit:
                    _, dropped = self._chunks.popitem(last=False)
                    self.nbytes -= int(dropped.nbytes)
                    self.stats["dropped"] += 1
            self._reading.pop(key).set()
        return chunk

    def room_for(self, key: Hashable, nbytes: int) -> str:
        """What a read-ahead finds for ``key`` of ``nbytes``: ``"kept"``, ``"reading"`` (by
        another thread), ``"fits"`` (under the limit with nothing dropped) or ``"full"``."""
        with self._lock:
            if key in self._chunks:
                return "kept"
            if key in self._reading:
                return "reading"
            return "fits" if self.nbytes + nbytes <= self.limit(self) else "full"

    def clear(self) -> None:
        """Drop every kept chunk (those in use stay alive with their users)."""
        with self._lock:
            self._chunks.clear()
            self.nbytes = 0
            self.clears += 1


def _host_limit() -> int:
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return HOST_BYTES
    return min(HOST_BYTES, memory // 8)


def _device_limit() -> int:
    return int(working_budget() * DEVICE_FRACTION)


# Every cache alive in this process, by where it keeps its chunks ("host", or a device number):
# each may keep what the others of its place leave of the place's limit. Totals of what they
# did, for resident_stats().
_live: dict[Any, weakref.WeakSet] = {}
_totals: dict[Any, dict[str, int]] = {}
_registry_lock = threading.Lock()


def _cache_for(place: Any) -> ResidentChunks:
    limit_of = _host_limit if place == "host" else _device_limit
    with _registry_lock:
        stats = _totals.setdefault(place, dict.fromkeys(_STAT_NAMES, 0))
        live = _live.setdefault(place, weakref.WeakSet())

    def limit(cache: ResidentChunks) -> int:
        # The cache is an argument, not a name this closure holds: no cycle keeps it alive.
        others = sum(c.nbytes for c in list(live) if c is not cache)
        return max(limit_of() - others, 0)

    cache = ResidentChunks(limit, stats)
    with _registry_lock:
        live.add(cache)
    return cache


def _drop_device_chunks() -> None:
    """Drop what every source keeps on a device (a chunk that ran out of device memory runs
    again without them; they are read again where needed)."""
    with _registry_lock:
        caches = [c for place, live in _live.items() if place != "host" for c in list(live)]
    for cache in caches:
        cache.clear()


out_of_memory_hooks.append(_drop_device_chunks)


def _to_device(chunk: Any) -> Any:
    """``chunk`` (host rows) copied to this process's current GPU."""
    import cupy

    def sent() -> Any:
        on_device = cupy.asarray(chunk)
        # From pinned memory the copy is asynchronous: done before other threads' streams read
        # the chunk, and before its pinned buffer goes back to the pool.
        cupy.cuda.get_current_stream().synchronize()
        return on_device

    t0 = time.perf_counter()
    # Admitted as a running chunk is (it waits for room, and runs alone where the device ran
    # out); once kept, the budget counts it as held outside the running chunks.
    on_device = run_reserved(sent, int(chunk.nbytes), "a chunk of words kept on the GPU")
    seconds = time.perf_counter() - t0
    staging_totals.add(h2d_bytes=int(chunk.nbytes), device_seconds=seconds)
    return on_device


def _read_ahead(cache_ref: weakref.ref, chunks: list[tuple[Hashable, int, Callable[[], Any]]],
                device: int | None) -> None:
    """Read ``chunks`` (key, bytes, read) into the cache ``cache_ref`` names, in order, while
    each fits with nothing dropped; stop at the first that does not, when the cache is
    cleared (a device that ran out of memory) or gone, or at a failed read (the block that
    needs the chunk reads it again itself and raises)."""
    if device is not None:
        import cupy

        cupy.cuda.Device(device).use()
    cache = cache_ref()
    clears = cache.clears if cache is not None else 0
    del cache
    for key, nbytes, read in chunks:
        cache = cache_ref()
        if cache is None or cache.clears != clears:
            return
        room = cache.room_for(key, nbytes)
        if room == "full":
            return
        if room == "fits":
            try:
                cache.get(key, read, ahead=True)
            except Exception:  # noqa: BLE001 - the block that needs it reads it and raises
                return
        del cache


def _rows_to_device(reader: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of ``reader`` on this process's current GPU: copied by the GPU
    straight from the file's pages where the reader can (``rows_on_device``, as
    :class:`~dask_gpuchunk.io.NpyReader`), else read into host memory and sent
    (:func:`_to_device`); admitted by the budget either way."""
    direct = getattr(reader, "rows_on_device", None)
    if direct is not None:
        nbytes = int(reader.row_nbytes) * (stop - start)
        t0 = time.perf_counter()
        on_device = run_reserved(lambda: direct(start, stop), nbytes,
                                 "a chunk of words kept on the GPU")
        if on_device is not None:
            staging_totals.add(h2d_bytes=nbytes, device_seconds=time.perf_counter() - t0)
            return on_device
    return _to_device(reader[slice(start, stop), :])


class ResidentSource:
    """Row chunks of ``reader`` (indexed by ``reader[start:stop, :]``, a NumPy array, pinned
    where a GPU is visible), each read once per process and kept (:class:`ResidentChunks`) on
    the GPU that reads it or in host memory, for as long as this object lives in the process.
    Pickled without what it keeps; ``token`` names the reader's content. ``read_ahead``: the
    row chunks (start, stop) the blocks will ask for, in order; after the first read in a
    place, a thread reads the others there while they fit (:func:`_read_ahead`).

    Examples
    --------
    >>> import numpy as np
    >>> source = ResidentSource(np.arange(12).reshape(6, 2), "arange")
    >>> source.rows(2, 4, on_gpu=False)
    array([[4, 5],
           [6, 7]])
    >>> source.rows(2, 4, on_gpu=False) is source.rows(2, 4, on_gpu=False)
    True
    """

    def __init__(self, reader: Any, token: str,
                 read_ahead: Sequence[tuple[int, int]] = ()) -> None:
        self.reader, self.token = reader, token
        self.read_ahead = tuple((int(a), int(b)) for a, b in read_ahead)
        self._caches: dict[Any, ResidentChunks] = {}
        self._reading_ahead: dict[Any, threading.Thread] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"reader": self.reader, "token": self.token, "read_ahead": self.read_ahead}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["reader"], state["token"], state.get("read_ahead", ()))

    def __dask_tokenize__(self) -> tuple:
        return ("dask-gpuchunk-resident", self.token)

    def _cache(self, place: Any) -> ResidentChunks:
        with self._lock:
            cache = self._caches.get(place)
            if cache is None:
                cache = self._caches[place] = _cache_for(place)
            return cache

    def rows(self, start: int, stop: int, on_gpu: bool) -> Any:
        """Rows ``start:stop``: on this process's current GPU (``on_gpu``: CuPy) or NumPy."""
        device = None
        if on_gpu:
            import cupy

            device = cupy.cuda.runtime.getDevice()
        place = "host" if device is None else device
        cache = self._cache(place)
        ahead = self.read_ahead and place not in self._reading_ahead and stop > start
        # A reader that knows its rows' size starts the read-ahead first, so that its reads
        # overlap the first block's.
        row_bytes = getattr(self.reader, "row_nbytes", None)
        if ahead and row_bytes is not None:
            self._start_read_ahead(place, cache, device, int(row_bytes), (start, stop))
        read = self._reading(start, stop, device)
        chunk = cache.get((start, stop), read)
        if ahead and row_bytes is None:
            self._start_read_ahead(place, cache, device, chunk.nbytes // (stop - start),
                                   (start, stop))
        return chunk

    def _reading(self, start: int, stop: int, device: int | None) -> Callable[[], Any]:
        """What reads rows ``start:stop`` for ``device`` (``None``: host memory); it holds the
        reader, not this source (a read-ahead must not keep the source alive)."""
        reader = self.reader
        if device is None:
            return lambda: reader[slice(start, stop), :]
        return lambda: _rows_to_device(reader, start, stop)

    def _start_read_ahead(self, place: Any, cache: ResidentChunks, device: int | None,
                          row_bytes: int, first: tuple[int, int]) -> None:
        # From the chunk after the first one asked for, round to the one before it: a worker
        # handed the blocks of one row from its middle wants the chunks after it soonest.
        order = list(self.read_ahead)
        if first in order:
            at = order.index(first)
            order = order[at + 1:] + order[:at]
        with self._lock:
            if place in self._reading_ahead:
                return
            chunks = [((a, b), (b - a) * row_bytes, self._reading(a, b, device))
                      for a, b in order]
            thread = threading.Thread(target=_read_ahead, name=f"dask-gpuchunk-read-ahead-{place}",
                                      args=(weakref.ref(cache), chunks, device), daemon=True)
            self._reading_ahead[place] = thread
        thread.start()


def resident_stats() -> dict[str, dict[str, int]]:
    """What this process's sources read, found kept and dropped, and keep now (``nbytes``):
    in host memory, and on each device by its number.

    Examples
    --------
    >>> sorted(resident_stats()["host"])
    ['bytes_read', 'dropped', 'hits', 'nbytes', 'read_ahead', 'reads']
    """
    with _registry_lock:
        places = {"host", *_totals}
        return {(place if place == "host" else f"device {place}"): {
                    **_totals.get(place, dict.fromkeys(_STAT_NAMES, 0)),
                    "nbytes": sum(c.nbytes for c in list(_live.get(place, ())))}
                for place in places}


def on_gpu_here(device: str) -> bool:
    """Whether chunks for ``device`` (``"auto"``, ``"gpu"``, ``"cpu"``) go to a GPU in this
    process."""
    return device != "cpu" and gpu_available()


def rows_where_it_runs(source: ResidentSource, start: int, stop: int, device: str) -> Any:
    """Rows ``start:stop`` of ``source``, kept where the calling task runs for ``device``: on
    this process's GPU (:func:`on_gpu_here`) or in host memory."""
    return source.rows(start, stop, on_gpu_here(device))


def row_bounds(row_chunks: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(start, stop)`` of each row chunk of ``row_chunks``, the rows a source is read by.

    Examples
    --------
    >>> row_bounds((3, 3, 1))
    [(0, 3), (3, 6), (6, 7)]
    """
    return list(itertools.pairwise(itertools.accumulate(row_chunks, initial=0)))


#: What the key of every source task of :func:`source_tasks` begins with.
SOURCE_KEY_PREFIX = "resident-words-"


def source_tasks(reader: Any, tag: str, read_ahead: Sequence[tuple[int, int]] = ()
                 ) -> tuple[dict[str, Any], str]:
    """The graph entries that make a :class:`ResidentSource` of ``reader`` at each compute, and
    the source's key: the reader as a value of the graph (where :func:`dask_gpuchunk.to_npy`
    finds a graph's inputs) and a task that makes the source from it, so that the chunks it
    keeps go when the compute's last task that needs them is done, not with the graph.
    ``read_ahead``: the source's (:class:`ResidentSource`), where ``read-ahead`` is on (``config.INTERNAL``).

    Examples
    --------
    >>> entries, key = source_tasks("a reader", "t")
    >>> key, sorted(entries)
    ('resident-words-t', ['npy-reader-t', 'resident-words-t'])
    """
    reader_key, source_key = f"npy-reader-{tag}", f"{SOURCE_KEY_PREFIX}{tag}"
    ahead = tuple(read_ahead) if config.flag("read-ahead") else ()
    source = (ResidentSource, reader_key, tokenize(reader)) + ((ahead,) if ahead else ())
    return {reader_key: reader, source_key: source}, source_key
