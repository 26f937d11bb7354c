"""The Gram's ``C.sum()`` under several ``distributed.scheduler.worker-saturation`` values,
alternated on one warm cluster per size, so that the settings share the machine's drift.

Usage (on a machine with GPUs; on a CPU machine a local CPU cluster of ``--cpu-workers`` workers
checks the tool at small sizes):
    python tools/saturation_pairs.py --gpus 1,2,4 --values 1.1,2.0 --rounds 4 --out pairs.json

Comparing two settings from separate runs of ``tools/gram_scaling.py`` mixes the setting with
the machine's drift: the same code read 1.83 / 3.37 x, then 1.70 / 3.06 x on one machine (the
perf-notes, stop 48). Here each size gets one ``dg.local_cluster``; after an untimed compute,
each round times ``C.sum()`` once under every value in turn (set on the running scheduler:
``SchedulerState.WORKER_SATURATION``, which the scheduler reads each time it hands out root
tasks), in an order that rotates from round to round. Reported per size and value: every
time, the best and the median, the idle share of the workers' threads in the best run, and the
speed-ups against one GPU (best against best, median against median). Every compute is checked
exactly against ``sum(C) = sum over bit columns of (ones in the column)²``. The input is
``tools/gram_scaling.py``'s (its ``--workdir`` and file, written once with ``--keep``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any


sys.path.insert(0, str(Path(__file__).resolve().parent))

import dask_gpuchunk as dg  # noqa: E402
from gram_scaling import _timeline, input_bits, set_saturation  # noqa: E402


def _one(client: Any, words: Any, method: str, threads: int) -> dict[str, Any]:
    from distributed import get_task_stream

    g = dg.gram(words, packed=True, method=method)
    with get_task_stream(client) as stream:
        wall0, t0 = time.time(), time.perf_counter()
        total = client.compute(g.sum(), sync=True)
        seconds = time.perf_counter() - t0
    timeline = _timeline(stream.data, wall0, wall0 + seconds)
    busy = sum(w["busy"] for w in timeline.values())
    return {"seconds": seconds, "total": int(total),
            "idle_share": round(1 - busy / (threads * len(timeline) * seconds), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--bits", type=int, default=262144)
    parser.add_argument("--chunk-rows", type=int, default=4096)
    parser.add_argument("--method", default="auto")
    parser.add_argument("--gpus", default="1,2,4")
    parser.add_argument("--cpu-workers", type=int, default=2)
    parser.add_argument("--values", default="1.1,2.0")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/gram-scaling"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    values = [float(v) for v in args.values.split(",")]
    if any(math.isinf(v) or v <= 0 for v in values):
        parser.error("--values: finite numbers above 0 (inf changes how the scheduler "
                     "queues, which a running scheduler does not switch)")
    path, _, _, _, expected_sum = input_bits(args.workdir, args.rows, args.bits, reuse=True)
    gpus_visible = dg.gpu_count()
    sizes = (sorted({int(g) for g in args.gpus.split(",")} | {1}) if gpus_visible
             else [1, args.cpu_workers])
    if gpus_visible and sizes[-1] > gpus_visible:
        parser.error(f"--gpus {args.gpus}: only {gpus_visible} GPUs are visible")
    result: dict[str, Any] = {"rows": args.rows, "bits": args.bits, "method": args.method,
                              "chunk_rows": args.chunk_rows, "values": values, "sizes": {}}
    for size in sizes:
        options = ({"gpus": size} if gpus_visible
                   else {"n_workers": size, "threads_per_worker": 1})
        with dg.local_cluster(dashboard_address=None, **options) as client:
            threads = sum(client.nthreads().values()) // len(client.nthreads())
            words = dg.from_npy(path, chunks=(args.chunk_rows, -1))
            _one(client, words, args.method, threads)  # compiles, warms the page cache
            runs: dict[float, list[dict[str, Any]]] = {v: [] for v in values}
            for r in range(args.rounds):
                for v in values[r % len(values):] + values[:r % len(values)]:
                    set_saturation(client, v)
                    run = _one(client, words, args.method, threads)
                    run["round"] = r
                    runs[v].append(run)
                    print(json.dumps({"size": size, "saturation": v, **run}), flush=True)
        entry = {}
        for v, rs in runs.items():
            best = min(rs, key=lambda run: run["seconds"])
            entry[str(v)] = {"seconds": [round(run["seconds"], 4) for run in rs],
                             "best": best["seconds"],
                             "median": statistics.median(run["seconds"] for run in rs),
                             "idle_share_best": best["idle_share"],
                             "exact": all(run["total"] == expected_sum for run in rs)}
        result["sizes"][size] = entry
    one = result["sizes"][sizes[0]]
    result["speedups"] = {
        size: {v: {"best": round(one[v]["best"] / entry[v]["best"], 3),
                   "median": round(one[v]["median"] / entry[v]["median"], 3)}
               for v in entry}
        for size, entry in result["sizes"].items() if size != sizes[0]}
    print("speed-ups: " + json.dumps(result["speedups"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
