"""Nearest neighbours of molecule fingerprints read from a ``.npy``: each one's 10 most similar
by Tanimoto, and every pair above 0.7, exactly.

Fingerprints here are made up (2048-bit, 7.5 % of bits set, as Morgan fingerprints have, with
a few near-duplicates planted) and saved as ``np.packbits`` rows, as RDKit's
``DataStructs.ConvertToNumpyArray`` plus ``np.packbits`` would give. ``dg.from_npy`` reads them
chunk by chunk; ``dg.similarity`` computes only the blocks of pairs on or above the diagonal
and keeps each row's best 10 (or its pairs over the threshold) as it goes, so the n x n scores
are never in memory. Sampled rows are checked against NumPy.

    python examples/fingerprint_neighbours.py --rows 5000        # small: seconds on a CPU
    python examples/fingerprint_neighbours.py                    # 20,000 fingerprints
    python examples/fingerprint_neighbours.py --rows 1000000 --chunk-rows 32768   # on a GPU
    dask-gpuchunk similarity fps.npy --packed --top-k 10 -o top.npz           # the same, a job
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

import dask_gpuchunk as dg


def make_fingerprints(rows: int, bits: int, density: float, seed: int) -> np.ndarray:
    """Packed random fingerprints, the second 1 % of them near-duplicates of the first."""
    rng = np.random.default_rng(seed)
    fps = rng.random((rows, bits)) < density
    twins = max(1, rows // 100)
    fps[twins:2 * twins] = fps[:twins] ^ (rng.random((twins, bits)) < 0.01)
    return np.packbits(fps, axis=1)


def tanimoto_row(words: np.ndarray, row: int) -> np.ndarray:
    """One row's Tanimoto against all, by the documented formula (for the check)."""
    c = np.bitwise_count(words & words[row]).sum(axis=1, dtype=np.int64)
    counts = np.bitwise_count(words).sum(axis=1, dtype=np.int64)
    den = np.float32(counts[row] + counts - c)
    return np.float32(c) / np.where(den == 0, np.float32(1), den)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000,
                        help="fingerprints to make (default %(default)s)")
    parser.add_argument("--bits", type=int, default=2048,
                        help="bits per fingerprint (default %(default)s)")
    parser.add_argument("--density", type=float, default=0.075,
                        help="share of bits set (default %(default)s)")
    parser.add_argument("--chunk-rows", type=int, default=4096,
                        help="fingerprints per chunk read from the file (default %(default)s)")
    parser.add_argument("--top-k", type=int, default=10,
                        help="neighbours kept per fingerprint (default %(default)s)")
    parser.add_argument("--threshold", type=float, default=0.7,
                        help="Tanimoto score of the pairs listed (default %(default)s)")
    parser.add_argument("--samples", type=int, default=8, help="rows checked against NumPy")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fps.npy"
        np.save(path, make_fingerprints(args.rows, args.bits, args.density, seed=1))
        words = dg.from_npy(path, chunks=(args.chunk_rows, -1))

        t0 = time.perf_counter()
        # .compute() of the result: both arrays in one pass over the blocks
        indices, scores = dg.similarity(words, packed=True, top_k=args.top_k).compute()
        t_top = time.perf_counter() - t0
        t0 = time.perf_counter()
        rows, cols, above = dg.similarity(words, packed=True,
                                          threshold=args.threshold).compute()
        t_pairs = time.perf_counter() - t0

        host = np.load(path)
        for row in np.random.default_rng(2).choice(args.rows, args.samples, replace=False):
            s = tanimoto_row(host, int(row)).astype(np.float64)
            s[row] = -1  # a fingerprint is not its own neighbour
            best = np.argsort(-s, kind="stable")[:args.top_k]
            assert np.array_equal(indices[row], best), row
            assert np.array_equal(scores[row], s[best].astype(np.float32)), row
            keep = np.nonzero(s >= np.float32(args.threshold))[0]
            assert np.array_equal(cols[rows == row], keep), row
    pairs = args.rows * (args.rows - 1) // 2  # unique pairs: each pair once
    print(f"{args.rows:,} fingerprints of {args.bits} bits: top-{args.top_k} of every one in "
          f"{t_top:.2f} s ({pairs / t_top:.3g} unique pairs/s); {len(rows):,} pairs at "
          f"Tanimoto >= "
          f"{args.threshold} in {t_pairs:.2f} s; {args.samples} rows checked against NumPy")
    first = int(np.argmax(scores[:, 0]))
    print(f"e.g. fingerprint {first}: nearest {indices[first, :3].tolist()} at "
          f"{[round(float(v), 3) for v in scores[first, :3]]}")
    return {"top_k_seconds": t_top, "threshold_seconds": t_pairs, "pairs_found": len(rows)}


if __name__ == "__main__":
    main()
