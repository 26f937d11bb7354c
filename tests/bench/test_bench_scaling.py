"""The scaling bench: every row on clusters of each size, checked; its checks can fail."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from dask_gpuchunk.bench import scaling
from dask_gpuchunk.cli import main
from dask_gpuchunk.devices import gpu_available, gpu_count

SMALL = dict(rows=300, bits=520, chunk_rows=64, fingerprints=700, fingerprint_bits=256,
             fingerprint_chunk_rows=128, repeat=1)


@pytest.mark.slow  # two local clusters
def test_every_row_runs_on_each_size_and_passes_its_check(tmp_path):
    sizes = [1] if gpu_available() and gpu_count() < 2 else [1, 2]
    result = CliRunner().invoke(main, ["bench", "scaling", "--gpus", ",".join(map(str, sizes)),
                                       "--rows", "300", "--bits", "520", "--chunk-rows", "64",
                                       "--fingerprints", "700", "--repeat", "1", "--out-dir",
                                       str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "bench-scaling.json").read_text())
    entries = {e["name"]: e for e in report["entries"]}
    unit = "GPU" if gpu_available() else "CPU worker"
    for where in (f"1 {unit}", f"2 {unit}s")[:len(sizes)]:
        for row in (*scaling.GRAM_ROWS, scaling.FLOOR_ROW, scaling.TOP_K_ROW):
            e = entries[f"{row}, {where}"]
            if not gpu_available() and row in scaling.GRAM_ROWS[:2]:
                assert e["skipped"] == "no CUDA GPU visible"
                continue
            assert e["skipped"] is None and e["seconds"] > 0, e
            assert e["extra"]["speedup"] == pytest.approx(
                entries[f"{row}, 1 {unit}"]["seconds"] / e["seconds"])
    assert report["workload"]["sizes"] == sizes and "speed-up" in result.output
    assert report["workload"]["threads_per_gpu"] == "default"
    # What the workers did over each row: every compute of the .npy's Gram reads all of its
    # words (300 rows of 65 bytes) at least once, on some worker.
    for where in (f"1 {unit}", f"2 {unit}s")[:len(sizes)]:
        did = entries[f"{scaling.GRAM_ROWS[2]}, {where}"]["extra"]["workers_did"]
        assert did["words_read_bytes"] >= 300 * 65 * 3, did  # warm-up, the timed run, check
        assert did["retried_alone"] == 0 and did["spilled_bytes"] == 0, did
    assert "workers read" in result.output
    # The floor row runs the first timed Gram row's graph: its groups, over trivial words.
    first = entries[f"{scaling.GRAM_ROWS[0 if gpu_available() else 2]}, 1 {unit}"]["extra"]
    floor = entries[f"{scaling.FLOOR_ROW}, 1 {unit}"]["extra"]
    assert floor["groups"] == [-(-r // 64) for r in first["c_row_blocks"]]


@pytest.mark.slow  # a local cluster
def test_a_wrong_gram_or_top_k_is_reported_as_such(monkeypatch):
    right = scaling.gram_expectations
    monkeypatch.setattr(scaling, "gram_expectations",
                        lambda packed, sample: (right(packed, sample)[0] + 1,
                                                right(packed, sample)[1]))
    exact = scaling.tanimoto_rows

    def shuffled(words: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return exact(words, rows)[:, ::-1].copy()  # every row's scores on other columns

    monkeypatch.setattr(scaling, "tanimoto_rows", shuffled)
    right_floor = scaling.floor_total
    monkeypatch.setattr(scaling, "floor_total", lambda words: right_floor(words) - 1)
    report = scaling.run(gpus=[1], log=lambda line: None, **SMALL)
    skipped = {e["extra"].get("row", e["name"]): e["skipped"] for e in report["entries"]}
    assert skipped[scaling.GRAM_ROWS[2]].startswith("WRONG RESULT: sum of C")
    assert skipped[scaling.FLOOR_ROW].startswith("WRONG RESULT: sum of C")
    assert skipped[scaling.TOP_K_ROW].startswith("WRONG RESULT: top-k of row")


def test_threads_per_gpu_reaches_the_gpu_clusters_only():
    assert scaling._cluster_options(1, True, None, 4)["threads_per_gpu"] == 4
    assert "threads_per_gpu" not in scaling._cluster_options(1, True, None)
    assert "threads_per_gpu" not in scaling._cluster_options(2, False, None, "cores")


@pytest.mark.parametrize("args, match", [
    (["--gpus", "one"], "cluster sizes as 1,2,4"),
    (["--gpus", "0"], "must be positive"),
    (["--bits", "12"], "multiple of 8"),
    (["--fingerprints", "5", "--top-k", "5"], "below --fingerprints"),
    (["--gpus", "64"], "between 1 and"),
    (["--threads-per-gpu", "0"], "number of at least 1 or 'cores'"),
    (["--threads-per-gpu", "many"], "number of at least 1 or 'cores'"),
])
def test_bad_options_are_refused_before_any_work(args, match, tmp_path):
    if args == ["--gpus", "64"] and not gpu_available():
        args, match = ["--gpus", "64", "--rows", "0"], "must be positive"
    result = CliRunner().invoke(main, ["bench", "scaling", *args, "--out-dir", str(tmp_path)])
    assert result.exit_code == 2 and match in result.output, result.output
    assert not (tmp_path / "bench-scaling.json").exists()
