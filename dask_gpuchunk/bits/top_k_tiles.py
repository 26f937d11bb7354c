"""The top-k of all pairs on GPUs in tiles of row-chunk groups, one state per row chunk.

The row chunks are cut into groups of consecutive chunks. A group's first task computes each
of its chunks' first state (the chunk against itself) and then every block between two of its
chunks; then the groups meet in rounds of disjoint pairs (the circle method,
:func:`round_robin`), a task per pair of groups running every block between a chunk of one and
a chunk of the other, in rounds of disjoint chunk pairs (:func:`bipartite_rounds`), on the
states the groups' previous tasks left. A task holds the words and states of its two groups
only, so the groups are cut for the device's budget (:func:`tile_groups`); the tasks of a
round are independent, so a cluster's workers take them side by side. Against the chains of
:func:`~dask_gpuchunk.bits.similarity_graphs.top_k_chain` (a chain per worker, each holding
every row's state, merged at the end), which they replace for all pairs on GPUs: each row has
one state, which has seen every block before it; no chain's beginning is gathered, nothing is
merged; a task's memory is bounded by its two groups. On a cluster each task goes to a
worker fixed when the graph is made (:func:`tile_places`), up to :data:`TILE_SLOTS` run at once
on a device. On 2 x H200 (8 GiB cap, UCX), the top-10 of 10**7 x 2048-bit fingerprints from a
``.npy``: 34.4-34.6 s (one GPU: 66.1 s), against the chains' 39.9-40.0 s (68.6 s); under a
2 GiB cap, where the chains ran out of memory, 39.4-40.2 s on two (76.0 s on one). The chains
remain for queries against a database and on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterator
from typing import Any

from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.task_spec import Task, TaskRef

from ..runtime.backend import is_cupy
from ..runtime.resident import DEVICE_FRACTION, on_gpu_here
from ..runtime.staging import per_device
from .selection import CHUNK_ARGS, chain_rounds

__all__ = ["DEVICE_STATES_FRACTION", "TILE_CHUNKS", "add_tile_tasks", "bipartite_rounds",
           "chunk_groups", "final_state", "host_states", "round_robin", "tile_bytes",
           "tile_groups", "tile_places", "tile_slot", "tile_slots", "tile_task",
           "tiles_graph"]

#: Row chunks a group takes at most: a task between two groups then runs at most
#: ``TILE_CHUNKS ** 2`` blocks, as a task of the chains takes up to
#: :data:`~dask_gpuchunk.bits.similarity_graphs.GPU_BLOCKS_PER_TASK` (1024).
TILE_CHUNKS = 32
#: Part of the device's working budget a task's two groups may take (their words and
#: popcounts, their states before and after): the rest is for the states the other groups'
#: tasks hold, the source's kept chunks and the blocks' scratch.
TILE_BUDGET_FRACTION = 1 / 3
#: Tile tasks a device runs at once at most (where they fit: :func:`tile_slots`): while one
#: task's host waits for the device at the end of a round, the others keep it busy. Three
#: against two (10**7 rows' top-10, 8 GiB cap, 2 x H200): one GPU 65.7 s against 67.4 s, two
#: 34.8-35.1 s against 35.7-36.7 s; the GPUs' busy time 93 % (two) and 96 % (one).
TILE_SLOTS = 3
#: Part of the working budget every row's state may take on the device between tasks; beyond
#: it (the top-10 of 10**8 rows holds 8 GB of states) the tasks leave their states in host
#: memory (:func:`host_states`).
DEVICE_STATES_FRACTION = 1 / 4


def host_states(rows: int, k: int, budget: int) -> bool:
    """Whether the tiles' tasks leave their states in host memory: where the states of all
    ``rows`` (``8 k`` bytes a row) exceed :data:`DEVICE_STATES_FRACTION` of ``budget``.
    Each task then moves its two groups' states to the device and back, 16 k bytes a row,
    against its blocks' ``rows`` squared pairs.

    Examples
    --------
    >>> host_states(10**7, 10, 7 << 30), host_states(10**7, 10, 1800 << 20)
    (False, True)
    """
    return rows * 8 * k > budget * DEVICE_STATES_FRACTION


def tile_groups(chunks: int, rows: int, row_bytes: int, k: int, budget: int,
                workers: int) -> int:
    """How many groups ``chunks`` row chunks of ``rows`` rows in all (``row_bytes`` bytes of
    words each) are cut into for a top-``k`` in tiles: enough that two groups' words,
    popcounts and states (before and after) fit :data:`TILE_BUDGET_FRACTION` of ``budget``,
    that no group has more than :data:`TILE_CHUNKS` chunks, and, on a cluster of ``workers``,
    a multiple of twice the workers (each round then has as many tasks for each); at most one
    group a chunk.

    Examples
    --------
    >>> tile_groups(306, 10**7, 256, 10, 7 << 30, 1)  # 10**7 rows, 8 GiB cap: by chunk count
    10
    >>> tile_groups(306, 10**7, 256, 10, 7 << 30, 2)  # two workers: a multiple of four
    12
    >>> tile_groups(306, 10**7, 256, 10, 1800 << 20, 1)  # 2 GiB cap: by memory
    14
    >>> tile_groups(3, 30, 256, 10, 7 << 30, 4)
    3
    """
    by_memory = math.ceil(tile_bytes(rows, row_bytes, k)
                          / max(budget * TILE_BUDGET_FRACTION, 1))
    groups = max(by_memory, math.ceil(chunks / TILE_CHUNKS), 1)
    if workers > 1:
        groups = max(groups, 2 * workers)
        groups = -(-groups // (2 * workers)) * 2 * workers
    return max(1, min(groups, chunks))


def tile_bytes(group_rows: int, row_bytes: int, k: int) -> int:
    """Device bytes a task of two groups of ``group_rows`` rows each holds besides its blocks'
    scratch: their words (``row_bytes`` a row), popcounts and top-``k`` states before and
    after.

    Examples
    --------
    >>> tile_bytes(625_000, 256, 10)  # 10**7 rows in 16 groups: 525 MB
    525000000
    """
    return 2 * group_rows * (row_bytes + 4 + 2 * 8 * k)


def tile_slots(budget: int, task_bytes: int, block_bytes: int, words_bytes: int | None = None
               ) -> int:
    """How many tile tasks run at once on a device of working ``budget``: as many tasks of
    ``task_bytes`` and a block's scratch (``block_bytes``) each as fit beside what the
    resident chunks may keep (:data:`~dask_gpuchunk.runtime.resident.DEVICE_FRACTION` of
    it, or all the words' ``words_bytes`` where fewer), one at least and
    :data:`TILE_SLOTS` at most. A task holds its groups' words and
    states until it ends, outside the budget's reservations: in one process of 32 threads
    under a 2 GiB cap, 14 groups' tasks at once held every chunk's words and ran the device
    out of memory.

    Examples
    --------
    >>> tile_slots(7 << 30, 840_000_000, 420_000_000)  # 10**7 rows in 10 groups, 8 GiB cap
    2
    >>> tile_slots(7 << 30, 700_000_000, 820_000_000, 2_600_000_000)  # 12 groups, words kept
    3
    >>> tile_slots(1800 << 20, 525_000_000, 820_000_000)  # 2 GiB cap
    1
    """
    kept = DEVICE_FRACTION * budget if words_bytes is None else min(
        DEVICE_FRACTION * budget, words_bytes)
    fits = int((budget - kept) // max(task_bytes + block_bytes, 1))
    return max(1, min(TILE_SLOTS, fits))


class _TileRuns:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.running = 0


_runs: dict[int, _TileRuns] = {}
_runs_lock = threading.Lock()


@contextlib.contextmanager
def tile_slot(slots: int) -> Iterator[None]:
    """Hold one of ``slots`` places for a tile task on this process's current device,
    waiting for one."""
    runs = per_device(_runs, _runs_lock, _TileRuns)
    with runs.cond:
        while runs.running >= slots:
            runs.cond.wait()
        runs.running += 1
    try:
        yield
    finally:
        with runs.cond:
            runs.running -= 1
            runs.cond.notify_all()


def tile_task(*args: Any, slots: int, device: str, **opts: Any) -> tuple:
    """A tile's rounds (:func:`~dask_gpuchunk.bits.selection.chain_rounds`, ``args`` as
    there) holding a tile slot of the device (:func:`tile_slot`); words and popcounts given
    as reads not yet made (``functools.partial``, for a ``.npy``'s chunks) are read once the
    slot is held, so that tasks waiting for one hold nothing on the device."""
    with tile_slot(slots) if on_gpu_here(device) else contextlib.nullcontext():
        return chain_rounds(*_read(args), device=device, **opts)


def _read(args: tuple) -> list[Any]:
    """``args`` with each chunk's deferred words and popcounts read."""
    return [a() if i % CHUNK_ARGS < 2 and isinstance(a, functools.partial) else a
            for i, a in enumerate(args)]


def chunk_groups(chunks: int, groups: int) -> list[range]:
    """``chunks`` row chunks cut into ``groups`` runs of consecutive chunks, their sizes
    differing by one at most.

    Examples
    --------
    >>> chunk_groups(7, 3)
    [range(0, 2), range(2, 4), range(4, 7)]
    """
    return [range(g * chunks // groups, (g + 1) * chunks // groups) for g in range(groups)]


def round_robin(count: int) -> list[tuple[int, int]]:
    """Every pair ``i < j`` of ``count`` chunks once, in rounds where each chunk meets one
    other (the circle method): a round's blocks update disjoint states, so they run at once.

    Examples
    --------
    >>> round_robin(4)  # three rounds of two
    [(0, 3), (1, 2), (0, 2), (1, 3), (0, 1), (2, 3)]
    """
    return [pair for pair, _ in _circle(count)]


def _circle(count: int) -> Iterator[tuple[tuple[int, int], int]]:
    """The pairs of :func:`round_robin`, each with its table in the round (``0`` to
    ``ceil(count / 2) - 1``): from one round to the next, each item but the first moves to a
    neighbouring table, or stays."""
    players = list(range(count)) + ([None] if count % 2 else [])
    size = len(players)
    for _ in range(size - 1):
        for p in range(size // 2):
            i, j = players[p], players[size - 1 - p]
            if i is not None and j is not None:
                yield (min(i, j), max(i, j)), p
        players = [players[0], players[-1], *players[1:-1]]


def tile_places(count: int, workers: int) -> dict[tuple[int, int], int]:
    """The worker (``0`` to ``workers - 1``) of each tile task of ``count`` groups: the
    rounds' tables (:func:`_circle`) cut into ``workers`` runs of neighbours, a pair's task
    going to its table's worker and a group's own task to that of the group's first pair. Each
    worker then takes as many tasks of every round, and a group's state moves to another
    worker only where its table crosses into another run (two states a round per boundary).

    Distributed places a task where its dependencies are: the two groups' states, on one
    worker when both came from it. On 2 x H200 that queued a third tile task on one worker
    (which had threads to spare for it, waiting for a GPU slot) while the other ran one alone
    for 5.1 s of a 37 s job; work stealing left them, the busy worker having idle threads.
    Placed, the two workers' tiles ended within 0.01 s of each other and the job took
    35.7-36.7 s against 37.6 s. Dask's low-level fusion drops a graph's annotations, so the
    places hold where :func:`dask_gpuchunk.resolving_aliases` is on (the package's jobs and
    local clusters: :func:`dask_gpuchunk.distributed.alias_tasks.optimize_arrays`).

    Examples
    --------
    >>> places = tile_places(4, 2)
    >>> [places[pair] for pair in round_robin(4)]  # two rounds' tables, one a worker
    [0, 1, 0, 1, 0, 1]
    >>> [places[(g, g)] for g in range(4)]
    [0, 1, 1, 0]
    """
    tables = -(-count // 2)
    places: dict[tuple[int, int], int] = {}
    for (i, j), table in _circle(count):
        places[(i, j)] = table * workers // max(tables, 1)
        for g in (i, j):
            places.setdefault((g, g), places[(i, j)])
    for g in range(count):  # a lone group (one in all) has no pair
        places.setdefault((g, g), 0)
    return places


def bipartite_rounds(a: list[Any], b: list[Any]) -> list[list[tuple[Any, Any]]]:
    """Every pair of an item of ``a`` and one of ``b`` once, in rounds where each item is in
    one pair at most: as many rounds as the longer list has items.

    Examples
    --------
    >>> bipartite_rounds([0, 1], [5, 6, 7])
    [[(0, 5), (1, 6)], [(0, 6), (1, 7)], [(0, 7), (1, 5)]]
    >>> bipartite_rounds([0, 1, 2], [9])
    [[(0, 9)], [(1, 9)], [(2, 9)]]
    """
    short, long_ = (a, b) if len(a) <= len(b) else (b, a)
    rounds = []
    for shift in range(len(long_)):
        pairs = [(s, long_[(t + shift) % len(long_)]) for t, s in enumerate(short)]
        rounds.append(pairs if short is a else [(p, q) for q, p in pairs])
    return rounds


def add_tile_tasks(dsk: dict, step: str, groups: list[range], opts: dict, chunk_args: tuple,
                   data_producer: bool, on_host: bool = False, slots: int = 2
                   ) -> dict[int, tuple[Any, int]]:
    """The tasks of the tiles into ``dsk`` (keys ``(step, g, h)``): each group's own task,
    then a task for each pair of groups, in the order of their rounds (:func:`round_robin`);
    all pairs, symmetric. ``chunk_args``: the chunks' words, popcounts and first rows
    (lists). Returns where each row chunk's last state is: ``{chunk: (task, slot)}``.
    ``data_producer``: the groups' own tasks need nothing but the words' source, and go where
    a thread is free. ``on_host``: the tasks leave their states in host memory
    (:func:`host_states`); ``slots``: tile tasks at once on a device (:func:`tile_slots`)."""
    words, pops, starts = chunk_args
    held: dict[int, tuple[Any, int]] = {}

    def add(key: tuple, members: list[int], firsts: tuple, rounds: list, producer: bool) -> None:
        place = {chunk: p for p, chunk in enumerate(members)}
        args: list[Any] = []
        for chunk in members:
            state = (None, 0) if chunk not in held else (TaskRef(held[chunk][0]),
                                                         held[chunk][1])
            args += [words[chunk], pops[chunk], starts[chunk], *state]
        plan = tuple(tuple((place[i], place[j]) for i, j in blocks) for blocks in rounds)
        dsk[key] = Task(key, functools.partial(
            tile_task, rounds=plan, firsts=tuple((place[c], place[c]) for c in firsts),
            symmetric=True, host_states=on_host, slots=slots, **opts), *args,
            _data_producer=producer)
        for chunk, p in place.items():
            held[chunk] = (key, p)

    for g, members in enumerate(groups):
        own = list(members)
        order = [(own[i], own[j]) for i, j in round_robin(len(own))]
        per_round = max(len(own) // 2, 1)
        rounds = [order[r:r + per_round] for r in range(0, len(order), per_round)]
        add((step, g, g), own, tuple(own), rounds, data_producer)
    for g, h in round_robin(len(groups)):
        add((step, g, h), [*groups[g], *groups[h]], (),
            bipartite_rounds(list(groups[g]), list(groups[h])), False)
    return held


def tiles_graph(name: str, step: str, dsk: dict, needs: list, groups: int,
                workers: list[str]) -> HighLevelGraph:
    """The graph of ``dsk``: the tiles' tasks (keys ``(step, g, h)`` of ``groups`` groups),
    the result's chunks (keys ``(name, i, 0)``) and the sources they read, on ``needs`` (the
    collections they take). On a cluster of several ``workers`` (addresses) whose count
    divides the rounds' tables, each tile task asks for its worker (:func:`tile_places`; a
    loose restriction, so a task whose worker is gone runs elsewhere); else distributed
    places them."""
    if len(workers) < 2 or -(-groups // 2) % len(workers):
        return HighLevelGraph.from_collections(name, dsk, dependencies=needs)
    places = {(step, g, h): [workers[w]]
              for (g, h), w in tile_places(groups, len(workers)).items()}
    tiles = {key: task for key, task in dsk.items() if key in places}
    results = {key: task for key, task in dsk.items()
               if isinstance(key, tuple) and key[0] == name}
    sources = {key: task for key, task in dsk.items() if key not in tiles and key not in results}
    base = HighLevelGraph.from_collections(f"{step}-sources", sources, dependencies=needs)
    layers = {**base.layers, step: MaterializedLayer(tiles, annotations={
        "workers": functools.partial(_worker_of, places), "allow_other_workers": True}),
        name: MaterializedLayer(results)}
    dependencies = {**base.dependencies,
                    step: {f"{step}-sources", *base.dependencies[f"{step}-sources"]},
                    name: {step}}
    return HighLevelGraph(layers, dependencies)


def _worker_of(places: dict, key: Any) -> list[str]:
    return places[key]


def final_state(previous: tuple, slot: int, on_device: bool) -> Any:
    """A row chunk's last state, out of the task that left it: on the device where the
    result's chunks are CuPy's (``on_device``), though the tiles left it in host memory."""
    state = previous[slot]
    if on_device and not is_cupy(state):
        import cupy

        return cupy.asarray(state)
    return state
