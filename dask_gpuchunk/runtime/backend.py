"""Chunk execution: run one chunk of an operation on the right device.

Every operator's chunks go through here. :func:`chunk_site` is the one rule for where a chunk
runs (its inputs' kind × ``device=`` × whether the operation measures its placement), with one
error text per failure; :func:`run_chunk` runs an operation's :class:`ChunkWork` there (Gram
blocks, bitpack, transposes, file writes), and :func:`run_elementwise` does the same for
elementwise functions, whose host chunks the measured rule of :mod:`dask_gpuchunk.runtime.placement`
places. Kernels take the stream they are queued on as an argument (a numba stream). Three
paths:

``device`` (``gpu-device``)
    Any input is a CuPy array: every input goes to (or stays on) the device, the kernel is
    queued on the thread's current CuPy stream like any CuPy operation, and the result is a
    CuPy array. No host round trip, no wait.
``staged`` (``gpu-host``)
    NumPy inputs on the GPU: each input is copied into a pinned staging buffer (unless it is
    already pinned and contiguous, then it is sent directly), H2D on this thread's stream, the
    kernel, D2H into the destination (directly if it is pinned and contiguous, else through a
    staging buffer). The result is a NumPy array. Device memory per chunk: its inputs plus its
    output, taken from CuPy's pool and returned when the chunk is done; at most
    ``staging.GPU_TASKS_PER_DEVICE`` chunks hold device memory at once (``staging.device_slot``).
``cpu``
    NumPy inputs on the CPU: the numba ``njit(parallel=True)`` twin writes the destination
    directly, in the Dask thread that computes the chunk, with a share of the cores
    (:func:`cpu_threads`).

``device="auto"`` sends CuPy chunks to their GPU; NumPy chunks of elementwise functions where the
measured rule of :mod:`dask_gpuchunk.runtime.placement` says they run faster (``placed``), those of
other operations to a GPU where one is visible, unless the operation keeps them on the host
(bitpack, transposes, file writes). Concurrency comes from Dask's own threads: several chunks in
flight on their own streams overlap copies in both directions and kernels.

This module is the dispatch (:func:`chunk_site`, :func:`run_chunk`, :func:`run_elementwise`) and
gives the chunk runners' names: the CPU path is :mod:`dask_gpuchunk.runtime.cpu_runner`'s, the GPU
paths :mod:`dask_gpuchunk.runtime.gpu_runners`', a kernel's launch on the device
:mod:`dask_gpuchunk.runtime.device_launch`', and what they share
:mod:`dask_gpuchunk.runtime.chunk_layout`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import placement
from .._kernels.elementwise import ElementwiseKernels, ElementwisePlan, is_python_number
from .budget import working_budget
from ..devices import GPUNotAvailableError, check_device_name, gpu_available
from .staging import is_pinned
from .chunk_layout import StagingTotals, _as_plan, is_cupy, staging_totals
from .cpu_runner import cpu_threads, dask_threads, prepare_process, run_cpu, run_cpu_kernel
from .device_launch import DeviceCall, device_call, input_kind, total_dtypes
from .gpu_runners import (
    host_result,
    run_gpu_from_host,
    run_gpu_on_device,
    run_on_device,
    run_staged,
    to_host,
)

__all__ = [
    "SITES",
    "StagingTotals",
    "ChunkWork",
    "DeviceLaunch",
    "chunk_site",
    "cpu_threads",
    "dask_threads",
    "host_result",
    "is_cupy",
    "prepare_process",
    "run_cpu",
    "run_chunk",
    "run_cpu_kernel",
    "run_elementwise",
    "run_gpu_from_host",
    "run_gpu_on_device",
    "run_on_device",
    "run_staged",
    "staging_totals",
    "to_host",
    "total_dtypes",
    "DeviceCall",
    "device_call",
    "input_kind",
]

#: Where a chunk runs (:func:`chunk_site`).
SITES = ("device", "staged", "placed", "cpu")

_CUPY_ON_CPU = ("device='cpu' was given CuPy chunks; use device='gpu' or 'auto', or move the data "
                "to the host first (x.map_blocks(cupy.asnumpy))")

_NO_GPU_HERE = "device='gpu' but this worker sees no CUDA GPU"


def chunk_site(device: str, on_device: bool, gpu_here: bool, *, placed: bool = False,
               stage: bool = True, gpu_only: str | None = None) -> str:
    """Where one chunk of an operation runs: the package's one rule, for every operator.

    Parameters
    ----------
    device
        The operation's ``device=``: ``"auto"``, ``"gpu"`` or ``"cpu"``.
    on_device
        Whether any input of the chunk is a CuPy array.
    gpu_here
        Whether this process sees a GPU.
    placed
        Whether the operation measures where its NumPy chunks run faster
        (:mod:`dask_gpuchunk.runtime.placement`); otherwise ``"auto"`` sends them to a GPU where
        there is one.
    stage
        Whether NumPy chunks may be copied to a GPU at all (not for work cheaper where the data
        is: a transpose, a file write).
    gpu_only
        Why the operation cannot run on the CPU (the error's text), or ``None``.

    Returns
    -------
    str
        ``"device"`` (CuPy inputs, on their GPU), ``"staged"`` (NumPy inputs through pinned
        staging to the GPU), ``"placed"`` (NumPy inputs where the measured rule says) or
        ``"cpu"``.

    Examples
    --------
    >>> chunk_site("auto", on_device=False, gpu_here=True)
    'staged'
    >>> chunk_site("auto", on_device=False, gpu_here=True, placed=True)
    'placed'
    >>> chunk_site("gpu", on_device=True, gpu_here=True)
    'device'
    >>> chunk_site("auto", on_device=False, gpu_here=False)
    'cpu'
    >>> chunk_site("cpu", on_device=True, gpu_here=True)
    Traceback (most recent call last):
    ...
    ValueError: device='cpu' was given CuPy chunks; use device='gpu' or 'auto', or move the data to the host first (x.map_blocks(cupy.asnumpy))
    """
    check_device_name(device)
    if on_device:
        if device == "cpu":
            raise ValueError(_CUPY_ON_CPU)
        return "device"
    if device == "gpu" and stage:
        if not gpu_here:  # a worker without a GPU, where the client had one
            raise GPUNotAvailableError(_NO_GPU_HERE)
        return "staged"
    if device == "auto" and stage and gpu_here:
        return "placed" if placed else "staged"
    if gpu_only is not None:
        raise ValueError(gpu_only)
    return "cpu"


def _site_of(inputs: Sequence[Any], device: str, **rule: Any) -> str:
    """:func:`chunk_site` for these inputs in this process (asking for a GPU only where the
    answer matters)."""
    on_device = any(is_cupy(a) for a in inputs)
    stage = rule.get("stage", True)
    gpu_here = on_device or (stage and device != "cpu" and gpu_available())
    return chunk_site(device, on_device, gpu_here, **rule)


class DeviceLaunch(NamedTuple):
    """An operation's GPU work for one chunk: ``launch(out, inputs, nb_stream)`` fills a new
    ``out`` of ``shape`` and ``dtype`` (as :func:`run_staged`), allocating ``scratch_bytes``
    of device memory beside it."""

    launch: Callable[[Any, list[Any], Any], None]
    shape: tuple[int, ...]
    dtype: Any
    scratch_bytes: int = 0


class ChunkWork(NamedTuple):
    """What an operation does to one chunk, wherever :func:`chunk_site` sends it.

    ``on_cpu()`` computes it from host inputs; ``on_gpu()`` makes its :class:`DeviceLaunch`
    (for device inputs, and host inputs staged to a GPU); ``on_device()``, where given, does
    the whole work for device inputs instead (work that makes no new device array, as writing
    a chunk to a file). ``what`` names the chunk in errors; ``gpu_only`` and ``stage`` are
    :func:`chunk_site`'s.
    """

    what: str
    on_cpu: Callable[[], Any]
    on_gpu: Callable[[], DeviceLaunch] | None = None
    on_device: Callable[[], Any] | None = None
    gpu_only: str | None = None
    stage: bool = True


def run_chunk(work: ChunkWork, inputs: Sequence[Any], device: str = "auto") -> Any:
    """Run one chunk of an operation where :func:`chunk_site` says: NumPy result from NumPy
    inputs (on the CPU or through staging), CuPy result on the current stream from CuPy ones.

    Examples
    --------
    >>> work = ChunkWork("a chunk", on_cpu=lambda: np.zeros(2), stage=False)
    >>> run_chunk(work, [np.ones(2)])
    array([0., 0.])
    """
    site = _site_of(inputs, device, stage=work.stage and work.on_gpu is not None,
                    gpu_only=work.gpu_only)
    if site == "cpu":
        return work.on_cpu()
    if site == "device" and work.on_device is not None:
        return work.on_device()
    gpu = work.on_gpu()
    if site == "device":
        return run_on_device(gpu.launch, gpu.shape, gpu.dtype, inputs,
                             scratch_bytes=gpu.scratch_bytes, what=work.what)
    return run_staged(gpu.launch, gpu.shape, gpu.dtype, inputs,
                      scratch_bytes=gpu.scratch_bytes, what=work.what)


def run_elementwise(
    kernels: ElementwiseKernels,
    out_dtype: Any,
    inputs: Sequence[Any],
    device: str = "auto",
    dest: np.ndarray | None = None,
    finished: bool = False,
) -> Any:
    """Compute one chunk of ``kernels.func`` over broadcastable ``inputs`` on the right device
    (:func:`chunk_site`, the measured rule deciding for NumPy chunks under ``"auto"``).

    Parameters
    ----------
    kernels
        The compiled kernels of the function.
    out_dtype
        The result dtype, or an :class:`ElementwisePlan`: several outputs and reductions of
        them fused into the pass.
    inputs
        NumPy and/or CuPy arrays (0-d arrays for scalars), broadcastable together.
    device
        ``"auto"``, ``"gpu"`` or ``"cpu"``.
    dest
        An array of the result's shape and dtype to write into (NumPy for NumPy inputs, CuPy
        for CuPy ones); a tuple of them with a plan.

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        CuPy where any input is CuPy, else NumPy (``dest`` itself when given). With a plan,
        ``(outputs, reductions)``: the chunk's reductions as 0-d arrays of their partial dtypes
        (:func:`~dask_gpuchunk._kernels.elementwise.partial_dtype`); ``finished``: on the GPU
        from CuPy inputs, in the dtypes of :func:`total_dtypes`.

    Examples
    --------
    >>> from dask_gpuchunk._kernels.elementwise import ElementwiseKernels
    >>> k = ElementwiseKernels(lambda a, b: a * b, 2)
    >>> run_elementwise(k, np.float64, [np.arange(3.0), np.float64(2.0)], device="cpu")
    array([0., 2., 4.])
    """
    if not isinstance(out_dtype, ElementwisePlan):
        out_dtype = np.dtype(out_dtype)
    site = _site_of(inputs, device, placed=True)
    if site == "device":
        if dest is not None and not all(is_cupy(d) for d in (
                dest if isinstance(dest, tuple) else (dest,))):
            raise ValueError("dest= for CuPy inputs takes CuPy arrays")
        return run_gpu_on_device(kernels, out_dtype, inputs, dest, finished)
    if site == "cpu":
        return run_cpu(kernels, out_dtype, inputs, dest)
    if site == "staged":
        return run_gpu_from_host(kernels, out_dtype, inputs, dest)
    return _run_placed(kernels, out_dtype, inputs, dest)


def _tiny(inputs: Sequence[Any]) -> list[Any]:
    """One-element slices with the inputs' dtypes and dimensionality, to compile kernels."""
    return [a[(slice(0, 1),) * a.ndim] if np.ndim(a) else a for a in inputs]


