"""The user's own numba kernels over Dask arrays: ``dg.map_kernel`` and ``dg.gufunc_op``.

:func:`map_kernel` runs a ``@cuda.jit`` kernel once per block: each NumPy block goes to the GPU
through the package's pinned staging on the worker's stream, each CuPy block is used where it is,
both within the device budget (:func:`dask_gpuchunk.runtime.backend.run_chunk`, as every operator's
chunks); a CPU twin (``cpu=``) runs where there is no GPU. :func:`gufunc_op` runs a numba
``@guvectorize`` function over Dask arrays as :func:`dask.array.apply_gufunc` does, on NumPy blocks
with the CPU gufunc and on CuPy blocks with the same function compiled for CUDA.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import dask.array as da
import numpy as np
from dask.base import tokenize

from . import _compat
from ._kernels.elementwise import check_dtype
from .arrays import asarray
from .runtime.backend import ChunkWork, DeviceLaunch, is_cupy, run_chunk
from .devices import Device, check_device_for_graph, distributed_client_active, gpu_available
from .ufunc.user_functions import (
    cuda_kernel_function,
    gufunc_parts,
    is_cuda_kernel,
    is_numba_function,
)

__all__ = ["GufuncOp", "gufunc_op", "map_kernel"]

#: The default launch's threads per block for 1-, 2- and 3-dimensional grids.
DEFAULT_THREADS = {1: (256,), 2: (16, 16), 3: (8, 8, 4)}

_MAX_THREADS = 1024  # per block, on every GPU numba-cuda supports


def _positional_count(func: Callable) -> int | None:
    """How many positional arguments ``func`` takes (``None``: any number)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def default_launch(dims: int) -> Callable[[tuple[int, ...]], tuple[tuple[int, ...],
                                                                     tuple[int, ...]]]:
    """A launch configuration of ``dims`` grid dimensions over a block's first output axes:
    ``cuda.grid(dims)`` then covers every index of those axes once (threads past the end
    must do nothing, as in any numba kernel).

    Examples
    --------
    >>> default_launch(1)((1000, 500))
    ((4,), (256,))
    >>> default_launch(2)((1000, 500))
    ((63, 32), (16, 16))
    """
    if dims not in DEFAULT_THREADS:
        raise ValueError(f"launch= takes 1, 2 or 3 grid dimensions, got {dims!r}")
    threads = DEFAULT_THREADS[dims]

    def config(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        sizes = tuple(shape[:dims]) + (1,) * (dims - len(shape))
        return tuple(max(1, math.ceil(n / t)) for n, t in zip(sizes, threads)), threads

    return config


def _as_dims(value: Any, what: str) -> tuple[int, ...]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, (int, np.integer)) and d >= 1
                                          for d in dims):
        raise ValueError(f"the launch configuration's {what} must be 1 to 3 positive integers, "
                         f"got {value!r}")
    return tuple(int(d) for d in dims)


def checked_launch(launch: Any, shape: tuple[int, ...]) -> tuple[tuple[int, ...],
                                                                 tuple[int, ...]]:
    """``launch(shape)`` checked: ``(blocks, threads)``, each 1 to 3 positive integers, at
    most 1024 threads per block.

    Examples
    --------
    >>> checked_launch(lambda shape: (8, 128), (1000,))
    ((8,), (128,))
    >>> checked_launch(lambda shape: (8, 2048), (1000,))
    Traceback (most recent call last):
    ...
    ValueError: the launch configuration asks for 2048 threads per block; at most 1024
    """
    got = launch(shape)
    try:
        blocks, threads = got
    except (TypeError, ValueError):
        raise ValueError(f"launch= must return (blocks, threads) for a block of shape {shape}; "
                         f"it gave {got!r}") from None
    blocks, threads = _as_dims(blocks, "blocks"), _as_dims(threads, "threads")
    if math.prod(threads) > _MAX_THREADS:
        raise ValueError(f"the launch configuration asks for {math.prod(threads)} threads per "
                         f"block; at most {_MAX_THREADS}")
    return blocks, threads


