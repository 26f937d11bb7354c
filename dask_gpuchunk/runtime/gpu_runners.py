"""The GPU paths of a chunk: ``device`` (CuPy inputs, queued on the current stream), ``staged``
(NumPy inputs through pinned buffers) and the host result of either."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import config
from .._kernels.elementwise import ElementwiseKernels, is_scalar
from .._kernels.launch import numba_stream
from .budget import reserve, run_reserved
from .staging import copy_to_device, copy_to_host, device_slot, h2d_slot, is_pinned, pinned_pool
from .chunk_layout import _as_plan, _host_inputs, _scalars_by_value, is_cupy, staging_totals
from .device_launch import _launch, _partials_bytes, _pass_launch, device_call

__all__ = ["host_result", "run_gpu_from_host", "run_gpu_on_device", "run_on_device", "run_staged",
           "to_host"]

def run_gpu_on_device(
    kernels: ElementwiseKernels, out_dtype: Any, inputs: Sequence[Any], dest: Any = None,
    finished: bool = False,
) -> Any:
    """Compute one chunk on the GPU where at least one input is a CuPy array; CuPy result.

    Like any CuPy operation, the kernel is queued on the thread's current CuPy stream (the
    default stream unless the caller chose another) and the result returned without waiting:
    work queued after it on that stream, or on the default stream, sees the result.
    ``out_dtype``: a dtype, or an :class:`ElementwisePlan` (as :func:`run_cpu`; reductions
    are 0-d CuPy arrays of their partial dtypes, or ``finished``, of NumPy's dtypes of them
    (:func:`total_dtypes`)). ``dest``: CuPy arrays to write into (a tuple with a plan), as
    ``out=`` of a CuPy ufunc.
    """
    plan, single = _as_plan(out_dtype)
    inputs = _scalars_by_value(inputs)
    if all(is_cupy(a) or is_scalar(a) for a in inputs):
        dests = None if dest is None else ([dest] if single else list(dest))
        return device_call(kernels, plan, inputs, dests, finished)(inputs, dests)
    # NumPy arrays among CuPy ones: copied to the device first.
    shape = np.broadcast_shapes(*(np.shape(a) for a in inputs))
    if single:
        return run_on_device(functools.partial(_launch, kernels), shape, out_dtype, inputs)
    return run_on_device(_pass_launch(kernels, plan), shape, plan.out_dtypes, inputs,
                         scratch_bytes=_partials_bytes(plan, shape))


def _send(host: np.ndarray, stream: Any) -> Any:
    """A new CuPy array holding the C-contiguous pinned ``host``, copied on ``stream``."""
    import cupy

    dev = cupy.empty(host.shape, dtype=host.dtype)
    copy_to_device(dev, host, stream)
    return dev


def run_gpu_from_host(
    kernels: ElementwiseKernels,
    out_dtype: Any,
    inputs: Sequence[np.ndarray],
    dest: Any = None,
    timings: dict[str, float] | None = None,
) -> Any:
    """Compute one NumPy chunk on the GPU through pinned staging, into ``dest`` if given.

    See :func:`run_staged`, which this calls with the elementwise kernel as the launch;
    ``out_dtype`` a dtype or an :class:`ElementwisePlan` (as :func:`run_cpu`).
    """
    plan, single = _as_plan(out_dtype)
    inputs = _host_inputs(inputs)
    shape = np.broadcast_shapes(*(np.shape(a) for a in inputs))
    if single:
        return run_staged(
            functools.partial(_launch, kernels), shape, out_dtype, inputs, dest, timings
        )
    return run_staged(_pass_launch(kernels, plan), shape, plan.out_dtypes, inputs, dest,
                      timings, scratch_bytes=_partials_bytes(plan, shape))


def host_result(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A host array for a result coming from the device: page-locked where
    ``pinned-results`` (``config.INTERNAL``) is on (the result lands in it with no staging copy, and a file
    writer sends it on from there: one host copy less per chunk), else plain NumPy."""
    if config.flag("pinned-results") and int(np.prod(shape)):
        return pinned_pool.lend(shape, dtype)
    return np.empty(shape, dtype=dtype)


