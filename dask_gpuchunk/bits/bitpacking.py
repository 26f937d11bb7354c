"""``bitpack``: 0/1 data packed into ``uint64`` words along the last axis, and the packed words
:func:`dask_gpuchunk.gram` and :func:`dask_gpuchunk.similarity` take.
"""

from __future__ import annotations

import itertools
from typing import Any

import dask.array as da
import numpy as np
from dask.array.utils import meta_from_array
from dask.base import tokenize

from ..runtime import backend
from .._kernels import bitpack as bits
from ..arrays import asarray
from ..devices import Device, check_device_for_graph

__all__ = ["bitpack", "packed_words"]


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
