"""``dg.similarity`` on GPUs: host words selected on the device with nothing but the kept
pairs brought back, the fused epilogues of the Hopper and Ampere kernels, blocks of the GPU's
size from small chunks."""

from __future__ import annotations

import importlib

import dask
import dask.array as da
import numpy as np
import pytest
from similarity_reference import assert_pairs, brute_top_k, fingerprints, reference

import dask_gpuchunk as dg
from dask_gpuchunk.bits import gram_blocks

QUERY_PLANNING = type(da.ones(1)).__module__.startswith("dask.array._array_expr")


@pytest.mark.gpu
@pytest.mark.skipif(QUERY_PLANNING, reason="threshold= is refused under array query planning")
@pytest.mark.parametrize("method", ["auto", "popcount"])
def test_selections_of_host_words_on_a_gpu_bring_back_no_counts(rng, method):
    # Host words go to the GPU and what a block keeps comes back; staged the plain way, each
    # block's counts (4 bytes a pair) came back for the CPU to select from.
    from dask_gpuchunk.runtime.backend import staging_totals

    x = fingerprints(rng, 700, 1000)
    w = da.from_array(np.packbits(x, axis=1), chunks=((300, 1, 399), -1))
    s = reference(x, x, "tanimoto")
    before = staging_totals.snapshot()["d2h_bytes"]
    indices, scores = dask.compute(*dg.similarity(w, packed=True, top_k=5, method=method))
    rows, cols, got = dask.compute(*dg.similarity(w, packed=True, threshold=0.1,
                                                  method=method))
    assert staging_totals.snapshot()["d2h_bytes"] == before
    assert all(isinstance(a, np.ndarray) for a in (indices, scores, rows, cols, got))
    want_i, want_s = brute_top_k(s, 5, False, True)
    np.testing.assert_array_equal(indices, want_i)
    np.testing.assert_array_equal(scores, want_s.astype(np.float32))
    assert 0 < assert_pairs(rows, cols, got, s, 0.1) < s.size // 4


def test_no_kernel_is_compiled_ahead_where_no_fused_kernel_will_run(monkeypatch):
    selection = importlib.import_module("dask_gpuchunk.bits.selection")

    monkeypatch.setattr(selection, "gpu_available", lambda: False)
    assert selection.compile_selection_ahead("auto", 10, None) is None
    monkeypatch.setattr(selection, "gpu_available", lambda: True)
    assert selection.compile_selection_ahead("popcount", 10, None) is None
    assert selection.compile_selection_ahead("bmma", None, None) is None  # dense: no selection
    started = []
    monkeypatch.setattr(selection, "compile_ahead",
                        lambda *args, **kwargs: started.append((*args, kwargs["method"])))
    selection.compile_selection_ahead("bmma", 64, None)  # k beyond the fused kernel's
    selection.compile_selection_ahead("bmma", 10, None)
    selection.compile_selection_ahead("bmma", None, 0.5, "dice")
    assert started == [("top_k", "tanimoto", "bmma"), ("threshold", "dice", "bmma")]


def test_selections_on_a_hopper_run_the_wgmma_kernel_s_fused_epilogue(monkeypatch):
    # wgmma, auto's method on compute capability 9.0, selects in its own epilogue; bmma's
    # epilogue only where asked for (or for a selection left out of WGMMA_SELECTIONS, to
    # measure one beside the other).
    selection = importlib.import_module("dask_gpuchunk.bits.selection")
    gram_module = importlib.import_module("dask_gpuchunk.bits.gram")

    monkeypatch.setattr(gram_blocks, "compute_capability", lambda: (9, 0))
    assert gram_module.resolve_method("auto", on_gpu=True) == "wgmma"
    assert selection._selecting_method("auto", "top_k") == "wgmma"
    assert selection._selecting_method("bmma", "threshold") == "bmma"
    assert selection._selecting_method("int8", "top_k") == "int8"
    monkeypatch.setattr(selection, "gpu_available", lambda: True)
    started = []
    monkeypatch.setattr(selection, "compile_ahead",
                        lambda *args, **kwargs: started.append((*args, kwargs["method"])))
    selection.compile_selection_ahead("auto", 10, None)
    monkeypatch.setattr(selection, "WGMMA_SELECTIONS", frozenset({"top_k"}))
    assert selection._selecting_method("wgmma", "threshold") == "bmma"
    selection.compile_selection_ahead("auto", None, 0.7)
    assert started == [("top_k", "tanimoto", "wgmma"), ("threshold", "tanimoto", "bmma")]


@pytest.mark.gpu
def test_dense_scores_from_the_wgmma_kernel(rng):
    from dask_gpuchunk._kernels.wgmma import wgmma_supported

    if not wgmma_supported():
        pytest.skip("wgmma needs a Hopper GPU (compute capability 9.0)")
    import cupy

    x = fingerprints(rng, 301, 2051)
    w = dg.asarray(cupy.asarray(x), chunks=(120, -1))
    for metric in ("tanimoto", "hamming"):
        dense = dg.similarity(w, metric=metric, method="wgmma").compute()
        np.testing.assert_array_equal(cupy.asnumpy(dense), reference(x, x, metric))


def test_small_row_chunks_are_grouped_for_the_gpu_and_a_npy_stays_read_where_blocks_run(
        rng, tmp_path):
    from dask_gpuchunk.io import npy_reader_of
    from dask_gpuchunk.bits.similarity import grouped_for_gpu

    x = fingerprints(rng, 2000, 256)
    np.save(tmp_path / "x.npy", np.packbits(x, axis=1))
    w = dg.from_npy(tmp_path / "x.npy", chunks=(100, -1))  # 20 chunks
    grouped = grouped_for_gpu(w, 4, "popcount", 5, None, budget=1 << 30, workers=2)
    assert grouped.chunks[0] == (500,) * 4  # at least 4 groups (2 workers: 4)
    assert QUERY_PLANNING or npy_reader_of(grouped) is not None
    np.testing.assert_array_equal(grouped.compute(), np.packbits(x, axis=1))
    assert grouped_for_gpu(w, 4, "popcount", 5, None, budget=1 << 30, workers=8).chunks[0] == (
        (100,) * 20)  # 16 groups of 125 rows at most: the chunks as they are
    indices, _ = dask.compute(*dg.similarity(grouped, packed=True, top_k=5, device="cpu"))
    np.testing.assert_array_equal(indices, brute_top_k(reference(x, x, "tanimoto"), 5, False,
                                                       True)[0])


@pytest.mark.gpu
def test_device_words_in_small_chunks_are_selected_in_blocks_of_the_gpus_size(rng, device_cap):
    import cupy

    device_cap(1 << 30)
    x = fingerprints(rng, 4000, 512)
    w = dg.asarray(cupy.asarray(np.packbits(x, axis=1)), chunks=(250, -1))  # 16 chunks
    indices, scores = dg.similarity(w, packed=True, top_k=6)
    assert len(indices.chunks[0]) < 16  # grouped
    got_i, got_s = (a.get() for a in dask.compute(indices, scores))
    want_i, want_s = brute_top_k(reference(x, x, "tanimoto"), 6, False, True)
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_s, want_s.astype(np.float32))
