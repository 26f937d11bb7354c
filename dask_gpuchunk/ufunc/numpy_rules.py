"""NumPy's rules for the values of a scalar function: types, promotion, and the code computing them.

A user's elementwise function, called on NumPy scalars, computes by NumPy's rules: ``int8 *
int8`` is an ``int8`` that wraps, ``uint8 + uint8`` wraps before ``/ 2``, a Python number is
"weak" (NEP 50: ``float32 * 0.1`` stays ``float32``), ``int8 * uint64`` is ``float64``.
numba compiles the same function by its own rules (small integers widened to 64 bits, Python
numbers as ``float64``/``int64``, signed and unsigned mixed into ``int64``), so its values
differ. :mod:`dask_gpuchunk.ufunc.translate` walks the function; for each operation it asks
the :class:`Emitter` here for code whose types are explicit, so that numba (or numba's CUDA
target) computes exactly what NumPy computes.

Types: a value is a NumPy scalar of a dtype (strong) or a Python number (weak: bool, int,
float, complex, held as bool/int64/float64/complex128; an int above 2**63 - 1 as uint64).
NumPy's own ``ufunc.resolve_dtypes`` decides each strong operation's loop; operations between
two Python numbers follow Python's rules (64-bit integers). What cannot follow NumPy raises
:class:`RuleError` (the translator adds where it was).

Emitted code calls the helpers of :mod:`dask_gpuchunk.ufunc.numpy_ops` (``_nr_...``). The
values and their types are in :mod:`~dask_gpuchunk.ufunc.numpy_values` (its public names
stay importable from here); the calls (number types, ``math``, ``cmath``, ufuncs) in
:mod:`~dask_gpuchunk.ufunc.numpy_calls`, a base class of :class:`Emitter`. No dask here.
"""

from __future__ import annotations

import math
import operator
from dataclasses import replace
from typing import Any

import numpy as np

from .numpy_calls import Calls
from .numpy_ops import cast_name
from .numpy_values import (
    BINARY_UFUNCS, BOOL, COMPARE_UFUNCS, COMPLEX128, FLOAT64, INT64, PY_BINARY, PY_COMPARE,
    PY_RANK, PY_STORAGE, RuleError, SWAPPED, UINT64, UNKNOWN, VType, Value, binary_bounds,
    check_supported, exactly, int_bounds, integer_helper, known_call, literal, power_bounds,
    resolve, suffix, unary_bounds, weak_type, wrapping
)

__all__ = ["UNKNOWN", "Emitter", "RuleError", "VType", "Value", "int_bounds", "weak_type"]


