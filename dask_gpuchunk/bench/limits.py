"""The physical limits a benchmark run measures on its own machine.

* PCIe: pinned host to device, device to host, and both directions at once (two streams).
* HBM: a large device-to-device copy (bytes read plus bytes written).
* Host memory: a numba parallel copy with every core (bytes read plus bytes written).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

__all__ = ["available_host_memory", "copy_bytes", "host_bandwidth", "hbm_bandwidth",
           "pcie_bandwidth"]


def available_host_memory() -> int | None:
    """Host memory available to a new allocation now, in bytes (Linux's ``MemAvailable``;
    free pages elsewhere); None where it cannot be read.

    Examples
    --------
    >>> m = available_host_memory()
    >>> m is None or m > 0
    True
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def host_bandwidth(nbytes: int = 1 << 30, repeat: int = 5) -> dict[str, float]:
    """All-core host memory traffic of a parallel copy, bytes/s (read + write counted)."""
    import numba

    @numba.njit(parallel=True, nogil=True)
    def copy(dst: np.ndarray, src: np.ndarray) -> None:
        for i in numba.prange(src.shape[0]):
            dst[i] = src[i]

    n = nbytes // 8
    src = np.ones(n)
    dst = np.zeros(n)
    copy(dst, src)
    best = min(_wall(lambda: copy(dst, src)) for _ in range(repeat))
    return {"host_copy_traffic": 2 * src.nbytes / best, "host_copy_seconds": best,
            "host_copy_bytes": float(src.nbytes)}


def _wall(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_bytes(wanted: int, room: int | None) -> int:
    """Bytes of each of a device measurement's two buffers: ``wanted``, or less where the
    device has less ``room`` (CuPy's pool limit, a ``--device-budget``), so that both buffers
    take at most half of it (whole MiB, at least one). Under a 2 GiB cap the HBM copy's two
    4 GiB buffers ran the bench out of memory.

    Examples
    --------
    >>> copy_bytes(4 << 30, None) == 4 << 30, copy_bytes(4 << 30, 2 << 30) == 512 << 20
    (True, True)
    >>> copy_bytes(1 << 30, 1000)
    1048576
    """
    if room is None:
        return wanted
    return max(1 << 20, min(wanted, room // 4) >> 20 << 20)


def _device_room() -> int | None:
    """What CuPy's pool may hold on this device: its limit where one is set
    (``CUPY_GPU_MEMORY_LIMIT``), else the device's free memory."""
    import cupy

    limit = cupy.get_default_memory_pool().get_limit()
    return int(limit) if limit else int(cupy.cuda.runtime.memGetInfo()[0])


def pcie_bandwidth(nbytes: int = 1 << 30, repeat: int = 5) -> dict[str, float]:
    """Pinned H2D, D2H and simultaneous H2D+D2H bandwidth in bytes/s (best of ``repeat``), over
    buffers of ``nbytes`` or what the device has room for (:func:`copy_bytes`)."""
    import cupy

    from ..runtime.staging import copy_to_device, copy_to_host, empty_pinned

    nbytes = copy_bytes(nbytes, _device_room())
    host_a = empty_pinned(nbytes, np.uint8)
    host_b = empty_pinned(nbytes, np.uint8)
    host_a[:] = 1
    dev_a = cupy.empty(nbytes, dtype=np.uint8)
    dev_b = cupy.empty(nbytes, dtype=np.uint8)
    s1 = cupy.cuda.Stream(non_blocking=True)
    s2 = cupy.cuda.Stream(non_blocking=True)

    def h2d() -> None:
        copy_to_device(dev_a, host_a, s1)
        s1.synchronize()

    def d2h() -> None:
        copy_to_host(host_b, dev_b, s1)
        s1.synchronize()

    def both() -> None:
        copy_to_device(dev_a, host_a, s1)
        copy_to_host(host_b, dev_b, s2)
        s1.synchronize()
        s2.synchronize()

    h2d(), d2h(), both()
    t_h2d = min(_wall(h2d) for _ in range(repeat))
    t_d2h = min(_wall(d2h) for _ in range(repeat))
    t_both = min(_wall(both) for _ in range(repeat))
    return {"h2d": nbytes / t_h2d, "d2h": nbytes / t_d2h, "bidirectional": 2 * nbytes / t_both}


def hbm_bandwidth(nbytes: int = 4 << 30, repeat: int = 10) -> float:
    """Device-to-device copy traffic in bytes/s (read + write counted), best of ``repeat``, over
    buffers of ``nbytes`` or what the device has room for (:func:`copy_bytes`)."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()  # what earlier measurements left cached
    nbytes = copy_bytes(nbytes, _device_room())
    src = cupy.ones(nbytes // 8)
    dst = cupy.empty_like(src)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    best = float("inf")
    for _ in range(repeat + 1):
        start.record()
        cupy.copyto(dst, src)
        stop.record()
        stop.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    del src, dst
    cupy.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes / best
