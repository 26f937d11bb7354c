"""Elementwise operations over Dask arrays: ``dg.elementwise(func)`` and ``dg.multiply``.

A scalar Python function becomes an operation on Dask arrays (NumPy and CuPy arrays and numbers
are accepted too) with NumPy's broadcasting, and NumPy's result dtype and values for that
function (the function is translated per dtype signature:
:mod:`dask_gpuchunk._kernels.translate`). Each chunk runs through
:func:`dask_gpuchunk.backend.run_elementwise`: numba CUDA kernel on the GPU, numba parallel twin
on the CPU, compiled lazily per dtype signature.
"""

from __future__ import annotations

import functools
import inspect
import math
import uuid
from collections.abc import Callable
from itertools import product
from typing import Any

import dask.array as da
import numpy as np
from dask.array.core import common_blockdim
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph
from dask.task_spec import Task, TaskRef

from ._kernels.elementwise import (
    RULES,
    arg_type,
    check_dtype,
    is_python_number,
    kernels_for,
)
from ._kernels.numpy_rules import VType, weak_type
from ._kernels.translate import check_call
from .arrays import asarray, is_array_like, refuse_masked
from .backend import is_cupy, run_elementwise
from .budget import check_fits
from .config import listed_graphs, map_blocks_prefix
from .devices import check_device_for_graph, gpu_available

__all__ = ["ElementwiseOp", "elementwise", "multiply"]


def _positional_arity(func: Callable) -> int:
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        raise TypeError(f"cannot inspect the signature of {func!r}") from None
    count = 0
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(
                f"{getattr(func, '__name__', func)!r} takes *args or **kwargs; an elementwise "
                "function takes a fixed number of positional arguments"
            )
        if p.kind == p.KEYWORD_ONLY:
            if p.default is p.empty:
                raise TypeError(
                    f"{getattr(func, '__name__', func)!r} has a required keyword-only argument "
                    f"{p.name!r}; an elementwise function takes positional arguments only"
                )
            continue
        count += 1
    if count == 0:
        raise TypeError(f"{getattr(func, '__name__', func)!r} takes no arguments")
    return count


def _block(*blocks: Any, kernels: Any, out_dtype: np.dtype, device: str) -> Any:
    return run_elementwise(kernels, out_dtype, blocks, device)


def _block_into(*blocks: Any, block_id: tuple[int, ...], kernels: Any, out_dtype: np.dtype,
                device: str, target: _Target, result_chunks: tuple[tuple[int, ...], ...]) -> np.ndarray:
    region = tuple(slice(sum(c[:i]), sum(c[:i + 1])) for c, i in zip(result_chunks, block_id))
    run_elementwise(kernels, out_dtype, blocks, device, dest=target.array[region])
    return np.ones((1,) * len(result_chunks), dtype=bool)  # a marker: the data went into out


class _Target:
    """``out=`` as a task argument: tokenized by a fresh name, not by hashing every byte."""

    __slots__ = ("array", "token")

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.token = array, uuid.uuid4().hex

    def __dask_tokenize__(self) -> str:
        return self.token


