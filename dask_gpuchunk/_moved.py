"""Module paths of one release ago, still importable: each attribute read through an old path
warns (``DeprecationWarning``) and comes from the module's new place.

The old paths stand in ``sys.modules`` as :class:`MovedModule` objects rather than as files:
two of them (``dask_gpuchunk.gram``, ``dask_gpuchunk.similarity``) share their names with the
package's public functions, and a file imported there would replace ``dg.gram`` and
``dg.similarity`` with modules. No dask here.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from typing import Any

__all__ = ["MovedModule", "keep_old_paths"]


class MovedModule(types.ModuleType):
    """An old module path whose attributes are the module ``new``'s, each read with a warning.

    Examples
    --------
    >>> import warnings
    >>> old = MovedModule("pkg.old_name", "json")
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     old.dumps([1])
    '[1]'
    >>> str(caught[0].message)
    'pkg.old_name moved to json; the old path goes in the next release'
    """

    def __init__(self, old: str, new: str) -> None:
        super().__init__(old, f"Moved to {new}; the old path goes in the next release.")
        self.__dict__["_new_path"] = new

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name != "__all__":  # __path__, __file__: not a package
            raise AttributeError(name)
        new = self.__dict__["_new_path"]
        # Looked up before the warning: pickle looks for a function's module by reading its
        # name from every module in sys.modules (dask's tokenize pickles), and a name the new
        # module lacks is that scan, not a user of the old path.
        value = getattr(importlib.import_module(new), name)
        warnings.warn(f"{self.__name__} moved to {new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return value


def keep_old_paths(package: str, moves: dict[str, str]) -> None:
    """Make each ``package.OLD`` of ``moves`` (old name: new dotted path under ``package``)
    importable as a :class:`MovedModule`, unless something already stands there."""
    for old, new in moves.items():
        sys.modules.setdefault(f"{package}.{old}", MovedModule(f"{package}.{old}",
                                                               f"{package}.{new}"))
