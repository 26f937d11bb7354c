"""dg.elementwise and dg.multiply over Dask arrays, against NumPy, on the CPU (and the GPU)."""

from __future__ import annotations

import cmath
import importlib
import math

import dask
import dask.array as da
import numpy as np
import pytest
from dask.blockwise import Blockwise
from dask.array.utils import assert_eq
from helpers import DTYPES, assert_same, random_array

import dask_gpuchunk as dg
from dask_gpuchunk.devices import gpu_available

elementwise_module = importlib.import_module("dask_gpuchunk.elementwise_ops.operations")

DEVICES_HERE = ["cpu", "auto"] + (["gpu"] if gpu_available() else [])
#: For the dtype tables: without a GPU, "auto" runs every chunk on the CPU, the "cpu" row's
#: path (26 s of CI's two cores for nothing more); with one, it places chunks, so it stays.
DEVICES_PER_DTYPE = ["cpu", "auto", "gpu"] if gpu_available() else ["cpu"]


@pytest.fixture(autouse=True)
def _threaded_scheduler():
    with dask.config.set(scheduler="threads"):
        yield


@pytest.fixture(params=["listed", "blockwise"])
def graph_form(request, monkeypatch):
    """Both graph forms of a result: tasks listed in a dict (small results) and a Blockwise
    layer (results of more than LISTED_GRAPH_MAX_BLOCKS blocks)."""
    if request.param == "blockwise":
        monkeypatch.setattr(elementwise_module, "LISTED_GRAPH_MAX_BLOCKS", 0)
    return request.param


# ---- every dtype, exact against NumPy ------------------------------------------------------


@pytest.mark.dtypes
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES_PER_DTYPE)
def test_multiply_every_dtype_uneven_chunks(rng, dtype, device):
    a = random_array(rng, (23, 17), dtype)
    b = random_array(rng, (23, 17), dtype)
    x = da.from_array(a, chunks=((5, 11, 7), (9, 8)))
    y = da.from_array(b, chunks=((12, 11), (4, 13)))  # mismatched chunks: unified
    result = dg.multiply(x, y, device=device)
    with np.errstate(all="ignore"):
        expected = a * b
    assert result.dtype == expected.dtype
    assert_same(result.compute(), expected)


# Every pair's values are checked at the kernel level (tests/ufunc/test_numpy_rules.py);
# here every dtype meets an int8, a uint64 or a float32 in turn through dg.multiply's whole
# path, and the pairs whose promotion widens or changes kind meet both ways (one compiled CPU
# kernel per pair, 2.5 s each on CI's cores: all 39 pairs took a minute of the run).
MIXED_PAIRS = [(x, ("int8", "uint64", "float32")[i % 3]) for i, x in enumerate(DTYPES)] + [
    ("uint64", "int8"), ("uint8", "int8"), ("bool", "float32"), ("int8", "float32")]


@pytest.mark.dtypes
@pytest.mark.parametrize("x_dtype, y_dtype", MIXED_PAIRS)
def test_multiply_mixed_dtypes_follow_numpy_promotion(rng, x_dtype, y_dtype):
    a = random_array(rng, (9, 4), x_dtype)
    b = random_array(rng, (4,), y_dtype)
    with np.errstate(all="ignore"):
        expected = a * b
    result = dg.multiply(da.from_array(a, chunks=(4, 3)), b, device="cpu")
    assert result.dtype == expected.dtype
    assert_same(result.compute(), expected, exact=True)


# ---- broadcasting, scalars, shapes ---------------------------------------------------------


def test_broadcast_of_a_small_table_against_a_large_one(rng, graph_form):
    mult_by = rng.random((4000, 5))
    discount = rng.random((100, 4000, 5))
    result = dg.multiply(mult_by, da.from_array(discount, chunks=(30, 1500, 5)))
    assert result.shape == (100, 4000, 5)
    assert result.chunks == ((30, 30, 30, 10), (1500, 1500, 1000), (5,))
    assert_same(result.compute(), mult_by * discount)


@pytest.mark.parametrize("shape_x, shape_y", [((6, 1), (1, 7)), ((3, 1, 4), (5, 1)),
                                              ((1,), (8, 3)), ((2, 3, 4), ())])
def test_broadcasting_both_ways(rng, shape_x, shape_y, graph_form):
    a = rng.standard_normal(shape_x)
    b = rng.standard_normal(shape_y)
    x = da.from_array(a, chunks=2) if a.ndim else a
    y = da.from_array(b, chunks=2) if b.ndim else b
    assert_same(dg.multiply(x, y).compute(), a * b)


@pytest.mark.parametrize("shape_x, shape_y", [((0, 3), (1, 3)), ((4, 1, 0), (1, 5, 1)),
                                              ((5, 0), (1,))])
def test_zero_length_dimensions_broadcast(rng, shape_x, shape_y, graph_form):
    a = rng.standard_normal(shape_x)
    b = rng.standard_normal(shape_y)
    result = dg.multiply(da.from_array(a, chunks=2), da.from_array(b, chunks=2))
    assert result.shape == (a * b).shape
    assert_same(result.compute(), a * b)


