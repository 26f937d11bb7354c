"""An elementwise operation's plans and graphs: the eager device calls kept per shapes and
dtypes, the chunk plan (listed by hand or through ``blockwise``), each block's regions of its
operands, and the check that a block fits the device."""

from __future__ import annotations

import functools
import math
from itertools import product
from typing import TYPE_CHECKING, Any

import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph
from dask.task_spec import Task, TaskRef

from .._kernels.elementwise import ElementwisePlan, is_python_number
from ..runtime.backend import device_call, input_kind, is_cupy
from ..runtime.budget import check_fits_for_graph
from ..config import map_blocks_prefix
from .blocks import _block, _finish, _finish_blocks, _pick_output, _pick_reduction
from ..io import npy_reader_of
from ..runtime.resident import row_bounds
from ..ufunc.numpy_rules import VType

if TYPE_CHECKING:  # annotations only: the operator imports this module
    from .operations import ElementwiseOp

__all__ = []

#: NumPy inputs with no Dask operand whose inputs and outputs take more than this are
#: computed in chunks on local threads (a GPU takes one chunk at a time); less, as one chunk.
EAGER_ONE_CHUNK_BYTES = 512 * 2**20


@functools.lru_cache(maxsize=256)
def _plan_text(plan: ElementwisePlan) -> str:
    """A plan as text, for result names (dask's tokenizing of it walks every dtype)."""
    return repr(plan)


def _token_of(operand: Any) -> Any:
    """What names an operand in a result's name: a Dask array's name; a number's type and
    bytes (dask's own tokenizing of a NumPy scalar took 180 us, on every step of a loop)."""
    if isinstance(operand, da.Array):
        return operand.name
    if is_python_number(operand):
        return (type(operand).__name__, repr(operand))
    if isinstance(operand, (np.generic, np.ndarray)) and operand.ndim == 0:
        return (operand.dtype.str, operand.tobytes())
    return operand


#: Kinds of eager call on CuPy data each operation keeps prepared; beyond, the oldest go.
EAGER_CALLS_KEPT = 64


def _eager_key(args: tuple[Any, ...], device: str, out: Any, reduce: Any) -> tuple | None:
    """What an eager call on CuPy data is, for :attr:`ElementwiseOp._eager_calls`: the
    arguments' kinds (:func:`~dask_gpuchunk.runtime.backend.input_kind`), ``out=``'s, ``reduce=``,
    ``device=`` and the current CUDA device. ``None`` where the call is not of that form
    (no CuPy array, Dask or NumPy arrays, a list for ``reduce=``): it goes the full way."""
    if device != "auto" and device != "gpu":
        return None
    kinds = tuple(map(input_kind, args))
    if None in kinds or not any(type(k) is tuple and len(k) == 3 for k in kinds):  # no CuPy
        return None
    outs = out if isinstance(out, tuple) else (out,)
    out_kinds = None if out is None else tuple(map(input_kind, outs))
    if out_kinds is not None and (None in out_kinds or not all(map(is_cupy, outs))):
        return None
    try:
        hash(reduce)
    except TypeError:
        return None
    import cupy

    return (device, reduce, kinds, out_kinds, cupy.cuda.runtime.getDevice())


class _EagerDeviceCall:
    """One kind of eager call on CuPy data, checked once: the operation's pass prepared
    (:func:`~dask_gpuchunk.runtime.backend.device_call`), what each call still checks (Python
    numbers' values) and finishes (a mean's division)."""

    def __init__(self, op: ElementwiseOp, plan: ElementwisePlan, argtypes: tuple[VType, ...],
                 operands: list[Any], outs: tuple[Any, ...] | None) -> None:
        self.op = op
        self.plan = plan
        self.argtypes = argtypes
        self.check_numbers = op.rules == "numpy" and any(vt.weak for vt in argtypes)
        self.call = device_call(op.kernels, plan, operands, outs, finished=True)
        self.count = self.call.n
        self.means = [(r, dt) for r, ((_, how), dt) in enumerate(
            zip(plan.reductions, plan.reduced_dtypes())) if how == "mean"]

    def __call__(self, args: Any, out: Any) -> Any:
        if self.check_numbers:
            self.op._check_python_numbers(list(args), self.argtypes)
        outs = None if out is None else (tuple(out) if isinstance(out, (tuple, list)) else (out,))
        # Allocated as any CuPy operation allocates (an eager call runs alone, in the
        # caller's thread: no Dask chunks of it to share the budget with).
        result = self.call.run(args, outs)
        if self.plan.plain:
            return result
        results, totals = result
        if self.means:
            totals = list(totals)
            for r, dt in self.means:
                totals[r] = _finish(totals[r], "mean", self.count, dt)
        return (*results, *totals)


