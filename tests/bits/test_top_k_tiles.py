"""The top-k of all pairs on GPUs in tiles of row-chunk groups: the pair
schedules, the groups' count, the graph as on GPUs run here against a brute force, and on a
cluster the tasks of a round side by side with only states moving."""

from __future__ import annotations

import importlib
import functools
import itertools

import dask
import dask.array as da
import numpy as np
import pytest
from dask.utils import key_split
from similarity_reference import (brute_top_k, fingerprints, reference,
                                  top_k_of_a_npy_on_four_workers)

import dask_gpuchunk as dg
from dask_gpuchunk.bits.top_k_tiles import (TILE_BUDGET_FRACTION, bipartite_rounds,
                                            chunk_groups, round_robin, tile_groups,
                                            tile_places, tile_slots)

QUERY_PLANNING = type(da.ones(1)).__module__.startswith("dask.array._array_expr")


@pytest.mark.parametrize("a, b", [(1, 1), (2, 3), (3, 2), (4, 4), (5, 1), (7, 9)])
def test_bipartite_rounds_meet_every_pair_once_in_rounds_of_disjoint_items(a, b):
    left, right = list(range(a)), list(range(100, 100 + b))
    rounds = bipartite_rounds(left, right)
    assert len(rounds) == max(a, b)
    pairs = [pair for blocks in rounds for pair in blocks]
    assert sorted(pairs) == sorted(itertools.product(left, right))  # each once, left first
    for blocks in rounds:
        items = [item for pair in blocks for item in pair]
        assert len(items) == len(set(items))


@pytest.mark.parametrize("chunks, rows, budget, workers", [
    (306, 10**7, 7 << 30, 1), (306, 10**7, 1800 << 20, 2), (40, 10**6, 64 << 20, 3),
    (5, 5000, 7 << 30, 4), (1, 10, 7 << 30, 2), (1000, 10**8, 7 << 30, 8)])
