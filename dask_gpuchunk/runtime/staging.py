"""Host-device staging: reusable pinned buffers, one CUDA stream per executing thread, raw copies.

Pageable host memory cannot be copied asynchronously: the driver stages it itself, at a third
of the link's speed, and serialises the copy with the caller. So a NumPy chunk bound for the GPU
is first copied into a pinned buffer borrowed from :class:`PinnedPool` and sent from there; a
chunk already in pinned memory is sent directly. Pinned buffers are expensive to make (tens of
milliseconds for 128 MiB) and CuPy's own pinned pool rounds every request up to a power of two
and never gives memory back, so the one pool here makes each buffer once, in size classes at
most 1/8 larger than the request, hands it out again (for a copy, or for as long as a chunk
lives), and keeps at most ``gpuchunk.pinned-pool-limit``. It makes them by registering memory
the kernel has filled (:class:`RegisteredMemory`), which holds the process's CUDA calls for a
few milliseconds, not by ``cudaHostAlloc``, which holds them for all of it.

Host copies run in every Dask thread at once. The device side of a chunk runs while holding one
of a few :func:`device_slot` s per device, each with its own non-blocking stream: the chunk's
copies and kernel are ordered on that stream, several slots' chunks overlap on the GPU, and the
device memory in use (and cached by CuPy's pool, one arena per stream) is bounded by the number
of slots. This module needs CuPy; nothing here is imported where no GPU is visible.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
from dask.utils import parse_bytes

from .. import config
from ..c_library import MADV_POPULATE_WRITE, advise, map_memory, unmap
from .._kernels.launch import numba_stream

__all__ = [
    "PinnedPool",
    "pinned_pool",
    "is_pinned",
    "device_slot",
    "h2d_slot",
    "copy_to_device",
    "copy_to_host",
    "empty_pinned",
    "per_device",
    "pinned_pool_limit",
    "RegisteredMemory",
]

T = TypeVar("T")

#: Chunks of NumPy data on the GPU at once, per device. Each holds device memory for its
#: inputs and output, so this bounds the device memory of the host-resident path; four keep
#: one chunk in H2D, one in D2H and two more ready.
GPU_TASKS_PER_DEVICE = 4
#: Chunks whose H2D copies are in flight at once, per device. Letting every chunk start its
#: copies together makes them share the link and finish together, so no D2H overlaps them;
#: two in flight keep the link busy and finish one after the other.
H2D_IN_FLIGHT = 2


def _size_class(nbytes: int) -> int:
    """Round up so that at most 1/8 is wasted and similar sizes share buffers."""
    if nbytes <= 1 << 16:
        return 1 << 16
    step = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


def _layout(shape: Any, dtype: Any) -> tuple[tuple[int, ...], np.dtype, int]:
    """``shape`` as a tuple (an int is one dimension), the dtype, and the bytes they take."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    return shape, dtype, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _cuda_pinned(size: int) -> tuple[Any, int]:
    """``size`` bytes of page-locked memory (``cudaHostAlloc``): the owner and its address."""
    import cupy

    mem = cupy.cuda.PinnedMemory(size)
    return mem, cupy.cuda.PinnedMemoryPointer(mem, 0).ptr


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class RegisteredMemory:
    """Anonymous memory that the kernel fills and CUDA then page-locks (``cudaHostRegister``),
    unlocked and unmapped when the last reference to it goes.

    ``cudaHostAlloc`` fills and locks its pages while holding the process's CUDA calls: on
    2 x H200, 55-134 ms for 128 MiB (up to 616 ms with two processes at it), during which no
    copy of the process reached its GPU. Here the kernel fills the pages first, in huge pages
    where it gives them (24-36 ms), with no CUDA call waiting, and the registration then holds
    CUDA for 3.3-6.2 ms (``tools/pinned_alloc_probe.py`` at 93972b0, ``register-huge``).
    """

    __slots__ = ("address", "size")

    def __init__(self, size: int) -> None:
        import cupy

        protection = mmap.PROT_READ | mmap.PROT_WRITE
        private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        address = map_memory(size, protection, private)
        try:
            # Huge pages where the kernel gives them: a fifth of the time to fill and lock
            # (refused where transparent huge pages are off; then small pages).
            advise(address, size, mmap.MADV_HUGEPAGE)
            if advise(address, size, MADV_POPULATE_WRITE) != 0:
                # A kernel before 5.14: map again, filled by mmap itself.
                unmap(address, size)
                address = map_memory(size, protection, private | mmap.MAP_POPULATE)
            cupy.cuda.runtime.hostRegister(address, size, _HOST_REGISTER_PORTABLE)
        except BaseException:
            unmap(address, size)
            raise
        self.address, self.size = address, size

    def __del__(self) -> None:
        if not hasattr(self, "address"):  # __init__ failed, and unmapped what it had mapped
            return
        # Plain tries: at interpreter exit CUDA, and this module's globals (contextlib, unmap),
        # may be gone first; the process's memory goes with it then.
        try:
            import cupy

            cupy.cuda.runtime.hostUnregister(self.address)
        except Exception:  # noqa: BLE001
            pass
        try:
            unmap(self.address, self.size)
        except Exception:  # noqa: BLE001
            pass


