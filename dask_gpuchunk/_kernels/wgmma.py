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
producer thread that keeps ``STAGES`` stages of ``KBITS`` bits in flight: for each, one TMA
copy (``cp.async.bulk.tensor``, from a tensor map of the words as they are) per 128 rows of
the tile's rows of A and of B, counted on the stage's "full" mbarrier; the consumers wait on
it, issue their instructions, and once those are done (``wgmma.wait_group``) arrive on the
stage's "empty" barrier, which the producer waits on before refilling it. No
``__syncthreads`` in the loop.

Layout. A copy is a box of 128 rows x 128 bytes (1024 bits) of the row-major words, stored
128-byte swizzled (each 16-byte piece of a row at a place XORed with the row's index within
its 8-row group: no bank conflicts), which ``wgmma`` reads through K-major descriptors with
the same swizzle (8-row groups 1024 bytes apart; each 256-bit k step 32 bytes further along
the row). The copy engine fills zeros past the data (rows, and bits up to the stage), so
nothing is padded or laid out beforehand; rows that are not contiguous whole 16-byte pieces
are copied first (:func:`tensor_map`). Which bits of a row an instruction takes first does not
matter: A and B share the layout, so every bit pair meets once. Of a symmetric block only the
tiles on and above the diagonal run, and each stores its counts above the diagonal at their
mirror too (no second pass over C).

Measured (H200, 16384 rows x 131072 bits, C on the device): full C 6.3-6.6e15 bit-MAC/s
against bmma's 1.9e15; symmetric 2.86 ms, 1.23e16 effective (N·N·K / t); 65,536 rows x 2048
bits 6.0 ms against bmma's 18.2 (C's 17 GB written is the time there). On the way
(``the perf notes (git show 85dc246:docs/perf-notes.md)``): every thread copying 16 bytes at a time (``cp.async``) with two
``__syncthreads`` a stage reached 1.5-1.9e15, its copies the whole time; bulk copies of 1 KiB
2.3e15; of whole laid-out blocks 6.2e15, the layout pass 0.18 ms a launch; clusters of two
blocks sharing B's copies (``.multicast::cluster``) gained nothing. No dask here.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np

from .bmma import gram_block
from .compiled import compiled_once
from .launch import cupy_stream

__all__ = ["BLOCK", "TILE", "WGMMA_CC", "WgmmaTile", "compile_for_sm90a", "kernel_source",
           "tile_source",
           "launch", "tensor_map", "wgmma_cuda", "wgmma_supported"]

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
        """The stages from a 1024-byte boundary, then two 8-byte barriers a stage."""
        return self.stages * (self.bm + self.bn) * self.kbits // 8 + 16 * self.stages + 1024


#: The tile used unless one is given: 193 KiB of shared memory, 128 accumulators a thread; the
#: fastest of those ``tools/wgmma_check.py`` at 93972b0 timed on an H200 (256 x 128 and groups of 4 or 16
#: within a few per cent, 3 stages or 128 x 128 5-15 % slower).
TILE = WgmmaTile()

#: Rows of one TMA copy (a box of the tensor map: :func:`tensor_map`) and the ``N`` of each
#: instruction (``m64n128k256``): a 256-column tile of B is two copies and two instructions.
BLOCK = 128


def _check_tile(tile: WgmmaTile) -> None:
    if (tile.bm not in (BLOCK, 2 * BLOCK) or tile.bn not in (BLOCK, 2 * BLOCK)
            or tile.stages < 2 or tile.kbits != 1024 or tile.group < 1):
        raise ValueError(f"bad wgmma tile {tile}: bm and bn {BLOCK} or {2 * BLOCK}; stages >= 2; "
                         "kbits 1024 (a 128-byte swizzled row); group >= 1")
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
#define BLOCK 128                     // rows of a tensor-map copy
#define BLOCK_BYTES (BLOCK * KBITS / 8) // one copy: 128 rows x 128 bytes, 16 KiB
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

