"""Binary similarity from the exact bit-packed Gram: ``similarity``, dense, top-k or threshold.

Dense scores are :func:`dask_gpuchunk.gram`'s blocks (all pairs of ``x``: only blocks on or
above the diagonal computed, those below their transposes), or
:func:`dask_gpuchunk.bits.gram.block_counts` of a row chunk of ``x`` with one of ``y`` (queries x
database), scored block by block. The rows' popcounts are computed once per input.

Top-k, where small graphs are listed (:func:`dask_gpuchunk.config.listed_graphs`): a chain of
*states* (each row's best ``k`` keys so far) per row chunk. A row chunk's first block (all pairs:
its diagonal block; queries: the first database chunk) is computed and selected the plain way; then
one task per further block updates the states of its row chunk and (all pairs) of its column chunk,
in rounds of disjoint chunk pairs (:func:`dask_gpuchunk.bits.top_k_tiles.round_robin`), so
that a round's tasks run at once and only states (``8 k`` bytes a row) move between them. On the
1-bit tensor cores the block is selected in the kernel's epilogue against the states
(:mod:`dask_gpuchunk._kernels.bmma_select`; on Hopper, of the ``wgmma`` kernel:
:mod:`dask_gpuchunk._kernels.wgmma_select`): its counts never reach memory. Under dask's array query
planning, one task per block keeps its best keys, merged per row chunk on the host.

Threshold: one task per block on or above the diagonal keeps its pairs (for all pairs also
those of the transposed block), selected in the epilogue on the tensor cores, else from the
block's counts; a task per row chunk merges them on the host. Where graphs are listed, the
blocks of words from a ``.npy`` read their own chunks where they run, as the top-k chain's do.

This module is the operator (checks, chunking, and one graph); the listed graphs are
:mod:`dask_gpuchunk.bits.similarity_graphs`, and what each block's task runs
:mod:`dask_gpuchunk.bits.selection`.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, NamedTuple

import dask
import dask.array as da
import numpy as np
from dask.array.core import PerformanceWarning
from dask.array.utils import meta_from_array

from .. import _compat
from .._kernels import similarity as kernels
from .._kernels.gram import Method
from .._kernels.similarity import Metric
from ..arrays import asarray
from ..runtime.backend import is_cupy
from ..runtime.budget import check_fits_for_graph, graph_budget
from ..config import listed_graphs
from ..devices import Device, cluster_workers, gpu_available
from ..io.fingerprint_files import bit_vectors_as_words
from .gram import (
    MIN_ROW_GROUPS,
    block_counts,
    check_method,
    gram,
    grouped_row_chunks,
    packed_words,
    resolve_method,
)
from ..io import with_row_chunks
from .selection import (
    Selection,
    block_bytes,
    compile_selection_ahead,
    cross_block,
    dense_block,
    popcounts,
    upper_block,
)
from .similarity_graphs import merged_keys, merged_pairs, threshold_pairs, top_k_chain

__all__ = ["GPU_BLOCK_ROWS", "METRICS", "MISSING_SCORE", "Neighbours", "Pairs", "block_bytes",
           "compile_selection_ahead", "grouped_for_gpu", "similarity"]

__all__ = ["GPU_BLOCK_ROWS", "METRICS", "MISSING_SCORE", "Neighbours", "Pairs", "block_bytes",
           "compile_selection_ahead", "grouped_for_gpu", "similarity"]

#: ``metric=`` values of :func:`similarity`.
METRICS = kernels.METRICS


_SHIFT, _LOW = np.uint64(32), np.uint64(0xFFFF_FFFF)


#: Rows per chunk at most of a top-k or threshold selection on the CPU. 30,000 x 2,048-bit
#: fingerprints, top-10, on two cores: 3.9, 4.0, 4.3 and 3.9 s in chunks of 30,000, 8,192,
#: 4,096 and 2,048 rows.
CPU_BLOCK_ROWS = 4096


def _rechunked(words: da.Array, rows_at_most: dict[int, int]) -> da.Array:
    """``words`` with its rows whole (one chunk per row range) and, where ``rows_at_most``
    says, no row chunk larger than that (chunks already small enough are kept)."""
    if rows_at_most and max(words.chunks[0], default=0) > rows_at_most[0]:
        return words.rechunk({0: rows_at_most[0], 1: -1})
    return words.rechunk({1: -1})


#: Rows of a selection's blocks on a GPU that smaller row chunks are grouped up to
#: (:func:`grouped_for_gpu`). On an H200 (8 GiB cap), top-10 of 10^6 x 2048 bits on the device:
#: 2.07 s in 32,768-row chunks, 2.7 s in 16,384-row ones; the similarity job from a .npy on an
#: H100: 6.4 s against 8.3 s.
GPU_BLOCK_ROWS = 32768


def grouped_for_gpu(words: da.Array, words64: int, method: str, top_k: int | None,
                    threshold: Any, budget: int, workers: int = 1, metric: str = "tanimoto"
                    ) -> da.Array:
    """``words`` whose row chunks are smaller than :data:`GPU_BLOCK_ROWS` grouped up to it (or
    to the largest half of it whose selection block fits half of ``budget``: two run at once
    on a worker), keeping at least ``max(MIN_ROW_GROUPS, 2 * workers)`` groups for the
    chains' rounds; a :func:`dask_gpuchunk.from_npy` array stays one
    (:func:`dask_gpuchunk.io.with_row_chunks`), its chunks still read where the blocks run.
    Larger chunks are the caller's and kept.

    Examples
    --------
    >>> w = da.zeros((400000, 32), chunks=(8000, 32), dtype=np.uint64)
    >>> grouped_for_gpu(w, 32, "popcount", 10, None, budget=8 << 30).chunks[0][:3]
    (32000, 32000, 32000)
    >>> grouped_for_gpu(w, 32, "popcount", 10, None, budget=1) is w  # none would fit
    True
    >>> len(grouped_for_gpu(w[:40000], 32, "popcount", 10, None, budget=8 << 30).chunks[0])
    5
    """
    rows = max(words.chunks[0], default=0)
    groups = max(MIN_ROW_GROUPS, 2 * workers)
    target = min(GPU_BLOCK_ROWS, -(-words.shape[0] // groups))
    while target > rows and block_bytes(target, words64, method, top_k, threshold,
                                        metric) > budget // 2:
        target //= 2
    if target <= rows:
        return words
    return with_row_chunks(words, grouped_row_chunks(words.chunks[0], target))


def _check_choice(metric: str, top_k: Any, threshold: Any, candidates: int, width: int
                  ) -> None:
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(map(repr, METRICS))}; got "
                         f"{metric!r}")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            raise TypeError(f"top_k must be an integer; got {top_k!r}")
        if not 1 <= top_k <= candidates:
            raise ValueError(f"top_k must be between 1 and the {candidates:,} candidates of "
                             f"each row; got {top_k}")
    if threshold is not None:
        high = 1.0 if metric in kernels.FLOAT_METRICS else width
        if (isinstance(threshold, bool) or not isinstance(threshold, numbers.Real)
                or not 0 <= threshold <= high):
            raise ValueError(f"threshold for {metric} must be a number from 0 to {high}; got "
                             f"{threshold!r}")


def _tversky_weights(metric: str, alpha: float | None, beta: float | None
                     ) -> tuple[float, float]:
    """Tversky's ``(alpha, beta)`` as float32 values (``alpha`` 1 and ``beta`` ``alpha``
    unless given); for other metrics Tanimoto's, and neither may be given."""
    if metric != "tversky":
        if alpha is not None or beta is not None:
            raise ValueError(f"alpha and beta weigh metric='tversky' only; got metric={metric!r}")
        return kernels.TANIMOTO_WEIGHTS
    alpha = 1.0 if alpha is None else alpha
    beta = alpha if beta is None else beta
    for name, value in (("alpha", alpha), ("beta", beta)):
        if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                or not math.isfinite(value) or value < 0):
            raise ValueError(f"{name} must be a finite number of at least 0; got {value!r}")
    return float(np.float32(alpha)), float(np.float32(beta))


