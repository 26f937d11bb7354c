"""Gram blocks on Hopper's warpgroup tensor-core instruction: ``wgmma.mma_async ... .b1.and.popc``.

``method="wgmma"`` of :func:`dask_gpuchunk.gram` (and ``"auto"`` on compute capability 9.0).
Where :mod:`dask_gpuchunk._kernels.bmma` has each warp issue ``mma.sync.m16n8k256`` on
fragments it loaded into registers, here a warpgroup (four warps, 128 threads) issues one
``m64nNk256`` instruction that reads both operands from shared memory itself, through 64-bit
matrix descriptors, and runs asynchronously. The counts per instruction are 64 x N x 256
bit-MACs (N = 256: 4.2 million) against 16 x 8 x 256 for ``mma.sync``; nothing passes through
registers but the int32 accumulators (``N / 2`` a thread).

Warp-specialised. A block tile of ``BM x BN`` has ``BM / 64`` consumer warpgroups (each 64
rows by all ``BN`` columns) and one producer thread that keeps ``STAGES`` stages of ``KBITS``
bits in flight: for each, two bulk copies (``cp.async.bulk``, the copy engine behind TMA) of
the tile's rows of A and of B, counted on the stage's "full" mbarrier; the consumers wait on
it, issue ``KBITS / 256`` instructions, and once those are done (``wgmma.wait_group``) arrive
on the stage's "empty" barrier, which the producer waits on before refilling it. No
``__syncthreads`` in the loop.

Layout. ``wgmma`` reads K-major 1-bit operands as "core matrices" of 8 rows x 16 bytes (128
bits), each 128 contiguous bytes. A stage holds each operand's rows as ``[16-byte column][8-row
group][row in group]``: core matrices adjacent in k ``rows x 16`` bytes apart (the descriptor's
leading byte offset), adjacent in rows 128 bytes apart (its stride byte offset); no swizzle, no
bank conflicts. Each launch first lays its operands out in memory that way
(:func:`tiled_words`: A by ``BM`` rows, B by ``BN``, zero-padded to whole tiles and stages),
so that a tile's stage is one contiguous copy: 16 and 32 KiB with the default tile. Which 128
bits of a row an instruction takes first does not matter: A and B share the layout, so every
bit pair meets once. Of a symmetric block only the tiles on and above the diagonal run, and
each stores its counts above the diagonal at their mirror too (no second pass over C).

Measured (H200, 16384 rows x 131072 bits, C on the device, tiling included): full C 5.4e15
bit-MAC/s against bmma's 1.9e15; symmetric 7.3e15 effective (N·N·K / t). On the way
(``docs/perf-notes.md``): the first version, with every thread copying 16 bytes at a time
(``cp.async``) and two ``__syncthreads`` a stage, reached 1.5-1.9e15, its instructions alone
7.3e15 and its copies alone the whole time; 1 KiB bulk copies 2.3e15. No dask here.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from .compiled import compiled_once
from .launch import cupy_stream

__all__ = ["TILE", "WGMMA_CC", "WgmmaTile", "compile_for_sm90a", "kernel_source",
           "launch", "tiled_words", "wgmma_cuda", "wgmma_supported"]

#: The compute capability with ``wgmma`` (``sm_90a``: Hopper's architecture-specific features).
WGMMA_CC = (9, 0)


class WgmmaTile(NamedTuple):
    """How the kernel is cut: block tile ``bm x bn`` of C (``bm / 64`` warpgroups, each 64
    rows by all ``bn`` columns, one ``m64n{bn}k256`` instruction a 256-bit k step), ``stages``
    copies in flight of ``kbits`` bits of k each, blocks launched in groups of ``group`` block
    rows (the blocks running at once share their rows of A and columns of B in L2)."""

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

#: Shapes ``wgmma`` has for 1-bit operands: ``m64nNk256`` with N one of these.
_N_SHAPES = (8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256)


def _check_tile(tile: WgmmaTile) -> None:
    if (tile.bm % 64 or not 64 <= tile.bm <= 256 or tile.bn not in _N_SHAPES
            or tile.stages < 2 or tile.kbits % 256 or not 256 <= tile.kbits <= 2048
            or tile.group < 1):
        raise ValueError(f"bad wgmma tile {tile}: bm 64, 128, 192 or 256; bn one of wgmma's "
                         f"1-bit N {_N_SHAPES}; stages >= 2; kbits a multiple of 256 up to "
                         "2048; group >= 1")
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
#if WARPGROUPS == 3
// 512 threads get 128 registers each, fewer than a consumer of m64n256 needs (154): the
// producer's warpgroup gives most of its own to the consumers.
#define PRODUCER_REGISTERS 32
#define CONSUMER_REGISTERS 160
#endif
#define ACC (BN / 2)                  // int32 accumulators a thread: 64 x BN over 128 threads
#define CHUNKS (KBITS / 128)          // 16-byte columns of a row a stage
#define STEPS_K (KBITS / 256)         // instructions a stage
#define A_BYTES (BM * KBITS / 8)      // a stage of the tile's rows of A: one bulk copy
#define B_BYTES (BN * KBITS / 8)

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
           int* __restrict__ c, int na, int nb, int steps, int ldc, int upper, int pair_store)
{
    // a, b: the operands tiled by BM and BN rows (tiled_words), `steps` stages of KBITS bits
    // a row. One-dimensional grid, block rows taken GROUP at a time; a
    // tile wholly below the diagonal of a symmetric block returns at once (its mirror is
    // computed).
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
#ifdef PRODUCER_REGISTERS
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(PRODUCER_REGISTERS));
#endif
        if (threadIdx.x != PRODUCER * 32) return;
        // A stage is two copies: the tile's rows of A and of B for KBITS bits, each laid out
        // in memory as in the stage (tiled_words), zero rows past the data included.
        const unsigned char* a_at = a + (size_t)(row_block / BM) * steps * A_BYTES;
        const unsigned char* b_at = b + (size_t)(col_block / BN) * steps * B_BYTES;
        for (int step = 0; step < steps; ++step) {
            const int slot = step % STAGES;
            const unsigned at = base + slot * stage_bytes, bar = full + 8 * slot;
            barrier_wait(empty + 8 * slot, ((step / STAGES) & 1) ^ 1);
            barrier_arrive_expecting(bar, stage_bytes);
            bulk_copy(at, a_at + (size_t)step * A_BYTES, A_BYTES, bar);
            bulk_copy(at + A_BYTES, b_at + (size_t)step * B_BYTES, B_BYTES, bar);
        }
        return;
    }

#ifdef CONSUMER_REGISTERS
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(CONSUMER_REGISTERS));
#endif
    const int warpgroup = warp / 4;
    int acc[ACC];
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0;
    for (int step = 0; step < steps; ++step) {
        const int slot = step % STAGES;
        barrier_wait(full + 8 * slot, (step / STAGES) & 1);
        const unsigned at = base + slot * stage_bytes;
        const unsigned a_at = at + warpgroup * 64 * 16;  // this warpgroup's 8 row groups
        const unsigned b_at = at + BM * CHUNKS * 16;
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int s = 0; s < STEPS_K; ++s)
            mma_b1(acc, descriptor(a_at + 2 * s * BM * 16, BM * 16, 128),
                   descriptor(b_at + 2 * s * BN * 16, BN * 16, 128), 1);
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
    return defines + _mma_source(tile.bn) + _BODY


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


def tiled_words(words: Any, kbits: int, rows: int) -> Any:
    """``uint64`` words ``(n, m)`` as the kernel's copies take them: rows zero-padded to a
    multiple of ``rows`` and bits to a multiple of ``kbits``, laid out as ``[block of rows]
    [stage of kbits][16-byte column][8-row group][row in group]``: a block's stage is
    contiguous (one bulk copy) and lands in shared memory as wgmma's core matrices."""
    import cupy

    n, m = words.shape
    per_stage = kbits // 64
    stages, padded_n = -(-m // per_stage), -(-n // rows) * rows
    if (padded_n, stages * per_stage) != (n, m) or not words.flags.c_contiguous:
        padded = cupy.zeros((padded_n, stages * per_stage), dtype=np.uint64)
        padded[:n, :m] = words
        words = padded
    return cupy.ascontiguousarray(
        words.reshape(padded_n // rows, rows // 8, 8, stages, kbits // 128, 2)
        .transpose(0, 3, 4, 1, 2, 5))


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
    ta = tiled_words(a, tile.kbits, tile.bm)
    tb = tiled_words(a if diagonal else b, tile.kbits, tile.bn)
    pair_store = c.shape[1] % 2 == 0 and c.data.ptr % 8 == 0
    grid = (-(-nb // tile.bn) * -(-na // tile.bm),)
    args = (ta, tb, c, np.int32(na), np.int32(nb), np.int32(ta.shape[1]), np.int32(c.shape[1]),
            np.int32(diagonal), np.int32(pair_store))
    kernel(grid, (tile.threads,), args, shared_mem=tile.shared_bytes)
