"""Timing helpers shared by the benchmarks: warm-up, repeats, medians, skipped entries."""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..devices import gpu_available

__all__ = ["Bench", "DevicePeaks", "Entry", "time_entry"]


@dataclass
class Entry:
    """One benchmark row: what ran, its wall times, or why it did not run."""

    table: str
    name: str
    kind: str  # "ours", "peer" or "limit"
    seconds: float | None = None
    runs: list[float] = field(default_factory=list)
    first_run: float | None = None
    skipped: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def time_entry(
    table: str,
    name: str,
    kind: str,
    fn: Callable[[], Any],
    *,
    repeat: int = 3,
    warmup: int = 1,
    setup: Callable[[], Any] | None = None,
) -> Entry:
    """Time ``fn`` (which must finish its device work before returning): median of ``repeat``.

    ``first_run`` is the first warm-up, which includes compilation and any one-off measurement
    (such as ``device="auto"``'s calibration). An exception becomes a skipped entry.
    """
    entry = Entry(table, name, kind)
    try:
        for i in range(warmup + repeat):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if i == 0:
                entry.first_run = dt
            if i >= warmup:
                entry.runs.append(dt)
        entry.seconds = statistics.median(entry.runs)
    except Exception as exc:  # a peer that cannot run here is reported, not fatal
        entry.skipped = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        entry.extra["traceback"] = traceback.format_exc(limit=4)
    return entry


class Bench:
    """Collects entries; knows the repeat count, what to skip and whether a GPU is here."""

    def __init__(self, repeat: int, skip: tuple[str, ...], log: Callable[[str], None]) -> None:
        self.entries: list[Entry] = []
        self.repeat = repeat
        self.skip = skip
        self.log = log
        self.has_gpu = gpu_available()

    def want(self, name: str) -> bool:
        return not any(s and s in name for s in self.skip)

    def add(self, entry: Entry) -> Entry:
        self.entries.append(entry)
        shown = f"{entry.seconds:.4f} s" if entry.seconds is not None else f"skipped: {entry.skipped}"
        self.log(f"  {entry.table:8s} {entry.name:40s} {shown}")
        return entry

    def timed(self, table: str, name: str, fn: Callable[[], Any], *, gpu: bool = False,
              check: Callable[[], None] | None = None, **kw: Any) -> Entry | None:
        if not self.want(name):
            return None
        kind = "ours" if name.startswith("ours") else "peer"
        if gpu and not self.has_gpu:
            return self.add(Entry(table, name, kind, skipped="no CUDA GPU visible"))
        kw.setdefault("repeat", self.repeat)
        entry = time_entry(table, name, kind, fn, **kw)
        if check is not None and entry.skipped is None:
            try:
                check()
            except AssertionError as exc:  # reported as a wrong result, not timed
                entry.skipped = f"WRONG RESULT: {exc}"
                entry.seconds = None
            except Exception as exc:  # a check that cannot run here (out of memory): said
                entry.skipped = f"not checked: {type(exc).__name__}: {exc}".splitlines()[0][:300]
                entry.seconds = None
        return self.add(entry)

    def interleaved(self, table: str, fns: dict[str, Callable[[], Any]],
                    check: Callable[[], None], repeat: int | None = None) -> list[Entry]:
        """Time several ways of doing the same work round-robin, so that drifts in the
        machine's state (clocks, memory placement, other load) fall on all of them alike.

        On the H200 host the same numba kernel took 0.10 to 0.15 s in different runs."""
        fns = {name: fn for name, fn in fns.items() if self.want(name)}
        entries = {name: Entry(table, name, "ours" if name.startswith("ours") else "peer")
                   for name in fns}
        for name, fn in fns.items():  # warm-up: compilation, calibration
            t0 = time.perf_counter()
            fn()
            entries[name].first_run = time.perf_counter() - t0
            check()
        for _ in range(repeat or self.repeat):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                entries[name].runs.append(time.perf_counter() - t0)
        for e in entries.values():
            e.seconds = float(np.median(e.runs))
            self.add(e)
        return list(entries.values())


class DevicePeaks:
    """Wraps ``fn`` to record, per call from an emptied pool, the CuPy pool's high-water mark
    (``pool``) and the driver's figure for this process (``process``: the pool's blocks plus the
    context, kernel modules and cuBLAS workspaces; sampled by
    :func:`dask_gpuchunk.runtime.process_memory.watch` and read at the end of the call; ``None``
    where the driver's per-process figure cannot be read). ``release``, where given, runs first: it
    drops what the previous call kept alive. ``keep_pool``: only the first call starts from an
    emptied pool (its peaks are recorded); later calls find the pool as the one before left it, as a
    loop of calls does."""

    def __init__(self, fn: Callable[[], Any], release: Callable[[], Any] | None = None,
                 keep_pool: bool = False) -> None:
        from ..runtime import process_memory

        process_memory.watch()
        self.fn = fn
        self.release = release
        self.keep_pool = keep_pool
        self.pool: list[int] = []
        self.process: list[int] = []

    def __call__(self) -> Any:
        import cupy

        from ..runtime import process_memory

        if self.release is not None:
            self.release()
        if self.keep_pool and self.pool:
            return self.fn()
        pool = cupy.get_default_memory_pool()
        pool.free_all_blocks()
        process_memory.reset_peak()
        result = self.fn()
        self.pool.append(int(pool.total_bytes()))  # the pool keeps its blocks until freed
        seen = process_memory.peak_bytes()
        if seen is not None:
            self.process.append(seen)
        return result

    def record(self, entry: Entry | None) -> None:
        """Put the peaks seen into ``entry.extra`` (``peak_device_bytes``,
        ``peak_process_bytes``)."""
        if entry is None:
            return
        if self.pool:
            entry.extra["peak_device_bytes"] = max(self.pool)
        if self.process:
            entry.extra["peak_process_bytes"] = max(self.process)
