"""How fast this host sums a Gram's blocks with 1, 2 and 4 processes summing at once, no dask
and no GPU: whether NumPy's sum of a block slows down when more processes sum beside it (the
cluster of four GPUs sums C's blocks ~20 % slower than the cluster of one).

    python tools/host_sum_probe.py [--processes 1,2,4] [--threads 2] [--seconds 2] [--out F]

Each process has ``--threads`` threads (a GPU worker's default is 2), each summing its own
int32 block of ``--block`` x ``--block`` (64 MiB at 4,096) as ``C.sum()`` does (int64, the
block then its transpose, as the Gram's lower blocks are) for ``--seconds``, all processes
started together. Reported per process count: milliseconds a sum, median and range over the
threads.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np


def _summer(block: int, seconds: float, barrier: Any, out: list[float]) -> None:
    rng = np.random.default_rng(threading.get_ident() % 2**32)
    upper = rng.integers(0, 2**20, size=(block, block), dtype=np.int32)
    barrier.wait()
    t0, count = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        np.sum(upper, dtype=np.int64)
        np.sum(upper.T, dtype=np.int64)
        count += 2
    out.append(1e3 * (time.perf_counter() - t0) / count)


def _process(threads: int, block: int, seconds: float, barrier: Any, results: Any) -> None:
    out: list[float] = []
    workers = [threading.Thread(target=_summer, args=(block, seconds, barrier, out))
               for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    results.put(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block", type=int, default=4096)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    report: dict[str, Any] = {"threads": args.threads, "block": args.block, "ms_a_sum": {}}
    for count in (int(n) for n in args.processes.split(",")):
        barrier = context.Barrier(count * args.threads)
        results = context.Queue()
        processes = [context.Process(target=_process, args=(args.threads, args.block,
                                                            args.seconds, barrier, results))
                     for _ in range(count)]
        for process in processes:
            process.start()
        ms = [m for _ in processes for m in results.get(timeout=120)]
        for process in processes:
            process.join()
        report["ms_a_sum"][count] = {"median": round(statistics.median(ms), 2),
                                     "min": round(min(ms), 2), "max": round(max(ms), 2)}
        print(count, report["ms_a_sum"][count], flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