def _registered_pinned(size: int) -> tuple[Any, int]:
    """``size`` bytes of :class:`RegisteredMemory`: the owner and its address."""
    mem = RegisteredMemory(size)
    return mem, mem.address


#: Set once a registration was refused in this process: its buffers come from cudaHostAlloc.
_registration_refused: list[str] = []


def _page_locked(size: int) -> tuple[Any, int]:
    """``size`` bytes of page-locked memory made as ``pinned-allocation`` (``config.INTERNAL``) says;
    ``cudaHostAlloc`` where CUDA refuses to register memory (a driver or host that does not
    allow it), from then on in this process, with one warning."""
    if config.get("pinned-allocation") == "register" and not _registration_refused:
        import cupy

        try:
            return _registered_pinned(size)
        except cupy.cuda.runtime.CUDARuntimeError as error:
            _registration_refused.append(str(error))
            warnings.warn(f"page-locking host memory with cudaHostRegister was refused "
                          f"({error}); the pinned pool allocates with cudaHostAlloc instead",
                          RuntimeWarning, stacklevel=2)
    return _cuda_pinned(size)


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def pinned_pool_limit() -> int:
    """Most bytes the pinned pool keeps (``gpuchunk.pinned-pool-limit``: bytes, or a share of
    the machine's memory such as ``"25%"``).

    Examples
    --------
    >>> import dask
    >>> with dask.config.set({"gpuchunk.pinned-pool-limit": "2 GiB"}):
    ...     pinned_pool_limit()
    2147483648
    """
    value = config.get("pinned-pool-limit")
    if isinstance(value, str) and value.strip().endswith("%"):
        return int(float(value.strip()[:-1]) / 100 * _host_memory())
    return int(parse_bytes(value) if isinstance(value, str) else value)


class _Loan:
    """Gives a lent buffer back to its pool when the last array over it is gone."""

    __slots__ = ("pool", "size", "mem")

    def __init__(self, pool: PinnedPool, size: int, mem: Any) -> None:
        self.pool, self.size, self.mem = pool, size, mem

    def __del__(self) -> None:
        try:  # at interpreter exit the pool (and module globals) may be gone first
            self.pool._give(self.size, self.mem)
        except Exception:  # noqa: BLE001
            pass


class PinnedPool:
    """The process's page-locked host buffers, allocated once in size classes and reused, at
    most ``limit()`` bytes of them (:func:`pinned_pool_limit`).

    :meth:`borrow` lends a buffer for a ``with`` block (staging copies); :meth:`lend` for as
    long as the array lives (chunks whose lifetime Dask decides: results of the GPU path, file
    regions read for it). Where a new buffer would pass the limit, idle buffers are freed
    first; if that is not enough, the array is pageable: slower to copy, never wrong.

    Examples
    --------
    ``allocate(size)`` makes the memory (page-locked, as ``pinned-allocation`` says,
    by default); here, plain bytes:

    >>> import ctypes
    >>> def allocate(size):
    ...     raw = ctypes.create_string_buffer(size)
    ...     return raw, ctypes.addressof(raw)
    >>> pool = PinnedPool(allocate, limit=lambda: 1 << 20)
    >>> with pool.borrow(np.float64, (100, 5)) as buf:
    ...     buf.shape, pool.allocated_bytes
    ((100, 5), 65536)
    """

    def __init__(self, allocate: Callable[[int], tuple[Any, int]] = _page_locked,
                 limit: Callable[[], int] = pinned_pool_limit) -> None:
        self._allocate = allocate
        self._limit = limit
        self._free: dict[int, list[tuple[Any, int]]] = {}
        # Re-entrant: a loan's __del__ may give a buffer back from inside a locked block of
        # the same thread (when the garbage collector runs there).
        self._lock = threading.RLock()
        self.allocated_bytes = 0

    def _take(self, nbytes: int) -> tuple[int, tuple[Any, int] | None]:
        size = _size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                return size, free.pop()
            over = self.allocated_bytes + size - self._limit()
            if over > 0:
                self._trim(over)
                if self.allocated_bytes + size > self._limit():
                    return size, None
            self.allocated_bytes += size  # reserved before the slow allocation
        try:
            return size, self._allocate(size)
        except BaseException:
            with self._lock:
                self.allocated_bytes -= size
            raise

    def _trim(self, nbytes: int) -> None:
        """Free idle buffers, largest first, until ``nbytes`` are freed or none is idle."""
        for size in sorted(self._free, reverse=True):
            buffers = self._free[size]
            while buffers and nbytes > 0:
                buffers.pop()
                self.allocated_bytes -= size
                nbytes -= size
        self._free = {size: b for size, b in self._free.items() if b}

    def _give(self, size: int, mem: tuple[Any, int]) -> None:
        with self._lock:
            self._free.setdefault(size, []).append(mem)

    @staticmethod
    def _array(address: int, size: int, dtype: np.dtype, shape: tuple[int, ...],
               owner: Any) -> np.ndarray:
        raw = (ctypes.c_ubyte * size).from_address(address)
        raw.owner = owner  # kept alive by every array over ``raw``
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)

    @contextlib.contextmanager
    def borrow(self, dtype: Any, shape: tuple[int, ...]) -> Iterator[np.ndarray]:
        """A C-contiguous page-locked NumPy array of ``shape`` and ``dtype``, returned on exit
        (pageable where the pool is at its limit).

        The caller must make sure every asynchronous copy touching it has completed (synchronise
        its stream) before the ``with`` block ends.
        """
        shape, dtype, nbytes = _layout(shape, dtype)
        size, mem = self._take(max(nbytes, 1))
        if mem is None:
            yield np.empty(shape, dtype)
            return
        try:
            yield self._array(mem[1], size, dtype, shape, mem[0])
        finally:
            self._give(size, mem)

    def lend(self, shape: Any, dtype: Any = np.float64) -> np.ndarray:
        """A new page-locked NumPy array whose buffer comes back to the pool when the array and
        every view of it are gone (pageable where the pool is at its limit)."""
        shape, dtype, nbytes = _layout(shape, dtype)
        size, mem = self._take(max(nbytes, 1))
        if mem is None:
            return np.empty(shape, dtype)
        return self._array(mem[1], size, dtype, shape, _Loan(self, size, mem))

    def clear(self) -> None:
        """Free every idle buffer (buffers on loan come back later, and are kept)."""
        with self._lock:
            self._trim(self.allocated_bytes)


