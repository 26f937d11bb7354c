"""The user's numba objects taken apart: Python functions, ufunc loops, per-target rebuilds."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import cuda

from dask_gpuchunk._kernels.elementwise import ElementwiseKernels
from dask_gpuchunk.ufunc.numpy_rules import VType, weak_type
from dask_gpuchunk.ufunc.user_functions import (
    Loop,
    for_target,
    gufunc_parts,
    is_cuda_kernel,
    pick_loop,
    scalar_function,
)


@numba.njit
def squared(x):
    return x * x


@cuda.jit(device=True)
def shifted(a, b):
    return a * b - 1


def calls_both(a, b):
    return squared(a) + shifted(a, b)


@cuda.jit
def a_kernel(x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i]


def test_numba_objects_give_their_python_function():
    assert scalar_function(squared) == (squared.py_func, "njit", ())
    assert scalar_function(shifted).func is shifted.py_func
    assert scalar_function(shifted).kind == "cuda device"
    assert is_cuda_kernel(a_kernel) and not is_cuda_kernel(shifted)
    with pytest.raises(TypeError, match="dg.map_kernel"):
        scalar_function(a_kernel)

    @numba.vectorize
    def lazy(a, b):
        return a - b

    assert scalar_function(lazy).loops == ()  # compiles for what it is given

    @numba.vectorize(["float64(float64)"], target="parallel")
    def parallel(a):
        return a + 1

    with pytest.raises(TypeError, match="target='parallel'"):
        scalar_function(parallel)


def test_ufunc_loops_in_numpy_order():
    @numba.vectorize(["int32(int32, int32)", "float64(float64, float64)"])
    def diff(a, b):
        return a - b

    found = scalar_function(diff)
    assert found.kind == "ufunc"
    i4, f8 = np.dtype("int32"), np.dtype("float64")
    assert found.loops == (Loop((i4, i4), i4), Loop((f8, f8), f8))
    assert pick_loop(found.loops, [VType(np.dtype("int16")), VType(i4)], "diff").output == i4
    assert pick_loop(found.loops, [VType(np.dtype("uint32")), VType(i4)], "diff").output == f8
    assert pick_loop(found.loops, [VType(i4), weak_type(0.5)], "diff").output == f8
    with pytest.raises(TypeError, match="no loop for arguments \\(complex64, int32\\)"):
        pick_loop(found.loops, [VType(np.dtype("complex64")), VType(i4)], "diff")


def test_gufunc_parts():
    @numba.guvectorize(["void(float32[:], float32[:], float32[:])",
                        "void(float64[:], float64[:], float64[:])"], "(n),(n)->()")
    def dot(a, b, out):
        out[0] = (a * b).sum()

    func, layout, loops = gufunc_parts(dot)
    assert func.__name__ == "dot" and layout == "(n),(n)->()"
    assert [str(ins[0]) for ins, _ in loops] == ["float32", "float64"]
    with pytest.raises(TypeError, match="guvectorize"):
        gufunc_parts(squared)


def test_for_target_compiles_callees_for_each_target(rng):
    # A CUDA device function called from a function the CPU runs becomes @njit there.
    cpu = for_target(calls_both, "cpu")
    assert cpu is not calls_both and cpu.__globals__["squared"] is squared
    assert isinstance(cpu.__globals__["shifted"], type(squared))
    assert numba.njit(cpu)(3.0, 2.0) == 14.0
    assert for_target(calls_both, "cpu") is cpu  # once per function and target
    with pytest.raises(ValueError, match="target"):
        for_target(calls_both, "tpu")


def test_numba_rules_kernels_call_numba_functions_on_both_targets(rng):
    a, b = rng.random(37), rng.random(37)
    expected = a * a + a * b - 1
    k = ElementwiseKernels(calls_both, 2, rules="numba")
    out = np.empty(37)
    k.cpu(out, a, b)
    np.testing.assert_allclose(out, expected, rtol=1e-15)
    dev = cuda.device_array(37)
    k.cuda(dev, cuda.to_device(a), cuda.to_device(b))
    # A GPU contracts a * b - 1 into one FMA: not NumPy's two roundings (rules="numba").
    np.testing.assert_allclose(dev.copy_to_host(), expected, rtol=1e-13)
