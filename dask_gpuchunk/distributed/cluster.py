"""Dask clusters for dask_gpuchunk jobs: every GPU of this node, or an existing cluster.

:func:`local_cluster` starts dask-cuda's ``LocalCUDACluster`` where GPUs are visible (one worker
process per GPU, ``CUDA_VISIBLE_DEVICES`` honoured; a worker spills chunks device → host when its
device memory passes ``device_memory_limit``, host → disk when its host memory passes
``memory_limit``) or a ``LocalCluster`` of one worker with a thread per core where none is.
:func:`connect` joins a running cluster: a batch job starts ``dask scheduler --scheduler-file``
and ``dask cuda worker --scheduler-file`` (or ``dask worker``) on its nodes and the job's
script connects through the same file.

Kernels are compiled inside the workers, at their first chunk, once per process. The clients of
:func:`local_cluster` and :func:`connect` register
:class:`dask_gpuchunk.distributed.worker.WorkerSetup` (a ``WorkerPlugin``) with every worker,
present and to come: it imports the package and prepares the process before any task. ``--preload
dask_gpuchunk.distributed.cluster`` (this module's :func:`dask_setup`) does the same where workers
are started by hand for another client.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import dask
from dask.utils import parse_bytes

from ..runtime import placement
from .alias_tasks import resolving_aliases
from ..runtime.budget import pool_limit_from_env, spill_limit
from ..devices import GPUNotAvailableError, distributed_client_active, gpu_available, gpu_count
from .joining import client_within, read_scheduler_file, shown, warn_if_plain
from .replicas import policies_keeping_sources
from ..runtime.staging import pinned_pool

__all__ = ["LOOPBACK", "PRELOAD", "SPARE_ROOT_TASKS", "THREADS_PER_GPU", "collector_paused",
           "connect", "dask_setup", "local_cluster", "parse_memory_limit", "placement_decisions",
           "release_memory", "root_task_saturation", "temporary_security", "wait_for_workers"]

#: The module a worker imports when it starts (``preload=``; ``--preload`` of ``dask worker``).
PRELOAD = "dask_gpuchunk.distributed.cluster"
#: Dask threads per GPU worker of :func:`local_cluster` by default. A worker gathers a task's
#: inputs, unspilling them to the device, before the task runs, so every running task over
#: device-resident chunks holds its inputs and output there at once: a thread per core (16 on
#: the H200 machine) ran an 8 GiB card out of memory with 1 GiB chunks. Two keep one task's
#: kernels running while the worker's event loop unspills the next task's inputs.
THREADS_PER_GPU = 2
#: Root tasks (tasks with no dependencies, as the Gram's blocks and a file's reads) that
#: :func:`local_cluster`'s scheduler lets each worker hold beyond its threads. distributed
#: queues root tasks on the scheduler and hands a worker one only while fewer than
#: ``ceil(worker-saturation x threads)`` tasks are assigned to it, counting its other tasks (the
#: Gram's sums of blocks) too: at its default of 1.1 a worker of 2 threads holds 3, so a block
#: finished often waits for the next one's round trip through the scheduler. On 4 x H200 (the
#: Gram's ``C.sum()``, settings alternated on one cluster, medians of 6) 4 of them took 10 % off
#: one GPU's time and 6 % off four's (perf-notes, stop 49).
SPARE_ROOT_TASKS = 2
# distributed's own default worker-saturation: a value other than it was set by the caller.
_DISTRIBUTED_SATURATION = 1.1


#: Where :func:`local_cluster`'s scheduler, workers and dashboard listen.
LOOPBACK = "127.0.0.1"


def temporary_security() -> Any:
    """``distributed.Security.temporary()``: TLS with a throwaway certificate that only this
    process and the workers it starts hold (it needs the ``cryptography`` package)."""
    from distributed import Security

    try:
        return Security.temporary()
    except ImportError as exc:
        raise ImportError(
            f"a local cluster talks TLS by default, which needs the cryptography package "
            f"({exc}); install it, or pass secure=False (--no-tls) for plain TCP on loopback"
        ) from None


def dask_setup(worker: Any) -> None:
    """Worker start-up hook of ``--preload dask_gpuchunk.distributed.cluster``
    (:func:`dask_gpuchunk.distributed.worker.set_up_worker`), for workers whose clients do not
    register :class:`dask_gpuchunk.distributed.worker.WorkerSetup`."""
    from .worker import set_up_worker  # distributed: 0.35 s more for every import of the package

    set_up_worker(worker)


def root_task_saturation(threads: int) -> float:
    """distributed's ``worker-saturation`` that lets a worker of ``threads`` threads hold
    :data:`SPARE_ROOT_TASKS` root tasks beyond them, or distributed's default where that
    already gives as many (workers of 20 threads or more); the caller's own value where
    ``distributed.scheduler.worker-saturation`` is set to another than distributed's default.

    Examples
    --------
    >>> root_task_saturation(2), root_task_saturation(8), root_task_saturation(64)
    (2.0, 1.25, 1.1)
    >>> import dask
    >>> with dask.config.set({"distributed.scheduler.worker-saturation": "inf"}):
    ...     root_task_saturation(2)
    'inf'
    """
    import dask

    configured = dask.config.get("distributed.scheduler.worker-saturation", None)
    if configured is not None and configured != _DISTRIBUTED_SATURATION:
        return configured
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads!r}")
    # ceil(saturation x threads) is what distributed allows: threads + SPARE_ROOT_TASKS.
    return max(_DISTRIBUTED_SATURATION, (threads + SPARE_ROOT_TASKS) / threads)


def parse_memory_limit(value: Any, what: str) -> Any:
    """Check a memory limit as dask takes it: bytes, ``"8GB"``-style text, a fraction of the
    total in (0, 1], ``"auto"``, or ``0``/``None`` for no limit. Returns it normalised.

    Examples
    --------
    >>> parse_memory_limit("8GB", "--device-memory-limit")
    8000000000
    >>> parse_memory_limit("0.5", "--memory-limit")
    0.5
    >>> parse_memory_limit("lots", "--memory-limit")
    Traceback (most recent call last):
    ...
    ValueError: --memory-limit: cannot read 'lots' as a memory size (give bytes, e.g. 8GB or 500MiB, a fraction such as 0.8, or auto)
    """
    if value is None or value == "auto":
        return value
    text = str(value).strip()
    if not text:
        raise ValueError(f"{what} is empty; give bytes (8GB), a fraction such as 0.8, 0 for "
                         "no limit, or auto")
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None:
        if not math.isfinite(number):
            raise ValueError(f"{what}: {value!r} is not a size; give bytes (8GB), a fraction "
                             "such as 0.8, 0 for no limit, or auto")
        if number < 0:
            raise ValueError(f"{what}: must not be negative, got {value!r}")
        if 0 < number <= 1:
            return number
        if not number.is_integer():
            raise ValueError(f"{what}: {value!r} is neither a fraction (at most 1) nor a whole "
                             "number of bytes; give 0.8 or 8GB")
        nbytes = int(number)
    else:
        try:
            nbytes = parse_bytes(text)
        except (ValueError, TypeError):
            raise ValueError(
                f"{what}: cannot read {value!r} as a memory size (give bytes, e.g. 8GB or "
                "500MiB, a fraction such as 0.8, or auto)"
            ) from None
    if nbytes < 0:
        raise ValueError(f"{what}: must not be negative, got {value!r}")
    if 0 < nbytes < MEMORY_LIMIT_MIN_BYTES:
        raise ValueError(f"{what}: {value!r} is {nbytes:,} bytes, less than any worker runs "
                         f"in; give at least {MEMORY_LIMIT_MIN_BYTES // 2**20} MiB, a fraction "
                         "such as 0.8, or 0 for no limit")
    return int(nbytes)


#: The smallest memory limit taken in bytes (below it, a number is a slip: ``1.5``, ``2``).
MEMORY_LIMIT_MIN_BYTES = 64 * 2**20


def release_memory() -> None:
    """Give back what this process caches: pinned staging buffers, CuPy's device and pinned
    pools. Run in each worker before a cluster closes: freeing many GB of page-locked memory
    takes seconds, which otherwise run out the nanny's time to stop its worker."""
    import gc

    gc.collect()

    if not gpu_available():
        return
    import cupy


    cupy.cuda.runtime.deviceSynchronize()
    pinned_pool.clear()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


