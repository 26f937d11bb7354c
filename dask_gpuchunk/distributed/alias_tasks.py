"""Dask's ``Alias`` tasks resolved before an array's graph goes to a cluster.

Dask's linear fusion (``dask._task_spec.fuse_linear_task_spec``) gives each chain of tasks it
fuses a new key, and keeps the chain's last key as an ``Alias`` of it so that the tasks after
the chain still find it. Distributed runs each alias as a task of its own: a trip through the
scheduler and a worker's thread for a lookup. ``C.sum()`` of a Gram of 16 x 16 blocks sent 719
tasks to the scheduler, 256 of them aliases (each block fused with its sum under a new name,
the old name kept for the tree of partial sums). :func:`optimize_arrays` is dask's own array
optimisation followed by :func:`resolve_aliases`: the tasks after an alias point at the task
it names, and the alias goes. The results are the same; only the number of tasks changes. Where
a graph's tasks ask for their workers (a layer's ``workers`` annotation: the top-k's tiles on
a cluster, :func:`dask_gpuchunk.bits.top_k_tiles.tiles_graph`), fusion turns the graph into a
dict and the layers' annotations go with it: here each fused task gets them back from the
tasks fused into it (where dask's own optimisation runs, outside these blocks, they are
lost).

Measured on 4 x H200 machines, 8 GiB cap a GPU, ``tools/gram_scaling.py`` at eefec16
(65,536 x 262,144 bits in 4,096-row chunks, ``C.sum()``, best of 4-5): on one machine 2.74 ->
1.47 -> 0.931 s on 1, 2 and 4 GPUs with the aliases, 2.39 -> 1.38 -> 0.815 s without; on
another 3.16 -> 1.73 -> 1.01 s with, 2.56 -> 1.37 -> 0.861 s without (stop 48 of the perf
notes: ``git show 85dc246:docs/perf-notes.md``).

:func:`dask_gpuchunk.local_cluster` resolves them while its client is open, and
:func:`dask_gpuchunk.connect` from then on (``gpuchunk.resolve-aliases``; an
``array_optimize`` of the caller's own in ``dask.config`` is left as it is). Under dask's
array query planning, arrays are expressions whose graphs are made without these aliases.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Any

import dask
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from .. import _compat, config

__all__ = ["optimize_arrays", "resolve_aliases", "resolving_aliases"]


def resolve_aliases(graph: Mapping[Hashable, Any], keys: Iterable[Any]) -> dict:
    """``graph`` (dask task specs) without the ``Alias`` tasks that are not among ``keys``:
    each task that depended on one depends on the task it names instead (through chains of
    aliases).

    Examples
    --------
    >>> import operator
    >>> from dask.task_spec import Task, TaskRef
    >>> Alias = _compat.alias_task_type()
    >>> graph = {"a": Task("a", operator.add, 1, 2), "b": Alias("b", "a"),
    ...          "c": Task("c", operator.neg, TaskRef("b"))}
    >>> resolved = resolve_aliases(graph, ["c"])
    >>> sorted(resolved), resolved["c"].dependencies
    (['a', 'c'], frozenset({'a'}))
    """
    Alias = _compat.alias_task_type()
    requested = set(_compat.flatten_keys(keys))
    targets = {key: node.target for key, node in graph.items()
               if isinstance(node, Alias) and key not in requested}
    if not targets:
        return dict(graph)

    def named(key: Hashable) -> Hashable:
        seen = set()
        while key in targets and key not in seen:  # a cycle of aliases is left as it is
            seen.add(key)
            key = targets[key]
        return key

    resolved = {}
    for key, node in graph.items():
        if key in targets:
            continue
        aliased = node.dependencies & targets.keys()
        resolved[key] = (node.substitute({name: named(name) for name in aliased}) if aliased
                         else node)
    return resolved


def optimize_arrays(dsk: Any, keys: Any, **kwargs: Any) -> Any:
    """Dask's array optimisation (``dask.array.optimization.optimize``), then
    :func:`resolve_aliases`: the ``array_optimize`` that :func:`resolving_aliases` sets.

    Examples
    --------
    ``b`` and ``c`` are a chain; dask fuses them as ``b-c`` and keeps ``c`` as its alias:

    >>> import operator
    >>> from dask._task_spec import Task, TaskRef
    >>> graph = {"a": Task("a", operator.add, 1, 2), "b": Task("b", operator.neg, TaskRef("a")),
    ...          "c": Task("c", operator.mul, TaskRef("b"), 2),
    ...          "d": Task("d", operator.sub, TaskRef("c"), TaskRef("a"))}
    >>> optimized = optimize_arrays(graph, ["d"])
    >>> sorted(optimized), optimized["d"].dependencies == {"a", "b-c"}
    (['a', 'b-c', 'd'], True)
    >>> from dask.local import get_sync
    >>> get_sync(optimized, "d")
    -9
    """
    from dask.array.optimization import optimize

    asked = _annotations_naming_workers(dsk)
    graph = optimize(dsk, keys, **kwargs)
    if not isinstance(graph, dict):  # low-level fusion turned off: no aliases were made
        return graph
    graph = resolve_aliases(graph, keys)
    return _annotated_again(graph, asked) if asked else graph


def _annotations_naming_workers(dsk: Any) -> dict[Hashable, dict[str, Any]]:
    """Each task's annotations, by key, in the layers of the high-level graph ``dsk`` that name
    their tasks' workers (the top-k's tiles on a cluster:
    :func:`dask_gpuchunk.bits.top_k_tiles.tiles_graph`)."""
    asked: dict[Hashable, dict[str, Any]] = {}
    for layer in getattr(dsk, "layers", {}).values():
        annotations = layer.annotations or {}
        if "workers" not in annotations:
            continue
        for key in layer:
            asked[key] = {kind: value(key) if callable(value) else value
                          for kind, value in annotations.items()}
    return asked


def _annotated_again(graph: dict, asked: dict[Hashable, dict[str, Any]]) -> HighLevelGraph:
    """The fused ``graph`` (a dict) as a high-level graph whose tasks carry the annotations
    ``asked`` of the tasks fused into them (the first one's that has any): fusion turns a
    graph into a dict, and a layer's annotations went with it. Left unfused instead (before),
    the top-k's results (each row chunk's last state, its indices and scores, their writes)
    ran as tasks of their own: the top-10 of 10**7 rows on 2 x H200 ended 0.7 s after its
    last tile, against 0.3-0.4 s fused (the job 34.37-34.61 s against 34.81-35.11 s)."""
    layers: dict[tuple[str, ...], dict] = {}
    given: dict[Hashable, dict[str, Any]] = {}
    for key, node in graph.items():
        found = next((asked[k] for k in _compat.fused_task_keys(node) if k in asked), {})
        kinds = tuple(sorted(found))
        layers.setdefault(kinds, {})[key] = node
        if found:
            given[key] = found
    named = {}
    for i, (kinds, tasks) in enumerate(layers.items()):
        # Named after this graph, so that graphs merged after their optimisation keep theirs.
        named[f"annotated-{id(graph):x}-{i}"] = MaterializedLayer(tasks, annotations={
            kind: functools.partial(_annotation_of, given, kind) for kind in kinds} or None)
    return HighLevelGraph(named, {name: set() for name in named})


def _annotation_of(given: dict, kind: str, key: Hashable) -> Any:
    return given[key][kind]


def _wanted() -> bool:
    return config.flag("resolve-aliases") and dask.config.get("array_optimize", None) is None


@contextlib.contextmanager
def resolving_aliases() -> Iterator[None]:
    """Dask arrays computed inside resolve their aliases (:func:`optimize_arrays`), where
    ``gpuchunk.resolve-aliases`` is on and ``dask.config`` has no ``array_optimize`` of its
    own; as before afterwards.

    Examples
    --------
    >>> with resolving_aliases():
    ...     dask.config.get("array_optimize") is optimize_arrays
    True
    >>> dask.config.get("array_optimize", None) is None
    True
    """
    if not _wanted():
        yield
        return
    with dask.config.set(array_optimize=optimize_arrays):
        yield