def test_one_task_per_block_that_dask_composes_and_culls(rng, graph_form):
    a = rng.standard_normal((7, 9))
    b = rng.standard_normal((1, 9))
    x = da.from_array(a, chunks=(3, 4))
    result = dg.multiply(x, da.from_array(b, chunks=(1, 4)))
    assert result.chunks == x.chunks
    if da.array_expr_enabled():  # expressions, not layers: what they compute is checked below
        assert math.prod(result.numblocks) == 9
    else:
        layer = result.dask.layers[result.name]
        assert isinstance(layer, Blockwise) == (graph_form == "blockwise")
        assert len(layer) == result.npartitions == 9
    # Dask sums across the row chunks in its own order: equal to rounding.
    assert_same((result[2:5, 1:] + 1).sum(axis=0).compute(), ((a * b)[2:5, 1:] + 1).sum(axis=0),
                exact=False)
    # A slice computes only the blocks it needs.
    if not da.array_expr_enabled():
        with dask.config.set({"optimization.fuse.active": False}):
            (corner,) = dask.optimize(result[:3, :4])
        ours = [k for k in dict(corner.dask) if isinstance(k, tuple) and k[0] == result.name]
        assert ours == [(result.name, 0, 0)]
    assert_same(result[:3, :4].compute(), (a * b)[:3, :4])


@pytest.mark.skipif(da.array_expr_enabled(), reason="array query planning: no graph layers")
def test_results_of_many_blocks_stay_lazy_blockwise_layers():
    limit = elementwise_module.LISTED_GRAPH_MAX_BLOCKS
    listed = dg.multiply(da.ones((limit, 2), chunks=(1, 2)), 2.0, device="cpu")
    lazy = dg.multiply(da.ones((limit + 1, 2), chunks=(1, 2)), 2.0, device="cpu")
    assert not isinstance(listed.dask.layers[listed.name], Blockwise)
    assert isinstance(lazy.dask.layers[lazy.name], Blockwise)
    assert_same(lazy[-2:].compute(), np.full((2, 2), 2.0))


@pytest.mark.dtypes
@pytest.mark.parametrize("array_dtype", ["int8", "uint8", "float32", "complex64", "bool"])
@pytest.mark.parametrize("scalar", [3, 2.5, 1j, True, np.float64(2.5), np.int16(3)])
def test_scalars_follow_nep50(rng, array_dtype, scalar):
    a = random_array(rng, (11,), array_dtype)
    try:
        with np.errstate(all="ignore"):
            expected = a * scalar
    except (OverflowError, TypeError) as exc:
        with pytest.raises(type(exc)):
            dg.multiply(da.from_array(a, chunks=4), scalar)
        return
    result = dg.multiply(da.from_array(a, chunks=4), scalar)
    assert result.dtype == expected.dtype
    assert_same(result.compute(), expected)
    # scalar first
    assert_same(dg.multiply(scalar, da.from_array(a, chunks=4)).compute(), scalar * a)


def test_python_int_out_of_range_raises_like_numpy():
    x = da.from_array(np.arange(5, dtype=np.int8), chunks=2)
    with pytest.raises(OverflowError):
        np.arange(5, dtype=np.int8) * 300
    with pytest.raises(OverflowError):
        dg.multiply(x, 300)


def test_all_scalars_give_a_numpy_scalar_and_0d_dask_operands_a_0d_dask_array(graph_form):
    r = dg.multiply(3, np.float32(2))
    assert type(r) is np.float32 and r == 6  # as np.multiply gives
    r = dg.multiply(da.from_array(np.float32(2)), 3)
    assert isinstance(r, da.Array) and r.shape == () and r.dtype == np.float32
    assert r.compute() == np.float32(6)


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0), (1,), (1, 1), ()])
def test_empty_0d_and_single_element(rng, shape, graph_form):
    a = rng.random(shape)
    b = rng.random(shape)
    x = da.from_array(a, chunks=2) if a.ndim else a
    result = dg.multiply(x, b)
    assert result.shape == shape
    assert isinstance(result, da.Array) == bool(a.ndim)
    assert_same(np.asarray(result.compute() if a.ndim else result), a * b)


def test_nan_and_inf_pass_through():
    a = np.array([np.nan, np.inf, -np.inf, 1.0, 0.0, -0.0, 5e307])
    b = np.array([1.0, 2.0, 0.0, np.nan, np.inf, 3.0, 10.0])
    with np.errstate(all="ignore"):
        assert_same(dg.multiply(da.from_array(a, chunks=3), b).compute(), a * b)
        c = a.astype(np.complex128) + 1j * b[::-1]
        assert_same(dg.multiply(c, b), c * b, exact=False)


@pytest.mark.parametrize("layout", ["sliced", "fortran", "reversed", "transposed"])
def test_non_contiguous_inputs(rng, layout):
    base = rng.random((40, 30))
    a = {
        "sliced": base[::3, 1::2],
        "fortran": np.asfortranarray(base[:14, :15]),
        "reversed": base[::-3, ::-2],
        "transposed": base.T[:15, :14],
    }[layout]
    b = rng.random(a.shape[1])
    assert_same(dg.multiply(a, b, device="cpu"), a * b)
    assert_same(dg.multiply(da.from_array(a, chunks=(5, 4)), b).compute(), a * b)


def test_numpy_and_list_inputs_are_chunked_like_the_dask_operand(rng):
    a = rng.random((10, 6))
    x = da.from_array(a, chunks=(3, 4))
    r = dg.multiply(a, x)
    assert r.chunks == x.chunks
    assert_same(dg.multiply(x, [1.0, 2, 3, 4, 5, 6]).compute(), a * np.array([1.0, 2, 3, 4, 5, 6]))


# ---- user functions -------------------------------------------------------------------------


