"""The ``dask-gpuchunk`` command line (also ``python -m dask_gpuchunk``).

``info``
    Versions, visible GPUs, and which execution paths are active on this machine.
``bench elementwise``
    A 1,000,000 x 500 float64 product and an RK4-style function through every path, beside the
    peers and the limits measured in the same run; prints a table and writes JSON and PNG.
``bench gram``
    The Gram matrix of bit-packed 0/1 data: every method, the peers and the popcount
    ceiling, as bit multiply-accumulates per second; prints a table and writes JSON and PNG.
``bench similarity``
    All-pairs and queries x database top-k and threshold search over binary fingerprints,
    beside the dense counts, CuPy, NumPy, RDKit and the 1-bit tensor-core ceiling, in pairs
    per second; prints a table and writes JSON and PNG.
``clean DIR``
    The temporary files that killed jobs left in DIR: listed, and removed where their writer
    is gone.
``multiply A.npy B.npy -o C.npy``, ``gram BITS.npy -o G.npy``, ``demo``
    (inputs and outputs ``.npy`` files or Zarr stores, chosen by the name: ``.zarr``)
    Jobs from files to files on a cluster: a local one (every GPU of this machine, or its CPU
    cores) or an existing one (``--scheduler-file`` / ``--scheduler-address``). Exit status:
    0 done; 1 the job failed while running; 2 bad command-line usage; 3 an input is wrong;
    4 the output cannot be written (or does not fit its file system); 5 the cluster or a GPU
    is not available; 130 Ctrl-C; 143 SIGTERM. Errors are one
    line on stderr; nothing is written where a job fails.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import logging
import os
import platform
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import click
from dask.utils import format_bytes

from . import __version__, jobs
from .alias_tasks import resolving_aliases
from .budget import DeviceBudgetError, cap_device_pool
from .cluster import collector_paused, connect, local_cluster, parse_memory_limit
from .config import check_settings
from .devices import GPUNotAvailableError, _probe_gpus, gpu_available, gpu_count
from .fingerprint_files import FINGERPRINT_KINDS
from .gram_blocks import METHODS, compute_capability, resolve_method
from .partials import partials_in, remove_partials
from .joining import PlainTransportWarning, write_credentials
from .progress import format_rate
from .jobs import (
    ClusterError,
    JobError,
    gram_job,
    multiply_job,
    sent_by_workers,
    staged_by_workers,
    similarity_job,
    watch_device_memory,
    where_it_ran,
)

__all__ = ["main", "environment"]


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:
        return None
    try:  # the installed distribution's version (click deprecates its __version__)
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:  # cupy is installed as cupy-cuda12x, ...
        return str(getattr(mod, "__version__", "?"))


def environment() -> dict[str, Any]:
    """What ``dask-gpuchunk info`` reports, as a dict.

    Examples
    --------
    >>> env = environment()
    >>> sorted(env["paths"])
    ['auto', 'cpu', 'gpu-device', 'gpu-host', 'gram']
    """
    versions = {"dask_gpuchunk": __version__, "python": platform.python_version()}
    for name in ("numpy", "numba", "numba_cuda", "dask", "distributed", "cupy", "dask_cuda", "click"):
        versions[name] = _version(name)
    count, reason = _probe_gpus()
    gpus = []
    if count:
        import cupy

        for i in range(count):
            p = cupy.cuda.runtime.getDeviceProperties(i)
            gpus.append({"index": i, "name": p["name"].decode(), "memory_bytes": int(p["totalGlobalMem"]),
                         "compute_capability": f"{p['major']}.{p['minor']}",
                         "multiprocessors": int(p["multiProcessorCount"])})
    import numba

    try:
        from numba.cuda import config as cuda_config

        simulator = bool(cuda_config.ENABLE_CUDASIM)
    except Exception:
        simulator = False
    cpu = f"numba njit(parallel=True), {numba.config.NUMBA_NUM_THREADS} threads"
    gpu_state = "active" if count else f"inactive: {reason}"
    paths = {
        "cpu": f"active: {cpu}",
        "gpu-host": f"{gpu_state}" + ("; NumPy chunks staged through pinned buffers, "
                                      "4 chunks per GPU at once, each on its own stream" if count else ""),
        "gpu-device": f"{gpu_state}" + ("; CuPy chunks computed on the device, queued on the "
                                        "current stream like CuPy operations" if count else ""),
        "auto": ("CuPy chunks on the GPU; NumPy chunks on the device the measured rule picks "
                 "(dask_gpuchunk.placement)") if count else "every chunk on the CPU (no GPU visible)",
    }
    if count:
        auto = resolve_method("auto", on_gpu=True)
        cc = "%d.%d" % compute_capability()
        why = {"wgmma": " (a Hopper: warpgroup 1-bit MMA; dg.gram measured 2.8 x bmma on a "
                        "long-row Gram, H200; top-k and threshold similarity run bmma's "
                        "fused kernel)",
               "bmma": f" (compute capability {cc}: wgmma needs 9.0)",
               "int8": f" (no 1-bit MMA on this GPU: compute capability {cc} < 8.0)",
               "popcount": f" (no int8 or 1-bit MMA on this GPU: compute capability {cc} < 7.5)"}
        paths["gram"] = (f"GPU methods: popcount, int8 (cuBLAS int8 tensor cores, cc >= 7.5), "
                         f"bmma (1-bit tensor cores, cc >= 8.0), wgmma (Hopper's warpgroup "
                         f"1-bit tensor cores, cc 9.0); method='auto' uses {auto}{why[auto]}; "
                         f"NumPy chunks computed on the GPU")
    else:
        paths["gram"] = "popcount on the CPU (method='auto'); int8, bmma and wgmma need a GPU"
    return {
        "versions": versions,
        "gpus": gpus,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "numba_cuda_simulator": simulator,
        "cpu_count": os.cpu_count(),
        "paths": paths,
    }


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dask-gpuchunk")
def main() -> None:
    """Numba CUDA kernels over Dask arrays larger than GPU memory."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of text.")
