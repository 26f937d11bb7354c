"""NumPy's rules for the values of a scalar function: types, promotion, and the code computing them.

A user's elementwise function, called on NumPy scalars, computes by NumPy's rules: ``int8 *
int8`` is an ``int8`` that wraps, ``uint8 + uint8`` wraps before ``/ 2``, a Python number is
"weak" (NEP 50: ``float32 * 0.1`` stays ``float32``), ``int8 * uint64`` is ``float64``.
numba compiles the same function by its own rules (small integers widened to 64 bits, Python
numbers as ``float64``/``int64``, signed and unsigned mixed into ``int64``), so its values
differ. :mod:`dask_gpuchunk._kernels.translate` walks the function; for each operation it asks
the :class:`Emitter` here for code whose types are explicit, so that numba (or numba's CUDA
target) computes exactly what NumPy computes.

Types: a value is a NumPy scalar of a dtype (strong) or a Python number (weak: bool, int,
float, complex, held as bool/int64/float64/complex128; an int above 2**63 - 1 as uint64).
NumPy's own ``ufunc.resolve_dtypes`` decides each strong operation's loop; operations between
two Python numbers follow Python's rules (64-bit integers). What cannot follow NumPy raises
:class:`RuleError` (the translator adds where it was).

Emitted code calls the helpers of :mod:`dask_gpuchunk._kernels.numpy_ops` (``_nr_...``). No
dask here.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .numpy_ops import cast_name

__all__ = ["UNKNOWN", "Emitter", "RuleError", "VType", "Value", "int_bounds", "weak_type"]


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
_PY_RANK = {"b": 0, "i": 1, "u": 1, "f": 2, "c": 3}
_PY_STORAGE = {0: np.dtype(bool), 1: np.dtype(np.int64), 2: np.dtype(np.float64),
               3: np.dtype(np.complex128)}
_INT64 = np.dtype(np.int64)
_UINT64 = np.dtype(np.uint64)
_FLOAT64 = np.dtype(np.float64)
_COMPLEX128 = np.dtype(np.complex128)
_BOOL = np.dtype(bool)


def weak_type(value: Any, arg: int | None = None) -> VType:
    """The type of the Python number ``value``: a constant, or argument ``arg`` of the call.

    Examples
    --------
    >>> weak_type(0.5).dtype, weak_type(2**64 - 1).dtype
    (dtype('float64'), dtype('uint64'))
    """
    if isinstance(value, bool):
        dtype = _BOOL
    elif isinstance(value, int):
        if -(2**63) <= value < 2**63:
            dtype = _INT64
        elif 0 <= value < 2**64:
            dtype = _UINT64
        else:
            raise RuleError(f"Python integer {value} does not fit in 64 bits", OverflowError)
    elif isinstance(value, float):
        dtype = _FLOAT64
    elif isinstance(value, complex):
        dtype = _COMPLEX128
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


def _binary_bounds(op: str, a: VType, b: VType) -> tuple[int, int] | None:
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


def _unary_bounds(op: str, a: VType) -> tuple[int, int] | None:
    bounds = int_bounds(a)
    if bounds is None:
        return None
    low, high = bounds
    if op == "-":
        return _within_64_bits((-high, -low))
    if op == "abs":
        return (0 if low <= 0 <= high else min(abs(low), abs(high)), max(abs(low), abs(high)))
    return None


def _power_bounds(a: VType, n: int) -> tuple[int, int] | None:
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


_BINARY_UFUNCS = {
    "+": np.add, "-": np.subtract, "*": np.multiply, "/": np.true_divide,
    "//": np.floor_divide, "%": np.remainder, "**": np.power, "&": np.bitwise_and,
    "|": np.bitwise_or, "^": np.bitwise_xor, "<<": np.left_shift, ">>": np.right_shift,
}
_COMPARE_UFUNCS = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal,
                   "==": np.equal, "!=": np.not_equal}
_PY_BINARY = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
    "//": operator.floordiv, "%": operator.mod, "**": operator.pow, "&": operator.and_,
    "|": operator.or_, "^": operator.xor, "<<": operator.lshift, ">>": operator.rshift,
}
_PY_COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
               "==": operator.eq, "!=": operator.ne}
_SWAPPED = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


def _suffix(dtype: np.dtype) -> str:
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


def _resolve(ufunc: np.ufunc, *vts: VType) -> tuple[np.dtype, ...]:
    """NumPy's loop for ``ufunc`` on these types: input dtypes then the output dtype."""
    try:
        return tuple(ufunc.resolve_dtypes((*(_py_operand(v) for v in vts), None)))
    except TypeError as exc:
        names = " and ".join(v.describe() for v in vts)
        raise RuleError(f"NumPy's {ufunc.__name__} does not take {names} ({exc})") from None


def _exactly(value: Any, dtype: np.dtype) -> bool:
    """Whether the Python number ``value`` converts to ``dtype`` without change."""
    try:
        with np.errstate(all="ignore"):
            converted = np.asarray(value, dtype=dtype)[()].item()  # a Python number again
        return converted == value or (value != value and converted != converted)
    except (OverflowError, TypeError, ValueError):
        return False


