"""The CPU path against one numba parallel kernel (run on the GPU host, 16 cores).

    python3 tools/profile_cpu_path.py [rows]

Times, on seed 000's product (two rows x 500 float64 arrays into a touched output): numba's own
2-D parallel kernel; our generated 1-D kernel on the whole arrays; our kernel chunk by chunk
with no Dask; and dg.multiply(device="cpu", out=) at several oversubscription factors.
"""

from __future__ import annotations

import sys
import time

import numba
import numpy as np

import dask_gpuchunk as dg
import dask_gpuchunk.backend as backend


def median_ms(fn, n=5):
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


@numba.njit(parallel=True, nogil=True)
def peer(a, b, out):
    for i in numba.prange(a.shape[0]):
        for j in range(a.shape[1]):
            out[i, j] = a[i, j] * b[i, j]


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    cols, chunk = 500, max(1, rows // 20)
    rng = np.random.default_rng(0)
    a, b = rng.random((rows, cols)), rng.random((rows, cols))
    out = np.empty((rows, cols))
    out[...] = 0.0
    k = dg.multiply.kernels
    cores = numba.config.NUMBA_NUM_THREADS

    def chunked():
        numba.set_num_threads(cores)
        for s in range(0, rows, chunk):
            k.cpu(out[s:s + chunk].reshape(-1), a[s:s + chunk].reshape(-1),
                  b[s:s + chunk].reshape(-1))

    def ours(factor):
        def run():
            saved = backend.CPU_OVERSUBSCRIPTION
            backend.CPU_OVERSUBSCRIPTION = factor
            try:
                dg.multiply(dg.asarray(a, (chunk, cols)), dg.asarray(b, (chunk, cols)),
                            device="cpu", out=out)
            finally:
                backend.CPU_OVERSUBSCRIPTION = saved
        return run

    def whole():
        numba.set_num_threads(cores)
        k.cpu(out.reshape(-1), a.reshape(-1), b.reshape(-1))

    rows_ = {"numba peer (2-D kernel, all cores)": lambda: peer(a, b, out),
             "ours 1-D kernel, whole arrays": whole,
             "ours kernel, 20 chunks in a loop": chunked}
    for factor in (1, 2, 4, 8, 16):
        rows_[f"dg.multiply cpu, oversubscription {factor}"] = ours(factor)
    for _ in range(2):  # two rounds: drift shows as a difference between them
        for name, fn in rows_.items():
            print(f"{name:42s} {median_ms(fn):8.1f} ms")
        print()
    assert np.array_equal(out, a * b)
    print("threading layer:", numba.threading_layer(), "cores:", cores)


if __name__ == "__main__":
    main()