class ElementwiseOp:
    """An elementwise operation built from a scalar function; see :func:`elementwise`."""

    def __init__(self, func: Callable, *, dtype: Any = None, name: str | None = None,
                 cache: bool = False, rules: str = "numpy") -> None:
        if not callable(func):
            raise TypeError(f"elementwise needs a function, got {type(func).__name__}")
        if rules not in RULES:
            raise ValueError(f"rules must be one of {RULES}, got {rules!r}")
        self.func = func
        self.nargs = _positional_arity(func)
        self.dtype = None if dtype is None else check_dtype(dtype, "dtype=")
        self.rules = rules
        self.__name__ = name or getattr(func, "__name__", "elementwise")
        self.__doc__ = getattr(func, "__doc__", None)
        self.__wrapped__ = func
        self.kernels = kernels_for(func, self.nargs, tokenize(func, self.nargs, rules), cache,
                                   rules)
        params = [inspect.Parameter(f"x{i + 1}", inspect.Parameter.POSITIONAL_ONLY)
                  for i in range(self.nargs)]
        self.__signature__ = inspect.Signature([
            *params,
            inspect.Parameter("device", inspect.Parameter.KEYWORD_ONLY, default="auto"),
            inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, default=None),
        ])

    def __repr__(self) -> str:
        return f"<dask_gpuchunk elementwise {self.__name__!r} of {self.nargs} arguments>"

    def result_dtype(self, *dtypes: Any) -> np.dtype:
        """The result dtype for arguments of these dtypes (``dtype=`` if given, else the
        function's, by its rules). A Python number's argument is given as its type (``float``,
        ``int``, ``complex``, ``bool``).

        Examples
        --------
        >>> multiply.result_dtype("int8", "float32")
        dtype('float32')
        >>> multiply.result_dtype("float32", float)
        dtype('float32')
        >>> multiply.result_dtype(np.dtype("float32"), np.dtype("int64"))
        dtype('float64')
        """
        return self._result_dtype(tuple(_argtype_of(d, i) for i, d in enumerate(dtypes)))

    def _result_dtype(self, argtypes: tuple[VType, ...]) -> np.dtype:
        # Always translated (or compiled, with rules="numba"): it checks the function.
        inferred = self.kernels.result_dtype(argtypes)
        return self.dtype if self.dtype is not None else inferred

    def __call__(self, *args: Any, device: str = "auto", out: np.ndarray | None = None) -> Any:
        """Apply the operation; see :func:`elementwise` for the arguments."""
        check_device_for_graph(device)
        if len(args) != self.nargs:
            raise TypeError(f"{self.__name__} takes {self.nargs} arguments, got {len(args)}")
        operands = _operands(args, self.__name__)
        argtypes = tuple(arg_type(op, i) for i, op in enumerate(operands))
        out_dtype = self._result_dtype(argtypes)
        self._check_python_numbers(operands, argtypes)
        shape = _broadcast_shape(operands, self.__name__)
        on_device = any(_is_cupy_backed(op) for op in operands)
        if on_device and device == "cpu":
            raise ValueError(
                f"{self.__name__}: device='cpu' was given CuPy (GPU) data; use device='gpu' or "
                "'auto', or move it to the host first (x.map_blocks(cupy.asnumpy))"
            )
        arrays, chunks = _to_dask(operands)
        if (on_device or device == "gpu") and gpu_available():
            _check_chunk_fits(self.__name__, arrays, chunks, out_dtype, on_device)
        if on_device:
            import cupy

            meta = cupy.empty((0,) * len(shape), dtype=out_dtype)
        else:
            meta = np.empty((0,) * len(shape), dtype=out_dtype)
        if out is not None:
            return self._compute_into(arrays, chunks, out, shape, out_dtype, device, on_device,
                                      meta)
        signature = [(vt.dtype.str, vt.weak) for vt in argtypes]
        name = f"{self.__name__}-{tokenize(self.kernels.token, out_dtype, device, signature, *arrays)}"
        task_kwargs = {"kernels": self.kernels, "out_dtype": out_dtype, "device": device}
        if listed_graphs() and math.prod(len(c) for c in chunks) <= LISTED_GRAPH_MAX_BLOCKS:
            graph = _listed_graph(name, arrays, chunks, task_kwargs)
            return da.Array(graph, name, chunks, meta=meta, dtype=out_dtype)
        # blockwise as map_blocks would call it (trailing dimensions aligned, length-1 block
        # dimensions broadcast), without map_blocks' signature inspection.
        # Under array query planning a given name= is kept through the optimizer's rewrites
        # and breaks them (dask 2026.8: a rechunked input is never lowered): a prefix only.
        naming = {"token": self.__name__} if da.array_expr_enabled() else {"name": name}
        return da.blockwise(
            _block, tuple(range(len(shape))), *_index_pairs(arrays, len(shape)), **naming,
            dtype=out_dtype, meta=meta, concatenate=True, align_arrays=False, **task_kwargs,
        )

    def _check_python_numbers(self, operands: list[Any], argtypes: tuple[VType, ...]) -> None:
        """Raise as NumPy would for the Python numbers given (a value out of the bounds of the
        dtype it meets, a negative integer exponent)."""
        if self.rules != "numpy" or not any(vt.weak for vt in argtypes):
            return
        try:
            check_call(self.kernels.translation(argtypes), operands)
        except (OverflowError, ValueError, ZeroDivisionError) as exc:
            raise type(exc)(f"{self.__name__}: {exc}") from None

    def _compute_into(self, arrays: list[Any], chunks: tuple[tuple[int, ...], ...], out: Any,
                      shape: tuple[int, ...], out_dtype: np.dtype, device: str,
                      on_device: bool, meta: Any) -> np.ndarray:
        if on_device:
            raise ValueError(f"{self.__name__}: out= takes a host array; CuPy inputs give CuPy "
                             "results (drop out= and persist or compute the result instead)")
        if not isinstance(out, np.ndarray):
            raise TypeError(f"{self.__name__}: out= must be a NumPy array (or np.memmap), "
                            f"got {type(out).__name__}")
        if out.shape != shape or out.dtype != out_dtype:
            raise ValueError(
                f"{self.__name__}: out= has shape {out.shape} and dtype {out.dtype}; the result "
                f"has shape {shape} and dtype {out_dtype}"
            )
        if not out.flags.writeable:
            raise ValueError(f"{self.__name__}: out= is read-only")
        if not any(isinstance(a, da.Array) for a in arrays):  # numbers only: one 0-d result
            out[...] = _block(*arrays, kernels=self.kernels, out_dtype=out_dtype, device=device)
            return out
        # One marker element per block: the data goes into out.
        marks = da.map_blocks(
            _block_into, *arrays, dtype=bool, meta=np.empty((0,) * len(shape), dtype=bool),
            chunks=tuple((1,) * len(c) for c in chunks),
            **map_blocks_prefix(f"{self.__name__}-into"),
            kernels=self.kernels, out_dtype=out_dtype, device=device, target=_Target(out),
            result_chunks=chunks,
        )
        # Writes land in this process's memory: run on local threads, never on a cluster.
        marks.compute(scheduler="threads")
        return out


