"""The graphs of :func:`dask_gpuchunk.gram`: ``C``'s blocks from packed words, listed by hand
where small graphs are, else dask's ``blockwise`` and ``reduction``; from words read where
each block runs (:mod:`dask_gpuchunk.runtime.resident`); row chunks grouped into larger blocks.

Each task runs a function of :mod:`dask_gpuchunk.bits.gram_blocks`; only blocks on or above the
diagonal are computed, a block below it is the transpose of its mirror.
"""

from __future__ import annotations

from typing import Any

import dask.array as da
import numpy as np
from dask.array.utils import meta_from_array
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph
from dask.task_spec import List, Task, TaskRef

from .. import config
from ..runtime import backend
from .._kernels import bitpack as bits
from ..config import listed_graphs
from ..runtime.resident import ResidentSource, row_bounds, rows_where_it_runs, source_tasks
from .gram_blocks import (
    block_task,
    gram_slab,
    kept_partial,
    mirrored_block,
    sum_blocks,
    sum_partials,
    transposed_block,
    upper_partial,
    word_partial,
)

__all__ = ["SPLIT_EVERY", "gram_graph", "resident_gram_slab"]

#: Partial blocks summed per task of the tree over word chunks (as ``split_every`` in dask).
SPLIT_EVERY = 4


def gram_graph(words: da.Array, reader: Any, method: str, device: str,
                row_chunks: tuple[int, ...], keep_on_device: bool = False) -> da.Array:
    """``C`` from packed words: listed by hand where small graphs are (:func:`_listed_graph`),
    else through dask's own constructors (so that array query planning can rewrite it): one
    task per block and word chunk, those below the diagonal returning ``None`` at once, the
    partials of a block summed in a tree (:func:`dask.array.reduction`, ``SPLIT_EVERY`` at a
    time), and a task per block that passes it on or, below the diagonal, transposes its
    mirror."""
    meta = meta_from_array(words._meta, ndim=2, dtype=np.int32)
    if not words.chunks[1]:  # no bits at all: every count is zero
        return da.zeros((words.shape[0],) * 2, chunks=(words.chunks[0],) * 2, dtype=np.int32,
                        meta=meta)
    if reader is not None:  # words straight from a .npy (npy_reader_of)
        if keep_on_device:
            import cupy

            meta = meta_from_array(cupy.empty((0, 0), np.int32), ndim=2, dtype=np.int32)
        return _resident_graph(words, reader, method, device, meta, row_chunks, keep_on_device)
    if listed_graphs():
        return _listed_graph(words, method, device, meta, row_chunks)
    if row_chunks != words.chunks[0]:
        # dask's own rechunk: each group one chunk, stored beside the words while needed.
        words = words.rechunk({0: row_chunks})
    rows = da.arange(words.shape[0], chunks=(words.chunks[0],))
    kwargs = {"method": method, "device": device, "dtype": np.int32}
    if len(words.chunks[1]) == 1:
        upper = da.blockwise(upper_partial, "ij", words, "ik", words, "jk", rows, "i", rows, "j",
                             concatenate=True, meta=meta, **kwargs)
    else:
        partials = da.blockwise(word_partial, "ijk", words, "ik", words, "jk", rows, "i",
                                rows, "j", meta=meta_from_array(meta, ndim=3), **kwargs)
        upper = da.reduction(partials, kept_partial, sum_partials, combine=sum_partials, axis=2,
                             dtype=np.int32, concatenate=False, split_every=SPLIT_EVERY,
                             meta=meta)
    return da.blockwise(mirrored_block, "ij", upper, "ij", upper, "ji", dtype=np.int32, meta=meta)


def _resident_block(source: ResidentSource, rows_a: tuple[int, int], rows_b: tuple[int, int],
                    diagonal: bool, method: str, device: str, keep_on_device: bool = False
                    ) -> Any:
    """Block ``(rows_a, rows_b)`` of the Gram of the words ``source`` reads from a file, each
    chunk read once per process and kept where the block runs (on this process's GPU, or in
    host memory for the CPU); a NumPy block, as the file's words are NumPy, unless
    ``keep_on_device`` (then where it was computed)."""
    a = rows_where_it_runs(source, *rows_a, device)
    b = a if diagonal else rows_where_it_runs(source, *rows_b, device)
    block = block_task(a, b, diagonal, method, device)
    return block if keep_on_device else backend.to_host(block)


