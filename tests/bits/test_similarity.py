"""``dg.similarity``: dense, top-k and threshold outputs against a brute-force NumPy reference
of the documented formulas on exact counts (equal to the last bit), with ties, empty rows, odd
shapes and uneven chunks, all pairs and queries x database."""

from __future__ import annotations

import importlib
import warnings

import dask
import dask.array as da
import numpy as np
import pytest
from helpers import random_bits
from similarity_reference import assert_pairs, brute_top_k, fingerprints, reference

import dask_gpuchunk as dg
from dask_gpuchunk.bits.similarity import METRICS, MISSING_SCORE

QUERY_PLANNING = type(da.ones(1)).__module__.startswith("dask.array._array_expr")


@pytest.mark.parametrize("metric", METRICS)
def test_dense_scores_are_the_formula_to_the_last_bit(rng, metric):
    x = fingerprints(rng, 83, 150)
    y = random_bits(rng, (41, 150), 0.3)
    dense = dg.similarity(da.from_array(x, chunks=(30, 150)), metric=metric).compute()
    assert dense.dtype == (np.int32 if metric in ("hamming", "counts") else np.float32)
    np.testing.assert_array_equal(dense, reference(x, x, metric))
    cross = dg.similarity(da.from_array(x, chunks=(40, 150)), da.from_array(y, chunks=17),
                          metric=metric).compute()
    np.testing.assert_array_equal(cross, reference(x, y, metric))


@pytest.mark.skipif(QUERY_PLANNING, reason="threshold= is refused under array query planning")
@pytest.mark.parametrize("alpha, beta", [(0.9, 0.1), (0.2, 0.7), (0.0, 1.0)])
def test_tversky_is_exact_for_rows_against_columns_and_not_their_mirror(xp, rng, alpha, beta):
    # Asymmetric: all pairs score every block for its rows (no transposed halves), on the
    # array path on a GPU and in the CPU's kernels; dense, top-k and threshold against the
    # formula, all pairs and queries, in uneven chunks.
    x = fingerprints(rng, 90, 133)
    y = random_bits(rng, (37, 133), 0.2)
    s = reference(x, x, "tversky", alpha, beta)
    assert not np.array_equal(s, s.T)
    w = dg.asarray(xp.asarray(x), chunks=(25, -1))
    host = (lambda a: a) if xp is np else (lambda a: a.get())
    options = dict(metric="tversky", alpha=alpha, beta=beta)
    np.testing.assert_array_equal(host(dg.similarity(w, **options).compute()), s)
    indices, scores = dg.similarity(w, top_k=4, **options).compute()
    want_i, want_s = brute_top_k(s, 4, False, True)
    np.testing.assert_array_equal(host(indices), want_i)
    np.testing.assert_array_equal(host(scores), want_s.astype(np.float32))
    assert_pairs(*dg.similarity(w, threshold=0.45, **options).compute(), s, 0.45)
    cross = reference(x, y, "tversky", alpha, beta)
    q = dg.asarray(xp.asarray(y), chunks=(11, -1))
    np.testing.assert_array_equal(host(dg.similarity(w, q, **options).compute()), cross)
    indices, scores = dg.similarity(w, q, top_k=3, **options).compute()
    want_i, want_s = brute_top_k(cross, 3, False, False)
    np.testing.assert_array_equal(host(indices), want_i)
    np.testing.assert_array_equal(host(scores), want_s.astype(np.float32))


def test_tversky_weights_are_checked():
    x = np.eye(4, dtype=np.uint8)
    with pytest.raises(ValueError, match="weigh metric='tversky' only"):
        dg.similarity(x, alpha=0.5)
    for bad in (-0.1, float("nan"), "1", True):
        with pytest.raises(ValueError, match="alpha must be a finite number"):
            dg.similarity(x, metric="tversky", alpha=bad)
    # beta defaults to alpha: (1, 1) is Tanimoto, (0.5, 0.5) Dice.
    fps = fingerprints(np.random.default_rng(3), 30, 64)
    np.testing.assert_array_equal(dg.similarity(fps, metric="tversky").compute(),
                                  dg.similarity(fps).compute())
    np.testing.assert_array_equal(dg.similarity(fps, metric="tversky", alpha=0.5).compute(),
                                  dg.similarity(fps, metric="dice").compute())


