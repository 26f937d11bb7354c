"""Top-k and threshold selection in the epilogue of the 1-bit tensor-core Gram kernel.

The kernels of this module compute a block's counts exactly as
:func:`dask_gpuchunk._kernels.bmma.bmma_cuda` does (the same tile code, in registers), then,
instead of storing them, score each one (``rank_of``, the formulas of
:mod:`dask_gpuchunk._kernels.similarity`) and keep only what a selection can use: the counts
matrix never reaches device memory. At 16,384 x 16,384 pairs of 2,048 bits, storing the block
writes 1 GiB and scoring it reads that GiB again (twice for both orientations), about 1 ms
against the tensor cores' 0.1 ms.

Top-k (:func:`top_k_candidates`): each target (a row, and for all pairs a column too) has a
running best-``k`` list, its *state*, from the blocks already merged; a pair is a candidate for
a target only if its key (rank << 32 | id) is smaller than the state's last key, since the
state already holds ``k`` better keys otherwise. Candidates go to ``SLOTS`` slots per target
(an atomic count each); a second kernel merges them into a new state. With the state from one
block of 16,384 candidates, a random block gives each target about ``k`` candidates, fewer as
the state tightens. A target with more (an empty row, whose every pair ties at 0 and beats the
state's last key wherever the block's ids are smaller; ordered data) is redone exactly from a
Gram of that target against the block, so the result never depends on the slots.

The epilogue stages the tile's counts in shared memory (where the copies of k were), then each
thread takes one row of the tile (and one column): per pair a shared-memory read, a test and,
rarely, a score; the fragments' scattered layout in registers made the same work 10 x slower
when each thread scored its own fragments (measured on an H200: 3.2 ms a 16,384-row block).

Threshold (:func:`pairs_at_least_bmma`): every pair that meets the threshold is appended to
one buffer (one atomic per row of a tile), as :func:`~dask_gpuchunk._kernels.similarity.pairs_at_least`
lays pairs out; a buffer too small is sized again from the count and the block recomputed.

Float scores need a division per pair; before it, a test that costs a multiply (``c >=
least * den``, with ``least`` a hair below the score to beat) leaves out nearly every pair of
a tight selection, and lets through every pair that can pass (float32 division is correctly
rounded: ``c / den >= s`` needs ``c >= s * den * (1 - 2**-24)``). No dask here.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from . import wgmma_select
from .bmma import TILE, TILE_SOURCE, BmmaTile, tile_kernel, words32
from .similarity import (
    CUDA_TOP_K_MAX,
    FLOAT_METRICS,
    RANK_SOURCE,
    cuda_metric_code,
    kept_popcount_order,
    rank_limit,
)
from .top_k_overflow import REDONE_TARGETS, Overflow, redo_overflows

__all__ = ["FUSED_METHODS", "PAIRS_FIRST_CAPACITY", "SLOTS", "compile_ahead",
           "launch_candidates", "pairs_at_least_bmma",
           "top_k_candidates", "top_k_scratch_bytes"]

#: Candidate slots per target and block in :func:`top_k_candidates`.
SLOTS = 64
#: Pairs :func:`pairs_at_least_bmma` makes room for before it knows how many there are.
PAIRS_FIRST_CAPACITY = 1 << 16

# What every selection kernel builds on (each kernel is a module of its own: see _kernel).
_SELECT_COMMON = TILE_SOURCE + RANK_SOURCE + r"""
#define LD (BN + 4)  // a staged tile's row stride in ints: 16-byte rows; see stage_tile

#define LINE_WORDS ((BM > BN ? BM : BN) / 32)

__device__ __forceinline__ float least_of(unsigned rank)
{
    // A score below which no pair can reach rank: rank's own score, less a margin for the
    // rounding of the tests below (float metrics only).
    return __uint_as_float(0xFFFFFFFFu - rank) * 0.99999905f;  // 1 - 2**-20
}

__device__ __forceinline__ bool may_reach(int c, int a, int b, int metric, float least,
                                          unsigned rank_bound)
{
    // False only for pairs whose rank is above rank_bound: the float scores below least (see
    // least_of), without a division; hamming and counts exactly.
    if (metric == 0) return (float)c >= least * (float)(a + b - c);
    if (metric == 1) return (float)(2 * c) >= least * (float)(a + b);
    if (metric == 2) return (float)c * (float)c >= (least * least) * 0.99999f * ((float)a * (float)b);
    if (metric == 3) return (unsigned)(a + b - 2 * c) <= rank_bound;
    return 0xFFFFFFFFu - (unsigned)c <= rank_bound;
}

