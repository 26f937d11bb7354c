"""The user's own numba objects, taken apart for the package's kernels.

Users bring what they wrote for numba: ``@njit`` and ``@cuda.jit(device=True)`` scalar functions,
``@vectorize`` ufuncs (CPU or CUDA target), ``@guvectorize`` gufuncs and ``@cuda.jit`` kernels.
The first three are scalar functions underneath: :func:`scalar_function` finds the Python function
each one was made from, with a ufunc's type loops (its signatures) so that calls pick the loop
NumPy would and compute as the user's ufunc does. :func:`for_target` rebuilds a Python function so
that the numba functions it calls are compiled for the target it runs on (a CUDA device function
called from a kernel's CPU twin runs there as ``@njit``, and the other way round). No dask here.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .numpy_rules import VType

__all__ = ["Loop", "ScalarFunction", "cuda_kernel_function", "for_target", "gufunc_parts",
           "is_cuda_kernel", "is_numba_function", "pick_loop", "scalar_function"]


class Loop(NamedTuple):
    """One type loop of a ufunc: its input dtypes and its output dtype."""

    inputs: tuple[np.dtype, ...]
    output: np.dtype


class ScalarFunction(NamedTuple):
    """What :func:`scalar_function` finds: the Python function, what it was given as, and the
    ufunc's loops (empty where the types follow the arguments)."""

    func: types.FunctionType
    kind: str
    loops: tuple[Loop, ...] = ()


def _cuda_device_flag(obj: Any) -> bool | None:
    """Whether a numba CUDA dispatcher is a device function (``None``: not a CUDA dispatcher).
    The simulator's stand-in (``NUMBA_ENABLE_CUDASIM``) is told apart by its own attribute."""
    name = type(obj).__name__
    if name == "FakeCUDAKernel":
        return bool(obj._device)
    if name == "CUDADispatcher":
        return bool(obj.targetoptions.get("device"))
    return None


def _is_cpu_dispatcher(obj: Any) -> bool:
    try:
        from numba.core.registry import CPUDispatcher
    except ImportError:  # pragma: no cover - numba is a dependency
        return False
    return isinstance(obj, CPUDispatcher)


def is_cuda_kernel(obj: Any) -> bool:
    """Whether ``obj`` is a ``@cuda.jit`` kernel (not a device function).

    Examples
    --------
    >>> is_cuda_kernel(lambda x: x)
    False
    """
    return _cuda_device_flag(obj) is False


def is_numba_function(obj: Any) -> bool:
    """Whether ``obj`` is a numba-compiled scalar function (``@njit`` or a CUDA device
    function), whose Python function :func:`for_target` compiles for each target."""
    return _is_cpu_dispatcher(obj) or _cuda_device_flag(obj) is True


def cuda_kernel_function(kernel: Any) -> types.FunctionType:
    """The Python function of a ``@cuda.jit`` kernel."""
    func = getattr(kernel, "py_func", None)
    if not isinstance(func, types.FunctionType):
        raise TypeError(f"{kernel!r} is not a numba @cuda.jit kernel")
    return func


def _core_of(kernel: Any) -> types.FunctionType | None:
    """The user's function inside a kernel numba-cuda generated for a CUDA ufunc or gufunc
    (its ``__core__``, a device function of the user's Python function)."""
    stager = getattr(kernel, "py_func", None)
    core = getattr(stager, "__globals__", {}).get("__core__")
    func = getattr(core, "py_func", None)
    return func if isinstance(func, types.FunctionType) else None


def _split_types(type_string: str) -> tuple[tuple[np.dtype, ...], tuple[np.dtype, ...]]:
    """A NumPy ufunc's loop (``"ff->f"``) as input and output dtypes."""
    ins, outs = type_string.split("->")
    return tuple(np.dtype(c) for c in ins), tuple(np.dtype(c) for c in outs)


def _loops_of_types(type_strings: Sequence[str]) -> tuple[Loop, ...]:
    return tuple(Loop(ins, outs[0]) for ins, outs in map(_split_types, type_strings))


