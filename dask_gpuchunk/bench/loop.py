"""``dask-gpuchunk bench elementwise --loop-sizes``: seed 002's device-resident RK4 loop.

Each step of the loop advances two complex64 arrays ``F`` and ``G`` by one RK4 step of::

    dF/dt = -2j F - 1j delta (2 G - 1)
    dG/dt = -1j (conj(delta) F - delta conj(F))

with ``delta = sum(F)`` of the previous step, kept on the device (a 0-d array) and recorded.
The same loop runs as:

- ``ours, eager CuPy``: :data:`rk4_step` on CuPy arrays, both outputs and the sum in one pass;
  ``fma=True``: :data:`rk4_step_fma`, the same with products fused into additions;
- ``ours, Dask, one chunk`` / ``four chunks``: the same on persisted CuPy-chunked Dask arrays,
  each step persisted (``delta`` stays a 0-d Dask array on the device), and the same with
  ``delta`` fetched to the host every step (``fetch delta``);
- ``peer cupy ElementwiseKernel + sum``: CuPy's best hand-written form, one
  ``ElementwiseKernel`` for both outputs, then ``cupy.sum`` (a second read of ``F``);
- ``peer numba-cuda kernel + sum``: a hand-written ``@cuda.jit`` kernel for both outputs, then
  ``cupy.sum``;
- ``floor: dask persist of one task + one scalar``: what any Dask step costs, measured here;
- ``floor: dask persist of the four-chunk step's graph``: the same for a graph of the four-chunk
  step's shape (13 tasks that compute nothing): what Dask costs that step.

Times are per step; ``vs_cupy`` divides by the CuPy row of the same size. Bytes per step: the
fused pass reads ``F`` and ``G`` and writes them (4 arrays); the peers read ``F`` once more.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..elementwise_ops import elementwise
from .timing import Entry

__all__ = ["LOOP_TABLE", "d_f", "d_g", "initial_values", "rk4_step", "rk4_step_fma", "run_loop"]

LOOP_TABLE = "seed002 loop"


def d_f(f: complex, g: complex, delta: complex) -> complex:
    return -2j * f - 1j * delta * (2 * g - 1)


def d_g(f: complex, delta: complex) -> complex:
    return -1j * (delta.conjugate() * f - delta * f.conjugate())


def _rk4(f: complex, g: complex, delta: complex, dt: float) -> tuple[complex, complex]:
    f1, g1 = d_f(f, g, delta), d_g(f, delta)
    f2, g2 = d_f(f + dt / 2 * f1, g + dt / 2 * g1, delta), d_g(f + dt / 2 * f1, delta)
    f3, g3 = d_f(f + dt / 2 * f2, g + dt / 2 * g2, delta), d_g(f + dt / 2 * f2, delta)
    f4, g4 = d_f(f + dt * f3, g + dt * g3, delta), d_g(f + dt * f3, delta)
    return (f + dt / 6 * (f1 + 2 * f2 + 2 * f3 + f4),
            g + dt / 6 * (g1 + 2 * g2 + 2 * g3 + g4))


#: One RK4 step of seed 002's system: ``F, G, delta = rk4_step(F, G, delta, dt,
#: reduce=("sum", None))`` gives both new arrays and ``sum(F)`` in one pass.
rk4_step = elementwise(_rk4, name="rk4_step")
#: The same step with products fused into additions on the GPU, as nvcc fuses them in CuPy's
#: kernel (``elementwise(..., fma=True)``).
rk4_step_fma = elementwise(_rk4, name="rk4_step_fma", fma=True)


def initial_values(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``F`` and ``G`` of ``n`` complex64 values: ``F`` scaled so that ``sum(F)`` is O(1), ``G``
    near 1/2 so that the coupling summed over every equation stays small (the loop is stable)."""
    rng = np.random.default_rng(seed)
    f = ((rng.standard_normal(n) + 1j * rng.standard_normal(n)) / n).astype(np.complex64)
    g = (0.5 + 1e-3 * (rng.standard_normal(n) + 1j * rng.standard_normal(n))).astype(np.complex64)
    return f, g


