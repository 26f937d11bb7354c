"""The translator: a function's statements, joins of types where paths meet, helper functions,
and what it refuses, compared with the same function on NumPy scalars.

Each function is run on the simulator target (plain Python over NumPy scalars) and compiled by
numba for the CPU. Every operator and dtype pair: test_numpy_rules.py.
"""

from __future__ import annotations

import cmath
import math
import warnings

import numba
import numpy as np
import pytest
from helpers import assert_same

from dask_gpuchunk._kernels.elementwise import arg_type, reference
from dask_gpuchunk.ufunc.numpy_ops import namespace
from dask_gpuchunk.ufunc.numpy_rules import VType
from dask_gpuchunk.ufunc.translate import capture_sources, check_call, translate

TARGETS = ["sim", "cpu"]


def run(func, *args, target="sim", out_dtype=None):
    """``func`` translated for ``args`` (arrays, NumPy scalars, Python numbers), applied
    element by element; returns (result, translation)."""
    t = translate(func, [arg_type(a, i) for i, a in enumerate(args)], out_dtype)
    scope = dict(namespace(target))
    exec(t.source, scope)
    for name in t.functions:
        if target == "cpu":
            scope[name] = numba.njit(scope[name], error_model="numpy")
    f = scope["f"]
    arrays = np.broadcast_arrays(*[np.asarray(a) for a in args])
    out = np.empty(arrays[0].shape, dtype=t.out_dtype)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        for idx in np.ndindex(out.shape):
            out[idx] = f(*(a if isinstance(a, (bool, int, float, complex)) else b[idx]
                           for a, b in zip(args, arrays)))
    return out, t


def check(func, *args, targets=TARGETS):
    """Ours equals NumPy scalars' result, value and dtype, on every target."""
    expected_dtype = None
    for target in targets:
        ours, t = run(func, *args, target=target)
        expected = reference(func, t.result_dtype, *args)
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            # NumPy's dtype for the function: that of its result on the first element.
            first = func(*(a if isinstance(a, (bool, int, float, complex)) else np.asarray(a).flat[0]
                           for a in args))
        expected_dtype = np.asarray(first).dtype
        assert t.result_dtype == expected_dtype, (target, t.result_dtype, expected_dtype)
        assert_same(ours, expected)
    return expected_dtype


I8 = np.array([100, 80, -86, 83, -128, 127, 0, 1], np.int8)
J8 = np.array([3, -9, 5, 4, -1, 2, 7, -3], np.int8)
F4 = np.array([0.1, -2.5, 3e38, np.nan, 1.0, -0.0, 7.0, 1e-40], np.float32)


# ---- the examples --------------------------------------------------------------------


