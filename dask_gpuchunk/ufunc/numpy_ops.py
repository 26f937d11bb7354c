"""Scalar operations with NumPy's results, for translated elementwise functions, per target.

:mod:`dask_gpuchunk.ufunc.numpy_rules` translates a user's scalar function into code where
every operation's types are explicit (``_nr_i1(_nr_i1(a) * _nr_i1(b))``). What numba's own
``//``, ``%``, ``<<``, ``**`` or complex ``/`` would not compute as NumPy does, and every
floating-point product, goes through a helper named here. :func:`namespace` binds those names
for one target:

``"cpu"``
    numba ``njit`` functions (numba inlines them into the kernel).
``"cuda"``
    numba CUDA device functions. Real products use libdevice's ``__nv_fmul_rn`` /
    ``__nv_dmul_rn``, which the compiler never fuses with an addition into one fused
    multiply-add (NVVM contracts ``a * b + c`` by default; NumPy rounds twice). Complex
    products of arrays are NumPy's array loop's (``_multiply_complex_array``: two products
    and two of libdevice's ``fma``, as NumPy's AVX2/AVX-512 and NEON loops compute them):
    seed 002's RK4 step, all complex products, ran its pass and fused sum in 180 µs at 4096²
    on an H200 instead of 209 with four rounded products (CuPy's kernel and sum: 190-199).
``"cuda-fma"``
    The same with plain real products, which NVVM fuses with additions as nvcc does for
    CuPy's kernels (``elementwise(..., fma=True)``), each fused product rounded once with its
    addition.
``"sim"``
    plain Python on NumPy scalars, for numba's CUDA simulator (where device functions run as
    Python).

Every helper computes what NumPy's C loops compute (``npy_divmod``, integer division and
remainder by zero give 0, shifts past the width give 0 or -1, Smith's complex division), and the
complex product what its SIMD array loop computes. No dask here.
"""

from __future__ import annotations

import math
import threading
import types
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np

from .numpy_helpers import (COMPLEX_CALLS, COMPLEX_HELPERS, FLOAT_HELPERS, INTEGER_HELPERS,
                            narrow_opaquely)

__all__ = ["CAST_DTYPES", "CUDA_TARGETS", "cast_name", "namespace"]

#: Every dtype the translated code converts to, by its cast helper's suffix.
CAST_DTYPES: dict[str, np.dtype] = {
    f"{dt.kind}{dt.itemsize}": dt
    for dt in map(np.dtype, ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                             "uint32", "uint64", "float32", "float64", "complex64",
                             "complex128"])
}


def cast_name(dtype: np.dtype) -> str:
    """The name of the helper that converts a value to ``dtype`` (``_nr_f4`` for float32).

    Examples
    --------
    >>> cast_name(np.dtype("uint16")), cast_name(np.dtype("complex128"))
    ('_nr_u2', '_nr_c16')
    """
    return f"_nr_{dtype.kind}{dtype.itemsize}"


def _opaque_int64() -> Any:
    """A numba-cuda intrinsic: an integer as int64, through an empty inline PTX ``mov`` that
    the compiler cannot see through (see the "cuda" target in :func:`_build`)."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def opaque(typingctx: Any, x: Any) -> Any:
        if not isinstance(x, (types.Integer, types.Boolean)):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            wide = context.cast(builder, args[0], signature.args[0], types.int64)
            fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64)])
            return builder.asm(fnty, "mov.b64 $0, $1;", "=l,l", [wide], side_effect=False)

        return types.int64(x), codegen

    return opaque


def _sim_cast(dtype: np.dtype) -> Callable[[Any], Any]:
    def cast(x: Any) -> Any:
        with np.errstate(all="ignore"):
            return np.asarray(x).astype(dtype)[()]
    return cast


def _primitives(target: str, precision: str) -> dict[str, Any]:
    """floor, ceil, trunc, fmod, copysign, hypot and the product of one real precision
    ("f4" or "f8")."""
    single = precision == "f4"
    if target in CUDA_TARGETS:
        from numba.cuda import libdevice

        return {
            "FLOOR": libdevice.floorf if single else libdevice.floor,
            "CEIL": libdevice.ceilf if single else libdevice.ceil,
            "TRUNC": libdevice.truncf if single else libdevice.trunc,
            "FMOD": libdevice.fmodf if single else libdevice.fmod,
            "COPYSIGN": libdevice.copysignf if single else libdevice.copysign,
            "HYPOT": libdevice.hypotf if single else libdevice.hypot,
            # "cuda-fma": a plain product, which the compiler may fuse with an addition.
            "FMUL": (None if target == "cuda-fma"
                     else libdevice.fmul_rn if single else libdevice.dmul_rn),
            "FMA": libdevice.fmaf if single else libdevice.fma,
        }
    # numba's CPU target has np.floor/np.fmod/np.copysign for scalars (not math.fmod); they
    # keep float32 as float32, as NumPy does on the simulator.
    return {"FLOOR": np.floor, "CEIL": np.ceil, "TRUNC": np.trunc, "FMOD": np.fmod,
            "COPYSIGN": np.copysign, "HYPOT": np.hypot, "FMUL": None,
            "FMA": _cpu_fma() if target == "cpu" else _sim_fma(np.dtype(precision))}


def _cpu_fma() -> Any:
    """A numba CPU intrinsic: ``a * b + c`` rounded once (LLVM's ``llvm.fma``: the machine's
    instruction, or the C library's exact ``fma`` where it has none)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.core.extending import intrinsic

    @intrinsic
    def fma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
        if not (isinstance(a, types.Float) and a == b == c):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            lty = args[0].type
            name = f"llvm.fma.f{signature.args[0].bitwidth}"
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(lty, [lty] * 3),
                                                name)
            return builder.call(fn, args)

        return a(a, b, c), codegen

    return fma


