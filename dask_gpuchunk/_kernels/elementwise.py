"""Per-chunk kernels for elementwise functions: a numba CUDA kernel, its CPU twin, a NumPy reference.

A user's scalar function ``f(a, b, ...)`` becomes, per number of arguments and dimensionality,
a generated kernel ``kernel(out, a0, a1, ...)`` that writes ``out[idx] = f(a0[idx], a1[idx], ...)``
for every index of ``out``. Inputs arrive already broadcast to ``out``'s shape (views with zero
strides where an input is broadcast) and with their dimensions collapsed as far as their strides
allow (:func:`collapse_dims`), so the common cases run as one flat loop.

Kernels are compiled lazily, once per (dimensionality, layout, input dtypes, output dtype), with
an explicit signature: a C-contiguous variant where every array is contiguous (the fast path) and
an any-stride variant otherwise. No dask here.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .launch import DirectLaunch, StridedArg, current_device, load_lock
from .source_cache import function_stamp, load_kernel

__all__ = [
    "SUPPORTED_DTYPES",
    "ElementwiseKernels",
    "check_dtype",
    "kernels_for",
    "collapse_dims",
    "infer_result_dtype",
    "reference",
]

#: The dtypes elementwise operations accept and produce.
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(name)
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float32", "float64", "complex64", "complex128",
    )
)


def check_dtype(dtype: Any, what: str) -> np.dtype:
    """Return ``np.dtype(dtype)`` if elementwise kernels support it, else raise ``TypeError``.

    Examples
    --------
    >>> check_dtype("f8", "x")
    dtype('float64')
    >>> check_dtype("float16", "x")
    Traceback (most recent call last):
    ...
    TypeError: x has dtype float16, which elementwise kernels do not support; supported: bool, int8, int16, int32, int64, uint8, uint16, uint32, uint64, float32, float64, complex64, complex128 (cast first, e.g. x.astype('float32'))
    """
    dt = np.dtype(dtype)
    if dt.isnative and dt in SUPPORTED_DTYPES:
        return dt
    if dt.newbyteorder("=") in SUPPORTED_DTYPES and not dt.isnative:
        raise TypeError(
            f"{what} has non-native byte order ({dt.str}); convert it first, "
            f"e.g. x.astype({dt.newbyteorder('=').name!r})"
        )
    names = ", ".join(d.name for d in SUPPORTED_DTYPES)
    raise TypeError(
        f"{what} has dtype {dt}, which elementwise kernels do not support; supported: {names} "
        "(cast first, e.g. x.astype('float32'))"
    )


def _numba_return_dtype(func: Callable, dtypes: Sequence[np.dtype],
                        cache: bool = False) -> np.dtype:
    """Compile ``func`` for the CPU at these argument dtypes and return its result dtype."""
    import numba
    from numba.np.numpy_support import as_dtype

    dispatcher = numba.njit(func, cache=cache)
    args = tuple(numba.from_dtype(dt) for dt in dtypes)
    try:
        dispatcher.compile(args)
    except Exception as exc:
        first = str(exc).strip().splitlines()
        detail = "\n".join(first[:12])
        sig = ", ".join(dt.name for dt in dtypes)
        raise TypeError(
            f"numba cannot compile {getattr(func, '__name__', func)!r} for arguments ({sig}); "
            f"elementwise functions must be scalar functions numba can compile in nopython mode. "
            f"numba said:\n{detail}"
        ) from None
    ret = dispatcher.nopython_signatures[-1].return_type
    try:
        return np.dtype(as_dtype(ret))
    except Exception:
        raise TypeError(
            f"{getattr(func, '__name__', func)!r} returns {ret}, not a single number"
        ) from None


def infer_result_dtype(func: Callable, dtypes: Sequence[np.dtype], *,
                       cache: bool = False) -> np.dtype:
    """Result dtype of ``func`` applied to scalars of ``dtypes``, by NumPy's rules.

    The function is first compiled by numba for these dtypes (which also checks it can run as
    a kernel), then called once on NumPy scalars of value 1: NumPy's promotion decides the
    result dtype (``int8 * int8 -> int8``, ``float32 * 2.0 -> float32``). If that call fails
    (a function that is only valid inside numba, or a value-dependent domain error), numba's
    inferred return type is used. ``cache``: numba keeps that compilation on disk.

    Examples
    --------
    >>> infer_result_dtype(lambda a, b: a * b, [np.dtype("int8"), np.dtype("int8")])
    dtype('int8')
    >>> infer_result_dtype(lambda a, b: a * b, [np.dtype("int32"), np.dtype("float32")])
    dtype('float64')
    """
    numba_dtype = _numba_return_dtype(func, dtypes, cache)
    ones = [np.ones((), dtype=dt)[()] for dt in dtypes]
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = func(*ones)
        dtype = np.asarray(result).dtype
    except Exception:
        dtype = numba_dtype
    if dtype not in SUPPORTED_DTYPES:
        dtype = numba_dtype
    return check_dtype(dtype, f"the result of {getattr(func, '__name__', func)!r}")


def collapse_dims(
    shape: Sequence[int], strides: Sequence[Sequence[int]]
) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Drop length-1 dimensions and merge neighbours that every array walks contiguously.

    ``strides`` holds one stride tuple (in bytes or elements, consistently) per array, all
    arrays having ``shape``. Dimension ``d`` merges into ``d + 1`` when, for every array,
    ``strides[d] == strides[d + 1] * shape[d + 1]`` (broadcast dimensions, stride 0, merge
    with each other). The result has at least one dimension.

    Examples
    --------
    >>> collapse_dims((100, 4000, 5), [(160000, 40, 8), (0, 40, 8)])
    ((100, 20000), [(160000, 8), (0, 8)])
    >>> collapse_dims((1, 7), [(56, 8)])
    ((7,), [(8,)])
    """
    keep = [d for d, n in enumerate(shape) if n != 1]
    if not keep:
        return (1,), [(0,) for _ in strides]
    new_shape = [shape[keep[0]]]
    new_strides = [[s[keep[0]]] for s in strides]
    for d in keep[1:]:
        n = shape[d]
        if all(st[-1] == s[d] * n for st, s in zip(new_strides, strides)):
            new_shape[-1] *= n
            for st, s in zip(new_strides, strides):
                st[-1] = s[d]
        else:
            new_shape.append(n)
            for st, s in zip(new_strides, strides):
                st.append(s[d])
    return tuple(new_shape), [tuple(st) for st in new_strides]


