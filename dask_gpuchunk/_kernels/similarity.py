"""Binary similarity scores from exact counts, and their best-first selection, on NumPy or CuPy.

With ``c`` the count of columns where both rows hold 1 (a Gram entry) and ``a``, ``b`` the two
rows' popcounts, the scores are, exactly as written (float32 arithmetic where it says so, each
operation correctly rounded, the same on the CPU and the GPU):

==============  ================================================  ================================
metric          score                                             when the denominator is 0
==============  ================================================  ================================
``tanimoto``    ``float32(c) / float32(a + b - c)``               0 (both rows empty)
``jaccard``     the same as ``tanimoto``                          0
``dice``        ``float32(2 * c) / float32(a + b)``               0 (both rows empty)
``cosine``      ``float32(c / sqrt(float64(a) * float64(b)))``    0 (either row empty)
``tversky``     ``float32(c) / d``, ``d = float32(c) + alpha *``    0
                ``float32(a - c) + beta * float32(b - c)``
                (``alpha``, ``beta`` float32, each product and
                sum rounded, left to right)
``hamming``     ``a + b - 2 * c`` (int32)                         -
``counts``      ``c`` (int32)                                     -
==============  ================================================  ================================

Tversky weighs what only the row has by ``alpha`` and what only the column has by ``beta``
(``alpha = beta = 1``: Tanimoto; ``0.5``: Dice): the one metric whose score of ``(i, j)`` is
not that of ``(j, i)`` unless ``alpha = beta``. It is scored on the array path and the CPU's
kernels only (:func:`cuda_metric_code` refuses it).

Empty rows score 0 against everything (an empty fingerprint says nothing, so it resembles
nothing), as RDKit and chemfp define it. Higher is better but for ``hamming``.

Selections work on ``uint64`` keys that sort best first: the score's rank in the high 32 bits
(the bits of a non-negative float32 order as its values), the column in the low 32, so that
equal scores order by the smaller column; excluded pairs get :data:`NO_PAIR`, which sorts last.
"""

from __future__ import annotations

import weakref
from typing import Any, Literal, get_args

import numpy as np

from .compiled import compiled_once

__all__ = ["ASYMMETRIC_METRICS", "COUNTED_POPCOUNTS", "CUDA_TOP_K_MAX", "FLOAT_METRICS", "METRICS",
           "METRIC_CODES", "Metric", "NO_PAIR", "RANK_SOURCE", "TANIMOTO_WEIGHTS",
           "cuda_metric_code", "best_keys_cuda", "decode_indices", "decode_scores",
           "kept_popcount_order", "merged_sorted_keys", "pairs_at_least_cuda", "popcount_order",
           "rank_limit",
           "same_ids", "swapped_pairs", "lower_is_better", "pair_rows_cols_scores",
           "pairs_at_least", "rank_keys", "row_popcounts", "score_dtype", "scores",
           "smallest_keys", "sorted_pairs"]

#: ``metric=`` values.
Metric = Literal["tanimoto", "jaccard", "dice", "cosine", "tversky", "hamming", "counts"]
METRICS: tuple[str, ...] = get_args(Metric)
#: Metrics whose scores are float32 in [0, 1].
FLOAT_METRICS = ("tanimoto", "jaccard", "dice", "cosine", "tversky")
#: Metrics whose score of a pair depends on which row is the row (``tversky``).
ASYMMETRIC_METRICS = ("tversky",)
#: The weights of a Tversky score that make it Tanimoto's (the default of ``alpha``, ``beta``).
TANIMOTO_WEIGHTS = (1.0, 1.0)
#: The key of an excluded pair (or of padding): sorts after every real pair.
NO_PAIR = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
_LOW = np.uint64(0xFFFF_FFFF)
_SHIFT = np.uint64(32)


def _xp(a: Any) -> Any:
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def score_dtype(metric: str) -> np.dtype:
    """float32 for the ratios, int32 for ``hamming`` and ``counts``."""
    return np.dtype(np.float32 if metric in FLOAT_METRICS else np.int32)


def lower_is_better(metric: str) -> bool:
    return metric == "hamming"


