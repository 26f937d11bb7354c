"""dask_gpuchunk: numba CUDA kernels over Dask arrays larger than GPU memory, chunk by chunk.

The same API runs where no GPU is present, on numba's parallel CPU kernels.

Examples
--------
>>> import dask.array as da
>>> import dask_gpuchunk as dg
>>> x = da.ones((4, 3), chunks=2)
>>> dg.multiply(x, 2.0).compute()
array([[2., 2., 2.],
       [2., 2., 2.],
       [2., 2., 2.],
       [2., 2., 2.]])
"""

from __future__ import annotations

from typing import Any

from . import _moved
from .arrays import asarray
from ._kernels.source_cache import package_version
from .distributed.alias_tasks import resolving_aliases
from .distributed.cluster import connect, local_cluster, placement_decisions
from .devices import GPUNotAvailableError, gpu_available, gpu_count
from .elementwise_ops import ElementwiseOp, elementwise, multiply
from .bits.gram import bitpack, gram
from .io import from_npy, to_npy, to_npz
from .io.zarr_files import from_zarr, to_zarr
from .bits.similarity import Neighbours, Pairs, similarity
from .user_kernels import GufuncOp, gufunc_op, map_kernel

#: The installed distribution's version (``importlib.metadata``).
__version__ = package_version()

__all__ = [
    "ElementwiseOp",
    "GPUNotAvailableError",
    "GufuncOp",
    "__version__",
    "asarray",
    "bitpack",
    "connect",
    "elementwise",
    "from_npy",
    "from_zarr",
    "gpu_available",
    "gpu_count",
    "gram",
    "gufunc_op",
    "local_cluster",
    "map_kernel",
    "multiply",
    "placement_decisions",
    "resolving_aliases",
    "similarity",
    "Neighbours",
    "Pairs",
    "to_npy",
    "to_npz",
    "to_zarr",
]


# Module paths of one release ago (binary data moved to dask_gpuchunk.bits, the elementwise
# operator and its parts to dask_gpuchunk.elementwise_ops, chunk execution to
# dask_gpuchunk.runtime: a package named elementwise would
# stand where dg.elementwise, the function, does, and `import dask_gpuchunk.elementwise.x as m`
# would find the function).
_moved.keep_old_paths(__name__, {name: f"bits.{name}" for name in (
    "bitpacking", "gram", "gram_blocks", "gram_graphs", "selection", "similarity",
    "similarity_graphs")})
_moved.keep_old_paths(__name__, {"elementwise": "elementwise_ops.operations", **{
    f"elementwise_{name}": f"elementwise_ops.{name}" for name in ("blocks", "graphs", "operands")}})
_moved.keep_old_paths(__name__, {name: f"runtime.{name}" for name in (
    "backend", "budget", "chunk_layout", "cpu_runner", "device_launch", "gpu_runners",
    "placement", "process_memory", "resident", "staging")})
_moved.keep_old_paths(__name__, {"fingerprint_jobs": "jobs.fingerprints"})
_moved.keep_old_paths(__name__, {name: f"distributed.{name}" for name in (
    "alias_tasks", "cluster", "joining", "replicas", "spilling", "worker")})
_moved.keep_old_paths(__name__, {"partials": "io.partials"})

#: Names of one release ago: dask's map_blocks and gufunc mean other things.
_RENAMED = {"map_blocks": "map_kernel", "gufunc": "gufunc_op"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        import warnings

        new = _RENAMED[name]
        warnings.warn(f"dg.{name} is now dg.{new} (dask's {name} means something else); the old "
                      "name goes in the next release", DeprecationWarning, stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
