"""Figures for the file jobs on a GPU machine: multiply and gram from .npy to .npy, against
plain NumPy reading and writing the same files on the same disk.

Usage (on the GPU machine, from the repository root):
    python tools/file_jobs_figures.py --workdir /tmp/fj --out $OUT/file-jobs.json

1. multiply: two 1,000,000 x 500 float64 inputs (4 GB each) -> 4 GB, ``dask-gpuchunk multiply``
   on a local cluster (one worker per GPU); NumPy: ``np.load`` both inputs, ``np.save`` the
   output. The PCIe floor (8 GB in, 4 GB out at the measured pinned rates) is printed beside.
2. gram: seed 001's largest case, 100,000 x 200,000 bits (packed input, 2.5 GB), C = 40 GB of
   int32, ``--device-memory-limit 8GB``; NumPy: ``np.save`` of a 40 GB int32 array (the same
   bytes) to the same disk. Sampled rows of C are checked against NumPy popcounts. The peak
   device memory is sampled with nvidia-smi during the job.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np


def drop_caches() -> bool:
    """Ask the kernel to drop clean page-cache pages (root only; may be refused in containers)."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


class GpuMemorySampler:
    """Peak used memory per GPU (MiB) sampled by nvidia-smi every 0.2 s."""

    def __init__(self) -> None:
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                 check=False).stdout
            for line in out.strip().splitlines():
                i, used = (int(v) for v in line.split(","))
                self.peak[i] = max(self.peak.get(i, 0), used)
            self._stop.wait(0.2)

    def __enter__(self) -> GpuMemorySampler:  # noqa: PYI034
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


#: Extra options for every job (e.g. ["--gpus", "1"] on a machine with several GPUs).
CLI_EXTRA: list[str] = []


def cli(*args: str, env: dict | None = None) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dask_gpuchunk", *args, *CLI_EXTRA, "--json"],
                       capture_output=True, text=True, check=False,
                       env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{args[0]} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    summary["wall_seconds_with_cluster_start"] = wall
    return summary


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


#: Values of DASK_GPUCHUNK_FILE_READS tried for the multiply job; the first is reported.
READS_VARIANTS = [0, 4, 1]


def multiply_figures(work: Path, result: dict) -> None:
    rng = np.random.default_rng(0)
    a_path, b_path, c_path = work / "a.npy", work / "b.npy", work / "c.npy"
    for p in (a_path, b_path):
        np.save(p, rng.random((1_000_000, 500)))
    from dask_gpuchunk.bench.limits import pcie_bandwidth

    pcie = pcie_bandwidth()
    floor = max(8e9 / pcie["h2d"], 4e9 / pcie["d2h"], 12e9 / pcie["bidirectional"])
    variants = {}
    for reads in READS_VARIANTS:  # region reads in flight per worker (0: no limit)
        cold = drop_caches()
        variants[reads] = cli("multiply", str(a_path), str(b_path), "-o", str(c_path),
                              "--overwrite", env={"DASK_GPUCHUNK_FILE_READS": str(reads)})
        print(f"multiply, {reads} reads in flight: {variants[reads]['seconds']:.2f} s", flush=True)
    ours = variants[READS_VARIANTS[0]]
    sample = np.random.default_rng(1).choice(1_000_000, 200, replace=False)
    a, b, c = (np.load(p, mmap_mode="r") for p in (a_path, b_path, c_path))
    exact = bool(np.array_equal(c[sample], a[sample] * b[sample]))
    del a, b, c
    drop_caches()
    arrays = {}
    t_read = timed(lambda: arrays.update(a=np.load(a_path), b=np.load(b_path)))
    product = arrays["a"] * arrays["b"]
    arrays.clear()
    t_write = timed(lambda: np.save(work / "c_numpy.npy", product))
    product = None  # free it before the next step
    numpy_seconds = t_read + t_write
    result["multiply"] = {
        "ours": ours, "sample_exact": exact, "pcie": pcie, "pcie_floor_s": floor,
        "seconds_by_reads_in_flight": {k: v["seconds"] for k, v in variants.items()},
        "numpy_read_s": t_read, "numpy_write_s": t_write, "numpy_read_write_s": numpy_seconds,
        "caches_dropped_before_each": cold,
        "ratio_to_bound": ours["seconds"] / max(floor, numpy_seconds),
    }
    print(json.dumps(result["multiply"], default=str), flush=True)
    for p in (a_path, b_path, c_path, work / "c_numpy.npy"):
        p.unlink()


PROFILE = False
#: DASK_GPUCHUNK_PINNED_RESULTS values and --layout values tried for the gram job; the first
#: of each is reported.
GRAM_PINNED_RESULTS = ["1"]
GRAM_LAYOUTS = ["auto"]


def profiled_gram(bits_path: Path, g_path: Path, result: dict, layout: str) -> dict:
    """The gram job in this process, on the same local cluster, with Dask's task stream:
    thread-seconds per kind of task, and when the first and last of each ran."""
    from dask.utils import key_split
    from distributed import get_task_stream

    import dask_gpuchunk as dg
    from dask_gpuchunk.jobs import gram_job

    gpus = int(CLI_EXTRA[1]) if CLI_EXTRA else None
    with dg.local_cluster(gpus=gpus, device_memory_limit="8GB", dashboard_address=None) as client:
        job = gram_job(bits_path, g_path, packed=True, layout=layout, overwrite=True)
        t0 = time.time()
        with get_task_stream(client) as ts:
            summary = job(None)
        kinds: dict = {}
        for task in ts.data:
            for ss in task.get("startstops", []):
                k = kinds.setdefault(f"{key_split(task['key'])}:{ss['action']}",
                                     {"thread_s": 0.0, "n": 0, "first": 1e18, "last": 0.0})
                k["thread_s"] += ss["stop"] - ss["start"]
                k["n"] += 1
                k["first"] = min(k["first"], ss["start"] - t0)
                k["last"] = max(k["last"], ss["stop"] - t0)
        summary["where"] = {"workers": len(client.scheduler_info()["workers"])}
    result.setdefault("gram_task_profiles", {})[layout] = kinds
    for name, k in sorted(kinds.items(), key=lambda kv: -kv[1]["thread_s"]):
        print(f"  {name:40s} {k['n']:5d} tasks {k['thread_s']:8.2f} thread-s  "
              f"{k['first']:6.2f}..{k['last']:6.2f} s", flush=True)
    return summary