def test_empty_rows_score_zero_and_packed_words_of_any_dtype(rng):
    x = fingerprints(rng, 20, 70)
    expected = reference(x, x, "tanimoto")
    assert expected[5].max() == 0 and expected[19, 19] == 0
    for words in (np.packbits(x, axis=1), np.packbits(x, axis=1, bitorder="little")):
        got = dg.similarity(words, packed=True).compute()
        np.testing.assert_array_equal(got, expected)
    wide = np.zeros((20, 16), dtype=np.uint8)
    wide[:, :9] = np.packbits(x, axis=1)
    got = dg.similarity(wide.view(np.uint64), packed=True, metric="cosine").compute()
    np.testing.assert_array_equal(got, reference(x, x, "cosine"))


@pytest.mark.parametrize("metric, k", [("tanimoto", 1), ("dice", 7), ("hamming", 5),
                                       ("counts", 3), ("cosine", 82)])
def test_top_k_matches_brute_force_with_ties(rng, metric, k):
    x = fingerprints(rng, 83, 150)
    indices, scores = dg.similarity(da.from_array(x, chunks=(30, 150)), metric=metric,
                                    top_k=k)
    assert indices.shape == scores.shape == (83, k) and indices.dtype == np.int64
    got_i, got_s = dask.compute(indices, scores)
    want_i, want_s = brute_top_k(reference(x, x, metric), k, metric == "hamming", True)
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_s.astype(np.float64), want_s)
    assert got_s.dtype == reference(x, x, metric).dtype


@pytest.mark.parametrize("mode", ["top_k", "threshold"])
def test_the_results_compute_together_in_one_pass(rng, mode):
    if mode == "threshold" and QUERY_PLANNING:
        pytest.skip("threshold= is refused under array query planning")
    from dask.callbacks import Callback

    x = da.from_array(fingerprints(rng, 90, 64), chunks=(20, 64))
    options = {"top_k": 3} if mode == "top_k" else {"threshold": 0.2}
    counted: list[int] = []

    def tasks_run(compute) -> int:
        counted.clear()
        with Callback(pretask=lambda key, dsk, state: counted.append(1)):
            compute()
        return len(counted)

    result = dg.similarity(x, **options)
    assert isinstance(result, dg.Neighbours if mode == "top_k" else dg.Pairs)
    together = tasks_run(result.compute)
    apart = tasks_run(lambda: [part.compute() for part in result])
    blocks = 5 * 6 // 2  # the blocks on and above the diagonal of 5 x 5 chunks
    assert apart - together >= blocks * (len(result) - 1), (together, apart)
    computed = result.compute()
    for got, part in zip(computed, result):
        np.testing.assert_array_equal(got, part.compute())
    assert type(computed) is type(result) and type(result.persist()) is type(result)


def test_top_k_of_queries_against_a_database_keeps_equal_indices(rng):
    x = fingerprints(rng, 30, 99)
    db = np.concatenate([x[:10], random_bits(rng, (47, 99), 0.1)])  # queries 0-9 in it
    indices, scores = dg.similarity(da.from_array(x, chunks=11), da.from_array(db, chunks=20),
                                    top_k=4)
    want_i, want_s = brute_top_k(reference(x, db, "tanimoto"), 4, False, False)
    np.testing.assert_array_equal(indices.compute(), want_i)
    np.testing.assert_array_equal(scores.compute(), want_s.astype(np.float32))
    assert (indices.compute()[:10, 0] <= np.arange(10)).all()  # each finds itself (or a twin)


