"""Launching compiled elementwise kernels from array addresses (the direct launch)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from helpers import assert_same, random_array

from dask_gpuchunk._kernels import launch
from dask_gpuchunk._kernels.elementwise import ElementwiseKernels
from dask_gpuchunk._kernels.elementwise_sources import _signature_key
from dask_gpuchunk._kernels.launch import StridedArg, direct_launch_available


def fma3(a, b, c):
    return a * b + c


@pytest.mark.parametrize("shape, view", [
    ((7, 5), np.s_[:, :]), ((7, 5), np.s_[:, ::2]), ((7, 5), np.s_[::-1]), ((1, 6), np.s_[:, :]),
    ((6, 1, 3), np.s_[:, :, 1:]), ((1,), np.s_[:]), ((4, 3), np.s_[:, :1]),
])
def test_strided_arg_contiguity_follows_numpy(shape, view):
    a = np.empty(shape)[view]
    arg = StridedArg(0, a.shape, a.strides, a.dtype)
    assert arg.ndim == a.ndim
    assert arg.flags["C_CONTIGUOUS"] == a.flags["C_CONTIGUOUS"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "int32", "uint64", "float32",
                                   "float64", "complex64", "complex128"])
def test_direct_launch_matches_numba_dispatch(rng, dtype):
    # Arrays by address (broadcast, strided, with a scalar of each dtype) through the direct
    # launch, against the same kernel through numba's dispatcher.
    import cupy
    from numba import cuda

    assert direct_launch_available(), "the GPU path fell back to numba's dispatcher"
    k = ElementwiseKernels(fma3, 3)
    a = cupy.asarray(random_array(rng, (9, 33), dtype))[:, ::2]  # strided
    c = cupy.asarray(random_array(rng, (17,), dtype))             # broadcast along rows
    s = random_array(rng, (1,), dtype)[0]
    out_dtype = (np.asarray(a[:1, :1].get()) * s + c[:1].get()).dtype
    shape = a.shape
    outs = [cupy.zeros(shape, out_dtype) for _ in range(2)]
    cb = cupy.broadcast_to(c, shape)
    k.cuda_strided(StridedArg(outs[0].data.ptr, shape, outs[0].strides, outs[0].dtype),
                   StridedArg(a.data.ptr, shape, a.strides, a.dtype), s,
                   StridedArg(cb.data.ptr, shape, cb.strides, cb.dtype),
                   stream=cuda.default_stream())
    k.cuda(cuda.as_cuda_array(outs[1]), cuda.as_cuda_array(a), s, cuda.as_cuda_array(cb))
    cupy.cuda.runtime.deviceSynchronize()
    assert_same(outs[0].get(), outs[1].get())
    with np.errstate(all="ignore"):
        assert_same(outs[0].get(), (a.get() * s + c.get()).astype(out_dtype),
                    exact=dtype[0] not in "cf")


def test_falling_back_to_numba_warns_once_and_turns_the_direct_launch_off(monkeypatch):
    monkeypatch.setattr(launch, "_direct_works", [True])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launch.fall_back_to_numba(launch.DirectLaunchError("a changed layout"))
        launch.fall_back_to_numba(launch.DirectLaunchError("again, from another thread"))
    expected = ("dask_gpuchunk: kernels are launched through numba's dispatcher from now on in "
                "this process (~0.1 ms more per chunk), because the direct launch cannot be used "
                "with this numba-cuda: a changed layout; please report it with your numba-cuda "
                "version.")
    assert [str(w.message) for w in caught if w.category is RuntimeWarning] == [expected]
    assert not launch._direct_works[0] and not direct_launch_available()


def _swapped_words(a: StridedArg) -> list[int]:
    # A layout numba does not use (strides before shape): what a changed numba-cuda would be.
    return [0, 0, int(np.prod(a.shape)), a.dtype.itemsize, a.ptr, *a.strides, *a.shape]


@pytest.mark.gpu
def test_a_layout_numba_does_not_use_is_refused(monkeypatch):
    k = ElementwiseKernels(fma3, 3)
    a = np.zeros((3, 4))
    dispatcher = k._cuda_kernel(_signature_key((a,), (a, a, a)))
    launch.DirectLaunch(dispatcher)  # numba's own layout passes
    monkeypatch.setattr(launch, "_array_words", _swapped_words)
    with pytest.raises(launch.DirectLaunchError, match="lays out"):
        launch.DirectLaunch(dispatcher)


@pytest.mark.gpu
def test_chunks_fall_back_to_numba_when_the_direct_launch_is_refused(rng, monkeypatch):
    import cupy

    from dask_gpuchunk.runtime.backend import run_gpu_on_device

    monkeypatch.setattr(launch, "_direct_works", [True])
    monkeypatch.setattr(launch, "_array_words", _swapped_words)
    k = ElementwiseKernels(fma3, 3)  # no launcher made yet
    # Integers: exact (the GPU fuses a float a * b + c into one rounding).
    a, b, c = (rng.integers(-1000, 1000, (5, 7)) for _ in range(3))
    with pytest.warns(RuntimeWarning, match="numba's dispatcher from now on"):
        out = run_gpu_on_device(k, np.dtype("i8"), [cupy.asarray(a), cupy.asarray(b),
                                                    cupy.asarray(c)])
    assert not launch._direct_works[0]
    assert_same(out.get(), a * b + c)
    out = run_gpu_on_device(k, np.dtype("i8"), [cupy.asarray(a), np.int64(3), cupy.asarray(c)])
    assert_same(out.get(), a * 3 + c)


@pytest.mark.gpu
def test_numba_handles_for_cupy_streams():
    import cupy
    from numba import cuda

    from dask_gpuchunk._kernels.launch import cupy_stream, numba_stream

    # CuPy's null stream is the legacy default stream (numba's handle: CU_STREAM_LEGACY, 1).
    assert int(numba_stream(cupy.cuda.Stream.null).handle) in (0, 1)
    s = cupy.cuda.Stream(non_blocking=True)
    assert int(numba_stream(s).handle) == s.ptr
    assert numba_stream(s) is numba_stream(s)  # cached
    assert isinstance(numba_stream(s), type(cuda.external_stream(s.ptr)))
    # and back: the CuPy stream a kernel's cuBLAS and CuPy work runs on
    assert cupy_stream(numba_stream(s)).ptr == s.ptr
    assert cupy_stream(numba_stream(cupy.cuda.Stream.null)) is cupy.cuda.Stream.null
    assert cupy_stream(0) is cupy.cuda.Stream.null
