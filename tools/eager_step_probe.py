"""Seed 002's RK4 step called eagerly on CuPy arrays: GPU time per call (CUDA events over 20
calls back to back) and host time per call (``cupyx.profiler.benchmark``), ours against CuPy's
best form (one ``ElementwiseKernel`` for both outputs, then ``cupy.sum``).

Usage (on a GPU machine): ``python tools/eager_step_probe.py [--sizes 4096,16384]``

Rows per size: CuPy's kernel alone and with its sum; ours with the fused sum as NumPy rounds
(``rk4_step``) and with products fused into additions (``rk4_step_fma``, ``fma=True``), each
writing into given outputs (``out=``), and ours without the sum. The largest relative
difference of ``F`` from CuPy's after one step is printed beside each of ours.
"""

from __future__ import annotations

import argparse
import json

import cupy
import numpy as np
from cupyx.profiler import benchmark

from dask_gpuchunk.bench import loop


def gpu_microseconds(fn, calls: int = 20) -> float:
    fn()
    cupy.cuda.Device().synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    stop.synchronize()
    return round(cupy.cuda.get_elapsed_time(start, stop) / calls * 1e3, 1)


def host_microseconds(fn) -> float:
    return round(float(np.median(benchmark(fn, n_repeat=100, n_warmup=10).cpu_times)) * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,16384", help="sides of the square arrays")
    args = parser.parse_args()
    for side in (int(s) for s in args.sizes.split(",")):
        f0, g0 = loop.initial_values(side * side)
        f, g = cupy.asarray(f0.reshape(side, side)), cupy.asarray(g0.reshape(side, side))
        delta = cupy.asarray(np.array([f0.sum()], np.complex64))
        d0, dt = delta[0], np.float32(1e-4)
        kernel = cupy.ElementwiseKernel(
            "complex64 f, complex64 g, raw complex64 d, float32 dt",
            "complex64 f_out, complex64 g_out",
            "const complex<float> delta = d[0];\n" + loop._CUPY_STEP, "probe_rk4")
        fo, go = cupy.empty_like(f), cupy.empty_like(g)
        ours_f, ours_g = cupy.empty_like(f), cupy.empty_like(g)
        forms = {
            "cupy kernel": lambda: kernel(f, g, delta, dt, fo, go),
            "cupy kernel + sum": lambda: (kernel(f, g, delta, dt, fo, go), cupy.sum(fo)),
            "ours, fused sum": lambda: loop.rk4_step(f, g, d0, dt, out=(ours_f, ours_g),
                                                     reduce=("sum", None)),
            "ours fma=True, fused sum": lambda: loop.rk4_step_fma(
                f, g, d0, dt, out=(ours_f, ours_g), reduce=("sum", None)),
            "ours, no sum": lambda: loop.rk4_step(f, g, d0, dt, out=(ours_f, ours_g)),
        }
        kernel(f, g, delta, dt, fo, go)
        row = {}
        for name, fn in forms.items():
            row[name] = {"gpu_us": gpu_microseconds(fn), "host_us": host_microseconds(fn)}
            if name.startswith("ours"):
                row[name]["f_max_rel_diff_from_cupy"] = float(
                    cupy.abs(ours_f - fo).max() / cupy.abs(fo).max())
        print(json.dumps({f"{side}x{side}": row}), flush=True)


if __name__ == "__main__":
    main()
