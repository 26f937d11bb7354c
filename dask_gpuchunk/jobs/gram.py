"""The Gram job: ``A · Aᵀ`` of a file's 0/1 rows (or packed words) into a file, in one of its
layouts (blocks, whole row slabs, the upper triangle's strips), chunk by chunk.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dask
import numpy as np
from dask.base import tokenize

from .. import config
from ..arrays import asarray
from ..runtime.budget import DeviceBudgetError
from ..devices import distributed_client_active
from ..bits.gram import (
    bitpack,
    block_bytes,
    block_scratch_bytes,
    check_block_fits,
    gram,
    gram_slab,
    resident_gram_slab,
    resolve_method,
)
from ..io import npy_bytes, npy_in_place, npy_reader_of, run_writes, write_region
from ..io.zarr_files import is_zarr_path, region_writer, zarr_in_place
from ..runtime.resident import row_bounds, source_tasks
from .common import (
    BudgetError,
    Job,
    Progress,
    _bits_header,
    _budgets_where_it_runs,
    _check_counting_options,
    check_gpus_where_it_runs,
    _check_output,
    _output_options,
    _read,
    _run,
    _start_warmup,
    _write,
)

__all__ = ["gram_files", "gram_job"]

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


def _slab_after(_previous: Any, a: Any, others: list[Any], method: str, device: str) -> Any:
    """:func:`dask_gpuchunk.bits.gram.gram_slab`, as a task that also waits for ``_previous`` (the
    write of an earlier slab), so that slabs are computed no further ahead of their writer."""
    return gram_slab(a, others, method, device)


def _resident_slab_after(_previous: Any, source: Any, rows_a: tuple[int, int],
                         others: list[tuple[int, int]], method: str, device: str) -> Any:
    """:func:`_slab_after` for words straight from a ``.npy``, which the slab reads itself
    (:func:`dask_gpuchunk.bits.gram.resident_gram_slab`): no chunk of words is sent between
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
    task computes one row slab (:func:`dask_gpuchunk.bits.gram.gram_slab`), whole (layout ``rows``)
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
        check_gpus_where_it_runs(method, device)
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
