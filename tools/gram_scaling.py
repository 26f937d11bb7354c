"""Gram on 1 GPU and on every GPU of this node, from a .npy of packed bits: the scaling figure,
and where each worker's time goes.

Usage (on a machine with 2 or more GPUs; on a CPU machine it runs on a local CPU cluster of
``--cpu-workers`` workers, for checking the tool itself at small sizes):
    python tools/gram_scaling.py --rows 65536 --bits 262144 --out $OUT/gram-scaling.json

The input is written once (packed random bits); then, on a fresh ``dg.local_cluster`` with
1 GPU and with all of them, for each ``--methods`` entry and each ``--variants`` entry:

* ``host``: ``dg.gram(dg.from_npy(...), packed=True)``, as a user writes it (NumPy chunks,
  each block staging its two word chunks to a GPU);
* ``kept``: as ``host``, with ``keep_on_device=True``: C's blocks stay on the GPUs and
  ``C.sum()`` runs there;
* ``device``: the same words moved to the GPUs first (``map_blocks(cupy.asarray)``,
  persisted, its time reported apart), then ``dg.gram`` on them: what the Gram costs when each
  chunk is staged once;

With ``--cli``, the job a user runs on the same file: ``dask-gpuchunk gram BITS.npy -o C.npy
--packed --gpus G`` for each size, timed end to end and until ``sync`` returns (C's bytes on the
disk), each from a clean page cache where this process may drop it (root); beside it, the
disk's own write rate: the same number of bytes written in 64 MiB pieces and fsynced. A
disk-bound job cannot scale past that.

The timed figure is ``C.sum()`` alone, as the issue times it (so the figure is the computation,
not the output's transfer or a disk), checked exactly against ``sum(C) = sum over bit columns
of (ones in the column)²``; a few sampled rows of ``C`` are checked against NumPy in a second,
untimed compute. Timed ``--repeats`` times (the first compiles), the best kept. Each timed run
reports, per worker: its tasks' seconds and counts by kind (dask's task stream: ``compute`` by
task prefix, ``transfer`` between workers), the CPUs the worker may run on, the bytes it sent
(:func:`dask_gpuchunk.jobs.sent_by_workers`) and what its host-fed chunks staged
(:func:`dask_gpuchunk.jobs.staged_by_workers`: H2D and D2H bytes, host copies, waits for
the device, time on it). ``--protocol`` picks the cluster's transport (TLS, TCP, UCX),
``--rmm`` RMM as the workers' and CuPy's allocator, ``--ucx-receive rmm`` distributed-ucxx's
own buffers for received chunks. ``--gil-probe``: how long a
thread in each worker that wakes every millisecond waited to run again (the GIL's hand-over);
``--switch-interval``: Python's switch interval in the workers. ``--keep-aliases``: the graphs
sent as dask makes them, with the ``Alias`` tasks its fusion leaves (which
``dg.local_cluster`` resolves: :mod:`dask_gpuchunk.distributed.alias_tasks`). ``--gc-probe``: each of Python's collections of 0.5 ms
or more in each worker and in this process during the best run (``gc_pauses``), and the objects
the collector tracks. ``--alloc-probe``: for every run, not only the best, each allocation of
0.5 ms or more in each worker (page-locked host buffers for the pinned pool, CuPy's device
pool; ``slow_allocations_by_run``). ``--pinned-alternate``: each repeat twice, the
workers' pinned buffers made by registering (``pinned-allocation = "register"``) and
by ``cudaHostAlloc`` in turn (ABBA order), freed before every run so that each run makes its
own (``seconds_by_pinned_allocation``).

The ``if __name__ == "__main__"`` guard matters: a local cluster's workers are spawned
processes that import this file again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

import dask_gpuchunk as dg
from dask_gpuchunk.jobs import sent_by_workers, staged_by_workers


def write_random_bits(path: Path, rows: int, bits: int, seed: int
                      ) -> tuple[np.ndarray, np.ndarray, int]:
    """Random packed bits ``(rows, bits // 8)`` uint8 saved to ``path``; four sampled row
    indices and their rows of the Gram (NumPy popcounts), and the sum of every count of the
    Gram, to check a result against: ``sum(C) = sum over bit columns of (ones in it)²``."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, size=(rows, bits // 8), dtype=np.uint8)
    np.save(path, packed)
    sample = np.sort(rng.choice(rows, 4, replace=False))
    expected_rows = np.stack([np.bitwise_count(packed & packed[r]).sum(axis=1, dtype=np.int64)
                              for r in sample]).astype(np.int32)
    ones = np.zeros(bits, np.int64)
    for start in range(0, rows, 4096):
        ones += np.unpackbits(packed[start:start + 4096], axis=1).sum(axis=0, dtype=np.int64)
    return sample, expected_rows, int((ones * ones).sum())


def _on_device(block: Any) -> Any:
    import cupy

    return cupy.asarray(block)


def _task_seconds(stream: list[dict]) -> dict[str, dict[str, float]]:
    """Per worker, seconds by ``compute <prefix>`` and by other actions (transfers)."""
    from dask.utils import key_split

    seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for task in stream:
        for part in task.get("startstops", ()):
            action = part["action"]
            name = f"compute {key_split(task['key'])}" if action == "compute" else action
            seconds[task["worker"]][name] += part["stop"] - part["start"]
            counts[task["worker"]][name] += 1
    return {worker: {name: [round(s, 4), counts[worker][name]] for name, s in sorted(by.items())}
            for worker, by in seconds.items()}


def _by_quarter(stream: list[dict], start: float, end: float) -> dict[str, list[Any]]:
    """Mean milliseconds of each task kind's computes by the quarter of the run they started
    in, over every worker, with their counts: whether the same tasks run slower early on
    (while the workers still read their words) than late."""
    from dask.utils import key_split

    spans: dict[str, list[list[float]]] = defaultdict(lambda: [[], [], [], []])
    for task in stream:
        for part in task.get("startstops", ()):
            if part["action"] == "compute":
                quarter = min(3, max(0, int(4 * (part["start"] - start) / (end - start))))
                spans[key_split(task["key"])][quarter].append(part["stop"] - part["start"])
    return {name: [[round(1e3 * sum(q) / len(q), 2) if q else None, len(q)] for q in quarters]
            for name, quarters in sorted(spans.items())}


def set_saturation(client: Any, value: float) -> None:
    """``worker-saturation`` on the running scheduler of ``client``
    (``SchedulerState.WORKER_SATURATION``, read each time it hands out root tasks). A finite
    value: ``inf`` changes how the scheduler queues, which a running scheduler does not switch."""
    def put(dask_scheduler: Any, value: float = value) -> None:
        dask_scheduler.WORKER_SATURATION = value

    client.run_on_scheduler(put)


def input_bits(workdir: Path, rows: int, bits: int, reuse: bool
               ) -> tuple[Path, Path, np.ndarray, np.ndarray, int]:
    """The input file ``workdir/bits.npy`` (:func:`write_random_bits`, seed 5) and what to check
    a result against, kept beside it; the file of an earlier run where ``reuse`` and both are
    there. Returns the file, the kept expectations' file, the sampled row indices, their rows of
    the Gram and the sum of every count."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "bits.npy"
    expected_path = workdir / f"bits-{rows}x{bits}.expected.npz"
    if reuse and expected_path.exists() and path.exists():  # the same file as last time
        kept = np.load(expected_path)
        return path, expected_path, kept["sample"], kept["rows"], int(kept["total"])
    sample, expected_rows, expected_sum = write_random_bits(path, rows, bits, seed=5)
    np.savez(expected_path, sample=sample, rows=expected_rows, total=expected_sum)
    return path, expected_path, sample, expected_rows, expected_sum


def _timeline(stream: list[dict], start: float, end: float) -> dict[str, Any]:
    """When each worker's tasks ran within the compute (``start``, ``end``: wall clock): the
    first task's start and the last one's end after ``start``, the time before ``end`` after
    the last, and the thread-seconds busy (the rest of threads × span was idle)."""
    by_worker: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for task in stream:
        for part in task.get("startstops", ()):
            if part["action"] == "compute":
                by_worker[task["worker"]].append((part["start"], part["stop"]))
    out: dict[str, Any] = {}
    for worker, spans in by_worker.items():
        first, last = min(a for a, _ in spans), max(b for _, b in spans)
        out[worker] = {"first_start": round(first - start, 4), "last_stop": round(last - start, 4),
                       "after_last": round(end - last, 4),
                       "busy": round(sum(b - a for a, b in spans), 4)}
    return out


def _profile_summary(tree: dict[str, Any], top: int = 25) -> dict[str, Any]:
    """Dask's statistical profile of worker threads (``client.profile``) as the functions that
    held the most samples: ``inclusive`` (on the stack) and ``self`` (at its top), as shares of
    all samples, each function named ``file:function`` once per stack (recursion counted once)."""
    inclusive: dict[str, int] = defaultdict(int)
    own: dict[str, int] = defaultdict(int)

    def walk(node: dict[str, Any], above: frozenset) -> None:
        d = node["description"]
        name = f"{os.path.basename(d['filename'])}:{d['name']}" if d["filename"] else "root"
        if name not in above:
            inclusive[name] += node["count"]
        below = sum(child["count"] for child in node["children"].values())
        own[name] += node["count"] - below
        for child in node["children"].values():
            walk(child, above | {name})

    walk(tree, frozenset())
    total = max(tree["count"], 1)
    pick = lambda d: {k: round(v / total, 3) for k, v in  # noqa: E731
                      sorted(d.items(), key=lambda kv: -kv[1])[:top]}
    return {"samples": tree["count"], "inclusive": pick(inclusive), "self": pick(own)}


def _gil_probe(dask_worker: Any, interval: float = 1e-3) -> None:
    """In a worker: a thread that sleeps ``interval`` over and over and logs, on the worker
    object (what this file defines is sent to the workers by value, so a list of its own would
    be a new copy at each call), how much later than asked it runs again: the time it waited
    for the GIL (and the OS), as a NumPy call returning to Python waits for it while another
    thread runs Python code."""
    import threading

    if hasattr(dask_worker, "gil_waits"):
        return
    waits = dask_worker.gil_waits = []

    def probe() -> None:
        while True:
            t0 = time.perf_counter()
            time.sleep(interval)
            waits.append(time.perf_counter() - t0 - interval)

    threading.Thread(target=probe, name="gil-probe", daemon=True).start()


def _gil_waits(dask_worker: Any, since: dict[str, int]) -> dict[str, float]:
    waits = sorted(dask_worker.gil_waits[since.get(dask_worker.address, 0):])
    if not waits:
        return {"samples": 0}
    return {"samples": len(waits), "mean_ms": round(1e3 * sum(waits) / len(waits), 3),
            "p90_ms": round(1e3 * waits[int(0.9 * (len(waits) - 1))], 3),
            "max_ms": round(1e3 * waits[-1], 3), "over_1ms": sum(w > 1e-3 for w in waits)}


def _gc_probe(dask_worker: Any = None) -> dict[str, int]:
    """In a worker (or, with no worker, this process): log each of Python's cycle
    collections of 0.5 ms or more (when it started, its generation, how long it took) on the
    worker object (or on this function), for :func:`_gc_pauses`. Returns the objects the
    collector tracks and those frozen out of its reach (``gc.freeze``)."""
    import gc

    holder = dask_worker if dask_worker is not None else _gc_probe
    if not hasattr(holder, "gc_pauses"):
        pauses = holder.gc_pauses = []
        started: dict[str, float] = {}

        def log(phase: str, info: dict) -> None:
            if phase == "start":
                started["wall"], started["t"] = time.time(), time.perf_counter()
            elif "t" in started:
                seconds = time.perf_counter() - started.pop("t")
                if seconds >= 5e-4:
                    pauses.append((started["wall"], info["generation"], seconds))

        gc.callbacks.append(log)
    return {"tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count()}


def _gc_pauses(dask_worker: Any = None, since: float = 0.0) -> list[list[float]]:
    """The collections :func:`_gc_probe` logged from ``since`` (``time.time()``) on:
    [milliseconds after ``since``, generation, milliseconds]."""
    holder = dask_worker if dask_worker is not None else _gc_probe
    return [[round(1e3 * (wall - since), 1), generation, round(1e3 * seconds, 2)]
            for wall, generation, seconds in getattr(holder, "gc_pauses", ()) if wall >= since]


#: ``pinned-allocation``'s ways (dask_gpuchunk.config.INTERNAL), alternated by ``--pinned-alternate``.
PINNED_WAYS = ("register", "host-alloc")


def _pinned_allocation(way: str) -> None:
    """In a worker: make its pinned pool's buffers ``way`` from now on, and free the idle
    ones, so that the next run makes its buffers anew."""
    from dask_gpuchunk import config
    from dask_gpuchunk.runtime import staging

    config.internal_values({"pinned-allocation": way}).__enter__()  # for the worker's life
    staging.pinned_pool.clear()


def _alloc_probe(dask_worker: Any) -> None:
    """In a worker: log each allocation of 0.5 ms or more on the worker object (when it began,
    its kind, bytes, milliseconds), for :func:`_slow_allocations`: page-locked host memory made
    for the package's pinned pool (``cudaHostAlloc``), and device memory from CuPy's pool (its
    ``malloc``: a new ``cudaMalloc``, or one after freeing cached blocks at the cap)."""
    if hasattr(dask_worker, "slow_allocations"):
        return
    import cupy

    from dask_gpuchunk.runtime import staging

    log = dask_worker.slow_allocations = []

    def timed(kind: str, allocate: Any) -> Any:
        def allocated(size: int) -> Any:
            wall, t0 = time.time(), time.perf_counter()
            try:
                return allocate(size)
            finally:
                seconds = time.perf_counter() - t0
                if seconds >= 5e-4:
                    log.append((wall, kind, int(size), seconds))
        return allocated

    pool = staging.pinned_pool
    pool._allocate = timed("pinned", pool._allocate)
    cupy.cuda.set_allocator(timed("device", cupy.get_default_memory_pool().malloc))


def _slow_allocations(dask_worker: Any, since: float) -> list[list[Any]]:
    """What :func:`_alloc_probe` logged from ``since`` on: [ms after ``since``, kind, MiB,
    ms]."""
    return [[round(1e3 * (wall - since), 1), kind, round(size / 2**20, 1), round(1e3 * s, 2)]
            for wall, kind, size, s in getattr(dask_worker, "slow_allocations", ())
            if wall >= since]


def _timed(client: Any, compute: Any, gil_probe: bool = False,
           gc_probe: bool = False, alloc_probe: bool = False) -> dict[str, Any]:
    from distributed import get_task_stream

    sent, staged = sent_by_workers(client), staged_by_workers(client)
    gil_marks = client.run(lambda dask_worker: len(dask_worker.gil_waits)) if gil_probe else {}
    with get_task_stream(client) as stream:
        t0, wall0 = time.perf_counter(), time.time()
        value = compute()
        seconds = time.perf_counter() - t0
    extra: dict[str, Any] = {}
    if gil_probe:
        extra["gil_waits_by_workers"] = client.run(_gil_waits, since=gil_marks)
    if alloc_probe:
        extra["slow_allocations"] = client.run(_slow_allocations, since=wall0)
    if gc_probe:
        extra["gc_pauses"] = {"client": _gc_pauses(since=wall0),
                              **client.run(_gc_pauses, since=wall0)}
    return {"seconds": seconds, "value": value, "wall": (wall0, wall0 + seconds), **extra,
            "timeline": _timeline(stream.data, wall0, wall0 + seconds),
            "by_quarter": _by_quarter(stream.data, wall0, wall0 + seconds),
            "tasks_by_worker": _task_seconds(stream.data),
            "sent_by_workers": sent_by_workers(client, sent),
            "staged_by_workers": staged_by_workers(client, staged)}


def _run(client: Any, path: Path, args: argparse.Namespace, method: str, variant: str,
         sample: np.ndarray, expected_rows: np.ndarray, expected_sum: int) -> dict[str, Any]:
    words = dg.from_npy(path, chunks=(args.chunk_rows, -1))
    entry: dict[str, Any] = {}
    if variant == "device":
        import cupy

        from distributed import wait

        def persisted() -> Any:
            on_device = client.persist(words.map_blocks(
                _on_device, dtype=words.dtype, meta=cupy.empty((0, 0), words.dtype)))
            wait(on_device)
            return on_device

        moved = _timed(client, persisted)
        words = moved.pop("value")
        moved.pop("wall")
        entry["to_device"] = moved
    runs = []
    for repeat in range(args.repeats * (2 if args.pinned_alternate else 1)):
        if args.pinned_alternate:  # each way in turn, every run's buffers made anew
            way = PINNED_WAYS[(repeat + repeat // 2) % 2]
            client.run(_pinned_allocation, way)
        g = dg.gram(words, packed=True, method=method, block_rows=args.block_rows,
                    keep_on_device=variant == "kept")
        # Timed: C.sum() alone, as a user's reduction of C; checked exactly by the column-count
        # identity. The sampled rows are a second, untimed compute.
        run = _timed(client, lambda g=g: client.compute(g.sum(), sync=True),
                     gil_probe=args.gil_probe, gc_probe=args.gc_probe,
                     alloc_probe=args.alloc_probe)
        total = run.pop("value")
        sample_rows = g[sample]
        if variant in ("device", "kept"):
            sample_rows = sample_rows.map_blocks(lambda b: b.get(), dtype=np.int32,
                                                 meta=np.empty((0, 0), np.int32))
        rows = client.compute(sample_rows, sync=True)
        if args.pinned_alternate:
            run["pinned_allocation"] = way
        run["sum_exact"] = int(total) == expected_sum
        run["c_row_blocks"] = list(g.chunks[0])
        run["sampled_rows_exact"] = bool(run["sum_exact"] and np.array_equal(
            np.asarray(rows), expected_rows))
        runs.append(run)
    best = min(runs, key=lambda r: r["seconds"])
    start, stop = best.pop("wall")
    for r in runs:
        r.pop("wall", None)
    if args.profile:
        # A worker files its samples once per profile cycle (1 s by default): wait for the
        # cycle holding the run's end to close.
        from dask.utils import parse_timedelta
        import dask

        time.sleep(parse_timedelta(dask.config.get("distributed.worker.profile.cycle")) + 0.2)
        workers = list(client.scheduler_info()["workers"])
        best["profile"] = {w: _profile_summary(client.profile(start=start, stop=stop,
                                                               workers=[w]))
                           for w in workers}
    if args.alloc_probe:  # every run's, the slow ones among them
        entry["slow_allocations_by_run"] = [r.get("slow_allocations") for r in runs]
    if args.pinned_alternate:
        entry["seconds_by_pinned_allocation"] = {
            way: [r["seconds"] for r in runs if r["pinned_allocation"] == way]
            for way in PINNED_WAYS}
    entry.update(seconds=[r["seconds"] for r in runs], best=best["seconds"],
                 sampled_rows_exact=all(r["sampled_rows_exact"] for r in runs),
                 bit_macs_per_s=float(args.rows) ** 2 * args.bits / best["seconds"],
                 breakdown=best)
    if variant == "device":
        del words
    return entry


def _drop_page_cache() -> bool:
    """Write back dirty pages and drop clean ones (root only): each timed file run starts from
    the same state."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _disk_write_rate(path: Path, nbytes: int) -> dict[str, Any]:
    """``nbytes`` written to ``path`` in 64 MiB pieces, then fsynced: the disk's rate for a
    file of C's size, which a job writing C cannot beat."""
    piece = memoryview(np.random.default_rng(0).integers(0, 2**31, 2**24, dtype=np.int32)
                       ).cast("B")  # 64 MiB
    dropped = _drop_page_cache()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(piece[: min(left, len(piece))])
        buffered = time.perf_counter() - t0
        os.fsync(f.fileno())
    durable = time.perf_counter() - t0
    path.unlink()
    return {"bytes": nbytes, "buffered_seconds": buffered, "durable_seconds": durable,
            "durable_gb_per_s": nbytes / durable / 1e9, "page_cache_dropped": dropped}


def _cli_runs(path: Path, sizes: list[int | None], args: argparse.Namespace, sample: np.ndarray,
              expected_rows: np.ndarray) -> dict[str, Any]:
    """The gram job as a user runs it on ``sizes`` GPUs (a fresh local cluster each), and the
    disk's write rate for C's bytes beside it."""
    out = args.workdir / "C.npy"
    result: dict[str, Any] = {"disk": _disk_write_rate(out, args.rows * args.rows * 4)}
    print("disk: " + json.dumps(result["disk"]), flush=True)
    for size in sizes:
        dropped = _drop_page_cache()
        cmd = [sys.executable, "-m", "dask_gpuchunk", "gram", str(path), "-o", str(out),
               "--packed", "--overwrite", "--json"] + (["--gpus", str(size)] if size else [])
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cli_timeout,
                           check=False)
        end_to_end = time.perf_counter() - t0
        os.sync()
        durable = time.perf_counter() - t0
        run: dict[str, Any] = {"returncode": p.returncode, "end_to_end_seconds": end_to_end,
                               "durable_seconds": durable, "page_cache_dropped": dropped}
        if p.returncode == 0:
            summary = json.loads(p.stdout.strip().splitlines()[-1])
            c = np.load(out, mmap_mode="r")
            run.update(job_seconds=summary.get("seconds"), where=summary.get("where"),
                       sampled_rows_exact=bool(np.array_equal(c[sample], expected_rows)))
        else:
            run["stderr"] = p.stderr[-2000:]
        out.unlink(missing_ok=True)
        print(json.dumps({"cli gpus": size, **{k: v for k, v in run.items() if k != "where"}}),
              flush=True)
        result[size] = run
    return result