def _argtype_of(d: Any, index: int) -> VType:
    """A :class:`VType` for :meth:`ElementwiseOp.result_dtype`'s arguments."""
    if isinstance(d, VType):
        return d
    # A type, not a dtype equal to one (np.dtype("int64") == int holds).
    if isinstance(d, type) and d in (bool, int, float, complex):
        return weak_type(d(0), index)
    return VType(check_dtype(d, f"argument {index + 1}"))


def _is_cupy_backed(x: Any) -> bool:
    if isinstance(x, da.Array):
        return is_cupy(x._meta)
    return is_cupy(x)


def _operands(args: tuple[Any, ...], name: str) -> list[Any]:
    """The arguments, checked: Dask, NumPy and CuPy arrays, NumPy scalars and array-likes (h5py,
    Zarr: read per chunk later) as they are; Python numbers as they are (weak, NEP 50: they
    take the type of what they meet); other sequences as NumPy arrays."""
    operands: list[Any] = []
    for i, a in enumerate(args):
        what = f"{name}: argument {i + 1}"
        if is_python_number(a):
            try:
                weak_type(a)
            except Exception:
                raise OverflowError(f"{what}: Python integer {a} does not fit in 64 bits") from None
            operands.append(a)
            continue
        refuse_masked(a, what)
        if not (isinstance(a, (da.Array, np.ndarray, np.generic)) or is_cupy(a)
                or is_array_like(a)):
            try:
                a = np.asarray(a)
            except Exception:
                raise TypeError(
                    f"{what} is a {type(a).__name__}; pass Dask, NumPy or CuPy arrays, or numbers"
                ) from None
            if a.dtype == object:
                raise TypeError(f"{what} is not numeric ({type(args[i]).__name__})")
        check_dtype(a.dtype, what)
        operands.append(a)
    return operands


