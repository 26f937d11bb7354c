"""Binary similarity from the exact bit-packed Gram: ``similarity``, dense, top-k or threshold.

Dense scores are :func:`dask_gpuchunk.gram`'s blocks (all pairs of ``x``: only blocks on or
above the diagonal computed, those below their transposes), or
:func:`dask_gpuchunk.gram.block_counts` of a row chunk of ``x`` with one of ``y`` (queries x
database), scored block by block. The rows' popcounts are computed once per input.

Top-k, where small graphs are listed (:func:`dask_gpuchunk.config.listed_graphs`): a chain of
*states* (each row's best ``k`` keys so far) per row chunk. A row chunk's first block (all
pairs: its diagonal block; queries: the first database chunk) is computed and selected the
plain way; then one task per further block updates the states of its row chunk and (all
pairs) of its column chunk, in rounds of disjoint chunk pairs (:func:`_round_robin`), so that a
round's tasks run at once and only states (``8 k`` bytes a row) move between them. On the 1-bit
tensor cores the block is selected in the kernel's epilogue against the states
(:mod:`dask_gpuchunk._kernels.bmma_select`; on Hopper, of the ``wgmma`` kernel:
:mod:`dask_gpuchunk._kernels.wgmma_select`): its counts never reach memory. Under dask's array
query planning, one task per block keeps its best keys, merged per row chunk on the host.

Threshold: one task per block on or above the diagonal keeps its pairs (for all pairs also
those of the transposed block), selected in the epilogue on the tensor cores, else from the
block's counts; a task per row chunk merges them on the host. Where graphs are listed, the
blocks of words from a ``.npy`` read their own chunks where they run, as the top-k chain's do.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import Any, NamedTuple

import dask
import dask.array as da
import numpy as np
from dask.array.core import PerformanceWarning
from dask.array.utils import meta_from_array
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph
from dask.task_spec import List, Task, TaskRef

from . import _compat
from ._kernels import bitpack as bits
from ._kernels import similarity as kernels
from ._kernels.similarity_cpu import best_keys_of_columns, best_keys_of_rows, pairs_at_least_cpu
from ._kernels.bmma_select import (
    FUSED_METHODS,
    PAIRS_FIRST_CAPACITY,
    compile_ahead,
    pairs_at_least_bmma,
    top_k_candidates,
    top_k_scratch_bytes,
)
from .arrays import asarray
from .backend import is_cupy, run_cpu_kernel
from .budget import check_fits, run_reserved, working_budget
from .config import listed_graphs
from ._kernels.gram import Method
from ._kernels.similarity import Metric
from .devices import Device, cluster_workers, gpu_available
from .fingerprint_files import bit_vectors_as_words
from .progress import blocks_done
from .gram import (
    block_counts,
    block_scratch_bytes,
    check_method,
    device_block_counts,
    device_block_scratch,
    MIN_ROW_GROUPS,
    gram,
    grouped_row_chunks,
    packed_words,
    resolve_method,
)
from .io import npy_reader_of, with_row_chunks
from .resident import ResidentSource, row_bounds, rows_where_it_runs, source_tasks

__all__ = ["GPU_BLOCK_ROWS", "METRICS", "MISSING_SCORE", "Neighbours", "Pairs", "block_bytes",
           "compile_selection_ahead", "grouped_for_gpu", "similarity"]

#: ``metric=`` values of :func:`similarity`.
METRICS = kernels.METRICS


_SHIFT, _LOW = np.uint64(32), np.uint64(0xFFFF_FFFF)


def _dense_block(c: Any, a: Any, b: Any, metric: str,
                 weights: tuple[float, float] = kernels.TANIMOTO_WEIGHTS) -> Any:
    return kernels.scores(c, a, b, metric, weights=weights)


#: Device bytes the scoring of a block allocates per pair at most (scores, their keys and the
#: selection's copies), reserved from the device budget while it runs.
SCORING_BYTES_PER_PAIR = 40


class _Selection(NamedTuple):
    """What each block keeps of its scores: the best ``k`` of each row (``k`` set) or the pairs
    meeting ``threshold``."""

    metric: str
    k: int | None
    threshold: Any
    exclude_self: bool
    weights: tuple[float, float] = kernels.TANIMOTO_WEIGHTS  # Tversky's alpha and beta

    def keep(self, s: Any, first_row: int, first_col: int, diagonal: bool) -> Any:
        excluded = (kernels.same_ids(s, first_row, first_col)
                    if self.exclude_self and diagonal else None)
        if self.k is None:
            return kernels.pairs_at_least(s, first_row, first_col, self.threshold,
                                          self.metric, excluded)
        keys = kernels.rank_keys(s, first_col, self.metric, excluded)
        return kernels.smallest_keys(keys, self.k)


def _moved_to_gpu(device: str, *arrays: Any) -> tuple[Any, ...]:
    """A selection block's inputs (words, popcounts, states; ``None`` kept) moved to this
    process's GPU where the block runs on one (``device`` not ``"cpu"``, a GPU here), else as
    they are. Host words then cross the bus (8 bytes a row per 64 bits) and what the block
    keeps comes back, a few bytes a row; staged the plain way, a block's counts came back
    instead, 4 bytes a pair (4 GiB for 32,768 x 32,768 rows), for the CPU to select from."""
    if (device == "cpu" or all(x is None or is_cupy(x) for x in arrays)
            or not gpu_available()):
        return arrays
    import cupy

    return tuple(None if x is None else cupy.asarray(x) for x in arrays)


def _scored_block(a: Any, b: Any, pop_a: Any, pop_b: Any, rows: Any, cols: Any,
                  selection: _Selection, both: bool, diagonal: bool, method: str, device: str,
                  symmetric: bool = False) -> tuple[Any, Any]:
    """The counts of one block (``a``'s rows against ``b``'s), scored and reduced to what
    ``selection`` keeps, for the block's rows and, with ``both``, for its columns too (the
    transposed block, below the diagonal of all pairs), on the host; the counts are gone when
    it returns. ``diagonal``: the block holds pairs of equal ids; ``symmetric``: ``b`` is
    ``a``."""
    # Rows and columns are consecutive ids (blocks of aranges): their first ones name them all,
    # and nothing is copied to the device for them.
    first_row, first_col = (int(ids[0]) if len(ids) else 0 for ids in (rows, cols))
    a, b, pop_a, pop_b = _moved_to_gpu(device, a, b, pop_a, pop_b)
    if not (is_cupy(a) and is_cupy(b)) or device == "cpu":
        # Host chunks where no GPU takes them (host words go to a GPU where there is one,
        # above): counts on the CPU, where its twin selects from them in one pass (no
        # scores, no keys of the whole block).
        counts = block_counts(a, b, method, device)
        exclude = selection.exclude_self and diagonal
        if selection.k is None:
            mine = pairs_at_least_cpu(counts, pop_a, pop_b, first_row, first_col,
                                      selection.metric, selection.threshold, exclude,
                                      run_cpu_kernel, selection.weights)
            return mine, (kernels.swapped_pairs(mine) if both else None)
        mine = best_keys_of_rows(counts, pop_a, pop_b, first_row, first_col, selection.metric,
                                 selection.k, exclude, run_cpu_kernel, selection.weights)
        theirs = (best_keys_of_columns(counts, pop_a, pop_b, first_row, first_col,
                                       selection.metric, selection.k, exclude, run_cpu_kernel,
                                       selection.weights)
                  if both else None)
        return mine, theirs
    mine, theirs = _device_selected(a, b, pop_a, pop_b, first_row, first_col, selection, both,
                                    diagonal, symmetric, method)
    # What a block keeps waits on the host for its row chunks' merges: kept on the device, the
    # blocks' best keys of 10**6 rows in 16,384-row chunks filled an 8 GiB card (4.9 GB, most of
    # it held until the last merges), where each block's counts need 2 GiB of it.
    mine = mine.get()
    if selection.k is None:  # a threshold's pairs: the transposed block's swapped, here
        return mine, (kernels.swapped_pairs(mine) if both else None)
    return mine, (None if theirs is None else theirs.get())


def _device_selected(a: Any, b: Any, pop_a: Any, pop_b: Any, first_row: int, first_col: int,
                     selection: _Selection, both: bool, diagonal: bool, symmetric: bool,
                     method: str) -> tuple[Any, Any]:
    """:func:`_scored_block` of CuPy blocks, what it keeps left on the device (a threshold's
    pairs for the rows only: the caller swaps them for the columns). A threshold on
    the 1-bit tensor cores is selected in the kernel's epilogue (no counts in memory); else
    the counts and their scoring hold their bytes of the device budget as one reservation
    (two, one waiting for the other, let every thread hold a block of counts while it waits:
    out of memory under a cap)."""
    exclude = selection.exclude_self and diagonal
    pairs = a.shape[0] * b.shape[0]
    what = f"a similarity block of {a.shape[0]} x {b.shape[0]} rows"
    if selection.metric in kernels.ASYMMETRIC_METRICS:  # no CUDA kernel scores it
        return _scored_on_arrays(a, b, pop_a, pop_b, first_row, first_col, selection, both,
                                 diagonal, method, what)
    fused_method = _selecting_method(method, "threshold")
    if selection.k is None and fused_method in FUSED_METHODS:
        def fused(capacity: int) -> tuple[Any, int]:
            found, count = pairs_at_least_bmma(bits.words64(a), bits.words64(b), pop_a, pop_b,
                                               first_row, first_col, selection.threshold,
                                               selection.metric, exclude, symmetric, capacity,
                                               method=fused_method)
            if found is None:
                return None, count
            if symmetric:  # the pairs below the diagonal are those above, swapped
                ids = found[:, 0]
                above = found[(ids >> _SHIFT) != (ids & _LOW)]
                found = kernels.sorted_pairs([found, kernels.swapped_pairs(above)])
            return (found, None), count

        # The pairs' buffer, their copies and the words' padded copies: room for the first
        # capacity, then (a block with more pairs) for all of them.
        scratch = device_block_scratch(a, b, method)
        capacity = PAIRS_FIRST_CAPACITY
        while True:
            kept, count = run_reserved(functools.partial(fused, capacity),
                                       capacity * 64 + scratch, what)
            if kept is not None:
                return kept
            capacity = count
    slice_bytes = _select_counts_bytes()
    if selection.k is None:
        step = _rows_per_slice(len(b), slice_bytes)

        def plain() -> tuple[Any, Any]:
            # A slice of a's rows at a time: the pairs come out in row order all the same.
            parts = [kernels.pairs_at_least_cuda(
                device_block_counts(a[start:start + step], b, method), pop_a[start:start + step],
                pop_b, first_row + start, first_col, selection.threshold, selection.metric,
                exclude) for start in range(0, len(a), step)]
            return (parts[0] if len(parts) == 1
                    else kernels._xp(parts[0]).concatenate(parts)), None

        return run_reserved(plain, min(len(a), step) * len(b) * 8
                            + device_block_scratch(a, b, method), what)
    if selection.k <= kernels.CUDA_TOP_K_MAX:
        def keys_of(targets: Any, others: Any, pop_t: Any, pop_o: Any, first_t: int,
                    first_o: int) -> Any:
            # The kernel reads each target's counts down a column, a thread a target: the
            # block of the others against the targets (a second Gram costs less than a
            # transposed copy), a slice of the others at a time, the slices' best keys merged
            # once at the end (a merge per slice cost two sorts each: 0.6 s of 2.6 s over
            # 10**6 rows in 32,768-row chunks). Slices of the targets instead left most of the
            # GPU idle: 2,048 threads each reading 32,768 counts.
            step = _rows_per_slice(len(targets), slice_bytes)
            parts = []
            for start in range(0, len(others), step):
                end = start + step
                counts = device_block_counts(others[start:end], targets, method)
                parts.append(kernels.best_keys_cuda(
                    counts, pop_o[start:end], pop_t, first_o + start, first_t, selection.k,
                    selection.metric, exclude, for_rows=False))
                del counts
            if len(parts) == 1:
                return parts[0]
            return kernels.smallest_keys(kernels._xp(parts[0]).concatenate(parts, axis=1),
                                         selection.k)

        def best() -> tuple[Any, Any]:
            theirs = None
            if both or symmetric:
                theirs = keys_of(b, a, pop_b, pop_a, first_col, first_row)
                if symmetric:  # a symmetric block's columns are its rows
                    return theirs, None
            return keys_of(a, b, pop_a, pop_b, first_row, first_col), theirs

        # The slices' keys (all of them before their merge) and its sort's copies.
        slices = -(-max(len(a), len(b)) // _rows_per_slice(min(len(a), len(b)), slice_bytes))
        kept = (a.shape[0] + b.shape[0]) * selection.k * 8 * (1 + 3 * slices)
        counts_bytes = (max(len(a), len(b))
                        * _rows_per_slice(max(len(a), len(b)), slice_bytes) * 4)
        return run_reserved(best, min(pairs * 4, counts_bytes) + kept
                            + device_block_scratch(a, b, method), what)

    return _scored_on_arrays(a, b, pop_a, pop_b, first_row, first_col, selection, both,
                             diagonal, method, what)


def _scored_on_arrays(a: Any, b: Any, pop_a: Any, pop_b: Any, first_row: int, first_col: int,
                      selection: _Selection, both: bool, diagonal: bool, method: str, what: str
                      ) -> tuple[Any, Any]:
    """:func:`_device_selected` through the block's counts and scores in device memory
    (top-k beyond the CUDA kernels' ``k``, and Tversky's scores), their bytes reserved."""
    def scored() -> tuple[Any, Any]:
        return _kept_from_scores(device_block_counts(a, b, method), pop_a, pop_b, first_row,
                                 first_col, selection, both, diagonal)

    return run_reserved(scored, a.shape[0] * b.shape[0] * (4 + SCORING_BYTES_PER_PAIR)
                        + device_block_scratch(a, b, method), what)


#: Device bytes of counts that one block holds at once on the plain path (a row chunk's first
#: block of all pairs, and other methods than bmma) at least: its top-k reads the block in
#: slices of a quarter of the working budget, never less than this, its threshold too. A whole
#: block of 32,768 x 32,768 rows holds 4 GiB, more than a small card's budget beside the
#: chunks' words.
SELECT_COUNTS_BYTES = 256 << 20


def compile_selection_ahead(method: str, top_k: int | None, threshold: Any,
                            metric: str = "tanimoto") -> Any:
    """On a GPU whose ``method`` resolves to the 1-bit tensor cores, start compiling the fused
    kernel a ``top_k`` or ``threshold`` selection by ``metric`` will run there, in a thread of
    its own (:func:`~dask_gpuchunk._kernels.bmma_select.compile_ahead`); return the thread, or
    ``None`` where no fused kernel will run."""
    if not gpu_available() or metric in kernels.ASYMMETRIC_METRICS:
        return None
    if top_k is not None and top_k <= kernels.CUDA_TOP_K_MAX:
        kind = "top_k"
    elif threshold is not None and top_k is None:
        kind = "threshold"
    else:
        return None
    fused_method = _selecting_method(method, kind)
    if fused_method not in FUSED_METHODS:
        return None
    return compile_ahead(kind, metric, method=fused_method)


def _select_counts_bytes() -> int:
    """Device bytes of counts a slice of the plain path holds on this device: a quarter of the
    working budget (room for four blocks at once), at least :data:`SELECT_COUNTS_BYTES`.
    Smaller slices cost time: in slices of 256 MiB, the first blocks of 10**6 rows in
    32,768-row chunks took 0.45 s more than whole (8 GiB cap, H200)."""
    return max(SELECT_COUNTS_BYTES, working_budget() // 4)


def _rows_per_slice(others: int, slice_bytes: int = SELECT_COUNTS_BYTES) -> int:
    """Rows whose counts against ``others`` rows fit ``slice_bytes``."""
    return max(1, slice_bytes // (4 * max(1, others)))


#: The selections (``"top_k"``, ``"threshold"``) that run in the epilogue of the ``wgmma``
#: kernel on Hopper; the others run bmma's there (kept to measure one beside the other).
WGMMA_SELECTIONS = frozenset({"top_k", "threshold"})


def _selecting_method(method: str, selection: str) -> str:
    """The method a ``"top_k"`` or ``"threshold"`` selection on a GPU runs: ``method``
    resolved (the fused selections are in the epilogues of :data:`FUSED_METHODS`' kernels),
    bmma's on Hopper for a selection not in :data:`WGMMA_SELECTIONS`."""
    resolved = resolve_method(method, on_gpu=True)
    return "bmma" if resolved == "wgmma" and selection not in WGMMA_SELECTIONS else resolved


def block_bytes(rows: int, words64: int, method: str, top_k: int | None = None,
                threshold: float | None = None, metric: str = "tanimoto") -> int:
    """Device bytes one block of :func:`similarity` on a GPU needs at once, in chunks of
    ``rows`` rows of ``words64`` 64-bit words by ``method`` (``"bmma"``, ``"int8"``,
    ``"popcount"``): both chunks' words, and the dense scores' counts and scores; or, with
    ``top_k`` or ``threshold``, what the selection allocates: the fused kernel's scratch
    (bmma), the plain path's slices of counts at their smallest (:data:`SELECT_COUNTS_BYTES`,
    larger where the budget has room; a row chunk's first top-k block, and every block of
    other methods), or beyond :data:`~dask_gpuchunk._kernels.similarity.CUDA_TOP_K_MAX` (and
    for Tversky's ``metric``) the block's scores and keys.

    Examples
    --------
    >>> block_bytes(32768, 32, "bmma", top_k=10) < 1 << 30
    True
    >>> block_bytes(32768, 32, "bmma") > 8 << 30  # dense: 8 bytes a pair
    True
    """
    words = 2 * rows * words64 * 8
    if top_k is None and threshold is None:
        return words + rows * rows * 8 + block_scratch_bytes(method, rows, rows, words64)
    if ((top_k is not None and top_k > kernels.CUDA_TOP_K_MAX)
            or metric in kernels.ASYMMETRIC_METRICS):
        return (words + rows * rows * (4 + SCORING_BYTES_PER_PAIR)
                + block_scratch_bytes(method, rows, rows, words64))
    step = min(rows, _rows_per_slice(rows))
    plain = step * rows * 8 + block_scratch_bytes(method, rows, step, words64)
    if top_k is not None:  # each slice's best keys, and their merge's copies
        plain += 2 * rows * top_k * 8 * (1 + 3 * -(-rows // step))
    fused_method = _selecting_method(method, "threshold" if top_k is None else "top_k")
    if fused_method not in FUSED_METHODS:
        return words + plain
    fused = (top_k_scratch_bytes(rows, rows, top_k, True, words64) if top_k is not None
             else PAIRS_FIRST_CAPACITY * 64 + block_scratch_bytes(fused_method, rows, rows,
                                                                   words64))
    return words + max(plain, fused)


def _kept_from_scores(counts: Any, pop_a: Any, pop_b: Any, first_row: int, first_col: int,
                      selection: _Selection, both: bool, diagonal: bool) -> tuple[Any, Any]:
    """What ``selection`` keeps of a block's counts through its scores in memory (the array
    path, NumPy or CuPy): for its rows and, with ``both``, its columns."""
    s = kernels.scores(counts, pop_a, pop_b, selection.metric, weights=selection.weights)
    mine = selection.keep(s, first_row, first_col, diagonal)
    if not both:
        return mine, None
    # Never Tversky's (its transposed block scores otherwise): similarity() selects it as
    # queries against themselves, blocks of rows only.
    if selection.k is None:  # a threshold's pairs of the transposed block: the same, swapped
        return mine, kernels.swapped_pairs(mine)
    return mine, selection.keep(s.T, first_col, first_row, diagonal)


def _upper_block(a: Any, b: Any, pop_a: Any, pop_b: Any, rows: Any, cols: Any,
                 selection: _Selection, method: str, device: str) -> tuple[Any, Any] | None:
    """:func:`_scored_block` of a block of all pairs on or above the diagonal, for both its
    rows and its columns (``None`` below the diagonal: its rows are the columns of a block
    above)."""
    if len(rows) and len(cols) and rows[0] > cols[0]:
        return None
    diagonal = len(rows) == len(cols) and (not len(rows) or rows[0] == cols[0])
    kept = _scored_block(a, b, pop_a, pop_b, rows, cols, selection, not diagonal, diagonal,
                         method, device, symmetric=diagonal)
    blocks_done()
    return kept


def _cross_block(a: Any, b: Any, pop_a: Any, pop_b: Any, rows: Any, cols: Any,
                 selection: _Selection, method: str, device: str) -> Any:
    """:func:`_scored_block` of queries ``a`` against a database chunk ``b``: for its rows."""
    diagonal = selection.exclude_self and _ids_meet(rows, cols)
    kept = _scored_block(a, b, pop_a, pop_b, rows, cols, selection, False, diagonal, method,
                         device)[0]
    blocks_done()
    return kept


def _ids_meet(rows: Any, cols: Any) -> bool:
    return bool(len(rows) and len(cols)) and not (rows[0] > cols[-1] or cols[0] > rows[-1])


# ---- top-k as a chain of states per row chunk ---------------------------------------------


def _state_of(previous: tuple, slot: int) -> Any:
    return previous[slot]


def _merged_state(state: Any, keys: Any) -> Any:
    xp = kernels._xp(state)
    return kernels.smallest_keys(xp.concatenate([state, keys], axis=1), state.shape[1])


def _first_state(a: Any, b: Any, pop_a: Any, pop_b: Any, first_a: int, first_b: int,
                 symmetric: bool, selection: _Selection, method: str, device: str) -> tuple:
    """The best keys of ``a``'s rows in their first block (against ``b``; ``symmetric``: ``b``
    is ``a``, the diagonal block of all pairs), by the plain path: ``(state,)``."""
    exclude = selection.exclude_self and (symmetric or _ids_meet(
        range(first_a, first_a + len(a)), range(first_b, first_b + len(b))))
    rows, cols = np.arange(first_a, first_a + len(a)), np.arange(first_b, first_b + len(b))
    a, b, pop_a, pop_b = _moved_to_gpu(device, a, b, pop_a, pop_b)
    if not (is_cupy(a) and is_cupy(b)) or device == "cpu":
        state = _scored_block(a, b, pop_a, pop_b, rows, cols, selection, False, exclude, method,
                              device)[0]
    else:
        state = _device_selected(a, b, pop_a, pop_b, first_a, first_b, selection, False, exclude,
                                 symmetric, method)[0]
    blocks_done()
    return (state,)


def _next_states(a: Any, b: Any, pop_a: Any, pop_b: Any, first_a: int, first_b: int,
                 previous_a: tuple, slot_a: int, previous_b: tuple | None, slot_b: int,
                 selection: _Selection, method: str, device: str) -> tuple:
    """The states of ``a``'s rows (and, with ``previous_b``, of ``b``'s rows: all pairs, a
    block above the diagonal) after their block: ``(state_a, state_b)``. On the 1-bit tensor
    cores, selected in the kernel's epilogue against the states so far
    (:func:`dask_gpuchunk._kernels.bmma_select.top_k_candidates`); where that cannot be used
    (another method, larger k, host chunks), the block's own best keys merged in."""
    state_a = previous_a[slot_a]
    state_b = None if previous_b is None else previous_b[slot_b]
    a, b, pop_a, pop_b, state_a, state_b = _moved_to_gpu(device, a, b, pop_a, pop_b, state_a,
                                                         state_b)
    both = state_b is not None
    exclude = selection.exclude_self and not both and _ids_meet(
        range(first_a, first_a + len(a)), range(first_b, first_b + len(b)))
    on_device = is_cupy(a) and is_cupy(b) and device != "cpu"
    fused_method = _selecting_method(method, "top_k") if on_device else None
    if (on_device and selection.k <= kernels.CUDA_TOP_K_MAX and fused_method in FUSED_METHODS
            and selection.metric not in kernels.ASYMMETRIC_METRICS):
        words64 = -(-a.shape[1] * a.dtype.itemsize // 8)
        return run_reserved(
            lambda: top_k_candidates(bits.words64(a), bits.words64(b), pop_a, pop_b, first_a,
                                     first_b, state_a, state_b, selection.metric, exclude,
                                     method=fused_method),
            top_k_scratch_bytes(len(a), len(b), selection.k, both, words64),
            f"a similarity block of {len(a)} x {len(b)} rows")
    if on_device:
        mine, theirs = _device_selected(a, b, pop_a, pop_b, first_a, first_b, selection, both,
                                        exclude, False, method)
    else:
        rows = np.arange(first_a, first_a + len(a))
        cols = np.arange(first_b, first_b + len(b))
        mine, theirs = _scored_block(a, b, pop_a, pop_b, rows, cols, selection, both, exclude,
                                     method, device)
    return (_merged_state(state_a, mine), _merged_state(state_b, theirs) if both else None)


#: Blocks of one round that one task of the top-k chain computes, one after the other, at
#: most, on GPUs. The distributed scheduler costs about a millisecond or two a task, as much as
#: the fused kernel takes for a block of 16,384 x 16,384 rows; a round of 62 chunks' 31 blocks
#: still makes four tasks, which one worker's threads run at once.
BLOCKS_PER_TASK = 8
#: The same on the CPU, where a block takes a tenth of a second or more: one a task, so that
#: progress bars counting tasks move with the work.
CPU_BLOCKS_PER_TASK = 1

#: Arguments of one block in a task of :func:`_next_states_of_blocks`.
_BLOCK_ARGS = 10


def _next_states_of_blocks(*args: Any, selection: _Selection, method: str, device: str
                           ) -> tuple:
    """:func:`_next_states` of several blocks (``_BLOCK_ARGS`` arguments each) with disjoint
    states, one after the other: ``(state_a, state_b)`` of each, flattened."""
    states: list[Any] = []
    for start in range(0, len(args), _BLOCK_ARGS):
        states += _next_states(*args[start:start + _BLOCK_ARGS], selection=selection,
                               method=method, device=device)
    blocks_done(len(args) // _BLOCK_ARGS)
    return tuple(states)


def _gathered(*states: tuple) -> tuple:
    """Every row chunk's first state (each a task's ``(state,)``), in one tuple: a chain's
    beginning."""
    return tuple(state[0] for state in states)


def _merged_chain_states(k: int, *refs: Any) -> Any:
    """One row chunk's states from several chains (``(previous, slot)`` pairs, flattened)
    merged: its ``k`` best keys over every block. Each chain began from the same first block,
    so its keys are in every state: a key twice is kept once."""
    states = [refs[i][refs[i + 1]] for i in range(0, len(refs), 2)]
    if any(is_cupy(s) for s in states):
        import cupy

        states = [cupy.asarray(s) for s in states]
    xp = kernels._xp(states[0])
    keys = xp.sort(xp.concatenate(states, axis=1), axis=1)
    keys[:, 1:][keys[:, 1:] == keys[:, :-1]] = kernels.NO_PAIR
    return kernels.smallest_keys(keys, k)


def _chains_for(workers: int, rounds: int) -> int:
    """Chains of the top-k over ``rounds`` rounds of blocks on a cluster of ``workers``: one
    per worker (each keeps its own states on its own device, merged once at the end), one on
    a single worker or process. One chain over two GPUs moved every state between them
    between rounds (1.2 GB a worker over TLS for 10**6 rows) and took twice as long as on one.

    Examples
    --------
    >>> _chains_for(1, 30), _chains_for(4, 30), _chains_for(4, 2), _chains_for(2, 0)
    (1, 4, 2, 1)
    """
    return max(1, min(workers, rounds))


def _round_robin(count: int) -> list[tuple[int, int]]:
    """Every pair ``i < j`` of ``count`` chunks once, in rounds where each chunk meets one
    other (the circle method): a round's blocks update disjoint states, so they run at once."""
    players = list(range(count)) + ([None] if count % 2 else [])
    size = len(players)
    order = []
    for _ in range(size - 1):
        for p in range(size // 2):
            i, j = players[p], players[size - 1 - p]
            if i is not None and j is not None:
                order.append((min(i, j), max(i, j)))
        players = [players[0], players[-1], *players[1:-1]]
    return order


def _resident_popcounts(source: ResidentSource, start: int, stop: int, device: str) -> Any:
    return _popcounts(rows_where_it_runs(source, start, stop, device))


def _chunk_refs(words: da.Array, pops: da.Array, device: str, dsk: dict, tag: str
                ) -> tuple[list[Any], list[Any], list[da.Array]]:
    """What a task of the top-k chain names for each row chunk's words and popcounts: the keys
    of ``words`` and ``pops``, or, for words straight from a ``.npy``
    (:func:`dask_gpuchunk.io.npy_reader_of`), tasks inside the task that read them where it
    runs (:func:`~dask_gpuchunk.resident.rows_where_it_runs`, through a source that ``dsk``
    gains): then no chunk of words is sent between workers. Last, the collections the names
    need (none for a ``.npy``)."""
    reader = npy_reader_of(words)
    if reader is None:
        keys = [(words.name, i, 0) for i in range(len(words.chunks[0]))]
        return ([TaskRef(key) for key in keys],
                [TaskRef((pops.name, i)) for i in range(len(words.chunks[0]))], [words, pops])
    entries, source_key = source_tasks(reader, tag)
    dsk.update(entries)
    bounds = row_bounds(words.chunks[0])
    source = TaskRef(source_key)
    return ([Task(None, rows_where_it_runs, source, a, b, device) for a, b in bounds],
            [Task(None, _resident_popcounts, source, a, b, device) for a, b in bounds], [])


def _chunk_refs_of_both(wx: da.Array, wy: da.Array, pop_x: da.Array, pop_y: da.Array,
                        device: str, dsk: dict, token: str) -> tuple[list, list, list, list, list]:
    """:func:`_chunk_refs` of ``x`` and of ``y`` (the same where ``wy`` is ``wx``): words and
    popcounts of each, then the collections they need."""
    words_x, pops_x, needs = _chunk_refs(wx, pop_x, device, dsk, f"x-{token}")
    if wy is wx:
        return words_x, pops_x, words_x, pops_x, needs
    words_y, pops_y, needs_y = _chunk_refs(wy, pop_y, device, dsk, f"y-{token}")
    return words_x, pops_x, words_y, pops_y, needs + needs_y


def _top_k_chain(wx: da.Array, wy: da.Array, pop_x: da.Array, pop_y: da.Array,
                 all_pairs: bool, selection: _Selection, method: str, device: str,
                 meta: Any) -> da.Array:
    """The best keys ``(n, k)`` of each row, listed by hand as a chain of states per row
    chunk: each row chunk's first block (all pairs: its diagonal block) by the plain path,
    then the further blocks, each updating the states of its row chunk and (all pairs) its
    column chunk (:func:`_next_states`), in rounds of disjoint chunk pairs, up to
    :data:`BLOCKS_PER_TASK` of a round in one task; what a block keeps never leaves the device
    that computed it, and only the states (``8 k`` bytes a row) move between tasks.

    On a cluster of several workers, a chain per worker (:func:`_chains_for`): chain ``c``
    begins from every first state, gathered by a task that distributed hands to a worker of
    its own (a data producer: a root task, which goes where a thread is free, not where its
    dependencies are), and takes the rounds ``r`` with ``r % chains == c``, which follow it
    there; a chunk's states of the chains merge at the end (:func:`_merged_chain_states`)."""
    k = selection.k
    chunks_x, chunks_y = len(wx.chunks[0]), len(wy.chunks[0])
    if all_pairs:  # rounds of disjoint chunk pairs
        order = _round_robin(chunks_x)
        per_round = max(chunks_x // 2, 1)
        rounds = [order[r:r + per_round] for r in range(0, len(order), per_round)]
    else:  # a round per database chunk: each query chunk's state once
        rounds = [[(i, j) for i in range(chunks_x)] for j in range(1, chunks_y)]
    chains = _chains_for(cluster_workers(), len(rounds))
    token = tokenize(wx, wy, selection, method, device, chains)
    name, first, begin, step = (f"similarity-top-k-{token}", f"similarity-first-{token}",
                                f"similarity-begin-{token}", f"similarity-step-{token}")
    starts_x = [start for start, _ in row_bounds(wx.chunks[0])]
    starts_y = [start for start, _ in row_bounds(wy.chunks[0])]
    opts = {"selection": selection, "method": method, "device": device}
    dsk: dict[Any, Any] = {}
    words_x, pops_x, words_y, pops_y, needs = _chunk_refs_of_both(wx, wy, pop_x, pop_y, device,
                                                                 dsk, token)
    # Read from a .npy, a first block's only dependency is the words' source: marked a data
    # producer, it goes to a worker with a free thread, not where the source was made.
    first_task = functools.partial(_first_state, **opts)
    for i in range(chunks_x):
        j = i if all_pairs else 0
        dsk[(first, i)] = Task((first, i), first_task, words_x[i], words_y[j], pops_x[i],
                               pops_y[j], starts_x[i], starts_y[j], all_pairs,
                               _data_producer=not needs)
    # latest[c][i]: the task and slot holding chain c's state of row chunk i so far.
    if chains == 1:
        latest = [{i: ((first, i), 0) for i in range(chunks_x)}]
    else:
        latest = []
        for c in range(chains):
            dsk[(begin, c)] = Task((begin, c), _gathered,
                                   *(TaskRef((first, i)) for i in range(chunks_x)),
                                   _data_producer=True)
            latest.append({i: ((begin, c), i) for i in range(chunks_x)})
    next_task = functools.partial(_next_states_of_blocks, **opts)
    per_task = (BLOCKS_PER_TASK if device != "cpu" and gpu_available()
                else CPU_BLOCKS_PER_TASK)
    for r, blocks in enumerate(rounds):
        held = latest[r % chains]
        tasks = -(-len(blocks) // per_task)
        for t in range(tasks):
            key = (step, r, t)
            args: list[Any] = []
            mine = blocks[t * len(blocks) // tasks:(t + 1) * len(blocks) // tasks]
            for i, j in mine:
                args += [words_x[i], words_y[j], pops_x[i], pops_y[j], starts_x[i],
                         starts_y[j], *_ref(held[i]), *_ref(held[j] if all_pairs else None)]
            dsk[key] = Task(key, next_task, *args)
            for b, (i, j) in enumerate(mine):
                held[i] = (key, 2 * b)
                if all_pairs:
                    held[j] = (key, 2 * b + 1)
    for i in range(chunks_x):
        key = (name, i, 0)
        if chains == 1:
            dsk[key] = Task(key, _state_of, *_ref(latest[0][i]))
        else:
            dsk[key] = Task(key, _merged_chain_states, k,
                            *(part for held in latest for part in _ref(held[i])))
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=needs)
    return da.Array(graph, name, (wx.chunks[0], (k,)), dtype=np.uint64, meta=meta)


def _threshold_pairs(wx: da.Array, wy: da.Array, pop_x: da.Array, pop_y: da.Array,
                     all_pairs: bool, selection: _Selection, method: str, device: str,
                     meta: Any) -> da.Array:
    """The pairs meeting ``selection``'s threshold of each row chunk ``(nan, 2)``, listed by
    hand: a task per block (all pairs: on or above the diagonal only) keeps its pairs
    (:func:`_upper_block`, :func:`_cross_block`), a task per row chunk merges them
    (:func:`_merged_pairs`). Words straight from a ``.npy`` are read by each block's own task
    where it runs (:func:`_chunk_refs`), each block then marked a data producer: through
    ``blockwise``, a task read each chunk and sent it to the blocks on other workers, which
    staged it to their GPU again for every block."""
    chunks_x, chunks_y = len(wx.chunks[0]), len(wy.chunks[0])
    token = tokenize(wx, wy, selection, method, device, "pairs")
    name, kept = f"similarity-pairs-{token}", f"similarity-kept-{token}"
    dsk: dict[Any, Any] = {}
    words_x, pops_x, words_y, pops_y, needs = _chunk_refs_of_both(wx, wy, pop_x, pop_y, device,
                                                                 dsk, token)
    ids_x = [range(a, b) for a, b in row_bounds(wx.chunks[0])]
    ids_y = [range(a, b) for a, b in row_bounds(wy.chunks[0])]
    block = functools.partial(_upper_block if all_pairs else _cross_block,
                              selection=selection, method=method, device=device)
    for i in range(chunks_x):
        for j in range(i if all_pairs else 0, chunks_y):
            dsk[(kept, i, j)] = Task((kept, i, j), block, words_x[i], words_y[j], pops_x[i],
                                     pops_y[j], ids_x[i], ids_y[j], _data_producer=not needs)
    for i in range(chunks_x):
        if all_pairs:  # the blocks right of the diagonal, and the transposed halves above it
            row_blocks = List(*(TaskRef((kept, i, j)) for j in range(i, chunks_x)))
            column_blocks: Any = List(*(TaskRef((kept, j, i)) for j in range(i)))
        else:
            row_blocks = List(*(TaskRef((kept, i, j)) for j in range(chunks_y)))
            column_blocks = None
        dsk[(name, i, 0)] = Task((name, i, 0), _merged_pairs, row_blocks, column_blocks)
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=needs)
    return da.Array(graph, name, ((np.nan,) * chunks_x, (2,)), dtype=np.uint64, meta=meta)


def _ref(held: tuple[Any, int] | None) -> tuple[Any, int]:
    """A state's ``(previous, slot)`` arguments: the task that holds it, or ``None``."""
    return (None, 0) if held is None else (TaskRef(held[0]), held[1])


def _row_parts(row_blocks: list[Any], column_blocks: list[Any] | None) -> list[Any]:
    """What the blocks of one row chunk kept: from its own blocks on or above the diagonal,
    and (all pairs) from the blocks above it in its column, their transposed halves."""
    if column_blocks is None:
        return list(row_blocks)
    parts = [block[0] for block in row_blocks if block is not None]
    parts += [block[1] for block in column_blocks if block is not None and block[1] is not None]
    return parts


def _merged_keys(row_blocks: list[Any], column_blocks: list[Any] | None = None, *, k: int
                 ) -> Any:
    parts = _row_parts(row_blocks, column_blocks)
    xp = kernels._xp(parts[0])
    return kernels.smallest_keys(xp.concatenate(parts, axis=1), k)


def _merged_pairs(row_blocks: list[Any], column_blocks: list[Any] | None = None) -> Any:
    return kernels.sorted_pairs(_row_parts(row_blocks, column_blocks))


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


def _popcounts(words: Any) -> Any:
    return kernels.row_popcounts(bits.words64(words))


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
            budget, workers = working_budget(), cluster_workers()
            wx = grouped_for_gpu(wx, words64, resolved, top_k, threshold, budget, workers,
                                 metric)
            wy = wx if y is None else grouped_for_gpu(wy, words64, resolved, top_k, threshold,
                                                      budget, workers, metric)
        rows = max(*wx.chunks[0], *wy.chunks[0], 0)
        check_fits(block_bytes(rows, words64, resolved, top_k, threshold, metric),
                   f"a similarity block of {rows} x {rows} rows of {words64 * 64} bits "
                   f"({resolved})", "fewer rows per chunk: chunks= of the rows, --chunk-rows")
    meta1 = meta_from_array(wx._meta, ndim=1, dtype=np.int32)
    pop_x = wx.map_blocks(_popcounts, drop_axis=1, dtype=np.int32, meta=meta1)
    pop_y = pop_x if y is None else wy.map_blocks(_popcounts, drop_axis=1, dtype=np.int32,
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
        return da.blockwise(_dense_block, "ij", counts, "ij", pop_x, "i", pop_y, "j",
                            metric=metric, weights=weights, dtype=dtype,
                            meta=meta_from_array(counts._meta, ndim=2, dtype=dtype))
    k = None if top_k is None else int(top_k)
    limit = None if threshold is None else _threshold_value(threshold, metric)
    # A top-k with a threshold selects the k best and masks those short of it afterwards:
    # the same blocks, exact.
    selection = _Selection(metric, k, limit if k is None else None, exclude_self, weights)
    meta2 = meta_from_array(wx._meta, ndim=2, dtype=np.uint64)
    on_device = is_cupy(wx._meta)
    if k is not None and listed_graphs():
        keys = _top_k_chain(wx, wy, pop_x, pop_y, all_pairs, selection, method, device, meta2)
        return _decoded(keys, on_device, metric, dtype, limit)
    if k is None and listed_graphs():
        return _pairs_parts(_threshold_pairs(wx, wy, pop_x, pop_y, all_pairs, selection,
                                             method, device, meta2), on_device, metric, dtype)
    rows = da.arange(n, chunks=(wx.chunks[0],), dtype=np.int64)
    cols = rows if y is None else da.arange(m, chunks=(wy.chunks[0],), dtype=np.int64)
    block = _upper_block if all_pairs else _cross_block
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
        keys = da.blockwise(_merged_keys, "it", kept, "ij", *mirrored, new_axes={"t": k},
                            concatenate=False, k=k, dtype=np.uint64, meta=meta2)
        return _decoded(keys, on_device, metric, dtype, limit)
    merged = da.blockwise(_merged_pairs, "ip", kept, "ij", *mirrored, new_axes={"p": 2},
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