def to_host(block: Any) -> np.ndarray:
    """``block`` as a NumPy array: a CuPy block copied into a :func:`host_result` on the
    current stream (its bytes and time counted in ``staging_totals``), any other returned as
    NumPy without a copy where it is one. A task that hands a device's result to another
    process or to a file calls it where the block is: what leaves the worker is then plain
    bytes, and the receiver needs no GPU.

    Examples
    --------
    >>> to_host(np.arange(3))
    array([0, 1, 2])
    """
    if not is_cupy(block):
        return np.asarray(block)
    import cupy

    block = cupy.ascontiguousarray(block)
    host = host_result(block.shape, block.dtype)
    t0 = time.perf_counter()
    stream = cupy.cuda.get_current_stream()
    copy_to_host(host, block, stream)
    stream.synchronize()
    staging_totals.add(d2h_bytes=int(block.nbytes), device_seconds=time.perf_counter() - t0)
    return host


def run_staged(
    launch: Callable[[Any, list[Any], Any], None],
    shape: tuple[int, ...],
    out_dtype: Any,
    inputs: Sequence[Any],
    dest: np.ndarray | None = None,
    timings: dict[str, float] | None = None,
    scratch_bytes: int = 0,
    what: str = "a chunk",
) -> np.ndarray:
    """Run ``launch`` on the GPU over host ``inputs`` through pinned staging; NumPy result.

    ``launch(out, inputs, nb_stream)`` queues the work that fills the CuPy array ``out`` from
    the CuPy ``inputs`` (scalars pass through) on the current CuPy stream, whose numba
    handle is ``nb_stream``.

    Three phases: inputs not already pinned and contiguous are copied into pinned buffers (in
    every Dask thread at once); then, holding one of the device's task slots, device buffers
    are taken from CuPy's pool, H2D (holding an H2D slot until the copies land), the launch,
    D2H straight into ``dest`` if it is pinned and contiguous, else into a pinned buffer; last,
    that buffer is copied into ``dest``.

    With ``timings`` (a dict), it records what :mod:`dask_gpuchunk.runtime.placement` needs:
    ``stage_seconds`` and ``staged_bytes`` (host copies into and out of pinned buffers),
    ``h2d_bytes``/``d2h_bytes`` (PCIe traffic) and ``kernel`` (seconds, CUDA events).

    The chunk holds a reservation of the device budget
    (:func:`dask_gpuchunk.runtime.budget.reserve`) for its inputs, its output and ``scratch_bytes``
    (what ``launch`` allocates) while it holds device memory; ``what`` names it in the error where
    it can never fit.

    Several outputs: ``out_dtype`` a tuple of dtypes, ``dest`` a tuple or ``None``; ``launch``
    gets the list of outputs and returns 0-d CuPy arrays (a chunk's reductions), and the
    result is ``(outputs, those values as 0-d NumPy arrays)``.
    """
    import cupy

    several = isinstance(out_dtype, tuple)
    out_dtypes = tuple(np.dtype(d) for d in (out_dtype if several else (out_dtype,)))
    dests = list(dest if several and dest is not None else (dest,) * len(out_dtypes))
    for k, dt in enumerate(out_dtypes):
        if dests[k] is not None:
            continue
        dests[k] = host_result(shape, dt)
    if not several and dests[0].size == 0:
        return dests[0]
    reduced: Any = ()
    events = (cupy.cuda.Event(), cupy.cuda.Event()) if timings is not None else None
    stage_seconds = 0.0
    staged = h2d = 0
    with contextlib.ExitStack() as borrowed:
        t0 = time.perf_counter()
        host_inputs: list[Any] = []
        for a in inputs:
            if not is_scalar(a) and not (a.flags.c_contiguous and is_pinned(a)):
                buf = borrowed.enter_context(pinned_pool.borrow(a.dtype, a.shape))
                np.copyto(buf, a)
                staged += a.nbytes
                a = buf
            host_inputs.append(a)
        direct = [d.flags.c_contiguous and is_pinned(d) for d in dests]
        host_outs = [d if ok else borrowed.enter_context(pinned_pool.borrow(dt, shape))
                     for d, ok, dt in zip(dests, direct, out_dtypes)]
        stage_seconds += time.perf_counter() - t0
        out_bytes = sum(d.nbytes for d in dests)
        device_bytes = (sum(0 if is_scalar(a) else a.nbytes for a in host_inputs)
                        + out_bytes + scratch_bytes)
        t_wait = time.perf_counter()
        with device_slot() as slot, reserve(device_bytes, what), slot.stream as stream:
            # The chunk's inputs on the device, then its outputs. All of them are released
            # before the slot is, so the next chunk on this slot's stream reuses them from
            # CuPy's pool (which keeps one arena per stream).
            t_device = time.perf_counter()
            on_device: list[Any] = []
            outs: list[Any] = []
            try:
                with h2d_slot():
                    for a in host_inputs:
                        on_device.append(a if is_scalar(a) else _send(a, stream))
                        h2d += 0 if is_scalar(a) else a.nbytes
                    stream.synchronize()
                outs = [cupy.empty(shape, dtype=dt) for dt in out_dtypes]
                if events:
                    events[0].record(stream)
                reduced = launch(outs if several else outs[0], on_device, slot.nb_stream)
                if events:
                    events[1].record(stream)
                for host, dev in zip(host_outs, outs):
                    if dev.size:
                        copy_to_host(host, dev, stream)
            finally:
                stream.synchronize()  # no copy may still use a buffer released below
                on_device.clear()
                outs.clear()
            reduced = tuple(v.get() for v in reduced or ())
        t0 = time.perf_counter()
        for d, host, ok in zip(dests, host_outs, direct):
            if not ok:
                np.copyto(d, host)
                staged += d.nbytes
        stage_seconds += time.perf_counter() - t0
    staging_totals.add(chunks=1, h2d_bytes=h2d, d2h_bytes=out_bytes, host_copy_bytes=staged,
                       host_copy_seconds=stage_seconds, wait_seconds=t_device - t_wait,
                       device_seconds=t0 - t_device)
    if timings is not None and events:
        timings.update(
            stage_seconds=stage_seconds,
            staged_bytes=float(staged),
            h2d_bytes=float(h2d),
            d2h_bytes=float(out_bytes),
            kernel=cupy.cuda.get_elapsed_time(events[0], events[1]) / 1e3,
        )
    return (tuple(dests), reduced) if several else dests[0]


