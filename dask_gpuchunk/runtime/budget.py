"""The device-memory budget: how many bytes the package's chunks may hold on a GPU at once.

A process's *capacity* on its current device is the device's memory, or CuPy's pool limit
where one is set (``CUPY_GPU_MEMORY_LIMIT``, ``MemoryPool.set_limit``): a card capped that way
behaves as a card of that size. Inside a dask-cuda worker, results stored on the device are
spilled to the host beyond the worker's ``device_memory_limit`` (dask-cuda's default: 80 % of
the capacity, see :func:`spill_limit`). The *working budget*, what running chunks may allocate,
is the capacity less :data:`HEADROOM_FRACTION` (for what CuPy's pool does not hold: kernel
modules, cuBLAS's workspace) and less the results stored on the device at the time, unless they
yield: in the workers of :func:`dask_gpuchunk.local_cluster` an allocation that fails first moves
stored results to the host (:mod:`dask_gpuchunk.distributed.spilling`).

Every chunk the package runs on a GPU holds a reservation (:func:`reserve`) of the bytes it
allocates there (its output, inputs it copies to the device, scratch) while it runs: chunks in
several Dask threads wait for each other instead of running the device out of memory, and a chunk
that could never fit raises :class:`DeviceBudgetError` naming its bytes, the budget and what to
change, before it allocates anything. The pool's high-water mark is kept (:func:`peak_bytes`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .. import _compat

from . import process_memory
from ..devices import distributed_client_active, gpu_available
from .staging import per_device

__all__ = [
    "DEFAULT_SPILL_FRACTION",
    "HEADROOM_FRACTION",
    "DeviceBudgetError",
    "budget_report",
    "cap_device_pool",
    "check_fits",
    "check_fits_for_graph",
    "device_capacity",
    "format_bytes",
    "graph_budget",
    "peak_bytes",
    "pool_limit_from_env",
    "reserve",
    "reset_peak",
    "retried_alone",
    "run_reserved",
    "spill_limit",
    "spilled_on_failure",
    "stored_bytes",
    "stored_limit",
    "stored_results_lru",
    "stored_results_yield",
    "workers_budgets",
    "working_budget",
]

#: Outside a spilling worker, the part of the capacity left to what CuPy's pool does not hold.
HEADROOM_FRACTION = 0.1
#: dask-cuda's ``device_memory_limit="default"``: spill stored results beyond this part of the
#: device (taken here of the capacity, so that a capped card spills as a card of that size).
DEFAULT_SPILL_FRACTION = 0.8


class DeviceBudgetError(MemoryError):
    """A chunk needs more device memory than the budget allows, even alone."""


def format_bytes(nbytes: float) -> str:
    """Bytes as text with a binary unit.

    Examples
    --------
    >>> format_bytes(3 * 2**30)
    '3.00 GiB'
    >>> format_bytes(512)
    '512 B'
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


def pool_limit_from_env(device_total: int, value: str | None = None) -> int | None:
    """CuPy's pool limit as ``CUPY_GPU_MEMORY_LIMIT`` gives it (bytes, or ``"50%"`` of the
    device), or ``None`` where it is unset or zero.

    Examples
    --------
    >>> pool_limit_from_env(16 * 2**30, "8589934592")
    8589934592
    >>> pool_limit_from_env(16 * 2**30, "25%")
    4294967296
    >>> pool_limit_from_env(16 * 2**30, "") is None
    True
    """
    text = (os.environ.get("CUPY_GPU_MEMORY_LIMIT", "") if value is None else value).strip()
    if not text:
        return None
    if text.endswith("%"):
        limit = int(device_total * float(text[:-1]) / 100)
    else:
        limit = int(float(text))
    return limit if limit > 0 else None


def cap_device_pool(nbytes: int) -> None:
    """Cap CuPy's pool of this process at ``nbytes`` (where a GPU is visible). The environment
    is the caller's: ``CUPY_GPU_MEMORY_LIMIT`` caps the processes it starts too."""
    if nbytes <= 0:
        raise ValueError(f"a device budget must be positive, got {nbytes}")

    if gpu_available():
        import cupy

        cupy.get_default_memory_pool().set_limit(size=int(nbytes))