def test_int8_wraps_at_every_step():
    check(lambda a, b: (a * b) // 3, I8, J8)


def test_uint8_sum_wraps_before_true_division():
    out, _ = run(lambda a, b: (a + b) / 2, np.array([200, 250], np.uint8), np.array([60, 50], np.uint8))
    assert_same(out, np.array([2.0, 22.0]))


def test_float32_with_python_constants_stays_float32():
    assert check(lambda x: x * 0.1 + 0.7, F4) == np.float32


def test_int8_times_uint64_is_float64():
    check(lambda a, b: a * b, np.array([3, -2], np.int8), np.array([2**64 - 1, 5], np.uint64))


# ---- statements ------------------------------------------------------------------------------


def branches(a, b):
    s = a + b
    if s > 10:
        r = s * 2
    elif s < -10:
        r = s - 1
    else:
        return a
    return r


def loop_sum(x, n):
    acc = 0.0  # a Python float merged with float32 at the loop's head
    for i in range(n):
        acc += x * i
    return acc


def while_halving(x):
    steps = 0
    while x > 1:
        x = x / 2
        steps += 1
        if steps > 50:
            break
    return x + steps


def reassigned(x):
    x = x * 2      # int8
    x = x * 0.5    # float64: a name may change type as the function runs
    return x


def swap(a, b):
    a, b = b, a - b
    return a * 3 + b


def uses_defaults(x, k=3, *, scale=0.5):
    return (x + k) * scale


def helper(v):
    if v > 0:
        return v * v
    return -v


def calls_helper(a, b):
    return helper(a) + helper(b * 2)


@pytest.mark.parametrize("target", TARGETS)
def test_branches_join_same_types(target):
    check(branches, I8.astype(np.int32), J8.astype(np.int32), targets=[target])


@pytest.mark.parametrize("target", TARGETS)
def test_loop_accumulator_takes_the_numpy_type(target):
    x = np.array([0.1, 1.5, -2.25], np.float32)
    out, t = run(loop_sum, x, 5, target=target)
    assert t.result_dtype == np.float32
    assert_same(out, reference(loop_sum, np.float32, x, 5))


@pytest.mark.parametrize("target", TARGETS)
def test_while_loop_with_break(target):
    check(while_halving, np.array([3.0, 1e300, 0.5, 7.0]), targets=[target])


def test_reassignment_changes_type():
    assert check(reassigned, I8) == np.float64


def test_tuple_assignment_evaluates_before_binding():
    check(swap, I8, J8)


def test_defaults_are_constants():
    check(uses_defaults, np.array([1.5, 2.0], np.float32))


def test_plain_helper_functions_are_translated_per_types():
    _, t = run(calls_helper, I8, J8)
    assert t.functions[-1] == "f" and len(t.functions) == 2  # one helper: int8 both times
    check(calls_helper, I8, J8)


def test_math_cmath_and_numpy_calls():
    x = np.array([0.5, 2.0, 9.0], np.float32)
    check(lambda v: math.sqrt(v) * v, x)          # a Python float, then weak: float32
    check(lambda v: np.sqrt(v) + v, x)            # NumPy's float32 loop
    check(lambda v: np.float32(v) * 3 + np.int16(2), np.array([1, 2, 3], np.int64))
    check(lambda v: abs(v) + min(v, 2) - max(v, -1), I8)
    check(lambda v: cmath.sqrt(v).real + float(v), np.array([4.0, 9.0]))
    check(lambda v: (v.real - v.imag) * v.conjugate(), np.array([1 + 2j, -3.5j], np.complex64))


def test_conditional_expressions_and_boolean_operators():
    check(lambda a, b: (a if a > b else b) + (a > 0 and b > 0), I8, J8)
    check(lambda a, b: 1 < a < 100 or b == -1, I8, J8)


def test_comparisons_of_python_integers_out_of_range_are_exact():
    check(lambda a: (a < 300) + (a == 1000) * 2, I8)
    check(lambda a, b: a < b, np.array([-1, 5], np.int64), np.array([2**64 - 1, 5], np.uint64))


def test_out_dtype_converts_as_astype():
    out, t = run(lambda a: a * 1.5, np.array([1.0, -2.7, 300.0]), out_dtype=np.dtype("int8"))
    assert t.result_dtype == np.float64 and t.out_dtype == np.int8
    assert_same(out, (np.array([1.0, -2.7, 300.0]) * 1.5).astype(np.int64).astype(np.int8))


# ---- what NumPy itself raises is raised when translating -----------------------------------


def test_python_integer_constant_out_of_bounds_raises_overflow_error():
    with pytest.raises(OverflowError, match="Python integer 300 out of bounds for int8"):
        translate(lambda a: a + 300, [VType(np.dtype("int8"))])


def test_python_integer_argument_bounds_are_checked_by_the_call():
    t = translate(lambda a, k: a * k, [VType(np.dtype("uint8")), arg_type(3, 1)])
    ((expr, low, high, exc, message),) = t.call_checks
    assert (expr, low, high, exc) == ("args[1]", 0, 255, OverflowError) and "uint8" in message
    check_call(t, [None, 255])
    with pytest.raises(OverflowError, match="-1 out of bounds for uint8"):
        check_call(t, [None, -1])


def test_values_computed_from_python_arguments_are_checked_by_the_call():
    t = translate(lambda a, k: a * (k ** 2 - 1), [VType(np.dtype("int8")), arg_type(3, 1)])
    check_call(t, [None, 11])  # 120 fits
    with pytest.raises(OverflowError, match="143 out of bounds for int8"):
        check_call(t, [None, 12])
    t = translate(lambda a, k: a ** k, [VType(np.dtype("int16")), arg_type(3, 1)])
    with pytest.raises(ValueError, match="negative integer powers"):
        check_call(t, [None, -2])


def test_negative_integer_power_constant_raises_value_error():
    with pytest.raises(ValueError, match="negative integer powers"):
        translate(lambda a: a ** -1, [VType(np.dtype("int16"))])


def test_no_numpy_loop_is_a_type_error():
    with pytest.raises(TypeError, match="boolean subtract|does not take"):
        translate(lambda a, b: a - b, [VType(np.dtype(bool))] * 2)


# ---- what cannot follow NumPy is refused, with the line -------------------------------------


def mixed_branch(a, flag):
    if flag > 0:
        r = a * 1      # int8
    else:
        r = a * 0.5    # float64
    return r + 1


def computed_python_int_meets_int8(a, n):
    total = a
    for i in range(n):
        total = total + i
    return total


def weak_join_then_differs(x, n):
    s = 0.1           # a Python float that float32 does not hold exactly
    for _ in range(n):
        s = x
    return s


def python_float_path_computes_differently(x, flag):
    s = math.sin(x)   # a Python float (float64) on one path ...
    if flag > 0:
        s = x         # ... float32 on the other
    return s * x


@pytest.mark.parametrize("func, args, match", [
    (mixed_branch, ("int8", "int8"), r"'r' after the if at line \d+ is (int8|float64) on some paths"),
    (computed_python_int_meets_int8, ("int8", "int64"), "NumPy raises OverflowError"),
    (weak_join_then_differs, ("float32", "int64"), "float32 on some paths and a Python float"),
    (python_float_path_computes_differently, ("float32", "int64"), "needs one type"),
    (lambda a, b: a ** b, ("int32", "int32"), "negative integer exponents"),
    (lambda a: [a][0], ("float64",), "Subscript expressions are not supported"),
    (lambda a: a.sum(), ("float64",), "attribute .sum"),
    (lambda a: numba.njit(lambda x: x)(a), ("float64",), "not supported|cannot call|numba"),
])
def test_refused_with_the_reason_and_line(func, args, match):
    with pytest.raises(TypeError, match=match) as info:
        translate(func, [VType(np.dtype(a)) for a in args])
    assert "line" in str(info.value) and "by NumPy's rules" in str(info.value)


def test_function_without_source_is_refused_with_the_alternative():
    scope: dict = {}
    exec("def f(a):\n    return a * 2\n", scope)
    with pytest.raises(TypeError, match="rules='numba'"):
        translate(scope["f"], [VType(np.dtype("f8"))])


def test_several_lambdas_on_one_line_are_told_apart():
    double, triple = (lambda a: a * 2), (lambda a: a * 3)  # noqa: E731
    assert "2" in translate(double, [VType(np.dtype("i8"))]).source
    assert "3" in translate(triple, [VType(np.dtype("i8"))]).source


def test_functions_that_may_return_nothing_are_refused():
    def sometimes(a):
        if a > 0:
            return a

    with pytest.raises(TypeError, match="without returning"):
        translate(sometimes, [VType(np.dtype("f8"))])


def test_a_function_unpickled_elsewhere_translates_from_the_sources_taken_where_it_was_made():
    import cloudpickle

    scale = 3

    def helper(t):
        return t * scale - 1

    def f(x, y):
        return helper(x) + y * 0.5

    sources = capture_sources(f)
    # What a worker gets: the functions by value, their files named "<dynamic-code>".
    g = cloudpickle.loads(cloudpickle.dumps(f))
    assert g.__code__.co_filename == "<dynamic-code>"
    argtypes = [VType(np.dtype("int16")), VType(np.dtype("float32"))]
    with pytest.raises(TypeError, match=r"cannot read the source of '.*\.f'"):
        translate(g, argtypes)
    here, there = translate(f, argtypes), translate(g, argtypes, sources=sources)
    assert there.source == here.source and there.result_dtype == here.result_dtype
    assert "h1_helper" in there.source  # the helper came from the carried source too
