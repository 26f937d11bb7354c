"""``device="auto"`` for NumPy chunks: a measured rule that decides CPU or GPU, then remembers.

The rule. The first NumPy chunk of each (function, input dtypes, output dtype, which inputs and
destination are pinned) is computed both ways:

* **CPU**: the parallel CPU twin on this chunk with every core, wall time ``t_cpu``: the cost
  of a chunk when all of Dask's threads share the cores.
* **GPU**: the staged GPU pipeline on this chunk, with its kernel timed (CUDA events) and its
  traffic counted: bytes over PCIe each way and bytes copied through pinned buffers. In steady
  state Dask's threads overlap the stages of different chunks, so a chunk costs its slowest
  resource::

      t_gpu = max(h2d_bytes / h2d_rate,            PCIe, each way
                  d2h_bytes / d2h_rate,
                  kernel,                          the GPU
                  staged_bytes / (one_thread_copy_rate * threads),   the staging threads
                  host_traffic / host_bandwidth)   host memory, shared by all of them

  ``host_traffic`` counts every byte the path moves through host memory: each staged byte is
  read and written by its copy, and each byte crossing PCIe is read or written again by the
  DMA engine: ``2 * staged_bytes + h2d_bytes + d2h_bytes``. The CPU kernel moves only
  ``in + out``, which is why a memory-bound function over pageable arrays stays on the CPU.
  The PCIe rates (pinned copies of 64 MB) and ``host_bandwidth`` (an all-core copy of 256 MB,
  read plus write) are measured once per process; one thread's copy rate on this chunk.

The device with the smaller estimate computes every later chunk of that key. Both estimates
scale with chunk size alike, so the decision holds for every chunk size. Measured on an H200
host (DESIGN.md): a product of pageable arrays is bound by host memory either way and the CPU
wins (staging moves every byte twice more than the CPU kernel does); a function with many
operations per element wins on the GPU. Kernels are compiled (on a one-element slice) before
anything is timed. :func:`decisions` lists what was decided and why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .staging import copy_to_device, copy_to_host, pinned_pool

__all__ = ["decide", "decided", "decisions", "estimate", "forget", "host_copy_bandwidth",
           "pcie_bandwidth"]

_decided: dict[tuple, str] = {}
_records: list[dict[str, Any]] = []
_locks: dict[tuple, threading.Lock] = {}
_guard = threading.Lock()
_host_bw: list[float] = []
_pcie_bw: dict[int, tuple[float, float]] = {}


def decisions() -> list[dict[str, Any]]:
    """What ``device="auto"`` decided in this process, one record per key, with the timings.

    Examples
    --------
    >>> isinstance(decisions(), list)
    True
    """
    with _guard:
        return [dict(r) for r in _records]


def forget() -> None:
    """Drop every cached decision (the next chunk of each key is measured again)."""
    with _guard:
        _decided.clear()
        _records.clear()
        _locks.clear()


def host_copy_bandwidth() -> float:
    """Host memory traffic (bytes read + written per second) of an all-core copy (measured once)."""
    if _host_bw:
        return _host_bw[0]
    import numba

    @numba.njit(parallel=True, nogil=True)
    def _copy(dst: np.ndarray, src: np.ndarray) -> None:
        for i in numba.prange(src.shape[0]):
            dst[i] = src[i]

    n = 32 << 20  # 32 Mi float64 = 256 MB per buffer: well past the CPU caches
    src = np.ones(n)
    dst = np.zeros(n)
    _copy(dst[:8], src[:8])
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        _copy(dst, src)
        best = min(best, time.perf_counter() - t0)
    _host_bw.append(2 * src.nbytes / best)
    return _host_bw[0]


def pcie_bandwidth() -> tuple[float, float]:
    """Pinned (H2D, D2H) bytes per second to the current GPU (measured once, 64 MB copies)."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    if device in _pcie_bw:
        return _pcie_bw[device]
    nbytes = 64 << 20
    stream = cupy.cuda.Stream(non_blocking=True)
    dev = cupy.empty(nbytes, dtype=np.uint8)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    rates = []
    with pinned_pool.borrow(np.uint8, (nbytes,)) as host:
        host[:] = 1
        for copy in (lambda: copy_to_device(dev, host, stream),
                     lambda: copy_to_host(host, dev, stream)):
            best = float("inf")
            for _ in range(4):
                start.record(stream)
                copy()
                stop.record(stream)
                stop.synchronize()
                best = min(best, cupy.cuda.get_elapsed_time(start, stop) / 1e3)
            rates.append(nbytes / best)
    _pcie_bw[device] = (rates[0], rates[1])
    return _pcie_bw[device]


def estimate(stages: dict[str, float], t_cpu: float, threads: int, h2d_rate: float,
             d2h_rate: float, host_bandwidth: float) -> dict[str, Any]:
    """The rule, a pure function: the GPU estimate of a chunk from its staged run's ``stages``
    (``h2d_bytes``, ``d2h_bytes``, ``staged_bytes``, ``stage_seconds``, ``kernel``), beside the
    CPU's measured ``t_cpu`` with every core; ``threads`` Dask threads share the staging.

    Examples
    --------
    A product of pageable arrays, 8 MB in and 8 MB out: bound by host memory either way.

    >>> stages = {"h2d_bytes": 16e6, "d2h_bytes": 8e6, "staged_bytes": 24e6,
    ...           "stage_seconds": 4e-3, "kernel": 1e-4}
    >>> r = estimate(stages, t_cpu=1.5e-3, threads=16, h2d_rate=25e9, d2h_rate=25e9,
    ...              host_bandwidth=40e9)
    >>> r["choice"], round(r["t_gpu_estimate"] * 1e3, 2), round(r["t_host_memory"] * 1e3, 2)
    ('cpu', 1.8, 1.8)
    """
    t_stage = 0.0
    if stages["staged_bytes"] and stages["stage_seconds"] > 0:
        one_thread = stages["staged_bytes"] / stages["stage_seconds"]
        t_stage = stages["staged_bytes"] / (one_thread * threads)
    host_traffic = 2 * stages["staged_bytes"] + stages["h2d_bytes"] + stages["d2h_bytes"]
    t_host = host_traffic / host_bandwidth
    t_h2d = stages["h2d_bytes"] / h2d_rate
    t_d2h = stages["d2h_bytes"] / d2h_rate
    t_gpu = max(t_h2d, t_d2h, stages["kernel"], t_stage, t_host)
    return {
        "t_cpu": t_cpu,
        "t_gpu_estimate": t_gpu,
        "t_h2d": t_h2d,
        "t_d2h": t_d2h,
        "t_stage": t_stage,
        "t_host_memory": t_host,
        "host_bandwidth": host_bandwidth,
        **{f"gpu_{k}": v for k, v in stages.items()},
        "choice": "gpu" if t_gpu < t_cpu else "cpu",
    }


def decided(key: tuple) -> str | None:
    """The device decided for ``key`` in this process, if any."""
    return _decided.get(key)


def decide(key: tuple, measure: Callable[[], tuple[dict[str, Any], Any]]) -> tuple[str, Any]:
    """The device decided for ``key``, with ``None``; or, the first time (one thread per key
    measures, the others wait for it), ``measure()``'s record's choice and its result, the
    record kept for :func:`decisions`."""
    choice = _decided.get(key)
    if choice is not None:
        return choice, None
    with _guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        choice = _decided.get(key)
        if choice is not None:
            return choice, None
        record, result = measure()
        with _guard:
            _records.append(record)
        _decided[key] = record["choice"]
        return record["choice"], result
