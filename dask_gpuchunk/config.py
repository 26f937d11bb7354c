"""The package's settings, read through ``dask.config`` when used: set them per call with
``dask.config.set({"gpuchunk.<name>": value})``, or for every process (workers included) with
``DASK_GPUCHUNK__<NAME>`` environment variables (``DASK_GPUCHUNK__FILE_WRITES=4``); a
:func:`dask_gpuchunk.local_cluster` started inside ``dask.config.set`` hands the settings to
its workers.

``gpuchunk.pinned-pool-limit`` (default ``"25%"``)
    Most page-locked host memory the pinned pool keeps: bytes (``"8GiB"``) or a share of the
    machine's memory. Beyond it, idle buffers are freed first; then host chunks are staged
    from pageable memory (slower, never wrong).
``gpuchunk.file-reads`` (default ``0``)
    Region reads of ``.npy`` files at once per process (0: no limit). A disk that serves one
    sequential stream faster than many interleaved ones wants a small number.
``gpuchunk.file-read-threads`` (default ``8``)
    Threads that read one large region of a ``.npy`` file together, each a piece of
    ``io.READ_PIECE_BYTES`` (1: the reading task's thread alone). On the 2 x H200 machine one
    thread copied ~2.5 GB/s out of the page cache, while its memory served 30 GB/s to 8.
``gpuchunk.file-writes`` (default ``1``)
    Chunk writes at once per process (0: no limit). Measured on the H200 machine's disk, a
    40 GB Gram output: 16 writers at once drained the page cache at 2 GB/s, one sequential
    writer at 3 GB/s.
``gpuchunk.resolve-aliases`` (default ``True``)
    Inside :func:`dask_gpuchunk.local_cluster` (and after :func:`dask_gpuchunk.connect`), dask
    arrays' graphs go to the cluster without dask's ``Alias`` tasks, which distributed runs as tasks
    of their own (:mod:`dask_gpuchunk.distributed.alias_tasks`): on 4 x H200 the Gram's ``C.sum()``
    ran 13-19 % faster on one GPU and 4-15 % on four. ``False``: dask's graphs as dask makes them.
``gpuchunk.no-workers-timeout`` (default ``300``)
    Seconds a job waits for a cluster without workers to get one again before giving up (the
    CLI's ``--worker-timeout``).
``gpuchunk.cache-dir`` (default ``None``: ``$XDG_CACHE_HOME/dask_gpuchunk``, by default
``~/.cache/dask_gpuchunk``)
    Where compiled kernels are kept: generated kernel sources, and numba's compiled code for
    them and for ``cache=True`` functions.


Removed settings (:data:`REMOVED`) are still accepted for one release, with a
``FutureWarning`` that says why they went; they do nothing.

Tuned choices, not settings (:data:`INTERNAL`): each was a setting until 2026-11-29, kept
for measuring one way against another; their values are the package's choices. A value given
through ``dask.config`` or the environment is still honoured until the next release, with a
``FutureWarning``; tests and tools choose another through :func:`internal_values`. What each
does and why its value:

``listed-graphs`` (default ``True``)
    Build small graphs as plain dicts of tasks (:func:`dask_gpuchunk.asarray`'s chunk views,
    :func:`dask_gpuchunk.elementwise`'s results of up to
    ``elementwise_ops.graphs.LISTED_GRAPH_MAX_BLOCKS`` blocks, :func:`dask_gpuchunk.gram`'s blocks)
    instead of through ``dask.array.from_array`` and ``blockwise``. Measured on an H200: a
    device-resident product of two 4 GB CuPy arrays took 4.8 ms listed and 5.4 ms through
    ``from_array``, beside CuPy's own 2.8 ms. Never under dask's array query planning
    (``array.query-planning``), whose arrays are expressions, not graphs.
``direct-launch`` (default ``True``)
    Launch elementwise kernels from the arrays' addresses through ``cuda.core`` (37-62 µs per
    chunk instead of 146-221 µs through numba's dispatcher); a process where numba-cuda's
    internals differ goes on through the dispatcher with one warning. ``False``: always the
    dispatcher.
``pinned-results`` (default ``True``)
    Results of the GPU path land in page-locked memory (the package's pinned pool): one host
    copy less per chunk. ``False`` allocates them pageable.
``pinned-allocation`` (default ``"register"``)
    How the pinned pool makes a page-locked buffer: anonymous memory that the kernel fills (in huge
    pages where it gives them) before CUDA locks it (``"register"``,
    :class:`dask_gpuchunk.runtime.staging.RegisteredMemory`), or ``cudaHostAlloc``
    (``"host-alloc"``). On 2 x H200, a 128 MiB buffer took 28-40 ms registered, during which the
    process's copies to its GPU waited at most 6 ms, against 55-134 ms allocated, during which they
    all waited (``tools/pinned_alloc_probe.py`` at 93972b0). Where CUDA refuses a registration, the
    pool allocates.
``gram-mirror`` (default ``"transpose"``)
    How ``dg.gram`` of words read straight from a ``.npy`` (outside dask's array query
    planning) makes its blocks below the diagonal: the transpose of the block above, a view on
    the host (``"transpose"``), or computed again (``"recompute"``): twice the GPU's work, but
    every block then one task with no other dependency than the source. On 2 x H200, one run
    each: 1.83 x from one GPU to two with ``"recompute"``, 1.64 x without.
``read-ahead`` (default ``True``)
    Where ``dg.gram`` (and its CLI job) reads its words straight from a ``.npy``, each process reads
    the row chunks its blocks will want on a thread of its own once its first block has asked, for
    as long as they fit where it keeps them (:mod:`dask_gpuchunk.runtime.resident`), instead of each
    block waiting on the file in its task's thread. ``False``: blocks read what they need when they
    need it.
``register-reads`` (default ``False``)
    Where ``dg.gram`` (and its CLI job) keeps a ``.npy``'s words on the GPU, let the GPU copy
    each chunk straight out of the page cache (the file's pages mapped and page-locked where
    they lie, read-only) instead of reading it into a pinned buffer first: no host copy. On
    4 x H200, 2.1 GB of cached words reached one GPU in 0.10 s against 0.23 s read, but four
    processes at once took 0.26 s against 0.33 s, and the 4-GPU Gram ran as fast either way
    (1.04 / 1.08 s, within the run-to-run spread); a cold file is not measured. A device that
    refuses such registrations reads as with ``False``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import dask.array as da

from ._kernels import source_cache

__all__ = ["DEFAULTS", "INTERNAL", "REMOVED", "cache_root", "check_settings", "checked", "flag",
           "get", "internal_values", "listed_graphs",
           "map_blocks_prefix"]

#: Every setting and its default (``gpuchunk.<name>``).
DEFAULTS: dict[str, Any] = {
    "pinned-pool-limit": "25%",
    "file-reads": 0,
    "file-read-threads": 8,
    "file-writes": 1,
    "resolve-aliases": True,
    "no-workers-timeout": 300,
    "cache-dir": None,
}

#: The package's tuned choices that were settings, by their old names (read with :func:`get`).
INTERNAL: dict[str, Any] = {
    "listed-graphs": True,
    "direct-launch": True,
    "pinned-results": True,
    "pinned-allocation": "register",
    "gram-mirror": "transpose",
    "read-ahead": True,
    "register-reads": False,
}

#: What :func:`internal_values` chose in this process, in place of :data:`INTERNAL`'s.
_chosen: dict[str, Any] = {}

dask.config.update_defaults({"gpuchunk": dict(DEFAULTS)})

#: Settings that were removed, still accepted (with a warning, doing nothing) until the next
#: release, and why each went.
REMOVED: dict[str, str] = {
    name: ("the package's own CUDA-IPC sharing between a node's workers is gone: over UCX "
           "(dg.local_cluster(protocol='ucx')) distributed moves device chunks between GPUs as "
           "fast or faster (docs/clusters.md, 'One transport')")
    for name in ("share-reads", "share-device-chunks", "share-min-bytes")
}


def get(name: str) -> Any:
    """The value of ``gpuchunk.<name>`` now (``dask.config.set`` and ``DASK_GPUCHUNK__*``
    included), checked as the command line checks it: a ``ValueError`` naming the setting,
    where it comes from and what it takes (:func:`check_settings`).

    Examples
    --------
    >>> get("file-writes")
    1
    >>> with dask.config.set({"gpuchunk.file-writes": 4}):
    ...     get("file-writes")
    4
    >>> with dask.config.set({"gpuchunk.file-writes": -3}):
    ...     get("file-writes")
    Traceback (most recent call last):
    ...
    ValueError: setting gpuchunk.file-writes (environment: DASK_GPUCHUNK__FILE_WRITES) is -3; it takes a whole number, 0 or more
    """
    if name in INTERNAL:
        value = _internal(name)
    elif name not in DEFAULTS:
        raise KeyError(f"no setting gpuchunk.{name}; the settings are "
                       f"{', '.join(sorted(DEFAULTS))}")
    else:
        value = dask.config.get(f"gpuchunk.{name}", DEFAULTS[name])
    valid, words = _CHECKS.get(name, (None, ""))
    if valid is not None and not valid(value):
        raise ValueError(f"setting gpuchunk.{name} (environment: {_variable(name)}) is "
                         f"{value!r}; it takes {words}")
    return value


def _internal(name: str) -> Any:
    """A tuned choice's value: :func:`internal_values`', else one still given through
    ``dask.config`` (honoured, with a warning), else :data:`INTERNAL`'s."""
    if name in _chosen:
        return _chosen[name]
    given = dask.config.get(f"gpuchunk.{name}", None)
    if given is None:
        return INTERNAL[name]
    warnings.warn(f"gpuchunk.{name} ({_variable(name)}) is no longer a setting: the package "
                  f"chooses {INTERNAL[name]!r}; {given!r} is honoured until the next release",
                  FutureWarning, stacklevel=4)
    return given


