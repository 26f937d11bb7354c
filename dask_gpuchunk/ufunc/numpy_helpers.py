"""NumPy's scalar operations as plain Python, written once, for
:mod:`dask_gpuchunk.ufunc.numpy_ops` to bind per target and precision.

Each helper's globals (``ZERO``, ``ONE``, casts, ``FLOOR``, ``FMOD``, ``FMUL``, ``FMA``, the
other helpers it calls) are not this module's: ``numpy_ops._instantiate`` copies each function
with one binding of them (numba ``njit`` or CUDA device functions, or plain Python on NumPy
scalars for the simulator). What they compute is NumPy's C loops' (``npy_divmod``, Smith's
complex division, the complex product of its SIMD array loop). No dask here.
"""

__all__ = ["COMPLEX_CALLS", "COMPLEX_HELPERS", "FLOAT_HELPERS", "INTEGER_HELPERS",
           "narrow_opaquely"]


# ---- helpers, written once; their globals (casts, primitives of one precision) are bound per
# target and precision by numpy_ops._instantiate. Each takes operands already converted to NumPy's loop
# type and returns a value that the caller converts back to it (numba widens small integers).


def _floor_divide_float(a, b):
    # npy_floor_divide / npy_divmod: Python's floor division, inf or nan for b == 0.
    if b == ZERO:
        return a / b
    mod = FMOD(a, b)
    div = (a - mod) / b
    if mod != ZERO:
        if (b < ZERO) != (mod < ZERO):
            div -= ONE
    if div != ZERO:
        floordiv = FLOOR(div)
        if div - floordiv > HALF:
            floordiv += ONE
        return floordiv
    return COPYSIGN(ZERO, a / b)


def _remainder_float(a, b):
    # npy_remainder: fmod, moved into the divisor's sign; fmod's nan for b == 0.
    mod = FMOD(a, b)
    if b == ZERO:
        return mod
    if mod != ZERO:
        if (b < ZERO) != (mod < ZERO):
            mod += b
        return mod
    return COPYSIGN(ZERO, b)


def _floor_divide_signed(a, b):
    a = I8(a)
    b = I8(b)
    if b == 0:
        return a - a  # NumPy: 0 (with a warning)
    if b == -1:
        return -a  # negation does not assume no overflow: the most negative value stays itself
    return a // b


def _remainder_signed(a, b):
    a = I8(a)
    b = I8(b)
    if b == 0 or b == -1:
        return a - a
    return a % b


def _floor_divide_unsigned(a, b):
    a = U8(a)
    b = U8(b)
    if b == U8(0):
        return a - a
    return a // b


def _remainder_unsigned(a, b):
    a = U8(a)
    b = U8(b)
    if b == U8(0):
        return a - a
    return a % b


def _power_integer(a, n):
    # Exponentiation by squaring modulo 2**64 (unsigned, where overflow is defined): the low
    # bits are NumPy's wrapped power of any integer type. n >= 0.
    a = U8(a)
    n = U8(n)
    one = U8(1)
    result = one
    while n > U8(0):
        if n & one:
            result = result * a
        a = a * a
        n = n >> one
    return result


def _left_shift_signed(a, b, bits):
    a = I8(a)
    b = I8(b)
    if b < 0 or b >= bits:
        return a - a  # NumPy: shifts by a negative count or the width or more give 0
    return a << b


def _right_shift_signed(a, b, bits):
    a = I8(a)
    b = I8(b)
    if b < 0 or b >= bits:
        return a - a - 1 if a < 0 else a - a
    return a >> b


def _left_shift_unsigned(a, b, bits):
    a = U8(a)
    b = U8(b)
    if b >= U8(bits):
        return a - a
    return a << b


def _right_shift_unsigned(a, b, bits):
    a = U8(a)
    b = U8(b)
    if b >= U8(bits):
        return a - a
    return a >> b


def narrow_opaquely(x):
    # NARROW (a cast to int8 or int16) of x, computed in 64 bits first: OPAQUE hides the 64-bit
    # value from the compiler, which then cannot evaluate what computed it in 16 bits.
    return NARROW(OPAQUE(x))


