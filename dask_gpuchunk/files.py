"""Moved to :mod:`dask_gpuchunk.io.files`; this name is kept for one release."""

import warnings

from .io.files import *  # noqa: F401,F403
from .io.files import __all__  # noqa: F401

warnings.warn("dask_gpuchunk.files moved to dask_gpuchunk.io.files; the old name goes in the "
              "next release", DeprecationWarning, stacklevel=2)