@contextlib.contextmanager
def internal_values(values: dict[str, Any]) -> Iterator[None]:
    """Choose other values of tuned choices (:data:`INTERNAL`, by name) in this process while
    the block runs: for tests and measurements of one way against another.

    Examples
    --------
    >>> with internal_values({"gram-mirror": "recompute"}):
    ...     get("gram-mirror")
    'recompute'
    >>> get("gram-mirror")
    'transpose'
    """
    unknown = sorted(set(values) - set(INTERNAL))
    if unknown:
        raise KeyError(f"no tuned choice {unknown[0]!r}; they are {', '.join(sorted(INTERNAL))}")
    before = dict(_chosen)
    _chosen.update(values)
    try:
        yield
    finally:
        _chosen.clear()
        _chosen.update(before)


def _variable(name: str) -> str:
    return "DASK_GPUCHUNK__" + name.upper().replace("-", "_")


def _flag(value: Any) -> bool:
    if isinstance(value, bool) or value in (0, 1):
        return True
    return isinstance(value, str) and value.strip().lower() in ("true", "false", "0", "1")


def _count(value: Any) -> bool:
    try:
        return int(str(value).strip()) >= 0 and float(str(value).strip()).is_integer()
    except ValueError:
        return False


def _positive(value: Any) -> bool:
    return _count(value) and int(str(value).strip()) >= 1


