"""The CPU twin of the similarity selection against the array path it replaces on the host
(scores, keys, smallest keys; pairs at least a threshold), key for key."""

from __future__ import annotations

import numpy as np
import pytest

from dask_gpuchunk._kernels import similarity as kernels
from dask_gpuchunk._kernels.similarity_cpu import (best_keys_of_columns, best_keys_of_rows,
                                                   pairs_at_least_cpu)

METRICS = ("tanimoto", "dice", "cosine", "hamming", "counts")


def block(rng, r: int, m: int, bits: int = 90):
    """Counts of random 0/1 rows at two densities, with repeated rows (ties) and empty rows."""
    x = (rng.random((r, bits)) < 0.3).astype(np.int64)
    y = (rng.random((m, bits)) < 0.15).astype(np.int64)
    if r > 1:
        x[1] = x[0]
    if m > 2:
        y[2] = y[0]
    x[-1] = 0
    y[-1] = 0
    return (x @ y.T).astype(np.int32), x.sum(1).astype(np.int32), y.sum(1).astype(np.int32)


def array_keys(c, pa, pb, first_row, first_col, metric, k, exclude):
    s = kernels.scores(c, pa, pb, metric)
    excluded = kernels.same_ids(s, first_row, first_col) if exclude else None
    return kernels.smallest_keys(kernels.rank_keys(s, first_col, metric, excluded), k)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("r, m, k, first_row, first_col, exclude", [
    (37, 53, 5, 0, 0, True),  # a diagonal block
    (40, 29, 7, 100, 90, True),  # ids that meet off the block's corner
    (33, 6, 9, 0, 40, False),  # fewer columns than k: padded
    (1, 70, 1, 5, 0, False),
])
def test_best_keys_are_the_array_paths(rng, metric, r, m, k, first_row, first_col, exclude):
    c, pa, pb = block(rng, r, m)
    got = best_keys_of_rows(c, pa, pb, first_row, first_col, metric, k, exclude)
    want = array_keys(c, pa, pb, first_row, first_col, metric, k, exclude)
    np.testing.assert_array_equal(got, want)
    got_t = best_keys_of_columns(c, pa, pb, first_row, first_col, metric, k, exclude)
    want_t = array_keys(c.T, pb, pa, first_col, first_row, metric, k, exclude)
    np.testing.assert_array_equal(got_t, want_t)
    assert (got != kernels.NO_PAIR).any()


@pytest.mark.parametrize("metric, thresholds", [
    ("tanimoto", [0.0, 0.2, 0.3333333, 1.0]), ("dice", [0.25, 0.5]), ("cosine", [0.3, 0.9]),
    ("hamming", [-1, 0, 12.5, 30]), ("counts", [0, 3.5, 8])])
def test_pairs_at_least_are_the_array_paths(rng, metric, thresholds):
    c, pa, pb = block(rng, 45, 38)
    s = kernels.scores(c, pa, pb, metric)
    for threshold in thresholds:
        for exclude in (False, True):
            excluded = kernels.same_ids(s, 7, 0) if exclude else None
            limit = (np.float32(threshold) if metric in kernels.FLOAT_METRICS else
                     np.int32(np.floor(threshold) if metric == "hamming" else
                              np.ceil(threshold)))
            want = kernels.pairs_at_least(s, 7, 0, limit, metric, excluded)
            got = pairs_at_least_cpu(c, pa, pb, 7, 0, metric, threshold, exclude)
            np.testing.assert_array_equal(got, want, err_msg=f"{metric} {threshold}")
    assert any(0 < len(pairs_at_least_cpu(c, pa, pb, 0, 0, metric, t)) < c.size
               for t in thresholds)


def test_popcounts_must_fit_the_block():
    with pytest.raises(ValueError, match="do not fit"):
        best_keys_of_rows(np.zeros((3, 4), np.int32), [1, 2, 3], [1, 2, 3], 0, 0, "dice", 2)