@dg.elementwise
def damped(x, k):
    return math.exp(-k * x) * math.cos(x)


@dg.elementwise
def clip_add(a, b, c):
    s = a + b
    if s > c:
        return c
    return s


@dg.elementwise
def polar(r, theta):
    return r * cmath.exp(1j * theta)


def test_user_function_with_math(rng):
    a = rng.random((20, 9))
    r = damped(da.from_array(a, chunks=(7, 4)), 0.75)
    assert r.dtype == np.float64
    np.testing.assert_allclose(r.compute(), np.exp(-0.75 * a) * np.cos(a), rtol=1e-14)


def test_three_argument_function_with_branches(rng):
    a, b = rng.random((8, 5)), rng.random((8, 5))
    c = rng.random(5)
    r = clip_add(da.from_array(a, chunks=3), b, c)
    assert_same(r.compute(), np.minimum(a + b, c))


def test_complex_result(rng):
    r_, t = rng.random(30), rng.random(30) * 6
    r = polar(da.from_array(r_, chunks=7), t)
    assert r.dtype == np.complex128
    np.testing.assert_allclose(r.compute(), r_ * np.exp(1j * t), rtol=1e-14)


def test_dtype_override_and_decorator_with_arguments():
    @dg.elementwise(dtype="float32", name="halve")
    def halve(x):
        return x / 2

    r = halve(da.arange(7, chunks=3))
    assert r.dtype == np.float32
    assert r.name.startswith("halve-")
    assert_same(r.compute(), (np.arange(7) / 2).astype(np.float32))


# ---- NumPy's rules, through the whole path ------------------------------------------------


@dg.elementwise
def third_of_product(a, b):
    return (a * b) // 3


@dg.elementwise
def mean_of_two(a, b):
    return (a + b) / 2


@dg.elementwise
def affine(x):
    return x * 0.1 + 0.7


@dg.elementwise
def scaled(x, k):
    return x * (k + 1)


@dg.elementwise
def powered(x, k):
    return x ** k