def _threshold_value(threshold: float, metric: str) -> Any:
    """The threshold as the scores are compared with it: float32 for the ratios (a pair's
    float32 score against ``float32(threshold)``), an integer bound for the counts."""
    if metric in kernels.FLOAT_METRICS:
        return np.float32(threshold)
    return np.int32(math.floor(threshold) if kernels.lower_is_better(metric)
                    else math.ceil(threshold))


def similarity(x: Any, y: Any = None, *, metric: Metric = "tanimoto", packed: bool = False,
               top_k: int | None = None, threshold: float | None = None,
               exclude_self: bool | None = None, method: Method = "auto",
               device: Device = "auto", alpha: float | None = None, beta: float | None = None
               ) -> Any:
    """Similarity of binary rows, exact, from the bit-packed Gram: all pairs of ``x``, or
    each row of ``x`` (queries) against each row of ``y`` (database).

    Parameters
    ----------
    x, y
        Dask, NumPy or CuPy arrays, as :func:`dask_gpuchunk.gram` takes them: 0/1 data
        ``(n, bits)`` of a bool or integer dtype, or with ``packed=True`` packed words of an
        unsigned dtype in any bit order, padding bits zero. Or lists of RDKit bit vectors
        (``ExplicitBitVect``), packed on the way. ``y=None``: all pairs of ``x``
        (only the blocks on or above the diagonal computed); else ``y`` has ``x``'s bits
        (``packed``: its dtype and width).
    metric
        ``"tanimoto"`` (= ``"jaccard"``), ``"dice"``, ``"cosine"``, ``"tversky"``,
        ``"hamming"`` or ``"counts"`` (the shared bits themselves); the formulas and the rule
        for empty rows are in :mod:`dask_gpuchunk._kernels.similarity` and the README.
    packed
        Whether ``x`` and ``y`` hold packed words.
    top_k
        Return each row's ``top_k`` best columns: ``(indices, scores)``, both ``(n, top_k)``
        (indices int64), best first (highest score; lowest for hamming), equal scores by the
        smaller index. With ``threshold`` too: the best ``top_k`` of those that meet it
        ("the 10 best above 0.7"), the places of the missing ones index ``-1`` and score
        :data:`MISSING_SCORE` of the metric's dtype (NaN; ``-1`` for hamming and counts).
    threshold
        Alone: return every pair whose score is at least ``threshold`` (at most, for
        hamming): ``(rows, cols, scores)``, three 1-D arrays in row-then-column order, of
        lengths known only once computed. Float metrics compare each float32 score with
        ``float32(threshold)``. Not under dask's array query planning (its arrays take no
        unknown lengths); with ``top_k``, it is.
    exclude_self
        Leave out pairs whose row and column indices are equal (default: ``True`` for all
        pairs, ``False`` for queries against a database); for top-k and threshold.
    method, device
        As for :func:`dask_gpuchunk.gram`.
    alpha, beta
        Tversky's weights (``metric="tversky"`` only): ``c / (c + alpha * (a - c) + beta *
        (b - c))`` with ``a`` the row's popcount and ``b`` the column's; ``alpha`` defaults
        to 1 and ``beta`` to ``alpha`` (1, 1: Tanimoto; 0.5, 0.5: Dice). A row's score
        against a column is not the column's against the row unless ``alpha == beta``: all
        pairs then score every block, not half (on a GPU, through the block's scores in
        memory, not a fused kernel).

    Returns
    -------
    dask.array.Array, Neighbours or Pairs
        Neither ``top_k`` nor ``threshold``: the dense scores ``(n, m)`` (float32; int32 for
        hamming and counts), chunked as the Gram. ``top_k``: :class:`Neighbours` ``(indices,
        scores)``; ``threshold`` alone: :class:`Pairs` ``(rows, cols, scores)``; named tuples
        of dask arrays whose ``.compute()`` computes them together, in one pass over the
        blocks (computing one and then another runs every block again). CuPy chunks for CuPy
        input.

    Raises
    ------
    ValueError
        An unknown metric, ``top_k`` below 1 or above the candidates of a row, a threshold
        outside the metric's range, inputs of different bit widths; at compute time, values
        other than 0 or 1.
    TypeError
        A non-integer ``top_k``, wrong dtypes for ``packed``.

    Examples
    --------
    >>> import numpy as np
    >>> fps = np.array([[1, 1, 0, 1], [1, 1, 0, 0], [0, 0, 1, 0]], dtype=np.uint8)
    >>> similarity(fps).compute()
    array([[1.       , 0.6666667, 0.       ],
           [0.6666667, 1.       , 0.       ],
           [0.       , 0.       , 1.       ]], dtype=float32)
    >>> indices, scores = similarity(fps, top_k=1).compute()
    >>> indices.ravel(), scores.ravel()
    (array([1, 0, 0]), array([0.6666667, 0.6666667, 0.       ], dtype=float32))
    >>> rows, cols, scores = similarity(fps, threshold=0.5).compute()
    >>> rows, cols
    (array([0, 1]), array([1, 0]))
    >>> similarity(fps, metric="tversky", alpha=0.9, beta=0.1).compute()[:2, :2]
    array([[1.       , 0.6896551],
           [0.952381 , 1.       ]], dtype=float32)
    """
    check_method(method, device)
    x, y, packed = bit_vectors_as_words(x, y, packed)
    x = asarray(x)
    y = None if y is None else asarray(y)
    wx = packed_words(x, packed, device, "similarity", "x")
    wy = wx if y is None else packed_words(y, packed, device, "similarity", "y")
    if y is not None and (wx.dtype != wy.dtype or wx.shape[1] != wy.shape[1]
                          or (not packed and x.shape[1] != y.shape[1])):
        what = "words of " if packed else "bits, as "
        raise ValueError(f"x and y must have the same bits: x has {x.shape[1]} {what}"
                         f"{x.dtype}, y {y.shape[1]} {what}{y.dtype}")
    exclude_self = (y is None) if exclude_self is None else bool(exclude_self)
    n, m = wx.shape[0], wy.shape[0]
    if max(n, m) >= 2**32:
        raise ValueError(f"at most 2**32 - 1 rows per input; got {max(n, m):,}")
    width = wx.shape[1] * wx.dtype.itemsize * 8 if packed else x.shape[1]
    _check_choice(metric, top_k, threshold, m - 1 if exclude_self else m, width)
    weights = _tversky_weights(metric, alpha, beta)
    # All pairs of an asymmetric metric: the rows against themselves as a database, every
    # block scored for its rows (the transposed half's scores are not the block's).
    all_pairs = y is None and metric not in kernels.ASYMMETRIC_METRICS
    if threshold is not None and top_k is None and _compat.is_array_expression(wx):
        raise NotImplementedError("similarity(threshold=) makes arrays of lengths known only "
                                  "once computed, which dask's array query planning does "
                                  "not take; turn it off (array.query-planning: False)")
    on_gpu = device != "cpu" and gpu_available()
    # Selections on the CPU in blocks of at most CPU_BLOCK_ROWS rows: as fast as larger ones,
    # and a progress bar then moves (a file read in one chunk was one task, done at the end).
    rows_at_most = {0: CPU_BLOCK_ROWS} if (top_k is not None or threshold is not None) and not \
        on_gpu else {}
    wx = _rechunked(wx, rows_at_most)
    wy = wx if y is None else _rechunked(wy, rows_at_most)
    if on_gpu:
        words64 = -(-wx.shape[1] * wx.dtype.itemsize // 8)
        resolved = resolve_method(method, on_gpu=True)
        if top_k is not None or threshold is not None:  # blocks of the GPU's size, ours
            budget, workers = graph_budget(), cluster_workers()
            wx = grouped_for_gpu(wx, words64, resolved, top_k, threshold, budget, workers,
                                 metric)
            wy = wx if y is None else grouped_for_gpu(wy, words64, resolved, top_k, threshold,
                                                      budget, workers, metric)
        rows = max(*wx.chunks[0], *wy.chunks[0], 0)
        check_fits_for_graph(block_bytes(rows, words64, resolved, top_k, threshold, metric),
                             f"a similarity block of {rows} x {rows} rows of {words64 * 64} "
                             f"bits ({resolved})",
                             "fewer rows per chunk: chunks= of the rows, --chunk-rows")
    meta1 = meta_from_array(wx._meta, ndim=1, dtype=np.int32)
    pop_x = wx.map_blocks(popcounts, drop_axis=1, dtype=np.int32, meta=meta1)
    pop_y = pop_x if y is None else wy.map_blocks(popcounts, drop_axis=1, dtype=np.int32,
                                                   meta=meta1)
    dtype = kernels.score_dtype(metric)
    if top_k is None and threshold is None:
        if y is None:
            # block_rows=1: the counts' blocks are the words' row chunks, as the popcounts'.
            counts = gram(wx, packed=True, method=method, device=device, block_rows=1)
        else:
            counts = da.blockwise(block_counts, "ij", wx, "ik", wy, "jk", concatenate=True,
                                  method=method, device=device, dtype=np.int32,
                                  meta=meta_from_array(wx._meta, ndim=2, dtype=np.int32))
        return da.blockwise(dense_block, "ij", counts, "ij", pop_x, "i", pop_y, "j",
                            metric=metric, weights=weights, dtype=dtype,
                            meta=meta_from_array(counts._meta, ndim=2, dtype=dtype))
    k = None if top_k is None else int(top_k)
    limit = None if threshold is None else _threshold_value(threshold, metric)
    # A top-k with a threshold selects the k best and masks those short of it afterwards:
    # the same blocks, exact.
    selection = Selection(metric, k, limit if k is None else None, exclude_self, weights)
    meta2 = meta_from_array(wx._meta, ndim=2, dtype=np.uint64)
    on_device = is_cupy(wx._meta)
    if k is not None and listed_graphs():
        keys = top_k_chain(wx, wy, pop_x, pop_y, all_pairs, selection, method, device, meta2)
        return _decoded(keys, on_device, metric, dtype, limit)
    if k is None and listed_graphs():
        return _pairs_parts(threshold_pairs(wx, wy, pop_x, pop_y, all_pairs, selection,
                                             method, device, meta2), on_device, metric, dtype)
    rows = da.arange(n, chunks=(wx.chunks[0],), dtype=np.int64)
    cols = rows if y is None else da.arange(m, chunks=(wy.chunks[0],), dtype=np.int64)
    block = upper_block if all_pairs else cross_block
    with warnings.catch_warnings():
        # A block per pair of chunks is the point: Dask's warning that the blockwise makes
        # many more chunks than its inputs have says nothing to the user here.
        warnings.simplefilter("ignore", PerformanceWarning)
        kept = da.blockwise(block, "ij", wx, "iw", wy, "jw", pop_x, "i", pop_y, "j", rows, "i",
                            cols, "j", concatenate=True, selection=selection, method=method,
                            device=device, dtype=np.uint64, meta=meta2)
    # Each row chunk's task merges what its blocks kept (and, for all pairs, the transposed
    # halves of the blocks above it in its column): lists of small arrays, never counts.
    mirrored = (kept, "ji") if all_pairs else ()
    if k is not None:
        keys = da.blockwise(merged_keys, "it", kept, "ij", *mirrored, new_axes={"t": k},
                            concatenate=False, k=k, dtype=np.uint64, meta=meta2)
        return _decoded(keys, on_device, metric, dtype, limit)
    merged = da.blockwise(merged_pairs, "ip", kept, "ij", *mirrored, new_axes={"p": 2},
                          adjust_chunks={"i": lambda _: np.nan}, concatenate=False,
                          dtype=np.uint64, meta=meta2)
    return _pairs_parts(merged, on_device, metric, dtype)


class Neighbours(NamedTuple):
    """Each row's best columns, ``(n, k)`` each, best first: what ``similarity(top_k=)``
    returns. ``.compute()`` computes both in one pass over the blocks (as
    ``dask.compute(*result)``); computing ``indices`` and then ``scores`` apart runs every
    block twice.

    Examples
    --------
    >>> import numpy as np
    >>> fps = np.array([[1, 1, 0, 1], [1, 1, 0, 0], [0, 0, 1, 0]], dtype=np.uint8)
    >>> found = similarity(fps, top_k=1).compute()
    >>> found.indices.ravel(), found.scores.ravel()
    (array([1, 0, 0]), array([0.6666667, 0.6666667, 0.       ], dtype=float32))
    """

    indices: Any
    scores: Any

    def compute(self, **kwargs: Any) -> Neighbours:
        """Both, computed together (``kwargs``: :func:`dask.compute`'s)."""
        return Neighbours(*dask.compute(*self, **kwargs))

    def persist(self, **kwargs: Any) -> Neighbours:
        """Both, persisted together (``kwargs``: :func:`dask.persist`'s)."""
        return Neighbours(*dask.persist(*self, **kwargs))


class Pairs(NamedTuple):
    """The pairs that meet a threshold, in row-then-column order: what
    ``similarity(threshold=)`` returns. ``.compute()`` computes the three in one pass over
    the blocks; computing them apart runs every block again for each."""

    rows: Any
    cols: Any
    scores: Any

    def compute(self, **kwargs: Any) -> Pairs:
        """The three, computed together (``kwargs``: :func:`dask.compute`'s)."""
        return Pairs(*dask.compute(*self, **kwargs))

    def persist(self, **kwargs: Any) -> Pairs:
        """The three, persisted together (``kwargs``: :func:`dask.persist`'s)."""
        return Pairs(*dask.persist(*self, **kwargs))


def _pairs_parts(merged: da.Array, on_device: bool, metric: str, dtype: np.dtype
                 ) -> Pairs:
    """``(rows, cols, scores)`` of the merged pairs ``(nan, 2)`` of each row chunk."""
    out = []
    for part, part_dtype in enumerate((np.int64, np.int64, dtype)):
        out.append(merged.map_blocks(_placed, _pair_part, on_device, part, metric,
                                     drop_axis=1, dtype=part_dtype,
                                     meta=meta_from_array(merged._meta, ndim=1,
                                                          dtype=part_dtype)))
    return Pairs(*out)


def _decoded(keys: da.Array, on_device: bool, metric: str, dtype: np.dtype,
             limit: Any = None) -> Neighbours:
    """``(indices, scores)`` of best keys ``(n, k)``; where ``limit`` is given, those that
    fall short of it masked (:func:`_indices_meeting`, :func:`_scores_meeting`)."""
    meta = keys._meta
    if limit is None:
        index_args: tuple[Any, ...] = (kernels.decode_indices, on_device)
        score_args: tuple[Any, ...] = (kernels.decode_scores, on_device, metric)
    else:
        index_args = (_indices_meeting, on_device, metric, limit)
        score_args = (_scores_meeting, on_device, metric, limit)
    indices = keys.map_blocks(_placed, *index_args, dtype=np.int64,
                              meta=meta_from_array(meta, ndim=2, dtype=np.int64))
    scores = keys.map_blocks(_placed, *score_args, dtype=dtype,
                             meta=meta_from_array(meta, ndim=2, dtype=dtype))
    return Neighbours(indices, scores)


#: What a top-k with a threshold puts in the place of a neighbour short of it, by the
#: metric's score dtype: index ``-1`` and this score.
MISSING_SCORE = {np.dtype(np.float32): np.float32("nan"), np.dtype(np.int32): np.int32(-1)}


def _meets(scores: Any, metric: str, limit: Any) -> Any:
    return scores <= limit if kernels.lower_is_better(metric) else scores >= limit


def _indices_meeting(keys: Any, metric: str, limit: Any) -> Any:
    """The column indices of best keys, ``-1`` where the score falls short of ``limit``."""
    indices = kernels.decode_indices(keys)
    indices[~_meets(kernels.decode_scores(keys, metric), metric, limit)] = -1
    return indices


def _scores_meeting(keys: Any, metric: str, limit: Any) -> Any:
    """The scores of best keys, :data:`MISSING_SCORE` where one falls short of ``limit``."""
    scores = kernels.decode_scores(keys, metric)
    scores[~_meets(scores, metric, limit)] = MISSING_SCORE[scores.dtype]
    return scores


def _placed(block: Any, decode: Any, on_device: bool, *args: Any) -> Any:
    """``decode(block, *args)`` as a CuPy array where the input was on the device (the merges
    ran on the host), else as a NumPy array."""
    out = decode(block, *args)
    if on_device and not is_cupy(out):
        import cupy

        return cupy.asarray(out)
    if not on_device and is_cupy(out):  # host words kept on a GPU (a .npy's): NumPy out
        return out.get()
    return out


def _pair_part(pairs: Any, part: int, metric: str) -> Any:
    return kernels.pair_rows_cols_scores(pairs, metric)[part]