__device__ __forceinline__ void stage_tile(const int (&acc)[MI][NJ][4], const TilePlace& p,
                                           const int* __restrict__ pop_a,
                                           const int* __restrict__ pop_b, int na, int nb,
                                           int* tile, int* pops_r, int* pops_c)
{
    // The tile's counts into shared memory (where the copies of k were: every warp must be
    // done with them), row stride LD, and the popcounts of its rows and columns.
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    // With LD = BN + 4: a fragment's 8-byte stores meet at most two to a bank, the rows read
    // as 16-byte vectors and the columns as ints without conflicts (LD = BN + 1 had 4-way
    // conflicts here).
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < NJ; ++j)
                *reinterpret_cast<int2*>(tile + (p.wr + i * 16 + g + 8 * h) * LD + p.wc + j * 8 + 2 * t) =
                    make_int2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
    for (int v = threadIdx.x; v < BM; v += THREADS)
        pops_r[v] = p.row_block + v < na ? pop_a[p.row_block + v] : 0;
    for (int v = threadIdx.x; v < BN; v += THREADS)
        pops_c[v] = p.col_block + v < nb ? pop_b[p.col_block + v] : 0;
    __syncthreads();
}

__device__ __forceinline__ void scan_line(const int* line, int stride, int length, int pop,
                                          const int* pops, int metric, float least,
                                          unsigned rank_bound, unsigned (&pass)[LINE_WORDS])
{
    // Which pairs of a line of the staged tile (a row, or a column) may reach rank_bound, as a
    // bit mask: a branch-free pass with every read independent of the others (the exact test,
    // with its division, runs for the few that pass). A loop that tested and scored each pair
    // in turn took 1.0-1.7 ms a 16,384-row block on an H200, this pass 0.15 ms.
#pragma unroll
    for (int word = 0; word < LINE_WORDS; ++word) {
        unsigned bits = 0;
        if (stride == 1) {  // a row: 16-byte reads
#pragma unroll
            for (int bit = 0; bit < 32; bit += 4) {
                const int v = word * 32 + bit;
                const int4 c = *reinterpret_cast<const int4*>(line + v);
                bits |= (unsigned)may_reach(c.x, pop, pops[v], metric, least, rank_bound) << bit;
                bits |= (unsigned)may_reach(c.y, pop, pops[v + 1], metric, least, rank_bound) << (bit + 1);
                bits |= (unsigned)may_reach(c.z, pop, pops[v + 2], metric, least, rank_bound) << (bit + 2);
                bits |= (unsigned)may_reach(c.w, pop, pops[v + 3], metric, least, rank_bound) << (bit + 3);
            }
        } else {
#pragma unroll
            for (int bit = 0; bit < 32; ++bit) {
                const int v = word * 32 + bit;
                bits |= (unsigned)may_reach(line[v * stride], pop, pops[v], metric, least,
                                            rank_bound) << bit;
            }
        }
        const int left = length - word * 32;
        pass[word] = left >= 32 ? bits : (left <= 0 ? 0u : bits & ((1u << left) - 1u));
    }
}

__device__ __forceinline__ void candidates_of(const int* line, int stride, int length,
                                              int pop, const int* pops, int target,
                                              long long id, long long first_other,
                                              const unsigned long long* __restrict__ state,
                                              int k, int metric, int exclude,
                                              unsigned long long* slots, int* count, int nslots)
{
    // One target against a line of the staged tile: the pairs whose key beats the target's
    // state into its slots.
    const unsigned long long bound = state[(size_t)target * k + k - 1];
    const unsigned rank_bound = (unsigned)(bound >> 32);
    unsigned pass[LINE_WORDS];
    scan_line(line, stride, length, pop, pops, metric, least_of(rank_bound), rank_bound, pass);
#pragma unroll
    for (int word = 0; word < LINE_WORDS; ++word) {
        for (unsigned bits = pass[word]; bits; bits &= bits - 1) {
            const int v = word * 32 + __ffs(bits) - 1;
            const long long other_id = first_other + v;
            if (exclude && other_id == id) continue;
            const unsigned long long key = ((unsigned long long)rank_of(
                line[v * stride], pop, pops[v], metric) << 32) | (unsigned)other_id;
            if (key >= bound) continue;
            const int slot = atomicAdd(count + target, 1);
            if (slot < nslots) slots[(size_t)target * nslots + slot] = key;
        }
    }
}

