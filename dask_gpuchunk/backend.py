"""Chunk execution: run one chunk of an operation on the right device.

Every operator's chunks go through here. :func:`chunk_site` is the one rule for where a chunk
runs (its inputs' kind × ``device=`` × whether the operation measures its placement), with one
error text per failure; :func:`run_chunk` runs an operation's :class:`ChunkWork` there (Gram
blocks, bitpack, transposes, file writes), and :func:`run_elementwise` does the same for
elementwise functions, whose host chunks the measured rule of :mod:`dask_gpuchunk.placement`
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

``device="auto"`` sends CuPy chunks to their GPU; NumPy chunks of elementwise functions where
the measured rule of :mod:`dask_gpuchunk.placement` says they run faster (``placed``), those of
other operations to a GPU where one is visible, unless the operation keeps them on the host
(bitpack, transposes, file writes). Concurrency comes from Dask's own threads:
several chunks in flight on their own streams overlap copies in both directions and kernels.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import _compat, config, placement
from ._kernels.elementwise import (
    ElementwiseKernels,
    ElementwisePlan,
    collapse_dims,
    is_python_number,
    is_scalar,
    partial_count,
    reduction_start,
)
from ._kernels.launch import (
    DirectLaunchError,
    StridedArg,
    direct_launch_available,
    fall_back_to_numba,
    numba_stream,
)
from .budget import reserve, run_reserved, working_budget
from .devices import GPUNotAvailableError, check_device_name, gpu_available
from .staging import (
    copy_to_device,
    copy_to_host,
    device_slot,
    h2d_slot,
    is_pinned,
    pinned_pool,
)

__all__ = [
    "SITES",
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
    "total_dtypes",
    "DeviceCall",
    "device_call",
    "input_kind",
]


def is_cupy(x: Any) -> bool:
    """Whether ``x`` is a CuPy array (checked without importing CuPy)."""
    return type(x).__module__.split(".", 1)[0] == "cupy"


# ---- what staging moved ----------------------------------------------------------------------


class StagingTotals:
    """What :func:`run_staged` (and the chunks that :mod:`dask_gpuchunk.resident` keeps on a GPU,
    and the Gram blocks it returns from there) has moved and spent in this process, summed over
    its threads:
    ``chunks``; ``h2d_bytes`` and ``d2h_bytes`` (PCIe); ``host_copy_bytes`` and
    ``host_copy_seconds`` (copies into and out of pinned buffers); ``wait_seconds`` (waiting
    for a device slot and the budget); ``device_seconds`` (holding a slot: the copies and the
    kernel). A cluster's job reads them from each worker before and after it
    (:func:`dask_gpuchunk.jobs.staged_by_workers`): what each GPU was sent, and where the time
    of a host-fed job went.

    Examples
    --------
    >>> totals = StagingTotals()
    >>> totals.add(chunks=1, h2d_bytes=64)
    >>> totals.snapshot()["h2d_bytes"]
    64
    """

    FIELDS = ("chunks", "h2d_bytes", "d2h_bytes", "host_copy_bytes",
              "host_copy_seconds", "wait_seconds", "device_seconds")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(self.FIELDS, 0)

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] += amount

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)


#: This process's :class:`StagingTotals`.
staging_totals = StagingTotals()


# ---- shape helpers -------------------------------------------------------------------------


def _scalars_by_value(inputs: Sequence[Any]) -> list[Any]:
    """0-d NumPy arrays become NumPy scalars: kernels take them by value, with no copy. Python
    numbers stay Python numbers (weak scalars, NEP 50)."""
    return [a[()] if isinstance(a, np.ndarray) and a.ndim == 0 else a for a in inputs]


def _host_inputs(inputs: Sequence[Any]) -> list[Any]:
    """Host chunks as NumPy arrays or scalars, Python numbers as they are."""
    return _scalars_by_value([a if is_python_number(a) else np.asarray(a) for a in inputs])


def _collapsed_layout(outs: Sequence[Any],
                      inputs: Sequence[Any]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """The collapsed shape, and the byte strides of each of ``outs`` (one shape) then of each
    array input in it.

    Array inputs are broadcast to the outputs' shape (stride 0 along the dimensions they are
    broadcast in), then all are collapsed alike (:func:`collapse_dims`). Scalars (NumPy
    scalars, Python numbers) are skipped.
    """
    shape = outs[0].shape
    strides = [o.strides for o in outs]
    for a in inputs:
        if is_scalar(a):
            continue
        lead = len(shape) - a.ndim
        strides.append((0,) * lead + tuple(
            0 if n == 1 and shape[lead + d] != 1 else st
            for d, (n, st) in enumerate(zip(a.shape, a.strides))
        ))
    return collapse_dims(shape, strides)


def _collapsed_views(xp: Any, outs: Sequence[Any],
                     inputs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """``outs`` and array ``inputs`` as views of :func:`_collapsed_layout`'s shape and strides.

    Scalars (NumPy scalars, Python numbers) pass through unchanged.
    """
    new_shape, new_strides = _collapsed_layout(outs, inputs)
    as_strided = xp.lib.stride_tricks.as_strided
    extra = {"writeable": False} if xp is np else {}
    result = list(inputs)
    arrays = [i for i, a in enumerate(inputs) if not is_scalar(a)]
    for i, st in zip(arrays, new_strides[len(outs):]):
        result[i] = as_strided(inputs[i], new_shape, st, **extra)
    writeable = {"writeable": True} if xp is np else {}
    out_v = [as_strided(o, new_shape, st, **writeable) for o, st in zip(outs, new_strides)]
    return out_v, result


def _as_plan(out_dtype: Any) -> tuple[ElementwisePlan, bool]:
    """A chunk function's ``out_dtype``: a dtype (one output, returned as an array) or an
    :class:`ElementwisePlan` (returned as ``(outputs, reductions)``)."""
    if isinstance(out_dtype, ElementwisePlan):
        return out_dtype, False
    return ElementwisePlan.single(out_dtype), True


def _chunk_reductions(xp: Any, plan: ElementwisePlan, partials: Sequence[Any]) -> tuple[Any, ...]:
    """Each reduction of one chunk from its kernel's partials: a 0-d array of the partial
    dtype (a chunk of no elements gives the reduction's start value)."""
    found = []
    for (k, op), part, dtype in zip(plan.reductions, partials, plan.partial_dtypes()):
        if part.size == 0:
            value = xp.asarray(reduction_start(op, dtype))
        elif op in ("sum", "mean"):
            value = part.sum()
        else:
            value = part.min() if op == "min" else part.max()
        found.append(value)
    return tuple(found)


# ---- CPU -----------------------------------------------------------------------------------

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
    GPU is visible, the imports of CuPy and numba's CUDA module; else numba's threading layer
    (its first parallel kernel). Workers of ``dg.local_cluster`` call it as they start
    (:func:`dask_gpuchunk.cluster.dask_setup`). It creates no CUDA context: dask-cuda creates
    each worker's, on its own device, after the preload (and warns if one exists already).

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


# ---- GPU -----------------------------------------------------------------------------------


def _launch(kernels: ElementwiseKernels, out: Any, inputs: Sequence[Any], nb_stream: Any) -> None:
    """Queue ``out[...] = f(*inputs)`` on ``nb_stream`` (CuPy arrays, broadcastable to ``out``)."""
    _launch_pass(kernels, None, [out], [], inputs, nb_stream)


_scratch = threading.local()


def _stream_scratch(nb_stream: Any, nbytes: int) -> Any:
    """Device memory for the passes with reductions launched on ``nb_stream``: a CuPy
    ``uint8`` array of at least ``nbytes``, its first 4 bytes the blocks' ticket counter
    (holding 0), then the partials (:func:`_scratch_layout`). The partials live only while the
    pass runs and the pass's last block sets the counter back to 0, so one buffer per stream
    serves every pass queued on it, in the stream's order. Per thread (a per-thread default
    stream is one stream per thread) and per device."""
    import cupy

    found = getattr(_scratch, "buffers", None)
    if found is None:
        found = _scratch.buffers = {}
    key = (int(cupy.cuda.runtime.getDevice()), id(nb_stream))
    entry = found.get(key)
    if entry is None or entry[0] is not nb_stream or entry[1].size < nbytes:
        # Made on the current CuPy stream, the one nb_stream stands for: zero before any pass
        # (a buffer it replaces goes back to CuPy's pool, reused after the passes queued).
        entry = found[key] = (nb_stream, cupy.zeros(max(nbytes, 4096), np.uint8))
    return entry[1]


def _scratch_layout(plan: ElementwisePlan, count: int) -> tuple[list[int], int]:
    """Where each reduction's ``count`` partials start in a stream's scratch (16-byte aligned,
    after the counter), and the bytes it needs."""
    offsets, end = [], 16
    for dt in plan.partial_dtypes():
        offsets.append(end)
        end += -(-count * dt.itemsize // 16) * 16
    return offsets, end


def _reduction_args(plan: ElementwisePlan | None, count: int, totals: Sequence[Any],
                    nb_stream: Any) -> list[StridedArg]:
    """A pass's reduction arguments (``ElementwiseKernels.cuda_pass``), by address: each
    reduction's ``count`` partials and the ticket counter in the stream's scratch, each total
    (``totals``: 0-d CuPy arrays)."""
    if plan is None or not plan.reductions:
        return []
    offsets, nbytes = _scratch_layout(plan, count)
    base = _stream_scratch(nb_stream, nbytes).data.ptr
    partials = [StridedArg(base + off, (count,), (dt.itemsize,), dt)
                for off, dt in zip(offsets, plan.partial_dtypes())]
    return [*partials, *map(_flat, totals), StridedArg(base, (1,), (4,), np.dtype(np.uint32))]


def _flat(a: Any) -> StridedArg:
    """A contiguous CuPy array (a 0-d one too) as a one-dimensional :class:`StridedArg`."""
    return StridedArg(a.data.ptr, (a.size,), (a.itemsize,), a.dtype)


def _launch_pass(kernels: ElementwiseKernels, plan: ElementwisePlan | None, outs: Sequence[Any],
                 totals: Sequence[Any], inputs: Sequence[Any], nb_stream: Any) -> None:
    """Queue one pass of ``plan`` (``None``: one output) on ``nb_stream``: CuPy ``outs`` of one
    shape, each reduction's total written into ``totals`` (0-d CuPy arrays of the dtypes it is
    wanted in), CuPy inputs broadcastable to the outputs."""
    count = partial_count(outs[0].size, "cuda") if plan is not None else 0
    reduction = _reduction_args(plan, count, totals, nb_stream)
    if direct_launch_available(config.flag("direct-launch")):
        shape, strides = _collapsed_layout(outs, inputs)
        by_address = iter(strides[len(outs):])
        try:
            kernels.cuda_strided_pass(
                plan,
                [StridedArg(o.data.ptr, shape, st, o.dtype) for o, st in zip(outs, strides)],
                reduction,
                *(a if is_scalar(a) else StridedArg(a.data.ptr, shape, next(by_address), a.dtype)
                  for a in inputs),
                stream=nb_stream,
            )
            return
        except DirectLaunchError as exc:  # raised before anything was launched
            fall_back_to_numba(exc)
    from numba import cuda

    out_v, in_v = _collapsed_views(__import__("cupy"), outs, inputs)
    kernels.cuda_pass(
        plan,
        [cuda.as_cuda_array(o, sync=False) for o in out_v],
        [_as_numba_array(r) for r in reduction],
        *(v if is_scalar(v) else cuda.as_cuda_array(v, sync=False) for v in in_v),
        stream=nb_stream,
    )


def _as_numba_array(a: StridedArg) -> Any:
    """A one-dimensional contiguous :class:`StridedArg` as a numba device array (no copy)."""
    import cupy
    from numba import cuda

    memory = cupy.cuda.UnownedMemory(a.ptr, a.shape[0] * a.dtype.itemsize, None)
    view = cupy.ndarray(a.shape, a.dtype, cupy.cuda.MemoryPointer(memory, 0))
    return cuda.as_cuda_array(view, sync=False)


def _start_totals(xp: Any, plan: ElementwisePlan, dtypes: Sequence[np.dtype]) -> list[Any]:
    """Each reduction of no elements (:func:`reduction_start`), as 0-d arrays of ``dtypes``."""
    return [xp.asarray(reduction_start("sum" if op == "mean" else op, pdt)).astype(dt)
            for (_, op), pdt, dt in zip(plan.reductions, plan.partial_dtypes(), dtypes)]


def _pass_launch(kernels: ElementwiseKernels, plan: ElementwisePlan) -> Callable[..., Any]:
    """A launch for :func:`run_on_device` / :func:`run_staged` of several outputs: queues the
    pass into ``outs`` and returns each reduction of the chunk, a 0-d CuPy array of its partial
    dtype."""
    import cupy

    def launch(outs: list[Any], inputs: list[Any], nb_stream: Any) -> tuple[Any, ...]:
        if not outs[0].size:
            return tuple(_start_totals(cupy, plan, plan.partial_dtypes()))
        totals = [cupy.empty((), dt) for dt in plan.partial_dtypes()]
        _launch_pass(kernels, plan, outs, totals, inputs, nb_stream)
        return tuple(totals)

    return launch


def _partials_bytes(plan: ElementwisePlan, shape: tuple[int, ...]) -> int:
    count = partial_count(int(np.prod(shape)), "cuda") if plan.reductions else 0
    return sum((count + 1) * dt.itemsize for dt in plan.partial_dtypes())


def total_dtypes(plan: ElementwisePlan, finished: bool) -> tuple[np.dtype, ...]:
    """The dtype a pass on the GPU writes each reduction's total in: its partial dtype, or
    ``finished``, NumPy's dtype of the reduction (a mean stays a sum, divided afterwards)."""
    if not finished:
        return plan.partial_dtypes()
    return tuple(pdt if op == "mean" else rdt for (_, op), pdt, rdt in zip(
        plan.reductions, plan.partial_dtypes(), plan.reduced_dtypes()))


class DeviceCall:
    """One kind of pass on CuPy data, prepared once: the kernel's launcher, its grid and the
    collapsed layout of its arrays, for inputs and outputs of given dtypes, shapes and strides.
    Calling it with inputs of that kind (new addresses, scalars of new values) allocates the
    outputs and launches, nothing else: what a loop of eager calls pays per call.

    ``finished``: each reduction's total in NumPy's dtype of it (a mean's sum in its partial
    dtype), else in the partial dtype (a Dask chunk's value, combined with the other chunks').
    """

    def __init__(self, kernels: ElementwiseKernels, plan: ElementwisePlan,
                 inputs: Sequence[Any], out_strides: Sequence[tuple[int, ...]] | None,
                 finished: bool) -> None:
        self.kernels = kernels
        self.plan = plan
        self.single = plan.plain
        self.shape = tuple(np.broadcast_shapes(*(np.shape(a) for a in inputs)))
        self.n = int(np.prod(self.shape))
        self.totals = total_dtypes(plan, finished) if plan.reductions else ()
        if out_strides is None:  # fresh C-contiguous outputs
            out_strides = [_c_strides(self.shape, dt) for dt in plan.out_dtypes]
        like = [StridedArg(0, self.shape, st, dt) for st, dt in zip(out_strides, plan.out_dtypes)]
        self.layout = _collapsed_layout(like, inputs)
        self.nbytes = self.n * sum(dt.itemsize for dt in plan.out_dtypes) + _partials_bytes(
            plan, self.shape)
        self.count = partial_count(self.n, "cuda") if plan.reductions else 0
        self.launch: Any = None
        if self.n and direct_launch_available(config.flag("direct-launch")):
            shape, strides = self.layout
            count = partial_count(self.n, "cuda") if plan.reductions else 0
            reduction = ([StridedArg(0, (count,), (dt.itemsize,), dt)
                          for dt in plan.partial_dtypes()]
                         + [StridedArg(0, (1,), (dt.itemsize,), dt) for dt in self.totals]
                         + ([StridedArg(0, (1,), (4,), np.dtype(np.uint32))] if plan.reductions
                            else []))
            by_address = iter(strides[len(like):])
            args = [a if is_scalar(a) else StridedArg(0, shape, next(by_address), a.dtype)
                    for a in inputs]
            try:
                self.launch = kernels.strided_launcher(
                    None if self.single else plan,
                    [StridedArg(0, shape, st, o.dtype) for o, st in zip(like, strides)],
                    reduction, args)
            except DirectLaunchError as exc:
                fall_back_to_numba(exc)

    def __call__(self, inputs: Sequence[Any], dest: Sequence[Any] | None = None,
                 reserved: bool = True) -> Any:
        """Queue the pass on the current CuPy stream: its outputs (``dest``, or new CuPy
        arrays); with reductions, ``(outputs, totals)`` (0-d CuPy arrays). ``reserved``: hold
        what it allocates of the device budget (:func:`~dask_gpuchunk.budget.run_reserved`),
        as a Dask chunk does beside the others; else allocate as any CuPy operation does."""
        if reserved:
            return run_reserved(lambda: self.run(inputs, dest), self.nbytes)
        return self.run(inputs, dest)

    def run(self, inputs: Sequence[Any], dest: Sequence[Any] | None) -> Any:
        """:meth:`__call__` without the budget."""
        import cupy

        plan = self.plan
        nb_stream = numba_stream(cupy.cuda.get_current_stream())
        outs = list(dest) if dest is not None else [cupy.empty(self.shape, dt)
                                                    for dt in plan.out_dtypes]
        if not self.n:
            totals = _start_totals(cupy, plan, self.totals)
        else:
            totals = [cupy.empty((), dt) for dt in self.totals]
            if self.launch is None:
                _launch_pass(self.kernels, None if self.single else plan, outs, totals, inputs,
                             nb_stream)
            else:
                launcher, blocks, threads = self.launch
                shape, strides = self.layout
                by_address = iter(strides[len(outs):])
                launcher(blocks, threads, nb_stream, [
                    *(StridedArg(o.data.ptr, shape, st, o.dtype) for o, st in zip(outs, strides)),
                    *_reduction_args(plan, self.count, totals, nb_stream),
                    *(a if is_scalar(a) else StridedArg(a.data.ptr, shape, next(by_address),
                                                        a.dtype) for a in inputs),
                ])
        if self.single:
            return outs[0]
        return tuple(outs), tuple(totals)


def _c_strides(shape: tuple[int, ...], dtype: np.dtype) -> tuple[int, ...]:
    """The strides of a new C-contiguous array of ``shape`` and ``dtype`` (as CuPy's)."""
    strides, step = [], dtype.itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


_device_calls: dict[tuple, DeviceCall] = {}
_device_calls_lock = threading.Lock()
#: Kinds of call remembered (:func:`device_call`); beyond, the oldest are forgotten.
DEVICE_CALLS_KEPT = 512


def input_kind(a: Any) -> Any:
    """What a prepared call (:class:`DeviceCall`) depends on of one input: a CuPy array's
    dtype, shape and strides; a NumPy scalar's dtype; a Python number's type (an integer's
    with whether it is beyond int64, which makes it uint64). ``None`` for anything else.

    Examples
    --------
    >>> input_kind(2.0), input_kind(np.float32(2)), input_kind(2**63), input_kind([1])
    (<class 'float'>, dtype('float32'), (<class 'int'>, True), None)
    """
    kind = type(a)
    if kind is float or kind is complex or kind is bool:
        return kind
    if kind is int:
        return (int, not -(2**63) <= a < 2**63)
    if isinstance(a, np.generic):
        return a.dtype
    if is_cupy(a):
        return (a.dtype, a.shape, a.strides)
    return None


def device_call(kernels: ElementwiseKernels, plan: ElementwisePlan, inputs: Sequence[Any],
                dest: Sequence[Any] | None = None, finished: bool = False) -> DeviceCall:
    """The process's :class:`DeviceCall` for this kind of call (CuPy arrays, NumPy scalars
    and Python numbers as ``inputs``; ``dest``: CuPy outputs or ``None``), made on first use
    on this device."""
    import cupy

    key = (kernels, plan, finished, int(cupy.cuda.runtime.getDevice()),
           tuple(input_kind(a) for a in inputs),
           None if dest is None else tuple(input_kind(d) for d in dest))
    found = _device_calls.get(key)
    if found is None:
        found = DeviceCall(kernels, plan, inputs,
                           None if dest is None else [d.strides for d in dest], finished)
        with _device_calls_lock:
            if len(_device_calls) >= DEVICE_CALLS_KEPT:
                _device_calls.pop(next(iter(_device_calls)))
            _device_calls[key] = found
    return found


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

    With ``timings`` (a dict), it records what :mod:`dask_gpuchunk.placement` needs:
    ``stage_seconds`` and ``staged_bytes`` (host copies into and out of pinned buffers),
    ``h2d_bytes``/``d2h_bytes`` (PCIe traffic) and ``kernel`` (seconds, CUDA events).

    The chunk holds a reservation of the device budget (:func:`dask_gpuchunk.budget.reserve`)
    for its inputs, its output and ``scratch_bytes`` (what ``launch`` allocates) while it holds
    device memory; ``what`` names it in the error where it can never fit.

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
    and ``scratch_bytes`` of the device budget (:func:`dask_gpuchunk.budget.run_reserved`: a
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


# ---- dispatch ------------------------------------------------------------------------------

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
        (:mod:`dask_gpuchunk.placement`); otherwise ``"auto"`` sends them to a GPU where there
        is one.
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
    """Run a NumPy chunk both ways, timed (:func:`dask_gpuchunk.placement.estimate`'s inputs):
    the record of the rule, and the result of the device it picks."""
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
