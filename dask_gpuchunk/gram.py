"""Exact Gram matrices ``A · Aᵀ`` of 0/1 data over Dask arrays, bit-packed: ``bitpack`` and ``gram``.

``gram`` is a contraction over word chunks, like :func:`dask.array.tensordot`: for every pair of
row chunks ``(i, j)`` and word chunk ``w`` one task computes the partial block
``A[i, w] · A[j, w]ᵀ``; the partials of a block are summed in a tree (``SPLIT_EVERY`` at a
time). Only blocks on or above the diagonal are computed: block ``(j, i)`` below it is the
transpose of block ``(i, j)``, and a diagonal block computes its own upper triangle and mirrors
it. The graph is listed by hand where small graphs are (``listed-graphs`` of
``config.INTERNAL``), else dask's ``blockwise`` and ``reduction``, as under dask's array query planning. The output's row and
column chunks are the input's row chunks, or consecutive groups of them (``block_rows``, by
default sized by the GPU's work), so it can be written to disk one block at a time
(:func:`dask_gpuchunk.to_npy`).

Placement of a block: CuPy chunks on their GPU (CuPy out); NumPy chunks on the GPU where one is
visible (``device="auto"``: a block of ``r`` rows does ``r`` AND + POPC per word it moves, and
the GPU's popcount rate is ~30 x the CPU's, so the GPU wins from a few hundred rows on), else on
the CPU.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from typing import Any

import dask.array as da
import numpy as np
from dask.array.utils import meta_from_array
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph
from dask.task_spec import List, Task, TaskRef

from . import backend, config
from ._kernels import bitpack as bits
from ._kernels import gram as kernels
from ._kernels.gram import Method
from ._kernels.bmma import BMMA_MIN_CC, TILE, bmma_cuda
from ._kernels.wgmma import WGMMA_CC, wgmma_cuda
from ._kernels.launch import numba_stream
from .arrays import asarray
from .budget import check_fits, working_budget
from .config import listed_graphs
from .devices import (
    Device,
    GPUNotAvailableError,
    check_device_for_graph,
    cluster_workers,
    distributed_client_active,
    gpu_available,
)
from .fingerprint_files import bit_vectors_as_words
from .io import npy_reader_of
from .resident import ResidentSource, row_bounds, rows_where_it_runs, source_tasks

__all__ = ["METHODS", "SPLIT_EVERY", "bitpack", "block_bytes", "block_counts",
           "block_scratch_bytes", "check_block_fits", "check_method", "device_block_counts",
           "device_block_scratch", "gram", "gram_slab", "grouped_row_chunks",
           "packed_words", "resident_gram_slab", "resolve_method", "task_block_rows"]

#: ``method=`` values of :func:`gram`.
METHODS = kernels.METHODS
#: Partial blocks summed per task of the tree over word chunks (as ``split_every`` in dask).
SPLIT_EVERY = 4
#: Bit-MACs a Gram block on a GPU should hold at least, where :func:`task_block_rows` groups
#: row chunks: ~20 ms of the wgmma kernel (7.9e15 bit-MAC/s on an H200 at 16,384-row blocks),
#: so that Dask's own ~1 ms a task stays under 5 % of the work. 4,096-row chunks of 262,144
#: bits are ~1 ms blocks: on 2 x H200 their ~600 tasks, not the GPUs, bounded the Gram.
TASK_BIT_MACS = 1.6e14
#: Row groups per side at least, and per worker of the cluster (as the square root of the
#: blocks a worker gets), so that every GPU has several blocks to run.
MIN_ROW_GROUPS = 4
BLOCKS_PER_WORKER = 8
#: One block of grouped rows takes at most this share (1/N) of the device's working budget: a
#: worker runs two at once, beside what it stores.
BLOCK_BUDGET_SHARE = 3
#: And its block of C at most this many bytes: blocks above the diagonal wait, stored on the
#: device, for their transposes below it. On 2 x H200 (8 GiB cap), 131,072 x 131,072 bits in
#: 1 GiB blocks spilled them to the host and ran slower than on one GPU (6.05 s against 4.52 s);
#: 65,536 x 262,144 bits in 576 MiB blocks ran in 0.18 s.
BLOCK_MAX_BYTES = 640 << 20


# ---- bitpack ---------------------------------------------------------------------------------


def _aligned_bit_chunks(chunks: tuple[int, ...]) -> tuple[int, ...]:
    """Column chunks whose boundaries (but the last) fall on multiples of 64, close to ``chunks``.

    Examples
    --------
    >>> _aligned_bit_chunks((100, 100, 100))
    (128, 128, 44)
    >>> _aligned_bit_chunks((64, 64, 5))
    (64, 64, 5)
    """
    total = sum(chunks)
    bounds, edge = [], 0
    for c in chunks[:-1]:
        edge += c
        b = -(-edge // bits.WORD_BITS) * bits.WORD_BITS
        if b < total and (not bounds or b > bounds[-1]):
            bounds.append(b)
    edges = [0, *bounds, total]
    return tuple(b - a for a, b in itertools.pairwise(edges))


def _bitpack_block(block: Any, device: str, block_info: dict | None = None) -> Any:
    origin = (0, 0)
    if block_info and 0 in block_info:
        origin = tuple(start for start, _ in block_info[0]["array-location"])
    shape = (block.shape[0], -(-block.shape[1] // bits.WORD_BITS))

    def launch(out: Any, inputs: list[Any], nb_stream: Any) -> None:
        bits.bitpack_cuda(inputs[0], origin, nb_stream, out=out)

    work = backend.ChunkWork(
        f"a bitpack chunk of {block.shape[0]} x {block.shape[1]}",
        on_cpu=lambda: backend.run_cpu_kernel(bits.bitpack_cpu, block, origin),
        on_gpu=lambda: backend.DeviceLaunch(launch, shape, np.uint64),
        # "auto" packs NumPy chunks on the CPU: it reads every byte once, faster than PCIe
        # would move it.
        stage=device == "gpu")
    inputs = [block if backend.is_cupy(block) else np.ascontiguousarray(block)]
    return backend.run_chunk(work, inputs, device)


def bitpack(x: Any, *, device: Device = "auto") -> da.Array:
    """Pack 0/1 data ``(n, k)`` into ``uint64`` words ``(n, ceil(k / 64))``, chunk by chunk.

    Bit ``j`` of word ``w`` is column ``64 w + j``; padding bits are zero. Column chunks are
    first aligned to multiples of 64 (the last may be shorter), so every chunk packs on its own.

    Parameters
    ----------
    x
        Dask, NumPy or CuPy array of bool or integer dtype holding only 0 and 1.
    device
        ``"auto"`` (CuPy chunks on their GPU, NumPy chunks on the CPU: packing reads every
        byte once, which the CPU does faster than PCIe moves it), ``"gpu"`` or ``"cpu"``.

    Returns
    -------
    dask.array.Array
        ``uint64``, row chunks as ``x``'s; CuPy chunks for CuPy input.

    Raises
    ------
    TypeError
        ``x`` is not bool or integer.
    ValueError
        ``x`` is not 2-D; at compute time, a value other than 0 or 1 (the message names the
        value, its row and its column).

    Examples
    --------
    >>> import numpy as np
    >>> bits = np.array([[1, 0, 1], [0, 1, 1]], dtype=np.int8)
    >>> bitpack(bits).compute()
    array([[5],
           [6]], dtype=uint64)
    """
    check_device_for_graph(device)
    x = asarray(x)
    if x.ndim != 2:
        raise ValueError(f"bitpack takes a 2-D array (rows x bits); got {x.ndim}-D shape {x.shape}")
    bits.check_bits_dtype(x.dtype, "x")
    col_chunks = _aligned_bit_chunks(x.chunks[1]) if x.shape[1] else x.chunks[1]
    if col_chunks != x.chunks[1]:
        x = x.rechunk({1: col_chunks})
    word_chunks = tuple(-(-c // bits.WORD_BITS) for c in x.chunks[1])
    meta = meta_from_array(x._meta, ndim=2, dtype=np.uint64)
    return x.map_blocks(
        _bitpack_block, device, dtype=np.uint64, meta=meta,
        chunks=(x.chunks[0], word_chunks), name=f"bitpack-{tokenize(x, device)}",
    )


# ---- gram ------------------------------------------------------------------------------------


def resolve_method(method: str, on_gpu: bool) -> str:
    """The method that runs a block: ``"auto"`` becomes the fastest one the executing device has.

    On a GPU, ``"wgmma"`` on a Hopper (compute capability 9.0: warpgroup 1-bit tensor-core
    instructions, about 2.8 x ``"bmma"`` there on a long-row Gram), else ``"bmma"`` (1-bit
    tensor cores, compute capability 8.0 and later; about 2 x ``"int8"`` and 10 x
    ``"popcount"`` on an H200, see the README), else ``"int8"`` (cuBLAS on the int8 tensor
    cores, compute capability 7.5 and later), else ``"popcount"``; on the CPU, ``"popcount"``.

    Examples
    --------
    >>> resolve_method("auto", on_gpu=False)
    'popcount'
    """
    if method != "auto":
        return method
    if not on_gpu:
        return "popcount"
    cc = _compute_capability()
    if cc == WGMMA_CC:
        return "wgmma"
    if cc >= BMMA_MIN_CC:
        return "bmma"
    return "int8" if cc >= (7, 5) else "popcount"


@functools.cache
def _cc(device_id: int) -> tuple[int, int]:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    return int(props["major"]), int(props["minor"])


def _compute_capability() -> tuple[int, int]:
    import cupy

    return _cc(cupy.cuda.runtime.getDevice())


def _launcher(method: str, diagonal: bool) -> Any:
    def launch(out: Any, inputs: list[Any], nb_stream: Any) -> None:
        a, b = inputs[0], (None if diagonal else inputs[1])
        if method == "int8":
            kernels.int8_cuda(a, b, out, nb_stream)
        elif method == "bmma":
            bmma_cuda(a, b, out, nb_stream)
        elif method == "wgmma":
            wgmma_cuda(a, b, out, nb_stream)
        else:
            kernels.popcount_cuda(a, b, out, nb_stream)

    return launch


def block_scratch_bytes(method: str, na: int, nb: int, words: int, diagonal: bool = False) -> int:
    """Device bytes a Gram block of ``na`` x ``nb`` rows of ``words`` 64-bit words allocates
    beyond its inputs and output: int8 unpacks each operand to a byte per bit; bmma copies an
    operand whose rows it must pad (counted as a copy of each, the most it makes); wgmma
    copies an operand whose rows are not contiguous whole 16-byte pieces (counted likewise).

    Examples
    --------
    >>> block_scratch_bytes("int8", 4096, 4096, 3125)
    1638400000
    >>> block_scratch_bytes("popcount", 4096, 4096, 3125)
    0
    """
    rows = na if diagonal else na + nb
    if method == "int8":
        return rows * words * 64
    if method == "bmma":
        per_stage = TILE.kbits // 64
        return rows * (-(-words // per_stage) * per_stage) * 8
    if method == "wgmma":
        return (na + (0 if diagonal else nb)) * (words + words % 2) * 8
    return 0


def _run_counts(inputs: list[Any], shape: tuple[int, int], method: str, device: str,
                gpu_launch: Callable[[str], Any], on_cpu: Callable[[], Any],
                scratch: Callable[[str], int] = lambda method: 0) -> Any:
    """Counts of packed ``inputs`` (``uint64`` words) where :func:`dask_gpuchunk.backend.chunk_site`
    says: CuPy chunks on their GPU, NumPy chunks on a GPU or the CPU. ``gpu_launch(method)``
    makes the ``launch`` for the resolved method, which allocates ``scratch(method)`` bytes on
    the device; ``on_cpu()`` computes on the CPU."""

    def on_gpu() -> backend.DeviceLaunch:
        resolved = resolve_method(method, on_gpu=True)
        return backend.DeviceLaunch(gpu_launch(resolved), shape, np.int32, scratch(resolved))

    gpu_only = (f"method={method!r} runs on a GPU only; use method='popcount' or 'auto' here"
                if method in kernels.GPU_METHODS else None)
    work = backend.ChunkWork(f"a Gram block of {shape[0]} x {shape[1]} rows", on_cpu, on_gpu,
                             gpu_only=gpu_only)
    return backend.run_chunk(work, inputs, device)


def _slab_launcher(method: str) -> Any:
    """``launch`` for a whole-width row slab: each column block into one device scratch block,
    then into its columns of the slab (so every kernel writes a contiguous ``C``)."""
    block_launch = _launcher(method, diagonal=False)

    def launch(out: Any, inputs: list[Any], nb_stream: Any) -> None:
        import cupy

        a, col, block = inputs[0], 0, None
        for b in inputs[1:]:
            width = b.shape[0]
            if block is None or block.shape[1] != width:
                block = cupy.empty((a.shape[0], width), dtype=np.int32)
            block_launch(block, [a, b], nb_stream)
            out[:, col:col + width] = block
            col += width

    return launch


def gram_slab(a: Any, others: list[Any], method: str = "auto", device: str = "auto") -> Any:
    """One whole-width row slab of a Gram matrix, every block computed, in one call.

    ``a``: packed words of some rows; ``others``: the packed words of all rows, in order, in
    row chunks (each with every word of its rows). Returns ``popcount(a & row)`` against every
    row: ``int32`` ``(len(a), sum of len(others))``, on the device ``a`` is on (NumPy chunks
    on a GPU where one is visible, as :func:`gram`). For writing a Gram row by row to a file
    with nothing left for the host to do but write (no transposes, no joining of blocks).

    Examples
    --------
    >>> a = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=np.uint8)
    >>> w = np.packbits(a, axis=1)
    >>> gram_slab(w[:1], [w[:2], w[2:]], device="cpu")
    array([[2, 1, 2]], dtype=int32)
    """
    inputs = [bits.words64(a), *(bits.words64(b) for b in others)]

    def on_cpu() -> np.ndarray:
        out = np.empty(shape, dtype=np.int32)
        col = 0
        for b in inputs[1:]:
            out[:, col:col + b.shape[0]] = backend.run_cpu_kernel(kernels.popcount_cpu, inputs[0], b)
            col += b.shape[0]
        return out

    shape = (a.shape[0], sum(b.shape[0] for b in inputs[1:]))
    widest = max((b.shape[0] for b in inputs[1:]), default=0)

    def scratch(resolved: str) -> int:
        # One block of the widest column chunk, and what its launch allocates.
        return (a.shape[0] * widest * 4
                + block_scratch_bytes(resolved, a.shape[0], widest, inputs[0].shape[1]))

    return _run_counts(inputs, shape, method, device, _slab_launcher, on_cpu, scratch)


def _gram_block(a: Any, b: Any, diagonal: bool, method: str, device: str) -> Any:
    """One partial block ``popcount(a & b)``; ``diagonal``: ``a`` and ``b`` the same rows, the
    symmetric ``a · aᵀ`` (half the work)."""
    inputs = [bits.words64(a)] if diagonal else [bits.words64(a), bits.words64(b)]
    return _run_counts(
        inputs, (a.shape[0], b.shape[0]), method, device,
        lambda resolved: _launcher(resolved, diagonal),
        lambda: backend.run_cpu_kernel(kernels.popcount_cpu, inputs[0],
                                       None if diagonal else inputs[1]),
        lambda resolved: block_scratch_bytes(resolved, a.shape[0], b.shape[0],
                                             inputs[0].shape[1], diagonal))


def _upper_partial(a: Any, b: Any, rows_a: Any, rows_b: Any, method: str, device: str) -> Any:
    """The partial block ``popcount(a & b)`` of one word chunk where it is on or above the
    diagonal (``None`` below it: :func:`_mirrored` takes its transpose from above).

    ``rows_a`` and ``rows_b`` hold the row positions of the two row chunks: a block is computed
    where its first row is not below its first column, so a pair of blocks is computed once
    even where slicing has cut the chunks unevenly. ``a`` and ``b`` the same rows: the
    symmetric ``a · aᵀ``, half the work."""
    if not (len(rows_a) and len(rows_b)):
        return _zeros_like_block(a, b)
    if rows_a[0] > rows_b[0]:
        return None
    return _gram_block(a, b, len(rows_a) == len(rows_b) and rows_a[0] == rows_b[0], method,
                       device)


def _zeros_like_block(a: Any, b: Any) -> Any:
    if backend.is_cupy(a):
        import cupy

        return cupy.zeros((a.shape[0], b.shape[0]), dtype=np.int32)
    return np.zeros((a.shape[0], b.shape[0]), dtype=np.int32)


def _word_partial(a: Any, b: Any, rows_a: Any, rows_b: Any, method: str, device: str) -> Any:
    """:func:`_upper_partial` of one of several word chunks, with the contracted axis kept
    (length 1) as :func:`dask.array.reduction` counts it."""
    block = _upper_partial(a, b, rows_a, rows_b, method, device)
    return None if block is None else block[..., None]


def _keep(block: Any, axis: Any = None, keepdims: bool = True) -> Any:
    return block


def _sum_partials(partials: list[Any], axis: Any = None, keepdims: bool = False) -> Any:
    """Sum a list of partial blocks (``None`` below the diagonal stays ``None``)."""
    partials = [p for p in partials if p is not None]
    if not partials:
        return None
    total = _sum_blocks(*partials) if len(partials) > 1 else partials[0]
    return total if keepdims else total[..., 0]


def _sum_blocks(*blocks: Any) -> Any:
    total = blocks[0] + blocks[1]
    for block in blocks[2:]:
        total += block
    return total


def _transposed(block: Any) -> Any:
    """``block.T`` where the block is: a view of a host block, a C-order copy on a GPU. A sum
    reads the view in memory order; a file write copies it tile by tile
    (:func:`dask_gpuchunk._kernels.gram.c_ordered`). Copied here, the 120 mirrored blocks of a
    65,536-row Gram from a file (7.7 GB) took more of one GPU worker's two threads than the
    kernels did (2 x H100, the perf notes (git show 85dc246:docs/perf-notes.md) item 31)."""
    return backend.run_chunk(backend.ChunkWork(
        "a transposed block", on_cpu=lambda: block.T,
        on_device=lambda: block.T.copy(), stage=False), [block])


def _mirrored(block: Any, above: Any) -> Any:
    """Block ``(i, j)`` of the Gram: computed (on or above the diagonal), or, where
    :func:`_upper_partial` left it ``None``, the transpose of block ``(j, i)``, ``above``."""
    return block if block is not None else _transposed(above)


def gram(x: Any, *, packed: bool = False, method: Method = "auto",
         device: Device = "auto", block_rows: int | None = None,
         keep_on_device: bool = False) -> da.Array:
    """The exact Gram matrix ``C = A · Aᵀ`` of 0/1 data ``A`` ``(n, k)``, as ``int32`` ``(n, n)``.

    Parameters
    ----------
    x
        Dask, NumPy or CuPy array. ``packed=False``: bool or integer 0/1 data ``(n, k)``, packed
        with :func:`bitpack` first. ``packed=True``: packed words ``(n, m)`` of any unsigned
        dtype in any bit order (``np.packbits(a, axis=1)`` output as it is, or
        :func:`bitpack`'s); padding bits must be zero. Or a list of RDKit bit vectors
        (``ExplicitBitVect``), packed on the way.
    packed
        Whether ``x`` already holds packed words.
    method
        ``"popcount"`` (numba kernels, AND + POPC over 64-bit words, GPU and CPU), ``"int8"``
        (GPU: unpack to int8 on the device, exact int32 GEMM on the tensor cores through cuBLAS),
        ``"bmma"`` (GPU, compute capability 8.0 and later: 1-bit tensor-core MMA on the words),
        ``"wgmma"`` (GPU, compute capability 9.0 only, Hopper: the same on the warpgroup
        instructions, operands copied in bulk) or ``"auto"`` (the fastest that the executing
        device has: :func:`resolve_method`).
    device
        ``"auto"`` (CuPy chunks on their GPU; NumPy chunks on a GPU where one is visible, else
        the CPU), ``"gpu"`` or ``"cpu"``.
    block_rows
        Rows of ``C``'s blocks, each a task: consecutive row chunks of ``x`` are grouped up to
        this many rows (a chunk is never split). ``None``: chosen by the GPU's work where ``x``
        is CuPy or a :func:`dask_gpuchunk.from_npy` array and a GPU is visible here
        (:func:`task_block_rows`: blocks of ~20 ms of GPU work, within the device budget,
        several for every worker), else ``x``'s row chunks.
    keep_on_device
        For words straight from a :func:`dask_gpuchunk.from_npy` file on a GPU: ``C``'s blocks
        stay on the GPU that computed them (CuPy), for a reduction such as ``C.sum()`` that
        then never moves ``C`` to the host. Elsewhere blocks are where they are computed
        already (CuPy for CuPy words, NumPy on the CPU).

    Returns
    -------
    dask.array.Array
        ``int32`` ``(n, n)``, row and column chunks of ``block_rows`` (grouped row chunks of
        ``x``); CuPy chunks for CuPy input or ``keep_on_device``. Each entry counts the columns
        where both rows hold 1, exactly (for ``k < 2**31``).

    Raises
    ------
    TypeError
        Wrong dtype for ``packed``.
    ValueError
        Not 2-D, unknown ``method`` or ``device``, ``method="int8"`` with ``device="cpu"``; at
        compute time, a value other than 0 or 1.
    GPUNotAvailableError
        ``device="gpu"`` or ``method="int8"`` where no GPU is visible.

    Notes
    -----
    Words straight from :func:`dask_gpuchunk.from_npy` (nothing done to them, whole rows in
    each chunk) are read by the blocks themselves: each row chunk once per process, kept on its
    GPU (at most half the device budget) or in host memory while the compute needs it, and never
    sent between workers (:mod:`dask_gpuchunk.resident`).

    Examples
    --------
    >>> import numpy as np
    >>> a = np.array([[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 1, 1]], dtype=np.uint8)
    >>> gram(a).compute()
    array([[3, 1, 3],
           [1, 2, 2],
           [3, 2, 4]], dtype=int32)
    >>> (gram(np.packbits(a, axis=1), packed=True).compute() == a.astype(int) @ a.T).all()
    np.True_
    >>> gram(da.ones((6, 8), chunks=(2, 8), dtype=np.uint8), block_rows=4).chunks
    ((4, 2), (4, 2))
    """
    check_method(method, device)
    if block_rows is not None and (isinstance(block_rows, bool) or not isinstance(
            block_rows, (int, np.integer)) or block_rows < 1):
        raise ValueError(f"block_rows must be a whole number of rows, 1 or more; got "
                         f"{block_rows!r}")
    x, _, packed = bit_vectors_as_words(x, None, packed)
    words = packed_words(x, packed, device, "gram")
    on_gpu = device != "cpu" and gpu_available()
    reader = npy_reader_of(words)
    if block_rows is None and on_gpu and (reader is not None or backend.is_cupy(words._meta)):
        block_rows = task_block_rows(words.shape[0], words.shape[1] * words.dtype.itemsize * 8,
                                     method)
    row_chunks = grouped_row_chunks(words.chunks[0], block_rows)
    if on_gpu:
        check_block_fits((row_chunks, words.chunks[1]), words.dtype.itemsize, method)
    return _gram_graph(words, reader, method, device, row_chunks,
                       keep_on_device and on_gpu and reader is not None)


def grouped_row_chunks(chunks: tuple[int, ...], block_rows: int | None) -> tuple[int, ...]:
    """``chunks`` grouped, consecutive ones summed while a group stays within ``block_rows``
    (a chunk larger than that is a group of its own; ``None``: as they are).

    Examples
    --------
    >>> grouped_row_chunks((4, 4, 4, 4, 3), 8)
    (8, 8, 3)
    >>> grouped_row_chunks((5, 2, 9, 1), 6)
    (5, 2, 9, 1)
    >>> grouped_row_chunks((4, 4), None)
    (4, 4)
    """
    if block_rows is None:
        return tuple(chunks)
    groups: list[int] = []
    for rows in chunks:
        if groups and groups[-1] + rows <= block_rows:
            groups[-1] += rows
        else:
            groups.append(rows)
    return tuple(groups)


def task_block_rows(rows: int, bits: int, method: str = "auto", budget: int | None = None,
                    workers: int | None = None) -> int:
    """Rows of the Gram's blocks on GPUs: enough for :data:`TASK_BIT_MACS` of work each, but
    no more than a block within ``budget / BLOCK_BUDGET_SHARE`` (this process's working budget
    where ``None``) or a block of C over :data:`BLOCK_MAX_BYTES`, and at least ``max(MIN_ROW_GROUPS, sqrt(BLOCKS_PER_WORKER * workers))``
    groups per side (``workers``: the default client's cluster's, where ``None``).

    Examples
    --------
    >>> task_block_rows(65536, 262144, "popcount", budget=7 << 30, workers=2)
    12952
    >>> task_block_rows(65536, 262144, "popcount", budget=2 << 30, workers=2)
    7424
    >>> task_block_rows(65536, 262144, "popcount", budget=7 << 30, workers=4)
    10923
    """
    budget = working_budget() if budget is None else budget
    workers = cluster_workers() if workers is None else workers
    words64 = -(-bits // 64)
    resolved = method if method != "auto" else resolve_method("auto", on_gpu=True)
    by_work = int((TASK_BIT_MACS / max(bits, 1)) ** 0.5)
    groups = max(MIN_ROW_GROUPS, int(np.ceil((BLOCKS_PER_WORKER * workers) ** 0.5)))
    by_balance = -(-rows // groups)
    # The largest multiple of 128 rows whose block fits its share of the budget.
    low, high = 0, max(rows, 128) // 128
    while low < high:
        mid = (low + high + 1) // 2
        fits = block_bytes(mid * 128, words64, resolved) <= budget // BLOCK_BUDGET_SHARE
        low, high = (mid, high) if fits else (low, mid - 1)
    by_memory = max(low * 128, 1)
    by_block = int((BLOCK_MAX_BYTES // 4) ** 0.5)
    return max(1, min(by_work, by_balance, by_memory, by_block))


def packed_words(x: Any, packed: bool, device: str, what: str = "gram", name: str = "x"
                 ) -> da.Array:
    """The packed words of ``x`` as :func:`gram` takes it: 2-D, words of an unsigned dtype
    (``packed``) or 0/1 data packed by :func:`bitpack`."""
    x = asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{what} takes 2-D arrays (rows x bits); got {x.ndim}-D shape "
                         f"{x.shape} for {name}")
    if packed:
        bits.check_words_dtype(x.dtype, name)
        return x
    return bitpack(x, device="cpu" if device == "cpu" else "auto")


def block_counts(a: Any, b: Any, method: Method = "auto", device: Device = "auto") -> Any:
    """``popcount(a & b)`` of every row of ``a`` with every row of ``b`` (packed words, the
    same width): one ``int32`` block ``(len(a), len(b))``, where the chunk dispatch sends it
    (as :func:`gram`'s blocks).

    Examples
    --------
    >>> w = np.packbits(np.array([[1, 0, 1], [0, 1, 1]], dtype=np.uint8), axis=1)
    >>> block_counts(w, w[:1], device="cpu")
    array([[2],
           [1]], dtype=int32)
    """
    return _gram_block(a, b, False, method, device)


def device_block_counts(a: Any, b: Any, method: str = "auto") -> Any:
    """:func:`block_counts` of two CuPy blocks, queued on the current stream, for a caller that
    holds the device budget it needs (:func:`device_block_scratch` and the ``int32`` block)
    and goes on to use the counts within the same reservation."""
    import cupy

    resolved = resolve_method(method, on_gpu=True)
    inputs = [bits.words64(a), bits.words64(b)]
    out = cupy.empty((a.shape[0], b.shape[0]), dtype=np.int32)
    if out.size:
        _launcher(resolved, False)(out, inputs, numba_stream(cupy.cuda.get_current_stream()))
    return out


def device_block_scratch(a: Any, b: Any, method: str = "auto") -> int:
    """Device bytes :func:`device_block_counts` of ``a`` and ``b`` allocates besides its
    output."""
    resolved = resolve_method(method, on_gpu=True)
    words = -(-a.shape[1] * a.dtype.itemsize // 8)
    return block_scratch_bytes(resolved, a.shape[0], b.shape[0], words)


def check_method(method: str, device: str) -> None:
    """Validate ``method=`` with ``device=`` as :func:`gram` does: a GPU method needs a GPU
    here, unless a distributed client is active (its workers may have one)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}; got {method!r}")
    check_device_for_graph(device)
    if method in kernels.GPU_METHODS:
        if device == "cpu":
            raise ValueError(f"method={method!r} runs on a GPU only; use device='auto' or 'gpu'")
        if not distributed_client_active() and not gpu_available():
            raise GPUNotAvailableError(
                f"method={method!r} needs a CUDA GPU and none is visible; use method='popcount' "
                "or 'auto', which run on the CPU too"
            )


def block_bytes(rows: int, words64: int, method: str) -> int:
    """Device bytes of one off-diagonal Gram block of ``rows``-row chunks of ``words64``
    64-bit words: both operands, the ``int32`` block and the method's scratch.

    Examples
    --------
    >>> block_bytes(4096, 3125, "popcount")
    271908864
    """
    return 2 * rows * words64 * 8 + rows * rows * 4 + block_scratch_bytes(method, rows, rows,
                                                                            words64)


def check_block_fits(chunks: tuple[tuple[int, ...], ...], itemsize: int, method: str,
                     budget: int | None = None) -> None:
    """Refuse, before any work, Gram blocks that cannot fit the device budget (this process's,
    or ``budget``): :class:`dask_gpuchunk.budget.DeviceBudgetError` naming the bytes."""
    rows = max(chunks[0], default=0)
    words64 = -(-max(chunks[1], default=0) * itemsize // 8)
    resolved = method if method != "auto" else resolve_method("auto", on_gpu=True)
    check_fits(block_bytes(rows, words64, resolved),
               f"a Gram block of {rows} x {rows} rows of {words64 * 64} bits ({resolved})",
               "fewer rows per chunk: chunks= of the rows, --chunk-rows", budget)


def _gram_graph(words: da.Array, reader: Any, method: str, device: str,
                row_chunks: tuple[int, ...], keep_on_device: bool = False) -> da.Array:
    """``C`` from packed words: listed by hand where small graphs are (:func:`_listed_graph`),
    else through dask's own constructors (so that array query planning can rewrite it): one
    task per block and word chunk, those below the diagonal returning ``None`` at once, the
    partials of a block summed in a tree (:func:`dask.array.reduction`, ``SPLIT_EVERY`` at a
    time), and a task per block that passes it on or, below the diagonal, transposes its
    mirror."""
    meta = meta_from_array(words._meta, ndim=2, dtype=np.int32)
    if not words.chunks[1]:  # no bits at all: every count is zero
        return da.zeros((words.shape[0],) * 2, chunks=(words.chunks[0],) * 2, dtype=np.int32,
                        meta=meta)
    if reader is not None:  # words straight from a .npy (npy_reader_of)
        if keep_on_device:
            import cupy

            meta = meta_from_array(cupy.empty((0, 0), np.int32), ndim=2, dtype=np.int32)
        return _resident_graph(words, reader, method, device, meta, row_chunks, keep_on_device)
    if listed_graphs():
        return _listed_graph(words, method, device, meta, row_chunks)
    if row_chunks != words.chunks[0]:
        # dask's own rechunk: each group one chunk, stored beside the words while needed.
        words = words.rechunk({0: row_chunks})
    rows = da.arange(words.shape[0], chunks=(words.chunks[0],))
    kwargs = {"method": method, "device": device, "dtype": np.int32}
    if len(words.chunks[1]) == 1:
        upper = da.blockwise(_upper_partial, "ij", words, "ik", words, "jk", rows, "i", rows, "j",
                             concatenate=True, meta=meta, **kwargs)
    else:
        partials = da.blockwise(_word_partial, "ijk", words, "ik", words, "jk", rows, "i",
                                rows, "j", meta=meta_from_array(meta, ndim=3), **kwargs)
        upper = da.reduction(partials, _keep, _sum_partials, combine=_sum_partials, axis=2,
                             dtype=np.int32, concatenate=False, split_every=SPLIT_EVERY,
                             meta=meta)
    return da.blockwise(_mirrored, "ij", upper, "ij", upper, "ji", dtype=np.int32, meta=meta)


def _resident_block(source: ResidentSource, rows_a: tuple[int, int], rows_b: tuple[int, int],
                    diagonal: bool, method: str, device: str, keep_on_device: bool = False
                    ) -> Any:
    """Block ``(rows_a, rows_b)`` of the Gram of the words ``source`` reads from a file, each
    chunk read once per process and kept where the block runs (on this process's GPU, or in
    host memory for the CPU); a NumPy block, as the file's words are NumPy, unless
    ``keep_on_device`` (then where it was computed)."""
    a = rows_where_it_runs(source, *rows_a, device)
    b = a if diagonal else rows_where_it_runs(source, *rows_b, device)
    block = _gram_block(a, b, diagonal, method, device)
    return _on_host(block) if backend.is_cupy(block) and not keep_on_device else block


def resident_gram_slab(source: ResidentSource, rows_a: tuple[int, int],
                       others: list[tuple[int, int]], method: str = "auto",
                       device: str = "auto") -> np.ndarray:
    """:func:`gram_slab` of rows ``rows_a`` (start, stop) of the words ``source`` reads from
    a file against its row chunks ``others``, each chunk read once per process and kept where
    the slab runs (:func:`~dask_gpuchunk.resident.rows_where_it_runs`), as a NumPy slab.
    Passed as chunks of a Dask array, every slab task was sent every chunk it did not hold
    (on two H100s, 1 GB of words a worker, then 9.1 GB of pageable copies into pinned buffers)
    and staged all of them to its GPU again.

    Examples
    --------
    >>> from dask_gpuchunk.resident import ResidentSource
    >>> w = np.packbits(np.array([[1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=np.uint8), axis=1)
    >>> resident_gram_slab(ResidentSource(w, "w"), (0, 1), [(0, 2), (2, 3)], device="cpu")
    array([[2, 1, 2]], dtype=int32)
    """
    a = rows_where_it_runs(source, *rows_a, device)
    slab = gram_slab(a, [rows_where_it_runs(source, *rows, device) for rows in others],
                     method, device)
    return _on_host(slab) if backend.is_cupy(slab) else slab


def _on_host(block: Any) -> np.ndarray:
    """A CuPy block copied to host memory (pinned, as the staged path's results are)."""
    import cupy

    from .staging import copy_to_host

    host = backend.host_result(block.shape, block.dtype)
    t0 = time.perf_counter()
    stream = cupy.cuda.get_current_stream()
    copy_to_host(host, block, stream)
    stream.synchronize()
    backend.staging_totals.add(d2h_bytes=int(block.nbytes), device_seconds=time.perf_counter() - t0)
    return host


def _resident_graph(words: da.Array, reader: Any, method: str, device: str, meta: Any,
                    row_chunks: tuple[int, ...], keep_on_device: bool = False) -> da.Array:
    """The graph of :func:`_gram_graph` for words straight from a ``.npy`` (:func:`from_npy`):
    a task per block on or above the diagonal that reads its two row chunks itself
    (:func:`_resident_block`), a transpose per block below. No task reads a chunk for the
    others, so none is sent between workers: on two GPUs the words' chunks had been sent (2.3 GB
    over TLS for 2.1 GB of words) and staged again for every block (34 GB of H2D). The reader
    and the source that reads it are entries of the graph
    (:func:`~dask_gpuchunk.resident.source_tasks`)."""
    recompute = config.checked("gram-mirror") == "recompute"
    token = tokenize(words, method, device, "resident", recompute, config.flag("read-ahead"),
                     row_chunks, keep_on_device)
    name, upper = f"gram-{token}", f"gram-upper-{token}"
    bounds = row_bounds(row_chunks)
    dsk, source_key = source_tasks(reader, token, read_ahead=bounds)
    # The computed blocks are a task group of their own, whose only dependency is the source,
    # each marked a data producer: distributed then takes them as root tasks and hands them to
    # whichever worker has a free thread. Named as the Gram's own blocks, the group depended
    # on itself (the transposes), so each went where the source was made: on two GPUs one
    # worker ran ~3/4 of the blocks and sent the other 1.3 GB of them for its transposes.
    # Unmarked, the diagonal blocks, fused with their one dependent, form a group of their own
    # that is root-ish only while it has more than twice the cluster's threads: on four GPUs
    # of two threads one worker ran all 16 of them.
    for i, rows_a in enumerate(bounds):
        first_computed = 0 if recompute else i  # the blocks before it are transposes
        for j in range(first_computed, len(bounds)):
            dsk[(upper, i, j)] = Task((upper, i, j), _resident_block, TaskRef(source_key),
                                      rows_a, bounds[j], i == j, method, device,
                                      keep_on_device, _data_producer=True)
            dsk[(name, i, j)] = (upper, i, j)
        for j in range(first_computed):
            dsk[(name, i, j)] = (_transposed, (upper, j, i))
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=[])
    return da.Array(graph, name, (row_chunks, row_chunks), dtype=np.int32, meta=meta)


def _add_tree(dsk: dict, parts: list[tuple], final: tuple, prefix: str) -> None:
    """Sum the task keys ``parts`` into ``final`` by a tree of ``SPLIT_EVERY``-way sums."""
    level = 0
    while len(parts) > SPLIT_EVERY:
        groups = [parts[g:g + SPLIT_EVERY] for g in range(0, len(parts), SPLIT_EVERY)]
        parts = []
        for g, group in enumerate(groups):
            if len(group) == 1:
                parts.append(group[0])
                continue
            key = (prefix, *final[1:], level, g)
            dsk[key] = (_sum_blocks, *group)
            parts.append(key)
        level += 1
    dsk[final] = (_sum_blocks, *parts)


def _listed_graph(words: da.Array, method: str, device: str, meta: Any,
                  row_chunks: tuple[int, ...]) -> da.Array:
    """The graph of :func:`_gram_graph` as a plain dict: a task per block on or above the
    diagonal and word chunk, a tree of sums, a transpose per block below; no task for what is
    not computed. Blocks over groups of row chunks (``row_chunks``, grouped from ``words``'
    by :func:`grouped_row_chunks`) join their groups' chunks inside the task
    (:func:`_grouped_block`): regrouped by dask's rechunk instead, a device-resident Gram
    held the words twice and spilled (one H200, 8 GiB cap: 1.16 s against 0.58 s ungrouped).
    Measured on an H200 (16,384 rows of 131,072 bits on the device,
    ``listed-graphs``): 13 ms listed against 19-21 ms through ``blockwise`` in chunks
    of 4,096 rows, 17-19 ms against 48-55 ms in chunks of 2,048, mostly dask's optimisation of
    the blockwise layers."""
    token = tokenize(words, method, device, row_chunks)
    name, partial, total = f"gram-{token}", f"gram-partial-{token}", f"gram-sum-{token}"
    groups = _chunk_groups(words.chunks[0], row_chunks)
    word_blocks = len(words.chunks[1])
    dsk: dict[tuple, Any] = {}

    def refs(group: list[int], w: int) -> Any:
        if len(group) == 1:
            return TaskRef((words.name, group[0], w))
        return List(*(TaskRef((words.name, i, w)) for i in group))

    for i, group_i in enumerate(groups):
        for j in range(i, len(groups)):
            parts = []
            for w in range(word_blocks):
                key = (partial, i, j, w) if word_blocks > 1 else (name, i, j)
                dsk[key] = Task(key, _grouped_block, refs(group_i, w), refs(groups[j], w),
                                i == j, method, device)
                parts.append(key)
            if word_blocks > 1:
                _add_tree(dsk, parts, (name, i, j), total)
        for j in range(i):
            dsk[(name, i, j)] = (_transposed, (name, j, i))
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=[words])
    return da.Array(graph, name, (row_chunks, row_chunks), dtype=np.int32, meta=meta)


