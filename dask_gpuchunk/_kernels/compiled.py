"""One compiled kernel per key and process: the memo every kernel module keeps its kernels in.

Compiling takes from milliseconds (a CuPy raw module from its cache) to seconds (numba's
parallel CPU kernels, NVRTC's tensor-core kernels), and Dask runs a worker's first chunks in
several threads at once: each key is compiled by one thread while the others wanting it wait,
then served from a dict without a lock. Different keys compile side by side (one lock per key:
a first similarity job's selection kernel takes seconds of NVRTC, which the kernels its other
tasks need should not wait behind).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["compiled_once"]

F = TypeVar("F", bound=Callable[..., Any])


def compiled_once(make: F) -> F:
    """Decorate ``make(*key)`` so that it runs once per key (its positional arguments,
    hashable) and process; later calls return what it returned.

    Examples
    --------
    >>> calls = []
    >>> @compiled_once
    ... def square(n):
    ...     calls.append(n)
    ...     return n * n
    >>> square(3), square(3), calls
    (9, 9, [3])
    """
    made: dict[tuple, Any] = {}
    locks: dict[tuple, threading.Lock] = {}
    locks_lock = threading.Lock()

    @functools.wraps(make)
    def get(*key: Any) -> Any:
        try:
            return made[key]
        except KeyError:
            pass
        with locks_lock:
            lock = locks.setdefault(key, threading.Lock())
        with lock:
            if key not in made:
                made[key] = make(*key)
            return made[key]

    get.made = made  # type: ignore[attr-defined] - for tests that drop what was compiled
    return get  # type: ignore[return-value]