@pytest.mark.parametrize("device", DEVICES_HERE)
def test_numpy_values_not_numbas(device):
    a, b = np.array([100, 80, -86, 83], np.int8), np.array([3, -9, 5, 4], np.int8)
    assert_eq(third_of_product(da.from_array(a, chunks=2), b, device=device), (a * b) // 3)
    u, v = np.array([200, 250], np.uint8), np.array([60, 50], np.uint8)
    assert_eq(mean_of_two(u, v, device=device), (u + v) / 2)  # [2., 22.]: wraps first
    x = (np.random.default_rng(5).standard_normal(1000) * 100).astype(np.float32)
    r = affine(da.from_array(x, chunks=300), device=device)
    assert r.dtype == np.float32
    assert_eq(r, x * 0.1 + 0.7)  # float32 arithmetic, not float64 cast down


@pytest.mark.parametrize("device", DEVICES_HERE)
@pytest.mark.parametrize("signed", ["int8", "int16", "int32", "int64"])
def test_int_times_uint64_is_exact(signed, device):
    a = np.array([3, -2, 0, np.iinfo(signed).min, np.iinfo(signed).max], signed)
    b = np.array([2**64 - 1, 5, 2**63, 1, 2**40 + 3], np.uint64)
    assert_eq(dg.multiply(da.from_array(a, chunks=2), b, device=device), a * b)
    assert_eq(dg.multiply(b, a, device=device), b * a)
    assert_eq(dg.multiply(np.int8([3]), np.uint64([2**64 - 1]), device=device),
              np.int8([3]) * np.uint64([2**64 - 1]))


def test_python_numbers_are_checked_as_numpy_checks_them():
    x = da.from_array(np.arange(5, dtype=np.int8), chunks=2)
    assert_eq(scaled(x, 20), np.arange(5, dtype=np.int8) * 21)
    with pytest.raises(OverflowError, match="Python integer 128 out of bounds for int8"):
        scaled(x, 127)  # k + 1 does not fit int8: NumPy raises, so do we
    with pytest.raises(OverflowError, match="-1 out of bounds for uint8"):
        dg.multiply(np.arange(3, dtype=np.uint8), -1)
    assert_eq(powered(x, 3), np.arange(5, dtype=np.int8) ** 3)
    with pytest.raises(ValueError, match="negative integer powers"):
        powered(x, -1)


def test_python_numbers_are_weak_and_numpy_scalars_are_not():
    x = np.array([1.5, 2.25], np.float32)
    assert dg.multiply(x, 2.5).dtype == np.float32
    assert dg.multiply(x, np.float64(2.5)).dtype == np.float64
    assert dg.multiply(2.5, 3).dtype == np.float64  # two Python numbers: Python's float
    assert dg.multiply(2.5, 3) == 7.5
    assert dg.multiply.result_dtype("float32", float) == np.float32
    assert dg.multiply.result_dtype("int8", int) == np.int8


def test_float16_is_refused_with_the_reason():
    with pytest.raises(TypeError, match="float16.*numba's CPU target has no float16"):
        dg.multiply(np.ones(3, np.float16), 2.0)


def test_signature_shows_the_keywords():
    import inspect

    params = inspect.signature(dg.multiply).parameters
    assert list(params) == ["x1", "x2", "device", "out", "reduce"]
    assert params["device"].default == "auto" and params["out"].kind is params["out"].KEYWORD_ONLY
    assert list(inspect.signature(damped).parameters) == ["x1", "x2", "device", "out", "reduce"]


def test_rules_numba_compiles_functions_without_source():
    scope: dict = {}
    exec("def f(a, b):\n    return (a * b) // 3\n", scope)  # noqa: S102 - no source file
    with pytest.raises(TypeError, match="rules='numba'"):
        dg.elementwise(scope["f"])(np.int8([100]), np.int8([3]))
    op = dg.elementwise(scope["f"], rules="numba")
    r = op(np.int8([100]), np.int8([3]), device="cpu")
    assert r.dtype == np.int64 and r[0] == 100  # numba's own types: no wrapping
    with pytest.raises(ValueError, match="rules must be one of"):
        dg.elementwise(scope["f"], rules="c")


def test_integer_arithmetic_wraps_like_numpy(rng):
    a = np.array([100, -128, 127, 3], dtype=np.int8)
    with np.errstate(all="ignore"):
        assert_same(dg.multiply(a, a), a * a)


def test_result_is_deterministic_and_lazy(rng):
    a = rng.random((6, 6))
    x = da.from_array(a, chunks=3)
    r1, r2 = dg.multiply(x, x), dg.multiply(x, x)
    assert r1.name == r2.name  # same inputs, same graph
    assert isinstance(r1, da.Array)


def test_repr_and_wrapped():
    assert "damped" in repr(damped) and damped.nargs == 2
    assert damped.__wrapped__(0.0, 1.0) == 1.0


# ---- out= ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES_HERE)
def test_out_is_written_in_place(rng, device):
    a = rng.random((50, 8))
    b = rng.random((50, 8))
    out = np.full((50, 8), np.nan)
    returned = dg.multiply(da.from_array(a, chunks=(13, 5)), b, device=device, out=out)
    assert returned is out
    assert_same(out, a * b)


def test_out_can_be_a_memmap(rng, tmp_path):
    a = rng.random((30, 4))
    out = np.lib.format.open_memmap(tmp_path / "c.npy", mode="w+", dtype=np.float64, shape=(30, 4))
    dg.multiply(da.from_array(a, chunks=7), 3.0, out=out)
    out.flush()
    assert_same(np.load(tmp_path / "c.npy"), a * 3.0)


# ---- errors a user can make ----------------------------------------------------------------


def test_shape_mismatch_names_the_shapes():
    with pytest.raises(ValueError, match=r"could not be broadcast together with shapes \(3, 4\) \(5,\)"):
        dg.multiply(da.ones((3, 4)), da.ones(5))


@pytest.mark.parametrize("bad", [np.ones(3, np.float16), np.array(["a", "b", "c"]),
                                 np.array([1, 2, 3], dtype="datetime64[s]"), np.array([None] * 3)])
def test_unsupported_dtypes_are_refused(bad):
    with pytest.raises(TypeError, match="argument 1"):
        dg.multiply(bad, 2)


def test_non_array_argument_is_refused():
    with pytest.raises(TypeError, match="argument 2"):
        dg.multiply(np.ones(3), {"a": 1})


def test_wrong_number_of_arguments():
    with pytest.raises(TypeError, match="multiply takes 2 arguments, got 3"):
        dg.multiply(np.ones(3), np.ones(3), np.ones(3))


def test_bad_device_value():
    with pytest.raises(ValueError, match="device must be one of"):
        dg.multiply(np.ones(3), 2, device="cuda")


@pytest.mark.skipif(gpu_available(), reason="a GPU is visible")
def test_gpu_requested_without_gpu_says_so():
    with pytest.raises(dg.GPUNotAvailableError, match="no CUDA GPU is visible"):
        dg.multiply(np.ones(3), 2, device="gpu")


def test_functions_that_cannot_be_elementwise():
    with pytest.raises(TypeError, match="fixed number"):
        dg.elementwise(lambda *xs: xs[0])
    with pytest.raises(TypeError, match="needs a function"):
        dg.elementwise(42)
    with pytest.raises(TypeError, match="takes no arguments"):
        dg.elementwise(lambda: 1.0)

    @dg.elementwise
    def makes_object(x):
        return object()

    with pytest.raises(TypeError, match="cannot compile 'makes_object'.*object is a type"):
        makes_object(np.ones(3))

    @dg.elementwise(rules="numba")
    def makes_object_numba(x):
        return object()

    with pytest.raises(TypeError, match="numba cannot compile 'makes_object_numba'"):
        makes_object_numba(np.ones(3))


@pytest.mark.parametrize("out, match", [
    (np.empty((3, 5)), "shape"),
    (np.empty((3, 4), np.float32), "dtype"),
    ([0.0] * 12, "NumPy array"),
])
def test_out_mismatches(out, match):
    with pytest.raises((ValueError, TypeError), match=match):
        dg.multiply(np.ones((3, 4)), 2.0, out=out)


def test_out_read_only():
    out = np.empty((3, 4))
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        dg.multiply(np.ones((3, 4)), 2.0, out=out)


def test_unknown_chunk_sizes_are_refused():
    x = da.ones(10, chunks=5)
    try:
        x = x[x > 0]
    except NotImplementedError:
        pytest.skip("this dask (array query planning) has no boolean indexing")
    with pytest.raises(ValueError, match="compute_chunk_sizes"):
        dg.multiply(x, 2)


def test_failing_input_chunk_raises_at_compute(rng):
    # An input chunk that fails to load surfaces its error from compute(); out= is not returned.
    def load(block, block_info=None):
        if block_info[0]["chunk-location"] == (1,):
            raise OSError("chunk 1 could not be read")
        return block

    x = da.from_array(rng.random(8), chunks=3).map_blocks(load, dtype=np.float64)
    with pytest.raises(OSError, match="chunk 1"):
        dg.multiply(x, 2.0).compute()
    with pytest.raises(OSError, match="chunk 1"):
        dg.multiply(x, 2.0, out=np.empty(8))


# ---- GPU: CuPy chunks stay on the device ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cupy_chunks_every_dtype(rng, dtype):
    import cupy

    a = random_array(rng, (33, 10), dtype)
    b = random_array(rng, (10,), dtype)
    x = da.from_array(cupy.asarray(a), chunks=(8, 6))
    r = dg.multiply(x, cupy.asarray(b))
    assert isinstance(r._meta, cupy.ndarray)
    computed = r.compute()
    assert isinstance(computed, cupy.ndarray)
    with np.errstate(all="ignore"):
        assert_same(cupy.asnumpy(computed), a * b)


@pytest.mark.gpu
def test_cupy_mixed_with_numpy_and_scalars(rng, graph_form):
    import cupy

    a = rng.random((12, 7))
    x = dg.asarray(cupy.asarray(a), chunks=5)
    r = damped(x, np.float64(0.5))
    assert isinstance(r.compute(), cupy.ndarray)
    np.testing.assert_allclose(cupy.asnumpy(r.compute()), np.exp(-0.5 * a) * np.cos(a), rtol=1e-14)
    r = dg.multiply(x, a[0])  # NumPy row broadcast against CuPy chunks: result on the device
    assert_same(cupy.asnumpy(r.compute()), a * a[0])


@pytest.mark.gpu
def test_cpu_device_refuses_cupy():
    import cupy

    with pytest.raises(ValueError, match="CuPy"):
        dg.multiply(cupy.ones(3), 2.0, device="cpu")


@pytest.mark.gpu
def test_device_resident_loop_with_on_device_reduction(rng, monkeypatch):
    # Seed 002's pattern: persisted CuPy chunks stepped in a loop, a device reduction each
    # step; no staging copy to the host happens inside the loop.
    import cupy

    from dask_gpuchunk.runtime import staging

    def no_host_copy(*args, **kwargs):
        raise AssertionError("host copy inside a device-resident loop")

    monkeypatch.setattr(staging, "copy_to_host", no_host_copy)
    f0 = rng.random((64, 64))
    f = dg.asarray(cupy.asarray(f0), chunks=16).persist()
    expected = f0.copy()
    for _ in range(3):
        total = f.sum()                       # a CuPy 0-d chunk, on the device
        f = damped(f, total / 4096.0).persist()
        expected = np.exp(-(expected.sum() / 4096.0) * expected) * np.cos(expected)
    np.testing.assert_allclose(cupy.asnumpy(f.compute()), expected, rtol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("pinned_inputs", [False, True])
@pytest.mark.parametrize("pinned_out", [False, True])
def test_gpu_from_host_pinned_and_pageable(rng, pinned_inputs, pinned_out):
    from dask_gpuchunk.runtime.staging import empty_pinned

    a = rng.random((300, 40))
    b = rng.random((300, 40))
    if pinned_inputs:
        pa, pb = empty_pinned(a.shape), empty_pinned(b.shape)
        pa[...], pb[...] = a, b
        a, b = pa, pb
    out = empty_pinned(a.shape) if pinned_out else np.empty(a.shape)
    out[...] = np.nan
    dg.multiply(dg.asarray(a, chunks=(70, 40)), dg.asarray(b, chunks=(70, 40)), device="gpu",
                out=out)
    assert_same(out, np.asarray(a) * np.asarray(b))


@pytest.mark.gpu
def test_eager_device_calls_are_prepared_once_per_kind_and_stay_exact(rng):
    import cupy

    @dg.elementwise
    def scale_and_compare(p, q):
        return p * q, p > q

    a = rng.standard_normal((300, 257)).astype(np.float32)
    b = rng.standard_normal(257).astype(np.float32)
    x, y = cupy.asarray(a), cupy.asarray(b)
    reduce = (("sum", "max"), "sum")  # sum and max of the product, sum of the comparison
    for _ in range(3):
        prod, above, total, most, count = scale_and_compare(x, y, reduce=reduce)
    assert len(scale_and_compare._eager_calls) == 1  # the same kind of call: one preparation
    assert_same(prod.get(), a * b) and assert_same(above.get(), a > b)
    assert total.shape == () and total.dtype == np.float32
    np.testing.assert_allclose(total.get(), (a * b).astype(np.float64).sum(), rtol=1e-5)
    assert most.get() == (a * b).max() and count.get() == (a > b).sum()
    assert count.dtype == np.int64
    scale_and_compare(x[:7], y, reduce=reduce)  # another shape: another kind
    scale_and_compare(x, 2.0, reduce=reduce)
    assert len(scale_and_compare._eager_calls) == 3
    with pytest.raises(OverflowError):  # a Python number's value is checked on every call
        scale_and_compare(cupy.asarray(a.astype(np.int8)), 300)
    with pytest.raises(OverflowError):
        scale_and_compare(cupy.asarray(a.astype(np.int8)), 300)


@pytest.mark.gpu
def test_device_reductions_on_many_streams_at_once_are_each_right(rng):
    # Each stream's passes take their tickets from that stream's counter: passes running at
    # once on other streams, in other threads, never mix them.
    import concurrent.futures

    import cupy

    values = [rng.standard_normal(3_000_001) for _ in range(4)]

    def run(v):
        with cupy.cuda.Stream(non_blocking=True) as stream:
            x = cupy.asarray(v)
            totals = [dg.multiply(x, float(k), reduce="sum")[1] for k in range(1, 9)]
            stream.synchronize()
            return [float(t.get()) for t in totals]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, values))
    for v, got in zip(values, results):
        np.testing.assert_allclose(got, [v.sum() * k for k in range(1, 9)], rtol=1e-9)