def _seconds(value: Any) -> bool:
    try:
        return 0 <= float(value) < float("inf")
    except (TypeError, ValueError):
        return False


def _size_or_share(value: Any) -> bool:
    from dask.utils import parse_bytes

    text = str(value).strip()
    try:
        if text.endswith("%"):
            return 0 <= float(text[:-1]) <= 100
        return parse_bytes(value) >= 0
    except (TypeError, ValueError):
        return False


#: What each setting takes (the rest: anything), as a test and the words an error uses.
_CHECKS: dict[str, tuple[Any, str]] = {
    "listed-graphs": (_flag, "True or False"),
    "direct-launch": (_flag, "True or False"),
    "pinned-results": (_flag, "True or False"),
    "pinned-pool-limit": (_size_or_share, "a size (8GiB) or a share of memory (25%)"),
    "pinned-allocation": (lambda v: v in ("host-alloc", "register"),
                          "'host-alloc' or 'register'"),
    "file-reads": (_count, "a whole number, 0 or more"),
    "file-read-threads": (_positive, "a whole number, 1 or more"),
    "file-writes": (_count, "a whole number, 0 or more"),
    "no-workers-timeout": (_seconds, "seconds, 0 or more"),
    "gram-mirror": (lambda v: v in ("transpose", "recompute"), "'transpose' or 'recompute'"),
    "read-ahead": (_flag, "True or False"),
    "register-reads": (_flag, "True or False"),
    "resolve-aliases": (_flag, "True or False"),
}


