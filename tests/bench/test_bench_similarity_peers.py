"""``bench similarity``'s peers: a peer that returns wrong results is never timed as if it ran."""

from __future__ import annotations

import sys
import types

import numpy as np

from dask_gpuchunk.bench import similarity_peers
from dask_gpuchunk.bench.timing import Bench
from dask_gpuchunk.bench.similarity import make_fingerprints


def _fake_faiss(gpu_distances_wrong: bool) -> types.ModuleType:
    """A FAISS stand-in with an exact host index and a GPU index that may answer wrongly, as
    faiss-gpu-cu12's does on a GPU it has no kernels for."""

    class IndexBinaryFlat:
        def __init__(self, bits: int) -> None:
            self.bits, self.rows = bits, None

        def add(self, rows: np.ndarray) -> None:
            self.rows = rows

        def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
            d = np.bitwise_count(self.rows[None] ^ queries[:, None]).sum(axis=2)
            order = np.argsort(d, axis=1, kind="stable")[:, :k]
            return np.take_along_axis(d, order, axis=1).astype(np.int32), order

    class GpuIndexBinaryFlat(IndexBinaryFlat):
        def __init__(self, resources: object, bits: int) -> None:
            super().__init__(bits)

        def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
            d, i = super().search(queries, k)
            return (d + 1 if gpu_distances_wrong else d), i

    fake = types.ModuleType("faiss")
    fake.IndexBinaryFlat = IndexBinaryFlat
    fake.GpuIndexBinaryFlat = GpuIndexBinaryFlat
    fake.StandardGpuResources = object
    fake.omp_get_max_threads = lambda: 3
    return fake


def _faiss_rows(monkeypatch, gpu_distances_wrong: bool) -> list:
    monkeypatch.setitem(sys.modules, "faiss", _fake_faiss(gpu_distances_wrong))
    monkeypatch.setattr("dask_gpuchunk.bits.gram_blocks.compute_capability", lambda: (9, 0))
    bench = Bench(repeat=1, skip=(), log=lambda s: None)
    db = make_fingerprints(300, 256, 0.1, seed=3)
    similarity_peers._faiss_peer(bench, "similarity", db, db[:20], 5, gpu=True)
    return bench.entries


def test_a_gpu_index_with_wrong_distances_says_why_and_the_host_index_is_timed(monkeypatch):
    gpu_row, host_row = _faiss_rows(monkeypatch, gpu_distances_wrong=True)
    assert gpu_row.seconds is None and "compute capability 9.0" in gpu_row.skipped
    assert "faiss-wheels #151" in gpu_row.skipped
    assert host_row.name == "peer FAISS IndexBinaryFlat, Hamming top-k (host, 3 threads)"
    assert host_row.seconds is not None and host_row.extra["pairs"] == 20 * 300


def test_a_gpu_index_that_answers_exactly_is_timed_alone(monkeypatch):
    (row,) = _faiss_rows(monkeypatch, gpu_distances_wrong=False)
    assert row.name == "peer FAISS GpuIndexBinaryFlat, Hamming top-k (device)"
    assert row.seconds is not None and row.skipped is None