def resident_gram_slab(source: ResidentSource, rows_a: tuple[int, int],
                       others: list[tuple[int, int]], method: str = "auto",
                       device: str = "auto") -> np.ndarray:
    """:func:`gram_slab` of rows ``rows_a`` (start, stop) of the words ``source`` reads from
    a file against its row chunks ``others``, each chunk read once per process and kept where
    the slab runs (:func:`~dask_gpuchunk.runtime.resident.rows_where_it_runs`), as a NumPy slab.
    Passed as chunks of a Dask array, every slab task was sent every chunk it did not hold
    (on two H100s, 1 GB of words a worker, then 9.1 GB of pageable copies into pinned buffers)
    and staged all of them to its GPU again.

    Examples
    --------
    >>> from dask_gpuchunk.runtime.resident import ResidentSource
    >>> w = np.packbits(np.array([[1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=np.uint8), axis=1)
    >>> resident_gram_slab(ResidentSource(w, "w"), (0, 1), [(0, 2), (2, 3)], device="cpu")
    array([[2, 1, 2]], dtype=int32)
    """
    a = rows_where_it_runs(source, *rows_a, device)
    slab = gram_slab(a, [rows_where_it_runs(source, *rows, device) for rows in others],
                     method, device)
    return backend.to_host(slab)


def _resident_graph(words: da.Array, reader: Any, method: str, device: str, meta: Any,
                    row_chunks: tuple[int, ...], keep_on_device: bool = False) -> da.Array:
    """The graph of :func:`gram_graph` for words straight from a ``.npy`` (:func:`from_npy`):
    a task per block on or above the diagonal that reads its two row chunks itself
    (:func:`_resident_block`), a transpose per block below. No task reads a chunk for the
    others, so none is sent between workers: on two GPUs the words' chunks had been sent (2.3 GB
    over TLS for 2.1 GB of words) and staged again for every block (34 GB of H2D). The reader
    and the source that reads it are entries of the graph
    (:func:`~dask_gpuchunk.runtime.resident.source_tasks`)."""
    recompute = config.checked("gram-mirror") == "recompute"
    token = tokenize(words, method, device, "resident", recompute, config.flag("read-ahead"),
                     row_chunks, keep_on_device)
    name, upper = f"gram-{token}", f"gram-upper-{token}"
    bounds = row_bounds(row_chunks)
    dsk, source_key = source_tasks(reader, token, read_ahead=bounds)
    # The computed blocks are a task group of their own, whose only dependency is the source,
    # each marked a data producer: distributed then takes them as root tasks and hands them to
    # whichever worker has a free thread. Named as the Gram's own blocks, the group depended
    # on itself (the transposes), so each went where the source was made: on two GPUs one
    # worker ran ~3/4 of the blocks and sent the other 1.3 GB of them for its transposes.
    # Unmarked, the diagonal blocks, fused with their one dependent, form a group of their own
    # that is root-ish only while it has more than twice the cluster's threads: on four GPUs
    # of two threads one worker ran all 16 of them.
    for i, rows_a in enumerate(bounds):
        first_computed = 0 if recompute else i  # the blocks before it are transposes
        for j in range(first_computed, len(bounds)):
            dsk[(upper, i, j)] = Task((upper, i, j), _resident_block, TaskRef(source_key),
                                      rows_a, bounds[j], i == j, method, device,
                                      keep_on_device, _data_producer=True)
            dsk[(name, i, j)] = (upper, i, j)
        for j in range(first_computed):
            dsk[(name, i, j)] = (transposed_block, (upper, j, i))
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=[])
    return da.Array(graph, name, (row_chunks, row_chunks), dtype=np.int32, meta=meta)