def reference(func: Callable, dtype: Any, *args: Any) -> np.ndarray:
    """Plain NumPy/Python evaluation of ``func`` element by element: the tests' reference.

    Each element is passed as a NumPy scalar, so integer arithmetic wraps as NumPy's does.

    Examples
    --------
    >>> reference(lambda a, b: a * b, "int8", np.array([100, 2], "int8"), np.int8(3))
    array([44,  6], dtype=int8)
    """
    arrays = np.broadcast_arrays(*[np.asarray(a) for a in args])
    out = np.empty(arrays[0].shape if arrays else (), dtype=dtype)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for idx in np.ndindex(out.shape):
            out[idx] = func(*(a[idx] for a in arrays))
    return out


# --------------------------------------------------------------------------------------------
# Code generation. The kernels are generated as source text because numba compiles neither
# *args nor loops over a variable number of dimensions; one source per (nargs, ndim).


def _args(scalars: Sequence[bool], idx: str) -> tuple[str, str]:
    """Parameter list and call arguments: arrays are indexed, scalars passed as they are."""
    params = ", ".join(f"a{k}" for k in range(len(scalars)))
    call = ", ".join(f"a{k}" if scalar else f"a{k}[{idx}]" for k, scalar in enumerate(scalars))
    return params, call


def _cpu_source(scalars: Sequence[bool], ndim: int) -> str:
    if ndim == 1:
        params, call = _args(scalars, "i")
        return (
            f"def kernel(out, {params}):\n"
            f"    for i in prange(out.shape[0]):\n"
            f"        out[i] = f({call})\n"
        )
    # Several dimensions: split the flat range into blocks, one per parallel iteration; each
    # block unravels its start once, then walks runs along the last axis (no division per
    # element) and carries into the outer axes at the end of each run.
    last = ndim - 1
    idx = ", ".join([f"i{d}" for d in range(last)] + ["j"])
    params, call = _args(scalars, idx)
    lines = [
        f"def kernel(out, {params}):",
        "    n = out.size",
        "    nblocks = min(n, 1024)",
        "    for b in prange(nblocks):",
        "        start = b * n // nblocks",
        "        stop = (b + 1) * n // nblocks",
        "        r = start",
    ]
    for d in range(last, 0, -1):
        lines.append(f"        i{d} = r % out.shape[{d}]")
        lines.append(f"        r = r // out.shape[{d}]")
    lines += [
        "        i0 = r",
        "        pos = start",
        "        while pos < stop:",
        f"            run = min(stop - pos, out.shape[{last}] - i{last})",
        f"            for j in range(i{last}, i{last} + run):",
        f"                out[{idx}] = f({call})",
        "            pos += run",
        f"            i{last} += run",
    ]
    indent = "            "
    for d in range(last, 0, -1):
        lines.append(f"{indent}if i{d} == out.shape[{d}]:")
        lines.append(f"{indent}    i{d} = 0")
        lines.append(f"{indent}    i{d - 1} += 1")
        indent += "    "
    return "\n".join(lines) + "\n"


