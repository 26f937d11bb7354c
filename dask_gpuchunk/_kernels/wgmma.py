"""Gram blocks on Hopper's warpgroup tensor-core instruction: ``wgmma.mma_async ... .b1.and.popc``.

``method="wgmma"`` of :func:`dask_gpuchunk.gram` (and ``"auto"`` on compute capability 9.0).
Where :mod:`dask_gpuchunk._kernels.bmma` has each warp issue ``mma.sync.m16n8k256`` on
fragments it loaded into registers, here a warpgroup (four warps, 128 threads) issues one
``m64nNk256`` instruction that reads both operands from shared memory itself, through 64-bit
matrix descriptors, and runs asynchronously. The counts per instruction are 64 x N x 256
bit-MACs (N = 128: 2.1 million) against 16 x 8 x 256 for ``mma.sync``; nothing passes through
registers but the int32 accumulators (``N / 2`` a thread).

Warp-specialised. A block tile of ``BM x BN`` has ``BM / 64`` consumer warpgroups (each 64
rows by all ``BN`` columns, ``BN / 128`` ``m64n128k256`` instructions a 256-bit k step) and one
producer thread that keeps ``STAGES`` stages of ``KBITS`` bits in flight: for each, one bulk
copy (``cp.async.bulk``, the copy engine behind TMA) per 128-row block of the tile's rows of A
and of B, counted on the stage's "full" mbarrier; the consumers wait on it, issue their
instructions, and once those are done (``wgmma.wait_group``) arrive on the stage's "empty"
barrier, which the producer waits on before refilling it. No ``__syncthreads`` in the loop.

Layout. ``wgmma`` reads K-major 1-bit operands as "core matrices" of 8 rows x 16 bytes (128
bits), each 128 contiguous bytes. A 128-row block's stage is held as ``[16-byte column][8-row
group][row in group]``: core matrices adjacent in k 2 KiB apart (the descriptor's leading byte
offset), adjacent in rows 128 bytes apart (its stride byte offset); no swizzle, no bank
conflicts. Each launch first lays its operands out in memory that way (:func:`tiled_words`,
one pass, zero-padded to whole blocks and stages), so that a block's stage is one contiguous
16 KiB copy, and the same array serves as A and as B. Which 128 bits of a row an instruction
takes first does not matter: A and B share the layout, so every bit pair meets once. Of a
symmetric block only the tiles on and above the diagonal run, and each stores its counts above
the diagonal at their mirror too (no second pass over C).

Measured (H200, 16384 rows x 131072 bits, C on the device, the layout pass included): full C
6.2e15 bit-MAC/s against bmma's 1.9e15; symmetric 2.99 ms, 1.18e16 effective (N·N·K / t);
65,536 rows x 2048 bits 5.9 ms against bmma's 18.2 (C's 17 GB written is the time there). On
the way (``docs/perf-notes.md``): every thread copying 16 bytes at a time (``cp.async``) with
two ``__syncthreads`` a stage reached 1.5-1.9e15, its copies the whole time; bulk copies of
1 KiB 2.3e15; clusters of two blocks sharing B's copies (``.multicast::cluster``) gained
nothing over this. No dask here.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from .compiled import compiled_once
from .launch import cupy_stream

__all__ = ["BLOCK", "TILE", "WGMMA_CC", "WgmmaTile", "compile_for_sm90a", "kernel_source",
           "launch", "tiled_words", "wgmma_cuda", "wgmma_supported"]

#: The compute capability with ``wgmma`` (``sm_90a``: Hopper's architecture-specific features).
WGMMA_CC = (9, 0)


class WgmmaTile(NamedTuple):
    """How the kernel is cut: block tile ``bm x bn`` of C (``bm / 64`` consumer warpgroups,
    each 64 rows by all ``bn`` columns, ``bn / 128`` ``m64n128k256`` instructions a 256-bit k
    step), ``stages`` copies in flight of ``kbits`` bits of k each, tiles launched in groups
    of ``group`` rows of tiles (the blocks running at once share their rows of A and columns
    of B in L2)."""

    bm: int = 128
    bn: int = 256
    stages: int = 4
    kbits: int = 1024
    group: int = 8

    @property
    def warpgroups(self) -> int:
        return self.bm // 64

    @property
    def threads(self) -> int:
        """The consumer warpgroups and the producer's (one warp of it copies)."""
        return 128 * self.warpgroups + 128

    @property
    def shared_bytes(self) -> int:
        """The stages, then two 8-byte barriers a stage."""
        return self.stages * (self.bm + self.bn) * self.kbits // 8 + 16 * self.stages