@pytest.mark.parametrize("metric, k, threshold", [
    ("tanimoto", 6, 0.2), ("hamming", 4, 14), ("dice", 9, 0.33), ("counts", 5, 3),
    ("cosine", 3, 0.0), ("tanimoto", 2, 1.0)])
@pytest.mark.parametrize("queries", [False, True])
def test_top_k_with_a_threshold_is_the_best_k_that_meet_it(xp, rng, metric, k, threshold,
                                                           queries):
    # "The k best above 0.7": brute force's top k, those short of the threshold masked.
    x = fingerprints(rng, 71, 130)
    db = random_bits(rng, (53, 130), 0.1) if queries else x
    indices, scores = dg.similarity(
        da.from_array(xp.asarray(x), chunks=(25, 130)),
        da.from_array(xp.asarray(db), chunks=(19, 130)) if queries else None,
        metric=metric, top_k=k, threshold=threshold)
    got_i, got_s = (np.asarray(getattr(a, "get", lambda: a)())
                    for a in dask.compute(indices, scores))
    s = reference(x, db, metric)
    lower = metric == "hamming"
    want_i, want_s = brute_top_k(s, k, lower, not queries)
    limit = np.float64(np.float32(threshold)) if s.dtype.kind == "f" else threshold
    meets = want_s <= limit if lower else want_s >= limit
    assert 0 < meets.sum() < meets.size or threshold in (0.0, 1.0)
    np.testing.assert_array_equal(got_i, np.where(meets, want_i, -1))
    missing = MISSING_SCORE[s.dtype]
    np.testing.assert_array_equal(got_s, np.where(meets, want_s, missing).astype(s.dtype))
    assert got_s.dtype == s.dtype


@pytest.mark.skipif(QUERY_PLANNING, reason="threshold= is refused under array query planning")
@pytest.mark.parametrize("metric, threshold, exclude_self", [
    ("tanimoto", 0.3, None), ("hamming", 30, None), ("cosine", 0.2, False)])
def test_threshold_pairs_in_row_then_column_order(rng, metric, threshold, exclude_self):
    x = fingerprints(rng, 61, 130)
    rows, cols, scores = dg.similarity(da.from_array(x, chunks=(25, 60)), metric=metric,
                                       threshold=threshold, exclude_self=exclude_self)
    rows, cols, scores = dask.compute(rows, cols, scores)
    s = reference(x, x, metric)
    found = assert_pairs(rows, cols, scores, s, threshold, lower=metric == "hamming",
                         exclude_self=exclude_self is not False)
    assert 0 < found < s.size


def test_threshold_under_query_planning_is_refused_clearly():
    if not QUERY_PLANNING:
        pytest.skip("array query planning is off")
    with pytest.raises(NotImplementedError, match="query planning"):
        dg.similarity(np.eye(4, dtype=np.uint8), threshold=0.5)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"metric": "euclid"}, ValueError, "metric must be one of"),
    ({"top_k": 2, "threshold": 1.5}, ValueError, "from 0 to 1.0"),
    ({"top_k": 0}, ValueError, "between 1 and the 5 candidates"),
    ({"top_k": 6}, ValueError, "between 1 and the 5 candidates"),
    ({"top_k": True}, TypeError, "integer"),
    ({"threshold": 1.5}, ValueError, "from 0 to 1.0"),
    ({"threshold": -1, "metric": "hamming"}, ValueError, "from 0 to 10"),
    ({"y": np.zeros((3, 11), np.uint8)}, ValueError, "same bits"),
    ({"method": "fast"}, ValueError, "method must be one of"),
])
def test_bad_input_is_refused_before_any_work(kwargs, error, match):
    with pytest.raises(error, match=match):
        dg.similarity(np.zeros((6, 10), dtype=np.uint8), **kwargs)


def test_values_other_than_zero_or_one_are_refused():
    with pytest.raises(ValueError, match="0 or 1|0/1"):
        dg.similarity(np.full((4, 8), 2, dtype=np.uint8)).compute()


