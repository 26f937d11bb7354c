"""Blocks of similarity work done, told to whoever watches, wherever the tasks run.

A top-k or threshold graph's tasks each compute one block of pairs or several (a step of the
top-k chain), and the result arrives only once the last of them is done: a progress bar that
counts tasks (``dask.diagnostics.ProgressBar``) or written chunks (the CLI's) cannot say how far
the work has gone. Each task tells :func:`blocks_done` how many blocks it computed: in a Dask
worker as an event under :data:`TOPIC` (``Worker.log_event``, batched to the scheduler, which
forwards it to subscribed clients), elsewhere (dask's local threads) to the listeners of this
process. :class:`BlockProgress` listens in both places and calls ``report(done, total)``.

Blocks of every such graph computed meanwhile are counted: one watcher per job (the CLI runs
one job at a time).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["TOPIC", "BlockProgress", "blocks_done", "format_rate"]

#: The event topic of blocks done on Dask workers.
TOPIC = "dask-gpuchunk-blocks"

_listeners: list[Callable[[int], None]] = []
_lock = threading.Lock()


def _current_worker() -> Any:
    """The Dask worker running this thread's task, or ``None`` (no distributed imported, or
    not a worker's task thread)."""
    if "distributed" not in sys.modules:
        return None
    from distributed import get_worker

    try:
        return get_worker()
    except ValueError:  # not in a worker's task
        return None


def blocks_done(count: int = 1) -> None:
    """Tell the watchers (:class:`BlockProgress`) that ``count`` more blocks are done."""
    worker = _current_worker()
    if worker is not None:
        worker.log_event(TOPIC, int(count))
        return
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener(count)


def format_rate(per_second: float) -> str:
    """A rate in three significant digits.

    Examples
    --------
    >>> format_rate(1234.5), format_rate(2.5e11)
    ('1.23e+03', '2.5e+11')
    """
    return f"{per_second:.3g}"


class BlockProgress:
    """Counts blocks done (:func:`blocks_done`) in this process and on the default client's
    workers while open, calling ``report(done, total)`` as they come.

    Parameters
    ----------
    total
        Blocks the watched work computes.
    report
        Called with the blocks done so far and ``total``, from the thread that heard of them
        (a task's thread, or the client's event loop): keep it short.

    Examples
    --------
    >>> seen = []
    >>> with BlockProgress(3, lambda done, total: seen.append(done)):
    ...     blocks_done(2)
    ...     blocks_done()
    >>> seen
    [2, 3]
    """

    def __init__(self, total: int, report: Callable[[int, int], None]) -> None:
        self.total = int(total)
        self.report = report
        self.done = 0
        self._lock = threading.Lock()
        self._client: Any = None
        self.started = time.perf_counter()

    def _add(self, count: int) -> None:
        with self._lock:
            self.done += int(count)
            done = self.done
        self.report(min(done, self.total), self.total)

    def _on_event(self, event: tuple[float, Any]) -> None:
        self._add(event[1])

    def __enter__(self) -> BlockProgress:
        self.started = time.perf_counter()
        with _lock:
            _listeners.append(self._add)
        if "distributed" in sys.modules:
            from distributed import default_client

            try:
                self._client = default_client()
            except ValueError:  # no client: local threads only
                self._client = None
            if self._client is not None:
                self._client.subscribe_topic(TOPIC, self._on_event)
        return self

    def __exit__(self, *exc: Any) -> None:
        with _lock:
            _listeners.remove(self._add)
        if self._client is not None:
            try:
                self._client.unsubscribe_topic(TOPIC)
            except Exception:  # noqa: BLE001 - a client already closing: nothing to undo
                pass
            self._client = None