__device__ __forceinline__ void tensor_copy(unsigned dst, const void* map, int x, int y,
                                            unsigned bar)
{
    // The copy engine moves the map's box at byte x of row y (rows past the data and bytes
    // past a row's end read as zeros), 128-byte swizzled, and counts its bytes on the barrier.
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];\n"
                 :: "r"(dst), "l"(map), "r"(x), "r"(y), "r"(bar) : "memory");
}

__device__ __forceinline__ unsigned long long descriptor(unsigned address)
{
    // K-major, 128-byte swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart (the stride
    // byte offset), the leading byte offset unused (1); start address and offsets in 16-byte
    // units. Each 256-bit k step starts 32 bytes further; the hardware swizzles the rest.
    return (unsigned long long)((address & 0x3FFFF) >> 4) | (1ull << 16)
         | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ bool tile_at(unsigned tile, int na, int nb, int upper,
                                        int& row_block, int& col_block)
{
    // Tile number `tile` of C, rows of tiles taken GROUP at a time (the tiles running at once
    // share their rows of A and columns of B in L2). False for a tile wholly below the
    // diagonal of a symmetric block (its mirror is computed).
    const int tiles_m = (na + BM - 1) / BM, tiles_n = (nb + BN - 1) / BN;
    const int per_group = GROUP * tiles_n;
    const int first_m = (tile / per_group) * GROUP;
    const int rows_here = min(tiles_m - first_m, GROUP);
    const int in_group = tile % per_group;
    row_block = (first_m + in_group % rows_here) * BM;
    col_block = (in_group / rows_here) * BN;
    return !(upper && row_block >= col_block + BN);
}

__device__ __forceinline__ bool tile_place(int na, int nb, int upper, int& row_block,
                                           int& col_block)
{
    // This block's tile of C: a one-dimensional grid, a tile a block.
    return tile_at(blockIdx.x, na, nb, upper, row_block, col_block);
}

__device__ __forceinline__ unsigned stages_base(const unsigned char* smem)
{
    // 128-byte swizzled copies land on 1024-byte boundaries.
    return (shared_address(smem) + 1023) & ~1023u;
}

__device__ __forceinline__ void copy_stage(const void* map_a, const void* map_b, unsigned at,
                                           unsigned bar, int step, int row_block, int col_block)
{
    // The producer's copies of one stage at `at`: a copy per 128 rows of the tile's rows of A
    // and of B, KBITS bits of each (a copy past the data fills zeros, and counts its whole box
    // all the same), their bytes expected on the stage's full barrier `bar`.
    barrier_arrive_expecting(bar, (BM + BN) * CHUNKS * 16);
    for (int p = 0; p < BM / BLOCK; ++p)
        tensor_copy(at + p * BLOCK_BYTES, map_a, step * (KBITS / 8), row_block + p * BLOCK, bar);
    for (int p = 0; p < NSUB; ++p)
        tensor_copy(at + (BM / BLOCK + p) * BLOCK_BYTES, map_b, step * (KBITS / 8),
                    col_block + p * BLOCK, bar);
}

__device__ __forceinline__ void mma_stage(int (&acc)[ACC], unsigned at, int warpgroup)
{
    // A consumer warpgroup's instructions on the stage at `at`, committed as one group.
    // This warpgroup's 64 rows of its copy of A (8 KiB in); B's copies after A's.
    const unsigned a_at = at + (warpgroup / 2) * BLOCK_BYTES + (warpgroup % 2) * 64 * 128;
    const unsigned b_at = at + (BM / BLOCK) * BLOCK_BYTES;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int s = 0; s < STEPS_K; ++s) {
        const unsigned long long a_desc = descriptor(a_at + 32 * s);
#pragma unroll
        for (int h = 0; h < NSUB; ++h)  // columns 128 h to 128 h + 127: accumulators 64 h on
            mma_b1(*reinterpret_cast<int(*)[64]>(acc + 64 * h), a_desc,
                   descriptor(b_at + h * BLOCK_BYTES + 32 * s), 1);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ bool tile_counts(int (&acc)[ACC], const void* map_a,
                                            const void* map_b, int steps, int row_block,
                                            int col_block, unsigned base)
{
    // The tile's counts into acc of the consumer warpgroups' threads (true); the producer
    // warpgroup's threads return false, with nothing left to do. Every thread of the block
    // calls it (it holds a __syncthreads).
    const unsigned stage_bytes = (BM + BN) * CHUNKS * 16;
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
        if (threadIdx.x != PRODUCER * 32) return false;
        // The maps were written by a copy from the host: made visible to the copy engine.
        asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n"
                     :: "l"(map_a) : "memory");
        asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n"
                     :: "l"(map_b) : "memory");
        for (int step = 0; step < steps; ++step) {
            const int slot = step % STAGES;
            const unsigned at = base + slot * stage_bytes, bar = full + 8 * slot;
            barrier_wait(empty + 8 * slot, ((step / STAGES) & 1) ^ 1);
            copy_stage(map_a, map_b, at, bar, step, row_block, col_block);
        }
        return false;
    }

    const int warpgroup = warp / 4;
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0;
    for (int step = 0; step < steps; ++step) {
        const int slot = step % STAGES;
        barrier_wait(full + 8 * slot, (step / STAGES) & 1);
        mma_stage(acc, base + slot * stage_bytes, warpgroup);
        // The previous step's instructions are done: its stage may take new copies.
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        if (step > 0 && lane == 0) barrier_arrive(empty + 8 * ((step - 1) % STAGES));
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    return true;
}
"""

_GRAM = r"""
extern "C" __global__ void __launch_bounds__(THREADS, 1)
gram_wgmma(const void* __restrict__ map_a, const void* __restrict__ map_b,
           int* __restrict__ c, int na, int nb, int steps, int ldc, int upper, int pair_store)
{
    // map_a, map_b: tensor maps of the operands' words (tensor_map), `steps` stages of KBITS
    // bits a row; the tile's counts stored in c (ldc ints a row), and with upper at their
    // mirror too.
    extern __shared__ __align__(128) unsigned char smem[];
    int row_block, col_block;
    if (!tile_place(na, nb, upper, row_block, col_block)) return;
    int acc[ACC];
    if (!tile_counts(acc, map_a, map_b, steps, row_block, col_block, stages_base(smem)))
        return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warpgroup = warp / 4;

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
            if (r0 < na)
                *reinterpret_cast<int2*>(c + (size_t)r0 * ldc + c0) = make_int2(d[0], d[1]);
            if (r1 < na)
                *reinterpret_cast<int2*>(c + (size_t)r1 * ldc + c0) = make_int2(d[2], d[3]);
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


def tile_source(tile: WgmmaTile = TILE) -> str:
    """The CUDA C++ every kernel over ``tile``'s tiles builds on (for ``sm_90a``): the tile's
    defines, the instruction, the copies and barriers, ``tile_place`` and ``tile_counts``
    (the tile's counts in the consumer threads' registers)."""
    _check_tile(tile)
    defines = "".join(f"#define {key.upper()} {value}\n" for key, value in tile._asdict().items())
    return defines + _mma_source(BLOCK) + _BODY


def kernel_source(tile: WgmmaTile = TILE) -> str:
    """The CUDA C++ of :func:`wgmma_cuda`'s kernel ``gram_wgmma`` for ``tile``, for
    ``sm_90a``."""
    return tile_source(tile) + _GRAM


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


def compile_for_sm90a(source: str, shared_bytes: int, name: str = "gram_wgmma") -> _Compiled:
    """Kernel ``name`` of ``source`` compiled by NVRTC for ``sm_90a`` on the current device,
    allowed ``shared_bytes`` of dynamic shared memory.

    Through NVRTC itself, not a CuPy ``RawModule``: CuPy adds its own ``-arch=sm_90`` after
    the options it is given, and ``wgmma`` exists only in ``sm_90a``."""
    from cupy.cuda import function
    from cupy_backends.cuda.api import driver
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(source, f"{name}.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(program, ("-std=c++17", "--gpu-architecture=sm_90a"))
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC could not compile the wgmma kernel {name}: "
                               f"{nvrtc.getProgramLog(program)}") from exc
        cubin = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    module = function.Module()
    module.load(cubin)
    kernel = module.get_function(name)
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


#: ``CUtensorMap`` is 128 bytes, 64-byte aligned; the enumerators below are CUDA's (cuda.h).
_MAP_BYTES = 128
_UINT8, _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_128B, _OOB_FILL_ZERO = 0, 0, 3, 2, 0


@functools.cache
def _encode_tiled() -> Any:
    """The driver's ``cuTensorMapEncodeTiled`` (CUDA 12 and later), through ctypes: CuPy has
    no binding of it."""
    import ctypes

    encode = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    encode.restype = ctypes.c_int
    encode.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p, ctypes.POINTER(u64),
                       ctypes.POINTER(u64), ctypes.POINTER(u32), ctypes.POINTER(u32),
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return encode


def tensor_map(words: Any, kbits: int = 1024) -> tuple[Any, Any]:
    """A tensor map of ``uint64`` words ``(n, m)`` on the device, for the kernel's copies:
    boxes of :data:`BLOCK` rows by ``kbits / 8`` bytes, 128-byte swizzled, zeros past the
    data. Returns the map (a 128-byte CuPy array) and the words it describes: ``words``
    itself, or a copy where its rows are not contiguous and 16-byte aligned, as the copy engine
    needs them (freed after the launch, the copy's memory is reused only by later work on the
    same stream, as CuPy's pool does for every temporary)."""
    import ctypes

    import cupy

    n, m = words.shape
    if not words.flags.c_contiguous or words.data.ptr % 16 or m % 2:
        padded = cupy.zeros((n, m + m % 2), dtype=np.uint64)
        padded[:, :m] = words
        words, m = padded, m + m % 2
    # A map holds only the words' address, shape and box, so one made for the same ones is
    # the same map, whatever the memory holds now: kept, as the Gram's blocks launch over the
    # same resident row chunks again and again. Made anew, its 128-byte copy to the device
    # waited for the stream's earlier work (5 % of a worker's busy time on 2 x H200).
    key = (words.device.id, words.data.ptr, n, m, kbits)
    with _maps_lock:
        found = _maps.get(key)
        if found is not None:
            _maps.move_to_end(key)
            return found, words
    host = np.zeros(_MAP_BYTES + 64, dtype=np.uint8)
    start = -host.ctypes.data % 64
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    status = _encode_tiled()(
        host.ctypes.data + start, _UINT8, 2, words.data.ptr, (u64 * 2)(m * 8, n), (u64 * 1)(m * 8),
        (u32 * 2)(kbits // 8, BLOCK), (u32 * 2)(1, 1), _INTERLEAVE_NONE, _SWIZZLE_128B,
        _L2_PROMOTION_128B, _OOB_FILL_ZERO)
    if status:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {status}) for words of shape "
                           f"{(n, m)} at {words.data.ptr:#x}")
    made = cupy.asarray(host[start:start + _MAP_BYTES])
    with _maps_lock:
        _maps[key] = made
        while len(_maps) > _MAPS_KEPT:
            _maps.popitem(last=False)
    return made, words


