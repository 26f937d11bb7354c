"""Moved to :mod:`dask_gpuchunk.io.zarr_files`; this name is kept for one release."""

import warnings

from .io.zarr_files import *  # noqa: F401,F403
from .io.zarr_files import __all__  # noqa: F401

warnings.warn("dask_gpuchunk.zarr_files moved to dask_gpuchunk.io.zarr_files; the old name goes in the "
              "next release", DeprecationWarning, stacklevel=2)
