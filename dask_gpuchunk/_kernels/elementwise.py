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

import hashlib
import importlib.util
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "SUPPORTED_DTYPES",
    "ElementwiseKernels",
    "StridedArg",
    "check_dtype",
    "kernels_for",
    "collapse_dims",
    "cache_dir",
    "direct_launch_available",
    "function_stamp",
    "infer_result_dtype",
    "reference",
]

#: Part of every cache file's key (kernel sources may change between versions).
_PACKAGE_VERSION = "0.1.0"

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

    With ``file_key``, the source lives in a file of :func:`cache_dir` named after a hash of the
    source and the key, so that numba can keep what it compiles from it on disk (numba's
    ``cache=True`` needs a function defined in a file, and keys its cache on that file).
    """
    path = _kernel_file(source, file_key) if file_key is not None else None
    if path is None:
        code = compile(source, "<dask_gpuchunk elementwise kernel>", "exec")
        exec(code, namespace)  # noqa: S102 - source generated above from integers only
        return namespace["kernel"]
    # One module per file and process (the file names the function and the source, so
    # another load would have the same globals); numba's cached code refers to it by name.
    name = f"dask_gpuchunk_kernel_{path.stem}"
    with _registry_lock:
        if name in _kernel_modules:
            return _kernel_modules[name].kernel
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update(namespace)
    spec.loader.exec_module(module)
    with _registry_lock:
        module = _kernel_modules.setdefault(name, module)
        sys.modules[name] = module  # where numba's cached code finds its globals again
    return module.kernel


_kernel_modules: dict[str, Any] = {}


def cache_dir() -> Path | None:
    """Where kernels compiled with ``cache=True`` are kept; ``None`` where it cannot be written.

    ``DASK_GPUCHUNK_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/dask_gpuchunk`` (by default
    ``~/.cache/dask_gpuchunk``). Holds the generated kernel sources and, in ``__pycache__``,
    numba's compiled code for them.
    """
    root = os.environ.get("DASK_GPUCHUNK_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "dask_gpuchunk")
    path = Path(root) / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


def _kernel_file(source: str, file_key: str) -> Path | None:
    """The cache file holding ``source`` for ``file_key``, written once (atomically)."""
    import numba

    root = cache_dir()
    if root is None:
        return None
    key = f"{source}\n{file_key}\n{numba.__version__}\n{_PACKAGE_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    path = root / f"k{digest}.py"
    if not path.exists():
        # Never rewritten once there: numba keys its cache on the file's size and mtime.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            tmp.write_text(f"# generated by dask_gpuchunk for {file_key}\n{source}")
            os.replace(tmp, path)
        except OSError:
            return None
    return path


def function_stamp(func: Callable) -> str | None:
    """What identifies ``func``'s code for a cache on disk, as numba's ``cache=True`` does:
    its source file (path, size, modification time), qualified name and first line. ``None``
    for a function defined outside a file (a REPL, ``exec``), which is then never cached.

    As with numba's cache, changes to other functions ``func`` calls from other files are not
    seen: clear :func:`cache_dir` after editing those.

    Examples
    --------
    >>> function_stamp(check_dtype).endswith(":check_dtype:" + str(check_dtype.__code__.co_firstlineno))
    True
    >>> function_stamp(eval("lambda x: x")) is None
    True
    """
    code = getattr(func, "__code__", None)
    if code is None or not os.path.isfile(code.co_filename):
        return None
    st = os.stat(code.co_filename)
    return (f"{os.path.abspath(code.co_filename)}:{st.st_size}:{st.st_mtime_ns}:"
            f"{getattr(func, '__qualname__', '')}:{code.co_firstlineno}")


def _is_scalar(x: Any) -> bool:
    return isinstance(x, np.generic)


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
        #: numba's compiled code kept on disk (:func:`cache_dir`), found again by later
        #: processes, where ``cache`` was asked for and ``func`` is defined in a file.
        self.stamp = function_stamp(func) if cache else None
        self._lock = threading.Lock()
        self._cpu: dict[tuple, Callable] = {}
        self._cuda: dict[tuple, Callable] = {}
        self._cpu_scalar: Callable | None = None
        self._cuda_device: Callable | None = None
        self._direct: dict[tuple, _DirectLaunch] = {}

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
                                    cache=cache and os.path.isfile(pyfunc.__code__.co_filename))(pyfunc)
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
                                  cache=cache and os.path.isfile(pyfunc.__code__.co_filename))(pyfunc)
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
        goes straight to the compiled function (:class:`_DirectLaunch`); ``stream`` is a numba
        stream. Only where :func:`direct_launch_available` says so (not under the simulator).
        """
        key = _signature_key(out, inputs)
        device = _current_device()
        launcher = self._direct.get((key, device))
        if launcher is None:
            dispatcher = self._cuda_kernel(key)
            # One thread loads the module: numba's get_cufunc is not safe to race (two loads
            # of one image on an H200: "key already in dictionary: <CUlibrary ...>").
            with _LOAD_LOCK:
                launcher = self._direct.get((key, device))
                if launcher is None:
                    launcher = self._direct[(key, device)] = _DirectLaunch(dispatcher)
        threads, blocks = _launch_config(math.prod(out.shape))
        launcher(blocks, threads, stream, (out, *inputs))


