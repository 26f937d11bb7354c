"""Per-chunk kernels for elementwise functions: a numba CUDA kernel, its CPU twin, a NumPy reference.

A user's scalar function ``f(a, b, ...)`` becomes, per number of arguments and dimensionality,
a generated kernel ``kernel(out, a0, a1, ...)`` that writes ``out[idx] = f(a0[idx], a1[idx], ...)``
for every index of ``out``. With ``rules="numpy"`` (the default) ``f`` is the user's function
translated for the chunk's dtypes so that it computes NumPy's values
(:mod:`~dask_gpuchunk._kernels.translate`); with ``rules="numba"`` it is the user's function as
numba types it. Inputs arrive already broadcast to ``out``'s shape (views with zero
strides where an input is broadcast) and with their dimensions collapsed as far as their strides
allow (:func:`collapse_dims`), so the common cases run as one flat loop.

Kernels are compiled lazily, once per (dimensionality, layout, input dtypes, output dtype), with
an explicit signature: a C-contiguous variant where every array is contiguous (the fast path) and
an any-stride variant otherwise. No dask here.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .launch import DirectLaunch, StridedArg, current_device, load_lock
from .numpy_rules import VType, weak_type
from .source_cache import cached_njit, function_stamp, load_kernel, numba_cache_here
from .translate import Sources, Translation, capture_sources, translate
from .user_functions import for_target

__all__ = [
    "REDUCTIONS",
    "RULES",
    "SUPPORTED_DTYPES",
    "ElementwiseKernels",
    "ElementwisePlan",
    "arg_type",
    "check_dtype",
    "collapse_dims",
    "is_python_number",
    "is_scalar",
    "kernels_for",
    "numba_result_dtype",
    "partial_count",
    "partial_dtype",
    "reduced_dtype",
    "reduction_start",
    "reference",
]

#: How an elementwise function's arithmetic is compiled: "numpy" (NumPy's types and values,
#: through :func:`~dask_gpuchunk._kernels.translate.translate`) or "numba" (numba's own).
RULES = ("numpy", "numba")

#: The dtypes elementwise operations accept and produce.
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(name)
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float32", "float64", "complex64", "complex128",
    )
)


def check_dtype(dtype: Any, what: str) -> np.dtype:
    """Return ``np.dtype(dtype)`` if elementwise kernels support it, else raise ``TypeError``.

    Examples
    --------
    >>> check_dtype("f8", "x")
    dtype('float64')
    >>> check_dtype("float16", "x")
    Traceback (most recent call last):
    ...
    TypeError: x has dtype float16, which elementwise kernels do not support (numba's CPU target has no float16 type); cast first, e.g. x.astype('float32')
    """
    dt = np.dtype(dtype)
    if dt.isnative and dt in SUPPORTED_DTYPES:
        return dt
    if dt.newbyteorder("=") in SUPPORTED_DTYPES and not dt.isnative:
        raise TypeError(
            f"{what} has non-native byte order ({dt.str}); convert it first, "
            f"e.g. x.astype({dt.newbyteorder('=').name!r})"
        )
    if dt == np.float16:
        raise TypeError(
            f"{what} has dtype float16, which elementwise kernels do not support (numba's CPU "
            "target has no float16 type); cast first, e.g. x.astype('float32')")
    names = ", ".join(d.name for d in SUPPORTED_DTYPES)
    raise TypeError(
        f"{what} has dtype {dt}, which elementwise kernels do not support; supported: {names} "
        "(cast first, e.g. x.astype('float32'))"
    )


def is_python_number(x: Any) -> bool:
    """A Python ``bool``, ``int``, ``float`` or ``complex`` (a "weak" scalar, NEP 50)."""
    return type(x) in (bool, int, float, complex)


def is_scalar(x: Any) -> bool:
    """A value passed to kernels by value: a NumPy scalar or a Python number."""
    return isinstance(x, np.generic) or is_python_number(x)


def arg_type(x: Any, index: int | None = None) -> VType:
    """The translation type of a kernel argument: a Python number is weak (``index`` marks it
    as that argument, whose value the call checks), anything else its dtype.

    Examples
    --------
    >>> t = arg_type(0.5, 1)
    >>> t.dtype, t.weak, t.call
    (dtype('float64'), True, 'args[1]')
    >>> arg_type(np.ones(3, np.float32)).weak
    False
    """
    if is_python_number(x):
        return weak_type(x, index)
    return VType(np.dtype(x.dtype))


#: Reductions an elementwise operation fuses into its kernel pass, over all elements.
REDUCTIONS = ("sum", "mean", "min", "max")


@functools.lru_cache(maxsize=None)
def _reduced(op: str, dtype: np.dtype) -> np.dtype:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.dtype(getattr(np.zeros(1, dtype), op)().dtype)


def reduced_dtype(op: str, dtype: Any) -> np.dtype:
    """NumPy's dtype for ``op`` of an array of ``dtype`` (``x.sum()``, ``x.mean()``, ...).

    Examples
    --------
    >>> reduced_dtype("sum", "int8"), reduced_dtype("mean", "int8"), reduced_dtype("max", "u2")
    (dtype('int64'), dtype('float64'), dtype('uint16'))
    """
    dtype = np.dtype(dtype)
    if op not in REDUCTIONS:
        raise ValueError(f"unknown reduction {op!r}; one of {REDUCTIONS}")
    if op in ("min", "max"):
        if dtype.kind == "c":
            raise TypeError(f"{op} of complex values is not fused (NumPy orders them "
                            "lexicographically); reduce .real or abs() of them instead")
        return dtype
    return _reduced(op, dtype)  # cached: it runs on every call of a loop


def partial_dtype(op: str, dtype: Any) -> np.dtype:
    """What a kernel accumulates ``op`` of ``dtype`` values in: sums of integers in 64 bits (as
    NumPy, wrapping alike), of floats in ``float64`` / ``complex128`` (closer to the exact sum
    than NumPy's pairwise float32 sum; the result is rounded to NumPy's dtype at the end);
    ``min`` / ``max`` in the dtype itself. ``mean`` is a sum, divided at the end.

    Examples
    --------
    >>> partial_dtype("mean", "complex64"), partial_dtype("sum", "bool"), partial_dtype("min", "f4")
    (dtype('complex128'), dtype('int64'), dtype('float32'))
    """
    dtype = np.dtype(dtype)
    result = reduced_dtype(op, dtype)
    if op in ("min", "max"):
        return result
    if dtype.kind in "biu":
        return np.dtype(np.uint64 if dtype.kind == "u" else np.int64)
    return np.dtype(np.complex128 if dtype.kind == "c" else np.float64)


class ElementwisePlan(NamedTuple):
    """What one kernel pass of an elementwise function produces.

    ``out_dtypes``: one dtype per output; ``tupled``: the function returns a tuple (NumPy's
    ``nout``; else one number); ``reductions``: ``(output index, op)`` pairs, each reduced over
    all elements of that output in the same pass (``op`` in :data:`REDUCTIONS`).

    Examples
    --------
    >>> ElementwisePlan.single("f4")
    ElementwisePlan(out_dtypes=(dtype('float32'),), tupled=False, reductions=())
    """

    out_dtypes: tuple[np.dtype, ...]
    tupled: bool = False
    reductions: tuple[tuple[int, str], ...] = ()

    @classmethod
    def single(cls, dtype: Any) -> ElementwisePlan:
        """One output, no reduction: what ``f`` returning one number makes."""
        return cls((np.dtype(dtype),))

    @property
    def plain(self) -> bool:
        """Whether this is :meth:`single`'s plan: one output, returned as one array."""
        return not self.tupled and not self.reductions and len(self.out_dtypes) == 1

    def partial_dtypes(self) -> tuple[np.dtype, ...]:
        """Each reduction's accumulator dtype (:func:`partial_dtype`)."""
        return _plan_dtypes(self)[0]

    def reduced_dtypes(self) -> tuple[np.dtype, ...]:
        """Each reduction's result dtype, NumPy's (:func:`reduced_dtype`)."""
        return _plan_dtypes(self)[1]


@functools.lru_cache(maxsize=1024)
def _plan_dtypes(plan: ElementwisePlan) -> tuple[tuple[np.dtype, ...], tuple[np.dtype, ...]]:
    """A plan's partial and reduced dtypes, once per plan (a loop asks every call)."""
    return (tuple(partial_dtype(op, plan.out_dtypes[k]) for k, op in plan.reductions),
            tuple(reduced_dtype(op, plan.out_dtypes[k]) for k, op in plan.reductions))


def numba_result_dtype(func: Callable, dtypes: Sequence[np.dtype],
                       cache: bool = False) -> np.dtype | tuple[np.dtype, ...]:
    """Compile ``func`` for the CPU at these argument dtypes and return numba's result dtype
    (``rules="numba"``), a tuple of them where ``func`` returns a tuple.

    Examples
    --------
    >>> numba_result_dtype(lambda a, b: a * b, [np.dtype("int8"), np.dtype("int8")])
    dtype('int64')
    """
    import numba
    from numba.np.numpy_support import as_dtype

    dispatcher = cached_njit(func) if cache else numba.njit(func)  # cached_njit: in the cache dir
    args = tuple(numba.from_dtype(dt) for dt in dtypes)
    try:
        dispatcher.compile(args)
    except Exception as exc:
        first = str(exc).strip().splitlines()
        detail = "\n".join(first[:12])
        sig = ", ".join(dt.name for dt in dtypes)
        raise TypeError(
            f"numba cannot compile {getattr(func, '__name__', func)!r} for arguments ({sig}); "
            f"elementwise functions must be scalar functions numba can compile in nopython mode. "
            f"numba said:\n{detail}"
        ) from None
    ret = dispatcher.nopython_signatures[-1].return_type
    name = getattr(func, "__name__", func)
    several = isinstance(ret, numba.types.BaseTuple)
    try:
        found = [np.dtype(as_dtype(t)) for t in (ret.types if several else (ret,))]
    except Exception:
        raise TypeError(f"{name!r} returns {ret}, not a number or a tuple of numbers") from None
    found = [check_dtype(d, f"the result of {name!r}") for d in found]
    return tuple(found) if several else found[0]


def collapse_dims(
    shape: Sequence[int], strides: Sequence[Sequence[int]]
) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Drop length-1 dimensions and merge neighbours that every array walks contiguously.

    ``strides`` holds one stride tuple (in bytes or elements, consistently) per array, all
    arrays having ``shape``. Dimension ``d`` merges into ``d + 1`` when, for every array,
    ``strides[d] == strides[d + 1] * shape[d + 1]`` (broadcast dimensions, stride 0, merge
    with each other). The result has at least one dimension.

    Examples
    --------
    >>> collapse_dims((100, 4000, 5), [(160000, 40, 8), (0, 40, 8)])
    ((100, 20000), [(160000, 8), (0, 8)])
    >>> collapse_dims((1, 7), [(56, 8)])
    ((7,), [(8,)])
    """
    keep = [d for d, n in enumerate(shape) if n != 1]
    if not keep:
        return (1,), [(0,) for _ in strides]
    new_shape = [shape[keep[0]]]
    new_strides = [[s[keep[0]]] for s in strides]
    for d in keep[1:]:
        n = shape[d]
        if all(st[-1] == s[d] * n for st, s in zip(new_strides, strides)):
            new_shape[-1] *= n
            for st, s in zip(new_strides, strides):
                st[-1] = s[d]
        else:
            new_shape.append(n)
            for st, s in zip(new_strides, strides):
                st.append(s[d])
    return tuple(new_shape), [tuple(st) for st in new_strides]


def reference(func: Callable, dtype: Any, *args: Any) -> np.ndarray:
    """Plain NumPy/Python evaluation of ``func`` element by element: the tests' reference.

    Each element is passed as a NumPy scalar (integer arithmetic wraps as NumPy's does), each
    Python number as it is (weak, as NumPy treats it).

    Examples
    --------
    >>> reference(lambda a, b: a * b, "int8", np.array([100, 2], "int8"), np.int8(3))
    array([44,  6], dtype=int8)
    >>> reference(lambda x, k: x * k, "float32", np.array([0.5], "float32"), 0.1)
    array([0.05], dtype=float32)
    """
    arrays = np.broadcast_arrays(*[np.asarray(a) for a in args])
    out = np.empty(arrays[0].shape if arrays else (), dtype=dtype)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for idx in np.ndindex(out.shape):
            out[idx] = func(*(a if is_python_number(a) else b[idx] for a, b in zip(args, arrays)))
    return out


# --------------------------------------------------------------------------------------------
# Code generation. The kernels are generated as source text because numba compiles neither
# *args nor loops over a variable number of dimensions; one source per (nargs, ndim).


def _args(scalars: Sequence[bool], idx: str) -> tuple[str, str]:
    """Parameter list and call arguments: arrays are indexed, scalars passed as they are."""
    params = ", ".join(f"a{k}" for k in range(len(scalars)))
    call = ", ".join(f"a{k}" if scalar else f"a{k}[{idx}]" for k, scalar in enumerate(scalars))
    return params, call


class _Pass(NamedTuple):
    """What a generated kernel's signature and body depend on beyond its inputs: the number of
    outputs, whether ``f`` returns a tuple, each reduction as ``(output, op, partial dtype)``
    (``op``: sum, min or max; a mean is a sum) and, for CUDA, the dtype each reduction's total
    is written in (the pass's last block combines the blocks' partials into it)."""

    nout: int = 1
    tupled: bool = False
    reductions: tuple[tuple[int, str, np.dtype], ...] = ()
    totals: tuple[np.dtype, ...] = ()

    def params(self) -> str:
        outs = [f"o{k}" for k in range(self.nout)]
        partials = [f"p{r}" for r in range(len(self.reductions))]
        totals = [f"t{r}" for r in range(len(self.totals))] + (["cnt"] if self.totals else [])
        return ", ".join([*outs, *partials, *totals])

    def element(self, call: str, idx: str) -> list[str]:
        """One element: ``f`` called, each output stored, each reduction accumulated."""
        if not self.tupled:
            if not self.reductions:
                return [f"o0[{idx}] = f({call})"]
            lines = [f"r0 = f({call})", f"o0[{idx}] = r0"]
            values = ["r0"]
        else:
            lines = [f"r = f({call})"]
            lines += [f"o{k}[{idx}] = r[{k}]" for k in range(self.nout)]
            values = [f"r[{k}]" for k in range(self.nout)]
        for r, (k, op, dtype) in enumerate(self.reductions):
            value = values[k] if op != "sum" else f"np.{dtype.name}({values[k]})"
            lines.append(f"acc{r} = {_combine(op, f'acc{r}', value, dtype)}")
        return lines

    def start(self) -> list[str]:
        return [f"acc{r} = {_identity_name(op, dtype)}"
                for r, (_, op, dtype) in enumerate(self.reductions)]


def _identity_name(op: str, dtype: np.dtype) -> str:
    return f"_identity_{op}_{dtype.str[1:]}"


def reduction_start(op: str, dtype: np.dtype) -> Any:
    """What a reduction of no elements is, as a value of its partial dtype: 0 for a sum (or
    mean); for a min / max, the value every element replaces (NaN-propagating float ones start
    from infinities, integer ones from the dtype's bounds).

    Examples
    --------
    >>> reduction_start("min", np.dtype("int8")), reduction_start("max", np.dtype("f4"))
    (np.int8(127), np.float32(-inf))
    """
    if op in ("sum", "mean"):
        return dtype.type(0)
    if dtype.kind == "b":
        return np.bool_(op == "min")
    if dtype.kind == "f":
        return dtype.type(np.inf if op == "min" else -np.inf)
    info = np.iinfo(dtype)
    return dtype.type(info.max if op == "min" else info.min)


def _identities(reductions: Sequence[tuple[int, str, np.dtype]]) -> dict[str, Any]:
    """The start value of each reduction (:func:`reduction_start`), by :func:`_identity_name`."""
    return {_identity_name(op, dtype): reduction_start(op, dtype) for _, op, dtype in reductions}


def _combine(op: str, acc: str, value: str, dtype: np.dtype) -> str:
    """``acc`` combined with ``value``: a sum, or a min / max that propagates NaN as NumPy's."""
    if op == "sum":
        return f"{acc} + {value}"
    cmp = "<" if op == "min" else ">"
    if dtype.kind == "f":
        return f"({value} if ({value} {cmp} {acc} or {value} != {value}) else {acc})"
    return f"({value} if {value} {cmp} {acc} else {acc})"


def _cpu_source(scalars: Sequence[bool], ndim: int, spec: _Pass = _Pass()) -> str:
    outs = spec.params()
    if ndim == 1 and not spec.reductions:
        params, call = _args(scalars, "i")
        return "\n".join([
            f"def kernel({outs}, {params}):",
            "    for i in prange(o0.shape[0]):",
            *("        " + line for line in spec.element(call, "i")),
        ]) + "\n"
    # Blocks of the flat range, one per parallel iteration; each block unravels its start once,
    # then walks runs along the last axis (no division per element) and carries into the outer
    # axes at the end of each run. Reductions: one partial per block (their arrays' length).
    last = ndim - 1
    idx = ", ".join([f"i{d}" for d in range(last)] + ["j"])
    params, call = _args(scalars, idx)
    blocks = "p0.shape[0]" if spec.reductions else "min(n, 1024)"
    lines = [
        f"def kernel({outs}, {params}):",
        "    n = o0.size",
        f"    nblocks = {blocks}",
        "    for b in prange(nblocks):",
        "        start = b * n // nblocks",
        "        stop = (b + 1) * n // nblocks",
        *("        " + line for line in spec.start()),
        "        r = start",
    ]
    for d in range(last, 0, -1):
        lines.append(f"        i{d} = r % o0.shape[{d}]")
        lines.append(f"        r = r // o0.shape[{d}]")
    lines += [
        "        i0 = r",
        "        pos = start",
        "        while pos < stop:",
        f"            run = min(stop - pos, o0.shape[{last}] - i{last})",
        f"            for j in range(i{last}, i{last} + run):",
        *("                " + line for line in spec.element(call, idx)),
        "            pos += run",
        f"            i{last} += run",
    ]
    indent = "            "
    for d in range(last, 0, -1):
        lines.append(f"{indent}if i{d} == o0.shape[{d}]:")
        lines.append(f"{indent}    i{d} = 0")
        lines.append(f"{indent}    i{d - 1} += 1")
        indent += "    "
    lines += [f"        p{r}[b] = acc{r}" for r in range(len(spec.reductions))]
    return "\n".join(lines) + "\n"


def _block_combine(spec: _Pass, threads: int) -> list[str]:
    """Each thread's ``acc{r}`` combined over the block in shared memory (a tree), the block's
    value left in ``s{r}[0]``: at the kernel's indentation, every thread of the block taking
    part."""
    lines = []
    for r, (_, _, dtype) in enumerate(spec.reductions):
        lines.append(f"s{r}[t] = acc{r}")
    lines += ["cuda.syncthreads()", f"w = {threads // 2}", "while w > 0:", "    if t < w:"]
    for r, (_, op, dtype) in enumerate(spec.reductions):
        lines.append(f"        s{r}[t] = {_combine(op, f's{r}[t]', f's{r}[t + w]', dtype)}")
    lines += ["    cuda.syncthreads()", "    w //= 2"]
    return lines


def _cuda_source(scalars: Sequence[bool], ndim: int, spec: _Pass = _Pass(),
                 threads: int = 128) -> str:
    """One element per thread (:func:`_launch_config` covers the outputs with the grid), then a
    grid-stride loop for what a smaller grid leaves (numba's simulator runs tiny grids).

    Measured on an H200 (4 GB float64 product, the perf notes (git show 85dc246:docs/perf-notes.md)): one element per thread in
    blocks of 128 ran in 2.73 ms, as CuPy's own multiply (2.75) and the same kernel in CUDA C
    (2.71); every grid-stride launch shape took 2.86-3.06 ms in numba, 2.79-2.98 in CUDA C.

    Reductions (:func:`_grid`: a few times as many blocks as the GPU holds at once, each
    thread looping over its share): each thread accumulates its elements, each block combines its
    ``threads`` values in shared memory and writes one partial per reduction
    (``p[blockIdx.x]``); the last block to finish (a ticket from ``cnt[0]``, taken after a
    memory fence) combines the partials into ``t[0]`` in the total's dtype and sets ``cnt[0]``
    back to 0 for the next launch on the stream. Measured on an H200 (perf note 23): one
    element per thread with one partial per 128 elements, summed by CuPy after the kernel,
    made seed 002's pass 1.5 x slower than without its sum.
    """
    idx = ", ".join(f"i{d}" for d in range(ndim)) if ndim > 1 else "i"
    params, call = _args(scalars, idx)
    unravel = []
    if ndim > 1:
        unravel.append("r = i")
        for d in range(ndim - 1, 0, -1):
            unravel.append(f"q = r // o0.shape[{d}]")
            unravel.append(f"i{d} = r - q * o0.shape[{d}]")
            unravel.append("r = q")
        unravel.append("i0 = r")
    body = [*unravel, *spec.element(call, idx)]
    lines = [
        f"def kernel({spec.params()}, {params}):",
        "    n = o0.size",
        *("    " + line for line in spec.start()),
        "    i = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x",
        "    step = int64(cuda.gridDim.x) * cuda.blockDim.x",
    ]
    if not spec.reductions:
        lines += [
            "    if i < n:",
            *("        " + line for line in body),
            "    i += step",
        ]
    lines += [
        "    while i < n:",
        *("        " + line for line in body),
        "        i += step",
    ]
    if not spec.reductions:
        return "\n".join(lines) + "\n"
    lines.append("    t = cuda.threadIdx.x")
    for r, (_, _, dtype) in enumerate(spec.reductions):
        lines.append(f"    s{r} = cuda.shared.array({threads}, _numba_{dtype.str[1:]})")
    lines.append("    last = cuda.shared.array(1, int32)")
    lines += ["    " + line for line in _block_combine(spec, threads)]
    lines.append("    if t == 0:")
    lines += [f"        p{r}[cuda.blockIdx.x] = s{r}[0]" for r in range(len(spec.reductions))]
    lines += [
        "        cuda.threadfence()",  # the partials are seen before the ticket is
        "        last[0] = cuda.atomic.add(cnt, 0, 1) == cuda.gridDim.x - 1",
        "    cuda.syncthreads()",
        "    if last[0]:",  # one value for the whole block: syncthreads inside is safe
        *("        " + line for line in spec.start()),
        "        j = t",
        "        while j < cuda.gridDim.x:",
    ]
    for r, (_, op, dtype) in enumerate(spec.reductions):
        lines.append(f"            acc{r} = {_combine(op, f'acc{r}', f'p{r}[j]', dtype)}")
    lines.append("            j += cuda.blockDim.x")
    lines += ["        " + line for line in _block_combine(spec, threads)]
    lines.append("        if t == 0:")
    lines += [f"            t{r}[0] = np.{dt.name}(s{r}[0])" for r, dt in enumerate(spec.totals)]
    lines.append("            cnt[0] = 0")
    return "\n".join(lines) + "\n"


def _generate(source: str, namespace: dict[str, Any], file_key: str | None = None) -> Callable:
    """The function ``kernel`` defined by ``source``, with ``namespace`` as its globals.

    With ``file_key``, the source lives in a file of the kernel cache
    (:func:`dask_gpuchunk._kernels.source_cache.load_kernel`), where numba can keep what it
    compiles from it; where that directory cannot be written, as without.
    """
    kernel = load_kernel(source, namespace, file_key) if file_key is not None else None
    if kernel is None:
        code = compile(source, "<dask_gpuchunk elementwise kernel>", "exec")
        exec(code, namespace)  # noqa: S102 - source generated above from integers only
        kernel = namespace["kernel"]
    return kernel


def _in_a_file(kernel: Callable) -> bool:
    """Whether a generated kernel came from a file of the kernel cache (:func:`_generate` with
    a ``file_key`` and a writable cache), where numba can cache what it compiles."""
    return os.path.isfile(kernel.__code__.co_filename)


def _signature_key(outs: Sequence[Any], inputs: Sequence[Any],
                   plan: ElementwisePlan | None = None, totals: Sequence[Any] = ()) -> tuple:
    """(ndim, layout, ((dtype, is_scalar, is_python_number), ...), out dtypes, the pass's
    :class:`_Pass`): one compiled kernel per key. A Python number's dtype is the one holding it
    (float64 for a float). ``totals``: the arrays a CUDA pass writes each reduction's total
    into (their dtypes are part of the key)."""
    arrays = [*outs, *(a for a in inputs if not is_scalar(a))]
    contiguous = all(a.flags["C_CONTIGUOUS"] for a in arrays)
    args = tuple((weak_type(a).dtype, True, True) if is_python_number(a)
                 else (np.dtype(a.dtype), is_scalar(a), False) for a in inputs)
    out_dtypes = tuple(np.dtype(o.dtype) for o in outs)
    if plan is None:
        spec = _Pass()
    else:
        spec = _Pass(len(outs), plan.tupled,
                     tuple((k, "sum" if op == "mean" else op, dt)
                           for (k, op), dt in zip(plan.reductions, plan.partial_dtypes())),
                     tuple(np.dtype(t.dtype) for t in totals))
    return (outs[0].ndim, "C" if contiguous else "A", args, out_dtypes, spec)


def _numba_signature(key: tuple, readonly_inputs: bool) -> Any:
    import numba
    from numba import types

    ndim, layout, args, out_dtypes, spec = key
    params = [types.Array(numba.from_dtype(dt), ndim, layout) for dt in out_dtypes]
    params += [types.Array(numba.from_dtype(dt), 1, "C") for _, _, dt in spec.reductions]
    params += [types.Array(numba.from_dtype(dt), 1, "C") for dt in spec.totals]
    if spec.totals:
        params.append(types.Array(types.uint32, 1, "C"))  # the blocks' ticket counter
    for dtype, scalar, _ in args:
        if scalar:
            params.append(numba.from_dtype(dtype))
        else:
            params.append(types.Array(numba.from_dtype(dtype), ndim, layout, readonly=readonly_inputs))
    return types.void(*params)


def _pass_namespace(spec: _Pass) -> dict[str, Any]:
    """What a kernel of this pass needs beside ``f``: NumPy (sums convert with ``np.int64(x)``
    ...), its reductions' start values and the numba types of their shared arrays."""
    import numba

    found: dict[str, Any] = {"np": np, "int32": numba.int32, **_identities(spec.reductions)}
    for _, _, dtype in spec.reductions:
        found[f"_numba_{dtype.str[1:]}"] = numba.from_dtype(dtype)
    return found


class ElementwiseKernels:
    """The compiled kernels of one scalar function, built on first use and cached.

    Parameters
    ----------
    func
        A scalar function of ``nargs`` arguments.
    nargs
        Its number of arguments.
    token
        What identifies the function (:func:`kernels_for`'s key).
    cache
        Keep compiled kernels on disk (see :func:`~dask_gpuchunk._kernels.source_cache.load_kernel`).
    rules
        ``"numpy"``: the function is translated per dtype signature to compute NumPy's values;
        ``"numba"``: compiled as numba types it.
    fma
        With ``rules="numpy"``, let the CUDA kernels fuse floating-point products with
        additions (:data:`~dask_gpuchunk._kernels.numpy_ops.CUDA_TARGETS`); the CPU twin is
        unchanged.

    Examples
    --------
    >>> k = ElementwiseKernels(lambda a, b: a * b, 2)
    >>> out = np.empty(4)
    >>> k.cpu(out, np.arange(4.0), np.full(4, 2.0))
    >>> out
    array([0., 2., 4., 6.])
    """

    def __init__(self, func: Callable, nargs: int, token: str | None = None,
                 cache: bool = False, rules: str = "numpy", fma: bool = False,
                 sources: Sources | None = None) -> None:
        if rules not in RULES:
            raise ValueError(f"rules must be one of {RULES}, got {rules!r}")
        self.func = func
        #: The source files the translation reads, taken where the function was defined and
        #: carried with it to every worker (:func:`~dask_gpuchunk._kernels.translate.capture_sources`);
        #: taken when the kernels are first pickled (``None`` until then).
        self.sources = dict(sources) if sources is not None else None
        self.nargs = nargs
        self.rules = rules
        self.fma = bool(fma)
        self.token = token if token is not None else f"{id(func):x}-{nargs}-{rules}"
        #: numba's compiled code kept on disk (``source_cache.cache_dir()``), found again by later
        #: processes, where ``cache`` was asked for and ``func`` is defined in a file.
        self.stamp = function_stamp(func) if cache else None
        self._lock = threading.Lock()
        self._cpu: dict[tuple, Callable] = {}
        self._cuda: dict[tuple, Callable] = {}
        self._translations: dict[tuple, Translation] = {}
        self._translations_lock = threading.Lock()  # apart: taken inside self._lock too
        self._numba_dtypes: dict[tuple, np.dtype] = {}
        self._cpu_scalar: Callable | None = None
        self._cuda_device: Callable | None = None
        self._direct: dict[tuple, DirectLaunch] = {}

    def __dask_tokenize__(self) -> tuple:
        # Graph names follow the function (by its token), not this object's compiled state.
        return ("ElementwiseKernels", self.token, self.nargs, self.rules, self.fma)

    def __reduce__(self) -> tuple:
        # Compiled kernels stay in the process that built them. A worker unpickles every task
        # afresh, so it looks the kernels up by token and compiles each signature only once.
        if self.sources is None:  # read once, and only for a process that is sent them
            self.sources = capture_sources(self.func) if self.rules == "numpy" else {}
        return (kernels_for, (self.func, self.nargs, self.token, self.stamp is not None,
                              self.rules, self.fma, self.sources))

    # ---- types -----------------------------------------------------------------------------
    def translation(self, argtypes: Sequence[VType], out_dtype: Any = None) -> Translation:
        """The function translated for these argument types (``rules="numpy"``), cached."""
        if out_dtype is not None:
            out_dtype = (tuple(np.dtype(d) for d in out_dtype) if isinstance(out_dtype, tuple)
                         else np.dtype(out_dtype))
        key = (tuple((vt.dtype, vt.weak, vt.call) for vt in argtypes), out_dtype)
        found = self._translations.get(key)
        if found is None:
            found = translate(self.func, argtypes, key[1], self.sources)
            with self._translations_lock:
                found = self._translations.setdefault(key, found)
        return found

    def result_dtype(self, argtypes: Sequence[VType]) -> np.dtype:
        """The result dtype for arguments of these types, by the function's rules (the first
        output's, where the function returns a tuple)."""
        return self.outputs(argtypes)[0][0]

    def outputs(self, argtypes: Sequence[VType]) -> tuple[tuple[np.dtype, ...], bool]:
        """The dtype of each output for arguments of these types, by the function's rules, and
        whether the function returns a tuple (then one output per value)."""
        if self.rules == "numpy":
            t = self.translation(argtypes)
            name = getattr(self.func, "__name__", "f")
            return (tuple(check_dtype(d, f"the result of {name!r}") for d in t.result_dtypes),
                    t.nout is not None)
        dtypes = tuple(vt.dtype for vt in argtypes)
        found = self._numba_dtypes.get(dtypes)
        if found is None:
            found = self._numba_dtypes[dtypes] = numba_result_dtype(
                _for_target(self.func, "cpu"), dtypes, cache=self.stamp is not None)
        return (found, True) if isinstance(found, tuple) else ((found,), False)

    def _compile_source(self, key: tuple, kernel_source: str, namespace: dict[str, Any],
                        jit: Callable[[Callable, bool], Any], target: str,
                        cache: bool) -> Callable:
        """The generated ``kernel`` of ``kernel_source`` with its ``f`` for ``key`` (each
        translated function made by ``jit(function, in_a_file)``), in a file of the kernel
        cache where ``cache``."""
        _, _, args, out_dtypes, spec = key
        if self.rules == "numpy":
            argtypes = [VType(dt, weak=weak, call=f"args[{i}]" if weak else None)
                        for i, (dt, _, weak) in enumerate(args)]
            t = self.translation(argtypes, out_dtypes if spec.tupled else out_dtypes[0])
            source = f"{t.source}\n{kernel_source}"
            functions = t.functions
        else:
            source, functions = kernel_source, ()
        file_key = f"{target} {self.rules} {self.stamp}" if cache else None
        pyfunc = _generate(source, namespace, file_key)
        cached = _in_a_file(pyfunc)
        scope = pyfunc.__globals__
        # A cached source is one module per process: another key of the same source (another
        # layout) finds its functions compiled already.
        done = scope.setdefault("_dask_gpuchunk_compiled", set())
        for name in functions:
            if name not in done:
                scope[name] = jit(scope[name], cached)
                done.add(name)
        return pyfunc

    # ---- CPU -----------------------------------------------------------------------------
    def _cpu_kernel(self, key: tuple) -> Callable:
        kernel = self._cpu.get(key)
        if kernel is not None:
            return kernel
        with self._lock, numba_cache_here():
            kernel = self._cpu.get(key)
            if kernel is None:
                import numba

                from .numpy_ops import namespace

                ndim, _, args, _, spec = key
                source = _cpu_source([scalar for _, scalar, _ in args], ndim, spec)
                if self.rules == "numpy":
                    scope = {**namespace("cpu"), "prange": numba.prange}
                else:
                    if self._cpu_scalar is None:
                        self._cpu_scalar = numba.njit(_for_target(self.func, "cpu"),
                                                      cache=self.stamp is not None)
                    scope = {"f": self._cpu_scalar, "prange": numba.prange}
                scope.update(_pass_namespace(spec))
                pyfunc = self._compile_source(
                    key, source, scope,
                    lambda f, cached: numba.njit(f, error_model="numpy", cache=cached), "cpu",
                    self.stamp is not None)
                sig = _numba_signature(key, readonly_inputs=True)
                kernel = numba.njit(sig, parallel=True, nogil=True, error_model="numpy",
                                    cache=_in_a_file(pyfunc))(pyfunc)
                self._cpu[key] = kernel
        return kernel

    def cpu(self, out: np.ndarray, *inputs: Any) -> None:
        """Run the CPU twin (``numba.njit(parallel=True)``): ``out[...] = f(*inputs)``.

        Each input is an array of ``out``'s shape (broadcast views are fine), a NumPy scalar or
        a Python number, passed to the kernel by value.
        """
        self._cpu_kernel(_signature_key((out,), inputs))(out, *inputs)

    def cpu_pass(self, plan: ElementwisePlan | None, outs: Sequence[np.ndarray],
                 partials: Sequence[np.ndarray], *inputs: Any) -> None:
        """As :meth:`cpu` for a :class:`ElementwisePlan`: every output of ``outs`` (one
        shape), and each reduction's partials (one per block of the loop: length
        :func:`partial_count` ``(n, "cpu")``)."""
        self._cpu_kernel(_signature_key(outs, inputs, plan))(*outs, *partials, *inputs)

    # ---- CUDA ----------------------------------------------------------------------------
    def _cuda_kernel(self, key: tuple) -> Callable:
        kernel = self._cuda.get(key)
        if kernel is not None:
            return kernel
        with self._lock, numba_cache_here():
            kernel = self._cuda.get(key)
            if kernel is None:
                import numba
                from numba import cuda
                from numba.cuda import config as cuda_config

                from .numpy_ops import namespace

                ndim, _, args, _, spec = key
                threads = (_reduction_config(1) if spec.reductions else _launch_config(1))[0]
                source = _cuda_source([scalar for _, scalar, _ in args], ndim, spec, threads)
                target = ("sim" if cuda_config.ENABLE_CUDASIM
                          else "cuda-fma" if self.fma else "cuda")
                if self.rules == "numpy":
                    scope = {**namespace(target), "cuda": cuda, "int64": numba.int64}
                else:
                    if self._cuda_device is None:
                        self._cuda_device = cuda.jit(device=True)(_for_target(self.func,
                                                                              "cuda"))
                    scope = {"f": self._cuda_device, "cuda": cuda, "int64": numba.int64}
                scope.update(_pass_namespace(spec))
                pyfunc = self._compile_source(
                    key, source, scope, lambda f, cached: cuda.jit(device=True)(f), target,
                    self.stamp is not None and not cuda_config.ENABLE_CUDASIM)
                kernel = cuda.jit(_numba_signature(key, readonly_inputs=False),
                                  cache=_in_a_file(pyfunc))(pyfunc)
                self._cuda[key] = kernel
        return kernel

    def cuda(self, out: Any, *inputs: Any, stream: Any = 0) -> None:
        """Launch the CUDA kernel on numba device arrays: ``out[...] = f(*inputs)``.

        Each input is a device array of ``out``'s shape (zero-stride broadcast views are fine),
        a NumPy scalar or a Python number, passed by value; ``stream`` is a numba stream
        (``cuda.external_stream(ptr)`` for a CuPy stream). The launch is asynchronous.
        """
        self.cuda_pass(None, (out,), (), *inputs, stream=stream)

    def cuda_pass(self, plan: ElementwisePlan | None, outs: Sequence[Any],
                  reduction: Sequence[Any], *inputs: Any, stream: Any = 0) -> None:
        """As :meth:`cuda` for a :class:`ElementwisePlan` (``None``: one output): every output
        of ``outs`` (one shape), numba device arrays. ``reduction``: where the plan reduces,
        each reduction's partials (length :func:`partial_count` ``(n, "cuda")``), then each
        one's total (one element, of the dtype it is wanted in), then a one-element ``uint32``
        counter holding 0 (the kernel leaves it at 0); else empty."""
        key = _signature_key(outs, inputs, plan, _totals(plan, reduction))
        kernel = self._cuda_kernel(key)
        threads, blocks = _grid(key, outs[0].size, lambda t: _resident_blocks(kernel, t))
        kernel[blocks, threads, stream](*outs, *reduction, *inputs)

    def cuda_strided(self, out: StridedArg, *inputs: StridedArg | np.generic,
                     stream: Any) -> None:
        """Launch the CUDA kernel on arrays given by address: ``out[...] = f(*inputs)``.

        As :meth:`cuda`, but arrays are :class:`StridedArg` (all of one shape) and the launch
        goes straight to the compiled function (:class:`~dask_gpuchunk._kernels.launch.DirectLaunch`);
        ``stream`` is a numba stream. Only where ``launch.direct_launch_available()`` says so
        (not under the simulator).
        """
        self.cuda_strided_pass(None, (out,), (), *inputs, stream=stream)

    def cuda_strided_pass(self, plan: ElementwisePlan | None, outs: Sequence[StridedArg],
                          reduction: Sequence[StridedArg], *inputs: StridedArg | np.generic,
                          stream: Any) -> None:
        """:meth:`cuda_strided` for a :class:`ElementwisePlan` (``None``: one output, as
        :meth:`cuda_strided`), as :meth:`cuda_pass`."""
        launcher, blocks, threads = self.strided_launcher(plan, outs, reduction, inputs)
        launcher(blocks, threads, stream, (*outs, *reduction, *inputs))

    def strided_launcher(self, plan: ElementwisePlan | None, outs: Sequence[StridedArg],
                         reduction: Sequence[StridedArg],
                         inputs: Sequence[StridedArg | np.generic]
                         ) -> tuple[DirectLaunch, int, int]:
        """What :meth:`cuda_strided_pass` launches for arrays of these dtypes, shapes and
        layouts on this thread's device: the launcher, blocks and threads per block. A caller
        that launches the same kind of call again keeps it and calls it with new addresses."""
        key = _signature_key(outs, inputs, plan, _totals(plan, reduction))
        device = current_device()
        launcher = self._direct.get((key, device))
        if launcher is None:
            dispatcher = self._cuda_kernel(key)
            with load_lock:
                launcher = self._direct.get((key, device))
                if launcher is None:
                    launcher = self._direct[(key, device)] = DirectLaunch(dispatcher)
        threads, blocks = _grid(key, math.prod(outs[0].shape), launcher.resident_blocks)
        return launcher, blocks, threads


def _totals(plan: ElementwisePlan | None, reduction: Sequence[Any]) -> Sequence[Any]:
    """The totals of a pass's ``reduction`` arrays (partials, totals, counter)."""
    count = len(plan.reductions) if plan is not None else 0
    return reduction[count:2 * count]


def _resident_blocks(dispatcher: Any, threads: int) -> int:
    """How many blocks of ``threads`` of a numba kernel the current GPU holds at once."""
    (overload,) = dispatcher.overloads.values()
    return int(overload.max_cooperative_grid_blocks(threads))


def _grid(key: tuple, n: int, resident: Callable[[int], int]) -> tuple[int, int]:
    """Threads per block and blocks of a pass of ``key`` over ``n`` elements: one thread per
    element (:func:`_launch_config`); a pass with reductions :data:`REDUCTION_WAVES` times as
    many blocks as the GPU holds at once (``resident(threads)``), at most
    :func:`partial_count`."""
    if not key[-1].reductions:
        return _launch_config(n)
    threads, most = _reduction_config(n)
    from numba.cuda import config as cuda_config

    if not cuda_config.ENABLE_CUDASIM:
        most = min(most, REDUCTION_WAVES * resident(threads))
    return threads, max(1, most)


_registry: dict[tuple[str, bool, str], ElementwiseKernels] = {}
_registry_lock = threading.Lock()


def _for_target(func: Callable, target: str) -> Callable:
    """``func`` with the numba functions it calls compiled for ``target``
    (:func:`~dask_gpuchunk._kernels.user_functions.for_target`)."""
    return for_target(func, target) if isinstance(func, types.FunctionType) else func


def kernels_for(func: Callable, nargs: int, token: str, cache: bool = False,
                rules: str = "numpy", fma: bool = False,
                sources: Sources | None = None) -> ElementwiseKernels:
    """The process's one :class:`ElementwiseKernels` for ``(token, cache, rules, fma)``, made
    on first use.

    ``token`` must identify the function (``dask.base.tokenize(func)`` does); ``sources`` are
    its source files' text where they were taken (a worker unpickling the kernels gets the
    client's), read here where not given.
    """
    with _registry_lock:
        kernels = _registry.get((token, cache, rules, fma))
        if kernels is None:
            kernels = _registry[(token, cache, rules, fma)] = ElementwiseKernels(
                func, nargs, token, cache, rules, fma, sources)
        return kernels


#: Most blocks of one launch (CUDA's limit on gridDim.x).
MAX_BLOCKS = 2**31 - 1


def partial_count(n: int, target: str) -> int:
    """How many partials each reduction of a pass over ``n`` elements writes: one per block of
    the CPU loop (``"cpu"``); at most one per block of the CUDA grid (``"cuda"``: the grid is
    never larger)."""
    if n == 0:
        return 0
    return min(n, 1024) if target == "cpu" else _reduction_config(n)[1]


#: Threads per block of a CUDA pass with reductions.
REDUCTION_THREADS = 256
#: Blocks of a CUDA pass with reductions, in GPU-fulls (the blocks the GPU holds at once).
#: Measured on an H200, seed 002's pass and sum over 16384² complex64 (perf note 23): 1, 2 and
#: 4 GPU-fulls of 256-thread blocks took 2930, 2769 and 2714 µs (CuPy's kernel and sum 2735);
#: 128, 512 and 1024 threads per block 2957, 2884 and 2875 µs at one GPU-full.
REDUCTION_WAVES = 4

_sm_counts: dict[int, int] = {}


def _reduction_config(n: int) -> tuple[int, int]:
    """Threads per block of a CUDA pass with reductions over ``n`` elements, and the most
    blocks it launches: no more than one per ``threads`` elements, nor than the current GPU
    holds in :data:`REDUCTION_WAVES` GPU-fulls (its multiprocessors x 2048 threads each)."""
    from numba import cuda
    from numba.cuda import config as cuda_config

    if cuda_config.ENABLE_CUDASIM:
        return _launch_config(n)
    device = current_device()
    sms = _sm_counts.get(device)
    if sms is None:
        sms = _sm_counts[device] = int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    threads = REDUCTION_THREADS
    return threads, max(1, min(math.ceil(n / threads), REDUCTION_WAVES * sms * 2048 // threads))


def _launch_config(n: int) -> tuple[int, int]:
    """Threads per block and blocks: one thread per element of ``n`` (see :func:`_cuda_source`)."""
    from numba.cuda import config as cuda_config

    if cuda_config.ENABLE_CUDASIM:
        # The simulator runs every CUDA thread as a Python thread: keep grids tiny (the
        # kernel's grid-stride loop covers the rest).
        threads = 32
        return threads, max(1, min(math.ceil(n / threads), 4))
    threads = 128
    return threads, max(1, min(math.ceil(n / threads), MAX_BLOCKS))
