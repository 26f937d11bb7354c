"""How far ``C.sum()`` of a Gram's blocks can scale on this host with no GPU in it: the ceiling
that the host's own part of ``tools/gram_scaling.py``'s figure puts on any GPU code.

Usage (on the GPU machine, from the repository root):
    python tools/host_sum_scaling.py --workers 1,2,4 --out $OUT/host-sum-scaling.json

The graph has the shape of ``dg.gram(...)``'s from a ``.npy`` followed by ``C.sum()``: a grid
of ``--grid`` x ``--grid`` int32 blocks of ``--block`` rows, the blocks on or above the
diagonal each made by a task that writes every element once (as the D2H copy of a GPU's block
does), the blocks below it the transposes of those, then Dask's own ``sum`` (int64 partial
sums of int32 blocks, combined in a tree). It runs on a ``distributed.LocalCluster`` of each
``--workers`` count, each worker a process with ``--threads`` threads (a GPU worker's default
is 2), TLS on loopback as ``dg.local_cluster`` talks; best of ``--repeats``. Per run: seconds,
the threads' busy seconds and idle share, and per kind of task (dask's key prefix) its
count, seconds and milliseconds each.

The speed-ups between worker counts are what the host allows: a GPU's part only adds to each
worker's time, so a GPU Gram measured this way cannot scale further than this unless its
GPU work were the larger part.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from gram_scaling import _task_seconds, _timeline


def upper_block(i: int, j: int, rows: int) -> np.ndarray:
    """A block written element by element, as a D2H copy writes it (values vary by block)."""
    block = np.empty((rows, rows), np.int32)
    block[...] = (i * 31 + j) % 97
    return block


def lower_block(upper: np.ndarray) -> np.ndarray:
    return upper.T


def blocks_array(grid: int, rows: int):
    """The Dask array of ``grid`` x ``grid`` blocks (upper made, lower transposed)."""
    import dask.array as da
    from dask.highlevelgraph import HighLevelGraph

    name, upper = "hostgram", "hostgram-upper"
    dsk: dict = {}
    for i in range(grid):
        for j in range(i, grid):
            dsk[(upper, i, j)] = (upper_block, i, j, rows)
            dsk[(name, i, j)] = (upper, i, j)
            if i != j:
                dsk[(name, j, i)] = (lower_block, (upper, i, j))
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=[])
    chunks = ((rows,) * grid,) * 2
    return da.Array(graph, name, chunks, dtype=np.int32, meta=np.empty((0, 0), np.int32))


def expected_sum(grid: int, rows: int) -> int:
    total = 0
    for i in range(grid):
        for j in range(grid):
            a, b = min(i, j), max(i, j)
            total += ((a * 31 + b) % 97) * rows * rows
    return total


def _timed(client, total_expr, expected: int, threads: int) -> dict:
    """One compute of ``total_expr``, its task stream summed over the workers with
    ``gram_scaling``'s own accounting (so that both tools' busy and idle mean the same)."""
    from distributed import get_task_stream

    with get_task_stream(client) as stream:
        t0, wall0 = time.perf_counter(), time.time()
        value = int(total_expr.compute())
        seconds = time.perf_counter() - t0
    timeline = _timeline(stream.data, wall0, wall0 + seconds)
    busy = sum(w["busy"] for w in timeline.values())
    span = (max(w["last_stop"] for w in timeline.values())
            - min(w["first_start"] for w in timeline.values()))
    by_kind: dict[str, list[float]] = {}
    for tasks in _task_seconds(stream.data).values():
        for name, (task_seconds, count) in tasks.items():
            if name.startswith("compute "):
                total = by_kind.setdefault(name[len("compute "):], [0.0, 0])
                total[0] += task_seconds
                total[1] += count
    return {"seconds": round(seconds, 4), "exact": value == expected,
            "busy": round(busy, 3),
            "idle_share": round(1 - busy / (threads * len(timeline) * span), 3),
            "tasks": {kind: {"count": count, "seconds": round(total, 3),
                             "ms_each": round(1e3 * total / count, 2)}
                      for kind, (total, count) in sorted(by_kind.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--grid", type=int, default=16)
    parser.add_argument("--block", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from distributed import Client, LocalCluster

    from dask_gpuchunk.cluster import LOOPBACK, temporary_security

    expected = expected_sum(args.grid, args.block)
    result: dict = {"grid": args.grid, "block": args.block, "threads": args.threads, "runs": {}}
    for n in [int(w) for w in args.workers.split(",")]:
        security = temporary_security()
        with LocalCluster(n_workers=n, threads_per_worker=args.threads, processes=True,
                          host=LOOPBACK, dashboard_address=None, security=security,
                          protocol="tls") as cluster, \
                Client(cluster, security=security) as client:
            expr = blocks_array(args.grid, args.block).sum()
            runs = [_timed(client, expr, expected, args.threads) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["seconds"])
        result["runs"][n] = {"all": runs, "best": best}
        print(json.dumps({"workers": n, **best}), flush=True)
    one = result["runs"].get(1)
    if one:
        result["speedups"] = {n: round(one["best"]["seconds"] / r["best"]["seconds"], 2)
                              for n, r in result["runs"].items()}
        print("speed-ups:", json.dumps(result["speedups"]), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