def _cuda_source(scalars: Sequence[bool], ndim: int) -> str:
    """One element per thread (:func:`_launch_config` covers ``out`` with the grid), then a
    grid-stride loop for what a smaller grid leaves (numba's simulator runs tiny grids).

    Measured on an H200 (4 GB float64 product, docs/perf-notes.md): one element per thread in
    blocks of 128 ran in 2.73 ms, as CuPy's own multiply (2.75) and the same kernel in CUDA C
    (2.71); every grid-stride launch shape took 2.86-3.06 ms in numba, 2.79-2.98 in CUDA C.
    """
    idx = ", ".join(f"i{d}" for d in range(ndim)) if ndim > 1 else "i"
    params, call = _args(scalars, idx)
    unravel = []
    if ndim > 1:
        unravel.append("r = i")
        for d in range(ndim - 1, 0, -1):
            unravel.append(f"q = r // out.shape[{d}]")
            unravel.append(f"i{d} = r - q * out.shape[{d}]")
            unravel.append("r = q")
        unravel.append("i0 = r")
    body = [*unravel, f"out[{idx}] = f({call})"]
    lines = [
        f"def kernel(out, {params}):",
        "    n = out.size",
        "    i = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x",
        "    if i < n:",
        *("        " + line for line in body),
        "    step = int64(cuda.gridDim.x) * cuda.blockDim.x",
        "    i += step",
        "    while i < n:",
        *("        " + line for line in body),
        "        i += step",
    ]
    return "\n".join(lines) + "\n"


def _generate(source: str, namespace: dict[str, Any], file_key: str | None = None) -> Callable:
    """The function ``kernel`` defined by ``source``, with ``namespace`` as its globals.

    With ``file_key``, the source lives in a file of the kernel cache
    (:func:`dask_gpuchunk._kernels.source_cache.load_kernel`), where numba can keep what it
    compiles from it; where that directory cannot be written, as without.
    """
    kernel = load_kernel(source, namespace, file_key) if file_key is not None else None
    if kernel is None:
        code = compile(source, "<dask_gpuchunk elementwise kernel>", "exec")
        exec(code, namespace)  # noqa: S102 - source generated above from integers only
        kernel = namespace["kernel"]
    return kernel


def _in_a_file(kernel: Callable) -> bool:
    """Whether a generated kernel came from a file of the kernel cache (:func:`_generate` with
    a ``file_key`` and a writable cache), where numba can cache what it compiles."""
    return os.path.isfile(kernel.__code__.co_filename)