_CUPY_STEP = r"""
    const float h = dt;
    const complex<float> j(0.0f, 1.0f);
    complex<float> fs = f, gs = g;
    #define DF(F, G) (-2.0f * j * (F) - j * delta * (2.0f * (G) - 1.0f))
    #define DG(F) (-j * (conj(delta) * (F) - delta * conj(F)))
    complex<float> f1 = DF(fs, gs), g1 = DG(fs);
    complex<float> f2 = DF(fs + h / 2 * f1, gs + h / 2 * g1), g2 = DG(fs + h / 2 * f1);
    complex<float> f3 = DF(fs + h / 2 * f2, gs + h / 2 * g2), g3 = DG(fs + h / 2 * f2);
    complex<float> f4 = DF(fs + h * f3, gs + h * g3), g4 = DG(fs + h * f3);
    f_out = fs + h / 6 * (f1 + 2.0f * f2 + 2.0f * f3 + f4);
    g_out = gs + h / 6 * (g1 + 2.0f * g2 + 2.0f * g3 + g4);
    #undef DF
    #undef DG
"""


def _cupy_loop() -> Callable[..., Any]:
    import cupy

    kernel = cupy.ElementwiseKernel(
        "complex64 f, complex64 g, raw complex64 d, float32 dt", "complex64 f_out, complex64 g_out",
        "const complex<float> delta = d[0];\n" + _CUPY_STEP, "seed002_rk4_step")

    def loop(f: Any, g: Any, delta: Any, dt: np.float32, steps: int, history: Any) -> Any:
        f, g = f.copy(), g.copy()  # the buffers swap: never write into the caller's arrays
        fo, go = cupy.empty_like(f), cupy.empty_like(g)
        for i in range(steps):
            kernel(f, g, delta, dt, fo, go)
            f, g, fo, go = fo, go, f, g
            delta = cupy.sum(f, keepdims=False).reshape(1)
            history[i] = delta[0]
        return f, g, delta

    return loop


def _numba_loop() -> Callable[..., Any]:
    import cupy
    from numba import cuda

    device_f = cuda.jit(device=True)(d_f)
    device_g = cuda.jit(device=True)(d_g)

    @cuda.jit
    def kernel(f: Any, g: Any, d: Any, dt: float, f_out: Any, g_out: Any) -> None:
        i = cuda.grid(1)
        if i < f.shape[0]:
            delta, fs, gs, h = d[0], f[i], g[i], dt
            f1, g1 = device_f(fs, gs, delta), device_g(fs, delta)
            f2 = device_f(fs + h / 2 * f1, gs + h / 2 * g1, delta)
            g2 = device_g(fs + h / 2 * f1, delta)
            f3 = device_f(fs + h / 2 * f2, gs + h / 2 * g2, delta)
            g3 = device_g(fs + h / 2 * f2, delta)
            f4, g4 = device_f(fs + h * f3, gs + h * g3, delta), device_g(fs + h * f3, delta)
            f_out[i] = fs + h / 6 * (f1 + 2 * f2 + 2 * f3 + f4)
            g_out[i] = gs + h / 6 * (g1 + 2 * g2 + 2 * g3 + g4)

    def loop(f: Any, g: Any, delta: Any, dt: np.float32, steps: int, history: Any) -> Any:
        stream = cuda.external_stream(cupy.cuda.get_current_stream().ptr)
        f, g = f.copy(), g.copy()  # the buffers swap: never write into the caller's arrays
        fo, go = cupy.empty_like(f), cupy.empty_like(g)
        blocks = (f.size + 127) // 128
        for i in range(steps):
            kernel[blocks, 128, stream](f.ravel(), g.ravel(), delta, dt, fo.ravel(), go.ravel())
            f, g, fo, go = fo, go, f, g
            delta = cupy.sum(f).reshape(1)
            history[i] = delta[0]
        return f, g, delta

    return loop


def _ours_eager(step: Any) -> Callable[..., Any]:
    def loop(f: Any, g: Any, delta: Any, dt: np.float32, steps: int, history: Any) -> Any:
        delta = delta[0]
        for i in range(steps):
            f, g, delta = step(f, g, delta, dt, reduce=("sum", None))
            history[i] = delta
        return f, g, delta

    return loop


