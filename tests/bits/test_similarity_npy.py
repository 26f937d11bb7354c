"""``dg.similarity`` of fingerprints straight from a ``.npy``: each chunk read where its
blocks run and never sent between workers, a top-k chain per worker, the rounds grouped into
tasks that follow their chain."""

from __future__ import annotations

import importlib

import dask
import dask.array as da
import numpy as np
import pytest
from helpers import random_bits
from similarity_reference import (assert_pairs, brute_top_k, fingerprints, reference,
                                  top_k_of_a_npy_on_four_workers)

import dask_gpuchunk as dg
from dask_gpuchunk.config import listed_graphs
from dask_gpuchunk import config

QUERY_PLANNING = type(da.ones(1)).__module__.startswith("dask.array._array_expr")


@pytest.mark.skipif(not listed_graphs(),
                    reason="the top-k chain reads a .npy's chunks itself only in listed graphs")
@pytest.mark.parametrize("queries", [False, True])
def test_top_k_of_a_npy_reads_its_chunks_where_the_blocks_run(rng, tmp_path, queries):
    x = fingerprints(rng, 230, 300)
    np.save(tmp_path / "x.npy", np.packbits(x, axis=1))
    wx = dg.from_npy(tmp_path / "x.npy", chunks=((60, 1, 90, 79), -1))
    wy = None
    if queries:
        np.save(tmp_path / "y.npy", np.packbits(x[::-3], axis=1))
        wy = dg.from_npy(tmp_path / "y.npy", chunks=(25, -1))
    indices, scores = dg.similarity(wx, wy, packed=True, metric="dice", top_k=6, device="cpu")
    graph = dict(indices.__dask_graph__())
    assert any(str(key).startswith("resident-words") for key in graph)
    assert not any(str(key).startswith("from-npy") for key in graph)  # no task reads for others
    # Every worker's chains meet every chunk: its source reads them all ahead.
    sources = [task for key, task in graph.items() if str(key).startswith("resident-words-x")]
    assert [task[-1] for task in sources] == [((0, 60), (60, 61), (61, 151), (151, 230))]
    s = reference(x, x if wy is None else x[::-3], "dice")
    want_i, want_s = brute_top_k(s, 6, False, not queries)
    got_i, got_s = dask.compute(indices, scores)
    assert isinstance(got_i, np.ndarray)
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_s, want_s.astype(np.float32))


@pytest.mark.skipif(not listed_graphs(),
                    reason="the top-k chain reads a .npy's chunks itself only in listed graphs")
def test_top_k_of_a_npy_sends_no_words_between_workers(rng, tmp_path):
    # Only the states (8 bytes a row per neighbour) move between two workers' tasks; the words
    # (4 KiB a row here) are read by each worker that needs them. Before, a third of their
    # bytes were sent between the two (8 KiB rows).
    from distributed import Client, LocalCluster

    from dask_gpuchunk.jobs import sent_by_workers

    x = random_bits(rng, (600, 32768), 0.1)
    words = np.packbits(x, axis=1)
    np.save(tmp_path / "x.npy", words)
    wx = dg.from_npy(tmp_path / "x.npy", chunks=(100, -1))
    indices, _ = dg.similarity(wx, packed=True, top_k=3, device="cpu")
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        before = sent_by_workers(client)
        got = client.compute(indices, sync=True)
        sent = sent_by_workers(client, before)
    np.testing.assert_array_equal(got, brute_top_k(reference(x, x, "tanimoto"), 3, False,
                                                   True)[0])
    assert sum(sent.values()) < words.nbytes // 10


