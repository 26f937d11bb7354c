"""Where the time of a similarity job from a ``.npy`` goes (run on a GPU machine, or a CPU one
with ``--rows`` small).

    python3 tools/similarity_job_profile.py --rows 1000000 --out $OUT/job-profile.json
    python3 tools/similarity_job_profile.py --defaults-only --cap 2147483648 --out $OUT/d.json

Writes ``--rows`` random packed 2048-bit fingerprints (7.5 % density) to a ``.npy``, then
times:

* a bare interpreter, and the imports the CLI pays (``dask_gpuchunk.cli``; with CuPy,
  distributed and dask-cuda);
* ``dask-gpuchunk similarity FPS.npy --packed --top-k 10`` end to end, twice, on a local
  cluster (``--local-cluster``), then with ``--in-process`` (no cluster; what the command does
  by default on one GPU) at the default chunks and at 16,384-row ones, each with the job's own
  ``seconds``; with ``--cap`` set, once more each way under that pool cap
  (``CUPY_GPU_MEMORY_LIMIT``);
* in this process: the local cluster's start, two jobs on it, its report and its close; then
  two jobs with no cluster (dask's threads), and whether both gave the same result file.

The ``if __name__ == "__main__"`` guard matters: a local cluster's workers are spawned
processes that import this file again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _cli(work: Path, label: str, *extra: str, env: dict | None = None,
         select: tuple[str, ...] = ("--top-k", "10")) -> list:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "dask_gpuchunk", "similarity", str(work / "fps.npy"),
                        "--packed", *select, "-o", str(work / "nn.npz"), "--json",
                        "--overwrite", *extra], capture_output=True, text=True, timeout=300,
                       env=env)
    total = time.perf_counter() - t0
    try:
        job = json.loads(p.stdout.strip().splitlines()[-1])["seconds"]
    except (IndexError, ValueError, KeyError):
        job = None
        print(p.stdout[-1500:], p.stderr[-3000:], flush=True)
    print(f"{label}: {total:.2f} s end to end, job {job}", flush=True)
    return [round(total, 3), job]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--work", type=Path, default=Path("/tmp/similarity-job-profile"))
    parser.add_argument("--cap", help="also run the CLI job under this CUPY_GPU_MEMORY_LIMIT "
                        "(bytes)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--defaults-only", action="store_true",
                        help="only the command as a user runs it: top-10 twice, threshold 0.7, "
                             "and top-10 under --cap")
    args = parser.parse_args()
    import numpy as np

    import dask_gpuchunk as dg
    from dask_gpuchunk.bench.similarity import make_fingerprints
    from dask_gpuchunk.devices import gpu_available
    from dask_gpuchunk.jobs import similarity_job, where_it_ran

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    np.save(work / "fps.npy", make_fingerprints(args.rows, 2048, 0.075, on_gpu=gpu_available()))
    out: dict = {"rows": args.rows}
    for label, code in [("bare interpreter", "pass"),
                        ("import dask_gpuchunk.cli", "import dask_gpuchunk.cli"),
                        ("+ cupy, distributed, dask_cuda",
                         "import dask_gpuchunk.cli, cupy, distributed, dask_cuda")]:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], capture_output=True)
        out[label] = round(time.perf_counter() - t0, 3)
    print(out, flush=True)
    if args.defaults_only:
        out["cli default"] = [_cli(work, "cli, default") for _ in range(2)]
        out["cli default, threshold 0.7"] = _cli(work, "cli, default, threshold 0.7",
                                                 select=("--threshold", "0.7"))
        if args.cap:
            out["cli default capped"] = _cli(work, f"cli, default, cap {args.cap}", env={
                **os.environ, "CUPY_GPU_MEMORY_LIMIT": args.cap})
        if args.out:
            args.out.write_text(json.dumps(out, indent=1))
        return
    out["cli"] = [_cli(work, "cli, local cluster", "--local-cluster") for _ in range(2)]
    out["cli in process"] = _cli(work, "cli, --in-process", "--in-process")
    out["cli in process, 16384-row chunks"] = _cli(work, "cli, --in-process, 16384-row chunks",
                                                   "--in-process", "--chunk-rows", "16384")
    if args.cap:
        capped = {**os.environ, "CUPY_GPU_MEMORY_LIMIT": args.cap}
        out["cli capped"] = _cli(work, f"cli, cap {args.cap}", "--local-cluster", env=capped)
        out["cli in process capped"] = _cli(work, f"cli, --in-process, cap {args.cap}",
                                            "--in-process", env=capped)
    t0 = time.perf_counter()
    cluster = dg.local_cluster()
    client = cluster.__enter__()
    out["cluster start"] = round(time.perf_counter() - t0, 3)
    for rep in range(2):
        job = similarity_job(work / "fps.npy", work / "nn_cluster.npz", packed=True, top_k=10,
                             overwrite=True)
        t0 = time.perf_counter()
        out[f"job on the cluster {rep}"] = [round(job(None)["seconds"], 3),
                                            round(time.perf_counter() - t0, 3)]
    t0 = time.perf_counter()
    where_it_ran(client)
    out["report"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    cluster.__exit__(None, None, None)
    out["cluster close"] = round(time.perf_counter() - t0, 3)
    for rep in range(2):
        job = similarity_job(work / "fps.npy", work / "nn_threads.npz", packed=True, top_k=10,
                             overwrite=True)
        out[f"job without a cluster {rep}"] = round(job(None)["seconds"], 3)
    with np.load(work / "nn_cluster.npz") as a, np.load(work / "nn_threads.npz") as b:
        out["same results"] = all(bool(np.array_equal(a[k], b[k])) for k in a)
    print(json.dumps(out), flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