def _numba_view(a: Any) -> Any:
    """A CuPy array as numba sees it (no copy, no synchronisation: the launch is queued on
    the same stream as the work that made it); anything else as it is."""
    if is_cupy(a):
        from numba import cuda

        return cuda.as_cuda_array(a, sync=False)
    return a


def kernel_launch(kernel: Any, launch: Any, extra: Sequence[Any]) -> Callable[..., None]:
    """The launch :class:`~dask_gpuchunk.runtime.backend.DeviceLaunch` takes: ``kernel(*inputs, out,
    *extra)`` over ``launch(out.shape)`` on the chunk's stream."""

    def run(out: Any, inputs: list[Any], nb_stream: Any) -> None:
        blocks, threads = checked_launch(launch, tuple(out.shape))
        kernel[blocks, threads, nb_stream](*map(_numba_view, inputs), _numba_view(out), *extra)

    return run


def _cpu_block(cpu: Callable, blocks: Sequence[Any], shape: tuple[int, ...], dtype: np.dtype,
               extra: Sequence[Any]) -> np.ndarray:
    out = np.empty(shape, dtype=dtype)
    if out.size:
        cpu(*blocks, out, *extra)
    return out


class _UserKernel:
    """What :func:`map_kernel`' tasks carry: the kernel, its CPU twin and launch. An object
    of its own: dask measures task arguments (``sizeof``), and its numba hook fails on the
    CUDA simulator's kernels."""

    def __init__(self, kernel: Any, cpu: Callable | None, launch: Callable) -> None:
        self.kernel = kernel
        self.cpu = cpu
        self.launch = launch


def _kernel_block(*blocks: Any, block_info: dict | None = None, user: _UserKernel,
                  out_dtype: np.dtype, args: tuple, offsets: tuple[int, ...], shaped: bool,
                  device: str, label: str) -> Any:
    """One block of :func:`map_kernel`, where :func:`~dask_gpuchunk.runtime.backend.chunk_site`
    sends it (``shaped``: the first block only gives the output's blocks; dropped)."""
    kernel, cpu, launch, dtype = user.kernel, user.cpu, user.launch, out_dtype
    blocks = blocks[1:] if shaped else blocks
    info = block_info[None]
    shape = tuple(info["chunk-shape"])
    location = info["array-location"]
    extra = (*args, *(location[axis][0] for axis in offsets))
    where = f"block {tuple(info['chunk-location'])} of {label}"
    no_cpu = (f"{label}: this block runs on the CPU (no GPU here, or device='cpu') and the "
              "kernel has no CPU twin; give dg.map_kernel a cpu= function")
    work = ChunkWork(
        where,
        on_cpu=lambda: _cpu_block(cpu, blocks, shape, dtype, extra),
        on_gpu=lambda: DeviceLaunch(kernel_launch(kernel, launch, extra), shape, dtype),
        gpu_only=None if cpu is not None else no_cpu,
    )
    return run_chunk(work, blocks, device)


