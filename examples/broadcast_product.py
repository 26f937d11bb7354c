"""A broadcasting product ``(4000, 5) x (100, 4000, 5)``, and where it runs fastest.

A ``guvectorize`` kernel with one GPU thread doing all the work runs slower on the GPU than on
the CPU. Broadcasting is NumPy's here, every element gets its own thread (or CPU
lane), and ``device="auto"`` measures both devices on the first chunk and keeps the faster: a
product this cheap is bound by memory traffic, and from host memory the CPU wins.

    python examples/broadcast_product.py --dates 20 --ids 1000   # small: seconds on a CPU
    python examples/broadcast_product.py                          # (4000, 5) x (100, 4000, 5)
"""

from __future__ import annotations

import argparse
import time

import dask.array as da
import numpy as np

import dask_gpuchunk as dg


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dates", type=int, default=100,
                        help="the leading axis of the larger array (default %(default)s)")
    parser.add_argument("--ids", type=int, default=4000,
                        help="rows of the smaller array, broadcast along --dates (default "
                             "%(default)s)")
    parser.add_argument("--n", type=int, default=5, help="columns of both (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per device, the best reported (default %(default)s)")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    mult_by = rng.random((args.ids, args.n))                  # (4000, 5)
    discount = rng.random((args.dates, args.ids, args.n))     # (100, 4000, 5)
    expected = mult_by * discount

    devices = ["cpu", "auto"] + (["gpu"] if dg.gpu_available() else [])
    times: dict[str, float] = {}
    for device in devices:
        x = da.from_array(discount, chunks=(max(1, args.dates // 4), args.ids, args.n))
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            result = dg.multiply(mult_by, x, device=device).compute()
            best = min(best, time.perf_counter() - t0)
        assert np.array_equal(result, expected), f"wrong result on {device}"
        times[device] = best
        print(f"device={device:4s}: {best * 1e3:8.2f} ms, shape {result.shape}, exact")
    for d in dg.placement_decisions():
        print(f"auto chose {d['choice']}: CPU {d['t_cpu'] * 1e3:.2f} ms vs GPU estimate "
              f"{d['t_gpu_estimate'] * 1e3:.2f} ms per chunk")
    return times


if __name__ == "__main__":
    main()
