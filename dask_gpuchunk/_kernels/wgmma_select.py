"""Top-k and threshold selection in the epilogue of the Hopper Gram kernel (``wgmma``).

The same selections as :mod:`dask_gpuchunk._kernels.bmma_select` (callers, slots, merge and
redo shared: only the launch differs), on :mod:`dask_gpuchunk._kernels.wgmma`'s tiles' counts,
never in memory: each consumer thread holds 128 of a 128 x 256 tile (2 rows by 64 columns),
compares each with integers first and scores only the rare one at or above them.

Top-k: a pair of count ``c`` between rows of popcounts ``a`` and ``b`` reaches a score ``s``
only on or above a line in ``c`` and ``b`` (Tanimoto: ``c >= s / (1 + s) * (a + b)``; Dice,
cosine, Hamming and counts alike: :c:func:`bound_line`). Each row's line at the tile's least
column popcount, and each column's at its least row popcount, is an integer floor below every
pair's own line: two integer compares a count, in one pass over the tile with no branch (the
8-column steps a warp must take again marked; a vote and a branch each step, each waiting on
its floors' shared loads, took 1.40 ms of a 32,768-row block where this takes 1.29 ms and no
selection at all 0.78 ms). Counts at or above a floor are queued (a warp's
queue in shared memory) and tested exactly a queue at a time, a lane each, as bmma's are, so
the candidates, and the new states, are exactly bmma's (tested where found: 10.7 ms a
32,768-row block on an H200; floors of ``c`` alone let half the pairs through: 11 ms).

Threshold: far above most pairs, each row's least count (``c >= s * a`` and its kin:
:c:func:`least_count`) leaves out nearly every pair with no tile-wide setup; the pairs that
pass are appended with one atomic per warp and 8-column step that has any (a warp's exclusive
scan gives each lane its places).

Both kernels are persistent (a block per multiprocessor takes tiles in turn:
:func:`resident_blocks`): the producer thread copies the next tile's stages while the consumers
select from this one, and helper warps fill the next tile's data (two buffers, in turn, each
with a full and an empty barrier): the threshold's column popcounts; the top-k's column
bounds, popcounts and floors, the tile's least popcounts and each row's line, which the
consumers, their registers full of counts, read from there.

The top-k kernel takes its rows in popcount order (the caller sorts each block's rows and
passes the orders: a key's id is ``first + order[r]``): a tile spans a few popcounts, its
floors lie near the pairs' lines. Of a mid-chain block's 0.56 G counts 1.7 M reached unsorted
rows' floors (68 k their lines); queueing them was most of its time (1.41 ms; none: 0.79 ms).

Measured (H200, 8 GiB cap, 10**6 x 2048 bits at 7.5 %, device-resident): all-pairs top-10
1.10-1.12 s (one wait for the device a round of the chain, not a block: 1.27-1.47 s; before
the branch-free pass, 1.09-1.20 s in the same process); persistent at first 1.39-1.51 s, a
block a tile 1.58-1.65 s in the same process (candidates kernels 0.95 s a
block a tile, 1.25 s unsorted; made persistent before the rows were sorted, no faster: 2.0-2.4
against 1.9 s); threshold 0.7 0.55 s (0.64 s a block a tile, bmma's 1.20 s). No dask here.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .compiled import compiled_once
from .similarity import cuda_metric_code
from .wgmma import TILE, WgmmaTile, compile_for_sm90a, tensor_map
from .wgmma_select_source import select_source

__all__ = ["launch_pairs_at_least", "launch_top_k_candidates", "resident_blocks",
           "select_source", "shared_bytes"]

def shared_bytes(tile: WgmmaTile = TILE) -> int:
    """Dynamic shared memory of a selection kernel: the Gram kernel's stages and barriers,
    then the top-k's two buffers' barriers and the buffers (for each column of the tile its
    bound, 8 bytes, popcount and floor, 4 bytes each; the tile's least popcounts; each row's
    line, two floats) and a queue of 128 counts (8 bytes each) per consumer warp. The
    threshold kernel's (:func:`_threshold_bytes`) take less."""
    return (tile.shared_bytes + 32 + 2 * (16 * tile.bn + 16 + 8 * tile.bm)
            + tile.warpgroups * 4 * 128 * 8)


def _threshold_bytes(tile: WgmmaTile = TILE) -> int:
    """What the persistent threshold kernel uses after the stages and their barriers: two
    column buffers' barriers and the buffers (each column's popcount)."""
    return tile.shared_bytes + 32 + 2 * 4 * tile.bn


