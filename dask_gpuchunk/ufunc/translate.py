"""Translate a scalar Python function into source that computes by NumPy's rules.

``translate(func, argtypes)`` reads ``func``'s source, walks it once per dtype signature with
the types of :mod:`~dask_gpuchunk.ufunc.numpy_rules`, and writes a new function ``f`` in
which every operation's types are explicit. numba (CPU or CUDA) compiles ``f`` and computes, for
every value, what NumPy computes when ``func`` is called on NumPy scalars of those dtypes.

Each assignment makes a new variable (``v3_x``), so a name may change type as the function
runs, as in Python. Where paths meet (after an ``if``, at a loop's head) a name must have one
type (:meth:`~dask_gpuchunk.ufunc.numpy_rules.Emitter.join`).

The subset translated: assignments (also ``+=`` and tuples), ``if``/``elif``/``else``,
``for`` over ``range``, ``while``, ``break``, ``continue``, ``return``; arithmetic, comparisons,
``and``/``or``/``not``, conditional expressions; numbers, the arguments, globals and closure
variables holding numbers; ``math``, ``cmath``, NumPy ufuncs and scalar types (``np.float32(x)``),
``abs``, ``min``, ``max``, ``float``, ``int``, ``complex``, ``bool``, ``pow``; ``.real``,
``.imag``, ``.conjugate()``; and other plain Python functions of the same subset, translated
for the types they are called with. Anything else is refused with the line it is on.
No dask here.
"""

from __future__ import annotations

import cmath
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .numpy_rules import Emitter, RuleError, VType
from .source_capture import Sources, capture_sources, code_key, function_node
from .translate_walk import Helpers, Walker

__all__ = ["Sources", "Translation", "capture_sources", "check_call", "code_key", "translate"]


@dataclass(frozen=True)
class Translation:
    """What :func:`translate` gives for one dtype signature.

    ``source`` defines the functions named in ``functions`` (the translated helpers first,
    ``f`` last), all to be compiled for the target with the globals of
    :func:`dask_gpuchunk.ufunc.numpy_ops.namespace`. ``result_dtype`` is NumPy's dtype for
    the function's result; ``f`` returns values of ``out_dtype`` (the result dtype unless
    another was asked for). A function that returns a tuple of numbers (NumPy's ``nout``
    convention) has one dtype per value in ``result_dtypes`` and ``out_dtypes``, and ``nout``. ``call_checks`` is what the call must check of values computed from
    the Python numbers given as arguments, as NumPy would raise
    (:class:`~dask_gpuchunk.ufunc.numpy_rules.Emitter`; :func:`check_call` checks them).
    """

    source: str
    functions: tuple[str, ...]
    result_dtypes: tuple[np.dtype, ...]
    out_dtypes: tuple[np.dtype, ...]
    call_checks: tuple[tuple[str, Any, Any, type, str], ...] = ()
    #: ``None`` where ``f`` returns one number; else the length of the tuple it returns.
    nout: int | None = None

    @property
    def result_dtype(self) -> np.dtype:
        """NumPy's dtype of the result (the first, where ``f`` returns a tuple)."""
        return self.result_dtypes[0]

    @property
    def out_dtype(self) -> np.dtype:
        """What ``f`` returns (the first value's dtype, where it returns a tuple)."""
        return self.out_dtypes[0]


def check_call(translation: Translation, args: Sequence[Any]) -> None:
    """Raise what NumPy raises for these arguments where the translation's ``call_checks`` fail
    (a Python integer out of bounds for the dtype it meets, a negative integer power).

    Examples
    --------
    >>> from dask_gpuchunk.ufunc.numpy_rules import weak_type
    >>> t = translate(lambda a, k: a * (k + 1), [VType(np.dtype("int8")), weak_type(0, 1)])
    >>> check_call(t, [None, 126])
    >>> check_call(t, [None, 127])
    Traceback (most recent call last):
    ...
    OverflowError: Python integer 128 out of bounds for int8
    """
    scope = {"args": list(args), "math": math, "cmath": cmath,
             "__builtins__": {"abs": abs, "int": int, "float": float, "complex": complex,
                              "bool": bool}}
    for expr, low, high, exc_type, message in translation.call_checks:
        value = eval(expr, scope)  # noqa: S307 - written by the translator from the user's code
        if not low <= value <= high:
            raise exc_type(message.format(value=value))


