"""``c = a * b`` for two (1,000,000 x 500) float64 arrays, more than an 8 GB GPU holds.

A numba kernel that copies the whole arrays to the GPU runs out of device memory
(``cuMemAlloc``). Here each ~200 MB chunk is streamed through the GPU (pinned staging, one
stream per slot, copies overlapped with compute) and written straight into ``c``.

    python examples/product_larger_than_gpu.py --rows 20000    # small: seconds on a CPU
    python examples/product_larger_than_gpu.py                 # 2 x 4 GB in, 4 GB out
    python examples/product_larger_than_gpu.py --pinned        # inputs and output in pinned memory
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import dask_gpuchunk as dg


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000,
                        help="rows of a, b and c (default %(default)s)")
    parser.add_argument("--cols", type=int, default=500,
                        help="columns of a, b and c (default %(default)s)")
    parser.add_argument("--chunk-mb", type=float, default=200.0,
                        help="megabytes per chunk streamed (default %(default)s)")
    parser.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto",
                        help="where (dg.multiply's device=)")
    parser.add_argument("--pinned", action="store_true",
                        help="allocate a, b and c in pinned memory (GPU only): no staging copies")
    args = parser.parse_args(argv)

    shape = (args.rows, args.cols)
    if args.pinned:
        from dask_gpuchunk.runtime.staging import empty_pinned

        a, b, c = (empty_pinned(shape) for _ in range(3))
    else:
        a, b, c = np.empty(shape), np.empty(shape), np.empty(shape)
    rng = np.random.default_rng(0)
    a[...] = rng.random(shape)
    b[...] = rng.random(shape)

    rows_per_chunk = max(1, int(args.chunk_mb * 1e6 // (args.cols * 8)))
    x = dg.asarray(a, chunks=(rows_per_chunk, args.cols))  # views of a: no copy
    y = dg.asarray(b, chunks=(rows_per_chunk, args.cols))
    dg.multiply(a[:1], b[:1], device=args.device, out=c[:1])  # compile the kernels first
    t0 = time.perf_counter()
    dg.multiply(x, y, device=args.device, out=c)
    seconds = time.perf_counter() - t0

    sample = rng.integers(0, args.rows, size=min(1000, args.rows))
    assert np.array_equal(c[sample], a[sample] * b[sample]), "wrong product"
    gb = (a.nbytes + b.nbytes + c.nbytes) / 1e9
    print(f"c = a * b, {shape[0]} x {shape[1]} float64, {x.numblocks[0]} chunks, "
          f"device={args.device}: {seconds:.3f} s ({gb / seconds:.1f} GB/s moved); sample exact")
    for d in dg.placement_decisions():
        print(f"  auto chose {d['choice']}: CPU {d['t_cpu'] * 1e3:.1f} ms vs GPU estimate "
              f"{d['t_gpu_estimate'] * 1e3:.1f} ms per chunk")
    return seconds


if __name__ == "__main__":
    main()
