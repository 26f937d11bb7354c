"""The CUDA C++ of :mod:`dask_gpuchunk._kernels.wgmma_select`'s kernels: their shared device
functions (lines, floors, the persistent kernels' rings, the exact test of a warp's queue),
the top-k candidates kernel and the threshold kernel, each assembled for one metric by
:func:`select_source`. How they select, and what they measured, is that module's docstring.
No dask here.
"""

from __future__ import annotations

from .similarity import RANK_SOURCE, cuda_metric_code
from .wgmma import TILE, WgmmaTile, tile_source

__all__ = ["select_source"]

_SELECT = r"""
#define FULL_MASK 0xFFFFFFFFu
#define NEVER 0x7FFFFFFF
#define TWO_23 8388608.0f
#define CONSUMERS (128 * WARPGROUPS)
#define QUEUE 128  // counts a warp queues for the exact test
#define ABOVE_ALL __int_as_float(0x7F800000)  // +inf (NVRTC has no math.h)

#define HELPERS 96  // the producer warpgroup's three warps that do not copy: the columns' data
#define STAGE_BYTES ((BM + BN) * CHUNKS * 16)
// Of the persistent threshold kernel, after the stages: their barriers, then the two column
// buffers' (full, empty), then the buffers (COLUMN_BYTES each: the tile's columns' popcounts).
#define COLUMNS_FULL(base) ((base) + STAGES * STAGE_BYTES + 16 * STAGES)
#define COLUMNS_EMPTY(base) (COLUMNS_FULL(base) + 16)
#define COLUMN_BYTES (4 * BN)
#define COLUMN_DATA(base, b) (COLUMNS_EMPTY(base) + 16 + (b) * COLUMN_BYTES)

__device__ __forceinline__ float lifted(int c)
{
    // 2**23 + c as a float, exactly (0 <= c < 2**23), in one integer operation.
    return __int_as_float(c | 0x4B000000);
}

__device__ __forceinline__ float side(int pop, int metric)
{
    // What a pair's bound is linear in, of the other row's popcount: its square root for
    // cosine, else itself.
    return metric == 2 ? sqrtf((float)pop) : (float)pop;
}

__device__ __forceinline__ void bound_line(unsigned rank_bound, int a, int metric, int filter,
                                           float& t, float& k)
{
    // A line below which no pair of a row of popcount a with a row of side() q reaches
    // rank_bound: only pairs with lifted(c) >= t * q + k can (tanimoto: c >= s/(1+s) (a + b);
    // dice: c >= s/2 (a + b); cosine: c >= s sqrt(a) sqrt(b); hamming: c >= (a + b - h) / 2;
    // counts: c >= the bound's count). The score at the bound is taken a hair lower, and
    // the line one count lower, for the float scores' rounding and the line's own (at
    // 2**23 a float's step is 1): every pair that can pass lies on or above it, and takes
    // the exact test. Without filter (counts of 2**22 bits or more), every pair does.
    if (!filter) { t = 0.0f; k = -ABOVE_ALL; return; }
    if (metric == 3) { t = 0.5f; k = TWO_23 + 0.5f * ((float)a - (float)rank_bound) - 1.0f; return; }
    if (metric == 4) { t = 0.0f; k = TWO_23 + (float)(0xFFFFFFFFu - rank_bound) - 1.0f; return; }
    const float s = __uint_as_float(0xFFFFFFFFu - rank_bound) * 0.999999f;
    if (metric == 0) t = s / (1.0f + s);
    else if (metric == 1) t = 0.5f * s;
    else t = s * sqrtf((float)a);
    t *= 0.999999f;
    k = TWO_23 + (metric == 2 ? 0.0f : t * (float)a) - 1.0f;
}

__device__ __forceinline__ int least_count(unsigned rank_bound, int a, int metric)
{
    // The fewest shared bits c with which a row of popcount a can reach rank_bound against any
    // row (c is at most the other's popcount): tanimoto <= c / a, dice <= 2c / (a + c),
    // cosine <= sqrt(c / a), hamming >= a - c, counts = c; floored with a margin for the
    // float scores' rounding. Weaker than the lines (half the pairs of random fingerprints
    // pass it at a top-10's bounds), it needs nothing of the other rows.
    if (metric == 3) {
        const long long m = (long long)a - (long long)rank_bound;
        return m > 0 ? (int)m : 0;
    }
    if (metric == 4) {
        const unsigned m = 0xFFFFFFFFu - rank_bound;
        return m > (unsigned)NEVER ? NEVER : (int)m;
    }
    const float s = __uint_as_float(0xFFFFFFFFu - rank_bound);
    float x;
    if (metric == 0) x = s * (float)a;
    else if (metric == 1) x = s * (float)a / (2.0f - s);
    else x = s * s * (float)a;
    return (int)floorf(x * 0.9999f);
}

__device__ __forceinline__ int line_floor(float t, float q, float k)
{
    // The fewest shared bits on or above a line at q: a count below it lies below the line.
    return __float2int_rd(fmaf(t, q, k) - TWO_23);  // saturates: +inf never, -inf always
}

__device__ __forceinline__ void rings_init(unsigned base)
{
    // The stages' barriers (as tile_counts has them), then each column buffer's: full once
    // every helper thread has filled it, empty once every consumer thread is done with it.
    // Thread 0 of the block; a __syncthreads after (persistent_start).
    const unsigned full = base + STAGES * STAGE_BYTES, empty = full + 8 * STAGES;
    for (int s = 0; s < STAGES; ++s) {
        barrier_init(full + 8 * s, 1);
        barrier_init(empty + 8 * s, 4 * WARPGROUPS);
    }
    for (int b = 0; b < 2; ++b) {
        barrier_init(COLUMNS_FULL(base) + 8 * b, HELPERS);
        barrier_init(COLUMNS_EMPTY(base) + 8 * b, CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ unsigned persistent_start(unsigned char* smem)
{
    // A persistent kernel's start: its stages' and column buffers' barriers made by thread 0
    // and seen by the whole block before any thread waits on one; the stages' base.
    const unsigned base = stages_base(smem);
    if (threadIdx.x == 0) rings_init(base);
    __syncthreads();
    return base;
}

__device__ void copy_tiles(const void* map_a, const void* map_b, int na, int nb, int steps,
                           int upper, unsigned base)
{
    // The producer thread: every stage of every tile of this block (tiles blockIdx.x,
    // + gridDim.x, ...), as far ahead of the consumers as the stages allow, so that a tile's
    // copies land while the one before is still being selected from.
    const unsigned full = base + STAGES * STAGE_BYTES, empty = full + 8 * STAGES;
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n"
                 :: "l"(map_a) : "memory");
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n"
                 :: "l"(map_b) : "memory");
    const unsigned tiles = ((na + BM - 1) / BM) * ((nb + BN - 1) / BN);
    unsigned g = 0;  // stages filled so far, over the block's tiles
    for (unsigned tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int row_block, col_block;
        if (!tile_at(tile, na, nb, upper, row_block, col_block)) continue;
        for (int step = 0; step < steps; ++step, ++g) {
            const unsigned slot = g % STAGES, at = base + slot * STAGE_BYTES, bar = full + 8 * slot;
            barrier_wait(empty + 8 * slot, ((g / STAGES) & 1) ^ 1);
            copy_stage(map_a, map_b, at, bar, step, row_block, col_block);
        }
    }
}

__device__ __forceinline__ void counts_of_tile(int (&acc)[ACC], int steps, unsigned base,
                                               unsigned& g)
{
    // A consumer thread's counts of its tile, from the stages g on (g advanced past them);
    // each stage given back once the instructions reading it are done.
    const unsigned full = base + STAGES * STAGE_BYTES, empty = full + 8 * STAGES;
    const int warpgroup = threadIdx.x / 128, lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0;
    for (int step = 0; step < steps; ++step, ++g) {
        const unsigned slot = g % STAGES, at = base + slot * STAGE_BYTES;
        barrier_wait(full + 8 * slot, (g / STAGES) & 1);
        mma_stage(acc, at, warpgroup);
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        if (step > 0 && lane == 0) barrier_arrive(empty + 8 * ((g - 1) % STAGES));
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    if (lane == 0) barrier_arrive(empty + 8 * ((g - 1) % STAGES));
}

__device__ __forceinline__ int warp_inclusive_sum(int mine, int lane)
{
    // The sum of mine over lanes 0 to lane (every lane of the warp calls it).
    int sum = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(FULL_MASK, sum, o);
        if (lane >= o) sum += t;
    }
    return sum;
}

__device__ __forceinline__ void* shared_pointer(unsigned char* smem, unsigned address)
{
    // The generic pointer of a shared-window address at or after smem.
    return smem + (address - shared_address(smem));
}

__device__ __forceinline__ void tested(const unsigned long long* queue, int queued,
                                       int row_block, int col_block, int na, int nb,
                                       const int* __restrict__ pop_a, const int* pops_c,
                                       long long first_a, long long first_b,
                                       const unsigned long long* __restrict__ state_a,
                                       const unsigned long long* bound_c, int k, int metric,
                                       int exclude, int both,
                                       unsigned long long* __restrict__ slots_a,
                                       int* __restrict__ count_a,
                                       unsigned long long* __restrict__ slots_b,
                                       int* __restrict__ count_b, int nslots,
                                       const int* __restrict__ order_a,
                                       const int* __restrict__ order_b)
{
    // A warp's queued counts (count << 32 | tile row << 16 | tile column), a lane each: the
    // pair's exact rank, then its key for the row's state and (both) the column's. The rank
    // is symmetric in the two rows: one serves both keys. Row r of a is row order_a[r] of the
    // caller's (ids first_a + order_a[r]), and so for b.
    __syncwarp();
    for (int e = threadIdx.x & 31; e < queued; e += 32) {
        const unsigned long long entry = queue[e];
        const int r = row_block + (int)(entry >> 16 & 0xFFFF), v = (int)(entry & 0xFFFF);
        const int col = col_block + v;
        if (r >= na || col >= nb) continue;
        const long long id_r = first_a + order_a[r], id_c = first_b + order_b[col];
        if (exclude && id_r == id_c) continue;
        const unsigned long long rank = rank_of((int)(entry >> 32), pop_a[r], pops_c[v], metric);
        const unsigned long long key_r = rank << 32 | (unsigned)id_c;
        if (key_r < state_a[(size_t)r * k + k - 1]) {
            const int slot = atomicAdd(count_a + r, 1);
            if (slot < nslots) slots_a[(size_t)r * nslots + slot] = key_r;
        }
        const unsigned long long key_c = rank << 32 | (unsigned)id_r;
        if (both && key_c < bound_c[v]) {
            const int slot = atomicAdd(count_b + col, 1);
            if (slot < nslots) slots_b[(size_t)col * nslots + slot] = key_c;
        }
    }
    __syncwarp();
}
"""