def map_kernel(kernel: Any, *arrays: Any, dtype: Any, chunks: Any = None,
               drop_axis: Any = None, new_axis: Any = None, launch: Any = None,
               cpu: Callable | None = None, args: Sequence[Any] = (), offsets: Any = False,
               device: Device = "auto", name: str | None = None) -> da.Array:
    """Run a numba ``@cuda.jit`` kernel over the blocks of Dask arrays.

    Each block of the result is one launch: ``kernel(*input_blocks, out, *args)`` (with
    ``offsets=True``, the output block's first index along each axis after ``args``), where
    ``out`` is a new array of the block's shape and ``dtype`` for the kernel to fill. NumPy
    blocks are copied to the GPU through the package's pinned buffers and the result copied
    back (NumPy out); CuPy blocks are used in place (CuPy out); both run on the worker's
    stream within the device budget. Where a block runs on the CPU (no GPU, or
    ``device="cpu"``), ``cpu(*input_blocks, out, *args)`` fills it instead.

    Parameters
    ----------
    kernel
        A ``@cuda.jit`` kernel whose arguments are the input blocks, the output, ``args`` and
        (``offsets=True``) the offsets, in that order.
    *arrays
        Dask, NumPy or CuPy arrays; blocks are matched as :func:`dask.array.map_blocks`
        matches them (an array of one block along an axis goes with every block there).
    dtype
        The output's dtype.
    chunks, drop_axis, new_axis
        The output's blocks, as for :func:`dask.array.map_blocks` (default: the first input's).
        Block sizes given for every axis (tuples) may make more blocks than the inputs have:
        an input of one block along an axis goes whole with every block there.
    launch
        How to launch on a block: ``1``, ``2`` or ``3`` (``cuda.grid(n)`` over the output
        block's first ``n`` axes: 256, 16 × 16 or 8 × 8 × 4 threads per block, enough blocks
        to cover them), or a function of the output block's shape returning ``(blocks,
        threads)``. Default: as many grid dimensions as the output has axes, at most 3.
    cpu
        The kernel's CPU twin (a ``@njit`` function or any Python function) of the same
        arguments. Without one, blocks that would run on the CPU raise ``ValueError``.
    args
        Further arguments for every launch (numbers, or arrays already on the device).
    offsets
        ``True``: pass the output block's first index along each axis after ``args``; a
        sequence of axes: along those only (``offsets=[0]`` for a kernel that computes rows
        ``row_offset`` onwards of a larger result).
    device
        ``"auto"`` (the GPU where there is one, else ``cpu=``), ``"gpu"`` or ``"cpu"``.
    name
        The tasks' name prefix (default: the kernel's name).

    Returns
    -------
    dask.array.Array
        Chunked as ``chunks`` says; CuPy blocks where any input has CuPy blocks.

    Examples
    --------
    >>> import dask.array as da, numba
    >>> from numba import cuda
    >>> @cuda.jit
    ... def product(a, b, out):
    ...     i = cuda.grid(1)
    ...     if i < out.shape[0]:
    ...         for j in range(out.shape[1]):
    ...             out[i, j] = a[i, j] * b[i, j]
    >>> @numba.njit
    ... def product_on_cpu(a, b, out):
    ...     for i in range(out.shape[0]):
    ...         for j in range(out.shape[1]):
    ...             out[i, j] = a[i, j] * b[i, j]
    >>> a = da.from_array(np.arange(12.0).reshape(4, 3), chunks=(3, 2))
    >>> c = map_kernel(product, a, a, dtype=a.dtype, launch=1, cpu=product_on_cpu)
    >>> c.compute(scheduler="sync")[3]
    array([ 81., 100., 121.])
    """
    label = name or getattr(kernel, "__name__", "kernel")
    if not is_cuda_kernel(kernel):
        hint = (" (an elementwise function: use dg.elementwise)"
                if is_numba_function(kernel) or inspect.isfunction(kernel) else "")
        raise TypeError(f"dg.map_kernel needs a numba @cuda.jit kernel, got {kernel!r}{hint}")
    if isinstance(dtype, (tuple, list)):
        raise TypeError("dg.map_kernel makes one output; dtype= takes one dtype")
    dtype = check_dtype(dtype, "dtype=")
    check_device_for_graph(device)
    if not arrays:
        raise TypeError("dg.map_kernel needs at least one array")
    if cpu is not None and not callable(cpu):
        raise TypeError(f"cpu= must be a function, got {type(cpu).__name__}")
    if cpu is None and (device == "cpu" or (
            not gpu_available() and not distributed_client_active())):
        raise ValueError(f"{label}: its blocks would run on the CPU ("
                         + ("device='cpu'" if device == "cpu" else "no GPU is visible")
                         + ") and the kernel has no CPU twin; give dg.map_kernel a cpu= "
                         "function")
    args = tuple(args)
    dask_arrays = _as_dask(arrays)
    out_ndim = _output_ndim(dask_arrays, chunks, drop_axis, new_axis)
    offsets = _offset_axes(offsets, out_ndim)
    wanted = len(dask_arrays) + 1 + len(args) + len(offsets)
    for what, func in (("the kernel", cuda_kernel_function(kernel)), ("cpu=", cpu)):
        have = None if func is None else _positional_count(func)
        if have is not None and have != wanted:
            raise TypeError(
                f"{label}: {what} takes {have} arguments; dg.map_kernel passes {wanted} "
                f"({len(dask_arrays)} input block(s), the output"
                + (f", {len(args)} args" if args else "")
                + (f", {len(offsets)} offset(s)" if offsets else "") + ")")
    if launch is None:
        launch = default_launch(min(max(out_ndim, 1), 3))
    elif isinstance(launch, (int, np.integer)) and not isinstance(launch, bool):
        launch = default_launch(int(launch))
    elif not callable(launch):
        raise TypeError(f"launch= takes 1, 2, 3 or a function of the block's shape, got "
                        f"{launch!r}")
    on_device = any(is_cupy(a._meta) for a in dask_arrays)
    xp = __import__("cupy") if on_device else np
    token = tokenize(label, dask_arrays, dtype, chunks, drop_axis, new_axis, args, offsets,
                     device, id(kernel), id(cpu), id(launch))
    shape_blocks = _output_blocks(chunks)
    if shape_blocks is not None:
        # Blocks of the output's shape and no memory lead the inputs: the output may have
        # more blocks along an axis than the inputs have (seed 001's row slabs of one whole A).
        dask_arrays = [shape_blocks, *dask_arrays]
    result = da.map_blocks(
        _kernel_block, *dask_arrays, dtype=dtype, chunks=chunks, drop_axis=drop_axis or [],
        new_axis=new_axis, meta=xp.empty((0,) * out_ndim, dtype=dtype),
        name=f"{label}-{token}", user=_UserKernel(kernel, cpu, launch), out_dtype=dtype,
        args=args, offsets=offsets, shaped=shape_blocks is not None, device=device,
        label=label)
    _check_first_launch(launch, result)
    return result


