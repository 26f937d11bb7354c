"""Top-k and threshold of fingerprints held in host memory (a NumPy-backed Dask array) on one
GPU, with each block's words moved to the GPU (as the package does) and, for comparison, with
the block's counts staged back to the host for the CPU to select from (the path before).

Usage (on a machine with a GPU): python tools/host_words_selection_probe.py --rows 131072
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

import dask
import dask.array as da
import numpy as np

import dask_gpuchunk as dg
from dask_gpuchunk.backend import staging_totals

similarity_module = importlib.import_module("dask_gpuchunk.similarity")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=131072)
    parser.add_argument("--bits", type=int, default=2048)
    parser.add_argument("--chunk-rows", type=int, default=32768)
    parser.add_argument("--threshold", type=float, default=0.1)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(5)
    words = np.packbits(rng.random((args.rows, args.bits)) < 0.075, axis=1)
    moved = similarity_module._moved_to_gpu
    results = {}
    for path in ("words moved", "counts staged back"):
        similarity_module._moved_to_gpu = (moved if path == "words moved"
                                           else lambda device, *arrays: arrays)
        for op, options in (("top-k", {"top_k": args.top_k}),
                            ("threshold", {"threshold": args.threshold})):
            times, d2h = [], []
            for _ in range(args.repeats):
                x = da.from_array(words, chunks=(args.chunk_rows, -1))
                out = dg.similarity(x, packed=True, **options)
                before = staging_totals.snapshot()["d2h_bytes"]
                t0 = time.perf_counter()
                value = dask.compute(*out)
                times.append(time.perf_counter() - t0)
                d2h.append(staging_totals.snapshot()["d2h_bytes"] - before)
            results[(path, op)] = value
            print(json.dumps({"path": path, "op": op, "seconds": times,
                              "d2h_bytes": d2h}), flush=True)
    similarity_module._moved_to_gpu = moved
    for op in ("top-k", "threshold"):
        same = all(np.array_equal(a, b) for a, b in zip(results[("words moved", op)],
                                                         results[("counts staged back", op)]))
        print(json.dumps({"op": op, "both paths equal": same}), flush=True)


if __name__ == "__main__":
    main()
