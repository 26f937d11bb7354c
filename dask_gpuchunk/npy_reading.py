"""Moved to :mod:`dask_gpuchunk.io.npy_reading`; this name is kept for one release."""

import warnings

from .io.npy_reading import *  # noqa: F401,F403
from .io.npy_reading import __all__  # noqa: F401

warnings.warn("dask_gpuchunk.npy_reading moved to dask_gpuchunk.io.npy_reading; the old name goes in the "
              "next release", DeprecationWarning, stacklevel=2)