def _as_dask(arrays: Sequence[Any]) -> list[da.Array]:
    """The inputs as Dask arrays: a NumPy or CuPy array of the first Dask array's shape chunked
    as it is (no copy), any other whole (one block, given to every block)."""
    first = next((a for a in arrays if isinstance(a, da.Array)), None)
    out = []
    for a in arrays:
        if not isinstance(a, da.Array):
            same = first is not None and np.shape(a) == first.shape
            a = asarray(a, chunks=first.chunks if same else -1)
        out.append(a)
    return out


def _offset_axes(offsets: Any, ndim: int) -> tuple[int, ...]:
    """``offsets=`` as the output axes whose block offsets the kernel gets."""
    if offsets is True:
        return tuple(range(ndim))
    if offsets is False or offsets is None:
        return ()
    axes = (offsets,) if isinstance(offsets, (int, np.integer)) else tuple(offsets)
    if not all(isinstance(a, (int, np.integer)) and -ndim <= a < ndim for a in axes):
        raise ValueError(f"offsets= takes True, False or axes of the {ndim}-d output, got "
                         f"{offsets!r}")
    return tuple(int(a) % ndim for a in axes)


def _output_blocks(chunks: Any) -> da.Array | None:
    """A Dask array of ``chunks`` (explicit block sizes per axis) whose blocks hold no memory,
    or ``None`` where ``chunks`` does not give them all."""
    if chunks is None or callable(chunks) or not all(
            isinstance(c, tuple) and all(isinstance(n, (int, np.integer)) for n in c)
            for c in chunks):
        return None
    shape = tuple(int(sum(c)) for c in chunks)
    return da.zeros(shape, chunks=chunks, dtype=np.int8)