def info(as_json: bool) -> None:
    """Versions, visible GPUs and the active execution paths."""
    env = environment()
    if as_json:
        click.echo(json.dumps(env))
        return
    click.echo("versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v))
    missing = [k for k, v in env["versions"].items() if v is None]
    if missing:
        click.echo("not installed: " + ", ".join(missing))
    if env["gpus"]:
        for g in env["gpus"]:
            click.echo(f"GPU {g['index']}: {g['name']}, {g['memory_bytes'] / 2**30:.1f} GiB, "
                       f"compute capability {g['compute_capability']}, {g['multiprocessors']} SMs")
    else:
        click.echo("GPUs: none visible")
    if env["numba_cuda_simulator"]:
        click.echo("numba CUDA simulator: ON (NUMBA_ENABLE_CUDASIM=1)")
    click.echo(f"CPU cores: {env['cpu_count']}")
    click.echo("execution paths:")
    for name, state in env["paths"].items():
        click.echo(f"  {name:10s} {state}")


@main.group()
def bench() -> None:
    """Benchmarks: ours, the peers and the limits, side by side in one run."""


@bench.command("elementwise")
@click.option("--rows", default=1_000_000, show_default=True, help="Rows of each input.")
@click.option("--cols", default=500, show_default=True, help="Columns of each input.")
@click.option("--chunk-mb", default=200.0, show_default=True, help="Chunk size in MB (rows are split).")
@click.option("--rk4-rows", default=500_000, show_default=True, help="Rows for the RK4 table.")
@click.option("--repeat", default=3, show_default=True, help="Timed runs per entry (median reported).")
@click.option("--skip", multiple=True, help="Skip entries whose name contains this (repeatable).")
@click.option("--out-dir", default=".", show_default=True, type=click.Path(file_okay=False),
              help="Where to write bench-elementwise.json and .png.")
@click.option("--device-budget", help="Run under a device-memory cap, as on a GPU of this size "
              "(8GiB, 2GiB): caps CuPy's pool here and in any workers (CUPY_GPU_MEMORY_LIMIT).")
@click.option("--loop-sizes", default="16777216,10000000", show_default=True,
              help="Seed 002's RK4 loop on the GPU at these numbers of complex64 values per "
              "array (a square number runs as a square); '' skips it.")
@click.option("--loop-steps", default=20, show_default=True, help="Steps per timed loop.")
def bench_elementwise(rows: int, cols: int, chunk_mb: float, rk4_rows: int, repeat: int,
                      skip: tuple[str, ...], out_dir: str, device_budget: str | None,
                      loop_sizes: str, loop_steps: int) -> None:
    """A float64 product, an RK4-style function through every path, and seed 002's
    device-resident loop, with limits."""
    if rows < 1 or cols < 1 or rk4_rows < 1 or repeat < 1 or chunk_mb <= 0 or loop_steps < 1:
        raise click.BadParameter("sizes, --repeat, --loop-steps and --chunk-mb must be positive")
    try:
        sizes = tuple(int(v) for v in loop_sizes.split(",") if v.strip())
        if any(v < 1 for v in sizes):
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"--loop-sizes takes positive integers, got {loop_sizes!r}") from None
    _apply_device_budget(device_budget)
    from .bench.elementwise import host_memory_needed, rows_that_fit, run
    from .bench.limits import available_host_memory
    from .bench.report import format_table, save

    gpu = gpu_available()
    need, have = host_memory_needed(rows, cols, rk4_rows, gpu), available_host_memory()
    if have is not None and need > 0.9 * have:
        fit_rows, fit_rk4 = rows_that_fit(int(0.8 * have), cols, gpu)
        click.echo(f"error: bench elementwise at {rows:,} x {cols} needs about {need / 1e9:.0f} "
                   f"GB of host memory and {have / 1e9:.0f} GB are available: "
                   f"--rows {fit_rows} --rk4-rows {fit_rk4} fits "
                   "(--rows 100000 --rk4-rows 50000 runs in about a minute)", err=True)
        sys.exit(2)
    report = run(rows=rows, cols=cols, chunk_mb=chunk_mb, rk4_rows=rk4_rows, repeat=repeat,
                 skip=skip, log=lambda s: click.echo(s, err=True), loop_sizes=sizes,
                 loop_steps=loop_steps)
    click.echo(format_table(report))
    for path in save(report, out_dir, "bench-elementwise", log=lambda s: click.echo(s, err=True)):
        click.echo(f"wrote {path}", err=True)


def _apply_device_budget(value: str | None) -> None:
    if value is None:
        return
    from dask.utils import parse_bytes


    try:
        nbytes = parse_bytes(value)
        if nbytes <= 0:
            raise ValueError
    except (ValueError, TypeError):
        raise click.BadParameter(f"--device-budget: cannot read {value!r} as a positive size "
                                 "(8GiB, 2GiB)") from None
    # This command's own process and the cluster workers it starts (which inherit its
    # environment): the GPU behaves as a card of that size. Asked for by the option.
    os.environ["CUPY_GPU_MEMORY_LIMIT"] = str(int(nbytes))
    cap_device_pool(nbytes)
    click.echo(f"device budget: CuPy's pool capped at {nbytes:,} bytes", err=True)


def _tile(value: str) -> tuple[int, int, int, int, int]:
    parts = tuple(int(v) for v in value.split(","))
    if len(parts) != 5 or min(parts) < 1:
        raise click.BadParameter(f"--tile takes five positive integers TY,TX,RM,RN,TK; got {value!r}")
    return parts  # type: ignore[return-value]


