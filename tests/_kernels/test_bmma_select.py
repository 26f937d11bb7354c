"""Selection in the 1-bit tensor-core kernels' epilogues (bmma's, and on Hopper wgmma's): new
top-k states and threshold pairs equal to the host path (exact counts, scores, keys and their
order) for every metric, with ties, empty rows, excluded ids, odd row counts and widths;
targets that fill their slots are redone from the target's own Gram; a pairs buffer too small
is reported with the count."""

from __future__ import annotations

import numpy as np
import pytest

from dask_gpuchunk._kernels import bmma_select, top_k_overflow
from dask_gpuchunk._kernels import similarity as kernels

pytestmark = pytest.mark.gpu

#: The metrics the CUDA kernels score (Tversky, asymmetric, takes the array path).
CUDA_METRICS = [m for m in kernels.METRICS if m not in kernels.ASYMMETRIC_METRICS]


@pytest.fixture(params=["bmma", "wgmma", "wgmma-3-blocks"])
def method(request, monkeypatch):
    if request.param.startswith("wgmma"):
        from dask_gpuchunk._kernels import wgmma_select
        from dask_gpuchunk._kernels.wgmma import wgmma_supported

        if not wgmma_supported():
            pytest.skip("wgmma needs a Hopper GPU (compute capability 9.0)")
        if request.param == "wgmma-3-blocks":
            # The persistent threshold kernel on three blocks: each takes many tiles in
            # turn, its stages and column buffers going round several times (a phase wrong
            # in any ring hangs or mixes tiles).
            monkeypatch.setattr(wgmma_select, "resident_blocks", lambda: 3)
        return "wgmma"
    return request.param


def _rows(rng, n: int, bits: int, density: float = 0.1) -> np.ndarray:
    x = (rng.random((n, bits)) < density).astype(np.uint8)
    x[3] = x[1]  # ties
    x[5] = 0  # an empty row
    return x


def _words(x: np.ndarray):
    import cupy

    packed = np.packbits(x, axis=1)
    pad = -packed.shape[1] % 8
    packed = np.pad(packed, ((0, 0), (0, pad)))
    return cupy.asarray(packed.view(np.uint64))


def _host_keys(x, y, first_x, first_y, metric, k, exclude):
    """The best k keys of each row of x against y, the host way."""
    c = (x.astype(np.int64) @ y.T.astype(np.int64)).astype(np.int32)
    s = kernels.scores(c, x.sum(axis=1), y.sum(axis=1), metric)
    excluded = kernels.same_ids(s, first_x, first_y) if exclude else None
    return kernels.smallest_keys(kernels.rank_keys(s, first_y, metric, excluded), k)


def _merged(state, keys, k):
    return kernels.smallest_keys(np.concatenate([state, keys], axis=1), k)


@pytest.mark.parametrize("metric", CUDA_METRICS)
@pytest.mark.parametrize("k", [1, 10, kernels.CUDA_TOP_K_MAX])
def test_new_states_of_rows_and_columns_equal_the_host_merge(rng, metric, k, method):
    import cupy

    bits = 1000  # not a multiple of the kernel's 1,024-bit stages: zero padding
    x, prev, y = _rows(rng, 301, bits), _rows(rng, 260, bits), _rows(rng, 257, bits)
    y[7] = x[1]  # ties across the block
    # States from a block before (x against prev; y against prev), as the chain has them.
    state_x = _host_keys(x, prev, 0, 1000, metric, k, False)
    state_y = _host_keys(y, prev, 400, 1000, metric, k, False)
    pop_x, pop_y = x.sum(axis=1).astype(np.int32), y.sum(axis=1).astype(np.int32)
    got = bmma_select.top_k_candidates(_words(x), _words(y), cupy.asarray(pop_x),
                                       cupy.asarray(pop_y), 0, 400, cupy.asarray(state_x),
                                       cupy.asarray(state_y), metric, False,
                                       method=method)
    want_x = _merged(state_x, _host_keys(x, y, 0, 400, metric, k, False), k)
    want_y = _merged(state_y, _host_keys(y, x, 400, 0, metric, k, False), k)
    np.testing.assert_array_equal(got[0].get(), want_x)
    np.testing.assert_array_equal(got[1].get(), want_y)


def test_rows_only_with_excluded_equal_ids(rng, method):
    import cupy

    x, y = _rows(rng, 150, 2048), _rows(rng, 140, 2048)
    y[:20] = x[30:50]  # ids 30..49 on both sides: equal ids, equal rows, excluded
    state = _host_keys(x, _rows(rng, 200, 2048), 0, 5000, "tanimoto", 5, False)
    got = bmma_select.top_k_candidates(
        _words(x), _words(y), cupy.asarray(x.sum(axis=1)), cupy.asarray(y.sum(axis=1)), 0, 30,
        cupy.asarray(state), None, "tanimoto", True, method=method)
    assert got[1] is None
    want = _merged(state, _host_keys(x, y, 0, 30, "tanimoto", 5, True), 5)
    np.testing.assert_array_equal(got[0].get(), want)