def _measure(kernels: ElementwiseKernels, out_dtype: Any, inputs: list[Any],
             dest: Any, key: tuple) -> tuple[dict[str, Any], Any]:
    """Run a NumPy chunk both ways, timed (the inputs of
    :func:`dask_gpuchunk.runtime.placement.estimate`): the record of the rule, and the result of
    the device it picks."""
    import numba

    shape = np.broadcast_shapes(*(np.shape(a) for a in inputs))
    tiny = _tiny(inputs)
    run_cpu(kernels, out_dtype, tiny)
    run_gpu_from_host(kernels, out_dtype, tiny)

    stages: dict[str, float] = {}
    result = run_gpu_from_host(kernels, out_dtype, inputs, dest, timings=stages)
    t0 = time.perf_counter()
    # Every core on this one chunk: the throughput of all Dask threads sharing the cores.
    on_cpu = run_cpu(kernels, out_dtype, inputs, threads=int(numba.config.NUMBA_NUM_THREADS))
    t_cpu = time.perf_counter() - t0
    h2d_rate, d2h_rate = placement.pcie_bandwidth()
    record = placement.estimate(stages, t_cpu, dask_threads(), h2d_rate, d2h_rate,
                                placement.host_copy_bandwidth())
    if record["choice"] == "cpu":  # the CPU's values, in the GPU's result arrays
        if isinstance(out_dtype, ElementwisePlan):
            for into, got in zip(result[0], on_cpu[0]):
                np.copyto(into, got)
            result = (result[0], on_cpu[1])
        else:
            np.copyto(result, on_cpu)
    record = {"function": getattr(kernels.func, "__name__", repr(kernels.func)),
              "key": key, "chunk_shape": shape, **record}
    return record, result


