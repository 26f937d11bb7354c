"""Per-chunk kernels for elementwise functions: a numba CUDA kernel, its CPU twin, a NumPy reference.

A user's scalar function ``f(a, b, ...)`` becomes, per number of arguments and dimensionality,
a generated kernel ``kernel(out, a0, a1, ...)`` that writes ``out[idx] = f(a0[idx], a1[idx], ...)``
for every index of ``out``. With ``rules="numpy"`` (the default) ``f`` is the user's function
translated for the chunk's dtypes so that it computes NumPy's values
(:mod:`~dask_gpuchunk.ufunc.translate`); with ``rules="numba"`` it is the user's function as
numba types it. Inputs arrive already broadcast to ``out``'s shape (views with zero
strides where an input is broadcast) and with their dimensions collapsed as far as their strides
allow (:func:`collapse_dims`), so the common cases run as one flat loop.

Kernels are compiled lazily, once per (dimensionality, layout, input dtypes, output dtype), with
an explicit signature: a C-contiguous variant where every array is contiguous (the fast path) and
an any-stride variant otherwise. No dask here.

This module is the kernels (:class:`ElementwiseKernels`, compiled and launched) and gives the
names of :mod:`~dask_gpuchunk._kernels.elementwise_rules` (dtypes, plans, the NumPy reference)
and :mod:`~dask_gpuchunk._kernels.elementwise_sources` (the generated sources).
"""

from __future__ import annotations

import math
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..ufunc.numpy_rules import VType
from ..ufunc.translate import Sources, Translation, capture_sources, translate
from ..ufunc.user_functions import for_target
from .elementwise_rules import (
    REDUCTIONS,
    RULES,
    SUPPORTED_DTYPES,
    ElementwisePlan,
    arg_type,
    check_dtype,
    collapse_dims,
    is_python_number,
    is_scalar,
    numba_result_dtype,
    partial_dtype,
    reduced_dtype,
    reference,
)
from .elementwise_sources import (
    _cpu_source,
    _cuda_source,
    _generate,
    _in_a_file,
    _numba_signature,
    _pass_namespace,
    _signature_key,
    reduction_start,
)
from .launch import DirectLaunch, StridedArg, current_device, load_lock
from .source_cache import function_stamp, numba_cache_here

