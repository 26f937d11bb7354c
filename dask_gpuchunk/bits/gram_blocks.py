"""What a Gram block's task runs: the counts ``popcount(a & b)`` of two row chunks' packed words
by the chosen method (the kernels of :mod:`dask_gpuchunk._kernels`), the partial blocks of word
chunks and their sums, a block's transpose and mirror, and the device memory a block takes.

The graphs of :mod:`dask_gpuchunk.bits.gram_graphs` call these; :func:`dask_gpuchunk.gram`
chooses the method (:func:`resolve_method`) and checks it (:func:`check_method`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..runtime import backend
from .._kernels import bitpack as bits
from .._kernels import gram as kernels
from .._kernels.gram import Method
from .._kernels.bmma import BMMA_MIN_CC, TILE, bmma_cuda
from .._kernels.wgmma import WGMMA_CC, wgmma_cuda
from .._kernels.launch import numba_stream
from ..devices import (
    Device,
    GPUNotAvailableError,
    check_device_for_graph,
    distributed_client_active,
    gpu_available,
)

__all__ = ["METHODS", "block_bytes", "block_counts", "block_scratch_bytes", "block_task",
           "check_method", "compute_capability", "device_block_counts", "device_block_scratch",
           "gram_slab", "kept_partial", "mirrored_block", "resolve_method", "sum_blocks",
           "sum_partials", "transposed_block", "upper_partial", "word_partial"]

#: ``method=`` values of :func:`gram`.
METHODS = kernels.METHODS


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
    cc = compute_capability()
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


def compute_capability() -> tuple[int, int]:
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
    """Counts of packed ``inputs`` (``uint64`` words) where
    :func:`dask_gpuchunk.runtime.backend.chunk_site` says: CuPy chunks on their GPU, NumPy chunks
    on a GPU or the CPU. ``gpu_launch(method)`` makes the ``launch`` for the resolved method,
    which allocates ``scratch(method)`` bytes on the device; ``on_cpu()`` computes on the CPU."""

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


def block_task(a: Any, b: Any, diagonal: bool, method: str, device: str) -> Any:
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


def upper_partial(a: Any, b: Any, rows_a: Any, rows_b: Any, method: str, device: str) -> Any:
    """The partial block ``popcount(a & b)`` of one word chunk where it is on or above the
    diagonal (``None`` below it: :func:`mirrored_block` takes its transpose from above).

    ``rows_a`` and ``rows_b`` hold the row positions of the two row chunks: a block is computed
    where its first row is not below its first column, so a pair of blocks is computed once
    even where slicing has cut the chunks unevenly. ``a`` and ``b`` the same rows: the
    symmetric ``a · aᵀ``, half the work."""
    if not (len(rows_a) and len(rows_b)):
        return _zeros_like_block(a, b)
    if rows_a[0] > rows_b[0]:
        return None
    return block_task(a, b, len(rows_a) == len(rows_b) and rows_a[0] == rows_b[0], method,
                       device)


def _zeros_like_block(a: Any, b: Any) -> Any:
    if backend.is_cupy(a):
        import cupy

        return cupy.zeros((a.shape[0], b.shape[0]), dtype=np.int32)
    return np.zeros((a.shape[0], b.shape[0]), dtype=np.int32)


def word_partial(a: Any, b: Any, rows_a: Any, rows_b: Any, method: str, device: str) -> Any:
    """:func:`upper_partial` of one of several word chunks, with the contracted axis kept
    (length 1) as :func:`dask.array.reduction` counts it."""
    block = upper_partial(a, b, rows_a, rows_b, method, device)
    return None if block is None else block[..., None]


def kept_partial(block: Any, axis: Any = None, keepdims: bool = True) -> Any:
    return block


def sum_partials(partials: list[Any], axis: Any = None, keepdims: bool = False) -> Any:
    """Sum a list of partial blocks (``None`` below the diagonal stays ``None``)."""
    partials = [p for p in partials if p is not None]
    if not partials:
        return None
    total = sum_blocks(*partials) if len(partials) > 1 else partials[0]
    return total if keepdims else total[..., 0]


def sum_blocks(*blocks: Any) -> Any:
    total = blocks[0] + blocks[1]
    for block in blocks[2:]:
        total += block
    return total


def transposed_block(block: Any) -> Any:
    """``block.T`` where the block is: a view of a host block, a C-order copy on a GPU. A sum
    reads the view in memory order; a file write copies it tile by tile
    (:func:`dask_gpuchunk._kernels.gram.c_ordered`). Copied here, the 120 mirrored blocks of a
    65,536-row Gram from a file (7.7 GB) took more of one GPU worker's two threads than the
    kernels did (2 x H100, the perf notes (git show 85dc246:docs/perf-notes.md) item 31)."""
    return backend.run_chunk(backend.ChunkWork(
        "a transposed block", on_cpu=lambda: block.T,
        on_device=lambda: block.T.copy(), stage=False), [block])


def mirrored_block(block: Any, above: Any) -> Any:
    """Block ``(i, j)`` of the Gram: computed (on or above the diagonal), or, where
    :func:`upper_partial` left it ``None``, the transpose of block ``(j, i)``, ``above``."""
    return block if block is not None else transposed_block(above)


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
    return block_task(a, b, False, method, device)


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
