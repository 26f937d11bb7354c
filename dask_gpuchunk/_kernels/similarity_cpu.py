"""The CPU twin of the similarity selection: from one block of counts (the popcount kernel's
``int32`` block, :mod:`dask_gpuchunk._kernels.gram`), each row's or each column's best keys,
or the pairs meeting a threshold, in one numba pass that never builds the block's scores or
keys.

Scoring a 4,096 x 4,096 block of 2048-bit rows through NumPy (scores, keys, a partition, the
same again transposed) took 1.1 s on a 2-core machine whose popcount kernel counts the block in
0.03 s. Here each pair's score is computed where it is read, and only a candidate better than
its row's current k-th key is inserted into that row's sorted list.

Scores and keys are those of :mod:`dask_gpuchunk._kernels.similarity` to the bit: the same
float32 (cosine: float64) formulas on exact counts, a zero denominator read as 1, and a pair's
key ``rank << 32 | id`` with ``rank`` the score's bits from the top (lower-is-better hamming:
the distance itself).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .similarity import FLOAT_METRICS, METRIC_CODES, NO_PAIR, TANIMOTO_WEIGHTS, lower_is_better
from .source_cache import cached_njit

__all__ = ["best_keys_of_columns", "best_keys_of_rows", "pairs_at_least_cpu"]

#: How a kernel is called: ``launch(kernel, *args)``.
Launch = Callable[..., Any]
_COLUMNS_PER_TASK = 32  # columns one thread keeps lists for while it walks the rows


def _score_bits(c: int, pa: int, pb: int, metric: int, alpha: Any, beta: Any, fbuf: Any,
                ubuf: Any) -> int:
    """The score of a pair as ``uint32`` bits: a float32 score's own bits (their order is the
    scores' order: scores are never negative), an integer score's value. ``pa`` is the row's
    popcount (Tversky weighs what only it has by the float32 ``alpha``), ``pb`` the other's."""
    if metric == 3:  # hamming
        return np.uint32(pa + pb - 2 * c)
    if metric == 4:  # counts
        return np.uint32(c)
    if metric == 0:  # tanimoto
        den = pa + pb - c
        fbuf[0] = np.float32(c) / np.float32(den if den != 0 else 1)
    elif metric == 1:  # dice
        den = pa + pb
        fbuf[0] = np.float32(2 * c) / np.float32(den if den != 0 else 1)
    elif metric == 5:  # tversky, float32 products and sums left to right, as the array path
        fden = (np.float32(c) + alpha * np.float32(pa - c)) + beta * np.float32(pb - c)
        fbuf[0] = np.float32(c) / (fden if fden != np.float32(0) else np.float32(1))
    else:  # cosine, in float64 as the array path computes it
        root = np.sqrt(np.float64(pa) * np.float64(pb))
        fbuf[0] = np.float32(np.float64(c) / (root if root != 0.0 else 1.0))
    return ubuf[0]


def _key(bits: int, lower_better: bool, ident: int) -> np.uint64:
    rank = np.uint64(bits) if lower_better else np.uint64(0xFFFFFFFF) - np.uint64(bits)
    return (rank << np.uint64(32)) | np.uint64(ident)


def _insert(row: Any, key: np.uint64) -> None:
    """``key`` into the sorted list ``row``, its largest falling off."""
    p = row.shape[0] - 1
    while p > 0 and row[p - 1] > key:
        row[p] = row[p - 1]
        p -= 1
    row[p] = key


def _rows_kernel(counts: Any, pop_r: Any, pop_c: Any, first_col: int, metric: int,
                 alpha: Any, beta: Any, exclude: bool, shift: int, out: Any) -> None:
    r, m = counts.shape
    k = out.shape[1]
    lower = metric == 3
    for i in _prange(r):
        fbuf = np.empty(1, np.float32)
        ubuf = fbuf.view(np.uint32)
        row = out[i]
        row[:] = _NO_PAIR
        for j in range(m):
            if exclude and j == i + shift:
                continue
            key = _key_jit(_bits_jit(counts[i, j], pop_r[i], pop_c[j], metric, alpha, beta,
                                     fbuf, ubuf), lower, first_col + j)
            if key < row[k - 1]:
                _insert_jit(row, key)


