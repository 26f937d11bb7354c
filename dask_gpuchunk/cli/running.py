"""How a job command runs: its cluster (started, joined or none), progress, signals, and the
summary and one-line errors it prints."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import click

from ..distributed.alias_tasks import resolving_aliases
from ..runtime.budget import DeviceBudgetError
from ..distributed.cluster import collector_paused, connect, local_cluster, parse_memory_limit
from ..config import check_settings
from ..devices import GPUNotAvailableError
from ..io import SchedulerLostError
from ..distributed.joining import PlainTransportWarning
from ..progress import format_rate
from ..jobs import (
    ClusterError,
    JobError,
    check_gpus_where_it_runs,
    sent_by_workers,
    staged_by_workers,
    watch_device_memory,
    where_it_ran,
)

__all__ = []


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


def _run_job(as_json: bool, opts: dict[str, Any], prepare: Callable[[], Callable], *,
             method: str = "", device: str = "auto") -> None:
    """Check the job (``prepare()``, and on a local cluster whether ``method`` and ``device``
    find a GPU, before any cluster starts), run it on the cluster the options describe,
    report; map errors to exit codes with one line on stderr. SIGTERM ends it as Ctrl-C does
    (exit 143); warnings are one line each."""
    _quiet_distributed_logs()
    previous_term = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warn_in_one_line
            summary = _job_summary(opts, prepare, quiet=as_json, method=method, device=device)
    finally:
        signal.signal(signal.SIGTERM, previous_term)
    if as_json:
        click.echo(json.dumps(summary, default=str))
    else:
        _print_summary(summary)


def _job_summary(opts: dict[str, Any], prepare: Callable[[], Callable], quiet: bool,
                 method: str = "", device: str = "auto") -> dict[str, Any]:
    """:func:`_run_job`'s run: the summary, or one line on stderr and the exit status."""
    try:
        check_settings()
        job = prepare()
        if not (opts["scheduler_file"] or opts["scheduler_address"]):
            # A local cluster's workers see the GPUs this process sees: GPU work where it sees
            # none ends here, not after the cluster's start and close (2.3 s a job on the CI
            # machine); a joined cluster's workers are asked once the job has joined them.
            check_gpus_where_it_runs(method, device)
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
    return (isinstance(exc, SchedulerLostError) or name in ("CommClosedError", "StreamClosedError")
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