def _listed_plan(name: str, arrays: list[Any], chunks: tuple[tuple[int, ...], ...],
                 task_kwargs: dict[str, Any], plan: ElementwisePlan, shape: tuple[int, ...],
                 xp: Any) -> tuple[da.Array, ...]:
    """The outputs and reductions of a plan over few blocks, listed: one task per block computes
    every output, one task per output block picks it, one task per reduction combines the
    blocks' values (:func:`_listed_graph`)."""
    base = _listed_graph(name, arrays, chunks, task_kwargs)
    block_keys = [(name, *idx) for idx in product(*(range(len(c)) for c in chunks))]
    results: list[da.Array] = []
    for k, dt in enumerate(plan.out_dtypes):
        out_name = f"{name}-out{k}"
        layer = {(out_name, *key[1:]): Task((out_name, *key[1:]), _pick_output, TaskRef(key), k)
                 for key in block_keys}
        graph = HighLevelGraph({**base.layers, out_name: layer},
                               {**base.dependencies, out_name: {name}})
        results.append(da.Array(graph, out_name, chunks, dtype=dt,
                                meta=_meta(xp, len(shape), dt)))
    count = math.prod(shape)
    for r, ((_, op), dt) in enumerate(zip(plan.reductions, plan.reduced_dtypes())):
        red_name = f"{name}-{op}{r}"
        layer = {(red_name,): Task((red_name,), _finish_blocks, r, op, count, dt,
                                   *(TaskRef(key) for key in block_keys))}
        graph = HighLevelGraph({**base.layers, red_name: layer},
                               {**base.dependencies, red_name: {name}})
        results.append(da.Array(graph, red_name, (), dtype=dt, meta=_meta(xp, None, dt)))
    return tuple(results)


_device_metas: dict[tuple, Any] = {}


def _meta(xp: Any, ndim: int | None, dtype: np.dtype) -> Any:
    """A result's meta: an empty array of ``ndim`` dimensions (``None``: a 0-d one) and
    ``dtype``, of ``xp``'s kind. CuPy's are made once per device and shared: each is an
    allocation (~20 us; a loop step on the device made three)."""
    shape = () if ndim is None else (0,) * ndim
    if xp is np:
        return np.empty(shape, dtype=dtype)
    key = (xp.cuda.runtime.getDevice(), ndim, np.dtype(dtype))
    meta = _device_metas.get(key)
    if meta is None:
        meta = _device_metas[key] = xp.empty(shape, dtype)
    return meta


def _blockwise_plan(blocks: da.Array, plan: ElementwisePlan, shape: tuple[int, ...],
                    chunks: tuple[tuple[int, ...], ...], xp: Any,
                    prefix: str) -> tuple[da.Array, ...]:
    """The outputs and reductions of a plan from a blockwise array whose blocks are
    ``(outputs, reductions)``: outputs picked block by block, reductions by Dask's own tree
    reductions over the blocks' values."""
    ndim = len(shape)
    results: list[da.Array] = [
        blocks.map_blocks(_pick_output, k, dtype=dt, meta=xp.empty((0,) * ndim, dtype=dt),
                          **map_blocks_prefix(f"{prefix}-out{k}"))
        for k, dt in enumerate(plan.out_dtypes)]
    count = math.prod(shape)
    for r, ((_, op), pdt, dt) in enumerate(zip(plan.reductions, plan.partial_dtypes(),
                                                plan.reduced_dtypes())):
        values = blocks.map_blocks(_pick_reduction, r, ndim, dtype=pdt,
                                   meta=xp.empty((0,) * ndim, dtype=pdt),
                                   chunks=tuple((1,) * len(c) for c in chunks),
                                   **map_blocks_prefix(f"{prefix}-{op}{r}"))
        combined = (values.sum(dtype=pdt) if op in ("sum", "mean")
                    else values.min() if op == "min" else values.max())
        results.append(combined.map_blocks(_finish, op, count, dt, dtype=dt,
                                           meta=xp.empty((), dtype=dt)))
    return tuple(results)


