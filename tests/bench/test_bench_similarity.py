"""``bench similarity``: every row runs and is checked exactly; the checks catch a wrong row."""

from __future__ import annotations

import importlib.util

import dask.array as da
import numpy as np
import pytest
from click.testing import CliRunner

from dask_gpuchunk.bench.similarity import (_check_pairs, check_top_k, format_table,
                                            make_fingerprints, run, tanimoto_rows)
from dask_gpuchunk.cli import main
from dask_gpuchunk.devices import gpu_available

QUERY_PLANNING = type(da.ones(1)).__module__.startswith("dask.array._array_expr")


def test_tanimoto_rows_is_the_formula_on_exact_counts():
    words = make_fingerprints(300, 72, 0.2, seed=5)  # 9 bytes a row: not whole uint64 words
    words[7] = 0
    bits = np.unpackbits(words, axis=1).astype(np.int64)
    c = bits @ bits.T
    a = bits.sum(axis=1)
    d = a[:, None] + a[None, :] - c
    want = np.float32(c) / np.float32(np.where(d == 0, 1, d))
    rows = np.array([0, 7, 150, 299])
    np.testing.assert_array_equal(tanimoto_rows(words, words[rows]), want[rows])
    assert want[7].max() == 0 and (words[4:8] != words[:4]).any()  # near twins, not copies


def test_every_row_runs_and_passes_its_exact_check_on_this_machine():
    report = run(n=2500, bits=192, density=0.1, queries=150, chunk_rows=600, k=4,
                 threshold=0.6, peer_rows=900, repeat=1, log=lambda s: None)
    entries = {e["name"]: e for e in report["entries"]}
    blocks = [e for e in entries.values() if e["name"].startswith("ours one ")]
    ours = [e for e in entries.values() if e["kind"] == "ours" and e not in blocks]
    assert len(ours) == 6
    gpu = gpu_available()
    if gpu:  # the parts of one GPU block, each timed
        assert len(blocks) > 1 and all(e["seconds"] for e in blocks), blocks
    else:
        assert [e["skipped"] for e in blocks] == ["no CUDA GPU visible"]
    for e in ours:
        if QUERY_PLANNING and "threshold" in e["name"]:  # refused there, and said why
            assert "query planning" in e["skipped"], e
        else:
            assert e["seconds"], e["skipped"]
    for e in entries.values():
        assert not (e["skipped"] or "").startswith("WRONG"), e
    found = [e["extra"]["pairs_found"] for e in ours if "pairs_found" in e["extra"]]
    assert len(found) == (0 if QUERY_PLANNING else 2) and min(found, default=1) > 0
    assert entries["peer NumPy bitwise_count + top-k (host, one thread)"]["seconds"]
    fpsim2 = entries["peer FPSim2 CPU engine top-k (host, one thread)"]
    assert fpsim2["seconds"] or "not importable" in fpsim2["skipped"], fpsim2
    # FAISS: one timed row (the GPU index where it runs here, else the host's), or one that
    # says it is not importable; a GPU row that did not run says why before the host's.
    faiss = [e for name, e in entries.items() if name.startswith("peer FAISS")]
    assert faiss[-1]["seconds"] or "not importable" in faiss[-1]["skipped"], faiss
    assert all("compute capability" in e["skipped"] for e in faiss[:-1]), faiss
    # nvMolKit's dense cross Tanimoto runs on a GPU only: its row says why it did not run.
    nvmolkit = entries["peer nvMolKit cross Tanimoto, dense scores (device)"]
    if gpu:
        assert nvmolkit["seconds"] or "not importable" in nvmolkit["skipped"], nvmolkit
    else:
        assert nvmolkit["skipped"] == "no CUDA GPU visible"
    assert all(e["extra"]["pairs_per_s"] > 0 for e in entries.values() if e["seconds"])
    where = "device-resident" if gpu else "host"
    top = entries[f"ours all-pairs top-4 ({where})"]["extra"]
    assert top["pairs"] == 2500 * 2499 / 2  # unique pairs
    assert entries[f"ours queries x database top-4 ({where})"]["extra"]["pairs"] == 150 * 2500
    table = format_table(report)
    assert "pairs/s" in table and "unique pairs" in table
    assert f"ours all-pairs top-4 ({where})" in table


def test_the_checks_catch_a_wrong_neighbour_or_a_missing_pair():
    words = make_fingerprints(400, 64, 0.2, seed=9)
    sample = np.array([1, 2])
    truth = tanimoto_rows(words, words[sample])
    scores = np.where(np.arange(400)[None, :] == sample[:, None], -np.inf, truth)
    order = np.argsort(-scores, kind="stable", axis=1)[:, :3]
    indices = np.zeros((400, 3), dtype=np.int64)
    best = np.zeros((400, 3), dtype=np.float32)
    indices[sample], best[sample] = order, np.take_along_axis(truth, order, axis=1)
    check_top_k(indices, best, truth, sample, 3, sample[:, None])
    indices[2, 1] = indices[2, 2]
    with pytest.raises(AssertionError, match="row 2"):
        check_top_k(indices, best, truth, sample, 3, sample[:, None])
    keep = truth >= 0.3
    keep[0, 1] = keep[1, 2] = False
    r, c = np.nonzero(keep)
    pairs = (sample[r], c, truth[r, c])
    _check_pairs(pairs, truth, sample, 0.3, sample[:, None])
    with pytest.raises(AssertionError, match="row 2"):
        _check_pairs((pairs[0][:-1], pairs[1][:-1], pairs[2][:-1]), truth, sample, 0.3,
                     sample[:, None])


@pytest.mark.parametrize("args, match", [(["--bits", "100"], "multiple of 8"),
                                         (["--n", "5", "--top-k", "5"], "below --n"),
                                         (["--threshold", "1.5"], "--threshold")])
def test_bad_options_are_refused_before_any_work(args, match):
    result = CliRunner().invoke(main, ["bench", "similarity", *args])
    assert result.exit_code == 2 and match in result.output


@pytest.mark.gpu
def test_on_the_gpu_ours_and_the_cupy_peer_run_and_agree(tmp_path):
    result = CliRunner().invoke(main, ["bench", "similarity", "--n", "20000", "--queries", "300",
                                       "--chunk-rows", "4096", "--peer-rows", "5000",
                                       "--repeat", "1", "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    # RDKit's, FPSim2's, FAISS's and nvMolKit's rows are skipped where they are not installed
    # (each says so); every other row runs, and every peer that runs agrees with the exact
    # results.
    optional = ("RDKit", "FPSim2", "FAISS", "nvMolKit")
    ours_and_cupy = "\n".join(line for line in result.output.splitlines()
                              if not any(peer in line for peer in optional))
    assert "WRONG" not in result.output and "skipped" not in ours_and_cupy, result.output
    for peer, module in [("FPSim2 CUDA", "FPSim2"), ("FAISS", "faiss"), ("nvMolKit", "nvmolkit")]:
        if importlib.util.find_spec(module) is not None:
            line = next(line for line in result.output.splitlines() if f"peer {peer}" in line)
            assert "not importable" not in line and "Error" not in line, line
    assert (tmp_path / "bench-similarity.json").exists()
    # One block in its parts, by each kernel with a selection epilogue.
    assert "one 4,096 x 4,096 block: fused top-10, its candidates kernel" in result.output