def _broadcast_shape(operands: list[Any], name: str) -> tuple[int, ...]:
    shapes = [tuple(np.shape(op)) if is_python_number(op) else tuple(op.shape) for op in operands]
    if any(np.isnan(n) for s in shapes for n in s):
        raise ValueError(f"{name}: an input has unknown chunk sizes; call "
                         "x.compute_chunk_sizes() first")
    try:
        return tuple(int(n) for n in np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError(
            f"{name}: operands could not be broadcast together with shapes "
            + " ".join(str(s) for s in shapes)
        ) from None


def _to_dask(operands: list[Any]) -> tuple[list[Any], tuple[tuple[int, ...], ...]]:
    """Dask arrays as they are; other arrays chunked like the largest Dask operand; and the
    result's chunks.

    0-d operands (NumPy scalars, Python numbers) stay constants passed to every chunk; where
    every operand is one, there is no Dask operand and the result is one 0-d chunk.
    """
    ref = max((op for op in operands if isinstance(op, da.Array)), key=lambda a: a.ndim,
              default=None)
    result: list[Any] = []
    for op in operands:
        if isinstance(op, da.Array) or is_python_number(op) or op.ndim == 0:
            result.append(op)
            continue
        if ref is None:
            ref = asarray(op)
            result.append(ref)
            continue
        chunks = []
        offset = ref.ndim - op.ndim
        for d, n in enumerate(op.shape):
            rd = d + offset
            if rd >= 0 and ref.shape[rd] == n:
                chunks.append(ref.chunks[rd])
            else:
                chunks.append((n,))
        result.append(asarray(op, chunks=tuple(chunks)))
    if not any(isinstance(r, da.Array) for r in result):
        return result, ()
    # Blockwise needs aligned blocks: rechunk where the Dask operands' chunks disagree,
    # aligning trailing dimensions as broadcasting does (length-1 dimensions broadcast).
    ndim = max(np.ndim(r) if not isinstance(r, da.Array) else r.ndim for r in result)
    dask_ops = [r for r in result if isinstance(r, da.Array)]
    chunks_by_dim = []
    for d in range(ndim):
        # The chunks of the operands that span this dimension (not broadcast along it).
        spans = {r.chunks[k] for r in dask_ops
                 if (k := d - (ndim - r.ndim)) >= 0 and r.shape[k] != 1}
        chunks_by_dim.append(common_blockdim(spans) if len(spans) > 1
                             else spans.pop() if spans else (1,))
    unified = []
    for r in result:
        if isinstance(r, da.Array):
            want = tuple(c if n == 1 else chunks_by_dim[ndim - r.ndim + k]
                         for k, (n, c) in enumerate(zip(r.shape, r.chunks)))
            r = r if want == r.chunks else r.rechunk(want)
        unified.append(r)
    return unified, tuple(chunks_by_dim)


def _index_pairs(arrays: list[Any], ndim: int) -> list[Any]:
    """``array, indices, ...`` for blockwise: trailing dimensions aligned; constants ``None``."""
    pairs: list[Any] = []
    for r in arrays:
        pairs += [r, tuple(range(ndim - r.ndim, ndim))] if isinstance(r, da.Array) else [r, None]
    return pairs


#: Up to this many result blocks the graph is a plain dict of tasks (:func:`_listed_graph`);
#: above, a ``Blockwise`` layer, which Dask builds in constant time and lists only when it is
#: computed. On the CPU box, listing costs ~4 µs per block (1024 blocks: 4 ms) and then makes
#: a persist of the whole result 4-10 % faster; 100,000 blocks would take over a second to list
#: (before any slice of the result could compute), where a ``Blockwise`` layer takes 0.6 ms.
LISTED_GRAPH_MAX_BLOCKS = 1024


def _largest_block_bytes(chunks: tuple[tuple[int, ...], ...], dtype: np.dtype) -> int:
    return math.prod(max(c, default=0) for c in chunks) * np.dtype(dtype).itemsize


def _check_chunk_fits(name: str, arrays: list[Any], chunks: tuple[tuple[int, ...], ...],
                      out_dtype: np.dtype, on_device: bool) -> None:
    """Refuse, before any work, a result chunk that cannot fit this process's device budget
    (:mod:`dask_gpuchunk.budget`) with its inputs: its output, and host inputs copied to the
    device (device inputs are already there)."""
    nbytes = _largest_block_bytes(chunks, out_dtype)
    if not on_device:
        nbytes += sum(_largest_block_bytes(a.chunks, a.dtype) for a in arrays
                      if isinstance(a, da.Array))
    check_fits(nbytes, f"{name}: one chunk", "chunks= of the inputs, or dask's rechunk")


def _listed_graph(name: str, arrays: list[Any], chunks: tuple[tuple[int, ...], ...],
                  task_kwargs: dict[str, Any]) -> HighLevelGraph:
    """One ``_block`` task per result block, in a plain dict.

    Block ``idx`` of the result reads block ``idx`` of each Dask operand, trailing dimensions
    aligned, block 0 along dimensions an operand broadcasts; constants go to every task.

    This is what ``da.blockwise`` gives for an elementwise function, listed now. A
    ``Blockwise`` layer costs each persist of a small graph 0.1-0.4 ms more, to build it and
    then for Dask to optimise and list it, against a 2.75 ms product of two 4 GB arrays on the
    H200 (docs/perf-notes.md, step 11); a loop of device-resident steps pays it every step.
    """
    ndim = len(chunks)
    # Per operand: a constant, or (name, where its dimensions start, which dimensions follow
    # the result's block index rather than staying at block 0).
    plans: list[Any] = []
    for r in arrays:
        if isinstance(r, da.Array):
            plans.append((r.name, ndim - r.ndim, tuple(n != 1 for n in r.numblocks)))
        else:
            plans.append(None)
    graph: dict[Any, Task] = {}
    for idx in product(*(range(len(c)) for c in chunks)):
        args = [
            r if plan is None else TaskRef((plan[0], *(idx[plan[1] + k] if follows else 0
                                                       for k, follows in enumerate(plan[2]))))
            for r, plan in zip(arrays, plans)
        ]
        key = (name, *idx)
        graph[key] = Task(key, _block, *args, **task_kwargs)
    dask_ops = [r for r in arrays if isinstance(r, da.Array)]
    return HighLevelGraph.from_collections(name, graph, dependencies=dask_ops)


def elementwise(func: Callable | None = None, *, dtype: Any = None,
                name: str | None = None, cache: bool = False, rules: str = "numpy") -> Any:
    """Turn a scalar function into an elementwise operation over Dask arrays.

    The function is compiled by numba, lazily and once per dtype signature and process, for
    CUDA (one thread per element) and for the CPU (a parallel loop). The returned operation
    takes as many arguments as the function: Dask, NumPy or CuPy arrays, or numbers, broadcast
    together as NumPy broadcasts, and returns a Dask array chunked like the Dask inputs.

    By default (``rules="numpy"``) every value is what NumPy computes when the function is
    called on NumPy scalars of the inputs' dtypes: ``int8 * int8`` is an ``int8`` that wraps,
    ``uint8 + uint8`` wraps before ``/ 2``, Python numbers are weak (NEP 50: ``float32 * 0.1``
    stays ``float32``, ``int8 * 300`` raises ``OverflowError``), ``int64 * uint64`` is
    ``float64``, integer ``//`` and ``%`` by zero give 0. The function is translated per dtype
    signature so that numba computes exactly that, on the CPU and the GPU alike
    (:mod:`dask_gpuchunk._kernels.translate` lists what it translates); what cannot be computed
    as NumPy computes it is refused with a ``TypeError`` naming the line, never computed
    differently.

    Parameters
    ----------
    func
        A scalar function of a fixed number of positional arguments, defined where its source
        can be read (a file, a notebook cell): arithmetic, comparisons, branches, ``for`` loops
        over ``range``, ``while`` loops, ``math`` and ``cmath`` functions, NumPy ufuncs and
        scalar types (``np.float32(x)``), and plain Python helper functions of the same kind.
    dtype
        The result dtype (each value converted as ``astype`` converts). Default: the dtype
        NumPy gives for the function's result (``int8 * int8`` is ``int8``, ``float32 * 0.5`` is
        ``float32``; a Python number returned is ``float64``, ``int64``, ``complex128``).
    name
        A name for the operation's tasks (default: the function's name).
    cache
        Keep the compiled kernels on disk (as numba's ``cache=True``; in
        ``gpuchunk.cache-dir``, by default ``~/.cache/dask_gpuchunk``), so that later
        processes (each worker of each job) load them instead of compiling: about 2 s per
        worker for a product on the H200 machine. Only for a function defined in a file; the
        cache follows that file and the function's code, not other files the function calls.
    rules
        ``"numpy"`` (default): NumPy's types and values, as above. ``"numba"``: the function as
        numba compiles it (its own typing: small integers computed in 64 bits, Python numbers
        as ``float64``/``int64``, mixed signed and unsigned integers as ``int64``); the result
        dtype is numba's unless ``dtype=`` is given. For functions outside the translated
        subset (local arrays, tuples, calls of numba-compiled functions).

    Returns
    -------
    ElementwiseOp
        Called as ``op(*arrays, device="auto", out=None)``:

        ``device``
            ``"gpu"``: CuPy chunks stay on the device; NumPy chunks are staged through pinned
            buffers, computed on the GPU and brought back as NumPy. ``"cpu"``: the numba
            parallel twin (NumPy chunks only). ``"auto"``: CuPy chunks on the GPU, NumPy chunks
            where a measured rule says they run faster (:mod:`dask_gpuchunk.placement`),
            CPU where no GPU is visible.
        ``out``
            A NumPy array (pinned or not, or an ``np.memmap``) of the result's shape and dtype:
            the result is computed now, on local threads, each chunk written straight into its
            region of ``out`` (no concatenation copy), and ``out`` is returned.

    Notes
    -----
    The function must not raise: numba's parallel loops and CUDA kernels do not report
    exceptions reliably. Return NaN or a sentinel value for invalid inputs instead.

    Where NumPy's own results are not unique, ours are within a rounding: complex products and
    quotients (NumPy's array loops use fused multiply-adds on AVX2/AVX-512 CPUs, its scalars
    do not; we compute as its scalars do), and ``math``/``cmath``/ufunc functions other than
    ``sqrt`` (the GPU's libdevice and the C library differ in the last bits).

    Examples
    --------
    >>> import math
    >>> import dask.array as da
    >>> @elementwise
    ... def damped(x, k):
    ...     return math.exp(-k * x) * math.cos(x)
    >>> x = da.linspace(0.0, 1.0, 5, chunks=2)
    >>> damped(x, 0.5, device="cpu").compute().round(4)
    array([1.    , 0.8551, 0.6835, 0.5029, 0.3277])
    >>> @elementwise(dtype="float32")
    ... def halve(x):
    ...     return x / 2
    >>> halve(da.arange(4, chunks=2), device="cpu").compute()
    array([0. , 0.5, 1. , 1.5], dtype=float32)

    NumPy's values, not numba's: ``int8`` arithmetic wraps at each step.

    >>> @elementwise
    ... def third_of_product(a, b):
    ...     return (a * b) // 3
    >>> a = np.array([100, 80, -86, 83], np.int8)
    >>> third_of_product(a, np.array([3, -9, 5, 4], np.int8), device="cpu").compute()
    array([14, 16, 27, 25], dtype=int8)
    """
    if func is None:
        return functools.partial(elementwise, dtype=dtype, name=name, cache=cache, rules=rules)
    return ElementwiseOp(func, dtype=dtype, name=name, cache=cache, rules=rules)


def _multiply(a: Any, b: Any) -> Any:
    return a * b


#: ``multiply(x, y, *, device="auto", out=None)``: the elementwise product with NumPy's
#: broadcasting, type promotion and values, for every real and complex dtype; see
#: :func:`elementwise`.
multiply = ElementwiseOp(_multiply, name="multiply", cache=True)
multiply.__doc__ = """Elementwise product ``x * y`` of Dask, NumPy or CuPy arrays or numbers.

NumPy's broadcasting, type promotion and values (``int8 * uint64`` is ``float64``, Python numbers
are weak); chunks run on the GPU or the CPU as ``device`` says (see :func:`elementwise`).
Returns a Dask array, or ``out`` filled when ``out=`` is given.

Examples
--------
>>> import dask.array as da
>>> x = da.from_array(np.arange(6).reshape(2, 3), chunks=(1, 2))
>>> multiply(x, da.from_array(np.array([1, 10, 100]), chunks=2), device="cpu").compute()
array([[  0,  10, 200],
       [  3,  40, 500]])
"""
