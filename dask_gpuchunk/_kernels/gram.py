"""Per-chunk kernels for Gram blocks ``C = A_I · A_Jᵀ`` of bit-packed 0/1 rows.

``A_I`` ``(ni, m)`` and ``A_J`` ``(nj, m)`` are ``uint64`` words over the same bits (see
:mod:`.bitpack`); ``C[r, s] = sum_w popcount(A_I[r, w] & A_J[s, w])`` as ``int32``. A block on
the diagonal (``A_J is A_I``) is symmetric: only its upper triangle is computed, then mirrored.

Methods:

``popcount``
    numba CUDA kernel (:func:`popcount_cuda`): each block of threads computes one tile of C from
    tiles of words staged through shared memory; each thread keeps ``RM x RN`` accumulators in
    registers, so every word it loads from shared memory serves several AND + POPC. Its CPU
    twin (:func:`popcount_cpu`) is a numba ``njit(parallel=True)`` loop over groups of rows
    that share each loaded word of the other operand.
``int8``
    GPU only (:func:`int8_cuda`): the words of both operands are unpacked to 0/1 ``int8`` bytes
    on the device (:func:`.bitpack.unpack_int8_cuda`) and multiplied by cuBLAS ``gemmEx``
    (int8 inputs, 32-bit integer compute: exact) on the tensor cores, through CuPy's cuBLAS
    bindings (``cupy.matmul`` on int8 does not use them). Device scratch: 8 bytes per word of
    each operand.

No dask here.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import numpy as np

from .compiled import compiled_once
from .bitpack import WORD_BITS, unpack_int8_cuda
from .launch import cupy_stream

__all__ = [
    "GPU_METHODS",
    "METHODS",
    "Method",
    "TileShape",
    "c_ordered",
    "int8_cuda",
    "mirror_upper_cpu",
    "popcount_cpu",
    "popcount_cuda",
    "reference_gram",
    "transpose_cpu",
]

#: Methods of computing a Gram block; ``"auto"`` is resolved by the caller.
Method = Literal["auto", "popcount", "int8", "bmma", "wgmma"]
METHODS: tuple[str, ...] = get_args(Method)
#: Methods that run on a GPU only.
GPU_METHODS: tuple[str, ...] = ("int8", "bmma", "wgmma")


def reference_gram(bits: np.ndarray) -> np.ndarray:
    """``A · Aᵀ`` of 0/1 data, as ``int32`` (what tests compare with): a float64 matmul (BLAS;
    NumPy's int64 matmul has none, 2,400 x 4,096 bits took 25 s), exact, every count being
    a whole number below 2**53.

    Examples
    --------
    >>> reference_gram(np.array([[1, 0, 1], [1, 1, 1]]))
    array([[2, 2],
           [2, 3]], dtype=int32)
    """
    a = np.asarray(bits).astype(np.float64)
    return (a @ a.T).astype(np.int32)


# ---- CPU -----------------------------------------------------------------------------------

#: ``numba.cuda``, imported at first use. Kernels must see it as a module global: numba's CUDA
#: simulator swaps that global for its own module when it runs them.
cuda: Any = None


def _load_cuda() -> None:
    global cuda
    if cuda is None:
        from numba import cuda as numba_cuda

        cuda = numba_cuda


def _popcount64() -> Any:
    """A numba intrinsic for LLVM's ``ctpop`` on 64-bit words (one POPCNT instruction)."""
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def popcount64(typingctx, x):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            return builder.ctpop(args[0])

        return types.uint64(types.uint64), codegen

    return popcount64


#: Rows of A_I that share each loaded word of A_J in the CPU kernel.
CPU_ROWS = 4


def _gram_cpu(a: Any, b: Any, c: Any, upper: bool) -> None:  # pragma: no cover - compiled
    na, m = a.shape
    nb = b.shape[0]
    groups = (na + 3) // 4
    for g in _prange(groups):
        i0 = g * 4
        first = i0 if upper else 0
        if i0 + 4 <= na:
            for j in range(first, nb):
                s0 = np.uint64(0)
                s1 = np.uint64(0)
                s2 = np.uint64(0)
                s3 = np.uint64(0)
                for w in range(m):
                    bw = b[j, w]
                    s0 += _popc(a[i0, w] & bw)
                    s1 += _popc(a[i0 + 1, w] & bw)
                    s2 += _popc(a[i0 + 2, w] & bw)
                    s3 += _popc(a[i0 + 3, w] & bw)
                c[i0, j] = s0
                c[i0 + 1, j] = s1
                c[i0 + 2, j] = s2
                c[i0 + 3, j] = s3
        else:
            for i in range(i0, na):
                for j in range(first, nb):
                    s = np.uint64(0)
                    for w in range(m):
                        s += _popc(a[i, w] & b[j, w])
                    c[i, j] = s


def _mirror(c: Any) -> None:  # pragma: no cover - compiled
    n = c.shape[0]
    for i in _prange(n):
        for j in range(i):
            c[i, j] = c[j, i]


def _transpose(a: Any, out: Any) -> None:  # pragma: no cover - compiled
    # 64 x 64 tiles: reads and writes both stay within a few cache lines per row.
    n, m = a.shape
    for ti in _prange((n + 63) // 64):
        i0 = ti * 64
        i1 = min(i0 + 64, n)
        for j0 in range(0, m, 64):
            j1 = min(j0 + 64, m)
            for i in range(i0, i1):
                for j in range(j0, j1):
                    out[j, i] = a[i, j]


# numba is imported at first use: the kernels above name these globals, which _cpu_kernels
# rebinds to numba's prange and the popcount intrinsic before it compiles them (numba reads a
# global's value when it compiles). Compiled with cache=True: a process (each CPU job, each
# worker) loads them instead of compiling them again, ~1.5 s on a 2-core machine.
_prange: Any = range
_popc: Any = None


@compiled_once
def _cpu_kernels() -> tuple[Any, Any, Any]:
    import numba

    from .source_cache import cached_njit

    global _prange, _popc
    _prange, _popc = numba.prange, _popcount64()
    return tuple(cached_njit(f, parallel=True) for f in (_gram_cpu, _mirror, _transpose))


def transpose_cpu(block: np.ndarray) -> np.ndarray:
    """A new C-contiguous ``block.T``, copied tile by tile (NumPy's strided copy of a large
    transpose misses the cache on every element).

    Examples
    --------
    >>> transpose_cpu(np.arange(6, dtype=np.int32).reshape(2, 3))
    array([[0, 3],
           [1, 4],
           [2, 5]], dtype=int32)
    """
    out = np.empty((block.shape[1], block.shape[0]), dtype=block.dtype)
    if out.size:
        _cpu_kernels()[2](np.ascontiguousarray(block), out)
    return out


def c_ordered(block: np.ndarray) -> np.ndarray:
    """``block`` in C order: itself where it is, a tiled copy (:func:`transpose_cpu`) where it is
    the transposed view of a C-order array (a Gram's mirrored block), else NumPy's copy.

    Examples
    --------
    >>> a = np.arange(6, dtype=np.int32).reshape(2, 3)
    >>> c_ordered(a) is a, c_ordered(a.T).flags.c_contiguous, np.array_equal(c_ordered(a.T), a.T)
    (True, True, True)
    """
    if block.flags.c_contiguous:
        return block
    if block.ndim == 2 and block.T.flags.c_contiguous:
        return transpose_cpu(block.T)
    return np.ascontiguousarray(block)


def mirror_upper_cpu(c: np.ndarray) -> None:
    """Copy the upper triangle of a square NumPy block onto its lower triangle, in place."""
    _cpu_kernels()[1](c)


def popcount_cpu(a: np.ndarray, b: np.ndarray | None, out: np.ndarray | None = None) -> np.ndarray:
    """``popcount(a & b)`` summed over words for every pair of rows; ``b=None`` means ``a · aᵀ``.

    Parameters
    ----------
    a, b
        C-contiguous ``uint64`` words, ``(na, m)`` and ``(nb, m)``.
    out
        ``int32`` ``(na, nb)`` to write into (allocated if omitted).

    Examples
    --------
    >>> a = np.array([[0b1011], [0b0110]], dtype=np.uint64)
    >>> popcount_cpu(a, None)
    array([[3, 1],
           [1, 2]], dtype=int32)
    """
    diagonal = b is None
    b = a if diagonal else b
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"word counts differ: {a.shape[1]} and {b.shape[1]}")
    if out is None:
        out = np.empty((a.shape[0], b.shape[0]), dtype=np.int32)
    if out.size == 0:
        return out
    if a.shape[1] == 0:
        out[...] = 0
        return out
    gram_cpu, mirror, _ = _cpu_kernels()
    gram_cpu(np.ascontiguousarray(a), np.ascontiguousarray(b), out, diagonal)
    if diagonal:
        mirror(out)
    return out


# ---- CUDA: popcount ------------------------------------------------------------------------


class TileShape(tuple):
    """``(TY, TX, RM, RN, TK)``: a ``TY x TX`` block of threads computes a ``TY*RM x TX*RN`` tile
    of C, ``RM x RN`` accumulators per thread, over ``TK`` words staged per step."""

    def __new__(cls, ty: int, tx: int, rm: int, rn: int, tk: int) -> TileShape:  # noqa: PYI034
        return super().__new__(cls, (ty, tx, rm, rn, tk))


#: Measured on an H200 (bench gram, the perf notes (git show 85dc246:docs/perf-notes.md)).
CUDA_TILE = TileShape(16, 16, 4, 4, 8)
#: The simulator runs every thread as a Python thread: a tiny tile keeps tests fast.
SIM_TILE = TileShape(2, 4, 2, 2, 2)


def _popcount_cuda_source(tile: TileShape) -> str:
    ty_n, tx_n, rm, rn, tk = tile
    bm, bn, nt = ty_n * rm, tx_n * rn, ty_n * tx_n
    lines = [
        "def kernel(a, b, c, upper):",
        f"    sa = cuda.shared.array(({tk}, {bm + 1}), uint64)",
        f"    sb = cuda.shared.array(({tk}, {bn + 1}), uint64)",
        "    tx = cuda.threadIdx.x",
        "    ty = cuda.threadIdx.y",
        f"    row0 = cuda.blockIdx.y * {bm}",
        f"    col0 = cuda.blockIdx.x * {bn}",
        # A tile wholly below the diagonal of a diagonal block is the mirror of one above it.
        f"    if upper and row0 >= col0 + {bn}:",
        "        return",
        "    na = a.shape[0]",
        "    nb = b.shape[0]",
        "    m = a.shape[1]",
        f"    tid = ty * {tx_n} + tx",
    ]
    for i in range(rm):
        for j in range(rn):
            lines.append(f"    acc{i}_{j} = uint64(0)")
    lines.append(f"    for k0 in range(0, m, {tk}):")
    # Stage TK words of each tile row: consecutive threads read consecutive words of a row.
    for name, rows, n_name, base, smem in (("a", bm, "na", "row0", "sa"), ("b", bn, "nb", "col0", "sb")):
        loads = -(-(rows * tk) // nt)
        for ld in range(loads):
            lines += [
                f"        e = tid + {ld * nt}",
                f"        r = e // {tk}",
                f"        w = e - r * {tk}",
            ]
            guard = f"r < {rows} and " if (ld + 1) * nt > rows * tk else ""
            lines += [
                f"        if {guard}True:",
                f"            gr = {base} + r",
                "            gw = k0 + w",
                "            v = uint64(0)",
                f"            if gr < {n_name} and gw < m:",
                f"                v = {name}[gr, gw]",
                f"            {smem}[w, r] = v",
            ]
    lines.append("        cuda.syncthreads()")
    for kk in range(tk):
        for i in range(rm):
            lines.append(f"        x{i} = sa[{kk}, ty + {i * ty_n}]")
        for j in range(rn):
            lines.append(f"        y{j} = sb[{kk}, tx + {j * tx_n}]")
        for i in range(rm):
            for j in range(rn):
                lines.append(f"        acc{i}_{j} += cuda.popc(x{i} & y{j})")
    lines.append("        cuda.syncthreads()")
    for i in range(rm):
        lines.append(f"    r = row0 + ty + {i * ty_n}")
        lines.append("    if r < na:")
        for j in range(rn):
            lines.append(f"        s = col0 + tx + {j * tx_n}")
            lines.append("        if s < nb:")
            lines.append(f"            c[r, s] = int32(acc{i}_{j})")
    return "\n".join(lines) + "\n"


@compiled_once
def _cuda_popcount_kernel(tile: TileShape) -> Any:
    from numba import cuda, int32, uint64

    namespace = {"cuda": cuda, "uint64": uint64, "int32": int32}
    code = compile(_popcount_cuda_source(tile), "<dask_gpuchunk popcount kernel>", "exec")
    exec(code, namespace)  # noqa: S102 - source generated above from integers only
    return cuda.jit(namespace["kernel"])


@compiled_once
def _cuda_mirror_kernel() -> Any:
    _load_cuda()

    @cuda.jit
    def mirror(c):  # pragma: no cover - compiled
        j, i = cuda.grid(2)  # x along columns: the writes of a warp are contiguous
        if i < c.shape[0] and j < i:
            c[i, j] = c[j, i]

    return mirror


def _simulated() -> bool:
    from numba.cuda import config as cuda_config

    return bool(cuda_config.ENABLE_CUDASIM)


def _as_numba(x: Any) -> Any:
    if type(x).__module__.split(".", 1)[0] == "cupy":
        from numba import cuda

        return cuda.as_cuda_array(x, sync=False)
    return x


def _mirror_cuda(c: Any, stream: Any) -> None:
    n = c.shape[0]
    threads = (8, 4) if _simulated() else (32, 8)
    blocks = (-(-n // threads[0]), -(-n // threads[1]))
    _cuda_mirror_kernel()[blocks, threads, stream](_as_numba(c))


def popcount_cuda(a: Any, b: Any | None, c: Any, stream: Any = 0, tile: TileShape | None = None) -> None:
    """Launch the popcount Gram kernel: ``c = popcount(a & b)`` per pair of rows, asynchronously.

    Parameters
    ----------
    a, b
        Device arrays (CuPy or numba) of C-contiguous ``uint64`` words; ``b=None`` computes the
        symmetric ``a · aᵀ`` (upper-triangle tiles, then mirrored).
    c
        ``int32`` device array ``(na, nb)``, written entirely.
    stream
        numba stream to launch on.
    tile
        Tile shape (default :data:`CUDA_TILE`, or :data:`SIM_TILE` under the simulator).
    """
    diagonal = b is None
    b = a if diagonal else b
    na, nb = a.shape[0], b.shape[0]
    if na == 0 or nb == 0:
        return
    tile = tile or (SIM_TILE if _simulated() else CUDA_TILE)
    ty_n, tx_n, rm, rn, _ = tile
    blocks = (-(-nb // (tx_n * rn)), -(-na // (ty_n * rm)))
    kernel = _cuda_popcount_kernel(tile)
    kernel[blocks, (tx_n, ty_n), stream](_as_numba(a), _as_numba(b), _as_numba(c), diagonal)
    if diagonal:
        _mirror_cuda(c, stream)


# ---- CUDA: int8 tensor cores through cuBLAS ------------------------------------------------

# CuPy's runtime module names CUDA_R_8I but not CUDA_R_32I (checked on the H200 machine's
# CuPy): that one is named here, from CUDA's library_types.h.
_CUDA_R_32I = 10
_ONE = np.ones(1, dtype=np.int32)
_ZERO = np.zeros(1, dtype=np.int32)


def _gemm_int8(x: Any, y: Any, c: Any, rows: slice, cols: slice, stream_ptr: int) -> None:
    """``c[rows, cols] = x[rows] · y[cols]ᵀ`` for row-major int8 ``x``, ``y`` and int32 ``c``.

    cuBLAS is column-major: row-major ``c`` is ``cᵀ`` column-major, and ``cᵀ = y · xᵀ`` is
    ``gemm(T, N)`` with ``y`` and ``x`` read as column-major ``(k, n)`` matrices ("TN", the
    layout the integer tensor-core kernels take).
    """
    import cupy
    from cupy_backends.cuda.api import runtime
    from cupy_backends.cuda.libs import cublas

    r0, r1 = rows.start, rows.stop
    c0, c1 = cols.start, cols.stop
    k = x.shape[1]
    ldc = c.shape[1]
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, stream_ptr)
    cublas.gemmEx(
        handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N,
        c1 - c0, r1 - r0, k,
        _ONE.ctypes.data,
        y.data.ptr + c0 * k, runtime.CUDA_R_8I, k,
        x.data.ptr + r0 * k, runtime.CUDA_R_8I, k,
        _ZERO.ctypes.data,
        c.data.ptr + (r0 * ldc + c0) * 4, _CUDA_R_32I, ldc,
        cublas.CUBLAS_COMPUTE_32I, cublas.CUBLAS_GEMM_DEFAULT,
    )


def int8_cuda(a: Any, b: Any | None, c: Any, stream: Any = 0) -> None:
    """Gram block through int8 tensor cores, queued on ``stream`` (a numba stream).

    ``a``, ``b``: CuPy ``uint64`` words (``b=None``: ``a · aᵀ``); ``c``: CuPy ``int32``
    ``(na, nb)``. The words are unpacked to int8 on the device (``k = 64 m`` bytes per row,
    a multiple of the 4 that cuBLAS's integer kernels need) and multiplied by cuBLAS
    ``gemmEx`` with 32-bit integer compute, which is exact for ``k < 2**31``. A diagonal block
    is cut in two halves along its rows: three GEMMs (upper-left, upper-right, lower-right)
    and a mirror instead of one full GEMM, 3/4 of the work.
    """
    import cupy

    ptr = cupy_stream(stream).ptr
    diagonal = b is None
    na, m = a.shape
    nb = na if diagonal else b.shape[0]
    if na == 0 or nb == 0:
        return
    if m == 0:
        c[...] = 0
        return
    xa = cupy.empty((na, m * WORD_BITS), dtype=np.int8)
    unpack_int8_cuda(a, xa, stream)
    if not diagonal:
        xb = cupy.empty((nb, m * WORD_BITS), dtype=np.int8)
        unpack_int8_cuda(b, xb, stream)
        _gemm_int8(xa, xb, c, slice(0, na), slice(0, nb), ptr)
        return
    half = (na // 2) // 16 * 16  # keeps every sub-block 16-byte aligned
    if half == 0:
        _gemm_int8(xa, xa, c, slice(0, na), slice(0, na), ptr)
        return
    _gemm_int8(xa, xa, c, slice(0, half), slice(0, half), ptr)
    _gemm_int8(xa, xa, c, slice(0, half), slice(half, na), ptr)
    _gemm_int8(xa, xa, c, slice(half, na), slice(half, na), ptr)
    _mirror_cuda(c, stream)
