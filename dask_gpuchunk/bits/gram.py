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

This module is the operator (checks, the method, the grouping of row chunks) and re-exports
the Gram's names: the graphs are :mod:`dask_gpuchunk.bits.gram_graphs`'s, what a block's task runs
:mod:`dask_gpuchunk.bits.gram_blocks`', ``bitpack`` :mod:`dask_gpuchunk.bits.bitpacking`'s.
"""

from __future__ import annotations

from typing import Any

import dask.array as da
import numpy as np

from ..runtime import backend
from .._kernels.gram import Method
from ..runtime.budget import check_fits, check_fits_for_graph, graph_budget
from ..devices import Device, cluster_workers, gpu_available
from ..io.fingerprint_files import bit_vectors_as_words
from ..io import npy_reader_of
from .bitpacking import bitpack, packed_words
from .gram_blocks import (
    METHODS,
    block_bytes,
    block_counts,
    block_scratch_bytes,
    check_method,
    device_block_counts,
    device_block_scratch,
    gram_slab,
    resolve_method,
)
from .gram_graphs import SPLIT_EVERY, gram_graph, resident_gram_slab

__all__ = ["METHODS", "SPLIT_EVERY", "bitpack", "block_bytes", "block_counts",
           "block_scratch_bytes", "check_block_fits", "check_method", "device_block_counts",
           "device_block_scratch", "gram", "gram_slab", "grouped_row_chunks",
           "packed_words", "resident_gram_slab", "resolve_method", "task_block_rows"]

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
    sent between workers (:mod:`dask_gpuchunk.runtime.resident`).

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
    return gram_graph(words, reader, method, device, row_chunks,
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
    budget = graph_budget() if budget is None else budget
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


def check_block_fits(chunks: tuple[tuple[int, ...], ...], itemsize: int, method: str,
                     budget: int | None = None) -> None:
    """Refuse, before any work, Gram blocks that cannot fit the device budget (``budget``, else
    the workers' smallest or this process's:
    :func:`~dask_gpuchunk.runtime.budget.check_fits_for_graph`):
    :class:`dask_gpuchunk.runtime.budget.DeviceBudgetError` naming the bytes."""
    rows = max(chunks[0], default=0)
    words64 = -(-max(chunks[1], default=0) * itemsize // 8)
    resolved = method if method != "auto" else resolve_method("auto", on_gpu=True)
    what = f"a Gram block of {rows} x {rows} rows of {words64 * 64} bits ({resolved})"
    option = "fewer rows per chunk: chunks= of the rows, --chunk-rows"
    if budget is None:
        check_fits_for_graph(block_bytes(rows, words64, resolved), what, option)
    else:
        check_fits(block_bytes(rows, words64, resolved), what, option, budget)
