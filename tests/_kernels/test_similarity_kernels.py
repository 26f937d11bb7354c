"""The similarity kernels: the one-pass best keys of a CuPy block of counts against the NumPy
path (scores, keys, selection), every metric, both orientations, ties and excluded pairs."""

from __future__ import annotations

import numpy as np
import pytest

from dask_gpuchunk._kernels import similarity as kernels


def _block(rng, rows: int, cols: int):
    bits = rng.random((rows + cols, 300)) < 0.2
    bits[3] = bits[1]  # ties
    bits[rows + 2] = bits[1]
    bits[5] = False  # an empty row
    x, y = bits[:rows].astype(np.int64), bits[rows:].astype(np.int64)
    counts = (x @ y.T).astype(np.int32)
    return counts, x.sum(axis=1).astype(np.int32), y.sum(axis=1).astype(np.int32)


def test_host_selection_keeps_the_best_first_with_ties_by_index(rng):
    counts, a, b = _block(rng, 9, 12)
    s = kernels.scores(counts, a, b, "tanimoto")
    keys = kernels.smallest_keys(kernels.rank_keys(s, 0, "tanimoto"), 4)
    order = np.argsort(-s.astype(np.float64), axis=1, kind="stable")[:, :4]
    np.testing.assert_array_equal(kernels.decode_indices(keys), order)
    np.testing.assert_array_equal(kernels.decode_scores(keys, "tanimoto"),
                                  np.take_along_axis(s, order, axis=1))


@pytest.mark.gpu
@pytest.mark.parametrize("metric", [m for m in kernels.METRICS if m not in kernels.ASYMMETRIC_METRICS])
@pytest.mark.parametrize("k", [1, 7, kernels.CUDA_TOP_K_MAX])
def test_best_keys_on_the_gpu_equal_the_host_path(rng, metric, k):
    import cupy

    counts, a, b = _block(rng, 70, 45)
    rows, cols = np.arange(100, 170), np.arange(130, 175)  # ids 130..169 on both sides
    for for_rows in (True, False):
        c, pa, pb, ri, ci = ((counts, a, b, rows, cols) if for_rows
                             else (counts.T, b, a, cols, rows))
        s = kernels.scores(c, pa, pb, metric)
        excluded = ri[:, None] == ci[None, :]
        assert excluded.any()
        np.testing.assert_array_equal(kernels.same_ids(s, ri[0], ci[0]), excluded)
        want = kernels.smallest_keys(kernels.rank_keys(s, ci[0], metric, excluded), k)
        got = kernels.best_keys_cuda(cupy.asarray(counts), cupy.asarray(a), cupy.asarray(b),
                                     100, 130, k, metric, True, for_rows)
        np.testing.assert_array_equal(got.get(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("metric, threshold", [("tanimoto", 0.25), ("jaccard", 1.0),
                                               ("dice", 0.4), ("cosine", 0.3),
                                               ("hamming", 60), ("counts", 20)])
def test_threshold_pairs_on_the_gpu_equal_the_host_path(rng, metric, threshold):
    import cupy

    counts, a, b = _block(rng, 70, 45)
    s = kernels.scores(counts, a, b, metric)
    limit = np.float32(threshold) if metric in kernels.FLOAT_METRICS else threshold
    excluded = kernels.same_ids(s, 100, 130)
    want = kernels.pairs_at_least(s, 100, 130, limit, metric, excluded)
    assert 0 < len(want) < s.size
    got = kernels.pairs_at_least_cuda(cupy.asarray(counts), cupy.asarray(a), cupy.asarray(b),
                                      100, 130, limit, metric, True)
    np.testing.assert_array_equal(got.get(), want)
    swapped = kernels.pair_rows_cols_scores(kernels.swapped_pairs(want), metric)
    mine = kernels.pair_rows_cols_scores(want, metric)
    np.testing.assert_array_equal(swapped[0], mine[1])
    np.testing.assert_array_equal(swapped[1], mine[0])


@pytest.mark.gpu
@pytest.mark.parametrize("n, bits", [(0, 64), (1, 64), (1000, 64), (40_000, 2048),
                                     (5000, 3001), (70_000, kernels.COUNTED_POPCOUNTS - 1),
                                     (3000, kernels.COUNTED_POPCOUNTS)])
def test_popcount_order_is_a_permutation_by_popcount(rng, n, bits):
    cupy = pytest.importorskip("cupy")
    pop = rng.integers(0, bits + 1, n).astype(np.int32)
    pop[: n // 3] = bits // 2  # many ties, as real popcounts have
    order = cupy.asnumpy(kernels.popcount_order(cupy.asarray(pop), bits))
    assert order.dtype == np.int32
    np.testing.assert_array_equal(np.sort(order), np.arange(n))
    np.testing.assert_array_equal(pop[order], np.sort(pop))


@pytest.mark.gpu
def test_a_popcounts_arrays_order_is_kept_while_it_lives(rng):
    cupy = pytest.importorskip("cupy")
    pop = cupy.asarray(rng.integers(0, 2049, 5000).astype(np.int32))
    order, in_order = kernels.kept_popcount_order(pop, 2048)
    again = kernels.kept_popcount_order(pop, 2048)
    assert again[0] is order and again[1] is in_order
    np.testing.assert_array_equal(cupy.asnumpy(pop[order]), np.sort(cupy.asnumpy(pop)))
    np.testing.assert_array_equal(cupy.asnumpy(in_order), np.sort(cupy.asnumpy(pop)))
    same_values = pop.copy()  # another array: its own order
    assert kernels.kept_popcount_order(same_values, 2048)[0] is not order
    key = id(pop)
    del pop, same_values
    assert key not in kernels._kept_orders  # freed with its array


def _chain_states(rng, chains: int, rows: int, k: int) -> list[np.ndarray]:
    """Sorted keys ``(rows, k)`` of ``chains`` chains sharing a first state: each row's keys
    drawn from a small pool (the same pair in several chains), some rows short of k."""
    shared = rng.choice(1000, size=(rows, 3))
    states = []
    for _ in range(chains):
        keys = np.full((rows, k), kernels.NO_PAIR, dtype=np.uint64)
        for r in range(rows):
            drawn = np.unique(np.concatenate([shared[r], rng.choice(1000, rng.integers(0, k))]))
            keys[r, :min(k, len(drawn))] = np.sort(drawn)[:k]
        states.append(keys)
    return states


def _brute_merged(states: list[np.ndarray], k: int) -> np.ndarray:
    out = np.full((states[0].shape[0], k), kernels.NO_PAIR, dtype=np.uint64)
    for r in range(out.shape[0]):
        distinct = np.unique(np.concatenate([s[r] for s in states]))
        distinct = distinct[distinct != kernels.NO_PAIR][:k]
        out[r, :len(distinct)] = distinct
    return out


@pytest.mark.parametrize("chains, k", [(2, 1), (2, 10), (3, 7)])
def test_merged_chain_states_keep_each_pair_once(rng, chains, k):
    states = _chain_states(rng, chains, 40, k)
    np.testing.assert_array_equal(kernels.merged_sorted_keys(states, k),
                                  _brute_merged(states, k))


@pytest.mark.gpu
@pytest.mark.parametrize("chains, k, rows", [(2, 1, 5), (2, 10, 3000), (4, 32, 700), (2, 5, 0)])
def test_merged_chain_states_on_the_gpu_equal_the_host_path(rng, chains, k, rows):
    import cupy

    states = _chain_states(rng, chains, rows, k)
    got = kernels.merged_sorted_keys([cupy.asarray(s) for s in states], k)
    np.testing.assert_array_equal(got.get(), _brute_merged(states, k))