# ---- eager calls, several outputs, fused reductions ----------------------------------------


def _on(xp, a):
    return a if xp is np or np.ndim(a) == 0 else xp.asarray(a)


def _host(x):
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


@elementwise_module.elementwise
def step_pair(f, g, d):
    return f * d + g, g - f


@pytest.mark.dtypes
@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_results_equal_the_dask_results_for_every_dtype(rng, xp, dtype):
    a, b = random_array(rng, (9, 7), dtype), random_array(rng, (7,), dtype)
    with np.errstate(all="ignore"):
        eager = dg.multiply(_on(xp, a), _on(xp, b))
        lazy = dg.multiply(dg.asarray(_on(xp, a), chunks=(4, 3)), _on(xp, b))
        assert type(eager) is type(_on(xp, a))  # NumPy in, NumPy out; CuPy in, CuPy out
        assert isinstance(lazy, da.Array)
        assert_same(_host(eager), _host(lazy.compute()))
        assert_same(_host(eager), a * b)


def test_eager_numpy_scalars_and_0d_results_are_numpy_scalars():
    r = dg.multiply(np.array(2.0, np.float32), 3)
    assert type(r) is np.float32 and r == 6
    f, g, total = step_pair(1.0, 2.0, 0.5, reduce=("sum", None))
    assert (f, g, total) == (2.5, 1.0, 2.5) and type(total) is np.float64


