"""Moved to :mod:`dask_gpuchunk.io.npy_writing`; this name is kept for one release."""

import warnings

from .io.npy_writing import *  # noqa: F401,F403
from .io.npy_writing import __all__  # noqa: F401

warnings.warn("dask_gpuchunk.npy_writing moved to dask_gpuchunk.io.npy_writing; the old name goes in the "
              "next release", DeprecationWarning, stacklevel=2)
