"""Where the per-chunk time goes on the device-resident path (run on a GPU machine).

    python3 tools/profile_overheads.py [out_dir]

Prints per-call microseconds of each step of run_gpu_on_device on a tiny CuPy chunk (so that
only overhead is left), a cProfile of 300 such calls, and the device-resident product of two
4 GB arrays at several chunk counts against CuPy's own a*b.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import cupy
import dask
import numpy as np
from numba import cuda

import dask_gpuchunk as dg
from dask_gpuchunk.backend import _launch, run_gpu_on_device
from dask_gpuchunk.staging import numba_stream


def per_call(fn, n=300):
    fn()
    cupy.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    kernels = dg.multiply.kernels
    x = cupy.arange(1000, dtype=np.float64)
    out = cupy.empty_like(x)
    stream = cupy.cuda.Stream(non_blocking=True)
    nb = numba_stream(stream)
    steps = {
        "run_gpu_on_device (whole chunk)": lambda: run_gpu_on_device(kernels, np.dtype("f8"), [x, x]),
        "_launch (views + as_cuda_array + dispatch)": lambda: _launch(kernels, out, [x, x], nb),
        "as_cuda_array x1": lambda: cuda.as_cuda_array(x, sync=False),
        "cupy.empty": lambda: cupy.empty(1000),
        "stream.synchronize": stream.synchronize,
        "event record + wait": lambda: stream.wait_event(cupy.cuda.get_current_stream().record()),
        "broadcast_to + as_strided": lambda: cupy.lib.stride_tricks.as_strided(
            cupy.broadcast_to(x, x.shape), x.shape, x.strides),
    }
    ax, ao = cuda.as_cuda_array(x, sync=False), cuda.as_cuda_array(out, sync=False)
    steps["kernels.cuda (dispatch + launch)"] = lambda: kernels.cuda(ao, ax, ax, stream=nb)
    for name, fn in steps.items():
        print(f"{name:45s} {per_call(fn):8.1f} us")

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        run_gpu_on_device(kernels, np.dtype("f8"), [x, x])
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue())

    a = cupy.random.random((1_000_000, 500))
    b = cupy.random.random((1_000_000, 500))
    c = cupy.empty_like(a)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()

    def events_ms(fn, n=10):
        fn()
        ts = []
        for _ in range(n):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(start, stop))
        return float(np.median(ts))

    print(f"kernel only, cupy multiply(a, b, out=c): {events_ms(lambda: cupy.multiply(a, b, out=c)):.3f} ms")
    from dask_gpuchunk._kernels import elementwise as kmod

    na, nb_, nc = (cuda.as_cuda_array(v.reshape(-1), sync=False) for v in (a, b, c))
    original = kmod._launch_config
    for label, config in [
        ("grid-stride, 16 blocks/SM x 256", original),
        ("full grid x 256", lambda n: (256, -(-n // 256))),
        ("grid-stride, 32 blocks/SM x 256", lambda n: (256, 132 * 32)),
        ("grid-stride, 8 blocks/SM x 512", lambda n: (512, 132 * 8)),
        ("full grid x 1024", lambda n: (1024, -(-n // 1024))),
    ]:
        kmod._launch_config = config
        t = events_ms(lambda: kernels.cuda(nc, na, nb_))
        print(f"kernel only, ours {label:35s}: {t:.3f} ms")
    kmod._launch_config = original
    ok = bool(cupy.array_equal(c, a * b))
    print("ours kernel result exact:", ok)
    for unroll in (2, 4):
        k = kmod.ElementwiseKernels(kernels.func, 2)
        k.cuda_unroll = unroll
        for label, config in [("16 blocks/SM", original), ("32 blocks/SM", lambda n: (256, 132 * 32)),
                              ("8 blocks/SM", lambda n: (256, 132 * 8))]:
            kmod._launch_config = config
            c[...] = 0
            t = events_ms(lambda: k.cuda(nc, na, nb_))
            print(f"kernel only, ours unroll {unroll}, {label:14s}: {t:.3f} ms, exact "
                  f"{bool(cupy.array_equal(c, a * b))}")
        kmod._launch_config = original

    def trivial(nchunks):
        xa = dg.asarray(a, chunks=(1_000_000 // nchunks, 500))

        def run():
            (r,) = dask.persist(xa.map_blocks(lambda blk: blk, dtype=xa.dtype, meta=xa._meta),
                                scheduler="threads")
            return r
        return run

    for n in (1, 4):
        t0 = time.perf_counter()
        for _ in range(50):
            trivial(n)()
        print(f"dask persist of an identity map_blocks, {n} chunks: "
              f"{(time.perf_counter() - t0) / 50 * 1e3:.3f} ms")

    def cupy_mul():
        r = a * b
        cupy.cuda.runtime.deviceSynchronize()
        return r

    def ours(nchunks):
        xa = dg.asarray(a, chunks=(1_000_000 // nchunks, 500))
        xb = dg.asarray(b, chunks=(1_000_000 // nchunks, 500))

        def run():
            (r,) = dask.persist(dg.multiply(xa, xb, device="gpu"), scheduler="threads")
            cupy.cuda.runtime.deviceSynchronize()
            return r
        return run

    def best(fn, n=7):
        fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            r = fn()
            ts.append(time.perf_counter() - t0)
            del r
        return np.median(ts) * 1e3

    # Where a device-resident persist spends its time: stamps around each chunk's execution.
    import dask_gpuchunk.backend as backend

    stamps = []
    original_run = backend.run_gpu_on_device

    def stamped(*args, **kwargs):
        t0 = time.perf_counter()
        r = original_run(*args, **kwargs)
        stamps.append((t0, time.perf_counter()))
        return r

    for n in (2, 4):
        run = ours(n)
        run()
        backend.run_gpu_on_device = stamped
        for _ in range(3):
            stamps.clear()
            t0 = time.perf_counter()
            xa = dg.asarray(a, chunks=(1_000_000 // n, 500))
            xb = dg.asarray(b, chunks=(1_000_000 // n, 500))
            graph = dg.multiply(xa, xb, device="gpu")
            t1 = time.perf_counter()
            (r,) = dask.persist(graph, scheduler="threads")
            t2 = time.perf_counter()
            cupy.cuda.runtime.deviceSynchronize()
            t3 = time.perf_counter()
            first, last = min(s[0] for s in stamps), max(s[1] for s in stamps)
            print(f"{n} chunks: build {1e3 * (t1 - t0):.2f} ms, persist->first task "
                  f"{1e3 * (first - t1):.2f}, tasks {1e3 * (last - first):.2f} "
                  f"(each {np.mean([1e3 * (e - s) for s, e in stamps]):.2f}), last task->persist "
                  f"returns {1e3 * (t2 - last):.2f}, then GPU drain {1e3 * (t3 - t2):.2f}; "
                  f"total {1e3 * (t3 - t0):.2f} ms")
            del r
        backend.run_gpu_on_device = original_run

    t_cupy = best(cupy_mul)
    print(f"cupy a*b 4 GB: {t_cupy:.2f} ms")
    for n in (1, 2, 4, 8, 20):
        t = best(ours(n))
        print(f"ours device-resident, {n:2d} chunks: {t:.2f} ms ({t / t_cupy:.2f} x cupy)")


if __name__ == "__main__":
    main()
