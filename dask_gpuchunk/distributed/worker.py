"""What every worker of a dask_gpuchunk cluster does before its first task.

:class:`WorkerSetup` is a ``distributed`` worker plugin: the clients of
:func:`dask_gpuchunk.local_cluster` and :func:`dask_gpuchunk.connect` register it, and it runs in
every worker of the cluster, those already there and those that join later (a batch job's workers
need no ``--preload``). ``--preload dask_gpuchunk.distributed.cluster`` runs the same
(:func:`dask_gpuchunk.distributed.cluster.dask_setup`) for workers whose clients do not register it.
"""

from __future__ import annotations

from typing import Any

from distributed import WorkerPlugin

# What the workers' tasks run: imported once here, not at the unpickling of a first task.
from .. import elementwise_ops, io  # noqa: F401
from ..runtime import process_memory  # noqa: F401
from ..bits import gram  # noqa: F401
from ..runtime import backend  # noqa: F401
from ..devices import gpu_available
from .spilling import hold_budget, receive_through_pool

__all__ = ["WorkerSetup", "set_up_worker"]


def set_up_worker(worker: Any) -> None:
    """Prepare a worker before its first task.

    A fresh worker otherwise imports the package, numba and CuPy when it unpickles its first task
    (~1 s on the H200 machine, every task of a job waiting behind it), and, without a GPU,
    initialises numba's threading layer in its first CPU chunk
    (:func:`dask_gpuchunk.runtime.backend.prepare_process`). In a dask-cuda worker it also makes
    spilling hold the device budget (:func:`dask_gpuchunk.distributed.spilling.hold_budget`) and,
    over UCX, chunks from other workers arrive in CuPy's pool
    (:func:`dask_gpuchunk.distributed.spilling.receive_through_pool`); in a worker with a GPU it
    samples the device memory the driver counts for the process
    (:func:`dask_gpuchunk.runtime.process_memory.watch`). Running it twice (plugin and preload) does
    nothing more.
    """
    backend.prepare_process()
    hold_budget(worker)
    receive_through_pool(worker)
    if gpu_available():
        process_memory.watch()


class WorkerSetup(WorkerPlugin):
    """:func:`set_up_worker` as a worker plugin, in each worker once (by its name).

    Examples
    --------
    >>> import dask_gpuchunk as dg
    >>> with dg.local_cluster(processes=False, dashboard_address=None) as client:
    ...     "dask-gpuchunk-setup" in client.run(lambda dask_worker: list(dask_worker.plugins))[
    ...         next(iter(client.scheduler_info()["workers"]))]
    True
    """

    name = "dask-gpuchunk-setup"
    idempotent = True

    def setup(self, worker: Any) -> None:
        set_up_worker(worker)