@bench.command("gram")
@click.option("--n", "n", default=16384, show_default=True, help="Rows of the 0/1 matrix.")
@click.option("--k", "k", default=131072, show_default=True, help="Bits per row.")
@click.option("--chunk-rows", multiple=True, type=int, help="Rows per chunk for dg.gram "
              "(repeatable; default 4096).")
@click.option("--tile", "tiles", multiple=True, help="Extra popcount tile shape TY,TX,RM,RN,TK to "
              "time (repeatable).")
@click.option("--bitloop-rows", "seed_rows", default=4096, show_default=True, help="Rows for the byte-packed bit-loop peer "
              "(timed there and scaled by N**2).")
@click.option("--cpu-rows", default=1024, show_default=True, help="Rows for our CPU path (scaled).")
@click.option("--repeat", default=3, show_default=True, help="Timed runs per entry (median reported).")
@click.option("--skip", multiple=True, help="Skip entries whose name contains this (repeatable).")
@click.option("--out-dir", default=".", show_default=True, type=click.Path(file_okay=False),
              help="Where to write bench-gram.json and .png.")
@click.option("--device-budget", help="Run under a device-memory cap, as on a GPU of this size "
              "(8GiB, 2GiB): caps CuPy's pool here and in any workers (CUPY_GPU_MEMORY_LIMIT).")
def bench_gram(n: int, k: int, chunk_rows: tuple[int, ...], tiles: tuple[str, ...], seed_rows: int,
               cpu_rows: int, repeat: int, skip: tuple[str, ...], out_dir: str,
               device_budget: str | None) -> None:
    """The Gram matrix A·Aᵀ of 0/1 data: every method, the peers, the popcount ceiling."""
    if min(n, k, seed_rows, cpu_rows, repeat, *(chunk_rows or (1,))) < 1:
        raise click.BadParameter("sizes, row counts and --repeat must be positive")
    _apply_device_budget(device_budget)
    from .bench.gram import format_table as gram_table
    from .bench.gram import run
    from .bench.report import save

    report = run(n=n, k=k, chunk_rows=chunk_rows or (4096,), tiles=[_tile(t) for t in tiles],
                 seed_rows=seed_rows, cpu_rows=cpu_rows, repeat=repeat, skip=skip,
                 log=lambda s: click.echo(s, err=True))
    click.echo(gram_table(report))
    for path in save(report, out_dir, "bench-gram", log=lambda s: click.echo(s, err=True)):
        click.echo(f"wrote {path}", err=True)


@bench.command("similarity")
@click.option("--n", "n", default=1_000_000, show_default=True, help="Fingerprints.")
@click.option("--bits", default=2048, show_default=True, help="Bits per fingerprint (a "
              "multiple of 8).")
@click.option("--density", default=0.075, show_default=True, help="Fraction of bits set.")
@click.option("--queries", default=10_000, show_default=True, help="Queries for the queries x "
              "database rows (0: none).")
@click.option("--chunk-rows", default=32768, show_default=True, help="Rows per chunk.")
@click.option("--top-k", "k", default=10, show_default=True, help="Neighbours per row.")
@click.option("--threshold", default=0.7, show_default=True, help="Tanimoto threshold.")
@click.option("--peer-rows", default=65536, show_default=True, help="Database rows the peers "
              "(CuPy, NumPy, RDKit) are timed on.")
@click.option("--repeat", default=2, show_default=True, help="Timed runs per entry (median).")
@click.option("--skip", multiple=True, help="Skip entries whose name contains this "
              "(repeatable).")
@click.option("--out-dir", default=".", show_default=True, type=click.Path(file_okay=False),
              help="Where to write bench-similarity.json and .png.")
@click.option("--device-budget", help="Run under a device-memory cap, as on a GPU of this size "
              "(8GiB, 2GiB): caps CuPy's pool here and in any workers (CUPY_GPU_MEMORY_LIMIT).")
def bench_similarity(n: int, bits: int, density: float, queries: int, chunk_rows: int, k: int,
                     threshold: float, peer_rows: int, repeat: int, skip: tuple[str, ...],
                     out_dir: str, device_budget: str | None) -> None:
    """Tanimoto top-k and threshold search over binary fingerprints, with peers and a
    ceiling."""
    if min(n, bits, chunk_rows, k, peer_rows, repeat) < 1 or queries < 0:
        raise click.BadParameter("sizes, --top-k and --repeat must be positive")
    if bits % 8:
        raise click.BadParameter(f"--bits must be a multiple of 8, got {bits}")
    if not 0 < density < 1 or not 0 <= threshold <= 1:
        raise click.BadParameter("--density must lie in (0, 1) and --threshold in [0, 1]")
    if k >= n:
        raise click.BadParameter(f"--top-k must be below --n ({n}), got {k}")
    _apply_device_budget(device_budget)
    from .bench.report import save
    from .bench.similarity import format_table as similarity_table
    from .bench.similarity import run

    report = run(n=n, bits=bits, density=density, queries=queries, chunk_rows=chunk_rows, k=k,
                 threshold=threshold, peer_rows=peer_rows, repeat=repeat, skip=skip,
                 log=lambda s: click.echo(s, err=True))
    click.echo(similarity_table(report))
    for path in save(report, out_dir, "bench-similarity", log=lambda s: click.echo(s, err=True)):
        click.echo(f"wrote {path}", err=True)


# ---- jobs --------------------------------------------------------------------------------------


