"""The wgmma Gram kernel on a Hopper GPU: exact or not, then how fast, beside bmma (run there).

    python tools/wgmma_check.py [N] [K]

First a probe of the smallest tile on 64 x 8 rows (:func:`diagnose`): exact or not, and which
rows of C came out where, so that one run tells a wrong layout from a wrong kernel. A kernel
fault (an illegal address) leaves the CUDA context unusable: run this last in a device call.

Per tile: registers and local (spilled) bytes per thread; exactness against NumPy on odd
sizes (symmetric and rectangular) and on 64 rows of the big case; then the symmetric N x N
Gram of K random bits (kernel alone, C on the device, upper tiles and the mirror) and the full
one (every tile), as N·N·K / t; bmma's default tile timed the same way in the same run. Also the
fingerprint size (65,536 x 2048 bits) where C's 17 GB and not the tensor cores set the time.
Errors are printed, not raised, so one bad tile does not hide the others.
"""

from __future__ import annotations

import sys

import cupy
import numpy as np
from bmma_tiles import exact, timed  # this folder's tool: run as tools/wgmma_check.py

from dask_gpuchunk._kernels.bitpack import reference_bitpack
from dask_gpuchunk._kernels.bmma import bmma_cuda
from dask_gpuchunk._kernels.wgmma import (
    TILE,
    WgmmaTile,
    _compiled_kernel,
    compile_for_sm90a,
    kernel_source,
    launch,
    wgmma_cuda,
)

T = WgmmaTile
TILES = [TILE, T(128, 256, 3, 1024, 8), T(256, 128, 4, 1024, 8), T(128, 128, 4, 1024, 8),
         T(128, 256, 4, 1024, 4), T(128, 256, 4, 1024, 16)]


def attribute(kernel, which: int) -> object:
    """CUDA's ``CUfunction_attribute`` ``which`` of a compiled kernel; "?" where not found."""
    from cupy_backends.cuda.api import driver

    try:
        return driver.funcGetAttribute(which, kernel.ptr)
    except Exception:  # noqa: BLE001 - a CuPy without it, or another argument order
        return "?"


def random_words(rng: np.random.Generator, n: int, k: int) -> cupy.ndarray:
    return cupy.asarray(rng.integers(0, 2**64, size=(n, k // 64), dtype=np.uint64,
                                     endpoint=False))


def rates(name: str, run, words: cupy.ndarray, c: cupy.ndarray, expected: np.ndarray,
          n: int, k: int) -> None:
    sym = timed(lambda: run(words, None, c))
    big = "ok" if np.array_equal(cupy.asnumpy(c[:64, :64]), expected) else "WRONG"
    full = timed(lambda: run(words, words, c))
    big_full = "ok" if np.array_equal(cupy.asnumpy(c[:64, :64]), expected) else "WRONG"
    print(f"  {name}: big {big}/{big_full}; symmetric {sym * 1e3:.2f} ms = {n * n * k / sym:.3e};"
          f" full {full * 1e3:.2f} ms = {n * n * k / full:.3e}", flush=True)


def diagnose(rng: np.random.Generator) -> None:
    """Where the kernel is wrong: the smallest tile on 64 x 8 rows of 256 bits; whether C
    matches, and which rows / columns of the expected C each computed one equals."""
    tile = WgmmaTile(128, 128, 2, 1024, 1)
    a = (rng.random((64, 256)) < 0.5).astype(np.uint8)
    b = (rng.random((8, 256)) < 0.5).astype(np.uint8)
    expected = a.astype(np.int64) @ b.T.astype(np.int64)
    wa, wb = cupy.asarray(reference_bitpack(a)), cupy.asarray(reference_bitpack(b))
    written = kernel_source(tile)
    # The descriptors' two byte offsets swapped faulted (an illegal address) on the H200
    # where the kernel as written was exact: only the latter is probed now.
    variants = {"as written": written}
    for name, source in variants.items():
        try:
            kernel = compile_for_sm90a(source, tile.shared_bytes).kernel
            c = cupy.full((64, 8), -1, dtype=np.int32)
            launch(kernel, wa, wb, c, tile)
            got = cupy.asnumpy(c)
        except Exception as exc:  # noqa: BLE001 - report what the compiler or driver said
            print(f"  probe {name}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
            continue
        rows = [[int(r) for r in np.flatnonzero((expected == got[i]).all(axis=1))]
                for i in range(8)]
        cols = [[int(j) for j in np.flatnonzero((expected.T == got[:, jj]).all(axis=1))]
                for jj in range(8)]
        print(f"  probe {name}: {'exact' if np.array_equal(got, expected) else 'WRONG'}; "
              f"rows 0-7 equal expected rows {rows}; columns equal expected columns {cols}; "
              f"got[:4] {got[:4].tolist()} expected[:4] {expected[:4].tolist()}", flush=True)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 131072
    rng = np.random.default_rng(0)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    print(f"{props['name'].decode()}; rates are N*N*K/t (bit-MAC/s)", flush=True)
    diagnose(rng)
    for size_n, size_k in ((n, k), (65536, 2048)):
        words = random_words(rng, size_n, size_k)
        bits = np.unpackbits(cupy.asnumpy(words[:64]).view(np.uint8), axis=1).astype(np.int64)
        expected = bits @ bits.T
        c = cupy.empty((size_n, size_n), dtype=np.int32)
        print(f"N={size_n} K={size_k}", flush=True)
        rates("bmma default", bmma_cuda, words, c, expected, size_n, size_k)
        for tile in TILES if size_k == k else TILES[:1]:
            try:
                kernel = _compiled_kernel(cupy.cuda.runtime.getDevice(), tile).kernel
                regs, local = attribute(kernel, 4), attribute(kernel, 3)  # NUM_REGS, LOCAL_SIZE

                def run(a, b, out, tile=tile):
                    wgmma_cuda(a, b, out, tile=tile)

                verdict = exact(run, rng)
                print(f"  wgmma {tuple(tile)}: {tile.threads} threads, "
                      f"{tile.shared_bytes // 1024} KiB shared, regs {regs}, local {local} B; "
                      f"{verdict}", flush=True)
                rates(f"wgmma {tuple(tile)}", run, words, c, expected, size_n, size_k)
            except Exception as exc:  # noqa: BLE001 - report what the compiler or driver said
                print(f"  wgmma {tuple(tile)}: {type(exc).__name__}: {str(exc)[:3000]}",
                      flush=True)
        del words, c
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