@pytest.mark.parametrize("shape, chunks", [((11, 7), (4, 3)), ((5,), 2), ((3, 1, 6), (2, 1, 4))])
def test_several_outputs_match_numpy_on_uneven_chunks(rng, shape, chunks, graph_form):
    f = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape[-1:])  # float64, broadcast
    F, G = step_pair(da.from_array(f, chunks=chunks), g, 0.5)
    assert F.dtype == np.float64 and G.dtype == np.float64 and F.chunks == G.chunks
    assert_same(F.compute(), f * 0.5 + g)
    assert_same(G.compute(), g - f)
    ef, eg = step_pair(f, g, 0.5)
    assert_same(ef, F.compute()) and assert_same(eg, G.compute())


@pytest.mark.dtypes
@pytest.mark.parametrize("dtype", ["int8", "uint16", "float32", "float64", "complex64", "bool"])
def test_fused_reductions_match_numpy(rng, dtype, graph_form):
    @dg.elementwise
    def scaled(x, y):
        return x * y

    a = random_array(rng, (13, 6), dtype)
    b = random_array(rng, (6,), dtype)
    ops = ("sum", "mean") if dtype.startswith("complex") else REDUCTION_NAMES
    with np.errstate(all="ignore"):
        expected = a * b
        lazy = scaled(da.from_array(a, chunks=(5, 4)), b, reduce=[ops])
        eager = scaled(a, b, reduce=[ops])
    assert_same(lazy[0].compute(), expected)
    for op, got_lazy, got_eager in zip(ops, lazy[1:], eager[1:]):
        want = getattr(expected, op)()
        assert got_lazy.shape == () and got_lazy.dtype == want.dtype, (op, got_lazy.dtype)
        value = got_lazy.compute()
        assert np.asarray(value).dtype == want.dtype and np.asarray(got_eager).dtype == want.dtype
        if want.dtype.kind in "biu":
            assert value == want and got_eager == want, op
        else:
            rtol = 1e-5 if want.dtype in (np.float32, np.complex64) else 1e-12
            np.testing.assert_allclose(value, want, rtol=rtol)
            np.testing.assert_allclose(got_eager, want, rtol=rtol)


REDUCTION_NAMES = ("sum", "mean", "min", "max")


def test_min_and_max_propagate_nan_and_sums_of_nothing_are_zero(graph_form):
    a = np.array([1.0, np.nan, -3.0, 2.0])
    _, lo, hi = dg.multiply(da.from_array(a, chunks=3), 2.0, reduce=[("min", "max")])
    assert np.isnan(lo.compute()) and np.isnan(hi.compute())
    empty = da.from_array(np.ones((0, 3)), chunks=2)
    out, total = dg.multiply(empty, 2.0, reduce="sum")
    assert out.shape == (0, 3) and total.compute() == 0.0
    with pytest.raises(ValueError, match="zero-size.*min has no identity"):
        dg.multiply(empty, 2.0, reduce="min")


def test_reductions_of_device_data_stay_on_the_device(xp, rng):
    f = rng.standard_normal((6, 5)).astype(np.complex64)
    F, G, total = step_pair(_on(xp, f), _on(xp, f), np.complex64(0.5), reduce=("sum", None))
    assert type(total) is (np.complex64 if xp is np else type(_on(xp, f)))
    np.testing.assert_allclose(_host(total), (f * 0.5 + f).sum(), rtol=1e-5)
    lazy = step_pair(dg.asarray(_on(xp, f), chunks=(4, 5)), _on(xp, f), np.complex64(0.5),
                     reduce=("sum", None))
    np.testing.assert_allclose(_host(lazy[2].compute()), _host(total), rtol=1e-6)
    assert type(lazy[2]._meta) is type(_on(xp, f))