_TOP_K = r"""
// Of the persistent top-k kernel, after the stages' barriers and the column buffers'
// barriers: two buffers (TOP_K_COLUMN_BYTES each: the tile's columns' bounds, popcounts and
// floors, its least column and row popcounts, its rows' lines), then a queue per consumer warp.
#define TOP_K_COLUMN_BYTES (16 * BN + 16 + 8 * BM)
#define TOP_K_DATA(base, b) (COLUMNS_EMPTY(base) + 16 + (b) * TOP_K_COLUMN_BYTES)

extern "C" __global__ void __launch_bounds__(THREADS, 1)
top_k_candidates_wgmma(
    const void* __restrict__ map_a, const void* __restrict__ map_b, int na, int nb, int steps,
    const int* __restrict__ pop_a, const int* __restrict__ pop_b, long long first_a,
    long long first_b, const unsigned long long* __restrict__ state_a,
    const unsigned long long* __restrict__ state_b, int k, int metric, int exclude, int both,
    int filter, unsigned long long* __restrict__ slots_a, int* __restrict__ count_a,
    unsigned long long* __restrict__ slots_b, int* __restrict__ count_b, int nslots,
    const int* __restrict__ order_a, const int* __restrict__ order_b)
{
    // As bmma_select's top_k_candidates: the pairs of a's rows with b's rows whose key beats
    // the row's state into its slots, with both also for the columns against state_b. Row r
    // of a has id first_a + order_a[r] (the caller's rows in popcount order), and so for b.
    // Persistent, as the threshold kernel: each block takes tiles blockIdx.x, + gridDim.x,
    // ...; the producer thread copies ahead, the helper warps fill the next tile's column and
    // row data (two buffers, in turn) while the consumers select from this one.
#ifdef SELECT_METRIC
    metric = SELECT_METRIC;
#endif
    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned base = persistent_start(smem);
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const unsigned tiles = ((na + BM - 1) / BM) * ((nb + BN - 1) / BN);

    if (warp == PRODUCER) {
        if (lane == 0) copy_tiles(map_a, map_b, na, nb, steps, 0, base);
        return;
    }
    if (warp > PRODUCER) {
        // For each column of the tile: its bound, popcount and floor (its line at the tile's
        // least row popcount); the tile's least column and row popcounts; each row's line
        // (the consumers' registers are short: 128 hold the counts).
        const int helper = threadIdx.x - 32 * (PRODUCER + 1);
        unsigned i = 0;
        for (unsigned tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            int row_block, col_block;
            if (!tile_at(tile, na, nb, 0, row_block, col_block)) continue;
            const int b = i & 1;
            barrier_wait(COLUMNS_EMPTY(base) + 8 * b, ((i >> 1) & 1) ^ 1);
            unsigned long long* bound_c =
                static_cast<unsigned long long*>(shared_pointer(smem, TOP_K_DATA(base, b)));
            int* pops_c = reinterpret_cast<int*>(bound_c + BN);
            int* lo_c = pops_c + BN;
            int* least = lo_c + BN;
            float* t_rows = reinterpret_cast<float*>(least + 4);
            float* k_rows = t_rows + BM;
            if (helper == 0) least[0] = least[1] = NEVER;
            asm volatile("bar.sync 2, %0;" :: "r"(HELPERS) : "memory");
            int least_c = NEVER, least_r = NEVER;
            for (int v = helper; v < BN; v += HELPERS) {
                const int col = col_block + v;
                const int pop = col < nb ? pop_b[col] : 0;
                pops_c[v] = pop;
                bound_c[v] = both && col < nb ? state_b[(size_t)col * k + k - 1] : 0;
                if (col < nb) least_c = min(least_c, pop);
            }
            for (int v = helper; v < BM; v += HELPERS) {
                const int r = row_block + v;
                float t = 0.0f, kk = ABOVE_ALL;
                if (r < na) {
                    const int pop = pop_a[r];
                    least_r = min(least_r, pop);
                    bound_line((unsigned)(state_a[(size_t)r * k + k - 1] >> 32), pop, metric,
                               filter, t, kk);
                }
                t_rows[v] = t;
                k_rows[v] = kk;
            }
            least_c = __reduce_min_sync(FULL_MASK, least_c);
            least_r = __reduce_min_sync(FULL_MASK, least_r);
            if (lane == 0) { atomicMin(least, least_c); atomicMin(least + 1, least_r); }
            asm volatile("bar.sync 2, %0;" :: "r"(HELPERS) : "memory");
            const float q_least_a = side(least[1], metric);
            for (int v = helper; v < BN; v += HELPERS) {
                float t = 0.0f, kk = ABOVE_ALL;
                if (both && col_block + v < nb)
                    bound_line((unsigned)(bound_c[v] >> 32), pops_c[v], metric, filter, t, kk);
                lo_c[v] = line_floor(t, q_least_a, kk);
            }
            barrier_arrive(COLUMNS_FULL(base) + 8 * b);
            ++i;
        }
        return;
    }

    const int warpgroup = warp / 4;
    const int row_local = warpgroup * 64 + (warp & 3) * 16 + lane / 4;
    unsigned long long* queue =
        static_cast<unsigned long long*>(shared_pointer(smem, TOP_K_DATA(base, 2))) + warp * QUEUE;
    unsigned g = 0, i = 0;
    for (unsigned tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int row_block, col_block;
        if (!tile_at(tile, na, nb, 0, row_block, col_block)) continue;
        int acc[ACC];
        counts_of_tile(acc, steps, base, g);
        const int b = i & 1;
        barrier_wait(COLUMNS_FULL(base) + 8 * b, (i >> 1) & 1);
        const unsigned long long* bound_c =
            static_cast<const unsigned long long*>(shared_pointer(smem, TOP_K_DATA(base, b)));
        const int* pops_c = reinterpret_cast<const int*>(bound_c + BN);
        const int* lo_c = pops_c + BN;
        const float q_least_b = side(lo_c[BN], metric);
        const float* t_rows = reinterpret_cast<const float*>(lo_c + BN + 4);
        int lo_r[2];
#pragma unroll
        for (int h = 0; h < 2; ++h)
            lo_r[h] = line_floor(t_rows[row_local + 8 * h], q_least_b,
                                 t_rows[BM + row_local + 8 * h]);
        // The 8-column steps at which a count of the warp reaches a floor, found first with no
        // branch (a step's vote and branch, each waiting on its floors' shared loads, took
        // 0.6 ms of a 32,768-row block's 1.4 ms on an H200; counts not even queued, 0.78 ms):
        // only those steps are taken again, their counts queued. The test is written twice on
        // purpose: one helper giving the 4-bit mask to both passes compiled to 200 more
        // instructions (nvcc 13.0), the first pass then building masks it only compares to 0.
        unsigned steps_hit = 0;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int* d = acc + 4 * j;
            const int2 lo2 = *reinterpret_cast<const int2*>(lo_c + 8 * j + 2 * (lane & 3));
            const bool hit = (d[0] >= min(lo_r[0], lo2.x)) | (d[1] >= min(lo_r[0], lo2.y))
                             | (d[2] >= min(lo_r[1], lo2.x)) | (d[3] >= min(lo_r[1], lo2.y));
            steps_hit |= (unsigned)hit << j;
        }
        steps_hit = __reduce_or_sync(FULL_MASK, steps_hit);
        int queued = 0;  // the same in every lane
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            if (!(steps_hit >> j & 1u)) continue;
            const int v0 = 8 * j + 2 * (lane & 3);
            const int* d = acc + 4 * j;
            const int2 lo2 = *reinterpret_cast<const int2*>(lo_c + v0);
            const unsigned hit = (unsigned)(d[0] >= min(lo_r[0], lo2.x))
                                 | (unsigned)(d[1] >= min(lo_r[0], lo2.y)) << 1
                                 | (unsigned)(d[2] >= min(lo_r[1], lo2.x)) << 2
                                 | (unsigned)(d[3] >= min(lo_r[1], lo2.y)) << 3;
            const int mine = __popc(hit);
            const int before = warp_inclusive_sum(mine, lane);
            const int total = __shfl_sync(FULL_MASK, before, 31);
            if (queued + total > QUEUE) {
                tested(queue, queued, row_block, col_block, na, nb, pop_a, pops_c, first_a,
                       first_b, state_a, bound_c, k, metric, exclude, both, slots_a, count_a,
                       slots_b, count_b, nslots, order_a, order_b);
                queued = 0;
            }
            int at = queued + before - mine;
#pragma unroll
            for (int q = 0; q < 4; ++q)
                if (hit >> q & 1u)
                    queue[at++] = (unsigned long long)d[q] << 32
                                  | (unsigned)(row_local + 8 * (q / 2)) << 16
                                  | (unsigned)(v0 + (q & 1));
            queued += total;
            __syncwarp();
        }
        tested(queue, queued, row_block, col_block, na, nb, pop_a, pops_c, first_a, first_b,
               state_a, bound_c, k, metric, exclude, both, slots_a, count_a, slots_b, count_b,
               nslots, order_a, order_b);
        barrier_arrive(COLUMNS_EMPTY(base) + 8 * b);
        ++i;
    }
}
"""

