"""What every job of :mod:`dask_gpuchunk.jobs` shares: its errors (one per exit status), reading
and writing a ``.npy`` or Zarr store through one call, the output's checks, the rows of its
chunks, the warm-up on every worker, and what its summary reports (bytes sent and staged,
where it ran, device memory).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from dask.array.core import normalize_chunks
from dask.utils import format_bytes, parse_bytes

from ..runtime import process_memory
from .._kernels.bitpack import BitValueError, check_bits_dtype, check_words_dtype
from .._kernels.gram import GPU_METHODS
from ..runtime.backend import dask_threads, staging_totals
from ..runtime.budget import budget_report, workers_budgets, working_budget
from ..devices import (
    DEVICES,
    GPUNotAvailableError,
    check_device,
    distributed_client_active,
    gpu_available,
    gpu_count,
)
from ..bits.gram import METHODS
from ..io import (
    NoWorkersError,
    NpyFormatError,
    NpyHeader,
    check_target,
    from_npy,
    read_header,
    to_npy,
)
from ..io.files import FileReplacedError, InputChangedError
from ..io.fingerprint_files import Fingerprints, FpsError, read_fps, read_fpsim2
from ..io.zarr_files import (
    ZarrFormatError,
    ZarrInfo,
    check_compression,
    check_zarr_target,
    from_zarr,
    is_zarr_path,
    read_zarr_info,
    to_zarr,
)

__all__ = ["BudgetError", "ClusterError", "InputError", "JobError", "OutputError",
           "check_gpus_where_it_runs", "is_fps_path", "job_errors", "sent_by_workers", "staged_by_workers", "watch_device_memory", "where_it_ran"]

#: ``progress(done, total)`` of chunks written; ``progress(done, total, "blocks")`` of a
#: similarity job's blocks computed.
Progress = Callable[..., None] | None


def _device_report(dask_worker: Any = None) -> dict[str, Any]:
    """:func:`dask_gpuchunk.runtime.budget.budget_report` of this process (``Client.run`` runs it in
    each worker, passing the worker)."""
    return budget_report(dask_worker)


def _watch_if_gpu() -> bool:
    return gpu_available() and process_memory.watch()


def watch_device_memory(client: Any | None) -> None:
    """Sample the device memory the driver counts for each process with a GPU: the workers of
    ``client``, or this process where it is ``None``
    (:func:`dask_gpuchunk.runtime.process_memory.watch`; the summaries' ``peak_process``)."""
    if client is None:
        _watch_if_gpu()
    else:
        client.run(_watch_if_gpu)


def _budgets_where_it_runs() -> list[int]:
    """The working device budgets of the workers of the active client that have a GPU (or of
    this process), in bytes; empty where none has one."""
    if not distributed_client_active():
        return [working_budget()] if gpu_available() else []
    return workers_budgets()


def check_gpus_where_it_runs(method: str, device: str) -> None:
    """Refuse GPU work (``device="gpu"``, a GPU-only Gram method) where it would run without a
    GPU: the active client's workers (asked now: the submitting process may have none, as a
    batch job's login node), or this process. :class:`ClusterError` or
    :class:`~dask_gpuchunk.devices.GPUNotAvailableError`, before anything is written."""
    if device != "gpu" and method not in GPU_METHODS:
        return
    what = "--device gpu" if device == "gpu" else f"method {method}"
    if not distributed_client_active():
        if method in GPU_METHODS and not gpu_available():
            raise GPUNotAvailableError(f"{what} needs a CUDA GPU and none is visible")
        check_device(device)
        return
    from distributed import default_client

    seen = default_client().run(gpu_available)
    if not any(seen.values()):
        raise ClusterError(f"{what} needs a GPU, and none of the cluster's {len(seen)} "
                           "worker(s) sees one")


class JobError(Exception):
    """A job that cannot run or did not finish; ``exit_code`` is the command's exit status."""

    exit_code = 1


class InputError(JobError):
    """An input file is missing, unreadable, not ``.npy``, or of the wrong shape or kind."""

    exit_code = 3


class BudgetError(JobError):
    """A chunk of the job cannot fit the device budget of the GPUs that would run it."""

    exit_code = 2


class OutputError(JobError):
    """The output cannot be written (exists, directory missing or read-only, same as an input)."""

    exit_code = 4


class ClusterError(JobError):
    """The cluster cannot be started or joined, or a GPU was asked for where none is."""

    exit_code = 5


def _header(path: str | os.PathLike, what: str) -> NpyHeader | ZarrInfo:
    """What an input's header (``.npy``) or metadata (``.zarr``) says; :class:`InputError`
    where it cannot be read."""
    try:
        return read_zarr_info(path) if is_zarr_path(path) else read_header(path)
    except (OSError, NpyFormatError, ZarrFormatError, ImportError) as exc:
        raise InputError(f"{what}: {exc}") from None


def _read(path: str | os.PathLike, chunks: Any, pinned: bool | None = None) -> Any:
    """An input file as a Dask array of ``chunks`` (:func:`dask_gpuchunk.from_npy` or
    :func:`dask_gpuchunk.from_zarr`)."""
    if is_zarr_path(path):
        try:
            return from_zarr(path, chunks=chunks)
        except ZarrFormatError as exc:  # damaged: a chunk missing, its shape edited
            raise InputError(f"input: {exc}") from None
    return from_npy(path, chunks=chunks, pinned=pinned)


def _write(x: Any, target: Path, overwrite: bool, progress: Progress,
           output: dict[str, Any]) -> None:
    """``x`` into ``target``: a ``.npy`` file, or a Zarr store (``output``: its compression
    and format)."""
    if is_zarr_path(target):
        to_zarr(x, target, overwrite=overwrite, progress=progress, **output)
    else:
        to_npy(x, target, overwrite=overwrite, progress=progress)


def _output_options(out: str | os.PathLike, compression: str, zarr_format: int
                    ) -> dict[str, Any]:
    """The Zarr output's options, checked; ``ValueError`` where they are given for a
    ``.npy``."""
    if not is_zarr_path(out):
        if compression != "none" or zarr_format != 3:
            raise ValueError("--compression and --zarr-format apply to Zarr outputs (a name "
                             f"ending in .zarr), not {out}")
        return {}
    check_compression(compression, zarr_format)
    return {"compression": compression, "zarr_format": zarr_format}


def _check_output(out: str | os.PathLike, inputs: list[str | os.PathLike], overwrite: bool,
                  nbytes: int, output: dict[str, Any]) -> Path:
    """The output's absolute path, checked as :func:`dask_gpuchunk.to_npy` (or
    :func:`dask_gpuchunk.to_zarr`, ``output`` its options) checks it (room for its ``nbytes``
    included, uncompressed), and not one of the inputs; :class:`OutputError` otherwise."""
    if os.fspath(out).endswith(("/", os.sep)) and not is_zarr_path(out):
        raise OutputError(f"output {out} names a directory (it ends in /); give the output's "
                          "file or store name")
    target = Path(os.path.abspath(os.fspath(out)))
    # Resolved, so that a symlinked directory (dirlink/a.npy with dirlink -> .) or a link to
    # an input is seen for what it is; the same file under another name (a hard link) too.
    resolved = os.path.realpath(target)
    for p in inputs:
        same = resolved == os.path.realpath(p)
        with contextlib.suppress(OSError):
            same = same or os.path.samefile(target, p)
        if same:
            raise OutputError(f"output {out} is also an input ({p}); write to another file")
    try:
        if is_zarr_path(target):
            # compressed too: zarr_in_place checks the uncompressed size when it starts
            check_zarr_target(target, overwrite, nbytes)
        else:
            check_target(target, overwrite, nbytes)
    except FileExistsError as exc:
        raise OutputError(f"output: {exc}".replace("overwrite=True", "--overwrite")) from None
    except OSError as exc:
        raise OutputError(f"output: {exc}") from None
    return target


def _native_str(dtype: np.dtype) -> str:
    return (dtype if dtype.isnative else dtype.newbyteorder("=")).str


#: Most chunks a job's input is cut into: a graph of millions of tiny tasks takes minutes and
#: gigabytes to build (--chunk-size 1 grew to 6.4 GB in 60 s) before any work is done.
MAX_CHUNKS = 100_000

#: Chunks smaller than this are refused where there are more than :data:`SMALL_CHUNKS_MAX` of
#: them: ``--chunk-size 8kB`` ran a product 70 x slower than the default and took 3.4 GB of
#: memory for its graph.
SMALL_CHUNK_BYTES = 1 << 20

SMALL_CHUNKS_MAX = 1_000


def _row_chunks(header: NpyHeader, chunk_size: str | int) -> tuple[Any, ...]:
    """Chunks of whole rows of about ``chunk_size`` bytes (one chunk for 0-d or empty);
    ``ValueError`` for a size that is not positive or cuts the input into more than
    :data:`MAX_CHUNKS` chunks, naming the smallest size that would do."""
    if isinstance(chunk_size, str) and not chunk_size.strip():
        raise ValueError("--chunk-size is empty; give a size such as 200MB")
    nbytes = parse_bytes(chunk_size) if isinstance(chunk_size, str) else int(chunk_size)
    if nbytes <= 0:
        raise ValueError(f"chunk size must be positive, got {chunk_size!r}")
    shape = header.shape
    if not shape:
        return ()
    row = max(1, int(np.prod(shape[1:], dtype=np.int64)) * header.dtype.itemsize)
    rows = max(1, nbytes // row)
    chunks = -(-shape[0] // rows)
    if chunks > MAX_CHUNKS:
        least = -(-shape[0] // MAX_CHUNKS) * row
        raise ValueError(f"--chunk-size {chunk_size} cuts {shape[0]:,} rows into "
                         f"{chunks:,} chunks, more than {MAX_CHUNKS:,}; use at "
                         f"least {format_bytes(least)}")
    if rows * row < SMALL_CHUNK_BYTES and chunks > SMALL_CHUNKS_MAX:
        raise ValueError(f"--chunk-size {chunk_size} cuts the input into {chunks:,} chunks of "
                         f"{format_bytes(rows * row)}: each costs Dask about a millisecond, "
                         "more than its work; use at least "
                         f"{format_bytes(SMALL_CHUNK_BYTES)}")
    if not int(np.prod(shape[1:], dtype=np.int64)):  # rows of no bytes: dask's rule divides by 0
        return (rows, *shape[1:])
    # dask's rule for chunks of at most nbytes along the first axis (its rows are ``rows``)
    return normalize_chunks(("auto", *(-1,) * (len(shape) - 1)), shape, limit=nbytes,
                            dtype=header.dtype)


def _start_warmup(fn: Callable[..., None], *args: Any, **kwargs: Any) -> list[Any]:
    """Compile on every worker of the active cluster while the job's first chunks are read.

    Each worker compiles in one of its threads, concurrently with the job's tasks; the kernels
    are then in the worker's process when its first computing task needs them. Returns the
    futures (to keep them alive); nothing where no distributed client is active.
    """
    if not distributed_client_active():
        return []
    from distributed import default_client

    client = default_client()
    workers = list(client.scheduler_info()["workers"])
    return [client.submit(fn, *args, workers=[w], allow_other_workers=False, pure=False,
                          **kwargs)
            for w in workers]


def _run(write: Callable[[], Any], warmup: Callable[[], list[Any]] | None = None) -> float:
    t0 = time.perf_counter()
    with job_errors():
        warming = warmup() if warmup else []  # noqa: F841 - kept alive until the job is done
        write()
    return time.perf_counter() - t0


@contextlib.contextmanager
def job_errors() -> Iterator[None]:
    """What a job's run raises, as the :class:`JobError` of its exit status, in the CLI's
    words."""
    try:
        yield
    except BitValueError as exc:
        raise InputError(f"input: {exc.hint('--packed')}") from None
    except ZarrFormatError as exc:  # a damaged input store, found while it was read
        raise InputError(f"input: {exc}") from None
    except GPUNotAvailableError as exc:
        raise ClusterError(str(exc)) from None
    except NoWorkersError as exc:
        raise ClusterError(str(exc)) from None
    except InputChangedError as exc:
        raise JobError(exc.strerror or str(exc)) from None
    except FileReplacedError as exc:
        raise OutputError(f"output: {exc.strerror or exc}") from None
    except FileExistsError as exc:  # the target appeared during the job: kept, not replaced
        raise OutputError(f"output: {exc.strerror or exc} (it appeared during the job); "
                          "this job's result was not kept") from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutputError(f"output: no room left on its file system ({exc.strerror}); "
                              "nothing was written") from None
        raise


Job = Callable[[Progress], dict[str, Any]]


def _check_counting_options(method: str, device: str, chunk_rows: int | None) -> None:
    """``ValueError`` for a ``method``, ``device`` or ``chunk_rows`` that the jobs counting
    shared bits (gram, similarity) cannot take, before any work."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    if method in GPU_METHODS and device == "cpu":
        raise ValueError(f"method={method!r} runs on a GPU only; use --device auto or gpu")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk rows must be positive, got {chunk_rows}")


class _ArrayInfo(NamedTuple):
    """An in-memory input's shape and dtype, as a file's header gives them."""

    shape: tuple[int, ...]
    dtype: np.dtype


def is_fps_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a fingerprint file with ids: chemfp's FPS (``.fps``) or an
    FPSim2 database (``.h5``)."""
    return os.fspath(path).lower().endswith((".fps", ".h5"))


def _read_fps(path: str | os.PathLike) -> Fingerprints:
    """An ``.fps`` or FPSim2 ``.h5`` input read whole; :class:`InputError` where it cannot
    be."""
    try:
        return (read_fpsim2 if os.fspath(path).lower().endswith(".h5") else read_fps)(path)
    except (OSError, FpsError, ImportError) as exc:
        raise InputError(f"input: {exc}") from None


def _bits_header(path: str | os.PathLike, packed: bool, command: str) -> NpyHeader | ZarrInfo:
    """The header of a 0/1 (or, ``packed``, packed-words) input of ``command``, checked: 2-D,
    a dtype the kernels take; :class:`InputError` otherwise."""
    h = _header(path, "input")
    if len(h.shape) != 2:
        raise InputError(f"input {path}: {command} needs a 2-D array (rows x bits), got shape "
                         f"{h.shape}")
    try:
        (check_words_dtype if packed else check_bits_dtype)(h.dtype, f"input {path}")
    except TypeError as exc:
        raise InputError(str(exc)) from None
    return h


def _bytes_sent(dask_worker: Any) -> int:
    return int(getattr(dask_worker, "transfer_outgoing_bytes_total", 0))


def sent_by_workers(client: Any | None, since: dict[str, int] | None = None
                         ) -> dict[str, int]:
    """Bytes each worker of ``client``'s cluster has sent to other workers and to clients
    (distributed's ``transfer_outgoing_bytes_total``: it does not tell them apart), less what
    it had sent at ``since`` (an earlier call): what a job moved out of each worker, results
    fetched by the job's process included. Empty without a client (threads move nothing).

    Examples
    --------
    >>> sent_by_workers(None)
    {}
    """
    if client is None:
        return {}
    now = client.run(_bytes_sent)
    return {worker: sent - (since or {}).get(worker, 0) for worker, sent in now.items()}


def _staged(dask_worker: Any = None) -> dict[str, float]:
    return staging_totals.snapshot()


def staged_by_workers(client: Any | None, since: dict[str, dict[str, float]] | None = None
                      ) -> dict[str, dict[str, float]]:
    """What host-fed chunks of each worker of ``client``'s cluster (or, without a client, of
    this process, as ``"this process"``) sent to its GPU and spent doing it
    (:class:`~dask_gpuchunk.runtime.backend.StagingTotals`: bytes to and from the device, host
    copies, waits for the device, time on it), less what it had at ``since`` (an earlier call).

    Examples
    --------
    >>> before = staged_by_workers(None)
    >>> staged_by_workers(None, before)["this process"]["h2d_bytes"]
    0
    """
    now = client.run(_staged) if client is not None else {"this process": _staged()}
    since = since or {}
    return {worker: {name: value - since.get(worker, {}).get(name, 0)
                     for name, value in totals.items()}
            for worker, totals in now.items()}


def _gpu_in_use() -> str | None:
    """The PCI bus id of the GPU this process runs on (its first visible), or ``None``."""
    if not gpu_count():
        return None
    import cupy

    return str(cupy.cuda.Device(0).pci_bus_id)


def where_it_ran(client: Any | None) -> dict[str, Any]:
    """Workers, threads and GPUs of the cluster behind ``client`` (or this process): ``gpus``
    counts the GPUs the jobs' chunks run on: each worker's first visible GPU (a worker of a
    local CUDA cluster sees every GPU, its own first), or this process's."""
    if client is None:
        return {"cluster": "local threads", "workers": 1, "threads": dask_threads(),
                "gpus": min(gpu_count(), 1),
                "device_memory": [_device_report()] if gpu_count() else []}
    info = client.scheduler_info()
    workers = info.get("workers", {})
    gpus = client.run(_gpu_in_use) if workers else {}
    reports = client.run(_device_report) if any(gpus.values()) else {}
    cluster = getattr(client, "cluster", None)
    return {
        "cluster": type(cluster).__name__ if cluster is not None
        else f"scheduler {client.scheduler.address}",
        "workers": len(workers),
        "threads": sum(int(w.get("nthreads", 0)) for w in workers.values()),
        "gpus": len({gpu for gpu in gpus.values() if gpu is not None}),
        # Per worker with a GPU: its budget and the high-water marks of its device memory.
        "device_memory": [dict(worker=address, **report) for address, report in reports.items()],
    }
