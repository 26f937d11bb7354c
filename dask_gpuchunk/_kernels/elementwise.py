"""Per-chunk kernels for elementwise functions: a numba CUDA kernel, its CPU twin, a NumPy reference.

A user's scalar function ``f(a, b, ...)`` becomes, per number of arguments and dimensionality,
a generated kernel ``kernel(out, a0, a1, ...)`` that writes ``out[idx] = f(a0[idx], a1[idx], ...)``
for every index of ``out``. With ``rules="numpy"`` (the default) ``f`` is the user's function
translated for the chunk's dtypes so that it computes NumPy's values
(:mod:`~dask_gpuchunk._kernels.translate`); with ``rules="numba"`` it is the user's function as
numba types it. Inputs arrive already broadcast to ``out``'s shape (views with zero
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
from .numpy_rules import VType, weak_type
from .source_cache import cached_njit, function_stamp, load_kernel, numba_cache_here
from .translate import Translation, translate

__all__ = [
    "RULES",
    "SUPPORTED_DTYPES",
    "ElementwiseKernels",
    "arg_type",
    "check_dtype",
    "collapse_dims",
    "is_python_number",
    "is_scalar",
    "kernels_for",
    "numba_result_dtype",
    "reference",
]

#: How an elementwise function's arithmetic is compiled: "numpy" (NumPy's types and values,
#: through :func:`~dask_gpuchunk._kernels.translate.translate`) or "numba" (numba's own).
RULES = ("numpy", "numba")

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
    TypeError: x has dtype float16, which elementwise kernels do not support (numba's CPU target has no float16 type); cast first, e.g. x.astype('float32')
    """
    dt = np.dtype(dtype)
    if dt.isnative and dt in SUPPORTED_DTYPES:
        return dt
    if dt.newbyteorder("=") in SUPPORTED_DTYPES and not dt.isnative:
        raise TypeError(
            f"{what} has non-native byte order ({dt.str}); convert it first, "
            f"e.g. x.astype({dt.newbyteorder('=').name!r})"
        )
    if dt == np.float16:
        raise TypeError(
            f"{what} has dtype float16, which elementwise kernels do not support (numba's CPU "
            "target has no float16 type); cast first, e.g. x.astype('float32')")
    names = ", ".join(d.name for d in SUPPORTED_DTYPES)
    raise TypeError(
        f"{what} has dtype {dt}, which elementwise kernels do not support; supported: {names} "
        "(cast first, e.g. x.astype('float32'))"
    )


def is_python_number(x: Any) -> bool:
    """A Python ``bool``, ``int``, ``float`` or ``complex`` (a "weak" scalar, NEP 50)."""
    return type(x) in (bool, int, float, complex)


def is_scalar(x: Any) -> bool:
    """A value passed to kernels by value: a NumPy scalar or a Python number."""
    return isinstance(x, np.generic) or is_python_number(x)


def arg_type(x: Any, index: int | None = None) -> VType:
    """The translation type of a kernel argument: a Python number is weak (``index`` marks it
    as that argument, whose value the call checks), anything else its dtype.

    Examples
    --------
    >>> t = arg_type(0.5, 1)
    >>> t.dtype, t.weak, t.call
    (dtype('float64'), True, 'args[1]')
    >>> arg_type(np.ones(3, np.float32)).weak
    False
    """
    if is_python_number(x):
        return weak_type(x, index)
    return VType(np.dtype(x.dtype))


