"""Host-device staging: reusable pinned buffers, one CUDA stream per executing thread, raw copies.

Pageable host memory cannot be copied asynchronously: the driver stages it itself, at a third
of the link's speed, and serialises the copy with the caller. So a NumPy chunk bound for the GPU
is first copied into a pinned buffer borrowed from :class:`PinnedPool` and sent from there; a
chunk already in pinned memory is sent directly. Pinned buffers are expensive to allocate
(``cudaHostAlloc`` of 200 MB takes tens of milliseconds) and CuPy's own pinned pool rounds every
request up to a power of two, so the pool here allocates each buffer once, in size classes at most
1/8 larger than the request, and hands it out again.

Host copies run in every Dask thread at once. The device side of a chunk runs while holding one
of a few :func:`device_slot` s per device, each with its own non-blocking stream: the chunk's
copies and kernel are ordered on that stream, several slots' chunks overlap on the GPU, and the
device memory in use (and cached by CuPy's pool, one arena per stream) is bounded by the number
of slots. This module needs CuPy; nothing here is imported where no GPU is visible.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from ._kernels.launch import numba_stream

__all__ = [
    "PinnedPool",
    "pinned_pool",
    "is_pinned",
    "device_slot",
    "h2d_slot",
    "copy_to_device",
    "copy_to_host",
    "empty_pinned",
    "empty_pooled_pinned",
    "per_device",
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

_H2D = 1  # cudaMemcpyHostToDevice
_D2H = 2  # cudaMemcpyDeviceToHost


def _size_class(nbytes: int) -> int:
    """Round up so that at most 1/8 is wasted and similar sizes share buffers."""
    if nbytes <= 1 << 16:
        return 1 << 16
    step = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


class PinnedPool:
    """A thread-safe pool of page-locked host buffers, allocated once and reused.

    Examples
    --------
    On a machine with a GPU::

        pool = PinnedPool()
        with pool.borrow(np.float64, (1000, 500)) as buf:   # a pinned NumPy array
            buf[...] = chunk
    """

    def __init__(self) -> None:
        self._free: dict[int, list[Any]] = {}
        self._lock = threading.Lock()
        self.allocated_bytes = 0

    def _take(self, nbytes: int) -> tuple[int, Any]:
        import cupy

        size = _size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                return size, free.pop()
        mem = cupy.cuda.PinnedMemory(size)
        with self._lock:
            self.allocated_bytes += size
        return size, mem

    def _give(self, size: int, mem: Any) -> None:
        with self._lock:
            self._free.setdefault(size, []).append(mem)

    @contextlib.contextmanager
    def borrow(self, dtype: Any, shape: tuple[int, ...]) -> Iterator[np.ndarray]:
        """A C-contiguous pinned NumPy array of ``shape`` and ``dtype``, returned on exit.

        The caller must make sure every asynchronous copy touching it has completed (synchronise
        its stream) before the ``with`` block ends.
        """
        import cupy

        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        size, mem = self._take(max(nbytes, 1))
        try:
            yield np.ndarray(shape, dtype=dtype, buffer=cupy.cuda.PinnedMemoryPointer(mem, 0))
        finally:
            self._give(size, mem)

    def clear(self) -> None:
        """Free every idle buffer (buffers on loan are kept by their borrowers)."""
        with self._lock:
            for size, buffers in self._free.items():
                self.allocated_bytes -= size * len(buffers)
            self._free.clear()


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

    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
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
    """Enqueue a copy of a C-contiguous host array into a C-contiguous CuPy array of equal size."""
    import cupy

    if src.nbytes:
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes, _H2D, stream.ptr)


def copy_to_host(dst: np.ndarray, src: Any, stream: Any) -> None:
    """Enqueue a copy of a C-contiguous CuPy array into a C-contiguous host array of equal size."""
    import cupy

    if dst.nbytes:
        cupy.cuda.runtime.memcpyAsync(dst.ctypes.data, src.data.ptr, dst.nbytes, _D2H, stream.ptr)



def empty_pooled_pinned(shape: Any, dtype: Any = np.float64) -> np.ndarray:
    """A new page-locked NumPy array from CuPy's pinned pool, back in the pool when it is gone.

    For chunks whose lifetime Dask decides (files read for the GPU, results of the GPU path):
    allocated from the pool's cached blocks after the first ones (which ``cudaHostAlloc``), at
    the price of the pool's rounding up to a power of two.
    """
    import cupyx

    return cupyx.empty_pinned(shape, dtype=dtype)
