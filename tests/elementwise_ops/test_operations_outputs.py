"""dg.elementwise's eager calls (NumPy and CuPy in, eager out), several outputs, fused
reductions, fma, ``.npy`` operands read by the blocks that use them, functions of a user's
``__main__`` script on worker processes, xarray in and out."""

from __future__ import annotations

import importlib

import dask
import dask.array as da
import numpy as np
import pytest
from helpers import DTYPES, assert_same, random_array

import dask_gpuchunk as dg

elementwise_module = importlib.import_module("dask_gpuchunk.elementwise_ops.operations")


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