def _protocol_options(args: Any) -> dict[str, Any]:
    """dg.local_cluster's transport options for ``--protocol`` (and the similarity tool's
    ``--tls no``)."""
    protocol = getattr(args, "protocol", None)
    rmm = getattr(args, "rmm", "none")
    options: dict[str, Any] = {}
    if rmm != "none":  # RMM as the workers' and CuPy's allocator, dask-cuda's options
        options["rmm_allocator_external_lib_list"] = ["cupy"]
        if rmm == "async":
            options.update(rmm_async=True, rmm_release_threshold=args.rmm_limit)
        else:
            options.update(rmm_pool_size=args.rmm_initial, rmm_maximum_pool_size=args.rmm_limit)
    if protocol == "ucx":
        return {"protocol": "ucx", **options}
    if protocol == "tcp" or getattr(args, "tls", "yes") == "no":
        return {"secure": False, **options}
    return options


def _ucx_receive(client: Any, args: Any) -> None:
    """``--ucx-receive rmm``: distributed-ucxx's own allocator of received chunks back in
    the workers (dask_gpuchunk's worker setup puts CuPy's in its place)."""
    if getattr(args, "ucx_receive", "pool") != "rmm":
        return

    def restore() -> bool:
        from dask_gpuchunk import _compat
        from dask_gpuchunk.distributed import spilling

        if spilling.ucx_own_allocator is None:
            return False
        _compat.set_ucx_device_allocator(spilling.ucx_own_allocator)
        return True

    print("ucx receive restored:", client.run(restore), flush=True)


