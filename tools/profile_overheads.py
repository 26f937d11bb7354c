"""Where the time of a device-resident persist goes (run on a GPU machine).

    python3 tools/profile_overheads.py              # everything below but the variants
    python3 tools/profile_overheads.py kernels      # everything below
    python3 tools/profile_overheads.py bench-rows   # the bench's device rows alone

Prints, on the seed-000 product (two 1,000,000 x 500 float64 arrays already on the device):

* the steps of one task (stream handle, output allocation, launch), from the main thread;
* per-call microseconds of one tiny chunk through ``run_gpu_on_device``, with the direct
  launch (``_kernels.launch.DirectLaunch``) and through numba's dispatcher, and CuPy's
  own ``a * b`` on the same tiny arrays;
* the kernel alone on the 4 GB arrays (CUDA events): CuPy's multiply, ours, and the same
  product written in CUDA C and in numba under several launch shapes;
* a cProfile of building the graph of a device-resident product;
* stamps of single persists (1 and 4 chunks): graph build, Dask's optimisation, submission
  to the first task, the tasks, the return, the device draining;
* medians of whole persists against CuPy's ``a * b``, every variant interleaved round by round
  so that drifts of the host hit all alike: ours, ours with the ``Blockwise`` layer it built
  before, with Dask's optimisation off, with the garbage collector off, and Dask's own
  ``a * b``, on 1 and 4 chunks per array.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable

import cupy
import dask
import numpy as np

import dask_gpuchunk as dg
from dask_gpuchunk import backend
from dask_gpuchunk._kernels import launch


def per_call_us(fn: Callable[[], object], n: int = 500) -> float:
    fn()
    cupy.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    return (time.perf_counter() - t0) / n * 1e6


def events_ms(fn: Callable[[], object], n: int = 10) -> float:
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    fn()
    ts = []
    for _ in range(n):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(ts))


_CUDA_C = r"""
extern "C" __global__ void grid_stride(const double* a, const double* b, double* c, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x)
        c[i] = a[i] * b[i];
}
extern "C" __global__ void grid_stride_restrict(const double* __restrict__ a,
        const double* __restrict__ b, double* __restrict__ c, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x)
        c[i] = a[i] * b[i];
}
extern "C" __global__ void one_each(const double* a, const double* b, double* c, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] * b[i];
}
"""


def kernel_variants(a, b, c, expected, ten) -> None:
    """The same product written in CUDA C and in numba, under several launch shapes."""
    from numba import cuda

    n = a.size
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    module = cupy.RawModule(code=_CUDA_C)
    shapes = {"32 blocks/SM x 256": (sms * 32, 256), "full grid x 128": (-(-n // 128), 128),
              "full grid x 256": (-(-n // 256), 256), "8 blocks/SM x 1024": (sms * 8, 1024)}
    for kname in ("grid_stride", "grid_stride_restrict", "one_each"):
        k = module.get_function(kname)
        for label, (grid, block) in shapes.items():
            if kname == "one_each" and not label.startswith("full"):
                continue
            c[...] = 0
            t = events_ms(ten(lambda k=k, g=grid, bl=block: k((g,), (bl,), (a, b, c, np.int64(n))))) / 10
            print(f"  CUDA C {kname:22s} {label:20s} {t:.3f} ms, exact "
                  f"{bool(cupy.array_equal(c, expected))}")

    @cuda.jit
    def numba_one_each(x, y, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = x[i] * y[i]

    @cuda.jit
    def numba_grid_stride(x, y, out):
        i = cuda.grid(1)
        step = cuda.gridsize(1)
        while i < out.size:
            out[i] = x[i] * y[i]
            i += step

    xa, xb, xc = (cuda.as_cuda_array(v.reshape(-1), sync=False) for v in (a, b, c))
    for kname, kern in (("numba one_each", numba_one_each), ("numba grid_stride", numba_grid_stride)):
        for label, (grid, block) in shapes.items():
            if kname.endswith("one_each") and not label.startswith("full"):
                continue
            c[...] = 0
            t = events_ms(ten(lambda kern=kern, g=grid, bl=block: kern[g, bl](xa, xb, xc))) / 10
            print(f"  {kname:29s} {label:20s} {t:.3f} ms, exact "
                  f"{bool(cupy.array_equal(c, expected))}")


def main() -> None:
    tiny = cupy.arange(1000, dtype=np.float64)
    f8 = np.dtype("f8")
    print("per call, one 1000-element chunk:")
    for direct in (True, False):
        launch.DIRECT_LAUNCH = direct
        us = per_call_us(lambda: backend.run_gpu_on_device(dg.multiply.kernels, f8, [tiny, tiny]))
        print(f"  run_gpu_on_device, {'direct launch' if direct else 'numba dispatch':14s} {us:7.1f} us")
    launch.DIRECT_LAUNCH = True
    print(f"  cupy a * b                         {per_call_us(lambda: tiny * tiny):7.1f} us")

    a = cupy.random.random((1_000_000, 500))
    b = cupy.random.random((1_000_000, 500))
    c = cupy.empty_like(a)
    expected = a * b
    print("kernel alone, 4 GB product (events around 10 launches back to back, per launch):")
    def ten(fn: Callable[[], object]) -> Callable[[], object]:
        return lambda: [fn() for _ in range(10)]  # each launch hides behind the kernel before

    t = events_ms(ten(lambda: cupy.multiply(a, b, out=c))) / 10
    print(f"  cupy multiply(a, b, out=c)        {t:.3f} ms")
    kernels = dg.multiply.kernels
    t = events_ms(ten(lambda: backend.run_gpu_on_device(kernels, f8, [a, b]))) / 10
    r = backend.run_gpu_on_device(kernels, f8, [a, b])
    print(f"  ours (dg.multiply's kernel)       {t:.3f} ms, exact {bool(cupy.array_equal(r, expected))}")
    del r
    if "kernels" in sys.argv[1:]:
        kernel_variants(a, b, c, expected, ten)

    import cProfile
    import pstats

    xa, xb = dg.asarray(a, chunks=a.shape), dg.asarray(b, chunks=b.shape)
    dg.multiply(xa, xb, device="gpu")  # the first call compiles
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(500):
        dg.multiply(xa, xb, device="gpu")
    profile.disable()
    print(f"build, per call: {per_call_us(lambda: dg.multiply(xa, xb, device='gpu')):.1f} us; "
          "cProfile of 500:")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(18)

    stamps: list[tuple[float, float]] = []
    original_run = backend.run_gpu_on_device

    def stamped(*args, **kwargs):
        t0 = time.perf_counter()
        r = original_run(*args, **kwargs)
        stamps.append((t0, time.perf_counter()))
        return r

    from dask.base import collections_to_expr

    print("stamps of single persists:")
    for n in (1, 4):
        xa = dg.asarray(a, chunks=(1_000_000 // n, 500))
        xb = dg.asarray(b, chunks=(1_000_000 // n, 500))
        (r,) = dask.persist(dg.multiply(xa, xb, device="gpu"), scheduler="threads")
        del r
        backend.run_gpu_on_device = stamped
        for _ in range(4):
            stamps.clear()
            cupy.cuda.runtime.deviceSynchronize()
            t0 = time.perf_counter()
            graph = dg.multiply(xa, xb, device="gpu")
            t1 = time.perf_counter()
            collections_to_expr([graph], optimize_graph=True).__dask_graph__()
            t_opt = time.perf_counter() - t1
            t1 = time.perf_counter()
            (r,) = dask.persist(graph, scheduler="threads")
            t2 = time.perf_counter()
            cupy.cuda.runtime.deviceSynchronize()
            t3 = time.perf_counter()
            first, last = min(s[0] for s in stamps), max(s[1] for s in stamps)
            each = np.mean([1e3 * (e - s) for s, e in stamps])
            print(f"  {n} chunks: build {1e3 * (t1 - t0 - t_opt):.2f} ms (optimise alone "
                  f"{1e3 * t_opt:.2f}), persist->first task {1e3 * (first - t1):.2f}, tasks "
                  f"{1e3 * (last - first):.2f} (each {each:.2f}), last task->persist returns "
                  f"{1e3 * (t2 - last):.2f}, device drain {1e3 * (t3 - t2):.2f}; persist+drain "
                  f"{1e3 * (t3 - t1):.2f} ms")
            del r
        backend.run_gpu_on_device = original_run

    def cupy_mul() -> None:
        r = a * b
        cupy.cuda.runtime.deviceSynchronize()
        del r

    def persisted(make: Callable[[object, object], object], n: int, *, graph: str = "listed",
                  optimize_graph: bool = True, gc_off: bool = False,
                  **scheduler: object) -> Callable[[], None]:
        xa = dg.asarray(a, chunks=(1_000_000 // n, 500))
        xb = dg.asarray(b, chunks=(1_000_000 // n, 500))

        def run() -> None:
            # The Blockwise layer: what every result was before the fourth session, and
            # results of more than LISTED_GRAPH_MAX_BLOCKS blocks still are.
            listed_max = elementwise_module.LISTED_GRAPH_MAX_BLOCKS
            if graph == "blockwise":
                elementwise_module.LISTED_GRAPH_MAX_BLOCKS = 0
            if gc_off:
                gc.disable()
            try:
                (r,) = dask.persist(make(xa, xb), optimize_graph=optimize_graph,
                                    **(scheduler or {"scheduler": "threads"}))
                cupy.cuda.runtime.deviceSynchronize()
            finally:
                gc.enable()
                elementwise_module.LISTED_GRAPH_MAX_BLOCKS = listed_max
            del r
        return run

    def ours(x: object, y: object) -> object:
        return dg.multiply(x, y, device="gpu")

    def dask_own(x: object, y: object) -> object:
        return x * y

    variants: dict[str, Callable[[], None]] = {"cupy a * b": cupy_mul}
    for n in (1, 4):
        tag = f"{n} chunk{'s' if n > 1 else ''}"
        variants[f"ours {tag}"] = persisted(ours, n)
        variants[f"ours {tag}, Blockwise layer (before)"] = persisted(ours, n, graph="blockwise")
        variants[f"ours {tag}, optimize_graph=False"] = persisted(ours, n, optimize_graph=False)
        variants[f"ours {tag}, gc off while timed"] = persisted(ours, n, gc_off=True)
        variants[f"dask a * b {tag}"] = persisted(dask_own, n)
        # Diagnostics: the same tasks without thread hand-offs, and on one pool thread.
        variants[f"ours {tag}, sync scheduler"] = persisted(ours, n, scheduler="sync")
        if n > 1:
            variants[f"ours {tag}, threads, num_workers=1"] = persisted(
                ours, n, scheduler="threads", num_workers=1)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn()
    rounds = 30
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    gc.collect()
    print(f"gc thresholds {gc.get_threshold()}, counts {gc.get_count()}, "
          f"objects {len(gc.get_objects())}")
    base = float(np.median(times["cupy a * b"]))
    print(f"whole persists (persist, then wait for the device), median of {rounds} interleaved "
          "rounds:")
    for name, ts in times.items():
        med = float(np.median(ts))
        print(f"  {name:42s} {1e3 * med:6.2f} ms  ({med / base:.2f} x cupy; "
              f"min {1e3 * min(ts):.2f}, max {1e3 * max(ts):.2f})")


elementwise_module = sys.modules["dask_gpuchunk.elementwise"]


def task_steps() -> None:
    """Where one device-resident task's time goes, step by step, on the 4 GB arrays."""
    from dask_gpuchunk.staging import numba_stream

    a = cupy.random.random((1_000_000, 500))
    b = cupy.random.random((1_000_000, 500))
    kernels = dg.multiply.kernels
    f8 = np.dtype("f8")
    steps: dict[str, list[float]] = {k: [] for k in ("stream", "empty", "launch", "whole")}
    for i in range(40):
        cupy.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        nb = numba_stream(cupy.cuda.get_current_stream())
        t1 = time.perf_counter()
        out = cupy.empty(a.shape, dtype=f8)
        t2 = time.perf_counter()
        backend._launch(kernels, out, [a, b], nb)
        t3 = time.perf_counter()
        cupy.cuda.runtime.deviceSynchronize()
        del out
        t4 = time.perf_counter()
        r = elementwise_module._block(a, b, kernels=kernels, out_dtype=f8, device="gpu")
        t5 = time.perf_counter()
        cupy.cuda.runtime.deviceSynchronize()
        del r
        if i >= 5:
            for k, dt in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t5 - t4)):
                steps[k].append(dt)
    print("one task on the 4 GB arrays, from the main thread, median of 35 (us): " + ", ".join(
        f"{k} {1e6 * float(np.median(v)):.1f}" for k, v in steps.items()))


def bench_rows() -> None:
    """The bench's own device-resident rows, alone in a process (no rows before them)."""
    from dask_gpuchunk.bench.elementwise import _Bench, _device_rows

    rng = np.random.default_rng(0)
    a, b = rng.random((1_000_000, 500)), rng.random((1_000_000, 500))
    expected = a * b
    bench = _Bench(3, (), print)

    def check(result: np.ndarray) -> None:
        assert np.array_equal(result, expected)

    _device_rows(bench, "product", dg.multiply, a, b, check)
    print("the bench's device rows, alone:")
    for e in bench.entries:
        print(f"  {e.name:48s} {1e3 * e.seconds:6.2f} ms  runs "
              f"{' '.join(f'{1e3 * t:.2f}' for t in e.runs)}")


if __name__ == "__main__":
    if sys.argv[1:] == ["bench-rows"]:
        bench_rows()
    else:  # add "kernels" for the kernel variants
        task_steps()
        main()
