"""Whole jobs from files to files, as the command line runs them: multiply, gram, similarity,
demo.

Each job checks everything it can before any work starts (inputs readable and of the right
kind, shapes compatible, the output writable and not already there), so that a user's mistake
ends at once with one line saying what is wrong and nothing written. Then it reads the inputs
chunk by chunk (:func:`dask_gpuchunk.from_npy`), computes on the current Dask scheduler (a
cluster's workers when a client is active), and writes the result chunk by chunk
(:func:`dask_gpuchunk.to_npy`). Each returns a summary dict (what the ``--json`` line prints).

A module a job (:mod:`~dask_gpuchunk.jobs.multiply`, :mod:`~dask_gpuchunk.jobs.gram`,
:mod:`~dask_gpuchunk.jobs.similarity`, :mod:`~dask_gpuchunk.jobs.demo`,
:mod:`~dask_gpuchunk.jobs.fingerprints`: SMILES to fingerprints, imported where it runs, as it
needs RDKit), and what they share in :mod:`~dask_gpuchunk.jobs.common`.
"""

from .common import (
    BudgetError,
    ClusterError,
    InputError,
    JobError,
    OutputError,
    check_gpus_where_it_runs,
    sent_by_workers,
    staged_by_workers,
    watch_device_memory,
    where_it_ran,
)
from .demo import demo
from .gram import gram_files, gram_job
from .multiply import multiply_files, multiply_job
from .similarity import similarity_job

__all__ = [
    "BudgetError",
    "ClusterError",
    "InputError",
    "JobError",
    "OutputError",
    "check_gpus_where_it_runs",
    "demo",
    "gram_files",
    "gram_job",
    "multiply_files",
    "multiply_job",
    "sent_by_workers",
    "similarity_job",
    "staged_by_workers",
    "watch_device_memory",
    "where_it_ran",
]
