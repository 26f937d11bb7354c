"""The graphs of a top-k or threshold similarity selection, listed by hand: the top-k chain
of states per row chunk, in rounds of disjoint chunk pairs (a chain per worker on a cluster of
several), and a threshold's task per block merged per row chunk; each block's words read where
it runs when they come from a ``.npy``. What the tasks run is
:mod:`dask_gpuchunk.bits.selection`.
"""

from __future__ import annotations

import functools
from typing import Any

import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph
from dask.task_spec import List, Task, TaskRef

from .._kernels import similarity as kernels
from ..devices import cluster_worker_addresses, cluster_workers, gpu_available
from ..io import npy_reader_of
from ..runtime.backend import is_cupy
from ..runtime.budget import graph_budget
from ..runtime.resident import ResidentSource, row_bounds, rows_where_it_runs, source_tasks
from .selection import (
    Selection,
    block_bytes,
    chain_rounds,
    cross_block,
    first_state,
    gathered,
    merged_chain_states,
    next_states_of_blocks,
    popcounts,
    state_of,
    upper_block,
)
from .top_k_tiles import (add_tile_tasks, chunk_groups, final_state, host_states,
                          round_robin, tile_bytes, tile_groups, tile_slots, tiles_graph)

__all__ = ["CPU_BLOCKS_PER_TASK", "GPU_BLOCKS_PER_TASK", "chains_for", "merged_keys",
           "merged_pairs", "threshold_pairs", "top_k_chain"]

#: Blocks a task of the top-k chain computes at most on GPUs, in whole rounds one after the
#: other (at least a round). On a cluster a task waits for a trip through the scheduler before
#: it starts: 16 ms a round for 10**7 rows on two GPUs when a task took a round (2.4 s of a 46 s
#: chain). In one process too (H200, 8 GiB cap, 2026-11-29, results equal): the top-10 of
#: 10**7 x 2048 bits from a .npy 68.9 s against 86.4 s with a round in a task; of 10**6 rows
#: 0.98-1.00 s against 1.01-1.03 s (1.00-1.01 s with 128 blocks a task).
GPU_BLOCKS_PER_TASK = 1024
#: The same on the CPU, where a block takes a tenth of a second or more: one a task, so that
#: progress bars counting tasks move with the work.
CPU_BLOCKS_PER_TASK = 1

def chains_for(workers: int, rounds: int) -> int:
    """Chains of the top-k over ``rounds`` rounds of blocks on a cluster of ``workers``: one
    per worker (each keeps its own states on its own device, merged once at the end), one on
    a single worker or process. One chain over two GPUs moved every state between them
    between rounds (1.2 GB a worker over TLS for 10**6 rows) and took twice as long as on one.

    Examples
    --------
    >>> chains_for(1, 30), chains_for(4, 30), chains_for(4, 2), chains_for(2, 0)
    (1, 4, 2, 1)
    """
    return max(1, min(workers, rounds))


def _resident_popcounts(source: ResidentSource, start: int, stop: int, device: str) -> Any:
    return popcounts(rows_where_it_runs(source, start, stop, device))