def test_a_0d_device_scalar_feeds_the_next_step(xp, rng):
    f = _on(xp, rng.standard_normal(50))
    delta = f.mean() if xp is not np else np.float64(f.mean())
    for _ in range(3):
        f, g, delta = step_pair(f, f, delta, reduce=("mean", None))
    assert _host(f).shape == (50,) and np.isfinite(_host(delta))


def test_out_takes_a_tuple_on_both_paths(rng, xp):
    f, g = rng.standard_normal((4, 6)), rng.standard_normal(6)
    outs = (_on(xp, np.empty((4, 6))), _on(xp, np.empty((4, 6))))
    r = step_pair(_on(xp, f), _on(xp, g), 2.0, out=outs, reduce=(None, "max"))
    assert r[0] is outs[0] and r[1] is outs[1]
    assert_same(_host(outs[0]), f * 2.0 + g)
    assert float(_host(r[2])) == (g - f).max()
    if xp is np:
        host = (np.empty((4, 6)), np.empty((4, 6)))
        r = step_pair(da.from_array(f, chunks=(3, 4)), g, 2.0, out=host, reduce=(None, "max"))
        assert r[1] is host[1] and r[2] == (g - f).max()
        assert_same(host[1], g - f)


def test_bad_outputs_and_reductions_are_refused_before_any_work(rng):
    f = rng.standard_normal((4, 6))
    with pytest.raises(ValueError, match="unknown reduction 'median'"):
        step_pair(f, f, 1.0, reduce="median")
    with pytest.raises(ValueError, match="3 entries for 2 outputs"):
        step_pair(f, f, 1.0, reduce=("sum", None, None))
    with pytest.raises(TypeError, match="output 1: max of complex"):
        step_pair(f.astype(complex), f, 1.0, reduce="max")
    with pytest.raises(ValueError, match="out= has 1 arrays for 2 outputs"):
        step_pair(f, f, 1.0, out=(np.empty((4, 6)),))
    with pytest.raises(ValueError, match="out= entry 2 has shape"):
        step_pair(f, f, 1.0, out=(np.empty((4, 6)), np.empty((4, 5))))
    with pytest.raises(TypeError, match="returns 2 values; dtype= gives 3"):
        dg.elementwise(step_pair.func, dtype=("f4", "f4", "f4"))(f, f, 1.0)
    with pytest.raises(TypeError, match="helper function returns one number"):
        dg.elementwise(_calls_a_pair)(f)


def _pair(x):
    return x, x


def _calls_a_pair(x):
    return _pair(x)


def test_dtype_tuple_converts_each_output(rng):
    op = dg.elementwise(step_pair.func, dtype=("float32", "int64"))
    f = rng.standard_normal(5) * 10
    a, b = op(da.from_array(f, chunks=2), f, 1.0)
    assert a.dtype == np.float32 and b.dtype == np.int64
    assert_same(b.compute(), (f - f).astype(np.int64))
    assert op.result_dtype("f8", "f8", float) == (np.dtype("float32"), np.dtype("int64"))


def _complex_step(f, g, h):  # products feeding additions: where a fused multiply-add differs
    f1 = -2j * f - 1j * h * (2 * g - 1)
    return f + h / 2 * f1, g - h * f1 * f.conjugate()


def test_fma_is_a_distinct_operation_and_the_cpu_twin_keeps_numpys_values(rng):
    exact, fused = dg.elementwise(_complex_step), dg.elementwise(_complex_step, fma=True)
    assert fused.fma and not exact.fma and fused.kernels is not exact.kernels
    f = (rng.standard_normal(300) + 1j * rng.standard_normal(300)).astype(np.complex64)
    g = (rng.standard_normal(300) + 1j * rng.standard_normal(300)).astype(np.complex64)
    h = np.complex64(0.3 + 0.1j)
    for op in (exact, fused):
        got = dask.compute(*op(da.from_array(f, chunks=70), g, h, device="cpu"))
        want = _complex_step(f, g, h)
        for a, b in zip(got, want):
            assert a.dtype == np.complex64
            np.testing.assert_allclose(a, b, rtol=1e-6)
    with pytest.raises(TypeError, match="fma= takes True or False"):
        dg.elementwise(_complex_step, fma="yes")


@pytest.mark.gpu
def test_fma_on_the_gpu_within_a_rounding_of_numpy_eager_and_dask_alike(rng):
    import cupy

    fused = dg.elementwise(_complex_step, fma=True)
    n = 100_003
    f = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(np.complex64)
    g = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(np.complex64)
    h = np.complex64(0.3 + 0.1j)
    want = _complex_step(f, g, h)
    eager = fused(cupy.asarray(f), cupy.asarray(g), h, reduce=("sum", None))
    lazy = fused(da.from_array(cupy.asarray(f), chunks=30_000), cupy.asarray(g), h,
                 reduce=("sum", None))
    lazy = dask.compute(*lazy)
    for a, b, w in zip(eager[:2], lazy[:2], want):
        np.testing.assert_array_equal(cupy.asnumpy(a), cupy.asnumpy(b))
        scale = np.abs(w).max()
        assert np.abs(cupy.asnumpy(a) - w).max() <= 1e-6 * scale
    np.testing.assert_allclose(complex(eager[2]), complex(want[0].astype(np.complex128).sum()),
                               rtol=1e-5)