def spill_limit(capacity: int, device_memory_limit: Any = "default") -> int | None:
    """The bytes of stored results a dask-cuda worker keeps on a device of ``capacity`` bytes
    before spilling to the host: ``"default"`` is :data:`DEFAULT_SPILL_FRACTION` of it, a
    fraction in (0, 1] a part of it, bytes as given (at most the capacity); ``0``/``None``:
    never spill (``None`` returned).

    Examples
    --------
    >>> spill_limit(8 * 2**30)
    6871947673
    >>> spill_limit(8 * 2**30, 0.5)
    4294967296
    >>> spill_limit(8 * 2**30, 10**12)
    8589934592
    >>> spill_limit(8 * 2**30, 0) is None
    True
    """
    if device_memory_limit == "default":
        return int(capacity * DEFAULT_SPILL_FRACTION)
    if device_memory_limit in (None, 0, "auto") or device_memory_limit == 0.0:
        return None
    value = float(device_memory_limit)
    if 0 < value <= 1:
        return int(capacity * value)
    return min(int(value), capacity)


# ---- what this process has --------------------------------------------------------------------


def _device_total(device: int) -> int:
    import cupy

    with cupy.cuda.Device(device):
        return int(cupy.cuda.runtime.memGetInfo()[1])


_totals: dict[int, int] = {}


def device_capacity() -> int:
    """Bytes this process may allocate through CuPy on its current device: the device's
    memory, or CuPy's pool limit where that is smaller."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    total = _totals.get(device)
    if total is None:
        total = _totals[device] = _device_total(device)
    limit = int(cupy.get_default_memory_pool().get_limit())
    return min(total, limit) if limit > 0 else total


def stored_results_lru(worker: Any = None) -> Any:
    """The LRU of results a dask-cuda worker (``worker``, default: the one running this task)
    stores on its device (its ``evict()`` moves the least recently used to the host), or
    ``None``."""
    if worker is None:
        try:
            from distributed import get_worker

            worker = get_worker()
        except (ImportError, ValueError):
            return None
    return _compat.device_results_lru(worker)


def stored_limit(dask_worker: Any = None) -> int:
    """Device bytes of stored results a dask-cuda worker (``dask_worker``, as
    ``Client.run`` passes it, or the one running this task) keeps before spilling to the host;
    0 outside such a worker, or where it never spills."""
    fast = stored_results_lru(dask_worker)
    return int(fast.n) if fast is not None else 0


def stored_bytes(dask_worker: Any = None) -> int:
    """Device bytes of results the dask-cuda worker holds stored now (0 outside such a worker)."""
    fast = stored_results_lru(dask_worker)
    return int(getattr(fast, "total_weight", 0)) if fast is not None else 0


def working_budget(dask_worker: Any = None) -> int:
    """Bytes the chunks running in this process may hold on its current device at once: the
    capacity less :data:`HEADROOM_FRACTION`, and less the results a dask-cuda worker holds
    stored on the device now (``dask_worker``: as for :func:`stored_limit`) unless they yield
    to running chunks (:func:`dask_gpuchunk.distributed.spilling.hold_budget`, as in the workers of
    :func:`dask_gpuchunk.local_cluster`)."""
    capacity = device_capacity()
    return max(int(capacity * (1 - HEADROOM_FRACTION)) - _stored_in_budget(dask_worker), 0)


def graph_budget() -> int:
    """The working budget (bytes) a graph's GPU blocks are sized for where it is built: with a
    ``distributed`` client, the smallest of its workers' that have a GPU (asked now); else, or
    where none answers, this process's (:func:`working_budget`). Sizing by the submitting
    process's own device made it a CUDA context on a device a worker uses (518 MiB of an H200
    by nvidia-smi beside worker 0's, for the whole job)."""
    budgets = _graph_budgets()
    return min(budgets) if budgets else working_budget()


def check_fits_for_graph(nbytes: int, what: str, option: str) -> None:
    """:func:`check_fits` of one chunk when a graph is built: against the workers' smallest
    budget where a ``distributed`` client has GPU workers, else this process's."""
    budgets = _graph_budgets()
    check_fits(nbytes, what, option, min(budgets) if budgets else None)


