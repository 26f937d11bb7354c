"""Whole jobs from files to files, as the command line runs them: multiply, gram, demo.

Each job checks everything it can before any work starts (inputs readable and of the right
kind, shapes compatible, the output writable and not already there), so that a user's mistake
ends at once with one line saying what is wrong and nothing written. Then it reads the inputs
chunk by chunk (:func:`dask_gpuchunk.from_npy`), computes on the current Dask scheduler (a
cluster's workers when a client is active), and writes the result chunk by chunk
(:func:`dask_gpuchunk.to_npy`). Each returns a summary dict (what the ``--json`` line prints).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import dask
import numpy as np
from dask.array.core import normalize_chunks
from dask.base import tokenize
from dask.utils import format_bytes, parse_bytes

from . import config, process_memory
from ._kernels.bitpack import BitValueError, check_bits_dtype, check_words_dtype
from ._kernels.elementwise import check_dtype
from ._kernels.gram import GPU_METHODS
from .arrays import asarray
from .backend import dask_threads, staging_totals
from .budget import DeviceBudgetError, budget_report
from .config import listed_graphs
from .devices import (
    DEVICES,
    GPUNotAvailableError,
    check_device,
    distributed_client_active,
    gpu_available,
    gpu_count,
)
from .elementwise import multiply
from .files import FileReplacedError, InputChangedError, publish
from .fingerprint_files import Fingerprints, FpsError, read_fps, read_fpsim2
from .gram import (
    METHODS,
    bitpack,
    block_bytes,
    block_scratch_bytes,
    check_block_fits,
    gram,
    gram_slab,
    resident_gram_slab,
    resolve_method,
)
from .io import (
    NoWorkersError,
    NpyFormatError,
    NpyHeader,
    check_target,
    from_npy,
    npy_bytes,
    npy_in_place,
    npy_reader_of,
    read_header,
    run_writes,
    temporary_output,
    to_npy,
    write_region,
)
from .progress import BlockProgress
from .resident import row_bounds, source_tasks
from .zarr_files import (
    ZarrFormatError,
    ZarrInfo,
    check_compression,
    check_zarr_target,
    from_zarr,
    is_zarr_path,
    read_zarr_info,
    region_writer,
    to_zarr,
    zarr_in_place,
)

__all__ = [
    "BudgetError",
    "ClusterError",
    "InputError",
    "JobError",
    "OutputError",
    "demo",
    "gram_files",
    "gram_job",
    "multiply_files",
    "multiply_job",
    "sent_by_workers",
    "staged_by_workers",
    "watch_device_memory",
    "where_it_ran",
]

#: ``progress(done, total)`` of chunks written; ``progress(done, total, "blocks")`` of a
#: similarity job's blocks computed.
Progress = Callable[..., None] | None

#: Largest whole-width row slab of a Gram output written as one piece (bytes).
SLAB_BYTES = 2 << 30
#: Largest packed input for which a Gram job on GPUs computes whole row slabs, one task each
#: (every such task holds all the words on its device).
ROWS_LAYOUT_WORDS_BYTES = 4 << 30
#: Rows per chunk of a Gram job where none is given (and per output block).
CHUNK_ROWS = 4096
#: Fewest rows per chunk a Gram job takes to fit its blocks into a device budget.
MIN_CHUNK_ROWS = 256
#: The layouts of a Gram job's work (:func:`gram_job`).
LAYOUTS = ("auto", "blocks", "rows", "upper")
#: Row slabs computed ahead of the one being written (layout "rows"): each waits for the
#: write of the slab this many places before it, so finished slabs never pile up in memory.
SLABS_AHEAD = 2


def _device_report(dask_worker: Any = None) -> dict[str, Any]:
    """:func:`dask_gpuchunk.budget.budget_report` of this process (``Client.run`` runs it in
    each worker, passing the worker)."""
    return budget_report(dask_worker)


def _watch_if_gpu() -> bool:
    return gpu_available() and process_memory.watch()


def watch_device_memory(client: Any | None) -> None:
    """Sample the device memory the driver counts for each process with a GPU: the workers of
    ``client``, or this process where it is ``None`` (:func:`dask_gpuchunk.process_memory.watch`;
    the summaries' ``peak_process``)."""
    if client is None:
        _watch_if_gpu()
    else:
        client.run(_watch_if_gpu)


def _budgets_where_it_runs() -> list[int]:
    """The working device budgets of the workers of the active client that have a GPU (or of
    this process), in bytes; empty where none has one."""
    if not distributed_client_active():
        return [_device_report()["working_budget"]] if gpu_available() else []
    from distributed import default_client

    reports = default_client().run(_device_report)
    return [r["working_budget"] for r in reports.values() if r["working_budget"] is not None]


def _check_gpus_where_it_runs(method: str, device: str) -> None:
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


def _slab_after(_previous: Any, a: Any, others: list[Any], method: str, device: str) -> Any:
    """:func:`dask_gpuchunk.gram.gram_slab`, as a task that also waits for ``_previous`` (the
    write of an earlier slab), so that slabs are computed no further ahead of their writer."""
    return gram_slab(a, others, method, device)


def _resident_slab_after(_previous: Any, source: Any, rows_a: tuple[int, int],
                         others: list[tuple[int, int]], method: str, device: str) -> Any:
    """:func:`_slab_after` for words straight from a ``.npy``, which the slab reads itself
    (:func:`dask_gpuchunk.gram.resident_gram_slab`): no chunk of words is sent between
    workers, and each is read and staged once per worker."""
    return resident_gram_slab(source, rows_a, others, method, device)


def _slab_tasks(words: Any, method: str, device: str, upper: bool
                ) -> Callable[[int, Any], Any]:
    """``slab(i, previous)``: the delayed task of row slab ``i`` of the Gram of ``words``
    (:func:`_slab_after`), waiting for ``previous``; over a ``.npy``'s words, read by the slab
    where it runs (:func:`_resident_slab_after`)."""
    from dask import delayed
    from dask.delayed import Delayed
    from dask.highlevelgraph import HighLevelGraph

    reader = npy_reader_of(words)
    if reader is None:
        chunks = _row_chunks_delayed(words)
        return lambda i, previous: delayed(_slab_after, pure=True)(
            previous, chunks[i], chunks[i:] if upper else chunks, method, device)
    bounds = row_bounds(words.chunks[0])
    tag = tokenize(words, "gram-slabs", config.flag("read-ahead"))
    dsk, source_key = source_tasks(reader, tag, read_ahead=bounds)
    source = Delayed(source_key, HighLevelGraph.from_collections(source_key, dsk,
                                                                 dependencies=[]))
    return lambda i, previous: delayed(_resident_slab_after, pure=True)(
        previous, source, bounds[i], bounds[i:] if upper else bounds, method, device)


def _write_upper_strip(strip: Any, n: int, start: int, writer: Callable[..., np.ndarray]
                       ) -> np.ndarray:
    """Write the part of a row slab from its diagonal block rightwards (rows ``start`` on,
    columns ``start`` to the end) in its place, and the same strip transposed in its place
    below the diagonal (columns of the slab's rows), through ``writer(block, region=)``
    (:func:`_region_writer`)."""
    rows = strip.shape[0]
    done = writer(strip, region=(slice(start, start + rows), slice(start, n)))
    below = strip[:, rows:].T  # C is symmetric: these are the slab's columns under the diagonal
    return done + writer(below, region=(slice(start + rows, n), slice(start, start + rows)))


@contextlib.contextmanager
def _region_writer(target: Path, shape: tuple[int, int], block_rows: int, overwrite: bool,
                   reads: Any, output: dict[str, Any]) -> Iterator[Callable[..., np.ndarray]]:
    """An int32 output of ``shape`` written in regions and published whole: ``writer(block,
    region=)`` for the tasks. A ``.npy`` (:func:`dask_gpuchunk.io.npy_in_place`), or a Zarr
    store (``output``: its compression and format) of ``block_rows``-square chunks, which the
    slab writers fill whole."""
    dtype = np.dtype(np.int32)
    if is_zarr_path(target):
        with zarr_in_place(target, dtype, shape, (block_rows, block_rows), overwrite,
                           reads=reads, **output) as store:
            yield region_writer(store)
        return
    with npy_in_place(target, dtype, shape, overwrite, reads) as (tmp, header, key):
        yield functools.partial(write_region, path=tmp, header=header, key=key)


def _gram_slabs_to_file(words: Any, target: Path, method: str, device: str, overwrite: bool,
                        progress: Progress, upper: bool, output: dict[str, Any]) -> None:
    """Write the Gram of ``words`` (whole-width row chunks) to ``target`` slab by slab: each
    task computes one row slab (:func:`dask_gpuchunk.gram.gram_slab`), whole (layout ``rows``)
    or from its diagonal block rightwards (``upper``, :func:`_write_upper_strip`), each write
    task puts it in its place, and slab ``i`` starts only once slab ``i - SLABS_AHEAD`` is
    written, so memory is bounded by slabs, not by the output. Never half-written, as
    :func:`dask_gpuchunk.to_npy`."""
    from dask import delayed

    n = words.shape[0]
    with _region_writer(target, (n, n), words.chunks[0][0], overwrite, words,
                        output) as writer:
        # Delayed tasks, not blockwise: slab i waits for the write of slab i - SLABS_AHEAD, a
        # dependency between blocks that no blockwise construct states; the measured
        # pipelining of the row-slab layout (the perf notes (git show 85dc246:docs/perf-notes.md), item 8) rests on it.
        slab_task = _slab_tasks(words, method, device, upper)
        workers = _workers_to_spread_over()
        writes: list[Any] = []
        start = 0
        for i, rows in enumerate(words.chunks[0]):
            previous = writes[i - SLABS_AHEAD] if i >= SLABS_AHEAD else None
            # Dealt out in turn: distributed places a task with dependencies only on a worker
            # holding one of them, and every slab depends on the words' source (or on the
            # chunks) and on an earlier slab's write, so on 2 x H100 every slab and write ran
            # on the worker that made the source, the other GPU idle. Loose: a worker that
            # dies leaves its slabs to the others.
            with dask.annotate(**({"workers": [workers[i % len(workers)]],
                                   "allow_other_workers": True} if workers else {})):
                slab = slab_task(i, previous)
            if upper:
                write = delayed(_write_upper_strip, pure=True)(slab, n, start, writer)
            else:
                write = delayed(writer, pure=True)(
                    slab, region=(slice(start, start + rows), slice(0, n)))
            writes.append(write)
            start += rows
        run_writes(writes, progress)


def _workers_to_spread_over() -> list[str]:
    """The active distributed client's workers, by address, where there are several; else
    none (one worker, or no cluster: nothing to spread)."""
    if not distributed_client_active():
        return []
    from distributed import default_client

    workers = sorted(default_client().scheduler_info(n_workers=-1)["workers"])
    return workers if len(workers) > 1 else []


def _store_rows(rows: int, n: int, target: Path) -> int:
    """Rows per slab for a Gram of ``n`` rows written to ``target``: ``rows`` for a ``.npy``;
    for a Zarr store, no more than ``rows`` and as equal as the slabs can be (4,000 for
    100,000 rows where ``rows`` is 4,096), since Zarr stores each edge chunk padded to the
    full chunk shape: square chunks of 4,096 over 100,000 rows pad the last column and the
    last row of chunks, 2 GB more of a 40 GB output written and stored."""
    if not is_zarr_path(target) or n <= 0:
        return rows
    return -(-n // -(-n // rows))


def _row_chunks_delayed(words: Any) -> list[Any]:
    """The chunks of ``words`` (one column chunk) as ``dask.delayed`` objects of one graph
    (``Array.to_delayed``, which dask's array query planning does not have)."""
    from dask.delayed import Delayed

    if hasattr(words, "to_delayed"):
        return list(words.to_delayed()[:, 0])
    graph = words.__dask_graph__()
    return [Delayed(row[0], graph) for row in words.__dask_keys__()]


def _slab_bytes(chunk_rows: int, n: int, words_bytes: int, words: int, itemsize: int,
                method: str) -> int:
    """Device bytes of one whole-width row slab task (layout ``rows``): every word, the slab,
    one scratch block and its method's scratch."""
    words64 = -(-words * itemsize // 8)
    resolved = method if method != "auto" else resolve_method("auto", on_gpu=True)
    return (words_bytes + chunk_rows * n * 4 + chunk_rows * chunk_rows * 4
            + block_scratch_bytes(resolved, chunk_rows, chunk_rows, words64))


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


def _warm_multiply(a_shape: tuple[int, ...], a_dtype: str, b_shape: tuple[int, ...],
                   b_dtype: str, device: str) -> None:
    """Compile the kernels a multiply job will use, on tiny arrays broadcast like its inputs."""
    def small(shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.ones(tuple(min(n, 2) for n in shape), dtype=dtype)

    a, b = small(a_shape, a_dtype), small(b_shape, b_dtype)
    for where in ("cpu", "gpu") if device == "auto" else (device,):
        if where == "cpu" or gpu_available():
            multiply(a, b, device=where)  # NumPy in: computed at once


def _warm_gram(words_dtype: str, method: str, device: str, layout: str) -> None:
    """Compile the kernels a Gram job of this layout runs, on two row blocks of packed words:
    for ``blocks`` (a mirror, a transpose), for ``rows`` and ``upper`` one slab, and nothing
    else (numba compiles under one lock per process, so a kernel compiled but not needed can
    still hold up the first slab: 2.4 s of it on the H200 machine)."""
    words = np.ones((96, 16), dtype=words_dtype)
    if layout in ("rows", "upper"):
        gram_slab(words[:48], [words[:48], words[48:]], method, device)
        return
    gram(asarray(words, (48, 16)), packed=True, method=method, device=device).compute(
        scheduler="sync")


def _similarity_words(x: Any, packed: bool, device: str, on_gpu: bool, selection: bool
                      ) -> Any:
    """A similarity job's input rows as the job computes on them: packed (unless ``packed``)
    into whole-row chunks, on the GPUs where ``on_gpu``; for a ``selection`` (top-k or
    threshold) of a ``.npy``'s words left as they are where graphs are listed, since its blocks
    then read those themselves where they run, once per worker (:mod:`dask_gpuchunk.resident`):
    none are sent between workers."""
    if not packed:
        x = bitpack(x, device="cpu" if device == "cpu" else "auto")
    x = x.rechunk({1: -1})
    if not on_gpu or (selection and listed_graphs() and npy_reader_of(x) is not None):
        return x
    return x.map_blocks(_on_device, dtype=x.dtype, meta=x._meta)


def _on_host_all(result: tuple[Any, ...]) -> tuple[Any, ...]:
    """A top-k's or threshold's arrays with NumPy blocks (:func:`_on_host`)."""
    return tuple(a.map_blocks(_on_host, dtype=a.dtype, meta=np.empty((0,) * a.ndim, a.dtype))
                 for a in result)


#: Rows a chunk of the similarity job's warm-up: more than a target's candidate slots in the
#: fused top-k (:data:`dask_gpuchunk._kernels.bmma_select.SLOTS`), so that its empty rows, which
#: tie with every row, overflow them and the exact redo of such targets is compiled too (its
#: ~2 s of kernels had compiled in a first 10^6-row job's last task).
WARM_UP_ROWS = 96


def _warm_similarity(dtype: str, width: int, packed: bool, queries: bool, on_gpu: bool,
                     from_npy_file: bool = False, **options: Any) -> None:
    """Compile the kernels a similarity job runs (``options``: :func:`similarity`'s), on
    random rows of its input's ``dtype`` and ``width`` (packed words, or 0/1 values) in three
    row chunks (two of queries), made ready as the job makes its inputs (``from_npy_file``:
    read back from a small ``.npy`` in a temporary folder, as the job reads its ``.npy``), in
    this thread (dask's synchronous scheduler).

    A first job's tasks otherwise each compiled the CuPy kernels they met first, the same ones
    in every thread at once: on an H100 machine (16 threads), 91 NVRTC compiles of 40 s; each
    kernel is now compiled once, here, and its tasks find it made. Rows made in memory missed
    the kernels of a ``.npy``'s read and of the top-k chain over it: ~1.7 s of a first 7.0 s
    job's compiles, in its tasks."""
    from .similarity import compile_selection_ahead, similarity

    top_k = options.get("top_k")
    if on_gpu:  # the longest compile first, beside the rest
        compile_selection_ahead(options.get("method", "auto"), top_k, options.get("threshold"),
                                options.get("metric", "tanimoto"))
    rows = max(WARM_UP_ROWS, (top_k or 0) + 1)
    rng = np.random.default_rng(0)
    dt = np.dtype(dtype)
    values = (rng.integers(0, np.iinfo(dt).max, (3 * rows, width), dtype=dt.newbyteorder("="),
                           endpoint=True) if packed
              else rng.integers(0, 2, (3 * rows, width))).astype(dt)
    values.reshape(3, rows, width)[:, -4:] = 0  # empty rows: they tie with every row

    with tempfile.TemporaryDirectory(prefix="dask-gpuchunk-warm-up-") as folder:
        def words_of(v: np.ndarray, name: str) -> Any:
            if from_npy_file:
                path = os.path.join(folder, f"{name}.npy")
                np.save(path, v)
                x = _read(path, chunks=(rows, -1))
            else:
                x = asarray(v, chunks=(rows, -1))
            return _similarity_words(x, packed, options.get("device", "auto"), on_gpu,
                                     top_k is not None or options.get("threshold") is not None)

        result = similarity(words_of(values, "x"),
                            words_of(values[:2 * rows], "y") if queries else None,
                            packed=True, **options)
        dask.compute(_on_host_all(result) if isinstance(result, tuple) else result,
                     scheduler="sync")


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


def multiply_files(a: str | os.PathLike, b: str | os.PathLike, out: str | os.PathLike, *,
                   progress: Progress = None, **options: Any) -> dict[str, Any]:
    """``out = a * b`` (NumPy broadcasting) from two ``.npy`` files into a third, chunk by chunk.

    Options as :func:`multiply_job`, which checks the files; this runs the job it returns.
    """
    return multiply_job(a, b, out, **options)(progress)


def multiply_job(
    a: str | os.PathLike,
    b: str | os.PathLike,
    out: str | os.PathLike,
    *,
    device: str = "auto",
    chunk_size: str | int = "200MB",
    overwrite: bool = False,
    compression: str = "none",
    zarr_format: int = 3,
) -> Job:
    """Check the files of ``out = a * b`` now; return the job, to run as ``job(progress)``.

    Inputs and output are ``.npy`` files or Zarr stores (names ending in ``.zarr``; the
    output's ``compression`` and ``zarr_format`` as for :func:`dask_gpuchunk.to_zarr`).
    Raises :class:`InputError` or :class:`OutputError` where the files do not fit; the result
    is written through :func:`dask_gpuchunk.to_npy` or :func:`dask_gpuchunk.to_zarr` (never
    half-written).
    """
    ha, hb = _header(a, "input A"), _header(b, "input B")
    for h, what in ((ha, "input A"), (hb, "input B")):
        try:
            check_dtype(h.dtype.newbyteorder("=") if not h.dtype.isnative else h.dtype, what)
        except TypeError as exc:
            raise InputError(str(exc)) from None
    try:
        shape = np.broadcast_shapes(ha.shape, hb.shape)
    except ValueError:
        raise InputError(f"shapes {ha.shape} (A) and {hb.shape} (B) do not broadcast together") from None
    output = _output_options(out, compression, zarr_format)
    out_dtype = multiply.result_dtype(ha.dtype, hb.dtype)
    target = _check_output(out, [a, b], overwrite, npy_bytes(out_dtype, shape), output)
    # A product is memory-bound: device="auto" runs it on the CPU unless the inputs are
    # already pinned, so only device="gpu" reads them into page-locked memory.
    pinned = device == "gpu"
    x = _read(a, chunks=_row_chunks(ha, chunk_size), pinned=pinned)
    y = _read(b, chunks=_row_chunks(hb, chunk_size), pinned=pinned)
    # The graph is built when the job runs, where its cluster is known (the submitting process
    # may see no GPU where the workers do); its dtype now, from CPU-side rules.
    out_dtype = multiply.result_dtype(x.dtype, y.dtype)
    moved = ha.nbytes + hb.nbytes + int(np.prod(shape, dtype=np.int64)) * out_dtype.itemsize
    result = None

    def run(progress: Progress) -> dict[str, Any]:
        nonlocal result
        _check_gpus_where_it_runs("", device)
        result = multiply(x, y, device=device)
        seconds = _run(
            lambda: _write(result, target, overwrite, progress, output),
            lambda: _start_warmup(_warm_multiply, ha.shape, _native_str(ha.dtype), hb.shape,
                                  _native_str(hb.dtype), device),
        )
        return _multiply_summary(seconds)

    def _multiply_summary(seconds: float) -> dict[str, Any]:
        return {
        "command": "multiply",
        "inputs": [{"path": str(a), "shape": list(ha.shape), "dtype": str(ha.dtype)},
                   {"path": str(b), "shape": list(hb.shape), "dtype": str(hb.dtype)}],
        "output": {"path": str(target), "shape": list(shape), "dtype": str(out_dtype)},
        "chunks": int(np.prod(result.numblocks)),
        "device": device,
        "seconds": seconds,
        "bytes_moved": moved,
        "gb_per_s": moved / seconds / 1e9 if seconds else None,
        }

    return run


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


def gram_files(bits: str | os.PathLike, out: str | os.PathLike, *, progress: Progress = None,
               **options: Any) -> dict[str, Any]:
    """The exact Gram matrix ``A · Aᵀ`` (int32) of a ``.npy`` of 0/1 data into another ``.npy``.

    Options as :func:`gram_job`, which checks the files; this runs the job it returns.
    """
    return gram_job(bits, out, **options)(progress)


def gram_job(
    bits: str | os.PathLike,
    out: str | os.PathLike,
    *,
    packed: bool = False,
    method: str = "auto",
    device: str = "auto",
    chunk_rows: int | None = None,
    layout: str = "auto",
    overwrite: bool = False,
    compression: str = "none",
    zarr_format: int = 3,
) -> Job:
    """Check the files of a Gram job now; return the job, to run as ``job(progress)``.

    ``chunk_rows``: rows per chunk of ``A``, and so per block of the output; ``None``:
    :data:`CHUNK_ROWS` (measured best for the int8 method on an H200), halved while a block
    would not fit the device budget of the workers (on the CPU: while a row slab of the output
    is over :data:`SLAB_BYTES`). ``layout``: ``"blocks"`` (:func:`dask_gpuchunk.gram`'s square
    blocks, only those above the diagonal computed, joined into row slabs on the host; holds
    each block until its transpose is written), ``"rows"`` (each whole row slab computed in one
    task and written, at most :data:`SLABS_AHEAD` ahead of the writer), ``"upper"`` (as
    ``"rows"``, each slab computed from its diagonal block rightwards only, and written in its
    rows and, transposed, in its columns), or ``"auto"``: ``"rows"`` where the job runs on GPUs
    with a method other than popcount and the packed words take at most
    :data:`ROWS_LAYOUT_WORDS_BYTES`, ``"blocks"`` on other GPUs, ``"upper"`` on the CPU. Values
    other than 0/1 raise
    :class:`InputError` when found, with nothing written.
    """
    _check_counting_options(method, device, chunk_rows)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    h = _bits_header(bits, packed, "gram")
    n, k = h.shape
    output = _output_options(out, compression, zarr_format)
    target = _check_output(out, [bits], overwrite, npy_bytes(np.int32, (n, n)), output)
    k_bits = k * h.dtype.itemsize * 8 if packed else k

    def packed_words(rows: int) -> Any:
        if packed:
            return _read(bits, chunks=(rows, -1))
        # Column chunks keep each read bounded; the packed words of a row block are then
        # merged into one chunk (64 x smaller), so each output block is one partial product.
        x = _read(bits, chunks=(rows, max(64, (1 << 27) // max(1, rows) // 64 * 64)))
        return bitpack(x, device="cpu" if device == "cpu" else "auto").rechunk({1: -1})

    words = packed_words(chunk_rows or CHUNK_ROWS)  # checks the input's layout now
    words_bytes = n * words.shape[1] * words.dtype.itemsize

    planned: dict[str, int] = {}

    def plan() -> tuple[str, int, Callable[[Progress], None]]:
        # Where the job runs (the cluster is up by now): the devices' budgets decide.
        nonlocal words
        _check_gpus_where_it_runs(method, device)
        budgets = _budgets_where_it_runs() if device != "cpu" else []
        rows_per_chunk = chunk_rows or CHUNK_ROWS
        if budgets:
            resolved = method if method != "auto" else resolve_method("auto", on_gpu=True)
            words64 = -(-words.shape[1] * words.dtype.itemsize // 8)
            if chunk_rows is None:
                while (rows_per_chunk > MIN_CHUNK_ROWS
                       and block_bytes(rows_per_chunk, words64, resolved) > min(budgets)):
                    rows_per_chunk //= 2
                rows_per_chunk = _store_rows(rows_per_chunk, n, target)
                if rows_per_chunk != CHUNK_ROWS:
                    words = packed_words(rows_per_chunk)
            try:
                check_block_fits(words.chunks, words.dtype.itemsize, method, min(budgets))
            except DeviceBudgetError as exc:
                raise BudgetError(str(exc)) from None
        elif chunk_rows is None and layout in ("auto", "upper"):
            # On the CPU: a strip of at most SLAB_BYTES per task.
            while rows_per_chunk > MIN_CHUNK_ROWS and rows_per_chunk * n * 4 > SLAB_BYTES:
                rows_per_chunk //= 2
            rows_per_chunk = _store_rows(rows_per_chunk, n, target)
            if rows_per_chunk != CHUNK_ROWS:
                words = packed_words(rows_per_chunk)
        planned["chunk_rows"] = rows_per_chunk
        chosen = layout
        if chosen == "auto":
            # On tensor cores the whole Gram costs less than moving it: computing each row
            # slab whole on the GPU leaves the host nothing to do but write it (no transposes
            # of the blocks below the diagonal, no joining of blocks into slabs). Each slab
            # task holds every word on its device, so it must fit the workers' budget.
            rows = (device != "cpu" and method != "popcount"
                    and rows_per_chunk * n * 4 <= SLAB_BYTES
                    and words_bytes <= ROWS_LAYOUT_WORDS_BYTES and bool(budgets)
                    and _slab_bytes(rows_per_chunk, n, words_bytes, words.shape[1],
                                    words.dtype.itemsize, method) <= min(budgets))
            # Elsewhere, on the CPU, each slab's strip from the diagonal rightwards, computed
            # once and written twice (itself, and transposed under the diagonal): half the
            # work of whole slabs, and memory bounded by strips, where dask's blocks hold every
            # block above the diagonal until its transpose is written (the output's half).
            chosen = "rows" if rows else "blocks" if budgets else "upper"
        if chosen in ("rows", "upper"):
            def write(progress: Progress) -> None:
                _gram_slabs_to_file(words, target, method, device, overwrite, progress,
                                    upper=chosen == "upper", output=output)

            return chosen, len(words.chunks[0]), write
        # The planned chunks are the output's (aligned to a store's): not grouped further.
        result = gram(words, packed=True, method=method, device=device,
                      block_rows=rows_per_chunk)
        if (1 < result.numblocks[1] and rows_per_chunk * n * 4 <= SLAB_BYTES
                and not is_zarr_path(target)):
            # Whole-width row slabs: each is one sequential write, as np.save's is. Square
            # blocks dirty the page cache in short runs all over the file, and its writeback
            # then goes to the disk in small pieces.
            result = result.rechunk({1: -1})

        def write_blocks(progress: Progress) -> None:
            _write(result, target, overwrite, progress, output)

        return chosen, int(np.prod(result.numblocks)), write_blocks

    def run(progress: Progress) -> dict[str, Any]:
        chosen, chunks, write = plan()
        seconds = _run(lambda: write(progress),
                       lambda: _start_warmup(_warm_gram, str(words.dtype), method, device,
                                             chosen))
        return {
            "command": "gram",
            "inputs": [{"path": str(bits), "shape": list(h.shape), "dtype": str(h.dtype),
                        "packed": packed}],
            "output": {"path": str(target), "shape": [n, n], "dtype": "int32"},
            "chunks": chunks,
            "chunk_rows": planned["chunk_rows"],
            "layout": chosen,
            "method": method,
            "device": device,
            "seconds": seconds,
            "bit_macs_per_s": float(n) * n * k_bits / seconds if seconds else None,
            "bytes_written": n * n * 4,
        }

    return run


#: Rows per chunk of a similarity job on GPUs, halved while a block would not fit the workers'
#: budget (:func:`dask_gpuchunk.similarity.block_bytes`); 4,096 on the CPU. Measured on an H200 under an
#: 8 GiB cap, the API on device words: all-pairs top-10 of 10**6 x 2048 bits in 2.8 s in
#: 16,384-row chunks, 2.0 s in 32,768-row ones (threshold 0.7: 3.95 s, 1.63 s). A row chunk's
#: first block, selected on the plain path, once held all its counts (4 GiB in 32,768-row
#: chunks); its counts are now taken in slices. The job from a .npy in process (H100, 8 GiB
#: cap): 6.4 s end to end in 32,768-row chunks, 8.3 s in 16,384-row ones.
SIMILARITY_CHUNK_ROWS = 32768


def _on_device(block: Any) -> Any:
    """A chunk of packed words moved to this worker's GPU once (each block of a similarity
    then runs on device words instead of staging both of its chunks again)."""
    import cupy

    return cupy.asarray(block)


def _on_host(block: Any) -> np.ndarray:
    """A result chunk as NumPy, made on the worker that holds it: the job's process then
    receives plain bytes and needs no GPU of its own to read them."""
    return block if isinstance(block, np.ndarray) else block.get()


def _save_arrays(target: Path, arrays: dict[str, np.ndarray], overwrite: bool) -> None:
    """``np.savez`` of ``arrays`` into a temporary file beside ``target``, published onto it
    when complete (never half-written; an existing file replaced only with ``overwrite``)."""
    with temporary_output(target) as (tmp, fd, key):
        with open(fd, "wb", closefd=False) as f:
            np.savez(f, **arrays)
        publish(tmp, target, key, overwrite)


def _check_similarity_inputs(paths: list[Any], headers: list[Any], packed: bool,
                             top_k: int | None, threshold: float | None, metric: str,
                             exclude_self: bool) -> None:
    """What :func:`dask_gpuchunk.similarity` checks of its arguments, in the command line's
    words, before any cluster starts: ``--queries`` and FINGERPRINTS of the same bits,
    ``--top-k`` within the candidates, ``--threshold`` within the metric's scores."""
    from ._kernels.similarity import FLOAT_METRICS

    (n, width), dtype = headers[-1].shape, headers[-1].dtype
    if len(headers) == 2 and (headers[0].shape[1] != width or headers[0].dtype != dtype):
        what = "words" if packed else "bits"
        raise InputError(f"--queries {paths[0]} has {headers[0].shape[1]} {what} of "
                         f"{headers[0].dtype} a row, FINGERPRINTS {paths[1]} {width} of {dtype}: "
                         "they must be fingerprints of the same kind")
    candidates = n - 1 if exclude_self else n
    if top_k is not None and candidates < 1:
        raise InputError(f"FINGERPRINTS {paths[-1]} has {n:,} row(s): no candidates for --top-k"
                         + (" other than each row itself" if exclude_self and n else ""))
    if top_k is not None and not 1 <= top_k <= candidates:
        raise ValueError(f"--top-k must be between 1 and {candidates:,} (the candidates of each "
                         f"row in {paths[-1]}); got {top_k}")
    bits = width * dtype.itemsize * 8 if packed else width
    high = 1.0 if metric in FLOAT_METRICS else bits
    if threshold is not None and not 0 <= threshold <= high:
        raise ValueError(f"--threshold for --metric {metric} must be from 0 to {high}; got "
                         f"{threshold}")


def similarity_job(
    fingerprints: str | os.PathLike,
    out: str | os.PathLike,
    *,
    queries: str | os.PathLike | None = None,
    metric: str = "tanimoto",
    top_k: int | None = None,
    threshold: float | None = None,
    packed: bool = False,
    exclude_self: bool | None = None,
    method: str = "auto",
    device: str = "auto",
    chunk_rows: int | None = None,
    overwrite: bool = False,
    compression: str = "none",
    zarr_format: int = 3,
    alpha: float | None = None,
    beta: float | None = None,
) -> Job:
    """Check the files of a similarity job now; return the job, to run as ``job(progress)``.

    All pairs of ``fingerprints`` (``.npy`` or ``.zarr``, 0/1 data or with ``packed`` packed
    words), or each row of ``queries`` against them (:func:`dask_gpuchunk.similarity`). With
    ``top_k``: ``out`` is a ``.npz`` of ``indices`` and ``scores`` ``(n, top_k)`` (with
    ``threshold`` too, those short of it masked as :func:`dask_gpuchunk.similarity` does);
    with ``threshold`` alone: a ``.npz`` of ``rows``, ``cols`` and ``scores``; else the dense scores into
    a ``.npy`` or Zarr store. ``chunk_rows``: rows per chunk of each input; ``None``:
    :data:`SIMILARITY_CHUNK_ROWS` on GPUs, halved while a block would not fit the workers'
    budget, 4,096 on the CPU. On GPUs the packed words are moved to the devices once: for
    top-k of a packed ``.npy``, read there by each worker (none sent between workers).
    ``alpha``, ``beta``: Tversky's weights (``metric="tversky"``), as
    :func:`dask_gpuchunk.similarity` takes them.
    """
    from ._kernels.similarity import score_dtype
    from .similarity import METRICS, similarity
    from .similarity import block_bytes as similarity_block_bytes

    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}; got {metric!r}")
    _check_counting_options(method, device, chunk_rows)
    paths = [fingerprints] if queries is None else [queries, fingerprints]
    fps = {i: _read_fps(path) for i, path in enumerate(paths) if is_fps_path(path)}
    if fps and len(fps) < len(paths) and not packed:
        raise InputError("an .fps or FPSim2 .h5 file holds packed words: give the other input "
                         "as packed words too (--packed), or as such a file")
    packed = packed or bool(fps)
    headers = [_ArrayInfo(fps[i].words.shape, fps[i].words.dtype) if i in fps
               else _bits_header(path, packed, "similarity") for i, path in enumerate(paths)]
    n, m = headers[0].shape[0], headers[-1].shape[0]
    _check_similarity_inputs(paths, headers, packed, top_k, threshold, metric,
                             (queries is None) if exclude_self is None else exclude_self)
    dense = top_k is None and threshold is None
    suffix = Path(out).suffix
    if dense and suffix == ".npz":
        raise OutputError(f"output {out}: dense scores go to a .npy file or a Zarr store; "
                          "top-k and threshold results to a .npz")
    if not dense and suffix != ".npz":
        raise OutputError(f"output {out}: top-k and threshold results go to a .npz file")
    dtype = score_dtype(metric)
    output = _output_options(out, compression, zarr_format) if dense else {}
    nbytes = (npy_bytes(dtype, (n, m)) if dense
              else n * int(top_k) * 12 if top_k is not None else 0)
    target = _check_output(out, paths, overwrite, nbytes, output)

    def words_of(i: int, rows: int, on_gpu: bool) -> Any:
        import dask.array as da

        read = (da.from_array(fps[i].words, chunks=(rows, -1)) if i in fps
                else _read(paths[i], chunks=(rows, -1)))
        return _similarity_words(read, packed, device, on_gpu,
                                 top_k is not None or threshold is not None)

    def run(progress: Progress) -> dict[str, Any]:
        _check_gpus_where_it_runs(method, device)
        budgets = _budgets_where_it_runs() if device != "cpu" else []
        rows = chunk_rows or (SIMILARITY_CHUNK_ROWS if budgets else CHUNK_ROWS)
        h = headers[0]  # 64-bit words per row
        width = -(-h.shape[1] * h.dtype.itemsize // 8) if packed else -(-h.shape[1] // 64)
        if budgets and chunk_rows is None:
            # "auto": wgmma, bmma or int8, as the workers' GPUs have them; the largest.
            methods = ["wgmma", "bmma", "int8"] if method == "auto" else [method]
            while rows > MIN_CHUNK_ROWS and max(similarity_block_bytes(
                    rows, width, each, top_k, threshold, metric) for each in methods
            ) > min(budgets):
                rows //= 2
        x = words_of(0, rows, bool(budgets))
        y = None if queries is None else words_of(1, rows, bool(budgets))
        t0 = time.perf_counter()
        options = dict(metric=metric, top_k=top_k, threshold=threshold,
                       exclude_self=exclude_self, method=method, device=device, alpha=alpha,
                       beta=beta)
        warm = (h.dtype.str, h.shape[1], packed, queries is not None, bool(budgets),
                not is_zarr_path(paths[0]) and not fps)
        if distributed_client_active():  # each worker compiles while the words are read
            warming = _start_warmup(_warm_similarity, *warm, **options)  # noqa: F841
        else:
            try:
                _warm_similarity(*warm, **options)
            except Exception as exc:  # noqa: BLE001 - the job meets the same code, and says
                logging.getLogger("dask_gpuchunk").debug("similarity warm-up: %r", exc)
        result = similarity(x, y, packed=True, **options)
        if dense:
            _run(lambda: _write(result, target, overwrite, progress, output))
            pairs_found = None
        else:
            # All pairs: the blocks on and above the diagonal; queries: each pair of chunks.
            cx, cy = len(x.chunks[0]), len(x.chunks[0] if y is None else y.chunks[0])
            blocks = cx * (cx + 1) // 2 if y is None else cx * cy
            report = ((lambda done, total: progress(done, total, "blocks"))
                      if progress is not None else None)
            watching = (contextlib.nullcontext() if report is None
                        else BlockProgress(blocks, report))
            with job_errors(), watching:
                computed = dask.compute(*_on_host_all(result))
            names = ("indices", "scores") if top_k is not None else ("rows", "cols", "scores")
            arrays = dict(zip(names, computed))
            # The molecules' ids of .fps inputs: indices, cols index ids; rows query_ids.
            if len(paths) - 1 in fps:
                arrays["ids"] = fps[len(paths) - 1].ids
            if queries is not None and 0 in fps:
                arrays["query_ids"] = fps[0].ids
            _save_arrays(target, arrays, overwrite)
            pairs_found = None if top_k is not None else int(computed[0].shape[0])
            if report is not None:
                report(blocks, blocks)
        seconds = time.perf_counter() - t0
        shape = ([n, m] if dense else [n, int(top_k)] if top_k is not None
                 else [pairs_found])
        return {
            "command": "similarity",
            "inputs": [{"path": str(p), "shape": list(h.shape), "dtype": str(h.dtype),
                        "packed": packed} for p, h in zip(paths, headers)],
            "output": {"path": str(target), "shape": shape, "dtype": str(dtype)},
            "metric": metric,
            **({"alpha": alpha, "beta": beta} if metric == "tversky" else {}),
            "top_k": top_k,
            "threshold": threshold,
            "pairs_found": pairs_found,
            "chunk_rows": rows,
            "seconds": seconds,
            # unique pairs: all pairs once each, n (n - 1) / 2; queries x database n m
            "pairs_per_s": (n * (n - 1) / 2 if queries is None else n * m) / seconds
            if seconds else None,
        }

    return run


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
    (:class:`~dask_gpuchunk.backend.StagingTotals`: bytes to and from the device, host copies,
    waits for the device, time on it), less what it had at ``since`` (an earlier call).

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


def demo(
    *,
    rows: int = 500_000,
    cols: int = 50,
    bit_rows: int = 4000,
    bits: int = 20_000,
    workdir: str | os.PathLike | None = None,
    device: str = "auto",
    progress: Progress = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The main job on an embedded default: synthetic inputs, multiply and gram through files.

    Writes two float64 ``(rows, cols)`` inputs and a 0/1 ``(bit_rows, bits)`` matrix with
    :func:`dask_gpuchunk.to_npy` (generated chunk by chunk), runs :func:`multiply_files` and
    :func:`gram_files` on the current scheduler, checks sampled rows of both outputs against
    NumPy, and returns both summaries. Files go to ``workdir`` (default: a temporary directory,
    removed at the end).
    """
    import dask.array as da

    with tempfile.TemporaryDirectory(prefix="dask-gpuchunk-demo-") as tmp:
        work = Path(workdir) if workdir is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        a_path, b_path, c_path = work / "a.npy", work / "b.npy", work / "c.npy"
        bits_path, g_path = work / "bits.npy", work / "gram.npy"
        rng = da.random.default_rng(2026)
        chunk = max(1, (64 << 20) // (cols * 8))
        log(f"demo: writing inputs to {work} ...")
        t0 = time.perf_counter()
        to_npy(rng.random((rows, cols), chunks=(chunk, cols)), a_path, overwrite=True)
        to_npy(rng.random((rows, cols), chunks=(chunk, cols)), b_path, overwrite=True)
        to_npy((rng.random((bit_rows, bits), chunks=(1024, bits)) < 0.3).astype(np.uint8),
               bits_path, overwrite=True)
        t_inputs = time.perf_counter() - t0
        log("demo: multiply ...")
        mult = multiply_files(a_path, b_path, c_path, device=device, overwrite=True,
                              progress=progress)
        log("demo: gram ...")
        grm = gram_files(bits_path, g_path, device=device, chunk_rows=1024, overwrite=True,
                         progress=progress)
        sample = np.random.default_rng(0).choice(rows, size=min(rows, 64), replace=False)
        a, b, c = (np.load(p, mmap_mode="r") for p in (a_path, b_path, c_path))
        if not np.array_equal(c[sample], a[sample] * b[sample]):
            raise JobError("demo: multiply result differs from NumPy")
        bits_arr = np.load(bits_path, mmap_mode="r")
        g = np.load(g_path, mmap_mode="r")
        rows_g = np.random.default_rng(1).choice(bit_rows, size=min(bit_rows, 8), replace=False)
        full = np.asarray(bits_arr, dtype=np.float32)  # exact: sums stay below 2**24
        expected = (full[rows_g] @ full.T).astype(np.int32)
        if not np.array_equal(g[rows_g], expected):
            raise JobError("demo: gram result differs from NumPy")
        del a, b, c, bits_arr, g, full
    return {"command": "demo", "inputs_seconds": t_inputs, "multiply": mult, "gram": grm,
            "checked": {"multiply_rows": len(sample), "gram_rows": len(rows_g)},
            "files_kept": workdir is not None}