__all__ = [
    "REDUCTIONS",
    "RULES",
    "SUPPORTED_DTYPES",
    "ElementwiseKernels",
    "ElementwisePlan",
    "arg_type",
    "check_dtype",
    "collapse_dims",
    "is_python_number",
    "is_scalar",
    "kernels_for",
    "numba_result_dtype",
    "partial_count",
    "partial_dtype",
    "reduced_dtype",
    "reduction_start",
    "reference",
]

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
    fma
        With ``rules="numpy"``, let the CUDA kernels fuse floating-point products with
        additions (:data:`~dask_gpuchunk.ufunc.numpy_ops.CUDA_TARGETS`); the CPU twin is
        unchanged.

    Examples
    --------
    >>> k = ElementwiseKernels(lambda a, b: a * b, 2)
    >>> out = np.empty(4)
    >>> k.cpu(out, np.arange(4.0), np.full(4, 2.0))
    >>> out
    array([0., 2., 4., 6.])
    """

    def __init__(self, func: Callable, nargs: int, token: str | None = None,
                 cache: bool = False, rules: str = "numpy", fma: bool = False,
                 sources: Sources | None = None) -> None:
        if rules not in RULES:
            raise ValueError(f"rules must be one of {RULES}, got {rules!r}")
        self.func = func
        #: The source files the translation reads, taken where the function was defined and
        #: carried with it to every worker (:func:`~dask_gpuchunk.ufunc.translate.capture_sources`);
        #: taken when the kernels are first pickled (``None`` until then).
        self.sources = dict(sources) if sources is not None else None
        self.nargs = nargs
        self.rules = rules
        self.fma = bool(fma)
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
        return ("ElementwiseKernels", self.token, self.nargs, self.rules, self.fma)

    def __reduce__(self) -> tuple:
        # Compiled kernels stay in the process that built them. A worker unpickles every task
        # afresh, so it looks the kernels up by token and compiles each signature only once.
        if self.sources is None:  # read once, and only for a process that is sent them
            self.sources = capture_sources(self.func) if self.rules == "numpy" else {}
        return (kernels_for, (self.func, self.nargs, self.token, self.stamp is not None,
                              self.rules, self.fma, self.sources))

    # ---- types -----------------------------------------------------------------------------
    def translation(self, argtypes: Sequence[VType], out_dtype: Any = None) -> Translation:
        """The function translated for these argument types (``rules="numpy"``), cached."""
        if out_dtype is not None:
            out_dtype = (tuple(np.dtype(d) for d in out_dtype) if isinstance(out_dtype, tuple)
                         else np.dtype(out_dtype))
        key = (tuple((vt.dtype, vt.weak, vt.call) for vt in argtypes), out_dtype)
        found = self._translations.get(key)
        if found is None:
            found = translate(self.func, argtypes, key[1], self.sources)
            with self._translations_lock:
                found = self._translations.setdefault(key, found)
        return found

    def result_dtype(self, argtypes: Sequence[VType]) -> np.dtype:
        """The result dtype for arguments of these types, by the function's rules (the first
        output's, where the function returns a tuple)."""
        return self.outputs(argtypes)[0][0]

    def outputs(self, argtypes: Sequence[VType]) -> tuple[tuple[np.dtype, ...], bool]:
        """The dtype of each output for arguments of these types, by the function's rules, and
        whether the function returns a tuple (then one output per value)."""
        if self.rules == "numpy":
            t = self.translation(argtypes)
            name = getattr(self.func, "__name__", "f")
            return (tuple(check_dtype(d, f"the result of {name!r}") for d in t.result_dtypes),
                    t.nout is not None)
        dtypes = tuple(vt.dtype for vt in argtypes)
        found = self._numba_dtypes.get(dtypes)
        if found is None:
            found = self._numba_dtypes[dtypes] = numba_result_dtype(
                _for_target(self.func, "cpu"), dtypes, cache=self.stamp is not None)
        return (found, True) if isinstance(found, tuple) else ((found,), False)

    def _compile_source(self, key: tuple, kernel_source: str, namespace: dict[str, Any],
                        jit: Callable[[Callable, bool], Any], target: str,
                        cache: bool) -> Callable:
        """The generated ``kernel`` of ``kernel_source`` with its ``f`` for ``key`` (each
        translated function made by ``jit(function, in_a_file)``), in a file of the kernel
        cache where ``cache``."""
        _, _, args, out_dtypes, spec = key
        if self.rules == "numpy":
            argtypes = [VType(dt, weak=weak, call=f"args[{i}]" if weak else None)
                        for i, (dt, _, weak) in enumerate(args)]
            t = self.translation(argtypes, out_dtypes if spec.tupled else out_dtypes[0])
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

                from ..ufunc.numpy_ops import namespace

                ndim, _, args, _, spec = key
                source = _cpu_source([scalar for _, scalar, _ in args], ndim, spec)
                if self.rules == "numpy":
                    scope = {**namespace("cpu"), "prange": numba.prange}
                else:
                    if self._cpu_scalar is None:
                        self._cpu_scalar = numba.njit(_for_target(self.func, "cpu"),
                                                      cache=self.stamp is not None)
                    scope = {"f": self._cpu_scalar, "prange": numba.prange}
                scope.update(_pass_namespace(spec))
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
        self._cpu_kernel(_signature_key((out,), inputs))(out, *inputs)

    def cpu_pass(self, plan: ElementwisePlan | None, outs: Sequence[np.ndarray],
                 partials: Sequence[np.ndarray], *inputs: Any) -> None:
        """As :meth:`cpu` for a :class:`ElementwisePlan`: every output of ``outs`` (one
        shape), and each reduction's partials (one per block of the loop: length
        :func:`partial_count` ``(n, "cpu")``)."""
        self._cpu_kernel(_signature_key(outs, inputs, plan))(*outs, *partials, *inputs)

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

                from ..ufunc.numpy_ops import namespace

                ndim, _, args, _, spec = key
                threads = (_reduction_config(1) if spec.reductions else _launch_config(1))[0]
                source = _cuda_source([scalar for _, scalar, _ in args], ndim, spec, threads)
                target = ("sim" if cuda_config.ENABLE_CUDASIM
                          else "cuda-fma" if self.fma else "cuda")
                if self.rules == "numpy":
                    scope = {**namespace(target), "cuda": cuda, "int64": numba.int64}
                else:
                    if self._cuda_device is None:
                        self._cuda_device = cuda.jit(device=True)(_for_target(self.func,
                                                                              "cuda"))
                    scope = {"f": self._cuda_device, "cuda": cuda, "int64": numba.int64}
                scope.update(_pass_namespace(spec))
                pyfunc = self._compile_source(
                    key, source, scope, lambda f, cached: cuda.jit(device=True)(f), target,
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
        self.cuda_pass(None, (out,), (), *inputs, stream=stream)

    def cuda_pass(self, plan: ElementwisePlan | None, outs: Sequence[Any],
                  reduction: Sequence[Any], *inputs: Any, stream: Any = 0) -> None:
        """As :meth:`cuda` for a :class:`ElementwisePlan` (``None``: one output): every output
        of ``outs`` (one shape), numba device arrays. ``reduction``: where the plan reduces,
        each reduction's partials (length :func:`partial_count` ``(n, "cuda")``), then each
        one's total (one element, of the dtype it is wanted in), then a one-element ``uint32``
        counter holding 0 (the kernel leaves it at 0); else empty."""
        key = _signature_key(outs, inputs, plan, _totals(plan, reduction))
        kernel = self._cuda_kernel(key)
        threads, blocks = _grid(key, outs[0].size, lambda t: _resident_blocks(kernel, t))
        kernel[blocks, threads, stream](*outs, *reduction, *inputs)

    def cuda_strided(self, out: StridedArg, *inputs: StridedArg | np.generic,
                     stream: Any) -> None:
        """Launch the CUDA kernel on arrays given by address: ``out[...] = f(*inputs)``.

        As :meth:`cuda`, but arrays are :class:`StridedArg` (all of one shape) and the launch
        goes straight to the compiled function (:class:`~dask_gpuchunk._kernels.launch.DirectLaunch`);
        ``stream`` is a numba stream. Only where ``launch.direct_launch_available()`` says so
        (not under the simulator).
        """
        self.cuda_strided_pass(None, (out,), (), *inputs, stream=stream)

    def cuda_strided_pass(self, plan: ElementwisePlan | None, outs: Sequence[StridedArg],
                          reduction: Sequence[StridedArg], *inputs: StridedArg | np.generic,
                          stream: Any) -> None:
        """:meth:`cuda_strided` for a :class:`ElementwisePlan` (``None``: one output, as
        :meth:`cuda_strided`), as :meth:`cuda_pass`."""
        launcher, blocks, threads = self.strided_launcher(plan, outs, reduction, inputs)
        launcher(blocks, threads, stream, (*outs, *reduction, *inputs))

    def strided_launcher(self, plan: ElementwisePlan | None, outs: Sequence[StridedArg],
                         reduction: Sequence[StridedArg],
                         inputs: Sequence[StridedArg | np.generic]
                         ) -> tuple[DirectLaunch, int, int]:
        """What :meth:`cuda_strided_pass` launches for arrays of these dtypes, shapes and
        layouts on this thread's device: the launcher, blocks and threads per block. A caller
        that launches the same kind of call again keeps it and calls it with new addresses."""
        key = _signature_key(outs, inputs, plan, _totals(plan, reduction))
        device = current_device()
        launcher = self._direct.get((key, device))
        if launcher is None:
            dispatcher = self._cuda_kernel(key)
            with load_lock:
                launcher = self._direct.get((key, device))
                if launcher is None:
                    launcher = self._direct[(key, device)] = DirectLaunch(dispatcher)
        threads, blocks = _grid(key, math.prod(outs[0].shape), launcher.resident_blocks)
        return launcher, blocks, threads


def _totals(plan: ElementwisePlan | None, reduction: Sequence[Any]) -> Sequence[Any]:
    """The totals of a pass's ``reduction`` arrays (partials, totals, counter)."""
    count = len(plan.reductions) if plan is not None else 0
    return reduction[count:2 * count]


def _resident_blocks(dispatcher: Any, threads: int) -> int:
    """How many blocks of ``threads`` of a numba kernel the current GPU holds at once."""
    (overload,) = dispatcher.overloads.values()
    return int(overload.max_cooperative_grid_blocks(threads))


def _grid(key: tuple, n: int, resident: Callable[[int], int]) -> tuple[int, int]:
    """Threads per block and blocks of a pass of ``key`` over ``n`` elements: one thread per
    element (:func:`_launch_config`); a pass with reductions :data:`REDUCTION_WAVES` times as
    many blocks as the GPU holds at once (``resident(threads)``), at most
    :func:`partial_count`."""
    if not key[-1].reductions:
        return _launch_config(n)
    threads, most = _reduction_config(n)
    from numba.cuda import config as cuda_config

    if not cuda_config.ENABLE_CUDASIM:
        most = min(most, REDUCTION_WAVES * resident(threads))
    return threads, max(1, most)


_registry: dict[tuple[str, bool, str], ElementwiseKernels] = {}


_registry_lock = threading.Lock()


def _for_target(func: Callable, target: str) -> Callable:
    """``func`` with the numba functions it calls compiled for ``target``
    (:func:`~dask_gpuchunk.ufunc.user_functions.for_target`)."""
    return for_target(func, target) if isinstance(func, types.FunctionType) else func


def kernels_for(func: Callable, nargs: int, token: str, cache: bool = False,
                rules: str = "numpy", fma: bool = False,
                sources: Sources | None = None) -> ElementwiseKernels:
    """The process's one :class:`ElementwiseKernels` for ``(token, cache, rules, fma)``, made
    on first use.

    ``token`` must identify the function (``dask.base.tokenize(func)`` does); ``sources`` are
    its source files' text where they were taken (a worker unpickling the kernels gets the
    client's), read here where not given.
    """
    with _registry_lock:
        kernels = _registry.get((token, cache, rules, fma))
        if kernels is None:
            kernels = _registry[(token, cache, rules, fma)] = ElementwiseKernels(
                func, nargs, token, cache, rules, fma, sources)
        return kernels


#: Most blocks of one launch (CUDA's limit on gridDim.x).
MAX_BLOCKS = 2**31 - 1


def partial_count(n: int, target: str) -> int:
    """How many partials each reduction of a pass over ``n`` elements writes: one per block of
    the CPU loop (``"cpu"``); at most one per block of the CUDA grid (``"cuda"``: the grid is
    never larger)."""
    if n == 0:
        return 0
    return min(n, 1024) if target == "cpu" else _reduction_config(n)[1]


#: Threads per block of a CUDA pass with reductions.
REDUCTION_THREADS = 256

#: Blocks of a CUDA pass with reductions, in GPU-fulls (the blocks the GPU holds at once).
#: Measured on an H200, seed 002's pass and sum over 16384² complex64 (perf note 23): 1, 2 and
#: 4 GPU-fulls of 256-thread blocks took 2930, 2769 and 2714 µs (CuPy's kernel and sum 2735);
#: 128, 512 and 1024 threads per block 2957, 2884 and 2875 µs at one GPU-full.
REDUCTION_WAVES = 4


_sm_counts: dict[int, int] = {}


def _reduction_config(n: int) -> tuple[int, int]:
    """Threads per block of a CUDA pass with reductions over ``n`` elements, and the most
    blocks it launches: no more than one per ``threads`` elements, nor than the current GPU
    holds in :data:`REDUCTION_WAVES` GPU-fulls (its multiprocessors x 2048 threads each)."""
    from numba import cuda
    from numba.cuda import config as cuda_config

    if cuda_config.ENABLE_CUDASIM:
        return _launch_config(n)
    device = current_device()
    sms = _sm_counts.get(device)
    if sms is None:
        sms = _sm_counts[device] = int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    threads = REDUCTION_THREADS
    return threads, max(1, min(math.ceil(n / threads), REDUCTION_WAVES * sms * 2048 // threads))


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
