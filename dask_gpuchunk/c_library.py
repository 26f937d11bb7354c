"""The C library's memory-mapping calls on raw addresses, typed: ``mmap``, ``madvise``,
``munmap``.

Python's :class:`mmap.mmap` refuses to close while any buffer over it is alive (distributed's
profiler keeps frames that hold arrays over one), and cannot be advised before it is filled. The
package maps ``.npy`` regions read-only for the GPU to copy from (:mod:`dask_gpuchunk.io`) and
anonymous memory for its page-locked buffers (:mod:`dask_gpuchunk.runtime.staging`) through these
instead. Each call releases the GIL while the kernel works.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

__all__ = ["MADV_POPULATE_WRITE", "advise", "map_memory", "unmap"]

#: ``madvise`` advice (Linux 5.14 on): fault every page in, writable. Python's :mod:`mmap`
#: names it only from 3.13.
MADV_POPULATE_WRITE = 23
_MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def map_memory(length: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> int:
    """``mmap(NULL, length, prot, flags, fd, offset)``: the address, or :class:`OSError`.

    Examples
    --------
    >>> import mmap
    >>> address = map_memory(1 << 16, mmap.PROT_READ | mmap.PROT_WRITE,
    ...                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    >>> (ctypes.c_ubyte * 4).from_address(address)[:]  # anonymous memory starts zeroed
    [0, 0, 0, 0]
    >>> unmap(address, 1 << 16)
    """
    address = _libc().mmap(None, length, prot, flags, fd, offset)
    if address in (None, _MAP_FAILED):
        error = ctypes.get_errno()
        raise OSError(error, f"mmap of {length} bytes failed: {os.strerror(error)}")
    return int(address)


def advise(address: int, length: int, advice: int) -> int:
    """``madvise(address, length, advice)``: 0 where taken, else the errno (``EINVAL`` from a
    kernel that does not know ``advice``)."""
    if _libc().madvise(ctypes.c_void_p(address), length, advice) == 0:
        return 0
    return ctypes.get_errno()


def unmap(address: int, length: int) -> None:
    """``munmap(address, length)``; :class:`OSError` where refused."""
    if _libc().munmap(ctypes.c_void_p(address), length) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"munmap of {length} bytes failed: {os.strerror(error)}")

