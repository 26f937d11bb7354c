"""One block of a top-k or threshold similarity selection, as a task runs it: the counts of
two row chunks scored and reduced to what the selection keeps (each row's best keys, or the
pairs meeting a threshold), on the CPU from the counts in one numba pass, on a GPU in a Gram
kernel's epilogue (:mod:`dask_gpuchunk._kernels.bmma_select`,
:mod:`dask_gpuchunk._kernels.wgmma_select`) or, where none applies, through the block's scores
in device memory within the device budget; and the steps of the top-k chain (a row chunk's
first block, then the states each further block updates). The graphs that call them are
:mod:`dask_gpuchunk.bits.similarity_graphs`; the operator, :mod:`dask_gpuchunk.bits.similarity`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from .._kernels import bitpack as bits
from .._kernels import similarity as kernels
from .._kernels.bmma_select import (
    FUSED_METHODS,
    PAIRS_FIRST_CAPACITY,
    compile_ahead,
    pairs_at_least_bmma,
    top_k_candidates,
    top_k_scratch_bytes,
)
from .._kernels.top_k_overflow import REDONE_TARGETS, redo_overflows
from .._kernels.similarity_cpu import best_keys_of_columns, best_keys_of_rows, pairs_at_least_cpu
from ..runtime.backend import is_cupy, run_cpu_kernel, to_host
from ..runtime.budget import run_reserved, working_budget
from ..devices import gpu_available
from .gram import (
    block_counts,
    block_scratch_bytes,
    device_block_counts,
    device_block_scratch,
    resolve_method,
)
from ..progress import blocks_done

__all__ = ["BLOCK_ARGS", "CHUNK_ARGS", "SCORING_BYTES_PER_PAIR", "SEEDED_FIRST_ROWS",
           "SELECT_COUNTS_BYTES", "Selection", "WGMMA_SELECTIONS", "block_bytes", "chain_rounds",
           "compile_selection_ahead", "cross_block", "dense_block", "first_state", "gathered",
           "merged_chain_states", "next_states_of_blocks", "popcounts", "state_of", "upper_block"]

_SHIFT, _LOW = np.uint64(32), np.uint64(0xFFFF_FFFF)


def dense_block(c: Any, a: Any, b: Any, metric: str,
                 weights: tuple[float, float] = kernels.TANIMOTO_WEIGHTS) -> Any:
    return kernels.scores(c, a, b, metric, weights=weights)


#: Device bytes the scoring of a block allocates per pair at most (scores, their keys and the
#: selection's copies), reserved from the device budget while it runs.
SCORING_BYTES_PER_PAIR = 40


class Selection(NamedTuple):
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
                  selection: Selection, both: bool, diagonal: bool, method: str, device: str,
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
                     selection: Selection, both: bool, diagonal: bool, symmetric: bool,
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
                      selection: Selection, both: bool, diagonal: bool, method: str, what: str
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
                      selection: Selection, both: bool, diagonal: bool) -> tuple[Any, Any]:
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


def upper_block(a: Any, b: Any, pop_a: Any, pop_b: Any, rows: Any, cols: Any,
                 selection: Selection, method: str, device: str) -> tuple[Any, Any] | None:
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


def cross_block(a: Any, b: Any, pop_a: Any, pop_b: Any, rows: Any, cols: Any,
                 selection: Selection, method: str, device: str) -> Any:
    """:func:`_scored_block` of queries ``a`` against a database chunk ``b``: for its rows."""
    diagonal = selection.exclude_self and _ids_meet(rows, cols)
    kept = _scored_block(a, b, pop_a, pop_b, rows, cols, selection, False, diagonal, method,
                         device)[0]
    blocks_done()
    return kept


def _ids_meet(rows: Any, cols: Any) -> bool:
    return bool(len(rows) and len(cols)) and not (rows[0] > cols[-1] or cols[0] > rows[-1])


# ---- top-k as a chain of states per row chunk ---------------------------------------------


def state_of(previous: tuple, slot: int) -> Any:
    return previous[slot]


def _merged_state(state: Any, keys: Any) -> Any:
    xp = kernels._xp(state)
    return kernels.smallest_keys(xp.concatenate([state, keys], axis=1), state.shape[1])


def first_state(a: Any, b: Any, pop_a: Any, pop_b: Any, first_a: int, first_b: int,
                 symmetric: bool, selection: Selection, method: str, device: str) -> tuple:
    """The best keys of ``a``'s rows in their first block (against ``b``; ``symmetric``: ``b``
    is ``a``, the diagonal block of all pairs), by the plain path: ``(state,)``."""
    exclude = selection.exclude_self and (symmetric or _ids_meet(
        range(first_a, first_a + len(a)), range(first_b, first_b + len(b))))
    rows, cols = np.arange(first_a, first_a + len(a)), np.arange(first_b, first_b + len(b))
    a, b, pop_a, pop_b = _moved_to_gpu(device, a, b, pop_a, pop_b)
    fused_method = _fused_top_k_method(a, b, selection, method, device)
    if not (is_cupy(a) and is_cupy(b)) or device == "cpu":
        state = _scored_block(a, b, pop_a, pop_b, rows, cols, selection, False, exclude, method,
                              device)[0]
    elif symmetric and fused_method is not None and len(a) >= SEEDED_FIRST_ROWS:
        state = _seeded_first_state(a, pop_a, first_a, selection, method, fused_method)
    else:
        state = _device_selected(a, b, pop_a, pop_b, first_a, first_b, selection, False, exclude,
                                 symmetric, method)[0]
    blocks_done()
    return (state,)


#: Rows of a chunk from which its first state (its block against itself) is seeded: the best
#: keys against its first :data:`SEED_PART`, then the fused kernel against spans of the rest,
#: each at most :data:`SPAN_GROWTH` times the rows already seen, with :data:`FIRST_SLOTS`
#: candidate slots a row (about ``k * SPAN_GROWTH`` candidates a row; the data's tail has
#: rows with many more). 10**6 x 2048 bits, top-10, H200, against an eighth, spans of twice
#: and 64 slots: a 32,768-row chunk's first state 5.7-6.0 ms (6.3-8.1), a 16,384-row one's
#: 2.1-2.2 (2.2-3.2), the whole run 1.07 s (1.12) and 1.09 s (1.12-1.14). A floor from a
#: sample's 4th best and one pass of 256 slots instead: 14-28 ms, a tenth of the rows over
#: their slots (rows whose neighbours cluster).
SEEDED_FIRST_ROWS = 8192
SEED_PART = 16
SPAN_GROWTH = 8
FIRST_SLOTS = 512


def _seeded_first_state(a: Any, pop_a: Any, first: int, selection: Selection, method: str,
                        fused_method: str) -> Any:
    """The best keys of CuPy chunk ``a``'s rows among its own rows (themselves left out): a
    plain block against its first :data:`SEED_PART`, then the fused kernel's candidates from
    spans of the rest against the keys so far."""
    seen = max(1, len(a) // SEED_PART)
    state = _device_selected(a, a[:seen], pop_a, pop_a[:seen], first, first, selection, False,
                             True, False, method)[0]
    words = bits.words64(a)  # once: each span is a view of it
    while seen < len(a):
        span = words[seen:seen + SPAN_GROWTH * seen]
        state = run_reserved(
            functools.partial(top_k_candidates, words, span, pop_a,
                              pop_a[seen:seen + len(span)], first, first + seen, state, None,
                              selection.metric, selection.exclude_self, method=fused_method,
                              slots=FIRST_SLOTS),
            top_k_scratch_bytes(len(a), len(span), selection.k, False, words.shape[1],
                                slots=FIRST_SLOTS),
            f"a similarity block of {len(a)} x {len(span)} rows")[0]
        seen += len(span)
    return state


def _fused_top_k_method(a: Any, b: Any, selection: Selection, method: str, device: str
                        ) -> str | None:
    """The method whose kernel selects a top-k block of ``a`` against ``b`` in its epilogue
    (:func:`~dask_gpuchunk._kernels.bmma_select.top_k_candidates`), or ``None`` where that
    cannot be used (host chunks, another method, larger k, an asymmetric metric)."""
    if not (is_cupy(a) and is_cupy(b)) or device == "cpu":
        return None
    fused_method = _selecting_method(method, "top_k")
    if (selection.k is None or selection.k > kernels.CUDA_TOP_K_MAX
            or fused_method not in FUSED_METHODS
            or selection.metric in kernels.ASYMMETRIC_METRICS):
        return None
    return fused_method


def _next_states(a: Any, b: Any, pop_a: Any, pop_b: Any, first_a: int, first_b: int,
                 previous_a: tuple, slot_a: int, previous_b: tuple | None, slot_b: int,
                 selection: Selection, method: str, device: str,
                 overflows: list | None = None) -> tuple:
    """The states of ``a``'s rows (and, with ``previous_b``, of ``b``'s rows: all pairs, a
    block above the diagonal) after their block: ``(state_a, state_b)``. On the 1-bit tensor
    cores, selected in the kernel's epilogue against the states so far
    (:func:`dask_gpuchunk._kernels.bmma_select.top_k_candidates`); where that cannot be used
    (another method, larger k, host chunks), the block's own best keys merged in. Given a list
    ``overflows``, the fused path's targets over their slots are left to the caller
    (:func:`~dask_gpuchunk._kernels.top_k_overflow.redo_overflows`)."""
    state_a = previous_a[slot_a]
    state_b = None if previous_b is None else previous_b[slot_b]
    a, b, pop_a, pop_b, state_a, state_b = _moved_to_gpu(device, a, b, pop_a, pop_b, state_a,
                                                         state_b)
    both = state_b is not None
    exclude = selection.exclude_self and not both and _ids_meet(
        range(first_a, first_a + len(a)), range(first_b, first_b + len(b)))
    on_device = is_cupy(a) and is_cupy(b) and device != "cpu"
    fused_method = _fused_top_k_method(a, b, selection, method, device)
    if fused_method is not None:
        words64 = -(-a.shape[1] * a.dtype.itemsize // 8)
        return run_reserved(
            lambda: top_k_candidates(bits.words64(a), bits.words64(b), pop_a, pop_b, first_a,
                                     first_b, state_a, state_b, selection.metric, exclude,
                                     method=fused_method, overflows=overflows),
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


#: Arguments of one block in a task of :func:`next_states_of_blocks`.
BLOCK_ARGS = 10


def next_states_of_blocks(*args: Any, selection: Selection, method: str, device: str
                           ) -> tuple:
    """:func:`_next_states` of several blocks (``BLOCK_ARGS`` arguments each) with disjoint
    states, one after the other: ``(state_a, state_b)`` of each, flattened. The targets over
    their slots are redone once all the blocks are queued (their states are disjoint: no block
    reads another's), so that the host waits for the device once a task, not once a block:
    10**6 rows' top-10 in 32,768-row chunks waited 465 times."""
    states: list[Any] = []
    overflows: list[Any] = []
    for start in range(0, len(args), BLOCK_ARGS):
        states += _next_states(*args[start:start + BLOCK_ARGS], selection=selection,
                               method=method, device=device, overflows=overflows)
    if overflows:
        rows = max(max(len(side[0]), len(side[1])) for block in overflows
                   for side in block.sides)
        run_reserved(functools.partial(redo_overflows, overflows),
                     REDONE_TARGETS * rows * 40, "the top-k targets over their slots")
    blocks_done(len(args) // BLOCK_ARGS)
    return tuple(states)


#: Arguments of one row chunk in a task of :func:`chain_rounds`.
CHUNK_ARGS = 5


def chain_rounds(*args: Any, rounds: tuple, symmetric: bool, selection: Selection,
                 method: str, device: str, firsts: tuple = (), host_states: bool = False
                 ) -> tuple:
    """Consecutive rounds of one top-k chain in one task: ``args`` holds ``CHUNK_ARGS`` for
    each chunk taking part (words, popcounts, first row, and its state so far as ``previous,
    slot``; ``None, 0`` for a database chunk, which has none), ``rounds`` each round's
    blocks as pairs of places in that list. ``firsts``: pairs of places ``(a, b)`` whose
    chunk ``a`` begins its state here, by :func:`first_state` against ``b`` (itself: its
    diagonal block), before the rounds. Each round runs as a task of
    :func:`next_states_of_blocks` would, on the states the rounds before left; returns each
    chunk's last state (``None`` where it has none), in the order of ``args``: in host memory
    with ``host_states`` (where every row's state would not fit the device beside the
    work), each moved to the device by its first block of the next task."""
    chunks = [args[i:i + CHUNK_ARGS] for i in range(0, len(args), CHUNK_ARGS)]
    states = [None if previous is None else previous[slot]
              for _, _, _, previous, slot in chunks]
    for a, b in firsts:
        (words_a, pops_a, first_a), (words_b, pops_b, first_b) = chunks[a][:3], chunks[b][:3]
        states[a] = first_state(words_a, words_b, pops_a, pops_b, first_a, first_b, a == b,
                                selection=selection, method=method, device=device)[0]
    for blocks in rounds:
        call: list[Any] = []
        for a, b in blocks:
            words_a, pops_a, first_a = chunks[a][:3]
            words_b, pops_b, first_b = chunks[b][:3]
            call += [words_a, words_b, pops_a, pops_b, first_a, first_b, (states[a],), 0,
                     (states[b],) if symmetric else None, 0]
        done = next_states_of_blocks(*call, selection=selection, method=method, device=device)
        for place, (a, b) in enumerate(blocks):
            states[a] = done[2 * place]
            if symmetric:
                states[b] = done[2 * place + 1]
    if host_states:
        return tuple(None if state is None else to_host(state) for state in states)
    return tuple(states)


def gathered(*states: tuple) -> tuple:
    """Every row chunk's first state (each a task's ``(state,)``), in one tuple: a chain's
    beginning."""
    return tuple(state[0] for state in states)


def merged_chain_states(k: int, *refs: Any) -> Any:
    """One row chunk's states from several chains (``(previous, slot)`` pairs, flattened)
    merged: its ``k`` best keys over every block. Each chain began from the same first block,
    so its keys are in every state: a key twice is kept once."""
    states = [refs[i][refs[i + 1]] for i in range(0, len(refs), 2)]
    if any(is_cupy(s) for s in states):
        import cupy

        states = [cupy.asarray(s) for s in states]
    return kernels.merged_sorted_keys(states, k)


def popcounts(words: Any) -> Any:
    """The popcount of each row of a chunk of packed words (any unsigned dtype)."""
    return kernels.row_popcounts(bits.words64(words))
