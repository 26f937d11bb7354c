"""Blocks done, counted where the tasks run: dask's local threads and a distributed cluster;
the similarity top-k and threshold graphs report every block once, as they go, and their tasks
are even enough for progress bars that count tasks."""

from __future__ import annotations

import importlib

import dask
import dask.array as da
import numpy as np
import pytest
from dask.callbacks import Callback
from helpers import random_bits

import dask_gpuchunk as dg
from dask_gpuchunk.progress import BlockProgress, blocks_done


def _fingerprints(rng, n=1100, chunk=100):
    bits = random_bits(rng, (n, 256), 0.2)
    return da.from_array(np.packbits(bits, axis=1), chunks=(chunk, -1))


class _TaskFractions(Callback):
    """Each finished task's share of the graph's tasks, as dask's ProgressBar draws it."""

    def __init__(self, blocks_seen):
        super().__init__()
        self.blocks_seen, self.pairs = blocks_seen, []

    def _start_state(self, dsk, state):
        self.total = sum(len(v) for v in state.values() if isinstance(v, (dict, list, set)))
        self.done = 0

    def _posttask(self, key, result, dsk, state, worker_id):
        self.done += 1
        self.pairs.append((self.done / len(dsk), self.blocks_seen[-1] if self.blocks_seen else 0))


@pytest.mark.parametrize("mode", [{"top_k": 5}, {"threshold": 0.3}])
def test_every_block_is_reported_once_as_it_is_done_on_local_threads(rng, mode, monkeypatch):
    if "threshold" in mode and type(da.ones(1)).__module__.startswith("dask.array._array_expr"):
        pytest.skip("threshold= needs dask's classic arrays")
    # The whole input in one chunk (as dg.from_npy reads a file of fingerprints): the
    # selection cuts it into blocks of CPU_BLOCK_ROWS rows (4,096; here 100, for speed).
    monkeypatch.setattr(importlib.import_module("dask_gpuchunk.bits.similarity"), "CPU_BLOCK_ROWS",
                        100)
    x = _fingerprints(rng, chunk=1100)
    chunks = 11
    blocks = chunks * (chunks + 1) // 2  # all pairs: the blocks on and above the diagonal
    seen: list[int] = []
    fractions = _TaskFractions(seen)
    with dask.config.set(scheduler="threads"), BlockProgress(
            blocks, lambda done, total: seen.append(done)), fractions:
        dask.compute(*dg.similarity(x, packed=True, **mode))
    assert seen[-1] == blocks and seen == sorted(seen)
    assert len(seen) >= chunks  # many updates, not one at the end
    # A bar counting tasks moves with the work: once half the blocks are done, it shows
    # between a fifth and four fifths (it jumped from 14 % to 100 % at the end before).
    at_half = [share for share, done in fractions.pairs if done >= blocks / 2][0]
    assert 0.2 <= at_half <= 0.8, fractions.pairs


def test_blocks_done_on_workers_reach_the_client_as_events(rng):
    x = _fingerprints(rng, n=700)
    chunks = len(x.chunks[0])
    blocks = chunks * (chunks + 1) // 2
    seen: list[int] = []
    with dg.local_cluster(processes=False, n_workers=2, threads_per_worker=1,
                          dashboard_address=None) as client:
        with BlockProgress(blocks, lambda done, total: seen.append(done)):
            indices, _ = dask.compute(*dg.similarity(x, packed=True, top_k=3))
            client.sync(client._update_scheduler_info)  # let the last events arrive
            deadline = __import__("time").monotonic() + 10
            while (not seen or seen[-1] < blocks) and __import__("time").monotonic() < deadline:
                __import__("time").sleep(0.05)
    assert indices.shape == (700, 3)
    assert seen and seen[-1] == blocks and len(seen) >= chunks


def test_a_watcher_hears_only_while_open():
    seen: list[tuple[int, int]] = []
    blocks_done(5)  # nobody watching: nothing happens
    with BlockProgress(4, lambda done, total: seen.append((done, total))):
        blocks_done(1)
        blocks_done(3)
    blocks_done(2)
    assert seen == [(1, 4), (4, 4)]