def scalar_function(obj: Any, what: str = "dg.elementwise") -> ScalarFunction:
    """The Python scalar function behind ``obj``: itself if plain, else what numba compiled.

    Parameters
    ----------
    obj
        A Python function; an ``@njit`` function; a ``@cuda.jit(device=True)`` function; a
        ``@vectorize`` ufunc (``target="cpu"`` or ``"cuda"``).
    what
        Who asks (named in errors).

    Returns
    -------
    ScalarFunction
        The function, its kind (``"python"``, ``"njit"``, ``"cuda device"``, ``"ufunc"``,
        ``"cuda ufunc"``), and a ufunc's loops in the order NumPy tries them (none for a
        ``@vectorize`` without signatures, which compiles for whatever it is given).

    Raises
    ------
    TypeError
        For a ``@cuda.jit`` kernel (:func:`dask_gpuchunk.map_blocks` runs those), a gufunc
        (:func:`dask_gpuchunk.gufunc`), or a ufunc that kept no Python function (numba's
        ``target="parallel"``).

    Examples
    --------
    >>> import numba
    >>> @numba.vectorize(["float32(float32, float32)", "float64(float64, float64)"])
    ... def scaled_sum(a, b):
    ...     return 2 * a + b
    >>> found = scalar_function(scaled_sum)
    >>> found.func.__name__, found.kind, [str(loop.output) for loop in found.loops]
    ('scaled_sum', 'ufunc', ['float32', 'float64'])
    """
    if isinstance(obj, types.FunctionType):
        return ScalarFunction(obj, "python")
    name = getattr(obj, "__name__", repr(obj))
    device = _cuda_device_flag(obj)
    if device is False:
        raise TypeError(f"{what}: {name!r} is a @cuda.jit kernel, which writes its own outputs; "
                        "run it over Dask arrays with dg.map_kernel (an elementwise function "
                        "returns its result)")
    if device is True or _is_cpu_dispatcher(obj):
        return ScalarFunction(obj.py_func, "njit" if device is None else "cuda device")
    kind = type(obj).__name__
    if kind in ("GUFunc", "CUDAGeneralizedUFunc"):
        raise TypeError(f"{what}: {name!r} is a @guvectorize gufunc; run it with dg.gufunc_op")
    if kind == "DUFunc":
        func = obj._dispatcher.py_func
        loops = _loops_of_types(obj.ufunc.types) if obj._frozen else ()
        return ScalarFunction(func, "ufunc", loops)
    if kind == "CUDAUFuncDispatcher":
        loops = []
        func = None
        for argtypes, (restype, kernel) in obj.functions.items():
            loops.append(Loop(tuple(np.dtype(t) for t in argtypes), np.dtype(restype)))
            func = func or _core_of(kernel)
        if func is None:
            raise TypeError(f"{what}: cannot find the Python function of the CUDA ufunc "
                            f"{name!r} (an unknown numba-cuda version?); pass the function "
                            "itself")
        return ScalarFunction(func, "cuda ufunc", tuple(loops))
    if isinstance(obj, np.ufunc):
        raise TypeError(
            f"{what}: {name!r} is a NumPy ufunc with no Python function to compile (numba's "
            "@vectorize(target='parallel') keeps none); call it on the Dask array directly "
            "(NumPy chunks, on the CPU), or give dg.elementwise the undecorated function or a "
            "target='cpu' / 'cuda' ufunc")
    if callable(obj) and not isinstance(obj, type):
        return ScalarFunction(obj, "python")  # checked as a Python function downstream
    raise TypeError(f"{what} needs a function, got {type(obj).__name__}")


def gufunc_parts(obj: Any) -> tuple[types.FunctionType, str, tuple[tuple[tuple[np.dtype, ...],
                                                                         tuple[np.dtype, ...]],
                                                                   ...]]:
    """A numba ``@guvectorize`` gufunc's Python function, layout (``"(n),(n)->(n)"``) and
    loops (input dtypes, output dtypes), CPU or CUDA target.

    Examples
    --------
    >>> import numba
    >>> @numba.guvectorize(["void(float64[:], float64[:])"], "(n)->()")
    ... def total(x, out):
    ...     out[0] = x.sum()
    >>> func, layout, loops = gufunc_parts(total)
    >>> func.__name__, layout, loops[0][1]
    ('total', '(n)->()', (dtype('float64'),))
    """
    kind = type(obj).__name__
    name = getattr(obj, "__name__", repr(obj))
    if kind == "GUFunc":
        func = obj.gufunc_builder.py_func
        return func, obj.signature, tuple(map(_split_types, obj.ufunc.types))
    if kind == "CUDAGeneralizedUFunc":
        engine = obj.engine
        layout = (",".join(f"({','.join(s)})" for s in engine.sin) + "->"
                  + ",".join(f"({','.join(s)})" for s in engine.sout))
        func = None
        found = []
        for indtypes, (outdtypes, kernel) in obj.kernelmap.items():
            found.append((tuple(np.dtype(t) for t in indtypes),
                          tuple(np.dtype(t) for t in outdtypes)))
            func = func or _core_of(kernel)
        if func is None:
            raise TypeError(f"cannot find the Python function of the CUDA gufunc {name!r}")
        return func, layout, tuple(found)
    raise TypeError(f"dg.gufunc_op needs a numba @guvectorize function, got {name!r}")


