"""Timing helpers shared by the benchmarks: warm-up, repeats, medians, skipped entries."""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Entry", "time_entry"]


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
