"""Dask arrays over arrays already in memory (NumPy, pinned NumPy, CuPy), without copying them.

``dask.array.from_array`` copies a NumPy input before slicing it (dask 2026.x): for the 4 GB
arrays of a GPU job that doubles host memory, costs a second of copying, and turns a pinned
array into a pageable one. :func:`asarray` slices views instead. Like any view, the result
sees later writes to the source array.
"""

from __future__ import annotations

import uuid
from itertools import product
from typing import Any

import dask.array as da
import numpy as np
from dask.array.core import normalize_chunks, slices_from_chunks

__all__ = ["asarray"]


def asarray(x: Any, chunks: Any = "auto", *, name: str | None = None) -> da.Array:
    """A Dask array whose chunks are views of the NumPy or CuPy array ``x`` (no copy).

    Parameters
    ----------
    x
        A NumPy array (pageable, pinned, or an ``np.memmap``) or a CuPy array. A Dask array is
        returned unchanged.
    chunks
        As for :func:`dask.array.from_array` (``"auto"``, a block shape, explicit sizes, or a
        byte size such as ``"200 MiB"``).
    name
        The Dask key name; default a unique random name (hashing the data would read all of it).

    Returns
    -------
    dask.array.Array
        Chunked like ``chunks``, with ``x``'s array type as meta (CuPy in, CuPy chunks).

    Examples
    --------
    >>> import numpy as np
    >>> a = np.arange(10.0)
    >>> x = asarray(a, chunks=4)
    >>> x.chunks
    ((4, 4, 2),)
    >>> x.blocks[1].compute()
    array([4., 5., 6., 7.])
    """
    if isinstance(x, da.Array):
        return x
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
    chunks = normalize_chunks(chunks, x.shape, dtype=x.dtype)
    name = name or f"asarray-{uuid.uuid4().hex}"
    keys = product([name], *(range(len(c)) for c in chunks))
    dsk = {key: x[(*slc, Ellipsis)] for key, slc in zip(keys, slices_from_chunks(chunks))}
    meta = x[(slice(0, 0),) * x.ndim]
    return da.Array(dsk, name, chunks, meta=meta, dtype=x.dtype)