@pytest.mark.skipif(QUERY_PLANNING, reason="the chain is listed where graphs are listed")
@pytest.mark.parametrize("workers", [2, 3, 7])
@pytest.mark.parametrize("metric", ["tanimoto", "hamming"])
def test_top_k_chains_of_several_workers_match_numpy(xp, rng, monkeypatch, workers, metric):
    # A chain per worker: each begins from every row chunk's first state, takes every
    # workers-th round, and the chains' states merge at the end, each key once (on GPUs, all
    # pairs run in tiles instead: no chain begins). The chains' count, and (CuPy chunks) the
    # grouping's share of the workers.
    for name in ("dask_gpuchunk.bits.similarity_graphs", "dask_gpuchunk.bits.similarity"):
        monkeypatch.setattr(importlib.import_module(name), "cluster_workers", lambda: workers)
    x = fingerprints(rng, 230, 90)  # 23 chunks of 10 rows
    y = random_bits(rng, (61, 90), 0.2)
    lower = metric == "hamming"
    host = (lambda a: a) if xp is np else (lambda a: a.get())
    indices, scores = dg.similarity(dg.asarray(xp.asarray(x), chunks=(10, -1)), metric=metric,
                                    top_k=4)
    begins = {key for key in dict(indices.__dask_graph__()) if isinstance(key, tuple)
              and key[0].startswith("similarity-begin")}
    assert len(begins) == (workers if xp is np else 0)
    want_i, want_s = brute_top_k(reference(x, x, metric), 4, lower, True)
    got_i, got_s = map(host, dask.compute(indices, scores))
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_s, want_s.astype(got_s.dtype))
    # queries x database, uneven chunks: a round per database chunk after the first
    indices, scores = dg.similarity(dg.asarray(xp.asarray(x[:75]), chunks=(10, -1)),
                                    dg.asarray(xp.asarray(y), chunks=(13, -1)), metric=metric,
                                    top_k=3)
    begins = {key for key in dict(indices.__dask_graph__()) if isinstance(key, tuple)
              and key[0].startswith("similarity-begin")}
    assert len(begins) > 1  # 4 rounds (5 database chunks, CuPy's too) over several chains
    want_i, want_s = brute_top_k(reference(x[:75], y, metric), 3, lower, False)
    got_i, got_s = map(host, dask.compute(indices, scores))
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_s, want_s.astype(got_s.dtype))