@pytest.mark.skipif(not dg.config.listed_graphs(), reason="only listed graphs read regions")
def test_npy_operands_are_read_by_the_block_that_uses_them(rng, tmp_path):
    # Read by tasks of their own, the two operands of a block were read on different workers
    # of two GPUs and one sent to the other (0.8 GB a worker for two 4 GB files). Now each
    # block's task reads its regions of the files, and distributed hands the tasks out as
    # root tasks; a row broadcast along the rows reads its one block each time.
    from dask.utils import key_split
    from distributed import Client, LocalCluster, get_task_stream

    from dask_gpuchunk.jobs import sent_by_workers

    a = rng.standard_normal((230, 70)).astype(np.float32)
    b = rng.standard_normal((230, 70)).astype(np.float32)
    row = rng.standard_normal((1, 70)).astype(np.float32)
    for label, value in (("a", a), ("b", b), ("row", row)):
        np.save(tmp_path / f"{label}.npy", value)
    x = dg.from_npy(tmp_path / "a.npy", chunks=(40, 30))
    y = dg.from_npy(tmp_path / "b.npy", chunks=(40, 30))
    r = dg.from_npy(tmp_path / "row.npy", chunks=(1, 30))
    product = dg.multiply(x, y)
    keys = {key_split(k) for k in dict(product.__dask_graph__())}
    assert not any(k.startswith("from-npy") for k in keys), keys
    np.testing.assert_array_equal(product.compute(), a * b)
    np.testing.assert_array_equal(dg.multiply(x, r).compute(), a * row)
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        before = sent_by_workers(client)
        with get_task_stream(client) as stream:
            got = client.compute(product.sum(dtype=np.float64), sync=True)
        sent = sent_by_workers(client, before)
    np.testing.assert_allclose(got, (a * b).sum(dtype=np.float64), rtol=1e-6)
    workers = {t["worker"] for t in stream.data if key_split(t["key"]).startswith("multiply")}
    assert len(workers) == 2
    assert sum(sent.values()) < 40 * 30 * 4, sent  # partial sums only: not one block


# ---- functions of a user's __main__ script on multi-process clusters -------------------------

SCRIPTS = __import__("pathlib").Path(__file__).resolve().parent.parent / "scripts"


def _run_script(name: str, *args: str, timeout: float = 240) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=SCRIPTS)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("cluster", ["dg", "plain"])
def test_functions_of_a_main_script_run_on_worker_processes(cluster):
    # The workers unpickle the functions by value, without their source file (cloudpickle names
    # it "<dynamic-code>"): the source taken where they were defined travels with them.
    assert _run_script("main_functions.py", cluster).strip().endswith("exact")


@pytest.mark.gpu
def test_functions_of_a_main_script_run_on_a_gpu_cluster():
    assert _run_script("main_functions.py", "dg", "--gpu").strip().endswith("exact")


# ---- xarray in, xarray out --------------------------------------------------------------------


def _divmod3(p, q):
    return p // q, p % q


@pytest.mark.skipif(type(da.ones(1)).__module__.startswith("dask.array._array_expr"),
                    reason="xarray cannot transpose dask's array expressions yet (dask raises "
                           "NotImplementedError in __array_function__), ours or NumPy's ufuncs")
def test_xarray_in_xarray_out_broadcast_by_dimension_names(rng):
    xr = pytest.importorskip("xarray")
    values = rng.standard_normal((5, 7))
    scale = rng.standard_normal(7)
    a = xr.DataArray(da.from_array(values, chunks=(2, 3)), dims=("time", "x"),
                     coords={"x": np.arange(7) * 10, "time": np.arange(5)}, name="a")
    b = xr.DataArray(scale, dims=("x",), coords={"x": np.arange(7) * 10})
    got = dg.multiply(b, a)  # by names: b's x meets a's x, whatever their positions
    want = b * a  # NumPy's ufunc on the same DataArrays
    assert isinstance(got, xr.DataArray) and isinstance(got.data, da.Array)
    assert got.dims == want.dims and list(got.coords) == list(want.coords)
    np.testing.assert_array_equal(got.values, want.values)
    eager = dg.multiply(b, a.compute(), device="cpu")  # NumPy-backed: NumPy data, at once
    assert isinstance(eager.data, np.ndarray)
    np.testing.assert_array_equal(eager.values, want.values)


def test_xarray_several_outputs_and_a_dataset(rng):
    xr = pytest.importorskip("xarray")
    ints = rng.integers(-50, 50, (4, 6)).astype(np.int16)
    a = xr.DataArray(ints, dims=("r", "c"))
    q, r = dg.elementwise(_divmod3)(a, 7)
    np.testing.assert_array_equal(q.values, ints // 7)
    np.testing.assert_array_equal(r.values, ints % 7)
    assert q.dtype == (ints // 7).dtype and q.dims == ("r", "c")
    ds = xr.Dataset({"u": a, "v": a * 2})
    doubled = dg.multiply(ds, 2)
    assert isinstance(doubled, xr.Dataset)
    np.testing.assert_array_equal(doubled["v"].values, ints * 4)
    with pytest.raises(TypeError, match="reduce= take no xarray"):
        dg.multiply(a, 2, reduce="sum")