#: The tile used unless one is given (not yet measured: a first guess, 192 KiB of shared
#: memory, 128 accumulators a thread).
TILE = WgmmaTile()

#: Rows of a block of the tiled operands (:func:`tiled_words`): a bulk copy of a stage, and the
#: ``N`` of each instruction (``m64n128k256``), so that one layout serves as A and as B.
BLOCK = 128


def _check_tile(tile: WgmmaTile) -> None:
    if (tile.bm not in (BLOCK, 2 * BLOCK) or tile.bn not in (BLOCK, 2 * BLOCK)
            or tile.stages < 2 or tile.kbits % 256 or not 256 <= tile.kbits <= 2048
            or tile.group < 1):
        raise ValueError(f"bad wgmma tile {tile}: bm and bn {BLOCK} or {2 * BLOCK}; stages >= 2; "
                         "kbits a multiple of 256 up to 2048; group >= 1")
    if tile.shared_bytes > 227 * 1024:
        raise ValueError(f"bad wgmma tile {tile}: {tile.shared_bytes:,} bytes of shared memory "
                         "(at most 227 KiB a block on sm_90)")


def _mma_source(bn: int) -> str:
    """The inline PTX of one ``m64n{bn}k256`` instruction: its ``bn / 2`` accumulators a thread
    listed one by one (PTX takes no arrays), then the two descriptors and whether to add."""
    regs = bn // 2
    operands = ", ".join(f"%{i}" for i in range(regs))
    outputs = ", ".join(f'"+r"(d[{i}])' for i in range(regs))
    return (
        "__device__ __forceinline__ void mma_b1(int (&d)[" + str(regs) + "], "
        "unsigned long long a_desc, unsigned long long b_desc, int add)\n{\n"
        '    asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(regs + 2) + ', 0;\\n"\n'
        f'        "wgmma.mma_async.sync.aligned.m64n{bn}k256.s32.b1.b1.and.popc "\n'
        f'        "{{{operands}}}, %{regs}, %{regs + 1}, p;\\n}}\\n"\n'
        f"        : {outputs}\n"
        '        : "l"(a_desc), "l"(b_desc), "r"(add));\n'
        "}\n")


