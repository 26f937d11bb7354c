"""Clusters and what runs in their workers: :func:`~dask_gpuchunk.distributed.cluster.local_cluster`
and :func:`~dask_gpuchunk.distributed.cluster.connect` (``dg.local_cluster``, ``dg.connect``),
the worker plugin and ``--preload`` hook (:mod:`.worker`), joining a batch cluster and its TLS
credentials (:mod:`.joining`), spilling that holds the device budget (:mod:`.spilling`), the
scheduler's replica policy that keeps resident sources (:mod:`.replicas`) and the graphs sent
without dask's ``Alias`` tasks (:mod:`.alias_tasks`). Importing this package imports none of
them (``distributed`` costs 0.35 s an import).
"""

__all__: list[str] = []