@pytest.mark.parametrize("metric", ["dice", "hamming"])
def test_targets_with_more_candidates_than_slots_are_redone_exactly(rng, metric, monkeypatch,
                                                                    method):
    import cupy

    monkeypatch.setattr(top_k_overflow, "REDONE_TARGETS", 9)  # several groups of targets
    x, y = _rows(rng, 40, 512), _rows(rng, bmma_select.SLOTS + 30, 512)
    empty = np.full((40, 3), kernels.NO_PAIR, dtype=np.uint64)  # every pair a candidate
    state_y = _host_keys(y, _rows(rng, 50, 512), 100, 500, metric, 3, False)
    before = top_k_overflow.redone["targets"]
    got = bmma_select.top_k_candidates(_words(x), _words(y), cupy.asarray(x.sum(axis=1)),
                                       cupy.asarray(y.sum(axis=1)), 0, 100,
                                       cupy.asarray(empty), cupy.asarray(state_y), metric,
                                       False, method=method)
    assert top_k_overflow.redone["targets"] - before >= 40
    want_x = _merged(empty, _host_keys(x, y, 0, 100, metric, 3, False), 3)
    want_y = _merged(state_y, _host_keys(y, x, 100, 0, metric, 3, False), 3)
    np.testing.assert_array_equal(got[0].get(), want_x)
    np.testing.assert_array_equal(got[1].get(), want_y)


@pytest.mark.parametrize("metric", CUDA_METRICS)
@pytest.mark.parametrize("upper", [False, True])
def test_threshold_pairs_equal_the_host_path(rng, metric, upper, method):
    import cupy

    x = _rows(rng, 270, 1100, 0.15)
    y = x if upper else _rows(rng, 203, 1100, 0.15)
    first_y = 0 if upper else 250  # ids 250..269 on both sides
    c = (x.astype(np.int64) @ y.T.astype(np.int64)).astype(np.int32)
    s = kernels.scores(c, x.sum(axis=1), y.sum(axis=1), metric)
    # A score that some pairs have (the boundary is kept): the best 2 % or so of the pairs.
    lower = metric == "hamming"
    limit = np.quantile(s, 0.02 if lower else 0.98, method="lower" if lower else "higher")
    excluded = kernels.same_ids(s, 0, first_y)
    if upper:
        excluded |= np.tril(np.ones(s.shape, dtype=bool), -1)
    want = kernels.pairs_at_least(s, 0, first_y, limit, metric, excluded)
    assert 8 < len(want) < s.size // 10
    assert (kernels.pair_rows_cols_scores(want, metric)[2] == limit).any()
    words_x = _words(x)
    args = (words_x, words_x if upper else _words(y), cupy.asarray(x.sum(axis=1)),
            cupy.asarray(y.sum(axis=1)), 0, first_y, limit, metric, True, upper)
    assert bmma_select.pairs_at_least_bmma(*args, capacity=8, method=method) == (None, len(want))
    got, count = bmma_select.pairs_at_least_bmma(*args, capacity=len(want), method=method)
    assert count == len(want)
    np.testing.assert_array_equal(kernels.sorted_pairs([got.get()]), want)


@pytest.mark.parametrize("selection, names", [
    ("top_k", {"top_k_candidates", "merge_candidates"}), ("threshold", {"pairs_at_least"})])
def test_compile_ahead_compiles_each_kernel_of_the_selection_in_its_thread(selection, names,
                                                                            method):
    import cupy

    from dask_gpuchunk._kernels import bmma, wgmma_select

    thread = bmma_select.compile_ahead(selection, method=method)
    thread.join(120)
    assert not thread.is_alive()
    device = cupy.cuda.runtime.getDevice()
    made = {key[3] for key in bmma._compiled_kernel.made if key[0] == device}
    made |= {key[1].removesuffix("_wgmma") for key in wgmma_select._compiled.made
             if key[0] == device}
    assert names <= made


def test_many_tiles_and_a_tight_selection_equal_bmma_s(rng, method):
    # Blocks of many tiles, states from a block before (tight: the cheap test leaves out
    # nearly every pair), near twins across the block: the candidates, hence the states,
    # are those of the host merge.
    import cupy

    x, y = _rows(rng, 1500, 2048, 0.075), _rows(rng, 1300, 2048, 0.075)
    flip = rng.random((100, 2048)) < 0.01
    y[:100] = x[200:300] ^ flip
    state_x = _host_keys(x, _rows(rng, 700, 2048, 0.075), 0, 9000, "tanimoto", 10, False)
    state_y = _host_keys(y, _rows(rng, 700, 2048, 0.075), 5000, 9000, "tanimoto", 10, False)
    got = bmma_select.top_k_candidates(
        _words(x), _words(y), cupy.asarray(x.sum(axis=1)), cupy.asarray(y.sum(axis=1)), 0,
        5000, cupy.asarray(state_x), cupy.asarray(state_y), "tanimoto", False, method=method)
    want_x = _merged(state_x, _host_keys(x, y, 0, 5000, "tanimoto", 10, False), 10)
    want_y = _merged(state_y, _host_keys(y, x, 5000, 0, "tanimoto", 10, False), 10)
    np.testing.assert_array_equal(got[0].get(), want_x)
    np.testing.assert_array_equal(got[1].get(), want_y)