def _ours_dask(chunks: Any, fetch: bool) -> Callable[..., Any]:
    import dask

    from ..arrays import asarray

    def loop(f: Any, g: Any, delta: Any, dt: np.float32, steps: int, history: Any) -> Any:
        fd, gd = dask.persist(asarray(f, chunks=chunks), asarray(g, chunks=chunks))
        d: Any = delta[0]
        for i in range(steps):
            fd, gd, d = dask.persist(*rk4_step(fd, gd, d, dt, reduce=("sum", None)))
            if fetch:
                history[i] = d.compute()
        return fd.compute(), gd.compute(), d.compute()

    return loop


def _dask_floor() -> Callable[..., Any]:
    """A persist of a one-task graph (a chunk already on the device, returned as it is) and
    the fetch of a 0-d device value: what any Dask step costs on this machine."""
    import dask
    import dask.array as da
    from dask.highlevelgraph import HighLevelGraph

    def loop(f: Any, g: Any, delta: Any, dt: np.float32, steps: int, history: Any) -> Any:
        chunks = tuple((n,) for n in f.shape)
        (scalar,) = dask.persist(da.from_array(delta[0], chunks=()))
        for i in range(steps):
            name = f"floor-{i}"
            key = (name, *(0,) * f.ndim)
            graph = HighLevelGraph.from_collections(name, {key: (_same, f)})
            dask.persist(da.Array(graph, name, chunks, dtype=f.dtype, meta=f[(slice(0, 0),) * f.ndim]))
            history[i] = scalar.compute()
        return f, g, delta

    return loop


def _same(x: Any) -> Any:
    return x


def _both(f: Any, g: Any) -> tuple[Any, Any]:
    return f, g


def _first_value(*pairs: Any) -> Any:
    return pairs[0][0].reshape(-1)[0]


def _dask_step_floor(chunks: tuple[int, ...]) -> Callable[..., Any]:
    """A persist of a graph shaped as a step's in ``chunks``: per block a task taking both
    arrays' blocks and two tasks picking them, one task over every block for ``delta``; none
    computes anything. What Dask costs for that step, whatever its tasks do."""
    import dask
    import dask.array as da
    from dask.highlevelgraph import HighLevelGraph

    from ..arrays import asarray

    def loop(f: Any, g: Any, delta: Any, dt: np.float32, steps: int, history: Any) -> Any:
        fd, gd = dask.persist(asarray(f, chunks=chunks), asarray(g, chunks=chunks))
        meta, scalar_meta = f[(slice(0, 0),) * f.ndim], delta[0]
        tail = (0,) * (f.ndim - 1)
        for i in range(steps):
            name = f"step-floor-{i}"
            blocks = [(name, b, *tail) for b in range(fd.numblocks[0])]
            graph: dict[Any, Any] = {(f"{name}-delta",): (_first_value, *blocks)}
            for key in blocks:
                graph[key] = (_both, (fd.name, *key[1:]), (gd.name, *key[1:]))
                graph[(f"{name}-f", *key[1:])] = (operator.getitem, key, 0)
                graph[(f"{name}-g", *key[1:])] = (operator.getitem, key, 1)
            layers = HighLevelGraph.from_collections(name, graph, dependencies=[fd, gd])
            fd, gd, _ = dask.persist(
                da.Array(layers, f"{name}-f", fd.chunks, dtype=f.dtype, meta=meta),
                da.Array(layers, f"{name}-g", gd.chunks, dtype=g.dtype, meta=meta),
                da.Array(layers, f"{name}-delta", (), dtype=delta.dtype, meta=scalar_meta))
        return f, g, delta

    return loop


