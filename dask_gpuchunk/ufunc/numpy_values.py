"""The values of a translated scalar function and NumPy's types for them: a value's type
(:class:`VType`: a dtype, strong or weak, with what is known of it), the bounds of integers
known at translation, literals, NumPy's loop for an operation, and the small pieces of code the
rules write (see :mod:`dask_gpuchunk.ufunc.numpy_rules`). No dask here.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["BINARY_UFUNCS", "BOOL", "COMPARE_UFUNCS", "COMPLEX128", "FLOAT64", "INT64", "PY_BINARY", "PY_COMPARE", "PY_RANK", "PY_STORAGE", "RuleError", "SWAPPED", "UINT64", "UNKNOWN", "VType", "Value", "binary_bounds", "check_supported", "exactly", "int_bounds", "integer_helper", "known_call", "literal", "power_bounds", "resolve", "suffix", "unary_bounds", "weak_type", "wrapping"]


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


#: The ``const`` of a value whose value is not known when translating.
UNKNOWN: Any = _Unknown()


class RuleError(Exception):
    """An operation that cannot be compiled to give NumPy's result, or that NumPy refuses.

    ``exc_type`` is what the user sees: ``TypeError`` where numba cannot follow NumPy (or
    NumPy has no such operation), ``OverflowError``/``ValueError`` where NumPy itself raises
    them for these values.
    """

    def __init__(self, message: str, exc_type: type[Exception] = TypeError) -> None:
        super().__init__(message)
        self.exc_type = exc_type


@dataclass(frozen=True)
class VType:
    """The type of a value in the translated function.

    ``dtype``: its NumPy dtype (strong) or the dtype holding a Python number (``weak``).
    ``const``: the value where known (Python numbers only). ``call``: for a Python number that
    depends only on the Python numbers given as arguments (and constants), a Python expression
    of them (``args[1] + 1``): its one value per call is known when the operation is called, and
    checked there. ``bounds``: the least and greatest value a Python integer can have, where
    known (a loop index over ``range(10)``: 0 and 9). ``alt``: where a branch or loop merged a
    Python number into this NumPy type, the Python number's type (each operation then checks
    that both compute alike; ``origin`` names the variable and line, for messages).
    """

    dtype: np.dtype
    weak: bool = False
    const: Any = field(default=UNKNOWN, compare=False)
    call: str | None = field(default=None, compare=False)
    alt: VType | None = field(default=None, compare=False)
    origin: str = field(default="", compare=False)
    bounds: tuple[int, int] | None = field(default=None, compare=False)

    @property
    def kind(self) -> str:
        """NumPy's kind letter: b, i, u, f, c."""
        return self.dtype.kind

    def describe(self) -> str:
        if self.weak:
            return f"a Python {_PY_NAMES[self.kind]}"
        return str(self.dtype)


@dataclass(frozen=True)
class Value:
    """Emitted code (an expression) and the type of its value."""

    expr: str
    vt: VType


_PY_NAMES = {"b": "bool", "i": "int", "u": "int", "f": "float", "c": "complex"}
PY_RANK = {"b": 0, "i": 1, "u": 1, "f": 2, "c": 3}
PY_STORAGE = {0: np.dtype(bool), 1: np.dtype(np.int64), 2: np.dtype(np.float64),
               3: np.dtype(np.complex128)}
INT64 = np.dtype(np.int64)
UINT64 = np.dtype(np.uint64)
FLOAT64 = np.dtype(np.float64)
COMPLEX128 = np.dtype(np.complex128)
BOOL = np.dtype(bool)


def weak_type(value: Any, arg: int | None = None) -> VType:
    """The type of the Python number ``value``: a constant, or argument ``arg`` of the call.

    Examples
    --------
    >>> weak_type(0.5).dtype, weak_type(2**64 - 1).dtype
    (dtype('float64'), dtype('uint64'))
    """
    if isinstance(value, bool):
        dtype = BOOL
    elif isinstance(value, int):
        if -(2**63) <= value < 2**63:
            dtype = INT64
        elif 0 <= value < 2**64:
            dtype = UINT64
        else:
            raise RuleError(f"Python integer {value} does not fit in 64 bits", OverflowError)
    elif isinstance(value, float):
        dtype = FLOAT64
    elif isinstance(value, complex):
        dtype = COMPLEX128
    else:
        raise RuleError(f"{type(value).__name__} {value!r} is not a number")
    if arg is not None:
        return VType(dtype, weak=True, call=f"args[{arg}]")
    return VType(dtype, weak=True, const=value)


def int_bounds(vt: VType) -> tuple[int, int] | None:
    """The least and greatest value of a Python integer or bool of this type, where known."""
    if vt.kind == "b":
        return (0, 1)
    if vt.const is not UNKNOWN and isinstance(vt.const, int):
        return (vt.const, vt.const)
    return vt.bounds


def _within_64_bits(bounds: tuple[int, int] | None) -> tuple[int, int] | None:
    if bounds is None or bounds[0] < -(2**63) or bounds[1] >= 2**63:
        return None
    return bounds


