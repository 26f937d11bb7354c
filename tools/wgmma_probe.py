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
)

TILES = [WgmmaTile(128, 256, 4, 1024, 8), WgmmaTile(128, 256, 3, 1024, 8),
         WgmmaTile(256, 128, 4, 1024, 8), WgmmaTile(128, 128, 4, 1024, 8)]


def variants(source: str) -> dict[str, str]:
    no_copies = (source.replace("tensor_copy(at + p * BLOCK_BYTES", "if (0) tensor_copy(at")
                 .replace("tensor_copy(at + (BM / BLOCK + p)",
                          "if (0) tensor_copy(at + (BM / BLOCK + p)")
                 .replace("barrier_arrive_expecting(bar, stage_bytes);",
                          "barrier_arrive_expecting(bar, 0);"))
    no_mma = source.replace("mma_b1(*reinterpret_cast", "if (0) mma_b1(*reinterpret_cast")
    no_stores = source.replace("    // Accumulator i of a thread: row 16 * warp",
                               "    if (acc[0] != -12345) { na = 0; nb = 0; }\n"
                               "    // Accumulator i of a thread: row 16 * warp")
    assert no_copies.count("if (0)") == 2 and no_mma != source and no_stores != source
    return {"as written": source, "no copies": no_copies, "no wgmma": no_mma,
            "no stores of C": no_stores}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 131072
    rng = np.random.default_rng(0)
    words = cupy.asarray(rng.integers(0, 2**64, size=(n, k // 64), dtype=np.uint64))
    c = cupy.empty((n, n), dtype=np.int32)
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}: full C, N={n} K={k}, "
          "N*N*K/t", flush=True)
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
