"""Chunks on the CPU: the numba ``njit(parallel=True)`` twins, in the Dask thread that computes
the chunk, with a share of the cores (:func:`cpu_threads`)."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _compat
from .._kernels.elementwise import ElementwiseKernels, partial_count
from ..devices import gpu_available
from .chunk_layout import _as_plan, _chunk_reductions, _collapsed_views, _host_inputs

__all__ = ["cpu_threads", "dask_threads", "prepare_process", "run_cpu", "run_cpu_kernel"]

#: CPU kernels run in the Dask thread that computes their chunk, each with
#: ``CPU_OVERSUBSCRIPTION * cores / dask_threads`` numba threads (at least one, at most every
#: core). Measured on the H200 host (16 cores, 16 Dask threads, seed 000's product in 20
#: chunks, docs/measurements): one thread per kernel 146-158 ms (the last four chunks run on
#: four cores); 2 to 16 threads per kernel 119-138 ms; one kernel at a time on all cores from a
#: single launcher thread (an earlier design) 154-162 ms; numba's own kernel over the whole
#: arrays 138-155 ms in the same runs.
CPU_OVERSUBSCRIPTION = 4


_layer_checked: list[bool] = []


_serial = threading.Lock()


def dask_threads() -> int:
    """How many threads of the Dask scheduler running this may compute chunks at once."""
    try:
        from distributed import get_worker

        return max(1, _compat.worker_threads(get_worker()))
    except Exception:
        import dask

        return int(dask.config.get("num_workers", None) or os.cpu_count() or 1)


def cpu_threads() -> int:
    """numba threads for one CPU kernel (see ``CPU_OVERSUBSCRIPTION``)."""
    import numba

    cores = int(numba.config.NUMBA_NUM_THREADS)
    return max(1, min(cores, CPU_OVERSUBSCRIPTION * cores // dask_threads()))


def _threadsafe_layer() -> bool:
    """Whether numba's threading layer runs parallel kernels from several threads at once.

    ``omp`` and ``tbb`` do; ``workqueue`` (numba's fallback) aborts the process instead, so
    with it CPU kernels run one at a time.
    """
    if not _layer_checked:
        import numba

        @numba.njit(parallel=True)
        def _touch(x: np.ndarray) -> None:
            for i in numba.prange(x.shape[0]):
                x[i] = i

        with _serial:
            if not _layer_checked:
                _touch(np.empty(2))
                _layer_checked.append(numba.threading_layer() in ("omp", "tbb"))
    return _layer_checked[0]


def prepare_process() -> None:
    """Initialise now what the first chunk of this process would otherwise wait for: where a
    GPU is visible, the imports of CuPy and numba's CUDA module; else numba's threading layer (its
    first parallel kernel). Workers of ``dg.local_cluster`` call it as they start
    (:func:`dask_gpuchunk.distributed.cluster.dask_setup`). It creates no CUDA context: dask-cuda
    creates each worker's, on its own device, after the preload (and warns if one exists already).

    A GPU worker starts numba's threading layer at its first CPU kernel, if it runs one: on
    this 2-core CI machine the layer took 0.9 s of a worker's setup and 0.5 s of its close
    (not yet measured on a GPU machine)."""
    if gpu_available():
        import cupy  # noqa: F401
        from numba import cuda  # noqa: F401
    else:
        _threadsafe_layer()


def run_cpu(
    kernels: ElementwiseKernels,
    out_dtype: Any,
    inputs: Sequence[np.ndarray],
    dest: Any = None,
    threads: int | None = None,
) -> Any:
    """Compute one NumPy chunk with the CPU twin, into ``dest`` if given.

    ``out_dtype``: the result's dtype, or an :class:`ElementwisePlan` (then ``dest`` is a
    tuple of outputs or ``None``, and the result ``(outputs, reductions)``: each reduction a
    0-d array of its partial dtype). ``threads``: numba threads for this kernel (default
    :func:`cpu_threads`).
    """
    plan, single = _as_plan(out_dtype)
    inputs = _host_inputs(inputs)
    shape = np.broadcast_shapes(*(np.shape(a) for a in inputs))
    dests = (dest,) if single and dest is not None else dest
    if dests is None:
        dests = tuple(np.empty(shape, dtype=dt) for dt in plan.out_dtypes)
    n = int(np.prod(shape))
    partials = [np.empty(partial_count(n, "cpu"), dt) for dt in plan.partial_dtypes()]
    if n:
        out_v, in_v = _collapsed_views(np, dests, inputs)
        if single:
            run_cpu_kernel(kernels.cpu, out_v[0], *in_v, threads=threads)
        else:
            run_cpu_kernel(functools.partial(kernels.cpu_pass, plan, out_v, partials), *in_v,
                           threads=threads)
    if single:
        return dests[0]
    return tuple(dests), _chunk_reductions(np, plan, partials)


def run_cpu_kernel(kernel: Callable[..., Any], *args: Any, threads: int | None = None) -> Any:
    """Call a numba ``parallel=True`` kernel from this (Dask) thread with its share of the cores.

    ``threads``: numba threads for this call (default :func:`cpu_threads`). Under numba's
    ``workqueue`` threading layer, calls run one at a time, each on every core.
    """
    import numba

    if _threadsafe_layer():
        numba.set_num_threads(threads or cpu_threads())  # for this thread's kernels only
        return kernel(*args)
    with _serial:
        numba.set_num_threads(threads or int(numba.config.NUMBA_NUM_THREADS))
        return kernel(*args)
