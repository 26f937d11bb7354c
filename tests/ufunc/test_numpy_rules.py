"""NumPy conformance: every pair of supported dtypes and Python numbers × a set of expressions.

For each pair, every expression is translated (numpy_rules / translate), and all of them are
compiled into one function for the target (one compile per pair keeps CI within its time):
numba's CPU target, numba's CUDA simulator (plain Python over NumPy scalars) and, on a GPU, a
CUDA kernel with the CUDA helpers (libdevice's unfused products). The elementwise kernels
compile the same translated function, writing its result into the output.

Each result must have NumPy's dtype and equal, value for value, what NumPy gives for the same
function on NumPy scalars (NaN where NumPy has NaN, wrapped integers, signed zeros aside).
NumPy's array loops give the same values and dtypes except where NumPy's arrays and its own
scalars disagree: complex products and quotients (its AVX2/AVX-512 array loops use fused
multiply-adds, its scalars do not: ours are within a few roundings of the operands' magnitudes;
also ``abs`` of complex numbers, whose array loop is NumPy's own SIMD code, not the C library's
``hypot`` its scalars call) and ``ARRAY_QUIRKS``. Where NumPy raises (no loop for the types, a
Python integer out of bounds, a negative integer power), the translation raises the same
exception.
"""

from __future__ import annotations

import os
import warnings

import numba
import numpy as np
import pytest
from helpers import DTYPES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dask_gpuchunk._kernels.elementwise import arg_type
from dask_gpuchunk.ufunc.numpy_ops import namespace
from dask_gpuchunk.ufunc.translate import check_call, translate
from dask_gpuchunk.devices import gpu_available

#: Python numbers, one value each (an out-of-bounds one is tested in tests/elementwise_ops/test_operations.py).
PYTHON = {"py-int": 3, "py-float": 0.1, "py-complex": 1.5 - 2j, "py-bool": True}
OPERANDS = [*DTYPES, *PYTHON]
#: Pairs of two Python numbers follow Python's rules; a few of them, not all.
PYTHON_PAIRS = [("py-int", "py-float"), ("py-float", "py-int"), ("py-complex", "py-float"),
                ("py-bool", "py-int"), ("py-int", "py-int")]
PAIRS = [(x, y) for x in OPERANDS for y in OPERANDS
         if not (x in PYTHON and y in PYTHON) or (x, y) in PYTHON_PAIRS]

EXPRESSIONS = {
    "a * b": lambda a, b: a * b,
    "a + b": lambda a, b: a + b,
    "a - b": lambda a, b: a - b,
    "a / b": lambda a, b: a / b,
    "a // b": lambda a, b: a // b,
    "a % b": lambda a, b: a % b,
    "(a * b) // 3": lambda a, b: (a * b) // 3,
    "(a + b) / 2": lambda a, b: (a + b) / 2,
    "a * 0.1 + b": lambda a, b: a * 0.1 + b,
    "a ** 2 - b": lambda a, b: a ** 2 - b,
    "-a * b": lambda a, b: -a * b,
    "abs(a) - b": lambda a, b: abs(a) - b,
    "a < b": lambda a, b: a < b,
    "a == b": lambda a, b: a == b,
    "a & b": lambda a, b: a & b,
    "a << b": lambda a, b: a << b,
}
N = 48

#: Where NumPy's arrays give another dtype than NumPy's scalars (we follow the scalars, which
#: follow the ufunc's type resolution): ``bool_array ** 2`` is computed by ``np.square``
#: (int8), ``np.True_ ** 2`` by ``np.power`` (int64).
ARRAY_QUIRKS = {("a ** 2 - b", "bool")}
#: Expressions within a rounding of NumPy's scalars on the GPU, for these operand kinds:
#: ``abs`` of a complex number is the hypot of its parts, libdevice's on the GPU, the C
#: library's in NumPy (exact on the CPU, where both call the C library).
GPU_WITHIN_A_ROUNDING = {("abs(a) - b", "complex64"), ("abs(a) - b", "complex128"),
                         ("abs(a) - b", "py-complex")}
#: Where NumPy's scalars leave the ufunc's rules (we follow the ufunc): ``np.float64``
#: subclasses Python's float, so ``python_complex / np.float64(x)`` is Python's complex
#: division (a Python complex, ZeroDivisionError for 0). The reference passes such elements as
#: 0-d arrays, which NumPy computes by its ufuncs.
SCALAR_QUIRKS = {("py-complex", "float64")}
#: NumPy's float scalars compute ``a ** 2`` with the C library's ``pow`` (within a rounding of
#: the square), its arrays as ``a * a`` (``np.power``'s fast path for 2), as we do: these
#: compare with the scalars within one unit in the last place, with the arrays exactly.
#: (315.5228693457769 ** 2: 99554.6810801922 by pow, 99554.68108019218 by a * a.)
POW_WITHIN_A_ROUNDING = {"a ** 2 - b"}