def run_on_device(
    launch: Callable[[Any, list[Any], Any], None],
    shape: tuple[int, ...],
    out_dtype: Any,
    inputs: Sequence[Any],
    scratch_bytes: int = 0,
    what: str = "a chunk",
) -> Any:
    """Run ``launch`` (as in :func:`run_staged`, several outputs too) on device inputs; CuPy
    result, no wait.

    NumPy inputs are copied to the device first; the work is queued on the thread's current
    CuPy stream, like any CuPy operation. The chunk reserves its output, the inputs it copies
    and ``scratch_bytes`` of the device budget (:func:`dask_gpuchunk.runtime.budget.run_reserved`: a
    chunk that runs out of memory beside others runs again alone) until it returns: the output
    then belongs to the caller (a dask-cuda worker stores it, and spills it beyond its limit).
    """
    import cupy

    several = isinstance(out_dtype, tuple)
    out_dtypes = tuple(np.dtype(d) for d in (out_dtype if several else (out_dtype,)))
    copied = sum(0 if is_cupy(a) or is_scalar(a) else np.asarray(a).nbytes for a in inputs)
    out_bytes = int(np.prod(shape, dtype=np.int64)) * sum(dt.itemsize for dt in out_dtypes)

    def run() -> Any:
        nb_stream = numba_stream(cupy.cuda.get_current_stream())
        dev_inputs = [a if is_cupy(a) or is_scalar(a) else cupy.asarray(a) for a in inputs]
        if several:  # the launch runs on empty outputs too: its reductions start there
            outs = [cupy.empty(shape, dtype=dt) for dt in out_dtypes]
            return tuple(outs), launch(outs, dev_inputs, nb_stream)
        out = cupy.empty(shape, dtype=out_dtypes[0])
        if out.size:
            launch(out, dev_inputs, nb_stream)
        return out

    return run_reserved(run, out_bytes + copied + scratch_bytes, what)
