"""Compile the bmma kernel for several tile shapes, check each exact, time each (run on a GPU).

    python tools/bmma_tiles.py [N] [K]

Per tile: registers and local (spilled) bytes per thread, exactness against NumPy on odd sizes
(symmetric and rectangular), then the symmetric N x N Gram of K random bits (kernel alone, C on
the device) and the full one (every tile), as N·N·K / t. Errors are printed, not raised, so one
bad tile does not hide the others.
"""

from __future__ import annotations

import sys
import time

import cupy
import numpy as np

from dask_gpuchunk._kernels.bitpack import reference_bitpack
from dask_gpuchunk._kernels.bmma import TILE, BmmaTile, _kernel, bmma_cuda
from dask_gpuchunk._kernels.gram import reference_gram

T = BmmaTile
TILES = [T(128, 128, 64, 64, 4, 512, 1, 1), T(128, 128, 64, 64, 3, 1024, 1, 0),
         T(128, 128, 64, 64, 3, 1024, 1, 1), T(128, 128, 64, 64, 3, 1024, 4, 1),
         T(128, 128, 64, 64, 3, 1024, 8, 1), T(128, 128, 64, 64, 3, 1024, 16, 1),
         T(128, 128, 64, 64, 4, 1024, 1, 1), T(128, 128, 64, 64, 2, 2048, 1, 1),
         T(128, 256, 64, 64, 3, 1024, 1, 1), T(256, 128, 64, 64, 3, 1024, 8, 1),
         T(128, 128, 32, 64, 3, 1024, 1, 1)]
if TILE not in TILES:
    TILES.insert(0, TILE)


def exact(run, rng: np.random.Generator) -> str:
    """Whether ``run(words, b, c)`` (a Gram kernel's launch) is exact on odd sizes, symmetric
    and rectangular: "exact", or where it first went wrong."""
    for n, k in ((1, 1), (333, 1043), (257, 4097), (1000, 700)):
        a = (rng.random((n, k)) < rng.uniform(0.05, 0.95)).astype(np.uint8)
        words = cupy.asarray(reference_bitpack(a))
        expected = reference_gram(a)
        for b in (None, words):
            c = cupy.empty((n, n), dtype=np.int32)
            run(words, b, c)
            got = cupy.asnumpy(c)
            if not np.array_equal(got, expected):
                wrong = np.argwhere(got != expected)
                return (f"WRONG n={n} k={k} diagonal={b is None}: {len(wrong)} entries, first "
                        f"{wrong[:4].tolist()}, got {got[tuple(wrong[0])]} expected "
                        f"{expected[tuple(wrong[0])]}, max error "
                        f"{int(np.abs(got.astype(np.int64) - expected).max())}")
    a = (rng.random((301, 777)) < 0.5).astype(np.uint8)
    b = (rng.random((45, 777)) < 0.2).astype(np.uint8)
    c = cupy.empty((301, 45), dtype=np.int32)
    run(cupy.asarray(reference_bitpack(a)), cupy.asarray(reference_bitpack(b)), c)
    if not np.array_equal(cupy.asnumpy(c), a.astype(np.int64) @ b.T.astype(np.int64)):
        return "WRONG rectangular"
    return "exact"


def timed(launch, repeat: int = 5) -> float:
    launch()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        launch()
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 131072
    rng = np.random.default_rng(0)
    words = cupy.asarray(rng.integers(0, 2**63, size=(n, k // 64), dtype=np.uint64)) ^ \
        cupy.asarray(rng.integers(0, 2, size=(n, k // 64), dtype=np.uint64) << np.uint64(63))
    sample = cupy.asnumpy(words[:64])
    bits = np.unpackbits(sample.view(np.uint8), axis=1)
    expected_rows = None
    c = cupy.empty((n, n), dtype=np.int32)
    print(f"N={n} K={k}; rates are N*N*K/t", flush=True)
    for tile in TILES:
        try:
            kern = _kernel(tile)
            regs = getattr(kern, "num_regs", "?")
            local = getattr(kern, "local_size_bytes", "?")
            verdict = exact(lambda a, b, c: bmma_cuda(a, b, c, tile=tile), rng)
            sym = timed(lambda: bmma_cuda(words, None, c, tile=tile))
            got = cupy.asnumpy(c[:64, :64])
            if expected_rows is None:
                expected_rows = (bits[:, None, :] & bits[None, :, :]).sum(axis=2)
            big = "ok" if np.array_equal(got, expected_rows) else "WRONG"
            full = timed(lambda: bmma_cuda(words, words, c, tile=tile))
            print(f"{tuple(tile)}: {tile.threads} thr, {tile.shared_bytes // 1024} KiB smem, "
                  f"regs {regs}, local {local} B; {verdict}, big {big}; symmetric {sym * 1e3:.2f} ms "
                  f"= {n * n * k / sym:.3e}; full {full * 1e3:.2f} ms = {n * n * k / full:.3e}",
                  flush=True)
        except Exception as exc:  # noqa: BLE001 - report whatever the compiler or driver said
            print(f"{tuple(tile)}: {type(exc).__name__}: {str(exc)[:3000]}", flush=True)


if __name__ == "__main__":
    main()
