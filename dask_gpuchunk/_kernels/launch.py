"""Launching compiled elementwise kernels straight from array addresses.

numba's dispatcher spends ~40 us per launch typing its arguments and another ~20 us per array
wrapping CuPy memory as numba device arrays (docs/measurements/…profile-overheads*); with one
kernel per chunk on device-resident data that was most of a chunk's cost. The elementwise
kernels have one fixed signature each, so :class:`DirectLaunch` flattens each array
(:class:`StridedArg`) into numba's kernel argument layout itself and hands the compiled function
to ``cuda.core.launch``, as numba does: 146-221 us per chunk became 37-62 us on the H200 machine.
That layout is numba-cuda's internal business: each launcher checks it against numba's own
when it is made, and a process where it differs goes on through numba's dispatcher
(:func:`fall_back_to_numba`). No dask here.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["DirectLaunch", "DirectLaunchError", "StridedArg", "cupy_stream",
           "current_device", "direct_launch_available", "fall_back_to_numba", "load_lock",
           "numba_stream"]


class StridedArg(NamedTuple):
    """A device array given by address: all that a kernel launch reads of an array.

    ``ptr`` is the device address of element ``(0, ..., 0)``, ``strides`` are in bytes (zero
    along broadcast dimensions).
    """

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def flags(self) -> dict[str, bool]:
        """``{"C_CONTIGUOUS": ...}`` by NumPy's rule (dimensions of length 1 do not count)."""
        expected = self.dtype.itemsize
        for n, st in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and st != expected:
                return {"C_CONTIGUOUS": False}
            expected *= n
        return {"C_CONTIGUOUS": True}


_local = threading.local()


def numba_stream(stream: Any) -> Any:
    """The numba handle of a CuPy stream: the stream every CUDA entry point of the kernels
    takes (numba ignores CuPy's ``with stream:``).

    CuPy's null stream (pointer 0) is the legacy default stream and pointer 2 the per-thread
    default stream; numba has its own objects for both. Cached per thread.
    """
    from numba import cuda

    handles = getattr(_local, "numba_streams", None)
    if handles is None:
        handles = _local.numba_streams = {}
    ptr = int(stream.ptr)
    handle = handles.get(ptr)
    if handle is None:
        if ptr == 0:
            handle = cuda.legacy_default_stream()
        elif ptr == 2:
            handle = cuda.per_thread_default_stream()
        else:
            handle = cuda.external_stream(ptr)
        handles[ptr] = handle
    return handle


def cupy_stream(stream: Any) -> Any:
    """The CuPy stream of a kernel's ``stream`` argument (a numba stream, or ``0`` for the
    legacy default stream), for the CuPy and cuBLAS work of a kernel (``with`` it, or its
    ``ptr``)."""
    import cupy

    ptr = stream if isinstance(stream, int) else int(stream.handle)
    # 0 and CU_STREAM_LEGACY (1, numba's handle of the legacy default stream): CuPy's null one.
    if ptr in (0, 1):
        return cupy.cuda.Stream.null
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:  # CuPy before 14
        return cupy.cuda.ExternalStream(ptr)
    # CuPy 14 deprecates ExternalStream for this, which takes the CUDA stream protocol.
    return from_external(_StreamHandle(ptr))