#: The process-wide pool used by chunk execution.
pinned_pool = PinnedPool()


def is_pinned(array: np.ndarray) -> bool:
    """Whether a host array's memory is page-locked (allocated or registered with CUDA)."""
    import cupy

    if array.size == 0:
        return False
    return bool(cupy.cuda.pinned_memory.is_memory_pinned(array.ctypes.data))


def empty_pinned(shape: Any, dtype: Any = np.float64) -> np.ndarray:
    """A new, uninitialised NumPy array in its own page-locked allocation, freed with the array.

    Unlike ``cupyx.empty_pinned`` it does not go through CuPy's pinned pool (which rounds up to
    a power of two and keeps the memory after the array is gone). Give it as ``out=`` to get
    results straight from the device, with no staging copy.
    """
    import cupy

    shape, dtype, nbytes = _layout(shape, dtype)
    mem = cupy.cuda.PinnedMemory(max(nbytes, 1))
    ptr = cupy.cuda.PinnedMemoryPointer(mem, 0)
    return np.ndarray(shape, dtype=dtype, buffer=ptr)


class DeviceSlot:
    """The right to run one chunk on a device: a non-blocking stream of its own.

    Device buffers are allocated while the slot's stream is current, so CuPy's pool (which
    keeps one arena per stream) caches at most one chunk's buffers per slot.
    """

    def __init__(self) -> None:
        import cupy

        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.nb_stream = numba_stream(self.stream)


class _DeviceQueue:
    def __init__(self) -> None:
        self.free: queue.SimpleQueue[DeviceSlot] = queue.SimpleQueue()
        for _ in range(GPU_TASKS_PER_DEVICE):
            self.free.put(DeviceSlot())
        self.h2d = threading.Semaphore(H2D_IN_FLIGHT)


_queues: dict[int, _DeviceQueue] = {}
_queues_lock = threading.Lock()


def per_device(registry: dict[int, T], lock: threading.Lock, make: Callable[[], T]) -> T:
    """The current device's entry of ``registry``, made by ``make()`` the first time (under
    ``lock``): state kept once per GPU of the process."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    with lock:
        entry = registry.get(device)
        if entry is None:
            entry = registry[device] = make()
        return entry


def _device_queue() -> _DeviceQueue:
    return per_device(_queues, _queues_lock, _DeviceQueue)


@contextlib.contextmanager
def device_slot() -> Iterator[DeviceSlot]:
    """Hold one of the current device's ``GPU_TASKS_PER_DEVICE`` slots (waiting for one)."""
    q = _device_queue()
    slot = q.free.get()
    try:
        yield slot
    finally:
        q.free.put(slot)


def h2d_slot() -> threading.Semaphore:
    """The current device's semaphore for H2D copies in flight (``H2D_IN_FLIGHT``)."""
    return _device_queue().h2d


def copy_to_device(dst: Any, src: np.ndarray, stream: Any) -> None:
    """Enqueue a copy of a C-contiguous host array into a C-contiguous CuPy array of its shape
    and dtype on ``stream`` (asynchronous from pinned memory)."""
    if src.nbytes:
        dst.set(src, stream=stream)


def copy_to_host(dst: np.ndarray, src: Any, stream: Any) -> None:
    """Enqueue a copy of a C-contiguous CuPy array into a C-contiguous host array of its shape
    and dtype on ``stream`` (asynchronous into pinned memory)."""
    if dst.nbytes:
        src.get(stream=stream, out=dst, blocking=False)