#: Whether GPU launches go through :class:`_DirectLaunch` (``DASK_GPUCHUNK_DIRECT_LAUNCH``,
#: default 1); 0 sends every launch through numba's dispatcher, as under the simulator.
DIRECT_LAUNCH = os.environ.get("DASK_GPUCHUNK_DIRECT_LAUNCH", "1") != "0"


def direct_launch_available() -> bool:
    """Whether :meth:`ElementwiseKernels.cuda_strided` can run here: a real GPU (not numba's
    simulator), ``DIRECT_LAUNCH`` on, and numba-cuda launching through ``cuda.core``."""
    if not DIRECT_LAUNCH:
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
_LOAD_LOCK = threading.Lock()
_core_streams = threading.local()


def _current_device() -> int:
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


class _DirectLaunch:
    """One compiled elementwise kernel, launched with its arguments built from addresses.

    numba's dispatcher spends ~40 us per launch typing its arguments and another ~20 us per
    array wrapping CuPy memory as numba device arrays (docs/measurements/…profile-overheads);
    with one kernel per chunk on device-resident data that is most of a chunk's cost. The
    kernels here have one fixed signature each, so this flattens each array into numba's
    kernel ABI (meminfo, parent, nitems, itemsize, data, shape..., strides...: what
    ``_Kernel._prepare_args`` passes) directly from its address, lets numba convert scalars
    as it always does, and hands the compiled function to ``cuda.core.launch`` as numba does.
    """

    def __init__(self, dispatcher: Any) -> None:
        from cuda.core import LaunchConfig, launch

        (self.overload,) = dispatcher.overloads.values()
        if getattr(self.overload, "debug", False) or getattr(self.overload, "cooperative", False):
            raise RuntimeError("debug and cooperative kernels launch through numba")
        self.types = tuple(self.overload.argument_types)
        self.function = self.overload._codelibrary.get_cufunc().kernel  # this device's
        self._config = LaunchConfig
        self._launch = launch
        self._configs: dict[tuple[int, int], Any] = {}

    def __call__(self, blocks: int, threads: int, stream: Any,
                 args: Sequence[StridedArg | np.generic]) -> None:
        flat: list[Any] = []
        for ty, a in zip(self.types, args):
            if isinstance(a, StridedArg):
                flat += (0, 0, math.prod(a.shape), a.dtype.itemsize, a.ptr, *a.shape,
                         *a.strides)
            else:
                self.overload._prepare_args(ty, a, stream, [], flat)
        config = self._configs.get((blocks, threads))
        if config is None:
            config = self._configs[(blocks, threads)] = self._config(grid=blocks, block=threads)
        self._launch(_core_stream(stream), config, self.function, *flat)


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
