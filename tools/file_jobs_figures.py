"""Figures for the file jobs on a GPU machine: multiply and gram from .npy to .npy, against
plain NumPy reading and writing the same files on the same disk.

Usage (on the GPU machine, from the repository root):
    python tools/file_jobs_figures.py --workdir /tmp/fj --out $OUT/file-jobs.json

1. multiply: two 1,000,000 x 500 float64 inputs (4 GB each) -> 4 GB, ``dask-gpuchunk multiply``
   on a local cluster (one worker per GPU); NumPy: ``np.load`` both inputs, ``np.save`` the
   output; the two alternate as for gram (below), after a first small job that compiles the
   kernels into the on-disk cache (as any earlier job on the machine would have). The PCIe floor (8 GB in, 4 GB out at the
   measured pinned rates) is printed beside.
2. gram: seed 001's largest case, 100,000 x 200,000 bits (packed input, 2.5 GB), C = 40 GB of
   int32, ``--device-memory-limit 8GB``, the job run as the CLI runs it on a local cluster
   started once; NumPy: ``np.save`` of a 40 GB int32 array (the same bytes) to the same disk.
   The two alternate (NumPy, ours, ours, NumPy), each from a clean page cache with no dirty
   pages; each is timed until its last write returns ("buffered", how the CLI times a job)
   and until an fsync of the file returns ("durable": the bytes on the disk, which the page
   cache cannot flatter). Sampled rows of C are checked against NumPy popcounts; the peak
   device memory is sampled with nvidia-smi.
3. gram to Zarr: the same job writing a Zarr store (format 3, uncompressed) beside the same job
   writing a .npy, alternating (npy, zarr, zarr, npy) after a .npy job left out, each made
   durable by ``sync`` right after the job, with the bytes the disk was sent.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from nvidia_smi_peaks import NvidiaSmiPeaks


class DiskWrites:
    """What the disk holding ``folder`` was sent while the ``with`` block ran, from
    /proc/diskstats (sectors written) and /proc/meminfo (Dirty + Writeback) every 0.5 s: bytes,
    mean and peak rate over 2 s windows, the most dirty memory, seconds the block ran."""

    def __init__(self, folder: Path) -> None:
        st = os.stat(folder)
        self.device = (os.major(st.st_dev), os.minor(st.st_dev))
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> tuple[float, int, int]:
        written = 0
        for line in Path("/proc/diskstats").read_text().splitlines():
            f = line.split()
            if (int(f[0]), int(f[1])) == self.device:
                written = int(f[9]) * 512
        meminfo = dict(line.split(":", 1) for line in
                       Path("/proc/meminfo").read_text().splitlines())
        dirty = sum(int(meminfo[k].split()[0]) * 1024 for k in ("Dirty", "Writeback"))
        return time.perf_counter(), written, dirty

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.samples.append(self._sample())

    def __enter__(self) -> "DiskWrites":
        self.samples.append(self._sample())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self._sample())

    def summary(self) -> dict:
        (t0, w0, _), (t1, w1, _) = self.samples[0], self.samples[-1]
        rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(self.samples, self.samples[4:])]
        return {"seconds": t1 - t0, "bytes": w1 - w0, "mean_gb_s": (w1 - w0) / (t1 - t0) / 1e9,
                "peak_gb_s_2s": max(rates, default=0.0) / 1e9,
                "max_dirty_gb": max(s[2] for s in self.samples) / 1e9}


def drop_caches() -> bool:
    """Ask the kernel to drop clean page-cache pages (root only; may be refused in containers)."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


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


#: DASK_GPUCHUNK__FILE_READS for the multiply job (--reads tries several after the comparison).
READS_VARIANTS: list[int] = []


#: Rows of each multiply input (seed 000: 1,000,000 x 500 float64, 4 GB).
MULTIPLY_ROWS = 1_000_000