def _output_ndim(arrays: list[da.Array], chunks: Any, drop_axis: Any, new_axis: Any) -> int:
    if chunks is not None and not callable(chunks):
        return len(chunks)
    ndim = max(a.ndim for a in arrays)
    drop = [drop_axis] if isinstance(drop_axis, int) else list(drop_axis or [])
    new = [new_axis] if isinstance(new_axis, int) else list(new_axis or [])
    return ndim - len(drop) + len(new)


def _check_first_launch(launch: Callable, result: da.Array) -> None:
    """A launch configuration that cannot work fails here, before any block runs."""
    if result.size and all(c for c in result.chunks):
        checked_launch(launch, tuple(c[0] for c in result.chunks))


class GufuncOp:
    """A numba ``@guvectorize`` function over Dask arrays; see :func:`gufunc_op`."""

    def __init__(self, func: Any) -> None:
        self.func = func
        self.py_func, self.layout, self.loops = gufunc_parts(func)
        self.on_cuda = type(func).__name__ == "CUDAGeneralizedUFunc"
        self.__name__ = getattr(func, "__name__", "gufunc")
        self.__doc__ = getattr(func, "__doc__", None)
        self.__wrapped__ = func
        self._cuda: Any = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<dask_gpuchunk gufunc {self.__name__!r} {self.layout}>"

    def __dask_tokenize__(self) -> tuple:
        return ("GufuncOp", self.__name__, self.layout, id(self.func))

    def loop(self, *dtypes: Any) -> tuple[tuple[np.dtype, ...], tuple[np.dtype, ...]]:
        """The loop (input and output dtypes) NumPy's rule picks for inputs of these dtypes:
        the first whose inputs they cast to safely.

        Examples
        --------
        >>> import numba
        >>> @numba.guvectorize(["void(float32[:], float32[:])",
        ...                     "void(float64[:], float64[:])"], "(n)->()")
        ... def total(x, out):
        ...     out[0] = x.sum()
        >>> gufunc_op(total).loop("int32")
        ((dtype('float64'),), (dtype('float64'),))
        """
        given = [np.dtype(d) for d in dtypes]
        for ins, outs in self.loops:
            if len(ins) == len(given) and all(np.can_cast(g, d, "safe")
                                             for g, d in zip(given, ins)):
                return ins, outs
        have = "; ".join(f"({', '.join(d.name for d in ins)})" for ins, _ in self.loops)
        raise TypeError(f"gufunc {self.__name__!r} has no loop for inputs "
                        f"({', '.join(d.name for d in given)}); its loops take: {have}")

    def __call__(self, *arrays: Any, device: Device = "auto") -> Any:
        """Apply the gufunc; see :func:`gufunc_op`."""
        check_device_for_graph(device)
        dask_arrays = _as_dask(arrays)
        _check_core_dims(self.layout, dask_arrays)
        ins, outs = self.loop(*(a.dtype for a in dask_arrays))
        dask_arrays = [a if a.dtype == d else a.astype(d) for a, d in zip(dask_arrays, ins)]
        if device == "cpu" and self.on_cuda:
            raise ValueError(f"{self.__name__}: a target='cuda' gufunc has no CPU version; "
                             "decorate the function for the CPU target to run it there")
        several = len(outs) > 1
        # output_dtypes, not meta: dask's array query planning takes no tuple of metas (the
        # outputs' array type follows the inputs').
        return da.apply_gufunc(
            self._block, self.layout, *dask_arrays,
            output_dtypes=list(outs) if several else outs[0],
            device=device, allow_rechunk=True)  # loop axes only: core axes checked whole

    def _cuda_gufunc(self) -> Any:
        """The function compiled for CUDA with the CPU gufunc's signatures (once)."""
        if self.on_cuda:
            return self.func
        with self._lock:
            if self._cuda is None:
                import numba

                self._cuda = numba.guvectorize(self.func.gufunc_builder._sigs, self.layout,
                                               target="cuda")(self.py_func)
        return self._cuda

    def _block(self, *blocks: Any, device: str) -> Any:
        on_device = any(is_cupy(b) for b in blocks)
        if on_device and device == "cpu":
            raise ValueError("device='cpu' was given CuPy chunks; use device='gpu' or 'auto'")
        to_gpu = on_device or self.on_cuda or (device == "gpu")
        if not to_gpu:
            return self.func(*blocks)
        import cupy

        from ._kernels.launch import numba_stream

        stream = numba_stream(cupy.cuda.get_current_stream())
        dev = [_numba_view(cupy.asarray(b)) for b in blocks]
        result = self._cuda_gufunc()(*dev, stream=stream)
        results = result if isinstance(result, tuple) else (result,)
        got = [cupy.asarray(r) for r in results]
        if not on_device:
            got = [cupy.asnumpy(r, stream=cupy.cuda.get_current_stream()) for r in got]
            cupy.cuda.get_current_stream().synchronize()
        return tuple(got) if isinstance(result, tuple) else got[0]


