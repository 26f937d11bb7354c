"""Elementwise operations over Dask arrays: ``dg.elementwise(func)`` and ``dg.multiply``.

A scalar Python function becomes an operation on Dask arrays (NumPy and CuPy arrays and numbers are
accepted too) with NumPy's broadcasting, and NumPy's result dtype and values for that function (the
function is translated per dtype signature: :mod:`dask_gpuchunk.ufunc.translate`). Each chunk runs
through :func:`dask_gpuchunk.runtime.backend.run_elementwise`: numba CUDA kernel on the GPU, numba
parallel twin on the CPU, compiled lazily per dtype signature.

This module is the operator (:class:`ElementwiseOp`, :func:`elementwise`, ``multiply``); its
operands are :mod:`dask_gpuchunk.elementwise_ops.operands`', its plans and graphs
:mod:`dask_gpuchunk.elementwise_ops.graphs`', what its tasks run
:mod:`dask_gpuchunk.elementwise_ops.blocks`'.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import dask.array as da
import numpy as np
from dask.base import tokenize

from .._kernels.elementwise import (
    RULES,
    ElementwisePlan,
    arg_type,
    check_dtype,
    is_python_number,
    is_scalar,
    kernels_for,
    reduced_dtype,
)
from ..arrays import is_array_like
from ..runtime.backend import is_cupy, run_elementwise
from ..config import listed_graphs, map_blocks_prefix
from ..devices import Device, check_device, check_device_for_graph, check_device_name, gpu_available
from .blocks import (
    _Target,
    _block,
    _block_into,
    _combine_reduced,
    _finish,
    _reductions_of,
)
from .graphs import (
    EAGER_CALLS_KEPT,
    EAGER_ONE_CHUNK_BYTES,
    LISTED_GRAPH_MAX_BLOCKS,
    _EagerDeviceCall,
    _blockwise_plan,
    _check_chunk_fits,
    _eager_key,
    _listed_graph,
    _listed_plan,
    _meta,
    _plan_text,
    _token_of,
)
from .operands import (
    _argtype_of,
    _broadcast_shape,
    _cast,
    _index_pairs,
    _is_cupy_backed,
    _is_xarray,
    _loop_type,
    _operands,
    _positional_arity,
    _to_dask,
    _xarray_dtype,
)
from ..ufunc.numpy_rules import VType
from ..ufunc.translate import check_call
from ..ufunc.user_functions import Loop, pick_loop, scalar_function

__all__ = ["ElementwiseOp", "elementwise", "multiply"]

class ElementwiseOp:
    """An elementwise operation built from a scalar function; see :func:`elementwise`."""

    def __init__(self, func: Callable, *, dtype: Any = None, name: str | None = None,
                 cache: bool = False, rules: str | None = None, fma: bool = False) -> None:
        if not callable(func):
            raise TypeError(f"elementwise needs a function, got {type(func).__name__}")
        found = scalar_function(func)
        if rules is None:  # numba's own objects were written for numba's typing
            rules = "numpy" if found.kind == "python" else "numba"
        if rules not in RULES:
            raise ValueError(f"rules must be one of {RULES}, got {rules!r}")
        given = func
        func = found.func
        self.func = func
        #: A numba ufunc's type loops: calls cast their arguments to the loop NumPy picks.
        self.loops = found.loops
        self._loop_for: dict[tuple, Loop] = {}
        self.nargs = _positional_arity(func)
        if self.loops and len(self.loops[0].inputs) != self.nargs:
            raise TypeError(f"{getattr(func, '__name__', func)!r}: the ufunc's loops take "
                            f"{len(self.loops[0].inputs)} arguments, its function {self.nargs}")
        if dtype is None:
            self.dtype = None
        elif isinstance(dtype, (tuple, list)):
            if not dtype:
                raise ValueError("dtype= is an empty sequence")
            self.dtype = tuple(check_dtype(d, f"dtype= entry {k + 1}") for k, d in enumerate(dtype))
        else:
            self.dtype = check_dtype(dtype, "dtype=")
        self.rules = rules
        self.__name__ = name or getattr(func, "__name__", "elementwise")
        self.__doc__ = getattr(func, "__doc__", None)
        self.__wrapped__ = given
        if not isinstance(fma, bool):
            raise TypeError(f"fma= takes True or False, got {fma!r}")
        self.fma = fma
        self.kernels = kernels_for(func, self.nargs, tokenize(func, self.nargs, rules, fma),
                                   cache, rules, fma)
        #: Eager calls on CuPy data, prepared by the kind of call (:func:`_eager_key`).
        self._eager_calls: dict[tuple, _EagerDeviceCall] = {}
        params = [inspect.Parameter(f"x{i + 1}", inspect.Parameter.POSITIONAL_ONLY)
                  for i in range(self.nargs)]
        self.__signature__ = inspect.Signature([
            *params,
            inspect.Parameter("device", inspect.Parameter.KEYWORD_ONLY, default="auto"),
            inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, default=None),
            inspect.Parameter("reduce", inspect.Parameter.KEYWORD_ONLY, default=None),
        ])

    def __repr__(self) -> str:
        return f"<dask_gpuchunk elementwise {self.__name__!r} of {self.nargs} arguments>"

    def result_dtype(self, *dtypes: Any) -> Any:
        """The result dtype for arguments of these dtypes (``dtype=`` if given, else the
        function's, by its rules); a tuple of them for a function that returns a tuple. A
        Python number's argument is given as its type (``float``, ``int``, ``complex``,
        ``bool``).

        Examples
        --------
        >>> multiply.result_dtype("int8", "float32")
        dtype('float32')
        >>> multiply.result_dtype("float32", float)
        dtype('float32')
        >>> multiply.result_dtype(np.dtype("float32"), np.dtype("int64"))
        dtype('float64')
        >>> elementwise(lambda a, b: (a * b, a > b)).result_dtype("int8", "int16")
        (dtype('int16'), dtype('bool'))
        """
        out_dtypes, tupled = self._outputs(tuple(_argtype_of(d, i) for i, d in enumerate(dtypes)))
        return out_dtypes if tupled else out_dtypes[0]

    def _outputs(self, argtypes: tuple[VType, ...]) -> tuple[tuple[np.dtype, ...], bool]:
        """Each output's dtype (``dtype=`` where given) and whether the function returns a
        tuple. Always translated (or compiled, with ``rules="numba"``): it checks the function."""
        if self.loops and self.dtype is None:  # what the user's ufunc returns
            return (self._loop(argtypes).output,), False
        inferred, tupled = self.kernels.outputs(argtypes)
        if self.dtype is None:
            return inferred, tupled
        if not isinstance(self.dtype, tuple):
            return (self.dtype,) * len(inferred), tupled
        if len(self.dtype) != len(inferred):
            raise TypeError(f"{self.__name__} returns {len(inferred)} value"
                            f"{'s' if len(inferred) != 1 else ''}; dtype= gives {len(self.dtype)}")
        return self.dtype, tupled

    def __call__(self, *args: Any, device: Device = "auto", out: Any = None,
                 reduce: Any = None) -> Any:
        """Apply the operation; see :func:`elementwise` for the arguments."""
        if any(_is_xarray(a) for a in args):
            return self._on_xarray(args, device, out, reduce)
        if self.loops and len(args) == self.nargs:
            args = self._loop_args(args)
        key = _eager_key(args, device, out, reduce)
        if key is not None:
            call = self._eager_calls.get(key)
            if call is not None:  # this kind of call was checked and prepared before
                return call(args, out)
        check_device_name(device)
        if len(args) != self.nargs:
            raise TypeError(f"{self.__name__} takes {self.nargs} arguments, got {len(args)}")
        operands = _operands(args, self.__name__)
        argtypes = tuple(arg_type(op, i) for i, op in enumerate(operands))
        out_dtypes, tupled = self._outputs(argtypes)
        self._check_python_numbers(operands, argtypes)
        shape = _broadcast_shape(operands, self.__name__)
        plan = self._plan(out_dtypes, tupled, reduce, shape)
        on_device = any(_is_cupy_backed(op) for op in operands)
        if on_device and device == "cpu":
            raise ValueError(
                f"{self.__name__}: device='cpu' was given CuPy (GPU) data; use device='gpu' or "
                "'auto', or move it to the host first (x.map_blocks(cupy.asnumpy))"
            )
        if not any(isinstance(op, da.Array) or is_array_like(op) for op in operands):
            check_device(device)
            if on_device and all(is_cupy(op) or is_scalar(op) for op in operands):
                outs = None if out is None else self._check_out(out, plan, shape, on_device)
                call = _EagerDeviceCall(self, plan, argtypes, operands, outs)
                if key is not None:
                    if len(self._eager_calls) >= EAGER_CALLS_KEPT:
                        self._eager_calls.pop(next(iter(self._eager_calls)), None)
                    self._eager_calls[key] = call
                return call(operands, outs)
            return self._eager(operands, plan, shape, device, out, on_device)
        check_device_for_graph(device)
        arrays, chunks = _to_dask(operands)
        if (on_device or device == "gpu") and gpu_available():
            _check_chunk_fits(self.__name__, arrays, chunks, plan.out_dtypes, on_device)
        xp = __import__("cupy") if on_device else np
        if out is not None:
            return self._compute_into(arrays, chunks, out, shape, plan, device, on_device)
        single = plan.plain
        task_kwargs = {"kernels": self.kernels, "out_dtype": plan.out_dtypes[0] if single
                       else plan, "device": device}
        signature = [(vt.dtype.str, vt.weak) for vt in argtypes]
        token = tokenize(self.kernels.token, _plan_text(plan), device, signature,
                         *map(_token_of, arrays))
        name = f"{self.__name__}-{token}"
        listed = listed_graphs() and math.prod(len(c) for c in chunks) <= LISTED_GRAPH_MAX_BLOCKS
        if single:
            meta = _meta(xp, len(shape), plan.out_dtypes[0])
            if listed:
                graph = _listed_graph(name, arrays, chunks, task_kwargs)
                return da.Array(graph, name, chunks, meta=meta, dtype=plan.out_dtypes[0])
            return self._blockwise(name, arrays, shape, task_kwargs, meta, plan.out_dtypes[0])
        if listed:
            return _listed_plan(name, arrays, chunks, task_kwargs, plan, shape, xp)
        blocks = self._blockwise(name, arrays, shape, task_kwargs,
                                 np.empty((0,) * len(shape), dtype=object), object)
        return _blockwise_plan(blocks, plan, shape, chunks, xp, self.__name__)

    def _on_xarray(self, args: tuple[Any, ...], device: str, out: Any, reduce: Any) -> Any:
        """The operation on xarray objects, as a NumPy ufunc works on them
        (``xarray.apply_ufunc``): operands aligned and broadcast by their dimensions' names,
        the results xarray objects of those dimensions and coordinates, holding what the
        operation gives for their data (Dask in, Dask out)."""
        import xarray as xr

        if out is not None or reduce is not None:
            raise TypeError(f"{self.__name__}: out= and reduce= take no xarray objects; pass "
                            "their .data (or use xarray's own reductions on the result)")
        if len(args) != self.nargs:
            raise TypeError(f"{self.__name__} takes {self.nargs} arguments, got {len(args)}")
        dtypes = tuple(_xarray_dtype(a) for a in args)
        outputs = self.result_dtype(*dtypes)
        nout = len(outputs) if isinstance(outputs, tuple) else 1
        return xr.apply_ufunc(functools.partial(self, device=device), *args, dask="allowed",
                              output_core_dims=[()] * nout)

    def _loop(self, argtypes: tuple[VType, ...]) -> Loop:
        """The ufunc loop NumPy picks for arguments of these types."""
        found = self._loop_for.get(argtypes)
        if found is None:
            found = self._loop_for[argtypes] = pick_loop(self.loops, argtypes, self.__name__)
        return found

    def _loop_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The arguments cast to the inputs of the ufunc loop NumPy picks for them (Dask
        arrays lazily; a Python number becomes a NumPy scalar of the loop's type)."""
        argtypes = tuple(_loop_type(a) for a in args)
        loop = self._loop(argtypes)
        return tuple(a if vt.dtype == dt and not vt.weak else _cast(a, dt)
                     for a, vt, dt in zip(args, argtypes, loop.inputs))

    def _blockwise(self, name: str, arrays: list[Any], shape: tuple[int, ...],
                   task_kwargs: dict[str, Any], meta: Any, dtype: Any) -> da.Array:
        # blockwise as map_blocks would call it (trailing dimensions aligned, length-1 block
        # dimensions broadcast), without map_blocks' signature inspection.
        # Under array query planning a given name= is kept through the optimizer's rewrites
        # and breaks them (dask 2026.8: a rechunked input is never lowered): a prefix only.
        naming = {"token": self.__name__} if da.array_expr_enabled() else {"name": name}
        return da.blockwise(
            _block, tuple(range(len(shape))), *_index_pairs(arrays, len(shape)), **naming,
            dtype=dtype, meta=meta, concatenate=True, align_arrays=False, **task_kwargs,
        )

    def _plan(self, out_dtypes: tuple[np.dtype, ...], tupled: bool, reduce: Any,
              shape: tuple[int, ...]) -> ElementwisePlan:
        """The pass's :class:`ElementwisePlan`, its reductions checked before any work."""
        reductions = _reductions_of(reduce, len(out_dtypes), self.__name__)
        for k, op in reductions:
            try:
                reduced_dtype(op, out_dtypes[k])
            except TypeError as exc:
                raise TypeError(f"{self.__name__}: output {k + 1}: {exc}") from None
            if op in ("min", "max") and 0 in shape:
                raise ValueError(f"{self.__name__}: zero-size result: {op} has no identity "
                                 "(as NumPy raises)")
        return ElementwisePlan(out_dtypes, tupled, reductions)

    def _check_python_numbers(self, operands: list[Any], argtypes: tuple[VType, ...]) -> None:
        """Raise as NumPy would for the Python numbers given (a value out of the bounds of the
        dtype it meets, a negative integer exponent)."""
        if self.rules != "numpy" or not any(vt.weak for vt in argtypes):
            return
        try:
            check_call(self.kernels.translation(argtypes), operands)
        except (OverflowError, ValueError, ZeroDivisionError) as exc:
            raise type(exc)(f"{self.__name__}: {exc}") from None

    def _check_out(self, out: Any, plan: ElementwisePlan, shape: tuple[int, ...],
                   on_device: bool) -> tuple[Any, ...]:
        """``out=`` as a tuple of arrays, one per output, checked: CuPy arrays for CuPy
        inputs, NumPy arrays (or np.memmap) for NumPy ones, of the outputs' shape and dtypes."""
        nout = len(plan.out_dtypes)
        several = plan.tupled or isinstance(out, tuple)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if several and len(outs) != nout:
            raise ValueError(f"{self.__name__}: out= has {len(outs)} arrays for {nout} outputs")
        kind = "CuPy" if on_device else "NumPy"
        for k, (o, dt) in enumerate(zip(outs, plan.out_dtypes)):
            what = f"{self.__name__}: out=" + (f" entry {k + 1}" if nout > 1 else "")
            if on_device != is_cupy(o) or not (is_cupy(o) or isinstance(o, np.ndarray)):
                raise TypeError(f"{what} must be a {kind} array for {kind} inputs "
                                f"(or np.memmap), got {type(o).__name__}")
            if tuple(o.shape) != shape or o.dtype != dt:
                raise ValueError(f"{what} has shape {tuple(o.shape)} and dtype {o.dtype}; the "
                                 f"result has shape {shape} and dtype {dt}")
            if isinstance(o, np.ndarray) and not o.flags.writeable:
                raise ValueError(f"{what} is read-only")
        return outs

    def _eager(self, operands: list[Any], plan: ElementwisePlan, shape: tuple[int, ...],
               device: str, out: Any, on_device: bool) -> Any:
        """NumPy, CuPy arrays and numbers only: computed now, as a ufunc would (CuPy in, CuPy
        out on the current stream; NumPy in, NumPy out, where ``device`` places it). CuPy
        arrays and numbers alone go through :class:`_EagerDeviceCall` instead."""
        single = plan.plain
        outs = None if out is None else self._check_out(out, plan, shape, on_device)
        nbytes = math.prod(shape) * sum(dt.itemsize for dt in plan.out_dtypes) + sum(
            op.nbytes for op in operands if not is_python_number(op))
        if (not on_device and nbytes > EAGER_ONE_CHUNK_BYTES and device != "cpu"
                and gpu_available()):
            # Too large for one staged chunk: chunked, on local threads, into the outputs.
            arrays, chunks = _to_dask(operands)
            if outs is None:
                outs = tuple(np.empty(shape, dt) for dt in plan.out_dtypes)
            result = self._compute_into(arrays, chunks, outs if not single else outs[0], shape,
                                        plan, device, False, eager=True)
        else:
            inputs = [op if is_python_number(op) or is_cupy(op) or isinstance(op, np.generic)
                      else np.asarray(op) for op in operands]
            dest = None if outs is None else (outs[0] if single else outs)
            result = run_elementwise(self.kernels, plan.out_dtypes[0] if single else plan,
                                     inputs, device, dest=dest)
        if single:
            return result[()] if out is None and not on_device and not shape else result
        results, reduced = result
        if out is None and not on_device and not shape:
            results = tuple(r[()] for r in results)
        finished = [_finish(v, op, math.prod(shape), dt)
                    for v, (_, op), dt in zip(reduced, plan.reductions, plan.reduced_dtypes())]
        if not on_device:
            finished = [f[()] for f in finished]  # NumPy scalars, as np.sum gives
        return (*results, *finished)

    def _compute_into(self, arrays: list[Any], chunks: tuple[tuple[int, ...], ...], out: Any,
                      shape: tuple[int, ...], plan: ElementwisePlan, device: str,
                      on_device: bool, eager: bool = False) -> Any:
        """Dask inputs with ``out=``: computed now, on local threads, each block written
        straight into its region of each output."""
        single = plan.plain
        if on_device:
            raise ValueError(f"{self.__name__}: out= takes a host array; CuPy inputs give CuPy "
                             "results (drop out= and persist or compute the result instead)")
        outs = out if eager else self._check_out(out, plan, shape, False)
        target = outs[0] if single and not eager else outs
        if not any(isinstance(a, da.Array) for a in arrays):  # numbers only: one 0-d result
            result = run_elementwise(self.kernels, plan.out_dtypes[0] if single else plan,
                                     arrays, device)
            marks = None
            if single:
                target[...] = result
            else:
                for o, r in zip(target, result[0]):
                    o[...] = r
                marks = [result[1]]
        else:
            # One mark per block: the data goes into the outputs.
            blocks = da.map_blocks(
                _block_into, *arrays, dtype=bool if single else object,
                meta=np.empty((0,) * len(shape), dtype=bool if single else object),
                chunks=tuple((1,) * len(c) for c in chunks),
                **map_blocks_prefix(f"{self.__name__}-into"),
                kernels=self.kernels, out_dtype=plan.out_dtypes[0] if single else plan,
                device=device, target=_Target(target), result_chunks=chunks,
            )
            # Writes land in this process's memory: run on local threads, never on a cluster.
            computed = blocks.compute(scheduler="threads")
            marks = None if single else list(np.asarray(computed, dtype=object).reshape(-1))
        if single:
            return target
        if eager:
            return tuple(target), tuple(
                _combine_reduced(op, *(m[r] for m in marks))
                for r, (_, op) in enumerate(plan.reductions))
        finished = [
            _finish(_combine_reduced(op, *(m[r] for m in marks)), op, math.prod(shape), dt)[()]
            for r, ((_, op), dt) in enumerate(zip(plan.reductions, plan.reduced_dtypes()))]
        return (*target, *finished)