def test_on_the_device_or_the_host(xp, rng):
    def host(a):
        return a if isinstance(a, np.ndarray) else a.get()

    x = fingerprints(rng, 70, 200)
    words = xp.asarray(np.packbits(x, axis=1))
    w = dg.asarray(words, chunks=(32, 25))
    dense = dg.similarity(w, packed=True).compute()
    assert type(dense) is type(words)
    np.testing.assert_array_equal(host(dense), reference(x, x, "tanimoto"))
    for k in (5, 40):  # on a GPU: in one pass over each block; beyond 32, through scores
        indices, scores = dask.compute(*dg.similarity(w, packed=True, top_k=k))
        want_i, want_s = brute_top_k(reference(x, x, "tanimoto"), k, False, True)
        np.testing.assert_array_equal(host(indices), want_i)
        np.testing.assert_array_equal(host(scores), want_s.astype(np.float32))


def test_dense_scores_agree_with_scipy_on_non_empty_rows(rng):
    # scipy's distances on booleans, as similarities; scipy computes in float64, we round to
    # float32 (hamming: scipy gives the fraction of differing bits). Empty rows differ by
    # definition (scipy: jaccard distance 0 between two empty rows; here Tanimoto 0).
    distance = pytest.importorskip("scipy.spatial.distance")
    x = random_bits(rng, (57, 333), 0.2).astype(bool)
    y = random_bits(rng, (31, 333), 0.3).astype(bool)
    assert x.any(axis=1).all() and y.any(axis=1).all()
    for metric, to_score in [("jaccard", lambda d: 1 - d), ("dice", lambda d: 1 - d),
                             ("cosine", lambda d: 1 - d), ("hamming", lambda d: d * 333)]:
        got = dg.similarity(x.astype(np.uint8), y.astype(np.uint8), metric=metric).compute()
        want = to_score(distance.cdist(x, y, metric))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=metric)


@pytest.mark.parametrize("count", [1, 2, 5, 8])
def test_round_robin_meets_every_pair_once_in_rounds_of_disjoint_chunks(count):
    from dask_gpuchunk.bits.top_k_tiles import round_robin

    order = round_robin(count)
    assert sorted(order) == [(i, j) for i in range(count) for j in range(i + 1, count)]
    per_round = count // 2
    for start in range(0, len(order), max(per_round, 1)):
        chunks = [c for pair in order[start:start + per_round] for c in pair]
        assert len(chunks) == len(set(chunks))


@pytest.mark.skipif(QUERY_PLANNING, reason="threshold= is refused under array query planning")
def test_top_k_and_threshold_beyond_the_kernels_first_room(xp, rng, monkeypatch):
    # On a GPU with the 1-bit tensor cores, one slot per target: nearly every target of the
    # top-k chain's blocks is redone from its own Gram, a few at a time; the results stay exact.
    from dask_gpuchunk._kernels import bmma_select, top_k_overflow

    monkeypatch.setattr(bmma_select, "SLOTS", 1)
    monkeypatch.setattr(top_k_overflow, "REDONE_TARGETS", 7)
    # and room for 4 pairs at first: blocks with more are computed again with room for all.
    monkeypatch.setattr(importlib.import_module("dask_gpuchunk.bits.selection"),
                        "PAIRS_FIRST_CAPACITY", 4)
    # The chain's tasks redo their blocks' targets once all are queued (one wait a task),
    # holding each block's counts until then, never its slots (their memory filled a card).
    selection = importlib.import_module("dask_gpuchunk.bits.selection")
    redo_calls, held = [], []
    monkeypatch.setattr(selection, "redo_overflows",
                        lambda blocks: (redo_calls.append(len(blocks)),
                                        held.extend(x for b in blocks for side in b.sides
                                                    for x in side if hasattr(x, "shape")),
                                        top_k_overflow.redo_overflows(blocks)))
    x = fingerprints(rng, 150, 300)
    w = dg.asarray(xp.asarray(np.packbits(x, axis=1)), chunks=(40, -1))
    before = top_k_overflow.redone["targets"]
    indices, scores = dask.compute(*dg.similarity(w, packed=True, metric="dice", top_k=6))
    want_i, want_s = brute_top_k(reference(x, x, "dice"), 6, False, True)
    host = (lambda a: a) if xp is np else (lambda a: a.get())
    np.testing.assert_array_equal(host(indices), want_i)
    np.testing.assert_array_equal(host(scores), want_s.astype(np.float32))
    if xp is not np:
        assert top_k_overflow.redone["targets"] > before
        assert redo_calls == [2, 2, 2]  # four chunks: three rounds of two blocks, a task each
        assert held and not any(x.ndim == 2 and x.shape[1] == 1 for x in held)  # SLOTS = 1
    rows, cols, got = dask.compute(*dg.similarity(w, packed=True, metric="dice", threshold=0.2))
    assert_pairs(rows, cols, got, reference(x, x, "dice"), 0.2)