def _check_core_dims(layout: str, arrays: Sequence[da.Array]) -> None:
    """Each input's core axes in one block (what the gufunc's Python loop sees whole)."""
    core_dims, _ = _compat.parse_gufunc_signature(layout)
    if len(core_dims) != len(arrays):
        raise TypeError(f"the gufunc's layout {layout} takes {len(core_dims)} inputs, "
                        f"got {len(arrays)}")
    for k, (dims, a) in enumerate(zip(core_dims, arrays)):
        if len(dims) > a.ndim:
            raise ValueError(f"input {k + 1} has {a.ndim} axes; {layout} needs {len(dims)}")
        split = [d for d, n in zip(dims, a.numblocks[a.ndim - len(dims):]) if n > 1]
        if split:
            raise ValueError(f"input {k + 1}: core dimension {split[0]!r} of {layout} has "
                             "multiple chunks; rechunk it into one (x.rechunk({-1: -1}))")


def gufunc_op(func: Any) -> GufuncOp:
    """A numba ``@guvectorize`` function as an operation over Dask arrays.

    Core dimensions (the layout's ``(n)``) must be whole in each block, as
    :func:`dask.array.apply_gufunc` requires; loop dimensions are chunked freely and broadcast.
    Inputs are cast to the loop NumPy's rule picks (the first of the gufunc's signatures they
    cast to safely). NumPy blocks run the CPU gufunc (``device="gpu"``: copied to the GPU and
    back); CuPy blocks run the same Python function compiled for CUDA with the same
    signatures, on the worker's stream (a ``target="cuda"`` gufunc runs every block on the
    GPU).

    Parameters
    ----------
    func
        A numba ``@guvectorize`` function (``target="cpu"``, ``"parallel"`` or ``"cuda"``).

    Returns
    -------
    GufuncOp
        Called as ``op(*arrays, device="auto")``: a Dask array, a tuple of them for several
        outputs.

    Examples
    --------
    >>> import dask.array as da, numba
    >>> @numba.guvectorize(["void(float64[:], float64[:], float64[:])"], "(n),(n)->()")
    ... def dot(a, b, out):
    ...     acc = 0.0
    ...     for i in range(a.shape[0]):
    ...         acc += a[i] * b[i]
    ...     out[0] = acc
    >>> x = da.ones((6, 4), chunks=(2, 4))
    >>> result = gufunc_op(dot)(x, 2 * x)  # doctest: +SKIP
    >>> result.compute()  # doctest: +SKIP
    array([8., 8., 8., 8., 8., 8.])
    """
    return GufuncOp(func)