_BODY = r"""
#define WARPGROUPS (BM / 64)          // consumers: a warpgroup per 64 rows of the tile
#define PRODUCER (4 * WARPGROUPS)     // the first warp of the warpgroup after them copies
#define THREADS (128 * WARPGROUPS + 128)
#define ACC (BN / 2)                  // int32 accumulators a thread: 64 x BN over 128 threads
#define CHUNKS (KBITS / 128)          // 16-byte columns of a row a stage
#define STEPS_K (KBITS / 256)         // instructions a stage
#define BLOCK 128                     // rows of a block of the tiled operands
#define BLOCK_BYTES (BLOCK * KBITS / 8) // a block's stage: one bulk copy
#define NSUB (BN / BLOCK)             // instructions a k step, m64n128 each

__device__ __forceinline__ unsigned shared_address(const void* p)
{
    size_t s;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(s) : "l"(p));
    return (unsigned)s;
}

__device__ __forceinline__ void barrier_init(unsigned bar, unsigned count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void barrier_wait(unsigned bar, unsigned parity)
{
    // Until the phase of this parity has completed (a new barrier's phase "1" counts as done).
    unsigned done = 0;
    while (!done)
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ void barrier_arrive(unsigned bar)
{
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n"
                 :: "r"(bar) : "memory");
}

__device__ __forceinline__ void barrier_arrive_expecting(unsigned bar, unsigned bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_copy(unsigned dst, const unsigned char* src,
                                          unsigned bytes, unsigned bar)
{
    // The copy engine moves the bytes and counts them on the stage's barrier.
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1], %2, [%3];\n"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ unsigned long long descriptor(unsigned address, unsigned leading,
                                                         unsigned stride)
{
    // Start address, leading and stride byte offsets, each in 16-byte units; base offset 0,
    // no swizzle (bits 62-63 zero).
    return (unsigned long long)((address & 0x3FFFF) >> 4)
         | ((unsigned long long)((leading & 0x3FFFF) >> 4) << 16)
         | ((unsigned long long)((stride & 0x3FFFF) >> 4) << 32);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
gram_wgmma(const unsigned char* __restrict__ a, const unsigned char* __restrict__ b,
           int* __restrict__ c, int na, int nb, int blocks_a, int blocks_b, int steps, int ldc,
           int upper, int pair_store)
{
    // a, b: the operands tiled (tiled_words), blocks_a and blocks_b blocks of BLOCK rows,
    // `steps` stages of KBITS bits a row. One-dimensional grid, rows of tiles taken GROUP at a
    // time; a tile wholly below the diagonal of a symmetric block returns at once (its mirror
    // is computed).
    extern __shared__ __align__(128) unsigned char smem[];
    const int tiles_m = (na + BM - 1) / BM, tiles_n = (nb + BN - 1) / BN;
    const int per_group = GROUP * tiles_n;
    const int first_m = (blockIdx.x / per_group) * GROUP;
    const int rows_here = min(tiles_m - first_m, GROUP);
    const int in_group = blockIdx.x % per_group;
    const int row_block = (first_m + in_group % rows_here) * BM;
    const int col_block = (in_group / rows_here) * BN;
    if (upper && row_block >= col_block + BN) return;

    const unsigned stage_bytes = (BM + BN) * CHUNKS * 16;
    const unsigned base = shared_address(smem);
    // Stage s is full once its copies have landed (full[s]: the producer's arrival and the
    // bytes), empty once every consumer warp's instructions reading it are done.
    const unsigned full = base + STAGES * stage_bytes, empty = full + 8 * STAGES;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(full + 8 * s, 1);
            barrier_init(empty + 8 * s, 4 * WARPGROUPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;

    if (warp >= PRODUCER) {
        if (threadIdx.x != PRODUCER * 32) return;
        // A stage is a copy per block of the tile's rows of A and of B (KBITS bits of each
        // row, laid out in memory as in the stage: tiled_words). A tile's last blocks may lie
        // past the operand's: not copied, what the stage holds there from before only reaches
        // C's rows and columns past the data, which are not stored.
        const int first_a = row_block / BLOCK, first_b = col_block / BLOCK;
        const int pieces_a = min(BM / BLOCK, blocks_a - first_a);
        const int pieces_b = min(BN / BLOCK, blocks_b - first_b);
        const unsigned bytes = (pieces_a + pieces_b) * BLOCK_BYTES;
        for (int step = 0; step < steps; ++step) {
            const int slot = step % STAGES;
            const unsigned at = base + slot * stage_bytes, bar = full + 8 * slot;
            barrier_wait(empty + 8 * slot, ((step / STAGES) & 1) ^ 1);
            barrier_arrive_expecting(bar, bytes);
            for (int p = 0; p < pieces_a; ++p)
                bulk_copy(at + p * BLOCK_BYTES,
                          a + ((size_t)(first_a + p) * steps + step) * BLOCK_BYTES,
                          BLOCK_BYTES, bar);
            for (int p = 0; p < pieces_b; ++p)
                bulk_copy(at + (BM / BLOCK + p) * BLOCK_BYTES,
                          b + ((size_t)(first_b + p) * steps + step) * BLOCK_BYTES,
                          BLOCK_BYTES, bar);
        }
        return;
    }

    const int warpgroup = warp / 4;
    int acc[ACC];
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0;
    for (int step = 0; step < steps; ++step) {
        const int slot = step % STAGES;
        barrier_wait(full + 8 * slot, (step / STAGES) & 1);
        const unsigned at = base + slot * stage_bytes;
        // This warpgroup's 64 rows: 8 row groups of its block of A; B's blocks after A's.
        const unsigned a_at = at + (warpgroup / 2) * BLOCK_BYTES + (warpgroup % 2) * 64 * 16;
        const unsigned b_at = at + (BM / BLOCK) * BLOCK_BYTES;
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int s = 0; s < STEPS_K; ++s) {
            const unsigned long long a_desc = descriptor(a_at + 2 * s * BLOCK * 16, BLOCK * 16, 128);
#pragma unroll
            for (int h = 0; h < NSUB; ++h)  // columns 128 h to 128 h + 127: accumulators 64 h on
                mma_b1(*reinterpret_cast<int(*)[64]>(acc + 64 * h), a_desc,
                       descriptor(b_at + h * BLOCK_BYTES + 2 * s * BLOCK * 16, BLOCK * 16, 128), 1);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        // The previous step's instructions are done: its stage may take new copies.
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        if (step > 0 && lane == 0) barrier_arrive(empty + 8 * ((step - 1) % STAGES));
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");

    // Accumulator i of a thread: row 16 * warp + lane / 4 (+ 8 for i % 4 >= 2) of the
    // warpgroup's 64, column 8 * (i / 4) + 2 * (lane % 4) (+ 1 for odd i). Of a symmetric
    // block, each count above the diagonal is also stored at its mirror: for one register
    // the warp's 32 stores there fill four whole 32-byte sectors, and C is written once.
    const int r0 = row_block + warpgroup * 64 + (warp & 3) * 16 + lane / 4, r1 = r0 + 8;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int c0 = col_block + 8 * j + 2 * (lane & 3), c1 = c0 + 1;
        const int* d = acc + 4 * j;
        if (pair_store && c1 < nb) {  // 8-byte stores where C's rows allow them
            if (r0 < na) *reinterpret_cast<int2*>(c + (size_t)r0 * ldc + c0) = make_int2(d[0], d[1]);
            if (r1 < na) *reinterpret_cast<int2*>(c + (size_t)r1 * ldc + c0) = make_int2(d[2], d[3]);
        } else {
            if (r0 < na) {
                if (c0 < nb) c[(size_t)r0 * ldc + c0] = d[0];
                if (c1 < nb) c[(size_t)r0 * ldc + c1] = d[1];
            }
            if (r1 < na) {
                if (c0 < nb) c[(size_t)r1 * ldc + c0] = d[2];
                if (c1 < nb) c[(size_t)r1 * ldc + c1] = d[3];
            }
        }
        if (upper) {
            if (c0 < nb) {
                if (r0 < c0) c[(size_t)c0 * ldc + r0] = d[0];
                if (r1 < c0) c[(size_t)c0 * ldc + r1] = d[2];
            }
            if (c1 < nb) {
                if (r0 < c1) c[(size_t)c1 * ldc + r0] = d[1];
                if (r1 < c1) c[(size_t)c1 * ldc + r1] = d[3];
            }
        }
    }
}
"""