#: Tensor maps kept (128 bytes each), the least recently used dropped first.
_MAPS_KEPT = 1024
_maps: OrderedDict[tuple[int, ...], Any] = OrderedDict()
_maps_lock = threading.Lock()


def launch(kernel: Any, a: Any, b: Any | None, c: Any, tile: WgmmaTile) -> None:
    """:func:`wgmma_cuda`'s work with ``kernel`` (compiled from :func:`kernel_source` of
    ``tile``, or a variant of it), on CuPy's current stream."""
    block = gram_block(a, b, c)
    if block is None:
        return
    # kept_a and kept_b (the words, or their copies) stay referenced until after the launch.
    map_a, kept_a = tensor_map(a, tile.kbits)
    map_b, kept_b = (map_a, kept_a) if block.diagonal else tensor_map(b, tile.kbits)
    steps = -(-kept_a.shape[1] * 64 // tile.kbits)
    grid = (-(-block.nb // tile.bn) * -(-block.na // tile.bm),)
    args = (map_a, map_b, c, np.int32(block.na), np.int32(block.nb), np.int32(steps),
            np.int32(c.shape[1]), np.int32(block.diagonal), np.int32(block.pair_store))
    kernel(grid, (tile.threads,), args, shared_mem=tile.shared_bytes)
