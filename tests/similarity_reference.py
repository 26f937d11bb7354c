"""Brute-force references the similarity tests compare with: each metric's formula on exact
counts, the top-k by a stable sort, the pairs over a threshold, test fingerprints with ties."""

from __future__ import annotations

import numpy as np
from helpers import bit_products, random_bits

__all__ = ["assert_pairs", "brute_top_k", "fingerprints", "reference",
           "top_k_of_a_npy_on_four_workers"]


def reference(x: np.ndarray, y: np.ndarray, metric: str, alpha: float = 1.0,
              beta: float = 1.0) -> np.ndarray:
    """The metric's formula (dask_gpuchunk._kernels.similarity) on exact int64 counts."""
    c = bit_products(x, y)
    a = x.sum(axis=1, dtype=np.int64)[:, None]
    b = y.sum(axis=1, dtype=np.int64)[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        if metric in ("tanimoto", "jaccard"):
            s = np.float32(c) / np.float32(a + b - c)
        elif metric == "dice":
            s = np.float32(2 * c) / np.float32(a + b)
        elif metric == "cosine":
            s = (c / np.sqrt(a.astype(np.float64) * b)).astype(np.float32)
        elif metric == "tversky":  # float32 products and sums, left to right
            fc = np.float32(c)
            den = (fc + np.float32(alpha) * np.float32(a - c)) + np.float32(beta) * np.float32(
                b - c)
            s = fc / den
        elif metric == "hamming":
            return (a + b - 2 * c).astype(np.int32)
        else:
            return c.astype(np.int32)
    return np.where(np.isnan(s), np.float32(0), s).astype(np.float32)


def brute_top_k(s: np.ndarray, k: int, lower: bool, exclude_self: bool):
    """Best first, equal scores by the smaller column (a stable sort by score)."""
    s = s.astype(np.float64)
    if exclude_self:
        np.fill_diagonal(s, np.inf if lower else -np.inf)
    order = np.argsort(s if lower else -s, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(s, order, axis=1)


def fingerprints(rng, n: int, bits: int) -> np.ndarray:
    """0/1 rows at ~10 % density, with repeated rows (ties) and two empty rows."""
    x = random_bits(rng, (n, bits), 0.1)
    x[3] = x[1]
    x[n - 2] = x[1]
    x[5] = 0
    x[n - 1] = 0
    return x


def assert_pairs(rows, cols, scores, s: np.ndarray, threshold: float, *, lower: bool = False,
                 exclude_self: bool = True) -> int:
    """The pairs of ``s`` scoring at least ``float32(threshold)`` (at most ``threshold``,
    ``lower``), in row-then-column order, the diagonal left out with ``exclude_self``, equal to
    ``rows``, ``cols`` and ``scores`` (NumPy or CuPy); returns how many there are."""
    keep = s <= threshold if lower else s >= np.float32(threshold)
    if exclude_self:
        np.fill_diagonal(keep, False)
    want_r, want_c = np.nonzero(keep)
    got = [a if isinstance(a, np.ndarray) else a.get() for a in (rows, cols, scores)]
    np.testing.assert_array_equal(got[0], want_r)
    np.testing.assert_array_equal(got[1], want_c)
    np.testing.assert_array_equal(got[2], s[want_r, want_c])
    return len(want_r)


def top_k_of_a_npy_on_four_workers(tmp_path, x, k: int, database=None, **options
                                   ) -> tuple[dict, dict]:
    """The top ``k`` of ``x`` saved packed to a ``.npy`` (all pairs, or against ``database``,
    saved the same way), on a cluster of four one-thread workers in this process without work
    stealing, checked against a brute force: where each task ran (key: worker) and the bytes
    each worker sent."""
    import dask
    from distributed import Client, LocalCluster, get_task_stream

    import dask_gpuchunk as dg
    from dask_gpuchunk.jobs import sent_by_workers

    np.save(tmp_path / "x.npy", np.packbits(x, axis=1))
    y = x if database is None else database
    want = brute_top_k(reference(x, y, "tanimoto"), k, False, database is None)
    if database is not None:
        np.save(tmp_path / "y.npy", np.packbits(database, axis=1))
    with dask.config.set({"distributed.scheduler.work-stealing": False}), \
            LocalCluster(n_workers=4, threads_per_worker=1, processes=False,
                         dashboard_address=None) as cluster, Client(cluster) as client:
        wx = dg.from_npy(tmp_path / "x.npy", chunks=(30, -1))
        wy = None if database is None else dg.from_npy(tmp_path / "y.npy", chunks=(30, -1))
        indices, scores = dg.similarity(wx, wy, packed=True, top_k=k, **options)
        before = sent_by_workers(client)
        with get_task_stream(client) as stream, dg.resolving_aliases():
            got = client.compute([indices, scores], sync=True)
        sent = sent_by_workers(client, before)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1].astype(np.float32))
    return {t["key"]: t["worker"] for t in stream.data}, sent