def translate(func: Callable, argtypes: Sequence[VType],
              out_dtype: np.dtype | Sequence[np.dtype] | None = None,
              sources: Sources | None = None) -> Translation:
    """Translate ``func`` for arguments of these types (see the module's docstring).

    Parameters
    ----------
    func
        A plain Python function (or lambda) of ``len(argtypes)`` positional arguments, defined
        where its source can be read (a file, a notebook cell, a doctest).
    argtypes
        Each argument's type: ``VType(dtype)`` for a NumPy array or scalar,
        :func:`~dask_gpuchunk.ufunc.numpy_rules.weak_type` for a Python number.
    out_dtype
        What ``f`` returns (each result converted as ``astype`` converts); default NumPy's
        result dtype. A sequence of dtypes for a function that returns a tuple.
    sources
        The source of the function and its helpers as :func:`capture_sources` took it where
        they were defined; a function found there is never read again (a worker process
        cannot read a function defined in the client's ``__main__`` script or notebook).

    Raises
    ------
    TypeError
        Where the function uses something outside the translated subset, or something whose
        NumPy result cannot be computed by a compiled kernel; ``OverflowError``,
        ``ValueError``, ``ZeroDivisionError`` where NumPy itself raises them for these types or
        constants. The message names the function and the line.

    Examples
    --------
    >>> from dask_gpuchunk.ufunc.numpy_rules import weak_type
    >>> t = translate(lambda x: x * 0.1 + 0.7, [VType(np.dtype("float32"))])
    >>> t.result_dtype
    dtype('float32')
    >>> print(t.source.strip())
    def f(a0):
        return (_nr_multiply_f4(a0, _nr_f4(0.10000000149011612)) + _nr_f4(0.699999988079071))
    """
    argtypes = tuple(argtypes)
    sources = sources or {}
    node, filename = function_node(func, sources)
    name = getattr(func, "__name__", "function")
    emitter = Emitter()
    for attempt in range(2):
        helpers = Helpers(sources)
        walker = Walker(func, node, filename, name, emitter, helpers, out_dtype)
        try:
            walker.translate_function(argtypes, "f")
        except RuleError as exc:
            where = os.path.basename(filename)
            if exc.exc_type is TypeError:
                raise TypeError(f"dg.elementwise cannot compile {name!r} by NumPy's rules: "
                                f"{where}, {exc}") from None
            raise exc.exc_type(f"{name!r} ({where}), {exc} (as NumPy raises)") from None
        nout = walker.nout
        if nout is None:
            result: tuple[np.dtype, ...] = (np.result_type(*(vt.dtype for vt in walker.returns)),)
        else:
            result = tuple(np.result_type(*(r[k].dtype for r in walker.returns))
                           for k in range(nout))
        if out_dtype is not None:
            break
        out_dtype = result[0] if nout is None else result  # a second walk converts to them
        emitter = Emitter()
    outs = (out_dtype,) if nout is None else tuple(out_dtype)
    if len(outs) != len(result):
        raise TypeError(f"dg.elementwise: {name!r} returns {len(result)} values, dtype= gives "
                        f"{len(outs)}")
    source = "\n".join([*helpers.sources, walker.source]) + "\n"
    return Translation(source, (*helpers.names, "f"), tuple(np.dtype(d) for d in result),
                       tuple(np.dtype(d) for d in outs),
                       tuple(dict.fromkeys(emitter.call_checks)), nout)