def _numpy_fuses_complex_products() -> bool:
    """Whether this NumPy's array loop computes a complex product as ours does (the first
    partial product fused with the rounded second: its AVX2/AVX-512 and NEON builds); a pair
    where that and four rounded products differ."""
    a = np.array([1 + 2 ** -12 + 1j], np.complex64)
    b = np.array([1 + 2 ** -12 + 1j], np.complex64)
    fused = np.float32(float(a.real[0]) * float(b.real[0]) - 1.0)  # exact in float64
    return bool((a * b).real[0] == fused)


#: True on CI's and the GPU machines' x86 (AVX-512): there complex products of arrays are
#: compared exactly with NumPy's arrays, and within a rounding with its scalars (which round
#: each partial product); elsewhere within a rounding of both.
NUMPY_FUSES_COMPLEX_PRODUCTS = _numpy_fuses_complex_products()
#: Complex helpers whose NumPy array loops are not ours (division, abs, power): an expression
#: with one of them is compared with NumPy's arrays within a rounding.
OTHER_COMPLEX_HELPERS = ("_nr_divide_c", "_nr_divide_python", "_nr_divide_npymath",
                         "_nr_power_c", "_nr_power_python", "_nr_absolute_c")


def operand(kind: str, seed: int):
    """A Python number, or N values of a dtype: its extremes, zeros, nan and inf, random."""
    if kind in PYTHON:
        return PYTHON[kind]
    rng = np.random.default_rng(seed)
    dt = np.dtype(kind)
    if dt.kind == "b":
        return rng.random(N) < 0.5
    if dt.kind in "iu":
        info = np.iinfo(dt)
        edges = [info.min, info.max, 0, 1, 2, 3, 7, info.max - 1, 64]
        if dt.kind == "i":
            edges += [-1, -7, info.min + 1, -64]
        values = rng.integers(info.min, info.max, size=N, endpoint=True, dtype=dt)
        values[:len(edges)] = edges
        return rng.permutation(values)
    real = np.dtype(f"f{dt.itemsize // 2}") if dt.kind == "c" else dt
    info = np.finfo(real)
    edges = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 0.5, 3.0, info.max, info.tiny,
             -info.max / 3, 1e-3, 7.0]
    values = (rng.standard_normal(N) * 100).astype(real)
    values[:len(edges)] = edges
    values = rng.permutation(values)
    if dt.kind == "c":
        return (values + 1j * rng.permutation(values)).astype(dt)
    return values


def _elements(pair, a, b):
    """Element ``i`` of each operand as NumPy computes a function on it: a NumPy scalar (a 0-d
    array for SCALAR_QUIRKS), a Python number as it is."""
    wrap = np.asarray if pair in SCALAR_QUIRKS else (lambda v: v)
    return lambda i: [v if np.ndim(v) == 0 else wrap(v[i]) for v in (a, b)]


def _scalar_reference(func, dtype, pair, a, b):
    """NumPy's result element by element, converted to ``dtype`` (ours)."""
    element = _elements(pair, a, b)
    out = np.empty(N, dtype=dtype)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        for i in range(N):
            out[i] = func(*element(i))
    return out


def _numpy_scalar_dtype(func, pair, a, b):
    """The dtype of NumPy's result for the first elements, as NumPy scalars."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return np.asarray(func(*_elements(pair, a, b)(0))).dtype


def _numpy(func, a, b):
    """NumPy's array result, or the exception NumPy raises."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        try:
            return np.asarray(func(a, b))
        except (TypeError, ValueError, OverflowError, ZeroDivisionError) as exc:
            return exc


def _ours(func, a, b):
    """Our translation, or the exception it raises (also from the call's checks of Python
    numbers, as ElementwiseOp makes them)."""
    try:
        t = translate(func, [arg_type(a, 0), arg_type(b, 1)])
        check_call(t, [a, b])
        return t
    except (TypeError, ValueError, OverflowError, ZeroDivisionError) as exc:
        return exc


def _combo_source(exprs: dict[str, str], scalar_a: bool, scalar_b: bool, cuda: bool) -> str:
    """One function computing every translated expression element by element."""
    outs = list(exprs)
    if cuda:
        head = [f"def combo(a, b, {', '.join(outs)}):", "    i = cuda.grid(1)",
                f"    if i < {outs[0]}.shape[0]:"]
        pad = "        "
    else:
        head = [f"def combo(n, a, b, {', '.join(outs)}):", "    for i in range(n):"]
        pad = "        "
    body = [f"{pad}a0 = {'a' if scalar_a else 'a[i]'}", f"{pad}a1 = {'b' if scalar_b else 'b[i]'}"]
    body += [f"{pad}{out}[i] = {expr}" for out, expr in exprs.items()]
    return "\n".join(head + body) + "\n"


