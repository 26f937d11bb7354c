"""Gram blocks on the 1-bit tensor cores: ``mma.sync.aligned.m16n8k256 .b1.and.popc``.

One instruction multiplies a 16 x 256-bit tile of A by a 256-bit x 8 tile of Bᵀ with AND and
POPC and adds into 16 x 8 int32 accumulators: exact, and on sm_80 and later the native BMMA
path. No library exposes it for ``A · Aᵀ`` (cuBLAS has no 1-bit GEMM), so the kernel is CUDA
C++ with inline PTX, compiled at first use with NVRTC through a CuPy ``RawModule`` for the
device's own architecture and cached per device. A CuPy raw module was chosen over numba's
``declare_device`` + ``link=`` because the whole kernel (register fragments, unrolled MMA loop)
is CUDA C++ either way and the raw module needs no glue between two compilers.

Each block of 128 threads computes a 128 x 128 tile of C: each of its four warps a 64 x 64
sub-tile of 4 x 8 MMA tiles, 128 int32 accumulators per thread in registers. Per 256 bits of k
a thread loads 16 words of A and 16 of B (its fragments) and issues 32 MMAs. Rows beyond the
block's data read as zero; tiles below the diagonal of a diagonal block are skipped and then
mirrored. No dask here.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

__all__ = ["BMMA_MIN_CC", "bmma_cuda", "bmma_supported"]

#: Compute capability from which ``mma.sync.m16n8k256 .b1.and.popc`` exists.
BMMA_MIN_CC = (8, 0)

_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(128)
gram_bmma(const unsigned* __restrict__ a, const unsigned* __restrict__ b, int* __restrict__ c,
          int na, int nb, int kw, int ldc, int upper)
{
    // a: na x kw and b: nb x kw 32-bit words, row-major, kw a multiple of 8 (256 bits).
    const int row_block = blockIdx.y * 128;
    const int col_block = blockIdx.x * 128;
    if (upper && row_block >= col_block + 128) return;  // the mirror of a tile above
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;  // fragment row (or column) and word within it
    const int row0 = row_block + (warp >> 1) * 64;
    const int col0 = col_block + (warp & 1) * 64;
    int acc[4][8][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = 0;
    for (int k = 0; k < kw; k += 8) {
        unsigned af[4][4], bf[8][2];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r0 = row0 + i * 16 + g, r1 = r0 + 8;
            const unsigned* p0 = a + (size_t)r0 * kw + k + t;
            const unsigned* p1 = a + (size_t)r1 * kw + k + t;
            af[i][0] = r0 < na ? __ldg(p0) : 0u;
            af[i][A1] = r1 < na ? __ldg(p1) : 0u;
            af[i][A2] = r0 < na ? __ldg(p0 + 4) : 0u;
            af[i][3] = r1 < na ? __ldg(p1 + 4) : 0u;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int cc = col0 + j * 8 + g;
            const unsigned* p = b + (size_t)cc * kw + k + t;
            bf[j][0] = cc < nb ? __ldg(p) : 0u;
            bf[j][1] = cc < nb ? __ldg(p + 4) : 0u;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j)
                asm("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc "
                    "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                    : "+r"(acc[i][j][0]), "+r"(acc[i][j][1]), "+r"(acc[i][j][2]),
                      "+r"(acc[i][j][3])
                    : "r"(af[i][0]), "r"(af[i][1]), "r"(af[i][2]), "r"(af[i][3]),
                      "r"(bf[j][0]), "r"(bf[j][1]));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r0 = row0 + i * 16 + g, r1 = r0 + 8;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int c0 = col0 + j * 8 + 2 * t;
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

#: Which A registers hold rows g + 8 and the upper k words: the PTX fragment layout of
#: m16n8k256 (a0: row g, k words t; a1: row g + 8; a2: row g, words t + 4; a3: both).
#: Checked on the H200 with tools/probe_bmma_layout.py: (1, 2) exact, (2, 1) off by up to 252.
A_LAYOUT = (1, 2)

_modules: dict[tuple[int, tuple[int, int]], Any] = {}
_lock = threading.Lock()


def bmma_supported() -> bool:
    """Whether the current CUDA device has 1-bit MMA (compute capability 8.0 or later)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    return (int(props["major"]), int(props["minor"])) >= BMMA_MIN_CC


def _kernel(layout: tuple[int, int] = A_LAYOUT) -> Any:
    """The compiled kernel for the current device (NVRTC at first use, then cached)."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    key = (device, layout)
    with _lock:
        if key not in _modules:
            props = cupy.cuda.runtime.getDeviceProperties(device)
            arch = f"sm_{props['major']}{props['minor']}"
            source = _SOURCE.replace("A1", str(layout[0])).replace("A2", str(layout[1]))
            module = cupy.RawModule(code=source, options=("-std=c++17", f"--gpu-architecture={arch}"))
            _modules[key] = module.get_function("gram_bmma")
    return _modules[key]


def _words32(words: Any) -> Any:
    """``uint64`` words ``(n, m)`` as ``uint32`` ``(n, kw)``, ``kw`` a multiple of 8 (zero-padded)."""
    import cupy

    n, m = words.shape
    m4 = -(-m // 4) * 4
    if m4 != m or not words.flags.c_contiguous:
        padded = cupy.zeros((n, m4), dtype=np.uint64)
        padded[:, :m] = words
        words = padded
    return words.view(np.uint32).reshape(n, 2 * m4)


def bmma_cuda(a: Any, b: Any | None, c: Any, layout: tuple[int, int] = A_LAYOUT) -> None:
    """Gram block ``c = popcount(a & b)`` per pair of rows on the 1-bit tensor cores.

    ``a``, ``b``: CuPy ``uint64`` words (``b=None``: the symmetric ``a · aᵀ``, upper tiles then
    mirrored); ``c``: CuPy ``int32`` ``(na, nb)``. Queued on the current CuPy stream.
    """
    import cupy

    from ..staging import numba_stream
    from .gram import _mirror_cuda

    diagonal = b is None
    na = a.shape[0]
    nb = na if diagonal else b.shape[0]
    if na == 0 or nb == 0:
        return
    if a.shape[1] == 0:
        c[...] = 0
        return
    a32 = _words32(a)
    b32 = a32 if diagonal else _words32(b)
    grid = (-(-nb // 128), -(-na // 128))
    args = (a32, b32, c, np.int32(na), np.int32(nb), np.int32(a32.shape[1]),
            np.int32(c.shape[1]), np.int32(1 if diagonal else 0))
    _kernel(layout)(grid, (128,), args)
    if diagonal:
        _mirror_cuda(c, numba_stream(cupy.cuda.get_current_stream()))