def _columns_kernel(counts: Any, pop_r: Any, pop_c: Any, first_row: int, metric: int,
                    alpha: Any, beta: Any, exclude: bool, shift: int, out: Any) -> None:
    r, m = counts.shape
    lower = metric == 3
    groups = (m + _COLUMNS_PER_TASK - 1) // _COLUMNS_PER_TASK
    for g in _prange(groups):
        fbuf = np.empty(1, np.float32)
        ubuf = fbuf.view(np.uint32)
        j0 = g * _COLUMNS_PER_TASK
        j1 = min(m, j0 + _COLUMNS_PER_TASK)
        out[j0:j1] = _NO_PAIR
        k = out.shape[1]
        for i in range(r):  # a row of counts at a time: the block is read in order
            for j in range(j0, j1):
                if exclude and i == j + shift:
                    continue
                # The column is the pair's row here: its popcount first.
                key = _key_jit(_bits_jit(counts[i, j], pop_c[j], pop_r[i], metric, alpha, beta,
                                         fbuf, ubuf), lower, first_row + i)
                if key < out[j, k - 1]:
                    _insert_jit(out[j], key)


def _pairs_kernel(counts: Any, pop_r: Any, pop_c: Any, first_row: int, first_col: int,
                  metric: int, alpha: Any, beta: Any, limit: int, exclude: bool, shift: int,
                  found: Any, out: Any) -> None:
    """``out`` empty (0 rows): count each row's pairs into ``found``; else write them where
    ``found`` (the counts' exclusive prefix sums) says."""
    r, m = counts.shape
    lower = metric == 3
    counting = out.shape[0] == 0
    for i in _prange(r):
        fbuf = np.empty(1, np.float32)
        ubuf = fbuf.view(np.uint32)
        at = 0 if counting else found[i]
        for j in range(m):
            if exclude and j == i + shift:
                continue
            bits = _bits_jit(counts[i, j], pop_r[i], pop_c[j], metric, alpha, beta, fbuf, ubuf)
            if (bits <= limit) if lower else (bits >= limit):
                if not counting:
                    out[at, 0] = (np.uint64(first_row + i) << np.uint64(32)) | np.uint64(
                        first_col + j)
                    out[at, 1] = np.uint64(bits)
                at += 1
        if counting:
            found[i] = at


# numba is imported at first use, as everywhere in the package (importing it costs a second):
# the kernels above name these globals, which _kernel rebinds to numba's prange and to the
# compiled helpers before it compiles them (numba reads a global's value when it compiles).
_NO_PAIR = NO_PAIR
_prange = range
_bits_jit: Any = _score_bits
_key_jit: Any = _key
_insert_jit: Any = _insert
_compiled: dict[str, Any] = {}
_lock = threading.Lock()


def _kernel(name: str) -> Any:
    """The numba kernel ``name``, compiled at first use (cached on disk)."""
    with _lock:
        if not _compiled:
            import numba

            global _prange, _bits_jit, _key_jit, _insert_jit
            _prange = numba.prange
            _bits_jit = cached_njit(_score_bits)
            _key_jit = cached_njit(_key)
            _insert_jit = cached_njit(_insert)
            for fn in (_rows_kernel, _columns_kernel, _pairs_kernel):
                _compiled[fn.__name__] = cached_njit(fn, parallel=True)
        return _compiled[name]


def _plain_call(kernel: Callable[..., Any], *args: Any) -> Any:
    return kernel(*args)


def _prepared(counts: np.ndarray, pop_rows: Any, pop_cols: Any) -> tuple[Any, Any, Any]:
    r, m = counts.shape
    pop_rows = np.ascontiguousarray(pop_rows, dtype=np.int32)
    pop_cols = np.ascontiguousarray(pop_cols, dtype=np.int32)
    if pop_rows.shape != (r,) or pop_cols.shape != (m,):
        raise ValueError(f"popcounts of shapes {pop_rows.shape} and {pop_cols.shape} do not fit "
                         f"a block of {counts.shape} counts")
    return np.ascontiguousarray(counts, dtype=np.int32), pop_rows, pop_cols


def best_keys_of_rows(counts: np.ndarray, pop_rows: Any, pop_cols: Any, first_row: int,
                      first_col: int, metric: str, k: int, exclude_self: bool = False,
                      launch: Launch | None = None,
                      weights: tuple[float, float] = TANIMOTO_WEIGHTS) -> np.ndarray:
    """Each row's ``k`` best keys ``(r, k)`` in a block of ``counts`` ``(r, m)`` (rows
    ``first_row`` on, columns ``first_col`` on), sorted, :data:`NO_PAIR` where fewer;
    ``exclude_self``: a pair of equal ids is left out. ``launch(kernel, *args)`` calls the
    numba kernel (the chunk layer's ``run_cpu_kernel``, which shares the cores between
    threads); default: a plain call. ``weights``: Tversky's ``(alpha, beta)``.

    Examples
    --------
    >>> from dask_gpuchunk._kernels.similarity import decode_indices, decode_scores
    >>> c = np.array([[2, 0, 1], [1, 3, 0]], dtype=np.int32)
    >>> keys = best_keys_of_rows(c, [2, 3], [3, 3, 1], 0, 0, "tanimoto", 2)
    >>> decode_indices(keys), decode_scores(keys, "tanimoto")
    (array([[0, 2],
           [1, 0]]), array([[0.6666667, 0.5      ],
           [1.       , 0.2      ]], dtype=float32))
    """
    return _best_keys(False, counts, pop_rows, pop_cols, first_row, first_col, metric, k,
                      exclude_self, launch, weights)


