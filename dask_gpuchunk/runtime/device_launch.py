"""A chunk's kernel launched on the GPU: its passes (reductions in partial rows), scratch per
stream, and the eager device call cached per shapes and dtypes (:func:`device_call`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import config
from .._kernels.elementwise import (
    ElementwiseKernels,
    ElementwisePlan,
    is_scalar,
    partial_count,
    reduction_start,
)
from .._kernels.launch import (
    DirectLaunchError,
    StridedArg,
    direct_launch_available,
    fall_back_to_numba,
    numba_stream,
)
from .budget import run_reserved
from .chunk_layout import _collapsed_layout, _collapsed_views, is_cupy

__all__ = ["DeviceCall", "device_call", "input_kind", "total_dtypes"]

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
        what it allocates of the device budget (:func:`~dask_gpuchunk.runtime.budget.run_reserved`),
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