def _is_scalar(x: Any) -> bool:
    return isinstance(x, np.generic)


def _signature_key(out: Any, inputs: Sequence[Any]) -> tuple:
    """(ndim, layout, ((dtype, is_scalar), ...), out dtype): one compiled kernel per key."""
    arrays = [out, *(a for a in inputs if not _is_scalar(a))]
    contiguous = all(a.flags["C_CONTIGUOUS"] for a in arrays)
    args = tuple((np.dtype(a.dtype), _is_scalar(a)) for a in inputs)
    return (out.ndim, "C" if contiguous else "A", args, np.dtype(out.dtype))


def _numba_signature(key: tuple, readonly_inputs: bool) -> Any:
    import numba
    from numba import types

    ndim, layout, args, out_dtype = key
    params = []
    for dtype, scalar in args:
        if scalar:
            params.append(numba.from_dtype(dtype))
        else:
            params.append(types.Array(numba.from_dtype(dtype), ndim, layout, readonly=readonly_inputs))
    return types.void(types.Array(numba.from_dtype(out_dtype), ndim, layout), *params)


class ElementwiseKernels:
    """The compiled kernels of one scalar function, built on first use and cached.

    Parameters
    ----------
    func
        A scalar function of ``nargs`` arguments that numba can compile (for the CPU and,
        to use the GPU, for CUDA).
    nargs
        Its number of arguments.

    Examples
    --------
    >>> k = ElementwiseKernels(lambda a, b: a * b, 2)
    >>> out = np.empty(4)
    >>> k.cpu(out, np.arange(4.0), np.full(4, 2.0))
    >>> out
    array([0., 2., 4., 6.])
    """

    def __init__(self, func: Callable, nargs: int, token: str | None = None,
                 cache: bool = False) -> None:
        self.func = func
        self.nargs = nargs
        self.token = token if token is not None else f"{id(func):x}-{nargs}"
        #: numba's compiled code kept on disk (``source_cache.cache_dir()``), found again by later
        #: processes, where ``cache`` was asked for and ``func`` is defined in a file.
        self.stamp = function_stamp(func) if cache else None
        self._lock = threading.Lock()
        self._cpu: dict[tuple, Callable] = {}
        self._cuda: dict[tuple, Callable] = {}
        self._cpu_scalar: Callable | None = None
        self._cuda_device: Callable | None = None
        self._direct: dict[tuple, DirectLaunch] = {}

    def __reduce__(self) -> tuple:
        # Compiled kernels stay in the process that built them. A worker unpickles every task
        # afresh, so it looks the kernels up by token and compiles each signature only once.
        return (kernels_for, (self.func, self.nargs, self.token, self.stamp is not None))

    # ---- CPU -----------------------------------------------------------------------------
    def _cpu_kernel(self, key: tuple) -> Callable:
        kernel = self._cpu.get(key)
        if kernel is not None:
            return kernel
        with self._lock:
            kernel = self._cpu.get(key)
            if kernel is None:
                import numba

                cache = self.stamp is not None
                if self._cpu_scalar is None:
                    self._cpu_scalar = numba.njit(self.func, cache=cache)
                ndim, _, args, _ = key
                pyfunc = _generate(
                    _cpu_source([scalar for _, scalar in args], ndim),
                    {"f": self._cpu_scalar, "prange": numba.prange},
                    f"cpu {self.stamp}" if cache else None,
                )
                sig = _numba_signature(key, readonly_inputs=True)
                kernel = numba.njit(sig, parallel=True, nogil=True, error_model="numpy",
                                    cache=_in_a_file(pyfunc))(pyfunc)
                self._cpu[key] = kernel
        return kernel

    def cpu(self, out: np.ndarray, *inputs: Any) -> None:
        """Run the CPU twin (``numba.njit(parallel=True)``): ``out[...] = f(*inputs)``.

        Each input is an array of ``out``'s shape (broadcast views are fine) or a NumPy scalar,
        passed to the kernel by value.
        """
        self._cpu_kernel(_signature_key(out, inputs))(out, *inputs)

    # ---- CUDA ----------------------------------------------------------------------------
    def _cuda_kernel(self, key: tuple) -> Callable:
        kernel = self._cuda.get(key)
        if kernel is not None:
            return kernel
        with self._lock:
            kernel = self._cuda.get(key)
            if kernel is None:
                import numba
                from numba import cuda

                if self._cuda_device is None:
                    self._cuda_device = cuda.jit(device=True)(self.func)
                ndim, _, args, _ = key
                from numba.cuda import config as cuda_config

                cache = self.stamp is not None and not cuda_config.ENABLE_CUDASIM
                pyfunc = _generate(
                    _cuda_source([scalar for _, scalar in args], ndim),
                    {"f": self._cuda_device, "cuda": cuda, "int64": numba.int64},
                    f"cuda {self.stamp}" if cache else None,
                )
                kernel = cuda.jit(_numba_signature(key, readonly_inputs=False),
                                  cache=_in_a_file(pyfunc))(pyfunc)
                self._cuda[key] = kernel
        return kernel

    def cuda(self, out: Any, *inputs: Any, stream: Any = 0) -> None:
        """Launch the CUDA kernel on numba device arrays: ``out[...] = f(*inputs)``.

        Each input is a device array of ``out``'s shape (zero-stride broadcast views are fine)
        or a NumPy scalar, passed by value; ``stream`` is a numba stream
        (``cuda.external_stream(ptr)`` for a CuPy stream). The launch is asynchronous.
        """
        kernel = self._cuda_kernel(_signature_key(out, inputs))
        threads, blocks = _launch_config(out.size)
        kernel[blocks, threads, stream](out, *inputs)

    def cuda_strided(self, out: StridedArg, *inputs: StridedArg | np.generic,
                     stream: Any) -> None:
        """Launch the CUDA kernel on arrays given by address: ``out[...] = f(*inputs)``.

        As :meth:`cuda`, but arrays are :class:`StridedArg` (all of one shape) and the launch
        goes straight to the compiled function (:class:`~dask_gpuchunk._kernels.launch.DirectLaunch`);
        ``stream`` is a numba stream. Only where ``launch.direct_launch_available()`` says so
        (not under the simulator).
        """
        key = _signature_key(out, inputs)
        device = current_device()
        launcher = self._direct.get((key, device))
        if launcher is None:
            dispatcher = self._cuda_kernel(key)
            with load_lock:
                launcher = self._direct.get((key, device))
                if launcher is None:
                    launcher = self._direct[(key, device)] = DirectLaunch(dispatcher)
        threads, blocks = _launch_config(math.prod(out.shape))
        launcher(blocks, threads, stream, (out, *inputs))


