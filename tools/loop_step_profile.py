"""Where one step of seed 002's device-resident loop goes (run on a GPU machine).

    python3 tools/loop_step_profile.py --out $OUT/loop-step

For each form of the step (``bench/loop.py``'s ``rk4_step``: both outputs and ``sum(F)`` in one
pass) and size, after a warm-up:

* ms per step, wall, the device drained at the end (as ``bench elementwise --loop-sizes``);
* ms per step of host time alone (the step's Python, no drain), and for Dask the split into
  building the graph and ``dask.persist``; host time above the GPU's step time is what a step
  loses to the host;
* the Dask forms again under ``scheduler="sync"`` and with ``optimize_graph=False`` (what
  dask's thread pool and its optimisation cost; not settings the package makes);
* per task of the four-chunk step, its time under ``scheduler="sync"`` (the pass, the picks,
  the sum; ``bench elementwise --loop-sizes`` has Dask's floor for the same graph);
* a cProfile of ``--steps`` steps, top functions by own and by cumulative time, to
  ``OUT-<form>.txt`` (and ``.prof``).

Writes ``OUT.json`` with the figures.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import cupy
import dask
import numpy as np

from dask_gpuchunk.arrays import asarray
from dask_gpuchunk.bench.loop import initial_values, rk4_step

DT = np.float32(1e-4)


@functools.lru_cache(maxsize=1)
def _host_values(n: int) -> tuple[np.ndarray, np.ndarray]:
    return initial_values(n)


def _arrays(n: int) -> tuple[Any, Any, Any, tuple[int, ...]]:
    f0, g0 = _host_values(n)
    side = int(round(n ** 0.5))
    shape = (side, side) if side * side == n else (n,)
    f, g = cupy.asarray(f0.reshape(shape)), cupy.asarray(g0.reshape(shape))
    return f, g, cupy.asarray(np.complex64(f0.sum())), shape


def _eager(n: int) -> Any:
    f, g, d, _ = _arrays(n)
    state = [f, g, d]

    def step() -> None:
        state[0], state[1], state[2] = rk4_step(state[0], state[1], state[2], DT,
                                                reduce=("sum", None))
    return step, None


def _dask(n: int, parts: int, **persist: Any) -> Any:
    f, g, d, shape = _arrays(n)
    chunks = (max(1, shape[0] // parts), *shape[1:])
    fd, gd = dask.persist(asarray(f, chunks=chunks), asarray(g, chunks=chunks))
    state: list[Any] = [fd, gd, d]
    split = {"build": [], "persist": []}

    def step() -> None:
        t0 = time.perf_counter()
        out = rk4_step(state[0], state[1], state[2], DT, reduce=("sum", None))
        t1 = time.perf_counter()
        state[:] = dask.persist(*out, **persist)
        split["build"].append(t1 - t0)
        split["persist"].append(time.perf_counter() - t1)
    return step, split


def _task_times(n: int, parts: int, steps: int) -> dict[str, float]:
    """Microseconds per task of each kind in one step (the scheduler's own time left out),
    under ``scheduler="sync"`` so that no other thread runs meanwhile."""
    import dask.local

    spent: dict[str, list[float]] = {}
    execute = dask.local.execute_task

    def timed(key: Any, *rest: Any) -> Any:
        t0 = time.perf_counter()
        result = execute(key, *rest)
        name = key[0] if isinstance(key, tuple) else str(key)
        kind = name.rsplit("-", 1)[-1] if name.count("-") > 1 else "pass"
        spent.setdefault(kind, []).append(time.perf_counter() - t0)
        return result

    step, _ = _dask(n, parts, scheduler="sync")
    for _ in range(3):
        step()
    dask.local.execute_task = timed
    try:
        for _ in range(steps):
            step()
    finally:
        dask.local.execute_task = execute
    cupy.cuda.Device().synchronize()
    return {f"{kind} us (x{len(v) // steps})": statistics.median(v) * 1e6
            for kind, v in spent.items()}


def _cupy(n: int) -> Any:
    from dask_gpuchunk.bench.loop import _CUPY_STEP

    kernel = cupy.ElementwiseKernel(
        "complex64 f, complex64 g, raw complex64 d, float32 dt", "complex64 f_out, complex64 g_out",
        "const complex<float> delta = d[0];\n" + _CUPY_STEP, "seed002_rk4_step_probe")
    f, g, d, _ = _arrays(n)
    state = [f, g, d.reshape(1), cupy.empty_like(f), cupy.empty_like(g)]

    def step() -> None:
        f, g, d, fo, go = state
        kernel(f, g, d, DT, fo, go)
        state[:] = [fo, go, cupy.sum(fo).reshape(1), f, g]
    return step, None


def measure(step: Any, split: Any, steps: int) -> dict[str, float]:
    for _ in range(3):
        step()
    cupy.cuda.Device().synchronize()
    if split:
        for v in split.values():
            v.clear()
    host = []
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        step()
        host.append(time.perf_counter() - t)
    cupy.cuda.Device().synchronize()
    wall = (time.perf_counter() - t0) / steps
    out = {"wall_ms": wall * 1e3, "host_ms": statistics.median(host) * 1e3}
    if split:
        out.update({f"{k}_ms": statistics.median(v) * 1e3 for k, v in split.items()})
    return out


def profile(step: Any, steps: int, path: Path) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    cupy.cuda.Device().synchronize()
    prof.disable()
    prof.dump_stats(str(path.with_suffix(".prof")))
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    path.with_suffix(".txt").write_text(text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--sizes", default="16777216,10000000,268435456")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {}
    for n in map(int, args.sizes.split(",")):
        forms = {
            "cupy": lambda: _cupy(n),
            "eager": lambda: _eager(n),
            "dask1": lambda: _dask(n, 1),
            "dask4": lambda: _dask(n, 4),
            "dask4-sync": lambda: _dask(n, 4, scheduler="sync"),
            "dask4-noopt": lambda: _dask(n, 4, optimize_graph=False),
            "dask1-sync": lambda: _dask(n, 1, scheduler="sync"),
        }
        for name, make in forms.items():
            try:
                step, split = make()
                figures[f"{name} n={n}"] = row = measure(step, split, args.steps)
            except Exception as exc:  # e.g. out of memory under a cap: say so, go on
                print(f"{name} n={n}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            print(f"{name} n={n}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()),
                  flush=True)
            if name == "dask4":
                figures[f"task times n={n}"] = times = _task_times(n, 4, args.steps)
                print(f"task times n={n}: {times}", flush=True)
            if name in ("eager", "dask1", "dask4"):
                profile(step, args.steps, Path(f"{args.out}-{name}-{n}"))
            del step, split
            cupy.get_default_memory_pool().free_all_blocks()
    Path(f"{args.out}.json").write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