def gram_figures(work: Path, result: dict, rows: int, bits: int) -> None:
    rng = np.random.default_rng(2)
    packed = rng.integers(0, 256, size=(rows, bits // 8), dtype=np.uint8)
    bits_path, g_path = work / "bits_packed.npy", work / "gram.npy"
    np.save(bits_path, packed)
    # NumPy writing the same bytes (C is rows x rows int32) to the same disk, first, so that
    # both files never sit on the disk together.
    c_numpy = np.empty((rows, rows), dtype=np.int32)
    c_numpy[...] = 7  # touched: NumPy writes resident memory
    t_numpy = timed(lambda: np.save(work / "gram_numpy.npy", c_numpy))
    c_numpy = None  # free it before the next step
    (work / "gram_numpy.npy").unlink()
    drop_caches()
    variants = {}
    runs = [(layout, pinned) for layout in GRAM_LAYOUTS for pinned in GRAM_PINNED_RESULTS]
    with GpuMemorySampler() as sampler:
        for layout, pinned in runs:
            os.environ["DASK_GPUCHUNK_PINNED_RESULTS"] = pinned
            drop_caches()
            name = f"layout {layout}, pinned results {pinned}"
            if PROFILE:
                variants[name] = profiled_gram(bits_path, g_path, result, layout)
            else:
                variants[name] = cli("gram", str(bits_path), "-o", str(g_path), "--packed",
                                     "--device-memory-limit", "8GB", "--layout", layout,
                                     "--overwrite")
            print(f"gram, {name}: {variants[name]['seconds']:.1f} s "
                  f"(layout used: {variants[name].get('layout')})", flush=True)
            if (layout, pinned) != runs[-1]:
                g_path.unlink()  # the disk holds one 40 GB output, not two
    ours = variants[f"layout {runs[0][0]}, pinned results {runs[0][1]}"]
    result["gram_seconds_by_variant"] = {k: v["seconds"] for k, v in variants.items()}
    g = np.load(g_path, mmap_mode="r")
    words = packed.view(np.uint8)
    exact = True
    for r in np.random.default_rng(3).choice(rows, 8, replace=False):
        expected = np.bitwise_count(words & words[r]).sum(axis=1, dtype=np.int64)
        exact &= bool(np.array_equal(g[r], expected.astype(np.int32)))
    del g
    result["gram"] = {
        "ours": ours, "sampled_rows_exact": exact, "numpy_write_same_bytes_s": t_numpy,
        "ratio_to_numpy_write": ours["seconds"] / t_numpy,
        "peak_device_memory_mib": sampler.peak,
        "input_plus_output_bytes": packed.nbytes + rows * rows * 4,
    }
    g_path.unlink()
    # The same NumPy write again after ours: this virtual disk's write rate varies between
    # runs (13.8 s and 21.0 s for the first write on two machines of the same kind).
    c_numpy = np.empty((rows, rows), dtype=np.int32)
    c_numpy[...] = 7
    t_after = timed(lambda: np.save(work / "gram_numpy.npy", c_numpy))
    c_numpy = None
    (work / "gram_numpy.npy").unlink()
    result["gram"]["numpy_write_again_after_ours_s"] = t_after
    result["gram"]["ratio_to_numpy_write_after"] = ours["seconds"] / t_after
    print(json.dumps(result["gram"], default=str), flush=True)
    bits_path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/file-jobs"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--bits", type=int, default=200_000)
    parser.add_argument("--skip", nargs="*", default=[])
    parser.add_argument("--gpus", default=None, help="--gpus for the jobs (default: all)")
    parser.add_argument("--pinned-results", nargs="*", default=None,
                        help="DASK_GPUCHUNK_PINNED_RESULTS values to try for gram")
    parser.add_argument("--layouts", nargs="*", default=None,
                        help="--layout values to try for gram (auto, blocks, rows)")
    parser.add_argument("--profile", action="store_true",
                        help="run the gram job in this process and profile its tasks")
    parser.add_argument("--reads", nargs="*", type=int, default=None,
                        help="DASK_GPUCHUNK_FILE_READS values to try for multiply")
    args = parser.parse_args()
    if args.gpus:
        CLI_EXTRA.extend(["--gpus", args.gpus])
    global PROFILE
    PROFILE = args.profile
    if args.pinned_results:
        GRAM_PINNED_RESULTS[:] = args.pinned_results
    if args.layouts:
        GRAM_LAYOUTS[:] = args.layouts
    if args.reads is not None:
        READS_VARIANTS[:] = args.reads
    args.workdir.mkdir(parents=True, exist_ok=True)
    result: dict = {"disk_free_bytes": shutil.disk_usage(args.workdir).free}
    try:
        if "multiply" not in args.skip:
            multiply_figures(args.workdir, result)
        if "gram" not in args.skip:
            gram_figures(args.workdir, result, args.rows, args.bits)
    finally:
        if args.out:
            args.out.write_text(json.dumps(result, indent=1, default=str))
        shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