def check_settings() -> None:
    """``ValueError`` naming the first setting whose value cannot be used, and where it comes
    from; the jobs and the command line check before any work (a bad
    ``DASK_GPUCHUNK__FILE_WRITES`` would otherwise fail deep in the first write).

    Examples
    --------
    >>> check_settings()
    >>> with dask.config.set({"gpuchunk.file-writes": "abc"}):
    ...     check_settings()
    Traceback (most recent call last):
    ...
    ValueError: setting gpuchunk.file-writes (environment: DASK_GPUCHUNK__FILE_WRITES) is 'abc'; it takes a whole number, 0 or more
    """
    # dask keeps an environment variable's name with underscores (file_writes)
    given = {str(k).replace("_", "-") for k in dask.config.get("gpuchunk", {}) or {}}
    for name in sorted(given & set(REMOVED)):
        warnings.warn(f"setting gpuchunk.{name} ({_variable(name)}) was removed and does "
                      f"nothing: {REMOVED[name]}; it will be refused in the next release",
                      FutureWarning, stacklevel=2)
    for name in sorted(given & set(INTERNAL)):
        _internal(name)  # honoured, with its warning
    unknown = sorted(given - set(DEFAULTS) - set(REMOVED) - set(INTERNAL))
    if unknown:
        import difflib

        name = unknown[0]
        close = difflib.get_close_matches(name, DEFAULTS, n=1)
        hint = f" (did you mean gpuchunk.{close[0]}?)" if close else ""
        raise ValueError(f"no setting gpuchunk.{name} ({_variable(name)}){hint}; the settings "
                         f"are {', '.join(sorted(DEFAULTS))}")
    for name in _CHECKS:
        get(name)


def checked(name: str) -> Any:
    """The value of ``gpuchunk.<name>`` now, or the ``ValueError`` of :func:`check_settings`
    where it cannot be used (as :func:`get`).

    Examples
    --------
    >>> checked("gram-mirror")
    'transpose'
    """
    return get(name)


def flag(name: str) -> bool:
    """A True/False setting's value now (:func:`checked`), from a bool, 0/1, or its text
    (``DASK_GPUCHUNK__READ_AHEAD=false``).

    Examples
    --------
    >>> with dask.config.set({"gpuchunk.resolve-aliases": "False"}):
    ...     flag("resolve-aliases")
    False
    """
    value = checked(name)
    return str(value).strip().lower() in ("true", "1")


def cache_root() -> Path:
    """The cache directory (``gpuchunk.cache-dir``, else ``$XDG_CACHE_HOME/dask_gpuchunk``).

    Examples
    --------
    >>> with dask.config.set({"gpuchunk.cache-dir": "/tmp/k"}):
    ...     cache_root()
    PosixPath('/tmp/k')
    """
    root = get("cache-dir")
    if root:
        return Path(os.path.expanduser(str(root)))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dask_gpuchunk"


# The kernels layer imports no dask: it asks this module where its cache is, when it needs it.
source_cache.set_cache_root(cache_root)


def listed_graphs() -> bool:
    """Whether small graphs are listed by hand (``listed-graphs`` of :data:`INTERNAL`; never under array
    query planning).

    Examples
    --------
    >>> with internal_values({"listed-graphs": False}):
    ...     listed_graphs()
    False
    """
    return not da.array_expr_enabled() and flag("listed-graphs")


def map_blocks_prefix(prefix: str) -> dict[str, str]:
    """The keyword that names ``dask.array.map_blocks``' keys ``<prefix>-<token>``: ``token=``
    for dask's legacy arrays, ``name=`` under array query planning (which deprecates
    ``token=``, and where ``name=`` is a prefix, not the whole name).

    Examples
    --------
    >>> map_blocks_prefix("to-npy") in ({"token": "to-npy"}, {"name": "to-npy"})
    True
    """
    return {"name": prefix} if da.array_expr_enabled() else {"token": prefix}
