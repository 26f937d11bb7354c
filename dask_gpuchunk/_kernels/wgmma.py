"""Gram blocks on Hopper's warpgroup tensor-core instruction: ``wgmma.mma_async ... .b1.and.popc``.

**Not yet run on a GPU**: written and checked by ``ptxas`` for ``sm_90a`` on a machine without
one (``tests/_kernels/test_wgmma.py``); ``dg.gram`` does not use it. What a GPU must show first
is in ``tools/wgmma_check.py``.

Where :mod:`dask_gpuchunk._kernels.bmma` has each warp issue ``mma.sync.m16n8k256`` on fragments
it loaded into registers, here a warpgroup (four warps, 128 threads) issues one
``m64nNk256`` instruction that reads both operands from shared memory itself, through 64-bit
matrix descriptors, and runs asynchronously: the loads of later k steps, the descriptors of the
next instructions and the instruction itself overlap. The counts per instruction are 64 x N x
256 bit-MACs (N = 256: 4.2 million) against 16 x 8 x 256 for ``mma.sync``; nothing passes
through registers but the int32 accumulators (``N / 2`` a thread).

Counts. A block tile of ``BM x BN`` (``BM / 64`` warpgroups, each 64 rows by all ``BN``
columns) stages ``(BM + BN) x KBITS / 8`` bytes a k step through L2 for ``BM x BN x KBITS``
bit-MACs. At the H200's ~5e15 bit-MAC/s over 132 SMs, a 128 x 256 tile asks 7.2 TB/s of L2
for the tensor cores to stay busy, about what L2 gives: this first version is expected to be
bound by its copies (predicted ~2.5-3.5e15 on the full C, against bmma's 1.9e15), and the next
steps are the ones fp-cuda's README describes (TMA copies with multicast between the CTAs of
a cluster, a producer warpgroup, a persistent scheduler).

Layout in shared memory. ``wgmma`` reads K-major operands of 1-bit data as "core matrices"
of 8 rows x 16 bytes (128 bits), each 128 contiguous bytes. A stage holds each operand's rows
as ``[16-byte column c][8-row group][row in group]``: core matrices adjacent in k are
``rows x 16`` bytes apart (the descriptor's leading byte offset) and those adjacent in rows 128
bytes apart (its stride byte offset); no swizzle. The copies write it without bank conflicts
(eight consecutive threads write the eight rows of one core matrix). Which 128 bits of a row an
instruction takes first does not matter: A and B share the layout, so every bit pair meets
once. Rows past the data are zero-filled by ``cp.async`` itself, and k is padded with zeros to
whole stages (:func:`~dask_gpuchunk._kernels.bmma.words32`). No dask here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .bmma import gram_operands
from .compiled import compiled_once
from .gram import _mirror_cuda
from .launch import cupy_stream

__all__ = ["TILE", "WGMMA_CC", "WgmmaTile", "compile_for_sm90a", "kernel_source", "launch",
           "wgmma_cuda", "wgmma_supported"]

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
        return 128 * self.warpgroups

    @property
    def shared_bytes(self) -> int:
        return self.stages * (self.bm + self.bn) * self.kbits // 8


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
#define WARPGROUPS (BM / 64)
#define THREADS (128 * WARPGROUPS)
#define ACC (BN / 2)             // int32 accumulators a thread: 64 x BN over 128 threads
#define CHUNKS (KBITS / 128)     // 16-byte columns of a row a stage
#define STEPS_K (KBITS / 256)    // instructions a stage

__device__ __forceinline__ unsigned shared_address(const void* p)
{
    size_t s;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(s) : "l"(p));
    return (unsigned)s;
}

__device__ __forceinline__ void copy16(unsigned dst, const uint4* src, bool valid)
{
    // cp.async with src-size 0 zero-fills the 16 bytes: rows beyond the data read as zero.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
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

__device__ __forceinline__ unsigned core_offset(int row, int c, int rows)
{
    // Byte offset of 16-byte column c of a row in an operand of ``rows`` rows (a multiple of
    // 8): core matrices of 8 x 16 bytes, those adjacent in k ``rows * 16`` bytes apart.
    return (((unsigned)c * (rows / 8) + (unsigned)row / 8) * 8 + (row & 7)) * 16;
}

template <int ROWS>
__device__ __forceinline__ void load_operand(unsigned base, const uint4* __restrict__ src,
                                             int first, int n, int kv, int step)
{
    // Thread v copies row 8 * (v / (8 * CHUNKS)) + v % 8, column (v / 8) % CHUNKS: eight
    // consecutive threads fill one core matrix (no bank conflicts), a warp reads 64 bytes of
    // each of 8 rows (whole 32-byte sectors).
#pragma unroll
    for (unsigned v = threadIdx.x; v < ROWS * CHUNKS; v += THREADS) {
        const int c = (v / 8) % CHUNKS;
        const int row = (v / (8 * CHUNKS)) * 8 + (v & 7);
        const bool ok = first + row < n;
        const uint4* from = ok ? src + (size_t)(first + row) * kv + step * CHUNKS + c : src;
        copy16(base + core_offset(row, c, ROWS), from, ok);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
gram_wgmma(const uint4* __restrict__ a, const uint4* __restrict__ b, int* __restrict__ c,
           int na, int nb, int kv, int ldc, int upper, int pair_store)
{
    // a: na x kv and b: nb x kv 16-byte vectors, kv a multiple of CHUNKS. One-dimensional
    // grid, block rows taken GROUP at a time; a tile wholly below the diagonal of a symmetric
    // block returns at once (its mirror is computed).
    extern __shared__ __align__(128) uint4 smem[];
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
    const int warpgroup = threadIdx.x / 128;
    const int steps = kv / CHUNKS;
    int acc[ACC];
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0;

    auto load_stage = [&](int slot, int step) {
        const unsigned at = base + slot * stage_bytes;
        load_operand<BM>(at, a, row_block, na, kv, step);
        load_operand<BN>(at + BM * CHUNKS * 16, b, col_block, nb, kv, step);
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) load_stage(s, s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    for (int step = 0; step < steps; ++step) {
        asm volatile("cp.async.wait_group %0;\n" :: "n"(STAGES - 2));
        // cp.async writes through the generic proxy, wgmma reads through the async one.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        const unsigned at = base + (step % STAGES) * stage_bytes;
        const unsigned a_at = at + warpgroup * 64 * 16;  // this warpgroup's 8 row groups
        const unsigned b_at = at + BM * CHUNKS * 16;
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int s = 0; s < STEPS_K; ++s)
            mma_b1(acc, descriptor(a_at + 2 * s * BM * 16, BM * 16, 128),
                   descriptor(b_at + 2 * s * BN * 16, BN * 16, 128), 1);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        // The previous step's instructions are done (this warpgroup's); once every
        // warpgroup's are, its slot takes the copies of step + STAGES - 1.
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        __syncthreads();
        const int next = step + STAGES - 1;
        if (next < steps) load_stage(next % STAGES, next);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    asm volatile("cp.async.wait_group 0;\n" ::);

    // Accumulator i of a thread: row 16 * warp + lane / 4 (+ 8 for i % 4 >= 2) of the
    // warpgroup's 64, column 8 * (i / 4) + 2 * (lane % 4) (+ 1 for odd i).
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
    const int r0 = row_block + warpgroup * 64 + warp * 16 + lane / 4, r1 = r0 + 8;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int c0 = col_block + 8 * j + 2 * (lane & 3);
        const int* d = acc + 4 * j;
        if (pair_store && c0 + 1 < nb) {  // 8-byte stores where C's rows allow them
            if (r0 < na) *reinterpret_cast<int2*>(c + (size_t)r0 * ldc + c0) = make_int2(d[0], d[1]);
            if (r1 < na) *reinterpret_cast<int2*>(c + (size_t)r1 * ldc + c0) = make_int2(d[2], d[3]);
            continue;
        }
        if (r0 < na) {
            if (c0 < nb) c[(size_t)r0 * ldc + c0] = d[0];
            if (c0 + 1 < nb) c[(size_t)r0 * ldc + c0 + 1] = d[1];
        }
        if (r1 < na) {
            if (c0 < nb) c[(size_t)r1 * ldc + c0] = d[2];
            if (c0 + 1 < nb) c[(size_t)r1 * ldc + c0 + 1] = d[3];
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

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
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

    ``a``, ``b``: CuPy ``uint64`` words (``b=None``: the symmetric ``a · aᵀ``, upper tiles
    then mirrored); ``c``: CuPy ``int32`` ``(na, nb)``, C-contiguous. Queued on ``stream`` (a
    numba stream). As :func:`~dask_gpuchunk._kernels.bmma.bmma_cuda`.
    """
    import cupy

    if not wgmma_supported():
        raise RuntimeError("wgmma needs a compute capability 9.0 GPU (Hopper)")
    with cupy_stream(stream):
        launch(_compiled_kernel(cupy.cuda.runtime.getDevice(), tile).kernel, a, b, c, tile,
               stream)


def launch(kernel: Any, a: Any, b: Any | None, c: Any, tile: WgmmaTile, stream: Any) -> None:
    """:func:`wgmma_cuda`'s work with ``kernel`` (compiled from :func:`kernel_source` of
    ``tile``, or a variant of it), on CuPy's current stream."""
    ops = gram_operands(a, b, c, tile.kbits)
    if ops is None:
        return
    grid = (-(-ops.nb // tile.bn) * -(-ops.na // tile.bm),)
    args = (ops.a32, ops.b32, c, np.int32(ops.na), np.int32(ops.nb),
            np.int32(ops.a32.shape[1] // 4), np.int32(c.shape[1]), np.int32(ops.diagonal),
            np.int32(ops.pair_store))
    kernel(grid, (tile.threads,), args, shared_mem=tile.shared_bytes)
    if ops.diagonal:
        _mirror_cuda(c, stream)