@compiled_once
def _popcount_kernel(device: int) -> Any:
    """The popcount kernel and its row sum, compiled on ``device`` by one thread: a job's
    first tasks all count popcounts at once, and CuPy compiled the same kernel in each of 16
    threads (2 s of a first job on an H100, against 0.15 s alone)."""
    import cupy

    kernel = cupy.ElementwiseKernel("uint64 w", "int32 c", "c = __popcll(w)",
                                    "dask_gpuchunk_popcount64")
    kernel(cupy.zeros((1, 1), dtype=np.uint64)).sum(axis=1, dtype=np.int32)
    return kernel


def row_popcounts(words64: Any) -> Any:
    """The popcount of each row of packed ``uint64`` words: ``int32`` ``(rows,)``, NumPy or CuPy
    as the input."""
    xp = _xp(words64)
    if xp is np:
        return np.bitwise_count(words64).sum(axis=1, dtype=np.int32)
    kernel = _popcount_kernel(xp.cuda.runtime.getDevice())
    return kernel(words64).sum(axis=1, dtype=np.int32)


def scores(c: Any, a: Any, b: Any, metric: str, pairwise: bool = False,
           weights: tuple[float, float] = TANIMOTO_WEIGHTS) -> Any:
    """The ``metric`` of counts ``c`` ``(r, m)`` with row popcounts ``a`` ``(r,)`` and column
    popcounts ``b`` ``(m,)``, by the formulas of this module's table; ``pairwise``: ``c``,
    ``a`` and ``b`` of one shape, a pair each; ``weights``: Tversky's ``(alpha, beta)``.

    Examples
    --------
    >>> c = np.array([[2, 0], [1, 3]], dtype=np.int32)
    >>> scores(c, np.array([2, 3]), np.array([3, 3]), "tanimoto")
    array([[0.6666667, 0.       ],
           [0.2      , 1.       ]], dtype=float32)
    >>> scores(c, np.array([2, 3]), np.array([3, 3]), "hamming")
    array([[1, 5],
           [4, 0]], dtype=int32)
    >>> scores(c, np.array([2, 3]), np.array([3, 3]), "tversky", weights=(0.9, 0.1))
    array([[0.952381  , 0.        ],
           [0.33333334, 1.        ]], dtype=float32)
    """
    xp = _xp(c)
    a = xp.asarray(a, dtype=np.int32)
    b = xp.asarray(b, dtype=np.int32)
    if not pairwise:
        a, b = a[:, None], b[None, :]
    if metric == "counts":
        return c.astype(np.int32, copy=False)
    if metric == "hamming":
        return (a + b - 2 * c).astype(np.int32, copy=False)
    if metric in ("tanimoto", "jaccard"):
        num, den = c.astype(np.float32), (a + b - c).astype(np.float32)
    elif metric == "dice":
        num, den = (2 * c).astype(np.float32), (a + b).astype(np.float32)
    elif metric == "cosine":
        num = c.astype(np.float64)
        den = xp.sqrt(a.astype(np.float64) * b.astype(np.float64))
    elif metric == "tversky":
        alpha, beta = (np.float32(w) for w in weights)
        num = c.astype(np.float32)
        den = (num + alpha * (a - c).astype(np.float32)) + beta * (b - c).astype(np.float32)
    else:
        raise ValueError(f"unknown metric {metric!r}")
    # A zero denominator comes with c = 0: 0 / 1 gives the defined 0.
    out = num / xp.where(den == 0, den.dtype.type(1), den)
    return out.astype(np.float32, copy=False)


def rank_keys(s: Any, first_col: int, metric: str, excluded: Any = None) -> Any:
    """``uint64`` keys of scores ``s`` ``(r, m)`` of columns ``first_col`` on that sort best
    first, ties by the smaller column; ``excluded`` (a boolean mask) gets :data:`NO_PAIR`."""
    xp = _xp(s)
    cols = xp.arange(first_col, first_col + s.shape[1], dtype=np.uint64)
    if s.dtype == np.float32:
        rank = _LOW - s.view(np.uint32).astype(np.uint64)  # non-negative floats: bits order
    elif lower_is_better(metric):
        rank = s.astype(np.uint64)
    else:
        rank = _LOW - s.astype(np.uint64)
    keys = (rank << _SHIFT) | cols[None, :]
    if excluded is not None:
        keys[excluded] = NO_PAIR
    return keys