"""

_TOP_K_CANDIDATES = r"""
extern "C" __global__ void __launch_bounds__(THREADS, 1)
top_k_candidates(const unsigned* __restrict__ a, const unsigned* __restrict__ b, int na, int nb,
                 int kw, const int* __restrict__ pop_a, const int* __restrict__ pop_b,
                 long long first_a, long long first_b,
                 const unsigned long long* __restrict__ state_a,
                 const unsigned long long* __restrict__ state_b, int k, int metric, int exclude,
                 int both, unsigned long long* __restrict__ slots_a, int* __restrict__ count_a,
                 unsigned long long* __restrict__ slots_b, int* __restrict__ count_b, int nslots)
{
    // The pairs of a's rows with b's rows (ids first_a + r, first_b + c) whose key beats the
    // row's state (k sorted keys a row) into its slots; with both, also for the columns
    // against state_b. Pairs of equal ids left out with exclude. The tile's counts are staged
    // in shared memory, then each thread takes a row of it (and a column).
#ifdef SELECT_METRIC
    metric = SELECT_METRIC;  // one metric a module: the others' branches fold away
#endif
    extern __shared__ uint4 smem[];
    TilePlace p;
    tile_place(na, nb, 0, p);
    int acc[MI][NJ][4];
    tile_counts(acc, a, b, na, nb, kw, p, smem);
    int* tile = reinterpret_cast<int*>(smem);
    int* pops_r = tile + BM * LD;
    int* pops_c = pops_r + BM;
    stage_tile(acc, p, pop_a, pop_b, na, nb, tile, pops_r, pops_c);
    const int rows = min(BM, na - p.row_block), cols = min(BN, nb - p.col_block);
    for (int v = threadIdx.x; v < rows; v += THREADS)
        candidates_of(tile + v * LD, 1, cols, pops_r[v], pops_c, p.row_block + v,
                      first_a + p.row_block + v, first_b + p.col_block, state_a, k, metric,
                      exclude, slots_a, count_a, nslots);
    if (!both) return;
    for (int v = threadIdx.x; v < cols; v += THREADS)
        candidates_of(tile + v, LD, rows, pops_c[v], pops_r, p.col_block + v,
                      first_b + p.col_block + v, first_a + p.row_block, state_b, k, metric,
                      exclude, slots_b, count_b, nslots);
}

"""

_MERGE_CANDIDATES = r"""
extern "C" __global__ void
merge_candidates(const unsigned long long* __restrict__ state,
                 const unsigned long long* __restrict__ slots, const int* __restrict__ count,
                 int n, int k, int nslots, unsigned long long* __restrict__ out,
                 const int* __restrict__ order)
{
    // A target's new state: the k smallest of its state and its candidates (those of a target
    // with more candidates than slots are redone by the caller), written to row order[target]
    // of out where an order is given (targets taken in popcount order, put back).
    const int target = blockIdx.x * blockDim.x + threadIdx.x;
    if (target >= n) return;
    unsigned long long best[MAX_K];
    for (int i = 0; i < k; ++i) best[i] = state[(size_t)target * k + i];
    const int m = min(count[target], nslots);
    for (int s = 0; s < m; ++s) {
        const unsigned long long key = slots[(size_t)target * nslots + s];
        if (key >= best[k - 1]) continue;
        int i = k - 1;
        while (i > 0 && best[i - 1] > key) { best[i] = best[i - 1]; --i; }
        best[i] = key;
    }
    const size_t row = order != nullptr ? (size_t)order[target] : (size_t)target;
    for (int i = 0; i < k; ++i) out[row * k + i] = best[i];
}