def _chunk_refs(words: da.Array, pops: da.Array, device: str, dsk: dict, tag: str,
                read_ahead: bool = False, deferred: bool = False
                ) -> tuple[list[Any], list[Any], list[da.Array]]:
    """What a task of the top-k chain names for each row chunk's words and popcounts: the keys
    of ``words`` and ``pops``, or, for words straight from a ``.npy``
    (:func:`dask_gpuchunk.io.npy_reader_of`), tasks inside the task that read them where it
    runs (:func:`~dask_gpuchunk.runtime.resident.rows_where_it_runs`, through a source that ``dsk``
    gains): then no chunk of words is sent between workers. Last, the collections the names
    need (none for a ``.npy``). ``read_ahead``: each process's source reads every chunk once a
    task has asked for its first (while they fit its device's share), for a graph whose every
    worker meets every chunk (the top-k's chains). ``deferred``: a ``.npy``'s reads as
    ``functools.partial`` calls, made by the task itself when it is ready (the tiles')."""
    reader = npy_reader_of(words)
    if reader is None:
        keys = [(words.name, i, 0) for i in range(len(words.chunks[0]))]
        return ([TaskRef(key) for key in keys],
                [TaskRef((pops.name, i)) for i in range(len(words.chunks[0]))], [words, pops])
    bounds = row_bounds(words.chunks[0])
    entries, source_key = source_tasks(reader, tag, read_ahead=bounds if read_ahead else ())
    dsk.update(entries)
    source = TaskRef(source_key)
    if deferred:
        return ([Task(None, functools.partial, rows_where_it_runs, source, a, b, device)
                 for a, b in bounds],
                [Task(None, functools.partial, _resident_popcounts, source, a, b, device)
                 for a, b in bounds], [])
    return ([Task(None, rows_where_it_runs, source, a, b, device) for a, b in bounds],
            [Task(None, _resident_popcounts, source, a, b, device) for a, b in bounds], [])


def _chunk_refs_of_both(wx: da.Array, wy: da.Array, pop_x: da.Array, pop_y: da.Array,
                        device: str, dsk: dict, token: str, read_ahead: bool = False,
                        deferred: bool = False) -> tuple[list, list, list, list, list]:
    """:func:`_chunk_refs` of ``x`` and of ``y`` (the same where ``wy`` is ``wx``): words and
    popcounts of each, then the collections they need."""
    words_x, pops_x, needs = _chunk_refs(wx, pop_x, device, dsk, f"x-{token}", read_ahead,
                                         deferred)
    if wy is wx:
        return words_x, pops_x, words_x, pops_x, needs
    words_y, pops_y, needs_y = _chunk_refs(wy, pop_y, device, dsk, f"y-{token}", read_ahead,
                                           deferred)
    return words_x, pops_x, words_y, pops_y, needs + needs_y


