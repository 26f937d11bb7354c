"""Where ``dg.gram``'s time goes on one device-resident chunk, beside its kernel alone (run on
a GPU machine).

    python3 tools/gram_path_profile.py [N] [K]

Packed words of N x K random bits on the device, one chunk: the default method's kernel alone
(C allocated once), then ``dg.gram(...).persist()`` on the threaded scheduler and on the
synchronous one (each followed by a device synchronisation, medians of 7), then each task of
one synchronous persist timed with the device drained after it (dask callbacks), and the tasks'
names, so that what runs besides the kernel (copies of C, reductions) shows.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import cupy
import dask
import numpy as np
from bmma_tiles import timed  # this folder's tool: run as tools/gram_path_profile.py
from dask.callbacks import Callback

import dask_gpuchunk as dg
from dask_gpuchunk.gram import resolve_method


def median_ms(fn) -> float:
    return timed(fn, repeat=7) * 1e3


class TaskTimes(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.spent: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.t0 = 0.0

    def _pretask(self, key, dsk, state) -> None:
        cupy.cuda.Device().synchronize()
        self.t0 = time.perf_counter()

    def _posttask(self, key, result, dsk, state, worker_id) -> None:
        cupy.cuda.Device().synchronize()
        name = key[0] if isinstance(key, tuple) else str(key)
        self.spent[name.rsplit("-", 1)[0]] += time.perf_counter() - self.t0
        self.count[name.rsplit("-", 1)[0]] += 1


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 131072
    rng = np.random.default_rng(0)
    words = cupy.asarray(rng.integers(0, 2**64, size=(n, k // 64), dtype=np.uint64))
    method = resolve_method("auto", on_gpu=True)
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}: N={n} K={k}, "
          f"auto = {method}", flush=True)
    from dask_gpuchunk.gram import _launcher

    c = cupy.empty((n, n), dtype=np.int32)
    launch = _launcher(method, diagonal=True)
    t = median_ms(lambda c=c: launch(c, [words], 0))
    print(f"  kernel alone (symmetric): {t:.2f} ms = {n * n * k / t / 1e-3:.3e}", flush=True)
    del c
    x = dg.asarray(words, chunks=(n, -1))
    (x,) = dask.persist(x)
    held = []

    def persist(scheduler: str) -> None:
        (g,) = dask.persist(dg.gram(x, packed=True), scheduler=scheduler)
        held[:] = [g]

    for scheduler in ("threads", "sync"):
        t = median_ms(lambda: persist(scheduler))
        print(f"  dg.gram persist, {scheduler}: {t:.2f} ms = {n * n * k / t / 1e-3:.3e}",
              flush=True)
    graph = dg.gram(x, packed=True)
    t0 = time.perf_counter()
    graph.__dask_graph__()
    print(f"  graph: {len(dict(graph.__dask_graph__()))} tasks, built in "
          f"{(time.perf_counter() - t0) * 1e3:.2f} ms", flush=True)
    for _ in range(2):
        times = TaskTimes()
        with times:
            held[:] = dask.persist(dg.gram(x, packed=True), scheduler="sync")
    for name, spent in sorted(times.spent.items(), key=lambda item: -item[1]):
        print(f"    task {name}: {times.count[name]} x, {spent * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
