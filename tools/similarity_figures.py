"""Figures for ``dg.similarity`` on a GPU: all-pairs top-k and threshold over device-resident
fingerprints, beside the dense Gram of the same words, sampled rows checked exactly.

    python tools/similarity_figures.py --rows 65536 131072 --bits 2048 --out $OUT/sim.json

Fingerprints are random at ``--density`` (Morgan fingerprints set 5-10 % of their bits), the
first n/64 with near twins (1 % of their bits flipped: Tanimoto ~0.9), made and packed on the
device (``np.packbits`` order), in row chunks of ``--chunk-rows``. Each figure is
the best of ``--repeats`` warm runs in this process (dask's threaded scheduler, CuPy chunks).
Sampled rows are checked against a brute force on the device: counts by a float32 GEMM of the
0/1 rows (exact: every sum is below 2**24), the documented formula, a stable sort by score.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import cupy
import dask
import dask.array as da
import numpy as np

import dask_gpuchunk as dg
from dask_gpuchunk.bits.gram import block_counts


SKIP_GRAM = False


def best_of(repeats: int, fn) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        try:
            out = fn()
        except cupy.cuda.memory.OutOfMemoryError:
            from dask_gpuchunk.runtime.budget import budget_report

            pool = cupy.get_default_memory_pool()
            print(f"out of memory: pool used {pool.used_bytes():,} of {pool.total_bytes():,}; "
                  f"budget {budget_report()}", flush=True)
            raise
        cupy.cuda.Device().synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


#: Rows made, packed or compared at a time (a float32 copy of 10**6 x 2048 bits is 8 GB).
PIECE = 65536


def reference_rows(bits01: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Tanimoto of ``rows`` against every row (0/1 on the host, compared on the device a piece
    at a time), by the documented formula on exact counts."""
    q = cupy.asarray(bits01[rows]).astype(cupy.float32)
    a = q.sum(axis=1, dtype=cupy.int32)[:, None]
    out = []
    for start in range(0, bits01.shape[0], PIECE):
        part = cupy.asarray(bits01[start:start + PIECE])
        c = (q @ part.T.astype(cupy.float32)).astype(cupy.int32)
        b = part.sum(axis=1, dtype=cupy.int32)[None, :]
        den = (a + b - c).astype(cupy.float32)
        out.append(cupy.asnumpy(c.astype(cupy.float32)
                                / cupy.where(den == 0, cupy.float32(1), den)))
    return np.concatenate(out, axis=1)


def figures(n: int, bits: int, density: float, chunk_rows: int, k: int, threshold: float,
            repeats: int, seed: int) -> dict:
    # Made on the device a piece at a time, kept on the host (only the words stay on the
    # device, as a user's would).
    rng = cupy.random.default_rng(seed)
    bits01 = np.concatenate([
        (rng.random((min(PIECE, n - start), bits), dtype=cupy.float32) < density).astype(
            cupy.uint8).get() for start in range(0, n, PIECE)])
    # Near twins (1 % of the bits flipped) of the first n/64 rows, so that the threshold finds
    # pairs: random fingerprints at this density score ~0.04 against each other.
    twins = n // 64
    flips = (rng.random((twins, bits), dtype=cupy.float32) < 0.01).astype(cupy.uint8).get()
    bits01[twins:2 * twins] = bits01[:twins] ^ flips
    words = cupy.concatenate([  # np.packbits order; bits: a multiple of 8
        cupy.packbits(cupy.asarray(bits01[start:start + PIECE]).ravel()).reshape(-1, bits // 8)
        for start in range(0, n, PIECE)])
    cupy.get_default_memory_pool().free_all_blocks()
    x = dg.asarray(words, chunks=(chunk_rows, -1))
    out: dict = {"rows": n, "bits": bits, "density": density, "chunk_rows": chunk_rows, "k": k,
                 "pairs": n * (n - 1)}
    from dask_gpuchunk._kernels.top_k_overflow import redone

    def top_k():
        return dask.compute(*dg.similarity(x, packed=True, top_k=k))

    rows = da.arange(n, chunks=(chunk_rows,))

    def gram_blocks():
        # The Gram's blocks on and above the diagonal, each computed and dropped (its corner
        # kept): the counts that top-k and threshold score, without the scoring.
        def corner(a, b, ra, rb):
            if ra[0] > rb[0]:
                return cupy.zeros((1, 1), dtype=cupy.int32)
            return block_counts(a, b)[:1, :1].copy()  # a view would keep the block

        return da.blockwise(corner, "ij", x, "ik", x, "jk", rows, "i", rows, "j",
                            concatenate=True, adjust_chunks={"i": 1, "j": 1}, dtype=np.int32,
                            meta=cupy.empty((0, 0), dtype=cupy.int32)).compute()

    def above():
        return dask.compute(*dg.similarity(x, packed=True, threshold=threshold))

    print(f"{n} rows: top-k", flush=True)
    out["top_k_s"], (indices, scores) = best_of(repeats, top_k)
    if not SKIP_GRAM:
        print(f"{n} rows: Gram blocks", flush=True)
        out["gram_blocks_s"], _ = best_of(repeats, gram_blocks)
    print(f"{n} rows: threshold", flush=True)
    out["threshold_s"], (r, c, s) = best_of(repeats, above)
    out["threshold_pairs"] = int(r.shape[0])
    out["redone_targets"] = redone["targets"]
    out["top_k_pairs_per_s"] = out["pairs"] / out["top_k_s"]
    out["pool_peak_bytes"] = int(cupy.get_default_memory_pool().total_bytes())
    pick = np.random.default_rng(seed)
    sample = np.concatenate([pick.choice(n // 32, 4, replace=False),
                             pick.choice(np.arange(n // 32, n), 4, replace=False)])
    ref = reference_rows(bits01, sample)
    ok = True
    r, c, s = (cupy.asnumpy(v) for v in (r, c, s))
    for row, want in zip(sample, ref):
        want = want.astype(np.float64)
        want[row] = -np.inf
        order = np.argsort(-want, kind="stable")[:k]
        ok &= bool(np.array_equal(cupy.asnumpy(indices[row]), order))
        ok &= bool(np.array_equal(cupy.asnumpy(scores[row]).astype(np.float64), want[order]))
        mine = r == row
        keep = np.nonzero(want >= np.float32(threshold))[0]
        ok &= bool(np.array_equal(c[mine], keep) and np.array_equal(s[mine], want[keep]))
    out["sampled_rows_exact"] = ok
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[65536])
    parser.add_argument("--bits", type=int, default=2048)
    parser.add_argument("--density", type=float, default=0.075)
    parser.add_argument("--chunk-rows", type=int, default=4096)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-gram", action="store_true",
                        help="leave out the Gram's blocks alone (the baseline)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    global SKIP_GRAM
    SKIP_GRAM = args.skip_gram
    figures(4096, args.bits, args.density, 1024, args.top_k, args.threshold, 1, 0)  # warm-up
    results = [figures(n, args.bits, args.density, args.chunk_rows, args.top_k, args.threshold,
                       args.repeats, 1) for n in args.rows]
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