def smallest_keys(keys: Any, k: int) -> Any:
    """The ``k`` smallest keys of each row, sorted (padded with :data:`NO_PAIR` where a row
    has fewer)."""
    xp = _xp(keys)
    if keys.shape[1] > k:
        keys = xp.partition(keys, k - 1, axis=1)[:, :k]
    keys = xp.sort(keys, axis=1)
    if keys.shape[1] < k:
        pad = xp.full((keys.shape[0], k - keys.shape[1]), NO_PAIR, dtype=np.uint64)
        keys = xp.concatenate([keys, pad], axis=1)
    return keys


_MERGE_KEYS_SOURCE = r"""
extern "C" __global__ void dask_gpuchunk_merge_keys(
        const unsigned long long* a, const unsigned long long* b, long long rows, int k,
        unsigned long long* out) {
    const unsigned long long none = 0xFFFFFFFFFFFFFFFFull;
    long long row = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (row >= rows) return;
    const unsigned long long* x = a + row * k;
    const unsigned long long* y = b + row * k;
    unsigned long long* z = out + row * k;
    int i = 0, j = 0, o = 0;
    unsigned long long last = none;
    while (o < k) {
        unsigned long long u = i < k ? x[i] : none, v = j < k ? y[j] : none;
        unsigned long long m = u < v ? u : v;
        if (m == none) break;
        if (u == m) ++i;
        if (v == m) ++j;  // the same pair in both: kept once
        if (m != last) { z[o++] = m; last = m; }
    }
    for (; o < k; ++o) z[o] = none;
}
"""


@compiled_once
def _merge_keys_kernel(device: int) -> Any:
    """The kernel of :func:`merged_sorted_keys`, compiled on ``device`` by one thread: a
    cluster's chains end in one merge task per row chunk, all at once in every thread."""
    import cupy

    return cupy.RawKernel(_MERGE_KEYS_SOURCE, "dask_gpuchunk_merge_keys")


