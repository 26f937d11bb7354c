"""Similarity top-k and a product of two files on 1 GPU and on every GPU of this node: issue
13's scaling figures for ``dg.similarity`` and ``dg.multiply`` from files.

Usage (on a machine with 2 or more GPUs; on a CPU machine it runs on a local CPU cluster of
``--cpu-workers`` workers, for checking the tool itself at small sizes):
    python tools/similarity_scaling.py --rows 1000000 --out $OUT/similarity-scaling.json

Inputs are written once: ``--rows`` fingerprints of ``--bits`` bits at ``--density`` (packed,
``np.packbits`` order) and two float32 arrays of ``--multiply-gb`` GB each. Then, on a fresh
``dg.local_cluster`` (its defaults) of each size:

* ``top-k``: ``dg.similarity(dg.from_npy(FPS, chunks=(--chunk-rows, -1)), packed=True,
  top_k=K)``, both results computed to the client, as a user writes it; four sampled rows
  checked against a brute force in NumPy (the documented float32 Tanimoto, best first, equal
  scores by the smaller index, the row itself left out);
* ``threshold``: ``dg.similarity(..., threshold=T)`` of the same fingerprints, the three
  results computed to the client, the four sampled rows' pairs checked against the brute force;
* ``multiply``: ``dg.multiply(dg.from_npy(A), dg.from_npy(B)).sum()``, checked against the
  float64 sum of the same product within float32's rounding.

Each is timed ``--repeats`` times (the first compiles), the best kept, with gram_scaling's
breakdown per worker (tasks by kind, busy time, bytes sent and staged). ``--words device``
moves the fingerprints to the GPUs first (``map_blocks(cupy.asarray)``, persisted over the
workers, untimed) for the top-k: what it costs where the words are already device-resident
(``--protocol`` then decides how a chunk reaches another worker's GPU).

The ``if __name__ == "__main__"`` guard matters: a local cluster's workers are spawned
processes that import this file again.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from gram_scaling import _protocol_options, _timed, _ucx_receive, add_transport_arguments

import dask_gpuchunk as dg


def write_fingerprints(path: Path, rows: int, bits: int, density: float, seed: int
                       ) -> np.ndarray:
    """Random packed fingerprints ``(rows, bits // 8)`` uint8 saved to ``path``, written in
    pieces; returns them (memory-mapped)."""
    rng = np.random.default_rng(seed)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(rows, bits // 8))
    for start in range(0, rows, 65536):
        stop = min(start + 65536, rows)
        out[start:stop] = np.packbits(rng.random((stop - start, bits)) < density, axis=1)
    out.flush()
    return np.load(path, mmap_mode="r")


def tanimoto_of_row(fps: np.ndarray, row: int) -> np.ndarray:
    """Row ``row``'s float32 Tanimoto against every row (``-inf`` against itself), as
    ``dg.similarity`` documents it."""
    pops = np.zeros(len(fps), np.int64)
    shared = np.zeros(len(fps), np.int64)
    for start in range(0, len(fps), 65536):
        part = np.asarray(fps[start:start + 65536])
        pops[start:start + len(part)] = np.bitwise_count(part).sum(axis=1)
        shared[start:start + len(part)] = np.bitwise_count(part & fps[row]).sum(axis=1)
    union = pops[row] + pops - shared
    scores = np.where(union > 0, np.float32(1) * shared.astype(np.float32)
                      / np.maximum(union, 1).astype(np.float32), np.float32(0))
    scores[row] = -np.inf
    return scores


def top_k_reference(fps: np.ndarray, row: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row ``row``'s ``k`` best columns by float32 Tanimoto, the row itself left out, equal
    scores by the smaller index: what ``dg.similarity(..., top_k=k)`` documents."""
    scores = tanimoto_of_row(fps, row)
    order = np.lexsort((np.arange(len(fps)), -scores))[:k]
    return order, scores[order]


def threshold_reference(fps: np.ndarray, row: int, threshold: float
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Row ``row``'s columns scoring at least ``threshold`` (the row itself left out), in
    order, and their scores."""
    scores = tanimoto_of_row(fps, row)
    cols = np.flatnonzero(scores >= np.float32(threshold))
    return cols, scores[cols]


def _device_words(client: Any, path: Path, args: argparse.Namespace) -> Any:
    """The fingerprints as CuPy chunks persisted over the cluster's workers."""
    import cupy
    from distributed import wait

    x = dg.from_npy(path, chunks=(args.chunk_rows, -1))
    x = x.map_blocks(cupy.asarray, dtype=x.dtype, meta=cupy.empty((0, 0), x.dtype)).persist()
    wait(x)
    return x


def _host(array: Any) -> np.ndarray:
    return array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else array


def _top_k(client: Any, path: Path, args: argparse.Namespace, sample: np.ndarray,
           expected: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    runs = []
    on_device = _device_words(client, path, args) if args.words == "device" else None
    for _ in range(args.repeats):
        x = on_device if on_device is not None else dg.from_npy(path,
                                                                 chunks=(args.chunk_rows, -1))
        idx, scores = dg.similarity(x, packed=True, top_k=args.top_k)
        run = _timed(client, lambda: client.compute([idx, scores], sync=True))
        got_idx, got_scores = (_host(part) for part in run.pop("value"))
        run["sampled_rows_exact"] = all(
            np.array_equal(got_idx[r], want_idx) and np.array_equal(got_scores[r], want_scores)
            for r, (want_idx, want_scores) in zip(sample, expected))
        runs.append(run)
    return _summary(runs)


def _threshold(client: Any, path: Path, args: argparse.Namespace, sample: np.ndarray,
               expected: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    runs = []
    for _ in range(args.repeats):
        x = dg.from_npy(path, chunks=(args.chunk_rows, -1))
        pairs = dg.similarity(x, packed=True, threshold=args.threshold)
        run = _timed(client, lambda: client.compute(list(pairs), sync=True))
        rows, cols, scores = run.pop("value")
        run["pairs"] = len(rows)
        run["sampled_rows_exact"] = all(
            np.array_equal(cols[rows == r], want_cols)
            and np.array_equal(scores[rows == r], want_scores)
            for r, (want_cols, want_scores) in zip(sample, expected))
        runs.append(run)
    return _summary(runs)


def _multiply(client: Any, a: Path, b: Path, args: argparse.Namespace, expected: float
              ) -> dict[str, Any]:
    runs = []
    for _ in range(args.repeats):
        product = dg.multiply(dg.from_npy(a), dg.from_npy(b))
        run = _timed(client, lambda: client.compute(product.sum(), sync=True))
        total = float(run.pop("value"))
        run["exact_within_float32"] = abs(total - expected) <= 1e-4 * max(abs(expected), 1.0)
        runs.append(run)
    return _summary(runs)


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = min(runs, key=lambda r: r["seconds"])
    for r in runs:
        r.pop("wall", None)
    checks = [v for r in runs for k, v in r.items() if k.startswith(("sampled", "exact"))]
    return {"seconds": [r["seconds"] for r in runs], "best": best["seconds"],
            "correct": all(checks), "breakdown": best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--bits", type=int, default=2048)
    parser.add_argument("--density", type=float, default=0.075)
    parser.add_argument("--chunk-rows", type=int, default=32768)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=0.1)
    parser.add_argument("--multiply-gb", type=float, default=4.0,
                        help="GB of each float32 operand of the product (0: no product)")
    parser.add_argument("--ops", default="top-k,multiply")
    parser.add_argument("--cpu-workers", type=int, default=2)
    parser.add_argument("--gpus", default=None,
                        help="cluster sizes, comma-separated (default: 1 and every GPU)")
    parser.add_argument("--repeats", type=int, default=3)
    add_transport_arguments(parser)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/similarity-scaling"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tls", default="yes", choices=["yes", "no"],
                        help="no: dg.local_cluster(secure=False), plain TCP between the "
                             "processes: what TLS costs the top-k's merges of the chains' states "
                             "and the results' way to this process")
    parser.add_argument("--words", default="host", choices=["host", "device"],
                        help="device: the top-k's fingerprints moved to the GPUs first "
                             "(persisted, untimed)")
    args = parser.parse_args()
    ops = args.ops.split(",")
    args.workdir.mkdir(parents=True, exist_ok=True)
    fps_path, a_path, b_path = (args.workdir / n for n in ("fps.npy", "a.npy", "b.npy"))
    rng = np.random.default_rng(7)
    result: dict[str, Any] = {"rows": args.rows, "bits": args.bits, "chunk_rows": args.chunk_rows,
                              "top_k": args.top_k, "threshold": args.threshold,
                              "multiply_gb": args.multiply_gb, "tls": args.tls,
                              "words": args.words, "protocol": args.protocol,
                              "rmm": args.rmm,
                              "ucx_receive": args.ucx_receive, "runs": {}}
    if "top-k" in ops or "threshold" in ops:
        t0 = time.perf_counter()
        fps = write_fingerprints(fps_path, args.rows, args.bits, args.density, seed=11)
        sample = np.sort(rng.choice(args.rows, 4, replace=False))
        expected = [top_k_reference(fps, int(r), args.top_k) for r in sample]
        expected_pairs = [threshold_reference(fps, int(r), args.threshold) for r in sample]
        result["inputs_seconds"] = time.perf_counter() - t0
    if "multiply" in ops:
        n = int(args.multiply_gb * 1e9 // 4)
        side = int(n ** 0.5)
        total = 0.0
        for path in (a_path, b_path):
            out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(side, side))
            for start in range(0, side, 4096):
                out[start:start + 4096] = rng.random((min(4096, side - start), side),
                                                     dtype=np.float32)
            out.flush()
            del out
        a, b = np.load(a_path, mmap_mode="r"), np.load(b_path, mmap_mode="r")
        for start in range(0, side, 4096):
            total += float((a[start:start + 4096] * b[start:start + 4096]).sum(dtype=np.float64))
        del a, b
    gpus_visible = dg.gpu_count()
    if args.gpus and gpus_visible:
        sizes = sorted({int(g) for g in args.gpus.split(",")})
    else:
        sizes = sorted({1, gpus_visible}) if gpus_visible else [1, args.cpu_workers]
    for size in sizes:
        options = ({"gpus": size} if gpus_visible
                   else {"n_workers": size, "threads_per_worker": 1})
        with dg.local_cluster(dashboard_address=None,
                                                **_protocol_options(args), **options) as client:
            _ucx_receive(client, args)
            runs: dict[str, Any] = {"workers": len(client.scheduler_info()["workers"])}
            if "top-k" in ops:
                runs["top-k"] = _top_k(client, fps_path, args, sample, expected)
            if "threshold" in ops:
                runs["threshold"] = _threshold(client, fps_path, args, sample, expected_pairs)
            if "multiply" in ops:
                runs["multiply"] = _multiply(client, a_path, b_path, args, total)
            for op in ops:
                print(json.dumps({"gpus" if gpus_visible else "workers": size, "op": op,
                                  "best": runs[op]["best"], "correct": runs[op]["correct"]}),
                      flush=True)
            result["runs"][size] = runs
    if len(sizes) > 1:
        one = result["runs"][sizes[0]]
        result["speedups"] = {size: {op: one[op]["best"] / result["runs"][size][op]["best"]
                                     for op in ops} for size in sizes[1:]}
        print("speed-ups: " + json.dumps(result["speedups"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))
    for path in (fps_path, a_path, b_path):
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
