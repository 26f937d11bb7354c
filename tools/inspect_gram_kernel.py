"""Count the PTX instructions of the popcount Gram kernel's inner loop (run on a GPU machine).

Usage: python tools/inspect_gram_kernel.py [TY,TX,RM,RN,TK ...] > ptx-summary.txt
"""

from __future__ import annotations

import collections
import re
import sys

import cupy
import numpy as np

from dask_gpuchunk._kernels import gram


def main() -> None:
    tiles = [gram.TileShape(*map(int, t.split(","))) for t in sys.argv[1:]] or [gram.CUDA_TILE]
    words = cupy.asarray(np.random.default_rng(0).integers(0, 2**63, (256, 64), dtype=np.uint64))
    c = cupy.empty((256, 256), dtype=np.int32)
    for tile in tiles:
        gram.popcount_cuda(words, None, c, tile=tile)
        kernel = gram._cuda_popcount_kernel(tile)
        for sig, ptx in kernel.inspect_asm().items():
            ops = collections.Counter(
                m.group(1) for m in re.finditer(r"^\s+(?:@%p\d+\s+)?([a-z][\w.]*)", ptx, re.MULTILINE)
            )
            print(f"tile {tuple(tile)} {sig}")
            for op, count in ops.most_common(25):
                print(f"  {op:24s} {count}")
        print(f"  registers per thread: {kernel.get_regs_per_thread()}")


if __name__ == "__main__":
    main()