class Emitter:
    """Typed code for each operation of a translated function, by NumPy's rules.

    ``call_checks`` collects what the call must check of values computed from the Python numbers
    given as arguments (one that must fit a dtype, an exponent that must not be negative):
    ``[(expression of args, low, high, exception type, message), ...]``.
    """

    def __init__(self) -> None:
        self.call_checks: list[tuple[str, Any, Any, type[Exception], str]] = []

    # ---- values and conversions ----------------------------------------------------------
    def constant(self, value: Any) -> Value:
        """A Python number written in the function (or one of its globals)."""
        vt = weak_type(value)
        return Value(literal(value), vt)

    def numpy_constant(self, value: np.generic) -> Value:
        """A NumPy scalar the function reads from its globals: a constant of its dtype."""
        dtype = np.dtype(value.dtype)
        _check_supported(dtype, f"the constant {value!r}")
        return Value(f"{cast_name(dtype)}({literal(value.item())})", VType(dtype))

    def convert(self, v: Value, dtype: np.dtype, *, astype: bool = False, what: str = "") -> str:
        """Code for ``v`` converted to ``dtype`` as NumPy converts an operand to a loop's type.

        A Python integer must fit an integer dtype (NumPy raises ``OverflowError``): checked now
        for constants and values of known bounds, recorded in ``call_checks`` for values of the
        call's Python numbers, refused for other integers the function computes. ``astype``: as
        ``ndarray.astype`` converts (wrapping, the real part of a complex number), for results
        and explicit casts.
        """
        vt = v.vt
        if vt.dtype == dtype and (not vt.weak or vt.const is UNKNOWN):
            return v.expr  # a Python number held in this very dtype needs no conversion
        if vt.weak and vt.kind in "iu" and dtype.kind in "iu" and not astype:
            self._check_python_int(v, dtype, what)
        if vt.weak and vt.const is not UNKNOWN and not astype:
            # A constant converts now, as NumPy converts it.
            with np.errstate(all="ignore"):
                converted = np.asarray(vt.const).astype(dtype)[()]
            if dtype.kind == "c":
                return f"{cast_name(dtype)}({literal(complex(converted))})"
            return f"{cast_name(dtype)}({literal(converted.item())})"
        if vt.kind == "c" and dtype.kind != "c":
            if not astype:
                raise RuleError(f"{what or 'a complex value'} cannot become {dtype} (NumPy "
                                "would not drop the imaginary part; use .real)")
            vt = VType(np.dtype(f"f{vt.dtype.itemsize // 2}"))  # the real part, as astype
            v = Value(f"({v.expr}).real", vt)
            if dtype == vt.dtype:
                return v.expr
        if vt.kind == "f" and dtype.kind in "iu" and dtype.itemsize < 8:
            # As C converts (NumPy's cast loop): through a 64-bit integer, then wrapped.
            return f"{cast_name(dtype)}(_nr_i8({v.expr}))"
        return f"{cast_name(dtype)}({v.expr})"

    def _check_python_int(self, v: Value, dtype: np.dtype, what: str) -> None:
        vt = v.vt
        if vt.dtype == dtype:
            return
        info = np.iinfo(dtype)
        bounds = int_bounds(vt)
        if vt.const is not UNKNOWN:
            if not info.min <= vt.const <= info.max:
                raise RuleError(f"Python integer {vt.const} out of bounds for {dtype}",
                                OverflowError)
            return
        if bounds is not None and info.min <= bounds[0] <= bounds[1] <= info.max:
            return  # its value always fits
        if vt.call is not None:
            self.call_checks.append((vt.call, int(info.min), int(info.max), OverflowError,
                                     f"Python integer {{value}} out of bounds for {dtype}"))
            return
        raise RuleError(
            f"{what or 'a Python integer the function computes'} meets {dtype}: NumPy raises "
            f"OverflowError where the value does not fit {dtype}, which a kernel cannot do; "
            f"convert it first (np.{dtype.name}(...) wraps, np.int64(...) keeps it)")

    # ---- joins -----------------------------------------------------------------------------
    def join(self, a: VType, b: VType, what: str) -> VType:
        """One type for a variable (or an expression) set to ``a`` on some paths, ``b`` on others.

        Equal types join as they are. A Python number joined with a NumPy type becomes that
        type, with ``alt`` recording it, where its value converts exactly: a number held in the
        same dtype (a Python float and float64), or a constant NumPy would convert to that
        type unchanged (``0.0`` and float32). Anything else depends on the path taken at run
        time, which one compiled type cannot follow.
        """
        if a == b:
            const = a.const if (a.const is not UNKNOWN and b.const is not UNKNOWN
                                and a.const == b.const
                                and type(a.const) is type(b.const)) else UNKNOWN
            call = a.call if a.call == b.call else None
            alt = a.alt if a.alt is not None else b.alt
            return replace(a, const=const, call=call, alt=alt,
                           origin=a.origin or b.origin)
        if a.weak and b.weak and a.kind in "iu" and b.kind in "iu" and self._fits(a, b):
            ba, bb = int_bounds(a), int_bounds(b)
            bounds = None if ba is None or bb is None else (min(ba[0], bb[0]), max(ba[1], bb[1]))
            return VType(_INT64, weak=True, bounds=bounds)
        if a.weak != b.weak:
            weak, strong = (a, b) if a.weak else (b, a)
            if strong.alt is not None and strong.alt.kind == weak.kind:
                return replace(strong, const=UNKNOWN, call=None)
            same_storage = weak.dtype == strong.dtype
            exact_const = (weak.const is not UNKNOWN
                           and _resolve(np.add, strong, weak)[2] == strong.dtype
                           and _exactly(weak.const, strong.dtype))
            if same_storage or exact_const:
                return VType(strong.dtype, alt=replace(weak, call=None), origin=what)
            hint = f"np.{strong.dtype.name}(...)"
            raise RuleError(
                f"{what} is {strong.describe()} on some paths and {weak.describe()}"
                f"{'' if weak.const is UNKNOWN else f' ({weak.const!r})'} on others: NumPy "
                "would compute with whichever it is at run time, and a compiled kernel needs "
                f"one type. Give it one type where it is set, e.g. {hint}")
        raise RuleError(
            f"{what} is {a.describe()} on some paths and {b.describe()} on others: NumPy's "
            "type would depend on the path taken at run time, and a compiled kernel needs one "
            "type. Convert it where it is set (e.g. np.float64(...)) so that every path gives "
            "the same type")

    @staticmethod
    def _fits(a: VType, b: VType) -> bool:
        """Whether two Python integers both fit int64 (one held as uint64 must be a constant)."""
        return all(v.dtype == _INT64 or (v.const is not UNKNOWN and v.const < 2**63)
                   for v in (a, b))

    # ---- alternatives (see VType.alt) --------------------------------------------------------
    def _check_alt(self, what: str, operands: tuple[Value, ...], loop: np.dtype,
                   alt_loop: Any) -> None:
        """Refuse an operation whose loop type would differ on the path where a merged
        variable still holds its Python number."""
        if alt_loop is None or alt_loop == loop:
            return
        origin = next((v.vt.origin for v in operands if v.vt.alt is not None), "a variable")
        raise RuleError(
            f"{origin} is a Python number on some paths and a NumPy value on others, and "
            f"{what} would then compute in {alt_loop} on the first and {loop} on the others; "
            "a compiled kernel needs one type. Set it to a NumPy value on every path (e.g. "
            "s = np.float32(0) instead of s = 0.0)")

    @staticmethod
    def _alts(operands: tuple[Value, ...]) -> tuple[VType, ...] | None:
        if all(v.vt.alt is None for v in operands):
            return None
        return tuple(v.vt.alt if v.vt.alt is not None else v.vt for v in operands)

    # ---- binary arithmetic ---------------------------------------------------------------
    def binary(self, op: str, a: Value, b: Value) -> Value:
        """``a op b`` by NumPy's rules (or Python's, for two Python numbers)."""
        if a.vt.weak and b.vt.weak:
            if a.vt.const is not UNKNOWN and b.vt.const is not UNKNOWN:
                return self._fold(op, a.vt.const, b.vt.const)
            return self._python_binary(op, a, b)
        result, loop = self._numpy_binary(op, a, b)
        alts = self._alts((a, b))
        if alts is None:
            return result
        if all(v.weak for v in alts):
            # On the other path both are Python numbers: Python's arithmetic, in the dtype
            # holding its result (Python's power differs from NumPy's in kind, not only type).
            alt_loop: Any = ("Python's power" if op == "**"
                             else self._python_kind(op, *alts)[1])
            self._check_alt(f"'{op}'", (a, b), loop, alt_loop)
            origin = next(v.vt.origin for v in (a, b) if v.vt.alt is not None)
            return Value(result.expr, replace(result.vt, alt=VType(result.vt.dtype, weak=True),
                                              origin=origin))
        self._check_alt(f"'{op}'", (a, b), loop, _resolve(_BINARY_UFUNCS[op], *alts)[0])
        return result

    def _fold(self, op: str, x: Any, y: Any) -> Value:
        try:
            value = _PY_BINARY[op](x, y)
        except ZeroDivisionError as exc:
            raise RuleError(f"{x!r} {op} {y!r}: {exc}", ZeroDivisionError) from None
        except (TypeError, ValueError, OverflowError) as exc:
            raise RuleError(f"{x!r} {op} {y!r}: {exc}", type(exc)) from None
        return self.constant(value)

    def _python_kind(self, op: str, a: VType, b: VType) -> tuple[int, np.dtype]:
        """Python's result rank (0 bool ... 3 complex) and the dtype computing it."""
        ra, rb = _PY_RANK[a.kind], _PY_RANK[b.kind]
        rank = max(ra, rb)
        if op in ("&", "|", "^"):
            if rank > 1:
                raise RuleError(f"Python's '{op}' does not take {a.describe()} and "
                                f"{b.describe()}")
            return rank, _PY_STORAGE[rank]
        if op in ("<<", ">>"):
            if rank > 1:
                raise RuleError(f"Python's '{op}' does not take {a.describe()} and "
                                f"{b.describe()}")
            return 1, _INT64
        if op in ("//", "%") and rank == 3:
            raise RuleError(f"Python's '{op}' does not take complex numbers")
        if op == "/":
            rank = max(rank, 2)
        rank = max(rank, 1)
        return rank, _PY_STORAGE[rank]

    def _python_binary(self, op: str, a: Value, b: Value) -> Value:
        """Two Python numbers, at least one not a constant: Python's rules, in 64 bits."""
        if _UINT64 in (a.vt.dtype, b.vt.dtype):
            raise RuleError("a Python integer above 2**63 - 1 in arithmetic with another "
                            "Python number: numba computes Python integers in 64 bits")
        if op == "**":
            return self._python_power(a, b)
        rank, dtype = self._python_kind(op, a.vt, b.vt)
        if op in ("&", "|", "^") and rank == 0:
            return Value(f"({a.expr} {op} {b.expr})", VType(_BOOL, weak=True,
                                                           call=_call(op, a.vt, b.vt)))
        x = self.convert(a, dtype)
        y = self.convert(b, dtype)
        s = _suffix(dtype)
        if op in ("<<", ">>"):
            name = "left_shift_signed" if op == "<<" else "right_shift_signed"
            expr = f"_nr_{name}({x}, {y}, 64)"
        elif dtype.kind == "i":
            expr = {"//": f"_nr_floor_divide_signed({x}, {y})",
                    "%": f"_nr_remainder_signed({x}, {y})"}.get(op, f"_nr_i8({x} {op} {y})")
            if op in ("+", "-", "*"):
                expr = f"_nr_i8({_wrapping(x, op, y)})"
        elif op == "*":
            expr = f"_nr_multiply_{s}({x}, {y})"
        elif op in ("//", "%"):
            expr = f"_nr_{'floor_divide' if op == '//' else 'remainder'}_{s}({x}, {y})"
        elif op == "/" and dtype.kind == "c":
            expr = f"_nr_divide_python_c16({x}, {y})"
        else:
            expr = f"({x} {op} {y})"
        bounds = _binary_bounds(op, a.vt, b.vt) if dtype.kind == "i" else None
        return Value(expr, VType(dtype, weak=True, bounds=bounds, call=_call(op, a.vt, b.vt)))

    def _python_power(self, a: Value, b: Value) -> Value:
        exp = b.vt.const
        if exp is UNKNOWN or isinstance(exp, complex) or exp != int(exp):
            raise RuleError(
                "'**' of two Python numbers with an exponent that is not a constant integer: "
                "Python's result type depends on the values (2 ** -1 is a float, "
                "(-8.0) ** 0.5 a complex); use math.pow(x, y) or make one side a NumPy value")
        rank = max(_PY_RANK[a.vt.kind], 1)
        if rank == 3:
            if abs(exp) > 100:
                raise RuleError("'**' of a Python complex number to a power above 100 is not "
                                "supported")
            x = self.convert(a, _COMPLEX128)
            return Value(f"_nr_power_python_c16({x}, {int(exp)})",
                         VType(_COMPLEX128, weak=True, call=_call("**", a.vt, b.vt)))
        if rank == 1 and exp >= 0:
            return Value(f"_nr_i8(_nr_power_integer(_nr_u8({a.expr}), {int(exp)}))",
                         VType(_INT64, weak=True, bounds=_power_bounds(a.vt, int(exp)),
                               call=_call("**", a.vt, b.vt)))
        x = self.convert(a, _FLOAT64)
        if exp == 2:
            return Value(f"_nr_multiply_f8({x}, {x})", VType(_FLOAT64, weak=True))
        return Value(f"({x} ** {literal(float(exp))})", VType(_FLOAT64, weak=True))

    def _numpy_binary(self, op: str, a: Value, b: Value) -> tuple[Value, np.dtype]:
        ufunc = _BINARY_UFUNCS[op]
        la, lb, out = _resolve(ufunc, a.vt, b.vt)
        if (la.kind == "f" and la.itemsize == 2) or (out.kind == "f" and out.itemsize == 2):
            raise RuleError(f"NumPy computes '{op}' of {a.vt.describe()} and {b.vt.describe()} "
                            "in float16, which numba's CPU target does not have; convert to "
                            "float32 first")
        what = f"the operand of '{op}'"
        x = self.convert(a, la, what=what)
        y = self.convert(b, lb, what=what)
        t = la
        s = _suffix(t)
        cast = cast_name(out)
        k = t.kind
        if op in ("+", "-", "*", "&", "|", "^"):
            if k == "c" and op == "*":
                # NumPy's array loop, not its scalar product: what NumPy computes on arrays.
                expr = f"_nr_multiply_array_{s}({x}, {y})"
            elif k == "f" and op == "*":
                expr = f"_nr_multiply_{s}({x}, {y})"
            elif k in "fc":
                expr = f"({x} {op} {y})"
            elif k in "iu" and op in ("+", "-", "*"):
                expr = f"{cast}({_wrapping(x, op, y)})"
            else:
                expr = f"{cast}({x} {op} {y})"
        elif op == "/":
            expr = f"_nr_divide_{s}({x}, {y})" if k == "c" else f"({x} / {y})"
        elif op in ("//", "%"):
            name = "floor_divide" if op == "//" else "remainder"
            if k == "f":
                expr = f"_nr_{name}_{s}({x}, {y})"
            else:
                sign, wide = _integer_helper(k)
                expr = f"{cast}(_nr_{name}_{sign}({wide}({x}), {wide}({y})))"
        elif op == "**":
            expr = self._numpy_power(a, b, t, x, y)
        else:  # shifts
            name = "left_shift" if op == "<<" else "right_shift"
            sign, wide = _integer_helper(k)
            expr = f"{cast}(_nr_{name}_{sign}({wide}({x}), {wide}({y}), {8 * t.itemsize}))"
        return Value(expr, VType(out)), t

    def _numpy_power(self, a: Value, b: Value, t: np.dtype, x: str, y: str) -> str:
        cast = cast_name(t)
        if t.kind in "iu":
            exp = b.vt
            if exp.weak and exp.const is not UNKNOWN:
                if exp.const < 0:
                    raise RuleError("Integers to negative integer powers are not allowed.",
                                    ValueError)
            elif exp.weak and exp.call is not None:
                self.call_checks.append((exp.call, 0, math.inf, ValueError,
                                         "Integers to negative integer powers are not allowed."))
            elif exp.kind not in "ub":
                raise RuleError(
                    f"'**' with {exp.describe()} exponent: NumPy raises ValueError for negative "
                    "integer exponents, which a kernel cannot do; use an unsigned exponent "
                    "(np.uint8(...)) or a float")
            return f"{cast}(_nr_power_integer(_nr_u8({x}), _nr_u8({y})))"
        if t.kind == "f" and b.vt.const is not UNKNOWN and b.vt.const == 2:
            return f"_nr_multiply_{_suffix(t)}({x}, {x})"
        if t.kind == "c":
            return f"_nr_power_{_suffix(t)}({x}, {y})"
        return f"{cast}({x} ** {y})"

    # ---- comparisons -----------------------------------------------------------------------
    def compare(self, op: str, a: Value, b: Value) -> Value:
        """``a op b`` for a comparison operator; NumPy's bool (Python's, for two numbers)."""
        if a.vt.weak and b.vt.weak:
            if a.vt.const is not UNKNOWN and b.vt.const is not UNKNOWN:
                try:
                    return self.constant(bool(_PY_COMPARE[op](a.vt.const, b.vt.const)))
                except TypeError as exc:
                    raise RuleError(str(exc)) from None
            rank = max(_PY_RANK[a.vt.kind], _PY_RANK[b.vt.kind])
            if rank == 3 and op not in ("==", "!="):
                raise RuleError("Python does not order complex numbers")
            call = _call(op, a.vt, b.vt)
            if rank <= 1:
                return Value(self._int_compare(op, a, b), VType(_BOOL, weak=True, call=call))
            dtype = _PY_STORAGE[rank]
            return Value(f"({self.convert(a, dtype)} {op} {self.convert(b, dtype)})",
                         VType(_BOOL, weak=True, call=call))
        if self._integral(a.vt) and self._integral(b.vt) and (a.vt.weak or b.vt.weak):
            # NumPy compares a Python integer with any integer exactly, in range or not.
            expr = self._int_compare(op, a, b)
        else:
            la, lb, _ = _resolve(_COMPARE_UFUNCS[op], a.vt, b.vt)
            x = self.convert(a, la)
            y = self.convert(b, lb)
            if la != lb:  # NumPy's exact int64/uint64 loops
                expr = self._int_compare(op, Value(x, VType(la)), Value(y, VType(lb)))
            elif la.kind == "c" and op not in ("==", "!="):
                s = _suffix(la)
                if op in ("<", "<="):
                    expr = f"_nr_{'less' if op == '<' else 'less_equal'}_{s}({x}, {y})"
                else:
                    expr = f"_nr_{'less' if op == '>' else 'less_equal'}_{s}({y}, {x})"
            else:
                expr = f"({x} {op} {y})"
        alts = self._alts((a, b))
        if alts is not None:
            self._check_alt(f"'{op}'", (a, b), self._compare_domain(op, a.vt, b.vt),
                            self._compare_domain(op, *alts))
        return Value(expr, VType(_BOOL))

    def _compare_domain(self, op: str, a: VType, b: VType) -> str:
        """What a comparison computes in: "exact" for integers, else the loop's dtype."""
        if self._integral(a) and self._integral(b) and (a.weak or b.weak):
            return "exact"
        if a.weak and b.weak:
            rank = max(_PY_RANK[a.kind], _PY_RANK[b.kind])
            return "exact" if rank <= 1 else str(_PY_STORAGE[rank])
        la, lb, _ = _resolve(_COMPARE_UFUNCS[op], a, b)
        return "exact" if la.kind in "iub" and lb.kind in "iub" else str(la)

    @staticmethod
    def _integral(vt: VType) -> bool:
        return vt.kind in "iu" or (vt.kind == "b" and vt.weak)

    def _int_compare(self, op: str, a: Value, b: Value) -> str:
        """Exact comparison of two integers of any signedness and width."""
        big_a = a.vt.dtype == _UINT64
        big_b = b.vt.dtype == _UINT64
        if big_a and big_b:
            return f"(_nr_u8({a.expr}) {op} _nr_u8({b.expr}))"
        if not big_a and not big_b:
            return f"(_nr_i8({a.expr}) {op} _nr_i8({b.expr}))"
        if big_b:
            return f"(_nr_compare_signed_unsigned({a.expr}, {b.expr}) {op} 0)"
        return f"(_nr_compare_signed_unsigned({b.expr}, {a.expr}) {_SWAPPED[op]} 0)"

    # ---- unary ---------------------------------------------------------------------------
    def unary(self, op: str, a: Value) -> Value:
        """``-a``, ``+a``, ``~a``."""
        vt = a.vt
        if vt.weak:
            if vt.const is not UNKNOWN:
                try:
                    return self.constant({"-": operator.neg, "+": operator.pos,
                                          "~": operator.invert}[op](vt.const))
                except TypeError as exc:
                    raise RuleError(str(exc)) from None
            if vt.dtype == _UINT64:
                raise RuleError("a Python integer above 2**63 - 1 in arithmetic: numba "
                                "computes Python integers in 64 bits")
            if op == "~":
                if vt.kind not in "iu":
                    raise RuleError(f"Python's '~' does not take {vt.describe()}")
                return Value(f"(~{a.expr})", VType(_INT64, weak=True))
            bounds = _unary_bounds(op, vt) if op == "-" else int_bounds(vt)
            if vt.kind == "b":
                return Value(f"({op}_nr_i8({a.expr}))", VType(_INT64, weak=True, bounds=bounds,
                                                             call=_call(op, vt)))
            return Value(f"({op}{a.expr})", replace(vt, const=UNKNOWN, call=_call(op, vt),
                                                    bounds=bounds if vt.kind in "iu" else None))
        ufunc = {"-": np.negative, "+": np.positive, "~": np.invert}[op]
        try:
            loop, out = ufunc.resolve_dtypes((vt.dtype, None))
        except TypeError as exc:
            raise RuleError(f"NumPy's {ufunc.__name__} does not take {vt.dtype} ({exc})") from None
        if op == "+":
            expr = a.expr
        elif vt.kind == "b":
            expr = f"(not {a.expr})"
        elif vt.kind in "iu":
            expr = f"{cast_name(out)}({op}_nr_u8({a.expr}))"  # in 64 bits, then wrapped
        else:
            expr = f"({op}{a.expr})"
        alt = vt.alt
        return Value(expr, VType(out, alt=alt if alt is not None and op != "~" else None,
                                 origin=vt.origin))

    def truth(self, a: Value) -> str:
        """A bool expression: what ``if a:`` tests (nonzero; nan is true)."""
        vt = a.vt
        if vt.const is not UNKNOWN:
            return repr(bool(vt.const))
        if vt.kind == "b":
            return a.expr
        if vt.kind == "c":
            return f"_nr_truth_{_suffix(vt.dtype)}({a.expr})"
        return f"({a.expr} != 0)"

    def logical_not(self, a: Value) -> Value:
        return Value(f"(not {self.truth(a)})", VType(_BOOL, weak=True))

    # ---- attributes and calls --------------------------------------------------------------
    def attribute(self, a: Value, name: str) -> Value:
        """``a.real`` or ``a.imag``."""
        vt = a.vt
        if name not in ("real", "imag"):
            raise RuleError(f"attribute .{name} of a number is not supported (.real, .imag are)")
        if vt.kind == "c":
            part = np.dtype(f"f{vt.dtype.itemsize // 2}")
            if vt.const is not UNKNOWN:
                return self.constant(getattr(vt.const, name))
            return Value(f"({a.expr}).{name}", VType(part, weak=vt.weak))
        if name == "real":
            return a
        if vt.weak:
            return self.constant(0.0 if vt.kind == "f" else 0)
        return Value(f"{cast_name(vt.dtype)}(0)", VType(vt.dtype))

    def conjugate(self, a: Value) -> Value:
        if a.vt.kind == "c":
            return Value(f"({a.expr}).conjugate()", replace(a.vt, const=UNKNOWN, call=None))
        return a

    def absolute(self, a: Value) -> Value:
        """``abs(a)``: NumPy's absolute (integers wrap: abs of int8 -128 is -128), Python's for
        Python numbers."""
        vt = a.vt
        if vt.weak and vt.const is not UNKNOWN:
            return self.constant(abs(vt.const))
        if vt.kind == "c":
            real = np.dtype(f"f{vt.dtype.itemsize // 2}")
            return Value(f"_nr_absolute_{_suffix(vt.dtype)}({a.expr})", VType(real, weak=vt.weak))
        if vt.weak:
            dtype = _INT64 if vt.kind == "b" else vt.dtype
            if dtype == _UINT64:
                return a
            bounds = _unary_bounds("abs", vt) if dtype.kind == "i" else None
            return Value(f"abs({self.convert(a, dtype)})", VType(dtype, weak=True, bounds=bounds,
                                                                call=_call("abs", vt)))
        if vt.kind in "ub":
            return a
        if vt.kind == "i":  # in 64 bits, then wrapped: abs of int8 -128 is -128
            return Value(f"{cast_name(vt.dtype)}(abs(_nr_i8({a.expr})))", VType(vt.dtype))
        return Value(f"{cast_name(vt.dtype)}(abs({a.expr}))", VType(vt.dtype))

    def python_number(self, kind: str, args: list[Value]) -> Value:
        """``float(x)``, ``int(x)``, ``complex(x[, y])``, ``bool(x)``: Python numbers."""
        if kind == "bool":
            (a,) = args
            return Value(self.truth(a), VType(_BOOL, weak=True))
        if all(v.vt.const is not UNKNOWN for v in args):
            builtin = {"float": float, "int": int, "complex": complex}[kind]
            try:
                return self.constant(builtin(*(v.vt.const for v in args)))
            except (TypeError, ValueError, OverflowError) as exc:
                raise RuleError(f"{kind}(...): {exc}", type(exc)) from None
        if kind == "complex":
            if len(args) == 2:
                if any(v.vt.kind == "c" for v in args):
                    raise RuleError("complex(re, im) with a complex argument is not supported")
                re, im = (self.convert(v, _FLOAT64, astype=True) for v in args)
                return Value(f"complex({re}, {im})", VType(_COMPLEX128, weak=True))
            (a,) = args
            return Value(self.convert(a, _COMPLEX128, astype=True), VType(_COMPLEX128, weak=True))
        (a,) = args
        if a.vt.kind == "c":
            raise RuleError(f"{kind}() of a complex number: Python raises TypeError")
        if kind == "float":
            return Value(self.convert(a, _FLOAT64, astype=True), VType(_FLOAT64, weak=True))
        # int(): truncates a float toward zero; an integer keeps its value (uint64 as uint64).
        call = _call("int", a.vt) if a.vt.weak else None
        if a.vt.dtype == _UINT64:
            return Value(a.expr, VType(_UINT64, weak=True, call=call))
        return Value(f"_nr_i8({a.expr})", VType(_INT64, weak=True, call=call))

    def numpy_cast(self, dtype: np.dtype, a: Value) -> Value:
        """``np.float32(x)`` and the like: NumPy's conversion of a scalar."""
        _check_supported(dtype, f"np.{dtype.name}(...)")
        if dtype.kind == "b":
            return Value(self.truth(a), VType(_BOOL))
        if a.vt.kind == "c" and dtype.kind != "c":
            raise RuleError(f"np.{dtype.name}() of a complex number (take .real first)")
        if a.vt.weak and a.vt.kind in "iu" and dtype.kind in "iu":
            self._check_python_int(a, dtype, f"np.{dtype.name}(...) of a Python integer")
        return Value(self.convert(a, dtype, astype=True), VType(dtype))

    def math_call(self, name: str, args: list[Value]) -> Value:
        """``math.<name>(...)``: arguments as Python floats, a Python number back."""
        spec = _MATH.get(name)
        if spec is None:
            raise RuleError(f"math.{name} is not supported in elementwise functions "
                            f"(supported: {', '.join(sorted(_MATH))})")
        nargs, result = spec
        if len(args) != nargs:
            raise RuleError(f"math.{name} takes {nargs} argument(s), got {len(args)}")
        converted = []
        for i, v in enumerate(args):
            if v.vt.kind == "c":
                raise RuleError(f"math.{name} of a complex number (Python raises TypeError; "
                                "use cmath)")
            if name == "ldexp" and i == 1:
                if v.vt.kind not in "iub":
                    raise RuleError("math.ldexp takes an integer exponent")
                converted.append(f"_nr_i8({v.expr})")
            else:
                converted.append(self.convert(v, _FLOAT64, astype=True))
        dtype = {"float": _FLOAT64, "int": _INT64, "bool": _BOOL}[result]
        call = _call(f"math.{name}", *(v.vt for v in args))
        return Value(f"math.{name}({', '.join(converted)})", VType(dtype, weak=True, call=call))

    def cmath_call(self, name: str, args: list[Value]) -> Value:
        """``cmath.<name>(x)``: the argument as a Python complex, a Python number back."""
        result = _CMATH.get(name)
        if result is None:
            raise RuleError(f"cmath.{name} is not supported in elementwise functions "
                            f"(supported: {', '.join(sorted(_CMATH))})")
        if len(args) != 1:
            raise RuleError(f"cmath.{name} takes one argument, got {len(args)}")
        x = self.convert(args[0], _COMPLEX128, astype=True)
        dtype = _COMPLEX128 if result == "complex" else _BOOL
        return Value(f"cmath.{name}({x})", VType(dtype, weak=True))

    def ufunc_call(self, ufunc: np.ufunc, args: list[Value]) -> Value:
        """``np.<ufunc>(...)`` on scalars: NumPy's loop; a NumPy scalar back."""
        name = ufunc.__name__
        if len(args) != ufunc.nin:
            raise RuleError(f"np.{name} takes {ufunc.nin} argument(s) here, got {len(args)}")
        if name in _UFUNC_OPERATORS:
            op = _UFUNC_OPERATORS[name]
            if ufunc.nin == 2:
                if op in _COMPARE_UFUNCS:
                    result = self.compare(op, *args)
                else:
                    result = self.binary(op, *args)
                return self._strong(result)
            if op == "abs":
                return self._strong(self.absolute(args[0]))
            return self._strong(self.unary(op, args[0]))
        if name not in _UFUNC_MATH and name not in _UFUNC_HELPERS:
            supported = sorted({*_UFUNC_MATH, *_UFUNC_HELPERS, *_UFUNC_OPERATORS})
            raise RuleError(f"np.{name} is not supported in elementwise functions "
                            f"(supported: {', '.join(supported)})")
        loop = _resolve(ufunc, *(v.vt for v in args))
        ins, out = loop[:-1], loop[-1]
        if any(d.kind == "f" and d.itemsize == 2 for d in loop):
            raise RuleError(f"NumPy computes np.{name} of "
                            f"{' and '.join(v.vt.describe() for v in args)} in float16, which "
                            "numba's CPU target does not have; convert to float32 first "
                            f"(np.{name}(np.float32(x)))")
        if any(d.kind == "c" for d in loop) and name not in ("isnan", "isinf", "isfinite"):
            raise RuleError(f"np.{name} of complex numbers is not supported (use cmath)")
        xs = [self.convert(v, d, what=f"the argument of np.{name}") for v, d in zip(args, ins)]
        if name in _UFUNC_HELPERS:
            if ins[0].kind in "iub":
                if name in ("isnan", "isinf"):
                    return Value("False", VType(_BOOL))
                if name == "isfinite":
                    return Value("True", VType(_BOOL))
                op = {"maximum": ">=", "fmax": ">=", "minimum": "<=", "fmin": "<="}[name]
                return Value(f"({xs[0]} if {xs[0]} {op} {xs[1]} else {xs[1]})", VType(out))
            if name in ("isnan", "isinf", "isfinite"):
                if ins[0].kind == "c":
                    parts = [f"math.{name}(({xs[0]}).{p})" for p in ("real", "imag")]
                    joiner = " and " if name == "isfinite" else " or "
                    return Value(f"({joiner.join(parts)})", VType(_BOOL))
                return Value(f"math.{name}({xs[0]})", VType(_BOOL))
            return Value(f"_nr_{name}_{_suffix(ins[0])}({', '.join(xs)})", VType(out))
        if ins[0].kind in "iub":  # floor, ceil, trunc of integers keep them
            return Value(xs[0], VType(out))
        if name in ("floor", "ceil", "trunc"):  # math.floor would give an int
            return Value(f"_nr_{name}_{_suffix(ins[0])}({xs[0]})", VType(out))
        return Value(f"{cast_name(out)}(math.{_UFUNC_MATH[name]}({', '.join(xs)}))", VType(out))

    @staticmethod
    def _strong(v: Value) -> Value:
        """NumPy's ufuncs give NumPy scalars, also from Python numbers."""
        if not v.vt.weak:
            return v
        return Value(f"{cast_name(v.vt.dtype)}({v.expr})", VType(v.vt.dtype))


