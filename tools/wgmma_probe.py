"""Where the wgmma kernel's time goes: the kernel as written, without its copies, and without
its tensor-core instructions, timed on the same full Gram (run on a Hopper GPU).

    python tools/wgmma_probe.py [N] [K]

A variant's results are wrong by construction (no data, no products, or no C); only its time is
read: without copies it shows what the instructions alone can do with this shared-memory
layout, without instructions what the copies alone can feed.
"""

from __future__ import annotations

import sys

import cupy
import numpy as np
from bmma_tiles import timed  # this folder's tool: run as tools/wgmma_probe.py

from dask_gpuchunk._kernels.wgmma import (
    WgmmaTile,
    compile_for_sm90a,
    kernel_source,
    launch,
    tiled_words,
)

TILES = [WgmmaTile(128, 256, 4, 1024, 8), WgmmaTile(128, 256, 3, 1024, 8),
         WgmmaTile(256, 128, 4, 1024, 8), WgmmaTile(128, 128, 4, 1024, 8)]


def variants(source: str) -> dict[str, str]:
    no_copies = (source.replace("bulk_copy(at + p * BLOCK_BYTES", "if (0) bulk_copy(at")
                 .replace("bulk_copy(at + (BM / BLOCK + p)", "if (0) bulk_copy(at + (BM / BLOCK + p)")
                 .replace("barrier_arrive_expecting(bar, bytes);",
                          "barrier_arrive_expecting(bar, 0);"))
    no_mma = source.replace("mma_b1(*reinterpret_cast", "if (0) mma_b1(*reinterpret_cast")
    no_stores = source.replace("    // Accumulator i of a thread: row 16 * warp",
                               "    if (acc[0] != -12345) { na = 0; nb = 0; }\n"
                               "    // Accumulator i of a thread: row 16 * warp")
    assert no_copies.count("if (0)") == 2 and no_mma != source and no_stores != source
    return {"as written": source, "no copies": no_copies, "no wgmma": no_mma,
            "no stores of C": no_stores}


#: The layout pass with its reads in the words' order (a warp reads 4 rows x 128 bytes) and
#: its writes scattered (8 runs of 64 bytes a warp), against tiled_words' opposite choice.
_READ_ORDER = r"""
extern "C" __global__ void tile_words(const unsigned long long* __restrict__ words,
                                      ulonglong2* __restrict__ out, long long n, long long m,
                                      long long stages, long long chunks, long long total)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long column = i % chunks, rest = i / chunks;   // [block][stage][row][column]
        const long long in_block = rest % 128, step = (rest / 128) % stages;
        const long long block = rest / 128 / stages, row = block * 128 + in_block;
        const long long word = (step * chunks + column) * 2;
        ulonglong2 v = make_ulonglong2(0ull, 0ull);
        if (row < n) {
            if (word < m) v.x = words[row * m + word];
            if (word + 1 < m) v.y = words[row * m + word + 1];
        }
        out[((block * stages + step) * chunks + column) * 128 + in_block] = v;
    }
}
"""


def tiling_rates(words: cupy.ndarray) -> None:
    """The layout pass alone (tiled_words), and the same pass in the words' order."""
    n, m = words.shape
    t = timed(lambda: tiled_words(words, 1024))
    moved = 2 * words.nbytes
    print(f"  tiled_words alone: {t * 1e3:.3f} ms = {moved / t / 1e12:.2f} TB/s", flush=True)
    out = tiled_words(words, 1024)
    kernel = cupy.RawKernel(_READ_ORDER, "tile_words")
    total = out.size // 2
    args = (words, out, np.int64(n), np.int64(m), np.int64(-(-m // 16)), np.int64(8),
            np.int64(total))
    t = timed(lambda: kernel((min(-(-total // 256), 65536),), (256,), args))
    same = bool((out == tiled_words(words, 1024)).all())
    print(f"  the same pass in the words' order: {t * 1e3:.3f} ms = {moved / t / 1e12:.2f} TB/s"
          f" ({'same' if same else 'DIFFERENT'} result)", flush=True)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 131072
    rng = np.random.default_rng(0)
    words = cupy.asarray(rng.integers(0, 2**64, size=(n, k // 64), dtype=np.uint64))
    c = cupy.empty((n, n), dtype=np.int32)
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}: full C, N={n} K={k}, "
          "N*N*K/t", flush=True)
    tiling_rates(words)
    for tile in TILES if k > 8192 else TILES[:1]:
        for name, source in variants(kernel_source(tile)).items():
            try:
                kernel = compile_for_sm90a(source, tile.shared_bytes).kernel
                t = timed(lambda kernel=kernel, tile=tile: launch(kernel, words, words, c, tile))
                print(f"  {tuple(tile)} {name}: {t * 1e3:.2f} ms = {n * n * k / t:.3e}",
                      flush=True)
            except Exception as exc:  # noqa: BLE001 - report what the compiler or driver said
                print(f"  {tuple(tile)} {name}: {type(exc).__name__}: {str(exc)[:1500]}",
                      flush=True)


if __name__ == "__main__":
    main()
