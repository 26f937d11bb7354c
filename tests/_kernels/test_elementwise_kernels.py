"""Kernel layer: code generation, dimension collapsing, dtype inference, CPU and CUDA kernels.

CUDA kernels run on numba's CUDA simulator where no GPU is visible (small sizes), on the real
GPU otherwise.
"""

from __future__ import annotations

import cmath
import math

import numpy as np
import pytest
from helpers import DTYPES, assert_same, random_array

from dask_gpuchunk._kernels.elementwise import (
    REDUCTIONS,
    ElementwiseKernels,
    ElementwisePlan,
    check_dtype,
    collapse_dims,
    kernels_for,
    numba_result_dtype,
    partial_count,
    partial_dtype,
    reduced_dtype,
    reference,
)
from dask_gpuchunk.ufunc.numpy_rules import VType


def mul(a, b):
    return a * b


def fma3(a, b, c):
    return a * b + c


@pytest.mark.parametrize(
    "shape, strides, expected",
    [
        ((100, 4000, 5), [(160000, 40, 8), (0, 40, 8)], ((100, 20000), [(160000, 8), (0, 8)])),
        ((3, 4), [(32, 8), (32, 8)], ((12,), [(8,), (8,)])),
        ((3, 4), [(8, 24)], ((3, 4), [(8, 24)])),  # Fortran order does not collapse
        ((1, 1), [(8, 8)], ((1,), [(0,)])),
        ((2, 1, 3), [(24, 24, 8), (0, 0, 8)], ((2, 3), [(24, 8), (0, 8)])),
        ((5, 6), [(48, 8), (0, 0)], ((30,), [(8,), (0,)])),
        ((5, 6), [(48, 8), (8, 0)], ((5, 6), [(48, 8), (8, 0)])),
    ],
)
def test_collapse_dims(shape, strides, expected):
    assert collapse_dims(shape, strides) == expected


def test_collapse_dims_matches_numpy_views(rng):
    # Walking the collapsed views visits the same elements as the originals.
    a = rng.random((4, 6, 5))[:, ::2, :]
    b = rng.random((6, 1))[::2]
    shape = np.broadcast_shapes(a.shape, b.shape)
    bb = np.broadcast_to(b, shape)
    new_shape, (sa, sb) = collapse_dims(shape, [a.strides, bb.strides])
    va = np.lib.stride_tricks.as_strided(a, new_shape, sa)
    vb = np.lib.stride_tricks.as_strided(bb, new_shape, sb)
    np.testing.assert_array_equal(va.ravel(), a.ravel())
    np.testing.assert_array_equal(vb.ravel(), bb.ravel())


@pytest.mark.parametrize("x", DTYPES)
@pytest.mark.parametrize("y", DTYPES)
def test_result_dtype_matches_numpy_promotion(x, y):
    expected = (np.ones(1, x) * np.ones(1, y)).dtype
    assert ElementwiseKernels(mul, 2).result_dtype([VType(np.dtype(x)), VType(np.dtype(y))]) == expected