#: Up to this many result blocks the graph is a plain dict of tasks (:func:`_listed_graph`);
#: above, a ``Blockwise`` layer, which Dask builds in constant time and lists only when it is
#: computed. On the CPU box, listing costs ~4 µs per block (1024 blocks: 4 ms) and then makes
#: a persist of the whole result 4-10 % faster; 100,000 blocks would take over a second to list
#: (before any slice of the result could compute), where a ``Blockwise`` layer takes 0.6 ms.
LISTED_GRAPH_MAX_BLOCKS = 1024


def _largest_block_bytes(chunks: tuple[tuple[int, ...], ...], dtype: np.dtype) -> int:
    return math.prod(max(c, default=0) for c in chunks) * np.dtype(dtype).itemsize


def _check_chunk_fits(name: str, arrays: list[Any], chunks: tuple[tuple[int, ...], ...],
                      out_dtypes: tuple[np.dtype, ...], on_device: bool) -> None:
    """Refuse, before any work, a result chunk that cannot fit the device budget where it runs
    (:func:`~dask_gpuchunk.runtime.budget.check_fits_for_graph`) with its inputs: its
    outputs, and host inputs copied to the device (device inputs are already there)."""
    nbytes = sum(_largest_block_bytes(chunks, dt) for dt in out_dtypes)
    if not on_device:
        nbytes += sum(_largest_block_bytes(a.chunks, a.dtype) for a in arrays
                      if isinstance(a, da.Array))
    check_fits_for_graph(nbytes, f"{name}: one chunk",
                         "chunks= of the inputs, or dask's rechunk")


def _listed_graph(name: str, arrays: list[Any], chunks: tuple[tuple[int, ...], ...],
                  task_kwargs: dict[str, Any]) -> HighLevelGraph:
    """One ``_block`` task per result block, in a plain dict.

    Block ``idx`` of the result reads block ``idx`` of each Dask operand, trailing dimensions
    aligned, block 0 along dimensions an operand broadcasts; constants go to every task. A
    :func:`~dask_gpuchunk.io.from_npy` operand as it was made is read by the block's task
    itself, its region of the file (:func:`_read_region`), and where every Dask operand is, the
    tasks are marked data producers, which distributed hands out as root tasks: read by tasks
    of their own, the two operands of a block were read on different workers of two GPUs and
    one of them sent to the other (0.8 GB a worker for two 4 GB files).

    This is what ``da.blockwise`` gives for an elementwise function, listed now. A
    ``Blockwise`` layer costs each persist of a small graph 0.1-0.4 ms more, to build it and
    then for Dask to optimise and list it, against a 2.75 ms product of two 4 GB arrays on the
    H200 (the perf notes (git show 85dc246:docs/perf-notes.md), step 11); a loop of device-resident steps pays it every step.
    """
    ndim = len(chunks)
    graph: dict[Any, Any] = {}
    # Per operand: a constant (None), or (where its dimensions start, which dimensions follow
    # the result's block index rather than staying at block 0, and what names its block: the
    # operand's own name, or (the reader's key, each dimension's bounds) to read it).
    plans: list[Any] = []
    dask_ops: list[da.Array] = []
    for r in arrays:
        if not isinstance(r, da.Array):
            plans.append(None)
            continue
        reader = npy_reader_of(r, whole_rows=False)
        if reader is None:
            source: Any = r.name
            dask_ops.append(r)
        else:
            source = (f"npy-reader-{tokenize(reader)}", [row_bounds(c) for c in r.chunks])
            graph[source[0]] = reader  # where to_npy finds the inputs it checks at the end
        plans.append((ndim - r.ndim, tuple(n != 1 for n in r.numblocks), source))
    producer = any(plan is not None for plan in plans) and not dask_ops
    for idx in product(*(range(len(c)) for c in chunks)):
        args = []
        for r, plan in zip(arrays, plans):
            if plan is None:
                args.append(r)
                continue
            start, follows, source = plan
            block = tuple(idx[start + k] if f else 0 for k, f in enumerate(follows))
            if isinstance(source, str):
                args.append(TaskRef((source, *block)))
            else:
                region = tuple(slice(*bounds[b]) for bounds, b in zip(source[1], block))
                args.append(Task(None, _read_region, TaskRef(source[0]), region))
        key = (name, *idx)
        graph[key] = Task(key, _block, *args, _data_producer=producer, **task_kwargs)
    return HighLevelGraph.from_collections(name, graph, dependencies=dask_ops)


def _read_region(reader: Any, region: tuple[slice, ...]) -> Any:
    """Region ``region`` of a ``.npy`` (:class:`~dask_gpuchunk.io.NpyReader`), read now."""
    return reader[region]