def _cluster_options(func: Callable) -> Callable:
    options = [
        click.option("--scheduler-file", type=click.Path(dir_okay=False),
                      help="Join the cluster whose scheduler wrote this file (batch jobs)."),
        click.option("--scheduler-address", help="Join the cluster at this address "
                     "(tls://host:8786)."),
        click.option("--tls-ca-file", type=click.Path(dir_okay=False),
                     help="Joined cluster: the certificate authority of its TLS credentials "
                     "(dask-gpuchunk tls-credentials makes them)."),
        click.option("--tls-cert", type=click.Path(dir_okay=False),
                     help="Joined cluster: this job's TLS certificate."),
        click.option("--tls-key", type=click.Path(dir_okay=False),
                     help="Joined cluster: this job's TLS key."),
        click.option("--workers", "--wait-workers", "workers", type=click.IntRange(min=1),
                     help="Joined cluster: wait until this many workers have joined before "
                     "the job starts [default: 1]."),
        click.option("--worker-timeout", type=click.FloatRange(min=0), default=300.0,
                     show_default=True, help="Joined cluster: seconds to wait for --workers; "
                     "fewer by then ends the job (exit 5, nothing written). Also how long a "
                     "job waits for a cluster that lost its last worker."),
        click.option("--gpus", help="Local cluster: how many GPUs (a number) or which (0,2); "
                     "default every visible GPU."),
        click.option("--device-memory-limit", default="default", show_default=True,
                     help="Local cluster: per GPU, spill to host memory beyond this (8GB, 0.8)."),
        click.option("--memory-limit", default="auto", show_default=True,
                     help="Local cluster: per worker, spill to disk beyond this (64GB, 0.5)."),
        click.option("--spill-dir", type=click.Path(file_okay=False),
                     help="Local cluster: where workers spill to disk."),
        click.option("--threads-per-gpu", type=click.IntRange(min=1),
                     help="Local cluster: Dask threads per GPU worker (CPU-only: per worker) "
                     "[default: cores / GPUs]."),
        click.option("--no-tls", is_flag=True,
                     help="Local cluster: plain TCP on loopback instead of TLS with throwaway "
                     "credentials (any local user could then connect and run code as you)."),
        click.option("--protocol", type=click.Choice(["tls", "tcp", "ucx"]), default="tls",
                     show_default=True,
                     help="Local cluster: how its processes talk. ucx sends device chunks GPU "
                     "to GPU (needs distributed-ucxx) but has no encryption, like tcp (= "
                     "--no-tls): any local user who reaches it could run code as you."),
        click.option("--in-process", is_flag=True,
                     help="Run the job in this process with Dask's threads instead of starting "
                     "a local cluster: no start-up to wait for (several seconds), but nothing "
                     "spills to host memory or disk, so what the job keeps on the GPU must fit "
                     "it (CUDA_VISIBLE_DEVICES picks the GPU)."),
        click.option("--device", type=click.Choice(["auto", "gpu", "cpu"]), default="auto",
                     show_default=True, help="Where chunks run."),
        click.option("--json", "as_json", is_flag=True,
                     help="Print one JSON line summarising the job, and no progress bar."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@contextlib.contextmanager
def _cluster(opts: dict[str, Any], quiet: bool = False) -> Iterator[Any]:
    import dask

    # A joined cluster that loses its last worker fails the job after the same time.
    with dask.config.set({"gpuchunk.no-workers-timeout": opts["worker_timeout"]}), \
            _started_cluster(opts, quiet) as client:
        yield client


#: The options that configure a local cluster or name one to join, with their defaults.
_CLUSTER_DEFAULTS = {"gpus": None, "spill_dir": None, "threads_per_gpu": None, "no_tls": False,
                     "protocol": "tls",
                     "scheduler_file": None, "scheduler_address": None, "workers": None,
                     "device_memory_limit": "default", "memory_limit": "auto",
                     "tls_ca_file": None, "tls_cert": None, "tls_key": None}


def _cluster_options_given(opts: dict[str, Any]) -> list[str]:
    """The cluster options of ``opts`` given other than their defaults, as their flags."""
    return [f"--{k.replace('_', '-')}" for k, default in _CLUSTER_DEFAULTS.items()
            if opts.get(k, default) != default]


@contextlib.contextmanager
def _started_cluster(opts: dict[str, Any], quiet: bool = False) -> Iterator[Any]:
    for name in ("scheduler_file", "scheduler_address"):
        if opts.get(name) is not None and not opts[name].strip():
            raise click.UsageError(f"--{name.replace('_', '-')} is empty")
    joined = opts["scheduler_file"] or opts["scheduler_address"]
    if opts["scheduler_file"] and opts["scheduler_address"]:
        raise click.UsageError("give --scheduler-file or --scheduler-address, not both")
    tls = [opts.get(k) for k in ("tls_ca_file", "tls_cert", "tls_key")]
    if any(tls) and not joined:
        raise click.UsageError("--tls-ca-file, --tls-cert and --tls-key are a joined cluster's "
                               "credentials; a local cluster makes its own")
    if any(tls) and not all(tls):
        raise click.UsageError("give all three of --tls-ca-file, --tls-cert and --tls-key")
    local_only = [f"--{k.replace('_', '-')}" for k in ("gpus", "spill_dir", "threads_per_gpu")
                  if opts[k] is not None] + (["--no-tls"] if opts.get("no_tls") else []) + (
                      ["--protocol"] if opts.get("protocol", "tls") != "tls" else [])
    if opts.get("no_tls") and opts.get("protocol", "tls") != "tls":
        raise click.UsageError("--no-tls is --protocol tcp; give one of them")
    if joined and local_only:
        raise click.UsageError(f"{', '.join(local_only)} configure a local cluster; the joined "
                               "cluster's workers are configured where they are started")
    if opts.get("in_process"):
        cluster_options = _cluster_options_given(opts)
        if cluster_options:
            raise click.UsageError(f"--in-process runs the job without a cluster; "
                                   f"{', '.join(cluster_options)} configure one")
        yield None  # this process's threads; the job finds no client
        return
    if not joined and opts["workers"] is not None:
        raise click.UsageError("--workers waits for the workers of a joined cluster "
                               "(--scheduler-file or --scheduler-address); a local cluster "
                               "starts its own")
    try:
        if opts["device_memory_limit"] != "default":
            parse_memory_limit(opts["device_memory_limit"], "--device-memory-limit")
        parse_memory_limit(opts["memory_limit"], "--memory-limit")
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if joined:
        try:
            security = None
            if all(tls):
                from distributed import Security

                security = Security(tls_ca_file=tls[0], tls_client_cert=tls[1],
                                    tls_client_key=tls[2], require_encryption=True)
            client = connect(scheduler_file=opts["scheduler_file"], address=opts["scheduler_address"],
                             timeout=15, workers=opts["workers"] or 1,
                             worker_timeout=opts["worker_timeout"], security=security,
                             log=None if quiet else lambda s: click.echo(s, err=True))
        except (OSError, TimeoutError, ValueError) as exc:
            raise ClusterError(f"cannot join the cluster: {exc}".splitlines()[0]) from None
        # The job runs outside that except: its own errors (a ValueError of its arguments, an
        # OSError writing) keep their exit codes instead of reading as the cluster's.
        try:
            with resolving_aliases():  # the job's graphs, not this process's dask settings
                yield client
        finally:
            with collector_paused():
                client.close()
        return
    protocol = "tcp" if opts["no_tls"] else opts.get("protocol", "tls")
    if protocol != "tls":
        warnings.warn(f"the local cluster talks plain {protocol.upper()} on loopback: any user "
                      "of this machine who reaches it can run code as you",
                      PlainTransportWarning, stacklevel=2)
    try:
        gpus: Any = opts["gpus"]
        if gpus is not None and gpus.strip().isdigit() and "," not in gpus:
            gpus = int(gpus)
        with _workers_ignore_sigint():
            cluster = local_cluster(
                gpus=gpus, device_memory_limit=opts["device_memory_limit"],
                memory_limit=opts["memory_limit"], spill_dir=opts["spill_dir"],
                # A job's chunks are all staged from files by the package, their device memory
                # bounded by its staging slots and budget: a thread per core copies at full
                # rate.
                threads_per_gpu=opts["threads_per_gpu"] or "cores",
                silence_logs=logging.CRITICAL, dashboard_address=None,
                secure=protocol == "tls", **({"protocol": "ucx"} if protocol == "ucx" else {}),
            )
            client = cluster.__enter__()
    except (OSError, TimeoutError, GPUNotAvailableError, ValueError, ImportError) as exc:
        raise ClusterError(f"cannot start or join the cluster: {exc}".splitlines()[0]) from None
    try:
        yield client
    finally:
        with contextlib.suppress(Exception):
            cluster.__exit__(None, None, None)


@contextlib.contextmanager
def _workers_ignore_sigint() -> Iterator[None]:
    """Start the local cluster's processes with SIGINT ignored (they inherit it): Ctrl-C in a
    terminal reaches the whole foreground process group, and workers stopped by it each print
    a traceback. The job's own process takes it and stops them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _progress(enabled: bool) -> Callable[..., None] | None:
    """A progress bar on stderr, with the rate and the time left: ``draw(done, total,
    unit="chunks")``, drawn again at most every tenth of a second and once more at the end."""
    if not enabled:
        return None
    width = 30
    started: list[float] = []
    last = [float("-inf")]
    finished: list[int] = []

    def draw(done: int, total: int, unit: str = "chunks") -> None:
        now = time.perf_counter()
        if not started:
            started.append(now)
        if (done < total and now - last[0] < 0.1) or finished == [total]:
            return  # drawn a moment ago, or already drawn finished
        last[0] = now
        if done == total:
            finished[:] = [total]
        filled = width * done // max(total, 1)
        line = f"\r[{'#' * filled}{' ' * (width - filled)}] {done}/{total} {unit}"
        elapsed = now - started[0]
        if done and elapsed > 0:
            line += f", {format_rate(done / elapsed)} {unit}/s"
            if done < total:
                line += f", {_duration((total - done) * elapsed / done)} left"
            else:
                line += f" in {_duration(elapsed)}"
        sys.stderr.write(f"{line}\033[K")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return draw


def _duration(seconds: float) -> str:
    """``"42 s"``, ``"3 min 20 s"``, ``"2 h 05 min"``.

    Examples
    --------
    >>> _duration(41.6), _duration(200), _duration(7500)
    ('42 s', '3 min 20 s', '2 h 05 min')
    """
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Terminated(KeyboardInterrupt):
    """SIGTERM (a batch scheduler's time limit or cancel), raised where the job is, so that it
    cleans up as for Ctrl-C."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def _warn_in_one_line(message: Any, category: Any, filename: str, lineno: int,
                      file: Any = None, line: Any = None) -> None:
    click.echo(f"warning: {message}", err=True)


def _run_job(as_json: bool, opts: dict[str, Any], prepare: Callable[[], Callable]) -> None:
    """Check the job (``prepare()``, before any cluster starts), run it on the cluster the
    options describe, report; map errors to exit codes with one line on stderr. SIGTERM ends
    it as Ctrl-C does (exit 143); warnings are one line each."""
    _quiet_distributed_logs()
    previous_term = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warn_in_one_line
            summary = _job_summary(opts, prepare, quiet=as_json)
    finally:
        signal.signal(signal.SIGTERM, previous_term)
    if as_json:
        click.echo(json.dumps(summary, default=str))
    else:
        _print_summary(summary)


def _job_summary(opts: dict[str, Any], prepare: Callable[[], Callable], quiet: bool
                 ) -> dict[str, Any]:
    """:func:`_run_job`'s run: the summary, or one line on stderr and the exit status."""
    try:
        check_settings()
        job = prepare()
        with _cluster(opts, quiet=quiet) as client:
            watch_device_memory(client)
            sent_before = sent_by_workers(client)
            staged_before = staged_by_workers(client)
            try:
                summary = job(_progress(not quiet and sys.stderr.isatty()))
            except Exception as exc:
                if client is not None and client.status != "running":  # reconnecting, closed
                    raise _ClusterLost(type(exc).__name__) from None
                raise
            summary["where"] = where_it_ran(client)
            # Per worker, bytes it sent to the others (and to this process) during the job,
            # and what its host-fed chunks sent to its GPU.
            summary["where"]["sent_by_workers"] = sent_by_workers(client, sent_before)
            summary["where"]["staged_by_workers"] = staged_by_workers(client, staged_before)
        return summary
    except click.ClickException:
        raise
    except JobError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except GPUNotAvailableError as exc:  # --device gpu, --method int8/bmma without a GPU
        click.echo(f"error: {str(exc).splitlines()[0]}", err=True)
        sys.exit(ClusterError.exit_code)
    except DeviceBudgetError as exc:  # a chunk larger than the device budget, found early
        click.echo(f"error: {str(exc).splitlines()[0]}; nothing was written", err=True)
        sys.exit(2)
    except (ValueError, TypeError) as exc:  # bad arguments found by the job's checks
        click.echo(f"error: {str(exc).splitlines()[0]}", err=True)
        sys.exit(2)
    except Terminated:
        click.echo("error: terminated (SIGTERM); nothing was written", err=True)
        sys.exit(128 + signal.SIGTERM)
    except KeyboardInterrupt:
        click.echo("error: interrupted; nothing was written", err=True)
        sys.exit(130)
    except Exception as exc:  # the job failed on the cluster: one line, not a traceback
        if isinstance(exc, _ClusterLost) or _cluster_lost(exc):
            what = str(exc) if isinstance(exc, _ClusterLost) else type(exc).__name__
            click.echo("error: the job lost its cluster: the scheduler stopped or cannot be "
                       f"reached ({what}); nothing was written", err=True)
            sys.exit(ClusterError.exit_code)
        if type(exc).__name__ == "KilledWorker":  # a worker died under a chunk, again and again
            click.echo("error: the job failed: workers died while running a chunk (most often "
                       "out of host memory): use a smaller --chunk-size (--chunk-rows for "
                       "gram) or a higher --memory-limit; nothing was written", err=True)
            sys.exit(1)
        text = str(exc).splitlines()[0] if str(exc) else ""
        click.echo(f"error: the job failed: {type(exc).__name__}: {text}; nothing was written",
                   err=True)
        sys.exit(1)


class _ClusterLost(Exception):
    """A job failed while its client had lost the scheduler: the cause is the cluster's."""


def _cluster_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the job's client lost its scheduler (killed, or the network)."""
    name = type(exc).__name__
    return (name in ("CommClosedError", "StreamClosedError")
            or (name in ("FutureCancelledError", "CancelledError")
                and "scheduler-connection-lost" in str(exc)))


def _quiet_distributed_logs() -> None:
    """Only critical records of distributed's loggers reach the terminal: a job's errors are
    one line of its own (a lost scheduler made distributed.client print a traceback)."""
    for name in ["distributed", *logging.Logger.manager.loggerDict]:
        if name == "distributed" or name.startswith("distributed."):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _print_summary(summary: dict[str, Any]) -> None:
    where = summary.get("where", {})
    place = (f"on {where.get('cluster')}: {where.get('workers')} worker(s), "
             f"{where.get('threads')} threads, {where.get('gpus')} GPU(s)")
    parts = [summary] if summary["command"] != "demo" else [summary["multiply"], summary["gram"]]
    for s in parts:
        out = s["output"]
        rate = (f"{s['gb_per_s']:.2f} GB/s moved" if "gb_per_s" in s
                else f"{s['pairs_per_s']:.3g} unique pairs/s" if "pairs_per_s" in s
                else f"{s['molecules_per_s'] or 0:.3g} molecules/s" if "molecules_per_s" in s
                else f"{s['bit_macs_per_s']:.3g} bit-MAC/s")
        click.echo(f"{s['command']}: {out['path']} {tuple(out['shape'])} {out['dtype']} in "
                   f"{s['seconds']:.2f} s ({rate})")
    if summary.get("unparsed"):
        named = ", ".join(summary["unparsed_ids"])
        click.echo(f"fingerprints: {summary['unparsed']} SMILES RDKit could not parse were "
                   f"left out (ids {named}{', ...' if summary['unparsed'] > len(summary['unparsed_ids']) else ''})")
    if summary["command"] == "demo":
        c = summary["checked"]
        click.echo(f"demo: {c['multiply_rows']} rows of the product and {c['gram_rows']} rows of "
                   "the Gram matrix checked against NumPy: exact")
        if not summary.get("files_kept"):
            click.echo("demo: its files were temporary and are removed (--workdir keeps them)")
    click.echo(place)


#: ``--method`` of the jobs that count shared bits (gram, similarity).
_method_option = click.option("--method", type=click.Choice(list(METHODS)),
                              default="auto", show_default=True)


def _output_options(func: Callable) -> Callable:
    options = [
        click.option("-o", "--output", required=True, type=click.Path(),
                     help="The .npy file, or Zarr store (a name ending in .zarr), to write."),
        click.option("--overwrite", is_flag=True, help="Replace the output if it exists (a "
                     "file, or a Zarr store: never another directory)."),
        click.option("--compression", default="none", show_default=True,
                     help="Zarr output: none, zstd, gzip or blosc (NAME or NAME:LEVEL)."),
        click.option("--zarr-format", type=click.Choice(["2", "3"]), default="3",
                     show_default=True, help="Zarr output: the format version to write."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@main.command()
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@_output_options
@click.option("--chunk-size", default="200MB", show_default=True,
              help="Bytes per chunk of each input (whole rows).")
@_cluster_options
def multiply(a: str, b: str, output: str, overwrite: bool, compression: str, zarr_format: str,
             chunk_size: str, device: str, as_json: bool, **opts: Any) -> None:
    """C = A * B (NumPy broadcasting) from two .npy files or Zarr stores into OUTPUT, chunk by
    chunk."""
    from dask.utils import parse_bytes


    try:
        if parse_bytes(chunk_size) <= 0:
            raise ValueError
    except (ValueError, TypeError):
        raise click.BadParameter(f"--chunk-size: {chunk_size!r} is not a positive size "
                                 "(e.g. 200MB)") from None
    _run_job(as_json, opts, lambda: multiply_job(
        a, b, output, device=device, chunk_size=chunk_size, overwrite=overwrite,
        compression=compression, zarr_format=int(zarr_format)))


@main.command("gram")
@click.argument("bits", type=click.Path())
@_output_options
@click.option("--packed", is_flag=True, help="BITS holds packed words (any unsigned dtype, "
              "e.g. np.packbits output), not 0/1 values.")
@_method_option
@click.option("--chunk-rows", type=click.IntRange(min=1),
              help="Rows per chunk (and per output block) [default: 4096, halved while a "
              "block would not fit the GPUs' memory budget].")
@click.option("--layout", type=click.Choice(["auto", "blocks", "rows", "upper"]), default="auto",
              show_default=True, help="blocks: upper blocks, the rest transposed on the host; "
              "rows: each row slab whole in one task; upper: each row slab from the diagonal "
              "rightwards, written also transposed; auto: rows on GPUs with tensor cores "
              "when the packed input is at most 4 GiB, blocks on other GPUs, upper on the CPU.")
@_cluster_options
def gram_command(bits: str, output: str, overwrite: bool, compression: str, zarr_format: str,
                 packed: bool, method: str, chunk_rows: int, layout: str, device: str,
                 as_json: bool, **opts: Any) -> None:
    """G = A · Aᵀ (exact, int32) of the 0/1 matrix in BITS (.npy or .zarr), written to
    OUTPUT."""
    _run_job(as_json, opts, lambda: gram_job(
        bits, output, packed=packed, method=method, device=device, chunk_rows=chunk_rows,
        layout=layout, overwrite=overwrite, compression=compression,
        zarr_format=int(zarr_format)))


def _in_process_by_default(opts: dict[str, Any]) -> bool:
    """Whether a job with nothing to spill runs in this process unless told otherwise: no
    cluster option given and at most one GPU visible. A local cluster would add its start and
    close (6-8 s on the GPU machines; the perf notes (git show 85dc246:docs/perf-notes.md), items 26, 28 and 31) and give such a
    job nothing: one GPU's worker, and results of a few bytes a row."""
    return (not opts.get("in_process") and not _cluster_options_given(opts)
            and gpu_count() <= 1)


@main.command("similarity")
@click.argument("fingerprints", type=click.Path())
@click.option("--queries", type=click.Path(), default=None,
              help="Score each row of QUERIES (.npy, .zarr, .fps or FPSim2 .h5) against "
              "FINGERPRINTS; without it, all pairs of FINGERPRINTS.")
@click.option("--metric", type=click.Choice(["tanimoto", "jaccard", "dice", "cosine", "tversky",
                                             "hamming", "counts"]),
              default="tanimoto", show_default=True)
@click.option("--alpha", type=click.FloatRange(min=0), default=None,
              help="Tversky's weight of what only a row has (--metric tversky) [default: 1].")
@click.option("--beta", type=click.FloatRange(min=0), default=None,
              help="Tversky's weight of what only the other row has [default: --alpha].")
@click.option("--top-k", type=click.IntRange(min=1), default=None,
              help="Each row's K best: OUTPUT a .npz of indices and scores (n x K). With "
              "--threshold: the K best that meet it, index -1 and score NaN (-1 for hamming "
              "and counts) in the places of the missing.")
@click.option("--threshold", type=float, default=None,
              help="Every pair scoring at least T (at most T for hamming): OUTPUT a .npz of "
              "rows, cols and scores. With --top-k: a bound on the K best.")
@click.option("--dense", is_flag=True, help="Every score: OUTPUT a .npy or Zarr store (the "
              "default where neither --top-k nor --threshold is given).")
@click.option("--include-self", is_flag=True, help="All pairs: keep each row's pair with "
              "itself (left out by default).")
@_output_options
@click.option("--packed", is_flag=True, help="The inputs hold packed words (any unsigned "
              "dtype, e.g. np.packbits output), not 0/1 values.")
@_method_option
@click.option("--chunk-rows", type=click.IntRange(min=1),
              help="Rows per chunk of each input [default: 32768 on GPUs, halved while a "
              "block would not fit their memory budget; 4096 on the CPU].")
@click.option("--local-cluster", "use_local_cluster", is_flag=True,
              help="Start a local cluster even for --top-k and --threshold on one GPU (or "
              "none), which run in this process by default.")
@_cluster_options
def similarity_command(fingerprints: str, queries: str | None, metric: str,
                       alpha: float | None, beta: float | None, top_k: int | None,
                       threshold: float | None, dense: bool, include_self: bool, output: str,
                       overwrite: bool, compression: str, zarr_format: str, packed: bool,
                       method: str, chunk_rows: int | None, device: str, as_json: bool,
                       use_local_cluster: bool, **opts: Any) -> None:
    """Similarity of the binary rows in FINGERPRINTS (.npy or .zarr; or chemfp's .fps or an
    FPSim2 .h5, whose molecules' ids then go into OUTPUT beside the results): each row's top
    K, the pairs over a threshold, or every score, exact, written to OUTPUT.

    Top-k and threshold jobs keep a few bytes a row and spill nothing: with no cluster option
    and one GPU or none, they run in this process (as --in-process); --local-cluster starts a
    cluster all the same. Dense scores and several GPUs take a local cluster."""
    if dense and (top_k is not None or threshold is not None):
        raise click.UsageError("--dense writes every score; leave out --top-k and --threshold")
    if metric != "tversky" and (alpha is not None or beta is not None):
        raise click.UsageError("--alpha and --beta weigh --metric tversky only")
    if use_local_cluster and opts.get("in_process"):
        raise click.UsageError("give --local-cluster or --in-process, not both")
    joined = [f"--{k.replace('_', '-')}" for k in ("scheduler_file", "scheduler_address")
              if opts.get(k)]
    if use_local_cluster and joined:
        raise click.UsageError(f"--local-cluster starts a cluster; {joined[0]} joins one")
    if (not use_local_cluster and (top_k is not None or threshold is not None)
            and _in_process_by_default(opts)):
        opts["in_process"] = True
    _run_job(as_json, opts, lambda: similarity_job(
        fingerprints, output, queries=queries, metric=metric, top_k=top_k,
        threshold=threshold, packed=packed,
        exclude_self=(not include_self) if queries is None else None, method=method,
        device=device, chunk_rows=chunk_rows, overwrite=overwrite, compression=compression,
        zarr_format=int(zarr_format), alpha=alpha, beta=beta))


@main.command("fingerprints")
@click.argument("smiles", type=click.Path())
@click.option("-o", "--output", required=True, type=click.Path(),
              help="An .fps file (fingerprints and the molecules' ids, which the similarity "
              "job then writes beside its results) or a .npy of the packed words alone.")
@click.option("--kind", type=click.Choice(list(FINGERPRINT_KINDS)), default="morgan",
              show_default=True, help="RDKit's fingerprint generator.")
@click.option("--bits", type=click.IntRange(min=8), default=2048, show_default=True,
              help="Bits a fingerprint (a multiple of 8).")
@click.option("--radius", type=click.IntRange(min=0), default=2, show_default=True,
              help="Morgan's radius (2: ECFP4).")
@click.option("--overwrite", is_flag=True, help="Replace the output if it exists.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON line summarising the job, and no progress bar.")
def fingerprints_command(smiles: str, output: str, kind: str, bits: int, radius: int,
                         overwrite: bool, as_json: bool) -> None:
    """Fingerprints of the molecules in SMILES (a .smi file: SMILES and id a line) through
    RDKit (pip install rdkit), in a process per core, packed into OUTPUT for the similarity
    job: dask-gpuchunk fingerprints mols.smi -o fps.fps, then dask-gpuchunk similarity fps.fps
    --top-k 10 -o nn.npz (its .npz then holds the ids)."""
    from .fingerprint_jobs import fingerprints_job

    opts = {**_CLUSTER_DEFAULTS, "in_process": True, "worker_timeout": 60}
    _run_job(as_json, opts, lambda: fingerprints_job(smiles, output, kind=kind, bits=bits,
                                                     radius=radius, overwrite=overwrite))


@main.command()
@click.option("--rows", default=500_000, show_default=True, type=click.IntRange(min=1),
              help="Rows of the two float64 inputs of the product.")
@click.option("--cols", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--bit-rows", default=4000, show_default=True, type=click.IntRange(min=1),
              help="Rows of the 0/1 matrix of the Gram job.")
@click.option("--bits", default=20_000, show_default=True, type=click.IntRange(min=1),
              help="Columns of the 0/1 matrix.")
@click.option("--workdir", type=click.Path(file_okay=False),
              help="Keep the files here (default: a temporary directory, removed).")
@_cluster_options
def demo(rows: int, cols: int, bit_rows: int, bits: int, workdir: str | None, device: str,
         as_json: bool, **opts: Any) -> None:
    """The main job on an embedded default: synthetic inputs, multiply and gram through .npy
    files on a cluster, sampled results checked against NumPy, figures printed."""
    log = (lambda s: None) if as_json else (lambda s: click.echo(s, err=True))
    _run_job(as_json, opts, lambda: lambda progress: jobs.demo(
        rows=rows, cols=cols, bit_rows=bit_rows, bits=bits, workdir=workdir, device=device,
        progress=progress, log=log))


@main.command("tls-credentials")
@click.argument("directory", type=click.Path(file_okay=False))
def tls_credentials(directory: str) -> None:
    """Write TLS credentials for a batch cluster into DIRECTORY (made, readable by you only):
    ca.pem, cert.pem and key.pem, which its scheduler, workers and jobs all present
    (--tls-ca-file, --tls-cert, --tls-key). Only holders of the key can then join it."""
    try:
        paths = write_credentials(directory)
    except (OSError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(4)
    for name, path in paths.items():
        click.echo(f"{name}: {path}")


@main.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--dry-run", is_flag=True, help="List only; remove nothing.")
@click.option("--force", is_flag=True, help="Also remove partial files whose writer cannot be "
              "checked from here (written on another host); never one that a running process "
              "on this host writes, nor a name without the package's dgc tag.")
def clean(directory: str, dry_run: bool, force: bool) -> None:
    """List the temporary files (.partial) that killed jobs left in DIRECTORY and remove those
    whose writer is gone."""
    found = partials_in(directory)
    if not found:
        click.echo(f"no partial files in {directory}")
        return
    # Each file gets one line below; the log hears only the files that could not go.
    removed = set() if dry_run else {p.path for p in remove_partials(
        found, unknown=force, log=lambda s: click.echo(f"warning: {s}", err=True),
        log_removals=False)}
    for p in found:
        done = ("removed" if p.path in removed else
                "would remove" if dry_run and p.writer is not None and (
                    p.state() == "gone" or force and p.state() == "unknown") else "kept")
        hint = (" (--force removes it)" if done == "kept" and p.writer is not None
                and p.state() == "unknown" else "")
        click.echo(f"{done}: {p.path.name}, {format_bytes(p.nbytes)}, {p.describe()}{hint}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