def workers_budgets() -> list[int]:
    """The working budgets of the default ``distributed`` client's workers that have a GPU,
    asked now (``Client.run``, whose errors it raises); empty without a client, or where no
    worker has one."""
    if not distributed_client_active():
        return []
    from distributed import default_client

    reports = default_client().run(_working_budget_here)
    return [b for b in reports.values() if b is not None]


def _graph_budgets() -> list[int]:
    """:func:`workers_budgets`, empty where the client cannot ask (an asynchronous one)."""
    try:
        return workers_budgets()
    except Exception:  # an asynchronous client, or no worker answered
        return []


def _working_budget_here(dask_worker: Any = None) -> int | None:
    """:func:`working_budget` of a worker (``Client.run`` passes it), ``None`` without a GPU."""
    return working_budget(dask_worker) if gpu_available() else None


def _stored_in_budget(dask_worker: Any = None) -> int:
    """The stored results the working budget subtracts: none where they yield."""
    return 0 if stored_results_yield else stored_bytes(dask_worker)


# : Set by :func:`dask_gpuchunk.distributed.spilling.hold_budget` in a worker whose stored device
# results : yield to allocations: the working budget then does not subtract them.
stored_results_yield = False
#: Stored results moved to the host because an allocation failed (see
#: :mod:`dask_gpuchunk.distributed.spilling`).
spilled_on_failure = {"bytes": 0, "results": 0}


# ---- admission --------------------------------------------------------------------------------


class _Admission:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.in_use = 0
        self.peak_pool = 0
        self.peak_reserved = 0


_admissions: dict[int, _Admission] = {}
_admissions_lock = threading.Lock()


def _admission() -> _Admission:

    return per_device(_admissions, _admissions_lock, _Admission)


def check_fits(nbytes: int, what: str, option: str, budget: int | None = None) -> None:
    """Raise :class:`DeviceBudgetError` if one chunk's ``nbytes`` exceed the working budget
    (this process's, or ``budget``): ``what`` names the chunk, ``option`` what to change."""
    origin = "the smallest of the workers' GPUs" if budget is not None else None
    budget = working_budget() if budget is None else budget
    if nbytes > budget:
        raise DeviceBudgetError(
            f"{what} needs {format_bytes(nbytes)} of device memory at once; the budget for "
            f"running chunks is {format_bytes(budget)} ({origin or _budget_origin()}). Use "
            "smaller chunks "
            f"({option}), or give the device more (a higher CUPY_GPU_MEMORY_LIMIT, a lower "
            "device_memory_limit / --device-memory-limit)"
        )


def _budget_origin() -> str:
    try:
        capacity, stored = device_capacity(), _stored_in_budget()
    except Exception:  # no device here
        return "the device's memory"
    text = f"{format_bytes(capacity)} on the device less {HEADROOM_FRACTION:.0%} headroom"
    return text + (f" and {format_bytes(stored)} of stored results" if stored else "")


def _held_elsewhere(pool: Any, in_use: int) -> int:
    """Bytes of CuPy's pool in use beyond what the running chunks reserved: arrays this process
    holds outside them (earlier outputs kept on the device, a user's own arrays; in a worker
    whose stored results yield, those are left out). A running chunk may not have allocated all
    it reserved yet, so this errs low; :func:`run_reserved` catches what it misses."""
    used = int(pool.used_bytes()) - in_use
    if stored_results_yield:
        used -= stored_bytes()
    return max(used, 0)


@contextlib.contextmanager
def reserve(nbytes: int, what: str = "a chunk", option: str = "chunks=", *,
            alone: bool = False) -> Iterator[None]:
    """Hold ``nbytes`` of the current device's working budget while the block runs, waiting
    for other chunks to release theirs (and counting what the process holds on the device
    outside them); :class:`DeviceBudgetError` if it can never fit. ``alone``: wait until no
    other chunk holds any."""
    import cupy

    nbytes = int(nbytes)
    budget = working_budget()
    check_fits(nbytes, what, option, budget)
    a = _admission()
    pool = cupy.get_default_memory_pool()
    with a.cond:
        # One chunk alone always runs (it fits, checked above); others wait their turn.
        while a.in_use and (alone or a.in_use + nbytes + _held_elsewhere(pool, a.in_use) > budget):
            a.cond.wait()
        a.in_use += nbytes
        a.peak_reserved = max(a.peak_reserved, a.in_use)
    try:
        yield
    finally:
        used = int(pool.total_bytes())
        with a.cond:
            a.peak_pool = max(a.peak_pool, used)
            a.in_use -= nbytes
            a.cond.notify_all()


