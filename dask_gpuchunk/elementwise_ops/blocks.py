"""What an elementwise operation's tasks run on a block: the chunk through
:func:`dask_gpuchunk.runtime.backend.run_elementwise`, one output picked of several, and the fused
reductions' partials combined and finished."""

from __future__ import annotations

import functools
import uuid
from typing import Any

import numpy as np

from .._kernels.elementwise import REDUCTIONS, ElementwisePlan
from ..runtime.backend import is_cupy, run_elementwise

__all__ = []

def _block(*blocks: Any, kernels: Any, out_dtype: Any, device: str) -> Any:
    return run_elementwise(kernels, out_dtype, blocks, device)


def _block_into(*blocks: Any, block_id: tuple[int, ...], kernels: Any, out_dtype: Any,
                device: str, target: _Target, result_chunks: tuple[tuple[int, ...], ...]) -> np.ndarray:
    region = tuple(slice(sum(c[:i]), sum(c[:i + 1])) for c, i in zip(result_chunks, block_id))
    ndim = len(result_chunks)
    if not isinstance(out_dtype, ElementwisePlan):
        run_elementwise(kernels, out_dtype, blocks, device, dest=target.array[region])
        return np.ones((1,) * ndim, dtype=bool)  # a marker: the data went into out
    _, reduced = run_elementwise(kernels, out_dtype, blocks, device,
                                 dest=tuple(o[region] for o in target.array))
    mark = np.empty((1,) * ndim, dtype=object)  # the block's reductions, for the caller
    mark[(0,) * ndim] = reduced
    return mark


def _pick_output(result: tuple[Any, Any], k: int) -> Any:
    """Output ``k`` of a block computed by a plan (``(outputs, reductions)``)."""
    return result[0][k]


def _pick_reduction(result: tuple[Any, Any], r: int, ndim: int) -> Any:
    """Reduction ``r`` of a block, as a one-element block of an array of the blocks' values."""
    return result[1][r].reshape((1,) * ndim)


#: Up to this many blocks' values, a reduction combines them pairwise, one small operation
#: each; beyond, stacked and reduced. On the device a stack and its reduction cost ~0.2 ms a
#: step of a loop over four blocks, three additions of 0-d arrays ~0.05 ms.
PAIRWISE_COMBINE_MAX = 8


def _combine_reduced(op: str, *values: Any) -> Any:
    """The blocks' values of one reduction (0-d arrays of its partial dtype) combined."""
    if len(values) == 1:
        return values[0]
    xp = __import__("cupy") if is_cupy(values[0]) else np
    if len(values) <= PAIRWISE_COMBINE_MAX:
        pair = (xp.add if op in ("sum", "mean") else xp.minimum if op == "min" else xp.maximum)
        return functools.reduce(pair, values)
    stacked = xp.stack(values)
    if op in ("sum", "mean"):
        return stacked.sum()
    return stacked.min() if op == "min" else stacked.max()


def _finish(value: Any, op: str, count: int, dtype: np.dtype) -> Any:
    """A reduction's combined value as NumPy gives it: its dtype; a mean divided by the count.
    A 0-d array (NumPy or CuPy, as ``value``)."""
    if op == "mean":
        with np.errstate(invalid="ignore", divide="ignore"):
            value = value / count
    return value.astype(dtype, copy=False)


def _finish_blocks(r: int, op: str, count: int, dtype: np.dtype, *blocks: Any) -> Any:
    """Reduction ``r`` of every block's ``(outputs, reductions)``, combined and finished."""
    return _finish(_combine_reduced(op, *(b[1][r] for b in blocks)), op, count, dtype)


class _Target:
    """``out=`` as a task argument: tokenized by a fresh name, not by hashing every byte."""

    __slots__ = ("array", "token")

    def __init__(self, array: Any) -> None:
        self.array, self.token = array, uuid.uuid4().hex

    def __dask_tokenize__(self) -> str:
        return self.token


def _reductions_of(reduce: Any, nout: int, name: str) -> tuple[tuple[int, str], ...]:
    """``reduce=`` as ``(output, op)`` pairs: a name for every output, or one entry per output
    (``None``, a name, or a sequence of names)."""
    if reduce is None:
        return ()
    if isinstance(reduce, str):
        per_output: list[Any] = [reduce] * nout
    else:
        try:
            per_output = list(reduce)
        except TypeError:
            raise TypeError(f"{name}: reduce= takes a reduction's name, or one entry per output; "
                            f"got {type(reduce).__name__}") from None
        if len(per_output) != nout:
            raise ValueError(f"{name}: reduce= has {len(per_output)} entries for {nout} "
                             f"output{'s' if nout != 1 else ''}")
    pairs = []
    for k, entry in enumerate(per_output):
        ops = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for op in ops:
            if op not in REDUCTIONS:
                raise ValueError(f"{name}: unknown reduction {op!r}; one of "
                                 f"{', '.join(REDUCTIONS)}")
            pairs.append((k, op))
    return tuple(pairs)