def test_result_dtype_of_functions_by_numpy_rules():
    f64, f32, i8 = VType(np.dtype("f8")), VType(np.dtype("f4")), VType(np.dtype("i1"))

    def result(func, *types):
        return ElementwiseKernels(func, len(types)).result_dtype(types)

    assert result(lambda a: math.sqrt(a), f32) == np.float64  # math gives a Python float
    assert result(lambda a: a > 0, f64) == np.bool_
    assert result(lambda a: cmath.sqrt(a), f64) == np.complex128
    assert result(lambda a, b: a // b, i8, i8) == np.int8
    assert result(lambda a: math.log(a - 1.0), f32) == np.float64


def test_numba_rules_take_numbas_types():
    k = ElementwiseKernels(mul, 2, rules="numba")
    assert k.result_dtype([VType(np.dtype("i1"))] * 2) == np.int64  # numba widens
    assert numba_result_dtype(mul, [np.dtype("f4"), np.dtype("f4")]) == np.float32


def test_numba_rules_reject_uncompilable_function():
    def uses_object(a):
        return object()

    with pytest.raises(TypeError, match="numba cannot compile 'uses_object'"):
        numba_result_dtype(uses_object, [np.dtype("f8")])
    with pytest.raises(TypeError, match="returns array"):
        numba_result_dtype(lambda a: np.empty(3), [np.dtype("f8")])


def test_numba_rules_give_one_dtype_per_value_of_a_returned_tuple():
    assert numba_result_dtype(lambda a: (a, a > 0), [np.dtype("f4")]) == (
        np.dtype("f4"), np.dtype("bool"))


@pytest.mark.parametrize("dtype", ["float16", "object", "U3", "datetime64[ns]", ">f8"])
def test_check_dtype_rejects(dtype):
    with pytest.raises(TypeError, match="x has"):
        check_dtype(dtype, "x")


def test_reference_wraps_like_numpy():
    a = np.array([100, -100, 7], dtype=np.int8)
    assert_same(reference(mul, "int8", a, a), a * a)


def _cpu(func, nargs, out_dtype, *args):
    k = ElementwiseKernels(func, nargs)
    shape = np.broadcast_shapes(*(np.shape(a) for a in args))
    out = np.empty(shape, dtype=out_dtype)
    views = [a if isinstance(a, np.generic) else np.broadcast_to(a, shape) for a in args]
    k.cpu(out, *views)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_kernel_every_dtype(rng, dtype):
    a = random_array(rng, (37,), dtype)
    b = random_array(rng, (37,), dtype)
    with np.errstate(all="ignore"):
        expected = a * b
    assert_same(_cpu(mul, 2, expected.dtype, a, b), expected)


@pytest.mark.parametrize("shape_a, shape_b", [((7, 1, 5), (4, 1)), ((3, 4, 5, 2), (2,)),
                                              ((1,), (6, 7)), ((2, 3), (2, 3))])
def test_cpu_kernel_broadcast_and_ndim(rng, shape_a, shape_b):
    a = rng.random(shape_a)
    b = rng.random(shape_b)
    assert_same(_cpu(mul, 2, np.float64, a, b), a * b)


def test_cpu_kernel_strided_and_scalar_arguments(rng):
    a = rng.random((9, 8))[::2, ::-3]
    c = rng.random((8, 9)).T[:5, :3]
    assert_same(_cpu(fma3, 3, np.float64, a, np.float64(2.5), c), a * 2.5 + c)


def test_cpu_kernel_nd_blocks_cover_every_element(rng):
    # More elements than parallel blocks, with rows that straddle block boundaries.
    a = rng.random((37, 29, 3))
    b = rng.random((29, 1))
    assert_same(_cpu(mul, 2, np.float64, a, b), a * b)


def test_kernels_for_is_one_per_token():
    k1 = kernels_for(mul, 2, "token-mul")
    assert kernels_for(mul, 2, "token-mul") is k1
    import pickle

    assert pickle.loads(pickle.dumps(k1)) is k1


# ---- CUDA kernels: simulator on CPU-only machines, the real GPU elsewhere ------------------


def _cuda(func, nargs, out_dtype, *args, views=None):
    from numba import cuda

    k = ElementwiseKernels(func, nargs)
    shape = np.broadcast_shapes(*(np.shape(a) for a in args))
    out = cuda.device_array(shape, dtype=out_dtype)
    dev = [a if isinstance(a, np.generic) else cuda.to_device(np.ascontiguousarray(
        np.broadcast_to(a, shape))) for a in args]
    k.cuda(out, *dev)
    return out.copy_to_host()


# numba's simulator runs the kernel on NumPy scalars, which warn where the GPU wraps silently.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "int64", "uint64", "float32",
                                   "float64", "complex64", "complex128"])
