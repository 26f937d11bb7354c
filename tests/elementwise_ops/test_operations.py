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
