"""How fast this host sums a Gram's blocks with 1, 2 and 4 processes summing at once, no dask
and no GPU: whether NumPy's sum of a block slows down when more processes sum beside it (the
cluster of four GPUs sums C's blocks ~20 % slower than the cluster of one).

    python tools/host_sum_probe.py [--processes 1,2,4] [--threads 2] [--seconds 2]
                                   [--from-gpu [--buffers 3]] [--out F]

Each process has ``--threads`` threads (a GPU worker's default is 2), each summing its own
int32 block of ``--block`` x ``--block`` (64 MiB at 4,096) as ``C.sum()`` does (int64, the
block then its transpose, as the Gram's lower blocks are) for ``--seconds``, all processes
started together. Reported per process count: milliseconds a sum, median and range over the
threads.

``--from-gpu`` makes each sum's block as a GPU worker does: process ``p`` uses GPU ``p`` (modulo
those visible), and each thread copies a block from it into the next of ``--buffers`` page-locked
host blocks (on a non-blocking stream of its own) before summing it and its transpose, so every
sum reads memory the GPU has just written, as C's blocks are. Reported beside the sums: the
milliseconds of each copy. One process against two then tells whether a second GPU's copies slow
the first's sums with no dask in the way (a worker's sums were 12.4 ms on one GPU, 14.3 ms on two).
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


def _summer_from_gpu(gpu: int, block: int, buffers: int, seconds: float, barrier: Any,
                     out: list[float], copies: list[float]) -> None:
    """:func:`_summer`, each block first copied from GPU ``gpu`` into page-locked memory."""
    import cupy

    cupy.cuda.Device(gpu).use()
    device_block = cupy.random.default_rng(threading.get_ident() % 2**32).integers(
        0, 2**20, size=(block, block), dtype=np.int32)
    hosts = []
    for _ in range(buffers):
        memory = cupy.cuda.alloc_pinned_memory(device_block.nbytes)
        hosts.append(np.frombuffer(memory, np.int32, block * block).reshape(block, block))
    stream = cupy.cuda.Stream(non_blocking=True)
    barrier.wait()
    t0, count, sum_seconds = time.perf_counter(), 0, 0.0
    while time.perf_counter() - t0 < seconds:
        host = hosts[count // 2 % buffers]
        c0 = time.perf_counter()
        device_block.get(out=host, stream=stream)
        stream.synchronize()
        c1 = time.perf_counter()
        copies.append(1e3 * (c1 - c0))
        np.sum(host, dtype=np.int64)
        np.sum(host.T, dtype=np.int64)
        sum_seconds += time.perf_counter() - c1
        count += 2
    out.append(1e3 * sum_seconds / count)


def _process(threads: int, block: int, seconds: float, barrier: Any, results: Any,
             gpu: int | None = None, buffers: int = 3) -> None:
    out: list[float] = []
    copies: list[float] = []
    if gpu is None:
        workers = [threading.Thread(target=_summer, args=(block, seconds, barrier, out))
                   for _ in range(threads)]
    else:
        workers = [threading.Thread(target=_summer_from_gpu,
                                    args=(gpu, block, buffers, seconds, barrier, out, copies))
                   for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    results.put((out, copies))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block", type=int, default=4096)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--from-gpu", action="store_true",
                        help="copy each block from GPU p (process p) into page-locked memory "
                             "before its sums")
    parser.add_argument("--buffers", type=int, default=3,
                        help="page-locked host blocks each thread copies into in turn")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    gpus = 0
    if args.from_gpu:
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
    report: dict[str, Any] = {"threads": args.threads, "block": args.block,
                              "from_gpu": args.from_gpu, "gpus": gpus, "ms_a_sum": {},
                              "ms_a_copy": {}}
    for count in (int(n) for n in args.processes.split(",")):
        barrier = context.Barrier(count * args.threads)
        results = context.Queue()
        processes = [context.Process(target=_process, args=(
            args.threads, args.block, args.seconds, barrier, results,
            p % gpus if args.from_gpu else None, args.buffers)) for p in range(count)]
        for process in processes:
            process.start()
        ms: list[float] = []
        copies: list[float] = []
        for _ in processes:
            sums, copy_ms = results.get(timeout=120)
            ms += sums
            copies += copy_ms
        for process in processes:
            process.join()
        report["ms_a_sum"][count] = {"median": round(statistics.median(ms), 2),
                                     "min": round(min(ms), 2), "max": round(max(ms), 2)}
        if copies:
            report["ms_a_copy"][count] = {"median": round(statistics.median(copies), 2),
                                          "max": round(max(copies), 2), "count": len(copies)}
        print(count, report["ms_a_sum"][count], report["ms_a_copy"].get(count, ""), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