def numba_result_dtype(func: Callable, dtypes: Sequence[np.dtype],
                       cache: bool = False) -> np.dtype:
    """Compile ``func`` for the CPU at these argument dtypes and return numba's result dtype
    (``rules="numba"``).

    Examples
    --------
    >>> numba_result_dtype(lambda a, b: a * b, [np.dtype("int8"), np.dtype("int8")])
    dtype('int64')
    """
    import numba
    from numba.np.numpy_support import as_dtype

    dispatcher = cached_njit(func) if cache else numba.njit(func)  # cached_njit: in the cache dir
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
        dtype = np.dtype(as_dtype(ret))
    except Exception:
        raise TypeError(
            f"{getattr(func, '__name__', func)!r} returns {ret}, not a single number"
        ) from None
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

    Each element is passed as a NumPy scalar (integer arithmetic wraps as NumPy's does), each
    Python number as it is (weak, as NumPy treats it).

    Examples
    --------
    >>> reference(lambda a, b: a * b, "int8", np.array([100, 2], "int8"), np.int8(3))
    array([44,  6], dtype=int8)
    >>> reference(lambda x, k: x * k, "float32", np.array([0.5], "float32"), 0.1)
    array([0.05], dtype=float32)
    """
    arrays = np.broadcast_arrays(*[np.asarray(a) for a in args])
    out = np.empty(arrays[0].shape if arrays else (), dtype=dtype)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for idx in np.ndindex(out.shape):
            out[idx] = func(*(a if is_python_number(a) else b[idx] for a, b in zip(args, arrays)))
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


def _signature_key(out: Any, inputs: Sequence[Any]) -> tuple:
    """(ndim, layout, ((dtype, is_scalar, is_python_number), ...), out dtype): one compiled
    kernel per key. A Python number's dtype is the one holding it (float64 for a float)."""
    arrays = [out, *(a for a in inputs if not is_scalar(a))]
    contiguous = all(a.flags["C_CONTIGUOUS"] for a in arrays)
    args = tuple((weak_type(a).dtype, True, True) if is_python_number(a)
                 else (np.dtype(a.dtype), is_scalar(a), False) for a in inputs)
    return (out.ndim, "C" if contiguous else "A", args, np.dtype(out.dtype))


def _numba_signature(key: tuple, readonly_inputs: bool) -> Any:
    import numba
    from numba import types

    ndim, layout, args, out_dtype = key
    params = []
    for dtype, scalar, _ in args:
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
        A scalar function of ``nargs`` arguments.
    nargs
        Its number of arguments.
    token
        What identifies the function (:func:`kernels_for`'s key).
    cache
        Keep compiled kernels on disk (see :func:`~dask_gpuchunk._kernels.source_cache.load_kernel`).
    rules
        ``"numpy"``: the function is translated per dtype signature to compute NumPy's values;
        ``"numba"``: compiled as numba types it.

    Examples
    --------
    >>> k = ElementwiseKernels(lambda a, b: a * b, 2)
    >>> out = np.empty(4)
    >>> k.cpu(out, np.arange(4.0), np.full(4, 2.0))
    >>> out
    array([0., 2., 4., 6.])
    """

    def __init__(self, func: Callable, nargs: int, token: str | None = None,
                 cache: bool = False, rules: str = "numpy") -> None:
        if rules not in RULES:
            raise ValueError(f"rules must be one of {RULES}, got {rules!r}")
        self.func = func
        self.nargs = nargs
        self.rules = rules
        self.token = token if token is not None else f"{id(func):x}-{nargs}-{rules}"
        #: numba's compiled code kept on disk (``source_cache.cache_dir()``), found again by later
        #: processes, where ``cache`` was asked for and ``func`` is defined in a file.
        self.stamp = function_stamp(func) if cache else None
        self._lock = threading.Lock()
        self._cpu: dict[tuple, Callable] = {}
        self._cuda: dict[tuple, Callable] = {}
        self._translations: dict[tuple, Translation] = {}
        self._translations_lock = threading.Lock()  # apart: taken inside self._lock too
        self._numba_dtypes: dict[tuple, np.dtype] = {}
        self._cpu_scalar: Callable | None = None
        self._cuda_device: Callable | None = None
        self._direct: dict[tuple, DirectLaunch] = {}

    def __dask_tokenize__(self) -> tuple:
        # Graph names follow the function (by its token), not this object's compiled state.
        return ("ElementwiseKernels", self.token, self.nargs, self.rules)

    def __reduce__(self) -> tuple:
        # Compiled kernels stay in the process that built them. A worker unpickles every task
        # afresh, so it looks the kernels up by token and compiles each signature only once.
        return (kernels_for, (self.func, self.nargs, self.token, self.stamp is not None,
                              self.rules))

    # ---- types -----------------------------------------------------------------------------
    def translation(self, argtypes: Sequence[VType], out_dtype: Any = None) -> Translation:
        """The function translated for these argument types (``rules="numpy"``), cached."""
        key = (tuple((vt.dtype, vt.weak, vt.call) for vt in argtypes),
               None if out_dtype is None else np.dtype(out_dtype))
        found = self._translations.get(key)
        if found is None:
            found = translate(self.func, argtypes, key[1])
            with self._translations_lock:
                found = self._translations.setdefault(key, found)
        return found

    def result_dtype(self, argtypes: Sequence[VType]) -> np.dtype:
        """The result dtype for arguments of these types, by the function's rules."""
        if self.rules == "numpy":
            dtype = self.translation(argtypes).result_dtype
            return check_dtype(dtype, f"the result of {getattr(self.func, '__name__', 'f')!r}")
        dtypes = tuple(vt.dtype for vt in argtypes)
        found = self._numba_dtypes.get(dtypes)
        if found is None:
            found = self._numba_dtypes[dtypes] = numba_result_dtype(
                self.func, dtypes, cache=self.stamp is not None)
        return found

    def _compile_source(self, key: tuple, kernel_source: str, namespace: dict[str, Any],
                        jit: Callable[[Callable, bool], Any], target: str,
                        cache: bool) -> Callable:
        """The generated ``kernel`` of ``kernel_source`` with its ``f`` for ``key`` (each
        translated function made by ``jit(function, in_a_file)``), in a file of the kernel
        cache where ``cache``."""
        _, _, args, out_dtype = key
        if self.rules == "numpy":
            argtypes = [VType(dt, weak=weak, call=f"args[{i}]" if weak else None)
                        for i, (dt, _, weak) in enumerate(args)]
            t = self.translation(argtypes, out_dtype)
            source = f"{t.source}\n{kernel_source}"
            functions = t.functions
        else:
            source, functions = kernel_source, ()
        file_key = f"{target} {self.rules} {self.stamp}" if cache else None
        pyfunc = _generate(source, namespace, file_key)
        cached = _in_a_file(pyfunc)
        scope = pyfunc.__globals__
        # A cached source is one module per process: another key of the same source (another
        # layout) finds its functions compiled already.
        done = scope.setdefault("_dask_gpuchunk_compiled", set())
        for name in functions:
            if name not in done:
                scope[name] = jit(scope[name], cached)
                done.add(name)
        return pyfunc

    # ---- CPU -----------------------------------------------------------------------------
    def _cpu_kernel(self, key: tuple) -> Callable:
        kernel = self._cpu.get(key)
        if kernel is not None:
            return kernel
        with self._lock, numba_cache_here():
            kernel = self._cpu.get(key)
            if kernel is None:
                import numba

                from .numpy_ops import namespace

                ndim, _, args, _ = key
                source = _cpu_source([scalar for _, scalar, _ in args], ndim)
                if self.rules == "numpy":
                    scope = {**namespace("cpu"), "prange": numba.prange}
                else:
                    if self._cpu_scalar is None:
                        self._cpu_scalar = numba.njit(self.func, cache=self.stamp is not None)
                    scope = {"f": self._cpu_scalar, "prange": numba.prange}
                pyfunc = self._compile_source(
                    key, source, scope,
                    lambda f, cached: numba.njit(f, error_model="numpy", cache=cached), "cpu",
                    self.stamp is not None)
                sig = _numba_signature(key, readonly_inputs=True)
                kernel = numba.njit(sig, parallel=True, nogil=True, error_model="numpy",
                                    cache=_in_a_file(pyfunc))(pyfunc)
                self._cpu[key] = kernel
        return kernel

    def cpu(self, out: np.ndarray, *inputs: Any) -> None:
        """Run the CPU twin (``numba.njit(parallel=True)``): ``out[...] = f(*inputs)``.

        Each input is an array of ``out``'s shape (broadcast views are fine), a NumPy scalar or
        a Python number, passed to the kernel by value.
        """
        self._cpu_kernel(_signature_key(out, inputs))(out, *inputs)

    # ---- CUDA ----------------------------------------------------------------------------
    def _cuda_kernel(self, key: tuple) -> Callable:
        kernel = self._cuda.get(key)
        if kernel is not None:
            return kernel
        with self._lock, numba_cache_here():
            kernel = self._cuda.get(key)
            if kernel is None:
                import numba
                from numba import cuda
                from numba.cuda import config as cuda_config

                from .numpy_ops import namespace

                ndim, _, args, _ = key
                source = _cuda_source([scalar for _, scalar, _ in args], ndim)
                if self.rules == "numpy":
                    target = "sim" if cuda_config.ENABLE_CUDASIM else "cuda"
                    scope = {**namespace(target), "cuda": cuda, "int64": numba.int64}
                else:
                    if self._cuda_device is None:
                        self._cuda_device = cuda.jit(device=True)(self.func)
                    scope = {"f": self._cuda_device, "cuda": cuda, "int64": numba.int64}
                pyfunc = self._compile_source(
                    key, source, scope, lambda f, cached: cuda.jit(device=True)(f), "cuda",
                    self.stamp is not None and not cuda_config.ENABLE_CUDASIM)
                kernel = cuda.jit(_numba_signature(key, readonly_inputs=False),
                                  cache=_in_a_file(pyfunc))(pyfunc)
                self._cuda[key] = kernel
        return kernel

    def cuda(self, out: Any, *inputs: Any, stream: Any = 0) -> None:
        """Launch the CUDA kernel on numba device arrays: ``out[...] = f(*inputs)``.

        Each input is a device array of ``out``'s shape (zero-stride broadcast views are fine),
        a NumPy scalar or a Python number, passed by value; ``stream`` is a numba stream
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


_registry: dict[tuple[str, bool, str], ElementwiseKernels] = {}
_registry_lock = threading.Lock()


def kernels_for(func: Callable, nargs: int, token: str, cache: bool = False,
                rules: str = "numpy") -> ElementwiseKernels:
    """The process's one :class:`ElementwiseKernels` for ``(token, cache, rules)``, made on
    first use.

    ``token`` must identify the function (``dask.base.tokenize(func)`` does).
    """
    with _registry_lock:
        kernels = _registry.get((token, cache, rules))
        if kernels is None:
            kernels = _registry[(token, cache, rules)] = ElementwiseKernels(
                func, nargs, token, cache, rules)
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