def binary_bounds(op: str, a: VType, b: VType) -> tuple[int, int] | None:
    """Bounds of ``a op b`` for two Python integers of known bounds (interval arithmetic)."""
    ba, bb = int_bounds(a), int_bounds(b)
    if ba is None or bb is None:
        return None
    (la, ha), (lb, hb) = ba, bb
    if op == "+":
        return _within_64_bits((la + lb, ha + hb))
    if op == "-":
        return _within_64_bits((la - hb, ha - lb))
    if op == "*":
        corners = [la * lb, la * hb, ha * lb, ha * hb]
        return _within_64_bits((min(corners), max(corners)))
    if op == "//" and lb > 0:
        corners = [la // lb, la // hb, ha // lb, ha // hb]
        return (min(corners), max(corners))
    if op == "%" and lb > 0:
        return (0, hb - 1)
    if op == "&" and la >= 0 and lb >= 0:
        return (0, min(ha, hb))
    return None


def unary_bounds(op: str, a: VType) -> tuple[int, int] | None:
    bounds = int_bounds(a)
    if bounds is None:
        return None
    low, high = bounds
    if op == "-":
        return _within_64_bits((-high, -low))
    if op == "abs":
        return (0 if low <= 0 <= high else min(abs(low), abs(high)), max(abs(low), abs(high)))
    return None


def power_bounds(a: VType, n: int) -> tuple[int, int] | None:
    bounds = int_bounds(a)
    if bounds is None:
        return None
    low, high = bounds
    values = [low ** n, high ** n]
    if low < 0 < high and n % 2 == 0:
        values.append(0)
    return _within_64_bits((min(values), max(values)))


def _py_operand(vt: VType) -> Any:
    """What ``ufunc.resolve_dtypes`` takes for this type (Python types mark weak numbers;
    a Python bool promotes as NumPy's bool)."""
    if not vt.weak or vt.kind == "b":
        return vt.dtype
    return {"i": int, "u": int, "f": float, "c": complex}[vt.kind]


BINARY_UFUNCS = {
    "+": np.add, "-": np.subtract, "*": np.multiply, "/": np.true_divide,
    "//": np.floor_divide, "%": np.remainder, "**": np.power, "&": np.bitwise_and,
    "|": np.bitwise_or, "^": np.bitwise_xor, "<<": np.left_shift, ">>": np.right_shift,
}
COMPARE_UFUNCS = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal,
                   "==": np.equal, "!=": np.not_equal}
PY_BINARY = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
    "//": operator.floordiv, "%": operator.mod, "**": operator.pow, "&": operator.and_,
    "|": operator.or_, "^": operator.xor, "<<": operator.lshift, ">>": operator.rshift,
}
PY_COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
               "==": operator.eq, "!=": operator.ne}
SWAPPED = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


def suffix(dtype: np.dtype) -> str:
    return f"{dtype.kind}{dtype.itemsize}"


def literal(value: Any) -> str:
    """Source text for a Python number, exact (``repr`` round-trips floats).

    Examples
    --------
    >>> literal(0.1), literal(-0.0), literal(float("inf")), literal(1j)
    ('0.1', '(-0.0)', '_nr_inf', 'complex(0.0, 1.0)')
    """
    if isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return f"({value})" if value < 0 else repr(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "_nr_nan"
        if math.isinf(value):
            return "_nr_inf" if value > 0 else "(-_nr_inf)"
        text = repr(value)
        return f"({text})" if text.startswith("-") else text
    if isinstance(value, complex):
        return f"complex({literal(value.real)}, {literal(value.imag)})"
    raise TypeError(value)


def resolve(ufunc: np.ufunc, *vts: VType) -> tuple[np.dtype, ...]:
    """NumPy's loop for ``ufunc`` on these types: input dtypes then the output dtype."""
    try:
        return tuple(ufunc.resolve_dtypes((*(_py_operand(v) for v in vts), None)))
    except TypeError as exc:
        names = " and ".join(v.describe() for v in vts)
        raise RuleError(f"NumPy's {ufunc.__name__} does not take {names} ({exc})") from None


def exactly(value: Any, dtype: np.dtype) -> bool:
    """Whether the Python number ``value`` converts to ``dtype`` without change."""
    try:
        with np.errstate(all="ignore"):
            converted = np.asarray(value, dtype=dtype)[()].item()  # a Python number again
        return converted == value or (value != value and converted != converted)
    except (OverflowError, TypeError, ValueError):
        return False

def wrapping(x: str, op: str, y: str) -> str:
    """``x op y`` (+, - or *) of integers, modulo 2**64: in unsigned 64-bit arithmetic, whose
    overflow is defined (numba marks signed integer arithmetic as not overflowing, so that
    LLVM and NVVM may assume it does not), to be converted to the loop's type, which keeps the
    low bits as NumPy's wrapping does."""
    return f"_nr_u8({x}) {op} _nr_u8({y})"


def integer_helper(kind: str) -> tuple[str, str]:
    """The integer helpers' variant for a loop of this kind, and the conversion of its operands:
    64 bits wide, so that each helper is compiled once, not once per pair of integer types."""
    return ("signed", "_nr_i8") if kind == "i" else ("unsigned", "_nr_u8")


def known_call(op: str, *vts: VType) -> str | None:
    """The Python expression (of the call's ``args``) of ``op`` applied to values known at the
    call (Python numbers given as arguments, constants, values computed from them); None where
    any operand depends on array elements."""
    parts = []
    for vt in vts:
        if not vt.weak:
            return None
        if vt.const is not UNKNOWN:
            parts.append(repr(vt.const))
        elif vt.call is not None:
            parts.append(vt.call)
        else:
            return None
    if len(parts) == 2 and (op in PY_BINARY or op in PY_COMPARE):
        return f"({parts[0]} {op} {parts[1]})"
    if len(parts) == 1 and op in ("-", "+", "~"):
        return f"({op}{parts[0]})"
    return f"{op}({', '.join(parts)})"


def check_supported(dtype: np.dtype, what: str) -> None:
    if dtype.kind == "f" and dtype.itemsize == 2:
        raise RuleError(f"{what}: float16 is not supported (numba's CPU target has no float16)")
    if dtype.kind not in "biufc" or dtype.itemsize > 16 or (dtype.kind == "f"
                                                             and dtype.itemsize > 8):
        raise RuleError(f"{what}: dtype {dtype} is not supported")