def _sim_fma(real: np.dtype) -> Callable[[Any, Any, Any], Any]:
    """``a * b + c`` rounded once to ``real``, in plain Python (exact rational arithmetic)."""
    def fma(a: Any, b: Any, c: Any) -> Any:
        a, b, c = float(a), float(b), float(c)
        with np.errstate(all="ignore"):
            if not (math.isfinite(a) and math.isfinite(b)):
                return real.type(a * b + c)  # inf and nan as the fused operation has them
            if not math.isfinite(c):
                return real.type(c)  # a finite product, however large, leaves c as it is
            if a == 0 or b == 0:
                # A zero product: the sum of signed zeros as IEEE adds them.
                return real.type(real.type(a * b) + real.type(c))
            exact = Fraction(a) * Fraction(b) + Fraction(c)
            if exact == 0:
                return real.type(0.0)
            try:
                return real.type(float(exact)) if real.itemsize == 8 else \
                    _round_fraction_to_float32(exact)
            except OverflowError:
                return real.type(-math.inf if exact < 0 else math.inf)

    return fma


def _round_fraction_to_float32(x: Fraction) -> np.float32:
    """``x`` (a non-zero Fraction) rounded once to float32, to nearest, ties to even (through
    float64 it could round twice)."""
    sign = -1 if x < 0 else 1
    x = abs(x)
    exponent = x.numerator.bit_length() - x.denominator.bit_length()  # 2**exponent ~ x
    if x >= Fraction(2) ** (exponent + 1):
        exponent += 1
    elif x < Fraction(2) ** exponent:
        exponent -= 1
    quantum = Fraction(2) ** (max(exponent, -126) - 23)  # subnormals: the smallest spacing
    steps = x / quantum
    whole, rest = divmod(steps.numerator, steps.denominator)
    if 2 * rest > steps.denominator or (2 * rest == steps.denominator and whole % 2):
        whole += 1
    value = sign * float(whole * quantum)  # exact: whole <= 2**24
    if abs(value) > float(np.finfo(np.float32).max):
        return np.float32(sign * math.inf)
    return np.float32(value)


def _instantiate(func: Callable, globals_: dict[str, Any], name: str) -> Callable:
    """A copy of ``func`` whose globals are ``globals_`` (one binding of its names).

    The globals name this module: numba's on-disk cache of a function that calls the copy
    rebuilds the copy's environment by importing the module its globals name.
    """
    globals_.setdefault("__name__", __name__)
    copy = types.FunctionType(func.__code__, globals_, name, func.__defaults__)
    copy.__qualname__ = name
    return copy