def kernel_source(tile: WgmmaTile = TILE) -> str:
    """The CUDA C++ of :func:`wgmma_cuda`'s kernel ``gram_wgmma`` for ``tile``, for
    ``sm_90a``."""
    _check_tile(tile)
    defines = "".join(f"#define {key.upper()} {value}\n" for key, value in tile._asdict().items())
    return defines + _mma_source(BLOCK) + _BODY


def wgmma_supported() -> bool:
    """Whether the current CUDA device is a Hopper (compute capability 9.0: ``sm_90a``)."""
    import cupy

    return _is_hopper(cupy.cuda.runtime.getDevice())


@functools.cache
def _is_hopper(device: int) -> bool:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device)
    return (int(props["major"]), int(props["minor"])) == WGMMA_CC


class _Compiled(NamedTuple):
    module: Any  # kept: the kernel lives as long as its module
    kernel: Any


#: CUDA's ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``.
_MAX_DYNAMIC_SHARED = 8


@compiled_once
def _compiled_kernel(device: int, tile: WgmmaTile) -> _Compiled:
    """The kernel for ``tile`` on ``device``, compiled at first use (:func:`compile_for_sm90a`)."""
    return compile_for_sm90a(kernel_source(tile), tile.shared_bytes)


def compile_for_sm90a(source: str, shared_bytes: int) -> _Compiled:
    """Kernel ``gram_wgmma`` of ``source`` compiled by NVRTC for ``sm_90a`` on the current
    device, allowed ``shared_bytes`` of dynamic shared memory.

    Through NVRTC itself, not a CuPy ``RawModule``: CuPy adds its own ``-arch=sm_90`` after
    the options it is given, and ``wgmma`` exists only in ``sm_90a``."""
    from cupy.cuda import function
    from cupy_backends.cuda.api import driver
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(source, "gram_wgmma.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(program, ("-std=c++17", "--gpu-architecture=sm_90a"))
        except nvrtc.NVRTCError as exc:
            raise RuntimeError("NVRTC could not compile the wgmma kernel: "
                               f"{nvrtc.getProgramLog(program)}") from exc
        cubin = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    module = function.Module()
    module.load(cubin)
    kernel = module.get_function("gram_wgmma")
    driver.funcSetAttribute(kernel.ptr, _MAX_DYNAMIC_SHARED, shared_bytes)
    return _Compiled(module, kernel)


def wgmma_cuda(a: Any, b: Any | None, c: Any, stream: Any = 0, tile: WgmmaTile = TILE) -> None:
    """Gram block ``c = popcount(a & b)`` per pair of rows with ``wgmma`` (Hopper only).

    ``a``, ``b``: CuPy ``uint64`` words (``b=None``: the symmetric ``a · aᵀ``, the tiles on
    and above the diagonal, each count above it stored at its mirror too); ``c``: CuPy
    ``int32`` ``(na, nb)``, C-contiguous. Queued on ``stream`` (a numba stream). As
    :func:`~dask_gpuchunk._kernels.bmma.bmma_cuda`.
    """
    import cupy

    device = cupy.cuda.runtime.getDevice()
    if not _is_hopper(device):
        raise RuntimeError("method 'wgmma' needs a compute capability 9.0 GPU (Hopper); "
                           "use 'bmma' or 'auto' on this one")
    with cupy_stream(stream):
        launch(_compiled_kernel(device, tile).kernel, a, b, c, tile)


#: One pass from row-major words to :func:`tiled_words`' layout, zeros where the padding is:
#: a thread per 16 bytes, taken in the words' order (a warp reads 4 rows x 128 bytes; its
#: writes are 8 runs of 64 bytes): 0.17 ms for 268 MB on an H200, against 0.20 ms with the
#: writes in order and the reads scattered.
_TILING_SOURCE = r"""
extern "C" __global__ void tile_words(const unsigned long long* __restrict__ words,
                                      ulonglong2* __restrict__ out, long long n, long long m,
                                      long long stages, long long chunks, long long total)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long column = i % chunks, rest = i / chunks;  // [block][stage][row][column]
        const long long in_block = rest % 128, step = (rest / 128) % stages;
        const long long block = rest / 128 / stages, row = block * 128 + in_block;
        const long long word = (step * chunks + column) * 2;
        ulonglong2 v = make_ulonglong2(0ull, 0ull);
        if (row < n) {
            if (word < m) v.x = words[row * m + word];
            if (word + 1 < m) v.y = words[row * m + word + 1];
        }
        out[((block * stages + step) * chunks + column) * 128 + in_block] = v;
    }
}
"""


@functools.cache
def _tiling_kernel(device: int) -> Any:
    import cupy

    return cupy.RawKernel(_TILING_SOURCE, "tile_words")


def tiled_words(words: Any, kbits: int) -> Any:
    """``uint64`` words ``(n, m)`` as the kernel's copies take them, in one pass: rows
    zero-padded to a multiple of :data:`BLOCK` and bits to a multiple of ``kbits``, laid out
    as ``[block of BLOCK rows][stage of kbits][16-byte column][8-row group][row in group]``:
    a block's stage is contiguous (one bulk copy) and lands in shared memory as wgmma's core
    matrices. The same array is A and B."""
    import cupy

    words = cupy.ascontiguousarray(words)
    n, m = words.shape
    chunks = kbits // 128
    stages, blocks = -(-m // (2 * chunks)), -(-n // BLOCK)
    out = cupy.empty((blocks, stages, chunks, BLOCK, 2), dtype=np.uint64)
    total = out.size // 2
    if total:
        _tiling_kernel(cupy.cuda.runtime.getDevice())(
            (min(-(-total // 256), 65536),), (256,),
            (words, out, np.int64(n), np.int64(m), np.int64(stages), np.int64(chunks),
             np.int64(total)))
    return out


def launch(kernel: Any, a: Any, b: Any | None, c: Any, tile: WgmmaTile) -> None:
    """:func:`wgmma_cuda`'s work with ``kernel`` (compiled from :func:`kernel_source` of
    ``tile``, or a variant of it), on CuPy's current stream."""
    diagonal = b is None
    na = a.shape[0]
    nb = na if diagonal else b.shape[0]
    if na == 0 or nb == 0:
        return
    if not c.flags.c_contiguous or c.shape != (na, nb):
        raise ValueError(f"c must be a C-contiguous ({na}, {nb}) array")
    if a.shape[1] == 0:
        c[...] = 0
        return
    ta = tiled_words(a, tile.kbits)
    tb = ta if diagonal else tiled_words(b, tile.kbits)
    pair_store = c.shape[1] % 2 == 0 and c.data.ptr % 8 == 0
    grid = (-(-nb // tile.bn) * -(-na // tile.bm),)
    args = (ta, tb, c, np.int32(na), np.int32(nb), np.int32(ta.shape[0]), np.int32(tb.shape[0]),
            np.int32(ta.shape[1]), np.int32(c.shape[1]), np.int32(diagonal),
            np.int32(pair_store))
    kernel(grid, (tile.threads,), args, shared_mem=tile.shared_bytes)
