"""dask_gpuchunk.jobs in this process: the CLI's multiply and gram jobs without the CLI.

tests/test_cli_jobs.py runs them through the command line, in processes with their own
clusters; these run in every CI job (that file only in the first: its processes take minutes).
"""

from __future__ import annotations

import numpy as np
from helpers import random_bits

from dask_gpuchunk.jobs import gram_files, multiply_files


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
    np.testing.assert_array_equal(np.load(tmp_path / "g.npy"), bits.astype(np.int64) @ bits.T)


def test_gram_on_the_cpu_holds_strips_not_the_output(rng, tmp_path):
    # NumPy's buffers are traced by tracemalloc: the peak is what the job held at once.
    import tracemalloc


    bits = random_bits(rng, (3001, 100), 0.4)
    np.save(tmp_path / "bits.npy", bits)
    expected = bits.astype(np.int64) @ bits.T
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
