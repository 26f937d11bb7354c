"""Dask arrays over arrays already in memory (NumPy, pinned NumPy, CuPy), without copying them.

``dask.array.from_array`` copies a NumPy input before slicing it (dask 2026.x): for the 4 GB
arrays of a GPU job that doubles host memory, costs a second of copying, and turns a pinned
array into a pageable one. :func:`asarray` lists views of the array as the graph's values
(``listed-graphs`` of :data:`dask_gpuchunk.config.INTERNAL`), or, under dask's array query
planning, hands ``from_array`` a reader without a ``copy`` method, which it does not copy
(:class:`ViewReader`): each chunk a view, sliced when computed. Like any view, the result sees
later writes to the source array. Arrays that are not in memory (h5py and Zarr datasets, other
objects with ``shape``, ``dtype`` and slicing) go to ``dask.array.from_array`` as they are,
read each chunk when it is computed. Through a reader, on a ``distributed`` cluster, an
in-memory array travels whole to each worker that computes one of its chunks (listed, each
chunk travels alone): for arrays near the workers' memory, write them to ``.npy`` and read
them with :func:`dask_gpuchunk.from_npy`.
"""

from __future__ import annotations

import itertools
import threading
import uuid
import weakref
from typing import Any

import dask.array as da
import numpy as np
from dask.array.core import normalize_chunks
from dask.base import tokenize

from . import _compat
from .runtime.backend import is_cupy
from .config import listed_graphs

__all__ = ["ViewReader", "asarray", "is_array_like", "refuse_masked"]


def asarray(x: Any, chunks: Any = "auto", *, name: str | None = None) -> da.Array:
    """A Dask array whose chunks are views of the NumPy or CuPy array ``x`` (no copy).

    Parameters
    ----------
    x
        A NumPy array (pageable, pinned, or an ``np.memmap``) or a CuPy array; an array-like
        that is not in memory (an h5py or Zarr dataset), read chunk by chunk when computed; a
        list or other sequence (converted to NumPy). A Dask array is returned unchanged.
        Masked arrays are refused (their mask would be lost).
    chunks
        As for :func:`dask.array.from_array` (``"auto"``, a block shape, explicit sizes, or a
        byte size such as ``"200 MiB"``).
    name
        The Dask key name (under dask's array query planning, which names arrays itself: the
        identity its name is made from). Default: from ``x``'s identity, the same for the same
        array object within a process (dask's ``tokenize`` of the data for arrays up to
        ``CONTENT_TOKEN_BYTES`` and for memmaps, whose token is their file; hashing a larger
        array in memory would read all of it).

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
    >>> x.compute()[4:8]
    array([4., 5., 6., 7.])
    >>> asarray(a, chunks=4).name == x.name
    True
    """
    refuse_masked(x, "asarray")
    if isinstance(x, da.Array):
        return x
    if not (isinstance(x, np.ndarray) or is_cupy(x)):
        if is_array_like(x):
            # Read per chunk at compute time; h5py is not safe to read from several threads.
            lock = type(x).__module__.split(".", 1)[0] == "h5py"
            return da.from_array(x, chunks=chunks, lock=lock, name=name or None,
                                 meta=np.empty((0,) * len(x.shape), dtype=x.dtype))
        x = np.asarray(x)
    chunks = normalize_chunks(chunks, x.shape, dtype=x.dtype)
    meta = x[(slice(0, 0),) * x.ndim]
    if listed_graphs():  # views listed as the graph's values (dask_gpuchunk.config)
        name = name or f"asarray-{tokenize(_identity(x), chunks)}"
        keys = itertools.product([name], *(range(len(c)) for c in chunks))
        dsk = {key: x[(*slc, Ellipsis)] for key, slc in zip(keys, _compat.slices_from_chunks(chunks))}
        return da.Array(dsk, name, chunks, meta=meta, dtype=x.dtype)
    reader = ViewReader(x, name or _identity(x))
    # asarray=False: CuPy views must stay CuPy (dask would call np.asarray on each chunk).
    # The name is dask's token of the reader (its identity) under array query planning, which
    # takes no name=; the same name gives the same keys either way.
    kwargs = {} if da.array_expr_enabled() else {"name": name or f"asarray-{tokenize(reader, chunks)}"}
    return da.from_array(reader, chunks=chunks, asarray=False, meta=meta, **kwargs)