def merged_sorted_keys(states: list[Any], k: int) -> Any:
    """The ``k`` smallest distinct keys of each row over ``states``, arrays ``(n, k)`` of keys
    sorted along each row (padded with :data:`NO_PAIR`): sorted, padded likewise. A key in
    several states (the same pair) is kept once. On CuPy states, a merge of sorted rows, a
    thread a row, ``k`` steps: a sort of all the keys, then a partition, took 0.37 s a row
    chunk with a worker's 16 threads at them, the last 4.2 s of the 10**7-row top-10 on two
    H200s; merged so, 0.86 s.

    Examples
    --------
    >>> a = np.array([[1, 4, 9]], dtype=np.uint64)
    >>> b = np.array([[2, 4, NO_PAIR]], dtype=np.uint64)
    >>> merged_sorted_keys([a, b], 3).tolist()
    [[1, 2, 4]]
    """
    xp = _xp(states[0])
    if xp is np or any(state.shape[1] != k for state in states):
        keys = xp.sort(xp.concatenate(states, axis=1), axis=1)
        keys[:, 1:][keys[:, 1:] == keys[:, :-1]] = NO_PAIR
        return smallest_keys(keys, k)
    kernel = _merge_keys_kernel(xp.cuda.runtime.getDevice())
    merged = xp.ascontiguousarray(states[0], dtype=np.uint64)
    rows = merged.shape[0]
    for other in states[1:]:
        out = xp.empty((rows, k), dtype=np.uint64)
        if rows:
            kernel((-(-rows // 256),), (256,),
                   (merged, xp.ascontiguousarray(other, dtype=np.uint64), np.int64(rows),
                    np.int32(k), out))
        merged = out
    return merged


def decode_indices(keys: Any) -> Any:
    """The columns of keys, int64."""
    return (keys & _LOW).astype(np.int64)


def decode_scores(keys: Any, metric: str) -> Any:
    """The scores of keys (:func:`rank_keys`), in the metric's dtype."""
    rank = keys >> _SHIFT
    if metric in FLOAT_METRICS:
        return (_LOW - rank).astype(np.uint32).view(np.float32)
    if lower_is_better(metric):
        return rank.astype(np.int32)
    return (_LOW - rank).astype(np.int32)


def same_ids(like: Any, first_row: int, first_col: int) -> Any:
    """The boolean mask of a block ``like`` ``(r, m)`` (rows ``first_row`` on, columns
    ``first_col`` on) where the row's id equals the column's; ``None`` where none does."""
    r, m = like.shape
    if not (r and m) or first_row >= first_col + m or first_col >= first_row + r:
        return None
    xp = _xp(like)
    return (xp.arange(first_row, first_row + r)[:, None]
            == xp.arange(first_col, first_col + m)[None, :])


def pairs_at_least(s: Any, first_row: int, first_col: int, threshold: Any, metric: str,
                   excluded: Any = None) -> Any:
    """The pairs of scores ``s`` ``(r, m)`` (rows ``first_row`` on, columns ``first_col`` on)
    that meet ``threshold`` (at least it; at most for ``hamming``), as ``uint64`` ``(p, 2)``:
    the key ``row << 32 | col``, and the score's bits."""
    xp = _xp(s)
    keep = s <= threshold if lower_is_better(metric) else s >= threshold
    if excluded is not None:
        keep &= ~excluded
    i, j = xp.nonzero(keep)
    out = xp.empty((i.shape[0], 2), dtype=np.uint64)
    out[:, 0] = ((i.astype(np.uint64) + np.uint64(first_row)) << _SHIFT) | (
        j.astype(np.uint64) + np.uint64(first_col))
    out[:, 1] = s[i, j].view(np.uint32).astype(np.uint64)
    return out


def sorted_pairs(parts: list[Any]) -> Any:
    """Pairs (:func:`pairs_at_least`) of several blocks joined, in row-then-column order."""
    if not parts:
        return np.empty((0, 2), dtype=np.uint64)
    xp = _xp(parts[0])
    joined = xp.concatenate(parts) if len(parts) > 1 else parts[0]
    return joined[xp.argsort(joined[:, 0])]  # keys are unique: any sort will do


def swapped_pairs(pairs: Any) -> Any:
    """Pairs (:func:`pairs_at_least`) with rows and columns exchanged (a block's transpose)."""
    out = pairs.copy()
    out[:, 0] = ((pairs[:, 0] & _LOW) << _SHIFT) | (pairs[:, 0] >> _SHIFT)
    return out


def rank_limit(threshold: Any, metric: str) -> int:
    """The largest rank (:func:`rank_keys`) of a score that meets ``threshold`` (as
    :func:`pairs_at_least` compares: float32 for the ratios, an integer bound else)."""
    if metric in FLOAT_METRICS:
        return int(_LOW) - int(np.float32(threshold).view(np.uint32))
    if lower_is_better(metric):
        return int(threshold)
    return int(_LOW) - int(threshold)


def pair_rows_cols_scores(pairs: Any, metric: str) -> tuple[Any, Any, Any]:
    """Rows (int64), columns (int64) and scores (the metric's dtype) of pairs."""
    rows = (pairs[:, 0] >> _SHIFT).astype(np.int64)
    cols = (pairs[:, 0] & _LOW).astype(np.int64)
    score = pairs[:, 1].astype(np.uint32).view(score_dtype(metric))
    return rows, cols, score


# ---- one pass over a block of counts on the GPU --------------------------------------------

#: The largest ``k`` that :func:`best_keys_cuda` keeps (each thread's best keys in its own
#: registers and local memory); larger ``k`` go through :func:`scores` and
#: :func:`smallest_keys`.
CUDA_TOP_K_MAX = 32

#: CUDA C++ of ``rank_of(c, a, b, metric)``: the rank of a score (:func:`rank_keys`).
RANK_SOURCE = r"""
__device__ __forceinline__ unsigned int rank_of(int c, int a, int b, int metric)
{
    // The score's rank (smaller is better), by the formulas of _kernels.similarity.
    if (metric == 0) {          // tanimoto: float32(c) / float32(a + b - c)
        const float den = (float)(a + b - c);
        return 0xFFFFFFFFu - __float_as_uint((float)c / (den == 0.0f ? 1.0f : den));
    }
    if (metric == 1) {          // dice: float32(2c) / float32(a + b)
        const float den = (float)(a + b);
        return 0xFFFFFFFFu - __float_as_uint((float)(2 * c) / (den == 0.0f ? 1.0f : den));
    }
    if (metric == 2) {          // cosine: float32(c / sqrt(float64(a) * float64(b)))
        const double den = sqrt((double)a * (double)b);
        return 0xFFFFFFFFu - __float_as_uint((float)((double)c / (den == 0.0 ? 1.0 : den)));
    }
    if (metric == 3) return (unsigned int)(a + b - 2 * c);   // hamming: lower is better
    return 0xFFFFFFFFu - (unsigned int)c;                     // counts
}
"""

_BEST_KEYS_SOURCE = RANK_SOURCE + r"""
extern "C" __global__ void best_keys(
    const int* __restrict__ counts, const int* __restrict__ pop_target,
    const int* __restrict__ pop_candidate, long long first_target, long long first_candidate,
    long long targets, long long candidates, int k, int metric, int exclude,
    unsigned long long* __restrict__ out)
{
    // counts: candidates x targets, row-major. A block holds 32 consecutive targets (x: reads
    // of a row coalesced) and blockDim.y slices of the candidates (y); each thread keeps the k
    // smallest keys (rank << 32 | candidate id, the formulas of _kernels.similarity) of its
    // slice, then the first slice merges the slices' lists through shared memory. Ids are
    // consecutive from first_target and first_candidate: no id array to copy.
    extern __shared__ unsigned long long lists[];
    const int lane = threadIdx.x, slice = threadIdx.y, slices = blockDim.y;
    const long long t = (long long)blockIdx.x * 32 + lane;
    unsigned long long best[MAX_K];
    for (int i = 0; i < k; ++i) best[i] = ~0ull;
    if (t < targets) {
        const int b = pop_target[t];
        const long long self = first_target + t;
        for (long long j = slice; j < candidates; j += slices) {
            const long long id = first_candidate + j;
            if (exclude && id == self) continue;
            const unsigned int rank = rank_of(counts[j * targets + t], pop_candidate[j], b,
                                              metric);
            const unsigned long long key = ((unsigned long long)rank << 32) | (unsigned int)id;
            if (key >= best[k - 1]) continue;
            int i = k - 1;
            while (i > 0 && best[i - 1] > key) { best[i] = best[i - 1]; --i; }
            best[i] = key;
        }
    }
    unsigned long long* mine = lists + ((long long)slice * 32 + lane) * k;
    for (int i = 0; i < k; ++i) mine[i] = best[i];
    __syncthreads();
    if (slice != 0 || t >= targets) return;
    int head[MAX_SLICES];
    for (int s = 0; s < slices; ++s) head[s] = 0;
    for (int i = 0; i < k; ++i) {
        int pick = 0;
        unsigned long long low = ~0ull;
        for (int s = 0; s < slices; ++s) {
            if (head[s] >= k) continue;
            const unsigned long long h = lists[((long long)s * 32 + lane) * k + head[s]];
            if (h < low) { low = h; pick = s; }
        }
        out[t * k + i] = low;
        head[pick] += 1;
    }
}
"""

#: Slices of the candidates per target in :func:`best_keys_cuda` (threads per target), at most.
_MAX_SLICES = 16
#: Shared memory a block of :func:`best_keys_cuda` may use for its lists.
_LIST_BYTES = 48 * 1024

_KEEP_SOURCE = "keep = rank_of(c, a, b, metric) <= limit;"
_keep_kernel: Any = None


def pairs_at_least_cuda(counts: Any, pop_rows: Any, pop_cols: Any, first_row: int,
                        first_col: int, threshold: Any, metric: str, exclude: bool) -> Any:
    """:func:`pairs_at_least` of a CuPy block of counts, the scores computed in one pass over
    it (a mask of the pairs that meet ``threshold``, by rank: :func:`rank_limit`) and again
    for those pairs only; pairs of equal ids left out where ``exclude``."""
    import cupy

    global _keep_kernel
    if _keep_kernel is None:
        _keep_kernel = cupy.ElementwiseKernel(
            "int32 c, int32 a, int32 b, uint32 limit, int32 metric", "bool keep", _KEEP_SOURCE,
            "dask_gpuchunk_similarity_keep", preamble=RANK_SOURCE)
    counts = cupy.asarray(counts, dtype=np.int32)
    pop_rows = cupy.asarray(pop_rows, dtype=np.int32)
    pop_cols = cupy.asarray(pop_cols, dtype=np.int32)
    keep = _keep_kernel(counts, pop_rows[:, None], pop_cols[None, :],
                        np.uint32(rank_limit(threshold, metric)),
                        np.int32(cuda_metric_code(metric)))
    excluded = same_ids(counts, first_row, first_col) if exclude else None
    if excluded is not None:
        keep &= ~excluded
    i, j = cupy.nonzero(keep)
    s = scores(counts[i, j], pop_rows[i], pop_cols[j], metric, pairwise=True)
    out = cupy.empty((i.shape[0], 2), dtype=np.uint64)
    out[:, 0] = ((i.astype(np.uint64) + np.uint64(first_row)) << _SHIFT) | (
        j.astype(np.uint64) + np.uint64(first_col))
    out[:, 1] = s.view(np.uint32).astype(np.uint64)
    return out


#: The ``metric`` argument of the kernels (Tversky's on the CPU only).
METRIC_CODES = {"tanimoto": 0, "jaccard": 0, "dice": 1, "cosine": 2, "hamming": 3,
                 "counts": 4, "tversky": 5}


def cuda_metric_code(metric: str) -> int:
    """The ``metric`` argument of the CUDA kernels (``rank_of``), which score every metric
    but Tversky's (scored on the array path on a GPU).

    Examples
    --------
    >>> cuda_metric_code("dice")
    1
    """
    if metric in ASYMMETRIC_METRICS:
        raise ValueError(f"the CUDA kernels do not score {metric!r}; it takes the array path")
    return METRIC_CODES[metric]


_best_keys_kernel: Any = None


def best_keys_cuda(counts: Any, pop_rows: Any, pop_cols: Any, first_row: int, first_col: int,
                   k: int, metric: str, exclude: bool, for_rows: bool) -> Any:
    """The ``k`` best keys (:func:`rank_keys`, sorted) of each row of a CuPy block of counts
    ``(r, m)`` over its columns (``for_rows``), or of each column over its rows, in one pass
    over the block on the current stream (no copy between host and device, so no wait; the
    rows' orientation reads a transposed copy of the block); row ``i`` has id
    ``first_row + i``, column ``j`` id ``first_col + j``, and pairs of equal ids are left out
    where ``exclude``. ``k`` at most :data:`CUDA_TOP_K_MAX`; rows or columns with fewer than
    ``k`` candidates are padded with :data:`NO_PAIR`. Scores equal :func:`scores` to the bit."""
    import cupy

    global _best_keys_kernel
    if _best_keys_kernel is None:
        _best_keys_kernel = cupy.RawKernel(
            _BEST_KEYS_SOURCE, "best_keys",
            options=(f"-DMAX_K={CUDA_TOP_K_MAX}", f"-DMAX_SLICES={_MAX_SLICES}"))
    if not 1 <= k <= CUDA_TOP_K_MAX:
        raise ValueError(f"k must be from 1 to {CUDA_TOP_K_MAX}; got {k}")
    pop_rows = cupy.ascontiguousarray(pop_rows, dtype=np.int32)
    pop_cols = cupy.ascontiguousarray(pop_cols, dtype=np.int32)
    if for_rows:  # the rows become the columns that the kernel reads across
        matrix = cupy.ascontiguousarray(cupy.asarray(counts, dtype=np.int32).T)
        pops, firsts = (pop_rows, pop_cols), (first_row, first_col)
    else:
        matrix = cupy.ascontiguousarray(counts, dtype=np.int32)
        pops, firsts = (pop_cols, pop_rows), (first_col, first_row)
    candidates, targets = matrix.shape
    out = cupy.empty((targets, k), dtype=np.uint64)
    if targets:
        slices = max(1, min(_MAX_SLICES, _LIST_BYTES // (32 * k * 8)))
        _best_keys_kernel(
            ((targets + 31) // 32,), (32, slices),
            (matrix, pops[0], pops[1], np.int64(firsts[0]), np.int64(firsts[1]),
             np.int64(targets), np.int64(candidates), np.int32(k),
             np.int32(cuda_metric_code(metric)), np.int32(bool(exclude)), out),
            shared_mem=slices * 32 * k * 8)
    return out


_POPCOUNT_ORDER_SOURCE = r"""
extern "C" __global__ void popcount_order(const int* __restrict__ pop, int n, int bins,
                                          int* __restrict__ order)
{
    // One block: a count of each popcount in shared memory, their running sum (each thread
    // sums a run of bins, the runs' sums scanned across the block: one thread summing 2,049
    // bins in turn took most of the kernel's time), then each row placed after the rows of
    // smaller popcounts (rows of one popcount in any order).
    extern __shared__ int next[];  // bins counts, then a sum per thread
    int* runs = next + bins;
    for (int v = threadIdx.x; v < bins; v += blockDim.x) next[v] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(next + pop[i], 1);
    __syncthreads();
    const int per = (bins + blockDim.x - 1) / blockDim.x;
    const int lo = threadIdx.x * per, hi = min(lo + per, bins);
    int sum = 0;
    for (int v = lo; v < hi; ++v) sum += next[v];
    runs[threadIdx.x] = sum;
    __syncthreads();
    for (int step = 1; step < blockDim.x; step <<= 1) {
        const int before = threadIdx.x >= step ? runs[threadIdx.x - step] : 0;
        __syncthreads();
        runs[threadIdx.x] += before;
        __syncthreads();
    }
    int start = runs[threadIdx.x] - sum;
    for (int v = lo; v < hi; ++v) { const int c = next[v]; next[v] = start; start += c; }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) order[atomicAdd(next + pop[i], 1)] = i;
}
"""

#: Popcounts up to which :func:`popcount_order` counts in shared memory (one int each); wider
#: rows are sorted by CuPy.
COUNTED_POPCOUNTS = 8192

_popcount_order_kernel: Any = None


def popcount_order(pop: Any, bits: int) -> Any:
    """The rows of CuPy ``int32`` popcounts ``pop`` (each at most ``bits``) in order of
    popcount, as ``int32`` indices (rows of one popcount in any order), on the current stream.
    A counting sort in one block where ``bits < COUNTED_POPCOUNTS``: tens of microseconds
    for 32,768 rows, where a sort's launches and scratch take more."""
    import cupy

    global _popcount_order_kernel
    n = pop.shape[0]
    if bits >= COUNTED_POPCOUNTS or n >= 1 << 31:
        return cupy.argsort(pop).astype(np.int32)
    if _popcount_order_kernel is None:
        _popcount_order_kernel = cupy.RawKernel(_POPCOUNT_ORDER_SOURCE, "popcount_order")
    order = cupy.empty(n, dtype=np.int32)
    if n:
        _popcount_order_kernel((1,), (_ORDER_THREADS,),
                               (cupy.ascontiguousarray(pop, dtype=np.int32), np.int32(n),
                                np.int32(bits + 1), order),
                               shared_mem=4 * (bits + 1 + _ORDER_THREADS))
    return order


_ORDER_THREADS = 1024
#: Each popcounts array's order while the array lives, by the array's id: its weak reference,
#: the bits, the order, the popcounts in that order and an event recorded after them.
_kept_orders: dict[int, tuple[Any, int, Any, Any, Any]] = {}


def kept_popcount_order(pop: Any, bits: int) -> tuple[Any, Any]:
    """:func:`popcount_order` of CuPy array ``pop`` and ``pop`` in that order (``int32``),
    made once while ``pop`` lives: the same array object given again returns the same arrays
    (the current stream waiting for them to be made). A top-k chain orders each chunk's rows
    for every block it takes part in: 930 one-block kernels and gathers for 10**6 rows in
    32,768-row chunks, where 31 do. Kept, they take 8 bytes a row of device memory beside the
    popcounts' 4, freed with them."""
    import cupy

    key = id(pop)
    kept = _kept_orders.get(key)
    if kept is not None and kept[0]() is pop and kept[1] == bits:
        cupy.cuda.get_current_stream().wait_event(kept[4])
        return kept[2], kept[3]
    order = popcount_order(pop, bits)
    in_order = cupy.ascontiguousarray(pop, dtype=np.int32)[order]
    made = cupy.cuda.Event(block=False, disable_timing=True)
    made.record()
    # Dropped when pop is freed (before its id can be another object's); the dict bound here,
    # not looked up, for frees at the interpreter's exit.
    _kept_orders[key] = (weakref.ref(pop, lambda _, key=key, kept=_kept_orders:
                                     kept.pop(key, None)), bits, order, in_order, made)
    return order, in_order
