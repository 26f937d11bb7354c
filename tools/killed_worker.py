"""A worker killed in the middle of a file job on a cluster of several GPUs: the job completes
(exact) or fails cleanly (a non-zero exit, one line on stderr, nothing written), never a
half-written file.

Usage (on a machine with 2 or more GPUs; on a CPU machine it runs on 2 CPU workers, for checking
the tool itself at small sizes):
    python tools/killed_worker.py --rows 65536 --bits 262144 --out $OUT/killed-worker.json

Writes random packed bits to a ``.npy``, then starts a cluster as a batch job does: a
``dask scheduler`` writing a scheduler file and ``dask cuda worker`` (one worker per GPU, each
under a nanny that starts it again) or, without GPUs, ``dask worker --nworkers 2``. For each
``--kill-at`` entry it runs ``dask-gpuchunk gram BITS.npy -o C.npy --packed --scheduler-file S``
and kills one worker's process (SIGKILL): ``write`` when the job's first file appears in the
output folder (its temporary output), a number that many seconds after the job started. Then it
records the job's exit status and stderr, the files left in the output folder, and, where the
job completed, whether sampled rows of C equal NumPy's popcounts. Each run waits for the
restarted worker before the next.

The ``if __name__ == "__main__"`` guard matters for the same reason as in the other tools: the
job's process spawns nothing here, but the workers import the package.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)


def _cluster(work: Path, gpus: int) -> tuple[Path, list[subprocess.Popen]]:
    sched_file = work / "scheduler.json"
    sched_file.unlink(missing_ok=True)
    procs = [_start([sys.executable, "-m", "distributed.cli.dask_scheduler", "--scheduler-file",
                     str(sched_file), "--host", "127.0.0.1", "--port", "0",
                     "--dashboard-address", ":0"], work / "scheduler.log")]
    deadline = time.time() + 60
    while not sched_file.exists() and time.time() < deadline:
        time.sleep(0.2)
    if gpus:
        worker = [sys.executable, "-m", "dask_cuda.cli", "--scheduler-file", str(sched_file),
                  "--host", "127.0.0.1", "--dashboard-address", ":0",
                  "--local-directory", str(work / "workers")]
    else:
        worker = [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
                  str(sched_file), "--nworkers", "2", "--nthreads", "1", "--host", "127.0.0.1",
                  "--dashboard-address", ":0", "--local-directory", str(work / "workers")]
    procs.append(_start(worker, work / "workers.log"))
    return sched_file, procs


def _worker_pids(client: Any, count: int) -> dict[str, int]:
    client.wait_for_workers(count, timeout=120)
    return client.run(os.getpid)


def _one_run(sched_file: Path, work: Path, bits: Path, kill_at: str, count: int,
             sample: np.ndarray, expected_rows: np.ndarray) -> dict[str, Any]:
    from distributed import Client

    out_dir = work / "out"
    out_dir.mkdir(exist_ok=True)
    for leftover in out_dir.iterdir():
        leftover.unlink()
    out = out_dir / "C.npy"
    with Client(scheduler_file=str(sched_file), timeout=60) as client:
        pids = _worker_pids(client, count)
    victim_address, victim = sorted(pids.items())[0]
    t0 = time.perf_counter()
    job = subprocess.Popen([sys.executable, "-m", "dask_gpuchunk", "gram", str(bits), "-o",
                            str(out), "--packed", "--scheduler-file", str(sched_file),
                            "--workers", str(count), "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if kill_at == "write":
        while not any(out_dir.iterdir()) and job.poll() is None and time.perf_counter() - t0 < 300:
            time.sleep(0.02)
    else:
        while job.poll() is None and time.perf_counter() - t0 < float(kill_at):
            time.sleep(0.02)
    killed_after = time.perf_counter() - t0
    alive = job.poll() is None
    if alive:
        os.kill(victim, signal.SIGKILL)
    stdout, stderr = job.communicate(timeout=600)
    run: dict[str, Any] = {
        "kill_at": kill_at, "killed": alive, "killed_after_seconds": round(killed_after, 3),
        "worker_killed": victim_address, "returncode": job.returncode,
        "job_seconds_end_to_end": round(time.perf_counter() - t0, 3),
        "files_left": sorted(p.name for p in out_dir.iterdir()),
        "stderr": stderr.strip()[-600:]}
    if job.returncode == 0:
        c = np.load(out, mmap_mode="r")
        run["sampled_rows_exact"] = bool(np.array_equal(c[sample], expected_rows))
        run["summary_seconds"] = json.loads(stdout.strip().splitlines()[-1]).get("seconds")
        run["clean"] = run["files_left"] == ["C.npy"] and run["sampled_rows_exact"]
    else:
        run["clean"] = (run["files_left"] == [] and stderr.strip().startswith("error:")
                        and stderr.strip().count("\n") == 0)
    for leftover in out_dir.iterdir():
        leftover.unlink()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--bits", type=int, default=262144)
    parser.add_argument("--kill-at", default="write,2",
                        help="comma-separated: 'write' or seconds after the job started")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/killed-worker"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import dask_gpuchunk as dg
    from gram_scaling import write_random_bits  # this folder's tool: run as tools/...py

    work = args.workdir
    (work / "workers").mkdir(parents=True, exist_ok=True)
    bits = work / "bits.npy"
    sample, expected_rows, _ = write_random_bits(bits, args.rows, args.bits, seed=11)
    gpus = dg.gpu_count()
    count = gpus or 2
    sched_file, procs = _cluster(work, gpus)
    result: dict[str, Any] = {"rows": args.rows, "bits": args.bits, "gpus": gpus,
                              "workers": count, "runs": []}
    try:
        for kill_at in args.kill_at.split(","):
            run = _one_run(sched_file, work, bits, kill_at, count, sample, expected_rows)
            print(json.dumps(run), flush=True)
            result["runs"].append(run)
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        bits.unlink(missing_ok=True)
    result["all_clean"] = all(r["clean"] for r in result["runs"])
    print(f"all clean: {result['all_clean']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