def _workers_spill_limit(device_memory_limit: Any, visible: str | None = None) -> Any:
    """dask-cuda's ``device_memory_limit`` for the workers: where CuPy's pool is capped
    (``CUPY_GPU_MEMORY_LIMIT``, which the workers inherit), taken of the capped size, so that
    a capped card spills as a card of that size would; else as given. ``visible``: the
    workers' ``CUDA_VISIBLE_DEVICES``, whose first device's size is read."""
    if not os.environ.get("CUPY_GPU_MEMORY_LIMIT", "").strip():
        return device_memory_limit
    total = _first_device_total(visible or os.environ.get("CUDA_VISIBLE_DEVICES") or None)
    capacity = min(total, pool_limit_from_env(total) or total)
    return spill_limit(capacity, device_memory_limit) or 0


def _first_device_total(visible: str | None) -> int:
    """The memory of the first of the ``visible`` devices (``CUDA_VISIBLE_DEVICES``'s form;
    device 0 where ``None``), read through NVML as dask-cuda reads it: asking the CUDA runtime
    made a context of this process on that device, kept while the cluster ran (518 MiB of an
    H200 beside worker 0's by nvidia-smi)."""
    try:
        from dask_cuda.utils import get_device_total_memory, nvml_device_index

        total = get_device_total_memory(nvml_device_index(0, visible) if visible else 0)
    except Exception:  # no NVML here (a driver without it): CUDA's figure, with its context
        total = None
    if total:
        return int(total)
    import cupy

    return int(cupy.cuda.runtime.memGetInfo()[1])