def _build(target: str) -> dict[str, Any]:
    import numba

    if target == "cpu":
        def jit(f: Callable) -> Any:
            return numba.njit(f, error_model="numpy")
    elif target in CUDA_TARGETS:
        from numba import cuda

        def jit(f: Callable) -> Any:
            return cuda.jit(device=True)(f)
    else:
        def jit(f: Callable) -> Any:
            return f

    ns: dict[str, Any] = {"math": math, "cmath": __import__("cmath"), "np": np,
                          "_nr_inf": math.inf, "_nr_nan": math.nan}
    for suffix, dt in CAST_DTYPES.items():
        ns[f"_nr_{suffix}"] = _sim_cast(dt) if target == "sim" else getattr(numba, dt.name
                                                                             if dt.kind != "b"
                                                                             else "boolean")
    ints = {"I8": ns["_nr_i8"], "U8": ns["_nr_u8"]}
    for name, func in INTEGER_HELPERS.items():
        ns[f"_nr_{name}"] = jit(_instantiate(func, ints, f"_nr_{name}"))
    if target in CUDA_TARGETS:
        # Measured on an H200: int32(int16(-x)) for x = -32768 gave +32768. The compiler
        # evaluates the negation in 16 bits (it only feeds a narrowing) as neg.s16, whose
        # overflow the following cvt.s32.s16 does not sign-extend; int8 and the unsigned types
        # came out right, and so did wrapping by a mask and a comparison, until the compiler
        # folded that into the same narrowing. Narrowing conversions to signed types smaller
        # than 32 bits therefore start from a value the compiler cannot see through.
        opaque = _opaque_int64()
        for suffix in ("i1", "i2"):
            ns[f"_nr_{suffix}"] = jit(_instantiate(narrow_opaquely, {
                "NARROW": ns[f"_nr_{suffix}"], "OPAQUE": opaque}, f"_nr_{suffix}"))
    # Double first: complex64's power falls back on complex128's product (exp(b log a)).
    for real, cplx in (("f8", "c16"), ("f4", "c8")):
        prims = _primitives(target, real)
        real_cast = ns[f"_nr_{real}"]
        consts = {"ZERO": real_cast(0.0), "ONE": real_cast(1.0), "HALF": real_cast(0.5),
                  "NAN": real_cast(math.nan)}
        if prims["FMUL"] is None:
            prims["FMUL"] = jit(_instantiate(FLOAT_HELPERS["multiply"], {}, f"_nr_multiply_{real}"))
        float_globals = {**prims, **consts}
        for name in ("floor", "ceil", "trunc"):
            ns[f"_nr_{name}_{real}"] = prims[name.upper()]
        for name, func in FLOAT_HELPERS.items():
            if name == "multiply":
                ns[f"_nr_multiply_{real}"] = prims["FMUL"]
                continue
            ns[f"_nr_{name}_{real}"] = jit(_instantiate(func, float_globals, f"_nr_{name}_{real}"))
        if target == "sim":
            pack_dtype = CAST_DTYPES[cplx]

            def pack(re: Any, im: Any, _dt: np.dtype = pack_dtype) -> Any:
                return _dt.type(complex(re, im))
        else:
            pack = complex  # numba: complex(float32, float32) is complex64
        complex_globals = {**float_globals, "PACK": pack, "cmath": __import__("cmath"),
                           "CAST": ns[f"_nr_{cplx}"], "WIDE": ns["_nr_c16"],
                           "MUL128": ns.get("_nr_multiply_c16")}
        for name, func in COMPLEX_HELPERS.items():
            helper = ns[f"_nr_{name}_{cplx}"] = jit(
                _instantiate(func, complex_globals, f"_nr_{name}_{cplx}"))
            for alias, callee in COMPLEX_CALLS.items():
                if callee == name:
                    complex_globals[alias] = helper
            if cplx == "c16" and name == "multiply":
                complex_globals["MUL128"] = helper
    return ns


#: The CUDA targets: ``"cuda"`` rounds every floating-point product by itself, as NumPy's
#: scalars do; ``"cuda-fma"`` leaves products plain, so that the compiler fuses a product and
#: an addition into one fused multiply-add (rounded once), as nvcc does for CuPy's kernels.
CUDA_TARGETS = ("cuda", "cuda-fma")
_namespaces: dict[str, dict[str, Any]] = {}
_lock = threading.Lock()


def namespace(target: str) -> dict[str, Any]:
    """The helpers of ``target`` (``"cpu"``, ``"cuda"``, ``"cuda-fma"`` or ``"sim"``), by name,
    built once.

    The globals a translated function is compiled with: its conversions (``_nr_f4`` ...),
    helpers (``_nr_floor_divide_f8`` ...), ``math``, ``cmath`` and ``np``.

    Examples
    --------
    >>> ops = namespace("sim")
    >>> ops["_nr_floor_divide_f8"](np.float64(-7.0), np.float64(2.0))
    np.float64(-4.0)
    >>> ops["_nr_i1"](ops["_nr_floor_divide_signed"](np.int8(-128), np.int8(-1)))
    np.int8(-128)
    """
    if target not in ("cpu", "sim", *CUDA_TARGETS):
        raise ValueError(f"unknown target {target!r}")
    ns = _namespaces.get(target)
    if ns is None:
        with _lock:
            ns = _namespaces.get(target)
            if ns is None:
                ns = _namespaces[target] = _build(target)
    return ns