#: Row widths (bits) up to which counts are filtered by their lines (``lifted`` holds counts
#: below 2**23 exactly; a line's sum two popcounts).
FILTERED_BITS = 1 << 22


@compiled_once
def _compiled(device: int, name: str, tile: WgmmaTile, metric: str) -> Any:
    return compile_for_sm90a(select_source(name, metric, tile), shared_bytes(tile), name)


def kernel(name: str, metric: str, tile: WgmmaTile = TILE) -> Any:
    """Selection kernel ``name`` scoring by ``metric`` on the current device, compiled at first
    use (NVRTC, ``sm_90a``), then cached."""
    import cupy

    return _compiled(cupy.cuda.runtime.getDevice(), name, tile, metric)


def resident_blocks() -> int:
    """Blocks the persistent threshold kernel launches on the current device: one per
    multiprocessor (a block's shared memory leaves room for no second one)."""
    import cupy

    return _multiprocessors(cupy.cuda.runtime.getDevice())


@functools.cache
def _multiprocessors(device: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])


def _filtered(words: Any) -> bool:
    return words.shape[1] * 64 < FILTERED_BITS


def _launch(name: str, a: Any, b: Any, pop_a: Any, pop_b: Any, first_a: int, first_b: int,
            metric: str, tile: WgmmaTile, *rest: Any, persistent: bool = False) -> None:
    """Queue the selection kernel ``name`` on CuPy's current stream over the tiles of ``a``
    against ``b``: its arguments the words' tensor maps, sizes, stages, popcounts and first
    ids, then ``rest``; a block a tile, or for a ``persistent`` kernel (its blocks take tiles
    in turn) at most a block a multiprocessor."""
    map_a, kept_a = tensor_map(a, tile.kbits)
    map_b, kept_b = (map_a, kept_a) if b is a else tensor_map(b, tile.kbits)
    na, nb = a.shape[0], b.shape[0]
    steps = -(-kept_a.shape[1] * 64 // tile.kbits)
    grid = -(-na // tile.bm) * -(-nb // tile.bn)
    if persistent:
        grid = min(grid, resident_blocks())
    kernel(name, metric, tile).kernel(
        (grid,), (tile.threads,),
        (map_a, map_b, np.int32(na), np.int32(nb), np.int32(steps), pop_a, pop_b,
         np.int64(first_a), np.int64(first_b), *rest),
        shared_mem=shared_bytes(tile))
    del kept_a, kept_b  # referenced until the launch is queued (see wgmma.launch)


def launch_top_k_candidates(a: Any, b: Any, pop_a: Any, pop_b: Any, first_a: int,
                            first_b: int, state_a: Any, state_b: Any, k: int, metric: str,
                            exclude: bool, both: bool, slots_a: Any, count_a: Any,
                            slots_b: Any, count_b: Any, nslots: int, order_a: Any,
                            order_b: Any, tile: WgmmaTile = TILE) -> None:
    """Queue the candidates kernel on CuPy's current stream: ``a``, ``b`` CuPy ``uint64``
    words of one width, the rest as
    :func:`~dask_gpuchunk._kernels.bmma_select.top_k_candidates` makes them; row ``r`` of
    ``a`` is the caller's row ``order_a[r]`` (``int32``; its id ``first_a + order_a[r]``),
    and so for ``b``."""
    _launch("top_k_candidates_wgmma", a, b, pop_a, pop_b, first_a, first_b, metric, tile,
            state_a, state_b, np.int32(k), np.int32(cuda_metric_code(metric)),
            np.int32(bool(exclude)), np.int32(both), np.int32(_filtered(a)), slots_a, count_a,
            slots_b, count_b, np.int32(nslots), order_a, order_b, persistent=True)


def launch_pairs_at_least(a: Any, b: Any, pop_a: Any, pop_b: Any, first_a: int, first_b: int,
                          limit: int, metric: str, exclude: bool, upper: bool, out: Any,
                          found: Any, capacity: int, tile: WgmmaTile = TILE) -> None:
    """Queue the threshold kernel on CuPy's current stream, as
    :func:`~dask_gpuchunk._kernels.bmma_select.pairs_at_least_bmma` makes its arguments."""
    _launch("pairs_at_least_wgmma", a, b, pop_a, pop_b, first_a, first_b, metric, tile,
            np.uint32(limit), np.int32(cuda_metric_code(metric)), np.int32(bool(exclude)),
            np.int32(bool(upper)), out, found, np.int64(capacity), persistent=True)