def multiply_figures(work: Path, result: dict) -> None:
    """Ours and NumPy (np.load both, multiply, np.save) alternating as ORDER says, each
    from a clean page cache; medians compared with the larger of NumPy's read + write and the
    PCIe floor."""
    rng = np.random.default_rng(0)
    a_path, b_path, c_path = work / "a.npy", work / "b.npy", work / "c.npy"
    for p in (a_path, b_path):
        np.save(p, rng.random((MULTIPLY_ROWS, 500)))
    from dask_gpuchunk.bench.limits import pcie_bandwidth

    pcie = pcie_bandwidth()
    nbytes = MULTIPLY_ROWS * 500 * 8
    floor = max(2 * nbytes / pcie["h2d"], nbytes / pcie["d2h"], 3 * nbytes / pcie["bidirectional"])
    from dask_gpuchunk.jobs import multiply_job

    # A first, small job on this machine: its workers compile the product's kernels and keep
    # them in the on-disk cache, as for any later job here; reported, not compared.
    small = [work / "small_a.npy", work / "small_b.npy", work / "small_c.npy"]
    for p in small[:2]:
        np.save(p, rng.random((20_000, 500)))
    first = ours_in_fresh_cluster(lambda: multiply_job(*small, overwrite=True), small[2], False)
    result["multiply_first_small_job_s"] = first["seconds"]
    print(f"multiply, first small job on this machine (compiles): {first['seconds']:.1f} s",
          flush=True)
    for p in small:
        p.unlink()
    checked: list[bool] = []

    def numpy_run() -> dict:
        arrays: dict = {}
        t_read = timed(lambda: arrays.update(a=np.load(a_path), b=np.load(b_path)))
        product = arrays["a"] * arrays["b"]
        arrays.clear()
        t_write = timed(lambda: np.save(work / "c_numpy.npy", product))
        product = None  # freed before the next step
        durable = t_read + t_write + fsync_seconds(work / "c_numpy.npy")
        (work / "c_numpy.npy").unlink()
        return {"read_s": t_read, "write_s": t_write, "buffered_s": t_read + t_write,
                "durable_s": durable}

    def ours_run() -> dict:
        run = ours_in_fresh_cluster(lambda: multiply_job(a_path, b_path, c_path, overwrite=True),
                                    c_path, PROFILE and not checked)
        if not checked:
            sample = np.random.default_rng(1).choice(MULTIPLY_ROWS, 200, replace=False)
            a, b, c = (np.load(p, mmap_mode="r") for p in (a_path, b_path, c_path))
            checked.append(bool(np.array_equal(c[sample], a[sample] * b[sample])))
            del a, b, c
        c_path.unlink()  # the next run writes a new file, as NumPy's does
        return run

    runs, med = alternate("multiply", numpy_run, ours_run)
    exact = checked[0]
    variants = {}
    for reads in READS_VARIANTS:  # region reads in flight per worker (0: no limit)
        drop_caches()
        variants[reads] = cli("multiply", str(a_path), str(b_path), "-o", str(c_path),
                              "--overwrite", env={"DASK_GPUCHUNK__FILE_READS": str(reads)})["seconds"]
        print(f"multiply, {reads} reads in flight: {variants[reads]:.2f} s", flush=True)
    result["multiply"] = {
        "runs": runs, "order": ORDER, "sample_exact": exact, "median_s": med, "pcie": pcie,
        "pcie_floor_s": floor, "seconds_by_reads_in_flight": variants,
        "ratio_to_bound": med["ours"]["buffered_s"] / max(floor, med["numpy"]["buffered_s"]),
        "ratio_to_bound_durable": med["ours"]["durable_s"] / max(floor, med["numpy"]["durable_s"]),
    }
    print(json.dumps({k: v for k, v in result["multiply"].items() if k != "runs"}, default=str),
          flush=True)
    for p in (a_path, b_path, c_path):
        p.unlink(missing_ok=True)


PROFILE = False
#: --layout of the gram job.
GRAM_LAYOUT = ["auto"]
#: Order of both comparisons: NumPy's write and ours alternate A B B A, so that a drift of
#: the disk's rate over the minutes of the run falls on both alike.
ORDER = ["numpy", "ours", "ours", "numpy"]