def _compare_signed_unsigned(a, b):
    # -1, 0, 1 for a signed and b unsigned integer, exactly (NumPy's int64/uint64 loops).
    a = I8(a)
    b = U8(b)
    if a < 0:
        return -1
    ua = U8(a)
    if ua < b:
        return -1
    if ua > b:
        return 1
    return 0


def _multiply_float(a, b):
    return a * b


def _multiply_complex(a, b):
    # NumPy's scalar product (and CPython's), each partial product rounded on its own.
    ar = a.real
    ai = a.imag
    br = b.real
    bi = b.imag
    return PACK(FMUL(ar, br) - FMUL(ai, bi), FMUL(ar, bi) + FMUL(ai, br))


def _multiply_complex_array(a, b):
    # NumPy's array loop (its AVX2/AVX-512 and NEON builds): the second partial product
    # rounded, the first fused with it, a the left operand. Two products and two fused
    # multiply-adds instead of four products and two additions.
    ar = a.real
    ai = a.imag
    br = b.real
    bi = b.imag
    return PACK(FMA(ar, br, -FMUL(ai, bi)), FMA(ar, bi, FMUL(ai, br)))


def _divide_complex(a, b):
    # NumPy's complex division loop (Smith's method, with 1/denominator).
    ar = a.real
    ai = a.imag
    br = b.real
    bi = b.imag
    abs_br = abs(br)
    abs_bi = abs(bi)
    if abs_br >= abs_bi:
        if abs_br == ZERO and abs_bi == ZERO:
            return PACK(ar / abs_br, ai / abs_br)
        rat = bi / br
        scl = ONE / (br + FMUL(bi, rat))
        return PACK(FMUL(ar + FMUL(ai, rat), scl), FMUL(ai - FMUL(ar, rat), scl))
    rat = br / bi
    scl = ONE / (bi + FMUL(br, rat))
    return PACK(FMUL(FMUL(ar, rat) + ai, scl), FMUL(FMUL(ai, rat) - ar, scl))


def _divide_python_complex(a, b):
    # CPython's complex division (_Py_c_quot), for two Python complex numbers; nan where
    # Python raises ZeroDivisionError.
    ar = a.real
    ai = a.imag
    br = b.real
    bi = b.imag
    abs_br = abs(br)
    abs_bi = abs(bi)
    if abs_br >= abs_bi:
        if abs_br == ZERO:
            return PACK(NAN, NAN)
        ratio = bi / br
        denom = br + FMUL(bi, ratio)
        return PACK((ar + FMUL(ai, ratio)) / denom, (ai - FMUL(ar, ratio)) / denom)
    if abs_bi >= abs_br:
        ratio = br / bi
        denom = FMUL(br, ratio) + bi
        return PACK((FMUL(ar, ratio) + ai) / denom, (FMUL(ai, ratio) - ar) / denom)
    return PACK(NAN, NAN)


def _divide_complex_npymath(a, b):
    # The division npy_cpow uses (npy_math's cdiv): as _divide_complex, but 0/0 parts apart.
    br = b.real
    bi = b.imag
    if abs(br) >= abs(bi) and br == ZERO and bi == ZERO:
        return PACK(a.real / abs(br), a.imag / abs(bi))
    return DIV(a, b)


def _power_complex(a, b):
    # NumPy's npy_cpow: 1 for a zero exponent, the zero base, repeated products for integer
    # exponents between -100 and 100; otherwise exp(b log a), as the C library's cpow (within
    # a rounding of it).
    ar = a.real
    ai = a.imag
    br = b.real
    bi = b.imag
    if br == ZERO and bi == ZERO:
        return PACK(ONE, ZERO)
    if ar == ZERO and ai == ZERO:
        if br > ZERO:
            return PACK(ZERO, ZERO)
        return PACK(NAN, NAN)
    if bi == ZERO and br > -100 and br < 100:
        n = int(br)
        if n == br:
            if n == 1:
                return PACK(ar, ai)
            if n == 2:
                return MUL(a, a)
            if n == 3:
                return MUL(a, MUL(a, a))
            m = -n if n < 0 else n
            result = PACK(ONE, ZERO)
            p = PACK(ar, ai)
            mask = 1
            while True:
                if m & mask:
                    result = MUL(result, p)
                mask <<= 1
                if m < mask:
                    break
                p = MUL(p, p)
            if br < ZERO:
                result = NPYDIV(PACK(ONE, ZERO), result)
            return result
    return CAST(cmath.exp(MUL128(WIDE(b), cmath.log(WIDE(a)))))


