"""The ``dask-gpuchunk`` command line (also ``python -m dask_gpuchunk``).

``info``
    Versions, visible GPUs, and which execution paths are active on this machine.
``bench elementwise``
    A 1,000,000 x 500 float64 product and an RK4-style function through every path, beside the
    peers and the limits measured in the same run; prints a table and writes JSON and PNG.
``bench gram``
    The Gram matrix of bit-packed 0/1 data: every method, the peers and the popcount
    ceiling, as bit multiply-accumulates per second; prints a table and writes JSON and PNG.
``bench similarity``
    All-pairs and queries x database top-k and threshold search over binary fingerprints,
    beside the dense counts, CuPy, NumPy, RDKit and the 1-bit tensor-core ceiling, in pairs
    per second; prints a table and writes JSON and PNG.
``clean DIR``
    The temporary files that killed jobs left in DIR: listed, and removed where their writer
    is gone.
``multiply A.npy B.npy -o C.npy``, ``gram BITS.npy -o G.npy``, ``demo``
    (inputs and outputs ``.npy`` files or Zarr stores, chosen by the name: ``.zarr``)
    Jobs from files to files on a cluster: a local one (every GPU of this machine, or its CPU
    cores) or an existing one (``--scheduler-file`` / ``--scheduler-address``). Exit status:
    0 done; 1 the job failed while running; 2 bad command-line usage; 3 an input is wrong;
    4 the output cannot be written (or does not fit its file system); 5 the cluster or a GPU
    is not available; 130 Ctrl-C; 143 SIGTERM. Errors are one
    line on stderr; nothing is written where a job fails.

The group and ``info`` are :mod:`~dask_gpuchunk.cli.app`'s, ``bench`` :mod:`~dask_gpuchunk.cli.bench`'s,
the jobs' commands :mod:`~dask_gpuchunk.cli.commands`', and how a job command runs (its
cluster, progress, signals, summary) :mod:`~dask_gpuchunk.cli.running`'s.
"""

from . import bench, commands  # noqa: F401 - their commands join the group
from .app import environment, main

__all__ = ["environment", "main"]
