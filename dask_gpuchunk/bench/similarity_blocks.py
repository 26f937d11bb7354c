"""``bench similarity``'s block table: one block of the selection, timed in its parts, for
each GPU kernel with a selection epilogue (``wgmma`` on Hopper, ``bmma`` from Ampere on).

A top-k of ``n`` rows in ``r``-row chunks runs about ``n² / (2 r²)`` such blocks (46,665 for
10⁷ rows in 32,768-row chunks), so a block's time, times that, is most of a large job: this
table says where it goes (the counts written to memory, as the dense Gram does; the fused
top-k whole, and its candidates kernel alone; the fused threshold), each method beside the
other on the same words. The states are a block's best keys against a third chunk, as a
chain's second block finds them. Where no GPU is visible, or it has no such kernel, the
entries say so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .timing import Bench, Entry

__all__ = ["block_entries"]


def _fused_methods() -> list[str]:
    from .._kernels.bmma import bmma_supported
    from .._kernels.wgmma import wgmma_supported

    return (["wgmma"] if wgmma_supported() else []) + (["bmma"] if bmma_supported() else [])


def block_entries(bench: Bench, table: str, words: np.ndarray, rows: int, k: int,
                  threshold: float) -> None:
    """Time one ``rows`` x ``rows`` block of packed ``words`` (``uint8`` rows, at least
    ``3 * rows`` of them) in its parts, for every fused method this GPU has; each entry's
    ``extra`` holds the block's pairs."""
    label = f"one {rows:,} x {rows:,} block"
    if not bench.has_gpu:
        bench.timed(table, f"ours {label}: fused top-{k}", lambda: None, gpu=True)
        return
    if len(words) < 3 * rows:
        bench.add(Entry(table, f"ours {label}: fused top-{k}", "ours",
                        skipped=f"fewer than {3 * rows:,} rows for the block and its states"))
        return
    methods = _fused_methods()
    if not methods:
        bench.add(Entry(table, f"ours {label}: fused top-{k}", "ours", skipped="this GPU has "
                        "no 1-bit tensor cores (compute capability 8.0 or later)"))
        return
    import cupy

    from .._kernels import bmma_select
    from .._kernels import similarity as kernels
    from ..bits.gram import check_block_fits, device_block_counts
    from ..runtime.budget import DeviceBudgetError

    try:  # the states are made from the block's dense counts: 4 GiB at 32,768 rows
        check_block_fits(((rows,), (words.shape[1],)), words.dtype.itemsize, methods[-1])
    except DeviceBudgetError as exc:
        bench.add(Entry(table, f"ours {label}: fused top-{k}", "ours",
                        skipped=f"{type(exc).__name__}: {exc}".splitlines()[0][:300]))
        return
    w = cupy.asarray(np.ascontiguousarray(words[:3 * rows])).view(np.uint64)
    a, b, c = w[:rows], w[rows:2 * rows], w[2 * rows:]
    pops = kernels.row_popcounts(w)
    pop_a, pop_b, pop_c = pops[:rows], pops[rows:2 * rows], pops[2 * rows:]

    def state(targets: Any, pop_t: Any, first_t: int) -> Any:
        counts = device_block_counts(c, targets, methods[-1])
        return cupy.ascontiguousarray(kernels.best_keys_cuda(
            counts, pop_c, pop_t, 2 * rows, first_t, k, "tanimoto", False, for_rows=False))

    state_a, state_b = state(a, pop_a, 0), state(b, pop_b, rows)
    slots_a = cupy.empty((rows, bmma_select.SLOTS), dtype=np.uint64)
    slots_b = cupy.empty_like(slots_a)
    count_a = cupy.zeros(rows, dtype=np.int32)
    count_b = cupy.zeros(rows, dtype=np.int32)

    def synced(fn: Callable[[], Any]) -> Callable[[], None]:
        def once() -> None:
            fn()
            cupy.cuda.Device().synchronize()
        return once

    def zero_counts() -> None:
        count_a.fill(0)
        count_b.fill(0)
        cupy.cuda.Device().synchronize()

    for method in methods:
        parts = [
            (f"counts written to memory ({method})",
             synced(lambda m=method: device_block_counts(a, b, m)), None),
            (f"fused top-{k}, whole ({method})",
             synced(lambda m=method: bmma_select.top_k_candidates(
                 a, b, pop_a, pop_b, 0, rows, state_a, state_b, "tanimoto", False, method=m)),
             None),
            (f"fused top-{k}, its candidates kernel ({method})",
             synced(lambda m=method: bmma_select.launch_candidates(
                 a, b, pop_a, pop_b, 0, rows, state_a, state_b, True, "tanimoto", False,
                 slots_a, count_a, slots_b, count_b, method=m)), zero_counts),
            (f"fused threshold {threshold} ({method})",
             synced(lambda m=method: bmma_select.pairs_at_least_bmma(
                 a, b, pop_a, pop_b, 0, rows, np.float32(threshold), "tanimoto", False, False,
                 method=m)), None),
        ]
        for name, fn, setup in parts:
            e = bench.timed(table, f"ours {label}: {name}", fn, setup=setup)
            if e is not None:
                e.extra["pairs"] = float(rows) * rows
