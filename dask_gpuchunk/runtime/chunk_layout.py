"""What every chunk runner shares: the CuPy test, the staging totals, and a chunk's inputs laid
out for its kernel (scalars by value, collapsed dimensions, reductions' partial rows)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._kernels.elementwise import (
    ElementwisePlan,
    collapse_dims,
    is_python_number,
    is_scalar,
    reduction_start,
)

__all__ = ["StagingTotals", "is_cupy", "staging_totals"]

def is_cupy(x: Any) -> bool:
    """Whether ``x`` is a CuPy array (checked without importing CuPy)."""
    return type(x).__module__.split(".", 1)[0] == "cupy"


class StagingTotals:
    """What :func:`run_staged` (and the chunks that :mod:`dask_gpuchunk.runtime.resident` keeps
    on a GPU, and the Gram blocks it returns from there) has moved and spent in this process,
    summed over its threads:
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