class _StreamHandle:
    """A raw ``cudaStream_t`` with the CUDA stream protocol (``__cuda_stream__``: version 0,
    the handle), as CuPy 14's ``Stream.from_external`` takes streams of other libraries."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


#: False once :func:`fall_back_to_numba` found that this process cannot launch directly.
_direct_works = [True]


def direct_launch_available(wanted: bool = True) -> bool:
    """Whether :class:`DirectLaunch` can run here: ``wanted`` (the package's
    ``direct-launch`` choice), a real GPU (not numba's simulator), no earlier failure in this
    process (:func:`fall_back_to_numba`), and numba-cuda launching through ``cuda.core``."""
    if not (wanted and _direct_works[0]):
        return False
    from numba.cuda import config as cuda_config

    if cuda_config.ENABLE_CUDASIM:
        return False
    if not _DIRECT_OK:
        try:
            import cuda.core  # noqa: F401 - numba-cuda launches through it
            from numba.cuda.cudadrv.driver import _to_core_stream  # noqa: F401
        except ImportError:
            _DIRECT_OK.append(False)
        else:
            _DIRECT_OK.append(True)
    return _DIRECT_OK[0]


_DIRECT_OK: list[bool] = []
_fallback_lock = threading.Lock()


class DirectLaunchError(RuntimeError):
    """numba-cuda's internals are not what :class:`DirectLaunch` relies on (another version):
    the kernel has to be launched through numba's dispatcher."""


def fall_back_to_numba(reason: BaseException) -> None:
    """Turn the direct launch off for this process, with one warning that says why."""
    import warnings

    with _fallback_lock:
        if not _direct_works[0]:
            return
        _direct_works[0] = False
    warnings.warn(
        f"dask_gpuchunk: kernels are launched through numba's dispatcher from now on in this "
        f"process (~0.1 ms more per chunk), because the direct launch cannot be used with this "
        f"numba-cuda: {reason}; please report it with your numba-cuda version.",
        RuntimeWarning, stacklevel=3,
    )


#: Held while a :class:`DirectLaunch` is made: numba's ``get_cufunc`` is not safe to race (two
#: loads of one image on an H200: "key already in dictionary: <CUlibrary ...>").
load_lock = threading.Lock()
_core_streams = threading.local()


def current_device() -> int:
    """The CUDA device of this thread (CuPy's)."""
    import cupy

    return int(cupy.cuda.runtime.getDevice())


def _core_stream(nb_stream: Any) -> Any:
    """The ``cuda.core`` stream of a numba stream, cached per thread (as numba converts it)."""
    cache = getattr(_core_streams, "by_id", None)
    if cache is None:
        cache = _core_streams.by_id = {}
    entry = cache.get(id(nb_stream))
    if entry is None or entry[0] is not nb_stream:
        from numba.cuda.cudadrv.driver import _to_core_stream

        entry = cache[id(nb_stream)] = (nb_stream, _to_core_stream(nb_stream))
    return entry[1]


def _array_words(a: StridedArg) -> list[int]:
    """An array argument as numba-cuda lays it out: meminfo, parent, nitems, itemsize, data,
    shape..., strides... (``_Kernel._prepare_args``)."""
    return [0, 0, math.prod(a.shape), a.dtype.itemsize, a.ptr, *a.shape, *a.strides]


class DirectLaunch:
    """One compiled kernel (a numba dispatcher of one signature) on this thread's device,
    launched with its arguments built from addresses: each :class:`StridedArg` as numba's
    ``_Kernel._prepare_args`` lays out an array (:func:`_array_words`), scalars converted by
    numba itself. Made under :data:`load_lock`.

    Raises :class:`DirectLaunchError` where this numba-cuda differs: missing internals, or an
    array layout other than :func:`_array_words`'s. The layout is checked when the launcher is
    made, against numba's own ``_prepare_args`` on a small device array of each array type:
    a changed layout would otherwise launch the kernel on wrong addresses.
    """

    def __init__(self, dispatcher: Any) -> None:
        try:
            from cuda.core import LaunchConfig, launch

            (self.overload,) = dispatcher.overloads.values()
            if getattr(self.overload, "debug", False) or getattr(self.overload, "cooperative",
                                                                 False):
                raise DirectLaunchError("debug and cooperative kernels launch through numba")
            self.types = tuple(self.overload.argument_types)
            self.function = self.overload._codelibrary.get_cufunc().kernel  # this device's
            self._check_array_layout()
        except DirectLaunchError:
            raise
        except Exception as exc:
            raise DirectLaunchError(f"{type(exc).__name__}: {exc}") from exc
        self._config = LaunchConfig
        self._launch = launch
        self._configs: dict[tuple[int, int], Any] = {}
        self._resident: dict[int, int] = {}

    def resident_blocks(self, threads: int) -> int:
        """How many blocks of ``threads`` of this kernel the device holds at once (CUDA's
        occupancy calculator, through numba), cached."""
        found = self._resident.get(threads)
        if found is None:
            found = self._resident[threads] = int(
                self.overload.max_cooperative_grid_blocks(threads))
        return found

    def _check_array_layout(self) -> None:
        from numba import cuda, types
        from numba.np.numpy_support import as_dtype

        for ty in self.types:
            if not isinstance(ty, types.Array):
                continue
            probe = cuda.device_array((2,) * ty.ndim, dtype=as_dtype(ty.dtype))
            theirs: list[Any] = []
            self.overload._prepare_args(ty, probe, 0, [], theirs)
            theirs = [int(getattr(v, "value", v)) for v in theirs]
            ours = _array_words(StridedArg(probe.device_ctypes_pointer.value, probe.shape,
                                           probe.strides, probe.dtype))
            if theirs != ours:
                raise DirectLaunchError(f"numba lays out a {ty} argument as {theirs}, the direct "
                                        f"launch as {ours}")

    def __call__(self, blocks: int, threads: int, stream: Any,
                 args: Sequence[StridedArg | np.generic]) -> None:
        flat: list[Any] = []
        for ty, a in zip(self.types, args):
            if isinstance(a, StridedArg):
                flat += _array_words(a)
            else:
                self.overload._prepare_args(ty, a, stream, [], flat)
        config = self._configs.get((blocks, threads))
        if config is None:
            config = self._configs[(blocks, threads)] = self._config(grid=blocks, block=threads)
        self._launch(_core_stream(stream), config, self.function, *flat)
