"""The user's own numba kernels over Dask arrays: dg.map_kernel, dg.gufunc_op, and numba
functions and ufuncs given to dg.elementwise."""

from __future__ import annotations

import dask
import dask.array as da
import numba
import numpy as np
import pytest
from numba import cuda

import dask_gpuchunk as dg
from dask_gpuchunk.user_kernels import checked_launch, default_launch, kernel_launch


@cuda.jit
def product(a, b, out):  # seed 000's kernel: a thread per row
    i = cuda.grid(1)
    if i < out.shape[0]:
        for j in range(out.shape[1]):
            out[i, j] = a[i, j] * b[i, j]


@numba.njit
def product_on_cpu(a, b, out):
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = a[i, j] * b[i, j]


@cuda.jit
def where_am_i(a, out, scale, row0, col0):  # a thread per element, offsets after args
    i, j = cuda.grid(2)
    if i < out.shape[0] and j < out.shape[1]:
        out[i, j] = a[i, j] + scale * ((row0 + i) * 1000 + col0 + j)


def where_am_i_on_cpu(a, out, scale, row0, col0):
    rows, cols = np.indices(out.shape)
    out[...] = a + scale * ((row0 + rows) * 1000 + col0 + cols)


def test_map_blocks_cpu_twin_uneven_chunks(rng):
    a = rng.random((23, 9))
    b = rng.random((23, 9)).astype(np.float32)  # NumPy: chunked as the Dask input is
    x = da.from_array(a, chunks=((7, 10, 6), (4, 5)))
    c = dg.map_kernel(product, x, b, dtype=np.float64, launch=1, cpu=product_on_cpu)
    assert c.chunks == x.chunks and c.dtype == np.float64
    np.testing.assert_array_equal(c.compute(), a * b)


def test_map_blocks_offsets_and_args(rng):
    a = rng.random((11, 13))
    x = da.from_array(a, chunks=(4, 6))
    c = dg.map_kernel(where_am_i, x, dtype=np.float64, cpu=where_am_i_on_cpu, args=(0.5,),
                      offsets=True)
    rows, cols = np.indices(a.shape)
    np.testing.assert_array_equal(c.compute(), a + 0.5 * (rows * 1000 + cols))


@cuda.jit
def rows_of_gram(a, out, row_offset):  # seed 001's row slice: A whole, rows row_offset on
    x, y = cuda.grid(2)
    if y < out.shape[0] and x < out.shape[1]:
        acc = 0
        for k in range(a.shape[1]):
            acc += a[y + row_offset, k] * a[x, k]
        out[y, x] = acc


@numba.njit
def rows_of_gram_on_cpu(a, out, row_offset):
    for y in range(out.shape[0]):
        for x in range(out.shape[1]):
            acc = 0
            for k in range(a.shape[1]):
                acc += a[y + row_offset, k] * a[x, k]
            out[y, x] = acc