def test_cuda_kernel_dtypes(rng, dtype):
    a = random_array(rng, (150,), dtype)
    b = random_array(rng, (150,), dtype)
    with np.errstate(all="ignore"):
        expected = a * b
    assert_same(_cuda(mul, 2, expected.dtype, a, b), expected, exact=dtype[0] != "c")


def test_cuda_kernel_2d_broadcast_and_scalar(rng):
    # Exact: a * b + c is rounded twice, as NumPy does; the GPU does not fuse it into one FMA.
    a = rng.random((5, 40)).astype(np.float32)
    c = rng.random((40,)).astype(np.float32)
    expected = a * np.float32(3) + c
    assert_same(_cuda(fma3, 3, np.float32, a, np.float32(3), c), expected)


def test_cuda_kernel_3d_grid_stride(rng):
    # More elements than the launch's threads: the grid-stride loop must cover all of them.
    a = rng.random((3, 9, 11))
    b = rng.random((9, 11))
    assert_same(_cuda(mul, 2, np.float64, a, b), a * b)


def test_cuda_kernel_user_function_with_math(rng):
    def damped(x, k):
        return math.exp(-k * x) * math.cos(x)

    x = rng.random(70)
    out = _cuda(damped, 2, np.float64, x, np.float64(0.3))
    np.testing.assert_allclose(out, np.exp(-0.3 * x) * np.cos(x), rtol=1e-12)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_cuda_kernel_nan_inf_pass_through():
    a = np.array([np.nan, np.inf, -np.inf, 1.0, 0.0])
    b = np.array([1.0, 2.0, 0.0, np.nan, np.inf])
    with np.errstate(all="ignore"):
        assert_same(_cuda(mul, 2, np.float64, a, b), a * b)


@pytest.mark.parametrize("shape", [(301,), (3, 5, 7)])
def test_cuda_kernel_grid_smaller_than_the_array(rng, shape, monkeypatch):
    # One thread per element, and a grid-stride loop for what a smaller grid leaves.
    from numba import cuda

    from dask_gpuchunk._kernels import elementwise as kmod

    monkeypatch.setattr(kmod, "_launch_config", lambda n: (32, 2))
    k = ElementwiseKernels(mul, 2)
    a = rng.random(shape)
    b = rng.random(shape[-1:])
    out = cuda.device_array(shape)
    k.cuda(out, cuda.to_device(a), cuda.to_device(np.ascontiguousarray(np.broadcast_to(b, shape))))
    assert_same(out.copy_to_host(), a * b)


def test_launch_config_covers_the_array_with_one_thread_each(monkeypatch):
    from numba.cuda import config as cuda_config

    from dask_gpuchunk._kernels.elementwise import MAX_BLOCKS, _launch_config

    monkeypatch.setattr(cuda_config, "ENABLE_CUDASIM", False)
    for n in (1, 127, 128, 129, 500_000_000):
        threads, blocks = _launch_config(n)
        assert threads * blocks >= n > threads * (blocks - 1)
    assert _launch_config(0)[1] == 1
    assert _launch_config(2**60)[1] == MAX_BLOCKS  # the loop covers the rest


# ---- passes: several outputs and fused reductions -------------------------------------------


def rotate_and_compare(a, b):
    return a * b - b, a > b


def _pass_plan(outs, reductions):
    return ElementwisePlan(tuple(np.dtype(d) for d in outs), True, tuple(reductions))


def _check_pass(outs_got, partials, plan, a, b, combine):
    expected = [reference(lambda x, y: rotate_and_compare(x, y)[k], dt, a, b)
                for k, dt in enumerate(plan.out_dtypes)]
    for got, want in zip(outs_got, expected):
        assert_same(got, want, exact=False)
    for (k, op), part in zip(plan.reductions, partials):
        value = combine(op, part)
        want = {"sum": np.sum, "mean": np.sum, "min": np.min, "max": np.max}[op](
            expected[k].astype(part.dtype))
        np.testing.assert_allclose(value, want, rtol=1e-12)


def _combine(op, part):
    return part.sum() if op in ("sum", "mean") else part.min() if op == "min" else part.max()


