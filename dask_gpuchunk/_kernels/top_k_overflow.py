"""The top-k candidates' overflow: the targets of a block of
:func:`~dask_gpuchunk._kernels.bmma_select.top_k_candidates` with more candidates than
:data:`~dask_gpuchunk._kernels.bmma_select.SLOTS` (ties with a state's last key from smaller
ids, as an empty row has with every row; ordered data) redone exactly from a Gram of those
targets against the block, so that the result never depends on the slots. Found by one scan
of the blocks' counts, which waits for the device: once a block, or once for several blocks
whose states are disjoint (a round of the chain in one task). No dask here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .bmma import bmma_cuda
from .similarity import rank_keys, scores, smallest_keys

__all__ = ["REDONE_TARGETS", "Overflow", "redo_overflows", "redone"]

class Overflow(NamedTuple):
    """What :func:`redo_overflows` needs of one block of
    :func:`~dask_gpuchunk._kernels.bmma_select.top_k_candidates`: each side's inputs (targets,
    others, their popcounts and first ids, old state) and candidate counts, its new state, its
    order (``None``: the caller's), the block's metric and exclusion, and the slots a target
    had. Never the slots themselves: a task of the 10**7-row chain queues 51 blocks, and their
    slots (32 MiB a block) held to its end filled an 8 GiB card."""

    sides: list[tuple]
    new_states: list[Any]
    orders: list[Any]
    metric: str
    exclude: bool
    slots: int


def redo_overflows(blocks: list[Overflow]) -> None:
    """Redo exactly (:func:`_redone`) the targets of ``blocks`` whose candidates overflowed
    their slots, in their new states; one wait for the device for all the blocks (their counts
    scanned at once; cupy.count_nonzero compiled a CUB reduction, ~12 s of a first job's 40 s
    on an H100)."""
    import cupy

    over = [side[-1] > block.slots for block in blocks for side in block.sides]
    if not over:
        return
    full = cupy.flatnonzero(cupy.concatenate(over))
    if not full.size:
        return
    redone["targets"] += int(full.size)
    full = cupy.asnumpy(full)
    start = 0
    for block in blocks:
        for side, state, order in zip(block.sides, block.new_states, block.orders):
            targets, others, pop_t, pop_o, first_t, first_o, old, count = side
            stop = start + count.shape[0]
            mine = full[(full >= start) & (full < stop)] - start
            start = stop
            if not mine.size:
                continue
            which = cupy.asarray(mine)
            if order is not None:  # in the caller's row order
                which = order[which]
            _redone(which, targets, others, pop_t, pop_o, first_t, first_o, old, state,
                    block.metric, block.exclude)


#: Targets whose candidates overflowed their slots and were redone (:func:`_redone`), in this
#: process.
redone = {"targets": 0}
#: Targets :func:`_redone` takes at a time (their counts, scores, keys and a sort's copies
#: against a block of 16,384 rows: 160 MiB).
REDONE_TARGETS = 256


def _redone(which: Any, targets: Any, others: Any, pop_t: Any, pop_o: Any, first_t: int,
            first_o: int, old: Any, new: Any, metric: str, exclude: bool) -> None:
    """Rows ``which`` of ``new``: their ``old`` state merged with their best keys against
    every row of ``others``, from their exact counts (a Gram of those targets only)."""
    import cupy

    k = old.shape[1]
    ids_o = cupy.arange(first_o, first_o + others.shape[0], dtype=np.int64)
    for start in range(0, which.shape[0], REDONE_TARGETS):
        part = which[start:start + REDONE_TARGETS]
        counts = cupy.empty((part.shape[0], others.shape[0]), dtype=np.int32)
        bmma_cuda(cupy.ascontiguousarray(targets[part]), others, counts,
                  cupy.cuda.get_current_stream().ptr)
        s = scores(counts, pop_t[part], pop_o, metric)
        excluded = (part[:, None] + first_t == ids_o[None, :]) if exclude else None
        keys = rank_keys(s, first_o, metric, excluded)
        new[part] = smallest_keys(cupy.concatenate([old[part], keys], axis=1), k)