def _run(translations: dict[str, object], a, b, target: str) -> dict[str, np.ndarray]:
    exprs = {}
    for i, (name, t) in enumerate(translations.items()):
        lines = t.source.strip().splitlines()
        assert t.functions == ("f",) and len(lines) == 2, t.source  # one return expression
        exprs[f"o{i}"] = lines[1].strip()[len("return "):]
    scalar_a, scalar_b = np.ndim(a) == 0, np.ndim(b) == 0
    outs = [np.empty(N, dtype=t.out_dtype) for t in translations.values()]
    scope = dict(namespace("cuda" if target == "gpu" else target))
    source = _combo_source(exprs, scalar_a, scalar_b, cuda=target == "gpu")
    if target == "gpu":
        from numba import cuda

        scope["cuda"] = cuda
        exec(source, scope)
        kernel = cuda.jit(scope["combo"])
        dev = [cuda.to_device(o) for o in outs]
        args = [x if np.ndim(x) == 0 else cuda.to_device(np.ascontiguousarray(x)) for x in (a, b)]
        kernel[1, 64](*args, *dev)
        outs = [d.copy_to_host() for d in dev]
    else:
        exec(source, scope)
        combo = scope["combo"]
        if target == "cpu":
            combo = numba.njit(combo, error_model="numpy")
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            combo(N, a, b, *outs)
    return dict(zip(translations, outs))


