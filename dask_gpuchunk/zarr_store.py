"""Moved to :mod:`dask_gpuchunk.io.zarr_store`; this name is kept for one release."""

import warnings

from .io.zarr_store import *  # noqa: F401,F403
from .io.zarr_store import __all__  # noqa: F401

warnings.warn("dask_gpuchunk.zarr_store moved to dask_gpuchunk.io.zarr_store; the old name goes in the "
              "next release", DeprecationWarning, stacklevel=2)
