"""distributed's active memory manager, told to keep every replica of a resident source.

A :class:`~dask_gpuchunk.runtime.resident.ResidentSource` is a small task result that each worker
running blocks over a ``.npy``'s words holds a copy of; the copy keeps what that worker has read
of the words, on its GPU or in its memory, and reads the rest ahead. The active memory manager's
:class:`~distributed.active_memory_manager.ReduceReplicas` drops copies of a result held by
several workers where fewer than 20 tasks still wait on it and none of them runs on that worker:
the last blocks of a compute. A block handed to that worker afterwards (a queued one, or one
stolen) fetches the source again, and the new copy reads every chunk again. On a CPU
:func:`dask_gpuchunk.local_cluster` of two workers with the manager running every 50 ms (2 s by
default), a worker read the words twice in 2 Gram computes of 30 (4 of 30 on a plain
``LocalCluster``); with this policy, in none of 30. :func:`dask_gpuchunk.local_cluster` starts
its scheduler with :class:`ReduceReplicasKeepingSources` in place of ``ReduceReplicas``
(:func:`policies_keeping_sources`); a copy then goes when the compute's last task that needs
the source is done, as the result itself does.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any


from .. import _compat
from ..runtime.resident import SOURCE_KEY_PREFIX

__all__ = ["REDUCE_REPLICAS", "ReduceReplicasKeepingSources", "policies_keeping_sources"]

#: The class path of distributed's policy, as its configuration names it.
REDUCE_REPLICAS = "distributed.active_memory_manager.ReduceReplicas"


def _is_source(key: Any) -> bool:
    return isinstance(key, str) and key.startswith(SOURCE_KEY_PREFIX)


class ReduceReplicasKeepingSources(_compat.reduce_replicas_policy()):  # type: ignore[misc]
    """:class:`~distributed.active_memory_manager.ReduceReplicas`, without the drops of
    resident sources' replicas."""

    def run(self) -> Generator[Any, Any, None]:
        suggestions = super().run()
        chosen = None
        while True:
            try:
                suggestion = suggestions.send(chosen)
            except StopIteration:
                return
            if _is_source(_compat.suggestion_key(suggestion)):
                chosen = None  # as if no worker could drop it
                continue
            chosen = yield suggestion


def policies_keeping_sources(policies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The active memory manager's ``policies`` setting with ``ReduceReplicas`` replaced by
    :class:`ReduceReplicasKeepingSources` (the others as they are).

    Examples
    --------
    >>> policies_keeping_sources([{"class": REDUCE_REPLICAS}, {"class": "my.Policy", "n": 2}])
    ... # doctest: +NORMALIZE_WHITESPACE
    [{'class': 'dask_gpuchunk.distributed.replicas.ReduceReplicasKeepingSources'},
     {'class': 'my.Policy', 'n': 2}]
    """
    mine = f"{__name__}.{ReduceReplicasKeepingSources.__name__}"
    return [{**policy, "class": mine} if policy.get("class") == REDUCE_REPLICAS else policy
            for policy in policies]