@pytest.mark.parametrize("dtype", ["float32", "int16", "uint8", "float64"])
@pytest.mark.parametrize("shape", [(37,), (13, 7), (3, 5, 4)])
def test_cpu_pass_gives_every_output_and_each_reduction_of_them(rng, dtype, shape):
    a, b = random_array(rng, shape, dtype), random_array(rng, shape[-1:], dtype)
    out0 = np.result_type(a.dtype, b.dtype) if dtype != "uint8" else np.dtype("uint8")
    plan = _pass_plan([a.dtype, "bool"], [(0, "sum"), (0, "min"), (0, "max"), (1, "sum")])
    k = ElementwiseKernels(rotate_and_compare, 2)
    outs = [np.empty(shape, dt) for dt in plan.out_dtypes]
    n = int(np.prod(shape))
    partials = [np.empty(partial_count(n, "cpu"), dt) for dt in plan.partial_dtypes()]
    with np.errstate(all="ignore"):
        k.cpu_pass(plan, outs, partials, a, np.broadcast_to(b, shape))
        _check_pass(outs, partials, plan, a, b, _combine)
    assert out0 == outs[0].dtype


def test_cuda_pass_combines_the_blocks_partials_into_each_total(rng):
    from numba import cuda

    shape = (41, 9)  # several blocks, each looping over several elements per thread
    a, b = rng.standard_normal(shape), rng.standard_normal(shape)
    a[3, 4] = np.nan
    plan = _pass_plan(["float64", "bool"], [(0, "sum"), (0, "max"), (1, "sum")])
    k = ElementwiseKernels(rotate_and_compare, 2)
    outs = [cuda.device_array(shape, dt) for dt in plan.out_dtypes]
    n = a.size
    # The first total in float32: written in the dtype it is wanted in.
    total_dtypes = [np.dtype("float32"), np.dtype("float64"), np.dtype("int64")]

    def run(a):
        partials = [cuda.device_array(partial_count(n, "cuda"), dt)
                    for dt in plan.partial_dtypes()]
        totals = [cuda.device_array(1, dt) for dt in total_dtypes]
        k.cuda_pass(plan, outs, [*partials, *totals, counter], cuda.to_device(a),
                    cuda.to_device(b))
        return [t.copy_to_host()[0] for t in totals]

    counter = cuda.to_device(np.zeros(1, np.uint32))
    totals = run(a)
    assert np.isnan(totals[0]) and np.isnan(totals[1])  # NaN propagates, as NumPy's
    assert counter.copy_to_host()[0] == 0  # left for the next pass on the stream
    a[3, 4] = 0.0
    totals = run(a)  # the same counter again
    got = [o.copy_to_host() for o in outs]
    expected = [reference(lambda x, y: rotate_and_compare(x, y)[k], dt, a, b)
                for k, dt in enumerate(plan.out_dtypes)]
    assert_same(got[0], expected[0], exact=False)
    assert_same(got[1], expected[1])
    assert totals[0].dtype == np.float32
    np.testing.assert_allclose(totals[0], expected[0].sum(), rtol=1e-6)
    assert totals[1] == expected[0].max()
    assert totals[2] == expected[1].sum() and totals[2].dtype == np.int64
    assert counter.copy_to_host()[0] == 0


def test_reduction_dtypes_are_numpys_and_partials_wider():
    assert [reduced_dtype(op, "int8") for op in REDUCTIONS] == [
        np.dtype("int64"), np.dtype("float64"), np.dtype("int8"), np.dtype("int8")]
    assert reduced_dtype("sum", "complex64") == np.complex64
    assert partial_dtype("sum", "float32") == np.float64
    assert partial_dtype("sum", "uint16") == np.uint64
    with pytest.raises(TypeError, match="lexicographically"):
        reduced_dtype("max", "complex128")
    with pytest.raises(ValueError, match="unknown reduction"):
        reduced_dtype("median", "f8")