_registry: dict[tuple[str, bool], ElementwiseKernels] = {}
_registry_lock = threading.Lock()


def kernels_for(func: Callable, nargs: int, token: str, cache: bool = False) -> ElementwiseKernels:
    """The process's one :class:`ElementwiseKernels` for ``(token, cache)``, made on first use.

    ``token`` must identify the function (``dask.base.tokenize(func)`` does).
    """
    with _registry_lock:
        kernels = _registry.get((token, cache))
        if kernels is None:
            kernels = _registry[(token, cache)] = ElementwiseKernels(func, nargs, token, cache)
        return kernels


#: Most blocks of one launch (CUDA's limit on gridDim.x).
MAX_BLOCKS = 2**31 - 1


def _launch_config(n: int) -> tuple[int, int]:
    """Threads per block and blocks: one thread per element of ``n`` (see :func:`_cuda_source`)."""
    from numba.cuda import config as cuda_config

    if cuda_config.ENABLE_CUDASIM:
        # The simulator runs every CUDA thread as a Python thread: keep grids tiny (the
        # kernel's grid-stride loop covers the rest).
        threads = 32
        return threads, max(1, min(math.ceil(n / threads), 4))
    threads = 128
    return threads, max(1, min(math.ceil(n / threads), MAX_BLOCKS))
