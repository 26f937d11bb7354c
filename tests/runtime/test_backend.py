"""Chunk execution: one chunk on the right device, results against NumPy."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import assert_same

from dask_gpuchunk._kernels.elementwise import ElementwiseKernels
from dask_gpuchunk.runtime.backend import is_cupy, run_cpu, run_elementwise
from dask_gpuchunk.runtime.chunk_layout import _collapsed_layout
from dask_gpuchunk.devices import GPUNotAvailableError, gpu_available


def mul(a, b):
    return a * b


KERNELS = ElementwiseKernels(mul, 2)


def _squares_from_threads(run, arrays):
    """``run(KERNELS, float64, [x, x])`` of each array in a thread of its own, all at once;
    each result equal to ``x * x``."""
    results = [None] * len(arrays)

    def work(i):
        results[i] = run(KERNELS, np.float64, [arrays[i], arrays[i]])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(arrays))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for x, r in zip(arrays, results):
        assert_same(r, x * x)


@pytest.mark.parametrize("out_shape, in_shapes", [
    ((100, 40, 5), [(40, 5), (100, 40, 5)]),
    ((6, 7), [(6, 1), (7,), (1, 1)]),
    ((3, 1, 4), [(1, 4), (3, 1, 1)]),
    ((5,), [()]),
])
def test_collapsed_layout_walks_the_broadcast_inputs(rng, out_shape, in_shapes):
    # Every element of out and of every input sits where the collapsed shape and strides say.
    out = rng.random(out_shape)
    inputs = [rng.random(s) for s in in_shapes]
    if inputs[0].ndim > 1:
        inputs[0] = np.asfortranarray(inputs[0])  # non-C strides: nothing of it may collapse
    shape, strides = _collapsed_layout([out], [*inputs, np.float64(2.0)])
    assert len(strides) == 1 + len(inputs)
    for a, st in zip([out, *inputs], strides):
        view = np.lib.stride_tricks.as_strided(a, shape, st)
        assert np.array_equal(view.reshape(out_shape), np.broadcast_to(a, out_shape))


def test_cpu_writes_into_dest_and_returns_it(rng):
    a, b = rng.random((6, 5)), rng.random(5)
    dest = np.full((6, 5), np.nan)
    assert run_cpu(KERNELS, np.float64, [a, b], dest) is dest
    assert_same(dest, a * b)


def test_cpu_dest_may_be_a_strided_view(rng):
    a, b = rng.random((4, 3)), rng.random((4, 3))
    big = np.full((8, 6), -1.0)
    run_cpu(KERNELS, np.float64, [a, b], big[::2, ::2])
    assert_same(big[::2, ::2], a * b)
    assert (big[1::2] == -1).all() and (big[:, 1::2] == -1).all()


def test_zero_d_inputs_are_passed_by_value(rng):
    a = rng.random(7)
    out = run_elementwise(KERNELS, np.float64, [a, np.array(3.0)], device="cpu")
    assert_same(out, a * 3.0)
    out = run_elementwise(KERNELS, np.float64, [np.array(2.0), np.array(3.0)], device="cpu")
    assert out.shape == () and out == 6.0


def test_empty_chunk_launches_nothing():
    out = run_elementwise(KERNELS, np.float64, [np.ones((0, 3)), np.ones(3)], device="cpu")
    assert out.shape == (0, 3)


def test_cpu_kernels_from_many_threads_at_once(rng):
    # Dask's threads each run their chunk's parallel kernel at the same time.
    _squares_from_threads(run_cpu, [rng.random(20_000) for _ in range(8)])


def test_cpu_threads_share_the_cores():
    import dask
    import numba

    from dask_gpuchunk.runtime.cpu_runner import CPU_OVERSUBSCRIPTION, cpu_threads

    cores = numba.config.NUMBA_NUM_THREADS
    with dask.config.set(num_workers=1):
        assert cpu_threads() == cores
    with dask.config.set(num_workers=4 * CPU_OVERSUBSCRIPTION * cores):
        assert cpu_threads() == 1
    with dask.config.set(num_workers=cores):
        assert cpu_threads() == min(cores, CPU_OVERSUBSCRIPTION)


def test_bad_device():
    with pytest.raises(ValueError, match="device must be one of"):
        run_elementwise(KERNELS, np.float64, [np.ones(2), np.ones(2)], device="tpu")


@pytest.mark.skipif(gpu_available(), reason="a GPU is visible")
def test_auto_without_gpu_runs_on_cpu(rng):
    from dask_gpuchunk.runtime.placement import decisions, forget

    forget()
    a = rng.random(50)
    assert_same(run_elementwise(KERNELS, np.float64, [a, a], device="auto"), a * a)
    assert decisions() == []  # nothing to decide without a GPU


# ---- GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_from_host_timings_and_result(rng):
    from dask_gpuchunk.runtime.backend import run_gpu_from_host

    a, b = rng.random((500, 64)), rng.random(64)
    timings: dict[str, float] = {}
    out = run_gpu_from_host(KERNELS, np.float64, [a, b], timings=timings)
    assert_same(out, a * b)
    # a new result is allocated pinned: the device writes it directly, only inputs are staged
    from dask_gpuchunk.runtime.staging import is_pinned

    assert is_pinned(out)
    assert timings["staged_bytes"] == a.nbytes + b.nbytes
    assert timings["h2d_bytes"] == a.nbytes + b.nbytes
    assert timings["d2h_bytes"] == out.nbytes
    assert timings["kernel"] > 0 and timings["stage_seconds"] > 0


@pytest.mark.gpu
def test_pinned_chunks_are_sent_without_staging(rng, monkeypatch):
    from dask_gpuchunk.runtime import staging
    from dask_gpuchunk.runtime.backend import run_gpu_from_host

    a, b, dest = (staging.empty_pinned((300, 50)) for _ in range(3))
    a[...], b[...] = rng.random((300, 50)), rng.random((300, 50))

    def no_staging(*args, **kwargs):
        raise AssertionError("a pinned chunk went through a staging buffer")

    monkeypatch.setattr(staging.pinned_pool, "borrow", no_staging)
    run_gpu_from_host(KERNELS, np.float64, [a, b], dest)
    assert_same(dest, a * b)


@pytest.mark.gpu
def test_host_path_device_memory_is_bounded_by_slots(rng):
    # Many threads, many chunks: CuPy's pool never holds more than the slots' buffers.
    import cupy

    from dask_gpuchunk.runtime import staging
    from dask_gpuchunk.runtime.backend import run_gpu_from_host

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    # What earlier tests of the process still hold (kept kernels' scratch, cached maps) is not
    # this test's: only the growth is bounded.
    held = pool.total_bytes()
    chunks = [rng.random((256, 1024)) for _ in range(24)]  # 2 MB each
    _squares_from_threads(run_gpu_from_host, chunks)
    per_chunk = 3 * chunks[0].nbytes
    assert pool.total_bytes() - held <= staging.GPU_TASKS_PER_DEVICE * per_chunk * 1.25


@pytest.mark.gpu
def test_device_path_is_asynchronous_like_cupy(rng):
    import cupy

    a = cupy.asarray(rng.random(1 << 20))
    out = run_elementwise(KERNELS, np.float64, [a, np.array(2.0)], device="gpu")
    assert is_cupy(out)
    # Ordered on the current (default) stream: a later CuPy op sees the finished result.
    assert bool(cupy.all(out == a * 2.0))
    with pytest.raises(ValueError, match="device='cpu'"):
        run_elementwise(KERNELS, np.float64, [a, a], device="cpu")


@pytest.mark.parametrize("device, on_device, gpu_here, placed, stage, expected", [
    ("auto", True, True, False, True, "device"),
    ("gpu", True, True, False, True, "device"),
    ("auto", False, True, False, True, "staged"),
    ("auto", False, True, True, True, "placed"),
    ("auto", False, False, True, True, "cpu"),
    ("gpu", False, True, True, True, "staged"),  # device="gpu" is never measured
    ("cpu", False, True, True, True, "cpu"),
    ("auto", False, True, False, False, "cpu"),  # kept on the host
    ("gpu", False, True, False, False, "cpu"),
    ("auto", True, True, False, False, "device"),  # device chunks stay where they are
])
def test_chunk_site_is_one_rule_for_every_operator(device, on_device, gpu_here, placed, stage,
                                                   expected):
    from dask_gpuchunk.runtime.backend import chunk_site

    assert chunk_site(device, on_device, gpu_here, placed=placed, stage=stage) == expected


def test_chunk_site_errors():
    from dask_gpuchunk.runtime.backend import chunk_site

    with pytest.raises(ValueError, match="device='cpu' was given CuPy chunks"):
        chunk_site("cpu", True, True)
    with pytest.raises(GPUNotAvailableError, match="this worker sees no CUDA GPU"):
        chunk_site("gpu", False, False)
    with pytest.raises(ValueError, match="GPU only"):
        chunk_site("auto", False, False, gpu_only="method='bmma' runs on a GPU only")
    with pytest.raises(ValueError, match="GPU only"):
        chunk_site("cpu", False, True, gpu_only="method='bmma' runs on a GPU only")
    assert chunk_site("auto", False, True, gpu_only="x") == "staged"
    with pytest.raises(ValueError, match="device must be one of"):
        chunk_site("tpu", False, True)