def _assert_equal_values(ours: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert ours.dtype == expected.dtype, (what, ours.dtype, expected.dtype)
    np.testing.assert_array_equal(ours, expected, err_msg=what)


def _assert_square_within_a_rounding(ours: np.ndarray, expected: np.ndarray, a,
                                     what: str) -> None:
    """``a ** 2 - b``: equal dtypes and non-finite values; finite ones within a rounding of
    the square in ``a``'s precision (``pow`` against ``a * a``), carried into the result."""
    assert ours.dtype == expected.dtype, (what, ours.dtype, expected.dtype)
    a = np.broadcast_to(np.asarray(a), ours.shape)
    eps = np.finfo(a.dtype).eps if a.dtype.kind in "fc" else np.finfo(np.float64).eps
    with np.errstate(over="ignore", invalid="ignore"):
        bound = 2 * eps * np.abs(a.astype(np.complex128)) ** 2
    parts = ((ours.real, expected.real), (ours.imag, expected.imag)) if ours.dtype.kind == "c" \
        else ((ours, expected),)
    with np.errstate(over="ignore"):
        bound = np.where(np.isfinite(bound), bound, np.inf)
    for got, want in parts:
        nonfinite = ~(np.isfinite(got) & np.isfinite(want))
        np.testing.assert_array_equal(got[nonfinite], want[nonfinite], err_msg=what)
        diff = np.abs(got[~nonfinite].astype(np.float64) - want[~nonfinite].astype(np.float64))
        assert np.all(diff <= bound[~nonfinite]), what


def _assert_complex_close(ours, expected, a, b, what):
    """Within a few roundings, in the least precise type involved, of the operands'
    magnitudes (NumPy's fused multiply-adds)."""
    eps = max(np.finfo(dt).eps for dt in (np.asarray(a).dtype, np.asarray(b).dtype, ours.dtype)
              if dt.kind in "fc")
    a, b = (np.abs(np.asarray(v, dtype=np.complex128)) for v in (a, b))
    scale = a * b + a + b + np.abs(expected.astype(np.complex128))
    both = np.isfinite(ours) & np.isfinite(expected) & np.isfinite(scale)
    diff = np.abs(ours[both].astype(np.complex128) - expected[both].astype(np.complex128))
    assert np.all(diff <= 8 * eps * scale[both]), what


def _check_pair(x: str, y: str, target: str, seeds: tuple[int, int] = (1, 2)) -> None:
    a, b = operand(x, seeds[0]), operand(y, seeds[1])
    translations = {}
    expected_arrays = {}
    for name, func in EXPRESSIONS.items():
        theirs, ours = _numpy(func, a, b), _ours(func, a, b)
        what = f"{name} with a: {x}, b: {y}"
        if isinstance(theirs, Exception) or isinstance(ours, Exception):
            assert isinstance(theirs, Exception) and isinstance(ours, Exception), (
                f"{what}: NumPy gave {theirs!r}, ours {ours!r}")
            family = (TypeError, ValueError, OverflowError, ZeroDivisionError)
            kind = next(k for k in family if isinstance(theirs, k))
            assert isinstance(ours, kind), f"{what}: NumPy raised {theirs!r}, ours {ours!r}"
            continue
        assert ours.result_dtype == _numpy_scalar_dtype(func, (x, y), a, b), what
        if theirs.dtype != ours.result_dtype:
            assert (name, x) in ARRAY_QUIRKS, (what, ours.result_dtype, theirs.dtype)
            theirs = None  # NumPy's arrays compute something else here: scalars only
        translations[name] = ours
        expected_arrays[name] = theirs
    if not translations:
        return
    results = _run(translations, a, b, target)
    for name, ours in results.items():
        what = f"{name} with a: {x}, b: {y} on {target}"
        func = EXPRESSIONS[name]
        scalars = _scalar_reference(func, ours.dtype, (x, y), a, b)
        source = translations[name].source
        array_product = "_nr_multiply_array_" in source
        if array_product or (target == "gpu" and (name, x) in GPU_WITHIN_A_ROUNDING):
            _assert_complex_close(ours, scalars, a, b, what + " (NumPy scalars)")
        elif name in POW_WITHIN_A_ROUNDING and ours.dtype.kind in "fc":
            _assert_square_within_a_rounding(ours, scalars, a, what + " (NumPy scalars)")
        else:
            _assert_equal_values(ours, scalars, what + " (NumPy scalars)")
        if expected_arrays[name] is None:
            continue
        theirs = np.broadcast_to(expected_arrays[name], ours.shape)
        from_complex = "c" in (np.asarray(a).dtype.kind, np.asarray(b).dtype.kind)
        if (array_product and NUMPY_FUSES_COMPLEX_PRODUCTS
                and not any(h in source for h in OTHER_COMPLEX_HELPERS)):
            _assert_equal_values(ours, theirs, what + " (NumPy arrays)")
        elif ours.dtype.kind == "c" or (from_complex and ours.dtype.kind == "f"):
            _assert_complex_close(ours, theirs, np.broadcast_to(a, ours.shape),
                                  np.broadcast_to(b, ours.shape), what + " (NumPy arrays)")
        else:
            _assert_equal_values(ours, theirs, what + " (NumPy arrays)")


def _id(pair):
    return f"{pair[0]}-{pair[1]}"


#: The pairs numba's CPU target compiles on every run (a compile each, ~0.5 s): every dtype
#: with itself and with a Python int and float, the pairs of Python numbers, and pairs whose
#: promotion changes kind or width. Every pair runs in the simulator (no compile; the same
#: translation) and on the GPU; the other CPU pairs are drawn by hypothesis, a different few
#: each run (DGC_ALL_PAIRS=1 compiles them all: 278 pairs, ~2.5 minutes on 2 cores).
CORE_PAIRS = sorted({*((x, x) for x in DTYPES), *((x, p) for x in DTYPES
                                                   for p in ("py-int", "py-float")),
                     *PYTHON_PAIRS, ("int8", "uint64"), ("uint64", "int8"), ("uint8", "int8"),
                     ("bool", "float32"), ("int64", "float32"), ("uint32", "int64"),
                     ("int32", "float64"), ("complex64", "float64"), ("float32", "complex128"),
                     ("py-complex", "float32"), ("bool", "py-complex"), ("int16", "uint16")})
ALL_PAIRS_ON_CPU = os.environ.get("DGC_ALL_PAIRS", "") not in ("", "0")


@pytest.mark.parametrize("pair", PAIRS if ALL_PAIRS_ON_CPU else CORE_PAIRS, ids=_id)
def test_cpu_matches_numpy(pair):
    _check_pair(*pair, "cpu")


@settings(max_examples=12, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow])
@given(pair=st.sampled_from([p for p in PAIRS if p not in CORE_PAIRS]),
       seeds=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)))
def test_cpu_matches_numpy_on_drawn_pairs_and_values(pair, seeds):
    _check_pair(*pair, "cpu", seeds)


@pytest.mark.parametrize("pair", PAIRS, ids=_id)
@pytest.mark.skipif(gpu_available(), reason="the simulator runs where no GPU is visible")
def test_simulator_matches_numpy(pair):
    _check_pair(*pair, "sim")


@pytest.mark.gpu
@pytest.mark.parametrize("pair", PAIRS, ids=_id)
def test_gpu_matches_numpy(pair):
    _check_pair(*pair, "gpu")


def test_the_matrix_covers_every_dtype_and_python_number():
    seen = {x for pair in PAIRS for x in pair}
    assert seen == set(OPERANDS) == {x for pair in CORE_PAIRS for x in pair}
    assert set(CORE_PAIRS) <= set(PAIRS)
    assert len(PAIRS) == len(DTYPES) * (len(DTYPES) + 2 * len(PYTHON)) + len(PYTHON_PAIRS)