def _chunk_groups(chunks: tuple[int, ...], row_chunks: tuple[int, ...]) -> list[list[int]]:
    """The indices of ``chunks`` that make each of ``row_chunks`` (consecutive groups).

    Examples
    --------
    >>> _chunk_groups((2, 2, 3, 1), (4, 4))
    [[0, 1], [2, 3]]
    >>> _chunk_groups((0,), (0,))
    [[0]]
    """
    groups: list[list[int]] = []
    index = 0
    for rows in row_chunks:
        group, filled = [index], chunks[index]  # at least one chunk: empty ones too
        index += 1
        while filled < rows:
            group.append(index)
            filled += chunks[index]
            index += 1
        if filled != rows:
            raise ValueError(f"row groups {row_chunks} do not fall on chunks {chunks}")
        groups.append(group)
    return groups


def _joined_rows(chunks: Any) -> Any:
    """One array of the row chunks ``chunks`` (a list), or the chunk itself."""
    if not isinstance(chunks, list):
        return chunks
    return bits._xp(chunks[0]).concatenate(chunks, axis=0)


def _grouped_block(a: Any, b: Any, diagonal: bool, method: str, device: str) -> Any:
    """:func:`_gram_block` of two groups of row chunks (each a list of chunks, or a chunk),
    joined where the task runs."""
    rows_a = _joined_rows(a)
    rows_b = rows_a if diagonal else _joined_rows(b)
    return _gram_block(rows_a, rows_b, diagonal, method, device)