#: Substituents of the molecules the RDKit test fingerprints: para-disubstituted benzenes,
#: c1(R1)ccc(R2)cc1, 18 x 18 of them (R1 and R2 swapped give the same molecule: equal rows).
SUBSTITUENTS = ["", "C", "CC", "O", "N", "F", "Cl", "Br", "C(=O)O", "C#N", "OC", "N(C)C",
                "C(F)(F)F", "S", "C=O", "CCO", "c2ccccc2", "[N+](=O)[O-]"]


def molecules() -> list[str]:
    """324 SMILES, and a few chains and rings that share few bits with the benzenes."""
    def branch(r: str) -> str:
        return f"({r})" if r else ""

    benzenes = [f"c1{branch(r1)}ccc{branch(r2)}cc1" for r1 in SUBSTITUENTS
                for r2 in SUBSTITUENTS]
    return benzenes + ["C" * n + "O" for n in range(1, 12)] + ["C1CCCCC1", "C1CCNCC1", "O=C=O"]


@pytest.mark.skipif(QUERY_PLANNING, reason="threshold= is refused under array query planning")
def test_tanimoto_of_morgan_fingerprints_agrees_with_rdkit(xp):
    # RDKit's BulkTanimotoSimilarity computes c / (a + b - c) in float64; rounded to float32
    # it is the correctly rounded quotient of the two integers (53 >= 2 * 24 + 2 bits: double
    # rounding is exact for a quotient), which is what the documented formula gives.
    pytest.importorskip("rdkit")
    from rdkit import Chem, DataStructs
    from rdkit.Chem import rdFingerprintGenerator

    mols = [Chem.MolFromSmiles(s) for s in molecules()]
    assert all(m is not None for m in mols)
    generator = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
    fps = [generator.GetFingerprint(m) for m in mols]
    bits = np.stack([generator.GetFingerprintAsNumPy(m) for m in mols])
    want = np.array([DataStructs.BulkTanimotoSimilarity(fp, fps) for fp in fps]).astype(
        np.float32)
    assert len(np.unique(want)) > 100 and (want == 1).sum() > len(mols)  # ties: equal molecules

    def host(a):
        return a if isinstance(a, np.ndarray) else a.get()

    x = dg.asarray(xp.asarray(bits), chunks=(97, -1))  # uneven chunks of 0/1 bytes
    np.testing.assert_array_equal(host(dg.similarity(x).compute()), want)
    indices, scores = dask.compute(*dg.similarity(x, top_k=7))
    want_i, want_s = brute_top_k(want, 7, False, True)
    np.testing.assert_array_equal(host(indices), want_i)
    np.testing.assert_array_equal(host(scores), want_s.astype(np.float32))
    # the words a user saves with np.packbits; every pair at 0.6 or more, self pairs left out
    words = dg.asarray(xp.asarray(np.packbits(bits, axis=1)), chunks=(128, -1))
    rows, cols, got = (host(a) for a in dask.compute(*dg.similarity(words, packed=True,
                                                                      threshold=0.6)))
    keep = (want >= np.float32(0.6)) & ~np.eye(len(mols), dtype=bool)
    want_rows, want_cols = np.nonzero(keep)
    assert 0 < len(want_rows) < keep.size // 4
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(cols, want_cols)
    np.testing.assert_array_equal(got, want[keep])