"""

_PAIRS_AT_LEAST = r"""
extern "C" __global__ void __launch_bounds__(THREADS, 1)
pairs_at_least(const unsigned* __restrict__ a, const unsigned* __restrict__ b, int na, int nb,
               int kw, const int* __restrict__ pop_a, const int* __restrict__ pop_b,
               long long first_a, long long first_b, unsigned limit, float least, int metric,
               int exclude, int upper, unsigned long long* __restrict__ out,
               unsigned long long* __restrict__ found, long long capacity)
{
    // Every pair whose rank is at most limit, as (row id << 32 | column id, the score's bits),
    // appended to out; found counts them all, also those beyond capacity. upper: a symmetric
    // block (a is b), only pairs with r <= c. Each thread takes a row of the staged tile.
#ifdef SELECT_METRIC
    metric = SELECT_METRIC;  // one metric a module: the others' branches fold away
#endif
    extern __shared__ uint4 smem[];
    TilePlace p;
    if (!tile_place(na, nb, upper, p)) return;
    int acc[MI][NJ][4];
    tile_counts(acc, a, b, na, nb, kw, p, smem);
    int* tile = reinterpret_cast<int*>(smem);
    int* pops_r = tile + BM * LD;
    int* pops_c = pops_r + BM;
    stage_tile(acc, p, pop_a, pop_b, na, nb, tile, pops_r, pops_c);
    const int cols = min(BN, nb - p.col_block);
    for (int v = threadIdx.x; v < BM; v += THREADS) {
        const int r = p.row_block + v;
        if (r >= na) continue;
        const int* line = tile + v * LD;
        const int pa = pops_r[v];
        const long long id_a = first_a + r;
        unsigned pass[LINE_WORDS];
        scan_line(line, 1, cols, pa, pops_c, metric, least, limit, pass);
        // The exact test of those that pass, then one atomic for the row's pairs of this tile.
        int hits = 0;
#pragma unroll
        for (int word = 0; word < LINE_WORDS; ++word) {
            unsigned kept = 0;
            for (unsigned bits = pass[word]; bits; bits &= bits - 1) {
                const int bit = __ffs(bits) - 1, w = word * 32 + bit;
                const int c = p.col_block + w;
                if ((upper && r > c) || (exclude && id_a == first_b + c)) continue;
                if (rank_of(line[w], pa, pops_c[w], metric) <= limit) kept |= 1u << bit;
            }
            pass[word] = kept;
            hits += __popc(kept);
        }
        if (!hits) continue;
        unsigned long long at = atomicAdd(found, (unsigned long long)hits);
#pragma unroll
        for (int word = 0; word < LINE_WORDS; ++word) {
            for (unsigned bits = pass[word]; bits; bits &= bits - 1) {
                const int w = word * 32 + __ffs(bits) - 1;
                const unsigned rank = rank_of(line[w], pa, pops_c[w], metric);
                if (at < (unsigned long long)capacity) {
                    out[2 * at] = ((unsigned long long)id_a << 32) | (unsigned)(first_b + p.col_block + w);
                    out[2 * at + 1] = metric == 3 ? rank : 0xFFFFFFFFu - rank;
                }
                ++at;
            }
        }
    }
}
"""

_SELECT_KERNELS = {"top_k_candidates": _TOP_K_CANDIDATES,
                   "merge_candidates": _MERGE_CANDIDATES,
                   "pairs_at_least": _PAIRS_AT_LEAST}


def _kernel(name: str, tile: BmmaTile, metric: str | None = None) -> Any:
    staged = (tile.bm * (tile.bn + 4) + tile.bm + tile.bn) * 4
    if staged > tile.shared_bytes or tile.bm % tile.threads or tile.bn % 32 or tile.bm % 32:
        raise ValueError(f"bmma tile {tile} cannot stage its counts for selection: "
                         f"{staged} bytes of shared memory (it has {tile.shared_bytes}), "
                         "bm a multiple of the threads, bm and bn of 32")
    # One module per kernel: a job compiles only those it runs (the three in one module took
    # 14 s of NVRTC on an H100), and they compile side by side in a job's threads. A kernel
    # that scores pairs is compiled for one metric: the scan's unrolled tests, five metrics in
    # each at two call sites, made the top-k kernel's 10-11 s of NVRTC on an H100.
    fixed = f"#define SELECT_METRIC {cuda_metric_code(metric)}\n" if metric is not None else ""
    source = (f"#define MAX_K {CUDA_TOP_K_MAX}\n" + fixed + _SELECT_COMMON
              + _SELECT_KERNELS[name])
    return tile_kernel(tile, source, name)


def compile_ahead(selection: str, metric: str = "tanimoto", tile: BmmaTile = TILE,
                  method: str = "bmma") -> threading.Thread:
    """Start compiling the fused kernels of a ``"top_k"`` or ``"threshold"`` selection by
    ``metric`` with ``method``'s kernel for the current device, in a thread of its own;
    return the thread.

    The top-k kernel took ~11 s of NVRTC on an H100 machine with every metric in it, 1.3 s
    for one; begun first, it compiles while the rest of a job gets ready, and the first block
    that needs it waits for this compile, not for one of its own (one lock per kernel:
    :func:`~dask_gpuchunk._kernels.compiled.compiled_once`). A compile that fails here is left
    for that block, which compiles again and raises."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    _check_fused(method)
    suffix = "_wgmma" if method == "wgmma" else ""
    kernels = (((f"top_k_candidates{suffix}", metric), ("merge_candidates", None))
               if selection == "top_k" else ((f"pairs_at_least{suffix}", metric),))

    def run() -> None:
        try:
            with cupy.cuda.Device(device):
                for name, scored_by in kernels:
                    if name.endswith("_wgmma"):
                        wgmma_select.kernel(name, scored_by)
                    else:
                        _kernel(name, tile, scored_by)
        except Exception:  # noqa: BLE001 - raised again where the kernel is needed
            pass

    thread = threading.Thread(target=run, name="dask-gpuchunk-compile-ahead", daemon=True)
    thread.start()
    return thread