@pytest.mark.skipif(QUERY_PLANNING, reason="the chain is listed where graphs are listed")
@pytest.mark.parametrize("workers, most", [(1, 40), (2, 25), (3, 1)])
def test_top_k_chains_on_gpus_take_rounds_a_task(xp, rng, monkeypatch, workers, most):
    # On GPUs, in one process or on a cluster, a task of a chain (queries against a database:
    # all pairs run in tiles) takes its rounds one after the other, whole, up to
    # GPU_BLOCKS_PER_TASK blocks (at least a round); the graph as there, run here. Uneven
    # chunks.
    graphs = importlib.import_module("dask_gpuchunk.bits.similarity_graphs")
    for name in ("dask_gpuchunk.bits.similarity_graphs", "dask_gpuchunk.bits.similarity"):
        monkeypatch.setattr(importlib.import_module(name), "cluster_workers", lambda: workers)
    monkeypatch.setattr(graphs, "gpu_available", lambda: True)
    monkeypatch.setattr(graphs, "GPU_BLOCKS_PER_TASK", most)
    host = (lambda a: a) if xp is np else (lambda a: a.get())
    x, y = fingerprints(rng, 75, 90), random_bits(rng, (230, 90), 0.2)
    indices, scores = dg.similarity(dg.asarray(xp.asarray(x), chunks=(10, -1)),
                                    dg.asarray(xp.asarray(y), chunks=(13, -1)), top_k=3)
    graph = dict(indices.__dask_graph__())
    steps = [key for key in graph if isinstance(key, tuple)
             and key[0].startswith("similarity-step")]
    if xp is np:  # CuPy's chunks are grouped by the workers first
        rounds, per_round = 230 // 13, 8  # a round per database chunk after the first
        chains = min(workers, rounds)
        each = [len(range(c, rounds, chains)) for c in range(chains)]  # each chain's rounds
        assert len(steps) == sum(-(-r // max(1, most // per_round)) for r in each)
    want_i, want_s = brute_top_k(reference(x, y, "tanimoto"), 3, False, False)
    got_i, got_s = map(host, dask.compute(indices, scores, scheduler="sync"))
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_s, want_s.astype(got_s.dtype))


@pytest.mark.skipif(not listed_graphs(),
                    reason="the top-k chain reads a .npy's chunks itself only in listed graphs")
def test_top_k_of_a_npy_runs_a_chain_on_each_worker(rng, tmp_path, monkeypatch):
    # One chain over two GPUs sent every state between them between rounds (1.2 GB a worker
    # for 10**6 rows) and took twice as long as on one. Now each worker's chain begins in a
    # task that distributed hands to a worker of its own, its rounds follow it there, and only
    # the first and the chains' last states move. Work stealing off: where the scheduler put
    # them.
    from dask.utils import key_split

    # The blocks of a round in tasks of several (on the CPU, a task each).
    similarity_module = importlib.import_module("dask_gpuchunk.bits.similarity_graphs")
    monkeypatch.setattr(similarity_module, "CPU_BLOCKS_PER_TASK", 64)
    x = fingerprints(rng, 17 * 30, 300)
    where, _ = top_k_of_a_npy_on_four_workers(tmp_path, x, 5, device="cpu")
    begins = {key: w for key, w in where.items() if key_split(key) == "similarity-begin"}
    assert len(begins) == 4 and len(set(begins.values())) == 4, begins  # a worker each
    chain_of = {key[1]: w for key, w in begins.items()}
    steps = {key: w for key, w in where.items() if key_split(key) == "similarity-step"}
    assert len(steps) == 17  # 17 rounds of 8 blocks, a task each (as on GPUs)
    assert all(w == chain_of[key[1] % 4] for key, w in steps.items()), (chain_of, steps)


@pytest.mark.skipif(not listed_graphs(),
                    reason="the top-k chain reads a .npy's chunks itself only in listed graphs")
def test_grouped_rounds_of_each_chain_follow_it_and_only_states_move(rng, tmp_path,
                                                                     monkeypatch):
    # On a cluster's GPUs a chain's rounds (queries against a database: all pairs run in
    # tiles) run several to a task; each such task runs where its chain began, and between
    # workers only states move (8 k bytes a row), never words.
    from dask.utils import key_split

    graphs = importlib.import_module("dask_gpuchunk.bits.similarity_graphs")
    monkeypatch.setattr(graphs, "gpu_available", lambda: True)  # the graph as on GPUs
    monkeypatch.setattr(graphs, "GPU_BLOCKS_PER_TASK", 24)  # three rounds of 8 blocks
    x, y = fingerprints(rng, 8 * 30, 8192), fingerprints(rng, 18 * 30, 8192)
    where, sent = top_k_of_a_npy_on_four_workers(tmp_path, x, 2, database=y)
    chain_of = {key[1]: w for key, w in where.items() if key_split(key) == "similarity-begin"}
    assert len(set(chain_of.values())) == 4  # a worker each
    steps = {key: w for key, w in where.items() if key_split(key) == "similarity-step"}
    # 17 rounds (a database chunk each after the first) over 4 chains (5, 4, 4, 4), three a
    # task: 2 tasks a chain
    assert sorted(key[1] for key in steps) == [0, 1, 2, 3, 12, 13, 14, 15]
    assert all(w == chain_of[key[1] % 4] for key, w in steps.items()), (chain_of, steps)
    # The first states to each chain's beginning, the chains' last states (each task's, whole)
    # to the merges, the results: a few sets of the queries' states (8 k bytes a row), under
    # half of one worker's copy of the database's words (1 KiB a row).
    assert 0 < sum(sent.values()) < len(y) * 8192 // 8 // 2, sent


@pytest.mark.skipif(QUERY_PLANNING, reason="threshold= is refused under array query planning")
@pytest.mark.parametrize("listed", [True, False])
@pytest.mark.parametrize("queries", [False, True])
def test_threshold_of_a_npy_reads_its_chunks_where_the_blocks_run(rng, tmp_path, listed,
                                                                   queries):
    from dask.utils import key_split

    x = fingerprints(rng, 230, 300)
    np.save(tmp_path / "x.npy", np.packbits(x, axis=1))
    wx = dg.from_npy(tmp_path / "x.npy", chunks=((60, 1, 90, 79), -1))
    wy, y = None, x
    if queries:
        y = x[::-3]
        np.save(tmp_path / "y.npy", np.packbits(y, axis=1))
        wy = dg.from_npy(tmp_path / "y.npy", chunks=(25, -1))
    with config.internal_values({"listed-graphs": listed}):
        rows, cols, scores = dg.similarity(wx, wy, packed=True, metric="dice", threshold=0.3,
                                           device="cpu")
        graph = dict(rows.__dask_graph__())
        # listed: no task reads a chunk for the blocks of others; else blockwise's from-npy
        assert any(str(key).startswith("resident-words") for key in graph) == listed
        assert any(key_split(key) == "from-npy" for key in graph) != listed
        # A block of its own a task: no read-ahead of chunks a worker may never meet.
        assert all(len(task) == 3 for key, task in graph.items()
                   if str(key).startswith("resident-words"))
        rows, cols, scores = dask.compute(rows, cols, scores)
    s = reference(x, y, "dice")
    assert 0 < assert_pairs(rows, cols, scores, s, 0.3, exclude_self=not queries) < s.size // 4


@pytest.mark.skipif(not listed_graphs(),
                    reason="the threshold reads a .npy's chunks itself only in listed graphs")
def test_threshold_of_a_npy_sends_no_words_between_workers(rng, tmp_path):
    # Through blockwise, a task read each chunk of words and sent it to the blocks on other
    # workers; now each block reads its own two chunks where it runs, and only the pairs move.
    from distributed import Client, LocalCluster

    from dask_gpuchunk.jobs import sent_by_workers

    x = random_bits(rng, (600, 32768), 0.1)
    x[300:310] = x[0]  # ten rows equal to row 0 (tanimoto 1), beside random pairs (~0.05)
    words = np.packbits(x, axis=1)
    np.save(tmp_path / "x.npy", words)
    wx = dg.from_npy(tmp_path / "x.npy", chunks=(100, -1))
    pairs = dg.similarity(wx, packed=True, threshold=0.5, device="cpu")
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        before = sent_by_workers(client)
        rows, cols, scores = client.compute(list(pairs), sync=True)
        sent = sent_by_workers(client, before)
    assert assert_pairs(rows, cols, scores, reference(x, x, "tanimoto"), 0.5) == 11 * 10
    assert (scores == 1).all()
    assert sum(sent.values()) < words.nbytes // 10


@pytest.mark.gpu
@pytest.mark.skipif(not listed_graphs(),
                    reason="the top-k chain reads a .npy's chunks itself only in listed graphs")
@pytest.mark.parametrize("method", ["auto", "popcount"])
def test_top_k_of_a_npy_keeps_its_chunks_on_the_gpu(rng, tmp_path, device_cap, method):
    from dask_gpuchunk.runtime.resident import resident_stats

    device_cap(1 << 30)
    x = fingerprints(rng, 500, 2048)
    np.save(tmp_path / "x.npy", np.packbits(x, axis=1))
    wx = dg.from_npy(tmp_path / "x.npy", chunks=(128, -1))  # 4 chunks
    reads = resident_stats().get("device 0", {}).get("reads", 0)
    indices, scores = dask.compute(*dg.similarity(wx, packed=True, top_k=7, method=method))
    assert isinstance(indices, np.ndarray) and isinstance(scores, np.ndarray)
    want_i, want_s = brute_top_k(reference(x, x, "tanimoto"), 7, False, True)
    np.testing.assert_array_equal(indices, want_i)
    np.testing.assert_array_equal(scores, want_s.astype(np.float32))
    stats = resident_stats()["device 0"]
    assert stats["reads"] - reads == 4 and stats["nbytes"] == 0
