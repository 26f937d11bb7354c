"""An elementwise call's operands: the function's arity, argument types (NumPy's rules, weak
Python scalars), xarray and CuPy inputs, the broadcast shape, and Dask arrays of them."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import dask.array as da
import numpy as np

from .. import _compat
from .._kernels.elementwise import arg_type, check_dtype, is_python_number
from ..arrays import asarray, is_array_like, refuse_masked
from ..runtime.backend import is_cupy
from ..ufunc.numpy_rules import VType, weak_type

__all__ = []

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


def _argtype_of(d: Any, index: int) -> VType:
    """A :class:`VType` for :meth:`ElementwiseOp.result_dtype`'s arguments."""
    if isinstance(d, VType):
        return d
    # A type, not a dtype equal to one (np.dtype("int64") == int holds).
    if isinstance(d, type) and d in (bool, int, float, complex):
        return weak_type(d(0), index)
    return VType(check_dtype(d, f"argument {index + 1}"))


def _is_xarray(a: Any) -> bool:
    """Whether ``a`` is an xarray object (a DataArray, Dataset or Variable)."""
    return type(a).__module__.split(".")[0] == "xarray"


def _xarray_dtype(a: Any) -> Any:
    """What :meth:`ElementwiseOp.result_dtype` takes for an argument of an xarray call: a
    DataArray's dtype, a Dataset's first data variable's, a Python number's type."""
    if _is_xarray(a):
        if hasattr(a, "dtype"):
            return a.dtype
        variables = list(a.data_vars.values())
        if not variables:
            raise TypeError("an xarray Dataset without data variables")
        return variables[0].dtype
    if is_python_number(a):
        return type(a)
    return a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype


def _loop_type(a: Any) -> VType:
    """An argument's type for picking a ufunc loop (a Python number weak; a list as NumPy
    reads it)."""
    return arg_type(a if is_python_number(a) or hasattr(a, "dtype") else np.asarray(a))


def _cast(a: Any, dtype: np.dtype) -> Any:
    if is_python_number(a):
        return dtype.type(a)
    if hasattr(a, "astype") and not is_array_like(a):
        return a.astype(dtype)
    return np.asarray(a, dtype=dtype)


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
        chunks_by_dim.append(_compat.common_blockdim(spans) if len(spans) > 1
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
