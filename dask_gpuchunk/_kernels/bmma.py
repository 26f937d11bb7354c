"""Gram blocks on the 1-bit tensor cores: ``mma.sync.aligned.m16n8k256 .b1.and.popc``.

One instruction multiplies a 16 x 256-bit tile of A by a 256-bit x 8 tile of Bᵀ with AND and
POPC and adds into 16 x 8 int32 accumulators: exact, and on sm_80 and later the native BMMA
path. No library exposes it for ``A · Aᵀ`` (cuBLAS has no 1-bit GEMM), so the kernel is CUDA
C++ with inline PTX, compiled at first use with NVRTC through a CuPy ``RawModule`` for the
device's own architecture and cached per device and tile shape. A CuPy raw module was chosen
over numba's ``declare_device`` + ``link=`` because the whole kernel (asynchronous copies,
register fragments, unrolled MMA loop) is CUDA C++ either way and the raw module needs no glue
between two compilers.

Counts. An MMA does 16 x 8 x 256 bit-MACs on 2 x 512 bytes of operands; the H200 issues about
5e15 bit-MAC/s, so operands must be reused from registers and shared memory: a block tile of
``BM x BN`` rows moves ``(BM + BN)`` x 64 bytes per 512 bits of k through L2 for
``BM * BN / 64`` MMAs. Each block stages those tiles in shared memory with ``cp.async``
(``STAGES`` deep, so the copies of later k steps overlap the MMAs of this one; rows beyond the
data are zero-filled by the copy itself). Each warp computes ``WM x WN`` of C from shared
memory: per 512 bits a lane makes one 16-byte load per fragment row and issues two MMAs per
tile. The 512 bits are consumed in an order of our choosing (words 4t, 4t+1 for the first MMA's
t and t + 4, 4t+2, 4t+3 for the second's), the same for A and B, so every bit pair meets once:
a Gram sum does not depend on the order of its terms. Blocks wholly below the diagonal of a
symmetric block exit at once, warps wholly below it skip their MMAs, and the mirror fills the
lower triangle. No dask here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .compiled import compiled_once
from .gram import _mirror_cuda
from .launch import cupy_stream

__all__ = ["BMMA_MIN_CC", "TILE", "TILE_SOURCE", "BmmaTile", "GramBlock", "bmma_cuda",
           "bmma_supported", "gram_block", "tile_kernel", "words32"]

#: Compute capability from which ``mma.sync.m16n8k256 .b1.and.popc`` exists.
BMMA_MIN_CC = (8, 0)


class BmmaTile(NamedTuple):
    """How the kernel is cut: block tile ``bm x bn`` of C, warp tile ``wm x wn``, ``stages``
    copies in flight of ``kbits`` bits of k each, blocks launched in groups of ``group`` block
    rows (so that the blocks running at once share their rows of A and columns of B in L2), and
    ``split``: the first MMA of every tile before the second (more independent MMAs between two
    that add into the same accumulators) instead of the two back to back."""

    bm: int
    bn: int
    wm: int
    wn: int
    stages: int
    kbits: int = 512
    group: int = 1
    split: int = 0

    @property
    def threads(self) -> int:
        return 32 * (self.bm // self.wm) * (self.bn // self.wn)

    @property
    def shared_bytes(self) -> int:
        return self.stages * (self.bm + self.bn) * self.kbits // 8

    @property
    def kwords(self) -> int:
        """32-bit words of k per stage; the words of a row are padded to a multiple of it."""
        return self.kbits // 32


#: The tile used unless one is given (chosen by measurement; see the perf notes (git show 85dc246:docs/perf-notes.md)).
TILE = BmmaTile(128, 128, 64, 64, 3, kbits=1024, split=1)

#: The pieces every kernel on the 1-bit tensor cores shares (a tile's place in the grid and its
#: counts in registers), for :mod:`dask_gpuchunk._kernels.bmma_select`'s kernels too.
TILE_SOURCE = r"""
#define THREADS (32 * (BM / WM) * (BN / WN))
#define MI (WM / 16)
#define NJ (WN / 8)
#define ROW_VECS (KBITS / 128)  // uint4 per row per stage
#define HALVES (ROW_VECS / 4)   // 512-bit pieces per row per stage

__device__ __forceinline__ void copy16(uint4* dst, const unsigned* src, bool valid)
{
    // cp.async with src-size 0 zero-fills the 16 bytes: rows beyond the data read as zero.
    size_t shared;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(shared) : "l"(dst));
    const unsigned d = (unsigned)shared;
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(d), "l"(src), "r"(bytes));
}

