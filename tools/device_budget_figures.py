"""Figures for the device-memory budget on a GPU machine: the same jobs uncapped and with every
process's CuPy pool capped (``CUPY_GPU_MEMORY_LIMIT``), as on a smaller card.

Usage (on the GPU machine, from the repository root; each scenario writes one JSON):
    python tools/device_budget_figures.py gram --rows 100000 --bits 200000 --cap 8GiB \\
        --workdir /tmp/db --out $OUT/gram.json
    python tools/device_budget_figures.py seed000 --cap 2GiB --out $OUT/seed000.json
    python tools/device_budget_figures.py resident --gb 32 --cap 8GiB \\
        --runs none:default,cap:default,cap:1,cap:16 --out $OUT/resident.json

gram: random packed bits to a ``.npy``, then ``dask-gpuchunk gram --packed --json`` (default
options) uncapped and capped, each from a fresh local cluster; sampled rows of C checked
against NumPy popcounts. seed000: two 1,000,000 x 500 float64 pageable arrays,
``dg.multiply(..., device="gpu")`` into a preallocated output, uncapped and capped (a process
each), median of 3. resident: ``--gb`` of float64 CuPy chunks (1 GiB each) persisted on a
``dg.local_cluster`` (each run its cap and threads per GPU, a process each), ``dg.multiply``
over them persisted, then a 10-step loop (an elementwise step and its sum, persisted together,
each step); sampled chunks checked against the same arithmetic on the host. Every run samples
nvidia-smi's per-process memory (peak per process, MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from dask.utils import parse_bytes
from nvidia_smi_peaks import NvidiaSmiPeaks


def _env(cap: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CUPY_GPU_MEMORY_LIMIT", None)
    if cap:
        env["CUPY_GPU_MEMORY_LIMIT"] = str(cap)
    return env


# ---- gram -------------------------------------------------------------------------------------


def gram(args: argparse.Namespace) -> dict:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    bits_path, out_path = work / "bits.npy", work / "g.npy"
    rng = np.random.default_rng(1)
    words = rng.integers(0, 256, (args.rows, args.bits // 8), dtype=np.uint8)
    np.save(bits_path, words)
    runs = []
    for cap in (None, args.cap, None, args.cap)[: 2 * args.repeat]:
        out_path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "dask_gpuchunk", "gram", str(bits_path), "-o", str(out_path),
               "--packed", "--json"]
        t0 = time.perf_counter()
        with NvidiaSmiPeaks("compute-apps", "pid", "used_memory") as sampler:
            r = subprocess.run(cmd, capture_output=True, text=True, env=_env(cap), check=False)
        wall = time.perf_counter() - t0
        run = {"cap": cap, "returncode": r.returncode, "wall_seconds": wall,
               "nvidia_smi_peak_mib": sampler.peak, "stderr": r.stderr[-2000:]}
        if r.returncode == 0:
            summary = json.loads(r.stdout.strip().splitlines()[-1])
            run.update(seconds=summary["seconds"], layout=summary["layout"],
                       device_memory=summary["where"].get("device_memory"))
            g = np.load(out_path, mmap_mode="r")
            w64 = words.view(np.uint64) if words.shape[1] % 8 == 0 else None
            sample = rng.choice(args.rows, 3, replace=False)
            ok = True
            for i in sample:
                expected = np.bitwise_count(w64 & w64[i]).sum(axis=1, dtype=np.int64)
                ok &= bool(np.array_equal(np.asarray(g[i]), expected))
            run["sampled_rows_exact"] = ok
            del g  # a memory map keeps the file's blocks on the disk after its unlink
        print(json.dumps({k: v for k, v in run.items() if k != "stderr"}), flush=True)
        runs.append(run)
    out_path.unlink(missing_ok=True)
    return {"scenario": "gram", "rows": args.rows, "bits": args.bits, "runs": runs}


# ---- seed 000 ----------------------------------------------------------------------------------


def _seed000_child(repeat: int) -> None:
    import dask_gpuchunk as dg
    from dask_gpuchunk import budget

    rng = np.random.default_rng(0)
    a, b = rng.random((1_000_000, 500)), rng.random((1_000_000, 500))
    out = np.empty_like(a)
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        dg.multiply(a, b, device="gpu", out=out)
        times.append(time.perf_counter() - t0)
    exact = bool(np.array_equal(out[::997], a[::997] * b[::997]))
    print(json.dumps({"first": times[0], "median": float(np.median(times[1:])), "exact": exact,
                      "budget": budget.budget_report()}))


def seed000(args: argparse.Namespace) -> dict:
    runs = []
    for cap in (None, args.cap):
        with NvidiaSmiPeaks("compute-apps", "pid", "used_memory") as sampler:
            r = subprocess.run([sys.executable, __file__, "_seed000_child", "--repeat",
                                str(args.repeat)], capture_output=True, text=True,
                               env=_env(cap), check=False)
        run = {"cap": cap, "returncode": r.returncode, "nvidia_smi_peak_mib": sampler.peak}
        if r.returncode == 0:
            run.update(json.loads(r.stdout.strip().splitlines()[-1]))
        else:
            run["stderr"] = r.stderr[-2000:]
        print(json.dumps(run), flush=True)
        runs.append(run)
    return {"scenario": "seed000", "runs": runs}


# ---- device-resident data beyond the cap ---------------------------------------------------------


def _resident_child(gb: int, steps: int, threads: int | None) -> None:
    import cupy
    import dask
    import dask.array as da
    from distributed import wait

    import dask_gpuchunk as dg
    from dask_gpuchunk import budget

    @dg.elementwise
    def step(y, k):
        return y + 0.01 * (-k * y + 0.5)

    rows = 2**27  # float64 elements per chunk: 1 GiB
    n = gb * rows
    result: dict = {"threads_per_gpu": threads}

    def to_device(block):
        return cupy.asarray(block) * 1e-9

    def host(i):  # chunk i as created, on the host
        return np.arange(i * rows, (i + 1) * rows, dtype=np.float64) * 1e-9

    sample = [0, gb // 2, gb - 1]

    def say(what, seconds):  # progress on stderr: a run cut short still shows how far it got
        print(f"{what}: {seconds:.2f} s", file=sys.stderr, flush=True)

    with dg.local_cluster(dashboard_address=None, threads_per_gpu=threads) as client:
        t0 = time.perf_counter()
        y = da.arange(n, chunks=rows, dtype=np.float64).map_blocks(
            to_device, dtype=np.float64, meta=cupy.empty((0,), np.float64)).persist()
        wait(y)
        result["persist_seconds"] = time.perf_counter() - t0
        say("persist", result["persist_seconds"])
        t0 = time.perf_counter()
        z = dg.multiply(y, y).persist()
        wait(z)
        result["multiply_seconds"] = time.perf_counter() - t0
        say("multiply", result["multiply_seconds"])
        result["multiply_sampled_chunks_exact"] = all(
            np.array_equal(cupy.asnumpy(z.blocks[i].compute()), host(i) * host(i)) for i in sample)
        del z
        t0 = time.perf_counter()
        ks, k, per_step = [], 0.5, []
        for _ in range(steps):
            s0 = time.perf_counter()
            y_next = step(y, k)
            y_next, total = dask.persist(y_next, y_next.sum())
            delta = float(total.compute())
            y = y_next
            ks.append(k)
            k = 0.5 + 1e-3 * (delta / n)
            per_step.append(time.perf_counter() - s0)
            say(f"step {len(per_step)}", per_step[-1])
        result["loop_seconds"] = time.perf_counter() - t0
        result["per_step_seconds"] = per_step
        worst = 0.0
        for i in sample:
            v = host(i)
            for kk in ks:
                v = v + 0.01 * (-kk * v + 0.5)
            got = cupy.asnumpy(y.blocks[i].compute())
            worst = max(worst, float(np.max(np.abs(got - v) / np.maximum(np.abs(v), 1e-300))))
        result["loop_sampled_chunks_max_rel_err"] = worst
        result["budgets"] = list(client.run(budget.budget_report).values())
    print(json.dumps(result))


def resident(args: argparse.Namespace) -> dict:
    runs = []
    for cap, threads in args.runs:
        cmd = [sys.executable, __file__, "_resident_child", "--gb", str(args.gb), "--steps",
               str(args.steps)] + (["--threads", str(threads)] if threads else [])
        t0 = time.perf_counter()
        with NvidiaSmiPeaks("compute-apps", "pid", "used_memory") as sampler:
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, env=_env(cap),
                                   check=False, timeout=args.timeout)
                code, out, err = r.returncode, r.stdout, r.stderr
            except subprocess.TimeoutExpired as exc:
                err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr
                code, out, err = "timeout", "", (err or "")[-3000:]
        run = {"cap": cap, "gb": args.gb, "threads_per_gpu": threads, "returncode": code,
               "wall_seconds": time.perf_counter() - t0, "nvidia_smi_peak_mib": sampler.peak}
        if code == 0:
            run.update(json.loads(out.strip().splitlines()[-1]))
        else:
            run["stderr"] = err[-3000:]
        print(json.dumps(run), flush=True)
        runs.append(run)
    return {"scenario": "resident", "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="scenario", required=True)
    g = sub.add_parser("gram")
    g.add_argument("--rows", type=int, default=100_000)
    g.add_argument("--bits", type=int, default=200_000)
    g.add_argument("--workdir", default="/tmp/device-budget")
    g.add_argument("--repeat", type=int, default=1, help="uncapped/capped pairs")
    s = sub.add_parser("seed000")
    s.add_argument("--repeat", type=int, default=3)
    r = sub.add_parser("resident")
    r.add_argument("--gb", type=int, default=32)
    r.add_argument("--steps", type=int, default=10)
    r.add_argument("--timeout", type=float, default=300)
    r.add_argument("--runs", default="cap:default",
                   help="comma-separated CAP:THREADS pairs; CAP 'none' runs uncapped, THREADS "
                        "'default' leaves dg.local_cluster's default")
    for p in (g, s, r):
        p.add_argument("--cap", required=True, help="e.g. 8GiB")
        p.add_argument("--out", required=True)
    c = sub.add_parser("_seed000_child")
    c.add_argument("--repeat", type=int, default=3)
    c2 = sub.add_parser("_resident_child")
    c2.add_argument("--gb", type=int)
    c2.add_argument("--steps", type=int)
    c2.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.scenario == "_seed000_child":
        return _seed000_child(args.repeat)
    if args.scenario == "_resident_child":
        return _resident_child(args.gb, args.steps, args.threads)
    args.cap = parse_bytes(args.cap)
    if args.scenario == "resident":
        args.runs = [(None if c == "none" else args.cap if c == "cap" else parse_bytes(c),
                      None if t == "default" else int(t))
                     for c, t in (pair.split(":") for pair in args.runs.split(","))]
    result = {"gram": gram, "seed000": seed000, "resident": resident}[args.scenario](args)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