#: The methods whose Gram kernel selects in its epilogue.
FUSED_METHODS = ("bmma", "wgmma")


def _check_fused(method: str) -> None:
    if method not in FUSED_METHODS:
        raise ValueError(f"no selection in the epilogue of method {method!r}; "
                         f"those of {FUSED_METHODS} have one")


def _operands(a: Any, b: Any, tile: BmmaTile) -> tuple[Any, Any]:
    a32 = words32(a, tile.kbits)
    return a32, (a32 if b is a else words32(b, tile.kbits))


def top_k_scratch_bytes(na: int, nb: int, k: int, both: bool, words64: int,
                        tile: BmmaTile = TILE, slots: int | None = None) -> int:
    """Device bytes :func:`top_k_candidates` allocates for blocks of ``na`` and ``nb`` rows:
    slots, counts, new states, (where the rows need padding) copies of the words, and room to
    redo :data:`REDONE_TARGETS` targets (their counts, scores, keys and a sort's copies)."""
    targets = na + (nb if both else 0)
    padded = -(-words64 * 64 // tile.kbits) * tile.kbits // 8
    redo = min(REDONE_TARGETS, targets) * max(na, nb) * 40
    # Hopper's rows in popcount order: the words' copies, orders, popcounts and states.
    ordered = (na + nb) * (words64 * 8 + 16) + targets * k * 16
    slots = SLOTS if slots is None else slots
    return targets * (slots * 8 + 4 + k * 8) + (na + nb) * padded + redo + ordered


def top_k_candidates(a: Any, b: Any, pop_a: Any, pop_b: Any, first_a: int, first_b: int,
                     state_a: Any, state_b: Any | None, metric: str, exclude: bool,
                     tile: BmmaTile = TILE, method: str = "bmma",
                     overflows: list[Overflow] | None = None, slots: int | None = None
                     ) -> tuple[Any, Any | None]:
    """The new states ``(r, k)`` of ``a``'s rows (and, with ``state_b``, of ``b``'s rows as
    the block's columns) after the block of ``a`` against ``b`` (CuPy ``uint64`` words of one
    width; row ids ``first_a`` and ``first_b`` on), from states of sorted keys
    (:func:`~dask_gpuchunk._kernels.similarity.rank_keys`, :data:`NO_PAIR` padding) of the
    blocks before. Targets with more candidates than ``slots`` (default :data:`SLOTS`; ties
    with a state's last key from smaller ids, as an empty row has with every row) are redone
    exactly against the whole block (:mod:`~dask_gpuchunk._kernels.top_k_overflow`). Waits
    for the device (one count read), unless given a list ``overflows``: the block's
    :class:`Overflow` is appended to it instead, and the caller passes the list to
    :func:`~dask_gpuchunk._kernels.top_k_overflow.redo_overflows` before the new states are
    read or updated again
    (one wait for several blocks: each block's launches then queue while the device runs the
    one before). ``method="wgmma"``:
    the candidates from Hopper's kernel (:mod:`~dask_gpuchunk._kernels.wgmma_select`), the
    same ones, its rows and columns taken in popcount order
    (:func:`~dask_gpuchunk._kernels.similarity.kept_popcount_order`, once for each popcounts
    array; the states and words gathered so, the new states put back)."""
    import cupy

    _check_fused(method)
    slots = SLOTS if slots is None else slots
    k = state_a.shape[1]
    if not 1 <= k <= CUDA_TOP_K_MAX:
        raise ValueError(f"k must be from 1 to {CUDA_TOP_K_MAX}; got {k}")
    na, nb = a.shape[0], b.shape[0]
    both = state_b is not None
    if na == 0 or nb == 0:
        return state_a, state_b
    given = (pop_a, pop_b)  # the callers' arrays: a chunk's order is kept by them
    pop_a = cupy.ascontiguousarray(pop_a, dtype=np.int32)
    pop_b = cupy.ascontiguousarray(pop_b, dtype=np.int32)
    state_a = cupy.ascontiguousarray(state_a)
    slots_a = cupy.empty((na, slots), dtype=np.uint64)
    count_a = cupy.zeros(na, dtype=np.int32)
    if both:
        state_b = cupy.ascontiguousarray(state_b)
        slots_b = cupy.empty((nb, slots), dtype=np.uint64)
        count_b = cupy.zeros(nb, dtype=np.int32)
    else:  # never read: both = 0
        state_b, slots_b, count_b = state_a, slots_a, count_a
    sides = [(a, b, pop_a, pop_b, first_a, first_b, state_a, slots_a, count_a)]
    if both:
        sides.append((b, a, pop_b, pop_a, first_b, first_a, state_b, slots_b, count_b))
    orders: list[Any] = [None, None]
    pops = [pop_a, pop_b]
    if method == "wgmma":
        # Hopper's kernel takes the rows in popcount order: a tile's rows and columns then
        # span a few popcounts, and the integer floors its epilogue tests every count against
        # (each row's line at the tile's least column popcount, and each column's) lie close
        # to the pairs' own lines, so that far fewer counts take the slow path.
        bits = 64 * a.shape[1]
        orders[0], pops[0] = kept_popcount_order(given[0], bits)
        orders[1], pops[1] = ((orders[0], pops[0]) if b is a
                              else kept_popcount_order(given[1], bits))
    ordered = [state if order is None else state[order]
               for (*_, state, _, _), order in zip(sides, orders)]
    launch_candidates(*(x if order is None else x[order] for x, order in zip((a, b), orders)),
                      *pops, first_a, first_b, ordered[0], ordered[-1] if both else state_b,
                      both, metric, exclude, slots_a, count_a, slots_b, count_b, tile, method,
                      *orders)
    merge = _kernel("merge_candidates", tile)
    new_states = []
    for (*_, queued, count), state, order in zip(sides, ordered, orders):
        n = state.shape[0]
        out = cupy.empty_like(state)  # in the caller's row order: the merge puts rows back
        merge((-(-n // 128),), (128,), (state, queued, count, np.int32(n), np.int32(k),
                                        np.int32(slots), out,
                                        np.uint64(0) if order is None else order))
        new_states.append(out)
    # The slots are merged: what a redo needs of each side (not the slots) is kept.
    block = Overflow([side[:7] + side[8:] for side in sides], new_states, orders, metric, exclude,
                     slots)
    if overflows is None:
        redo_overflows([block])
    else:
        overflows.append(block)
    return new_states[0], (new_states[1] if both else None)


def launch_candidates(a: Any, b: Any, pop_a: Any, pop_b: Any, first_a: int, first_b: int,
                      state_a: Any, state_b: Any, both: bool, metric: str, exclude: bool,
                      slots_a: Any, count_a: Any, slots_b: Any, count_b: Any,
                      tile: BmmaTile = TILE, method: str = "bmma", order_a: Any = None,
                      order_b: Any = None) -> None:
    """Queue :func:`top_k_candidates`' kernel alone (``method``'s) on CuPy's current stream:
    ``a``, ``b`` CuPy ``uint64`` words, popcounts ``int32``, states ``(n, k)`` C-contiguous,
    candidates into ``slots_*`` ``(n, slots)`` counted in ``count_*`` (zeros before); with
    ``both`` false nothing is kept for the columns (pass ``state_a``'s buffers for theirs).
    ``"wgmma"`` only: row ``r`` of ``a`` has id ``first_a + order_a[r]`` (``int32``; default
    ``r``), and so for ``b``."""
    import cupy

    k = state_a.shape[1]
    if method == "wgmma":
        if order_a is None:
            order_a = cupy.arange(a.shape[0], dtype=np.int32)
        if order_b is None:
            order_b = cupy.arange(b.shape[0], dtype=np.int32)
        wgmma_select.launch_top_k_candidates(
            a, b, pop_a, pop_b, first_a, first_b, state_a, state_b, k, metric, exclude, both,
            slots_a, count_a, slots_b, count_b, slots_a.shape[1], order_a, order_b)
        return
    na, nb = a.shape[0], b.shape[0]
    a32, b32 = _operands(a, b, tile)
    grid = (-(-na // tile.bm) * -(-nb // tile.bn),)
    _kernel("top_k_candidates", tile, metric)(
        grid, (tile.threads,),
        (a32, b32, np.int32(na), np.int32(nb), np.int32(a32.shape[1]), pop_a, pop_b,
         np.int64(first_a), np.int64(first_b), state_a, state_b, np.int32(k),
         np.int32(cuda_metric_code(metric)), np.int32(bool(exclude)), np.int32(both),
         slots_a, count_a, slots_b, count_b, np.int32(slots_a.shape[1])),
        shared_mem=tile.shared_bytes)


def pairs_at_least_bmma(a: Any, b: Any, pop_a: Any, pop_b: Any, first_a: int, first_b: int,
                        threshold: Any, metric: str, exclude: bool, upper: bool,
                        capacity: int | None = None, tile: BmmaTile = TILE,
                        method: str = "bmma") -> tuple[Any | None, int]:
    """The pairs of ``a``'s rows with ``b``'s (CuPy ``uint64`` words; ids ``first_a`` and
    ``first_b`` on) whose score meets ``threshold``, as
    :func:`~dask_gpuchunk._kernels.similarity.pairs_at_least` gives them (in no order), and
    their count; ``upper``: ``b`` is ``a`` and only pairs of row <= column are kept. Room is
    made for ``capacity`` pairs (:data:`PAIRS_FIRST_CAPACITY` unless given): where the block
    has more, ``(None, count)``, and the caller calls again with ``capacity=count`` (within
    its budget). Waits for the device (one count read). ``method="wgmma"``: the pairs from
    Hopper's kernel (:mod:`~dask_gpuchunk._kernels.wgmma_select`), the same ones."""
    import cupy

    _check_fused(method)
    na, nb = a.shape[0], b.shape[0]
    if na == 0 or nb == 0:
        return cupy.empty((0, 2), dtype=np.uint64), 0
    capacity = PAIRS_FIRST_CAPACITY if capacity is None else capacity
    pop_a = cupy.ascontiguousarray(pop_a, dtype=np.int32)
    pop_b = cupy.ascontiguousarray(pop_b, dtype=np.int32)
    limit = rank_limit(threshold, metric)
    out = cupy.empty((capacity, 2), dtype=np.uint64)
    found = cupy.zeros(1, dtype=np.uint64)
    if method == "wgmma":
        wgmma_select.launch_pairs_at_least(a, b, pop_a, pop_b, first_a, first_b, limit, metric,
                                           exclude, upper, out, found, capacity)
    else:
        a32, b32 = _operands(a, b, tile)
        least = (np.float32(threshold) * np.float32(0.99999905) if metric in FLOAT_METRICS
                 else 0.0)
        grid = (-(-na // tile.bm) * -(-nb // tile.bn),)
        _kernel("pairs_at_least", tile, metric)(
            grid, (tile.threads,),
            (a32, b32, np.int32(na), np.int32(nb), np.int32(a32.shape[1]), pop_a, pop_b,
             np.int64(first_a), np.int64(first_b), np.uint32(limit), np.float32(least),
             np.int32(cuda_metric_code(metric)), np.int32(bool(exclude)),
             np.int32(bool(upper)), out, found, np.int64(capacity)),
            shared_mem=tile.shared_bytes)
    count = int(found.get()[0])
    return (out[:count] if count <= capacity else None), count