__device__ __forceinline__ int slot_of(int r, int q)
{
    // Where vector q of row r lives in a stage: rows of more than 64 bytes are XOR-swizzled by
    // 64-byte halves so that the two rows a quarter-warp reads fall in different banks.
    return r * ROW_VECS + (q ^ ((r & (HALVES - 1)) << 2));
}

__device__ __forceinline__ void bmma(int* acc, const unsigned a0, const unsigned a1,
                                     const unsigned a2, const unsigned a3,
                                     const unsigned b0, const unsigned b1)
{
    asm("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(acc[0]), "+r"(acc[1]), "+r"(acc[2]), "+r"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

struct TilePlace {
    int row_block, col_block;  // the tile's first row and column of C
    int wr, wc;                // this warp's tile within it
    bool active;               // whether this warp has entries on or above the diagonal
};

__device__ __forceinline__ bool tile_place(int na, int nb, int upper, TilePlace& p)
{
    // One-dimensional grid, block rows taken GROUP at a time; false for a tile wholly below
    // the diagonal of a symmetric block (its mirror is computed).
    const int tiles_m = (na + BM - 1) / BM, tiles_n = (nb + BN - 1) / BN;
    const int per_group = GROUP * tiles_n;
    const int first_m = (blockIdx.x / per_group) * GROUP;
    const int rows_here = min(tiles_m - first_m, GROUP);
    const int in_group = blockIdx.x % per_group;
    p.row_block = (first_m + in_group % rows_here) * BM;
    p.col_block = (in_group / rows_here) * BN;
    if (upper && p.row_block >= p.col_block + BN) return false;
    const int warp = threadIdx.x >> 5;
    p.wr = (warp / (BN / WN)) * WM;
    p.wc = (warp % (BN / WN)) * WN;
    p.active = !(upper && p.row_block + p.wr >= p.col_block + p.wc + WN);
    return true;
}

__device__ __forceinline__ void tile_counts(int (&acc)[MI][NJ][4],
                                            const unsigned* __restrict__ a,
                                            const unsigned* __restrict__ b,
                                            int na, int nb, int kw, const TilePlace& p,
                                            uint4* smem)
{
    // a: na x kw and b: nb x kw 32-bit words, row-major, kw a multiple of KBITS / 32, 16-byte
    // aligned. Every thread of the block takes part in the copies; only active warps multiply.
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int row_block = p.row_block, col_block = p.col_block, wr = p.wr, wc = p.wc;
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = 0;

    const int steps = kw / (KBITS / 32);
    auto load_stage = [&](int slot, int step) {
        uint4* sa = smem + slot * (BM + BN) * ROW_VECS;
        uint4* sb = sa + BM * ROW_VECS;
        const int k = step * (KBITS / 32);
        // Unsigned: with signed division by ROW_VECS these few lines cost 20% of the kernel
        // (more registers, measured on the H200).
#pragma unroll
        for (unsigned v = tid; v < BM * ROW_VECS; v += THREADS) {
            const int r = v / ROW_VECS, q = v % ROW_VECS;
            const bool ok = row_block + r < na;
            copy16(sa + slot_of(r, q), ok ? a + (size_t)(row_block + r) * kw + k + 4 * q : a, ok);
        }
#pragma unroll
        for (unsigned v = tid; v < BN * ROW_VECS; v += THREADS) {
            const int r = v / ROW_VECS, q = v % ROW_VECS;
            const bool ok = col_block + r < nb;
            copy16(sb + slot_of(r, q), ok ? b + (size_t)(col_block + r) * kw + k + 4 * q : b, ok);
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) load_stage(s, s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    for (int step = 0; step < steps; ++step) {
        asm volatile("cp.async.wait_group %0;\n" :: "n"(STAGES - 2));
        __syncthreads();  // this step's tiles are in; every warp is done with the slot reused next
        const int next = step + STAGES - 1;
        if (next < steps) load_stage(next % STAGES, next);
        asm volatile("cp.async.commit_group;\n" ::);
        if (!p.active) continue;
        const uint4* sa = smem + (step % STAGES) * (BM + BN) * ROW_VECS;
        const uint4* sb = sa + BM * ROW_VECS;
#pragma unroll
        for (int h = 0; h < HALVES; ++h) {
            // 512 bits of a row per h: lane t loads words 4t..4t+3 of it with one 16-byte load.
            // The PTX fragment of m16n8k256 wants words t and t + 4 of 256 bits (a0 row g,
            // a1 row g + 8, a2 and a3 the same rows' upper words; b0, b1 column g; checked on
            // the H200 with the first version of this kernel, commit 8ea0fe0); words 4t, 4t+1
            // play those parts in the first MMA and 4t+2, 4t+3 in the second. A and B take the
            // same order, so every bit pair still meets once.
            uint4 av[MI][2];
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                av[i][0] = sa[slot_of(wr + i * 16 + g, t + 4 * h)];
                av[i][1] = sa[slot_of(wr + i * 16 + g + 8, t + 4 * h)];
            }
            if (SPLIT) {
                uint4 bv[NJ];
#pragma unroll
                for (int j = 0; j < NJ; ++j) bv[j] = sb[slot_of(wc + j * 8 + g, t + 4 * h)];
#pragma unroll
                for (int i = 0; i < MI; ++i)
#pragma unroll
                    for (int j = 0; j < NJ; ++j)
                        bmma(acc[i][j], av[i][0].x, av[i][1].x, av[i][0].y, av[i][1].y, bv[j].x, bv[j].y);
#pragma unroll
                for (int i = 0; i < MI; ++i)
#pragma unroll
                    for (int j = 0; j < NJ; ++j)
                        bmma(acc[i][j], av[i][0].z, av[i][1].z, av[i][0].w, av[i][1].w, bv[j].z, bv[j].w);
            } else {
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
                    const uint4 bv = sb[slot_of(wc + j * 8 + g, t + 4 * h)];
#pragma unroll
                    for (int i = 0; i < MI; ++i) {
                        bmma(acc[i][j], av[i][0].x, av[i][1].x, av[i][0].y, av[i][1].y, bv.x, bv.y);
                        bmma(acc[i][j], av[i][0].z, av[i][1].z, av[i][0].w, av[i][1].w, bv.z, bv.w);
                    }
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
}
"""

_SOURCE = TILE_SOURCE + r"""
extern "C" __global__ void __launch_bounds__(THREADS, 1)
gram_bmma(const unsigned* __restrict__ a, const unsigned* __restrict__ b, int* __restrict__ c,
          int na, int nb, int kw, int ldc, int upper, int pair_store)
{
    extern __shared__ uint4 smem[];
    TilePlace p;
    if (!tile_place(na, nb, upper, p)) return;  // the mirror of a tile above
    int acc[MI][NJ][4];
    tile_counts(acc, a, b, na, nb, kw, p, smem);
    if (!p.active) return;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < MI; ++i) {
        const int r0 = p.row_block + p.wr + i * 16 + g, r1 = r0 + 8;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const int c0 = p.col_block + p.wc + j * 8 + 2 * t;
            if (pair_store && c0 + 1 < nb) {  // 8-byte stores where C's rows allow them
                if (r0 < na) *reinterpret_cast<int2*>(c + (size_t)r0 * ldc + c0) = make_int2(acc[i][j][0], acc[i][j][1]);
                if (r1 < na) *reinterpret_cast<int2*>(c + (size_t)r1 * ldc + c0) = make_int2(acc[i][j][2], acc[i][j][3]);
                continue;
            }
            if (r0 < na) {
                if (c0 < nb) c[(size_t)r0 * ldc + c0] = acc[i][j][0];
                if (c0 + 1 < nb) c[(size_t)r0 * ldc + c0 + 1] = acc[i][j][1];
            }
            if (r1 < na) {
                if (c0 < nb) c[(size_t)r1 * ldc + c0] = acc[i][j][2];
                if (c0 + 1 < nb) c[(size_t)r1 * ldc + c0 + 1] = acc[i][j][3];
            }
        }
    }
}
"""

def bmma_supported() -> bool:
    """Whether the current CUDA device has 1-bit MMA (compute capability 8.0 or later)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    return (int(props["major"]), int(props["minor"])) >= BMMA_MIN_CC


def _check_tile(tile: BmmaTile) -> None:
    if tile.wm % 16 or tile.wn % 8 or tile.bm % tile.wm or tile.bn % tile.wn or tile.stages < 2:
        raise ValueError(f"bad bmma tile {tile}: wm a multiple of 16, wn of 8, bm of wm, "
                         "bn of wn, stages >= 2")
    if tile.threads > 1024:
        raise ValueError(f"bad bmma tile {tile}: {tile.threads} threads per block (at most 1024)")
    if tile.kbits not in (512, 1024, 2048) or tile.group < 1 or tile.split not in (0, 1):
        raise ValueError(f"bad bmma tile {tile}: kbits 512, 1024 or 2048, group >= 1, split 0 or 1")


def _kernel(tile: BmmaTile) -> Any:
    """The compiled Gram kernel for the current device and tile (NVRTC at first use, then
    cached)."""
    return tile_kernel(tile, _SOURCE, "gram_bmma")


def tile_kernel(tile: BmmaTile, source: str, name: str) -> Any:
    """Kernel ``name`` of ``source`` (which builds on :data:`TILE_SOURCE`) compiled for the
    current device with ``tile``'s shape, at first use, then cached."""
    import cupy

    return _compiled_kernel(cupy.cuda.runtime.getDevice(), tile, source, name)


@compiled_once
def _compiled_kernel(device: int, tile: BmmaTile, source: str, name: str) -> Any:
    import cupy

    _check_tile(tile)
    props = cupy.cuda.runtime.getDeviceProperties(device)
    arch = f"sm_{props['major']}{props['minor']}"
    defines = "".join(f"#define {key.upper()} {value}\n"
                      for key, value in tile._asdict().items())
    module = cupy.RawModule(code=defines + source,
                            options=("-std=c++17", f"--gpu-architecture={arch}"))
    kernel = module.get_function(name)
    kernel.max_dynamic_shared_size_bytes = tile.shared_bytes
    return kernel


def words32(words: Any, kbits: int) -> Any:
    """``uint64`` words ``(n, m)`` as ``uint32`` ``(n, kw)``: rows zero-padded to a multiple of
    ``kbits`` bits, 16-byte aligned."""
    import cupy

    n, m = words.shape
    per_stage = kbits // 64
    padded_m = -(-m // per_stage) * per_stage
    if padded_m != m or not words.flags.c_contiguous or words.data.ptr % 16:
        padded = cupy.zeros((n, padded_m), dtype=np.uint64)
        padded[:, :m] = words
        words = padded
    return words.view(np.uint32).reshape(n, 2 * padded_m)


def bmma_cuda(a: Any, b: Any | None, c: Any, stream: Any = 0, tile: BmmaTile = TILE) -> None:
    """Gram block ``c = popcount(a & b)`` per pair of rows on the 1-bit tensor cores.

    ``a``, ``b``: CuPy ``uint64`` words (``b=None``: the symmetric ``a · aᵀ``, upper tiles then
    mirrored); ``c``: CuPy ``int32`` ``(na, nb)``, C-contiguous. Queued on ``stream`` (a numba
    stream).
    """
    with cupy_stream(stream):
        _bmma(a, b, c, stream, tile)


class GramBlock(NamedTuple):
    """A Gram block's shape as the 1-bit tensor-core kernels launch it."""

    na: int
    nb: int
    diagonal: bool  # b is None: the symmetric a · aᵀ
    pair_store: bool  # whether C's rows allow 8-byte stores of two counts


def gram_block(a: Any, b: Any | None, c: Any) -> GramBlock | None:
    """``a · bᵀ`` (``b=None``: ``a · aᵀ``) into ``c``, checked; ``None`` where there is nothing
    to launch (an empty block, or no bits: then ``c`` is zeroed)."""
    diagonal = b is None
    na = a.shape[0]
    nb = na if diagonal else b.shape[0]
    if na == 0 or nb == 0:
        return None
    if a.shape[1] == 0:
        c[...] = 0
        return None
    if not c.flags.c_contiguous or c.shape != (na, nb):
        raise ValueError(f"c must be a C-contiguous ({na}, {nb}) array")
    return GramBlock(na, nb, diagonal, c.shape[1] % 2 == 0 and c.data.ptr % 8 == 0)


def _bmma(a: Any, b: Any | None, c: Any, stream: Any, tile: BmmaTile) -> None:
    block = gram_block(a, b, c)
    if block is None:
        return
    a32 = words32(a, tile.kbits)
    b32 = a32 if block.diagonal else words32(b, tile.kbits)
    grid = (-(-block.nb // tile.bn) * -(-block.na // tile.bm),)
    args = (a32, b32, c, np.int32(block.na), np.int32(block.nb), np.int32(a32.shape[1]),
            np.int32(c.shape[1]), np.int32(block.diagonal), np.int32(block.pair_store))
    _kernel(tile)(grid, (tile.threads,), args, shared_mem=tile.shared_bytes)
    if block.diagonal:
        _mirror_cuda(c, stream)