class Emitter(Calls):
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
        check_supported(dtype, f"the constant {value!r}")
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
            return VType(INT64, weak=True, bounds=bounds)
        if a.weak != b.weak:
            weak, strong = (a, b) if a.weak else (b, a)
            if strong.alt is not None and strong.alt.kind == weak.kind:
                return replace(strong, const=UNKNOWN, call=None)
            same_storage = weak.dtype == strong.dtype
            exact_const = (weak.const is not UNKNOWN
                           and resolve(np.add, strong, weak)[2] == strong.dtype
                           and exactly(weak.const, strong.dtype))
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
        return all(v.dtype == INT64 or (v.const is not UNKNOWN and v.const < 2**63)
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
        self._check_alt(f"'{op}'", (a, b), loop, resolve(BINARY_UFUNCS[op], *alts)[0])
        return result

    def _fold(self, op: str, x: Any, y: Any) -> Value:
        try:
            value = PY_BINARY[op](x, y)
        except ZeroDivisionError as exc:
            raise RuleError(f"{x!r} {op} {y!r}: {exc}", ZeroDivisionError) from None
        except (TypeError, ValueError, OverflowError) as exc:
            raise RuleError(f"{x!r} {op} {y!r}: {exc}", type(exc)) from None
        return self.constant(value)

    def _python_kind(self, op: str, a: VType, b: VType) -> tuple[int, np.dtype]:
        """Python's result rank (0 bool ... 3 complex) and the dtype computing it."""
        ra, rb = PY_RANK[a.kind], PY_RANK[b.kind]
        rank = max(ra, rb)
        if op in ("&", "|", "^"):
            if rank > 1:
                raise RuleError(f"Python's '{op}' does not take {a.describe()} and "
                                f"{b.describe()}")
            return rank, PY_STORAGE[rank]
        if op in ("<<", ">>"):
            if rank > 1:
                raise RuleError(f"Python's '{op}' does not take {a.describe()} and "
                                f"{b.describe()}")
            return 1, INT64
        if op in ("//", "%") and rank == 3:
            raise RuleError(f"Python's '{op}' does not take complex numbers")
        if op == "/":
            rank = max(rank, 2)
        rank = max(rank, 1)
        return rank, PY_STORAGE[rank]

    def _python_binary(self, op: str, a: Value, b: Value) -> Value:
        """Two Python numbers, at least one not a constant: Python's rules, in 64 bits."""
        if UINT64 in (a.vt.dtype, b.vt.dtype):
            raise RuleError("a Python integer above 2**63 - 1 in arithmetic with another "
                            "Python number: numba computes Python integers in 64 bits")
        if op == "**":
            return self._python_power(a, b)
        rank, dtype = self._python_kind(op, a.vt, b.vt)
        if op in ("&", "|", "^") and rank == 0:
            return Value(f"({a.expr} {op} {b.expr})", VType(BOOL, weak=True,
                                                           call=known_call(op, a.vt, b.vt)))
        x = self.convert(a, dtype)
        y = self.convert(b, dtype)
        s = suffix(dtype)
        if op in ("<<", ">>"):
            name = "left_shift_signed" if op == "<<" else "right_shift_signed"
            expr = f"_nr_{name}({x}, {y}, 64)"
        elif dtype.kind == "i":
            expr = {"//": f"_nr_floor_divide_signed({x}, {y})",
                    "%": f"_nr_remainder_signed({x}, {y})"}.get(op, f"_nr_i8({x} {op} {y})")
            if op in ("+", "-", "*"):
                expr = f"_nr_i8({wrapping(x, op, y)})"
        elif op == "*":
            expr = f"_nr_multiply_{s}({x}, {y})"
        elif op in ("//", "%"):
            expr = f"_nr_{'floor_divide' if op == '//' else 'remainder'}_{s}({x}, {y})"
        elif op == "/" and dtype.kind == "c":
            expr = f"_nr_divide_python_c16({x}, {y})"
        else:
            expr = f"({x} {op} {y})"
        bounds = binary_bounds(op, a.vt, b.vt) if dtype.kind == "i" else None
        return Value(expr, VType(dtype, weak=True, bounds=bounds, call=known_call(op, a.vt, b.vt)))

    def _python_power(self, a: Value, b: Value) -> Value:
        exp = b.vt.const
        if exp is UNKNOWN or isinstance(exp, complex) or exp != int(exp):
            raise RuleError(
                "'**' of two Python numbers with an exponent that is not a constant integer: "
                "Python's result type depends on the values (2 ** -1 is a float, "
                "(-8.0) ** 0.5 a complex); use math.pow(x, y) or make one side a NumPy value")
        rank = max(PY_RANK[a.vt.kind], 1)
        if rank == 3:
            if abs(exp) > 100:
                raise RuleError("'**' of a Python complex number to a power above 100 is not "
                                "supported")
            x = self.convert(a, COMPLEX128)
            return Value(f"_nr_power_python_c16({x}, {int(exp)})",
                         VType(COMPLEX128, weak=True, call=known_call("**", a.vt, b.vt)))
        if rank == 1 and exp >= 0:
            return Value(f"_nr_i8(_nr_power_integer(_nr_u8({a.expr}), {int(exp)}))",
                         VType(INT64, weak=True, bounds=power_bounds(a.vt, int(exp)),
                               call=known_call("**", a.vt, b.vt)))
        x = self.convert(a, FLOAT64)
        if exp == 2:
            return Value(f"_nr_multiply_f8({x}, {x})", VType(FLOAT64, weak=True))
        return Value(f"({x} ** {literal(float(exp))})", VType(FLOAT64, weak=True))

    def _numpy_binary(self, op: str, a: Value, b: Value) -> tuple[Value, np.dtype]:
        ufunc = BINARY_UFUNCS[op]
        la, lb, out = resolve(ufunc, a.vt, b.vt)
        if (la.kind == "f" and la.itemsize == 2) or (out.kind == "f" and out.itemsize == 2):
            raise RuleError(f"NumPy computes '{op}' of {a.vt.describe()} and {b.vt.describe()} "
                            "in float16, which numba's CPU target does not have; convert to "
                            "float32 first")
        what = f"the operand of '{op}'"
        x = self.convert(a, la, what=what)
        y = self.convert(b, lb, what=what)
        t = la
        s = suffix(t)
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
                expr = f"{cast}({wrapping(x, op, y)})"
            else:
                expr = f"{cast}({x} {op} {y})"
        elif op == "/":
            expr = f"_nr_divide_{s}({x}, {y})" if k == "c" else f"({x} / {y})"
        elif op in ("//", "%"):
            name = "floor_divide" if op == "//" else "remainder"
            if k == "f":
                expr = f"_nr_{name}_{s}({x}, {y})"
            else:
                sign, wide = integer_helper(k)
                expr = f"{cast}(_nr_{name}_{sign}({wide}({x}), {wide}({y})))"
        elif op == "**":
            expr = self._numpy_power(a, b, t, x, y)
        else:  # shifts
            name = "left_shift" if op == "<<" else "right_shift"
            sign, wide = integer_helper(k)
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
            return f"_nr_multiply_{suffix(t)}({x}, {x})"
        if t.kind == "c":
            return f"_nr_power_{suffix(t)}({x}, {y})"
        return f"{cast}({x} ** {y})"

    # ---- comparisons -----------------------------------------------------------------------
    def compare(self, op: str, a: Value, b: Value) -> Value:
        """``a op b`` for a comparison operator; NumPy's bool (Python's, for two numbers)."""
        if a.vt.weak and b.vt.weak:
            if a.vt.const is not UNKNOWN and b.vt.const is not UNKNOWN:
                try:
                    return self.constant(bool(PY_COMPARE[op](a.vt.const, b.vt.const)))
                except TypeError as exc:
                    raise RuleError(str(exc)) from None
            rank = max(PY_RANK[a.vt.kind], PY_RANK[b.vt.kind])
            if rank == 3 and op not in ("==", "!="):
                raise RuleError("Python does not order complex numbers")
            call = known_call(op, a.vt, b.vt)
            if rank <= 1:
                return Value(self._int_compare(op, a, b), VType(BOOL, weak=True, call=call))
            dtype = PY_STORAGE[rank]
            return Value(f"({self.convert(a, dtype)} {op} {self.convert(b, dtype)})",
                         VType(BOOL, weak=True, call=call))
        if self._integral(a.vt) and self._integral(b.vt) and (a.vt.weak or b.vt.weak):
            # NumPy compares a Python integer with any integer exactly, in range or not.
            expr = self._int_compare(op, a, b)
        else:
            la, lb, _ = resolve(COMPARE_UFUNCS[op], a.vt, b.vt)
            x = self.convert(a, la)
            y = self.convert(b, lb)
            if la != lb:  # NumPy's exact int64/uint64 loops
                expr = self._int_compare(op, Value(x, VType(la)), Value(y, VType(lb)))
            elif la.kind == "c" and op not in ("==", "!="):
                s = suffix(la)
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
        return Value(expr, VType(BOOL))

    def _compare_domain(self, op: str, a: VType, b: VType) -> str:
        """What a comparison computes in: "exact" for integers, else the loop's dtype."""
        if self._integral(a) and self._integral(b) and (a.weak or b.weak):
            return "exact"
        if a.weak and b.weak:
            rank = max(PY_RANK[a.kind], PY_RANK[b.kind])
            return "exact" if rank <= 1 else str(PY_STORAGE[rank])
        la, lb, _ = resolve(COMPARE_UFUNCS[op], a, b)
        return "exact" if la.kind in "iub" and lb.kind in "iub" else str(la)

    @staticmethod
    def _integral(vt: VType) -> bool:
        return vt.kind in "iu" or (vt.kind == "b" and vt.weak)

    def _int_compare(self, op: str, a: Value, b: Value) -> str:
        """Exact comparison of two integers of any signedness and width."""
        big_a = a.vt.dtype == UINT64
        big_b = b.vt.dtype == UINT64
        if big_a and big_b:
            return f"(_nr_u8({a.expr}) {op} _nr_u8({b.expr}))"
        if not big_a and not big_b:
            return f"(_nr_i8({a.expr}) {op} _nr_i8({b.expr}))"
        if big_b:
            return f"(_nr_compare_signed_unsigned({a.expr}, {b.expr}) {op} 0)"
        return f"(_nr_compare_signed_unsigned({b.expr}, {a.expr}) {SWAPPED[op]} 0)"

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
            if vt.dtype == UINT64:
                raise RuleError("a Python integer above 2**63 - 1 in arithmetic: numba "
                                "computes Python integers in 64 bits")
            if op == "~":
                if vt.kind not in "iu":
                    raise RuleError(f"Python's '~' does not take {vt.describe()}")
                return Value(f"(~{a.expr})", VType(INT64, weak=True))
            bounds = unary_bounds(op, vt) if op == "-" else int_bounds(vt)
            if vt.kind == "b":
                return Value(f"({op}_nr_i8({a.expr}))", VType(INT64, weak=True, bounds=bounds,
                                                             call=known_call(op, vt)))
            return Value(f"({op}{a.expr})", replace(vt, const=UNKNOWN, call=known_call(op, vt),
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
            return f"_nr_truth_{suffix(vt.dtype)}({a.expr})"
        return f"({a.expr} != 0)"

    def logical_not(self, a: Value) -> Value:
        return Value(f"(not {self.truth(a)})", VType(BOOL, weak=True))

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
            return Value(f"_nr_absolute_{suffix(vt.dtype)}({a.expr})", VType(real, weak=vt.weak))
        if vt.weak:
            dtype = INT64 if vt.kind == "b" else vt.dtype
            if dtype == UINT64:
                return a
            bounds = unary_bounds("abs", vt) if dtype.kind == "i" else None
            return Value(f"abs({self.convert(a, dtype)})", VType(dtype, weak=True, bounds=bounds,
                                                                call=known_call("abs", vt)))
        if vt.kind in "ub":
            return a
        if vt.kind == "i":  # in 64 bits, then wrapped: abs of int8 -128 is -128
            return Value(f"{cast_name(vt.dtype)}(abs(_nr_i8({a.expr})))", VType(vt.dtype))
        return Value(f"{cast_name(vt.dtype)}(abs({a.expr}))", VType(vt.dtype))