def add_transport_arguments(parser: argparse.ArgumentParser) -> None:
    """The transport and allocator options both scaling tools take."""
    parser.add_argument("--protocol", default=None, choices=["tls", "tcp", "ucx"],
                        help="the local cluster's transport (default: dg.local_cluster's, TLS)")
    parser.add_argument("--rmm", default="none", choices=["none", "pool", "async"],
                        help="RMM as the workers' and CuPy's allocator (dask-cuda's "
                             "rmm_pool_size / rmm_async)")
    parser.add_argument("--rmm-initial", default="2GB")
    parser.add_argument("--rmm-limit", default="8GB")
    parser.add_argument("--ucx-receive", default="pool", choices=["pool", "rmm"],
                        help="rmm: distributed-ucxx's own rmm.DeviceBuffer per received chunk")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--bits", type=int, default=262144)
    parser.add_argument("--chunk-rows", type=int, default=4096)
    parser.add_argument("--methods", default="auto,popcount")
    parser.add_argument("--variants", default="host,device")
    parser.add_argument("--cpu-workers", type=int, default=2)
    parser.add_argument("--block-rows", type=int, default=None,
                        help="dg.gram's block_rows (default: its own choice; 1: the chunks as "
                             "they are)")
    parser.add_argument("--gpus", default=None,
                        help="cluster sizes to time, comma-separated, e.g. 1,2,4 (default: 1 "
                             "and every GPU visible)")
    parser.add_argument("--threads-per-gpu", default=None,
                        help="dg.local_cluster's threads_per_gpu (default: its own)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each method (the first compiles); the best is kept")
    parser.add_argument("--saturation", default=None,
                        help="distributed.scheduler.worker-saturation "
                             "(default: dg.local_cluster's)")
    parser.add_argument("--profile", action="store_true",
                        help="add each worker's statistical profile of the best run (dask's "
                             "sampler; set DASK_DISTRIBUTED__WORKER__PROFILE__INTERVAL finer)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the input file, and reuse one this tool kept before")
    add_transport_arguments(parser)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/gram-scaling"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cli", action="store_true",
                        help="also the gram job through the CLI to a .npy, beside the disk's "
                             "write rate")
    parser.add_argument("--api", default="yes", choices=["yes", "no"],
                        help="no: only the --cli runs")
    parser.add_argument("--cli-timeout", type=float, default=300)
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval in each worker (Python's default: 0.005 s)")
    parser.add_argument("--keep-aliases", action="store_true",
                        help="send dask's Alias tasks to the cluster as dask makes them "
                             "(gpuchunk.resolve-aliases off; dask_gpuchunk.distributed.alias_tasks)")
    parser.add_argument("--gil-probe", action="store_true",
                        help="report how long a sleeping thread in each worker waits to run "
                             "again (the GIL's hand-over) during each timed run")
    parser.add_argument("--gc-probe", action="store_true",
                        help="report each worker's (and this process's) cycle collections of "
                             "0.5 ms or more during the best timed run, and the objects tracked")
    parser.add_argument("--alloc-probe", action="store_true",
                        help="report each worker's allocations of 0.5 ms or more (pinned host "
                             "memory, CuPy's device pool) in every timed run")
    parser.add_argument("--pinned-alternate", action="store_true",
                        help="run each repeat twice, with the workers' pinned buffers made "
                             "each way of pinned-allocation in turn and freed before "
                             "every run (seconds_by_pinned_allocation)")
    args = parser.parse_args()
    if args.threads_per_gpu is not None and args.threads_per_gpu.isdigit():
        args.threads_per_gpu = int(args.threads_per_gpu)
    path, expected_path, sample, expected_rows, expected_sum = input_bits(
        args.workdir, args.rows, args.bits, reuse=args.keep)
    if args.saturation is not None:
        import dask

        dask.config.set({"distributed.scheduler.worker-saturation": float(args.saturation)})
    if args.keep_aliases:
        import dask

        dask.config.set({"gpuchunk.resolve-aliases": False})
    gpus_visible = dg.gpu_count()
    variants = args.variants.split(",") if gpus_visible else ["host"]
    result: dict = {"rows": args.rows, "bits": args.bits, "chunk_rows": args.chunk_rows,
                    "block_rows": args.block_rows,
                    "gpus_visible": gpus_visible, "saturation": args.saturation,
                    "threads_per_gpu": args.threads_per_gpu,
                    "aliases_resolved": not args.keep_aliases, "protocol": args.protocol,
                    "rmm": args.rmm, "ucx_receive": args.ucx_receive,
                    "runs": {}}
    if args.gpus and gpus_visible:
        sizes = sorted({int(g) for g in args.gpus.split(",")})
        if sizes[-1] > gpus_visible:
            parser.error(f"--gpus {args.gpus}: only {gpus_visible} GPUs are visible")
    else:
        sizes = sorted({1, gpus_visible}) if gpus_visible else [1, args.cpu_workers]
    for size in sizes if args.api == "yes" else []:
        options = ({"gpus": size, "threads_per_gpu": args.threads_per_gpu} if gpus_visible
                   else {"n_workers": size, "threads_per_worker": 1})
        t0 = time.perf_counter()
        with dg.local_cluster(dashboard_address=None,
                                                **_protocol_options(args), **options) as client:
            started = time.perf_counter() - t0
            _ucx_receive(client, args)
            if args.saturation is not None and math.isfinite(float(args.saturation)):
                # dg.local_cluster keeps a configured value only where it differs from
                # distributed's default (1.1): set on the running scheduler, any value holds.
                set_saturation(client, float(args.saturation))
            if args.switch_interval is not None:
                client.run(sys.setswitchinterval, args.switch_interval)
            if args.gil_probe:
                client.run(_gil_probe)
            if args.alloc_probe and gpus_visible:
                client.run(_alloc_probe)
            runs: dict[str, Any] = {"cluster_start": started,
                                    "workers": len(client.scheduler_info()["workers"]),
                                    "cpu_affinity": client.run(  # each worker's CPUs
                                        lambda: sorted(os.sched_getaffinity(0)))}
            if args.gc_probe:
                runs["gc_objects_at_start"] = {"client": _gc_probe(), **client.run(_gc_probe)}
            for method in args.methods.split(","):
                for variant in variants:
                    entry = _run(client, path, args, method, variant, sample, expected_rows,
                                 expected_sum)
                    runs[f"{method} {variant}"] = entry
                    if args.gc_probe:
                        entry["gc_objects_after"] = client.run(_gc_probe)
                    print(json.dumps({"gpus" if gpus_visible else "workers": size,
                                      "run": f"{method} {variant}", "best": entry["best"],
                                      "exact": entry["sampled_rows_exact"]}), flush=True)
            result["runs"][size] = runs
    if args.cli:  # on a CPU machine once, on its default local cluster (checks the tool)
        result["cli"] = _cli_runs(path, sizes if gpus_visible else [None], args, sample,
                                  expected_rows)
    if len(sizes) > 1 and args.api == "yes":
        one = result["runs"][sizes[0]]
        result["speedups"] = {}
        for size in sizes[1:]:
            many = result["runs"][size]
            result["speedups"][size] = {
                name: one[name]["best"] / many[name]["best"]
                for name in one if isinstance(one[name], dict) and "best" in one[name]}
            print(f"speed-up on {size}: " + json.dumps(
                {k: round(v, 2) for k, v in result["speedups"][size].items()}), flush=True)
        result["speedup"] = result["speedups"][sizes[-1]]
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))
    if not args.keep:
        path.unlink()
        expected_path.unlink()


if __name__ == "__main__":
    main()
