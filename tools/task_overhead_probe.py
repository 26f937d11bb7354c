"""What distributed's handling of short tasks costs, with nothing of the package in them: the
shape of ``C.sum()`` over a Gram's blocks (a task makes a 64 MiB int32 block, another sums it),
256 blocks, on dask's threaded scheduler and on a local distributed cluster of one worker, both
with 2 threads (the GPU workers' default), and the same work in one thread without a scheduler.

Usage: ``python tools/task_overhead_probe.py [--blocks 256] [--repeats 3]`` (set
``DASK_DISTRIBUTED__SCHEDULER__WORKER_SATURATION`` to try distributed's root-task queuing).
Prints per run: wall seconds, and for the cluster its threads' busy seconds and idle share
between the first task's start and the last one's end (dask's task stream).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def block(i: int) -> np.ndarray:
    out = np.empty((4096, 4096), np.int32)
    out[...] = i % 7
    return out


def total(*sums: int) -> int:
    return int(sum(int(s) for s in sums))


def graph(blocks: int) -> dict:
    dsk: dict = {("b", i): (block, i) for i in range(blocks)}
    dsk.update({("s", i): (np.sum, ("b", i)) for i in range(blocks)})
    dsk["total"] = (total, *[("s", i) for i in range(blocks)])
    return dsk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dsk = graph(args.blocks)
    t0 = time.perf_counter()
    for i in range(args.blocks):
        np.sum(block(i))
    print(json.dumps({"run": "one thread, no scheduler",
                      "wall": round(time.perf_counter() - t0, 3)}), flush=True)
    from dask.threaded import get

    for _ in range(args.repeats):
        t0 = time.perf_counter()
        get(dsk, "total", num_workers=2)
        print(json.dumps({"run": "threaded scheduler, 2 threads",
                          "wall": round(time.perf_counter() - t0, 3)}), flush=True)
    from distributed import Client, LocalCluster, get_task_stream

    with LocalCluster(n_workers=1, threads_per_worker=2, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        for _ in range(args.repeats):
            with get_task_stream(client) as stream:
                t0 = time.perf_counter()
                client.get(dsk, "total")
                wall = time.perf_counter() - t0
            spans = [(p["start"], p["stop"]) for t in stream.data for p in t["startstops"]
                     if p["action"] == "compute"]
            busy = sum(b - a for a, b in spans)
            span = max(b for _, b in spans) - min(a for a, _ in spans)
            print(json.dumps({"run": "distributed, 1 worker x 2 threads", "wall": round(wall, 3),
                              "busy": round(busy, 3), "idle_share": round(1 - busy / (2 * span), 3),
                              "ms_per_task": round(busy / len(spans) * 1e3, 2)}), flush=True)


if __name__ == "__main__":
    main()