def pick_loop(loops: Sequence[Loop], argtypes: Sequence[VType], name: str) -> Loop:
    """The loop NumPy's ufunc machinery picks for arguments of these types: the first whose
    inputs every argument casts to safely (a Python number by its kind, as NEP 50 treats it).

    Examples
    --------
    >>> from dask_gpuchunk.ufunc.numpy_rules import weak_type
    >>> loops = [Loop((np.dtype("f4"),), np.dtype("f4")), Loop((np.dtype("f8"),), np.dtype("f8"))]
    >>> pick_loop(loops, [VType(np.dtype("int16"))], "f").output
    dtype('float32')
    >>> pick_loop(loops, [VType(np.dtype("int32"))], "f").output
    dtype('float64')
    >>> pick_loop(loops, [weak_type(2.5)], "f").output
    dtype('float32')
    """
    for loop in loops:
        if all(_casts(vt, dt) for vt, dt in zip(argtypes, loop.inputs)):
            return loop
    given = ", ".join(vt.dtype.name + (" (Python number)" if vt.weak else "")
                      for vt in argtypes)
    have = "; ".join(f"({', '.join(d.name for d in lp.inputs)}) -> {lp.output.name}"
                     for lp in loops)
    raise TypeError(f"ufunc {name!r} has no loop for arguments ({given}) by NumPy's safe "
                    f"casting; its loops: {have}")


_WEAK_KINDS = {"b": "biufc", "i": "iufc", "u": "iufc", "f": "fc", "c": "c"}


def _casts(vt: VType, dtype: np.dtype) -> bool:
    if vt.weak:
        return dtype.kind in _WEAK_KINDS.get(vt.dtype.kind, "")
    return bool(np.can_cast(vt.dtype, dtype, "safe"))


@functools.lru_cache(maxsize=256)
def for_target(func: types.FunctionType, target: str) -> types.FunctionType:
    """``func`` with each numba function it calls (a global or closure variable that is an
    ``@njit`` or CUDA device function) replaced by that function compiled for ``target``
    (``"cpu"``: ``numba.njit``; ``"cuda"``: ``cuda.jit(device=True)``), recursively; ``func``
    itself where it calls none.

    Examples
    --------
    >>> def twice(x):
    ...     return 2 * x
    >>> for_target(twice, "cpu") is twice
    True
    """
    if target not in ("cpu", "cuda"):
        raise ValueError(f"target must be 'cpu' or 'cuda', got {target!r}")
    code = func.__code__
    glob = func.__globals__
    replaced = {name: _compiled_for(glob[name], target) for name in _names(code)
                if name in glob and is_numba_function(glob[name])}
    cells = func.__closure__ or ()
    new_cells = []
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            new_cells.append(cell)
            continue
        new_cells.append(types.CellType(_compiled_for(value, target))
                         if is_numba_function(value) else cell)
    if not replaced and all(a is b for a, b in zip(new_cells, cells)):
        return func
    rebuilt = types.FunctionType(code, {**glob, **replaced}, func.__name__, func.__defaults__,
                                 tuple(new_cells) or None)
    rebuilt.__kwdefaults__ = func.__kwdefaults__
    rebuilt.__qualname__ = func.__qualname__
    rebuilt.__module__ = func.__module__
    return rebuilt


def _names(code: types.CodeType) -> set[str]:
    """The global names ``code`` and the code nested in it load."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _compiled_for(dispatcher: Any, target: str) -> Any:
    inner = for_target(dispatcher.py_func, target)
    if target == "cpu":
        if _is_cpu_dispatcher(dispatcher) and inner is dispatcher.py_func:
            return dispatcher  # the user's own @njit function, compiled as they asked
        import numba

        return numba.njit(inner)
    if _cuda_device_flag(dispatcher) is True and inner is dispatcher.py_func:
        return dispatcher
    return _cuda_device(inner)


@functools.lru_cache(maxsize=256)
def _cuda_device(func: types.FunctionType) -> Any:
    from numba import cuda

    return cuda.jit(device=True)(func)