class ViewReader:
    """An in-memory array as :func:`dask.array.from_array` reads it without copying it first:
    ``shape``, ``dtype``, ``ndim``, slicing (views), no ``copy``; tokenized by ``identity``
    (:func:`asarray`'s name for the array) instead of by hashing its data.

    Examples
    --------
    >>> r = ViewReader(np.arange(6.0), "six")
    >>> r[2:4], r.shape, hasattr(r, "copy")
    (array([2., 3.]), (6,), False)
    """

    __slots__ = ("array", "identity", "shape", "dtype", "ndim")

    def __init__(self, array: Any, identity: Any) -> None:
        self.array, self.identity = array, identity
        self.shape, self.dtype, self.ndim = array.shape, array.dtype, array.ndim

    def __getitem__(self, index: Any) -> Any:
        return self.array[index]

    def __dask_tokenize__(self) -> Any:
        return ("dask-gpuchunk-view", self.identity)


#: NumPy arrays in memory up to this size are named by a hash of their data (the same name in
#: every process); larger ones by the object (hashing 400 MB took 0.3 s on the CPU box).
CONTENT_TOKEN_BYTES = 16 << 20

_object_tokens: dict[int, str] = {}
_object_tokens_lock = threading.Lock()
_counter = itertools.count()


def _identity(x: Any) -> Any:
    """What names ``x``: its data (small NumPy arrays, memmaps), or a token of the object
    itself, kept for as long as it lives (a new array at the same address gets a new one)."""
    if isinstance(x, np.memmap) or (isinstance(x, np.ndarray) and x.nbytes <= CONTENT_TOKEN_BYTES):
        return x
    key = id(x)
    with _object_tokens_lock:
        token = _object_tokens.get(key)
        if token is None:
            try:
                weakref.finalize(x, _forget, key)
            except TypeError:  # not weakly referable (some CuPy versions): never reused
                return uuid.uuid4().hex
            token = _object_tokens[key] = f"{uuid.uuid4().hex}-{next(_counter)}"
    return (token, x.shape, x.dtype.str, getattr(x, "strides", None))


def _forget(key: int) -> None:
    with _object_tokens_lock:
        _object_tokens.pop(key, None)


def is_array_like(x: Any) -> bool:
    """An array not in memory: ``shape``, ``dtype`` and slicing, but neither NumPy nor CuPy
    (an h5py or Zarr dataset).

    Examples
    --------
    >>> is_array_like(np.ones(3)), is_array_like([1, 2])
    (False, False)
    """
    return (not isinstance(x, (np.ndarray, np.generic, da.Array)) and not is_cupy(x)
            and hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "__getitem__"))


def refuse_masked(x: Any, what: str) -> None:
    """Raise ``TypeError`` for a masked array (NumPy's or Dask's): its mask would be lost.

    Examples
    --------
    >>> refuse_masked(np.ma.masked_array([1.0, 2.0], mask=[0, 1]), "x")
    Traceback (most recent call last):
    ...
    TypeError: x is a masked array: its mask would be lost. Pass x.filled(value) for the data with masked values replaced, and apply the mask to the result yourself
    """
    meta = x._meta if isinstance(x, da.Array) else x
    if isinstance(meta, np.ma.MaskedArray):
        raise TypeError(f"{what} is a masked array: its mask would be lost. Pass "
                        "x.filled(value) for the data with masked values replaced, and apply "
                        "the mask to the result yourself")