def run_reserved(fn: Callable[[], Any], nbytes: int, what: str = "a chunk",
                 option: str = "chunks=") -> Any:
    """``fn()`` holding ``nbytes`` of the budget (:func:`reserve`). If the device runs out of
    memory while other chunks run (they had not yet allocated what they reserved, or the
    process holds more than the budget saw), wait until they are done and run ``fn`` again,
    alone, with what :data:`out_of_memory_hooks` drop and CuPy's cached blocks returned to the
    device first."""
    import cupy

    try:
        with reserve(nbytes, what, option):
            return fn()
    except cupy.cuda.memory.OutOfMemoryError:
        pass
    retried_alone["chunks"] += 1
    with reserve(nbytes, what, option, alone=True):
        for drop in out_of_memory_hooks:
            drop()
        cupy.get_default_memory_pool().free_all_blocks()
        return fn()


#: Chunks that ran out of device memory beside others and ran again alone
#: (:func:`run_reserved`).
retried_alone = {"chunks": 0}
#: What :func:`run_reserved` calls before a chunk that ran out of device memory runs again
#: alone: each drops what this process keeps on its devices and can read again
#: (:mod:`dask_gpuchunk.runtime.resident` adds its own).
out_of_memory_hooks: list[Callable[[], None]] = []


def peak_bytes() -> dict[str, int]:
    """This process's high-water marks on its current device: ``pool`` (CuPy's pool, sampled
    as each reserved chunk ends, and now) and ``reserved`` (the budget held at once)."""
    import cupy

    a = _admission()
    with a.cond:
        a.peak_pool = max(a.peak_pool, int(cupy.get_default_memory_pool().total_bytes()))
        return {"pool": a.peak_pool, "reserved": a.peak_reserved}


def reset_peak() -> None:
    """Forget the high-water marks of the current device (see :func:`peak_bytes`)."""
    a = _admission()
    with a.cond:
        a.peak_pool = a.peak_reserved = 0


def budget_report(dask_worker: Any = None) -> dict[str, Any]:
    """The budget of this process on its current device, and its peaks (for summaries):
    ``capacity``, ``stored_limit``, ``working_budget``, ``peak_pool``, ``peak_reserved``;
    ``None`` values where no GPU is visible; ``spilled_on_failure_bytes``: stored results moved
    to the host because an allocation failed (:mod:`dask_gpuchunk.distributed.spilling`);
    ``retried_alone``: chunks that ran out of memory beside others and ran again alone
    (:func:`run_reserved`);
    ``peak_process``: the driver's figure for this process at its highest (what nvidia-smi
    lists: the pool, the context, kernel modules, cuBLAS workspaces), from
    :func:`dask_gpuchunk.runtime.process_memory.watch`, ``None`` where it cannot be read.
    ``dask_worker``: as for :func:`stored_limit` (``Client.run(budget_report)`` reports each
    worker's)."""

    if not gpu_available():
        return {"capacity": None, "stored_limit": None, "stored_bytes": None, "working_budget": None,
                "peak_pool": None, "peak_reserved": None, "spilled_on_failure_bytes": None,
                "retried_alone": None, "peak_process": None}

    peaks = peak_bytes()
    return {"capacity": device_capacity(), "stored_limit": stored_limit(dask_worker) or None,
            "stored_bytes": stored_bytes(dask_worker),
            "working_budget": working_budget(dask_worker), "peak_pool": peaks["pool"],
            "peak_reserved": peaks["reserved"], "spilled_on_failure_bytes": spilled_on_failure["bytes"],
            "retried_alone": retried_alone["chunks"], "peak_process": process_memory.peak_bytes()}