_PAIRS = r"""
extern "C" __global__ void __launch_bounds__(THREADS, 1)
pairs_at_least_wgmma(const void* __restrict__ map_a, const void* __restrict__ map_b,
                     int na, int nb, int steps, const int* __restrict__ pop_a,
                     const int* __restrict__ pop_b, long long first_a, long long first_b,
                     unsigned limit, int metric, int exclude, int upper,
                     unsigned long long* __restrict__ out, unsigned long long* __restrict__ found,
                     long long capacity)
{
    // As bmma_select's pairs_at_least: every pair whose rank is at most limit, appended to
    // out as (row id << 32 | column id, the score's bits); found counts them all.
    // Persistent: each block takes tiles blockIdx.x, + gridDim.x, ...; the producer thread
    // copies ahead, the helper warps fill the next tile's column popcounts (two buffers, in
    // turn) while the consumers select from this one.
#ifdef SELECT_METRIC
    metric = SELECT_METRIC;
#endif
    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned base = persistent_start(smem);
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const unsigned tiles = ((na + BM - 1) / BM) * ((nb + BN - 1) / BN);

    if (warp == PRODUCER) {
        if (lane == 0) copy_tiles(map_a, map_b, na, nb, steps, upper, base);
        return;
    }
    if (warp > PRODUCER) {
        const int helper = threadIdx.x - 32 * (PRODUCER + 1);
        unsigned i = 0;
        for (unsigned tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            int row_block, col_block;
            if (!tile_at(tile, na, nb, upper, row_block, col_block)) continue;
            const int b = i & 1;
            barrier_wait(COLUMNS_EMPTY(base) + 8 * b, ((i >> 1) & 1) ^ 1);
            int* pops_c = static_cast<int*>(shared_pointer(smem, COLUMN_DATA(base, b)));
            for (int v = helper; v < BN; v += HELPERS)
                pops_c[v] = col_block + v < nb ? pop_b[col_block + v] : 0;
            barrier_arrive(COLUMNS_FULL(base) + 8 * b);
            ++i;
        }
        return;
    }

    const int warpgroup = warp / 4;
    unsigned g = 0, i = 0;
    for (unsigned tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int row_block, col_block;
        if (!tile_at(tile, na, nb, upper, row_block, col_block)) continue;
        const int r0 = row_block + warpgroup * 64 + (warp & 3) * 16 + lane / 4;
        // A threshold is far above most pairs: each row's least count (no tile-wide setup,
        // whose barrier held each tile's first copies back: 0.92 s against 0.67 s for 10^6
        // rows at 0.7 on an H200) leaves out nearly all of them.
        int pop_r[2], least_r[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + 8 * h;
            pop_r[h] = r < na ? pop_a[r] : 0;
            least_r[h] = r < na ? least_count(limit, pop_r[h], metric) : NEVER;
        }
        int acc[ACC];
        counts_of_tile(acc, steps, base, g);
        const int b = i & 1;
        barrier_wait(COLUMNS_FULL(base) + 8 * b, (i >> 1) & 1);
        const int* pops_c = static_cast<const int*>(shared_pointer(smem, COLUMN_DATA(base, b)));
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int v0 = 8 * j + 2 * (lane & 3);
            const int* d = acc + 4 * j;
            const bool may = max(d[0], d[1]) >= least_r[0] || max(d[2], d[3]) >= least_r[1];
            // The whole warp takes each step (its shuffles need every lane): skipped only
            // where no lane has a pair that may pass.
            if (!__any_sync(FULL_MASK, may)) continue;
            unsigned kept = 0, ranks[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int h = q / 2, v = v0 + (q & 1), r = r0 + 8 * h, col = col_block + v;
                ranks[q] = 0;
                if (!may || r >= na || col >= nb || (upper && r > col)
                    || (exclude && first_a + r == first_b + col))
                    continue;
                ranks[q] = rank_of(d[q], pop_r[h], pops_c[v], metric);
                if (ranks[q] <= limit) kept |= 1u << q;
            }
            // The warp's pairs of this step in one atomic: each lane's place from an
            // exclusive scan of the lanes' counts.
            const int mine = __popc(kept);
            const int before = warp_inclusive_sum(mine, lane);
            const int total = __shfl_sync(FULL_MASK, before, 31);
            if (!total) continue;
            unsigned long long at = 0;
            if (lane == 31) at = atomicAdd(found, (unsigned long long)total);
            at = __shfl_sync(FULL_MASK, at, 31) + (unsigned long long)(before - mine);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                if (!(kept >> q & 1u)) continue;
                const int r = r0 + 8 * (q / 2), col = col_block + v0 + (q & 1);
                if (at < (unsigned long long)capacity) {
                    out[2 * at] = ((unsigned long long)(first_a + r) << 32)
                                  | (unsigned)(first_b + col);
                    out[2 * at + 1] = metric == 3 ? ranks[q] : 0xFFFFFFFFu - ranks[q];
                }
                ++at;
            }
        }
        barrier_arrive(COLUMNS_EMPTY(base) + 8 * b);
        ++i;
    }
}
"""

#: The kernels, by name: each a module of its own, for one metric (as bmma_select's: a job
#: compiles only what it runs, and the other metrics' branches fold away).
_KERNELS = {"top_k_candidates_wgmma": _TOP_K, "pairs_at_least_wgmma": _PAIRS}


def select_source(name: str, metric: str, tile: WgmmaTile = TILE) -> str:
    """The CUDA C++ of the selection kernel ``name`` (``"top_k_candidates_wgmma"`` or
    ``"pairs_at_least_wgmma"``) scoring by ``metric``, for ``tile``, for ``sm_90a``."""
    if name not in _KERNELS:
        raise ValueError(f"no wgmma selection kernel {name!r}; there are {tuple(_KERNELS)}")
    return (tile_source(tile) + f"#define SELECT_METRIC {cuda_metric_code(metric)}\n" + RANK_SOURCE
            + _SELECT + _KERNELS[name])
