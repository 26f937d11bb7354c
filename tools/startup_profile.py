"""Where a command's fixed costs go: imports, a local cluster's start, first-use compiles.

    python3 tools/startup_profile.py --rows 65536 --out $OUT/startup

Writes, under ``--out``:

* ``importtime-cli.txt``: the 40 slowest imports (cumulative) of ``dask_gpuchunk.cli``, from
  ``python -X importtime``;
* ``first-use.txt``: a similarity job (``--in-process``, packed, top-10) in a fresh process
  with empty CuPy, numba and package caches (in one thread, profiled), then again with the
  caches it filled (Dask's threads): seconds each; ``first-use-profile.txt``: the first run's
  60 costliest calls (cumulative, cProfile);
* ``cluster.txt``: the parts of a local cluster's start timed one by one in this process:
  ``import distributed, dask_cuda``; a bare ``LocalCUDACluster`` over TCP (``LocalCluster``
  without a GPU); the same with TLS credentials; the worker setup's parts (the package's
  imports, the whole setup, numba's threading layer), each registered alone on a bare cluster;
  ``dask_gpuchunk.local_cluster()`` whole; how long its worker process took from its start to
  its first answer; each close.

The ``if __name__ == "__main__"`` guard matters: a local cluster's workers are spawned
processes that import this file again.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from distributed import WorkerPlugin


def _importtime(out: Path) -> None:
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", "import dask_gpuchunk.cli"],
                       capture_output=True, text=True)
    rows = []
    for line in p.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    rows.sort(reverse=True)
    (out / "importtime-cli.txt").write_text(
        "cumulative us | module\n" + "\n".join(f"{us:>12} | {name}" for us, name in rows[:40]))
    print("imports:", rows[:5], flush=True)


def _first_use(out: Path, fps: Path) -> None:
    caches = Path(tempfile.mkdtemp(prefix="fresh-caches-"))
    env = {**os.environ, "CUPY_CACHE_DIR": str(caches / "cupy"),
           "NUMBA_CACHE_DIR": str(caches / "numba"),
           "XDG_CACHE_HOME": str(caches / "xdg")}
    lines = []
    for label, profile in (("fresh caches", True), ("caches filled", False)):
        prof = caches / "first.prof"
        # cProfile sees one thread: the profiled run computes in it (Dask's synchronous
        # scheduler), the other as a user's would.
        run_env = {**env, "DASK_SCHEDULER": "synchronous"} if profile else env
        cmd = [sys.executable] + (["-m", "cProfile", "-o", str(prof)] if profile else []) + [
            "-m", "dask_gpuchunk", "similarity", str(fps), "--packed", "--top-k", "10",
            "-o", str(caches / "nn.npz"), "--overwrite", "--in-process", "--json"]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env=run_env, timeout=400)
        seconds = time.perf_counter() - t0
        lines.append(f"{label}: {seconds:.2f} s end to end, rc {p.returncode}, "
                     f"{p.stdout.strip().splitlines()[-1:] if p.stdout.strip() else p.stderr[-800:]}")
        print(lines[-1], flush=True)
        if profile and prof.exists():
            with open(out / "first-use-profile.txt", "w") as f:
                pstats.Stats(str(prof), stream=f).sort_stats("cumulative").print_stats(60)
    (out / "first-use.txt").write_text("\n".join(lines) + "\n")


class _ImportsOnly(WorkerPlugin):
    """A worker plugin that imports what dask_gpuchunk's setup imports, and nothing more."""

    name = "startup-imports"

    def setup(self, worker) -> None:
        importlib.import_module("dask_gpuchunk.worker")


class _ThreadingLayer(WorkerPlugin):
    """A worker plugin that starts numba's threading layer (a first parallel kernel)."""

    name = "startup-threading-layer"

    def setup(self, worker) -> None:
        from dask_gpuchunk import backend

        backend._threadsafe_layer()


def _cluster(out: Path) -> None:
    lines = []

    def note(label: str, t0: float) -> None:
        lines.append(f"{label}: {time.perf_counter() - t0:.3f} s")
        print(lines[-1], flush=True)

    t0 = time.perf_counter()
    import distributed
    from distributed import Client

    from dask_gpuchunk.devices import gpu_count
    if gpu_count():
        import dask_cuda
        note(f"import distributed, dask_cuda {dask_cuda.__version__}", t0)
        factory = dask_cuda.LocalCUDACluster
    else:
        note("import distributed", t0)
        factory = distributed.LocalCluster
    import dask_gpuchunk as dg
    from dask_gpuchunk.cluster import temporary_security
    from dask_gpuchunk.worker import WorkerSetup

    def boot(dask_worker=None) -> float:  # seconds from the worker process's start to now
        import psutil
        return time.time() - psutil.Process().create_time()

    for label, kwargs in (("bare, tcp", {"protocol": "tcp://"}),
                          ("bare, tls", {"security": temporary_security()})):
        t0 = time.perf_counter()
        cluster = factory(host="127.0.0.1", dashboard_address="127.0.0.1:0", **kwargs)
        note(f"{label}: start", t0)
        t0 = time.perf_counter()
        client = Client(cluster)
        lines.append(f"{label}: worker process up {client.run(boot)} s before the first answer")
        note(f"{label}: client + first run", t0)
        t0 = time.perf_counter()
        client.close()
        cluster.close()
        note(f"{label}: close", t0)
    # The worker setup's parts, each registered alone on a bare cluster of one worker.
    for label, part in (("imports", _ImportsOnly()), ("setup whole", WorkerSetup()),
                        ("numba threading layer", _ThreadingLayer())):
        cluster = factory(host="127.0.0.1", dashboard_address="127.0.0.1:0", protocol="tcp://",
                          **({} if gpu_count() else {"n_workers": 1}))
        client = Client(cluster)
        t0 = time.perf_counter()
        client.register_plugin(part)
        note(f"setup part {label}: register", t0)
        t0 = time.perf_counter()
        client.close()
        cluster.close()
        note(f"setup part {label}: close", t0)
    t0 = time.perf_counter()
    with dg.local_cluster(dashboard_address=None) as client:
        note("dask_gpuchunk.local_cluster(): start", t0)
        lines.append(f"its worker process up {client.run(boot)} s")
        t0 = time.perf_counter()
    note("dask_gpuchunk.local_cluster(): close", t0)
    (out / "cluster.txt").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip", default="", help="comma-separated: imports,first-use,cluster")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(args.skip.split(","))
    if "imports" not in skip:
        _importtime(args.out)
    if "first-use" not in skip:
        import numpy as np

        from dask_gpuchunk.bench.similarity import make_fingerprints
        fps = Path(tempfile.mkdtemp(prefix="startup-")) / "fps.npy"
        np.save(fps, make_fingerprints(args.rows, 2048, 0.075, on_gpu=False))
        _first_use(args.out, fps)
    if "cluster" not in skip:
        _cluster(args.out)


if __name__ == "__main__":
    main()