def _run_placed(kernels: ElementwiseKernels, out_dtype: Any, inputs: Sequence[Any],
                dest: Any) -> Any:
    """Compute a NumPy chunk on the device the rule picks (measuring first if needed)."""
    plan, single = _as_plan(out_dtype)
    inputs = [a if is_python_number(a) else np.asarray(a) for a in inputs]
    shape = np.broadcast_shapes(*(np.shape(a) for a in inputs))
    device_bytes = (sum(np.asarray(a).nbytes for a in inputs if not is_python_number(a))
                    + int(np.prod(shape)) * sum(dt.itemsize for dt in plan.out_dtypes))
    if device_bytes > working_budget():  # never fits the GPU here: the CPU computes it
        return run_cpu(kernels, out_dtype, inputs, dest)
    pinned = tuple(bool(np.ndim(a) and a.flags.c_contiguous and is_pinned(a)) for a in inputs)
    dests = (dest,) if single else (dest or ())
    dest_pinned = any(d is not None and d.flags.c_contiguous and is_pinned(d) for d in dests)
    outputs = np.dtype(out_dtype).str if single else repr(plan)
    key = (kernels.token, tuple(type(a).__name__ if is_python_number(a) else a.dtype.str
                                for a in inputs), outputs, pinned, dest_pinned)
    if int(np.prod(shape)) <= 1:  # nothing to measure on: as decided, else the CPU
        choice, result = placement.decided(key) or "cpu", None
    else:
        choice, result = placement.decide(
            key, lambda: _measure(kernels, out_dtype, inputs, dest, key))
    if result is not None:
        return result
    if choice == "gpu":
        return run_gpu_from_host(kernels, out_dtype, inputs, dest)
    return run_cpu(kernels, out_dtype, inputs, dest)