def test_tile_groups_fit_the_budget_and_share_the_workers(chunks, rows, budget, workers):
    groups = tile_groups(chunks, rows, 256, 10, budget, workers)
    assert 1 <= groups <= chunks
    cut = chunk_groups(chunks, groups)
    assert [c for g in cut for c in g] == list(range(chunks))
    assert max(map(len, cut)) - min(map(len, cut)) <= 1
    if groups < chunks:  # two groups' words, popcounts and states fit the task's share
        biggest = 2 * -(-rows // groups) * (256 + 4 + 160)
        assert biggest <= budget * TILE_BUDGET_FRACTION * 1.01 or groups * 32 >= chunks
        if workers > 1:
            assert groups % (2 * workers) == 0


def _tile_steps(indices) -> list:
    return [key for key in dict(indices.__dask_graph__())
            if isinstance(key, tuple) and key_split(key) == "similarity-step"]


@pytest.mark.skipif(QUERY_PLANNING, reason="the top-k is listed where graphs are listed")
@pytest.mark.parametrize("workers, most", [(1, 4), (2, 3), (3, 32)])
@pytest.mark.parametrize("metric", ["tanimoto", "hamming"])
def test_top_k_in_tiles_matches_numpy(xp, rng, monkeypatch, workers, most, metric):
    # The graph as on GPUs (run here): a task per group and per pair of groups, every row's
    # one state, nothing merged; uneven chunks.
    graphs = importlib.import_module("dask_gpuchunk.bits.similarity_graphs")
    monkeypatch.setattr("dask_gpuchunk.bits.similarity.cluster_workers", lambda: workers)
    monkeypatch.setattr(graphs, "cluster_worker_addresses",
                        lambda: [f"tcp://w{i}" for i in range(workers)])
    monkeypatch.setattr(graphs, "gpu_available", lambda: True)
    monkeypatch.setattr(graphs, "graph_budget", lambda: 1 << 40)  # sized by chunk count
    monkeypatch.setattr("dask_gpuchunk.bits.top_k_tiles.TILE_CHUNKS", most)
    host = (lambda a: a) if xp is np else (lambda a: a.get())
    x = fingerprints(rng, 230, 90)
    chunks = (10,) * 8 + (7, 12, 1) + (10,) * 13  # 24 chunks
    indices, scores = dg.similarity(dg.asarray(xp.asarray(x), chunks=(chunks, -1)),
                                    metric=metric, top_k=4)
    graph = dict(indices.__dask_graph__())
    assert not any(key_split(key) in ("similarity-first", "similarity-begin")
                   for key in graph if isinstance(key, tuple))
    groups = len({key[1] for key in _tile_steps(indices) if key[1] == key[2]})
    # On a GPU, CuPy's small chunks are first grouped into the selection's blocks.
    assert len(indices.chunks[0]) == 24 or xp is not np
    assert groups == tile_groups(len(indices.chunks[0]), 230, 90 // 8 + 1, 4, 1 << 40, workers)
    assert len(_tile_steps(indices)) == groups * (groups + 1) // 2
    want_i, want_s = brute_top_k(reference(x, x, metric), 4, metric == "hamming", True)
    got_i, got_s = map(host, dask.compute(indices, scores, scheduler="sync"))
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_s, want_s.astype(got_s.dtype))


@pytest.mark.skipif(QUERY_PLANNING, reason="the top-k is listed where graphs are listed")
def test_a_tile_task_takes_only_its_two_groups_chunks(rng, monkeypatch):
    graphs = importlib.import_module("dask_gpuchunk.bits.similarity_graphs")
    monkeypatch.setattr(graphs, "gpu_available", lambda: True)
    monkeypatch.setattr(graphs, "graph_budget", lambda: 1 << 40)  # sized by chunk count
    monkeypatch.setattr("dask_gpuchunk.bits.top_k_tiles.TILE_CHUNKS", 5)
    x = fingerprints(rng, 230, 90)
    indices, _ = dg.similarity(dg.asarray(x, chunks=(10, -1)), top_k=3)
    graph = dict(indices.__dask_graph__())
    groups = chunk_groups(23, 5)
    for key in _tile_steps(indices):
        g, h = key[1], key[2]
        members = len(groups[g]) + (len(groups[h]) if g != h else 0)
        assert len(graph[key].args) == 5 * members  # words, popcounts, first row, state


@pytest.mark.skipif(QUERY_PLANNING, reason="the top-k is listed where graphs are listed")
def test_top_k_in_tiles_of_a_npy_on_four_workers_moves_only_states(rng, tmp_path,
                                                                   monkeypatch):
    # Four workers: eight groups, each round's four tasks side by side; between the workers
    # only states move (8 k bytes a row), never words (1 KiB a row here).
    graphs = importlib.import_module("dask_gpuchunk.bits.similarity_graphs")
    monkeypatch.setattr(graphs, "gpu_available", lambda: True)
    monkeypatch.setattr(graphs, "graph_budget", lambda: 1 << 40)  # sized by chunk count
    x = fingerprints(rng, 16 * 30, 8192)
    where, sent = top_k_of_a_npy_on_four_workers(tmp_path, x, 2)
    steps = {key: w for key, w in where.items() if key_split(key) == "similarity-step"}
    assert len(steps) == 8 + 28
    own = [w for key, w in steps.items() if key[1] == key[2]]
    assert len(set(own)) == 4  # the groups' own tasks spread over the workers
    # Each task on its table's worker (tile_places), each worker as many of every round.
    workers, places = sorted(set(where.values())), tile_places(8, 4)
    assert all(w == workers[places[key[1:]]] for key, w in steps.items()), steps
    assert 0 < sum(sent.values()) < len(x) * 8192 // 8 // 2, sent


@pytest.mark.skipif(QUERY_PLANNING, reason="the top-k is listed where graphs are listed")
def test_tiles_leave_their_states_in_host_memory_where_all_would_not_fit(xp, rng, monkeypatch):
    # A budget a few rows' states: a group a chunk, every task's states back in host memory,
    # the result's chunks where the input's are (CuPy's on the device).
    from dask.local import get_sync as get

    from dask_gpuchunk.bits.top_k_tiles import host_states

    graphs = importlib.import_module("dask_gpuchunk.bits.similarity_graphs")
    monkeypatch.setattr(graphs, "gpu_available", lambda: True)
    monkeypatch.setattr(graphs, "graph_budget", lambda: 4000)
    assert host_states(230, 3, 4000)
    x = fingerprints(rng, 230, 90)
    indices, scores = dg.similarity(dg.asarray(xp.asarray(x), chunks=(30, -1)), top_k=3)
    steps = _tile_steps(indices)
    chunks = len(indices.chunks[0])  # 8; on a GPU 7, CuPy's last two chunks grouped
    assert len(steps) == chunks * (chunks + 1) // 2  # a group a chunk
    graph = dict(indices.__dask_graph__())
    states = get(graph, steps[-1])
    assert all(type(state) is np.ndarray for state in states)
    want_i, want_s = brute_top_k(reference(x, x, "tanimoto"), 3, False, True)
    got_i, got_s = dask.compute(indices, scores, scheduler="sync")
    assert type(got_i) is type(xp.asarray(x))
    host = (lambda a: a) if xp is np else (lambda a: a.get())
    np.testing.assert_array_equal(host(got_i), want_i)
    np.testing.assert_array_equal(host(got_s), want_s.astype(got_s.dtype))


@pytest.mark.gpu
@pytest.mark.skipif(QUERY_PLANNING, reason="the top-k is listed where graphs are listed")
@pytest.mark.parametrize("budget", [None, 3 << 20])
def test_tiles_on_a_gpu_equal_the_cpu_key_for_key(rng, tmp_path, monkeypatch, budget):
    # Chunks of 8,192 rows and more begin their states by the seeded path, the rest by the
    # fused kernels: from a .npy and from device chunks, the tiles' result is the CPU's, key
    # for key; a 3 MiB budget cuts a group a chunk and leaves the states in host memory
    # between tasks.
    import cupy

    if budget is not None:
        graphs = importlib.import_module("dask_gpuchunk.bits.similarity_graphs")
        monkeypatch.setattr(graphs, "graph_budget", lambda: budget)
    monkeypatch.setattr("dask_gpuchunk.bits.top_k_tiles.TILE_CHUNKS", 2)
    x = fingerprints(rng, 41_000, 512)
    words = np.packbits(x, axis=1)
    np.save(tmp_path / "x.npy", words)
    want = dask.compute(*dg.similarity(dg.asarray(words, chunks=(8192, -1)), packed=True,
                                       top_k=7, device="cpu"))
    for source in ("npy", "device"):
        w = (dg.from_npy(tmp_path / "x.npy", chunks=(8192, -1)) if source == "npy"
             else dg.asarray(cupy.asarray(words), chunks=(8192, -1)))
        indices, scores = dg.similarity(w, packed=True, top_k=7)
        steps = _tile_steps(indices)
        groups = sum(key[1] == key[2] for key in steps)
        assert len(steps) == groups * (groups + 1) // 2
        assert groups == (len(indices.chunks[0]) if budget else
                          -(-len(indices.chunks[0]) // 2))
        got = [getattr(a, "get", lambda a=a: a)() for a in dask.compute(indices, scores)]
        for w_, g_ in zip(want, got):
            np.testing.assert_array_equal(g_, w_)
    sample = np.sort(rng.choice(len(x), 5, replace=False))
    s = reference(x[sample], x, "tanimoto").astype(np.float64)
    s[np.arange(len(sample)), sample] = -np.inf  # each row's own id left out
    want_i, want_s = brute_top_k(s, 7, False, False)
    np.testing.assert_array_equal(want[0][sample], want_i)
    np.testing.assert_array_equal(want[1][sample], want_s.astype(np.float32))


def test_tile_slots_let_two_tasks_run_where_both_fit_beside_the_kept_chunks():
    budget = 1 << 30
    assert tile_slots(budget, budget // 8, budget // 16) == 2  # 1/2 + 2 (1/8 + 1/16) = 7/8
    assert tile_slots(budget, budget // 8, budget // 4) == 1  # 1/2 + 2 (1/8 + 1/4) > 1


def test_a_tile_task_reads_its_chunks_once_it_holds_a_slot(monkeypatch):
    # Tasks waiting for a slot hold nothing: their deferred reads run inside it, and no more
    # than `slots` tasks run at once.
    import threading
    import time

    tiles = importlib.import_module("dask_gpuchunk.bits.top_k_tiles")
    runs = tiles._TileRuns()
    monkeypatch.setattr(tiles, "per_device", lambda registry, lock, make: runs)
    monkeypatch.setattr(tiles, "on_gpu_here", lambda device: True)
    seen = []

    def chain_rounds(*args, **opts):
        seen.append((runs.running, args))
        time.sleep(0.02)
        return args

    monkeypatch.setattr(tiles, "chain_rounds", chain_rounds)

    def read(tag):
        assert runs.running >= 1, "read before the slot was held"
        return tag

    args = (functools.partial(read, "w"), functools.partial(read, "p"), 0,
            functools.partial(read, "not a chunk's words"), 0)
    threads = [threading.Thread(target=tiles.tile_task, args=args,
                                kwargs={"slots": 2, "device": "gpu"}) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 6 and max(running for running, _ in seen) <= 2
    assert all(a[:3] == ("w", "p", 0) and isinstance(a[3], functools.partial)
               for _, a in seen)


@pytest.mark.parametrize("groups, workers", [(4, 2), (12, 2), (8, 4), (16, 4), (32, 8), (7, 1)])
def test_tile_places_share_every_round_and_move_few_states(groups, workers):
    places = tile_places(groups, workers)
    order = round_robin(groups)
    assert set(places) == set(order) | {(g, g) for g in range(groups)}
    tables = -(-groups // 2)
    for r in range(0, len(order), tables):  # a round's tasks: as many on each worker
        counts = [0] * workers
        for pair in order[r:r + tables]:
            counts[places[pair]] += 1
        assert max(counts) - min(counts) <= (groups % 2)
    where = {g: places[(g, g)] for g in range(groups)}
    moves = 0
    for i, j in order:  # a group's state moves where its next task is on another worker
        moves += (where[i] != places[(i, j)]) + (where[j] != places[(i, j)])
        where[i] = where[j] = places[(i, j)]
    assert moves <= 2 * (workers - 1) * (groups - 1) + (groups if workers > 1 else 0)