def test_map_blocks_row_slabs_of_a_gram(rng):
    bits = rng.integers(0, 2, (19, 40), dtype=np.int32)
    whole = da.from_array(bits, chunks=-1)  # one block: given whole to every output block
    chunks = ((6, 6, 7), (19,))
    with pytest.raises(TypeError, match="the kernel takes 3 arguments; dg.map_kernel passes 4"):
        dg.map_kernel(rows_of_gram, whole, dtype=np.int32, chunks=chunks,
                      cpu=rows_of_gram_on_cpu, offsets=True)
    # x over the columns, y over the rows: the launch says so (the default puts x on rows).
    c = dg.map_kernel(rows_of_gram, whole, dtype=np.int32, chunks=chunks,
                      cpu=rows_of_gram_on_cpu, offsets=[0], launch=lambda shape: (
                          (-(-shape[1] // 16), -(-shape[0] // 16)), (16, 16)))
    assert c.chunks == chunks
    np.testing.assert_array_equal(c.compute(), bits @ bits.T)
    with pytest.raises(ValueError, match="offsets= takes"):
        dg.map_kernel(rows_of_gram, whole, dtype=np.int32, chunks=chunks,
                      cpu=rows_of_gram_on_cpu, offsets=[2])


def test_map_blocks_refuses_bad_input_before_any_work(rng):
    x = da.ones((8, 8), chunks=4)
    with pytest.raises(TypeError, match="@cuda.jit kernel.*dg.elementwise"):
        dg.map_kernel(product_on_cpu, x, x, dtype=float)
    with pytest.raises(TypeError, match="takes 3 arguments; dg.map_kernel passes 2"):
        dg.map_kernel(product, x, dtype=float, cpu=product_on_cpu)
    with pytest.raises(ValueError, match="1024"):
        dg.map_kernel(product, x, x, dtype=float, cpu=product_on_cpu,
                      launch=lambda shape: (1, 2048))
    with pytest.raises(ValueError, match="must return \\(blocks, threads\\)"):
        dg.map_kernel(product, x, x, dtype=float, cpu=product_on_cpu, launch=lambda shape: 3)
    with pytest.raises(ValueError, match="1, 2 or 3 grid dimensions"):
        dg.map_kernel(product, x, x, dtype=float, cpu=product_on_cpu, launch=4)
    with pytest.raises(ValueError, match="CPU twin"):
        dg.map_kernel(product, x, x, dtype=float, device="cpu")
    with pytest.raises(TypeError, match="one output"):
        dg.map_kernel(product, x, x, dtype=(float, float), cpu=product_on_cpu)
    with pytest.raises(ValueError, match="device must be"):
        dg.map_kernel(product, x, x, dtype=float, cpu=product_on_cpu, device="tpu")


def test_default_launch_covers_the_block():
    assert default_launch(1)((1000, 7)) == ((4,), (256,))
    assert default_launch(3)((9, 1, 5)) == ((2, 1, 2), (8, 8, 4))
    assert checked_launch(default_launch(2), (1,)) == ((1, 1), (16, 16))


def test_kernel_launch_runs_the_kernel_on_the_device(rng):
    # The GPU path's launch itself (numba's simulator where there is no GPU).
    a, b = rng.random((37, 5)), rng.random((37, 5))
    out = cuda.device_array((37, 5))
    kernel_launch(product, default_launch(1), ())(out, [cuda.to_device(a), cuda.to_device(b)],
                                                  0)
    np.testing.assert_array_equal(out.copy_to_host(), a * b)


@numba.guvectorize(["void(float32[:], float32[:], float32[:], float32[:])",
                    "void(float64[:], float64[:], float64[:], float64[:])"],
                   "(n),(n)->(),(n)")
def dot_and_sum(a, b, dot, total):
    acc = a[0] * 0
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
        total[i] = a[i] + b[i]
    dot[0] = acc


# Not yet under dask's array query planning: its apply_gufunc fails making the outputs' meta.
QUERY_PLANNING = bool(dask.config.get("array.query-planning", False))


@pytest.mark.skipif(QUERY_PLANNING, reason="dg.gufunc_op under array query planning: not yet")
def test_gufunc_two_outputs_broadcast_and_cast(rng):
    a = rng.random((3, 10, 6)).astype(np.float32)
    b = rng.random((10, 6)).astype(np.int16)  # cast to float32: the first loop it fits
    x = da.from_array(a, chunks=(2, 4, -1))
    dot, total = dg.gufunc_op(dot_and_sum)(x, b)
    assert dot.dtype == np.float32 and dot.shape == (3, 10) and total.shape == (3, 10, 6)
    ref_dot, ref_total = dot_and_sum(a, b.astype(np.float32))
    np.testing.assert_array_equal(dot.compute(), ref_dot)
    np.testing.assert_array_equal(total.compute(), ref_total)
    with pytest.raises(TypeError, match="no loop for inputs \\(complex64"):
        dg.gufunc_op(dot_and_sum)(x.astype(np.complex64), b)
    with pytest.raises(ValueError, match="core dimension 'n' of .* has multiple chunks"):
        dg.gufunc_op(dot_and_sum)(x.rechunk((2, 4, 3)), b)


# ---- numba functions and ufuncs in dg.elementwise ------------------------------------------


@numba.njit
def damping(x):
    return x * 0.5


@numba.vectorize(["complex64(complex64, complex64, complex64, float32)",
                  "complex128(complex128, complex128, complex128, float64)"])
def euler_step(g, f, delta, dt):
    return f + dt * (-2j * f - 1j * delta * (2 * g - 1)) + damping(dt)


def test_elementwise_takes_a_numba_ufunc_and_matches_it(rng):
    shape = (9, 14)
    g = (rng.random(shape) + 1j * rng.random(shape)).astype(np.complex64)
    f = (rng.random(shape) + 1j * rng.random(shape)).astype(np.complex64)
    delta = np.complex64(0.3 - 0.1j)
    op = dg.elementwise(euler_step)
    assert op.rules == "numba"
    expected = euler_step(g, f, delta, 0.01)  # the user's own ufunc, on the CPU
    assert expected.dtype == np.complex64
    eager = op(g, f, delta, 0.01, device="cpu")
    assert eager.dtype == np.complex64
    np.testing.assert_array_equal(eager, expected)
    lazy = op(da.from_array(g, chunks=(4, 5)), f, delta, 0.01)
    np.testing.assert_array_equal(lazy.compute(), expected)
    # float64 data picks the complex128 loop, as NumPy picks it for the ufunc.
    wide = op(g.astype(np.complex128), f, delta, 0.01, device="cpu")
    np.testing.assert_array_equal(wide, euler_step(g.astype(np.complex128), f, delta, 0.01))
    with pytest.raises(TypeError, match="no loop"):
        op(g, f, delta, np.ones(1, dtype=np.int64).view(np.timedelta64))


def test_elementwise_takes_njit_and_cuda_device_functions(rng):
    x = rng.integers(-50, 50, 31).astype(np.int8)
    by_numba = dg.elementwise(damping)
    assert by_numba.rules == "numba"
    np.testing.assert_array_equal(by_numba(x, device="cpu"), x * 0.5)

    @cuda.jit(device=True)
    def cube(v):
        return v * v * v

    # rules="numpy": NumPy's int8 arithmetic, wrapping, whatever compiled the function.
    wrapped = dg.elementwise(cube, rules="numpy")(da.from_array(x, chunks=8))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(wrapped.compute(), x * x * x)

    def uses_both(a, b):
        return cube(a) + damping(b)  # a plain function calling numba functions

    a, b = rng.random(17), rng.random(17)
    np.testing.assert_allclose(dg.elementwise(uses_both)(a, b, device="cpu"),
                               a ** 3 + b * 0.5, rtol=1e-15)


# ---- on a real GPU ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_map_blocks_on_the_gpu_numpy_and_cupy_blocks(rng):
    import cupy

    a = rng.random((301, 17))
    b = rng.random((301, 17))
    x = da.from_array(a, chunks=(100, -1))
    staged = dg.map_kernel(product, x, b, dtype=np.float64, launch=1, device="gpu")
    got = staged.compute()
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, a * b)
    xd = da.from_array(cupy.asarray(a), chunks=(64, 9))
    on_device = dg.map_kernel(where_am_i, xd, dtype=np.float64, args=(0.25,), offsets=True)
    rows, cols = np.indices(a.shape)
    got = on_device.compute()
    assert isinstance(got, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(got), a + 0.25 * (rows * 1000 + cols))


@pytest.mark.gpu
def test_gufunc_on_cupy_blocks(rng):
    import cupy

    a = rng.random((40, 6))
    b = rng.random((6,))
    x = da.from_array(cupy.asarray(a), chunks=(16, -1))
    dot, total = dg.gufunc_op(dot_and_sum)(x, cupy.asarray(b))
    ref_dot, ref_total = dot_and_sum(a, b)
    got = dot.compute()
    assert isinstance(got, cupy.ndarray)
    np.testing.assert_allclose(cupy.asnumpy(got), ref_dot, rtol=1e-14)
    np.testing.assert_array_equal(cupy.asnumpy(total.compute()), ref_total)


@pytest.mark.gpu
def test_elementwise_takes_a_cuda_ufunc_and_matches_it(rng):
    import cupy

    @cuda.jit(device=True)
    def rate(f, g, delta):
        return -2j * f - 1j * delta * (2 * g - 1)

    @numba.vectorize(["complex64(complex64, complex64, complex64, float32)"], target="cuda")
    def step(g, f, delta, dt):
        return f + dt * rate(f, g, delta)

    shape = (129, 65)
    g = cupy.asarray((rng.random(shape) + 1j * rng.random(shape)).astype(np.complex64))
    f = cupy.asarray((rng.random(shape) + 1j * rng.random(shape)).astype(np.complex64))
    delta = np.complex64(0.3 - 0.1j)
    expected = step(cuda.as_cuda_array(g.ravel()), cuda.as_cuda_array(f.ravel()),
                    delta, np.float32(0.01)).copy_to_host().reshape(shape)
    op = dg.elementwise(step)
    eager = op(g, f, delta, 0.01)
    assert isinstance(eager, cupy.ndarray) and eager.dtype == np.complex64
    np.testing.assert_array_equal(cupy.asnumpy(eager), expected)
    lazy = op(da.from_array(g, chunks=(64, 65)), f, delta, 0.01).compute()
    np.testing.assert_array_equal(cupy.asnumpy(lazy), expected)
    on_cpu = op(cupy.asnumpy(g), cupy.asnumpy(f), delta, 0.01, device="cpu")
    np.testing.assert_allclose(on_cpu, expected, rtol=1e-5)


@pytest.mark.parametrize("old, new", [("map_blocks", "map_kernel"), ("gufunc", "gufunc_op")])
def test_the_names_that_shadowed_dasks_still_work_for_a_release_with_a_warning(old, new):
    with pytest.warns(DeprecationWarning, match=f"dg.{old} is now dg.{new}"):
        assert getattr(dg, old) is getattr(dg, new)
    assert old not in dg.__all__ and new in dg.__all__
    with pytest.raises(AttributeError):
        dg.no_such_name  # noqa: B018