def fsync_seconds(path: Path) -> float:
    """Seconds until every byte of ``path`` written so far is on the disk."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def alternate(label: str, numpy_run, ours_run) -> tuple[list[dict], dict]:
    """Run NumPy's side and ours in ORDER, each from a clean page cache (no dirty pages of the
    last run, the inputs not cached); return the runs and the medians of each side's
    ``buffered_s`` and ``durable_s``."""
    runs: list[dict] = []
    for who in ORDER:
        cold = drop_caches()
        run = numpy_run() if who == "numpy" else ours_run()
        run.update(who=who, caches_dropped_before=cold)
        runs.append(run)
        print(f"{label} comparison, {who}: buffered {run['buffered_s']:.2f} s, durable "
              f"{run['durable_s']:.2f} s", flush=True)
    med = {who: {kind: float(np.median([r[kind] for r in runs if r["who"] == who]))
                 for kind in ("buffered_s", "durable_s")} for who in ("numpy", "ours")}
    return runs, med


def numpy_write(path: Path, rows: int) -> dict:
    """np.save of a rows x rows int32 array (resident) to ``path``: buffered and durable."""
    c = np.empty((rows, rows), dtype=np.int32)
    c[...] = 7  # touched: NumPy writes resident memory
    buffered = timed(lambda: np.save(path, c))
    durable = buffered + fsync_seconds(path)
    return {"buffered_s": buffered, "durable_s": durable}


def ours_in_fresh_cluster(make_job, out_path: Path, profile: bool,
                          sync_all: bool = False) -> dict:
    """A job as the CLI runs it (a new local cluster, so new worker processes that compile
    what they run): buffered (the job's own time, until its last write returns and the file is
    renamed) and durable (then an fsync of the output, or with ``sync_all`` a ``sync`` of
    everything, which a Zarr store of many files needs; before the cluster closes).
    ``make_job()`` returns the job (``dask_gpuchunk.jobs.*_job``)."""
    from dask.utils import key_split
    from distributed import get_task_stream

    import dask_gpuchunk as dg

    gpus = int(CLI_EXTRA[1]) if CLI_EXTRA else None
    with dg.local_cluster(gpus=gpus, device_memory_limit="8GB", dashboard_address=None,
                          threads_per_gpu="cores", silence_logs=logging.CRITICAL) as client:
        job = make_job()
        t0 = time.time()
        if profile:
            with get_task_stream(client) as ts:
                summary = job(None)
        else:
            summary = job(None)
        summary["buffered_s"] = summary["seconds"]
        summary["durable_s"] = summary["seconds"] + (
            sync_seconds() if sync_all else fsync_seconds(out_path))
    if profile:
        kinds: dict = {}
        for task in ts.data:
            for ss in task.get("startstops", []):
                k = kinds.setdefault(f"{key_split(task['key'])}:{ss['action']}",
                                     {"thread_s": 0.0, "n": 0, "first": 1e18, "last": 0.0})
                k["thread_s"] += ss["stop"] - ss["start"]
                k["n"] += 1
                k["first"] = min(k["first"], ss["start"] - t0)
                k["last"] = max(k["last"], ss["stop"] - t0)
        summary["task_profile"] = kinds
        for name, k in sorted(kinds.items(), key=lambda kv: kv[1]["first"]):
            print(f"  {name:40s} {k['n']:5d} tasks {k['thread_s']:8.2f} thread-s  "
                  f"{k['first']:6.2f}..{k['last']:6.2f} s", flush=True)
    return summary


def ours_gram(bits_path: Path, g_path: Path, profile: bool, sync_all: bool = False) -> dict:
    from dask_gpuchunk.jobs import gram_job

    return ours_in_fresh_cluster(
        lambda: gram_job(bits_path, g_path, packed=True, layout=GRAM_LAYOUT[0], overwrite=True),
        g_path, profile, sync_all)


def gram_figures(work: Path, result: dict, rows: int, bits: int) -> None:
    rng = np.random.default_rng(2)
    packed = rng.integers(0, 256, size=(rows, bits // 8), dtype=np.uint8)
    bits_path, g_path, numpy_path = work / "bits_packed.npy", work / "gram.npy", work / "g_np.npy"
    np.save(bits_path, packed)
    # A first, small job on this machine: CuPy compiles the tensor-core kernel (NVRTC) and
    # keeps it in its on-disk cache, as for any later job here; reported, not compared.
    small_bits, small_out = work / "small_bits.npy", work / "small_gram.npy"
    np.save(small_bits, packed[:8192, :2048])
    first = ours_gram(small_bits, small_out, False)
    result["gram_first_small_job_s"] = first["seconds"]
    print(f"gram, first small job on this machine (compiles): {first['seconds']:.1f} s", flush=True)
    small_bits.unlink()
    small_out.unlink()
    checked: list[bool] = []

    def numpy_run() -> dict:
        run = numpy_write(numpy_path, rows)
        numpy_path.unlink()
        return run

    def ours_run() -> dict:
        run = ours_gram(bits_path, g_path, PROFILE and not checked)
        if not checked:
            g = np.load(g_path, mmap_mode="r")
            ok = True
            for r in np.random.default_rng(3).choice(rows, 8, replace=False):
                expected = np.bitwise_count(packed & packed[r]).sum(axis=1, dtype=np.int64)
                ok &= bool(np.array_equal(g[r], expected.astype(np.int32)))
            checked.append(ok)
            del g
        g_path.unlink()
        return run

    with NvidiaSmiPeaks("gpu", "index", "memory.used") as sampler:
        runs, med = alternate("gram", numpy_run, ours_run)
    exact = checked[0]
    result["gram"] = {
        "runs": runs, "order": ORDER, "sampled_rows_exact": exact, "median": med,
        "ratio_buffered": med["ours"]["buffered_s"] / med["numpy"]["buffered_s"],
        "ratio_durable": med["ours"]["durable_s"] / med["numpy"]["durable_s"],
        "peak_device_memory_mib": sampler.peak,
        "input_plus_output_bytes": packed.nbytes + rows * rows * 4,
    }
    print(json.dumps({k: v for k, v in result["gram"].items() if k != "runs"}, default=str),
          flush=True)
    bits_path.unlink()


#: The order of the .npy and Zarr gram jobs in their comparison; "warmup" is a .npy job left
#: out of the figures (the first job after the input is written ran slower in every run).
ZARR_ORDER = ["warmup", "npy", "zarr", "zarr", "npy"]


def sync_seconds() -> float:
    """Seconds until every dirty page of the machine is on the disk (``sync``): a Zarr store is
    many files, so both sides of the Zarr comparison are made durable this way."""
    t0 = time.perf_counter()
    os.sync()
    return time.perf_counter() - t0


def gram_zarr_figures(work: Path, result: dict, rows: int, bits: int) -> None:
    """The gram job to a Zarr store (uncompressed, format 3) beside the same job to a .npy, in
    ZARR_ORDER, each from a clean page cache; sampled rows of each checked against NumPy."""
    rng = np.random.default_rng(2)
    packed = rng.integers(0, 256, size=(rows, bits // 8), dtype=np.uint8)
    bits_path = work / "bits_packed.npy"
    np.save(bits_path, packed)
    small_bits = work / "small_bits.npy"
    np.save(small_bits, packed[:8192, :2048])
    for name in ("small.npy", "small.zarr"):  # compiles, as any earlier job here would have
        ours_gram(small_bits, work / name, False)
    small_bits.unlink()
    runs: list[dict] = []
    exact: dict[str, bool] = {}
    with NvidiaSmiPeaks("gpu", "index", "memory.used") as sampler:
        for spec in ZARR_ORDER:
            # "zarr:N": the job with N file writes at once per process (gpuchunk.file-writes).
            kind, _, writes = spec.partition(":")
            kind = "npy" if kind == "warmup" else kind
            out = work / f"G.{kind}"
            cold = drop_caches()
            if writes:
                os.environ["DASK_GPUCHUNK__FILE_WRITES"] = writes
            try:
                with DiskWrites(work) as disk:
                    # durable: both kinds by one sync inside the cluster, right after the job
                    run = ours_gram(bits_path, out, PROFILE, sync_all=True)
            finally:
                os.environ.pop("DASK_GPUCHUNK__FILE_WRITES", None)
            run["disk"] = disk.summary()
            print(f"  disk: {json.dumps(run['disk'])}", flush=True)
            run.update(who=spec, caches_dropped_before=cold)
            if kind not in exact:
                if kind == "zarr":
                    import zarr

                    g = zarr.open_array(str(out), mode="r")
                    run["zarr_chunks"] = list(g.chunks)
                else:
                    g = np.load(out, mmap_mode="r")
                ok = True
                for r in np.random.default_rng(3).choice(rows, 4, replace=False):
                    expected = np.bitwise_count(packed & packed[r]).sum(axis=1, dtype=np.int64)
                    ok &= bool(np.array_equal(g[int(r)], expected.astype(np.int32)))
                exact[kind] = ok
                del g
            shutil.rmtree(out) if out.is_dir() else out.unlink()
            runs.append({k: v for k, v in run.items() if k not in ("where",)})
            print(f"gram to {spec}: {run['seconds']:.2f} s buffered, {run['durable_s']:.2f} s "
                  f"durable, layout {run['layout']}", flush=True)
    med = {spec: {k: float(np.median([r[k] for r in runs if r["who"] == spec]))
                  for k in ("seconds", "durable_s")}
           for spec in dict.fromkeys(ZARR_ORDER) if spec != "warmup"}
    result["gram_zarr"] = {
        "runs": runs, "order": ZARR_ORDER, "sampled_rows_exact": exact, "median": med,
        "ratio_buffered": {spec: m["seconds"] / med["npy"]["seconds"] for spec, m in med.items()},
        "ratio_durable": {spec: m["durable_s"] / med["npy"]["durable_s"]
                          for spec, m in med.items()},
        "peak_device_memory_mib": sampler.peak,
    }
    print(json.dumps({k: v for k, v in result["gram_zarr"].items() if k != "runs"},
                     default=str), flush=True)
    bits_path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/file-jobs"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--bits", type=int, default=200_000)
    parser.add_argument("--skip", nargs="*", default=[])
    parser.add_argument("--gpus", default=None, help="--gpus for the jobs (default: all)")
    parser.add_argument("--layout", default="auto", help="--layout of the gram job")
    parser.add_argument("--order", nargs="*", default=None,
                        help="gram comparison order, e.g. numpy ours ours numpy (the default)")
    parser.add_argument("--zarr-order", nargs="*", default=None,
                        help="Zarr comparison order: npy, zarr, zarr:N (N file writes at once)")
    parser.add_argument("--profile", action="store_true",
                        help="profile the tasks of the first gram job")
    parser.add_argument("--reads", nargs="*", type=int, default=None,
                        help="DASK_GPUCHUNK__FILE_READS values to try for multiply")
    args = parser.parse_args()
    if args.gpus:
        CLI_EXTRA.extend(["--gpus", args.gpus])
    global PROFILE
    PROFILE = args.profile
    GRAM_LAYOUT[:] = [args.layout]
    if args.order:
        ORDER[:] = args.order
    if args.zarr_order:
        ZARR_ORDER[:] = args.zarr_order
    if args.reads is not None:
        READS_VARIANTS[:] = args.reads
    args.workdir.mkdir(parents=True, exist_ok=True)
    result: dict = {"disk_free_bytes": shutil.disk_usage(args.workdir).free}
    try:
        if "multiply" not in args.skip:
            multiply_figures(args.workdir, result)
        if "gram" not in args.skip:
            gram_figures(args.workdir, result, args.rows, args.bits)
        if "gram-zarr" not in args.skip:
            gram_zarr_figures(args.workdir, result, args.rows, args.bits)
    finally:
        if args.out:
            args.out.write_text(json.dumps(result, indent=1, default=str))
        shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