def best_keys_of_columns(counts: np.ndarray, pop_rows: Any, pop_cols: Any, first_row: int,
                         first_col: int, metric: str, k: int, exclude_self: bool = False,
                         launch: Launch | None = None,
                         weights: tuple[float, float] = TANIMOTO_WEIGHTS) -> np.ndarray:
    """:func:`best_keys_of_rows` of the transposed block: each column's ``k`` best rows,
    ``(m, k)``, without a transposed copy (the column the pair's row: Tversky's ``alpha``
    weighs what only the column has)."""
    return _best_keys(True, counts, pop_rows, pop_cols, first_row, first_col, metric, k,
                      exclude_self, launch, weights)


def _best_keys(columns: bool, counts: np.ndarray, pop_rows: Any, pop_cols: Any,
               first_row: int, first_col: int, metric: str, k: int, exclude_self: bool,
               launch: Launch | None, weights: tuple[float, float]) -> np.ndarray:
    counts, pop_rows, pop_cols = _prepared(counts, pop_rows, pop_cols)
    out = np.empty((counts.shape[1 if columns else 0], k), dtype=np.uint64)
    launch = launch or _plain_call
    alpha, beta = (np.float32(w) for w in weights)
    if columns:  # the columns' candidates are rows: their ids from first_row
        launch(_kernel("_columns_kernel"), counts, pop_rows, pop_cols, first_row,
               METRIC_CODES[metric], alpha, beta, exclude_self, first_col - first_row, out)
    else:
        launch(_kernel("_rows_kernel"), counts, pop_rows, pop_cols, first_col,
               METRIC_CODES[metric], alpha, beta, exclude_self, first_row - first_col, out)
    return out


def pairs_at_least_cpu(counts: np.ndarray, pop_rows: Any, pop_cols: Any, first_row: int,
                       first_col: int, metric: str, threshold: Any, exclude_self: bool = False,
                       launch: Launch | None = None,
                       weights: tuple[float, float] = TANIMOTO_WEIGHTS) -> np.ndarray:
    """The pairs of a block of ``counts`` whose score meets ``threshold`` (at most it for
    hamming), as :func:`dask_gpuchunk._kernels.similarity.pairs_at_least` gives them: ``uint64``
    ``(p, 2)``, ``row << 32 | col`` and the score's bits, in row-then-column order. ``launch``
    and ``weights``: as for :func:`best_keys_of_rows`.

    Examples
    --------
    >>> c = np.array([[2, 0, 1], [1, 3, 0]], dtype=np.int32)
    >>> pairs = pairs_at_least_cpu(c, [2, 3], [3, 3, 1], 10, 20, "tanimoto", 0.5)
    >>> pairs[:, 0] >> np.uint64(32), pairs[:, 0] & np.uint64(0xFFFFFFFF)
    (array([10, 10, 11], dtype=uint64), array([20, 22, 21], dtype=uint64))
    """
    counts, pop_rows, pop_cols = _prepared(counts, pop_rows, pop_cols)
    code = METRIC_CODES[metric]
    alpha, beta = (np.float32(w) for w in weights)
    if metric in FLOAT_METRICS:  # float32 scores compared as their bits (never negative)
        limit = int(np.float32(max(float(threshold), 0.0)).view(np.uint32))
    elif lower_is_better(metric):  # an integer distance of at most the threshold
        limit = int(np.floor(threshold))
        if limit < 0:
            return np.empty((0, 2), dtype=np.uint64)
    else:  # integer counts of at least it
        limit = max(int(np.ceil(threshold)), 0)
    limit = min(limit, 0xFFFFFFFF)
    found = np.zeros(counts.shape[0], dtype=np.int64)
    kernel, launch = _kernel("_pairs_kernel"), launch or _plain_call
    shift = first_row - first_col
    launch(kernel, counts, pop_rows, pop_cols, first_row, first_col, code, alpha, beta, limit,
           exclude_self, shift, found, np.empty((0, 2), dtype=np.uint64))
    starts = np.concatenate([[0], np.cumsum(found)])
    out = np.empty((int(starts[-1]), 2), dtype=np.uint64)
    if len(out):
        launch(kernel, counts, pop_rows, pop_cols, first_row, first_col, code, alpha, beta,
               limit, exclude_self, shift, starts[:-1].copy(), out)
    return out