def top_k_chain(wx: da.Array, wy: da.Array, pop_x: da.Array, pop_y: da.Array,
                 all_pairs: bool, selection: Selection, method: str, device: str,
                 meta: Any) -> da.Array:
    """The best keys ``(n, k)`` of each row, listed by hand as a chain of states per row
    chunk: each row chunk's first block (all pairs: its diagonal block) by the plain path,
    then the further blocks, each updating the states of its row chunk and (all pairs) its
    column chunk (:func:`_next_states`), in rounds of disjoint chunk pairs: on GPUs whole
    rounds one after the other in a task, up to :data:`GPU_BLOCKS_PER_TASK` blocks
    (:func:`_add_chain_tasks`), on the CPU :data:`CPU_BLOCKS_PER_TASK` blocks a task; what a
    block keeps never leaves the device that computed it, and only the states (``8 k`` bytes
    a row) move between tasks.

    On a cluster of several workers, a chain per worker (:func:`chains_for`): chain ``c``
    begins from every first state, gathered by a task that distributed hands to a worker of
    its own (a data producer: a root task, which goes where a thread is free, not where its
    dependencies are), and takes the rounds ``r`` with ``r % chains == c``, which follow it
    there; a chunk's states of the chains merge at the end (:func:`merged_chain_states`).

    All pairs on GPUs run in tiles of row-chunk groups instead
    (:mod:`dask_gpuchunk.bits.top_k_tiles`): one state per row chunk, nothing merged. On
    2 x H200 (8 GiB cap), the top-10 of 10**7 x 2048-bit fingerprints from a ``.npy``:
    34.4-34.6 s in tiles against 39.9-40.0 s in two chains; on one GPU 65.7-66.1 s against
    68.6 s; under a 2 GiB cap, where the chains ran out of memory, 39.4-40.2 s on two GPUs."""
    k = selection.k
    chunks_x, chunks_y = len(wx.chunks[0]), len(wy.chunks[0])
    tiles = all_pairs and device != "cpu" and gpu_available()
    if tiles:  # the groups and where the states stay, from the device's budget
        budget, workers = graph_budget(), cluster_worker_addresses()
        row_bytes = wx.shape[1] * wx.dtype.itemsize
        groups = chunk_groups(chunks_x, tile_groups(chunks_x, wx.shape[0], row_bytes, k, budget,
                                                    max(len(workers), 1)))
        on_host = host_states(wx.shape[0], k, budget)
        # A block's bytes by bmma's where the device's method is not named (the graph may be
        # made where no GPU is): the fused kernels' scratch is the same function of the rows.
        slots = tile_slots(budget, tile_bytes(-(-wx.shape[0] // len(groups)), row_bytes, k),
                           block_bytes(max(wx.chunks[0]), -(-row_bytes // 8),
                                       "bmma" if method == "auto" else method, k),
                           wx.shape[0] * (row_bytes + 4))
    elif all_pairs:  # rounds of disjoint chunk pairs
        order = round_robin(chunks_x)
        per_round = max(chunks_x // 2, 1)
        rounds = [order[r:r + per_round] for r in range(0, len(order), per_round)]
    else:  # a round per database chunk: each query chunk's state once
        rounds = [[(i, j) for i in range(chunks_x)] for j in range(1, chunks_y)]
    chains = 1 if tiles else chains_for(cluster_workers(), len(rounds))
    token = tokenize(wx, wy, selection, method, device, chains,
                     (len(groups), on_host, slots) if tiles else None)
    name, first, begin, step = (f"similarity-top-k-{token}", f"similarity-first-{token}",
                                f"similarity-begin-{token}", f"similarity-step-{token}")
    starts_x = [start for start, _ in row_bounds(wx.chunks[0])]
    starts_y = [start for start, _ in row_bounds(wy.chunks[0])]
    opts = {"selection": selection, "method": method, "device": device}
    dsk: dict[Any, Any] = {}
    # Each chain, and each worker's tiles, meet every chunk: on two GPUs a worker's first chain
    # task read the half its first states had not (2.5 s against 2.1 s in one process for
    # 10**7 rows).
    words_x, pops_x, words_y, pops_y, needs = _chunk_refs_of_both(
        wx, wy, pop_x, pop_y, device, dsk, token, read_ahead=True, deferred=tiles)
    if tiles:  # each row chunk's first state in its group's own task
        latest = [add_tile_tasks(dsk, step, groups, opts, (words_x, pops_x, starts_x),
                                 not needs, on_host, slots)]
    else:
        x, y = (words_x, pops_x, starts_x), (words_y, pops_y, starts_y)
        latest = _first_states(dsk, first, begin, chains, all_pairs, opts, not needs, x, y)
        if device != "cpu" and gpu_available():  # rounds several to a task
            for c in range(chains):
                _add_chain_tasks(dsk, step, rounds, c, chains, latest[c], all_pairs, opts, x, y)
        else:
            _add_cpu_rounds(dsk, step, rounds, latest, all_pairs, opts, x, y)
    for i in range(chunks_x):
        key = (name, i, 0)
        if tiles:
            dsk[key] = Task(key, final_state, *_ref(latest[0][i]), is_cupy(meta))
        elif chains == 1:
            dsk[key] = Task(key, state_of, *_ref(latest[0][i]))
        else:
            dsk[key] = Task(key, merged_chain_states, k,
                            *(part for held in latest for part in _ref(held[i])))
    graph = (tiles_graph(name, step, dsk, needs, len(groups), workers) if tiles
             else HighLevelGraph.from_collections(name, dsk, dependencies=needs))
    return da.Array(graph, name, (wx.chunks[0], (k,)), dtype=np.uint64, meta=meta)


def _first_states(dsk: dict, first: str, begin: str, chains: int, all_pairs: bool, opts: dict,
                  producer: bool, x: tuple, y: tuple) -> list[dict[int, tuple[Any, int]]]:
    """Each row chunk's first block into ``dsk`` (all pairs: its diagonal block; else against
    the first database chunk), and, for several chains, each chain's beginning gathering them
    all: where each chain's state of each row chunk begins, ``[{chunk: (task, slot)}]``.
    ``producer``: the words come from a ``.npy`` source, a first block's only dependency;
    marked a data producer, it goes to a worker with a free thread, not where the source was
    made."""
    (words_x, pops_x, starts_x), (words_y, pops_y, starts_y) = x, y
    first_task = functools.partial(first_state, **opts)
    for i in range(len(words_x)):
        j = i if all_pairs else 0
        dsk[(first, i)] = Task((first, i), first_task, words_x[i], words_y[j], pops_x[i],
                               pops_y[j], starts_x[i], starts_y[j], all_pairs,
                               _data_producer=producer)
    if chains == 1:
        return [{i: ((first, i), 0) for i in range(len(words_x))}]
    latest = []
    for c in range(chains):
        dsk[(begin, c)] = Task((begin, c), gathered,
                               *(TaskRef((first, i)) for i in range(len(words_x))),
                               _data_producer=True)
        latest.append({i: ((begin, c), i) for i in range(len(words_x))})
    return latest


def _add_cpu_rounds(dsk: dict, step: str, rounds: list[list[tuple[int, int]]],
                    latest: list[dict], all_pairs: bool, opts: dict, x: tuple, y: tuple
                    ) -> None:
    """The chains' tasks on the CPU: each round ``r`` (chain ``r % chains``) in tasks of at
    most :data:`CPU_BLOCKS_PER_TASK` blocks; ``latest`` (each chain's ``{chunk: (task,
    slot)}``) follows them."""
    (words_x, pops_x, starts_x), (words_y, pops_y, starts_y) = x, y
    next_task = functools.partial(next_states_of_blocks, **opts)
    for r, blocks in enumerate(rounds):
        held = latest[r % len(latest)]
        tasks = -(-len(blocks) // CPU_BLOCKS_PER_TASK)
        for t in range(tasks):
            key = (step, r, t)
            args: list[Any] = []
            mine = blocks[t * len(blocks) // tasks:(t + 1) * len(blocks) // tasks]
            for i, j in mine:
                args += [words_x[i], words_y[j], pops_x[i], pops_y[j], starts_x[i],
                         starts_y[j], *_ref(held[i]), *_ref(held[j] if all_pairs else None)]
            dsk[key] = Task(key, next_task, *args)
            for b, (i, j) in enumerate(mine):
                held[i] = (key, 2 * b)
                if all_pairs:
                    held[j] = (key, 2 * b + 1)


def _add_chain_tasks(dsk: dict, step: str, rounds: list[list[tuple[int, int]]], chain: int,
                     chains: int, held: dict, all_pairs: bool, opts: dict, x: tuple,
                     y: tuple) -> None:
    """The tasks of chain ``chain`` on GPUs: its rounds (``r % chains == chain``), whole,
    as many one after the other in a task as :data:`GPU_BLOCKS_PER_TASK` allows
    (:func:`~dask_gpuchunk.bits.selection.chain_rounds`); ``held`` (each row chunk's
    ``(task, slot)`` so far) follows them. A chain's next task waits for a trip through the
    scheduler: 16 ms a round of 10**7 rows on two GPUs, when a task took a round."""
    groups: list[list[int]] = []
    blocks = 0  # in the last group
    for r in range(chain, len(rounds), chains):
        if groups and blocks + len(rounds[r]) <= GPU_BLOCKS_PER_TASK:
            groups[-1].append(r)
            blocks += len(rounds[r])
        else:
            groups.append([r])
            blocks = len(rounds[r])
    for group in groups:
        places: dict[tuple[str, int], int] = {}
        for r in group:
            for i, j in rounds[r]:
                places.setdefault(("x", i), len(places))
                places.setdefault(("x" if all_pairs else "y", j), len(places))
        args: list[Any] = []
        for side, i in places:
            words, pops, starts = x if side == "x" else y
            state = _ref(held[i]) if side == "x" else (None, 0)
            args += [words[i], pops[i], starts[i], *state]
        plan = tuple(tuple((places[("x", i)], places[("x" if all_pairs else "y", j)])
                           for i, j in rounds[r]) for r in group)
        key = (step, group[0], 0)
        dsk[key] = Task(key, functools.partial(chain_rounds, rounds=plan, symmetric=all_pairs,
                                               **opts), *args)
        for (side, i), place in places.items():
            if side == "x":
                held[i] = (key, place)


def threshold_pairs(wx: da.Array, wy: da.Array, pop_x: da.Array, pop_y: da.Array,
                     all_pairs: bool, selection: Selection, method: str, device: str,
                     meta: Any) -> da.Array:
    """The pairs meeting ``selection``'s threshold of each row chunk ``(nan, 2)``, listed by
    hand: a task per block (all pairs: on or above the diagonal only) keeps its pairs
    (:func:`upper_block`, :func:`cross_block`), a task per row chunk merges them
    (:func:`merged_pairs`). Words straight from a ``.npy`` are read by each block's own task
    where it runs (:func:`_chunk_refs`), each block then marked a data producer: through
    ``blockwise``, a task read each chunk and sent it to the blocks on other workers, which
    staged it to their GPU again for every block."""
    chunks_x, chunks_y = len(wx.chunks[0]), len(wy.chunks[0])
    token = tokenize(wx, wy, selection, method, device, "pairs")
    name, kept = f"similarity-pairs-{token}", f"similarity-kept-{token}"
    dsk: dict[Any, Any] = {}
    words_x, pops_x, words_y, pops_y, needs = _chunk_refs_of_both(wx, wy, pop_x, pop_y, device,
                                                                 dsk, token)
    ids_x = [range(a, b) for a, b in row_bounds(wx.chunks[0])]
    ids_y = [range(a, b) for a, b in row_bounds(wy.chunks[0])]
    block = functools.partial(upper_block if all_pairs else cross_block,
                              selection=selection, method=method, device=device)
    for i in range(chunks_x):
        for j in range(i if all_pairs else 0, chunks_y):
            dsk[(kept, i, j)] = Task((kept, i, j), block, words_x[i], words_y[j], pops_x[i],
                                     pops_y[j], ids_x[i], ids_y[j], _data_producer=not needs)
    for i in range(chunks_x):
        if all_pairs:  # the blocks right of the diagonal, and the transposed halves above it
            row_blocks = List(*(TaskRef((kept, i, j)) for j in range(i, chunks_x)))
            column_blocks: Any = List(*(TaskRef((kept, j, i)) for j in range(i)))
        else:
            row_blocks = List(*(TaskRef((kept, i, j)) for j in range(chunks_y)))
            column_blocks = None
        dsk[(name, i, 0)] = Task((name, i, 0), merged_pairs, row_blocks, column_blocks)
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=needs)
    return da.Array(graph, name, ((np.nan,) * chunks_x, (2,)), dtype=np.uint64, meta=meta)


def _ref(held: tuple[Any, int] | None) -> tuple[Any, int]:
    """A state's ``(previous, slot)`` arguments: the task that holds it, or ``None``."""
    return (None, 0) if held is None else (TaskRef(held[0]), held[1])


def _row_parts(row_blocks: list[Any], column_blocks: list[Any] | None) -> list[Any]:
    """What the blocks of one row chunk kept: from its own blocks on or above the diagonal,
    and (all pairs) from the blocks above it in its column, their transposed halves."""
    if column_blocks is None:
        return list(row_blocks)
    parts = [block[0] for block in row_blocks if block is not None]
    parts += [block[1] for block in column_blocks if block is not None and block[1] is not None]
    return parts


def merged_keys(row_blocks: list[Any], column_blocks: list[Any] | None = None, *, k: int
                 ) -> Any:
    parts = _row_parts(row_blocks, column_blocks)
    xp = kernels._xp(parts[0])
    return kernels.smallest_keys(xp.concatenate(parts, axis=1), k)


def merged_pairs(row_blocks: list[Any], column_blocks: list[Any] | None = None) -> Any:
    return kernels.sorted_pairs(_row_parts(row_blocks, column_blocks))