def elementwise(func: Callable | None = None, *, dtype: Any = None,
                name: str | None = None, cache: bool = False, rules: str | None = None,
                fma: bool = False) -> Any:
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
    (:mod:`dask_gpuchunk.ufunc.translate` lists what it translates); what cannot be computed
    as NumPy computes it is refused with a ``TypeError`` naming the line, never computed
    differently.

    Parameters
    ----------
    func
        A scalar function of a fixed number of positional arguments, defined where its source
        can be read (a file, a notebook cell): arithmetic, comparisons, branches, ``for`` loops
        over ``range``, ``while`` loops, ``math`` and ``cmath`` functions, NumPy ufuncs and
        scalar types (``np.float32(x)``), and plain Python, ``@njit`` or
        ``@cuda.jit(device=True)`` helper functions of the same kind. Or numba's own: an
        ``@njit`` function, a ``@cuda.jit(device=True)`` function, a ``@vectorize`` ufunc
        (``target="cpu"`` or ``"cuda"``; its arguments are cast to the loop NumPy picks from
        its signatures, and the result has that loop's dtype).
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
        ``"numpy"`` (the default for plain Python functions): NumPy's types and values, as
        above; numba's own objects default to ``"numba"``. ``"numba"``: the function as
        numba compiles it (its own typing: small integers computed in 64 bits, Python numbers
        as ``float64``/``int64``, mixed signed and unsigned integers as ``int64``); the result
        dtype is numba's unless ``dtype=`` is given. For functions outside the translated
        subset (local arrays, tuples).
    fma
        On the GPU, let the compiler fuse a real product with the addition that follows into
        one fused multiply-add, rounded once, as nvcc does for CuPy's own kernels (NumPy, and
        the default here, round the product first); values then differ from NumPy's by a
        rounding per fused operation. Complex products are fused either way, as NumPy's array
        loops fuse them: seed 002's RK4 step, whose products are all complex, computes the
        same values with and without it (180 µs and 175 µs with its fused sum at 4096²
        complex64 on an H200; CuPy's kernel and sum 199 µs). The CPU twin is unchanged.

    Returns
    -------
    ElementwiseOp
        Called as ``op(*arrays, device="auto", out=None, reduce=None)``. With a Dask operand
        (or an h5py / Zarr dataset) the results are Dask arrays; with NumPy or CuPy arrays and
        numbers only, they are computed at once, like a NumPy ufunc's: CuPy in, CuPy out (on
        the current stream, no host copy); NumPy in, NumPy out (0-d results as NumPy scalars),
        computed where ``device`` says (NumPy inputs larger than 512 MiB in chunks on local
        threads). A function that returns a tuple gives one output per value, computed in one
        pass (NumPy's ``nout``; ``dtype=`` may be a tuple). With an xarray ``DataArray`` or
        ``Dataset`` among the operands, the results are xarray objects, as a NumPy ufunc's
        are: operands aligned and broadcast by their dimensions' names, coordinates kept
        (``xarray.apply_ufunc``), each holding what the operation gives for the data (Dask
        arrays for Dask-backed objects).

        ``device``
            ``"gpu"``: CuPy chunks stay on the device; NumPy chunks are staged through pinned
            buffers, computed on the GPU and brought back as NumPy. ``"cpu"``: the numba
            parallel twin (NumPy chunks only). ``"auto"``: CuPy chunks on the GPU, NumPy chunks
            where a measured rule says they run faster (:mod:`dask_gpuchunk.runtime.placement`),
            CPU where no GPU is visible.
        ``out``
            A NumPy array (pinned or not, or an ``np.memmap``) of the result's shape and dtype
            (a CuPy array for CuPy inputs; a tuple of arrays for several outputs): the result
            is computed now, on local threads, each chunk written straight into its region of
            ``out`` (no concatenation copy), and ``out`` is returned.
        ``reduce``
            Reductions over all elements of the outputs, computed in the same kernel pass (no
            second read of the outputs): ``"sum"``, ``"mean"``, ``"min"`` or ``"max"`` for
            every output, or one entry per output (``None``, a name, or a tuple of names). They
            follow the outputs in the result, in order: 0-d Dask arrays (a tree of the
            blocks' partials), 0-d CuPy arrays or NumPy scalars, with NumPy's dtypes (a
            ``float32`` sum is accumulated in ``float64``, then rounded).

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
    >>> third_of_product(a, np.array([3, -9, 5, 4], np.int8), device="cpu")
    array([14, 16, 27, 25], dtype=int8)

    Several outputs in one pass, and a reduction of one of them fused into it:

    >>> @elementwise
    ... def divide_with_rest(a, b):
    ...     return a // b, a % b
    >>> q, r, q_max = divide_with_rest(da.arange(7, chunks=3), 3, reduce=("max", None),
    ...                                device="cpu")
    >>> q.compute(), r.compute(), q_max.compute()
    (array([0, 0, 0, 1, 1, 1, 2]), array([0, 1, 2, 0, 1, 2, 0]), np.int64(2))
    """
    if func is None:
        return functools.partial(elementwise, dtype=dtype, name=name, cache=cache, rules=rules,
                                 fma=fma)
    return ElementwiseOp(func, dtype=dtype, name=name, cache=cache, rules=rules, fma=fma)


def _multiply(a: Any, b: Any) -> Any:
    return a * b


#: ``multiply(x, y, *, device="auto", out=None)``: the elementwise product with NumPy's
#: broadcasting, type promotion and values, for every real and complex dtype; see
#: :func:`elementwise`.
multiply = ElementwiseOp(_multiply, name="multiply", cache=True)


multiply.__doc__ = """Elementwise product ``x * y`` of Dask, NumPy or CuPy arrays or numbers.

NumPy's broadcasting, type promotion and values (``int8 * uint64`` is ``float64``, Python numbers
are weak); chunks run on the GPU or the CPU as ``device`` says (see :func:`elementwise`).
Returns a Dask array for Dask operands, the product computed at once for NumPy / CuPy arrays and
numbers only, or ``out`` filled when ``out=`` is given.

Examples
--------
>>> import dask.array as da
>>> x = da.from_array(np.arange(6).reshape(2, 3), chunks=(1, 2))
>>> multiply(x, da.from_array(np.array([1, 10, 100]), chunks=2), device="cpu").compute()
array([[  0,  10, 200],
       [  3,  40, 500]])
"""