def _power_python_complex(a, n):
    # CPython's c_powi, for a Python complex number to a constant integer power, |n| <= 100.
    m = -n if n < 0 else n
    result = PACK(ONE, ZERO)
    p = a
    mask = 1
    while mask > 0 and m >= mask:
        if m & mask:
            result = MUL(result, p)
        mask <<= 1
        p = MUL(p, p)
    if n < 0:
        return PYDIV(PACK(ONE, ZERO), result)
    return result


def _absolute_complex(a):
    return HYPOT(a.real, a.imag)


def _less_complex(a, b):
    # NumPy's complex order: lexicographic, nan imaginary parts never less.
    ar = a.real
    ai = a.imag
    br = b.real
    bi = b.imag
    return (ar < br and ai == ai and bi == bi) or (ar == br and ai < bi)


def _less_equal_complex(a, b):
    ar = a.real
    ai = a.imag
    br = b.real
    bi = b.imag
    return (ar < br and ai == ai and bi == bi) or (ar == br and ai <= bi)


def _truth_complex(a):
    return a.real != ZERO or a.imag != ZERO


def _maximum_float(a, b):
    # np.maximum: nan if either is nan.
    return a if (a >= b or a != a) else b


def _minimum_float(a, b):
    return a if (a <= b or a != a) else b


def _fmax_float(a, b):
    # np.fmax: the other value where one is nan.
    return a if (a >= b or b != b) else b


def _fmin_float(a, b):
    return a if (a <= b or b != b) else b


#: Helpers of a floating-point precision, bound once per (target, "f4"/"f8").
FLOAT_HELPERS = {
    "floor_divide": _floor_divide_float,
    "remainder": _remainder_float,
    "multiply": _multiply_float,
    "maximum": _maximum_float,
    "minimum": _minimum_float,
    "fmax": _fmax_float,
    "fmin": _fmin_float,
}
#: Helpers of a complex precision, bound once per (target, "c8"/"c16"), in this order (later
#: ones call earlier ones: MUL, DIV, NPYDIV, PYDIV).
COMPLEX_HELPERS = {
    "multiply": _multiply_complex,
    "multiply_array": _multiply_complex_array,
    "divide": _divide_complex,
    "divide_npymath": _divide_complex_npymath,
    "divide_python": _divide_python_complex,
    "power": _power_complex,
    "power_python": _power_python_complex,
    "absolute": _absolute_complex,
    "less": _less_complex,
    "less_equal": _less_equal_complex,
    "truth": _truth_complex,
}
#: What each complex helper calls, by the name it uses.
COMPLEX_CALLS = {"MUL": "multiply", "DIV": "divide", "NPYDIV": "divide_npymath",
                  "PYDIV": "divide_python"}
#: Integer helpers (they widen to 64 bits first).
INTEGER_HELPERS = {
    "floor_divide_signed": _floor_divide_signed,
    "remainder_signed": _remainder_signed,
    "floor_divide_unsigned": _floor_divide_unsigned,
    "remainder_unsigned": _remainder_unsigned,
    "power_integer": _power_integer,
    "left_shift_signed": _left_shift_signed,
    "right_shift_signed": _right_shift_signed,
    "left_shift_unsigned": _left_shift_unsigned,
    "right_shift_unsigned": _right_shift_unsigned,
    "compare_signed_unsigned": _compare_signed_unsigned,
}
