"""The calls of a translated scalar function by NumPy's rules: Python's number types
(``float(x)``, ``int(x)``, ...), NumPy's scalar types, ``math`` and ``cmath`` functions and NumPy
ufuncs, as methods of :class:`~dask_gpuchunk.ufunc.numpy_rules.Emitter` (a base class of
it; see that module). No dask here.
"""

from __future__ import annotations

import numpy as np

from .numpy_ops import cast_name
from .numpy_values import BOOL, COMPARE_UFUNCS, COMPLEX128, FLOAT64, INT64, RuleError, UINT64, UNKNOWN, VType, Value, check_supported, known_call, resolve, suffix

__all__ = ["Calls"]


class Calls:
    """The emitter's calls (they use the emitter's other methods:
    :class:`~dask_gpuchunk.ufunc.numpy_rules.Emitter` takes this class as its base)."""

    def python_number(self, kind: str, args: list[Value]) -> Value:
        """``float(x)``, ``int(x)``, ``complex(x[, y])``, ``bool(x)``: Python numbers."""
        if kind == "bool":
            (a,) = args
            return Value(self.truth(a), VType(BOOL, weak=True))
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
                re, im = (self.convert(v, FLOAT64, astype=True) for v in args)
                return Value(f"complex({re}, {im})", VType(COMPLEX128, weak=True))
            (a,) = args
            return Value(self.convert(a, COMPLEX128, astype=True), VType(COMPLEX128, weak=True))
        (a,) = args
        if a.vt.kind == "c":
            raise RuleError(f"{kind}() of a complex number: Python raises TypeError")
        if kind == "float":
            return Value(self.convert(a, FLOAT64, astype=True), VType(FLOAT64, weak=True))
        # int(): truncates a float toward zero; an integer keeps its value (uint64 as uint64).
        call = known_call("int", a.vt) if a.vt.weak else None
        if a.vt.dtype == UINT64:
            return Value(a.expr, VType(UINT64, weak=True, call=call))
        return Value(f"_nr_i8({a.expr})", VType(INT64, weak=True, call=call))

    def numpy_cast(self, dtype: np.dtype, a: Value) -> Value:
        """``np.float32(x)`` and the like: NumPy's conversion of a scalar."""
        check_supported(dtype, f"np.{dtype.name}(...)")
        if dtype.kind == "b":
            return Value(self.truth(a), VType(BOOL))
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
                converted.append(self.convert(v, FLOAT64, astype=True))
        dtype = {"float": FLOAT64, "int": INT64, "bool": BOOL}[result]
        call = known_call(f"math.{name}", *(v.vt for v in args))
        return Value(f"math.{name}({', '.join(converted)})", VType(dtype, weak=True, call=call))

    def cmath_call(self, name: str, args: list[Value]) -> Value:
        """``cmath.<name>(x)``: the argument as a Python complex, a Python number back."""
        result = _CMATH.get(name)
        if result is None:
            raise RuleError(f"cmath.{name} is not supported in elementwise functions "
                            f"(supported: {', '.join(sorted(_CMATH))})")
        if len(args) != 1:
            raise RuleError(f"cmath.{name} takes one argument, got {len(args)}")
        x = self.convert(args[0], COMPLEX128, astype=True)
        dtype = COMPLEX128 if result == "complex" else BOOL
        return Value(f"cmath.{name}({x})", VType(dtype, weak=True))

    def ufunc_call(self, ufunc: np.ufunc, args: list[Value]) -> Value:
        """``np.<ufunc>(...)`` on scalars: NumPy's loop; a NumPy scalar back."""
        name = ufunc.__name__
        if len(args) != ufunc.nin:
            raise RuleError(f"np.{name} takes {ufunc.nin} argument(s) here, got {len(args)}")
        if name in _UFUNC_OPERATORS:
            op = _UFUNC_OPERATORS[name]
            if ufunc.nin == 2:
                if op in COMPARE_UFUNCS:
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
        loop = resolve(ufunc, *(v.vt for v in args))
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
                    return Value("False", VType(BOOL))
                if name == "isfinite":
                    return Value("True", VType(BOOL))
                op = {"maximum": ">=", "fmax": ">=", "minimum": "<=", "fmin": "<="}[name]
                return Value(f"({xs[0]} if {xs[0]} {op} {xs[1]} else {xs[1]})", VType(out))
            if name in ("isnan", "isinf", "isfinite"):
                if ins[0].kind == "c":
                    parts = [f"math.{name}(({xs[0]}).{p})" for p in ("real", "imag")]
                    joiner = " and " if name == "isfinite" else " or "
                    return Value(f"({joiner.join(parts)})", VType(BOOL))
                return Value(f"math.{name}({xs[0]})", VType(BOOL))
            return Value(f"_nr_{name}_{suffix(ins[0])}({', '.join(xs)})", VType(out))
        if ins[0].kind in "iub":  # floor, ceil, trunc of integers keep them
            return Value(xs[0], VType(out))
        if name in ("floor", "ceil", "trunc"):  # math.floor would give an int
            return Value(f"_nr_{name}_{suffix(ins[0])}({xs[0]})", VType(out))
        return Value(f"{cast_name(out)}(math.{_UFUNC_MATH[name]}({', '.join(xs)}))", VType(out))

    @staticmethod
    def _strong(v: Value) -> Value:
        """NumPy's ufuncs give NumPy scalars, also from Python numbers."""
        if not v.vt.weak:
            return v
        return Value(f"{cast_name(v.vt.dtype)}({v.expr})", VType(v.vt.dtype))

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