@pytest.mark.skipif(QUERY_PLANNING, reason="the chain is listed where graphs are listed")
@pytest.mark.parametrize("per_task", [1, 3, 64])
def test_top_k_chain_tasks_take_several_blocks_of_a_round(rng, monkeypatch, per_task):
    similarity_module = importlib.import_module("dask_gpuchunk.bits.similarity_graphs")
    monkeypatch.setattr(similarity_module, "CPU_BLOCKS_PER_TASK", per_task)
    x = fingerprints(rng, 230, 90)  # 23 chunks (odd: a chunk rests each round)
    y = random_bits(rng, (61, 90), 0.2)
    # On the CPU: with a GPU visible the chunks would be regrouped into larger blocks.
    indices, scores = dg.similarity(da.from_array(x, chunks=(10, -1)), metric="cosine", top_k=4,
                                    device="cpu")
    steps = {key[1:] for key in dict(indices.__dask_graph__()) if isinstance(key, tuple)
             and key[0].startswith("similarity-step")}
    rounds, per_round = 23, 11  # 253 blocks above the diagonal
    assert len(steps) == rounds * -(-per_round // per_task)
    want_i, want_s = brute_top_k(reference(x, x, "cosine"), 4, False, True)
    got_i, got_s = dask.compute(indices, scores)
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_s, want_s.astype(np.float32))
    # queries x database: a round per database chunk, over the 7 query chunks
    indices, scores = dg.similarity(da.from_array(x[:70], chunks=(10, -1)),
                                    da.from_array(y, chunks=(13, -1)), top_k=3)
    want_i, want_s = brute_top_k(reference(x[:70], y, "tanimoto"), 3, False, False)
    got_i, got_s = dask.compute(indices, scores)
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_s, want_s.astype(np.float32))


@pytest.mark.skipif(QUERY_PLANNING, reason="threshold= is refused under array query planning")
def test_threshold_over_many_chunks_warns_nothing(rng):
    # A block per pair of chunks is what the threshold path builds; Dask's PerformanceWarning
    # about the blockwise's many chunks would reach every job's output.
    x = np.packbits(random_bits(rng, (400, 64), 0.2), axis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dg.similarity(da.from_array(x, chunks=(20, -1)), packed=True, threshold=0.5)


def test_plain_path_slices_are_a_quarter_of_the_budget_and_never_below_the_floor(monkeypatch):
    similarity_module = importlib.import_module("dask_gpuchunk.bits.selection")
    floor = similarity_module.SELECT_COUNTS_BYTES
    monkeypatch.setattr(similarity_module, "working_budget", lambda: 8 << 30)
    assert similarity_module._select_counts_bytes() == 2 << 30
    # 2 GiB of counts against 32,768 rows: 16,384 rows a slice, two slices a block.
    assert similarity_module._rows_per_slice(32768, 2 << 30) == 16384
    monkeypatch.setattr(similarity_module, "working_budget", lambda: floor)
    assert similarity_module._select_counts_bytes() == floor
    assert similarity_module._rows_per_slice(32768) == floor // (4 * 32768)
    assert similarity_module._rows_per_slice(10 ** 12) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["bmma", "int8", "popcount"])