def run_loop(sizes: list[int], steps: int, repeat: int, log: Callable[[str], None],
             skip: tuple[str, ...] = (), dt: float = 1e-4) -> list[Entry]:
    """Every form of the loop at each size (number of values per array); one entry per form
    and size, ``seconds`` per step (median of ``repeat`` loops of ``steps`` steps)."""
    import statistics

    import cupy

    entries: list[Entry] = []
    dt32 = np.float32(dt)
    forms: list[tuple[str, str, Callable[..., Any]]] = [
        ("peer cupy ElementwiseKernel + sum", "peer", _cupy_loop()),
        ("peer numba-cuda kernel + sum", "peer", _numba_loop()),
        ("ours, eager CuPy", "ours", _ours_eager(rk4_step)),
        ("ours, eager CuPy, fma=True", "ours", _ours_eager(rk4_step_fma)),
    ]
    for n in sizes:
        f0, g0 = initial_values(n)
        side = int(round(n ** 0.5))
        shape = (side, side) if side * side == n else (n,)
        f0, g0 = f0.reshape(shape), g0.reshape(shape)
        four = (max(1, shape[0] // 4), *shape[1:])
        sized = [*forms,
                 ("ours, Dask, one chunk", "ours", _ours_dask(shape, False)),
                 ("ours, Dask, four chunks", "ours", _ours_dask(four, False)),
                 ("ours, Dask, one chunk, fetch delta", "ours", _ours_dask(shape, True)),
                 ("floor: dask persist of one task + one scalar", "limit", _dask_floor()),
                 ("floor: dask persist of the four-chunk step's graph", "limit",
                  _dask_step_floor(four))]
        results: dict[str, Any] = {}
        first = len(entries)  # this size's entries (skipped forms add none)
        for name, kind, loop in sized:
            label = f"{name} [{'x'.join(map(str, shape))}]"
            if any(s in label for s in skip):
                continue
            entry = Entry(LOOP_TABLE, label, kind)
            try:
                f, g = cupy.asarray(f0), cupy.asarray(g0)
                delta = cupy.asarray(np.array([f0.sum()], np.complex64))
                history = cupy.zeros(steps, np.complex64)
                loop(f, g, delta, dt32, 2, history)  # compile
                cupy.cuda.Device().synchronize()
                for _ in range(repeat):
                    history[...] = 0
                    t0 = time.perf_counter()
                    out = loop(f, g, delta, dt32, steps, history)
                    cupy.cuda.Device().synchronize()
                    entry.runs.append((time.perf_counter() - t0) / steps)
                entry.seconds = statistics.median(entry.runs)
                results[name] = (out, history.get())
            except Exception as exc:  # reported, not fatal
                entry.skipped = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            entries.append(entry)
            log(f"{label}: {entry.seconds and entry.seconds * 1e3:.3f} ms per step"
                if entry.seconds else f"{label}: skipped ({entry.skipped})")
        _compare(entries[first:], results, shape)
    return entries


def _compare(entries: list[Entry], results: dict[str, Any], shape: tuple[int, ...]) -> None:
    """``vs_cupy`` per row; the relative error of each loop's last ``delta`` and ``F`` against
    the CuPy loop's."""
    cupy_name = "peer cupy ElementwiseKernel + sum"
    ref = next((e for e in entries if e.name.startswith(cupy_name) and e.seconds), None)
    if ref is None or cupy_name not in results:
        return
    (ref_f, _, _), ref_history = results[cupy_name]
    ref_f = ref_f.get() if hasattr(ref_f, "get") else np.asarray(ref_f)
    for e in entries:
        if not e.seconds:
            continue
        e.extra["vs_cupy"] = e.seconds / ref.seconds
        e.extra["vs_cupy_row"] = ref.name
        e.extra["shape"] = list(shape)
        name = e.name.rsplit(" [", 1)[0]
        if name in results and not name.startswith("floor"):
            (f, _, delta), _ = results[name]
            f = f.get() if hasattr(f, "get") else np.asarray(f)
            d = complex(np.asarray(delta.get() if hasattr(delta, "get") else delta).reshape(-1)[0])
            d_ref = complex(ref_history[-1])
            e.extra["delta_rel_error"] = abs(d - d_ref) / abs(d_ref)
            e.extra["f_max_rel_error"] = float(np.max(np.abs(f - ref_f)) / np.max(np.abs(ref_f)))
