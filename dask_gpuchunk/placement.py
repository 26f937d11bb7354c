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
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["decisions", "forget", "host_copy_bandwidth", "pcie_bandwidth", "run_placed"]

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

    from .staging import copy_to_device, copy_to_host, pinned_pool

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


def _tiny(inputs: Sequence[Any]) -> list[Any]:
    """One-element slices with the inputs' dtypes and dimensionality, to compile kernels."""
    return [a[(slice(0, 1),) * a.ndim] if np.ndim(a) else a for a in inputs]


def _measure(kernels: Any, out_dtype: np.dtype, inputs: list[np.ndarray], dest: np.ndarray | None,
             key: tuple) -> tuple[str, np.ndarray]:
    import numba

    from .backend import dask_threads, run_cpu, run_gpu_from_host

    shape = np.broadcast_shapes(*(np.shape(a) for a in inputs))
    tiny = _tiny(inputs)
    run_cpu(kernels, out_dtype, tiny)
    run_gpu_from_host(kernels, out_dtype, tiny)

    stages: dict[str, float] = {}
    result = run_gpu_from_host(kernels, out_dtype, inputs, dest, timings=stages)
    scratch = np.empty(shape, dtype=out_dtype)
    t0 = time.perf_counter()
    # Every core on this one chunk: the throughput of all Dask threads sharing the cores.
    run_cpu(kernels, out_dtype, inputs, scratch, threads=int(numba.config.NUMBA_NUM_THREADS))
    t_cpu = time.perf_counter() - t0

    h2d_rate, d2h_rate = pcie_bandwidth()
    t_stage = 0.0
    if stages["staged_bytes"] and stages["stage_seconds"] > 0:
        one_thread = stages["staged_bytes"] / stages["stage_seconds"]
        t_stage = stages["staged_bytes"] / (one_thread * dask_threads())
    host_traffic = 2 * stages["staged_bytes"] + stages["h2d_bytes"] + stages["d2h_bytes"]
    t_host = host_traffic / host_copy_bandwidth()
    t_h2d = stages["h2d_bytes"] / h2d_rate
    t_d2h = stages["d2h_bytes"] / d2h_rate
    t_gpu = max(t_h2d, t_d2h, stages["kernel"], t_stage, t_host)
    choice = "gpu" if t_gpu < t_cpu else "cpu"
    if choice == "cpu":
        np.copyto(result, scratch)
    record = {
        "function": getattr(kernels.func, "__name__", repr(kernels.func)),
        "key": key,
        "chunk_shape": shape,
        "t_cpu": t_cpu,
        "t_gpu_estimate": t_gpu,
        "t_h2d": t_h2d,
        "t_d2h": t_d2h,
        "t_stage": t_stage,
        "t_host_memory": t_host,
        "host_bandwidth": host_copy_bandwidth(),
        **{f"gpu_{k}": v for k, v in stages.items()},
        "choice": choice,
    }
    with _guard:
        _records.append(record)
    return choice, result


def run_placed(kernels: Any, out_dtype: np.dtype, inputs: Sequence[Any],
               dest: np.ndarray | None) -> np.ndarray:
    """Compute a NumPy chunk on the device the rule picks (measuring first if needed)."""
    from ._kernels.elementwise import is_python_number
    from .backend import run_cpu, run_gpu_from_host
    from .staging import is_pinned

    from .budget import working_budget

    inputs = [a if is_python_number(a) else np.asarray(a) for a in inputs]
    shape = np.broadcast_shapes(*(np.shape(a) for a in inputs))
    device_bytes = (sum(np.asarray(a).nbytes for a in inputs if not is_python_number(a))
                    + int(np.prod(shape)) * np.dtype(out_dtype).itemsize)
    if device_bytes > working_budget():  # never fits the GPU here: the CPU computes it
        return run_cpu(kernels, out_dtype, inputs, dest)
    pinned = tuple(bool(np.ndim(a) and a.flags.c_contiguous and is_pinned(a)) for a in inputs)
    dest_pinned = dest is not None and dest.flags.c_contiguous and is_pinned(dest)
    key = (kernels.token, tuple(type(a).__name__ if is_python_number(a) else a.dtype.str
                                for a in inputs), np.dtype(out_dtype).str, pinned, dest_pinned)
    choice = _decided.get(key)
    if choice is None:
        with _guard:
            lock = _locks.setdefault(key, threading.Lock())
        with lock:
            choice = _decided.get(key)
            if choice is None and int(np.prod(shape)) > 1:
                choice, result = _measure(kernels, np.dtype(out_dtype), inputs, dest, key)
                _decided[key] = choice
                return result
    if choice == "gpu":
        return run_gpu_from_host(kernels, out_dtype, inputs, dest)
    return run_cpu(kernels, out_dtype, inputs, dest)