def _add_tree(dsk: dict, parts: list[tuple], final: tuple, prefix: str) -> None:
    """Sum the task keys ``parts`` into ``final`` by a tree of ``SPLIT_EVERY``-way sums."""
    level = 0
    while len(parts) > SPLIT_EVERY:
        groups = [parts[g:g + SPLIT_EVERY] for g in range(0, len(parts), SPLIT_EVERY)]
        parts = []
        for g, group in enumerate(groups):
            if len(group) == 1:
                parts.append(group[0])
                continue
            key = (prefix, *final[1:], level, g)
            dsk[key] = (sum_blocks, *group)
            parts.append(key)
        level += 1
    dsk[final] = (sum_blocks, *parts)


def _listed_graph(words: da.Array, method: str, device: str, meta: Any,
                  row_chunks: tuple[int, ...]) -> da.Array:
    """The graph of :func:`gram_graph` as a plain dict: a task per block on or above the
    diagonal and word chunk, a tree of sums, a transpose per block below; no task for what is
    not computed. Blocks over groups of row chunks (``row_chunks``, grouped from ``words``'
    by :func:`grouped_row_chunks`) join their groups' chunks inside the task
    (:func:`_grouped_block`): regrouped by dask's rechunk instead, a device-resident Gram
    held the words twice and spilled (one H200, 8 GiB cap: 1.16 s against 0.58 s ungrouped).
    Measured on an H200 (16,384 rows of 131,072 bits on the device,
    ``listed-graphs``): 13 ms listed against 19-21 ms through ``blockwise`` in chunks
    of 4,096 rows, 17-19 ms against 48-55 ms in chunks of 2,048, mostly dask's optimisation of
    the blockwise layers."""
    token = tokenize(words, method, device, row_chunks)
    name, partial, total = f"gram-{token}", f"gram-partial-{token}", f"gram-sum-{token}"
    groups = _chunk_groups(words.chunks[0], row_chunks)
    word_blocks = len(words.chunks[1])
    dsk: dict[tuple, Any] = {}

    def refs(group: list[int], w: int) -> Any:
        if len(group) == 1:
            return TaskRef((words.name, group[0], w))
        return List(*(TaskRef((words.name, i, w)) for i in group))

    for i, group_i in enumerate(groups):
        for j in range(i, len(groups)):
            parts = []
            for w in range(word_blocks):
                key = (partial, i, j, w) if word_blocks > 1 else (name, i, j)
                dsk[key] = Task(key, _grouped_block, refs(group_i, w), refs(groups[j], w),
                                i == j, method, device)
                parts.append(key)
            if word_blocks > 1:
                _add_tree(dsk, parts, (name, i, j), total)
        for j in range(i):
            dsk[(name, i, j)] = (transposed_block, (name, j, i))
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=[words])
    return da.Array(graph, name, (row_chunks, row_chunks), dtype=np.int32, meta=meta)


def _chunk_groups(chunks: tuple[int, ...], row_chunks: tuple[int, ...]) -> list[list[int]]:
    """The indices of ``chunks`` that make each of ``row_chunks`` (consecutive groups).

    Examples
    --------
    >>> _chunk_groups((2, 2, 3, 1), (4, 4))
    [[0, 1], [2, 3]]
    >>> _chunk_groups((0,), (0,))
    [[0]]
    """
    groups: list[list[int]] = []
    index = 0
    for rows in row_chunks:
        group, filled = [index], chunks[index]  # at least one chunk: empty ones too
        index += 1
        while filled < rows:
            group.append(index)
            filled += chunks[index]
            index += 1
        if filled != rows:
            raise ValueError(f"row groups {row_chunks} do not fall on chunks {chunks}")
        groups.append(group)
    return groups


def _joined_rows(chunks: Any) -> Any:
    """One array of the row chunks ``chunks`` (a list), or the chunk itself."""
    if not isinstance(chunks, list):
        return chunks
    return bits._xp(chunks[0]).concatenate(chunks, axis=0)


def _grouped_block(a: Any, b: Any, diagonal: bool, method: str, device: str) -> Any:
    """:func:`block_task` of two groups of row chunks (each a list of chunks, or a chunk),
    joined where the task runs."""
    rows_a = _joined_rows(a)
    rows_b = rows_a if diagonal else _joined_rows(b)
    return block_task(rows_a, rows_b, diagonal, method, device)