def _wrapping(x: str, op: str, y: str) -> str:
    """``x op y`` (+, - or *) of integers, modulo 2**64: in unsigned 64-bit arithmetic, whose
    overflow is defined (numba marks signed integer arithmetic as not overflowing, so that
    LLVM and NVVM may assume it does not), to be converted to the loop's type, which keeps the
    low bits as NumPy's wrapping does."""
    return f"_nr_u8({x}) {op} _nr_u8({y})"


def _integer_helper(kind: str) -> tuple[str, str]:
    """The integer helpers' variant for a loop of this kind, and the conversion of its operands:
    64 bits wide, so that each helper is compiled once, not once per pair of integer types."""
    return ("signed", "_nr_i8") if kind == "i" else ("unsigned", "_nr_u8")


def _call(op: str, *vts: VType) -> str | None:
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
    if len(parts) == 2 and (op in _PY_BINARY or op in _PY_COMPARE):
        return f"({parts[0]} {op} {parts[1]})"
    if len(parts) == 1 and op in ("-", "+", "~"):
        return f"({op}{parts[0]})"
    return f"{op}({', '.join(parts)})"


def _check_supported(dtype: np.dtype, what: str) -> None:
    if dtype.kind == "f" and dtype.itemsize == 2:
        raise RuleError(f"{what}: float16 is not supported (numba's CPU target has no float16)")
    if dtype.kind not in "biufc" or dtype.itemsize > 16 or (dtype.kind == "f"
                                                             and dtype.itemsize > 8):
        raise RuleError(f"{what}: dtype {dtype} is not supported")