def _gpu_list(gpus: Any) -> str | None:
    if gpus is None:
        return None
    if isinstance(gpus, int):
        if gpus < 1:
            raise ValueError(f"gpus must be at least 1, got {gpus}")
        available = gpu_count()
        if gpus > available:
            raise GPUNotAvailableError(f"asked for {gpus} GPUs; {available} visible")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(available)]
        return ",".join(ids[:gpus])
    text = ",".join(str(g) for g in gpus) if not isinstance(gpus, str) else gpus
    if not text.strip():
        raise ValueError("gpus: empty list")
    return text


@contextlib.contextmanager
def local_cluster(
    gpus: int | str | list[int] | None = None,
    device_memory_limit: Any = "default",
    memory_limit: Any = "auto",
    spill_dir: str | os.PathLike | None = None,
    threads_per_gpu: int | str | None = None,
    secure: bool | None = None,
    **cluster_kwargs: Any,
) -> Iterator[Any]:
    """A ``distributed.Client`` on a cluster of this machine, closed on exit.

    While it is open, dask arrays reach the cluster without the ``Alias`` tasks that dask's
    fusion leaves (:mod:`dask_gpuchunk.distributed.alias_tasks`, ``gpuchunk.resolve-aliases``). Its
    scheduler hands each worker :data:`SPARE_ROOT_TASKS` root tasks beyond its threads
    (:func:`root_task_saturation`; a ``distributed.scheduler.worker-saturation`` of your own
    is kept, unless it is distributed's default of 1.1).

    Parameters
    ----------
    gpus
        ``None``: every visible GPU; an int: the first that many; a list or ``"0,2"``: those
        devices (as ``CUDA_VISIBLE_DEVICES``). Asking for GPUs where none is visible raises
        :class:`GPUNotAvailableError`.
    device_memory_limit
        Per GPU worker: spill finished chunks to host memory beyond this (bytes, ``"8GB"``, a
        fraction of the device's memory, or dask-cuda's ``"default"``).
    memory_limit
        Per worker: spill to disk beyond this (``"auto"``: the machine's memory split between
        workers).
    spill_dir
        Where workers spill to disk (their ``local_directory``).
    threads_per_gpu
        Dask threads per GPU worker. Default :data:`THREADS_PER_GPU`: tasks over chunks that
        live on the device hold their inputs and outputs there while they run, so few run at
        once; results stored beyond ``device_memory_limit`` spill to the host, and stored
        results yield to a running task's allocation that would fail
        (:mod:`dask_gpuchunk.distributed.spilling`). ``"cores"``: ``cores /
        gpus``, for work staged from host memory (files, NumPy chunks: host copies run in every
        thread, device memory bounded by the package's staging slots and budget), as the CLI's
        jobs run. On a CPU-only machine, the threads of its one worker (default: a thread per
        core).
    secure
        Talk TLS with throwaway credentials (``distributed.Security.temporary()``) and listen on
        loopback only, dashboard included: without them, any local user could connect to the
        scheduler and run code as you. ``False``: Dask's plain TCP (still on loopback). A
        ``security=`` of your own is used as given. Default: TLS, unless ``protocol="ucx"``
        is given, which has no encryption (``secure=True`` with it is refused): over UCX,
        CuPy chunks go from GPU to GPU (NVLink, CUDA IPC) at tens of GB/s, and any user of
        this machine who reaches the cluster can run code as you.
    **cluster_kwargs
        Passed to the cluster class.

    Yields
    ------
    distributed.Client

    Examples
    --------
    >>> import dask.array as da
    >>> import dask_gpuchunk as dg
    >>> with dg.local_cluster(processes=False, dashboard_address=None) as client:
    ...     total = dg.multiply(da.ones(10, chunks=5), 2.0).sum().compute()
    >>> float(total)
    20.0
    """
    from distributed import Client

    from .worker import WorkerSetup

    device_memory_limit = (device_memory_limit if device_memory_limit == "default"
                           else parse_memory_limit(device_memory_limit, "device_memory_limit"))
    memory_limit = parse_memory_limit(memory_limit, "memory_limit")
    if threads_per_gpu is not None and threads_per_gpu != "cores" and (
            not isinstance(threads_per_gpu, int) or threads_per_gpu < 1):
        raise ValueError(f"threads_per_gpu must be a number of at least 1 or 'cores', got "
                         f"{threads_per_gpu!r}")
    cores = os.cpu_count() or 1
    ucx = str(cluster_kwargs.get("protocol", "")).startswith("ucx")
    if ucx and secure:
        raise ValueError("protocol='ucx' has no TLS; leave secure= out (or False) to use UCX, "
                         "or leave protocol= out for TLS over TCP")
    secure = not ucx if secure is None else secure
    if ucx:
        import importlib.util

        if importlib.util.find_spec("distributed_ucxx") is None:
            raise ImportError("protocol='ucx' needs distributed-ucxx: pip install "
                              "distributed-ucxx-cu12 (or -cu13, for your CUDA)")
    kwargs: dict[str, Any] = {"memory_limit": memory_limit if memory_limit is not None else 0,
                              "host": LOOPBACK}
    if secure and "security" not in cluster_kwargs:
        kwargs["security"] = temporary_security()
    if "dashboard_address" not in cluster_kwargs:
        # Dask's default, ":8787", listens on every interface: the dashboard shows the
        # workers, their tasks and this user's data to whoever reaches the machine.
        cluster_kwargs = {**cluster_kwargs, "dashboard_address": f"{LOOPBACK}:8787"}
    elif cluster_kwargs["dashboard_address"] is None:
        # No dashboard wanted; the scheduler's HTTP server (health, metrics) still starts, on
        # Dask's 8787 unless told otherwise, and a second cluster then warns that the port is
        # taken: any free loopback port instead.
        cluster_kwargs = {**cluster_kwargs, "dashboard_address": f"{LOOPBACK}:0"}
    if not secure and "protocol" not in cluster_kwargs and "security" not in cluster_kwargs:
        # In one process Dask's default is "inproc", whose HTTP servers listen on every
        # interface; TCP takes the loopback host.
        kwargs["protocol"] = "tcp://"
    if spill_dir is not None:
        spill_dir = os.fspath(spill_dir)
        os.makedirs(spill_dir, exist_ok=True)
        kwargs["local_directory"] = spill_dir
    if gpu_count() > 0:
        from dask_cuda import LocalCUDACluster

        visible = _gpu_list(gpus)
        n = len(visible.split(",")) if visible else gpu_count()
        kwargs.update(
            CUDA_VISIBLE_DEVICES=visible,
            threads_per_worker=(max(1, cores // n) if threads_per_gpu == "cores"
                                else threads_per_gpu or THREADS_PER_GPU),
        )
        limit = _workers_spill_limit(device_memory_limit, visible)
        if limit != "default":
            kwargs["device_memory_limit"] = limit if limit else 0
        kwargs.update(cluster_kwargs)
        with _root_tasks_spared(kwargs["threads_per_worker"]), _resident_sources_kept(), \
                collector_paused():
            cluster: Any = LocalCUDACluster(**kwargs)
    else:
        if gpus is not None:
            raise GPUNotAvailableError(
                f"gpus={gpus!r} was asked for but no CUDA GPU is visible; leave it out to run on "
                "the CPU"
            )
        from distributed import LocalCluster

        kwargs.update(n_workers=1, threads_per_worker=(
            threads_per_gpu if isinstance(threads_per_gpu, int) else cores))
        kwargs.update(cluster_kwargs)
        with _root_tasks_spared(kwargs["threads_per_worker"]), _resident_sources_kept(), \
                collector_paused():
            cluster = LocalCluster(**kwargs)
    try:
        with collector_paused():
            client = Client(cluster)
        try:
            client.register_plugin(WorkerSetup())  # before any task of the caller's
            try:
                with resolving_aliases():
                    yield client
            finally:
                with contextlib.suppress(Exception):  # a worker already gone frees nothing
                    client.run(release_memory)
        finally:
            with collector_paused():
                client.close()
    finally:
        try:
            with collector_paused():
                cluster.close()
        except (TimeoutError, asyncio.TimeoutError):
            # A worker still stopping after the nanny's few seconds is killed; every result
            # was already delivered, so this is not an error of the job.
            pass


@contextlib.contextmanager
def _root_tasks_spared(threads: Any) -> Iterator[None]:
    """While a local cluster starts: its scheduler (created in this process, which reads
    ``worker-saturation`` when it starts) lets each worker hold :data:`SPARE_ROOT_TASKS` root
    tasks beyond its threads (:func:`root_task_saturation`)."""
    import dask

    if not isinstance(threads, int) or threads < 1:  # the cluster class says what is wrong
        yield
        return
    with dask.config.set({"distributed.scheduler.worker-saturation":
                          root_task_saturation(threads)}):
        yield


@contextlib.contextmanager
def _resident_sources_kept() -> Iterator[None]:
    """While a local cluster starts: its scheduler's active memory manager keeps every replica
    of a resident source (:mod:`dask_gpuchunk.distributed.replicas`), so that no worker reads a
    ``.npy``'s words twice in one compute."""
    import dask

    key = "distributed.scheduler.active-memory-manager.policies"
    with dask.config.set({key: policies_keeping_sources(dask.config.get(key, []))}):
        yield


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector paused while a cluster or client starts or stops.

    distributed's event-loop runners start and stop under one lock shared by all of them, and
    it is not re-entrant. An earlier client left in a reference cycle and collected by an
    allocation during a start stops its runner from ``__del__`` under that lock, and the
    process hangs (CI hung so: ``Client.__del__`` inside ``Client.start``); a stop holds the
    same lock. Paused, the collector frees such garbage later, outside the lock. Not collected
    first: that took 50 ms a call here, four calls a job.

    Examples
    --------
    >>> with collector_paused():
    ...     gc.isenabled()
    False
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def connect(scheduler_file: str | os.PathLike | None = None, address: str | None = None,
            timeout: float = 30.0, *, workers: int = 0, worker_timeout: float = 300.0,
            log: Callable[[str], None] | None = None, security: Any = None) -> Any:
    """A ``distributed.Client`` joined to a running cluster, by scheduler file or address.

    Give exactly one of ``scheduler_file`` (written by ``dask scheduler --scheduler-file``) and
    ``address`` (``"tcp://host:8786"``). ``timeout``: seconds to wait for the scheduler.
    ``workers``: wait until at least this many workers have joined (a batch job's workers start
    beside its scheduler and join when they are up), at most ``worker_timeout`` seconds; ``log``
    hears how many have joined while it waits. Dask arrays computed inside ``with
    dg.resolving_aliases():`` reach the cluster without the ``Alias`` tasks that dask's fusion
    leaves (:mod:`dask_gpuchunk.distributed.alias_tasks`; ``dg.local_cluster`` does this for its
    block); nothing of this process's dask settings is changed.

    Whoever controls the scheduler runs code in this process: the scheduler file must be a small
    regular file of this user's (or root's) that no one else may write
    (:func:`dask_gpuchunk.distributed.joining.read_scheduler_file`), and an address without TLS
    draws a :class:`~dask_gpuchunk.distributed.joining.PlainTransportWarning`. ``security``: a
    ``distributed.Security`` for a TLS cluster (Dask's ``distributed.comm.tls`` settings otherwise).

    Raises
    ------
    ValueError
        Neither or both given, an empty address, or a scheduler file that is not safe to read.
    FileNotFoundError
        The scheduler file does not exist.
    OSError
        The scheduler did not answer within ``timeout``, or not as a Dask scheduler.
    TimeoutError
        Fewer than ``workers`` workers joined within ``worker_timeout`` (the client is closed).
    """
    from distributed import Client

    from .worker import WorkerSetup

    if (scheduler_file is None) == (address is None):
        raise ValueError("give exactly one of scheduler_file and address")
    if scheduler_file is not None:
        address = read_scheduler_file(scheduler_file)
    elif not address.strip():
        raise ValueError("the scheduler address is empty")
    warn_if_plain(address)
    if (address.startswith("tls://") and security is None
            and not dask.config.get("distributed.comm.tls.ca-file", None)):
        raise ValueError(f"the scheduler at {shown(address)} talks TLS: give its credentials "
                         "(--tls-ca-file, --tls-cert, --tls-key; security= in Python; or Dask's "
                         "distributed.comm.tls settings)")
    options = {} if security is None else {"security": security}
    with collector_paused():
        client = client_within(lambda: Client(address, timeout=timeout, **options), address,
                               timeout + 5)
    try:
        client.register_plugin(WorkerSetup())
        if workers > 0:
            wait_for_workers(client, workers, worker_timeout, log)
    except BaseException:
        with collector_paused():
            client.close()
        raise
    return client


def wait_for_workers(client: Any, workers: int, timeout: float,
                     log: Callable[[str], None] | None = None) -> int:
    """Wait until the client's cluster has at least ``workers`` workers; return how many.

    ``log`` hears each change in the count while waiting. Raises ``TimeoutError`` after
    ``timeout`` seconds with fewer.

    Examples
    --------
    >>> import dask_gpuchunk as dg
    >>> with dg.local_cluster(processes=False, dashboard_address=None) as client:
    ...     wait_for_workers(client, 1, timeout=10)
    1
    """
    deadline = time.monotonic() + timeout
    said = -1
    while True:
        joined = len(client.nthreads())
        if joined >= workers:
            return joined
        if log is not None and joined != said:
            log(f"waiting for workers: {joined} of {workers} joined")
            said = joined
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"{joined} of {workers} worker(s) joined the cluster within {timeout:g} s (are "
                "the workers started, with the same scheduler file or address?)")
        time.sleep(0.25)


def _decisions_here() -> tuple[int, list[dict[str, Any]]]:
    return os.getpid(), placement.decisions()


def placement_decisions() -> list[dict[str, Any]]:
    """What ``device="auto"`` measured and chose, one record per function and dtype signature:
    in this process, and in every worker of the default ``distributed`` client (where the
    chunks ran), each of those records naming its ``"worker"``.

    Examples
    --------
    >>> isinstance(placement_decisions(), list)
    True
    """
    records = placement.decisions()
    if not distributed_client_active():
        return records
    from distributed import default_client

    for worker, (pid, found) in default_client().run(_decisions_here).items():
        if pid != os.getpid():  # a worker thread of this process recorded into ``records``
            records += [{**r, "worker": worker} for r in found]
    return records
