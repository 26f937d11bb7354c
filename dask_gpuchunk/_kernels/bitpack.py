"""Per-chunk kernels for 0/1 matrices as bits: pack to 64-bit words, view packed words as 64-bit
words, unpack words to int8 bytes. A numba CUDA kernel and a CPU twin each, a NumPy reference.

Layout of packed words (the one :func:`dask_gpuchunk.bitpack` produces): a chunk of shape
``(n, k)`` becomes ``(n, ceil(k / 64))`` ``uint64``; bit ``j`` of word ``w`` is column ``64 w + j``;
padding bits are zero.

A Gram matrix only needs every row's bits in the *same* order, not in any particular one:
``popcount(a & b)`` summed over words does not change when the same permutation is applied to the
bits of both rows. So packed words of any unsigned dtype and any bit order (``np.packbits``
output, big- or little-endian words) are used as they are, viewed as 64-bit words
(:func:`words64`), and unpacking to bytes (:func:`unpack_int8_cuda`) may put the bits in any fixed
order. No dask here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .compiled import compiled_once

__all__ = [
    "WORD_BITS",
    "BitValueError",
    "bitpack_cpu",
    "bitpack_cuda",
    "check_bits_dtype",
    "check_words_dtype",
    "reference_bitpack",
    "unpack_int8_cuda",
    "words64",
]

#: Bits per packed word.
WORD_BITS = 64


class BitValueError(ValueError):
    """A value other than 0 or 1 where bits were expected, and where it was found.

    ``looks_packed``: the data are unsigned integers, the dtypes of packed words
    (``np.packbits`` output, ``uint64`` words), which is what such values most often mean; the
    message then names ``packed=True`` of ``dg.gram`` and ``dg.similarity`` first (converting
    packed bytes with ``x != 0`` would make each byte one bit: other answers, silently).
    :meth:`hint` words it for a caller whose option has another name (the CLI's ``--packed``).

    Examples
    --------
    >>> print(BitValueError(16, 0, 3, looks_packed=True).hint("--packed"))
    found 16 at row 0, column 3, where bits must be 0 or 1; these look like packed bits (np.packbits output or words): pass --packed to use them as they are; if each value is one bit, nonzero meaning 1, convert first: (x != 0).astype('uint8')
    """

    def __init__(self, value: Any, row: int, column: int, looks_packed: bool = False) -> None:
        self.value, self.row, self.column = value, row, column
        self.looks_packed = looks_packed
        super().__init__(f"bitpack: {self.hint('packed=True (dg.gram, dg.similarity)')}")

    def __reduce__(self) -> tuple:  # raised on a worker, re-raised by the client
        return type(self), (self.value, self.row, self.column, self.looks_packed)

    def hint(self, packed_option: str) -> str:
        """The message, naming the option that takes packed words as ``packed_option``."""
        where = f"found {self.value!r} at row {self.row}, column {self.column}"
        convert = "(x != 0).astype('uint8')"
        if self.looks_packed:
            return (f"{where}, where bits must be 0 or 1; these look like packed bits "
                    f"(np.packbits output or words): pass {packed_option} to use them as they "
                    f"are; if each value is one bit, nonzero meaning 1, convert first: {convert}")
        return f"{where}; bits must be 0 or 1 (convert first, e.g. {convert})"


def check_bits_dtype(dtype: Any, what: str = "x") -> np.dtype:
    """Return ``np.dtype(dtype)`` if it can hold 0/1 data to pack (bool or integer), else raise.

    Examples
    --------
    >>> check_bits_dtype("i1")
    dtype('int8')
    >>> check_bits_dtype("f8")
    Traceback (most recent call last):
    ...
    TypeError: x has dtype float64; bits must be bool or integer 0/1 data (convert first, e.g. (x > 0.5).astype('uint8'), or pass packed words with packed=True)
    """
    dt = np.dtype(dtype)
    if dt.kind not in "biu":
        raise TypeError(
            f"{what} has dtype {dt}; bits must be bool or integer 0/1 data (convert first, e.g. "
            "(x > 0.5).astype('uint8'), or pass packed words with packed=True)"
        )
    return dt.newbyteorder("=") if not dt.isnative else dt


def check_words_dtype(dtype: Any, what: str = "x") -> np.dtype:
    """Return ``np.dtype(dtype)`` if it is an unsigned word type for packed bits, else raise.

    Examples
    --------
    >>> check_words_dtype("u1")
    dtype('uint8')
    >>> check_words_dtype("i8")
    Traceback (most recent call last):
    ...
    TypeError: packed=True needs words of an unsigned integer dtype (uint8, uint16, uint32 or uint64, e.g. np.packbits output); x has dtype int64 (for 0/1 data, leave packed=False)
    """
    dt = np.dtype(dtype)
    if dt.kind != "u":
        raise TypeError(
            "packed=True needs words of an unsigned integer dtype (uint8, uint16, uint32 or "
            f"uint64, e.g. np.packbits output); {what} has dtype {dt} (for 0/1 data, leave "
            "packed=False)"
        )
    return dt


def words64(words: Any) -> Any:
    """View a 2-D chunk of packed words of any unsigned dtype as C-contiguous ``uint64`` words.

    Each row's bytes are zero-padded to a multiple of 8 and reinterpreted: the bits keep their
    count per row and the same order in every row, which is all a Gram matrix needs. Works on
    NumPy and CuPy arrays (CuPy in, CuPy out); copies only when padding or a contiguous copy
    is needed.

    Examples
    --------
    >>> w = words64(np.array([[0xFF, 0x01, 0x80]], dtype=np.uint8))
    >>> w.dtype, w.shape, [bin(int(v)).count("1") for v in w[0]]
    (dtype('uint64'), (1, 1), [10])
    """
    xp = _xp(words)
    if words.dtype.kind != "u":
        raise TypeError(f"packed words must be unsigned integers, got {words.dtype}")
    n, m = words.shape
    nbytes = m * words.dtype.itemsize
    nwords = -(-nbytes // 8)
    if words.dtype == np.uint64 and words.dtype.isnative and words.flags.c_contiguous:
        return words
    raw = xp.ascontiguousarray(words).view(np.uint8).reshape(n, nbytes)
    if nbytes != nwords * 8:
        padded = xp.zeros((n, nwords * 8), dtype=np.uint8)
        padded[:, :nbytes] = raw
        raw = padded
    return raw.view(np.uint64).reshape(n, nwords)


def _xp(a: Any) -> Any:
    if type(a).__module__.split(".", 1)[0] == "cupy":
        import cupy

        return cupy
    return np


def reference_bitpack(x: np.ndarray) -> np.ndarray:
    """Pack 0/1 data with NumPy only (what tests compare the kernels with).

    Examples
    --------
    >>> reference_bitpack(np.array([[1, 0, 1]]))
    array([[5]], dtype=uint64)
    """
    x = np.asarray(x)
    n, k = x.shape
    m = -(-k // WORD_BITS)
    bits = np.zeros((n, m * WORD_BITS), dtype=np.uint64)
    bits[:, :k] = x != 0
    weights = np.uint64(1) << np.arange(WORD_BITS, dtype=np.uint64)
    return (bits.reshape(n, m, WORD_BITS) * weights).sum(axis=2, dtype=np.uint64)


# ---- packing -------------------------------------------------------------------------------

#: ``numba.cuda``, imported at first use. Kernels must see it as a module global: numba's CUDA
#: simulator swaps that global for its own module when it runs them.
cuda: Any = None


def _load_cuda() -> None:
    global cuda
    if cuda is None:
        from numba import cuda as numba_cuda

        cuda = numba_cuda


# numba is imported at first use: the kernels below name this global, which their builders
# rebind to numba's prange before compiling them (numba reads a global's value when it
# compiles), as _kernels/gram.py does. Compiled with cache=True (in the package's cache
# directory): each process that packs (a job's workers, each command) loads them instead of
# compiling them again, 1.5 s on a 2-core machine.
_prange: Any = range


def _pack_bits(x, out, bad_col):  # pragma: no cover - compiled
    n, k = x.shape
    m = out.shape[1]
    for i in _prange(n):
        bad_col[i] = -1
        for w in range(m):
            acc = np.uint64(0)
            start = w * 64
            stop = min(start + 64, k)
            for c in range(start, stop):
                v = x[i, c]
                if v == 1:
                    acc |= np.uint64(1) << np.uint64(c - start)
                elif v != 0 and bad_col[i] < 0:
                    bad_col[i] = c
            out[i, w] = acc


#: Multiplying 8 bytes of 0/1 (one uint64, byte j the bit of column j) by this gathers them in
#: its top byte, bit j = byte j: every product term lands on its own bit, so nothing carries.
_GATHER = 0x0102040810204080
_LOW_BITS = 0x0101010101010101


def _pack_bytes(x, out, bad_row):  # pragma: no cover - compiled
    # One-byte data, 8 columns per multiply: 41-71 GB/s on the H200 host's 16 cores (9.3
    # on 2), where _pack_bits's branch per byte made 3.0 (0.4 on 2) and np.packbits
    # with a 0/1 check 3.8-4.8 on one core, holding the GIL.
    n, k = x.shape
    m = out.shape[1]
    full = k // 8
    gather = np.uint64(_GATHER)
    for i in _prange(n):
        seen = np.uint64(0)
        for w in range(m):
            acc = np.uint64(0)
            for g in range(8):
                b = w * 8 + g
                if b < full:
                    c = b * 8
                    v = np.uint64(0)
                    for j in range(8):
                        v |= np.uint64(x[i, c + j]) << np.uint64(8 * j)
                    seen |= v
                    acc |= ((v * gather) >> np.uint64(56)) << np.uint64(8 * g)
                elif b == full:
                    for c in range(b * 8, k):
                        v = np.uint64(x[i, c])
                        seen |= v
                        acc |= (v & np.uint64(1)) << np.uint64(c - w * 64)
            out[i, w] = acc
        bad_row[i] = (seen & ~np.uint64(_LOW_BITS)) != 0


@compiled_once
def _cpu_pack_kernel() -> Any:
    return _cached_parallel(_pack_bits)


@compiled_once
def _cpu_pack_bytes_kernel() -> Any:
    return _cached_parallel(_pack_bytes)


def _cached_parallel(kernel: Any) -> Any:
    import numba

    from .source_cache import cached_njit

    global _prange
    _prange = numba.prange
    return cached_njit(kernel, parallel=True)


def _raise_bad(x: Any, row: int, col: int, origin: tuple[int, int]) -> None:
    value = x[row, col]
    value = value.item() if hasattr(value, "item") else value
    raise BitValueError(value, row + origin[0], col + origin[1],
                        looks_packed=np.dtype(x.dtype).kind == "u")


def bitpack_cpu(x: np.ndarray, origin: tuple[int, int] = (0, 0)) -> np.ndarray:
    """Pack a 2-D NumPy chunk of 0/1 data into ``uint64`` words with numba's parallel CPU kernel.

    ``origin``: the chunk's first row and column in the whole array, for error messages.
    Raises :class:`BitValueError` naming the first value other than 0/1 and where it is.

    Examples
    --------
    >>> bitpack_cpu(np.array([[1, 1, 0, 1]], dtype=np.int8))
    array([[11]], dtype=uint64)
    >>> bitpack_cpu(np.array([[1, 2]]), origin=(10, 64))
    Traceback (most recent call last):
    ...
    dask_gpuchunk._kernels.bitpack.BitValueError: bitpack: found 2 at row 10, column 65; bits must be 0 or 1 (convert first, e.g. (x != 0).astype('uint8'))
    """
    x = np.asarray(x)
    if not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    if x.dtype == np.bool_:
        x = x.view(np.uint8)
    n, k = x.shape
    out = np.empty((n, -(-k // WORD_BITS)), dtype=np.uint64)
    if out.size == 0:
        return out
    if x.dtype.itemsize == 1 and x.dtype.kind in "iu":
        raw = x.view(np.uint8)
        bad_row = np.empty(n, dtype=np.bool_)
        _cpu_pack_bytes_kernel()(raw, out, bad_row)
        rows = np.flatnonzero(bad_row)
        if rows.size:
            col = int(np.flatnonzero(raw[rows[0]] > 1)[0])
            _raise_bad(x, int(rows[0]), col, origin)
        return out
    bad_col = np.empty(n, dtype=np.int64)
    _cpu_pack_kernel()(x, out, bad_col)
    rows = np.flatnonzero(bad_col >= 0)
    if rows.size:
        _raise_bad(x, int(rows[0]), int(bad_col[rows[0]]), origin)
    return out


@compiled_once
def _cuda_pack_kernel() -> Any:
    from numba import uint64

    _load_cuda()
    @cuda.jit
    def pack(x, out, first_bad):  # pragma: no cover - compiled
        # One thread per word: reads its 64 columns (a warp reads 32 * 64 consecutive
        # elements, whole cache lines) and keeps the first bad position seen anywhere.
        n, k = x.shape
        m = out.shape[1]
        start_t = cuda.grid(1)
        stride = cuda.gridsize(1)
        for t in range(start_t, n * m, stride):
            i = t // m
            w = t - i * m
            start = w * 64
            stop = min(start + 64, k)
            acc = uint64(0)
            for c in range(start, stop):
                v = x[i, c]
                if v == 1:
                    acc |= uint64(1) << uint64(c - start)
                elif v != 0:
                    cuda.atomic.min(first_bad, 0, i * k + c)
            out[i, w] = acc

    return pack


def bitpack_cuda(x: Any, origin: tuple[int, int] = (0, 0), stream: Any = 0,
                 out: Any = None) -> Any:
    """Pack a 2-D device chunk (CuPy or numba device array) of 0/1 data on the GPU.

    Returns a new device array of the same kind (or ``out``, a CuPy ``uint64`` array of the
    words' shape, filled). Checking the values needs one 8-byte read back
    of the first bad position, which waits for the kernel. Raises :class:`BitValueError`.
    """
    from numba import cuda

    cupy_in = _xp(x) is not np
    if cupy_in:
        import cupy

        if x.dtype == np.bool_:
            x = x.view(np.uint8)
        n, k = x.shape
        if out is None:
            out = cupy.empty((n, -(-k // WORD_BITS)), dtype=np.uint64)
        first_bad = cupy.full(1, n * k, dtype=np.int64)
        args = [cuda.as_cuda_array(a, sync=False) for a in (x, out, first_bad)]
    else:
        if x.dtype == np.bool_:
            x = x.view(np.uint8)
        n, k = x.shape
        out = cuda.device_array((n, -(-k // WORD_BITS)), dtype=np.uint64, stream=stream)
        first_bad = cuda.to_device(np.array([n * k], dtype=np.int64), stream=stream)
        args = [x, out, first_bad]
    if out.size == 0:
        return out
    threads = 256
    blocks = min(-(-out.size // threads), 4096)
    _cuda_pack_kernel()[blocks, threads, stream](*args)
    bad = int(first_bad[0]) if cupy_in else int(first_bad.copy_to_host(stream=stream)[0])
    if bad < n * k:
        _raise_bad(x, bad // k, bad % k, origin)
    return out


# ---- unpacking to bytes (for integer GEMMs on tensor cores) --------------------------------

_SPREAD = 0x0101010101010101
_BIT_OF_BYTE = 0x8040201008040201
_HIGH7 = 0x7F7F7F7F7F7F7F7F


@compiled_once
def _cuda_unpack_kernel() -> Any:
    from numba import uint64

    _load_cuda()
    @cuda.jit
    def unpack(words, out8):  # pragma: no cover - compiled
        # out8 is the int8 output viewed as uint64: each thread writes 8 bytes, one per
        # bit of one byte of a word (byte b of the result = bit b), so a warp's stores
        # are 256 consecutive bytes. Replicating the byte into all 8 bytes, masking bit
        # b in byte b and normalising each byte to 0/1 needs no loop and no carries.
        n, m8 = out8.shape
        start_t = cuda.grid(1)
        stride = cuda.gridsize(1)
        for t in range(start_t, n * m8, stride):
            i = t // m8
            q = t - i * m8
            byte = (words[i, q >> 3] >> uint64((q & 7) * 8)) & uint64(0xFF)
            spread = (byte * uint64(_SPREAD)) & uint64(_BIT_OF_BYTE)
            out8[i, q] = ((spread + uint64(_HIGH7)) >> uint64(7)) & uint64(_SPREAD)

    return unpack


def unpack_int8_cuda(words: Any, out: Any, stream: Any = 0) -> None:
    """Unpack ``uint64`` words ``(n, m)`` into 0/1 ``int8`` bytes ``out`` ``(n, 64 m)`` on the GPU.

    Both arguments are device arrays (CuPy or numba). Byte ``8 q + b`` of a row is bit ``b`` of
    byte ``q`` of the row's words: the order of bits within each word's bytes is kept, which is
    the same for every row.
    """
    from numba import cuda

    n, m = words.shape
    if out.shape != (n, m * WORD_BITS) or out.dtype != np.int8:
        raise ValueError(f"out must be int8 of shape {(n, m * WORD_BITS)}, got {out.dtype} {out.shape}")
    if n * m == 0:
        return
    if _xp(words) is not np:
        w_arg = cuda.as_cuda_array(words, sync=False)
        o_arg = cuda.as_cuda_array(out.view(np.uint64), sync=False)
    else:
        w_arg, o_arg = words, out.view(np.uint64)
    threads = 256
    blocks = min(-(-(n * m * 8) // threads), 8192)
    _cuda_unpack_kernel()[blocks, threads, stream](w_arg, o_arg)