#: math functions: (number of arguments, result: "float", "int" or "bool"). Those that numba
#: compiles both for the CPU and for CUDA.
_MATH: dict[str, tuple[int, str]] = {
    **{name: (1, "float") for name in (
        "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "sin", "sinh", "tan",
        "tanh", "exp", "expm1", "log", "log10", "log1p", "log2", "sqrt", "fabs", "erf", "erfc",
        "gamma", "lgamma", "degrees", "radians")},
    **{name: (2, "float") for name in ("atan2", "hypot", "copysign", "pow", "ldexp")},
    **{name: (1, "int") for name in ("floor", "ceil", "trunc")},
    **{name: (1, "bool") for name in ("isnan", "isinf", "isfinite")},
}
#: cmath functions numba compiles for the CPU and CUDA: result "complex" or "bool".
_CMATH: dict[str, str] = {
    **{name: "complex" for name in ("acos", "asin", "asinh", "atan", "atanh", "cos", "exp",
                                     "log", "sin", "sqrt", "tan")},
    **{name: "bool" for name in ("isnan", "isinf", "isfinite")},
}
#: NumPy ufuncs that are operators.
_UFUNC_OPERATORS = {
    "add": "+", "subtract": "-", "multiply": "*", "divide": "/", "true_divide": "/",
    "floor_divide": "//", "remainder": "%", "power": "**", "bitwise_and": "&",
    "bitwise_or": "|", "bitwise_xor": "^", "left_shift": "<<", "right_shift": ">>",
    "less": "<", "less_equal": "<=", "greater": ">", "greater_equal": ">=", "equal": "==",
    "not_equal": "!=", "negative": "-", "positive": "+", "invert": "~", "absolute": "abs",
}
#: NumPy ufuncs computed by the math function of their loop's precision.
_UFUNC_MATH = {
    "sqrt": "sqrt", "exp": "exp", "expm1": "expm1", "log": "log", "log2": "log2",
    "log10": "log10", "log1p": "log1p", "sin": "sin", "cos": "cos", "tan": "tan",
    "arcsin": "asin", "arccos": "acos", "arctan": "atan", "sinh": "sinh", "cosh": "cosh",
    "tanh": "tanh", "arcsinh": "asinh", "arccosh": "acosh", "arctanh": "atanh",
    "floor": "floor", "ceil": "ceil", "trunc": "trunc", "fabs": "fabs", "arctan2": "atan2",
    "hypot": "hypot", "copysign": "copysign",
}
#: NumPy ufuncs with a helper of their own (nan handling).
_UFUNC_HELPERS = ("maximum", "minimum", "fmax", "fmin", "isnan", "isinf", "isfinite")