def test_plain_path_takes_a_blocks_counts_in_slices(rng, monkeypatch, method):
    # Counts of a few targets at a time (room for 7 of them against a 40-row chunk): the
    # first block of each row chunk's top-k, and with int8 and popcount every block and the
    # threshold's pairs; the results are the same as from whole blocks.
    import cupy

    similarity_module = importlib.import_module("dask_gpuchunk.bits.selection")
    monkeypatch.setattr(similarity_module, "_select_counts_bytes", lambda: 7 * 40 * 4)
    assert similarity_module._rows_per_slice(40, similarity_module._select_counts_bytes()) == 7
    x = fingerprints(rng, 150, 300)
    w = dg.asarray(cupy.asarray(np.packbits(x, axis=1)), chunks=(40, -1))
    s = reference(x, x, "cosine")
    indices, scores = dask.compute(*dg.similarity(w, packed=True, metric="cosine", top_k=9,
                                                  method=method))
    want_i, want_s = brute_top_k(s, 9, False, True)
    np.testing.assert_array_equal(indices.get(), want_i)
    np.testing.assert_array_equal(scores.get(), want_s.astype(np.float32))
    q = w[25:95].rechunk((33, -1))
    indices, _ = dask.compute(*dg.similarity(q, w, packed=True, metric="cosine", top_k=9,
                                             exclude_self=False, method=method))
    np.testing.assert_array_equal(indices.get(), brute_top_k(s[25:95], 9, False, False)[0])
    if QUERY_PLANNING:
        return
    rows, cols, got = dask.compute(*dg.similarity(w, packed=True, metric="cosine",
                                                  threshold=0.2, method=method))
    assert assert_pairs(rows, cols, got, s, 0.2) > 50


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["tanimoto", "dice", "cosine", "hamming"])
@pytest.mark.parametrize("exclude_self", [True, False])
@pytest.mark.parametrize("schedule", [(8, 2, 64), (16, 8, 16)])
def test_first_states_seeded_from_a_part_are_exact(rng, monkeypatch, metric, exclude_self,
                                                    schedule):
    # Each chunk's block against itself: its first part's best keys, then the fused kernel's
    # candidates from spans of the rest (SEEDED_FIRST_ROWS lowered so that small chunks take
    # that path; few slots and long spans: rows over their slots, redone); ties (repeated and
    # empty rows) and uneven chunks.
    import cupy

    selection = importlib.import_module("dask_gpuchunk.bits.selection")
    monkeypatch.setattr(selection, "SEEDED_FIRST_ROWS", 32)
    for name, value in zip(("SEED_PART", "SPAN_GROWTH", "FIRST_SLOTS"), schedule):
        monkeypatch.setattr(selection, name, value)
    seeded = []
    real = selection._seeded_first_state
    monkeypatch.setattr(selection, "_seeded_first_state",
                        lambda *args: seeded.append(len(args[0])) or real(*args))
    x = fingerprints(rng, 333, 520)
    w = dg.asarray(cupy.asarray(np.packbits(x, axis=1)), chunks=((200, 133), -1))
    lower = metric == "hamming"
    for k in (1, 7):
        indices, scores = dask.compute(*dg.similarity(w, packed=True, metric=metric, top_k=k,
                                                      exclude_self=exclude_self))
        want_i, want_s = brute_top_k(reference(x, x, metric), k, lower, exclude_self)
        np.testing.assert_array_equal(indices.get(), want_i)
        np.testing.assert_array_equal(scores.get(), want_s.astype(scores.dtype))
    assert seeded


@pytest.mark.gpu
def test_blocks_that_cannot_fit_the_device_are_refused_by_what_they_hold(rng, device_cap):
    # On a 1 GiB card: dense scores of 32,768-row chunks would hold 8 GiB a block, refused
    # before any work; their top-k selects in slices and the fused kernel, under 0.6 GiB.
    import cupy

    from dask_gpuchunk.runtime.budget import DeviceBudgetError

    device_cap(1 << 30)
    words = cupy.asarray(rng.integers(0, 2**63, size=(40000, 32), dtype=np.uint64))
    w = dg.asarray(words, chunks=(32768, -1))
    with pytest.raises(DeviceBudgetError, match="a similarity block of 32768 x 32768 rows"):
        dg.similarity(w, packed=True)
    dg.similarity(w, packed=True, top_k=10)  # built, not computed
