"""An elementwise function's dtypes by NumPy's rules or numba's: the dtypes it takes, a
scalar's type, reductions' result and partial dtypes, the per-chunk plan
(:class:`ElementwisePlan`), collapsed dimensions, and the NumPy reference."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..ufunc.numpy_rules import VType, weak_type
from .source_cache import cached_njit

__all__ = ["ElementwisePlan", "arg_type", "check_dtype", "collapse_dims", "is_python_number", "is_scalar", "numba_result_dtype", "partial_dtype", "reduced_dtype", "reference"]

#: How an elementwise function's arithmetic is compiled: "numpy" (NumPy's types and values,
#: through :func:`~dask_gpuchunk.ufunc.translate.translate`) or "numba" (numba's own).
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
