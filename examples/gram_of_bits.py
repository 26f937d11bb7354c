"""``C = A · Aᵀ`` of a 0/1 matrix with 1e4 to 1e5 rows and 2e5 columns, exactly.

A numba kernel over the whole matrix runs out of device memory, and packing bits by hand is
messy when the column count is not a multiple of 8. Here the bits are
packed chunk by chunk (any column count), ``dg.gram`` computes only the blocks on or above the
diagonal, and ``dg.to_npy`` writes each block of C into its place in a ``.npy`` file as it is
computed (from the host or straight from the device), so neither A nor C has to fit in memory
(A is generated chunk by chunk too).

    python examples/gram_of_bits.py --rows 3000 --cols 1043  # small, odd column count: seconds on a CPU
    python examples/gram_of_bits.py                          # 10,000 x 200,000 bits -> 400 MB .npy
    python examples/gram_of_bits.py --rows 100000 --out /scratch/c.npy   # 100,000 rows: C is 40 GB
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import dask
import dask.array as da
import numpy as np

import dask_gpuchunk as dg


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000,
                        help="rows of A, and of C (default %(default)s)")
    parser.add_argument("--cols", type=int, default=200_000,
                        help="columns (bits) of A (default %(default)s)")
    parser.add_argument("--density", type=float, default=0.5,
                        help="share of ones in A (default %(default)s)")
    parser.add_argument("--chunk-rows", type=int, default=4096,
                        help="rows of A per chunk, and of C's blocks (default %(default)s)")
    parser.add_argument("--method", choices=["auto", "popcount", "int8"], default="auto",
                        help="how blocks of C are counted (dg.gram's method=)")
    parser.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto",
                        help="where (dg.gram's device=)")
    parser.add_argument("--out", type=Path, default=None, help="the .npy to write (default: a "
                        "temporary file, removed at the end)")
    parser.add_argument("--samples", type=int, default=16, help="rows of C checked against NumPy")
    args = parser.parse_args(argv)

    # A: random 0/1 bytes, generated per chunk (as np.random.randint(2, ...) would give).
    chunks = (args.chunk_rows, 65_536)
    a = (da.random.default_rng(1).random((args.rows, args.cols), chunks=chunks) < args.density)
    a = a.astype(np.uint8)
    t0 = time.perf_counter()
    (words,) = dask.persist(dg.bitpack(a, device=args.device))  # 8 x smaller than A
    t_pack = time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        path = args.out or Path(tmp) / "gram.npy"
        c = dg.gram(words, packed=True, method=args.method, device=args.device)
        t0 = time.perf_counter()
        dg.to_npy(c, path, overwrite=True)  # each block of C lands in its place as it is computed
        t_gram = time.perf_counter() - t0

        # Check sampled rows of the file: C[r, :] = popcount(A[r] & A) summed over words.
        host_words = np.asarray(words.compute())
        if hasattr(host_words, "get"):
            host_words = host_words.get()
        written = np.load(path, mmap_mode="r")
        rng = np.random.default_rng(2)
        for r in rng.choice(args.rows, size=min(args.samples, args.rows), replace=False):
            expected = np.bitwise_count(host_words & host_words[r]).sum(axis=1, dtype=np.int64)
            assert np.array_equal(written[r], expected), f"row {r} of C is wrong"
        size_gb = path.stat().st_size / 1e9
        del written

    rate = float(args.rows) ** 2 * args.cols / t_gram
    print(f"A {args.rows} x {args.cols} bits, {words.numblocks[0]} row chunks: packed in "
          f"{t_pack:.2f} s; C ({size_gb:.2f} GB .npy) computed and written in {t_gram:.2f} s "
          f"({rate:.3g} bit-MAC/s); {min(args.samples, args.rows)} sampled rows exact")
    return {"pack_seconds": t_pack, "gram_seconds": t_gram, "bit_macs_per_s": rate}


if __name__ == "__main__":
    main()
