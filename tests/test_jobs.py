"""dask_gpuchunk.jobs in this process: the CLI's multiply, gram and similarity jobs without the
CLI.

tests/test_cli_jobs.py and tests/test_cli_failures.py run them through the command line, in
processes with their own clusters; these run in every CI job (those files only in the first:
their processes take minutes).
"""

from __future__ import annotations

import collections
import os

import dask.array as da
import numpy as np
import pytest
from dask.utils import key_split
from helpers import bit_products, random_bits

from dask_gpuchunk.jobs import gram_files, multiply_files
from dask_gpuchunk import config


def test_multiply_files_writes_the_broadcast_product_chunk_by_chunk(rng, tmp_path):
    a = rng.random((2000, 30))
    b = rng.random((1, 30)).astype(np.float32)  # broadcast along the rows, promoted
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    summary = multiply_files(tmp_path / "a.npy", tmp_path / "b.npy", tmp_path / "c.npy",
                             chunk_size="100kB", device="cpu")
    assert summary["chunks"] > 1 and summary["output"]["dtype"] == "float64"
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), a * b)


def test_gram_files_of_packed_words_in_row_slabs(rng, tmp_path):
    bits = random_bits(rng, (300, 1043), 0.4)
    np.save(tmp_path / "packed.npy", np.packbits(bits, axis=1))
    summary = gram_files(tmp_path / "packed.npy", tmp_path / "g.npy", packed=True,
                         chunk_rows=70, layout="rows", device="cpu")
    assert summary["layout"] == "rows" and summary["chunks"] == -(-300 // 70)
    np.testing.assert_array_equal(np.load(tmp_path / "g.npy"), bit_products(bits, bits))


@pytest.mark.parametrize("layout", ["rows", "upper"])
def test_gram_files_in_row_slabs_send_no_words_between_workers(rng, tmp_path, layout):
    # Each slab task took every row chunk of words as a Dask input: on two H100s each worker
    # was sent 1 GB of words and copied 9.1 GB into pinned buffers. Slabs of a .npy's words
    # now read them where they run, each chunk once per worker. Then every slab ran on the
    # worker that made the words' source (the other GPU idle): slabs are now dealt out.
    from distributed import Client, LocalCluster, get_task_stream

    from dask_gpuchunk.jobs import sent_by_workers

    bits = random_bits(rng, (480, 20000), 0.3)
    words = np.packbits(bits, axis=1)  # 1.2 MB in 8 row chunks
    np.save(tmp_path / "packed.npy", words)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        before = sent_by_workers(client)
        with get_task_stream(client) as tasks:
            summary = gram_files(tmp_path / "packed.npy", tmp_path / "g.npy", packed=True,
                                 chunk_rows=60, layout=layout, device="cpu")
        sent = sent_by_workers(client, before)
    assert summary["layout"] == layout and summary["chunks"] == 8
    assert len(sent) == 2
    slabs = collections.Counter(t["worker"] for t in tasks.data
                                if key_split(t["key"]).endswith("slab_after"))
    assert sorted(slabs.values()) == [4, 4], slabs
    if not type(da.ones(1)).__module__.startswith("dask.array._array_expr"):
        # (under dask's array query planning the words are read through their tasks)
        assert sum(sent.values()) < words.nbytes // 20
    # float64 products are exact to 2**53 and take BLAS (NumPy multiplies int64 in a plain loop:
    # 20 s here)
    np.testing.assert_array_equal(np.load(tmp_path / "g.npy"), bits.astype(np.float64) @ bits.T)


def test_gram_on_the_cpu_holds_strips_not_the_output(rng, tmp_path):
    # NumPy's buffers are traced by tracemalloc: the peak is what the job held at once.
    import tracemalloc


    bits = random_bits(rng, (3001, 100), 0.4)
    np.save(tmp_path / "bits.npy", bits)
    expected = bit_products(bits, bits)
    output_bytes = expected.size * 4
    gram_files(tmp_path / "bits.npy", tmp_path / "warm.npy", chunk_rows=150, device="cpu",
               layout="rows")  # numba's compilation is traced too: done before measuring
    peaks = {}
    for layout in ("auto", "blocks"):
        tracemalloc.start()
        try:
            summary = gram_files(tmp_path / "bits.npy", tmp_path / f"{layout}.npy",
                                 chunk_rows=100, device="cpu", layout=layout)
            peaks[summary["layout"]] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        np.testing.assert_array_equal(np.load(tmp_path / f"{layout}.npy"), expected)
    # Strips of 100 x 3001 int32 (1.2 MB), a few at a time; dask's blocks hold those above
    # the diagonal until their transposes are written: half the output and more.
    assert peaks["upper"] < output_bytes / 5 < output_bytes / 2 < peaks["blocks"], peaks


def _similarity_reference(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    c = bit_products(x, y)
    a, b = x.sum(axis=1)[:, None], y.sum(axis=1)[None, :]
    den = np.float32(a + b - c)
    return np.float32(c) / np.where(den == 0, np.float32(1), den)


def test_similarity_files_top_k_threshold_and_dense(rng, tmp_path):
    from dask_gpuchunk.jobs import OutputError, similarity_job

    fps = random_bits(rng, (157, 300), 0.15)
    fps[7] = fps[2]  # a tie
    queries = random_bits(rng, (23, 300), 0.15)
    np.save(tmp_path / "fps.npy", np.packbits(fps, axis=1))
    np.save(tmp_path / "q.npy", queries)
    np.save(tmp_path / "fps01.npy", fps)
    s = _similarity_reference(fps, fps)
    np.fill_diagonal(s, -1)
    summary = similarity_job(tmp_path / "fps.npy", tmp_path / "top.npz", packed=True,
                             top_k=5, chunk_rows=40, device="cpu")(None)
    assert summary["output"]["shape"] == [157, 5] and summary["chunk_rows"] == 40
    with np.load(tmp_path / "top.npz") as got:
        order = np.argsort(-s.astype(np.float64), axis=1, kind="stable")[:, :5]
        np.testing.assert_array_equal(got["indices"], order)
        np.testing.assert_array_equal(got["scores"], np.take_along_axis(s, order, axis=1))
    cross = _similarity_reference(queries, fps)
    pairs_job = similarity_job(tmp_path / "fps01.npy", tmp_path / "pairs.npz",
                               queries=tmp_path / "q.npy", threshold=0.2, chunk_rows=50,
                               device="cpu")
    if type(da.ones(1)).__module__.startswith("dask.array._array_expr"):
        with pytest.raises(NotImplementedError, match="query planning"):
            pairs_job(None)
        np.savez(tmp_path / "pairs.npz", rows=[], cols=[], scores=[])
        return
    pairs_job(None)
    with np.load(tmp_path / "pairs.npz") as got:
        rows, cols = np.nonzero(cross >= np.float32(0.2))
        assert 0 < len(rows) < cross.size
        np.testing.assert_array_equal(got["rows"], rows)
        np.testing.assert_array_equal(got["cols"], cols)
        np.testing.assert_array_equal(got["scores"], cross[rows, cols])
    similarity_job(tmp_path / "fps01.npy", tmp_path / "dense.npy", queries=tmp_path / "q.npy",
                   chunk_rows=50, device="cpu")(None)
    np.testing.assert_array_equal(np.load(tmp_path / "dense.npy"), cross)
    for out, kwargs, match in [("top.npz", {"top_k": 5}, "exists"),
                               ("x.npy", {"top_k": 5}, "to a .npz"),
                               ("x.npz", {}, "dense scores go to")]:
        with pytest.raises((OutputError, FileExistsError), match=match):
            similarity_job(tmp_path / "fps.npy", tmp_path / out, packed=True, **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dense.npy", "fps.npy", "fps01.npy", "pairs.npz", "q.npy", "top.npz"]


def test_the_k_best_above_a_threshold_through_the_command_line(rng, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from dask_gpuchunk.cli import main

    fps = random_bits(rng, (97, 200), 0.15)
    np.save(tmp_path / "fps.npy", np.packbits(fps, axis=1))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["similarity", "fps.npy", "--packed", "--top-k", "6",
                                  "--threshold", "0.12", "--chunk-rows", "30", "--device",
                                  "cpu", "-o", "top.npz"])
    assert r.exit_code == 0, r.output
    s = _similarity_reference(fps, fps)
    np.fill_diagonal(s, -1)
    order = np.argsort(-s.astype(np.float64), axis=1, kind="stable")[:, :6]
    best = np.take_along_axis(s, order, axis=1)
    meets = best >= np.float32(0.12)
    assert 0 < meets.sum() < meets.size
    with np.load(tmp_path / "top.npz") as got:
        np.testing.assert_array_equal(got["indices"], np.where(meets, order, -1))
        np.testing.assert_array_equal(got["scores"], np.where(meets, best, np.nan))


def test_a_tversky_job_scores_each_row_against_the_others_with_its_weights(rng, tmp_path):
    from dask_gpuchunk.jobs import similarity_job
    from dask_gpuchunk._kernels.similarity import scores

    fps = random_bits(rng, (90, 200), 0.15)
    np.save(tmp_path / "fps.npy", np.packbits(fps, axis=1))
    summary = similarity_job(tmp_path / "fps.npy", tmp_path / "top.npz", packed=True, top_k=4,
                             metric="tversky", alpha=0.9, beta=0.2, chunk_rows=32,
                             device="cpu")(None)
    assert (summary["alpha"], summary["beta"]) == (0.9, 0.2)
    s = scores(bit_products(fps, fps), fps.sum(axis=1), fps.sum(axis=1), "tversky",
               weights=(0.9, 0.2)).astype(np.float64)
    np.fill_diagonal(s, -1)
    order = np.argsort(-s, axis=1, kind="stable")[:, :4]
    with np.load(tmp_path / "top.npz") as got:
        np.testing.assert_array_equal(got["indices"], order)
        np.testing.assert_array_equal(got["scores"],
                                      np.take_along_axis(s, order, axis=1).astype(np.float32))


def test_a_similarity_job_warms_up_first_and_a_failed_warm_up_loses_nothing(rng, tmp_path,
                                                                             monkeypatch):
    from dask_gpuchunk import jobs

    fps = random_bits(rng, (90, 200), 0.2)
    np.save(tmp_path / "fps.npy", np.packbits(fps, axis=1))
    calls = []

    def failing_warm_up(*args, **options):
        calls.append((args, options["top_k"]))
        raise RuntimeError("no warm-up here")

    monkeypatch.setattr(jobs.similarity, "_warm_similarity", failing_warm_up)
    jobs.similarity_job(tmp_path / "fps.npy", tmp_path / "top.npz", packed=True, top_k=3,
                        chunk_rows=40, device="cpu")(None)
    assert calls == [(("|u1", 25, True, False, False, True), 3)]
    s = _similarity_reference(fps, fps)
    np.fill_diagonal(s, -1)
    with np.load(tmp_path / "top.npz") as got:
        order = np.argsort(-s.astype(np.float64), axis=1, kind="stable")[:, :3]
        np.testing.assert_array_equal(got["indices"], order)


def test_the_similarity_warm_up_runs_the_job_kind_on_a_few_rows(monkeypatch):
    from dask_gpuchunk import jobs

    for packed, dtype, width in [(True, ">u8", 4), (False, "bool", 200)]:
        jobs.similarity._warm_similarity(dtype, width, packed, True, False, metric="dice", top_k=40,
                              threshold=None, exclude_self=None, method="auto", device="cpu")
    if not type(da.ones(1)).__module__.startswith("dask.array._array_expr"):  # no pairs there
        jobs.similarity._warm_similarity("uint8", 8, True, False, False, metric="hamming", top_k=None,
                              threshold=10, exclude_self=None, method="auto", device="cpu")


def test_the_similarity_warm_up_reads_its_rows_from_a_npy_as_the_job_does(monkeypatch):
    from dask_gpuchunk import jobs

    read = []
    real_read = jobs.similarity._read

    def recorded_read(path, chunks, pinned=None):
        read.append((path, chunks))
        return real_read(path, chunks, pinned)

    monkeypatch.setattr(jobs.similarity, "_read", recorded_read)
    jobs.similarity._warm_similarity("<u8", 4, True, True, False, True, metric="tanimoto", top_k=40,
                          threshold=None, exclude_self=None, method="auto", device="cpu")
    rows = jobs.similarity.WARM_UP_ROWS
    assert [(os.path.basename(p), chunks) for p, chunks in read] == [
        ("x.npy", (rows, -1)), ("y.npy", (rows, -1))]
    assert not any(os.path.exists(os.path.dirname(p)) for p, _ in read)  # gone with it
    read.clear()
    jobs.similarity._warm_similarity("<u8", 4, True, False, False, False, metric="tanimoto", top_k=3,
                          threshold=None, exclude_self=None, method="auto", device="cpu")
    assert read == []  # a Zarr job's warm-up makes its rows in memory


@pytest.mark.gpu
def test_the_similarity_warm_up_meets_the_redo_of_overflowing_targets_on_the_gpu():
    from dask_gpuchunk import jobs
    from dask_gpuchunk._kernels import bmma_select, top_k_overflow

    assert jobs.similarity.WARM_UP_ROWS > bmma_select.SLOTS
    before = top_k_overflow.redone["targets"]
    jobs.similarity._warm_similarity("|u1", 256, True, False, True, True, metric="tanimoto", top_k=10,
                          threshold=None, exclude_self=None, method="bmma", device="gpu")
    assert top_k_overflow.redone["targets"] > before


@pytest.mark.gpu
def test_similarity_files_on_the_gpu(rng, tmp_path):
    from dask_gpuchunk.jobs import similarity_job

    fps = random_bits(rng, (1000, 2048), 0.075)
    fps[9] = fps[4]
    np.save(tmp_path / "fps.npy", np.packbits(fps, axis=1))
    s = _similarity_reference(fps, fps)
    summary = similarity_job(tmp_path / "fps.npy", tmp_path / "top.npz", packed=True,
                             top_k=10, chunk_rows=256, device="gpu")(None)
    assert summary["chunk_rows"] == 256
    np.fill_diagonal(s, -1)
    with np.load(tmp_path / "top.npz") as got:
        order = np.argsort(-s.astype(np.float64), axis=1, kind="stable")[:, :10]
        np.testing.assert_array_equal(got["indices"], order)
        np.testing.assert_array_equal(got["scores"], np.take_along_axis(s, order, axis=1))
    similarity_job(tmp_path / "fps.npy", tmp_path / "dense.npy", packed=True, metric="dice",
                   chunk_rows=300, device="gpu")(None)
    c = bit_products(fps, fps)
    a = fps.sum(axis=1)
    dice = np.float32(2 * c) / np.float32(a[:, None] + a[None, :])
    np.testing.assert_array_equal(np.load(tmp_path / "dense.npy"), dice)


def test_bytes_sent_by_workers_are_counted_per_worker():
    from distributed import Client, LocalCluster

    from dask_gpuchunk.jobs import sent_by_workers

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        before = sent_by_workers(client)
        assert set(before) == {a, b}
        x = client.submit(np.ones, 1_000_000, workers=[a], pure=False)  # 8 MB on a
        y = client.submit(lambda v: float(v.sum()), x, workers=[b])  # needs x on b
        assert y.result() == 1_000_000
        moved = sent_by_workers(client, before)
        assert moved[a] >= 8_000_000 and moved[b] < 1_000_000
        assert sent_by_workers(client, sent_by_workers(client)) == {a: 0, b: 0}


def test_what_chunks_staged_is_counted_per_worker_and_since_a_call():
    from distributed import Client, LocalCluster

    from dask_gpuchunk.runtime.backend import StagingTotals, staging_totals
    from dask_gpuchunk.jobs import staged_by_workers

    before = staged_by_workers(None)
    staging_totals.add(chunks=2, h2d_bytes=300, d2h_bytes=40, device_seconds=0.5)
    moved = staged_by_workers(None, before)["this process"]
    assert (moved["chunks"], moved["h2d_bytes"], moved["d2h_bytes"]) == (2, 300, 40)
    assert moved["device_seconds"] == pytest.approx(0.5) and moved["wait_seconds"] == 0
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        staged = staged_by_workers(client)
        assert set(staged) == set(client.scheduler_info()["workers"])
        assert all(set(totals) == set(StagingTotals.FIELDS) for totals in staged.values())


@pytest.mark.gpu
def test_host_words_of_a_gram_are_counted_as_staged():
    import dask_gpuchunk as dg
    from dask_gpuchunk.jobs import staged_by_workers

    words = np.random.default_rng(3).integers(0, 2**63, size=(300, 40), dtype=np.uint64)
    before = staged_by_workers(None)
    c = dg.gram(da.from_array(words, chunks=(100, -1)), packed=True, device="gpu").compute()
    moved = staged_by_workers(None, before)["this process"]
    assert c[5, 7] == np.bitwise_count(words[5] & words[7]).sum()
    # Six blocks on or above the diagonal, each staging its two word chunks, each sending
    # back its counts.
    assert moved["chunks"] >= 6 and moved["h2d_bytes"] >= 6 * 100 * 40 * 8
    assert moved["d2h_bytes"] >= 6 * 100 * 100 * 4


@pytest.mark.parametrize("listed", [True, False])
def test_similarity_job_leaves_a_npy_to_the_selection_s_blocks(rng, tmp_path, listed):
    # Where graphs are listed, the blocks of a top-k or threshold read a .npy's words where
    # they run, kept on their worker's GPU: moved to the GPUs first, by a task each, they were
    # sent between workers. Dense scores, and every selection under blockwise, take them moved.
    import dask

    from dask_gpuchunk.config import listed_graphs
    from dask_gpuchunk.io import npy_reader_of
    from dask_gpuchunk.jobs.similarity import _read, _similarity_words

    np.save(tmp_path / "fps.npy", np.packbits(random_bits(rng, (300, 2048), 0.075), axis=1))
    with config.internal_values({"listed-graphs": listed}):
        x = _read(tmp_path / "fps.npy", chunks=(100, -1))
        for selection in (True, False):
            words = _similarity_words(x, True, "auto", True, selection)
            assert (npy_reader_of(words) is not None) == (selection and listed_graphs())
        on_host = _similarity_words(x, True, "auto", False, False)  # no GPU: as it is
        assert (npy_reader_of(on_host) is not None) == (npy_reader_of(x) is not None)


@pytest.mark.parametrize("options, rows", [
    ({"top_k": 10}, 32768),  # the selections need well under 1 GiB a block
    pytest.param({"threshold": 0.5}, 32768, marks=pytest.mark.skipif(
        type(da.ones(1)).__module__.startswith("dask.array._array_expr"),
        reason="threshold pairs are refused under dask's array query planning")),
    ({"top_k": 40}, 4096),  # beyond the kernels' 32: scores and keys of whole blocks
    ({"top_k": 10, "metric": "tversky", "alpha": 0.7}, 4096),  # no CUDA kernel scores it
    ({}, 8192),  # dense: each block's counts and scores, 8 bytes a pair
])
def test_similarity_job_chunks_by_what_a_block_holds(rng, tmp_path, monkeypatch, options,
                                                      rows):
    from dask_gpuchunk import jobs
    from dask_gpuchunk.jobs import similarity_job
    from dask_gpuchunk.bits.similarity import block_bytes

    np.save(tmp_path / "fps.npy", np.packbits(random_bits(rng, (300, 2048), 0.075), axis=1))
    # GPU workers of 2 GiB each, as the job sees them; the chunks stay on the host here.
    monkeypatch.setattr(jobs.similarity, "_budgets_where_it_runs", lambda: [2 << 30])
    monkeypatch.setattr(jobs.similarity, "_on_device", lambda block: block)
    out = tmp_path / ("out.npz" if options else "out.npy")
    summary = similarity_job(tmp_path / "fps.npy", out, packed=True, **options)(None)
    assert summary["chunk_rows"] == rows

    def held(rows):
        return max(block_bytes(rows, 32, method, options.get("top_k"), options.get("threshold"),
                               options.get("metric", "tanimoto"))
                   for method in ("bmma", "int8"))

    assert held(rows) <= 2 << 30 and (held(2 * rows) > 2 << 30 or rows == 32768)
